//! The volume: its label (identity, geometry, redundancy and which devices
//! are lost, kept in `data_dir`), its devices, and track I/O through the
//! [`crate::backend::raid`] layout, degraded when a device is lost and rebuilt onto
//! a replacement while the volume serves (DESIGN.md failure model: "a lost
//! device"; the data reconstruction rung).
//!
//! The label binds the NVS to its volume: NVS records carry the volume id,
//! and an NVS whose id differs is refused rather than replayed onto the
//! wrong data.
//!
//! Label file `volume.toml` (written to a temporary file, synced, renamed):
//! ```toml
//! id = 1234567890          # random, chosen at creation
//! size_bytes = 1073741824
//! track_bytes = 4096
//! devices = 3
//! raid = "parity"          # none (absent in labels older than raid) | mirror | parity
//! [[degraded]]             # one per lost device, until its rebuild ends
//! device = 1
//! rebuilt_slots = 4096     # slots [0, 4096) of the replacement are rebuilt and synced
//! generation = 2718281828 # this loss's number, in its ahead log's records
//! ```
//!
//! Ahead log `device<N>.ahead` (parity only; slots of the replacement
//! rebuilt out of order, for a write): appended and synced, 16 bytes per
//! record, little-endian:
//! ```text
//! u64 slot | u32 generation | u32 crc32c of the first 12 bytes
//! ```
//! Records of another generation (an earlier loss) are ignored; reading
//! stops at the first record failing its check (a torn last append, whose
//! write never went on).
//!
//! ## Losing a device
//!
//! An I/O error from a device of a redundant volume (or `inject
//! lose-device`) marks it lost: the label records it *before* any write
//! skips the device, so a restart never trusts its stale contents. The
//! volume then serves degraded: a read of a lost slot comes from the other
//! copy, or is the XOR of the rest of its stripe. At once a replacement
//! (a fresh `device<N>.img`; the old file is kept as
//! `device<N>.failed.img`) is rebuilt slot by slot in the background, under
//! the same per-stripe (per-track for mirror) lock the writes take, and the
//! label records the rebuilt prefix every [`REBUILD_PERSIST_SLOTS`] slots
//! or [`REBUILD_PERSIST_INTERVAL`], whichever comes first
//! (after syncing the replacement), so a restart resumes there. A slot of
//! the replacement is read once rebuilt; it counts for writes once the label
//! says so.
//!
//! Writes keep every stripe recoverable across a crash at any point, since
//! the NVS redoes an interrupted destage after a restart:
//! - mirror: every copy not lost is written (idempotent);
//! - parity, the parity slot missing: the data alone is written;
//! - parity, the written track's own slot missing: only the parity,
//!   recomputed from the other members (idempotent);
//! - parity, another data member missing: writing around it would have to
//!   read-modify-write the parity, and a crash in between would leave the
//!   missing member unrecoverable (the RAID-5 write hole). So that member
//!   is rebuilt *ahead* first: its slot on the replacement is computed
//!   from the (consistent) stripe, written and synced, and recorded in the
//!   device's ahead log before the write goes on as a reconstruct-write
//!   with every member present. The rebuild skips slots rebuilt ahead (a
//!   stripe half written at a crash must not be rebuilt from, the slot
//!   already holds the member). Without a replacement (or with
//!   [`AHEAD_MAX`] slots ahead already) the write waits
//!   ([`std::io::ErrorKind::ResourceBusy`]; destage retries, the data stays
//!   in the NVS) until the rebuild has passed that stripe.
//!
//! What the redo cannot cover is a loss *before* it: a crash between a
//! parity write's data slot and its parity slot leaves the stripe torn,
//! and a device lost before the NVS redoes the write (its file gone at the
//! restart) would rebuild another member of that stripe from the stale
//! parity. So a parity write logs its partial parity first (the partial
//! parity log, `ppl.log`, [`crate::backend::ppl`]), and opening the volume replays
//! the log before any rebuild: torn stripes are made whole.
//!
//! A second loss in the same stripe (or of both copies) makes those tracks
//! unreadable (an error, never other data) and their writes wait in the
//! NVS. A volume without redundancy (`raid = "none"`) returns device errors
//! as they are and never marks a device lost.

mod ahead;
mod io;
mod label;
mod rebuild;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock};
use redundancy::xor_into;
use serde::{Deserialize, Serialize};

