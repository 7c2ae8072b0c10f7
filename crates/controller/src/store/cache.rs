//! The cache: directory of tracks and read cache (CLOCK eviction).
//!
//! The directory maps a track to its state: a cached copy (a *frame*, a
//! control block from a bounded pool), and/or a dirty record in the NVS
//! (slot, sequence number), and whether a destage of it is in flight. Dirty
//! data is authoritative in the NVS; a frame is only a copy, so any frame can
//! be evicted and a dirty track without a frame is read from its NVS record.
//!
//! Eviction is CLOCK (second chance) per shard: a hit sets the frame's
//! reference bit; the hand clears bits until it finds an unreferenced frame.
//! For this workload (random 4 KiB I/O) CLOCK keeps LRU's hit ratio without
//! LRU's list update on every hit under the lock.
//!
//! Every frame carries a check word (the papers' "LRC") over its identity;
//! a hit verifies it, and a frame that fails is dropped and its track read
//! again from the NVS or the device (the micro-recovery for a corrupt
//! control block).
//!
//! Each shard's lock is also a Log(Lock) tracked structure (paper §4):
//! while a `cache.apply` task tracks a shard, every access to it by any
//! thread is recorded in the shard's change-track log (reads as R, changes
//! as W), so if the task fails part-way its restoration level says whether
//! it may undo its own changes ([`Cache::undo_apply`]) or must escalate.
//!
//! # Invariants (per track, under its shard lock)
//!
//! - `dirty.seq` only grows; a write older than the current dirty record is
//!   discarded (its slot freed), never applied.
//! - At most one destage of a track is in flight; a destage never writes a
//!   record older than one already destaged.
//! - A slot is freed exactly once: when superseded (if no destage holds it)
//!   or when its destage ends.
//! - A staged (device) read is installed only if nothing changed in the
//!   shard since the miss (epoch check), so a stale read never hides a newer
//!   write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use crate::limits::{CACHE_SHARDS, TRACK_BYTES};
use crate::store::nvs::{Nvs, NvsError};

const NO_FRAME: u32 = u32::MAX;
/// "No journal record" handle.
pub const NO_HANDLE: u32 = u32::MAX;

/// Where the directory's dirty entries are kept current for a fast restart
/// (the recovery box). Called under the track's shard lock, so the journal
/// sees a track's changes in the order the directory makes them, and before
/// the write they describe is acknowledged.
pub trait DirtyJournal: Send + Sync + std::fmt::Debug {
    /// `track` is dirty with record `d`; `handle` is its current journal
    /// record ([`NO_HANDLE`] if none). Returns the record's handle
    /// ([`NO_HANDLE`] if the journal failed and stopped keeping records).
    fn record(&self, track: u64, d: Dirty, handle: u32) -> u32;
    /// `track` is clean: drop its record.
    fn forget(&self, handle: u32);
}
const EMPTY_TRACK: u64 = u64::MAX;

/// A dirty record of a track in the NVS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dirty {
    /// NVS slot.
    pub slot: u32,
    /// Sequence number.
    pub seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    frame: u32,
    dirty: Option<Dirty>,
    destaging: Option<Dirty>,
    queued: bool,
    journal: u32,
}

impl Entry {
    fn new() -> Self {
        Self {
            frame: NO_FRAME,
            dirty: None,
            destaging: None,
            queued: false,
            journal: NO_HANDLE,
        }
    }

    fn is_idle(&self) -> bool {
        self.frame == NO_FRAME && self.dirty.is_none() && self.destaging.is_none()
    }
}

/// A frame's control block; its bytes are its slice of the shard's slab.
struct Frame {
    track: u64,
    referenced: bool,
    lrc: u32,
}

/// Frame `f`'s bytes in a shard's slab.
fn frame_bytes(slab: &[u8], f: u32) -> &[u8] {
    let at = f as usize * TRACK_BYTES;
    &slab[at..at + TRACK_BYTES]
}

fn lrc(track: u64, frame: u32) -> u32 {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&track.to_le_bytes());
    b[8..].copy_from_slice(&frame.to_le_bytes());
    crc32c::crc32c(&b)
}

struct Shard {
    map: FxHashMap<u64, Entry>,
    frames: Vec<Frame>,
    /// Every frame's bytes, one anonymous mapping per shard (zero pages
    /// the kernel gives as they are first touched, whatever the
    /// allocator): creating a large cache costs nothing at start-up (a
    /// restart is on the recovery path), and no frame is allocated on the
    /// I/O path. [`Cache::prefault_step`] maps it in ahead of use.
    slab: memmap2::MmapMut,
    free: Vec<u32>,
    hand: usize,
    epoch: u64,
    dirty: u32,
    /// Tracks whose dirty entry changed since the last checkpoint (rung 3;
    /// kept only when the cache notes changes; duplicates allowed).
    changed: Vec<u64>,
    notes_changes: bool,
    /// Shards with changes noted, one bit each (shared by the cache's
    /// shards): a checkpoint visits only those ([`Cache::take_changes`]).
    changed_shards: Arc<AtomicU64>,
    /// This shard's bit in `changed_shards`.
    bit: u64,
}

/// The dirty entry of `track` changed (for the next checkpoint). A macro
/// rather than a method, so it borrows only the shard's `changed` list
/// while an entry of its map is borrowed.
macro_rules! note {
    ($shard:expr, $track:expr) => {
        if $shard.notes_changes {
            $shard.changed.push($track);
            $shard
                .changed_shards
                .fetch_or($shard.bit, Ordering::Release);
        }
    };
}

impl Shard {
    /// A free frame, evicting by CLOCK if needed.
    fn allocate(&mut self) -> Option<u32> {
        if let Some(f) = self.free.pop() {
            return Some(f);
        }
        let n = self.frames.len();
        for _ in 0..2 * n {
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            let frame = &mut self.frames[i];
            if frame.referenced {
                frame.referenced = false;
                continue;
            }
            let track = frame.track;
            frame.track = EMPTY_TRACK;
            if let Some(e) = self.map.get_mut(&track) {
                e.frame = NO_FRAME;
                if e.is_idle() {
                    self.map.remove(&track);
                }
            }
            return Some(i as u32);
        }
        None
    }

    fn install(&mut self, track: u64, data: &[u8]) -> u32 {
        let e = self.map.get(&track).copied().unwrap_or_else(Entry::new);
        let f = if e.frame != NO_FRAME {
            e.frame
        } else {
            match self.allocate() {
                Some(f) => f,
                None => return NO_FRAME,
            }
        };
        let frame = &mut self.frames[f as usize];
        frame.track = track;
        frame.referenced = true;
        frame.lrc = lrc(track, f);
        let at = f as usize * TRACK_BYTES;
        self.slab[at..at + TRACK_BYTES].copy_from_slice(data);
        self.map.entry(track).or_insert_with(Entry::new).frame = f;
        f
    }

