//! The runtime: building it (with validation), the state its workers share,
//! and the [`Handle`] through which tasks are submitted and the runtime is
//! steered at run time.
//!
//! # Structure
//!
//! ```text
//!   submit(g, prio) ──► performance policy: shared queues [high, medium, low]
//!                   └─► RCS policies:       group g's queues [high, medium, low]
//!                                                  │ ready masks (one bit per queue)
//!   pool 0: worker 0 ─┐                            ▼
//!   pool 1: worker 1 ─┼─ QoS loop (Figure 7) ─► ScanDispatch per policy ─► admission (sigma,
//!   ...               ┘                                                     reactive fence) ─► run
//! ```
//!
//! Job queues are bounded (`crossbeam` array queues allocated at build
//! time); a full queue refuses the submission ([`SubmitError::QueueFull`]),
//! it never drops a task. Switching between the performance policy (shared
//! queues) and an RCS policy (per-group queues) migrates queued tasks; workers
//! migrate stragglers that raced with the switch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use crossbeam_utils::CachePadded;
use hdrhistogram::Histogram;
use parking_lot::Mutex;

use crate::admission::Admission;
use crate::deadline::TaskClock;
use crate::error::{BuildError, ControlError, SubmitError};
use crate::events::{RecoveryEvent, SystemFailure};
use crate::failure::Failure;
use crate::fault::GroupFaults;
use crate::group::{GroupId, GroupSpec, Priority, RecoveryHandler};
use crate::idle::IdleSet;
use crate::limits::{
    AFFILIATES_MAX, GROUPS_MAX, IDLE_SPINS_DEFAULT, IDLE_SPINS_MAX, LOOP_COUNT_MAX,
    QUEUE_CAPACITY_DEFAULT, QUEUE_CAPACITY_MAX, RECOVERY_EVENTS_MAX, SIGMA_MAX, WORKERS_MAX,
};
use crate::mapping::Mapping;
use crate::metrics::{
    GroupCounters, GroupMetrics, LatencySummary, MetricsSnapshot, PoolMetrics, WorkerStats,
    recovery_histogram,
};
use crate::policy::{Policy, QosLoops};
use crate::pool::{PoolId, PoolLayout};
use crate::ready::ReadyMask;
use crate::refine::{DependencyTracker, Refinement};
use crate::task::{Task, TaskBody, TaskCtx};
use crate::worker::Worker;

/// The embedder's system-level recovery callback.
pub type SystemRecovery = Arc<dyn Fn(&SystemFailure) + Send + Sync>;

/// Run-time state of one recovery group.
pub(crate) struct GroupState {
    pub(crate) name: String,
    pub(crate) sigma: u32,
    pub(crate) queues: [ArrayQueue<Task>; Priority::COUNT],
    pub(crate) admission: CachePadded<Admission>,
    /// Bumped when a recovery of the group begins.
    pub(crate) recovery_epoch: CachePadded<AtomicU64>,
    pub(crate) recoveries: AtomicU64,
    pub(crate) recovery_times_us: Mutex<Histogram<u64>>,
    /// Processor time held by the fault emulation's recoveries, in
    /// nanoseconds (see [`GroupState::hold_for_recovery`]).
    pub(crate) emulated_hold_ns: AtomicU64,
    pub(crate) faults: GroupFaults,
    pub(crate) handler: Option<RecoveryHandler>,
}

impl GroupState {
    /// Occupy the calling thread for the emulated recovery time `d`
    /// (§6.3.3) and count it as processor time the group's recoveries held.
    pub(crate) fn hold_for_recovery(&self, d: Duration) {
        crate::fault::spend(d);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.emulated_hold_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub(crate) fn queued(&self) -> [usize; 3] {
        [
            self.queues[0].len(),
            self.queues[1].len(),
            self.queues[2].len(),
        ]
    }
}

/// A worker as the rest of the runtime sees it.
pub(crate) struct WorkerSlot {
    pub(crate) thread: std::sync::OnceLock<Thread>,
    /// `None` for an affiliate's slot (see [`crate::affiliate`]).
    pub(crate) pool: Option<PoolId>,
    pub(crate) stats: CachePadded<WorkerStats>,
    /// Which task the worker runs and whether it is overdue (see
    /// [`crate::deadline`]).
    pub(crate) clock: CachePadded<TaskClock>,
}

/// State shared by the workers and every [`Handle`].
pub(crate) struct Shared {
    pub(crate) groups: Box<[CachePadded<GroupState>]>,
    /// The performance policy's shared queues.
    pub(crate) shared_queues: [ArrayQueue<Task>; Priority::COUNT],
    /// Per priority: groups whose queue may hold work.
    pub(crate) group_ready: [CachePadded<ReadyMask>; Priority::COUNT],
    /// Bit `p`: the shared queue of priority `p` may hold work.
    pub(crate) shared_ready: CachePadded<ReadyMask>,
    /// Groups whose dispatch is suspended and whose running tasks are told
    /// to clean up (reactive scheduling).
    pub(crate) suspended: CachePadded<AtomicU64>,
    /// Groups in recovery (the bit elects the recovery leader).
    pub(crate) recovering: CachePadded<AtomicU64>,
    pub(crate) idle: CachePadded<IdleSet>,
    pub(crate) policy: AtomicU8,
    pub(crate) reactive: AtomicBool,
    pub(crate) shutdown: AtomicBool,
    pub(crate) mapping: Mapping,
    pub(crate) qos: QosLoops,
    pub(crate) lease_dispatches: u32,
    pub(crate) drain_timeout: Duration,
    /// How long a task may run before it is declared past its deadline.
    pub(crate) task_deadline: Option<Duration>,
    pub(crate) idle_spins: u32,
    /// The pool workers' slots, then the affiliates' slots.
    pub(crate) workers: Box<[WorkerSlot]>,
    /// Free affiliate slots (indexes into `workers`).
    pub(crate) affiliate_slots: Mutex<Vec<usize>>,
    pub(crate) pool_sizes: Vec<usize>,
    pub(crate) system_recovery: SystemRecovery,
    pub(crate) events: Mutex<VecDeque<RecoveryEvent>>,
    pub(crate) event_seq: AtomicU64,
    pub(crate) system_escalations: AtomicU64,
    pub(crate) dependencies: Option<DependencyTracker>,
    /// Service times per group and priority, when tracing.
    pub(crate) trace: Option<crate::trace::Recorder>,
    pub(crate) started: Instant,
}

impl Shared {
    #[inline]
    pub(crate) fn policy(&self) -> Policy {
        Policy::from_u8(self.policy.load(Ordering::Relaxed))
    }

