//! NVS: the non-volatile write cache. A write is acknowledged once its
//! records are here; destage writes them to the devices and frees them.
//! A hard restart rebuilds the dirty directory by scanning this file alone,
//! so the NVS never depends on the recovery box.
//!
//! # Format (version 1, little-endian)
//!
//! ```text
//! offset 0      superblock, 4096 bytes:
//!   0   u64 magic "RBNDNVS1"       8  u32 version (1)      12  u32 slot_bytes
//!  16   u32 slot_count            20  u32 track_bytes      24  u64 volume_id
//!  32   u32 crc32c of bytes 0..32
//!  40   u32 high_water: no slot at or above it has ever held a record
//!  44   u32 crc32c of bytes 40..44 (a bad one reads as high_water = slot_count)
//!  (rest zero)
//! offset 4096   slot_count slots of slot_bytes = 64 + track_bytes each:
//!   0   u32 magic "RBNV" (0x56_4E_42_52); 0 = free slot
//!   4   u16 kind (1 = data)        6  u16 reserved (0)
//!   8   u64 seq (global, increasing; the newest record of a track wins)
//!  16   u64 track                 24  u32 data_bytes       28  u32 crc32c of the data
//!  32   u64 volume_id             40  [u8; 20] reserved (0)
//!  60   u32 crc32c of header bytes 0..60
//!  64   data (data_bytes, then zero padding to track_bytes)
//! ```
//!
//! # Crash assumptions
//!
//! The file is mapped shared; stores reach the page cache in program order
//! as far as this process is concerned, so a record written before a reply
//! survives the death of the process (SIGKILL, abort). On `/dev/shm` it does
//! not survive a reboot; on a file on disk, [`Nvs::sync`] (`msync` of the
//! slots, then `fdatasync` of the file for the superblock) makes it survive
//! a power loss. The superblock and the new file's directory entry are
//! synced when the file is created, and the high-water mark each time it is
//! raised, before a slot above the old mark is handed out: a power loss
//! never leaves a mark below a record that was synced.
//!
//! A record is written data first, then header bytes 4..64, then, after a
//! release fence, the magic. A crash before the magic store leaves the slot
//! free (its old record was freed before reuse); a torn record fails its
//! checksums and is discarded. Both cases are writes never acknowledged.
//! Freeing is a single aligned 4-byte store of magic = 0.
//!
//! A record whose magic and header are intact but whose data fails its
//! checksum cannot come from a crash in this order: it is damage to the
//! NVS memory, and may be the only copy of an acknowledged write. The scan
//! keeps it ([`ScanReport::damaged`]) instead of letting an older record or
//! the device's older data stand in for it: if it is its track's newest
//! record, the track is lost (reads answer `EIO`; see `destage`'s module
//! doc) until it is written again. (Where pages of a file-backed NVS reach
//! the disk out of order at a power loss, an unacknowledged write can look
//! the same; answering `EIO` for it is conservative, never wrong data.)
//!
//! Slots are handed out lowest first, so the slots that ever held a record
//! stay below a high-water mark. Raising it (in steps of a segment) is
//! written to the superblock before any slot above the old mark is handed
//! out; a restart therefore reads only the slots below the mark (a fast
//! restart clears their stale magics, a hard restart validates them), and
//! never faults in the untouched rest of a large NVS.
//!
//! # Concurrency
//!
//! Slots are grouped in segments of [`SEGMENT_SLOTS`] slots, each its own
//! mapping behind its own mutex. A slot belongs to one owner at a time: the
//! free list, a reservation, or a record referenced by the cache directory.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};
use parking_lot::{Condvar, Mutex};

use crate::limits::TRACK_BYTES;

/// Superblock magic.
pub const NVS_MAGIC: u64 = u64::from_le_bytes(*b"RBNDNVS1");
/// Format version.
pub const NVS_VERSION: u32 = 1;
/// Superblock size.
pub const SUPERBLOCK_BYTES: u64 = 4096;
/// Slot header size.
pub const SLOT_HEADER_BYTES: usize = 64;
/// Slot magic.
pub const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"RBNV");
/// Slots per mapped segment (a multiple of 64 keeps segments page-aligned).
pub const SEGMENT_SLOTS: u32 = 256;
/// Record kind: track data.
pub const KIND_DATA: u16 = 1;

/// Slot size for 4 KiB tracks.
pub const SLOT_BYTES: usize = SLOT_HEADER_BYTES + TRACK_BYTES;

/// How often a reservation waiting for NVS space looks again without a
/// wake-up ([`Nvs::reserve`]).
const RESERVE_RECHECK: Duration = Duration::from_millis(10);

// Header layout: each offset derived from the previous field.
const H_MAGIC: usize = 0;
const H_KIND: usize = H_MAGIC + 4;
const H_RESERVED: usize = H_KIND + 2;
const H_SEQ: usize = H_RESERVED + 2;
const H_TRACK: usize = H_SEQ + 8;
const H_DATA_BYTES: usize = H_TRACK + 8;
const H_DATA_CRC: usize = H_DATA_BYTES + 4;
const H_VOLUME: usize = H_DATA_CRC + 4;
const H_PAD: usize = H_VOLUME + 8;
const H_CRC: usize = H_PAD + 20;
const _: () = assert!(H_CRC + 4 == SLOT_HEADER_BYTES);
const _: () = assert!(H_SEQ == 8 && H_TRACK == 16 && H_VOLUME == 32 && H_CRC == 60);
const _: () = assert!((SEGMENT_SLOTS as usize * SLOT_BYTES).is_multiple_of(4096));
const _: () = assert!(SLOT_BYTES.is_multiple_of(4), "magic stores stay aligned");

/// Errors of NVS operations.
#[derive(Debug, thiserror::Error)]
pub enum NvsError {
    /// File system trouble.
    #[error("NVS {path}: {source}")]
    Io {
        /// The NVS file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Another process holds the NVS.
    #[error("NVS {0} is in use by another rebound process")]
    Locked(PathBuf),
    /// The file is not an NVS, or a damaged one.
    #[error("NVS {path} is not usable: {reason}")]
    BadSuperblock {
        /// The NVS file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The NVS was made for another volume or geometry.
    #[error(
        "NVS {path} belongs to {what}; refusing to replay its records here (move the file away only if its volume is gone)"
    )]
    Foreign {
        /// The NVS file.
        path: PathBuf,
        /// What differs.
        what: String,
    },
    /// A record failed its checksum when read.
    #[error("NVS record in slot {slot} is corrupt: {reason}")]
    Corrupt {
        /// The slot.
        slot: u32,
        /// Why.
        reason: &'static str,
    },
    /// The slot holds the record asked for (its header is intact and names
    /// it), but the data failed its checksum: the NVS memory itself is
    /// damaged, and no rollback or rebuild of the directory brings the data
    /// back (unlike [`NvsError::Corrupt`], where the directory may be what
    /// is wrong).
    #[error(
        "NVS record in slot {slot} (track {track}, seq {seq}) failed its data checksum: its data is damaged"
    )]
    Damaged {
        /// The slot.
        slot: u32,
        /// The record's track.
        track: u64,
        /// The record's sequence number.
        seq: u64,
    },
    /// The server is shutting down; no more space is handed out.
    #[error("NVS is shutting down")]
    ShuttingDown,
    /// No space came free within the wait limit.
    #[error("no NVS space came free within {0:?}")]
    Timeout(Duration),
}

