//! Recovery points (paper §3, Figure 2): "the context of a failure", with the
//! strategy to apply there: retry (with a bound and backoff), ignore, abort,
//! or escalate to the enclosing recovery point.
//!
//! ```text
//!   task ──► recovery point A (retry 3) ──► recovery point B (escalate) ──► body
//!                 clean-ups a1 a2                 clean-ups b1
//!   body fails: b1 runs; B escalates; a2, a1 run; A retries its body.
//! ```
//!
//! Semantics of [`TaskCtx::recovery_point`]:
//! - the body runs; a panic inside it is a failure of class `Panic`;
//! - on success, the clean-up blocks registered inside it are dropped unrun;
//! - on failure, they run newest first, exactly once; then the strategy for
//!   the failure's class applies:
//!   - `Retry`: run the body again after a backoff, up to `retries_max`
//!     times, then escalate;
//!   - `Ignore`: return [`Outcome::Ignored`] and carry on (the paper's
//!     "continuing the operations, ignoring the error");
//!   - `Abort`: end the task; every enclosing clean-up runs; no group recovery;
//!   - `Escalate`: hand the failure to the enclosing recovery point; above
//!     the outermost one it becomes group recovery;
//!   - `System`: straight to system-level recovery (enclosing clean-ups run).
//! - a failure already aborting or headed for system level, or the
//!   cooperative [`GroupRecovering`](FailureClass::GroupRecovering) signal,
//!   passes through after the clean-ups, whatever the strategy;
//! - a clean-up block that fails is a failure during recovery: system level.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use crate::failure::{Disposition, Failure, FailureClass};
use crate::limits::RETRY_ATTEMPTS_MAX;
use crate::task::TaskCtx;

/// Bounded retry with exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Re-executions after the first failure before escalating.
    pub retries_max: u32,
    /// Sleep before the first retry; doubled for each further one.
    pub backoff_initial: Duration,
    /// Cap on the backoff.
    pub backoff_max: Duration,
}

impl RetryPolicy {
    /// Retry up to `retries_max` times, first after `backoff_initial`,
    /// doubling up to 64 times that. Panics (at compile time in a `const`)
    /// when `retries_max` exceeds [`RETRY_ATTEMPTS_MAX`].
    pub const fn new(retries_max: u32, backoff_initial: Duration) -> Self {
        assert!(
            retries_max <= RETRY_ATTEMPTS_MAX,
            "retries_max above RETRY_ATTEMPTS_MAX"
        );
        Self {
            retries_max,
            backoff_initial,
            backoff_max: backoff_initial.saturating_mul(64),
        }
    }

    /// The backoff before retry number `attempt` (1-based).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(20);
        self.backoff_initial
            .saturating_mul(1u32 << shift)
            .min(self.backoff_max)
    }
}

/// What a recovery point does with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Run the body again, bounded, with backoff; then escalate.
    Retry(RetryPolicy),
    /// Carry on after the recovery point.
    Ignore,
    /// End the task without group recovery.
    Abort,
    /// Hand the failure to the enclosing recovery point.
    Escalate,
    /// Go straight to system-level recovery.
    System,
}

/// A recovery point: a name and the strategy per failure class.
/// `const`-constructible, so hot paths can keep theirs in a `static`.
#[derive(Debug, Clone)]
pub struct RecoveryPoint {
    name: &'static str,
    default: Strategy,
    overrides: [Option<Strategy>; FailureClass::COUNT],
}

impl RecoveryPoint {
    /// A recovery point applying `default` to every failure class.
    pub const fn new(name: &'static str, default: Strategy) -> Self {
        Self {
            name,
            default,
            overrides: [None; FailureClass::COUNT],
        }
    }

    /// Apply `strategy` to failures of `class` instead of the default.
    pub const fn on(mut self, class: FailureClass, strategy: Strategy) -> Self {
        self.overrides[class as usize] = Some(strategy);
        self
    }

    /// The point's name (for logs and metrics).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The strategy applied to a failure of `class`.
    pub fn strategy_for(&self, class: FailureClass) -> Strategy {
        self.overrides[class.index()].unwrap_or(self.default)
    }
}

/// The result of a recovery point that did not fail upward.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// The body completed (possibly after retries).
    Done(T),
    /// The body failed and the strategy said to ignore it.
    Ignored(Failure),
}

impl<T> Outcome<T> {
    /// The body's value, if it completed.
    pub fn done(self) -> Option<T> {
        match self {
            Outcome::Done(v) => Some(v),
            Outcome::Ignored(_) => None,
        }
    }

    /// Whether the body completed.
    pub fn is_done(&self) -> bool {
        matches!(self, Outcome::Done(_))
    }
}

impl TaskCtx<'_> {
    /// Run `body` inside a recovery point (see the module doc for the exact
    /// semantics). `Err` means the failure leaves this point: to the
    /// enclosing one (propagate it with `?`), or, for an abort or a system
    /// escalation, through every enclosing point.
    pub fn recovery_point<T>(
        &mut self,
        point: &RecoveryPoint,
        mut body: impl FnMut(&mut TaskCtx<'_>) -> Result<T, Failure>,
    ) -> Result<Outcome<T>, Failure> {
        let mut attempt = 0u32;
        loop {
            let frame = self.cleanups.mark();
            let result = catch_unwind(AssertUnwindSafe(|| body(self)));
            let failure = match result {
                Ok(Ok(value)) => {
                    self.cleanups.discard_to(frame);
                    return Ok(Outcome::Done(value));
                }
                Ok(Err(failure)) => failure,
                Err(payload) => Failure::from_panic(&*payload),
            };
            self.cleanups.unwind_to(frame)?;
            if failure.disposition() != Disposition::Escalate
                || failure.class() == FailureClass::GroupRecovering
            {
                return Err(failure);
            }
            match point.strategy_for(failure.class()) {
                Strategy::Retry(policy) if attempt < policy.retries_max => {
                    attempt += 1;
                    self.note_retry();
                    tracing::debug!(point = point.name, attempt, %failure, "retrying");
                    std::thread::sleep(policy.backoff(attempt));
                    self.check()?;
                }
                Strategy::Retry(_) | Strategy::Escalate => return Err(failure),
                Strategy::Ignore => {
                    self.note_ignored();
                    return Ok(Outcome::Ignored(failure));
                }
                Strategy::Abort => return Err(failure.abort()),
                Strategy::System => return Err(failure.system()),
            }
        }
    }
}
