//! The per-lock change-track log (paper §4.1: "a hashtable indexed using the
//! pointer to the lock as key"; here the log lives next to the lock, which
//! is the same map without the lookup).
//!
//! A lock is *tracked* while at least one actor has called
//! `start_tracking` on it. An untracked lock pays one relaxed load of the
//! tracker count per acquisition and records nothing. A tracked lock records
//! every access by every actor (the conflicting accesses are the *other*
//! actors').
//!
//! # The log: a ring written under the structure's own lock
//!
//! Events go into a ring of [`CHANGE_LOG_ENTRIES_MAX`] slots, allocated the
//! first time the lock is tracked. The writer holds the tracked structure
//! exclusively (the mutex, the rwlock's write side, the pool's mutex), so
//! writers never race and recording costs a few plain stores, no atomic
//! read-modify-write: the lock's sequence counter `head` has one writer.
//! Shared holders (rwlock readers) serialise their recording on a small
//! mutex; they never overlap with an exclusive holder.
//!
//! Each slot is a seqlock: the writer clears the slot's tag, stores the
//! fields, then stores the tag (with the event's sequence number) with
//! Release, then advances `head` with Release. A reader (the tracker
//! computing its restoration level, on its own thread, without the
//! structure's lock) reads tag, fields, tag again, and keeps the slot only
//! if both tags name the sequence number it expects. A slot overwritten
//! because the ring wrapped is therefore detected, and the level is reported
//! incomplete (every conflict assumed); a slot whose fields do not match its
//! check word is corruption.
//!
//! # Visibility of the tracker count
//!
//! `start_tracking` increments the tracker count before the tracker's first
//! access. Another actor's later access acquires the lock after the
//! tracker's release of it, so the increment happens-before that access and
//! its relaxed load sees a count above zero. Accesses that miss the count
//! happened before the tracker's first access, and the paper ignores those
//! ("read or write actions performed by T2 before any such actions by T1").
//!
//! # Purge (§4.2)
//!
//! When a tracker stops, its entries are only marked: the log's live window
//! starts at the oldest remaining tracker's start, and when the last tracker
//! stops the window is emptied.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;

use crate::event::{ActorId, Event, EventKind, LockId, thread_commits};
use crate::limits::CHANGE_LOG_ENTRIES_MAX;

/// A tracker: an actor and the first sequence number it sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tracker {
    pub actor: ActorId,
    pub start: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    pub trackers: Vec<Tracker>,
    /// Events below this sequence number are purged.
    pub base: u64,
}

/// One ring slot. `tag` is `seq << 8 | kind`, zero while being written.
#[derive(Debug, Default)]
struct Slot {
    tag: AtomicU64,
    actor: AtomicU64,
    item: AtomicU64,
    /// `commits << 32 | check`.
    extra: AtomicU64,
}

/// What a reader got from the log.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    pub events: Vec<Event>,
    /// Some events at or after the requested start were lost (overwritten
    /// by the ring wrapping).
    pub lost: bool,
    /// A slot failed its check word.
    pub corrupt: bool,
}

/// What every tracked lock and pool shares: identity, tracker count, log.
#[derive(Debug)]
pub struct LockCore {
    id: LockId,
    name: &'static str,
    trackers: AtomicU32,
    /// Sequence number of the next event (one writer at a time).
    head: AtomicU64,
    ring: OnceLock<Box<[Slot]>>,
    /// Serialises recorders that hold the structure shared.
    shared: Mutex<()>,
    /// The tracking actor holding the structure exclusively (0: none).
    /// Written only by the holder, under the structure's lock.
    holder: AtomicU64,
    pub(crate) registry: Mutex<Registry>,
}

