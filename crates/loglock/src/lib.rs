//! # loglock: Log(Lock) state restoration for micro-recovery
//!
//! Implements *Log(Lock): state restoration for micro-recovery* in a
//! storage controller (`papers/loglock-micro-recovery.txt`, sections 2 to
//! 5). A recoverable
//! actor (thread or task) that fails in the middle of changing shared state
//! wants to roll back alone and retry; Log(Lock) tells it whether that is
//! safe, from what other actors did to the same state meanwhile.
//!
//! | paper | here |
//! |---|---|
//! | §2.1 events R, W, A, Re, E; happened-before | [`Event`], [`EventKind`] ([`event`](crate::event) module) |
//! | §2.1 restoration level ⟨DR, LU, UR, RR, CD⟩ | [`RestorationLevel`], [`Actor::restoration_level`] |
//! | §2.1 recovery point, recovery criterion ⟨DR, LU, UR, RR⟩ | [`RecoveryPoint`], [`RecoveryCriterion`], [`Requirement`] |
//! | §2.2 resource recovery protocol, state recovery protocol | [`resource_recovery`], [`state_recovery`], [`decide`], [`Strategy`] |
//! | §4.1 startTracking, stopTracking, getRestorationLevel, getResourceOwnership | [`Actor::start_tracking`], [`Actor::stop_tracking`], [`Actor::restoration_level`], [`Actor::resource_ownership`] |
//! | §4.1 change-track log keyed by lock, undo log, checksums | [`LockCore`] ([`core`](crate::core) module), [`undo`](crate::undo) module |
//! | §4.1 trapping lock/unlock | [`TrackedMutex`], [`TrackedRwLock`], [`TrackedPool`] |
//! | §4.2 purge: undo at actor end, change-track marked then purged at the last stopTracking | [`Actor`]'s drop, [`Actor::stop_tracking`] |
//!
//! ## Model
//!
//! A runtime makes an actor current on a thread with [`Actor::begin`]. The
//! actor calls `start_tracking(lock)` for the shared structures its
//! recoverable work touches. From then on every access to those locks, by
//! any thread, is recorded (read or write, at unlock) in the lock's
//! change-track log, and the tracking actor's first modification under each
//! guard saves the old value in its undo log. On a failure, the recovery
//! handler asks [`Actor::decide`] at a recovery point and gets the
//! restoration level, the resource actions (release what is still held)
//! and the strategies the protocols allow; single-actor rollback is
//! [`Actor::rollback`].
//!
//! ## Invariants
//!
//! - An untracked lock records nothing and pays one relaxed load.
//! - Sequence order of the events on one lock is the lock's acquisition
//!   order (events are numbered while the lock is held).
//! - A restoration level computed from incomplete logs (overflow) assumes
//!   every conflict: an overflow can cost a micro-recovery, never make an
//!   unsafe one look safe.
//! - A log entry that fails its checksum stops the computation with
//!   [`LogError::Corrupt`]; nothing is restored from a damaged undo log.

pub mod actor;
pub mod commit;
pub mod core;
pub mod criterion;
pub mod error;
pub mod event;
pub mod level;
pub mod limits;
pub mod mutex;
pub mod pool;
pub mod protocol;
pub mod recovery_point;
pub mod rwlock;
pub mod undo;

pub use actor::{Actor, Tracked, current_actor};
pub use core::LockCore;
pub use criterion::{RecoveryCriterion, Requirement};
pub use error::{LogError, PoolError};
pub use event::{ActorId, Event, EventKind, IMPLICIT_ACTOR_BIT, LockId};
pub use level::{Ownership, RestorationLevel};
pub use mutex::{TrackedMutex, TrackedMutexGuard};
pub use pool::TrackedPool;
pub use protocol::{Decision, ResourceAction, Strategy, decide, resource_recovery, state_recovery};
pub use recovery_point::RecoveryPoint;
pub use rwlock::{TrackedReadGuard, TrackedRwLock, TrackedWriteGuard};

/// Record an externally visible action by whoever runs on this thread (an
/// actor, or a thread with its implicit id): see [`Actor::commit`].
pub fn commit() {
    commit::record_commit(current_actor());
}