use crate::backend::device::{Device, FileDevice};
use crate::backend::faulty::{DeviceOp, FaultPlan, FaultyDevice};
use crate::backend::ppl::{Intent, PartialParityLog};
use crate::backend::raid::{Layout, Owner, Place, Raid};
use crate::limits::TRACK_BYTES;
use crate::recovery::{RecoveryLog, Rung};
use ahead::{ahead_path, new_generation, read_ahead_log};
use io::ppl_error;
use label::{fastrand_id, write_label};

/// Slots rebuilt between two records of the rebuilt prefix in the label.
pub const REBUILD_PERSIST_SLOTS: u64 = 1024;

/// Longest time between two records of the rebuilt prefix: a process
/// restarted more often than this still makes progress.
pub const REBUILD_PERSIST_INTERVAL: Duration = Duration::from_millis(50);

/// Most slots of one replacement rebuilt ahead of its rebuild (kept in
/// memory too).
pub const AHEAD_MAX: usize = 1 << 20;

/// Bytes of one ahead log record.
const AHEAD_RECORD: usize = 16;

/// First wait before a stopped rebuild tries again (it doubles each time).
pub const REBUILD_RETRY_MIN: Duration = Duration::from_millis(250);
/// Longest wait between tries of a stopped rebuild.
pub const REBUILD_RETRY_MAX: Duration = Duration::from_secs(30);

/// Stripe (or track) locks; a stripe uses lock `stripe % STRIPE_LOCKS`.
const STRIPE_LOCKS: usize = 1024;

/// The partial parity log's entry for zeroing (after the per-lock ones).
const ZERO_INTENT: usize = STRIPE_LOCKS;

/// Identity and geometry of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Label {
    /// Random id chosen at creation.
    pub id: u64,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Track size.
    pub track_bytes: u32,
    /// Devices.
    pub devices: u32,
    /// Redundancy across the devices.
    #[serde(default)]
    pub raid: Raid,
    /// Lost devices and how far their replacements are rebuilt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub degraded: Vec<Degraded>,
}

/// A lost device, recorded in the label until its replacement is rebuilt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Degraded {
    /// The device.
    pub device: u32,
    /// Slots `[0, rebuilt_slots)` of its replacement are rebuilt and synced.
    pub rebuilt_slots: u64,
    /// This loss's number: the ahead log's records carry it.
    #[serde(default)]
    pub generation: u32,
}

/// Why a volume could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// File system trouble.
    #[error("volume in {dir}: {source}")]
    Io {
        /// The data directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The label is damaged.
    #[error("volume label {path} is not valid: {message}")]
    BadLabel {
        /// The label file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The configuration asks for a different geometry than the label's.
    #[error(
        "the volume in {dir} was created with {setting} = {existing}, but the configuration says {configured}; use the original value or another data directory"
    )]
    Mismatch {
        /// The data directory.
        dir: PathBuf,
        /// Which setting.
        setting: &'static str,
        /// In the label.
        existing: String,
        /// In the configuration.
        configured: String,
    },
}

/// A device's state.
const ONLINE: u8 = 0;
/// Lost, no replacement yet: no I/O goes to it.
const LOST: u8 = 1;
/// A replacement is being rebuilt: slots below `rebuilt` hold good data.
const REBUILDING: u8 = 2;

/// One device of the volume.
#[derive(Debug)]
struct Member {
    dev: RwLock<Arc<FaultyDevice>>,
    state: AtomicU8,
    /// Device errors seen, by operation (read, write, sync).
    errors: [AtomicU64; 3],
    /// The last device error (status).
    last_error: Mutex<Option<String>>,
    /// Write and sync errors counted towards declaring it lost
    /// ([`DeviceOptions::error_limit`]); a rebuild's end starts over.
    strikes: AtomicU64,
    /// Injected loss: every I/O fails as a pulled device's would.
    pulled: AtomicBool,
    /// REBUILDING: slots `[0, rebuilt)` are rebuilt (readable).
    rebuilt: AtomicU64,
    /// REBUILDING: slots `[0, durable)` are rebuilt and in the label
    /// (writable as a good member).
    durable: AtomicU64,
    /// Losses so far: a rebuild stops when the device is lost again.
    losses: AtomicU64,
    /// REBUILDING: slots past `durable` rebuilt ahead and in the ahead log.
    ahead: Mutex<std::collections::BTreeSet<u64>>,
    /// The ahead log, open for appending.
    ahead_log: Mutex<Option<std::fs::File>>,
    /// Why its rebuild is stopped and waits to try again (status).
    stalled: Mutex<Option<String>>,
}

