//! Tasks: short units of work (microseconds) that belong to one recovery
//! group (paper §2.1: "a large number of asynchronous, short-running threads
//! (~µsecs). We refer to each of these threads as a 'task'").
//!
//! A task is a closure `FnOnce(&mut TaskCtx) -> Result<(), Failure>`. Its
//! [`TaskCtx`] gives it the task-level recovery framework: recovery points
//! ([`TaskCtx::recovery_point`]), clean-up blocks ([`TaskCtx::cleanup`]), the
//! cooperative check that its group is recovering ([`TaskCtx::check`]), the
//! implicit-dependency hook ([`TaskCtx::observe_lock`]) and submission of
//! follow-up tasks.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use crate::cleanup::CleanupStack;
use crate::error::SubmitError;
use crate::failure::Failure;
use crate::group::{GroupId, Priority};
use crate::runtime::Shared;

/// The body of a task.
pub(crate) type TaskBody = Box<dyn FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send>;

/// A queued task.
pub(crate) struct Task {
    pub(crate) body: TaskBody,
    pub(crate) kind: &'static str,
    pub(crate) group: GroupId,
    /// The queue it was submitted to (recorded by task traces).
    pub(crate) priority: Priority,
}

impl std::fmt::Debug for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Task")
            .field("kind", &self.kind)
            .field("group", &self.group)
            .finish()
    }
}

/// What a running task can reach of its runtime.
pub struct TaskCtx<'a> {
    pub(crate) shared: &'a Arc<Shared>,
    pub(crate) group: GroupId,
    pub(crate) kind: &'static str,
    pub(crate) worker: usize,
    pub(crate) cleanups: &'a mut CleanupStack,
    /// On an affiliated thread: follow-ups of the groups it runs stay here.
    pub(crate) local: Option<&'a crate::execute::Local>,
}

impl std::fmt::Debug for TaskCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskCtx")
            .field("group", &self.group)
            .field("kind", &self.kind)
            .field("worker", &self.worker)
            .field("cleanups", &self.cleanups)
            .finish()
    }
}

impl TaskCtx<'_> {
    /// The task's recovery group.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The task's kind (its name at submission, or its closure's type name).
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// Index of the worker thread running the task.
    pub fn worker_index(&self) -> usize {
        self.worker
    }

    /// Register a clean-up block in the innermost recovery point (or at the
    /// task's top level). It runs, newest first and once, only if a failure
    /// unwinds through that point; on success it is dropped unrun.
    pub fn cleanup(&mut self, name: &'static str, action: impl FnOnce() + 'static) {
        self.cleanups.push(name, Box::new(action));
    }

    /// Whether the task's group is in recovery and the task has been told to
    /// clean up (reactive scheduling on). One relaxed load.
    #[inline]
    pub fn is_recovering(&self) -> bool {
        self.shared.is_told(self.group)
    }

    /// The cooperative check: `Err` of class
    /// [`GroupRecovering`](crate::FailureClass::GroupRecovering) when the
    /// task's group entered recovery, of class
    /// [`Timeout`](crate::FailureClass::Timeout) when the watchdog declared
    /// the task past its deadline ([`crate::deadline`]). Propagate it with
    /// `?`: the task unwinds through its clean-up blocks, and its recovery
    /// points or its group's recovery decide what follows.
    #[inline]
    pub fn check(&self) -> Result<(), Failure> {
        if self.is_recovering() {
            Err(Failure::group_recovering())
        } else if self.shared.workers[self.worker].clock.is_overdue() {
            Err(Failure::timeout(format!(
                "task {} past its deadline",
                self.kind
            )))
        } else {
            Ok(())
        }
    }

    /// Report that the task used lock `lock` (section 3.1's implicit
    /// dependencies). Recorded only when the runtime was built with
    /// [`observe_dependencies`](crate::RuntimeBuilder::observe_dependencies).
    pub fn observe_lock(&self, lock: u64) {
        self.shared.observe_lock(self.kind, self.group, lock);
    }

    /// Submit a follow-up task (see [`Handle::submit`](crate::Handle::submit)).
    /// If this worker may run it, no parked peer is woken for it while its
    /// queue was empty: this worker dispatches it when the current task ends.
    /// On an [affiliated thread](crate::Affiliate), a follow-up of a group
    /// the thread runs stays on it: it runs there when the current task ends
    /// if admission allows then, and is queued for the pools otherwise.
    pub fn submit(
        &self,
        group: GroupId,
        priority: Priority,
        body: impl FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send + 'static,
    ) -> Result<(), SubmitError> {
        let kind = std::any::type_name_of_val(&body);
        self.submit_named(group, priority, kind, body)
    }

    /// [`TaskCtx::submit`] with an explicit kind.
    pub fn submit_named(
        &self,
        group: GroupId,
        priority: Priority,
        kind: &'static str,
        body: impl FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send + 'static,
    ) -> Result<(), SubmitError> {
        if let Some(local) = self.local
            && local.groups & group.bit() != 0
        {
            if self
                .shared
                .shutdown
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                return Err(SubmitError::ShuttingDown);
            }
            let task = Task {
                body: Box::new(body),
                kind,
                group,
                priority,
            };
            local.tasks.borrow_mut().push_back((task, priority));
            return Ok(());
        }
        // An affiliate is no pool worker: it never runs a queued task later.
        let submitter = self.local.is_none().then_some(self.worker);
        self.shared
            .submit_task(group, priority, kind, Box::new(body), submitter)
    }

    /// A handle to the runtime, for work that outlives the task.
    pub fn handle(&self) -> crate::Handle {
        crate::Handle {
            shared: Arc::clone(self.shared),
        }
    }

    pub(crate) fn note_retry(&self) {
        self.shared
            .worker_counters(self.worker, self.group)
            .retried
            .bump();
    }

    pub(crate) fn note_ignored(&self) {
        self.shared
            .worker_counters(self.worker, self.group)
            .ignored
            .bump();
    }
}

/// Per-thread state of a worker, reachable from code that has no `TaskCtx`
/// (a lock library reporting an acquisition, the panic hook).
pub(crate) struct WorkerTls {
    pub(crate) shared: Arc<Shared>,
    /// Index of this worker in the runtime.
    pub(crate) index: usize,
    pub(crate) group: Cell<Option<GroupId>>,
    pub(crate) kind: Cell<&'static str>,
}

thread_local! {
    pub(crate) static WORKER: RefCell<Option<WorkerTls>> = const { RefCell::new(None) };
    /// Set while a task body runs on this thread: panics are then task
    /// failures, reported through tracing instead of the default hook.
    pub(crate) static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The task running on the current thread, if it is a worker of an rcs
/// runtime: its group and kind.
pub fn current_task() -> Option<(GroupId, &'static str)> {
    WORKER.with(|w| {
        let w = w.borrow();
        let tls = w.as_ref()?;
        Some((tls.group.get()?, tls.kind.get()))
    })
}

/// Report that the task running on this thread used lock `lock` (section 3.1's
/// implicit dependencies), for code that has no [`TaskCtx`] at hand. A no-op
/// outside rcs tasks.
pub fn observe_lock(lock: u64) {
    WORKER.with(|w| {
        let w = w.borrow();
        if let Some(tls) = w.as_ref()
            && let Some(group) = tls.group.get()
        {
            tls.shared.observe_lock(tls.kind.get(), group, lock);
        }
    });
}

/// Whether the current thread is a worker of an rcs runtime.
pub fn on_worker_thread() -> bool {
    WORKER.with(|w| w.borrow().is_some())
}
