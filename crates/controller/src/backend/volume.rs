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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock};
use redundancy::xor_into;

use crate::backend::ppl::{Intent, PartialParityLog};
use serde::{Deserialize, Serialize};

use crate::backend::device::{Device, FileDevice};
use crate::backend::raid::{Layout, Owner, Place, Raid};
use crate::limits::TRACK_BYTES;
use crate::recovery::{RecoveryLog, Rung};

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
    dev: RwLock<Arc<dyn Device>>,
    state: AtomicU8,
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
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    direct: bool,
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

fn device_path(dir: &Path, d: usize) -> PathBuf {
    dir.join(format!("device{d}.img"))
}

fn ahead_path(dir: &Path, d: usize) -> PathBuf {
    dir.join(format!("device{d}.ahead"))
}

/// A number for a new loss, distinct from earlier ones' (a stale ahead log
/// is never read as this loss's).
fn new_generation() -> u32 {
    (fastrand_id() >> 16) as u32
}

/// The slots of device `d` rebuilt ahead in loss `generation`.
fn read_ahead_log(
    dir: &Path,
    d: usize,
    generation: u32,
    slots: u64,
) -> std::collections::BTreeSet<u64> {
    let bytes = std::fs::read(ahead_path(dir, d)).unwrap_or_default();
    let mut ahead = std::collections::BTreeSet::new();
    for r in bytes.chunks_exact(AHEAD_RECORD) {
        let crc = u32::from_le_bytes(r[12..].try_into().expect("4 bytes"));
        if crc32c::crc32c(&r[..12]) != crc {
            break;
        }
        let slot = u64::from_le_bytes(r[..8].try_into().expect("8 bytes"));
        let g = u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
        if g == generation && slot < slots {
            ahead.insert(slot);
        }
    }
    ahead
}

/// An error of the partial parity log, naming its file.
fn ppl_error(log: &PartialParityLog, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(
        e.kind(),
        format!("partial parity log {}: {e}", log.path().display()),
    )
}