    #[inline]
    pub(crate) fn is_told(&self, group: GroupId) -> bool {
        self.suspended.load(Ordering::Relaxed) & group.bit() != 0
    }

    #[inline]
    pub(crate) fn worker_counters(&self, worker: usize, group: GroupId) -> &GroupCounters {
        &self.workers[worker].stats.groups[group.index()]
    }

    pub(crate) fn observe_lock(&self, kind: &'static str, group: GroupId, lock: u64) {
        if let Some(tracker) = &self.dependencies {
            tracker.observe(kind, group, lock);
        }
    }

    /// Enqueue a task and wake an eligible parked worker.
    pub(crate) fn submit_task(
        &self,
        group: GroupId,
        priority: Priority,
        kind: &'static str,
        body: TaskBody,
        submitter: Option<usize>,
    ) -> Result<(), SubmitError> {
        if self.shutdown.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let state = self
            .groups
            .get(group.index())
            .ok_or(SubmitError::UnknownGroup(group))?;
        let task = Task {
            body,
            kind,
            group,
            priority,
        };
        let p = priority.index();
        let policy = self.policy();
        let full = || SubmitError::QueueFull { group, priority };
        let eligible = self.mapping.eligible_workers(policy, group.index());
        // A worker that may run the task itself will, once its current task
        // ends; wake a peer only if the queue already had work.
        let runs_it_later = submitter.is_some_and(|w| eligible & (1u64 << w) != 0);
        let wake = |was_set: bool| {
            if (was_set || !runs_it_later)
                && let Some(w) = self.idle.claim_one(eligible)
            {
                self.unpark(w as usize);
            }
        };
        if policy == Policy::Performance {
            self.shared_queues[p].push(task).map_err(|_| full())?;
            self.shared_ready.mark_then(1 << p, wake);
        } else {
            state.queues[p].push(task).map_err(|_| full())?;
            self.group_ready[p].mark_then(group.bit(), wake);
        }
        Ok(())
    }

    pub(crate) fn wake_all(&self, eligible: u64) {
        let mut claimed = self.idle.claim_all(eligible);
        while claimed != 0 {
            let w = claimed.trailing_zeros();
            claimed &= !(1u64 << w);
            self.unpark(w as usize);
        }
    }

    fn unpark(&self, worker: usize) {
        if let Some(thread) = self.workers[worker].thread.get() {
            thread.unpark();
        }
    }

    /// A task of group `g` was released while the group was at its sigma
    /// bound, on a thread that is not a pool worker. Under an enforcing
    /// policy a worker parks when every ready group is at its bound
    /// ([`PoolScheduler::has_work`](crate::scheduler::PoolScheduler::has_work)),
    /// and a worker's own release is followed by its next scheduling round;
    /// an affiliate's is not, so it wakes one parked eligible worker if the
    /// group has queued tasks. Dekker's pattern again: the release is a
    /// SeqCst read-modify-write and the fence orders it before the loads,
    /// against the worker's announce, fence, re-check (see [`crate::idle`]).
    /// Only the enforcing policies park on bounded work, so under the
    /// others (the default, dynamic, among them) this is one load on the
    /// affiliate's hot path; a policy switch wakes every worker itself.
    pub(crate) fn released_at_bound(&self, g: GroupId) {
        let policy = self.policy();
        if !policy.needs_static_mapping() {
            return;
        }
        crate::sync::fence(crate::sync::Ordering::SeqCst);
        let queued = self
            .group_ready
            .iter()
            .any(|ready| ready.load() & g.bit() != 0);
        if queued
            && let Some(w) = self
                .idle
                .claim_one(self.mapping.eligible_workers(policy, g.index()))
        {
            self.unpark(w as usize);
        }
    }