/// How a slot may be used now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Readable and a good member for writes.
    Good,
    /// Readable, but rebuilt past what the label records: writes wait.
    Unrecorded,
    /// Not readable (lost, or not rebuilt yet).
    Missing,
}

/// A device I/O outcome: a device failed (marked lost, then retried), the
/// data cannot be served now, or a write must wait.
enum Fault {
    Device(usize, std::io::Error),
    Io(std::io::Error),
}

impl From<std::io::Error> for Fault {
    fn from(e: std::io::Error) -> Self {
        Fault::Io(e)
    }
}

/// A device's health, for `rebound status` and the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHealth {
    /// Its file.
    pub path: PathBuf,
    /// `online`, `lost` or `rebuilding`.
    pub state: &'static str,
    /// Slots rebuilt (rebuilding only).
    pub rebuilt_slots: u64,
    /// Slots on the device.
    pub slots: u64,
    /// Lost or rebuilding: why the rebuild is stopped, waiting to try
    /// again (see [`REBUILD_RETRY_MAX`]).
    pub stalled: Option<String>,
    /// Device errors seen: read, write, sync.
    pub errors: [u64; 3],
    /// The last device error.
    pub last_error: Option<String>,
    /// Faults armed on it (`rebound inject device-error`, `device-latency`).
    pub armed: usize,
}

/// How the volume's devices are opened and judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Open the device files with `O_DIRECT`.
    pub direct: bool,
    /// Keep what a power cut would undo ([`crate::backend::faulty`]), so
    /// [`Volume::power_cut`] can run.
    pub power_loss_tracking: bool,
    /// Write or sync errors (not `ENOSPC`) after which a device of a
    /// redundant volume is declared lost.
    pub error_limit: u64,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            direct: false,
            power_loss_tracking: false,
            error_limit: DEVICE_ERROR_LIMIT,
        }
    }
}

/// Default write or sync errors after which a device of a redundant volume
/// is declared lost (md fails a member at its first write error; a few
/// strikes let a transient error pass without a rebuild).
pub const DEVICE_ERROR_LIMIT: u64 = 3;

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    options: DeviceOptions,
    /// Each device number's injected faults (kept across replacements).
    plans: Vec<Arc<FaultPlan>>,
    layout: Layout,
    label: Mutex<Label>,
    members: Vec<Member>,
    locks: Box<[Mutex<()>]>,
    log: OnceLock<Arc<RecoveryLog>>,
    closing: AtomicBool,
    rebuilds: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Most bytes per second a rebuild writes (0: as fast as it can).
    rebuild_rate: AtomicU64,
    /// Injected faults: this many more writes to a replacement during a
    /// rebuild fail (`rebound inject rebuild-error`).
    rebuild_faults: AtomicU64,
    /// Parity volumes: the partial parity log (`crate::backend::ppl`), entry
    /// `stripe % STRIPE_LOCKS` for a track write (writes sharing an entry
    /// share a lock), entry [`ZERO_INTENT`] for zeroing.
    ppl: Option<PartialParityLog>,
    /// Serialises zeroing on a parity volume (one intent entry).
    zeroing: Mutex<()>,
    /// Device syncs, one at a time, shared by the callers each covers.
    syncs: crate::backend::syncgate::SyncGate,
    /// Which tracks may hold data (BLOCK_STATUS), synced with the devices.
    alloc: crate::backend::allocmap::AllocMap,
    /// Tests: called with (device, slot) once a slot of a replacement is
    /// written, before it counts as rebuilt.
    #[cfg(test)]
    slot_written: Mutex<Option<SlotWritten>>,
}

/// A test's hook into the rebuild ([`Inner::slot_written`]).
#[cfg(test)]
struct SlotWritten(Box<dyn Fn(usize, u64) + Send + Sync>);

#[cfg(test)]
impl std::fmt::Debug for SlotWritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SlotWritten")
    }
}

/// An open volume.
#[derive(Debug)]
pub struct Volume {
    inner: Arc<Inner>,
}

impl Drop for Volume {
    fn drop(&mut self) {
        self.inner.closing.store(true, Ordering::Release);
        let rebuilds = std::mem::take(&mut *self.inner.rebuilds.lock());
        for h in rebuilds {
            let _ = h.join();
        }
    }
}