/// A valid record found by the scan at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Its slot.
    pub slot: u32,
    /// Its sequence number.
    pub seq: u64,
    /// The track it holds.
    pub track: u64,
}

/// What the scan at open found.
#[derive(Debug, Default, Clone)]
pub struct ScanReport {
    /// Records whose header is intact, in slot order (their data is
    /// checked when read: see `damaged`).
    pub records: Vec<ScannedRecord>,
    /// Slots whose header was torn or damaged (now free).
    pub discarded: u32,
    /// Of `records`, those whose data fails its checksum (kept: see the
    /// module doc's crash assumptions).
    pub damaged: u32,
    /// Time the scan took.
    pub elapsed: Duration,
}

struct FreeList {
    slots: Vec<u32>,
}

/// The NVS.
pub struct Nvs {
    path: PathBuf,
    _file: File,
    volume_id: u64,
    tracks: u64,
    slot_count: u32,
    segments: Box<[Mutex<MmapMut>]>,
    free: Mutex<FreeList>,
    space: Condvar,
    /// Reservations woken by releases ([`Nvs::waiters_woken`]).
    woken: AtomicU64,
    next_seq: AtomicU64,
    closing: AtomicBool,
    /// Slots at or above this have never held a record (persisted in the
    /// superblock before it is crossed). Changed under the free-list lock.
    high_water: AtomicU32,
    /// The next [`Nvs::sync`] fails (tests: a failing disk cannot be had).
    #[cfg(test)]
    fail_next_sync: AtomicBool,
}

impl std::fmt::Debug for Nvs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvs")
            .field("path", &self.path)
            .field("slot_count", &self.slot_count)
            .field("free", &self.free.lock().slots.len())
            .finish()
    }
}

fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn encode_superblock(slot_count: u32, volume_id: u64) -> [u8; 36] {
    let mut sb = [0u8; 36];
    sb[0..8].copy_from_slice(&NVS_MAGIC.to_le_bytes());
    sb[8..12].copy_from_slice(&NVS_VERSION.to_le_bytes());
    sb[12..16].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
    sb[16..20].copy_from_slice(&slot_count.to_le_bytes());
    sb[20..24].copy_from_slice(&(TRACK_BYTES as u32).to_le_bytes());
    sb[24..32].copy_from_slice(&volume_id.to_le_bytes());
    let c = crc(&sb[0..32]);
    sb[32..36].copy_from_slice(&c.to_le_bytes());
    sb
}

/// Slots that fit in `size_bytes` (whole segments only).
pub fn slots_for(size_bytes: u64) -> u32 {
    let raw = size_bytes.saturating_sub(SUPERBLOCK_BYTES) / SLOT_BYTES as u64;
    let whole = raw / u64::from(SEGMENT_SLOTS) * u64::from(SEGMENT_SLOTS);
    whole.min(u64::from(u32::MAX - SEGMENT_SLOTS)) as u32
}

impl Nvs {
    /// Open the NVS at `path` for volume `volume_id` (of `tracks` tracks),
    /// creating it with `size_bytes` when absent. A new NVS is ready (every
    /// slot free); an existing one must then be [scanned](Nvs::scan) (hard
    /// restart) or [adopted](Nvs::adopt) (fast restart) before use.
    pub fn open_or_create(
        path: &Path,
        size_bytes: u64,
        volume_id: u64,
        tracks: u64,
    ) -> Result<(Self, bool), NvsError> {
        let io = |source| NvsError::Io {
            path: path.to_owned(),
            source,
        };
        // 0600, no symbolic link followed, ours (crate::files).
        let file =
            crate::files::open_state_file(path, crate::files::Create::IfMissing).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(NvsError::Locked(path.to_owned()));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        let len = file.metadata().map_err(io)?.len();
        let fresh = len == 0;
        let slot_count = if fresh {
            let slot_count = slots_for(size_bytes);
            let total = SUPERBLOCK_BYTES + u64::from(slot_count) * SLOT_BYTES as u64;
            // Reserve the memory now: a sparse NVS on tmpfs could fault
            // (SIGBUS) on a write when /dev/shm fills, and would allocate
            // its pages one fault at a time on the restart path instead of
            // once here.
            crate::files::reserve(&file, total).map_err(io)?;
            file.write_all_at(&encode_superblock(slot_count, volume_id), 0)
                .map_err(io)?;
            // high_water = 0: nothing written yet.
            let mut hw = [0u8; 8];
            let c = crc(&hw[0..4]);
            hw[4..8].copy_from_slice(&c.to_le_bytes());
            file.write_all_at(&hw, 40).map_err(io)?;
            // The superblock, then the new file's name, durable before any
            // record is written (on /dev/shm both are nearly free).
            file.sync_data().map_err(io)?;
            crate::files::sync_parent(path).map_err(io)?;
            slot_count
        } else {
            Self::check_superblock(&file, path, len, size_bytes, volume_id)?
        };
        let segments = (0..slot_count / SEGMENT_SLOTS)
            .map(|s| {
                let offset = SUPERBLOCK_BYTES + u64::from(s * SEGMENT_SLOTS) * SLOT_BYTES as u64;
                // SAFETY: the mapping covers a range inside the file (its
                // length was checked or set above). memmap2 requires that no
                // one else truncates or modifies the file behind our back:
                // we hold an exclusive flock on it for our lifetime, and
                // every access from this process goes through these mappings
                // behind their mutexes.
                unsafe {
                    MmapOptions::new()
                        .offset(offset)
                        .len(SEGMENT_SLOTS as usize * SLOT_BYTES)
                        .map_mut(&file)
                }
                .map(Mutex::new)
                .map_err(io)
            })
            .collect::<Result<Box<[_]>, _>>()?;
        let file_for_hwm = file.try_clone().map_err(io)?;
        let nvs = Self {
            path: path.to_owned(),
            _file: file,
            volume_id,
            tracks,
            slot_count,
            segments,
            free: Mutex::new(FreeList { slots: Vec::new() }),
            space: Condvar::new(),
            woken: AtomicU64::new(0),
            next_seq: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            high_water: AtomicU32::new(if fresh {
                0
            } else {
                Self::read_high_water(&file_for_hwm, slot_count)
            }),
            #[cfg(test)]
            fail_next_sync: AtomicBool::new(false),
        };
        if fresh {
            // A new file holds no records: every slot is free.
            nvs.free.lock().slots = (0..slot_count).rev().collect();
        }
        Ok((nvs, fresh))
    }

