//! The controller: the components of DESIGN.md composed on one rcs runtime.
//!
//! | recovery group | tasks |
//! |---|---|
//! | `host` | request validation and routing, replies (the host adapter) |
//! | `cache` | directory lookups, read hits, write absorption |
//! | `nvs` | writing records of incoming writes |
//! | `device` | staging misses, FUA, FLUSH, TRIM / WRITE_ZEROES |
//! | `destage` | background destage of dirty tracks (low priority) |
//! | `background` | periodic work (the destage tick) |
//!
//! Start-up always scans the NVS and replays its records into the cache
//! directory (newest per track wins) before serving: every acknowledged
//! write that was not destaged is found again, whatever happened to the
//! previous process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::cache::{Cache, DirtyJournal};
use crate::config::{Config, ConfigError, FlushPolicy};
use crate::ctlblock::ControlBlocks;
use crate::destage::DestageQueue;
use crate::devqueue::DeviceQueue;
use crate::journal::{BoxJournal, VolumeIdentity};
use crate::limits::{MAX_PAYLOAD_BYTES, TRACK_BYTES};
use crate::metrics::{Gauges, Metrics};
use crate::nbd::handshake::ExportInfo;
use crate::nvs::{Nvs, NvsError, ScanReport};
use crate::recovery::{RecoveryLog, Rung};
use crate::system::{SystemError, SystemRecovery, SystemReport};
use crate::timer::Timer;
use crate::volume::{Volume, VolumeError};

/// The recovery groups of the controller's components.
#[derive(Debug, Clone, Copy)]
pub struct Groups {
    /// Host adapter.
    pub host: rcs::GroupId,
    /// Cache.
    pub cache: rcs::GroupId,
    /// NVS.
    pub nvs: rcs::GroupId,
    /// Device manager.
    pub device: rcs::GroupId,
    /// Destage.
    pub destage: rcs::GroupId,
    /// Background work.
    pub background: rcs::GroupId,
}

/// Why a controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A bad setting.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The volume or its devices.
    #[error(transparent)]
    Volume(#[from] VolumeError),
    /// The NVS.
    #[error(transparent)]
    Nvs(#[from] NvsError),
    /// The task runtime.
    #[error("cannot start the task runtime: {0}")]
    Runtime(#[from] rcs::BuildError),
    /// A thread could not start.
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
    /// The recovery box could not be created.
    #[error("cannot create the recovery box: {0}")]
    RecoveryBox(String),
}

/// How the controller came up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestartKind {
    /// A new NVS: nothing to recover.
    Fresh,
    /// Rung 5: the directory came back from the recovery box.
    Fast,
    /// Rung 6: the recovery box could not be used; the NVS was scanned.
    Hard {
        /// Why the fast path was refused.
        reason: String,
    },
}

/// What start-up found.
#[derive(Debug, Clone)]
pub struct StartupReport {
    /// Which path start-up took.
    pub kind: RestartKind,
    /// The NVS scan (hard restart only).
    pub scan: Option<ScanReport>,
    /// Tracks found dirty (records replayed).
    pub replayed_tracks: u64,
    /// Time from open to ready.
    pub elapsed: Duration,
}

/// A running controller.
pub struct Controller {
    pub(crate) config: Config,
    pub(crate) volume: Volume,
    pub(crate) nvs: Nvs,
    pub(crate) cache: Cache,
    pub(crate) destage: DestageQueue,
    pub(crate) scrub: crate::scrub::ScrubStats,
    pub(crate) journal: Arc<BoxJournal>,
    pub(crate) metrics: Metrics,
    pub(crate) export: ExportInfo,
    pub(crate) groups: Groups,
    pub(crate) rt: rcs::Handle,
    runtime: Mutex<Option<rcs::Runtime>>,
    pub(crate) timer: Timer,
    pub(crate) stopping: AtomicBool,
    /// Every recovery the controller performed.
    pub(crate) recoveries: Arc<RecoveryLog>,
    /// Rung 4's gate, quiesce flag and parked requests.
    pub(crate) system: SystemRecovery,
    /// What the recovery box describes (checked again by rung 4).
    pub(crate) identity: VolumeIdentity,
    /// One submission queue per device.
    pub(crate) queues: Vec<DeviceQueue>,
    /// Request control blocks.
    pub(crate) blocks: ControlBlocks,
    /// Rung 3: epochs, checkpoints, output commit.
    pub(crate) epochs: crate::epoch::Epochs,
    /// Shut down: the checkpoint thread stops.
    closed: AtomicBool,
    startup: StartupReport,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("listen", &self.config.listen)
            .field("volume", &self.volume.label())
            .finish_non_exhaustive()
    }
}