    /// Move queued tasks from the per-group queues to the shared ones, or
    /// back, to match `policy`. Safe to run concurrently with submissions
    /// and with itself.
    pub(crate) fn migrate_queues(&self, policy: Policy) {
        for p in 0..Priority::COUNT {
            if policy == Policy::Performance {
                let mut ready = self.group_ready[p].load();
                while ready != 0 {
                    let g = ready.trailing_zeros() as usize;
                    ready &= !(1u64 << g);
                    let queue = &self.groups[g].queues[p];
                    while let Some(task) = queue.pop() {
                        push_spinning(&self.shared_queues[p], task);
                        self.shared_ready.mark(1 << p);
                    }
                    self.group_ready[p].clear_if_empty(1u64 << g, || queue.is_empty());
                }
            } else {
                let queue = &self.shared_queues[p];
                while let Some(task) = queue.pop() {
                    let g = task.group;
                    push_spinning(&self.groups[g.index()].queues[p], task);
                    self.group_ready[p].mark(g.bit());
                }
                self.shared_ready
                    .clear_if_empty(1 << p, || queue.is_empty());
            }
        }
    }

    pub(crate) fn push_event(&self, mut event: RecoveryEvent) {
        event.seq = self.event_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let mut events = self.events.lock();
        if events.len() == RECOVERY_EVENTS_MAX {
            events.pop_front();
        }
        events.push_back(event);
    }
}

/// Push, yielding while the queue is momentarily full (migration only: the
/// target has the room the source just gave up unless submissions race).
fn push_spinning(queue: &ArrayQueue<Task>, mut task: Task) {
    loop {
        match queue.push(task) {
            Ok(()) => return,
            Err(back) => {
                task = back;
                std::thread::yield_now();
            }
        }
    }
}

/// Builds a [`Runtime`]; every setting has a default except the groups.
///
/// ```
/// use rcs::{GroupSpec, Policy, PoolId, Priority, Runtime};
/// let mut builder = Runtime::builder();
/// builder.workers(2).policy(Policy::Static);
/// let cache = builder.group(GroupSpec::new("cache").sigma(1).pools([PoolId(0)]));
/// let device = builder.group(GroupSpec::new("device").sigma(1).pools([PoolId(1)]));
/// let runtime = builder.build().unwrap();
/// let handle = runtime.handle();
/// handle.submit(cache, Priority::High, |_ctx| Ok(())).unwrap();
/// handle.submit(device, Priority::Low, |_ctx| Ok(())).unwrap();
/// runtime.shutdown(std::time::Duration::from_secs(5));
/// ```
#[derive(Clone)]
pub struct RuntimeBuilder {
    workers: Option<usize>,
    pools: Option<usize>,
    pool_sizes: Option<Vec<usize>>,
    policy: Policy,
    reactive: bool,
    qos: QosLoops,
    lease_dispatches: u32,
    queue_capacity: usize,
    drain_timeout: Duration,
    task_deadline: Option<Duration>,
    hung_after: Option<Duration>,
    idle_spins: u32,
    affiliates: usize,
    groups: Vec<GroupSpec>,
    system_recovery: Option<SystemRecovery>,
    observe_dependencies: bool,
    trace_tasks: bool,
    thread_name: String,
}

impl std::fmt::Debug for RuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeBuilder")
            .field("workers", &self.workers)
            .field("pools", &self.pools)
            .field("pool_sizes", &self.pool_sizes)
            .field("policy", &self.policy)
            .field("reactive", &self.reactive)
            .field("qos", &self.qos)
            .field("lease_dispatches", &self.lease_dispatches)
            .field("queue_capacity", &self.queue_capacity)
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            workers: None,
            pools: None,
            pool_sizes: None,
            policy: Policy::Dynamic,
            reactive: true,
            qos: QosLoops::default(),
            lease_dispatches: 1,
            queue_capacity: QUEUE_CAPACITY_DEFAULT,
            drain_timeout: Duration::from_secs(1),
            task_deadline: None,
            hung_after: None,
            idle_spins: IDLE_SPINS_DEFAULT,
            affiliates: 0,
            groups: Vec::new(),
            system_recovery: None,
            observe_dependencies: false,
            trace_tasks: false,
            thread_name: "rcs-worker".to_owned(),
        }
    }
}

impl RuntimeBuilder {
    /// Worker threads (default: the number of cores).
    pub fn workers(&mut self, workers: usize) -> &mut Self {
        self.workers = Some(workers);
        self
    }

    /// Split the workers into `pools` pools of (nearly) equal size
    /// (default: one worker per pool).
    pub fn pools(&mut self, pools: usize) -> &mut Self {
        self.pools = Some(pools);
        self.pool_sizes = None;
        self
    }