    fn check_superblock(
        file: &File,
        path: &Path,
        len: u64,
        size_bytes: u64,
        volume_id: u64,
    ) -> Result<u32, NvsError> {
        let bad = |reason: String| NvsError::BadSuperblock {
            path: path.to_owned(),
            reason,
        };
        if len < SUPERBLOCK_BYTES {
            return Err(bad(format!(
                "truncated: {len} bytes, shorter than its {SUPERBLOCK_BYTES}-byte superblock"
            )));
        }
        let mut sb = [0u8; 36];
        file.read_exact_at(&mut sb, 0)
            .map_err(|e| bad(format!("cannot read the superblock: {e}")))?;
        if le_u64(&sb, 0) != NVS_MAGIC {
            return Err(bad("no NVS magic (not an NVS file)".into()));
        }
        if le_u32(&sb, 32) != crc(&sb[0..32]) {
            return Err(bad("superblock checksum mismatch".into()));
        }
        if le_u32(&sb, 8) != NVS_VERSION {
            return Err(bad(format!(
                "format version {} (expected {NVS_VERSION})",
                le_u32(&sb, 8)
            )));
        }
        if le_u32(&sb, 12) as usize != SLOT_BYTES || le_u32(&sb, 20) as usize != TRACK_BYTES {
            return Err(bad("slot or track size differs from this build's".into()));
        }
        let slot_count = le_u32(&sb, 16);
        if slot_count == 0 || !slot_count.is_multiple_of(SEGMENT_SLOTS) {
            return Err(bad(format!(
                "slot count {slot_count} is not a whole number of segments"
            )));
        }
        let needed = SUPERBLOCK_BYTES + u64::from(slot_count) * SLOT_BYTES as u64;
        if len < needed {
            return Err(bad(format!("truncated: {len} bytes, {needed} needed")));
        }
        let id = le_u64(&sb, 24);
        if id != volume_id {
            return Err(NvsError::Foreign {
                path: path.to_owned(),
                what: format!("volume {id:#x}, not this volume ({volume_id:#x})"),
            });
        }
        if slot_count != slots_for(size_bytes) {
            return Err(NvsError::Foreign {
                path: path.to_owned(),
                what: format!(
                    "an NVS of {slot_count} slots, but nvs_size asks for {}; start with the old nvs_size (records are replayed and destaged), then change it after a clean shutdown",
                    slots_for(size_bytes)
                ),
            });
        }
        Ok(slot_count)
    }

    /// The persisted high-water mark (`slot_count` if it cannot be trusted).
    fn read_high_water(file: &File, slot_count: u32) -> u32 {
        let mut b = [0u8; 8];
        if file.read_exact_at(&mut b, 40).is_err() || le_u32(&b, 4) != crc(&b[0..4]) {
            return slot_count;
        }
        let hwm = le_u32(&b, 0);
        if hwm > slot_count { slot_count } else { hwm }
    }

    /// Persist a new high-water mark (before any slot below it but above the
    /// old one is handed out): written and `fdatasync`ed, so a power loss
    /// cannot leave a stale mark below records the scan must find. Raised
    /// once per segment, so the sync is rare (and nearly free on /dev/shm).
    fn write_high_water(&self, hwm: u32) -> io::Result<()> {
        let mut b = [0u8; 8];
        b[0..4].copy_from_slice(&hwm.to_le_bytes());
        let c = crc(&b[0..4]);
        b[4..8].copy_from_slice(&c.to_le_bytes());
        self._file.write_all_at(&b, 40)?;
        self._file.sync_data()
    }

    /// Slots below the high-water mark (the only ones that can hold records).
    pub fn high_water(&self) -> u32 {
        self.high_water.load(Ordering::SeqCst)
    }

    fn locate(slot: u32) -> (usize, usize) {
        let seg = (slot / SEGMENT_SLOTS) as usize;
        let at = (slot % SEGMENT_SLOTS) as usize * SLOT_BYTES;
        (seg, at)
    }

    /// Hard restart: validate every slot (header and data checksums); free
    /// those whose header is invalid (keeping those whose data alone is
    /// damaged); rebuild the free list and the sequence counter.
    pub fn scan(&self) -> ScanReport {
        self.scan_with_progress(&mut |_, _| {})
    }

    /// [`Nvs::scan`], telling `progress(slots read, slots to read)` after
    /// each segment (slots above the high-water mark are not read).
    pub fn scan_with_progress(&self, progress: &mut dyn FnMut(u32, u32)) -> ScanReport {
        let started = Instant::now();
        let to_read = self.high_water().min(self.slot_count);
        let mut report = ScanReport::default();
        let mut free = Vec::new();
        let mut max_seq = 0;
        let hwm = self.high_water();
        for (s, segment) in self.segments.iter().enumerate() {
            let mut map = segment.lock();
            for i in 0..SEGMENT_SLOTS as usize {
                let slot = s as u32 * SEGMENT_SLOTS + i as u32;
                if slot >= hwm {
                    // Never held a record: free without touching it.
                    free.push(slot);
                    continue;
                }
                let rec = &mut map[i * SLOT_BYTES..(i + 1) * SLOT_BYTES];
                if le_u32(rec, H_MAGIC) == 0 {
                    free.push(slot);
                    continue;
                }
                match self.validate_header(&rec[..SLOT_HEADER_BYTES]) {
                    Some((seq, track)) => {
                        if self.validate(rec).is_none() {
                            report.damaged += 1;
                        }
                        max_seq = max_seq.max(seq);
                        report.records.push(ScannedRecord { slot, seq, track });
                    }
                    None => {
                        rec[H_MAGIC..H_MAGIC + 4].copy_from_slice(&0u32.to_le_bytes());
                        report.discarded += 1;
                        free.push(slot);
                    }
                }
            }
            let read = ((s as u32 + 1) * SEGMENT_SLOTS).min(to_read);
            progress(read, to_read);
        }
        free.reverse();
        self.free.lock().slots = free;
        self.next_seq.store(max_seq + 1, Ordering::SeqCst);
        report.elapsed = started.elapsed();
        report
    }

