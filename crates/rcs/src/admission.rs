//! Admission of a task of one recovery group: the per-group running count,
//! the recoverability constraint sigma (paper §5, Table 1), and the reactive
//! fence (paper §4.2: "suspends the dispatch of tasks belonging to the group
//! undergoing recovery").
//!
//! # Protocol
//!
//! - dispatcher: [`Admission::admit`] raises the running count (under the
//!   static policy only while it is below sigma, by compare-and-swap),
//!   `fence(SeqCst)`, then loads the group's *suspended* bit; if it is set the
//!   dispatcher backs out.
//! - recovery leader: [`Admission::suspend`] sets the suspended bit,
//!   `fence(SeqCst)`, then waits until [`Admission::running`] has drained to
//!   the tasks it allows (itself).
//!
//! The fences make this Dekker's pattern: a dispatcher
//! that did not see the suspension was already counted when the leader read
//! the count, so the leader waits for it (it is one of the tasks "running when
//! recovery began" and is told to clean up); no task passes admission after
//! the leader's drain wait starts. This is the property
//! `recovering_group_never_dispatches` asserts end to end; loom checks the
//! protocol alone (`admission_is_fenced_by_suspension`).

use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// Whether admission enforces sigma (static) or only counts (dynamic prefers
/// groups under sigma but may exceed it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sigma {
    Enforce,
    Count,
}

/// The sigma rule alone: whether a group with `running` tasks running
/// admits one more under `mode`. Shared by the runtime's [`Admission`] and
/// the simulator, so both apply the same constraint.
#[inline]
pub(crate) fn admits(running: u32, sigma: u32, mode: Sigma) -> bool {
    match mode {
        Sigma::Enforce => running < sigma,
        Sigma::Count => true,
    }
}

/// Running count of one group.
#[derive(Debug, Default)]
pub(crate) struct Admission {
    running: AtomicU32,
}

impl Admission {
    pub(crate) fn new() -> Self {
        Self {
            running: AtomicU32::new(0),
        }
    }

    /// Tasks of the group currently running (including ones backing out).
    #[inline]
    pub(crate) fn running(&self) -> u32 {
        self.running.load(Ordering::SeqCst)
    }

    /// Try to admit one task. `suspended` is the runtime's mask of groups
    /// whose dispatch is suspended, `bit` this group's bit in it (0 when the
    /// reactive fence does not apply, e.g. under the performance policy).
    #[inline]
    pub(crate) fn admit(&self, sigma: u32, mode: Sigma, suspended: &AtomicU64, bit: u64) -> bool {
        match mode {
            Sigma::Enforce => {
                let mut current = self.running.load(Ordering::Relaxed);
                loop {
                    if !admits(current, sigma, mode) {
                        return false;
                    }
                    match self.running.compare_exchange_weak(
                        current,
                        current + 1,
                        Ordering::SeqCst,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => break,
                        Err(actual) => current = actual,
                    }
                }
            }
            Sigma::Count => {
                self.running.fetch_add(1, Ordering::SeqCst);
            }
        }
        fence(Ordering::SeqCst);
        if bit != 0 && suspended.load(Ordering::SeqCst) & bit != 0 {
            self.release();
            return false;
        }
        true
    }

    /// Recovery leader: suspend the group's dispatch. After this returns,
    /// [`Admission::running`] counts every task that passed admission
    /// before the suspension; none passes after it.
    pub(crate) fn suspend(suspended: &AtomicU64, bit: u64) {
        suspended.fetch_or(bit, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// A task of the group finished (or backed out of admission). Returns
    /// the running count before the release: a caller that released a
    /// group at its sigma bound may have to wake a worker that parked
    /// because the group's queued tasks could not be admitted
    /// ([`Shared::released_at_bound`](crate::runtime::Shared::released_at_bound)).
    #[inline]
    pub(crate) fn release(&self) -> u32 {
        let before = self.running.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(before > 0, "running count underflow");
        before
    }
}