/// Open (or create) device `d`'s file; a device the label records as lost
/// resumes rebuilding from its durable progress and read-ahead log.
fn open_member(
    dir: &Path,
    d: usize,
    label: &Label,
    layout: &Layout,
    options: DeviceOptions,
    plan: &Arc<FaultPlan>,
) -> Result<Member, VolumeError> {
    let io = |source| VolumeError::Io {
        dir: dir.to_owned(),
        source,
    };
    let dev =
        FileDevice::open_or_create(&device_path(dir, d), layout.device_bytes(), options.direct)
            .map_err(io)?;
    let dev = FaultyDevice::new(dev, d, Arc::clone(plan), options.power_loss_tracking);
    let lost = label.degraded.iter().find(|g| g.device as usize == d);
    Ok(Member {
        dev: RwLock::new(Arc::new(dev)),
        errors: Default::default(),
        last_error: Mutex::new(None),
        strikes: AtomicU64::new(0),
        state: AtomicU8::new(if lost.is_some() { REBUILDING } else { ONLINE }),
        pulled: AtomicBool::new(false),
        rebuilt: AtomicU64::new(lost.map_or(0, |g| g.rebuilt_slots)),
        durable: AtomicU64::new(lost.map_or(0, |g| g.rebuilt_slots)),
        losses: AtomicU64::new(0),
        ahead: Mutex::new(match lost {
            Some(g) => read_ahead_log(dir, d, g.generation, layout.slots_per_device()),
            None => Default::default(),
        }),
        ahead_log: Mutex::new(None),
        stalled: Mutex::new(None),
    })
}

fn device_path(dir: &Path, d: usize) -> PathBuf {
    dir.join(format!("device{d}.img"))
}

impl Volume {
    /// Open the volume in `dir`, creating it (label and device files) when
    /// the directory holds none. A label recording lost devices resumes
    /// their rebuilds.
    pub fn open_or_create(
        dir: &Path,
        size_bytes: u64,
        devices: u32,
        raid: Raid,
        direct: bool,
    ) -> Result<Self, VolumeError> {
        let options = DeviceOptions {
            direct,
            ..DeviceOptions::default()
        };
        Self::open_with(dir, size_bytes, devices, raid, options)
    }

    /// [`Volume::open_or_create`] with every device option.
    pub fn open_with(
        dir: &Path,
        size_bytes: u64,
        devices: u32,
        raid: Raid,
        options: DeviceOptions,
    ) -> Result<Self, VolumeError> {
        let io = |source| VolumeError::Io {
            dir: dir.to_owned(),
            source,
        };
        crate::files::private_dir(dir).map_err(io)?;
        let (mut label, created) = Self::open_or_create_label(dir, size_bytes, devices, raid)?;
        label.degraded.sort_by_key(|g| g.device);
        let layout = Layout::new(
            label.raid,
            label.devices,
            label.size_bytes / TRACK_BYTES as u64,
        );
        let plans: Vec<Arc<FaultPlan>> = (0..label.devices).map(|_| Arc::default()).collect();
        let members = (0..label.devices as usize)
            .map(|d| open_member(dir, d, &label, &layout, options, &plans[d]))
            .collect::<Result<Vec<_>, VolumeError>>()?;
        let resume: Vec<usize> = label.degraded.iter().map(|g| g.device as usize).collect();
        let ppl = match label.raid {
            Raid::Parity => Some(PartialParityLog::open(dir, STRIPE_LOCKS + 1).map_err(io)?),
            _ => None,
        };
        let alloc =
            crate::backend::allocmap::AllocMap::open(dir, label.id, layout.tracks(), created)
                .map_err(io)?;
        let v = Volume {
            inner: Arc::new(Inner {
                dir: dir.to_owned(),
                options,
                plans,
                layout,
                label: Mutex::new(label),
                members,
                locks: (0..STRIPE_LOCKS).map(|_| Mutex::new(())).collect(),
                log: OnceLock::new(),
                closing: AtomicBool::new(false),
                rebuilds: Mutex::new(Vec::new()),
                rebuild_rate: AtomicU64::new(0),
                rebuild_faults: AtomicU64::new(0),
                ppl,
                zeroing: Mutex::new(()),
                syncs: Default::default(),
                alloc,
                #[cfg(test)]
                slot_written: Mutex::new(None),
            }),
        };
        // Before any rebuild reads a stripe: make torn stripes whole.
        v.inner.replay_partial_parity().map_err(io)?;
        for d in resume {
            tracing::warn!(
                device = d,
                from_slot = v.inner.members[d].durable.load(Ordering::Relaxed),
                "volume is degraded: resuming the rebuild of a lost device"
            );
            Inner::spawn_rebuild(&v.inner, d);
        }
        Ok(v)
    }