/// The controller, once built: rcs's system-level callback needs it, and
/// the runtime is built before it.
type LateController = Arc<std::sync::OnceLock<std::sync::Weak<Controller>>>;

fn build_runtime(
    config: &Config,
    late: &LateController,
) -> Result<(rcs::Runtime, Groups), OpenError> {
    let workers = if config.workers == 0 {
        std::thread::available_parallelism().map_or(2, |n| n.get())
    } else {
        config.workers
    };
    let policy = config.rcs_policy()?;
    // Relative task load per group (for sigma and the static mapping).
    let weights = [3.0, 3.0, 1.0, 2.0, 1.0, 0.2];
    let names = ["host", "cache", "nvs", "device", "destage", "background"];
    let mapping = rcs::proportional_mapping(&weights, workers);
    let total: f64 = weights.iter().sum();
    let mut b = rcs::Runtime::builder();
    b.workers(workers)
        .policy(policy)
        .queue_capacity(16_384)
        .idle_spins(config.idle_spins)
        // One per connection thread (see `connection`); past that, threads
        // queue their requests for the workers.
        .affiliates(
            (config.max_connections * config.connection_threads).min(rcs::limits::AFFILIATES_MAX),
        )
        .task_deadline(Some(config.task_deadline).filter(|d| !d.is_zero()))
        .hung_after(config.hung_after())
        .thread_name("rebound-worker");
    // A group recovery that cannot finish (its tasks do not drain, its
    // handler fails) escalates here: the controller's next rung, on a
    // thread of its own (this may run on a worker).
    let slot = Arc::clone(late);
    b.system_recovery(move |f: &rcs::SystemFailure| {
        match slot.get().and_then(std::sync::Weak::upgrade) {
            Some(ctl) => crate::system::escalate(
                &ctl,
                format!("rcs escalated ({}): {}", f.cause.name(), f.failure),
            ),
            None => tracing::error!(cause = f.cause.name(), failure = %f.failure,
                "system-level recovery requested before the controller was up"),
        }
    });
    let ids: Vec<rcs::GroupId> = names
        .iter()
        .zip(weights)
        .zip(mapping)
        .map(|((name, w), pools)| {
            let sigma = ((workers as f64 * w / total).round() as u32).max(1);
            b.group(rcs::GroupSpec::new(*name).sigma(sigma).pools(pools))
        })
        .collect();
    let runtime = b.build()?;
    Ok((
        runtime,
        Groups {
            host: ids[0],
            cache: ids[1],
            nvs: ids[2],
            device: ids[3],
            destage: ids[4],
            background: ids[5],
        },
    ))
}

/// Bring back the dirty directory: from the recovery box (fast restart) if
/// it is trusted and agrees with the NVS, otherwise by scanning the NVS
/// (hard restart), which also rebuilds the box.
#[allow(clippy::type_complexity)]
fn recover_state(
    config: &Config,
    identity: VolumeIdentity,
    nvs: &Nvs,
    frames: usize,
    destage: &DestageQueue,
    fresh: bool,
) -> Result<(Arc<BoxJournal>, Cache, RestartKind, Option<ScanReport>), OpenError> {
    let box_path = config.box_path();
    let reason = if fresh {
        None
    } else {
        match BoxJournal::recover(&box_path, identity) {
            Ok(rec) => match nvs.adopt(&BoxJournal::referenced(&rec.dirty), rec.next_seq) {
                Ok(()) => {
                    let journal = Arc::new(rec.journal);
                    let cache = Cache::with_checkpoints(
                        frames,
                        Some(Arc::clone(&journal) as Arc<dyn DirtyJournal>),
                        config.output_commit.0 != crate::config::OutputCommit::Off,
                    );
                    let mut dirty = rec.dirty;
                    dirty.sort_by_key(|&(_, d, _)| d.seq);
                    for (track, d, handle) in dirty {
                        cache.adopt_dirty(track, d, handle);
                        destage.push(track);
                    }
                    return Ok((journal, cache, RestartKind::Fast, None));
                }
                Err(e) => Some(
                    crate::journal::FastRestartRefused::NvsDisagrees(e.to_string()).to_string(),
                ),
            },
            Err(refused) => Some(refused.to_string()),
        }
    };
    let scan = (!fresh).then(|| nvs.scan_with_progress(&mut scan_progress()));
    let journal = Arc::new(
        BoxJournal::create(&box_path, identity, nvs.last_seq() + 1)
            .map_err(OpenError::RecoveryBox)?,
    );
    let cache = Cache::with_checkpoints(
        frames,
        Some(Arc::clone(&journal) as Arc<dyn DirtyJournal>),
        config.output_commit.0 != crate::config::OutputCommit::Off,
    );
    let mut free = Vec::new();
    if let Some(scan) = &scan {
        let mut records = scan.records.clone();
        records.sort_by_key(|r| r.seq);
        for r in &records {
            let applied = cache.recover_dirty(r.track, r.slot, r.seq);
            free.extend(applied.free);
            if applied.queue {
                destage.push(r.track);
            }
        }
    }
    nvs.free(&free);
    let kind = match reason {
        None => RestartKind::Fresh,
        Some(reason) => {
            tracing::warn!(%reason, "fast restart refused; hard restart from an NVS scan");
            RestartKind::Hard { reason }
        }
    };
    Ok((journal, cache, kind, scan))
}