fn write_label(dir: &Path, label: &Label) -> std::io::Result<()> {
    use std::io::Write;
    let text = toml::to_string(label).map_err(std::io::Error::other)?;
    let tmp = dir.join("volume.toml.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_data()?;
    std::fs::rename(&tmp, dir.join("volume.toml"))?;
    std::fs::File::open(dir)?.sync_all()
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
        let io = |source| VolumeError::Io {
            dir: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let label_path = dir.join("volume.toml");
        let mut label = match std::fs::read_to_string(&label_path) {
            Ok(text) => {
                let mut label: Label =
                    toml::from_str(&text).map_err(|e| VolumeError::BadLabel {
                        path: label_path.clone(),
                        message: e.to_string(),
                    })?;
                Self::check(dir, &label, size_bytes, devices, raid)?;
                Self::adopt_missing_devices(dir, &mut label)?;
                label
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
                label
            }
            Err(e) => return Err(io(e)),
        };
        label.degraded.sort_by_key(|g| g.device);
        let layout = Layout::new(
            label.raid,
            label.devices,
            label.size_bytes / TRACK_BYTES as u64,
        );
        let members = (0..label.devices as usize)
            .map(|d| {
                let dev =
                    FileDevice::open_or_create(&device_path(dir, d), layout.device_bytes(), direct)
                        .map_err(io)?;
                let lost = label.degraded.iter().find(|g| g.device as usize == d);
                Ok(Member {
                    dev: RwLock::new(Arc::new(dev)),
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
            })
            .collect::<Result<Vec<_>, VolumeError>>()?;
        let resume: Vec<usize> = label.degraded.iter().map(|g| g.device as usize).collect();
        let ppl = match label.raid {
            Raid::Parity => Some(PartialParityLog::open(dir, STRIPE_LOCKS + 1).map_err(io)?),
            _ => None,
        };
        let v = Volume {
            inner: Arc::new(Inner {
                dir: dir.to_owned(),
                direct,
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

    /// A device file missing from an existing volume: lost (rebuilt from
    /// the others, recorded in the label first) when the volume has
    /// redundancy, else an error, never a device of zeroes served as data.
    fn adopt_missing_devices(dir: &Path, label: &mut Label) -> Result<(), VolumeError> {
        let mut changed = false;
        for d in 0..label.devices as usize {
            let path = device_path(dir, d);
            if path.exists() {
                continue;
            }
            if !label.raid.redundant() {
                return Err(VolumeError::BadLabel {
                    path,
                    message: "the device file of an existing volume is missing, and the volume has no redundancy to rebuild it from (raid = \"none\")".into(),
                });
            }
            tracing::warn!(device = d, path = %path.display(), "device file missing: treating the device as lost");
            label.degraded.retain(|g| g.device as usize != d);
            label.degraded.push(Degraded {
                device: d as u32,
                rebuilt_slots: 0,
                generation: new_generation(),
            });
            changed = true;
        }
        if changed {
            write_label(dir, label).map_err(|source| VolumeError::Io {
                dir: dir.to_owned(),
                source,
            })?;
        }
        Ok(())
    }

    fn check(
        dir: &Path,
        label: &Label,
        size: u64,
        devices: u32,
        raid: Raid,
    ) -> Result<(), VolumeError> {
        let mismatch = |setting, existing: String, configured: String| VolumeError::Mismatch {
            dir: dir.to_owned(),
            setting,
            existing,
            configured,
        };
        let bad = |message: String| VolumeError::BadLabel {
            path: dir.join("volume.toml"),
            message,
        };
        if label.track_bytes as usize != TRACK_BYTES {
            return Err(bad(format!(
                "track_bytes {} is not {TRACK_BYTES}",
                label.track_bytes
            )));
        }
        if label.size_bytes != size {
            return Err(mismatch(
                "volume_size",
                label.size_bytes.to_string(),
                size.to_string(),
            ));
        }
        if label.devices != devices {
            return Err(mismatch(
                "devices",
                label.devices.to_string(),
                devices.to_string(),
            ));
        }
        if label.raid != raid {
            return Err(mismatch("raid", label.raid.to_string(), raid.to_string()));
        }
        if label.devices < label.raid.min_devices() {
            return Err(bad(format!(
                "raid {} needs {} devices, the label has {}",
                label.raid,
                label.raid.min_devices(),
                label.devices
            )));
        }
        if let Some(g) = label.degraded.iter().find(|g| g.device >= label.devices) {
            return Err(bad(format!("degraded device {} does not exist", g.device)));
        }
        let slots = Layout::new(
            label.raid,
            label.devices,
            label.size_bytes / TRACK_BYTES as u64,
        )
        .slots_per_device();
        if let Some(g) = label.degraded.iter().find(|g| g.rebuilt_slots > slots) {
            return Err(bad(format!(
                "degraded device {} is rebuilt to slot {}, past its {slots} slots",
                g.device, g.rebuilt_slots
            )));
        }
        let mut seen: Vec<u32> = label.degraded.iter().map(|g| g.device).collect();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad("a device is recorded degraded twice".into()));
        }
        if !label.raid.redundant() && !label.degraded.is_empty() {
            return Err(bad("a volume without redundancy cannot be degraded".into()));
        }
        Ok(())
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
        Inner::fail(&self.inner, d, &std::io::Error::other("pulled (injected)"));
        Ok(())
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
    pub fn read_track(&self, track: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.retry(|i| i.read_once(track, out))
    }

    /// Write one track's `data` to track `track`.
    pub fn write_track(&self, track: u64, data: &[u8]) -> std::io::Result<()> {
        debug_assert_eq!(data.len(), TRACK_BYTES);
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
                    i.on(d, |dev| {
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
        Ok(())
    }

    /// `fdatasync` every device not lost.
    pub fn sync(&self) -> std::io::Result<()> {
        self.inner.retry(|i| {
            for (d, m) in i.members.iter().enumerate() {
                if m.state.load(Ordering::Acquire) != LOST {
                    i.on(d, |dev| dev.sync())?;
                }
            }
            Ok(())
        })
    }
}

impl Inner {
    /// Run `op`, marking a failing device lost and trying again (redundant
    /// volumes), at most once per device.
    fn retry<T>(
        self: &Arc<Self>,
        mut op: impl FnMut(&Arc<Self>) -> Result<T, Fault>,
    ) -> std::io::Result<T> {
        for _ in 0..=self.members.len() {
            match op(self) {
                Ok(v) => return Ok(v),
                Err(Fault::Io(e)) => return Err(e),
                Err(Fault::Device(d, e)) => {
                    if !self.layout.raid().redundant() {
                        return Err(e);
                    }
                    Self::fail(self, d, &e);
                }
            }
        }
        Err(std::io::Error::other("every device of the volume failed"))
    }

    /// Device `d`'s I/O `f`; an error (other than a refused request) is the
    /// device's fault.
    fn on<T>(
        &self,
        d: usize,
        f: impl FnOnce(&dyn Device) -> std::io::Result<T>,
    ) -> Result<T, Fault> {
        let m = &self.members[d];
        let result = if m.pulled.load(Ordering::Acquire) {
            Err(std::io::Error::other(format!(
                "device {d} is pulled (injected loss)"
            )))
        } else {
            let dev = m.dev.read().clone();
            f(&*dev)
        };
        result.map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                Fault::Io(e)
            } else {
                Fault::Device(d, e)
            }
        })
    }

    fn read_slot(&self, d: usize, slot: u64, out: &mut [u8]) -> Result<(), Fault> {
        self.on(d, |dev| dev.read_at(out, slot * TRACK_BYTES as u64))
    }

    fn write_slot(&self, d: usize, slot: u64, data: &[u8]) -> Result<(), Fault> {
        self.on(d, |dev| dev.write_at(data, slot * TRACK_BYTES as u64))
    }

    fn usable(&self, d: usize, slot: u64) -> Use {
        let m = &self.members[d];
        match m.state.load(Ordering::Acquire) {
            ONLINE => Use::Good,
            LOST => Use::Missing,
            _ => {
                if slot < m.durable.load(Ordering::Acquire) || m.ahead.lock().contains(&slot) {
                    Use::Good
                } else if slot < m.rebuilt.load(Ordering::Acquire) {
                    Use::Unrecorded
                } else {
                    Use::Missing
                }
            }
        }
    }

    fn lock(&self, key: u64) -> MutexGuard<'_, ()> {
        self.locks[(key % STRIPE_LOCKS as u64) as usize].lock()
    }

    fn unavailable(what: String) -> Fault {
        Fault::Io(std::io::Error::other(what))
    }

    fn wait_for_rebuild(what: String) -> Fault {
        Fault::Io(std::io::Error::new(std::io::ErrorKind::ResourceBusy, what))
    }

    fn read_once(&self, track: u64, out: &mut [u8]) -> Result<(), Fault> {
        match self.layout.place(track) {
            Place::Single((d, slot)) => self.read_slot(d, slot, out),
            Place::Mirror(copies) => {
                for (d, slot) in copies {
                    if self.usable(d, slot) != Use::Missing {
                        return self.read_slot(d, slot, out);
                    }
                }
                Err(Self::unavailable(format!(
                    "track {track}: both copies are on lost devices"
                )))
            }
            Place::Parity {
                stripe,
                data,
                parity,
                others,
            } => {
                if self.usable(data, stripe) != Use::Missing {
                    return self.read_slot(data, stripe, out);
                }
                // Degraded read: the XOR of the rest of the stripe, under
                // the stripe's lock so no write is half done.
                let _g = self.lock(stripe);
                if self.usable(data, stripe) != Use::Missing {
                    return self.read_slot(data, stripe, out);
                }
                self.xor_of(stripe, std::iter::once(parity).chain(others), out)
                    .map_err(|f| match f {
                        Fault::Io(e) => Self::unavailable(format!(
                            "track {track} (stripe {stripe}) cannot be reconstructed: {e}"
                        )),
                        f => f,
                    })
            }
        }
    }

    /// XOR of slot `stripe` of `devices` into `out` (zeroed first); every
    /// one must be readable.
    fn xor_of(
        &self,
        stripe: u64,
        devices: impl IntoIterator<Item = usize>,
        out: &mut [u8],
    ) -> Result<(), Fault> {
        out.fill(0);
        let mut buf = vec![0u8; TRACK_BYTES];
        for d in devices {
            if self.usable(d, stripe) == Use::Missing {
                return Err(Fault::Io(std::io::Error::other(format!(
                    "device {d} is lost too"
                ))));
            }
            self.read_slot(d, stripe, &mut buf)?;
            xor_into(out, &buf);
        }
        Ok(())
    }

    fn write_once(&self, track: u64, data: &[u8]) -> Result<(), Fault> {
        match self.layout.place(track) {
            Place::Single((d, slot)) => self.write_slot(d, slot, data),
            Place::Mirror(copies) => {
                let _g = self.lock(track);
                let uses = copies.map(|(d, slot)| self.usable(d, slot));
                if !uses.contains(&Use::Good) {
                    return Err(if uses.contains(&Use::Unrecorded) {
                        Self::wait_for_rebuild(format!(
                            "track {track}: its one readable copy is rebuilt but not yet recorded"
                        ))
                    } else {
                        Self::unavailable(format!("track {track}: both copies are on lost devices"))
                    });
                }
                for (d, slot) in copies {
                    // A copy not rebuilt yet is written too: the rebuild
                    // copies the same data under this lock later.
                    if self.members[d].state.load(Ordering::Acquire) != LOST {
                        self.write_slot(d, slot, data)?;
                    }
                }
                Ok(())
            }
            Place::Parity {
                stripe,
                data: dd,
                parity: pd,
                others,
            } => {
                let _g = self.lock(stripe);
                let du = self.usable(dd, stripe);
                let pu = self.usable(pd, stripe);
                let ou: Vec<Use> = others.iter().map(|&o| self.usable(o, stripe)).collect();
                if du == Use::Unrecorded || pu == Use::Unrecorded || ou.contains(&Use::Unrecorded) {
                    return Err(Self::wait_for_rebuild(format!(
                        "stripe {stripe} is rebuilt but not yet recorded"
                    )));
                }
                let missing = usize::from(du == Use::Missing)
                    + usize::from(pu == Use::Missing)
                    + ou.iter().filter(|&&u| u == Use::Missing).count();
                if missing > 1 {
                    return Err(Self::unavailable(format!(
                        "track {track}: stripe {stripe} has {missing} members on lost devices"
                    )));
                }
                let entry = (stripe % STRIPE_LOCKS as u64) as usize;
                if pu == Use::Missing {
                    // No parity to keep: the data alone (and no partial
                    // parity: an older record of this entry must not be
                    // replayed over what this write changes).
                    self.ppl_clear(entry)?;
                    return self.write_slot(dd, stripe, data);
                }
                if let Some(i) = ou.iter().position(|&u| u == Use::Missing) {
                    // Rebuild that member ahead (module doc), or wait.
                    self.rebuild_ahead(others[i], stripe).map_err(|why| {
                        Self::wait_for_rebuild(format!(
                            "track {track}: stripe {stripe} misses another data member ({why}); a read-modify-write could lose it in a crash"
                        ))
                    })?;
                }
                // Reconstruct-write: parity from the new data and the other
                // members as they are on the devices; idempotent, so an
                // interrupted one is made whole by the redo.
                let mut p = vec![0u8; TRACK_BYTES];
                self.xor_of(stripe, others.iter().copied(), &mut p)?;
                // `p` is the partial parity now: logged before the data
                // slot changes, so a crash between the two writes leaves a
                // stripe the replay makes whole (crate::backend::ppl).
                match (&self.ppl, du) {
                    (Some(log), Use::Good) => log
                        .record_write(entry, stripe, dd, &p)
                        .map_err(|e| Fault::Io(ppl_error(log, e)))?,
                    _ => self.ppl_clear(entry)?,
                }
                xor_into(&mut p, data);
                let written = if du != Use::Missing {
                    self.write_slot(dd, stripe, data)
                } else {
                    Ok(())
                }
                .and_then(|()| self.write_slot(pd, stripe, &p));
                // Cleared however the write ended: after an error the
                // failing device is lost (the stripe is served degraded and
                // the NVS redoes the write), and an entry left behind could
                // later be replayed over contents changed without the log
                // (a whole-stripe zeroing).
                let cleared = self.ppl_clear(entry);
                written.and(cleared)
            }
        }
    }

    /// Empties partial parity log entry `entry` (parity volumes).
    fn ppl_clear(&self, entry: usize) -> Result<(), Fault> {
        match &self.ppl {
            Some(log) => log.clear(entry).map_err(|e| Fault::Io(ppl_error(log, e))),
            None => Ok(()),
        }
    }

    /// Replays the partial parity log (at open, before rebuilds start):
    /// each torn track write's stripe gets the parity `partial XOR data`
    /// when its written member and its parity are both readable (a lost
    /// written member is rebuilt from the rest and its write redone from
    /// the NVS; a lost parity is rebuilt from the data), and each
    /// interrupted zeroing is done again. Then the log is emptied.
    fn replay_partial_parity(&self) -> std::io::Result<()> {
        let Some(log) = &self.ppl else {
            return Ok(());
        };
        let intents = log.intents()?;
        if intents.is_empty() {
            return Ok(());
        }
        let slots = self.layout.slots_per_device();
        let (mut stripes, mut zeroed) = (0u64, 0u64);
        let mut buf = vec![0u8; TRACK_BYTES];
        for intent in intents {
            match intent {
                Intent::Write {
                    stripe,
                    device,
                    partial,
                } => {
                    let members = if stripe < slots {
                        self.layout.stripe_devices(stripe)
                    } else {
                        Vec::new()
                    };
                    if members.is_empty() || !members[1..].contains(&device) {
                        tracing::warn!(
                            stripe,
                            device,
                            "partial parity log entry names no data member of its stripe; ignored"
                        );
                        continue;
                    }
                    let pd = members[0];
                    if self.usable(device, stripe) != Use::Good
                        || self.usable(pd, stripe) != Use::Good
                    {
                        continue;
                    }
                    let io = |f: Fault| match f {
                        Fault::Device(_, e) | Fault::Io(e) => e,
                    };
                    self.read_slot(device, stripe, &mut buf).map_err(io)?;
                    xor_into(&mut buf, &partial);
                    self.write_slot(pd, stripe, &buf).map_err(io)?;
                    stripes += 1;
                }
                Intent::Zero { first, end } => {
                    if first > end || end > self.layout.tracks() {
                        tracing::warn!(
                            first,
                            end,
                            "partial parity log zeroing intent out of range; ignored"
                        );
                        continue;
                    }
                    let (runs, _) = self.layout.zero_runs(first, end);
                    let t = TRACK_BYTES as u64;
                    for (d, lo, hi) in runs {
                        if self.members[d].state.load(Ordering::Acquire) != LOST {
                            self.members[d]
                                .dev
                                .read()
                                .zero_range(lo * t, (hi - lo) * t, true)?;
                        }
                    }
                    zeroed += 1;
                }
            }
        }
        for m in &self.members {
            if m.state.load(Ordering::Acquire) != LOST {
                m.dev.read().sync()?;
            }
        }
        tracing::warn!(
            stripes,
            zeroed,
            "replayed the partial parity log: torn stripes made whole"
        );
        log.reset()
    }

    /// Rebuild slot `stripe` of replacement `d` now, out of order: compute
    /// it from the rest of the stripe (under the stripe's lock, held by the
    /// caller), write and sync it, and record it in the label. An error
    /// (no replacement, too many ahead, an I/O failure) says why not.
    fn rebuild_ahead(&self, d: usize, stripe: u64) -> Result<(), String> {
        let m = &self.members[d];
        if m.state.load(Ordering::Acquire) != REBUILDING {
            return Err(format!("device {d} has no replacement yet"));
        }
        if m.ahead.lock().len() >= AHEAD_MAX {
            return Err(format!(
                "{AHEAD_MAX} slots of device {d} rebuilt ahead already"
            ));
        }
        let mut buf = vec![0u8; TRACK_BYTES];
        let rest = self
            .layout
            .stripe_devices(stripe)
            .into_iter()
            .filter(|&x| x != d);
        let fault = |f: Fault| match f {
            Fault::Device(x, e) => format!("device {x}: {e}"),
            Fault::Io(e) => e.to_string(),
        };
        self.xor_of(stripe, rest, &mut buf).map_err(fault)?;
        self.write_slot(d, stripe, &buf).map_err(fault)?;
        self.on(d, |dev| dev.sync()).map_err(fault)?;
        let label = self.label.lock();
        if m.state.load(Ordering::Acquire) != REBUILDING {
            return Err(format!("device {d} was lost again"));
        }
        let Some(g) = label.degraded.iter().find(|g| g.device as usize == d) else {
            return Err(format!("device {d} is not recorded degraded"));
        };
        let mut record = [0u8; AHEAD_RECORD];
        record[..8].copy_from_slice(&stripe.to_le_bytes());
        record[8..12].copy_from_slice(&g.generation.to_le_bytes());
        let crc = crc32c::crc32c(&record[..12]);
        record[12..].copy_from_slice(&crc.to_le_bytes());
        let mut log = m.ahead_log.lock();
        let appended = (|| -> std::io::Result<()> {
            use std::io::Write;
            if log.is_none() {
                *log = Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(ahead_path(&self.dir, d))?,
                );
            }
            let f = log.as_mut().expect("opened above");
            f.write_all(&record)?;
            f.sync_data()
        })();
        if let Err(e) = appended {
            // A partial record fails its check at the next open.
            *log = None;
            return Err(format!("recording it in the ahead log: {e}"));
        }
        m.ahead.lock().insert(stripe);
        Ok(())
    }

    /// Mark device `d` lost (after `why`), record it in the label before
    /// any write skips it, and start rebuilding a replacement.
    fn fail(self: &Arc<Self>, d: usize, why: &std::io::Error) {
        let m = &self.members[d];
        {
            let mut label = self.label.lock();
            if m.state.load(Ordering::Acquire) == LOST {
                return;
            }
            label.degraded.retain(|g| g.device as usize != d);
            label.degraded.push(Degraded {
                device: d as u32,
                rebuilt_slots: 0,
                generation: new_generation(),
            });
            label.degraded.sort_by_key(|g| g.device);
            if let Err(e) = write_label(&self.dir, &label) {
                // The device is lost either way; a restart before the label
                // is written again would trust it.
                tracing::error!(device = d, error = %e, "could not record a lost device in the volume label");
            }
            m.losses.fetch_add(1, Ordering::AcqRel);
            m.state.store(LOST, Ordering::Release);
            m.ahead.lock().clear();
            *m.ahead_log.lock() = None;
            m.rebuilt.store(0, Ordering::Release);
            m.durable.store(0, Ordering::Release);
        }
        tracing::error!(device = d, error = %why, "device lost; the volume serves degraded");
        if let Some(log) = self.log.get() {
            log.record(
                Rung::Reconstruct,
                format!(
                    "device {d} lost ({why}): serving degraded from {}",
                    self.layout.raid()
                ),
                Duration::ZERO,
                0,
            );
        }
        Self::spawn_rebuild(self, d);
    }

    /// Open a replacement for lost device `d` (a fresh file, unless the
    /// device is already rebuilding from a restart) and rebuild it in the
    /// background.
    fn spawn_rebuild(self: &Arc<Self>, d: usize) {
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("rebound-rebuild-{d}"))
            .spawn(move || me.rebuild(d));
        match spawned {
            Ok(h) => self.rebuilds.lock().push(h),
            Err(e) => tracing::error!(device = d, error = %e, "could not start a rebuild"),
        }
    }

    fn replace(&self, d: usize) -> std::io::Result<()> {
        let path = device_path(&self.dir, d);
        let failed = self.dir.join(format!("device{d}.failed.img"));
        if let Err(e) = std::fs::rename(&path, &failed) {
            tracing::warn!(device = d, error = %e, "could not move the lost device's file aside");
        }
        let dev = FileDevice::open_or_create(&path, self.layout.device_bytes(), self.direct)?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        let m = &self.members[d];
        *m.dev.write() = Arc::new(dev);
        m.pulled.store(false, Ordering::Release);
        Ok(())
    }

    /// Rebuild device `d` (creating its replacement first if it is lost),
    /// trying again after a growing wait while what stops it is not a
    /// second loss: a replacement that cannot be created or written, a
    /// label that cannot be recorded (a full or failing disk may recover).
    fn rebuild(self: Arc<Self>, d: usize) {
        let m = &self.members[d];
        let loss = m.losses.load(Ordering::Acquire);
        // A stop of an earlier loss's rebuild is no news about this one.
        *m.stalled.lock() = None;
        let mut wait = REBUILD_RETRY_MIN;
        loop {
            let why = match Arc::clone(&self).rebuild_once(d, loss) {
                Stopped::Done => return,
                Stopped::Fatal(why) => {
                    tracing::error!(device = d, %why, "rebuild stopped; the volume stays degraded");
                    *m.stalled.lock() = Some(format!("stopped: {why}"));
                    if let Some(log) = self.log.get() {
                        log.record(
                            Rung::Reconstruct,
                            format!("rebuild of device {d} stopped for good: {why}"),
                            Duration::ZERO,
                            0,
                        );
                    }
                    return;
                }
                Stopped::Retry(why) => why,
            };
            tracing::error!(device = d, %why, ?wait, "rebuild stopped; trying again");
            *m.stalled.lock() = Some(format!("stopped ({why}); trying again in {wait:?}"));
            if let Some(log) = self.log.get() {
                log.record(
                    Rung::Reconstruct,
                    format!("rebuild of device {d} stopped ({why}); trying again in {wait:?}"),
                    Duration::ZERO,
                    0,
                );
            }
            // In short naps, so closing the volume is not held up.
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if self.closing.load(Ordering::Acquire) || m.losses.load(Ordering::Acquire) != loss
                {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
            }
            *m.stalled.lock() = None;
            wait = (wait * 2).min(REBUILD_RETRY_MAX);
        }
    }

    /// One try of [`Inner::rebuild`], from the rebuilt prefix the label
    /// records.
    fn rebuild_once(self: Arc<Self>, d: usize, loss: u64) -> Stopped {
        let m = &self.members[d];
        if self.closing.load(Ordering::Acquire) || m.losses.load(Ordering::Acquire) != loss {
            return Stopped::Done;
        }
        if m.state.load(Ordering::Acquire) == LOST {
            if let Err(e) = self.replace(d) {
                return Stopped::Retry(format!("no replacement device: {e}"));
            }
            m.state.store(REBUILDING, Ordering::Release);
        }
        let started = Instant::now();
        let slots = self.layout.slots_per_device();
        let from = m.durable.load(Ordering::Acquire);
        tracing::info!(
            device = d,
            from_slot = from,
            slots,
            "rebuilding a lost device"
        );
        let mut buf = vec![0u8; TRACK_BYTES];
        let mut last_report = Instant::now();
        let mut last_persist = (from, Instant::now());
        let mut slot = from;
        let outcome: Result<(), Stopped> = loop {
            if self.closing.load(Ordering::Acquire) {
                return Stopped::Done;
            }
            if m.state.load(Ordering::Acquire) != REBUILDING
                || m.losses.load(Ordering::Acquire) != loss
            {
                return Stopped::Done; // lost again; a new rebuild starts over
            }
            if slot < slots {
                let owner = self.layout.owner(d, slot);
                // The lock the writes of this slot take, held until the
                // slot counts as rebuilt: a write in between would see the
                // slot missing and skip it (parity: write only the parity)
                // after the rebuild had copied the old data into it.
                let mut guard = match owner {
                    Owner::Unused => None,
                    Owner::Copy { track, .. } => Some(self.lock(track)),
                    Owner::Stripe(stripe) => Some(self.lock(stripe)),
                };
                let rebuilt = match owner {
                    Owner::Unused => {
                        buf.fill(0);
                        self.write_slot(d, slot, &buf)
                    }
                    Owner::Copy { track, from } => {
                        if self.usable(from.0, from.1) == Use::Missing {
                            break Err(Stopped::Fatal(format!(
                                "track {track}: its other copy is lost too"
                            )));
                        }
                        self.read_slot(from.0, from.1, &mut buf)
                            .and_then(|()| self.injected_rebuild_fault(d))
                            .and_then(|()| self.write_slot(d, slot, &buf))
                    }
                    // Rebuilt ahead for a write, and kept current since:
                    // never rebuilt again from a stripe a crash may have
                    // left half written.
                    Owner::Stripe(stripe) if m.ahead.lock().contains(&stripe) => Ok(()),
                    Owner::Stripe(stripe) => {
                        let rest = self
                            .layout
                            .stripe_devices(stripe)
                            .into_iter()
                            .filter(|&x| x != d);
                        self.xor_of(stripe, rest, &mut buf)
                            .and_then(|()| self.injected_rebuild_fault(d))
                            .and_then(|()| self.write_slot(d, slot, &buf))
                    }
                };
                if rebuilt.is_err() {
                    guard = None;
                }
                match rebuilt {
                    Ok(()) => {}
                    Err(Fault::Device(x, e)) if x != d => {
                        // Another device failed: that one is lost too, and
                        // what this one held with it cannot be rebuilt.
                        Self::fail(&self, x, &e);
                        break Err(Stopped::Fatal(format!("device {x}: {e}")));
                    }
                    // The replacement failed: a full or failing disk,
                    // perhaps for a while only.
                    Err(Fault::Device(_, e)) => {
                        break Err(Stopped::Retry(format!("replacement device {d}: {e}")));
                    }
                    // The data cannot be read now (a stripe missing
                    // another member): a second loss.
                    Err(Fault::Io(e)) => break Err(Stopped::Fatal(e.to_string())),
                }
                #[cfg(test)]
                if let Some(hook) = &*self.slot_written.lock() {
                    (hook.0)(d, slot);
                }
                slot += 1;
                m.rebuilt.store(slot, Ordering::Release);
                drop(guard.take());
                let rate = self.rebuild_rate.load(Ordering::Relaxed);
                if rate > 0 {
                    let due = Duration::from_secs_f64(
                        ((slot - from) * TRACK_BYTES as u64) as f64 / rate as f64,
                    );
                    // In short naps, so closing the volume is not held up.
                    while let Some(ahead) = due.checked_sub(started.elapsed())
                        && ahead > Duration::from_millis(1)
                        && !self.closing.load(Ordering::Acquire)
                    {
                        std::thread::sleep(ahead.min(Duration::from_millis(20)));
                    }
                }
            }
            if slot == slots
                || slot - last_persist.0 >= REBUILD_PERSIST_SLOTS
                || last_persist.1.elapsed() >= REBUILD_PERSIST_INTERVAL
            {
                last_persist = (slot, Instant::now());
                if let Err(e) = self.on(d, |dev| dev.sync()) {
                    break Err(Stopped::Retry(match e {
                        Fault::Device(_, e) | Fault::Io(e) => {
                            format!("syncing replacement device {d}: {e}")
                        }
                    }));
                }
                let mut label = self.label.lock();
                if m.state.load(Ordering::Acquire) != REBUILDING
                    || m.losses.load(Ordering::Acquire) != loss
                {
                    return Stopped::Done;
                }
                if slot == slots {
                    label.degraded.retain(|g| g.device as usize != d);
                } else if let Some(g) = label.degraded.iter_mut().find(|g| g.device as usize == d) {
                    g.rebuilt_slots = slot;
                }
                if let Err(e) = write_label(&self.dir, &label) {
                    break Err(Stopped::Retry(format!(
                        "recording the rebuild in the label: {e}"
                    )));
                }
                m.durable.store(slot, Ordering::Release);
                m.ahead.lock().retain(|&a| a >= slot);
                if slot == slots {
                    m.state.store(ONLINE, Ordering::Release);
                    // Its records are of a finished loss's generation now.
                    *m.ahead_log.lock() = None;
                    let _ = std::fs::remove_file(ahead_path(&self.dir, d));
                    break Ok(());
                }
                if last_report.elapsed() >= Duration::from_secs(2) {
                    last_report = Instant::now();
                    tracing::info!(
                        device = d,
                        percent = slot * 100 / slots.max(1),
                        "rebuild progress"
                    );
                }
            }
        };
        match outcome {
            Ok(()) => {
                let took = started.elapsed();
                tracing::info!(device = d, slots = slots - from, ?took, "device rebuilt");
                if let Some(log) = self.log.get() {
                    log.record(
                        Rung::Reconstruct,
                        format!(
                            "device {d} rebuilt from {} ({} MiB)",
                            self.layout.raid(),
                            ((slots - from) * TRACK_BYTES as u64) >> 20
                        ),
                        took,
                        0,
                    );
                }
                *m.stalled.lock() = None;
                Stopped::Done
            }
            Err(stopped) => stopped,
        }
    }

    /// An injected write error of replacement `d` during its rebuild, if
    /// one is armed.
    fn injected_rebuild_fault(&self, d: usize) -> Result<(), Fault> {
        let armed = self
            .rebuild_faults
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if armed {
            return Err(Fault::Device(
                d,
                std::io::Error::other("injected write error on the replacement"),
            ));
        }
        Ok(())
    }
}

/// How one try of a rebuild ended.
enum Stopped {
    /// Rebuilt, or no longer this try's business (closing, lost again).
    Done,
    /// Stopped by what may pass: try again later.
    Retry(String),
    /// Stopped by a second loss: what the device held with the other
    /// cannot be rebuilt.
    Fatal(String),
}

fn fastrand_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = crc32c::crc32c(&nanos.to_le_bytes()) as u64;
    (mixed << 32) ^ nanos ^ u64::from(std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(track: u64, version: u8) -> Vec<u8> {
        let mut b = vec![0u8; TRACK_BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (track as u8).wrapping_mul(31) ^ (i as u8) ^ version.wrapping_mul(97);
        }
        b[0..8].copy_from_slice(&track.to_le_bytes());
        b[8] = version;
        b
    }

    fn read(v: &Volume, t: u64) -> std::io::Result<Vec<u8>> {
        let mut b = vec![0u8; TRACK_BYTES];
        v.read_track(t, &mut b).map(|()| b)
    }

    /// Write, retrying while the layout asks the write to wait for the
    /// rebuild (what destage does).
    fn write_retrying(v: &Volume, t: u64, data: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match v.write_track(t, data) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                    assert!(Instant::now() < deadline, "track {t} waited too long: {e}");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("track {t}: {e}"),
            }
        }
    }

    fn raw(dir: &Path, d: usize, slot: u64) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open(device_path(dir, d)).unwrap();
        let mut b = vec![0u8; TRACK_BYTES];
        f.read_exact_at(&mut b, slot * TRACK_BYTES as u64).unwrap();
        b
    }

    /// Every copy equal, every stripe's parity the XOR of its data.
    fn assert_consistent(v: &Volume, dir: &Path) {
        let l = v.layout();
        for t in 0..l.tracks() {
            match l.place(t) {
                Place::Single(_) => {}
                Place::Mirror([a, b]) => {
                    assert_eq!(raw(dir, a.0, a.1), raw(dir, b.0, b.1), "track {t} copies");
                }
                Place::Parity { stripe, .. } => {
                    let mut x = vec![0u8; TRACK_BYTES];
                    for d in l.stripe_devices(stripe) {
                        xor_into(&mut x, &raw(dir, d, stripe));
                    }
                    assert!(x.iter().all(|&b| b == 0), "stripe {stripe} parity");
                }
            }
        }
    }

    #[test]
    fn striping_places_consecutive_tracks_on_consecutive_devices() {
        let dir = tempfile::tempdir().unwrap();
        let v = Volume::open_or_create(dir.path(), 10 * 4096, 3, Raid::None, false).unwrap();
        for t in 0..10 {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        assert_eq!(raw(dir.path(), 0, 0), pattern(0, 1));
        assert_eq!(raw(dir.path(), 1, 1), pattern(4, 1));
        assert_eq!(raw(dir.path(), 0, 3), pattern(9, 1));
    }

    #[test]
    fn every_layout_reads_back_what_was_written_and_keeps_its_redundancy() {
        for (raid, devices) in [
            (Raid::None, 2),
            (Raid::Mirror, 2),
            (Raid::Mirror, 3),
            (Raid::Parity, 3),
            (Raid::Parity, 5),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let v = Volume::open_or_create(dir.path(), 23 * 4096, devices, raid, false).unwrap();
            for t in 0..23 {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            for t in (0..23).step_by(3) {
                v.write_track(t, &pattern(t, 2)).unwrap();
            }
            for t in 0..23 {
                let want = pattern(t, if t % 3 == 0 { 2 } else { 1 });
                assert_eq!(read(&v, t).unwrap(), want, "{raid} x{devices} track {t}");
            }
            assert_consistent(&v, dir.path());
        }
    }

    #[test]
    fn zero_tracks_zeroes_exactly_the_range_in_every_layout() {
        for (raid, devices) in [
            (Raid::None, 1),
            (Raid::None, 3),
            (Raid::Mirror, 3),
            (Raid::Parity, 3),
            (Raid::Parity, 4),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let v = Volume::open_or_create(dir.path(), 20 * 4096, devices, raid, false).unwrap();
            for t in 0..20 {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            v.zero_tracks(3, 17, false).unwrap();
            for t in 0..20 {
                let b = read(&v, t).unwrap();
                if (3..17).contains(&t) {
                    assert!(b.iter().all(|&x| x == 0), "{raid} x{devices} track {t}");
                } else {
                    assert_eq!(b, pattern(t, 1), "{raid} x{devices} track {t}");
                }
            }
            assert_consistent(&v, dir.path());
        }
    }

    #[test]
    fn reopening_with_another_geometry_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let id = Volume::open_or_create(dir.path(), 8 * 4096, 3, Raid::Parity, false)
            .unwrap()
            .label()
            .id;
        let again = Volume::open_or_create(dir.path(), 8 * 4096, 3, Raid::Parity, false).unwrap();
        assert_eq!(again.label().id, id);
        drop(again);
        let e = Volume::open_or_create(dir.path(), 16 * 4096, 3, Raid::Parity, false).unwrap_err();
        assert!(e.to_string().contains("volume_size"), "{e}");
        let e = Volume::open_or_create(dir.path(), 8 * 4096, 3, Raid::Mirror, false).unwrap_err();
        assert!(e.to_string().contains("raid = parity"), "{e}");
        std::fs::write(dir.path().join("volume.toml"), "garbage = [").unwrap();
        let e = Volume::open_or_create(dir.path(), 8 * 4096, 3, Raid::Parity, false).unwrap_err();
        assert!(matches!(e, VolumeError::BadLabel { .. }), "{e}");
    }

    #[test]
    fn a_label_from_before_raid_opens_as_a_volume_without_redundancy() {
        let dir = tempfile::tempdir().unwrap();
        drop(Volume::open_or_create(dir.path(), 32768, 2, Raid::None, false).unwrap());
        std::fs::write(
            dir.path().join("volume.toml"),
            "id = 7\nsize_bytes = 32768\ntrack_bytes = 4096\ndevices = 2\n",
        )
        .unwrap();
        let v = Volume::open_or_create(dir.path(), 32768, 2, Raid::None, false).unwrap();
        assert_eq!(v.label().raid, Raid::None);
        assert_eq!(v.label().id, 7);
    }

    #[test]
    fn a_damaged_degraded_record_in_the_label_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        drop(Volume::open_or_create(dir.path(), 32768, 3, Raid::Parity, false).unwrap());
        let text = std::fs::read_to_string(dir.path().join("volume.toml")).unwrap();
        std::fs::write(
            dir.path().join("volume.toml"),
            format!("{text}[[degraded]]\ndevice = 9\nrebuilt_slots = 0\n"),
        )
        .unwrap();
        let e = Volume::open_or_create(dir.path(), 32768, 3, Raid::Parity, false).unwrap_err();
        assert!(e.to_string().contains("degraded device 9"), "{e}");
    }

    #[test]
    fn impossible_degraded_records_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        drop(Volume::open_or_create(dir.path(), 32768, 3, Raid::Parity, false).unwrap());
        let text = std::fs::read_to_string(dir.path().join("volume.toml")).unwrap();
        for (extra, want) in [
            (
                "[[degraded]]\ndevice = 1\nrebuilt_slots = 99\n",
                "past its 4 slots",
            ),
            (
                "[[degraded]]\ndevice = 1\nrebuilt_slots = 0\n[[degraded]]\ndevice = 1\nrebuilt_slots = 1\n",
                "degraded twice",
            ),
        ] {
            std::fs::write(dir.path().join("volume.toml"), format!("{text}{extra}")).unwrap();
            let e = Volume::open_or_create(dir.path(), 32768, 3, Raid::Parity, false).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    /// A device file gone from an existing volume is never replaced by
    /// zeroes served as data: rebuilt with redundancy, an error without.
    #[test]
    fn a_missing_device_file_is_rebuilt_with_redundancy_and_refused_without() {
        let dir = tempfile::tempdir().unwrap();
        let v = Volume::open_or_create(dir.path(), 64 * 4096, 2, Raid::None, false).unwrap();
        v.write_track(0, &pattern(0, 1)).unwrap();
        drop(v);
        std::fs::remove_file(device_path(dir.path(), 1)).unwrap();
        let e = Volume::open_or_create(dir.path(), 64 * 4096, 2, Raid::None, false).unwrap_err();
        assert!(
            e.to_string().contains("device1.img") && e.to_string().contains("missing"),
            "{e}"
        );

        for raid in [Raid::Mirror, Raid::Parity] {
            let dir = tempfile::tempdir().unwrap();
            let v = Volume::open_or_create(dir.path(), 300 * 4096, 3, raid, false).unwrap();
            for t in 0..300 {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            drop(v);
            std::fs::remove_file(device_path(dir.path(), 2)).unwrap();
            let v = Volume::open_or_create(dir.path(), 300 * 4096, 3, raid, false).unwrap();
            for t in 0..300 {
                assert_eq!(read(&v, t).unwrap(), pattern(t, 1), "{raid} track {t}");
            }
            assert!(v.wait_rebuilds(Duration::from_secs(60)));
            assert_consistent(&v, dir.path());
            assert!(v.label().degraded.is_empty());
        }
    }

    #[test]
    fn losing_a_device_is_refused_without_redundancy() {
        let dir = tempfile::tempdir().unwrap();
        let v = Volume::open_or_create(dir.path(), 32768, 2, Raid::None, false).unwrap();
        assert!(v.pull(0).unwrap_err().contains("no redundancy"));
        let dir = tempfile::tempdir().unwrap();
        let v = Volume::open_or_create(dir.path(), 32768, 2, Raid::Mirror, false).unwrap();
        assert!(v.pull(2).unwrap_err().contains("does not exist"));
        // A second loss while the first is rebuilt (one slot a second).
        v.set_rebuild_rate(4096);
        v.pull(0).unwrap();
        assert!(
            v.pull(0)
                .unwrap_err()
                .contains("already lost or rebuilding")
        );
        let e = v.pull(1).unwrap_err();
        assert!(e.contains("device 0 is still lost or rebuilding"), "{e}");
    }

    /// The failure model's lost device: nothing written is lost, reads
    /// while degraded return the data, writes while degraded land, and the
    /// replacement is rebuilt to a consistent volume.
    #[test]
    fn a_lost_device_loses_nothing_and_its_replacement_is_rebuilt() {
        for (raid, devices, lost) in [
            (Raid::Mirror, 2, 1),
            (Raid::Mirror, 4, 2),
            (Raid::Parity, 3, 0),
            (Raid::Parity, 4, 3),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let tracks = 3000;
            let v =
                Volume::open_or_create(dir.path(), tracks * 4096, devices, raid, false).unwrap();
            let log = Arc::new(RecoveryLog::default());
            v.attach_log(Arc::clone(&log));
            for t in 0..tracks {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            v.pull(lost).unwrap();
            assert!(v.degraded());
            assert!(v.label().degraded.iter().any(|g| g.device as usize == lost));
            // Degraded (or partly rebuilt) reads and writes.
            for t in 0..tracks {
                assert_eq!(
                    read(&v, t).unwrap(),
                    pattern(t, 1),
                    "{raid} x{devices} track {t}"
                );
                if t % 2 == 0 {
                    write_retrying(&v, t, &pattern(t, 2));
                }
            }
            assert!(
                v.wait_rebuilds(Duration::from_secs(60)),
                "{raid}: rebuild did not end"
            );
            assert!(!v.degraded());
            assert!(
                v.label().degraded.is_empty(),
                "the label still records the loss"
            );
            assert!(dir.path().join(format!("device{lost}.failed.img")).exists());
            for t in 0..tracks {
                let want = pattern(t, if t % 2 == 0 { 2 } else { 1 });
                assert_eq!(
                    read(&v, t).unwrap(),
                    want,
                    "{raid} x{devices} track {t} after rebuild"
                );
            }
            assert_consistent(&v, dir.path());
            let causes: Vec<String> = log.recent().into_iter().map(|r| r.cause).collect();
            assert!(
                causes
                    .iter()
                    .any(|c| c.contains(&format!("device {lost} lost"))),
                "{causes:?}"
            );
            assert!(
                causes
                    .iter()
                    .any(|c| c.contains(&format!("device {lost} rebuilt"))),
                "{causes:?}"
            );
        }
    }

    /// A write to a stripe whose slot the rebuild has just written, before
    /// that slot counts as rebuilt, is not lost: it waits for the stripe's
    /// lock instead of seeing its own slot missing and writing only the
    /// parity (after which the slot kept the old data the rebuild copied
    /// into it, and the track read back as its old contents: a data loss
    /// `tests/lost_device.rs` caught about one run in six).
    #[test]
    fn a_write_racing_the_rebuild_of_its_own_slot_is_not_lost() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 600;
        let lost = 1;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        // A track whose data lives on the lost device, in a middle stripe.
        let l = v.layout();
        let (track, stripe) = (tracks / 2..tracks)
            .find_map(|t| match l.place(t) {
                Place::Parity { stripe, data, .. } if data == lost => Some((t, stripe)),
                _ => None,
            })
            .expect("a track on the lost device");
        let (reached, wait) = std::sync::mpsc::channel();
        *v.inner.slot_written.lock() = Some(SlotWritten(Box::new(move |d, slot| {
            if d == lost && slot == stripe {
                reached.send(()).unwrap();
                // Time for the write to run into the window, if it can.
                std::thread::sleep(Duration::from_millis(300));
            }
        })));
        v.pull(lost).unwrap();
        wait.recv_timeout(Duration::from_secs(60))
            .expect("the rebuild reached the stripe");
        write_retrying(&v, track, &pattern(track, 2));
        assert!(v.wait_rebuilds(Duration::from_secs(60)));
        let got = read(&v, track).unwrap();
        assert!(
            got == pattern(track, 2),
            "track {track} (stripe {stripe}) lost its write: reads version {}",
            got[8]
        );
        for t in (0..tracks).filter(|&t| t != track) {
            assert_eq!(read(&v, t).unwrap(), pattern(t, 1), "track {t}");
        }
        assert_consistent(&v, dir.path());
    }

    fn raw_write(dir: &Path, d: usize, slot: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(device_path(dir, d))
            .unwrap();
        f.write_all_at(data, slot * TRACK_BYTES as u64).unwrap();
    }

    /// The RAID-5 write hole: a crash between a track write's data slot and
    /// its parity slot, then the loss of the device of *another* member of
    /// that stripe (one no write touched). Replaying the partial parity log
    /// at the restart makes the stripe whole first, so the other member is
    /// rebuilt as it was; without the log it would be rebuilt from the
    /// stale parity as other bytes.
    #[test]
    fn a_torn_parity_write_then_a_lost_device_loses_no_other_member() {
        for torn_entry_logged in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let tracks = 300;
            let v =
                Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
            for t in 0..tracks {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            let l = v.layout();
            let (written, stripe, dd) = (100..tracks)
                .find_map(|t| match l.place(t) {
                    Place::Parity { stripe, data, .. } => Some((t, stripe, data)),
                    _ => None,
                })
                .unwrap();
            let Place::Parity { others, .. } = l.place(written) else {
                unreachable!()
            };
            let lost = others[0];
            let untouched = (0..tracks)
                .find(|&t| matches!(l.place(t), Place::Parity { stripe: s, data, .. } if s == stripe && data == lost))
                .unwrap();
            // What the write path does, up to a crash after the data slot:
            // log the partial parity, write the data, never the parity.
            let partial = raw(dir.path(), lost, stripe);
            if torn_entry_logged {
                v.inner
                    .ppl
                    .as_ref()
                    .unwrap()
                    .record_write(
                        (stripe % STRIPE_LOCKS as u64) as usize,
                        stripe,
                        dd,
                        &partial,
                    )
                    .unwrap();
            }
            drop(v);
            raw_write(dir.path(), dd, stripe, &pattern(written, 2));
            // The restart finds the untouched member's device gone.
            std::fs::remove_file(device_path(dir.path(), lost)).unwrap();
            let v =
                Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
            assert!(v.wait_rebuilds(Duration::from_secs(60)));
            let got = read(&v, untouched).unwrap();
            if torn_entry_logged {
                assert!(
                    got == pattern(untouched, 1),
                    "track {untouched} of torn stripe {stripe} rebuilt as other bytes"
                );
                assert_eq!(read(&v, written).unwrap(), pattern(written, 2));
                assert_consistent(&v, dir.path());
                assert!(v.inner.ppl.as_ref().unwrap().intents().unwrap().is_empty());
            } else {
                // The hole the log closes: the stale parity rebuilds it wrong.
                assert!(got != pattern(untouched, 1), "the write hole did not open");
            }
        }
    }

    /// Writes and zeroing leave no entry behind in the partial parity log,
    /// and an interrupted zeroing is done again at the restart.
    #[test]
    fn partial_parity_entries_live_only_while_their_write_is_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 300;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        v.zero_tracks(3, 40, false).unwrap();
        let log = v.inner.ppl.as_ref().unwrap();
        assert!(log.intents().unwrap().is_empty());
        // A zeroing interrupted after its first device.
        log.record_zero(ZERO_INTENT, 100, 200).unwrap();
        let (runs, _) = v.layout().zero_runs(100, 200);
        drop(v);
        let (d, lo, hi) = runs[0];
        for slot in lo..hi {
            raw_write(dir.path(), d, slot, &[0u8; TRACK_BYTES]);
        }
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        let (first_whole, end_whole) = {
            let (_, loose) = v.layout().zero_runs(100, 200);
            let inner: Vec<u64> = (100..200).filter(|t| !loose.contains(t)).collect();
            (inner[0], inner[inner.len() - 1] + 1)
        };
        for t in 0..tracks {
            let b = read(&v, t).unwrap();
            if (3..40).contains(&t) || (first_whole..end_whole).contains(&t) {
                assert!(b.iter().all(|&x| x == 0), "track {t} not zeroed");
            } else {
                assert_eq!(b, pattern(t, 1), "track {t}");
            }
        }
        assert_consistent(&v, dir.path());
        assert!(v.inner.ppl.as_ref().unwrap().intents().unwrap().is_empty());
    }

    /// Zeroing a range while a rebuild runs leaves every stripe whole: the
    /// rebuild never copies a half-zeroed stripe onto the replacement.
    #[test]
    fn zeroing_during_a_rebuild_leaves_the_volume_consistent() {
        for raid in [Raid::Mirror, Raid::Parity] {
            let dir = tempfile::tempdir().unwrap();
            let tracks = 6000;
            let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, raid, false).unwrap();
            for t in 0..tracks {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            v.pull(2).unwrap();
            v.zero_tracks(10, tracks - 10, false).unwrap();
            assert!(v.wait_rebuilds(Duration::from_secs(60)));
            for t in 0..tracks {
                let b = read(&v, t).unwrap();
                if (10..tracks - 10).contains(&t) {
                    assert!(b.iter().all(|&x| x == 0), "{raid} track {t}");
                } else {
                    assert_eq!(b, pattern(t, 1), "{raid} track {t}");
                }
            }
            assert_consistent(&v, dir.path());
        }
    }

    /// A zeroed range's edge track whose stripe misses another member,
    /// with no replacement yet, is held (`ResourceBusy`, to try again)
    /// instead of failing, and zeroing again once one exists completes.
    #[test]
    fn zeroing_an_edge_track_of_a_held_stripe_is_held_until_a_replacement() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 600;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        // Lose the device of track 599, the other member of track 598's
        // (last) stripe, with a rebuild of about half a second.
        let Place::Parity { data: lost, .. } = v.layout().place(599) else {
            unreachable!()
        };
        // Lost, and its replacement only 300 ms later.
        v.inner.members[lost].state.store(LOST, Ordering::Release);
        let inner = Arc::clone(&v.inner);
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            Inner::spawn_rebuild(&inner, lost);
        });
        let started = Instant::now();
        let mut held = 0;
        loop {
            match v.zero_tracks(1, 599, false) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                    held += 1;
                    assert!(started.elapsed() < Duration::from_secs(60), "held for ever");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("zeroing failed: {e}"),
            }
        }
        assert!(held > 0, "the edge track was not held");
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "it completed before the replacement existed"
        );
        late.join().unwrap();
        assert!(v.wait_rebuilds(Duration::from_secs(60)));
        for t in [0, 599] {
            assert_eq!(read(&v, t).unwrap(), pattern(t, 1), "track {t}");
        }
        for t in [1, 2, 300, 597, 598] {
            assert!(read(&v, t).unwrap().iter().all(|&b| b == 0), "track {t}");
        }
        assert_consistent(&v, dir.path());
    }

    /// A write around a missing data member rebuilds that member ahead and
    /// records it; a crash in the middle of a later write to the stripe
    /// (data written, parity not) does not make the restarted rebuild
    /// recompute the member from the half-written stripe.
    #[test]
    fn a_member_rebuilt_ahead_is_kept_across_a_crash_mid_write() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 600;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        // Stripe 200 = tracks 400 and 401; lose 401's device; the rebuild
        // crawls (one slot a second), far from slot 200.
        let l = v.layout();
        let Place::Parity { data: lost, .. } = l.place(401) else {
            unreachable!()
        };
        let Place::Parity {
            stripe, data: d400, ..
        } = l.place(400)
        else {
            unreachable!()
        };
        assert_eq!(stripe, 200);
        v.set_rebuild_rate(4096);
        v.pull(lost).unwrap();
        // Goes ahead once the replacement exists (the rebuild itself is
        // 200 s from slot 200): 401's slot rebuilt ahead.
        write_retrying(&v, 400, &pattern(400, 2));
        assert!(v.inner.members[lost].rebuilt.load(Ordering::Acquire) < 200);
        let label = v.label();
        let ahead = read_ahead_log(dir.path(), lost, label.degraded[0].generation, 300);
        assert_eq!(
            ahead.into_iter().collect::<Vec<_>>(),
            vec![200],
            "{label:?}"
        );
        drop(v);
        // A crash in the middle of writing 400 again: its data on the
        // device, the parity not.
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(device_path(dir.path(), d400))
                .unwrap();
            f.write_all_at(&pattern(400, 3), 200 * TRACK_BYTES as u64)
                .unwrap();
        }
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        assert!(v.wait_rebuilds(Duration::from_secs(60)));
        // 401 is what was written, not the XOR of the half-written stripe.
        assert_eq!(read(&v, 401).unwrap(), pattern(401, 1));
        // The redo of the interrupted write makes the stripe whole.
        v.write_track(400, &pattern(400, 3)).unwrap();
        assert_eq!(read(&v, 400).unwrap(), pattern(400, 3));
        assert_consistent(&v, dir.path());
        assert!(v.label().degraded.is_empty());
    }

    #[test]
    fn the_ahead_log_keeps_this_losss_whole_records_only() {
        let dir = tempfile::tempdir().unwrap();
        let rec = |slot: u64, g: u32| {
            let mut r = [0u8; AHEAD_RECORD];
            r[..8].copy_from_slice(&slot.to_le_bytes());
            r[8..12].copy_from_slice(&g.to_le_bytes());
            let crc = crc32c::crc32c(&r[..12]);
            r[12..].copy_from_slice(&crc.to_le_bytes());
            r
        };
        let mut bytes = Vec::new();
        for (slot, g) in [(3, 5), (7, 4), (9, 5), (999, 5)] {
            bytes.extend_from_slice(&rec(slot, g));
        }
        bytes.extend_from_slice(&rec(11, 5)[..10]); // torn
        std::fs::write(ahead_path(dir.path(), 0), &bytes).unwrap();
        let got: Vec<u64> = read_ahead_log(dir.path(), 0, 5, 100).into_iter().collect();
        assert_eq!(
            got,
            vec![3, 9],
            "other generations and slots past the end are ignored"
        );
        // A damaged record ends the log: what follows is not trusted.
        let mut damaged = bytes.clone();
        damaged[AHEAD_RECORD + 2] ^= 1;
        std::fs::write(ahead_path(dir.path(), 0), &damaged).unwrap();
        let got: Vec<u64> = read_ahead_log(dir.path(), 0, 5, 100).into_iter().collect();
        assert_eq!(got, vec![3]);
        assert!(
            read_ahead_log(dir.path(), 1, 5, 100).is_empty(),
            "no log, nothing ahead"
        );
    }

    /// A restart trusts a lost device's replacement only up to the prefix
    /// the label records: garbage past it is rebuilt, not served.
    #[test]
    fn a_restart_rebuilds_what_the_label_does_not_record_as_rebuilt() {
        for raid in [Raid::Mirror, Raid::Parity] {
            let dir = tempfile::tempdir().unwrap();
            let tracks = 2500;
            let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, raid, false).unwrap();
            for t in 0..tracks {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            let mut label = v.label();
            drop(v);
            // As if killed mid-rebuild: the first 1024 slots recorded, the
            // rest of the replacement garbage.
            label.degraded.push(Degraded {
                device: 1,
                rebuilt_slots: 1024,
                generation: 1,
            });
            write_label(dir.path(), &label).unwrap();
            {
                use std::os::unix::fs::FileExt;
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(device_path(dir.path(), 1))
                    .unwrap();
                let slots = Layout::new(raid, 3, tracks).slots_per_device();
                for s in 1024..slots {
                    f.write_all_at(&[0xA5; TRACK_BYTES], s * TRACK_BYTES as u64)
                        .unwrap();
                }
            }
            let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, raid, false).unwrap();
            for t in 0..tracks {
                assert_eq!(
                    read(&v, t).unwrap(),
                    pattern(t, 1),
                    "{raid} track {t} while rebuilding"
                );
            }
            assert!(v.wait_rebuilds(Duration::from_secs(60)));
            assert_consistent(&v, dir.path());
            assert!(v.label().degraded.is_empty());
        }
    }

    /// With a member lost and no rebuild running, a write goes ahead
    /// where it is idempotent (its own slot or the parity lost) and waits
    /// where it would have to read-modify-write the parity.
    #[test]
    fn degraded_parity_writes_wait_only_where_a_crash_could_lose_a_member() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 60;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        // Lost, and no replacement (as if the spare could not be made).
        v.inner.members[1].state.store(LOST, Ordering::Release);
        let (mut waited, mut written) = (0, 0);
        for t in 0..tracks {
            let Place::Parity {
                stripe,
                data,
                parity,
                ..
            } = v.layout().place(t)
            else {
                unreachable!()
            };
            match v.write_track(t, &pattern(t, 2)) {
                Ok(()) => {
                    assert!(
                        data == 1 || parity == 1,
                        "track {t} wrote around a lost data member"
                    );
                    written += 1;
                }
                Err(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy, "{e}");
                    assert!(
                        data != 1 && parity != 1,
                        "track {t} of stripe {stripe} waited"
                    );
                    waited += 1;
                }
            }
        }
        assert!(waited > 0 && written > 0);
        for t in 0..tracks {
            let b = read(&v, t).unwrap();
            assert!(b == pattern(t, 1) || b == pattern(t, 2), "track {t}");
            let Place::Parity { data, parity, .. } = v.layout().place(t) else {
                unreachable!()
            };
            let version = if data == 1 || parity == 1 { 2 } else { 1 };
            assert_eq!(b, pattern(t, version), "track {t} read degraded");
        }
    }

    /// Two losses in one stripe: the tracks that cannot be reconstructed
    /// are errors, never other data.
    #[test]
    fn a_second_loss_makes_tracks_unreadable_never_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let tracks = 600;
        let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, Raid::Parity, false).unwrap();
        for t in 0..tracks {
            v.write_track(t, &pattern(t, 1)).unwrap();
        }
        // Lose two devices; fail the replacement of the first too, so
        // nothing is rebuilt.
        v.inner.members[0].pulled.store(true, Ordering::Release);
        v.inner.members[1].pulled.store(true, Ordering::Release);
        let mut errors = 0;
        for t in 0..tracks {
            match read(&v, t) {
                Ok(b) => assert_eq!(b, pattern(t, 1), "track {t}"),
                Err(_) => errors += 1,
            }
        }
        assert!(
            errors > 0,
            "two lost devices of three must cost some tracks"
        );
        assert!(v.degraded());
    }

    /// A replacement that fails writes for a while (a full or failing
    /// disk) stops the rebuild, which says why and tries again until it
    /// completes; nothing is lost meanwhile.
    #[test]
    fn a_rebuild_stopped_by_a_failing_replacement_tries_again_until_done() {
        for raid in [Raid::Mirror, Raid::Parity] {
            let dir = tempfile::tempdir().unwrap();
            let tracks = 600;
            let v = Volume::open_or_create(dir.path(), tracks * 4096, 3, raid, false).unwrap();
            for t in 0..tracks {
                v.write_track(t, &pattern(t, 1)).unwrap();
            }
            v.inject_rebuild_errors(2);
            let started = Instant::now();
            v.pull(1).unwrap();
            // Stopped, with its reason in the device's health.
            let mut seen = None;
            while seen.is_none() && started.elapsed() < Duration::from_secs(5) {
                seen = v.health()[1].stalled.clone();
                std::thread::sleep(Duration::from_millis(1));
            }
            let why = seen.expect("the stopped rebuild says so");
            assert!(why.contains("injected write error"), "{why}");
            assert!(why.contains("trying again"), "{why}");
            // Served meanwhile, written meanwhile.
            for t in (0..tracks).step_by(7) {
                assert_eq!(read(&v, t).unwrap(), pattern(t, 1), "{raid:?} track {t}");
            }
            write_retrying(&v, 10, &pattern(10, 2));
            assert!(
                v.wait_rebuilds(Duration::from_secs(60)),
                "{raid:?}: never rebuilt"
            );
            assert!(
                started.elapsed() >= REBUILD_RETRY_MIN * 3,
                "two failures wait 250 ms then 500 ms before the third try"
            );
            assert!(!v.degraded());
            assert_eq!(v.health()[1].stalled, None);
            assert_eq!(read(&v, 10).unwrap(), pattern(10, 2));
            for t in (0..tracks).filter(|&t| t != 10) {
                assert_eq!(read(&v, t).unwrap(), pattern(t, 1), "{raid:?} track {t}");
            }
            assert_consistent(&v, dir.path());
        }
    }
}