    /// Explicit pool sizes; they must add up to the worker count.
    pub fn pool_sizes(&mut self, sizes: impl IntoIterator<Item = usize>) -> &mut Self {
        self.pool_sizes = Some(sizes.into_iter().collect());
        self.pools = None;
        self
    }

    /// The scheduling policy at start (default: dynamic).
    pub fn policy(&mut self, policy: Policy) -> &mut Self {
        self.policy = policy;
        self
    }

    /// Reactive scheduling: suspend a recovering group's dispatch and tell
    /// its running tasks (default: on; off for experiments).
    pub fn reactive(&mut self, reactive: bool) -> &mut Self {
        self.reactive = reactive;
        self
    }

    /// The QoS loop counts of Figures 6 and 7.
    pub fn qos(&mut self, qos: QosLoops) -> &mut Self {
        self.qos = qos;
        self
    }

    /// Partial-dynamic lease length in dispatches (default 1, the paper's
    /// "single dispatch cycle").
    pub fn lease_dispatches(&mut self, dispatches: u32) -> &mut Self {
        self.lease_dispatches = dispatches;
        self
    }

    /// Capacity of each job queue (default
    /// [`QUEUE_CAPACITY_DEFAULT`](crate::limits::QUEUE_CAPACITY_DEFAULT)).
    pub fn queue_capacity(&mut self, capacity: usize) -> &mut Self {
        self.queue_capacity = capacity;
        self
    }

    /// How long a group recovery waits for its running tasks to clean up
    /// before escalating to system level (default 1 s).
    pub fn drain_timeout(&mut self, timeout: Duration) -> &mut Self {
        self.drain_timeout = timeout;
        self
    }

    /// How long a task may run before the watchdog declares it past its
    /// deadline; it then fails with a time-out at its next cooperative
    /// check (see [`crate::deadline`]). `None` (the default): no watchdog.
    pub fn task_deadline(&mut self, deadline: Option<Duration>) -> &mut Self {
        self.task_deadline = deadline;
        self
    }

    /// A task still running this long (more than the
    /// [`task_deadline`](Self::task_deadline)) after it was dispatched has
    /// ignored its time-out: the watchdog starts a recovery of its group
    /// from outside, which, the hung task never draining, escalates to
    /// system level after the [`drain_timeout`](Self::drain_timeout) under
    /// reactive scheduling. `None` (the default): an overdue task is only
    /// marked and counted.
    pub fn hung_after(&mut self, after: Option<Duration>) -> &mut Self {
        self.hung_after = after;
        self
    }

    /// Scheduling rounds an idle worker spins through before it parks
    /// (default [`IDLE_SPINS_DEFAULT`](crate::limits::IDLE_SPINS_DEFAULT)).
    /// More spinning lowers wake-up latency and costs CPU that other
    /// threads of the machine could use.
    pub fn idle_spins(&mut self, rounds: u32) -> &mut Self {
        self.idle_spins = rounds;
        self
    }

    /// Slots for [affiliated threads](crate::affiliate): threads outside the
    /// pools (connection readers, say) that run tasks of some groups
    /// themselves through [`Handle::affiliate`] (default 0, at most
    /// [`AFFILIATES_MAX`](crate::limits::AFFILIATES_MAX)).
    pub fn affiliates(&mut self, slots: usize) -> &mut Self {
        self.affiliates = slots;
        self
    }

    /// Add a recovery group; returns its id.
    pub fn group(&mut self, spec: GroupSpec) -> GroupId {
        let id = GroupId(u8::try_from(self.groups.len()).unwrap_or(u8::MAX));
        self.groups.push(spec);
        id
    }

    /// The system-level recovery callback, run when a failure escalates past
    /// group recovery (default: log the failure at ERROR).
    pub fn system_recovery(
        &mut self,
        callback: impl Fn(&SystemFailure) + Send + Sync + 'static,
    ) -> &mut Self {
        self.system_recovery = Some(Arc::new(callback));
        self
    }

    /// Record `observe_lock` reports for scope refinement (default off).
    pub fn observe_dependencies(&mut self, on: bool) -> &mut Self {
        self.observe_dependencies = on;
        self
    }

    /// Record every task's service time per group and priority (default
    /// off), for [`Handle::task_trace`] and the simulator (see
    /// [`crate::trace`]).
    pub fn trace_tasks(&mut self, on: bool) -> &mut Self {
        self.trace_tasks = on;
        self
    }

    /// Prefix of worker thread names (default `rcs-worker`).
    pub fn thread_name(&mut self, prefix: impl Into<String>) -> &mut Self {
        self.thread_name = prefix.into();
        self
    }