    /// The label in `dir`: read and checked against the configuration
    /// (adopting device files lost since), or written for a new volume
    /// (then `true`).
    fn open_or_create_label(
        dir: &Path,
        size_bytes: u64,
        devices: u32,
        raid: Raid,
    ) -> Result<(Label, bool), VolumeError> {
        let io = |source| VolumeError::Io {
            dir: dir.to_owned(),
            source,
        };
        let label_path = dir.join("volume.toml");
        let read = crate::files::read_state_file(&label_path).and_then(|b| {
            String::from_utf8(b)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        });
        let label = match read {
            Ok(text) => {
                let mut label: Label =
                    toml::from_str(&text).map_err(|e| VolumeError::BadLabel {
                        path: label_path.clone(),
                        message: e.to_string(),
                    })?;
                Self::check(dir, &label, size_bytes, devices, raid)?;
                Self::adopt_missing_devices(dir, &mut label)?;
                (label, false)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let label = Label {
                    id: fastrand_id(),
                    size_bytes,
                    track_bytes: TRACK_BYTES as u32,
                    devices,
                    raid,
                    degraded: Vec::new(),
                };
                write_label(dir, &label).map_err(io)?;
                (label, true)
            }
            Err(e) => return Err(io(e)),
        };
        Ok(label)
    }

    /// Throttle rebuilds to `bytes_per_sec` (0: unthrottled), so client
    /// I/O keeps the devices' bandwidth.
    pub fn set_rebuild_rate(&self, bytes_per_sec: u64) {
        self.inner
            .rebuild_rate
            .store(bytes_per_sec, Ordering::Relaxed);
    }

    /// Report recoveries (a device lost, a rebuild done) to `log`.
    pub fn attach_log(&self, log: Arc<RecoveryLog>) {
        let _ = self.inner.log.set(log);
    }

    /// The label as it is now.
    pub fn label(&self) -> Label {
        self.inner.label.lock().clone()
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.inner.layout
    }

    /// Tracks in the volume.
    pub fn tracks(&self) -> u64 {
        self.inner.layout.tracks()
    }

    /// Each device's health.
    pub fn health(&self) -> Vec<DeviceHealth> {
        let slots = self.inner.layout.slots_per_device();
        self.inner
            .members
            .iter()
            .map(|m| {
                let state = m.state.load(Ordering::Acquire);
                DeviceHealth {
                    path: m.dev.read().path().to_owned(),
                    state: match state {
                        ONLINE => "online",
                        LOST => "lost",
                        _ => "rebuilding",
                    },
                    rebuilt_slots: if state == REBUILDING {
                        m.rebuilt.load(Ordering::Relaxed)
                    } else {
                        0
                    },
                    slots,
                    stalled: m.stalled.lock().clone(),
                    errors: m.errors.each_ref().map(|e| e.load(Ordering::Relaxed)),
                    last_error: m.last_error.lock().clone(),
                    armed: m.dev.read().plan().armed().len(),
                }
            })
            .collect()
    }

    /// Make the next `count` writes to a replacement during a rebuild fail
    /// (the failure model's failing disk, for tests and `rebound inject
    /// rebuild-error`): the rebuild stops and tries again later.
    pub fn inject_rebuild_errors(&self, count: u64) {
        self.inner.rebuild_faults.store(count, Ordering::Release);
    }

    /// Arm `fault` on device `d` (`rebound inject device-error`,
    /// `device-latency`).
    pub fn arm_device_fault(
        &self,
        d: usize,
        fault: crate::backend::faulty::DeviceFault,
    ) -> Result<(), String> {
        let plan = self.inner.plans.get(d).ok_or_else(|| {
            format!(
                "device {d} does not exist (the volume has {})",
                self.inner.plans.len()
            )
        })?;
        plan.arm(fault);
        Ok(())
    }

    /// Disarm every device fault.
    pub fn clear_device_faults(&self) {
        for p in &self.inner.plans {
            p.clear();
        }
    }

