//! Metrics per group and per pool, read as a [`MetricsSnapshot`].
//!
//! Hot counters are per worker and single-writer (a worker bumps its own with
//! a plain load and store, no read-modify-write, no shared cache line); a
//! snapshot sums them. Only the running count, which the scheduler itself
//! needs, is shared.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::group::GroupId;
use crate::policy::Policy;
use crate::pool::PoolId;

/// A counter with one writer (the worker that owns it) and any readers.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    /// Add one. Only the owning worker may call this.
    #[inline]
    pub(crate) fn bump(&self) {
        self.add(1);
    }

    /// Add `n`. Only the owning worker may call this.
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.0
            .store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// One worker's counters for one group.
#[derive(Debug, Default)]
pub(crate) struct GroupCounters {
    pub(crate) dispatched: Counter,
    pub(crate) completed: Counter,
    pub(crate) failed: Counter,
    pub(crate) aborted: Counter,
    pub(crate) cancelled: Counter,
    pub(crate) retried: Counter,
    pub(crate) ignored: Counter,
    pub(crate) injected: Counter,
    pub(crate) overdue: Counter,
}

/// One worker's counters.
#[derive(Debug)]
pub(crate) struct WorkerStats {
    pub(crate) groups: Box<[GroupCounters]>,
    pub(crate) busy_ns: Counter,
    pub(crate) parks: Counter,
    pub(crate) leases: Counter,
}

impl WorkerStats {
    pub(crate) fn new(groups: usize) -> Self {
        Self {
            groups: (0..groups).map(|_| GroupCounters::default()).collect(),
            busy_ns: Counter::default(),
            parks: Counter::default(),
            leases: Counter::default(),
        }
    }
}

/// A new recovery-time histogram (microseconds, 1 µs to 1 hour).
pub(crate) fn recovery_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds are valid")
}

/// Summary of a latency histogram.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: Duration,
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Largest.
    pub max: Duration,
}

impl LatencySummary {
    /// Summarise a histogram recorded in microseconds.
    pub fn from_micros(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let us = |v: u64| Duration::from_micros(v);
        Self {
            count: h.len(),
            mean: Duration::from_secs_f64(h.mean() / 1e6),
            p50: us(h.value_at_quantile(0.5)),
            p99: us(h.value_at_quantile(0.99)),
            max: us(h.max()),
        }
    }
}

/// Counters of one recovery group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupMetrics {
    /// The group.
    pub id: GroupId,
    /// Its name.
    pub name: String,
    /// Its recoverability constraint.
    pub sigma: u32,
    /// Tasks dispatched (admitted and started).
    pub dispatched: u64,
    /// Tasks that completed.
    pub completed: u64,
    /// Tasks that failed up to group or system level.
    pub failed: u64,
    /// Tasks aborted by a recovery point's strategy.
    pub aborted: u64,
    /// Tasks that stopped because their group entered recovery.
    pub cancelled: u64,
    /// Recovery-point retries.
    pub retried: u64,
    /// Failures ignored by a recovery point's strategy.
    pub ignored: u64,
    /// Faults injected at dispatch.
    pub injected: u64,
    /// Tasks the watchdog declared past their deadline.
    pub overdue: u64,
    /// Group recoveries completed.
    pub recoveries: u64,
    /// Tasks running now.
    pub running: u32,
    /// Tasks queued now, per priority (high, medium, low).
    pub queued: [usize; 3],
    /// Whether the group is in recovery now.
    pub recovering: bool,
    /// Fault injection probability per dispatch.
    pub fault_probability: f64,
    /// Time to recover, per recovery.
    pub recovery_time: LatencySummary,
    /// Processor time held by the fault emulation's recoveries (§6.3.3):
    /// the failing task's emulated recovery, and the same time again for
    /// every task of the group running when a recovery began or dispatched
    /// during one. Summed over threads; divided by the group's recoveries,
    /// it says how many processors a policy lets one recovery hold.
    pub emulated_hold: Duration,
}

/// Counters of one resource pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolMetrics {
    /// The pool.
    pub id: PoolId,
    /// Worker threads in it.
    pub workers: usize,
    /// Tasks its workers dispatched.
    pub dispatched: u64,
    /// Time its workers spent busy (dispatching and running tasks, including
    /// emulated recovery), summed over workers.
    pub busy: Duration,
    /// Times its workers parked for lack of work.
    pub parks: u64,
    /// Partial-dynamic leases its workers took on the alternative mapping.
    pub leases: u64,
}

/// A point-in-time view of the runtime.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    /// The policy in force.
    pub policy: Policy,
    /// Whether reactive scheduling is on.
    pub reactive: bool,
    /// Time since the runtime started.
    pub uptime: Duration,
    /// Per group.
    pub groups: Vec<GroupMetrics>,
    /// Per pool.
    pub pools: Vec<PoolMetrics>,
    /// Tasks in the performance policy's shared queues, per priority.
    pub shared_queued: [usize; 3],
    /// Escalations to system-level recovery.
    pub system_escalations: u64,
    /// Tasks dispatched by affiliated threads (counted in their groups too).
    pub affiliated: u64,
}

impl MetricsSnapshot {
    /// Tasks completed over all groups.
    pub fn completed(&self) -> u64 {
        self.groups.iter().map(|g| g.completed).sum()
    }

    /// Tasks dispatched over all groups.
    pub fn dispatched(&self) -> u64 {
        self.groups.iter().map(|g| g.dispatched).sum()
    }

    /// The metrics of the group named `name`.
    pub fn group(&self, name: &str) -> Option<&GroupMetrics> {
        self.groups.iter().find(|g| g.name == name)
    }
}