    fn validate_groups(&self) -> Result<(), BuildError> {
        if self.groups.is_empty() {
            return Err(BuildError::NoGroups);
        }
        if self.groups.len() > GROUPS_MAX {
            return Err(BuildError::TooManyGroups {
                groups: self.groups.len(),
                max: GROUPS_MAX,
            });
        }
        let mut names = std::collections::HashSet::new();
        for (index, g) in self.groups.iter().enumerate() {
            if g.name.is_empty() {
                return Err(BuildError::EmptyGroupName { index });
            }
            if !names.insert(g.name.as_str()) {
                return Err(BuildError::DuplicateGroup {
                    name: g.name.clone(),
                });
            }
            if g.sigma == 0 {
                return Err(BuildError::SigmaZero {
                    group: g.name.clone(),
                });
            }
            if g.sigma > SIGMA_MAX {
                return Err(BuildError::SigmaTooLarge {
                    group: g.name.clone(),
                    sigma: g.sigma,
                    max: SIGMA_MAX,
                });
            }
            if !(0.0..=1.0).contains(&g.fault_probability) {
                return Err(BuildError::FaultProbability {
                    group: g.name.clone(),
                    value: g.fault_probability,
                });
            }
        }
        Ok(())
    }

    fn layout(&self) -> Result<PoolLayout, BuildError> {
        let workers = self
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if workers == 0 {
            return Err(BuildError::NoWorkers);
        }
        if workers > WORKERS_MAX {
            return Err(BuildError::TooManyWorkers {
                workers,
                max: WORKERS_MAX,
            });
        }
        let sizes = match (&self.pool_sizes, self.pools) {
            (Some(sizes), _) => {
                if let Some(pool) = sizes.iter().position(|&s| s == 0) {
                    return Err(BuildError::EmptyPool { pool });
                }
                let sum: usize = sizes.iter().sum();
                if sizes.len() > workers {
                    return Err(BuildError::MorePoolsThanWorkers {
                        pools: sizes.len(),
                        workers,
                    });
                }
                if sum != workers {
                    return Err(BuildError::PoolSizesMismatch {
                        sizes: sizes.clone(),
                        sum,
                        workers,
                    });
                }
                sizes.clone()
            }
            (None, Some(pools)) => {
                if pools == 0 {
                    return Err(BuildError::EmptyPool { pool: 0 });
                }
                if pools > workers {
                    return Err(BuildError::MorePoolsThanWorkers { pools, workers });
                }
                (0..pools)
                    .map(|i| workers / pools + usize::from(i < workers % pools))
                    .collect()
            }
            (None, None) => vec![1; workers],
        };
        Ok(PoolLayout { sizes })
    }

    fn validate_settings(&self, pools: usize) -> Result<(), BuildError> {
        for g in &self.groups {
            let all = g.pools.iter().chain(match &g.alternative {
                crate::group::Alternative::Pools(list) => list.as_slice(),
                _ => &[],
            });
            for pool in all {
                if pool.index() >= pools {
                    return Err(BuildError::UnknownPool {
                        group: g.name.clone(),
                        pool: pool.index(),
                        pools,
                    });
                }
            }
        }
        if self.policy.needs_static_mapping()
            && let Some(g) = self.groups.iter().find(|g| g.pools.is_empty())
        {
            return Err(BuildError::UnmappedGroup {
                group: g.name.clone(),
                policy: self.policy,
            });
        }
        if self.lease_dispatches == 0 {
            return Err(BuildError::LeaseZero);
        }
        for (which, value) in [
            ("high", self.qos.high_loop_count),
            ("medium", self.qos.medium_loop_count),
        ] {
            if value == 0 || value > LOOP_COUNT_MAX {
                return Err(BuildError::LoopCount {
                    which,
                    value,
                    max: LOOP_COUNT_MAX,
                });
            }
        }
        if self.queue_capacity == 0 || self.queue_capacity > QUEUE_CAPACITY_MAX {
            return Err(BuildError::QueueCapacity {
                value: self.queue_capacity,
                max: QUEUE_CAPACITY_MAX,
            });
        }
        if self.drain_timeout.is_zero() {
            return Err(BuildError::DrainTimeout(self.drain_timeout));
        }
        if let Some(d) = self.task_deadline.filter(|d| d.is_zero()) {
            return Err(BuildError::TaskDeadline(d));
        }
        if let Some(h) = self.hung_after
            && self.task_deadline.is_none_or(|d| h <= d)
        {
            return Err(BuildError::HungAfter {
                hung_after: h,
                deadline: self.task_deadline,
            });
        }
        if self.affiliates > AFFILIATES_MAX {
            return Err(BuildError::Affiliates {
                value: self.affiliates,
                max: AFFILIATES_MAX,
            });
        }
        if self.idle_spins > IDLE_SPINS_MAX {
            return Err(BuildError::IdleSpins {
                value: self.idle_spins,
                max: IDLE_SPINS_MAX,
            });
        }
        Ok(())
    }

