//! Group recovery (reactive RCS, paper §4.2) and escalation to system level.
//!
//! When a failure reaches the top of a task of group `g`:
//!
//! 1. The failing worker sets `g`'s *recovering* bit; if it was already set,
//!    the failure joins the recovery in progress (its leader covers it).
//! 2. With reactive scheduling on (any RCS policy), it also sets `g`'s
//!    *suspended* bit: no new task of `g` passes admission, and `g`'s running
//!    tasks see [`TaskCtx::check`](crate::TaskCtx::check) fail and unwind
//!    through their clean-ups.
//! 3. Emulated recovery time (fault injection, §6.3.3) is spent.
//! 4. With reactive scheduling on, the leader waits until `g`'s other running
//!    tasks have finished (at most the drain timeout; past it, the recovery
//!    escalates). Without it there is no fence, and tasks of `g` keep running.
//! 5. `g`'s recovery handler runs. If it fails or panics, the recovery
//!    escalates to the system-level callback (still suspended).
//! 6. `g` resumes: the bits are cleared, eligible parked workers are woken.
//!
//! Invariant (reactive on): no task of `g` starts between step 2 and step 6
//! (see [`admission`](crate::admission)).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::events::{RecoveryEvent, RecoveryOutcome, RecoveryScope, SystemCause, SystemFailure};
use crate::failure::Failure;
use crate::group::{GroupId, GroupRecovery};
use crate::policy::Policy;
use crate::runtime::{GroupState, Shared};

impl Shared {
    /// Recover group `g` from `failure`. `self_running` is how many of `g`'s
    /// running tasks belong to the caller (1 from a failing task, 0 from
    /// outside).
    pub(crate) fn recover_group(&self, g: GroupId, failure: Failure, self_running: u32) {
        let bit = g.bit();
        if self.recovering.fetch_or(bit, Ordering::SeqCst) & bit != 0 {
            tracing::debug!(group = %self.groups[g.index()].name, %failure,
                "failure joins the group recovery in progress");
            return;
        }
        let group = &self.groups[g.index()];
        let reactive =
            self.reactive.load(Ordering::Relaxed) && self.policy() != Policy::Performance;
        if reactive {
            crate::admission::Admission::suspend(&self.suspended, bit);
        }
        group.recovery_epoch.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        let tasks_running = group.admission.running().saturating_sub(self_running);
        let tasks_queued: usize = group.queued().iter().sum();
        tracing::info!(group = %group.name, %failure, tasks_running, tasks_queued,
            "group recovery started");

        if let Some(d) = group.faults.recovery_time() {
            group.hold_for_recovery(d);
        }
        let mut escalation = None;
        if reactive && !wait_drained(group, self_running, self.drain_timeout) {
            escalation = Some((SystemCause::DrainTimeout, failure.clone()));
        }
        if escalation.is_none()
            && let Some(handler) = &group.handler
        {
            let info = GroupRecovery {
                group: g,
                name: &group.name,
                failure: &failure,
                tasks_running,
                tasks_queued,
            };
            let failed = match catch_unwind(AssertUnwindSafe(|| handler(&info))) {
                Ok(Ok(())) => None,
                Ok(Err(f)) => Some(f),
                Err(payload) => Some(Failure::from_panic(&*payload)),
            };
            escalation = failed.map(|f| (SystemCause::HandlerFailed, f));
        }
        let duration = started.elapsed();
        group.recoveries.fetch_add(1, Ordering::Relaxed);
        let us = u64::try_from(duration.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let _ = group.recovery_times_us.lock().record(us);
        let outcome = match &escalation {
            None => RecoveryOutcome::Recovered,
            Some((cause, _)) => RecoveryOutcome::Escalated(*cause),
        };
        self.push_event(RecoveryEvent {
            seq: 0,
            scope: RecoveryScope::Group(g),
            group_name: Some(group.name.clone()),
            cause: failure,
            at: started.duration_since(self.started),
            duration,
            tasks_running,
            tasks_queued,
            outcome,
        });
        if let Some((cause, f)) = escalation {
            self.escalate_system(Some(g), cause, f);
        }
        if reactive {
            self.suspended.fetch_and(!bit, Ordering::SeqCst);
        }
        self.recovering.fetch_and(!bit, Ordering::SeqCst);
        tracing::info!(group = %group.name, ?duration, "group recovery finished");
        self.wake_all(self.mapping.eligible_workers(self.policy(), g.index()));
    }

    /// Hand a failure to the embedder's system-level recovery callback.
    pub(crate) fn escalate_system(
        &self,
        group: Option<GroupId>,
        cause: SystemCause,
        failure: Failure,
    ) {
        self.system_escalations.fetch_add(1, Ordering::Relaxed);
        tracing::error!(cause = cause.name(), %failure, "escalating to system-level recovery");
        let started = Instant::now();
        let info = SystemFailure {
            group,
            cause,
            failure: failure.clone(),
        };
        if catch_unwind(AssertUnwindSafe(|| (self.system_recovery)(&info))).is_err() {
            tracing::error!("the system-level recovery callback panicked");
        }
        self.push_event(RecoveryEvent {
            seq: 0,
            scope: RecoveryScope::System,
            group_name: group.map(|g| self.groups[g.index()].name.clone()),
            cause: failure,
            at: started.duration_since(self.started),
            duration: started.elapsed(),
            tasks_running: 0,
            tasks_queued: 0,
            outcome: RecoveryOutcome::Escalated(cause),
        });
    }
}

/// Wait until at most `allowed` tasks of the group run; false on timeout.
fn wait_drained(group: &GroupState, allowed: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut spins = 0u32;
    while group.admission.running() > allowed {
        if Instant::now() >= deadline {
            return false;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    true
}
