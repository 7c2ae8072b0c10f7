//! A worker thread: the pool scheduler of Figures 7 and 8.
//!
//! Each round is the QoS loop of Figure 7: up to `high_loop_count` scans of
//! the high-priority queues per medium scan, up to `medium_loop_count` times,
//! then one low scan. A loop stops early when its scans find nothing (the
//! remaining scans would find nothing either), so an idle priority costs one
//! load. `ScanDispatch(queue)` picks one task according to the policy:
//!
//! - performance: pop the shared queue of that priority (Figure 6);
//! - static: among the ready groups of the pool's static mapping, round-robin
//!   from a per-worker cursor, the first that admits under sigma;
//! - partial-dynamic (Figure 8): as static; if the static mapping has no work,
//!   acquire a lease and scan the alternative mapping (sigma kept only for
//!   isolated groups); the lease covers `lease_dispatches` dispatches, after
//!   which the pool returns to its static mapping first;
//! - dynamic: among all ready groups, round-robin, the first one under sigma;
//!   if every ready group is at or over sigma, the one with the fewest
//!   running tasks.
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
use crate::task::{IN_TASK, Task, WORKER, WorkerTls};

/// The next group of `mask` at or after `cursor`, cyclically.
#[inline]
pub(crate) fn next_round_robin(mask: u64, cursor: u32) -> u32 {
    debug_assert!(mask != 0);
    let c = cursor % 64;
    (mask.rotate_right(c).trailing_zeros() + c) % 64
}

pub(crate) struct Worker {
    index: usize,
    bit: u64,
    pool: PoolId,
    cursor: u32,
    lease_left: u32,
    exec: Executor,
    busy_since: Option<Instant>,
    dispatches_since_flush: u32,
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

impl Worker {
    pub(crate) fn new(index: usize, pool: PoolId) -> Self {
        Self {
            index,
            bit: 1u64 << index,
            pool,
            cursor: index as u32,
            lease_left: 0,
            exec: Executor::new(index),
            busy_since: None,
            dispatches_since_flush: 0,
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
        while !sh.shutdown.load(Ordering::Acquire) {
            let policy = sh.policy();
            migrate_stragglers(sh, policy);
            if self.round(sh, policy) {
                idle_rounds = 0;
                continue;
            }
            self.end_busy_streak(sh);
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
        self.end_busy_streak(sh);
        WORKER.with(|w| w.borrow_mut().take());
    }

    /// One QoS round (Figure 7). Whether any task was dispatched.
    fn round(&mut self, sh: &Arc<Shared>, policy: Policy) -> bool {
        let qos = sh.qos;
        let mut found = false;
        for _ in 0..qos.medium_loop_count {
            let mut found_high = false;
            for _ in 0..qos.high_loop_count {
                if !self.scan_dispatch(sh, policy, Priority::High) {
                    break;
                }
                found_high = true;
            }
            let found_medium = self.scan_dispatch(sh, policy, Priority::Medium);
            found |= found_high | found_medium;
            if !found_high && !found_medium {
                break;
            }
        }
        found |= self.scan_dispatch(sh, policy, Priority::Low);
        found
    }

    /// `ScanDispatch(queue)`: dispatch at most one task of priority `p`.
    fn scan_dispatch(&mut self, sh: &Arc<Shared>, policy: Policy, p: Priority) -> bool {
        match policy {
            Policy::Performance => self.dispatch_shared(sh, p),
            Policy::Static => {
                let groups = sh.mapping.pool_primary[self.pool.index()];
                self.dispatch_mapped(sh, p, groups, u64::MAX)
            }
            Policy::Partial => self.dispatch_partial(sh, p),
            Policy::Dynamic => self.dispatch_dynamic(sh, p),
        }
    }

    fn dispatch_shared(&mut self, sh: &Arc<Shared>, p: Priority) -> bool {
        let bit = 1u64 << p.index();
        if sh.shared_ready.load() & bit == 0 {
            return false;
        }
        let queue = &sh.shared_queues[p.index()];
        match queue.pop() {
            Some(task) => {
                let group = &sh.groups[task.group.index()];
                // The baseline ignores groups: no sigma, no reactive fence.
                let admitted = group.admission.admit(0, Sigma::Count, &sh.suspended, 0);
                debug_assert!(admitted);
                self.run_task(sh, task);
                true
            }
            None => {
                sh.shared_ready.clear_if_empty(bit, || queue.is_empty());
                false
            }
        }
    }

    /// Try to admit and run one task of group `g` at priority `p`.
    fn try_dispatch(&mut self, sh: &Arc<Shared>, g: u32, p: Priority, mode: Sigma) -> bool {
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
                self.run_task(sh, task);
                true
            }
            None => {
                group.admission.release();
                sh.group_ready[p.index()].clear_if_empty(bit, || queue.is_empty());
                false
            }
        }
    }