    /// Fast restart: `referenced` are the records the recovery box says are
    /// live. Their headers are checked (not their data: the box vouches for
    /// them); every other slot is freed, so no stale record survives to be
    /// replayed by a later scan. Sequence numbers continue from `next_seq`.
    pub fn adopt(&self, referenced: &[ScannedRecord], next_seq: u64) -> Result<(), NvsError> {
        let mut live = vec![false; self.slot_count as usize];
        let hwm = self.high_water();
        for r in referenced {
            let (seg, at) = Self::locate(r.slot);
            if r.slot >= hwm || live[r.slot as usize] {
                return Err(NvsError::Corrupt {
                    slot: r.slot,
                    reason: "referenced twice or out of range",
                });
            }
            let map = self.segments[seg].lock();
            match self.validate_header(&map[at..at + SLOT_HEADER_BYTES]) {
                Some((seq, track)) if (seq, track) == (r.seq, r.track) && seq < next_seq => {}
                _ => {
                    return Err(NvsError::Corrupt {
                        slot: r.slot,
                        reason: "does not hold the record the recovery box names",
                    });
                }
            }
            live[r.slot as usize] = true;
        }
        let mut free = Vec::with_capacity(self.slot_count as usize - referenced.len());
        for (s, segment) in self.segments.iter().enumerate() {
            let mut map = segment.lock();
            for i in 0..SEGMENT_SLOTS as usize {
                let slot = s as u32 * SEGMENT_SLOTS + i as u32;
                if live[slot as usize] {
                    continue;
                }
                if slot >= hwm {
                    free.push(slot);
                    continue;
                }
                let magic = &mut map[i * SLOT_BYTES..i * SLOT_BYTES + 4];
                if magic != [0; 4] {
                    magic.copy_from_slice(&0u32.to_le_bytes());
                }
                free.push(slot);
            }
        }
        free.reverse();
        self.free.lock().slots = free;
        self.next_seq.store(next_seq, Ordering::SeqCst);
        Ok(())
    }

    fn validate_header(&self, header: &[u8]) -> Option<(u64, u64)> {
        if le_u32(header, H_MAGIC) != SLOT_MAGIC || le_u32(header, H_CRC) != crc(&header[..H_CRC]) {
            return None;
        }
        let kind = u16::from_le_bytes([header[H_KIND], header[H_KIND + 1]]);
        let track = le_u64(header, H_TRACK);
        (kind == KIND_DATA
            && le_u32(header, H_DATA_BYTES) as usize == TRACK_BYTES
            && track < self.tracks
            && le_u64(header, H_VOLUME) == self.volume_id)
            .then(|| (le_u64(header, H_SEQ), track))
    }

    fn validate(&self, rec: &[u8]) -> Option<(u64, u64)> {
        let header = &rec[..SLOT_HEADER_BYTES];
        if le_u32(header, H_MAGIC) != SLOT_MAGIC || le_u32(header, H_CRC) != crc(&header[..H_CRC]) {
            return None;
        }
        let kind = u16::from_le_bytes([header[H_KIND], header[H_KIND + 1]]);
        let data_bytes = le_u32(header, H_DATA_BYTES) as usize;
        let track = le_u64(header, H_TRACK);
        if kind != KIND_DATA
            || data_bytes != TRACK_BYTES
            || track >= self.tracks
            || le_u64(header, H_VOLUME) != self.volume_id
        {
            return None;
        }
        let data = &rec[SLOT_HEADER_BYTES..SLOT_HEADER_BYTES + data_bytes];
        (crc(data) == le_u32(header, H_DATA_CRC)).then(|| (le_u64(header, H_SEQ), track))
    }

    /// Slots in the NVS.
    pub fn slot_count(&self) -> u32 {
        self.slot_count
    }

    /// Free slots now.
    pub fn free_slots(&self) -> u32 {
        self.free.lock().slots.len() as u32
    }

    /// Reserve `n` free slots, waiting (at most `timeout`) for destage to
    /// free some. Callers must not be tasks that destage depends on.
    pub fn reserve(&self, n: u32, timeout: Duration) -> Result<Vec<u32>, NvsError> {
        assert!(
            n <= self.slot_count / 2,
            "reservation larger than half the NVS"
        );
        // The clock is read only once the slots are not there at once.
        let mut deadline = None;
        let mut free = self.free.lock();
        loop {
            if self.closing.load(Ordering::SeqCst) {
                return Err(NvsError::ShuttingDown);
            }
            if free.slots.len() >= n as usize {
                let at = free.slots.len() - n as usize;
                let top = free.slots[at..].iter().copied().max().unwrap_or(0);
                let hwm = self.high_water();
                if top >= hwm {
                    // Persist the new mark before the slot can hold a record.
                    let new = (top / SEGMENT_SLOTS + 1) * SEGMENT_SLOTS;
                    self.write_high_water(new.min(self.slot_count))
                        .map_err(|source| NvsError::Io {
                            path: self.path.clone(),
                            source,
                        })?;
                    self.high_water
                        .store(new.min(self.slot_count), Ordering::SeqCst);
                }
                return Ok(free.slots.split_off(at));
            }
            crate::blocking::about_to_block();
            // A release wakes one waiter per slot: a wake-up taken by a
            // larger reservation that could not use it is made up for by
            // looking again every RESERVE_RECHECK.
            let now = Instant::now();
            let deadline = *deadline.get_or_insert(now + timeout);
            if now >= deadline {
                return Err(NvsError::Timeout(timeout));
            }
            self.space
                .wait_until(&mut free, deadline.min(now + RESERVE_RECHECK));
        }
    }

    /// Allocate `n` consecutive sequence numbers; returns the first.
    pub fn next_seqs(&self, n: u64) -> u64 {
        self.next_seq.fetch_add(n, Ordering::SeqCst)
    }

    /// The highest sequence number handed out so far.
    pub fn last_seq(&self) -> u64 {
        self.next_seq.load(Ordering::SeqCst) - 1
    }

