//! A worker thread: one processor of a resource pool, running the pool
//! scheduler of Figures 7 and 8 over the runtime's shared queues.
//!
//! The decisions (the QoS round, `ScanDispatch` per policy, the lease, the
//! round-robin cursor) are made by the [`PoolScheduler`] state machine in
//! [`crate::scheduler`], the same code the simulator drives. This module is
//! the thread around it: the [`JobQueues`] view of the lock-free queues,
//! ready masks and admission counters, where a dispatch runs the task to
//! its end (see [`crate::execute`]); the busy-time accounting; and idling.
//!
//! Under every RCS policy, groups whose dispatch is suspended (reactive
//! scheduling) are skipped, and [admission](crate::admission) fences the race
//! with a recovery that starts concurrently.
//!
//! A round that finds nothing makes the worker spin a few rounds (no
//! yields), then park (see [`idle`](crate::idle)).

use std::sync::Arc;
use std::sync::Once;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::admission::Sigma;
use crate::execute::Executor;
use crate::group::Priority;
use crate::limits::{BUSY_FLUSH_DISPATCHES, PARK_TIMEOUT};
use crate::policy::Policy;
use crate::pool::PoolId;
use crate::runtime::Shared;
use crate::scheduler::{JobQueues, PoolScheduler, Rules, Step};
use crate::task::{IN_TASK, Task, WORKER, WorkerTls};

pub(crate) struct Worker {
    index: usize,
    bit: u64,
    scheduler: PoolScheduler,
    runner: Runner,
}

/// The part of a worker that runs dispatched tasks.
struct Runner {
    index: usize,
    exec: Executor,
    busy_since: Option<Instant>,
    dispatches_since_flush: u32,
}

/// The runtime's queues as one worker's scheduler sees them.
struct Live<'a> {
    sh: &'a Arc<Shared>,
    runner: &'a mut Runner,
}

/// Tasks queued in the structure the current policy does not use (a
/// submission that raced with a policy switch) are moved over.
fn migrate_stragglers(sh: &Shared, policy: Policy) {
    let stray = if policy == Policy::Performance {
        sh.group_ready.iter().any(|m| m.load() != 0)
    } else {
        sh.shared_ready.load() != 0
    };
    if stray {
        sh.migrate_queues(policy);
    }
}

fn rules(sh: &Shared) -> Rules<'_> {
    Rules {
        tables: &sh.mapping.tables,
        qos: sh.qos,
        lease_dispatches: sh.lease_dispatches,
    }
}

impl Worker {
    pub(crate) fn new(index: usize, pool: PoolId) -> Self {
        Self {
            index,
            bit: 1u64 << index,
            scheduler: PoolScheduler::new(pool.index(), index as u32),
            runner: Runner {
                index,
                exec: Executor::new(index),
                busy_since: None,
                dispatches_since_flush: 0,
            },
        }
    }

    /// The worker thread's main loop, until the runtime shuts down.
    pub(crate) fn run(mut self, shared: Arc<Shared>) {
        let sh = &shared;
        WORKER.with(|w| {
            *w.borrow_mut() = Some(WorkerTls {
                shared: Arc::clone(sh),
                index: self.index,
                group: std::cell::Cell::new(None),
                kind: std::cell::Cell::new(""),
            });
        });
        let mut idle_rounds = 0u32;
        let mut policy = sh.policy();
        while !sh.shutdown.load(Ordering::Acquire) {
            if self.scheduler.at_round_start() {
                policy = sh.policy();
                migrate_stragglers(sh, policy);
            }
            let mut live = Live {
                sh,
                runner: &mut self.runner,
            };
            if self.scheduler.next(&mut live, policy, rules(sh)) == Step::Dispatched {
                idle_rounds = 0;
                continue;
            }
            self.runner.end_busy_streak(sh);
            idle_rounds += 1;
            // A short spin catches work that arrives within microseconds; no
            // yields: on a machine with more runnable threads than cores a
            // yield is a context switch that makes no progress. Then park.
            if idle_rounds < sh.idle_spins {
                std::hint::spin_loop();
                continue;
            }
            self.park(sh, policy);
            idle_rounds = 0;
        }
        self.runner.end_busy_streak(sh);
        WORKER.with(|w| w.borrow_mut().take());
    }

