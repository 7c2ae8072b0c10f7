//! A discrete-event simulator of recovery-conscious scheduling: the real
//! pool scheduler ([`crate::scheduler`]) on N virtual processors with a
//! virtual clock, so the policies of Seshadri et al. (FAST '08, §5) can be
//! measured at 8 to 1024 processors on a host that has 2.
//!
//! # Model
//!
//! - **Processors.** `cpus` virtual processors, one per resource pool (the
//!   paper: "a pool size of 1 CPU which resulted in 8 pools"). Each runs a
//!   [`PoolScheduler`](crate::scheduler::PoolScheduler), the same state
//!   machine the runtime's workers run; a dispatch costs `dispatch_ns` of
//!   processor time besides the task's own service time.
//! - **Groups.** Those of the [`Workload`]. As `rebound bench rcs` and the
//!   paper (§6.1): the static mapping is proportional to each group's share
//!   of the dispatches ([`proportional_mapping`](crate::proportional_mapping)),
//!   sigma is the group's share of the processors (at least 1), and the
//!   partial-dynamic policy isolates the two busiest groups.
//! - **Load.** A closed loop: `clients_per_cpu x cpus` clients, each
//!   keeping one task in flight and submitting the next from inside the
//!   task that completes (so the submitting processor, if eligible, runs
//!   it next, as a worker does). With [`Clients::Bound`] (as `rebound bench
//!   rcs`) each client belongs to one group, clients spread over the groups
//!   in proportion to their weight, and groups under 1% of the weight get a
//!   periodic trickle instead, at their share of the processors' capacity.
//!   With [`Clients::Roaming`] a client's next task goes to a group drawn
//!   by weight, as a request walks through the controller's groups (host,
//!   cache, NVS, device): every policy then dispatches the same mix of
//!   tasks. Queues are unbounded (a closed loop bounds them).
//! - **Idling.** A processor whose QoS round finds nothing, and whose
//!   re-check finds nothing, idles until a submission wakes it (the lowest
//!   idle eligible processor, after `wake_ns`), exactly as the runtime's
//!   idle set does, including a submitting worker not waking a peer for a
//!   task it will run itself.
//! - **Faults (§6.3.3).** One group takes faults with probability `rate`
//!   per dispatch; the task fails before its body runs and its client
//!   redrives it (same submission time, so its latency includes the
//!   stall). The group's recovery holds the failing task's processor for
//!   `recovery`; every task of the group running when the recovery began,
//!   or dispatched during it, holds its processor for `recovery` as well.
//!   With reactive scheduling (on for the RCS policies) the group's dispatch
//!   is suspended and the recovery waits for the group's running tasks to
//!   drain before it resumes, exactly as [`crate::recovery`] does.
//!
//! Throughput is tasks completed per simulated second after the warm-up;
//! latency is from a task's (first) submission to its completion. The
//! same configuration and seed give the same result, bit for bit.
//!
//! What the model leaves out: memory and cache effects (a task's service
//! time does not depend on where it runs or what ran before), lock and
//! queue contention between processors (dispatch costs the same at 1024
//! processors as at 2), and the park time-out (an idle processor wakes
//! only when work for it arrives; the simulator checks that no work is
//! ever left behind).

mod engine;
mod events;
mod workload;

use std::time::Duration;

pub use engine::simulate;
pub use workload::{FIGURE9, Workload, WorkloadGroup};

use crate::policy::{Policy, QosLoops};

/// How a closed-loop client picks the group of its next task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clients {
    /// Every task of a client goes to the client's own group (the load of
    /// `rebound bench rcs`; the paper's per-group workload of Figure 9).
    Bound,
    /// Each next task goes to a group drawn by weight (requests that visit
    /// several groups, as in the controller).
    Roaming,
}

/// The paper's fault model for one group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultModel {
    /// Index of the faulty group in the workload.
    pub group: usize,
    /// Fault probability per dispatch of that group (paper: 1e-4).
    pub rate: f64,
    /// Emulated recovery time (paper: 20 ms).
    pub recovery: Duration,
}