    /// Validate the configuration and start the workers.
    pub fn build(&self) -> Result<Runtime, BuildError> {
        self.validate_groups()?;
        let layout = self.layout()?;
        self.validate_settings(layout.sizes.len())?;
        crate::worker::install_panic_hook();

        let pool_of_worker = layout.pool_of_workers();
        let mapping = Mapping::new(&self.groups, &pool_of_worker, layout.sizes.len());
        let shared_capacity = self.queue_capacity.saturating_mul(self.groups.len());
        // Popped from the end: the lowest slot first.
        let affiliate_slots = (pool_of_worker.len()..pool_of_worker.len() + self.affiliates)
            .rev()
            .collect();
        let shared = Arc::new(Shared {
            groups: self.group_states(),
            shared_queues: std::array::from_fn(|_| ArrayQueue::new(shared_capacity)),
            group_ready: std::array::from_fn(|_| CachePadded::new(ReadyMask::new())),
            shared_ready: CachePadded::new(ReadyMask::new()),
            suspended: CachePadded::new(AtomicU64::new(0)),
            recovering: CachePadded::new(AtomicU64::new(0)),
            idle: CachePadded::new(IdleSet::new()),
            policy: AtomicU8::new(self.policy.to_u8()),
            reactive: AtomicBool::new(self.reactive),
            shutdown: AtomicBool::new(false),
            mapping,
            qos: self.qos,
            lease_dispatches: self.lease_dispatches,
            drain_timeout: self.drain_timeout,
            task_deadline: self.task_deadline,
            idle_spins: self.idle_spins,
            workers: self.worker_slots(&pool_of_worker),
            affiliate_slots: Mutex::new(affiliate_slots),
            pool_sizes: layout.sizes.clone(),
            system_recovery: self.system_recovery_or_log(),
            events: Mutex::new(VecDeque::with_capacity(RECOVERY_EVENTS_MAX)),
            event_seq: AtomicU64::new(0),
            system_escalations: AtomicU64::new(0),
            dependencies: self.observe_dependencies.then(DependencyTracker::default),
            trace: self.trace_tasks.then(|| {
                crate::trace::Recorder::new(self.groups.iter().map(|g| g.name.clone()).collect())
            }),
            started: Instant::now(),
        });
        let mut threads = Vec::with_capacity(pool_of_worker.len());
        let spawned = self
            .spawn_workers(&shared, &pool_of_worker, &mut threads)
            .and_then(|()| self.spawn_watchdog(&shared, &mut threads));
        let runtime = Runtime {
            handle: Handle { shared },
            threads,
        };
        match spawned {
            Ok(()) => Ok(runtime),
            Err(e) => {
                // Stops the threads already started.
                drop(runtime);
                Err(BuildError::Spawn(e))
            }
        }
    }

    /// Each group's run-time state, its job queues allocated here.
    fn group_states(&self) -> Box<[CachePadded<GroupState>]> {
        let capacity = self.queue_capacity;
        self.groups
            .iter()
            .map(|spec| {
                CachePadded::new(GroupState {
                    name: spec.name.clone(),
                    sigma: spec.sigma,
                    queues: std::array::from_fn(|_| ArrayQueue::new(capacity)),
                    admission: CachePadded::new(Admission::new()),
                    recovery_epoch: CachePadded::new(AtomicU64::new(0)),
                    recoveries: AtomicU64::new(0),
                    recovery_times_us: Mutex::new(recovery_histogram()),
                    emulated_hold_ns: AtomicU64::new(0),
                    faults: GroupFaults::new(spec.fault_probability, spec.fault_recovery_time),
                    handler: spec.handler.clone(),
                })
            })
            .collect()
    }

    /// The pool workers' slots, then the affiliates' slots.
    fn worker_slots(&self, pool_of_worker: &[PoolId]) -> Box<[WorkerSlot]> {
        pool_of_worker
            .iter()
            .map(|&pool| Some(pool))
            .chain(std::iter::repeat_n(None, self.affiliates))
            .map(|pool| WorkerSlot {
                thread: std::sync::OnceLock::new(),
                pool,
                stats: CachePadded::new(WorkerStats::new(self.groups.len())),
                clock: CachePadded::new(TaskClock::default()),
            })
            .collect()
    }

    /// The installed system-level recovery callback, or one that logs.
    fn system_recovery_or_log(&self) -> SystemRecovery {
        self.system_recovery.clone().unwrap_or_else(|| {
            Arc::new(|failure: &SystemFailure| {
                tracing::error!(
                    cause = failure.cause.name(),
                    failure = %failure.failure,
                    "system-level recovery requested, but no callback is installed"
                );
            })
        })
    }

    /// Start one thread per pool worker, pushing each onto `threads`; stops
    /// at the first that fails to start.
    fn spawn_workers(
        &self,
        shared: &Arc<Shared>,
        pool_of_worker: &[PoolId],
        threads: &mut Vec<JoinHandle<()>>,
    ) -> std::io::Result<()> {
        for (index, &pool) in pool_of_worker.iter().enumerate() {
            let for_worker = Arc::clone(shared);
            let handle = std::thread::Builder::new()
                .name(format!("{}-{index}", self.thread_name))
                .spawn(move || Worker::new(index, pool).run(for_worker))?;
            let _ = shared.workers[index].thread.set(handle.thread().clone());
            threads.push(handle);
        }
        Ok(())
    }