    /// Cut the power (`rebound inject power-loss`): every device stops
    /// taking I/O, and what no completed sync covered is undone at random
    /// ([`crate::backend::faulty`]). The process must end right after.
    /// Returns the blocks put back and kept; refused without power-loss
    /// tracking.
    pub fn power_cut(&self, seed: u64) -> Result<(u64, u64), String> {
        if !self.inner.options.power_loss_tracking {
            return Err("power-loss needs the server started with --power-loss-tracking (it keeps what a power cut would undo)".into());
        }
        let (mut back, mut kept) = (0, 0);
        for (d, m) in self.inner.members.iter().enumerate() {
            let (b, k) = m
                .dev
                .read()
                .power_cut(seed.wrapping_add(d as u64))
                .map_err(|e| format!("device {d}: undoing unsynced writes failed: {e}"))?;
            back += b;
            kept += k;
        }
        Ok((back, kept))
    }

    /// Whether any device is lost or rebuilding.
    pub fn degraded(&self) -> bool {
        self.inner
            .members
            .iter()
            .any(|m| m.state.load(Ordering::Acquire) != ONLINE)
    }

    /// Pull device `d` (the failure model's lost device, injected): every
    /// I/O to it fails from now on, which marks it lost at its next use; a
    /// replacement then takes its place. Refused without redundancy, and
    /// while another device is lost or rebuilding.
    pub fn pull(&self, d: usize) -> Result<(), String> {
        let raid = self.inner.layout.raid();
        if !raid.redundant() {
            return Err(format!(
                "the volume has no redundancy (raid = \"none\"): losing device {d} would lose its tracks; serve with --raid mirror or parity"
            ));
        }
        let Some(m) = self.inner.members.get(d) else {
            return Err(format!(
                "device {d} does not exist (the volume has {})",
                self.inner.members.len()
            ));
        };
        if m.state.load(Ordering::Acquire) != ONLINE {
            return Err(format!("device {d} is already lost or rebuilding"));
        }
        // One loss is what the layouts survive; an injected second one
        // would only make tracks unreadable (a real one is not asked).
        if let Some(other) = self
            .inner
            .members
            .iter()
            .position(|m| m.state.load(Ordering::Acquire) != ONLINE)
        {
            return Err(format!(
                "device {other} is still lost or rebuilding; losing device {d} too would make tracks unreadable"
            ));
        }
        m.pulled.store(true, Ordering::Release);
        // Mark it now rather than at its next I/O, so an idle volume
        // shows it too.
        Inner::fail(&self.inner, d, &std::io::Error::other("pulled (injected)")).map_err(|e| {
            m.pulled.store(false, Ordering::Release);
            e.to_string()
        })
    }