/// One simulation run.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Virtual processors, one per pool.
    pub cpus: usize,
    /// The scheduling policy.
    pub policy: Policy,
    /// Reactive scheduling (suspend a recovering group). The paper's
    /// performance-oriented baseline has none; its RCS policies do.
    pub reactive: bool,
    /// The groups and their tasks.
    pub workload: Workload,
    /// Closed-loop clients per processor.
    pub clients_per_cpu: usize,
    /// How clients choose the group of their next task.
    pub clients: Clients,
    /// The bad path's faults; `None` for the good path.
    pub fault: Option<FaultModel>,
    /// Measured simulated time (after the warm-up).
    pub duration: Duration,
    /// Simulated time before measuring starts.
    pub warmup: Duration,
    /// Seed of every random choice.
    pub seed: u64,
    /// The QoS loop counts.
    pub qos: QosLoops,
    /// The partial-dynamic lease, in dispatches.
    pub lease_dispatches: u32,
    /// Processor time per dispatch outside the task (queue and admission
    /// work, bookkeeping), in nanoseconds.
    pub dispatch_ns: u64,
    /// Time from waking an idle processor until it asks for work.
    pub wake_ns: u64,
    /// Track every task's life (queued, running, done) and count any
    /// transition out of order. Costs memory per task: for tests.
    pub audit: bool,
}

impl SimConfig {
    /// A configuration with the defaults of `rebound sim rcs`: reactive for
    /// the RCS policies, 32 clients per processor, the paper's QoS loops and
    /// lease, 10 s measured after 1 s.
    pub fn new(cpus: usize, policy: Policy, workload: Workload) -> Self {
        Self {
            cpus,
            policy,
            reactive: policy != Policy::Performance,
            workload,
            clients_per_cpu: 32,
            clients: Clients::Roaming,
            fault: None,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(1),
            seed: 1,
            qos: QosLoops::default(),
            lease_dispatches: 1,
            dispatch_ns: 0,
            wake_ns: 0,
            audit: false,
        }
    }
}

/// What the simulator checked while it ran; every count should be zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invariants {
    /// Dispatches that took a group past sigma under an enforcing policy
    /// (static, partial-dynamic's isolated groups).
    pub sigma_exceeded: u64,
    /// Tasks of a suspended (recovering, reactive) group that started.
    pub dispatched_while_suspended: u64,
    /// Task life-cycle transitions out of order (with `audit`): a task
    /// completed twice, run while not queued, or never accounted for.
    pub audit_errors: u64,
    /// Times a processor idled while it could have dispatched.
    pub idle_with_work: u64,
}

/// The measurements of one run.
#[derive(Debug, Clone)]
pub struct SimReport {
    /// Tasks completed per simulated second.
    pub tasks_per_s: f64,
    /// Mean latency, submission to completion, in microseconds.
    pub mean_latency_us: f64,
    /// 99th percentile latency in microseconds.
    pub p99_latency_us: f64,
    /// Dispatches per simulated second (failed ones included).
    pub dispatches_per_s: f64,
    /// Dispatches per group, measured window.
    pub dispatches_per_group: Vec<u64>,
    /// Group recoveries started in the measured window.
    pub recoveries: u64,
    /// Processors held per recovery: processor time the faulty group's
    /// recoveries held, in units of the recovery time (1 when only the
    /// failing task's processor is held).
    pub held_per_recovery: f64,
    /// Most processors the faulty group held at once during a recovery.
    pub max_held_in_recovery: u32,
    /// Fraction of processor time spent dispatching, running tasks or held
    /// by recoveries.
    pub utilization: f64,
    /// Longest time, in microseconds, a task waited at the head of its
    /// queue while its group was not suspended.
    pub max_head_wait_us: f64,
    /// Dispatches simulated (warm-up included).
    pub dispatches_total: u64,
    /// Events processed.
    pub events: u64,
    /// What the simulator checked.
    pub invariants: Invariants,
}
