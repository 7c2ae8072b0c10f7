//! Ready masks: one bit per job queue that may hold work.
//!
//! A pool scheduler (paper §5.1, "the scheduler can simply skip the job queues
//! for the recovering group") must find, among up to [`GROUPS_MAX`] groups and
//! three priorities, a queue with work. Probing every queue costs one shared
//! cache line per group per scan; a [`ReadyMask`] answers with a single load.
//!
//! # Protocol
//!
//! The mask is a *hint that never loses work*: whenever a queue is non-empty
//! and no operation on it is in flight, its bit is set. Bits may be set for an
//! empty queue (a consumer then clears them).
//!
//! - producer, after a successful push: [`ReadyMask::mark`]: `fence(SeqCst)`,
//!   load the mask, and `fetch_or` the bit only if it is clear (the common
//!   case under load, a set bit, costs a shared read instead of a contended
//!   read-modify-write).
//! - consumer, after a pop found the queue empty: [`ReadyMask::clear_if_empty`]:
//!   `fetch_and` the bit away, `fence(SeqCst)`, then re-check the queue and set
//!   the bit again if an item arrived meanwhile.
//!
//! The two fences make this Dekker's pattern: either the producer's load sees
//! the consumer's clear (and sets the bit), or the consumer's re-check sees the
//! producer's push (and sets it back). Checked exhaustively by loom in
//! `tests/loom.rs` (`ready_mask_never_loses_work`).
//!
//! [`GROUPS_MAX`]: crate::limits::GROUPS_MAX

use crate::sync::{AtomicU64, Ordering, fence};

/// A word of "may have work" bits, one per queue.
#[derive(Debug, Default)]
pub(crate) struct ReadyMask {
    bits: AtomicU64,
}

impl ReadyMask {
    pub(crate) fn new() -> Self {
        Self {
            bits: AtomicU64::new(0),
        }
    }

    /// The current bits (a snapshot; see the module doc for what a bit means).
    #[inline]
    pub(crate) fn load(&self) -> u64 {
        self.bits.load(Ordering::SeqCst)
    }

    /// Producer side: the queue for `bit` just received an item.
    #[inline]
    pub(crate) fn mark(&self, bit: u64) {
        debug_assert_eq!(bit.count_ones(), 1);
        fence(Ordering::SeqCst);
        if self.bits.load(Ordering::SeqCst) & bit == 0 {
            self.bits.fetch_or(bit, Ordering::SeqCst);
        }
    }

    /// Producer side, fused with the wake-up: mark `bit`, then call `then`
    /// with whether the bit was already set (the queue probably held other
    /// work). One fence in the common case where the bit is already set: the
    /// fence that orders the push before the mask load also orders it before
    /// the loads `then` does (see [`IdleSet`]).
    ///
    /// [`IdleSet`]: crate::idle::IdleSet
    #[inline]
    pub(crate) fn mark_then(&self, bit: u64, then: impl FnOnce(bool)) {
        debug_assert_eq!(bit.count_ones(), 1);
        fence(Ordering::SeqCst);
        let was_set = self.bits.load(Ordering::SeqCst) & bit != 0;
        if !was_set {
            self.bits.fetch_or(bit, Ordering::SeqCst);
            fence(Ordering::SeqCst);
        }
        then(was_set);
    }

    /// Consumer side: a pop from the queue for `bit` found it empty.
    /// `is_empty` re-checks the queue after the bit is cleared.
    #[inline]
    pub(crate) fn clear_if_empty(&self, bit: u64, is_empty: impl Fn() -> bool) {
        debug_assert_eq!(bit.count_ones(), 1);
        self.bits.fetch_and(!bit, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !is_empty() {
            self.bits.fetch_or(bit, Ordering::SeqCst);
        }
    }
}
