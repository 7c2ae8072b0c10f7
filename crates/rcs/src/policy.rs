//! Scheduling policies (paper §5) and the QoS loop counts (Figures 6 and 7).

use std::fmt;
use std::str::FromStr;

/// Which scheduler the pools run. Chosen at start, switchable at run time
/// with [`Handle::set_policy`](crate::Handle::set_policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// The paper's baseline (Figures 4 and 6): one set of high/medium/low job
    /// queues shared by every worker; groups are ignored (no sigma, no
    /// suspension during recovery).
    Performance,
    /// Static RCS (§5.1): a pool dispatches only from the groups mapped to it,
    /// round-robin between groups sharing it, never more than sigma at once.
    Static,
    /// Partial-dynamic RCS (§5.2, Figure 8): the static mapping, plus an
    /// alternative mapping taken under a lease when a pool finds no work.
    Partial,
    /// Dynamic RCS (§5.3): every pool serves every group, preferring groups
    /// under sigma, otherwise the group with the fewest running tasks.
    Dynamic,
}

impl Policy {
    /// All policies, baseline first.
    pub const ALL: [Policy; 4] = [
        Policy::Performance,
        Policy::Static,
        Policy::Partial,
        Policy::Dynamic,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Performance => "performance",
            Policy::Static => "static",
            Policy::Partial => "partial",
            Policy::Dynamic => "dynamic",
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_u8(v: u8) -> Policy {
        Self::ALL[usize::from(v)]
    }

    /// Whether the policy uses the static mapping (and so needs every group
    /// mapped to at least one pool).
    pub fn needs_static_mapping(self) -> bool {
        matches!(self, Policy::Static | Policy::Partial)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "performance" | "performance-oriented" => Ok(Policy::Performance),
            "static" => Ok(Policy::Static),
            "partial" | "partial-dynamic" => Ok(Policy::Partial),
            "dynamic" => Ok(Policy::Dynamic),
            other => Err(format!(
                "unknown policy {other:?} (expected performance, static, partial or dynamic)"
            )),
        }
    }
}

/// The QoS loop counts of Figures 6 and 7: per scheduling round a pool scans
/// its high-priority queues up to `high_loop_count` times per medium scan, and
/// does that up to `medium_loop_count` times per low scan. So a queued
/// low-priority task waits at most `medium_loop_count * (high_loop_count + 1)`
/// dispatches of its pool before its queue is scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QosLoops {
    /// HighPriorityLoopCount.
    pub high_loop_count: u32,
    /// MediumPriorityLoopCount.
    pub medium_loop_count: u32,
}

impl Default for QosLoops {
    fn default() -> Self {
        Self {
            high_loop_count: 4,
            medium_loop_count: 4,
        }
    }
}

impl QosLoops {
    /// Dispatches of one pool between two scans of its low-priority queues,
    /// at most.
    pub fn low_scan_interval(&self) -> u32 {
        self.medium_loop_count * (self.high_loop_count + 1)
    }
}