    /// Start the deadline watchdog, if a task deadline is set.
    fn spawn_watchdog(
        &self,
        shared: &Arc<Shared>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> std::io::Result<()> {
        if let Some(deadline) = self.task_deadline {
            let hung_after = self.hung_after;
            let for_watchdog = Arc::clone(shared);
            let handle = std::thread::Builder::new()
                .name(format!("{}-watchdog", self.thread_name))
                .spawn(move || crate::deadline::watchdog(for_watchdog, deadline, hung_after))?;
            threads.push(handle);
        }
        Ok(())
    }
}

/// A running recovery-conscious runtime. Dropping it stops the workers and
/// drops the tasks still queued; [`Runtime::shutdown`] lets them run first.
pub struct Runtime {
    handle: Handle,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("workers", &self.handle.shared.workers.len())
            .field("policy", &self.handle.policy())
            .finish()
    }
}

impl Runtime {
    /// A builder with the defaults.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A handle for submitting tasks and steering the runtime.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Stop accepting tasks, let queued and running ones finish (waiting at
    /// most `timeout`), then stop the workers. Returns whether everything
    /// finished in time.
    pub fn shutdown(mut self, timeout: Duration) -> bool {
        let drained = self.handle.wait_idle(timeout);
        self.stop();
        drained
    }

