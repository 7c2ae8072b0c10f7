//! Change-track log events (paper §2.1): the reads (R), writes (W),
//! acquisitions (A), releases (Re) and externally visible actions (E) whose
//! happened-before order decides the restoration level.
//!
//! Events on one lock are numbered by that lock's own sequence counter,
//! advanced while the lock (or pool) is held, so their order is the lock's
//! acquisition order, which is the happened-before order of the accesses.
//! Commits are ordered against an actor's accesses by the actor's own
//! program order: each event carries the number of commits its thread had
//! made when it happened ([`Event::commits`]).
//!
//! Every event carries a check word over its fields ([`check_word`]),
//! verified whenever the log is read (the paper keeps its logs in memory
//! "verified for integrity using checksums").

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// An actor: a recoverable thread or task (paper: "recoverable thread").
/// Runtimes pick ids; threads that run no actor get an implicit id with
/// [`IMPLICIT_ACTOR_BIT`] set.
pub type ActorId = u64;

/// Set in the ids Log(Lock) gives threads that run no actor, so they never
/// collide with runtime-chosen ids below 2^63.
pub const IMPLICIT_ACTOR_BIT: u64 = 1 << 63;

/// Identifies a tracked lock or pool for the process's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockId(pub u64);

impl fmt::Display for LockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

static NEXT_LOCK: AtomicU64 = AtomicU64::new(1);

impl LockId {
    pub(crate) fn fresh() -> Self {
        Self(NEXT_LOCK.fetch_add(1, Ordering::Relaxed))
    }
}

thread_local! {
    /// Commits made on this thread so far.
    static THREAD_COMMITS: Cell<u32> = const { Cell::new(0) };
}

/// Commits made on this thread so far.
#[inline]
pub(crate) fn thread_commits() -> u32 {
    THREAD_COMMITS.with(Cell::get)
}

/// Count a commit on this thread; returns the new count.
pub(crate) fn count_commit() -> u32 {
    THREAD_COMMITS.with(|c| {
        let n = c.get().wrapping_add(1);
        c.set(n);
        n
    })
}

/// What an actor did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EventKind {
    /// Read the protected state (T·R).
    Read = 1,
    /// Modified the protected state (T·W). A mutable access may also read,
    /// so restoration levels treat it as a read as well.
    Write = 2,
    /// Acquired an item of a pool (T·A).
    Acquire = 3,
    /// Released an item of a pool (T·Re).
    Release = 4,
    /// An externally visible action, a commit that cannot be rolled back
    /// (T·E).
    Commit = 5,
}

impl EventKind {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Read,
            2 => Self::Write,
            3 => Self::Acquire,
            4 => Self::Release,
            5 => Self::Commit,
            _ => return None,
        })
    }
}

/// The check word of a log entry: each field folded in with a 64x64->128
/// multiply (the mixing step of wyhash). A checksum against memory damage,
/// not an adversary: a CRC-32C call cost as much as the rest of recording
/// an event (measured with perf), this is a few cycles and inlines.
#[inline]
pub(crate) fn check_word(words: &[u64]) -> u32 {
    const K0: u64 = 0xa076_1d64_78bd_642f;
    const K1: u64 = 0xe703_7ed1_a0b4_28db;
    let mut h = K0;
    for &w in words {
        let m = u128::from(h ^ w) * u128::from(K1);
        h = (m as u64) ^ ((m >> 64) as u64);
    }
    (h ^ (h >> 32)) as u32
}

/// One change-track (or commit) log entry, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Position in the lock's order (or the commit order).
    pub seq: u64,
    /// Who.
    pub actor: ActorId,
    /// What.
    pub kind: EventKind,
    /// Pool item for [`EventKind::Acquire`]/[`EventKind::Release`], else 0.
    pub item: u64,
    /// Commits the actor's thread had made when this happened (for a
    /// commit: including it).
    pub commits: u32,
    /// Check word as stored.
    pub check: u32,
}

impl Event {
    /// A sealed event (check word computed).
    pub fn new(seq: u64, actor: ActorId, kind: EventKind, item: u64, commits: u32) -> Self {
        let mut e = Self {
            seq,
            actor,
            kind,
            item,
            commits,
            check: 0,
        };
        e.check = e.expected_check();
        e
    }

    pub(crate) fn expected_check(&self) -> u32 {
        // Three words: every field, packed without overlap except the
        // item, whose rotation keeps the commit count in its own half.
        check_word(&[
            self.seq << 8 | self.kind as u64,
            self.actor,
            self.item.rotate_left(32) ^ u64::from(self.commits),
        ])
    }

    /// Whether the entry still matches its check word.
    pub fn is_intact(&self) -> bool {
        self.check == self.expected_check()
    }
}