impl LockCore {
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            id: LockId::fresh(),
            name,
            trackers: AtomicU32::new(0),
            head: AtomicU64::new(1),
            ring: OnceLock::new(),
            shared: Mutex::new(()),
            holder: AtomicU64::new(0),
            registry: Mutex::new(Registry {
                base: 1,
                ..Registry::default()
            }),
        }
    }

    /// The lock's identity.
    pub fn id(&self) -> LockId {
        self.id
    }

    /// The name given at construction (for logs and reports).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether any actor tracks this lock: the one relaxed check an
    /// untracked acquisition pays.
    #[inline]
    pub fn is_tracked(&self) -> bool {
        self.trackers.load(Ordering::Relaxed) != 0
    }

    /// Note (or clear, with 0) the tracking actor holding the structure
    /// exclusively.
    #[inline]
    pub(crate) fn set_holder(&self, actor: ActorId) {
        self.holder.store(actor, Ordering::Relaxed);
    }

    /// The tracking actor holding the structure exclusively (0: none).
    pub(crate) fn holder(&self) -> ActorId {
        self.holder.load(Ordering::Relaxed)
    }

    /// The sequence number the next event will get.
    pub(crate) fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Live entries in the change-track log (not yet purged, not yet
    /// overwritten).
    pub fn log_len(&self) -> usize {
        let base = self.registry.lock().base;
        let live = self.head().saturating_sub(base);
        live.min(CHANGE_LOG_ENTRIES_MAX as u64) as usize
    }

    fn ring(&self) -> &[Slot] {
        self.ring.get_or_init(|| {
            (0..CHANGE_LOG_ENTRIES_MAX)
                .map(|_| Slot::default())
                .collect()
        })
    }

    /// Record an event. The caller holds the structure exclusively, so
    /// it is the only writer.
    #[inline]
    pub(crate) fn record(&self, actor: ActorId, kind: EventKind, item: u64) {
        let ring = self.ring();
        let seq = self.head.load(Ordering::Relaxed);
        let e = Event::new(seq, actor, kind, item, thread_commits());
        let slot = &ring[(seq % CHANGE_LOG_ENTRIES_MAX as u64) as usize];
        slot.tag.store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.actor.store(e.actor, Ordering::Relaxed);
        slot.item.store(e.item, Ordering::Relaxed);
        slot.extra.store(
            u64::from(e.commits) << 32 | u64::from(e.check),
            Ordering::Relaxed,
        );
        slot.tag.store(seq << 8 | kind as u64, Ordering::Release);
        self.head.store(seq + 1, Ordering::Release);
    }

    /// Record an event while holding the structure shared.
    pub(crate) fn record_shared(&self, actor: ActorId, kind: EventKind, item: u64) {
        let _one_writer = self.shared.lock();
        self.record(actor, kind, item);
    }

    /// The events with sequence numbers from `from` on.
    pub(crate) fn snapshot(&self, from: u64) -> Snapshot {
        let mut out = Snapshot::default();
        let Some(ring) = self.ring.get() else {
            return out;
        };
        let cap = CHANGE_LOG_ENTRIES_MAX as u64;
        let head = self.head();
        let oldest = head.saturating_sub(cap).max(1);
        let lo = from.max(oldest);
        out.lost = from < oldest;
        for seq in lo..head {
            let slot = &ring[(seq % cap) as usize];
            let tag = slot.tag.load(Ordering::Acquire);
            let actor = slot.actor.load(Ordering::Relaxed);
            let item = slot.item.load(Ordering::Relaxed);
            let extra = slot.extra.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            let again = slot.tag.load(Ordering::Relaxed);
            if tag != again || tag >> 8 != seq {
                // Overwritten under us: the ring wrapped.
                out.lost = true;
                continue;
            }
            let Some(kind) = EventKind::from_u8(tag as u8) else {
                out.corrupt = true;
                continue;
            };
            let e = Event {
                seq,
                actor,
                kind,
                item,
                commits: (extra >> 32) as u32,
                check: extra as u32,
            };
            if !e.is_intact() {
                out.corrupt = true;
            }
            out.events.push(e);
        }
        out
    }

    /// Register a tracker; returns its start sequence number.
    pub(crate) fn add_tracker(&self, actor: ActorId) -> u64 {
        self.ring();
        let mut reg = self.registry.lock();
        self.trackers.fetch_add(1, Ordering::SeqCst);
        let start = self.head();
        if reg.trackers.is_empty() {
            reg.base = start;
        }
        reg.trackers.push(Tracker { actor, start });
        start
    }

    /// Unregister a tracker: its entries are marked, the log purged as far
    /// as the remaining trackers allow.
    pub(crate) fn remove_tracker(&self, actor: ActorId) {
        let mut reg = self.registry.lock();
        if let Some(i) = reg.trackers.iter().position(|t| t.actor == actor) {
            reg.trackers.swap_remove(i);
            self.trackers.fetch_sub(1, Ordering::SeqCst);
            let head = self.head();
            // The stopped tracker's entries stay (marked) as long as an
            // earlier-started tracker needs them.
            reg.base = match reg.trackers.iter().map(|t| t.start).min() {
                None => head,
                Some(min) => reg.base.max(min),
            };
        }
    }

    /// Damage the newest log entry (tests of checksum verification).
    #[doc(hidden)]
    pub fn corrupt_newest_entry(&self) {
        let head = self.head();
        if let Some(ring) = self.ring.get()
            && head > 1
        {
            let slot = &ring[((head - 1) % CHANGE_LOG_ENTRIES_MAX as u64) as usize];
            slot.actor.fetch_xor(1, Ordering::Relaxed);
        }
    }
}
