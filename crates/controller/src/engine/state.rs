//! [`Engine`]: the state every stage, destage, scrub and recovery shares.
//!
//! One value per running controller, built at start-up by
//! [`Controller::open`](crate::Controller::open) once the volume, the NVS
//! and the dirty directory are back (fast or hard restart), and shared as
//! `Arc<Engine>` by every task of the I/O path. It owns no thread and no
//! socket: the runtime, the listener and the admin socket belong to the
//! [`Controller`](crate::Controller) that composes it, so an engine can be
//! built and driven in-process by tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::devqueue::DeviceQueue;
use crate::backend::volume::Volume;
use crate::config::{Config, FlushPolicy};
use crate::engine::ctlblock::ControlBlocks;
use crate::engine::destage::DestageQueue;
use crate::engine::system::{SystemError, SystemRecovery, SystemReport};
use crate::metrics::histogram::RECOVERY_BOUNDS_NS;
use crate::metrics::{Gauges, HistogramSnapshot, Metrics};
use crate::nbd::handshake::ExportInfo;
use crate::recovery::{RecoveryLog, Rung};
use crate::store::cache::Cache;
use crate::store::journal::{BoxJournal, VolumeIdentity};
use crate::store::nvs::Nvs;
use crate::timer::Timer;

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

/// The shared state of a running controller's I/O path and recovery
/// rungs.
pub struct Engine {
    pub(crate) config: Config,
    pub(crate) volume: Volume,
    pub(crate) nvs: Nvs,
    pub(crate) cache: Cache,
    pub(crate) destage: DestageQueue,
    pub(crate) scrub: crate::engine::scrub::ScrubStats,
    pub(crate) journal: Arc<BoxJournal>,
    pub(crate) metrics: Metrics,
    pub(crate) export: ExportInfo,
    pub(crate) groups: Groups,
    pub(crate) rt: rcs::Handle,
    pub(crate) timer: Timer,
    /// Shutting down: new requests are refused, background work stops.
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
    pub(crate) epochs: crate::engine::epoch::Epochs,
    /// Shut down: the checkpoint thread stops.
    pub(crate) closed: AtomicBool,
    /// Track locks of partial-track writes ([`crate::engine::tracklock`]).
    pub(crate) track_locks: Arc<crate::engine::tracklock::TrackLocks>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("listen", &self.config.listen)
            .field("volume", &self.volume.label())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Rung 3's epochs and output gate.
    pub fn epochs(&self) -> &crate::engine::epoch::Epochs {
        &self.epochs
    }

    /// Rung 3: roll the controller's state back to the last checkpoint and
    /// run the open epoch's requests again. Runs on the calling thread (not
    /// a worker).
    pub fn rollback(
        self: &Arc<Self>,
        cause: &str,
    ) -> Result<crate::engine::system::RollbackReport, SystemError> {
        crate::engine::system::rollback(self, cause)
    }

    /// Rung 4: quiesce, rebuild the in-memory state from the recovery box
    /// (or an NVS scan) and redrive the requests in flight, in process;
    /// connections stay up. Runs on the calling thread (not a worker).
    pub fn system_recover(self: &Arc<Self>, cause: &str) -> Result<SystemReport, SystemError> {
        crate::engine::system::recover(self, cause)
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
        // Group recoveries are performed and timed by rcs, in microseconds.
        let group_recovery: Vec<HistogramSnapshot> = rcs
            .groups
            .iter()
            .map(|g| match self.rt.recovery_histogram(g.id) {
                Some(h) => HistogramSnapshot::from_micros(&h, RECOVERY_BOUNDS_NS),
                None => HistogramSnapshot::empty(RECOVERY_BOUNDS_NS),
            })
            .collect();
        Gauges {
            cache: (
                s.hits.load(Ordering::Relaxed),
                s.nvs_hits.load(Ordering::Relaxed),
                s.misses.load(Ordering::Relaxed),
            ),
            frames_rebuilt: s.frames_rebuilt.load(Ordering::Relaxed),
            nvs: (total - u64::from(self.nvs.free_slots()), total),
            dirty_tracks: self.cache.dirty_tracks(),
            lost_tracks: crate::engine::destage::lost_tracks(self).len() as u64,
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
                        let mut durations = HistogramSnapshot::empty(RECOVERY_BOUNDS_NS);
                        group_recovery.iter().for_each(|h| durations.merge(h));
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
                            durations,
                        }
                    }
                    _ => crate::metrics::RungTotals {
                        rung: rung as u8,
                        name: rung.name(),
                        count: self.recoveries.count(rung),
                        seconds: self.recoveries.time(rung).as_secs_f64(),
                        requests: self.recoveries.requests(rung),
                        durations: self.recoveries.durations(rung),
                    },
                })
                .collect(),
            rcs: Some(rcs),
            group_recovery,
            control_blocks: (u64::from(self.blocks.available()), self.blocks.counts().1),
            device_queue: self.queues.iter().fold((0, 0), |(f, u), q| {
                (f + q.full_count(), u + q.unsolicited_count())
            }),
            device_errors: self.volume.health().iter().map(|h| h.errors).collect(),
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

    /// The metrics exposition (OpenMetrics text, [`crate::metrics::CONTENT_TYPE`]).
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
        crate::engine::destage::destage_all(self)?;
        self.sync_durable()
    }

    /// [`Engine::sync_durable`] covered by a device sync that started
    /// after `mark` ([`crate::backend::volume::Volume::sync_mark`]), one
    /// that already ended included (the end of every FLUSH and FUA).
    pub(crate) fn sync_durable_after(&self, mark: u64) -> std::io::Result<()> {
        match self.config.flush {
            FlushPolicy::Devices => self.volume.sync_after(mark),
            FlushPolicy::Nvs => self.nvs.sync().map_err(std::io::Error::other),
        }
    }

    /// Make what is destaged durable where `--flush` says: `fdatasync`
    /// the devices, or `msync` the NVS.
    pub(crate) fn sync_durable(&self) -> std::io::Result<()> {
        match self.config.flush {
            FlushPolicy::Devices => self.volume.sync(),
            FlushPolicy::Nvs => self.nvs.sync().map_err(std::io::Error::other),
        }
    }

    /// Whether the controller's shutdown finished.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.timer.stop();
        self.nvs.close();
    }
}