    /// Wait until no rebuild is running (tests, benches, clean shutdown).
    pub fn wait_rebuilds(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self
            .inner
            .members
            .iter()
            .any(|m| m.state.load(Ordering::Acquire) == REBUILDING)
        {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Read track `track` into `out` (one track).
    ///
    /// A track the allocation map says holds no data (never written, or
    /// trimmed or zeroed since) reads as zeroes without a device read: on
    /// a fresh or sparse volume most read misses are such tracks, and a
    /// file device answered each with a page-cache fill of zeroes (7% of
    /// the server's CPU time at 20k IOPS of the cache benchmark on a new
    /// volume, in ext4's extent lookups and the zeroing of new pages).
    /// The map errs only towards "data"
    /// ([`crate::backend::allocmap`]), and its bit is set before any write
    /// of the track reaches a device ([`Volume::write_track`]; output
    /// commit's door for the writes it holds or renames).
    pub fn read_track(&self, track: u64, out: &mut [u8]) -> std::io::Result<()> {
        if track < self.tracks() && !self.may_hold_data(track) {
            out.fill(0);
            return Ok(());
        }
        self.inner.retry(|i| i.read_once(track, out))
    }

    /// Write one track's `data` to track `track`.
    pub fn write_track(&self, track: u64, data: &[u8]) -> std::io::Result<()> {
        debug_assert_eq!(data.len(), TRACK_BYTES);
        // Before the data can reach a device: a clear bit reads as zeroes
        // without a device read (`read_track`). Output commit's door sets
        // it earlier, for writes it holds or renames.
        if track < self.tracks() {
            self.note_written(track);
        }
        self.inner.retry(|i| i.write_once(track, data))
    }

    /// Make tracks `[first, end)` read as zeroes on the devices.
    ///
    /// `ResourceBusy` when a track at the range's edge shares a stripe with
    /// a missing member and no replacement exists yet (its write is held,
    /// as [`Volume::write_track`]'s): the caller tries again later, holding
    /// no worker meanwhile; zeroing again what this call zeroed is harmless.
    pub fn zero_tracks(&self, first: u64, end: u64, keep_allocated: bool) -> std::io::Result<()> {
        let (runs, loose) = self.inner.layout.zero_runs(first, end);
        let t = TRACK_BYTES as u64;
        if !runs.is_empty() {
            // Whole stripes (or copies) zeroed on every device keep the
            // parity the XOR of zeroes. A destage racing the range is
            // ordered by the cache, which discarded its dirty tracks first;
            // a rebuild is not, and must not copy a stripe half zeroed onto
            // the replacement, so while one runs every stripe lock is held
            // (in index order; nobody else holds two).
            let _one_intent = self.inner.zeroing.lock();
            if let Some(log) = &self.inner.ppl {
                log.record_zero(ZERO_INTENT, first, end)
                    .map_err(|e| ppl_error(log, e))?;
            }
            let zeroed = self.inner.retry(|i| {
                let _all: Vec<MutexGuard<'_, ()>> = if self.degraded() {
                    i.locks.iter().map(|l| l.lock()).collect()
                } else {
                    Vec::new()
                };
                for &(d, lo, hi) in &runs {
                    if i.members[d].state.load(Ordering::Acquire) == LOST {
                        continue;
                    }
                    i.on(d, DeviceOp::Write, |dev| {
                        dev.zero_range(lo * t, (hi - lo) * t, keep_allocated)
                    })?;
                }
                Ok(())
            });
            // Cleared also after an error: the caller was told the range
            // may not be zeroed, and a replay must not zero it later, over
            // writes acknowledged since.
            if let Some(log) = &self.inner.ppl {
                log.clear(ZERO_INTENT).map_err(|e| ppl_error(log, e))?;
            }
            zeroed?;
        }
        let zeros = vec![0u8; TRACK_BYTES];
        for track in loose {
            self.write_track(track, &zeros)?;
        }
        self.inner.alloc.clear(first, end);
        Ok(())
    }

    /// Track `track` may hold data from now on: called before a write of
    /// it goes to the devices ([`Volume::write_track`]; output commit's
    /// door, the pseudo-device, for the writes it holds or renames).
    pub fn note_written(&self, track: u64) {
        self.inner.alloc.set(track);
    }

    /// Whether track `track` may hold data on the devices (else it reads
    /// as zeroes: never written, or trimmed or zeroed since).
    pub fn may_hold_data(&self, track: u64) -> bool {
        self.inner.alloc.may_hold_data(track)
    }

    /// `fdatasync` every device not lost: done once this call is covered
    /// by a sync that started after it ([`crate::backend::syncgate`]).
    pub fn sync(&self) -> std::io::Result<()> {
        self.sync_since(self.sync_ticket())
    }

    /// The ticket to take before a device write that a later
    /// [`Volume::sync_since`] must cover.
    pub fn sync_ticket(&self) -> u64 {
        self.inner.syncs.ticket()
    }

    /// A mark for [`Volume::sync_after`].
    pub fn sync_mark(&self) -> u64 {
        self.inner.syncs.mark()
    }

    /// [`Volume::sync`] covered by any sync that started after `mark` was
    /// taken, one that already ended included: what was on the devices
    /// at the mark is durable once this returns `Ok`.
    pub fn sync_after(&self, mark: u64) -> std::io::Result<()> {
        self.inner.syncs.sync_after(mark, || self.sync_devices())
    }

    /// [`Volume::sync`] covering writes made since `ticket` was taken: an
    /// error if any device sync since then failed.
    pub fn sync_since(&self, ticket: u64) -> std::io::Result<()> {
        self.inner.syncs.sync(ticket, || self.sync_devices())
    }

    /// One sync of the allocation map and every device not lost.
    fn sync_devices(&self) -> std::io::Result<()> {
        // The allocation map first: a write made durable by this sync
        // has its bit durable too.
        self.inner.alloc.sync()?;
        self.inner.retry(|i| {
            for (d, m) in i.members.iter().enumerate() {
                if m.state.load(Ordering::Acquire) != LOST {
                    i.on(d, DeviceOp::Sync, |dev| dev.sync())?;
                }
            }
            Ok(())
        })
    }
}
