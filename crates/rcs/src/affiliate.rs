//! Affiliated threads: a thread outside the pools that runs tasks of some
//! groups itself, when their admission allows (caller-runs execution).
//!
//! The paper's controller runs every task on the CPUs of the resource pools
//! (§4.1), and a request that arrives from the host is queued for them.
//! Where the work arrives on a thread of its own (a connection's reader in
//! `controller`), queuing a task costs a hand-off: a wake-up of a parked
//! worker and a context switch on each side, more than the few microseconds
//! of the task itself on a machine with fewer cores than runnable threads.
//! An affiliate removes the hand-off on the good path without changing what
//! a task is: it runs the task through the same [executor](crate::execute)
//! as a worker (its own slot of counters and task clock, recovery points,
//! clean-up blocks, the failure's disposition, group recovery), admitted by
//! the same [admission](crate::admission) (the reactive fence; sigma
//! enforced under the static and partial-dynamic policies, counted under
//! dynamic, ignored under performance), and a follow-up task of one of its
//! groups stays on the thread (a continuation) instead of being queued.
//!
//! A task is *queued for the pools* instead, exactly as
//! [`Handle::submit`](crate::Handle::submit) would, when:
//! - its group is not one of the affiliate's;
//! - admission refuses it (the group is suspended, or at sigma where sigma
//!   is enforced);
//! - its group is recovering, or has fault emulation armed
//!   ([`Handle::inject`](crate::Handle::inject)): the bad path is the
//!   scheduler's to decide, so a faulty group's tasks stay on the pools
//!   where the recovery-conscious policy confines them (§6.3.3's
//!   experiments measure the policies, not the affiliate);
//! - the runtime is shutting down (the submission is then refused).
//!
//! Slots for affiliates are allocated when the runtime is built
//! ([`RuntimeBuilder::affiliates`](crate::RuntimeBuilder::affiliates));
//! [`Handle::affiliate`](crate::Handle::affiliate) returns `None` when all
//! are taken (the caller then submits as usual) and a dropped affiliate
//! gives its slot back. Its counters stay in its slot, so
//! [`Runtime::metrics`](crate::Runtime::metrics) counts its tasks in their
//! groups and in [`MetricsSnapshot::affiliated`](crate::MetricsSnapshot).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::admission::Sigma;
use crate::error::SubmitError;
use crate::execute::{Executor, Local};
use crate::failure::Failure;
use crate::group::{GroupId, Priority};
use crate::policy::Policy;
use crate::runtime::Shared;
use crate::task::{Task, TaskCtx, WORKER, WorkerTls};

/// A thread's claim on an affiliate slot: runs tasks of its groups itself.
/// Not shared between threads (it holds the thread's continuations).
pub struct Affiliate {
    shared: Arc<Shared>,
    exec: Executor,
    local: Local,
}

impl std::fmt::Debug for Affiliate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Affiliate")
            .field("slot", &self.exec.index)
            .field("groups", &format_args!("{:#x}", self.local.groups))
            .finish()
    }
}

impl Affiliate {
    /// Claim a free slot for the groups `groups`.
    pub(crate) fn claim(shared: &Arc<Shared>, groups: &[GroupId]) -> Option<Self> {
        if crate::task::on_worker_thread() {
            // A worker runs tasks through its own scheduler.
            return None;
        }
        let index = shared.affiliate_slots.lock().pop()?;
        let mask = groups
            .iter()
            .filter(|g| g.index() < shared.groups.len())
            .fold(0u64, |m, g| m | g.bit());
        Some(Self {
            shared: Arc::clone(shared),
            exec: Executor::new(index),
            local: Local {
                groups: mask,
                tasks: Default::default(),
            },
        })
    }

    /// Run a task of `group` on this thread now if its admission allows,
    /// then its follow-ups of this affiliate's groups; queue for the pools
    /// whatever may not run here. `Err` only when the task itself is
    /// refused (as [`Handle::submit_named`](crate::Handle::submit_named)
    /// would refuse it); the refused task is dropped unrun.
    pub fn run_named(
        &mut self,
        group: GroupId,
        priority: Priority,
        kind: &'static str,
        body: impl FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send + 'static,
    ) -> Result<(), SubmitError> {
        let sh = Arc::clone(&self.shared);
        if group.index() >= sh.groups.len() {
            return Err(SubmitError::UnknownGroup(group));
        }
        if sh.shutdown.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let first = Task {
            body: Box::new(body),
            kind,
            group,
            priority,
        };
        let mut result = Ok(());
        let _tls = TlsGuard::enter(&sh, self.exec.index);
        let mut next = Some((first, priority));
        let mut is_first = true;
        while let Some((task, p)) = next
            .take()
            .or_else(|| self.local.tasks.borrow_mut().pop_front())
        {
            if let Some(task) = self.try_run(&sh, task) {
                let (g, kind) = (task.group, task.kind);
                if let Err(e) = sh.submit_task(g, p, kind, task.body, None) {
                    if is_first {
                        result = Err(e);
                    } else {
                        tracing::warn!(task = kind, error = %e,
                            "a follow-up task was refused by the runtime; it is dropped unrun");
                    }
                }
            }
            is_first = false;
        }
        result
    }

    /// Run `task` here if it may run here now; give it back otherwise.
    fn try_run(&mut self, sh: &Arc<Shared>, task: Task) -> Option<Task> {
        let g = task.group;
        let bit = g.bit();
        let group = &sh.groups[g.index()];
        if self.local.groups & bit == 0
            || sh.shutdown.load(Ordering::Relaxed)
            || group.faults.probability_threshold() != 0
            || group.faults.recovery_time().is_some()
            || sh.recovering.load(Ordering::SeqCst) & bit != 0
        {
            return Some(task);
        }
        let admitted = match sh.policy() {
            // The baseline ignores groups: no sigma, no reactive fence.
            Policy::Performance => group.admission.admit(0, Sigma::Count, &sh.suspended, 0),
            Policy::Dynamic => group
                .admission
                .admit(group.sigma, Sigma::Count, &sh.suspended, bit),
            Policy::Static | Policy::Partial => {
                group
                    .admission
                    .admit(group.sigma, Sigma::Enforce, &sh.suspended, bit)
            }
        };
        if !admitted {
            return Some(task);
        }
        self.exec.run_admitted(sh, task, Some(&self.local));
        None
    }
}

impl Drop for Affiliate {
    fn drop(&mut self) {
        // Continuations are only left over if a task body panicked past
        // the executor, which catches every panic: none remain.
        debug_assert!(self.local.tasks.borrow().is_empty());
        self.shared.affiliate_slots.lock().push(self.exec.index);
    }
}

/// The worker thread-local state an affiliate's tasks see while it runs
/// them (task-clock checks, lock observation, the panic hook).
struct TlsGuard;

impl TlsGuard {
    fn enter(shared: &Arc<Shared>, index: usize) -> Self {
        WORKER.with(|w| {
            *w.borrow_mut() = Some(WorkerTls {
                shared: Arc::clone(shared),
                index,
                group: std::cell::Cell::new(None),
                kind: std::cell::Cell::new(""),
            });
        });
        TlsGuard
    }
}

impl Drop for TlsGuard {
    fn drop(&mut self) {
        WORKER.with(|w| w.borrow_mut().take());
    }
}
