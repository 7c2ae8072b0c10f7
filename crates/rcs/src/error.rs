//! Errors, one enum per kind of operation: building a runtime, submitting a
//! task, changing the policy or fault injection at run time.

use std::time::Duration;

use crate::group::{GroupId, Priority};
use crate::policy::Policy;

/// An invalid runtime configuration. Every problem is reported by name;
/// nothing is silently fixed.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Zero worker threads.
    #[error("the runtime needs at least one worker thread")]
    NoWorkers,
    /// More workers than the idle set can track.
    #[error("{workers} worker threads requested; at most {max} are supported")]
    TooManyWorkers {
        /// Requested.
        workers: usize,
        /// Supported.
        max: usize,
    },
    /// No recovery group was defined.
    #[error("the runtime needs at least one recovery group")]
    NoGroups,
    /// More groups than group masks can hold.
    #[error("{groups} recovery groups defined; at most {max} are supported")]
    TooManyGroups {
        /// Defined.
        groups: usize,
        /// Supported.
        max: usize,
    },
    /// A group with an empty name.
    #[error("recovery group #{index} has an empty name")]
    EmptyGroupName {
        /// Its index.
        index: usize,
    },
    /// Two groups with the same name.
    #[error("recovery group {name:?} is defined twice")]
    DuplicateGroup {
        /// The name.
        name: String,
    },
    /// Sigma of 0 would forbid the group from ever running.
    #[error(
        "recovery group {group:?} has sigma = 0; sigma is the most tasks of the group running at once and must be at least 1"
    )]
    SigmaZero {
        /// The group.
        group: String,
    },
    /// Sigma above [`SIGMA_MAX`](crate::limits::SIGMA_MAX).
    #[error("recovery group {group:?} has sigma = {sigma}; at most {max} is supported")]
    SigmaTooLarge {
        /// The group.
        group: String,
        /// Its sigma.
        sigma: u32,
        /// Supported.
        max: u32,
    },
    /// More pools than worker threads: some pool would be empty.
    #[error(
        "{pools} resource pools requested but only {workers} worker threads; every pool needs at least one worker"
    )]
    MorePoolsThanWorkers {
        /// Pools requested.
        pools: usize,
        /// Workers.
        workers: usize,
    },
    /// Explicit pool sizes that do not add up to the worker count.
    #[error("pool sizes {sizes:?} add up to {sum} workers, but the runtime has {workers}")]
    PoolSizesMismatch {
        /// The sizes given.
        sizes: Vec<usize>,
        /// Their sum.
        sum: usize,
        /// The worker count.
        workers: usize,
    },
    /// An explicit pool size of zero.
    #[error("resource pool #{pool} has size 0; every pool needs at least one worker")]
    EmptyPool {
        /// The pool.
        pool: usize,
    },
    /// A group mapped to a pool that does not exist.
    #[error(
        "recovery group {group:?} is mapped to pool #{pool}, but the runtime has {pools} pools (0..{pools})"
    )]
    UnknownPool {
        /// The group.
        group: String,
        /// The missing pool.
        pool: usize,
        /// Pools that exist.
        pools: usize,
    },
    /// A group with no pool under a policy that needs the static mapping.
    #[error(
        "recovery group {group:?} is mapped to no resource pool, which the {policy} policy needs (give it pools, or use the dynamic policy)"
    )]
    UnmappedGroup {
        /// The group.
        group: String,
        /// The policy.
        policy: Policy,
    },
    /// A lease of zero dispatches (partial-dynamic).
    #[error("the partial-dynamic lease must cover at least one dispatch (got 0)")]
    LeaseZero,
    /// A QoS loop count of zero or above the limit.
    #[error("QoS {which} loop count must be in 1..={max} (got {value})")]
    LoopCount {
        /// `high` or `medium`.
        which: &'static str,
        /// The value given.
        value: u32,
        /// The largest accepted.
        max: u32,
    },
    /// A queue capacity of zero or above the limit.
    #[error("job queue capacity must be in 1..={max} (got {value})")]
    QueueCapacity {
        /// The value given.
        value: usize,
        /// The largest accepted.
        max: usize,
    },
    /// A fault probability outside 0..=1.
    #[error("recovery group {group:?}: fault probability must be within 0..=1 (got {value})")]
    FaultProbability {
        /// The group.
        group: String,
        /// The value given.
        value: f64,
    },
    /// A drain timeout of zero.
    #[error("the recovery drain timeout must be positive (got {0:?})")]
    DrainTimeout(Duration),
    /// A task deadline of zero.
    #[error("the task deadline must be positive (got {0:?})")]
    TaskDeadline(Duration),
    /// A hung-task escalation without a deadline, or not after it.
    #[error("hung_after ({hung_after:?}) needs a task deadline shorter than it (got {deadline:?})")]
    HungAfter {
        /// The value given.
        hung_after: Duration,
        /// The task deadline, if any.
        deadline: Option<Duration>,
    },
    /// An idle spin count above the limit.
    #[error("idle spin count must be at most {max} (got {value})")]
    IdleSpins {
        /// The value given.
        value: u32,
        /// The largest accepted.
        max: u32,
    },
    /// More affiliate slots than the limit.
    #[error("{value} affiliate slots requested; at most {max} are supported")]
    Affiliates {
        /// The value given.
        value: usize,
        /// The largest accepted.
        max: usize,
    },
    /// The OS refused a worker thread.
    #[error("could not start worker thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Why a task was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The group id does not belong to this runtime.
    #[error("unknown recovery group {0}")]
    UnknownGroup(GroupId),
    /// The job queue is at its capacity (back-pressure: retry later).
    #[error("job queue of recovery group {group} at {priority} priority is full")]
    QueueFull {
        /// The group.
        group: GroupId,
        /// The priority.
        priority: Priority,
    },
    /// The runtime is shutting down.
    #[error("the runtime is shutting down")]
    ShuttingDown,
}

/// Why a run-time change was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ControlError {
    /// Switching to a policy whose static mapping is incomplete.
    #[error(
        "cannot switch to the {policy} policy: recovery group {group:?} is mapped to no resource pool"
    )]
    UnmappedGroup {
        /// The policy.
        policy: Policy,
        /// The unmapped group.
        group: String,
    },
    /// The group id does not belong to this runtime.
    #[error("unknown recovery group {0}")]
    UnknownGroup(GroupId),
    /// A fault probability outside 0..=1.
    #[error("fault probability must be within 0..=1 (got {0})")]
    FaultProbability(f64),
}
