//! Recovery events: a bounded log of recent group and system recoveries
//! (rung, cause, duration, tasks affected), for status displays and tests.

use std::time::Duration;

use crate::failure::Failure;
use crate::group::GroupId;

/// Why a failure reached system-level recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SystemCause {
    /// A task's failure was headed for system level: a recovery point's
    /// strategy said so, or a clean-up block failed.
    TaskEscalated,
    /// A group's recovery handler failed or panicked.
    HandlerFailed,
    /// A group's running tasks did not finish their clean-ups within the
    /// drain timeout.
    DrainTimeout,
    /// Requested from outside the runtime.
    External,
}

impl SystemCause {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            SystemCause::TaskEscalated => "task-escalated",
            SystemCause::HandlerFailed => "handler-failed",
            SystemCause::DrainTimeout => "drain-timeout",
            SystemCause::External => "external",
        }
    }
}

/// What the system-level recovery callback receives.
#[derive(Debug, Clone)]
pub struct SystemFailure {
    /// The group whose recovery escalated, if any.
    pub group: Option<GroupId>,
    /// Why it escalated.
    pub cause: SystemCause,
    /// The failure.
    pub failure: Failure,
}

/// The scope a recovery covered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryScope {
    /// One recovery group (rung 2).
    Group(GroupId),
    /// The whole system (handed to the embedder's callback).
    System,
}

/// How a recovery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryOutcome {
    /// The group resumed.
    Recovered,
    /// The recovery failed and escalated to system level.
    Escalated(SystemCause),
}

/// One recovery.
#[derive(Debug, Clone)]
pub struct RecoveryEvent {
    /// Sequence number (per runtime, from 1).
    pub seq: u64,
    /// What recovered.
    pub scope: RecoveryScope,
    /// The group's name, for group recoveries.
    pub group_name: Option<String>,
    /// The failure that caused it.
    pub cause: Failure,
    /// When it started, since the runtime started.
    pub at: Duration,
    /// How long it took.
    pub duration: Duration,
    /// Other tasks of the group running when it began.
    pub tasks_running: u32,
    /// Tasks of the group queued when it began.
    pub tasks_queued: usize,
    /// How it ended.
    pub outcome: RecoveryOutcome,
}