    fn stop(&mut self) {
        let shared = &self.handle.shared;
        shared.shutdown.store(true, Ordering::SeqCst);
        shared.wake_all(u64::MAX);
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("an rcs worker thread panicked outside any task");
            }
        }
        for p in 0..Priority::COUNT {
            while shared.shared_queues[p].pop().is_some() {}
            for g in shared.groups.iter() {
                while g.queues[p].pop().is_some() {}
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A cloneable handle to a runtime.
#[derive(Clone)]
pub struct Handle {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("policy", &self.policy())
            .finish()
    }
}

impl Handle {
    /// Submit a task to `group` at `priority`. Fails, without blocking, when
    /// the group's queue is full ([`SubmitError::QueueFull`]; the task is
    /// dropped, so whatever it owned is released).
    pub fn submit(
        &self,
        group: GroupId,
        priority: Priority,
        body: impl FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send + 'static,
    ) -> Result<(), SubmitError> {
        let kind = std::any::type_name_of_val(&body);
        self.shared
            .submit_task(group, priority, kind, Box::new(body), None)
    }

    /// Submit a task with an explicit kind (used by scope refinement and in
    /// logs).
    pub fn submit_named(
        &self,
        group: GroupId,
        priority: Priority,
        kind: &'static str,
        body: impl FnOnce(&mut TaskCtx<'_>) -> Result<(), Failure> + Send + 'static,
    ) -> Result<(), SubmitError> {
        self.shared
            .submit_task(group, priority, kind, Box::new(body), None)
    }

    /// Claim an [affiliate](crate::affiliate) slot for the calling thread:
    /// it then runs tasks of `groups` itself when their admission allows.
    /// `None` when every slot is taken (or none were built), or on a worker
    /// thread; submit as usual then.
    pub fn affiliate(&self, groups: &[GroupId]) -> Option<crate::Affiliate> {
        crate::Affiliate::claim(&self.shared, groups)
    }

    /// The id of the group named `name`.
    pub fn group_id(&self, name: &str) -> Option<GroupId> {
        self.shared
            .groups
            .iter()
            .position(|g| g.name == name)
            .map(|i| GroupId(i as u8))
    }

    /// The groups, in id order.
    pub fn groups(&self) -> Vec<(GroupId, String)> {
        self.shared
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| (GroupId(i as u8), g.name.clone()))
            .collect()
    }

    /// The policy in force.
    pub fn policy(&self) -> Policy {
        self.shared.policy()
    }

    /// Switch the scheduling policy. Queued tasks follow.
    pub fn set_policy(&self, policy: Policy) -> Result<(), ControlError> {
        if policy.needs_static_mapping()
            && let Some(g) = self.shared.mapping.tables.first_unmapped
        {
            return Err(ControlError::UnmappedGroup {
                policy,
                group: self.shared.groups[g].name.clone(),
            });
        }
        self.shared.policy.store(policy.to_u8(), Ordering::SeqCst);
        self.shared.migrate_queues(policy);
        self.shared.wake_all(u64::MAX);
        Ok(())
    }

    /// Whether reactive scheduling is on.
    pub fn reactive(&self) -> bool {
        self.shared.reactive.load(Ordering::Relaxed)
    }

    /// Switch reactive scheduling (takes effect at the next recovery).
    pub fn set_reactive(&self, on: bool) {
        self.shared.reactive.store(on, Ordering::Relaxed);
    }

    /// Set fault injection for `group` (see
    /// [`GroupSpec::inject_faults`]); probability 0 turns it off.
    pub fn inject(
        &self,
        group: GroupId,
        probability: f64,
        recovery_time: Duration,
    ) -> Result<(), ControlError> {
        if !(0.0..=1.0).contains(&probability) {
            return Err(ControlError::FaultProbability(probability));
        }
        let state = self
            .shared
            .groups
            .get(group.index())
            .ok_or(ControlError::UnknownGroup(group))?;
        state.faults.set(probability, recovery_time);
        Ok(())
    }

    /// Start a recovery of `group` from outside its tasks (e.g. a failure
    /// detected by a monitor). Runs on the calling thread and returns when
    /// the group has resumed.
    pub fn recover_group(&self, group: GroupId, failure: Failure) -> Result<(), ControlError> {
        if group.index() >= self.shared.groups.len() {
            return Err(ControlError::UnknownGroup(group));
        }
        self.shared.recover_group(group, failure, 0);
        Ok(())
    }

    /// Wait until no task is queued or running, at most `timeout`; whether
    /// that happened.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let busy =
                self.shared.shared_queues.iter().any(|q| !q.is_empty())
                    || self.shared.groups.iter().any(|g| {
                        g.admission.running() > 0 || g.queues.iter().any(|q| !q.is_empty())
                    });
            if !busy {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The most recent recovery events, oldest first.
    pub fn recent_events(&self) -> Vec<RecoveryEvent> {
        self.shared.events.lock().iter().cloned().collect()
    }

    /// The scope refinement proposed from `observe_lock` reports so far
    /// (empty unless built with `observe_dependencies(true)`).
    pub fn refinement(&self) -> Refinement<&'static str> {
        self.shared
            .dependencies
            .as_ref()
            .map_or_else(|| crate::refine::refine(Vec::new()), |d| d.refinement())
    }

    /// The task trace recorded so far (`None` unless built with
    /// [`RuntimeBuilder::trace_tasks`]).
    pub fn task_trace(&self) -> Option<crate::trace::TaskTrace> {
        self.shared
            .trace
            .as_ref()
            .map(crate::trace::Recorder::snapshot)
    }

    /// A snapshot of the metrics.
    pub fn metrics(&self) -> MetricsSnapshot {
        let shared = &self.shared;
        let recovering = shared.recovering.load(Ordering::Relaxed);
        let groups = shared
            .groups
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let sum = |f: fn(&GroupCounters) -> u64| -> u64 {
                    shared.workers.iter().map(|w| f(&w.stats.groups[i])).sum()
                };
                GroupMetrics {
                    id: GroupId(i as u8),
                    name: g.name.clone(),
                    sigma: g.sigma,
                    dispatched: sum(|c| c.dispatched.get()),
                    completed: sum(|c| c.completed.get()),
                    failed: sum(|c| c.failed.get()),
                    aborted: sum(|c| c.aborted.get()),
                    cancelled: sum(|c| c.cancelled.get()),
                    retried: sum(|c| c.retried.get()),
                    ignored: sum(|c| c.ignored.get()),
                    injected: sum(|c| c.injected.get()),
                    overdue: sum(|c| c.overdue.get()),
                    recoveries: g.recoveries.load(Ordering::Relaxed),
                    running: g.admission.running(),
                    queued: g.queued(),
                    recovering: recovering & (1u64 << i) != 0,
                    fault_probability: g.faults.probability(),
                    recovery_time: LatencySummary::from_micros(&g.recovery_times_us.lock()),
                    emulated_hold: Duration::from_nanos(g.emulated_hold_ns.load(Ordering::Relaxed)),
                }
            })
            .collect();
        let pools = shared
            .pool_sizes
            .iter()
            .enumerate()
            .map(|(p, &size)| {
                let members = shared
                    .workers
                    .iter()
                    .filter(|w| w.pool == Some(PoolId(p as u16)));
                let mut m = PoolMetrics {
                    id: PoolId(p as u16),
                    workers: size,
                    dispatched: 0,
                    busy: Duration::ZERO,
                    parks: 0,
                    leases: 0,
                };
                for w in members {
                    m.dispatched += w
                        .stats
                        .groups
                        .iter()
                        .map(|c| c.dispatched.get())
                        .sum::<u64>();
                    m.busy += Duration::from_nanos(w.stats.busy_ns.get());
                    m.parks += w.stats.parks.get();
                    m.leases += w.stats.leases.get();
                }
                m
            })
            .collect();
        MetricsSnapshot {
            policy: shared.policy(),
            reactive: shared.reactive.load(Ordering::Relaxed),
            uptime: shared.started.elapsed(),
            groups,
            pools,
            shared_queued: std::array::from_fn(|p| shared.shared_queues[p].len()),
            system_escalations: shared.system_escalations.load(Ordering::Relaxed),
            affiliated: shared
                .workers
                .iter()
                .filter(|w| w.pool.is_none())
                .flat_map(|w| w.stats.groups.iter().map(|c| c.dispatched.get()))
                .sum(),
        }
    }

    /// The recovery-time histogram of `group`, in microseconds.
    pub fn recovery_histogram(&self, group: GroupId) -> Option<Histogram<u64>> {
        self.shared
            .groups
            .get(group.index())
            .map(|g| g.recovery_times_us.lock().clone())
    }
}
