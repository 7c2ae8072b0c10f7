//! Clean-up blocks (paper §3, Figure 2): recovery procedures registered by a
//! task as it acquires things, "gathered and carried along during task
//! execution but not invoked unless a failure occurs".
//!
//! One stack per worker, reused by every task it runs (no allocation per
//! task once warm). A recovery point remembers the stack height when it is
//! entered (its *frame*); on success the blocks above the frame are dropped
//! unrun, on failure they run newest first, each exactly once.
//!
//! Invariants: the stack is empty between tasks; a block is either run once
//! or dropped unrun, never both; a failing (panicking) block does not stop
//! the blocks below it from running: it turns the failure into a failure
//! during recovery, which escalates to system level.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::failure::Failure;

/// A registered clean-up block.
struct CleanupBlock {
    name: &'static str,
    action: Box<dyn FnOnce()>,
}

/// The stack of clean-up blocks of the task running on one worker.
#[derive(Default)]
pub(crate) struct CleanupStack {
    blocks: Vec<CleanupBlock>,
}

impl std::fmt::Debug for CleanupStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.blocks.iter().map(|b| b.name))
            .finish()
    }
}

impl CleanupStack {
    /// Current height: the frame of a recovery point being entered.
    pub(crate) fn mark(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub(crate) fn push(&mut self, name: &'static str, action: Box<dyn FnOnce()>) {
        self.blocks.push(CleanupBlock { name, action });
    }

    /// Success: drop the blocks above `mark` unrun.
    pub(crate) fn discard_to(&mut self, mark: usize) {
        debug_assert!(mark <= self.blocks.len());
        self.blocks.truncate(mark);
    }

    /// Failure: run the blocks above `mark`, newest first, each once.
    /// Returns the failure of the first block that panicked, as a failure
    /// headed for system-level recovery; every block still runs.
    pub(crate) fn unwind_to(&mut self, mark: usize) -> Result<(), Failure> {
        debug_assert!(mark <= self.blocks.len());
        let mut first_failure = None;
        while self.blocks.len() > mark {
            let block = self.blocks.pop().expect("length checked above");
            let name = block.name;
            if let Err(payload) = catch_unwind(AssertUnwindSafe(block.action)) {
                let cause = Failure::from_panic(&*payload);
                tracing::error!(block = name, %cause, "clean-up block failed during recovery");
                first_failure.get_or_insert_with(|| {
                    Failure::internal_logic(format!(
                        "clean-up block {name:?} failed: {}",
                        cause.message()
                    ))
                    .system()
                });
            }
        }
        first_failure.map_or(Ok(()), Err)
    }
}