/// Progress of a hard restart's NVS scan: silent for the first
/// [`SCAN_QUIET`], then a log line every [`SCAN_QUIET`] (a large NVS on a
/// slow medium takes seconds).
fn scan_progress() -> impl FnMut(u32, u32) {
    let started = Instant::now();
    let mut last = started;
    move |read, total| {
        let now = Instant::now();
        if now - last >= SCAN_QUIET || (read == total && now - started >= SCAN_QUIET) {
            last = now;
            let pct = if total == 0 {
                100.0
            } else {
                100.0 * f64::from(read) / f64::from(total)
            };
            tracing::warn!(
                "hard restart: scanned {read} of {total} NVS slots ({pct:.0}%) in {:.1?}",
                now - started
            );
        }
    }
}

/// How long a hard restart's scan runs before it reports progress.
const SCAN_QUIET: Duration = Duration::from_millis(500);

impl Controller {
    /// Open (or create) the volume and NVS, recover the dirty directory
    /// (fast or hard restart), start the runtime.
    pub fn open(config: Config) -> Result<Arc<Self>, OpenError> {
        let started = Instant::now();
        config.validate()?;
        let recoveries: Arc<RecoveryLog> = Arc::default();
        let volume = Volume::open_or_create(
            &config.data_dir,
            config.volume_size,
            config.devices,
            config.raid,
            config.direct_io,
        )?;
        volume.attach_log(Arc::clone(&recoveries));
        volume.set_rebuild_rate(config.rebuild_rate);
        let (nvs, fresh) = Nvs::open_or_create(
            &config.nvs_path(),
            config.nvs_size,
            volume.label().id,
            volume.tracks(),
        )?;
        let identity = VolumeIdentity {
            id: volume.label().id,
            size_bytes: config.volume_size,
            devices: config.devices,
            nvs_slots: nvs.slot_count(),
        };
        let frames = (config.cache_size / TRACK_BYTES as u64) as usize;
        let destage = DestageQueue::default();
        let (journal, cache, kind, scan) =
            recover_state(&config, identity, &nvs, frames, &destage, fresh)?;
        let replayed_tracks = cache.dirty_tracks();
        let late = LateController::default();
        let (runtime, groups) = build_runtime(&config, &late)?;
        let export = ExportInfo {
            name: "rebound".into(),
            description: format!(
                "rebound volume {:#x}, {} bytes",
                volume.label().id,
                config.volume_size
            ),
            size_bytes: config.volume_size,
            min_block_bytes: TRACK_BYTES as u32,
            preferred_block_bytes: TRACK_BYTES as u32,
            max_payload_bytes: MAX_PAYLOAD_BYTES,
        };
        let blocks = ControlBlocks::new(config.control_blocks);
        let epochs = crate::epoch::Epochs::new(
            config.output_commit.0,
            config.checkpoint_interval,
            config.commit_when_idle,
            &config.data_dir,
            &volume,
        )?;
        let queues = (0..config.devices)
            .map(|_| DeviceQueue::new(config.device_queue_depth))
            .collect();
        let ctl = Arc::new(Self {
            rt: runtime.handle(),
            runtime: Mutex::new(Some(runtime)),
            timer: Timer::start("rebound-timer")?,
            config,
            volume,
            nvs,
            cache,
            destage,
            scrub: crate::scrub::ScrubStats::default(),
            journal,
            metrics: Metrics::default(),
            export,
            groups,
            stopping: AtomicBool::new(false),
            recoveries,
            system: SystemRecovery::default(),
            identity,
            queues,
            blocks,
            epochs,
            closed: AtomicBool::new(false),
            startup: StartupReport {
                kind,
                scan,
                replayed_tracks,
                elapsed: started.elapsed(),
            },
        });
        let _ = late.set(Arc::downgrade(&ctl));
        if replayed_tracks > 0 {
            tracing::info!(
                tracks = replayed_tracks,
                "replayed dirty tracks from the NVS"
            );
        }
        if let Some(scan) = &ctl.startup.scan
            && (scan.discarded > 0 || scan.damaged > 0)
        {
            tracing::warn!(
                discarded = scan.discarded,
                damaged = scan.damaged,
                "NVS scan: records with a damaged header freed; records with damaged data kept (their tracks read as EIO until rewritten)"
            );
        }
        {
            // Rung 1: a cache control block failing its check word is
            // dropped and rebuilt from its NVS record or the device.
            let log = Arc::clone(&ctl.recoveries);
            ctl.cache.set_rebuild_hook(Box::new(move |track| {
                log.record(
                    Rung::Task,
                    format!("cache frame of track {track} failed its check word; rebuilt from NVS or device"),
                    Duration::ZERO,
                    1,
                );
            }));
        }
        match &ctl.startup.kind {
            RestartKind::Fresh => {}
            RestartKind::Fast => ctl.recoveries.record(
                Rung::FastRestart,
                format!("restart: {replayed_tracks} dirty tracks from the recovery box"),
                ctl.startup.elapsed,
                0,
            ),
            RestartKind::Hard { reason } => ctl.recoveries.record(
                Rung::HardRestart,
                format!("restart: recovery box refused ({reason}); NVS scanned"),
                ctl.startup.elapsed,
                0,
            ),
        }
        for entry in &ctl.config.inject {
            let armed = crate::admin::execute(&format!("inject {entry}"), &ctl).map_err(|e| {
                ConfigError::Invalid {
                    setting: "inject",
                    message: format!("{entry:?}: {e}"),
                }
            })?;
            tracing::warn!(fault = %armed.trim(), "fault armed by the configuration");
        }
        ctl.epochs.rebase(&ctl);
        crate::epoch::start(&ctl)?;
        crate::destage::start_tick(&ctl);
        crate::destage::kick(&ctl);
        crate::scrub::start(&ctl);
        Ok(ctl)
    }