    /// Static scan over `groups`, enforcing sigma for the groups in
    /// `enforce`, round-robin from the worker's cursor.
    fn dispatch_mapped(
        &mut self,
        sh: &Arc<Shared>,
        p: Priority,
        groups: u64,
        enforce: u64,
    ) -> bool {
        let mut candidates =
            sh.group_ready[p.index()].load() & groups & !sh.suspended.load(Ordering::Relaxed);
        while candidates != 0 {
            let g = next_round_robin(candidates, self.cursor);
            candidates &= !(1u64 << g);
            let mode = if enforce & (1u64 << g) != 0 {
                Sigma::Enforce
            } else {
                Sigma::Count
            };
            if self.try_dispatch(sh, g, p, mode) {
                self.cursor = g + 1;
                return true;
            }
        }
        false
    }

    /// Figure 8: the static mapping first; without work there, the
    /// alternative mapping under a lease.
    fn dispatch_partial(&mut self, sh: &Arc<Shared>, p: Priority) -> bool {
        let pool = self.pool.index();
        let primary = sh.mapping.pool_primary[pool];
        let alternative = sh.mapping.pool_alternative[pool];
        let strict = sh.mapping.strict;
        if self.lease_left > 0 {
            if self.dispatch_mapped(sh, p, alternative, strict) {
                self.lease_left -= 1;
                return true;
            }
            self.lease_left = 0;
        }
        if self.dispatch_mapped(sh, p, primary, u64::MAX) {
            return true;
        }
        // AcquireLease()
        self.lease_left = sh.lease_dispatches;
        sh.workers[self.index].stats.leases.bump();
        if self.dispatch_mapped(sh, p, alternative, strict) {
            self.lease_left -= 1;
            return true;
        }
        self.lease_left = 0;
        false
    }

    /// §5.3: prefer groups under sigma; otherwise the fewest running.
    fn dispatch_dynamic(&mut self, sh: &Arc<Shared>, p: Priority) -> bool {
        let mut candidates =
            sh.group_ready[p.index()].load() & !sh.suspended.load(Ordering::Relaxed);
        let mut saturated = 0u64;
        while candidates != 0 {
            let g = next_round_robin(candidates, self.cursor);
            candidates &= !(1u64 << g);
            let group = &sh.groups[g as usize];
            if group.admission.running() >= group.sigma {
                saturated |= 1u64 << g;
                continue;
            }
            if self.try_dispatch(sh, g, p, Sigma::Count) {
                self.cursor = g + 1;
                return true;
            }
        }
        while saturated != 0 {
            let g = fewest_running(sh, saturated);
            saturated &= !(1u64 << g);
            if self.try_dispatch(sh, g, p, Sigma::Count) {
                self.cursor = g + 1;
                return true;
            }
        }
        false
    }

    /// Run an admitted task to its end (see [`crate::execute`]), within the
    /// worker's busy streak.
    fn run_task(&mut self, sh: &Arc<Shared>, task: Task) {
        self.start_busy_streak();
        self.exec.run_admitted(sh, task, None);
        self.dispatches_since_flush += 1;
        if self.dispatches_since_flush >= BUSY_FLUSH_DISPATCHES {
            self.end_busy_streak(sh);
        }
    }

    fn has_work(&self, sh: &Shared, policy: Policy) -> bool {
        if sh.shared_ready.load() != 0 {
            return true;
        }
        let pool = self.pool.index();
        let (groups, enforce) = match policy {
            Policy::Performance | Policy::Dynamic => (u64::MAX, false),
            Policy::Static => (sh.mapping.pool_primary[pool], true),
            Policy::Partial => (
                sh.mapping.pool_primary[pool] | sh.mapping.pool_alternative[pool],
                true,
            ),
        };
        let suspended = sh.suspended.load(Ordering::SeqCst);
        sh.group_ready.iter().any(|mask| {
            let mut ready = mask.load() & groups & !suspended;
            if enforce {
                // Groups at sigma cannot be dispatched here; the worker that
                // runs their task picks up their queue when it finishes.
                let mut m = ready;
                while m != 0 {
                    let g = m.trailing_zeros();
                    m &= !(1u64 << g);
                    let group = &sh.groups[g as usize];
                    if group.admission.running() >= group.sigma {
                        ready &= !(1u64 << g);
                    }
                }
            }
            ready != 0
        })
    }

    fn park(&mut self, sh: &Shared, policy: Policy) {
        sh.idle.announce(self.bit);
        if self.has_work(sh, policy) || sh.shutdown.load(Ordering::SeqCst) {
            sh.idle.retract(self.bit);
            return;
        }
        sh.workers[self.index].stats.parks.bump();
        std::thread::park_timeout(PARK_TIMEOUT);
        sh.idle.retract(self.bit);
    }

    #[inline]
    fn start_busy_streak(&mut self) {
        if self.busy_since.is_none() {
            self.busy_since = Some(Instant::now());
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

/// Among the groups of `mask`, the one with the fewest running tasks.
fn fewest_running(sh: &Shared, mask: u64) -> u32 {
    let mut best = (u32::MAX, mask.trailing_zeros());
    let mut m = mask;
    while m != 0 {
        let g = m.trailing_zeros();
        m &= !(1u64 << g);
        let running = sh.groups[g as usize].admission.running();
        if running < best.0 {
            best = (running, g);
        }
    }
    best.1
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
