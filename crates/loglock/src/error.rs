//! Errors of Log(Lock) operations.

use crate::event::LockId;

/// Why an operation of Log(Lock) failed. Every one of them means the state
/// cannot be restored at this level; the caller escalates (system-level
/// recovery).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// No actor is current on this thread.
    #[error("no recoverable actor is current on this thread")]
    NoActor,
    /// The actor is suspended: another actor is current on this thread.
    #[error("actor {0} is not the current actor on this thread")]
    NotCurrent(u64),
    /// `stop_tracking` on a lock the actor does not track.
    #[error("lock {0} is not tracked by this actor")]
    NotTracking(LockId),
    /// `start_tracking` on a lock the actor already tracks.
    #[error("lock {0} is already tracked by this actor")]
    AlreadyTracking(LockId),
    /// More tracked locks than [`TRACKED_PER_ACTOR_MAX`](crate::limits::TRACKED_PER_ACTOR_MAX).
    #[error("an actor may track at most {0} locks at once")]
    TooManyTracked(usize),
    /// A log entry failed its checksum: the logs cannot be trusted.
    #[error("a {0} log entry failed its checksum")]
    Corrupt(&'static str),
    /// The undo log is full; nothing more can be undone reliably.
    #[error("the undo log overflowed ({0} entries)")]
    UndoOverflow(usize),
    /// A recovery point that does not exist (or went out of scope).
    #[error("unknown recovery point {0}")]
    UnknownRecoveryPoint(usize),
    /// Rolling back would lose another actor's work: it read or overwrote
    /// this actor's change to `lock` (DR or LU). `restored` structures were
    /// rolled back before this one.
    #[error(
        "rollback of lock {lock} refused: another actor consumed the change ({restored} restored before it)"
    )]
    Interfered {
        /// The structure that could not be restored.
        lock: LockId,
        /// How many structures were restored before it.
        restored: usize,
    },
    /// Too many recovery points.
    #[error("an actor may have at most {0} recovery points")]
    TooManyRecoveryPoints(usize),
}

/// Errors of tracked pools.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Every item is in use.
    #[error("pool {0} is exhausted")]
    Exhausted(LockId),
    /// Releasing an item the current actor does not own.
    #[error("item {item} of pool {pool} is not owned by this actor")]
    NotOwner {
        /// The pool.
        pool: LockId,
        /// The item.
        item: usize,
    },
    /// An item index outside the pool.
    #[error("pool {pool} has no item {item}")]
    UnknownItem {
        /// The pool.
        pool: LockId,
        /// The item.
        item: usize,
    },
}
