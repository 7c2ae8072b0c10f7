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

use crate::backend::devqueue::DeviceQueue;
use crate::backend::volume::{Volume, VolumeError};
use crate::config::{Config, ConfigError};
use crate::engine::ctlblock::ControlBlocks;
use crate::engine::destage::DestageQueue;
use crate::engine::system::SystemRecovery;
use crate::engine::{Engine, Groups};
use crate::limits::{MAX_PAYLOAD_BYTES, TRACK_BYTES};
use crate::metrics::Metrics;
use crate::nbd::handshake::ExportInfo;
use crate::recovery::{RecoveryLog, Rung};
use crate::store::cache::{Cache, DirtyJournal};
use crate::store::journal::{BoxJournal, VolumeIdentity};
use crate::store::nvs::{Nvs, NvsError, ScanReport};
use crate::timer::Timer;

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

/// A running controller: the [`Engine`] it composes, the task runtime
/// that runs the engine's tasks, and what start-up found. The host and
/// control layers take an `Arc<Controller>` and reach the engine's state
/// through [`Deref`](std::ops::Deref).
pub struct Controller {
    engine: Arc<Engine>,
    runtime: Mutex<Option<rcs::Runtime>>,
    startup: StartupReport,
}

impl std::ops::Deref for Controller {
    type Target = Engine;

    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

/// The engine, once built: rcs's system-level callback needs it, and the
/// runtime is built before it.
type LateEngine = Arc<std::sync::OnceLock<std::sync::Weak<Engine>>>;

fn build_runtime(config: &Config, late: &LateEngine) -> Result<(rcs::Runtime, Groups), OpenError> {
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
        .trace_tasks(config.trace_tasks.is_some())
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
            Some(engine) => crate::engine::system::escalate(
                &engine,
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
                    crate::store::journal::FastRestartRefused::NvsDisagrees(e.to_string())
                        .to_string(),
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

/// Open (or create) the volume and the NVS, and the identity that ties
/// them (and the recovery box) together.
fn open_volume_and_nvs(
    config: &Config,
    recoveries: &Arc<RecoveryLog>,
) -> Result<(Volume, Nvs, bool, VolumeIdentity), OpenError> {
    let volume = Volume::open_with(
        &config.data_dir,
        config.volume_size,
        config.devices,
        config.raid,
        crate::backend::volume::DeviceOptions {
            direct: config.direct_io,
            power_loss_tracking: config.power_loss_tracking,
            error_limit: config.device_error_limit,
        },
    )?;
    volume.attach_log(Arc::clone(recoveries));
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
    Ok((volume, nvs, fresh, identity))
}

/// What the NBD handshake tells clients about the export.
fn export_info(config: &Config, volume: &Volume) -> ExportInfo {
    let description = if config.description.is_empty() {
        format!(
            "rebound volume {:#x}, {} bytes",
            volume.label().id,
            config.volume_size
        )
    } else {
        config.description.clone()
    };
    ExportInfo {
        name: config.export_name.clone(),
        description,
        size_bytes: config.volume_size,
        // Any byte offset and length: the host layer turns partial tracks
        // into read-modify-writes (`host::partial`); whole tracks are
        // cheapest.
        min_block_bytes: 1,
        preferred_block_bytes: TRACK_BYTES as u32,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
        read_only: config.read_only,
    }
}

/// Frames in the cache: `cache_size` in tracks, but never more than the
/// volume has tracks. A frame beyond them could never hold a track, and
/// the prefault (`engine/prefault.rs`) maps every frame's memory in, so an
/// uncapped cache larger than its volume would keep memory resident for
/// nothing. The cache shards tracks by their low bits and gives every
/// shard `frames / shards` frames rounded up, so the volume's tracks
/// all fit.
fn cache_frames(config: &Config) -> usize {
    let asked = config.cache_size / TRACK_BYTES as u64;
    let tracks = config.volume_tracks();
    if asked > tracks {
        tracing::info!(
            cache_size = config.cache_size,
            volume_size = config.volume_size,
            "the cache is larger than the volume: using one frame per track of the volume"
        );
    }
    asked.min(tracks) as usize
}

/// Arm the faults the configuration names (`inject`), as `rebound inject`
/// would.
fn arm_configured_faults(engine: &Arc<Engine>) -> Result<(), OpenError> {
    for entry in &engine.config.inject {
        let words: Vec<&str> = entry.split_whitespace().collect();
        let armed = crate::faults::Fault::parse(&words)
            .and_then(|fault| crate::engine::inject::arm(engine, &fault))
            .map_err(|e| ConfigError::Invalid {
                setting: "inject",
                message: format!("{entry:?}: {e}"),
            })?;
        tracing::warn!(fault = %armed.trim(), "fault armed by the configuration");
    }
    Ok(())
}

/// Start the background work: epochs (output commit), the destage tick
/// and a first destage, and the scrub.
fn start_background_work(engine: &Arc<Engine>) -> Result<(), OpenError> {
    engine.epochs.rebase(engine);
    crate::engine::epoch::start(engine)?;
    crate::engine::destage::start_tick(engine);
    crate::engine::destage::start_syncer(engine)?;
    crate::engine::destage::kick(engine);
    crate::engine::scrub::start(engine);
    crate::engine::prefault::start(engine);
    Ok(())
}

impl Controller {
    /// Open (or create) the volume and NVS, recover the dirty directory
    /// (fast or hard restart), start the runtime.
    pub fn open(config: Config) -> Result<Arc<Self>, OpenError> {
        let started = Instant::now();
        config.validate()?;
        let recoveries: Arc<RecoveryLog> = Arc::default();
        let (volume, nvs, fresh, identity) = open_volume_and_nvs(&config, &recoveries)?;
        let frames = cache_frames(&config);
        let destage = DestageQueue::default();
        let (journal, cache, kind, scan) =
            recover_state(&config, identity, &nvs, frames, &destage, fresh)?;
        let replayed_tracks = cache.dirty_tracks();
        let late = LateEngine::default();
        let (runtime, groups) = build_runtime(&config, &late)?;
        let export = export_info(&config, &volume);
        let blocks = ControlBlocks::new(config.control_blocks);
        let epochs = crate::engine::epoch::Epochs::new(
            config.output_commit.0,
            config.checkpoint_interval,
            config.commit_when_idle,
            &config.data_dir,
            &volume,
        )?;
        let queues = (0..config.devices)
            .map(|_| DeviceQueue::new(config.device_queue_depth))
            .collect();
        let engine = Arc::new(Engine {
            rt: runtime.handle(),
            timer: Timer::start("rebound-timer")?,
            config,
            volume,
            nvs,
            cache,
            destage,
            scrub: crate::engine::scrub::ScrubStats::default(),
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
            track_locks: Arc::default(),
        });
        let _ = late.set(Arc::downgrade(&engine));
        let ctl = Arc::new(Self {
            engine,
            runtime: Mutex::new(Some(runtime)),
            startup: StartupReport {
                kind,
                scan,
                replayed_tracks,
                elapsed: started.elapsed(),
            },
        });
        ctl.log_startup();
        ctl.install_frame_rebuild_hook();
        ctl.record_restart();
        let engine = &ctl.engine;
        arm_configured_faults(engine)?;
        start_background_work(engine)?;
        Ok(ctl)
    }

    /// Log what start-up replayed, and what a hard restart's scan found
    /// damaged.
    fn log_startup(&self) {
        let replayed_tracks = self.startup.replayed_tracks;
        if replayed_tracks > 0 {
            tracing::info!(
                tracks = replayed_tracks,
                "replayed dirty tracks from the NVS"
            );
        }
        if let Some(scan) = &self.startup.scan
            && (scan.discarded > 0 || scan.damaged > 0)
        {
            tracing::warn!(
                discarded = scan.discarded,
                damaged = scan.damaged,
                "NVS scan: records with a damaged header freed; records with damaged data kept (their tracks read as EIO until rewritten)"
            );
        }
    }

    /// Rung 1: a cache control block failing its check word is dropped and
    /// rebuilt from its NVS record or the device.
    fn install_frame_rebuild_hook(&self) {
        let log = Arc::clone(&self.recoveries);
        self.cache.set_rebuild_hook(Box::new(move |track| {
            log.record(
                Rung::Task,
                format!(
                    "cache frame of track {track} failed its check word; rebuilt from NVS or device"
                ),
                Duration::ZERO,
                1,
            );
        }));
    }

    /// Record a fast (rung 5) or hard (rung 6) restart in the recovery log.
    fn record_restart(&self) {
        let replayed_tracks = self.startup.replayed_tracks;
        match &self.startup.kind {
            RestartKind::Fresh => {}
            RestartKind::Fast => self.recoveries.record(
                Rung::FastRestart,
                format!("restart: {replayed_tracks} dirty tracks from the recovery box"),
                self.startup.elapsed,
                0,
            ),
            RestartKind::Hard { reason } => self.recoveries.record(
                Rung::HardRestart,
                format!("restart: recovery box refused ({reason}); NVS scanned"),
                self.startup.elapsed,
                0,
            ),
        }
    }

    /// The engine this controller composes.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// What start-up found.
    pub fn startup(&self) -> &StartupReport {
        &self.startup
    }

    /// Stop: refuse new work, destage everything, sync, stop the runtime.
    /// Connections must already be closed. Returns the flush result.
    pub fn shutdown(self: &Arc<Self>) -> std::io::Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        let flushed = self.flush_all();
        if self.epochs.enabled() {
            // Release what the last epoch holds (replies, device writes).
            self.epochs.commit(&self.engine);
        }
        self.engine.closed.store(true, Ordering::SeqCst);
        if let Some(rt) = self.runtime.lock().take() {
            rt.shutdown(Duration::from_secs(10));
        }
        self.timer.stop();
        self.nvs.close();
        flushed
    }
}
