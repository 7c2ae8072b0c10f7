//! The controller's state in the recovery box: what a fast restart (rung 5)
//! needs and would otherwise rebuild by scanning the whole NVS.
//!
//! | type (app id) | items | contents (little-endian) |
//! |---|---|---|
//! | volume (1) | 1 | volume id u64, size u64, devices u32, NVS slots u32, track bytes u32, pad |
//! | dirty directory (2) | one per dirty track (app item id = track) | track u64, NVS slot u32, pad u32, seq u64 |
//! | destage cursor (3) | 1 | sequence high-water u64, tracks destaged u64 |
//!
//! Dirty records are inserted, updated and deleted under the track's cache
//! shard lock, before the write they describe is acknowledged (see
//! [`DirtyJournal`]). If any box operation fails, the box is invalidated on
//! its medium and no longer used: a later restart takes the hard path
//! instead of trusting state that stopped being kept current.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use recobox::{CreateOptions, ItemId, RecoveryBox, TypeId, TypeSpec};

use crate::limits::TRACK_BYTES;
use crate::store::cache::{Dirty, DirtyJournal, NO_HANDLE};
use crate::store::nvs::ScannedRecord;

const VOLUME_TYPE: u64 = 1;
const DIRTY_TYPE: u64 = 2;
const CURSOR_TYPE: u64 = 3;
const VOLUME_BYTES: u32 = 32;
const DIRTY_BYTES: u32 = 24;
const CURSOR_BYTES: u32 = 16;
/// Sequence numbers reserved ahead in the cursor.
const SEQ_RESERVE: u64 = 1 << 16;

/// Identity of the volume and NVS the box describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeIdentity {
    /// Volume id.
    pub id: u64,
    /// Volume size.
    pub size_bytes: u64,
    /// Devices.
    pub devices: u32,
    /// NVS slots.
    pub nvs_slots: u32,
}

impl VolumeIdentity {
    fn encode(&self) -> [u8; VOLUME_BYTES as usize] {
        let mut b = [0u8; VOLUME_BYTES as usize];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.size_bytes.to_le_bytes());
        b[16..20].copy_from_slice(&self.devices.to_le_bytes());
        b[20..24].copy_from_slice(&self.nvs_slots.to_le_bytes());
        b[24..28].copy_from_slice(&(TRACK_BYTES as u32).to_le_bytes());
        b
    }
}

fn encode_dirty(track: u64, d: Dirty) -> [u8; DIRTY_BYTES as usize] {
    let mut b = [0u8; DIRTY_BYTES as usize];
    b[0..8].copy_from_slice(&track.to_le_bytes());
    b[8..12].copy_from_slice(&d.slot.to_le_bytes());
    b[16..24].copy_from_slice(&d.seq.to_le_bytes());
    b
}

fn decode_dirty(b: &[u8]) -> (u64, Dirty) {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let slot = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    (
        u64_at(0),
        Dirty {
            slot,
            seq: u64_at(16),
        },
    )
}

/// Why a fast restart was not possible (the hard path is taken).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FastRestartRefused {
    /// No box file.
    #[error("no recovery box at the configured path")]
    Missing,
    /// The box failed validation.
    #[error("{0}")]
    Untrusted(String),
    /// The box describes another volume or NVS.
    #[error("the recovery box describes another volume or NVS")]
    Mismatch,
    /// A record the box names is not in the NVS.
    #[error("the NVS does not hold a record the recovery box names: {0}")]
    NvsDisagrees(String),
}

/// The recovery box as the cache's dirty journal.
pub struct BoxJournal {
    rbox: RecoveryBox,
    dirty: TypeId,
    cursor: ItemId,
    healthy: AtomicBool,
    high_water: AtomicU64,
    cursor_lock: Mutex<()>,
}

impl std::fmt::Debug for BoxJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoxJournal")
            .field("path", &self.rbox.path())
            .field("healthy", &self.healthy.load(Ordering::Relaxed))
            .finish()
    }
}

/// What a fast restart (`J` = [`BoxJournal`]) or an in-process rebuild
/// (`J` = `()`: the journal in use stays) recovered from the box.
#[derive(Debug)]
pub struct Recovered<J = BoxJournal> {
    /// The journal, ready for use.
    pub journal: J,
    /// Dirty records with their journal handles.
    pub dirty: Vec<(u64, Dirty, u32)>,
    /// The next sequence number to hand out.
    pub next_seq: u64,
}

