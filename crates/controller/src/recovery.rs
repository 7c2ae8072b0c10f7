//! The controller's recovery log (DESIGN.md: "every rung is measured"):
//! each recovery the controller performs, with its rung, cause, duration and
//! the requests it affected, kept in a bounded in-memory log for `rebound
//! status` and counted per rung for the metrics endpoint, each duration
//! in a per-rung histogram.
//!
//! Group recoveries (rung 2) are performed and logged by rcs itself
//! ([`rcs::Handle::recent_events`]); `status` shows both logs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::metrics::histogram::{Histogram, HistogramSnapshot, RECOVERY_BOUNDS_NS};

/// Recovery records kept.
pub const RECOVERY_LOG_MAX: usize = 256;

/// The rungs of the ladder (DESIGN.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rung {
    /// 1: task micro-recovery (a failed stage's request redriven).
    Task = 1,
    /// 2: group recovery (reactive rcs).
    Group = 2,
    /// 3: rollback to a checkpoint.
    Rollback = 3,
    /// 4: in-process system-level recovery.
    System = 4,
    /// 5: fast restart from the recovery box.
    FastRestart = 5,
    /// 6: hard restart from an NVS scan.
    HardRestart = 6,
    /// 7: data reconstruction: a lost device's tracks served from the
    /// volume's redundancy and rebuilt onto a replacement (the mission's
    /// last rung, across devices; across nodes in smartstore).
    Reconstruct = 7,
}

impl Rung {
    /// All rungs, in order.
    pub const ALL: [Rung; 7] = [
        Rung::Task,
        Rung::Group,
        Rung::Rollback,
        Rung::System,
        Rung::FastRestart,
        Rung::HardRestart,
        Rung::Reconstruct,
    ];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Rung::Task => "task",
            Rung::Group => "group",
            Rung::Rollback => "rollback",
            Rung::System => "system",
            Rung::FastRestart => "fast-restart",
            Rung::HardRestart => "hard-restart",
            Rung::Reconstruct => "reconstruct",
        }
    }
}

/// One recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryRecord {
    /// Sequence number, from 1.
    pub seq: u64,
    /// Time since the controller started.
    pub at: Duration,
    /// Which rung.
    pub rung: Rung,
    /// What failed.
    pub cause: String,
    /// How long the recovery took (0 when it is a redrive whose cost is the
    /// request's extra latency).
    pub duration: Duration,
    /// Requests it affected.
    pub requests: u64,
}

/// The bounded recovery log and per-rung counters.
#[derive(Debug)]
pub struct RecoveryLog {
    started: Instant,
    next: AtomicU64,
    records: Mutex<VecDeque<RecoveryRecord>>,
    counts: [AtomicU64; 8],
    nanos: [AtomicU64; 8],
    requests: [AtomicU64; 8],
    durations: [Histogram; 8],
}

impl Default for RecoveryLog {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            next: AtomicU64::new(1),
            records: Mutex::new(VecDeque::with_capacity(RECOVERY_LOG_MAX)),
            counts: Default::default(),
            nanos: Default::default(),
            requests: Default::default(),
            durations: std::array::from_fn(|_| Histogram::new(RECOVERY_BOUNDS_NS)),
        }
    }
}

impl RecoveryLog {
    /// Record a recovery.
    pub fn record(&self, rung: Rung, cause: impl Into<String>, duration: Duration, requests: u64) {
        let record = RecoveryRecord {
            seq: self.next.fetch_add(1, Ordering::Relaxed),
            at: self.started.elapsed(),
            rung,
            cause: cause.into(),
            duration,
            requests,
        };
        self.counts[rung as usize].fetch_add(1, Ordering::Relaxed);
        self.nanos[rung as usize].fetch_add(
            u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.requests[rung as usize].fetch_add(requests, Ordering::Relaxed);
        self.durations[rung as usize].observe(duration);
        let mut records = self.records.lock();
        if records.len() == RECOVERY_LOG_MAX {
            records.pop_front();
        }
        records.push_back(record);
    }

    /// Recoveries at `rung` so far.
    pub fn count(&self, rung: Rung) -> u64 {
        self.counts[rung as usize].load(Ordering::Relaxed)
    }

    /// Time spent recovering at `rung` so far.
    pub fn time(&self, rung: Rung) -> Duration {
        Duration::from_nanos(self.nanos[rung as usize].load(Ordering::Relaxed))
    }

    /// Requests affected by recoveries at `rung` so far.
    pub fn requests(&self, rung: Rung) -> u64 {
        self.requests[rung as usize].load(Ordering::Relaxed)
    }

    /// How long each recovery at `rung` took, bucketed.
    pub fn durations(&self, rung: Rung) -> HistogramSnapshot {
        self.durations[rung as usize].snapshot()
    }

    /// The most recent records, oldest first.
    pub fn recent(&self) -> Vec<RecoveryRecord> {
        self.records.lock().iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_newest_records_and_counts_every_one() {
        let log = RecoveryLog::default();
        for i in 0..RECOVERY_LOG_MAX + 10 {
            log.record(Rung::Task, format!("cause {i}"), Duration::ZERO, 1);
        }
        log.record(Rung::FastRestart, "restart", Duration::from_millis(3), 0);
        let recent = log.recent();
        assert_eq!(recent.len(), RECOVERY_LOG_MAX);
        assert_eq!(recent.last().unwrap().rung, Rung::FastRestart);
        assert_eq!(recent[0].cause, "cause 11");
        assert_eq!(log.count(Rung::Task), RECOVERY_LOG_MAX as u64 + 10);
        assert_eq!(log.count(Rung::FastRestart), 1);
        assert_eq!(log.time(Rung::FastRestart), Duration::from_millis(3));
        assert_eq!(log.requests(Rung::Task), RECOVERY_LOG_MAX as u64 + 10);
        assert_eq!(log.requests(Rung::FastRestart), 0);
        assert!(recent.windows(2).all(|w| w[0].seq < w[1].seq));
    }
}