    fn park(&mut self, sh: &Arc<Shared>, policy: Policy) {
        sh.idle.announce(self.bit);
        let live = Live {
            sh,
            runner: &mut self.runner,
        };
        if self.scheduler.has_work(&live, policy, rules(sh)) || sh.shutdown.load(Ordering::SeqCst) {
            sh.idle.retract(self.bit);
            return;
        }
        sh.workers[self.index].stats.parks.bump();
        std::thread::park_timeout(PARK_TIMEOUT);
        sh.idle.retract(self.bit);
    }
}

impl JobQueues for Live<'_> {
    #[inline]
    fn ready(&self, p: Priority) -> u64 {
        self.sh.group_ready[p.index()].load()
    }

    #[inline]
    fn shared_ready(&self, p: Priority) -> bool {
        self.sh.shared_ready.load() & (1u64 << p.index()) != 0
    }

    #[inline]
    fn suspended(&self) -> u64 {
        self.sh.suspended.load(Ordering::SeqCst)
    }

    #[inline]
    fn running(&self, g: u32) -> u32 {
        self.sh.groups[g as usize].admission.running()
    }

    #[inline]
    fn sigma(&self, g: u32) -> u32 {
        self.sh.groups[g as usize].sigma
    }

    fn dispatch_shared(&mut self, p: Priority) -> bool {
        let sh = self.sh;
        let queue = &sh.shared_queues[p.index()];
        match queue.pop() {
            Some(task) => {
                let group = &sh.groups[task.group.index()];
                // The baseline ignores groups: no sigma, no reactive fence.
                let admitted = group.admission.admit(0, Sigma::Count, &sh.suspended, 0);
                debug_assert!(admitted);
                self.runner.run_task(sh, task);
                true
            }
            None => {
                let bit = 1u64 << p.index();
                sh.shared_ready.clear_if_empty(bit, || queue.is_empty());
                false
            }
        }
    }

    fn dispatch(&mut self, g: u32, p: Priority, mode: Sigma) -> bool {
        let sh = self.sh;
        let group = &sh.groups[g as usize];
        let bit = 1u64 << g;
        let queue = &group.queues[p.index()];
        if queue.is_empty() {
            // A stale ready bit: shared reads only, no admission round trip.
            sh.group_ready[p.index()].clear_if_empty(bit, || queue.is_empty());
            return false;
        }
        if !group.admission.admit(group.sigma, mode, &sh.suspended, bit) {
            return false;
        }
        match queue.pop() {
            Some(task) => {
                debug_assert_eq!(task.group.index(), g as usize);
                self.runner.run_task(sh, task);
                true
            }
            None => {
                group.admission.release();
                sh.group_ready[p.index()].clear_if_empty(bit, || queue.is_empty());
                false
            }
        }
    }

    fn lease_acquired(&mut self) {
        self.sh.workers[self.runner.index].stats.leases.bump();
    }
}

impl Runner {
    /// Run an admitted task to its end (see [`crate::execute`]), within the
    /// worker's busy streak.
    fn run_task(&mut self, sh: &Arc<Shared>, task: Task) {
        if self.busy_since.is_none() {
            self.busy_since = Some(Instant::now());
        }
        self.exec.run_admitted(sh, task, None);
        self.dispatches_since_flush += 1;
        if self.dispatches_since_flush >= BUSY_FLUSH_DISPATCHES {
            self.end_busy_streak(sh);
        }
    }

    fn end_busy_streak(&mut self, sh: &Shared) {
        self.dispatches_since_flush = 0;
        if let Some(since) = self.busy_since.take() {
            let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
            sh.workers[self.index].stats.busy_ns.add(ns);
        }
    }
}

/// Panics inside task bodies are task failures, handled and counted by the
/// runtime; they are reported through `tracing` (DEBUG) instead of the default
/// hook's stderr message. Panics anywhere else go to the previous hook.
pub(crate) fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_TASK.with(|t| t.get()) {
                tracing::debug!(%info, "task panicked (handled as a task failure)");
            } else {
                previous(info);
            }
        }));
    });
}