    /// Write a data record for `track` into the reserved `slot`.
    pub fn write_record(&self, slot: u32, seq: u64, track: u64, data: &[u8]) {
        assert_eq!(data.len(), TRACK_BYTES, "a record holds exactly one track");
        assert!(track < self.tracks, "track {track} past the volume");
        let (seg, at) = Self::locate(slot);
        let mut map = self.segments[seg].lock();
        let rec = &mut map[at..at + SLOT_BYTES];
        rec[SLOT_HEADER_BYTES..].copy_from_slice(data);
        let mut h = [0u8; SLOT_HEADER_BYTES];
        h[H_MAGIC..H_MAGIC + 4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        h[H_KIND..H_KIND + 2].copy_from_slice(&KIND_DATA.to_le_bytes());
        h[H_SEQ..H_SEQ + 8].copy_from_slice(&seq.to_le_bytes());
        h[H_TRACK..H_TRACK + 8].copy_from_slice(&track.to_le_bytes());
        h[H_DATA_BYTES..H_DATA_BYTES + 4].copy_from_slice(&(TRACK_BYTES as u32).to_le_bytes());
        h[H_DATA_CRC..H_DATA_CRC + 4].copy_from_slice(&crc(data).to_le_bytes());
        h[H_VOLUME..H_VOLUME + 8].copy_from_slice(&self.volume_id.to_le_bytes());
        let hc = crc(&h[..H_CRC]);
        h[H_CRC..H_CRC + 4].copy_from_slice(&hc.to_le_bytes());
        rec[4..SLOT_HEADER_BYTES].copy_from_slice(&h[4..]);
        // The magic goes last: everything before it is in place first.
        fence(Ordering::Release);
        rec[H_MAGIC..H_MAGIC + 4].copy_from_slice(&h[H_MAGIC..H_MAGIC + 4]);
    }

    /// Copy the data of the record in `slot` into `out`, checking it is the
    /// record of `track` with `seq` and that its checksums hold.
    pub fn read_record(
        &self,
        slot: u32,
        track: u64,
        seq: u64,
        out: &mut [u8],
    ) -> Result<(), NvsError> {
        self.with_record(slot, track, seq, |data| out.copy_from_slice(data))
    }

    /// [`Nvs::read_record`] into a new buffer (a destage's: copied once,
    /// never zeroed first).
    pub fn record_data(&self, slot: u32, track: u64, seq: u64) -> Result<Vec<u8>, NvsError> {
        self.with_record(slot, track, seq, <[u8]>::to_vec)
    }

    /// `f` of the data of the record in `slot`, under its segment's lock,
    /// once it is checked to be the record (`track`, `seq`), whole.
    fn with_record<R>(
        &self,
        slot: u32,
        track: u64,
        seq: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, NvsError> {
        let (seg, at) = Self::locate(slot);
        let map = self.segments[seg].lock();
        let rec = &map[at..at + SLOT_BYTES];
        self.check_record(rec, slot, track, seq)?;
        Ok(f(&rec[SLOT_HEADER_BYTES..]))
    }

    /// Whether `rec` (slot `slot`) holds the record (`track`, `seq`), whole.
    fn check_record(&self, rec: &[u8], slot: u32, track: u64, seq: u64) -> Result<(), NvsError> {
        let corrupt = |reason| NvsError::Corrupt { slot, reason };
        let Some((s, t)) = self.validate_header(&rec[..SLOT_HEADER_BYTES]) else {
            return Err(corrupt("checksum or header mismatch"));
        };
        if (s, t) != (seq, track) {
            return Err(corrupt("the slot holds another record"));
        }
        if crc(&rec[SLOT_HEADER_BYTES..]) != le_u32(rec, H_DATA_CRC) {
            return Err(NvsError::Damaged { slot, track, seq });
        }
        Ok(())
    }

    /// Check the record in `slot` as [`Nvs::read_record`] does, without
    /// copying its data out (the scrub).
    pub fn verify_record(&self, slot: u32, track: u64, seq: u64) -> Result<(), NvsError> {
        self.with_record(slot, track, seq, |_| ())
    }

    /// Repair the damaged data of the record (`track`, `seq`) in `slot`
    /// from `copy`, a copy of the data it was written with: written only if
    /// the header still names that record and `copy` matches the data
    /// checksum in the header (so the record becomes exactly what was
    /// written; its header is not touched). Whether the record is whole.
    pub fn repair_record(&self, slot: u32, track: u64, seq: u64, copy: &[u8]) -> bool {
        assert_eq!(copy.len(), TRACK_BYTES, "a record holds one track");
        let (seg, at) = Self::locate(slot);
        let mut map = self.segments[seg].lock();
        let rec = &mut map[at..at + SLOT_BYTES];
        if self.validate_header(&rec[..SLOT_HEADER_BYTES]) != Some((seq, track))
            || crc(copy) != le_u32(rec, H_DATA_CRC)
        {
            return false;
        }
        rec[SLOT_HEADER_BYTES..].copy_from_slice(copy);
        true
    }

    /// Free slots (their records are destaged or superseded).
    pub fn free(&self, slots: &[u32]) {
        if slots.is_empty() {
            return;
        }
        for &slot in slots {
            self.invalidate(slot);
        }
        self.release(slots);
    }

    /// Make the record in `slot` invisible to a scan (its magic is
    /// cleared; the rest stays), without giving the slot back. The cache
    /// directory invalidates a record under the track's lock at the moment
    /// it stops naming it, so a record can never outlive a newer one of the
    /// same track in the NVS: otherwise a hard restart could replay the
    /// older record over a newer write already destaged and freed.
    pub fn invalidate(&self, slot: u32) {
        let (seg, at) = Self::locate(slot);
        let mut map = self.segments[seg].lock();
        map[at + H_MAGIC..at + H_MAGIC + 4].copy_from_slice(&0u32.to_le_bytes());
    }

    /// Undo [`Nvs::invalidate`] of a record whose slot was not given back
    /// in between (a rolled-back write puts the record it superseded back).
    pub fn revalidate(&self, slot: u32) {
        let (seg, at) = Self::locate(slot);
        let mut map = self.segments[seg].lock();
        map[at + H_MAGIC..at + H_MAGIC + 4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
    }

    /// Return reserved but unwritten slots to the free list.
    pub fn release(&self, slots: &[u32]) {
        if slots.is_empty() {
            return;
        }
        let mut free = self.free.lock();
        debug_assert!(free.slots.len() + slots.len() <= self.slot_count as usize);
        free.slots.extend_from_slice(slots);
        drop(free);
        // At most one waiter per slot given back (a reservation takes at
        // least one). Waking every waiter on every release made a full NVS
        // cost more in futex calls than in destaging: with 8 clients x 256
        // writes in flight, 32 connection threads woke per destaged track.
        for _ in 0..slots.len() {
            if !self.space.notify_one() {
                break;
            }
            self.woken.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Reservations waiting for space that releases have woken so far.
    pub fn waiters_woken(&self) -> u64 {
        self.woken.load(Ordering::Relaxed)
    }

    /// `msync` the whole NVS, then `fdatasync` the file for the superblock
    /// (written with `pwrite`, outside the mappings): every record and the
    /// high-water mark above them are then durable (for a file on
    /// persistent storage).
    ///
    /// A failed sync dirties every page below the high-water mark again
    /// before it answers: Linux may mark pages clean after a failed
    /// writeback and report the error once, so the next sync would
    /// succeed without writing records written before this one (a FLUSH
    /// answered `Ok` for writes an earlier FLUSH answered `EIO` for).
    pub fn sync(&self) -> Result<(), NvsError> {
        self.sync_once().map_err(|source| {
            self.redirty();
            NvsError::Io {
                path: self.path.clone(),
                source,
            }
        })
    }

    fn sync_once(&self) -> io::Result<()> {
        #[cfg(test)]
        if self.fail_next_sync.swap(false, Ordering::AcqRel) {
            return Err(io::Error::from_raw_os_error(5));
        }
        for segment in self.segments.iter() {
            segment.lock().flush()?;
        }
        self._file.sync_data()
    }

    /// Store one byte of every page of every segment below the high-water
    /// mark again (under the segment's lock, so no record changes under
    /// it), so that the next `msync` writes every page whatever a failed
    /// writeback left of their dirty state. The superblock needs none: its
    /// mark is written and synced before it is used, and written again
    /// (with `pwrite`, which dirties the page) at the next raise.
    fn redirty(&self) {
        const PAGE: usize = 4096;
        let segments = self.high_water().div_ceil(SEGMENT_SLOTS) as usize;
        for segment in &self.segments[..segments] {
            let mut map = segment.lock();
            for at in (0..map.len()).step_by(PAGE) {
                let byte: *mut u8 = &mut map[at];
                // SAFETY: `byte` comes from a live `&mut` into the
                // mapping (held under the segment's lock, so nothing else
                // reads or writes it meanwhile); volatile, so that the
                // store of the value just read is not elided: the store
                // itself is the point (it faults on a cleaned page and
                // dirties it).
                unsafe { byte.write_volatile(byte.read_volatile()) };
            }
        }
    }

    /// Refuse further reservations and wake every waiter.
    pub fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _guard = self.free.lock();
        self.space.notify_all();
    }

    /// The NVS file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Corrupt one byte of a slot (fault injection and tests: "a record
    /// failing its checksum").
    pub fn damage_slot(&self, slot: u32, byte: usize) {
        let (seg, at) = Self::locate(slot);
        let mut map = self.segments[seg].lock();
        map[at + byte % SLOT_BYTES] ^= 0x5a;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 2 << 20;

    fn open(dir: &Path) -> (Nvs, ScanReport) {
        let (nvs, fresh) = Nvs::open_or_create(&dir.join("nvs"), SIZE, 42, 1000).unwrap();
        let report = if fresh {
            ScanReport::default()
        } else {
            nvs.scan()
        };
        (nvs, report)
    }

    #[test]
    fn records_survive_reopen_and_the_scan_finds_them() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, report) = open(dir.path());
        assert!(report.records.is_empty());
        let total = nvs.slot_count();
        let slots = nvs.reserve(3, Duration::from_secs(1)).unwrap();
        for (i, &s) in slots.iter().enumerate() {
            nvs.write_record(s, 10 + i as u64, i as u64, &[i as u8 + 1; TRACK_BYTES]);
        }
        nvs.free(&slots[2..]);
        drop(nvs);
        let (nvs, report) = open(dir.path());
        let mut found: Vec<_> = report.records.iter().map(|r| (r.track, r.seq)).collect();
        found.sort();
        assert_eq!(found, [(0, 10), (1, 11)]);
        assert_eq!(nvs.free_slots(), total - 2);
        assert_eq!(
            nvs.next_seqs(1),
            12,
            "sequence numbers continue after the newest"
        );
        let mut out = vec![0u8; TRACK_BYTES];
        let r = report.records.iter().find(|r| r.track == 1).unwrap();
        nvs.read_record(r.slot, 1, 11, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 2));
        assert!(nvs.read_record(r.slot, 1, 99, &mut out).is_err());
    }

    #[test]
    fn damaged_data_is_repaired_only_from_an_exact_copy() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(1, Duration::from_secs(1)).unwrap();
        nvs.write_record(slots[0], 4, 2, &[6; TRACK_BYTES]);
        nvs.verify_record(slots[0], 2, 4).unwrap();
        nvs.damage_slot(slots[0], SLOT_HEADER_BYTES + 7);
        assert!(matches!(
            nvs.verify_record(slots[0], 2, 4),
            Err(NvsError::Damaged {
                track: 2,
                seq: 4,
                ..
            })
        ));
        assert!(matches!(
            nvs.verify_record(slots[0], 2, 5),
            Err(NvsError::Corrupt { .. })
        ));
        // Another record's name, or data that is not what was written: no.
        assert!(!nvs.repair_record(slots[0], 2, 5, &[6; TRACK_BYTES]));
        assert!(!nvs.repair_record(slots[0], 2, 4, &[7; TRACK_BYTES]));
        assert!(nvs.verify_record(slots[0], 2, 4).is_err());
        assert!(nvs.repair_record(slots[0], 2, 4, &[6; TRACK_BYTES]));
        nvs.verify_record(slots[0], 2, 4).unwrap();
        let mut out = vec![0u8; TRACK_BYTES];
        nvs.read_record(slots[0], 2, 4, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 6));
    }

