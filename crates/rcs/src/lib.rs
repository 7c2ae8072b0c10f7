//! # rcs: recovery-conscious scheduling
//!
//! A task runtime for a storage controller that must keep serving while one
//! of its components recovers from a software fault. It implements Seshadri
//! et al., *Enhancing Storage System Availability on Multi-Core Architectures
//! with Recovery-Conscious Scheduling* (FAST '08), `papers/rcs-recovery-conscious-scheduling.txt`:
//!
//! | paper | here |
//! |---|---|
//! | §3 task-level recovery: recovery points, clean-up blocks, strategies | [`TaskCtx::recovery_point`], [`TaskCtx::cleanup`], [`Strategy`] ([`recovery_point`](crate::recovery_point), [`cleanup`](crate::cleanup) modules) |
//! | §2.2 taxonomy of failures | [`FailureClass`] |
//! | §3.1 implicit dependencies, Figure 3 | [`TaskCtx::observe_lock`], [`refine`](crate::refine) |
//! | §4.1 recovery groups, resource pools | [`GroupSpec`], [`PoolId`], [`RuntimeBuilder::pools`] |
//! | §4.2 proactive RCS (sigma) | [`GroupSpec::sigma`], [`admission`](crate::admission) |
//! | §4.2 reactive RCS (suspend the recovering group) | [`RuntimeBuilder::reactive`], [`recovery`](crate::recovery) |
//! | Figures 6, 7 QoS loop counts | [`QosLoops`] |
//! | §5.1 static, §5.2 partial-dynamic (Figure 8, lease), §5.3 dynamic; the performance-oriented baseline | [`Policy`], the pool scheduler state machine (`scheduler`, driven by [`worker`](crate::worker) and by [`sim`]) |
//! | §6 the experiments at 8 (or 1024) processors | [`sim`]: the same scheduler on virtual processors, replaying a [`trace`] of the real controller |
//! | §2.2 time-outs: a task past its deadline | [`RuntimeBuilder::task_deadline`], [`deadline`] |
//! | §4.1 tasks on the pools' CPUs; caller-runs on threads outside them | [`Handle::affiliate`], [`affiliate`] |
//! | §6.3.3 fault injection (probability per dispatch, emulated recovery time) | [`GroupSpec::inject_faults`], [`Handle::inject`], [`fault`] |
//!
//! ## Model
//!
//! Every task belongs to exactly one recovery group. Each group has three
//! bounded job queues (high, medium, low) and a recoverability constraint
//! sigma. Worker threads are partitioned into resource pools; each worker
//! runs its pool's scheduler (Figure 7): a QoS loop over priorities whose
//! every scan picks a task according to the [`Policy`].
//!
//! A failure inside a task (an `Err(Failure)` or a panic) unwinds through its
//! recovery points: each runs its clean-up blocks, newest first and exactly
//! once, then applies its strategy (retry, ignore, abort, escalate). A
//! failure that escalates past the outermost recovery point starts *group
//! recovery*: the group's dispatch is suspended, its running tasks are told
//! (the cooperative [`TaskCtx::check`]) and clean up, its recovery handler
//! runs, and it resumes, while the other groups keep running on their pools.
//! A failure during recovery (a clean-up block or handler failing, a drain
//! timeout) escalates to the system-level callback the embedder installs
//! ([`RuntimeBuilder::system_recovery`]).
//!
//! ## Invariants
//!
//! - Under the static policy (and for isolated groups under partial-dynamic)
//!   no more than sigma tasks of a group run at once.
//! - With reactive scheduling on, no task of a recovering group starts while
//!   its recovery is in progress.
//! - Clean-up blocks run at most once each: newest first on failure, never
//!   on success.
//! - A group with queued work is dispatched within a bounded number of scans
//!   of a pool that serves it (round-robin within a priority; the QoS loop
//!   counts bound the wait across priorities).
//! - Queues are bounded; a full queue refuses a submission, it never drops a
//!   queued task.
//!
//! ## Example
//!
//! ```
//! use std::time::Duration;
//! use rcs::{Failure, GroupSpec, Priority, RecoveryPoint, RetryPolicy, Runtime, Strategy};
//!
//! static WRITE_TO_CACHE: RecoveryPoint = RecoveryPoint::new(
//!     "write-to-cache",
//!     Strategy::Retry(RetryPolicy::new(3, Duration::from_micros(10))),
//! );
//!
//! let mut builder = Runtime::builder();
//! builder.workers(2);
//! let cache = builder.group(GroupSpec::new("cache").sigma(1));
//! let runtime = builder.build().unwrap();
//! runtime.handle().submit(cache, Priority::High, |ctx| {
//!     let outcome = ctx.recovery_point(&WRITE_TO_CACHE, |ctx| {
//!         ctx.cleanup("release control block", || { /* give it back */ });
//!         ctx.check()?; // stop if the cache group is recovering
//!         Ok(42)
//!     })?;
//!     assert_eq!(outcome.done(), Some(42));
//!     Ok(())
//! }).unwrap();
//! assert!(runtime.shutdown(Duration::from_secs(5)));
//! ```

#![deny(unsafe_code)]

pub mod admission;
pub mod affiliate;
mod cleanup;
pub mod deadline;
mod error;
mod events;
mod execute;
mod failure;
pub mod fault;
mod group;
mod idle;
pub mod limits;
mod mapping;
mod metrics;
mod policy;
mod pool;
pub mod ready;
pub mod recovery;
pub mod recovery_point;
pub mod refine;
mod runtime;
mod scheduler;
pub mod sim;
mod sync;
mod task;
pub mod trace;
pub mod worker;

pub use affiliate::Affiliate;
pub use error::{BuildError, ControlError, SubmitError};
pub use events::{RecoveryEvent, RecoveryOutcome, RecoveryScope, SystemCause, SystemFailure};
pub use failure::{Disposition, Failure, FailureClass};
pub use group::{Alternative, GroupId, GroupRecovery, GroupSpec, Priority, RecoveryHandler};
pub use metrics::{GroupMetrics, LatencySummary, MetricsSnapshot, PoolMetrics};
pub use policy::{Policy, QosLoops};
pub use pool::{PoolId, proportional_mapping};
pub use recovery_point::{Outcome, RecoveryPoint, RetryPolicy, Strategy};
pub use runtime::{Handle, Runtime, RuntimeBuilder, SystemRecovery};
pub use task::{TaskCtx, current_task, observe_lock, on_worker_thread};
