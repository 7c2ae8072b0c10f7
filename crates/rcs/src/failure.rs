//! Failures: what a task reports when it cannot go on.
//!
//! The classes are the paper's taxonomy of transient faults (§2.2): domain,
//! range, state and internal-logic errors, plus a time-out (§2.2, "time-out
//! conditions are also very common"). A panic inside a task is a failure of
//! class [`FailureClass::Panic`]. [`FailureClass::GroupRecovering`] is not a
//! fault: it is what the cooperative check [`TaskCtx::check`] returns to a
//! task whose recovery group entered recovery, so that it unwinds through its
//! clean-up blocks.
//!
//! A failure also carries its [`Disposition`]: where it is headed while it
//! unwinds through nested recovery points.
//!
//! [`TaskCtx::check`]: crate::TaskCtx::check

use std::borrow::Cow;
use std::fmt;

/// The kind of fault (paper §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureClass {
    /// Bad input arguments, or a combination of them (e.g. a divide by zero).
    Domain,
    /// Correct inputs whose result cannot be computed (e.g. an overflow).
    Range,
    /// Inputs wrong for the current state of the object (e.g. an unsolicited
    /// response from an adapter).
    State,
    /// The system entered an incorrect or unknown state (e.g. a control block
    /// with a wrong LRC, a queue-full from an adapter).
    InternalLogic,
    /// An operation ran past its deadline.
    Timeout,
    /// The task panicked.
    Panic,
    /// Not a fault: the task's recovery group entered recovery and the task
    /// was told to clean up.
    GroupRecovering,
}

impl FailureClass {
    /// Number of classes (for per-class tables).
    pub const COUNT: usize = 7;

    /// All classes, in declaration order.
    pub const ALL: [FailureClass; Self::COUNT] = [
        Self::Domain,
        Self::Range,
        Self::State,
        Self::InternalLogic,
        Self::Timeout,
        Self::Panic,
        Self::GroupRecovering,
    ];

    /// Dense index of the class, `0..COUNT`.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name used in logs, metrics and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Self::Domain => "domain",
            Self::Range => "range",
            Self::State => "state",
            Self::InternalLogic => "internal-logic",
            Self::Timeout => "timeout",
            Self::Panic => "panic",
            Self::GroupRecovering => "group-recovering",
        }
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FailureClass {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|c| c.name()).collect();
                format!(
                    "unknown failure class {s:?} (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Where a failure is headed while it unwinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// To the enclosing recovery point, whose strategy decides; at the top of
    /// the task it becomes group recovery.
    Escalate,
    /// The task is being aborted: every enclosing clean-up runs and the task
    /// ends without group recovery.
    Abort,
    /// Straight to the system-level recovery callback (every enclosing
    /// clean-up still runs on the way).
    System,
}

/// A failure of a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    class: FailureClass,
    message: Cow<'static, str>,
    disposition: Disposition,
}

impl Failure {
    /// A failure of `class` with a human-readable message.
    pub fn new(class: FailureClass, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            class,
            message: message.into(),
            disposition: Disposition::Escalate,
        }
    }

    /// A domain error (§2.2).
    pub fn domain(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(FailureClass::Domain, message)
    }

    /// A range error (§2.2).
    pub fn range(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(FailureClass::Range, message)
    }

    /// A state error (§2.2).
    pub fn state(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(FailureClass::State, message)
    }

    /// An internal-logic error (§2.2).
    pub fn internal_logic(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(FailureClass::InternalLogic, message)
    }

    /// A time-out.
    pub fn timeout(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(FailureClass::Timeout, message)
    }

    /// The failure the cooperative check returns during group recovery.
    pub(crate) fn group_recovering() -> Self {
        Self::new(
            FailureClass::GroupRecovering,
            "recovery group is recovering",
        )
    }

    /// Turn a panic payload into a failure of class [`FailureClass::Panic`].
    pub(crate) fn from_panic(payload: &(dyn std::any::Any + Send)) -> Self {
        let message = if let Some(s) = payload.downcast_ref::<&'static str>() {
            Cow::Borrowed(*s)
        } else if let Some(s) = payload.downcast_ref::<String>() {
            Cow::Owned(s.clone())
        } else if let Some(f) = payload.downcast_ref::<Failure>() {
            return f.clone();
        } else {
            Cow::Borrowed("panic with a non-string payload")
        };
        Self::new(FailureClass::Panic, message)
    }

    /// The class of the fault.
    pub fn class(&self) -> FailureClass {
        self.class
    }

    /// The message given when the failure was raised.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Where the failure is headed.
    pub fn disposition(&self) -> Disposition {
        self.disposition
    }

    /// The same failure, now headed for `disposition`.
    pub fn with_disposition(mut self, disposition: Disposition) -> Self {
        self.disposition = disposition;
        self
    }

    /// The same failure, aborting the task.
    pub fn abort(self) -> Self {
        self.with_disposition(Disposition::Abort)
    }

    /// The same failure, escalating straight to system-level recovery.
    pub fn system(self) -> Self {
        self.with_disposition(Disposition::System)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failure: {}", self.class, self.message)
    }
}

impl std::error::Error for Failure {}