    /// Whether [`Controller::shutdown`] finished.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Rung 3's epochs and output gate.
    pub fn epochs(&self) -> &crate::epoch::Epochs {
        &self.epochs
    }

    /// Rung 3: roll the controller's state back to the last checkpoint and
    /// run the open epoch's requests again. Runs on the calling thread (not
    /// a worker).
    pub fn rollback(
        self: &Arc<Self>,
        cause: &str,
    ) -> Result<crate::system::RollbackReport, SystemError> {
        crate::system::rollback(self, cause)
    }

    /// Rung 4: quiesce, rebuild the in-memory state from the recovery box
    /// (or an NVS scan) and redrive the requests in flight, in process;
    /// connections stay up. Runs on the calling thread (not a worker).
    pub fn system_recover(self: &Arc<Self>, cause: &str) -> Result<SystemReport, SystemError> {
        crate::system::recover(self, cause)
    }

    /// Rung 4's state (requests in the pipeline, whether it runs).
    pub fn system(&self) -> &SystemRecovery {
        &self.system
    }

    /// The submission queue of the device holding `track` (the volume
    /// stripes tracks round-robin over its devices).
    pub(crate) fn queue(&self, track: u64) -> (usize, &DeviceQueue) {
        let i = (track % self.queues.len() as u64) as usize;
        (i, &self.queues[i])
    }

