//! The idle set: which workers are parked, one bit per worker.
//!
//! A worker that found no work for a while parks instead of spinning (on a
//! 2-core machine a spinning worker steals the core its producers need). A
//! producer wakes one parked worker *eligible* for the group it submitted to
//! (under the static policy only the pools mapped to that group are).
//!
//! # Protocol
//!
//! - worker: [`IdleSet::announce`] its bit (`fetch_or`, then `fence(SeqCst)`),
//!   then re-check the [ready masks](crate::ready); if work showed up it
//!   [`retract`](IdleSet::retract)s and goes on, otherwise it parks.
//! - producer: after its push, [`ReadyMask::mark_then`](crate::ready::ReadyMask::mark_then)
//!   (which ends with a `fence(SeqCst)` after the push and any change to the
//!   mask) runs [`IdleSet::claim_one`] among the eligible workers: a load,
//!   then a `fetch_and` that only one producer can win per worker; the winner
//!   unparks.
//!
//! A thread outside the pools (an affiliate) that ends a task of a group at
//! its sigma bound wakes one parked eligible worker if the group has queued
//! tasks: under an enforcing policy a worker parks when every ready group
//! is at its bound, and nothing else would tell it a slot was freed
//! (`Shared::released_at_bound`; a worker's own release is followed by its
//! next scheduling round).
//!
//! A producer that is itself a worker eligible for the task, and that found
//! the queue empty, skips the wake-up: it dispatches the task itself when
//! its current task ends (waking a parked peer only to find the task gone
//! would cost two context switches per hop of a request). It still wakes a
//! peer when the queue already held work.
//!
//! The fences make it Dekker's pattern: either the producer's load sees the
//! worker's announcement, or the worker's re-check sees the producer's ready
//! bit. (SeqCst read-modify-writes and loads alone would do in the C++20
//! model, but loom, which checks this protocol, models SeqCst accesses as
//! acquire/release and only SeqCst fences as such; the fences keep the
//! checked code and the shipped code the same.) Parking uses `std::thread::park`,
//! whose token makes an unpark that races ahead of the park harmless; a park
//! timeout ([`PARK_TIMEOUT`](crate::limits::PARK_TIMEOUT)) is a last line of
//! defence, not part of the protocol. Checked by loom in `tests/loom.rs`
//! (`fused_submit_wakes_a_parking_worker_or_it_sees_work`,
//! `release_at_bound_wakes_a_parking_worker_or_it_sees_the_slot`).

use crate::sync::{AtomicU64, Ordering, fence};

/// Parked-worker bits.
#[derive(Debug, Default)]
pub(crate) struct IdleSet {
    parked: AtomicU64,
}

impl IdleSet {
    pub(crate) fn new() -> Self {
        Self {
            parked: AtomicU64::new(0),
        }
    }

    /// Worker: "I am about to park". Follow with a re-check for work.
    #[inline]
    pub(crate) fn announce(&self, worker_bit: u64) {
        self.parked.fetch_or(worker_bit, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// Worker: "I am awake again" (found work on the re-check, or woke up).
    #[inline]
    pub(crate) fn retract(&self, worker_bit: u64) {
        self.parked.fetch_and(!worker_bit, Ordering::SeqCst);
    }

    /// Producer: claim one parked worker among `eligible`; the caller must
    /// unpark the worker whose index is returned. The caller must have issued
    /// `fence(SeqCst)` after its push and ready mark (as
    /// [`ReadyMask::mark_then`](crate::ready::ReadyMask::mark_then) does).
    #[inline]
    pub(crate) fn claim_one(&self, eligible: u64) -> Option<u32> {
        let mut candidates = self.parked.load(Ordering::SeqCst) & eligible;
        while candidates != 0 {
            let index = candidates.trailing_zeros();
            let bit = 1u64 << index;
            if self.parked.fetch_and(!bit, Ordering::SeqCst) & bit != 0 {
                return Some(index);
            }
            candidates &= !bit;
        }
        None
    }

    /// Producer: claim every parked worker among `eligible` (used when a
    /// group resumes after recovery or the policy changes).
    #[inline]
    pub(crate) fn claim_all(&self, eligible: u64) -> u64 {
        self.parked.fetch_and(!eligible, Ordering::SeqCst) & eligible
    }
}
