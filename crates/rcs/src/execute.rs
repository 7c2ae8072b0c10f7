//! Running one admitted task to its end: the part of dispatch that a pool
//! worker ([`crate::worker`]) and an affiliated thread ([`crate::affiliate`])
//! share.
//!
//! In order: count the dispatch; the §6.3.3 fault emulation (a task
//! dispatched while its group recovers, or running when a recovery begins,
//! takes the emulated recovery time; a fault fires at dispatch with the
//! group's probability); the body under `catch_unwind` with its context;
//! on failure the task's top-level clean-up blocks, newest first; then the
//! failure's disposition (group recovery, or system-level recovery); and
//! last the admission release. The release comes after the disposition so
//! that a recovery leader that is itself a task of the group counts itself
//! as one running task (`self_running` of `recover_group`).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::cleanup::CleanupStack;
use crate::failure::{Disposition, Failure, FailureClass};
use crate::group::{GroupId, Priority};
use crate::runtime::Shared;
use crate::task::{IN_TASK, Task, TaskCtx, WORKER};

/// Follow-up tasks a task submitted to groups its thread runs itself (an
/// affiliated thread's continuations; see [`crate::affiliate`]).
#[derive(Debug, Default)]
pub(crate) struct Local {
    /// The groups whose follow-ups stay on this thread.
    pub(crate) groups: u64,
    pub(crate) tasks: RefCell<VecDeque<(Task, Priority)>>,
}

/// The state of one thread that runs tasks: its slot in the runtime, its
/// random source for fault injection, its clean-up stack and its task clock
/// numbering.
pub(crate) struct Executor {
    /// Index of the thread's slot in `Shared::workers`.
    pub(crate) index: usize,
    rng: fastrand::Rng,
    cleanups: CleanupStack,
    /// Tasks this thread started under a deadline (numbers its task clock).
    tasks_started: u64,
}

impl Executor {
    pub(crate) fn new(index: usize) -> Self {
        Self {
            index,
            rng: fastrand::Rng::new(),
            cleanups: CleanupStack::default(),
            tasks_started: 0,
        }
    }

    /// Run an admitted task to its end, including fault emulation, its
    /// clean-ups on failure and the recovery its failure starts; release its
    /// admission. `local` keeps follow-ups on this thread (affiliates).
    pub(crate) fn run_admitted(&mut self, sh: &Arc<Shared>, task: Task, local: Option<&Local>) {
        let g = task.group;
        let group = &sh.groups[g.index()];
        sh.worker_counters(self.index, g).dispatched.bump();

        let emulated = group.faults.recovery_time();
        let epoch_at_start = emulated.map(|_| group.recovery_epoch.load(Ordering::SeqCst));
        let dispatched_in_recovery =
            emulated.is_some() && sh.recovering.load(Ordering::SeqCst) & g.bit() != 0;
        if let (true, Some(d)) = (dispatched_in_recovery, emulated) {
            // §6.3.3: tasks dispatched during the recovery take d as well.
            group.hold_for_recovery(d);
        }
        let injected =
            group.faults.probability_threshold() != 0 && group.faults.fires(self.rng.u32(..));
        let result = if injected {
            sh.worker_counters(self.index, g).injected.bump();
            drop(task);
            Err(Failure::internal_logic("fault injected at dispatch"))
        } else {
            self.execute(sh, task, local)
        };
        if let (Some(d), Some(epoch)) = (emulated, epoch_at_start)
            && !dispatched_in_recovery
            && !injected
            && group.recovery_epoch.load(Ordering::SeqCst) != epoch
        {
            // §6.3.3: tasks running when the recovery began take d as well.
            group.hold_for_recovery(d);
        }
        self.finish(sh, g, result);
        let before = group.admission.release();
        if local.is_some() && before >= group.sigma {
            // An affiliate ended a task of a group at its bound: a worker
            // may have parked on that group's queued tasks.
            sh.released_at_bound(g);
        }
    }

    /// Run the body with its context; on failure, unwind the task's
    /// top-level clean-up blocks.
    fn execute(
        &mut self,
        sh: &Arc<Shared>,
        task: Task,
        local: Option<&Local>,
    ) -> Result<(), Failure> {
        let Task {
            body,
            kind,
            group,
            priority,
        } = task;
        let traced_since = sh.trace.as_ref().map(|_| std::time::Instant::now());
        debug_assert!(
            self.cleanups.is_empty(),
            "clean-up stack leaked between tasks"
        );
        set_current(Some(group), kind);
        let mut ctx = TaskCtx {
            shared: sh,
            group,
            kind,
            worker: self.index,
            cleanups: &mut self.cleanups,
            local,
        };
        let clock = sh.task_deadline.map(|_| &sh.workers[self.index].clock);
        if let Some(c) = clock {
            self.tasks_started += 1;
            c.start(group.index(), self.tasks_started);
        }
        IN_TASK.with(|t| t.set(true));
        let outcome = catch_unwind(AssertUnwindSafe(|| body(&mut ctx)));
        IN_TASK.with(|t| t.set(false));
        let result = match outcome {
            Ok(result) => result,
            Err(payload) => Err(Failure::from_panic(&*payload)),
        };
        let result = match result {
            Ok(()) => {
                self.cleanups.discard_to(0);
                Ok(())
            }
            Err(failure) => match self.cleanups.unwind_to(0) {
                Ok(()) => Err(failure),
                Err(cleanup_failure) => Err(cleanup_failure),
            },
        };
        set_current(None, "");
        if let (Some(trace), Some(since)) = (&sh.trace, traced_since) {
            let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
            trace.record(group.index(), priority, ns);
        }
        if let Some(c) = clock {
            c.stop();
        }
        result
    }

    /// Account for the task's end; a failure at the top of the task becomes
    /// group recovery, or system-level recovery if it was headed there.
    fn finish(&mut self, sh: &Arc<Shared>, g: GroupId, result: Result<(), Failure>) {
        let counters = sh.worker_counters(self.index, g);
        let Err(failure) = result else {
            counters.completed.bump();
            return;
        };
        match (failure.class(), failure.disposition()) {
            (FailureClass::GroupRecovering, Disposition::Escalate | Disposition::Abort) => {
                counters.cancelled.bump();
            }
            (_, Disposition::Abort) => counters.aborted.bump(),
            (_, Disposition::System) => {
                counters.failed.bump();
                sh.escalate_system(Some(g), crate::events::SystemCause::TaskEscalated, failure);
            }
            (_, Disposition::Escalate) => {
                counters.failed.bump();
                sh.recover_group(g, failure, 1);
            }
        }
    }
}

/// Record the running task in the thread's thread-local state.
fn set_current(group: Option<GroupId>, kind: &'static str) {
    WORKER.with(|w| {
        if let Some(tls) = w.borrow().as_ref() {
            tls.group.set(group);
            tls.kind.set(kind);
        }
    });
}