    fn drop_frame(&mut self, track: u64) {
        if let Some(e) = self.map.get_mut(&track)
            && e.frame != NO_FRAME
        {
            let f = e.frame;
            e.frame = NO_FRAME;
            self.frames[f as usize].track = EMPTY_TRACK;
            self.free.push(f);
            if e.is_idle() {
                self.map.remove(&track);
            }
        }
    }
}

/// Where a read found its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A clean or dirty cached copy.
    Hit,
    /// The track's dirty record in the NVS (no cached copy).
    FromNvs,
    /// Not cached: read the device, then [`Cache::install_staged`] with
    /// this epoch.
    Miss {
        /// The shard's epoch at the miss.
        epoch: u64,
    },
}

/// What applying a write did. A slot in `free` holds a record the
/// directory no longer names; it was invalidated in the NVS under the
/// track's lock, and the caller gives it back with [`Nvs::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// A slot that no longer holds needed data (free it).
    pub free: Option<u32>,
    /// The track must be queued for destage.
    pub queue: bool,
}

/// What ending a destage did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Destaged {
    /// The destaged slot, now free to reuse.
    pub free: Option<u32>,
    /// A newer write arrived meanwhile: queue the track again.
    pub queue: bool,
}

/// Cache counters.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Reads served from a frame.
    pub hits: AtomicU64,
    /// Reads served from an NVS record.
    pub nvs_hits: AtomicU64,
    /// Reads that went to a device.
    pub misses: AtomicU64,
    /// Frames that failed their check word and were rebuilt.
    pub frames_rebuilt: AtomicU64,
}

/// How an operation uses a shard, for Log(Lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Reads directory entries (a dirty read if it reads a tracker's change).
    Read,
    /// Changes directory entries or frames.
    Write,
    /// Aggregates only (counts, lists for FLUSH): not an access to any
    /// entry's value.
    Quiet,
}

/// A shard's lock, and Log(Lock)'s view of it: every access under the
/// shard lock also takes `accesses` (a read reads it, a change bumps it)
/// while some actor tracks the shard, so the shard's change-track log sees
/// every access in lock order. Untracked, this costs one relaxed load.
struct ShardLock {
    shard: Mutex<Shard>,
    accesses: loglock::TrackedMutex<u64>,
}

impl ShardLock {
    #[inline]
    fn lock(&self, how: Use) -> parking_lot::MutexGuard<'_, Shard> {
        let guard = self.shard.lock();
        // Tracking starts under the shard lock (see `apply_write_tracked`),
        // so this load cannot miss an access that must be recorded.
        if how != Use::Quiet && self.accesses.core().is_tracked() {
            let mut a = self.accesses.lock();
            if how == Use::Write {
                *a += 1;
            } else {
                let _ = *a;
            }
        }
        guard
    }
}

/// What undoing one applied track needs (the directory entry before).
#[derive(Debug, Clone, Copy)]
pub struct ApplyUndo {
    track: u64,
    before: Option<Dirty>,
    queued: bool,
    applied: Dirty,
    /// The superseded record this apply invalidated (put back on undo).
    retired: Option<u32>,
}

/// A range fenced against destage while it is zeroed (TRIM, WRITE_ZEROES).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ZeroFence {
    first: u64,
    end: u64,
    /// Names this fence; a rung 3 or 4 rebuild drops every fence, so the
    /// request that set it asks by name whether it still holds it.
    id: u64,
}

/// The cache.
pub struct Cache {
    shards: Box<[CachePadded<ShardLock>]>,
    /// Shards with changes noted since the last [`Cache::take_changes`],
    /// a bit each (shared with the shards, which set their bits).
    changed_shards: Arc<AtomicU64>,
    zeroing: RwLock<Vec<ZeroFence>>,
    /// The next [`ZeroFence::id`].
    next_fence: std::sync::atomic::AtomicU64,
    stats: CacheStats,
    frames: usize,
    journal: Option<Arc<dyn DirtyJournal>>,
    /// Told of every frame rebuilt after failing its check word (rung 1).
    rebuild_hook: std::sync::OnceLock<RebuildHook>,
    /// Each shard's slab, as (address, length), for
    /// [`Cache::prefault_step`], which must not take the shard's lock.
    slabs: Box<[(usize, usize)]>,
}

/// Bytes of the cache's memory one [`Cache::prefault_step`] maps in (64
/// pages: about 0.1 ms on an idle core here), so the thread doing it
/// holds the process's memory map (read-locked by the kernel for the
/// call) only briefly, and can stop between steps.
pub const PREFAULT_STEP_BYTES: usize = 256 << 10;

/// Called with the track whose frame failed its check word and was dropped
/// to be rebuilt from its NVS record or the device.
pub type RebuildHook = Box<dyn Fn(u64) + Send + Sync>;

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("frames", &self.frames)
            .finish()
    }
}

fn shard_of(track: u64) -> usize {
    (track as usize) & (CACHE_SHARDS - 1)
}

impl Cache {
    /// A cache of `frames` frames (at least one per shard), keeping its dirty
    /// entries in `journal` if given.
    pub fn new(frames: usize, journal: Option<Arc<dyn DirtyJournal>>) -> Self {
        Self::with_checkpoints(frames, journal, false)
    }

    /// [`Cache::new`], noting every change of a dirty entry when
    /// `checkpoints` (rung 3's incremental checkpoints, [`Cache::take_changes`]).
    pub fn with_checkpoints(
        frames: usize,
        journal: Option<Arc<dyn DirtyJournal>>,
        checkpoints: bool,
    ) -> Self {
        let per_shard = frames.div_ceil(CACHE_SHARDS).max(1);
        const { assert!(CACHE_SHARDS <= 64, "one bit per shard in a u64") };
        let changed_shards = Arc::new(AtomicU64::new(0));
        let slab_bytes = per_shard * TRACK_BYTES;
        let mut slabs = Vec::with_capacity(CACHE_SHARDS);
        let shards = (0..CACHE_SHARDS)
            .map(|i| {
                // Address space only: the kernel gives zero pages as they
                // are touched. Failing here is failing to allocate.
                let mut slab = memmap2::MmapMut::map_anon(slab_bytes)
                    .unwrap_or_else(|e| panic!("mapping {slab_bytes} bytes of cache: {e}"));
                slabs.push((slab.as_mut_ptr() as usize, slab.len()));
                CachePadded::new(ShardLock {
                    accesses: loglock::TrackedMutex::new("cache shard", 0),
                    shard: Mutex::new(Shard {
                        map: FxHashMap::default(),
                        frames: (0..per_shard)
                            .map(|_| Frame {
                                track: EMPTY_TRACK,
                                referenced: false,
                                lrc: 0,
                            })
                            .collect(),
                        slab,
                        free: (0..per_shard as u32).rev().collect(),
                        hand: 0,
                        epoch: 0,
                        dirty: 0,
                        changed: Vec::new(),
                        notes_changes: checkpoints,
                        changed_shards: Arc::clone(&changed_shards),
                        bit: 1 << i,
                    }),
                })
            })
            .collect();
        Self {
            shards,
            changed_shards,
            zeroing: RwLock::new(Vec::new()),
            next_fence: std::sync::atomic::AtomicU64::new(1),
            stats: CacheStats::default(),
            frames: per_shard * CACHE_SHARDS,
            journal,
            rebuild_hook: std::sync::OnceLock::new(),
            slabs: slabs.into_boxed_slice(),
        }
    }