    #[test]
    fn a_damaged_header_reads_as_corrupt_not_as_damaged_data() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(1, Duration::from_secs(1)).unwrap();
        nvs.write_record(slots[0], 3, 9, &[1; TRACK_BYTES]);
        nvs.damage_slot(slots[0], H_SEQ);
        let mut out = vec![0u8; TRACK_BYTES];
        // Without an intact header nothing says which record the slot held:
        // the directory may be what is wrong.
        assert!(matches!(
            nvs.read_record(slots[0], 9, 3, &mut out),
            Err(NvsError::Corrupt { .. })
        ));
    }

    #[test]
    fn the_high_water_mark_is_persisted_before_slots_above_it_are_used() {
        let dir = tempfile::tempdir().unwrap();
        let open = |dir: &Path| {
            let (nvs, fresh) = Nvs::open_or_create(&dir.join("nvs"), 8 << 20, 42, 1000).unwrap();
            let report = if fresh {
                ScanReport::default()
            } else {
                nvs.scan()
            };
            (nvs, report)
        };
        let (nvs, _) = open(dir.path());
        assert_eq!(nvs.high_water(), 0, "a new NVS has held nothing");
        // Take a whole segment and one more slot: the mark covers both.
        let first = nvs
            .reserve(SEGMENT_SLOTS / 2, Duration::from_secs(1))
            .unwrap();
        assert_eq!(
            nvs.high_water(),
            SEGMENT_SLOTS,
            "lowest slots first, one segment marked"
        );
        let second = nvs
            .reserve(SEGMENT_SLOTS / 2 + 1, Duration::from_secs(1))
            .unwrap();
        assert_eq!(nvs.high_water(), 2 * SEGMENT_SLOTS);
        let top = *second.iter().max().unwrap();
        assert_eq!(top, SEGMENT_SLOTS, "slots are handed out lowest first");
        nvs.write_record(top, 7, 3, &[9; TRACK_BYTES]);
        nvs.release(&first);
        drop(nvs);
        // Reopen: the scan reads only below the mark and finds the record.
        let (nvs, report) = open(dir.path());
        assert_eq!(nvs.high_water(), 2 * SEGMENT_SLOTS);
        assert_eq!(report.records.len(), 1);
        assert_eq!(report.records[0].slot, top);
        drop(nvs);
        // A damaged mark is distrusted: the whole NVS is scanned.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("nvs"))
            .unwrap();
        f.write_all_at(&[0xff], 44).unwrap();
        drop(f);
        let (nvs, report) = open(dir.path());
        assert_eq!(nvs.high_water(), nvs.slot_count());
        assert_eq!(report.records.len(), 1, "still found");
    }

    #[test]
    fn a_raised_high_water_mark_is_on_the_file_at_once_and_sync_succeeds_on_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(1, Duration::from_secs(1)).unwrap();
        assert_eq!(nvs.high_water(), SEGMENT_SLOTS);
        // Read through another handle while the NVS is open: the mark is
        // in the file as soon as it is raised, not at close.
        let other = File::open(dir.path().join("nvs")).unwrap();
        assert_eq!(
            Nvs::read_high_water(&other, nvs.slot_count()),
            SEGMENT_SLOTS,
            "the raised mark is written before the slot is handed out"
        );
        nvs.write_record(slots[0], 5, 1, &[3; TRACK_BYTES]);
        nvs.sync()
            .expect("msync and fdatasync of a file-backed NVS");
        drop(nvs);
        let (nvs, report) = open(dir.path());
        assert_eq!(nvs.high_water(), SEGMENT_SLOTS, "a fresh open reads it");
        assert_eq!(report.records.len(), 1);
    }

    #[test]
    fn a_failed_sync_dirties_every_page_below_the_high_water_mark_again_for_the_next() {
        use crate::files::pagecache::{disk_tempdir, pages_dirty};
        let dir = disk_tempdir();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(2, Duration::from_secs(1)).unwrap();
        nvs.write_record(slots[0], 5, 1, &[3; TRACK_BYTES]);
        nvs.write_record(slots[1], 6, 2, &[4; TRACK_BYTES]);
        nvs.sync().unwrap();
        let (seg, at) = Nvs::locate(slots[0].min(slots[1]));
        assert_eq!((seg, at), (0, 0), "the lowest slots first");
        let dirty = |bytes: std::ops::Range<usize>| pages_dirty(&nvs.segments[0].lock()[bytes]);
        assert!(
            dirty(0..2 * SLOT_BYTES).iter().all(|d| !d),
            "after a successful sync no page of the records is dirty"
        );
        // The kernel may have cleaned the pages in a failed writeback:
        // the next sync must still write them.
        nvs.fail_next_sync.store(true, Ordering::Release);
        let e = nvs.sync().unwrap_err();
        assert!(matches!(e, NvsError::Io { .. }), "{e}");
        let segment = 0..SEGMENT_SLOTS as usize * SLOT_BYTES;
        let clean = dirty(segment.clone()).iter().filter(|&&d| !d).count();
        assert_eq!(
            clean, 0,
            "every page of the segment below the mark dirty again"
        );
        nvs.sync().unwrap();
        assert!(dirty(segment).iter().all(|d| !d), "written");
        drop(nvs);
        let (_, report) = open(dir.path());
        assert_eq!(report.records.len(), 2);
    }

    #[test]
    fn the_scan_reports_progress_per_segment_up_to_the_high_water_mark() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = Nvs::open_or_create(&dir.path().join("nvs"), 8 << 20, 42, 1000).unwrap();
        let slots = nvs
            .reserve(SEGMENT_SLOTS + 1, Duration::from_secs(1))
            .unwrap();
        nvs.release(&slots);
        let mut calls = Vec::new();
        nvs.scan_with_progress(&mut |read, total| calls.push((read, total)));
        let segments = nvs.slot_count().div_ceil(SEGMENT_SLOTS) as usize;
        assert_eq!(calls.len(), segments, "one report per segment");
        assert!(calls.iter().all(|&(_, t)| t == 2 * SEGMENT_SLOTS));
        assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "monotonic");
        assert_eq!(calls[0], (SEGMENT_SLOTS, 2 * SEGMENT_SLOTS));
        assert_eq!(
            *calls.last().unwrap(),
            (2 * SEGMENT_SLOTS, 2 * SEGMENT_SLOTS)
        );
    }

    #[test]
    fn the_scan_discards_a_damaged_header_but_keeps_damaged_data_that_reads_refuse() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(3, Duration::from_secs(1)).unwrap();
        nvs.write_record(slots[0], 1, 5, &[7; TRACK_BYTES]);
        nvs.write_record(slots[1], 2, 6, &[8; TRACK_BYTES]);
        nvs.write_record(slots[2], 3, 7, &[9; TRACK_BYTES]);
        nvs.damage_slot(slots[0], SLOT_HEADER_BYTES + 100);
        nvs.damage_slot(slots[2], H_TRACK);
        let mut out = vec![0u8; TRACK_BYTES];
        // The header still names the record: its data is what is damaged.
        assert!(matches!(
            nvs.read_record(slots[0], 5, 1, &mut out),
            Err(NvsError::Damaged {
                track: 5,
                seq: 1,
                ..
            })
        ));
        // Asked for another record, the slot answers that it holds another.
        assert!(matches!(
            nvs.read_record(slots[0], 5, 2, &mut out),
            Err(NvsError::Corrupt { .. })
        ));
        drop(nvs);
        let (nvs, report) = open(dir.path());
        // Slot 2's header is damaged: nothing says what it held; freed.
        assert_eq!(report.discarded, 1);
        // Slot 0's data is damaged: kept, so that an older copy never
        // stands in for it, and still refused when read.
        assert_eq!(report.damaged, 1);
        let mut found: Vec<_> = report.records.iter().map(|r| (r.track, r.seq)).collect();
        found.sort();
        assert_eq!(found, [(5, 1), (6, 2)]);
        assert!(matches!(
            nvs.read_record(slots[0], 5, 1, &mut out),
            Err(NvsError::Damaged {
                track: 5,
                seq: 1,
                ..
            })
        ));
        nvs.read_record(slots[1], 6, 2, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 8));
    }

    #[test]
    fn a_foreign_truncated_or_garbage_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvs");
        drop(Nvs::open_or_create(&path, SIZE, 42, 1000).unwrap());
        let e = Nvs::open_or_create(&path, SIZE, 43, 1000).unwrap_err();
        assert!(matches!(e, NvsError::Foreign { .. }), "{e}");
        let e = Nvs::open_or_create(&path, SIZE * 2, 42, 1000).unwrap_err();
        assert!(e.to_string().contains("nvs_size"), "{e}");
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(8192).unwrap();
        let e = Nvs::open_or_create(&path, SIZE, 42, 1000).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        std::fs::write(&path, b"hello world, not an nvs").unwrap();
        let e = Nvs::open_or_create(&path, SIZE, 42, 1000).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        std::fs::write(&path, vec![b'x'; 8192]).unwrap();
        let e = Nvs::open_or_create(&path, SIZE, 42, 1000).unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let mut sb = encode_superblock(slots_for(SIZE), 42).to_vec();
        sb[20] ^= 1;
        sb.resize(8192, 0);
        std::fs::write(&path, &sb).unwrap();
        let e = Nvs::open_or_create(&path, SIZE, 42, 1000).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }

    #[test]
    fn adopting_keeps_the_named_records_and_frees_every_other_slot() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let slots = nvs.reserve(3, Duration::from_secs(1)).unwrap();
        for (i, &s) in slots.iter().enumerate() {
            nvs.write_record(s, 10 + i as u64, i as u64, &[1; TRACK_BYTES]);
        }
        drop(nvs);
        let (nvs, fresh) = Nvs::open_or_create(&dir.path().join("nvs"), SIZE, 42, 1000).unwrap();
        assert!(!fresh);
        let keep = [ScannedRecord {
            slot: slots[1],
            seq: 11,
            track: 1,
        }];
        // A wrong reference is refused.
        let wrong = [ScannedRecord {
            slot: slots[1],
            seq: 12,
            track: 1,
        }];
        assert!(nvs.adopt(&wrong, 100).is_err());
        nvs.adopt(&keep, 100).unwrap();
        assert_eq!(nvs.free_slots(), nvs.slot_count() - 1);
        assert_eq!(nvs.next_seqs(1), 100);
        drop(nvs);
        // The unreferenced records are gone for a later hard restart too.
        let (_, report) = open(dir.path());
        assert_eq!(report.records, keep);
    }

    #[test]
    fn a_second_opener_is_refused_while_the_first_holds_the_nvs() {
        let dir = tempfile::tempdir().unwrap();
        let (_nvs, _) = open(dir.path());
        let e = Nvs::open_or_create(&dir.path().join("nvs"), SIZE, 42, 1000).unwrap_err();
        assert!(matches!(e, NvsError::Locked(_)), "{e}");
    }

    #[test]
    fn reservation_waits_for_space_then_times_out_or_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, _) = open(dir.path());
        let nvs = std::sync::Arc::new(nvs);
        let half = nvs.slot_count() / 2;
        let a = nvs.reserve(half, Duration::from_secs(1)).unwrap();
        let b = nvs.reserve(half, Duration::from_secs(1)).unwrap();
        assert!(matches!(
            nvs.reserve(1, Duration::from_millis(20)),
            Err(NvsError::Timeout(_))
        ));
        let n2 = std::sync::Arc::clone(&nvs);
        let waiter = std::thread::spawn(move || n2.reserve(4, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        nvs.release(&a[..4]);
        assert_eq!(waiter.join().unwrap().unwrap().len(), 4);
        nvs.close();
        assert!(matches!(
            nvs.reserve(1, Duration::from_secs(1)),
            Err(NvsError::ShuttingDown)
        ));
        drop(b);
    }

    /// A new NVS with every slot reserved (the slots returned).
    fn full(dir: &Path) -> (std::sync::Arc<Nvs>, Vec<u32>) {
        let (nvs, _) = open(dir);
        let half = nvs.slot_count() / 2;
        let mut all = nvs.reserve(half, Duration::from_secs(1)).unwrap();
        all.extend(nvs.reserve(half, Duration::from_secs(1)).unwrap());
        let rest = nvs.slot_count() - 2 * half;
        if rest > 0 {
            all.extend(nvs.reserve(rest, Duration::from_secs(1)).unwrap());
        }
        assert_eq!(nvs.free_slots(), 0);
        (std::sync::Arc::new(nvs), all)
    }

    /// Spawn `n` reservations of `each` slots on a full NVS and wait until
    /// all of them are waiting.
    fn waiters(
        nvs: &std::sync::Arc<Nvs>,
        n: usize,
        each: u32,
    ) -> Vec<std::thread::JoinHandle<Result<Vec<u32>, NvsError>>> {
        let handles = (0..n)
            .map(|_| {
                let nvs = std::sync::Arc::clone(nvs);
                std::thread::spawn(move || nvs.reserve(each, Duration::from_secs(10)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        handles
    }

    #[test]
    fn a_release_wakes_one_waiter_per_slot_it_gives_back_not_every_waiter() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, all) = full(dir.path());
        let waiting = waiters(&nvs, 8, 1);
        nvs.release(&all[..1]);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            nvs.waiters_woken(),
            1,
            "one slot given back wakes one of the 8 waiting reservations"
        );
        nvs.release(&all[1..8]);
        let got: usize = waiting
            .into_iter()
            .map(|h| h.join().unwrap().expect("every waiter gets its slot").len())
            .sum();
        assert_eq!(got, 8);
        assert!(nvs.waiters_woken() <= 8, "{} woken", nvs.waiters_woken());
    }

    #[test]
    fn a_waiter_the_wake_ups_missed_still_gets_a_slot_that_is_free() {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, all) = full(dir.path());
        // Waiting in this order: a reservation of 3, then two of 1 each.
        let spawn = |n: u32, timeout: Duration| {
            let nvs = std::sync::Arc::clone(&nvs);
            let h = std::thread::spawn(move || nvs.reserve(n, timeout));
            std::thread::sleep(Duration::from_millis(30));
            h
        };
        let large = spawn(3, Duration::from_secs(10));
        let small = [
            spawn(1, Duration::from_secs(10)),
            spawn(1, Duration::from_secs(10)),
        ];
        // Two slots back: two wake-ups, the first to the reservation of 3
        // (which cannot use them and waits on), the second to one of 1.
        // The other reservation of 1 is woken by no one, yet a slot is free.
        let released = Instant::now();
        nvs.release(&all[..2]);
        for h in small {
            let got = h.join().unwrap().expect("a free slot reaches every waiter");
            assert_eq!(got.len(), 1);
        }
        // Not at its time-out: within a few looks again.
        let waited = released.elapsed();
        assert!(waited < Duration::from_secs(1), "waited {waited:?}");
        nvs.release(&all[2..5]);
        assert_eq!(large.join().unwrap().unwrap().len(), 3);
        assert_eq!(nvs.free_slots(), 0);
    }
}