    /// The devices' submission queues.
    pub fn device_queues(&self) -> &[DeviceQueue] {
        &self.queues
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What start-up found.
    pub fn startup(&self) -> &StartupReport {
        &self.startup
    }

    /// The export as clients see it.
    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The recovery log.
    pub fn recoveries(&self) -> &RecoveryLog {
        &self.recoveries
    }

    /// The task runtime.
    pub fn runtime(&self) -> &rcs::Handle {
        &self.rt
    }

    /// The recovery groups.
    pub fn groups(&self) -> Groups {
        self.groups
    }

    /// Values for the metrics exposition.
    pub fn gauges(&self) -> Gauges {
        let s = self.cache.stats();
        let total = u64::from(self.nvs.slot_count());
        let rcs = self.rt.metrics();
        Gauges {
            cache: (
                s.hits.load(Ordering::Relaxed),
                s.nvs_hits.load(Ordering::Relaxed),
                s.misses.load(Ordering::Relaxed),
            ),
            frames_rebuilt: s.frames_rebuilt.load(Ordering::Relaxed),
            nvs: (total - u64::from(self.nvs.free_slots()), total),
            dirty_tracks: self.cache.dirty_tracks(),
            lost_tracks: crate::destage::lost_tracks(self).len() as u64,
            scrub: (
                self.scrub.checked.load(Ordering::Relaxed),
                self.scrub.repaired.load(Ordering::Relaxed),
            ),
            rungs: Rung::ALL
                .iter()
                .map(|&rung| match rung {
                    // Group recoveries are performed and timed by rcs.
                    Rung::Group => {
                        let groups = rcs.groups.iter();
                        crate::metrics::RungTotals {
                            rung: rung as u8,
                            name: rung.name(),
                            count: groups.clone().map(|g| g.recoveries).sum(),
                            seconds: groups
                                .map(|g| {
                                    g.recovery_time.mean.as_secs_f64()
                                        * g.recovery_time.count as f64
                                })
                                .sum(),
                            requests: 0,
                        }
                    }
                    _ => crate::metrics::RungTotals {
                        rung: rung as u8,
                        name: rung.name(),
                        count: self.recoveries.count(rung),
                        seconds: self.recoveries.time(rung).as_secs_f64(),
                        requests: self.recoveries.requests(rung),
                    },
                })
                .collect(),
            rcs: Some(rcs),
            control_blocks: (u64::from(self.blocks.available()), self.blocks.counts().1),
            device_queue: self.queues.iter().fold((0, 0), |(f, u), q| {
                (f + q.full_count(), u + q.unsolicited_count())
            }),
            volume: self
                .volume
                .health()
                .iter()
                .filter(|h| h.state != "online")
                .fold((0, 0), |(n, left), h| {
                    (n + 1, left + h.slots - h.rebuilt_slots)
                }),
        }
    }

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.gauges())
    }

    /// The recovery box journal.
    pub fn journal(&self) -> &Arc<BoxJournal> {
        &self.journal
    }

    /// Tracks not yet destaged.
    pub fn dirty_tracks(&self) -> u64 {
        self.cache.dirty_tracks()
    }

    /// Destage every dirty track and make the devices durable (the work of
    /// FLUSH, and of a clean shutdown).
    pub fn flush_all(&self) -> std::io::Result<()> {
        crate::destage::destage_all(self)?;
        self.sync_durable()
    }

    /// Make what is destaged durable where `--flush` says: `fdatasync`
    /// the devices, or `msync` the NVS (the end of every FLUSH).
    pub(crate) fn sync_durable(&self) -> std::io::Result<()> {
        match self.config.flush {
            FlushPolicy::Devices => self.volume.sync(),
            FlushPolicy::Nvs => self.nvs.sync().map_err(std::io::Error::other),
        }
    }

    /// Stop: refuse new work, destage everything, sync, stop the runtime.
    /// Connections must already be closed. Returns the flush result.
    pub fn shutdown(self: &Arc<Self>) -> std::io::Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        let flushed = self.flush_all();
        if self.epochs.enabled() {
            // Release what the last epoch holds (replies, device writes).
            self.epochs.commit(self);
        }
        self.closed.store(true, Ordering::SeqCst);
        if let Some(rt) = self.runtime.lock().take() {
            rt.shutdown(Duration::from_secs(10));
        }
        self.timer.stop();
        self.nvs.close();
        flushed
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.timer.stop();
        self.nvs.close();
    }
}