    /// How many [`Cache::prefault_step`]s map in the whole cache.
    pub fn prefault_steps(&self) -> usize {
        self.slabs.len() * self.prefault_steps_per_slab()
    }

    /// Steps per shard's slab (every slab has the same length:
    /// `with_checkpoints`).
    fn prefault_steps_per_slab(&self) -> usize {
        self.slabs[0].1.div_ceil(PREFAULT_STEP_BYTES)
    }

    /// Map in step `step` (of [`Cache::prefault_steps`]) of the frames'
    /// memory: up to [`PREFAULT_STEP_BYTES`] of one shard's slab, with
    /// `MADV_POPULATE_WRITE` (Linux 5.14), as a first write would, without
    /// reading or changing a byte. The frames' first fill then takes no
    /// page fault on the request path. Takes no lock: the shards' owners
    /// may use the same bytes meanwhile. The bytes mapped; an error from a
    /// kernel without it (`EINVAL`) or out of memory (`ENOMEM`).
    pub fn prefault_step(&self, step: usize) -> std::io::Result<usize> {
        let per_shard = self.prefault_steps_per_slab();
        let (addr, len) = self.slabs[step / per_shard];
        let at = (step % per_shard) * PREFAULT_STEP_BYTES;
        let n = PREFAULT_STEP_BYTES.min(len - at);
        // SAFETY: [addr + at, addr + at + n) lies inside one shard's slab
        // mapping (page-aligned: a mapping starts on a page and `at` is a
        // multiple of the step, itself of the page), which lives as long
        // as `self`, borrowed for the call (a slab is never replaced).
        // MADV_POPULATE_WRITE only maps the pages in writable; their bytes
        // are not read or changed (a page never touched stays zero), so a
        // thread using them under its shard's lock sees no change.
        let rc = unsafe {
            libc::madvise(
                (addr + at) as *mut libc::c_void,
                n,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n)
    }

    fn journal_record(&self, e: &mut Entry, track: u64) {
        if let (Some(j), Some(d)) = (&self.journal, e.dirty) {
            e.journal = j.record(track, d, e.journal);
        }
    }

    fn journal_forget(&self, e: &mut Entry) {
        if let Some(j) = &self.journal
            && e.journal != NO_HANDLE
        {
            j.forget(e.journal);
        }
        e.journal = NO_HANDLE;
    }

    /// Frames in the cache.
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Counters.
    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Tracks with a dirty record.
    pub fn dirty_tracks(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| u64::from(s.lock(Use::Quiet).dirty))
            .sum()
    }

    /// Read `track` into `out` from a frame or its NVS record.
    pub fn read(&self, track: u64, out: &mut [u8], nvs: &Nvs) -> Result<ReadOutcome, NvsError> {
        let mut guard = self.shards[shard_of(track)].lock(Use::Read);
        let shard = &mut *guard;
        let Some(e) = shard.map.get(&track).copied() else {
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(ReadOutcome::Miss { epoch: shard.epoch });
        };
        if e.frame != NO_FRAME {
            let frame = &mut shard.frames[e.frame as usize];
            if frame.track == track && frame.lrc == lrc(track, e.frame) {
                frame.referenced = true;
                out.copy_from_slice(frame_bytes(&shard.slab, e.frame));
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(ReadOutcome::Hit);
            }
            // A control block failing its check: drop it, read the track again.
            tracing::error!(
                track,
                frame = e.frame,
                "cache frame failed its check word; rebuilding it"
            );
            self.stats.frames_rebuilt.fetch_add(1, Ordering::Relaxed);
            shard.drop_frame(track);
            shard.epoch += 1;
            if let Some(hook) = self.rebuild_hook.get() {
                hook(track);
            }
        }
        let record = e.dirty.or(e.destaging);
        match record {
            Some(d) => {
                nvs.read_record(d.slot, track, d.seq, out)?;
                shard.install(track, out);
                self.stats.nvs_hits.fetch_add(1, Ordering::Relaxed);
                Ok(ReadOutcome::FromNvs)
            }
            None => {
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                Ok(ReadOutcome::Miss { epoch: shard.epoch })
            }
        }
    }

    /// Install data read from the device after a miss, unless anything in
    /// the shard changed since (then the read may be stale; it is dropped).
    pub fn install_staged(&self, track: u64, data: &[u8], epoch: u64) -> bool {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        if shard.epoch != epoch {
            return false;
        }
        if shard.map.get(&track).is_some_and(|e| !e.is_idle()) {
            return false;
        }
        shard.install(track, data) != NO_FRAME
    }

    /// Apply a write whose record (`slot`, `seq`) is already in the NVS.
    pub fn apply_write(&self, nvs: &Nvs, track: u64, slot: u32, seq: u64, data: &[u8]) -> Applied {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        self.apply_locked(nvs, &mut guard, track, slot, seq, data)
    }

    /// [`Cache::apply_write`] by a recoverable actor (rung 1 through
    /// Log(Lock), paper §4): under the shard lock the actor starts tracking
    /// the shard (the first time), the access is recorded (saving the
    /// shard's access count in the actor's undo log), and the entry as it
    /// was goes to `undo`, for [`Cache::undo_apply`].
    pub fn apply_write_tracked(
        &self,
        nvs: &Nvs,
        track: u64,
        (slot, seq): (u32, u64),
        data: &[u8],
        actor: &loglock::Actor,
        undo: &mut Vec<ApplyUndo>,
    ) -> Result<Applied, loglock::LogError> {
        let lock = &self.shards[shard_of(track)];
        let mut guard = lock.shard.lock();
        if !actor.is_tracking(&lock.accesses) {
            actor.start_tracking(&lock.accesses)?;
        }
        *lock.accesses.lock() += 1;
        let before = guard
            .map
            .get(&track)
            .map_or((None, false), |e| (e.dirty, e.queued));
        let applied = self.apply_locked(nvs, &mut guard, track, slot, seq, data);
        let d = Dirty { slot, seq };
        if guard.map.get(&track).and_then(|e| e.dirty) == Some(d) {
            undo.push(ApplyUndo {
                track,
                before: before.0,
                queued: before.1,
                applied: d,
                retired: applied.free,
            });
        }
        Ok(applied)
    }