impl BoxJournal {
    /// Size of a box for an NVS of `nvs_slots` slots.
    pub fn box_bytes(nvs_slots: u32) -> u64 {
        let region = |item, n| recobox::layout::region_bytes(item, n).expect("bounded sizes");
        recobox::layout::data_start(4)
            + region(VOLUME_BYTES, 1)
            + region(DIRTY_BYTES, nvs_slots)
            + region(CURSOR_BYTES, 1)
            + 4096
    }

    /// Create a fresh box at `path` for `identity` (hard restart or new volume).
    pub fn create(path: &Path, identity: VolumeIdentity, next_seq: u64) -> Result<Self, String> {
        let opts = CreateOptions {
            size_bytes: Self::box_bytes(identity.nvs_slots),
            type_slots: 4,
        };
        let rbox = RecoveryBox::create(path, opts).map_err(|e| e.to_string())?;
        let err = |e: recobox::TypeError| e.to_string();
        let vol = rbox
            .init_type(TypeSpec::new(VOLUME_BYTES, 1).app_id(VOLUME_TYPE))
            .map_err(err)?;
        let dirty = rbox
            .init_type(TypeSpec::new(DIRTY_BYTES, identity.nvs_slots).app_id(DIRTY_TYPE))
            .map_err(err)?;
        let cur = rbox
            .init_type(TypeSpec::new(CURSOR_BYTES, 1).app_id(CURSOR_TYPE))
            .map_err(err)?;
        rbox.insert(vol, &identity.encode(), None)
            .map_err(|e| e.to_string())?;
        let high = next_seq + SEQ_RESERVE;
        let cursor = rbox
            .insert(cur, &cursor_bytes(high, 0), None)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            rbox,
            dirty,
            cursor,
            healthy: AtomicBool::new(true),
            high_water: AtomicU64::new(high),
            cursor_lock: Mutex::new(()),
        })
    }

    /// Fast restart: open the box at `path` and read back the dirty
    /// directory, if the box is trusted and describes `identity`.
    pub fn recover(path: &Path, identity: VolumeIdentity) -> Result<Recovered, FastRestartRefused> {
        let rbox = match RecoveryBox::open(path) {
            Ok(b) => b,
            Err(recobox::OpenError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Err(FastRestartRefused::Missing);
            }
            Err(e) => return Err(FastRestartRefused::Untrusted(e.to_string())),
        };
        let types = (
            rbox.type_by_app_id(VOLUME_TYPE),
            rbox.type_by_app_id(DIRTY_TYPE),
            rbox.type_by_app_id(CURSOR_TYPE),
        );
        let (Some(vol), Some(dirty), Some(cur)) = types else {
            return Err(FastRestartRefused::Mismatch);
        };
        let read = |t| {
            rbox.items(t)
                .map_err(|e| FastRestartRefused::Untrusted(e.to_string()))
        };
        let volume = read(vol)?;
        if volume.len() != 1 || volume[0].2 != identity.encode() {
            return Err(FastRestartRefused::Mismatch);
        }
        let cursor = read(cur)?;
        let [(cursor_id, _, cursor_data)] = cursor.as_slice() else {
            return Err(FastRestartRefused::Mismatch);
        };
        let high = u64::from_le_bytes(cursor_data[0..8].try_into().expect("8 bytes"));
        let destaged = u64::from_le_bytes(cursor_data[8..16].try_into().expect("8 bytes"));
        let mut next_seq = 1;
        let mut records = Vec::new();
        for (id, _, data) in read(dirty)? {
            let (track, d) = decode_dirty(&data);
            next_seq = next_seq.max(d.seq + 1);
            records.push((track, d, id.index));
        }
        // Sequence numbers keep increasing across restarts.
        let next_seq = next_seq.max(high);
        let new_high = next_seq + SEQ_RESERVE;
        rbox.update(*cursor_id, &cursor_bytes(new_high, destaged))
            .map_err(|e| FastRestartRefused::Untrusted(e.to_string()))?;
        Ok(Recovered {
            journal: Self {
                rbox,
                dirty,
                cursor: *cursor_id,
                healthy: AtomicBool::new(true),
                high_water: AtomicU64::new(new_high),
                cursor_lock: Mutex::new(()),
            },
            dirty: records,
            next_seq,
        })
    }

    /// Rung 4: read the dirty directory back from the box this process
    /// keeps open (every item's checksum verified), for an in-process
    /// rebuild. Refused when the box stopped being kept current or fails
    /// its checks; the caller then scans the NVS instead.
    pub fn reread(&self, identity: VolumeIdentity) -> Result<Recovered<()>, FastRestartRefused> {
        if !self.healthy() {
            return Err(FastRestartRefused::Untrusted(
                "the recovery box was abandoned".into(),
            ));
        }
        let untrusted = |e: recobox::ItemError| FastRestartRefused::Untrusted(e.to_string());
        let vol = self
            .rbox
            .type_by_app_id(VOLUME_TYPE)
            .ok_or(FastRestartRefused::Mismatch)?;
        let volume = self.rbox.items(vol).map_err(untrusted)?;
        if volume.len() != 1 || volume[0].2 != identity.encode() {
            return Err(FastRestartRefused::Mismatch);
        }
        let high = self.high_water.load(Ordering::SeqCst);
        let mut next_seq = 1;
        let mut records = Vec::new();
        for (id, _, data) in self.rbox.items(self.dirty).map_err(untrusted)? {
            let (track, d) = decode_dirty(&data);
            next_seq = next_seq.max(d.seq + 1);
            records.push((track, d, id.index));
        }
        Ok(Recovered {
            journal: (),
            dirty: records,
            next_seq: next_seq.max(high),
        })
    }

    /// The records a fast restart hands to the NVS to adopt.
    pub fn referenced(dirty: &[(u64, Dirty, u32)]) -> Vec<ScannedRecord> {
        dirty
            .iter()
            .map(|&(track, d, _)| ScannedRecord {
                slot: d.slot,
                seq: d.seq,
                track,
            })
            .collect()
    }

    /// Make sure sequence numbers below `seq` are covered by the cursor's
    /// high-water mark (so they keep increasing after a fast restart).
    pub fn cover_seq(&self, seq: u64) {
        if seq < self.high_water.load(Ordering::Relaxed) || !self.healthy.load(Ordering::Relaxed) {
            return;
        }
        let _g = self.cursor_lock.lock();
        let high = self.high_water.load(Ordering::Relaxed);
        if seq < high {
            return;
        }
        let new_high = seq + SEQ_RESERVE;
        match self.rbox.update(self.cursor, &cursor_bytes(new_high, 0)) {
            Ok(()) => self.high_water.store(new_high, Ordering::Relaxed),
            Err(e) => self.fail(&e),
        }
    }

    /// Whether the box is still being kept current.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The box.
    pub fn rbox(&self) -> &RecoveryBox {
        &self.rbox
    }

    fn fail(&self, e: &dyn std::fmt::Display) {
        if self.healthy.swap(false, Ordering::SeqCst) {
            tracing::error!(error = %e, path = %self.rbox.path().display(),
                "recovery box update failed; invalidating it (the next restart will be a hard restart)");
            self.rbox.invalidate();
        }
    }

    /// Stop keeping the box current and invalidate it (fault injection and
    /// tests: "a corrupted recovery box").
    pub fn abandon(&self) {
        self.fail(&"abandoned on request");
    }
}

fn cursor_bytes(high: u64, destaged: u64) -> [u8; CURSOR_BYTES as usize] {
    let mut b = [0u8; CURSOR_BYTES as usize];
    b[0..8].copy_from_slice(&high.to_le_bytes());
    b[8..16].copy_from_slice(&destaged.to_le_bytes());
    b
}

impl DirtyJournal for BoxJournal {
    fn record(&self, track: u64, d: Dirty, handle: u32) -> u32 {
        if !self.healthy() {
            return NO_HANDLE;
        }
        let item = encode_dirty(track, d);
        let r = if handle == NO_HANDLE {
            self.rbox
                .insert(self.dirty, &item, Some(track))
                .map(|id| id.index)
        } else {
            self.rbox
                .update(
                    ItemId {
                        ty: self.dirty,
                        index: handle,
                    },
                    &item,
                )
                .map(|()| handle)
        };
        r.unwrap_or_else(|e| {
            self.fail(&e);
            NO_HANDLE
        })
    }

    fn forget(&self, handle: u32) {
        if !self.healthy() || handle == NO_HANDLE {
            return;
        }
        if let Err(e) = self.rbox.delete(ItemId {
            ty: self.dirty,
            index: handle,
        }) {
            self.fail(&e);
        }
    }
}