    /// The shards `undo` touched, for the actor's restoration level.
    pub fn undo_locks<'a>(&'a self, undo: &[ApplyUndo]) -> Vec<&'a dyn loglock::Tracked> {
        let mut idx: Vec<usize> = undo.iter().map(|u| shard_of(u.track)).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter()
            .map(|i| &self.shards[i].accesses as &dyn loglock::Tracked)
            .collect()
    }

    /// Single-actor rollback of a partly applied write: with every shard in
    /// `undo` locked (in index order), ask `still_safe` (Log(Lock)'s
    /// rollback, which restores the shards' access counts only if no other
    /// actor read or overwrote them since the recovery point) and, if so,
    /// put each entry back as it was (newest first): its dirty record, its
    /// journal item, its dirty count; its frame, which held the new data,
    /// is dropped. Returns whether it rolled back. The superseded records
    /// must not have been freed (the caller frees them only on success).
    pub fn undo_apply(
        &self,
        nvs: &Nvs,
        undo: &[ApplyUndo],
        still_safe: impl FnOnce() -> bool,
    ) -> bool {
        let mut idx: Vec<usize> = undo.iter().map(|u| shard_of(u.track)).collect();
        idx.sort_unstable();
        idx.dedup();
        let mut guards: Vec<(usize, parking_lot::MutexGuard<'_, Shard>)> = idx
            .iter()
            .map(|&i| (i, self.shards[i].shard.lock()))
            .collect();
        if !still_safe() {
            return false;
        }
        for u in undo.iter().rev() {
            let i = shard_of(u.track);
            let shard = &mut *guards
                .iter_mut()
                .find(|(g, _)| *g == i)
                .expect("every shard of the undo is locked")
                .1;
            shard.epoch += 1;
            let Some(e) = shard.map.get_mut(&u.track) else {
                debug_assert!(false, "an applied track left the directory");
                continue;
            };
            debug_assert_eq!(e.dirty, Some(u.applied), "no one changed it (no LU)");
            if let Some(slot) = u.retired {
                // The superseded record is named again: make it valid again
                // (its slot was not given back: the caller frees only on
                // success).
                nvs.revalidate(slot);
            }
            e.dirty = u.before;
            note!(shard, u.track);
            e.queued = u.queued;
            if u.before.is_some() {
                self.journal_record(e, u.track);
            } else {
                self.journal_forget(e);
                shard.dirty -= 1;
            }
            // The frame holds the new data: drop it (it is only a copy).
            shard.drop_frame(u.track);
            if shard.map.get(&u.track).is_some_and(Entry::is_idle) {
                shard.map.remove(&u.track);
            }
        }
        true
    }

    fn apply_locked(
        &self,
        nvs: &Nvs,
        shard: &mut Shard,
        track: u64,
        slot: u32,
        seq: u64,
        data: &[u8],
    ) -> Applied {
        shard.epoch += 1;
        let e = shard.map.entry(track).or_insert_with(Entry::new);
        if let Some(current) = e.dirty
            && current.seq > seq
        {
            // An older write finishing after a newer one: it lost the race.
            nvs.invalidate(slot);
            return Applied {
                free: Some(slot),
                queue: false,
            };
        }
        let superseded = e.dirty.replace(Dirty { slot, seq });
        self.journal_record(e, track);
        note!(shard, track);
        let free = superseded
            .filter(|old| e.destaging != Some(*old))
            .map(|old| old.slot);
        if let Some(old) = free {
            nvs.invalidate(old);
        }
        let queue = !e.queued;
        e.queued = true;
        if superseded.is_none() {
            shard.dirty += 1;
        }
        shard.install(track, data);
        Applied { free, queue }
    }

    /// Start destaging `track`: its dirty record, unless it is clean,
    /// already being destaged, or inside a range being zeroed.
    pub fn begin_destage(&self, track: u64) -> Option<Dirty> {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        if self
            .zeroing
            .read()
            .iter()
            .any(|f| (f.first..f.end).contains(&track))
        {
            return None;
        }
        let e = shard.map.get_mut(&track)?;
        e.queued = false;
        if e.destaging.is_some() {
            return None;
        }
        let d = e.dirty?;
        e.destaging = Some(d);
        Some(d)
    }

    /// End the destage of `d` (`written`: the device write succeeded). A
    /// slot in the result is invalidated already; give it back with
    /// [`Nvs::release`].
    pub fn end_destage(&self, nvs: &Nvs, track: u64, d: Dirty, written: bool) -> Destaged {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        shard.epoch += 1;
        let Some(e) = shard.map.get_mut(&track) else {
            debug_assert!(false, "destaged track {track} has no directory entry");
            return Destaged::default();
        };
        debug_assert_eq!(e.destaging, Some(d));
        e.destaging = None;
        let mut out = Destaged::default();
        if !written {
            // Keep the record dirty; destage it again later.
            out.queue = !e.queued;
            e.queued = true;
            return out;
        }
        // The record is on the device (or superseded): invalidate it now,
        // under the lock, before a newer record of the track can be
        // destaged and freed; after the recovery box stops naming it (a
        // box must never name an invalid record).
        if e.dirty == Some(d) {
            e.dirty = None;
            note!(shard, track);
            self.journal_forget(e);
            nvs.invalidate(d.slot);
            out.free = Some(d.slot);
            shard.dirty -= 1;
        } else {
            nvs.invalidate(d.slot);
            // Superseded while being written: the newer record stays dirty.
            out.free = Some(d.slot);
            out.queue = !e.queued;
            e.queued = true;
        }
        if e.is_idle() {
            shard.map.remove(&track);
        }
        out
    }

    /// Copy the cached frame of `track` into `out` if it holds the data of
    /// dirty record `d` (used when the record itself fails its checksum).
    pub fn dirty_copy(&self, track: u64, d: Dirty, out: &mut [u8]) -> bool {
        let shard = self.shards[shard_of(track)].lock(Use::Read);
        let Some(e) = shard.map.get(&track) else {
            return false;
        };
        if e.dirty != Some(d) && e.destaging != Some(d) || e.frame == NO_FRAME {
            return false;
        }
        // A frame is installed with the newest record's data; it holds d's
        // data only if d is that newest record.
        if e.dirty.is_some_and(|cur| cur != d) {
            return false;
        }
        let frame = &shard.frames[e.frame as usize];
        if frame.track != track || frame.lrc != lrc(track, e.frame) {
            return false;
        }
        out.copy_from_slice(frame_bytes(&shard.slab, e.frame));
        true
    }

    /// Whether `track` has a dirty record or a destage in flight.
    pub fn is_dirty(&self, track: u64) -> bool {
        let shard = self.shards[shard_of(track)].lock(Use::Read);
        shard
            .map
            .get(&track)
            .is_some_and(|e| e.dirty.is_some() || e.destaging.is_some())
    }

    /// Tracks dirty now (for FLUSH).
    pub fn dirty_snapshot(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let shard = s.lock(Use::Quiet);
            out.extend(
                shard
                    .map
                    .iter()
                    .filter(|(_, e)| e.dirty.is_some() || e.destaging.is_some())
                    .map(|(&t, _)| t),
            );
        }
        out
    }

    /// Register a record found in the NVS at start-up (newest per track
    /// wins; returns the slot of the loser to free, and whether to queue).
    pub fn recover_dirty(&self, track: u64, slot: u32, seq: u64) -> Applied {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        let e = shard.map.entry(track).or_insert_with(Entry::new);
        match e.dirty {
            Some(cur) if cur.seq > seq => Applied {
                free: Some(slot),
                queue: false,
            },
            cur => {
                e.dirty = Some(Dirty { slot, seq });
                note!(shard, track);
                self.journal_record(e, track);
                let queue = !e.queued;
                e.queued = true;
                if cur.is_none() {
                    shard.dirty += 1;
                }
                Applied {
                    free: cur.map(|c| c.slot),
                    queue,
                }
            }
        }
    }

    /// Register a dirty record that the journal already holds (fast restart).
    pub fn adopt_dirty(&self, track: u64, d: Dirty, handle: u32) {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        let e = shard.map.entry(track).or_insert_with(Entry::new);
        debug_assert!(e.dirty.is_none(), "the journal names track {track} twice");
        e.dirty = Some(d);
        note!(shard, track);
        e.journal = handle;
        e.queued = true;
        shard.dirty += 1;
    }

    /// Fence destage out of tracks `[first, end)` (zeroing starts);
    /// returns the fence's name for [`Cache::end_zeroing`].
    pub fn begin_zeroing(&self, first: u64, end: u64) -> u64 {
        let id = self
            .next_fence
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.zeroing.write().push(ZeroFence { first, end, id });
        id
    }

    /// Whether fence `id` still stands (a rung 3 or 4 rebuild drops them).
    pub fn holds_zeroing(&self, id: u64) -> bool {
        self.zeroing.read().iter().any(|f| f.id == id)
    }

    /// Lift fence `id` without zeroing anything (a zeroing abandoned).
    pub fn lift_zeroing(&self, id: u64) {
        self.zeroing.write().retain(|f| f.id != id);
    }

    /// Whether a destage of a track in `[first, end)` is in flight.
    pub fn destaging_in(&self, first: u64, end: u64) -> bool {
        self.for_range_shards(first, end, Use::Read, |shard| {
            shard
                .map
                .iter()
                .any(|(&t, e)| (first..end).contains(&t) && e.destaging.is_some())
        })
    }

    /// Zeroing of `[first, end)` done on the devices: forget dirty records
    /// older than `seq` and cached copies in the range, lift fence `id`.
    /// Returns their slots, invalidated already: give them back with
    /// [`Nvs::release`].
    pub fn end_zeroing(&self, nvs: &Nvs, first: u64, end: u64, seq: u64, id: u64) -> Vec<u32> {
        let mut free = Vec::new();
        self.for_range_shards(first, end, Use::Write, |shard| {
            shard.epoch += 1;
            let tracks: Vec<u64> = shard
                .map
                .keys()
                .copied()
                .filter(|t| (first..end).contains(t))
                .collect();
            for t in tracks {
                shard.drop_frame(t);
                let Some(e) = shard.map.get_mut(&t) else {
                    continue;
                };
                if let Some(d) = e.dirty
                    && d.seq < seq
                {
                    debug_assert!(e.destaging.is_none());
                    e.dirty = None;
                    note!(shard, t);
                    if let Some(j) = &self.journal
                        && e.journal != NO_HANDLE
                    {
                        j.forget(e.journal);
                    }
                    e.journal = NO_HANDLE;
                    nvs.invalidate(d.slot);
                    free.push(d.slot);
                    shard.dirty -= 1;
                }
                if e.is_idle() {
                    shard.map.remove(&t);
                }
            }
            false
        });
        self.lift_zeroing(id);
        free
    }

    fn for_range_shards(
        &self,
        first: u64,
        end: u64,
        how: Use,
        mut f: impl FnMut(&mut Shard) -> bool,
    ) -> bool {
        let span = end.saturating_sub(first);
        let mut any = false;
        if span < CACHE_SHARDS as u64 {
            let mut seen = [false; CACHE_SHARDS];
            for t in first..end {
                let s = shard_of(t);
                if !std::mem::replace(&mut seen[s], true) {
                    any |= f(&mut self.shards[s].lock(how));
                }
            }
        } else {
            for s in self.shards.iter() {
                any |= f(&mut s.lock(how));
            }
        }
        any
    }

    /// Rung 4: forget the whole directory and every cached copy, as a
    /// cache just created (frame buffers stay allocated). The journal is
    /// not told: its records are what the rebuild adopts back. Callers
    /// quiesce first: nothing may use the cache during the reset.
    pub fn reset(&self) {
        for s in self.shards.iter() {
            let mut shard = s.lock(Use::Write);
            let shard = &mut *shard;
            shard.map.clear();
            for f in &mut shard.frames {
                f.track = EMPTY_TRACK;
                f.referenced = false;
                f.lrc = 0;
            }
            shard.free = (0..shard.frames.len() as u32).rev().collect();
            shard.hand = 0;
            shard.epoch += 1;
            shard.dirty = 0;
            shard.changed.clear();
        }
        self.zeroing.write().clear();
    }

    /// Rung 3's incremental checkpoint: hand every track whose dirty entry
    /// changed since the last call to `f`, with its dirty record now (a
    /// track may come more than once). Callers hold the epoch cut, so no
    /// change is in progress.
    pub fn take_changes(&self, mut f: impl FnMut(u64, Option<Dirty>)) {
        // Only the shards that noted a change (a commit every few hundred
        // microseconds would otherwise lock all of them each time).
        let mask = self.changed_shards.swap(0, Ordering::AcqRel);
        for (i, s) in self.shards.iter().enumerate() {
            if mask & (1 << i) == 0 {
                continue;
            }
            let mut guard = s.lock(Use::Quiet);
            let shard = &mut *guard;
            for track in shard.changed.drain(..) {
                f(track, shard.map.get(&track).and_then(|e| e.dirty));
            }
        }
    }

    /// Every dirty record now (track, record).
    pub fn dirty_records(&self) -> Vec<(u64, Dirty)> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let shard = s.lock(Use::Quiet);
            out.extend(
                shard
                    .map
                    .iter()
                    .filter_map(|(&t, e)| e.dirty.map(|d| (t, d))),
            );
        }
        out
    }

    /// Rung 3: put every dirty entry changed since the last checkpoint back
    /// to its value there (`image`), and drop every cached copy. The
    /// checkpoint's records are made valid in the NVS again first (an
    /// epoch's supersede or zeroing invalidated them; their slots were not
    /// given back, see [`crate::engine::epoch::Epochs::retire`]), then the journal
    /// is told. Returns the tracks put back. Callers quiesce and hold the
    /// epoch cut; no destage is in flight.
    pub fn roll_back_changes(&self, nvs: &Nvs, image: impl Fn(u64) -> Option<Dirty>) -> u64 {
        let mut restored = 0;
        for s in self.shards.iter() {
            let mut guard = s.lock(Use::Write);
            let shard = &mut *guard;
            shard.epoch += 1;
            let mut changed = std::mem::take(&mut shard.changed);
            changed.sort_unstable();
            changed.dedup();
            for track in changed {
                let want = image(track);
                let e = shard.map.entry(track).or_insert_with(Entry::new);
                debug_assert!(e.destaging.is_none(), "a destage is in flight");
                e.destaging = None;
                e.queued = false;
                if e.dirty == want {
                    continue;
                }
                restored += 1;
                match (e.dirty, want) {
                    (None, Some(_)) => shard.dirty += 1,
                    (Some(_), None) => shard.dirty -= 1,
                    _ => {}
                }
                e.dirty = want;
                if let Some(d) = want {
                    nvs.revalidate(d.slot);
                    self.journal_record(e, track);
                } else {
                    self.journal_forget(e);
                }
            }
            for f in &mut shard.frames {
                f.track = EMPTY_TRACK;
                f.referenced = false;
                f.lrc = 0;
            }
            shard.free = (0..shard.frames.len() as u32).rev().collect();
            shard.hand = 0;
            for e in shard.map.values_mut() {
                e.frame = NO_FRAME;
                // The caller queues every dirty track for destage.
                e.queued = e.dirty.is_some();
            }
            shard.map.retain(|_, e| !e.is_idle());
        }
        self.zeroing.write().clear();
        restored
    }

    /// Rung 3: note `track` as changed since the checkpoint (a suspect:
    /// its entry was found inconsistent), so a rollback restores it.
    pub fn mark_changed(&self, track: u64) {
        let mut guard = self.shards[shard_of(track)].lock(Use::Quiet);
        let shard = &mut *guard;
        shard.changed.push(track);
        shard.changed_shards.fetch_or(shard.bit, Ordering::Release);
    }

    /// Damage the directory entry of dirty `track` in memory (fault
    /// injection: state corruption): its record's sequence number is
    /// flipped and its cached copy dropped, so the next read of the track
    /// finds the entry naming a record the NVS does not hold. The change is
    /// not noted for the checkpoint (as real corruption would not be); the
    /// recovery box keeps the true record. Returns the true record.
    pub fn damage_directory(&self, track: u64) -> Option<Dirty> {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        let d = shard.map.get(&track).and_then(|e| e.dirty)?;
        shard.drop_frame(track);
        shard.epoch += 1;
        let e = shard.map.get_mut(&track)?;
        e.dirty = Some(Dirty {
            slot: d.slot,
            seq: d.seq ^ (1 << 62),
        });
        Some(d)
    }

    /// The record that holds `track`'s newest data: its dirty record, or
    /// the one being destaged.
    pub fn newest_record(&self, track: u64) -> Option<Dirty> {
        let shard = self.shards[shard_of(track)].lock(Use::Quiet);
        shard.map.get(&track).and_then(|e| e.dirty.or(e.destaging))
    }

    /// Fault injection: damage the data of `track`'s newest NVS record and
    /// drop its cached copy, so that no good copy of the track's newest
    /// data is left (memory corruption of the NVS). Returns the record.
    pub fn damage_record(&self, track: u64, nvs: &Nvs) -> Option<Dirty> {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        let d = shard
            .map
            .get(&track)
            .and_then(|e| e.dirty.or(e.destaging))?;
        shard.drop_frame(track);
        shard.epoch += 1;
        nvs.damage_slot(d.slot, crate::store::nvs::SLOT_HEADER_BYTES + 100);
        Some(d)
    }

    /// Install the rebuild hook (once; later calls are ignored).
    pub fn set_rebuild_hook(&self, hook: RebuildHook) {
        let _ = self.rebuild_hook.set(hook);
    }

    /// Corrupt the check word of the frame caching `track`, if any (fault
    /// injection: "a control block failing its checksum").
    pub fn damage_frame(&self, track: u64) -> bool {
        let mut guard = self.shards[shard_of(track)].lock(Use::Write);
        let shard = &mut *guard;
        let Some(f) = shard
            .map
            .get(&track)
            .map(|e| e.frame)
            .filter(|&f| f != NO_FRAME)
        else {
            return false;
        };
        shard.frames[f as usize].lrc ^= 0xdead_beef;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn nvs() -> (tempfile::TempDir, Nvs) {
        let dir = tempfile::tempdir().unwrap();
        let (nvs, fresh) =
            Nvs::open_or_create(&dir.path().join("nvs"), 4 << 20, 1, 1 << 20).unwrap();
        assert!(fresh);
        (dir, nvs)
    }

    fn write(cache: &Cache, nvs: &Nvs, track: u64, byte: u8) -> (Dirty, Applied) {
        let slot = nvs.reserve(1, Duration::from_secs(1)).unwrap()[0];
        let seq = nvs.next_seqs(1);
        let data = vec![byte; TRACK_BYTES];
        nvs.write_record(slot, seq, track, &data);
        (
            Dirty { slot, seq },
            cache.apply_write(nvs, track, slot, seq, &data),
        )
    }

    /// A checkpoint takes every change, from whichever shards noted one (it
    /// visits only those), with each track's dirty record now, and a
    /// change is taken by one checkpoint only.
    #[test]
    fn take_changes_reports_every_changed_track_with_its_newest_record_until_taken() {
        let (_d, nvs) = nvs();
        let cache = Cache::with_checkpoints(256, None, true);
        let tracks = [0u64, 1, 65, 130, 1000];
        let mut newest = std::collections::BTreeMap::new();
        for (i, &t) in tracks.iter().enumerate() {
            newest.insert(t, write(&cache, &nvs, t, i as u8).0);
        }
        // Track 65 again (shard 1, like track 1): its newest record only.
        newest.insert(65, write(&cache, &nvs, 65, 9).0);
        let mut taken = std::collections::BTreeMap::new();
        cache.take_changes(|t, d| {
            taken.insert(t, d.expect("dirty"));
        });
        assert_eq!(taken, newest);
        let mut again = 0;
        cache.take_changes(|_, _| again += 1);
        assert_eq!(again, 0, "changes are taken once");
        write(&cache, &nvs, 3, 7);
        let mut later = Vec::new();
        cache.take_changes(|t, _| later.push(t));
        assert_eq!(later, [3]);
    }

    /// Apply `byte` to `tracks` as Log(Lock) actor `actor`; the undo list.
    fn apply_tracked(
        cache: &Cache,
        nvs: &Nvs,
        actor: &loglock::Actor,
        tracks: &[u64],
        byte: u8,
    ) -> Vec<ApplyUndo> {
        let mut undo = Vec::new();
        for &track in tracks {
            let slot = nvs.reserve(1, Duration::from_secs(1)).unwrap()[0];
            let seq = nvs.next_seqs(1);
            let data = vec![byte; TRACK_BYTES];
            nvs.write_record(slot, seq, track, &data);
            cache
                .apply_write_tracked(nvs, track, (slot, seq), &data, actor, &mut undo)
                .unwrap();
        }
        undo
    }

    fn read_byte(cache: &Cache, nvs: &Nvs, track: u64) -> Option<u8> {
        let mut out = vec![0u8; TRACK_BYTES];
        match cache.read(track, &mut out, nvs).unwrap() {
            ReadOutcome::Miss { .. } => None,
            _ => Some(out[0]),
        }
    }

    #[test]
    fn a_partly_applied_write_is_undone_when_log_lock_finds_no_other_access() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        write(&cache, &nvs, 1, 0x0a);
        let actor = loglock::Actor::begin(9_001);
        let point = actor
            .recovery_point(loglock::RecoveryCriterion::ISOLATED_ROLLBACK)
            .unwrap();
        let undo = apply_tracked(&cache, &nvs, &actor, &[1, 2], 0x0b);
        assert_eq!(undo.len(), 2);
        assert_eq!(cache.dirty_tracks(), 2);
        let locks = cache.undo_locks(&undo);
        assert_eq!(locks.len(), 2, "tracks 1 and 2 are in two shards");
        let decision = actor.decide(&point, &locks).unwrap();
        assert!(decision.single_actor_rollback(), "{decision:?}");
        assert!(cache.undo_apply(&nvs, &undo, || actor.rollback(&point).is_ok()));
        drop(actor);
        assert_eq!(
            read_byte(&cache, &nvs, 1),
            Some(0x0a),
            "the older write again"
        );
        assert_eq!(read_byte(&cache, &nvs, 2), None, "never written");
        assert_eq!(cache.dirty_tracks(), 1);
    }

    #[test]
    fn a_dirty_read_by_another_thread_rules_out_the_rollback() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        write(&cache, &nvs, 1, 0x0a);
        let actor = loglock::Actor::begin(9_002);
        let point = actor
            .recovery_point(loglock::RecoveryCriterion::ISOLATED_ROLLBACK)
            .unwrap();
        let undo = apply_tracked(&cache, &nvs, &actor, &[1], 0x0b);
        // Another thread (another actor) reads the changed track.
        std::thread::scope(|s| {
            s.spawn(|| assert_eq!(read_byte(&cache, &nvs, 1), Some(0x0b)));
        });
        let decision = actor.decide(&point, &cache.undo_locks(&undo)).unwrap();
        assert!(decision.level.dr, "{decision:?}");
        assert!(!decision.single_actor_rollback());
        // Even asked to, the rollback re-checks under the locks and refuses.
        assert!(!cache.undo_apply(&nvs, &undo, || actor.rollback(&point).is_ok()));
        assert_eq!(read_byte(&cache, &nvs, 1), Some(0x0b), "nothing was undone");
    }

    /// The hard-restart race the crash loop found: a destage ended, a
    /// newer record of the track was destaged and freed, and the process
    /// died before the first destage's caller freed the older record; the
    /// NVS scan then replayed the older record over the newer data on the
    /// device. A record the directory drops must be invalid at once.
    #[test]
    fn a_record_the_directory_drops_is_invalid_before_its_slot_is_given_back() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let (w1, _) = write(&cache, &nvs, 7, 1);
        assert_eq!(cache.begin_destage(7), Some(w1));
        let (w2, a2) = write(&cache, &nvs, 7, 2);
        assert_eq!(a2.free, None, "w1 is being destaged: its destage frees it");
        // w1's destage ends; its caller has not given the slot back yet.
        let end1 = cache.end_destage(&nvs, 7, w1, true);
        assert_eq!(end1.free, Some(w1.slot));
        // w2 is destaged and its slot given back.
        assert_eq!(cache.begin_destage(7), Some(w2));
        let end2 = cache.end_destage(&nvs, 7, w2, true);
        nvs.release(&[end2.free.unwrap()]);
        // A crash here: the scan must not find w1 (nor w2).
        let scan = nvs.scan();
        assert!(
            scan.records.iter().all(|r| r.track != 7),
            "a dropped record survived: {:?}",
            scan.records
        );
        // Superseding (no destage in flight) invalidates at once too.
        let (w3, _) = write(&cache, &nvs, 8, 3);
        let (_, a4) = write(&cache, &nvs, 8, 4);
        assert_eq!(a4.free, Some(w3.slot));
        let scan = nvs.scan();
        assert_eq!(
            scan.records.iter().filter(|r| r.track == 8).count(),
            1,
            "only the newest record of track 8 is valid"
        );
    }

    #[test]
    fn a_write_is_read_back_and_supersedes_the_older_record() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let (first, a) = write(&cache, &nvs, 7, 1);
        assert_eq!(
            a,
            Applied {
                free: None,
                queue: true
            }
        );
        let (_, b) = write(&cache, &nvs, 7, 2);
        assert_eq!(b.free, Some(first.slot), "the superseded slot is freed");
        assert!(!b.queue, "already queued");
        let mut out = vec![0u8; TRACK_BYTES];
        assert_eq!(cache.read(7, &mut out, &nvs).unwrap(), ReadOutcome::Hit);
        assert!(out.iter().all(|&x| x == 2));
        assert_eq!(cache.dirty_tracks(), 1);
    }

    #[test]
    fn an_older_write_applied_late_is_discarded() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let old_slot = nvs.reserve(1, Duration::from_secs(1)).unwrap()[0];
        let old_seq = nvs.next_seqs(1);
        write(&cache, &nvs, 3, 9);
        let a = cache.apply_write(&nvs, 3, old_slot, old_seq, &[1; TRACK_BYTES]);
        assert_eq!(a.free, Some(old_slot));
        let mut out = vec![0u8; TRACK_BYTES];
        cache.read(3, &mut out, &nvs).unwrap();
        assert!(out.iter().all(|&x| x == 9));
    }

    #[test]
    fn a_write_during_destage_keeps_the_track_dirty_and_frees_each_slot_once() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let (first, _) = write(&cache, &nvs, 5, 1);
        let d = cache.begin_destage(5).unwrap();
        assert_eq!(d, first);
        assert!(cache.begin_destage(5).is_none(), "one destage at a time");
        let (_, during) = write(&cache, &nvs, 5, 2);
        assert_eq!(
            during.free, None,
            "the slot being destaged is not freed under the destager"
        );
        assert!(during.queue);
        let end = cache.end_destage(&nvs, 5, d, true);
        assert_eq!(
            end,
            Destaged {
                free: Some(first.slot),
                queue: false
            }
        );
        assert!(cache.is_dirty(5));
        let d2 = cache.begin_destage(5).unwrap();
        let end = cache.end_destage(&nvs, 5, d2, true);
        assert!(end.free.is_some() && !end.queue);
        assert!(!cache.is_dirty(5));
        assert_eq!(cache.dirty_tracks(), 0);
    }

    #[test]
    fn a_stale_staged_read_is_not_installed_after_a_write() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let mut out = vec![0u8; TRACK_BYTES];
        let ReadOutcome::Miss { epoch } = cache.read(9, &mut out, &nvs).unwrap() else {
            panic!("expected a miss");
        };
        write(&cache, &nvs, 9, 4);
        assert!(!cache.install_staged(9, &[0; TRACK_BYTES], epoch));
        cache.read(9, &mut out, &nvs).unwrap();
        assert!(out.iter().all(|&x| x == 4));
    }

    #[test]
    fn eviction_keeps_dirty_data_readable_from_the_nvs() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(CACHE_SHARDS, None); // one frame per shard
        write(&cache, &nvs, 0, 1);
        write(&cache, &nvs, CACHE_SHARDS as u64, 2); // same shard: evicts track 0's frame
        let mut out = vec![0u8; TRACK_BYTES];
        assert_eq!(cache.read(0, &mut out, &nvs).unwrap(), ReadOutcome::FromNvs);
        assert!(out.iter().all(|&x| x == 1));
    }

    #[test]
    fn a_frame_failing_its_check_word_is_rebuilt_not_served() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        write(&cache, &nvs, 11, 6);
        assert!(cache.damage_frame(11));
        let mut out = vec![0u8; TRACK_BYTES];
        assert_eq!(
            cache.read(11, &mut out, &nvs).unwrap(),
            ReadOutcome::FromNvs
        );
        assert!(out.iter().all(|&x| x == 6));
        assert_eq!(cache.stats().frames_rebuilt.load(Ordering::Relaxed), 1);
        assert_eq!(cache.read(11, &mut out, &nvs).unwrap(), ReadOutcome::Hit);
    }

    #[test]
    fn zeroing_fences_destage_and_drops_only_older_records() {
        let (_d, nvs) = nvs();
        let cache = Cache::new(256, None);
        let (old, _) = write(&cache, &nvs, 20, 1);
        let fence = cache.begin_zeroing(16, 32);
        let other = cache.begin_zeroing(16, 32);
        assert!(
            cache.begin_destage(20).is_none(),
            "no destage inside a zeroing range"
        );
        cache.lift_zeroing(other);
        assert!(!cache.holds_zeroing(other));
        assert!(cache.holds_zeroing(fence), "fences are lifted by name");
        assert!(cache.begin_destage(20).is_none(), "still fenced");
        let zero_seq = nvs.next_seqs(1);
        let (newer, _) = write(&cache, &nvs, 21, 2);
        assert!(newer.seq > zero_seq);
        let freed = cache.end_zeroing(&nvs, 16, 32, zero_seq, fence);
        assert_eq!(freed, vec![old.slot]);
        assert!(!cache.is_dirty(20));
        assert!(
            cache.is_dirty(21),
            "a write newer than the zeroing survives it"
        );
        assert!(cache.begin_destage(21).is_some(), "fence lifted");
        assert!(!cache.holds_zeroing(fence));
    }

    fn page_bytes() -> usize {
        // SAFETY: sysconf takes an integer and touches no memory.
        usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap()
    }

    /// How many of the pages of `cache`'s slabs are resident (`mincore`).
    fn resident_pages(cache: &Cache) -> usize {
        let page = page_bytes();
        cache
            .slabs
            .iter()
            .map(|&(addr, len)| {
                let mut vec = vec![0u8; len.div_ceil(page)];
                // SAFETY: mincore reads nothing of the range (a mapping of
                // `cache`, alive here) and writes one byte per page into
                // `vec`, which has exactly that many.
                let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
                assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
                vec.iter().filter(|&&v| v & 1 == 1).count()
            })
            .sum()
    }

    /// The slabs are address space until touched; prefaulting maps every
    /// page in, frame data written before and after it reads back whole,
    /// and a frame never written still reads as zeroes.
    #[test]
    fn prefaulting_maps_the_slabs_in_without_changing_a_frame() {
        let (_d, nvs) = nvs();
        // Four whole steps and a short one per shard.
        let frames = CACHE_SHARDS * (PREFAULT_STEP_BYTES * 4 + TRACK_BYTES * 3) / TRACK_BYTES;
        let cache = Cache::new(frames, None);
        let pages = cache
            .slabs
            .iter()
            .map(|&(_, len)| len / page_bytes())
            .sum::<usize>();
        assert!(
            resident_pages(&cache) < pages / 100,
            "a fresh cache is resident"
        );
        write(&cache, &nvs, 5, 0x55);
        let steps = cache.prefault_steps();
        assert_eq!(steps, CACHE_SHARDS * 5);
        let mapped: usize = (0..steps).map(|i| cache.prefault_step(i).unwrap()).sum();
        assert_eq!(mapped, pages * page_bytes());
        assert_eq!(resident_pages(&cache), pages);
        write(&cache, &nvs, 6, 0x66);
        let mut out = vec![0u8; TRACK_BYTES];
        for (track, byte) in [(5, 0x55u8), (6, 0x66)] {
            assert_eq!(cache.read(track, &mut out, &nvs).unwrap(), ReadOutcome::Hit);
            assert!(out.iter().all(|&x| x == byte), "track {track}");
        }
        let shard = cache.shards[0].shard.lock();
        assert!(shard.slab.iter().all(|&x| x == 0), "shard 0 holds no frame");
    }
}
