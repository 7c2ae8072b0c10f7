//! Recovery groups (paper §4.1): "the unit of a localized recovery operation,
//! i.e. the set of tasks that will undergo recovery concurrently". Every task
//! belongs to exactly one group. A group has a recoverability constraint sigma
//! (§5, Table 1: the most tasks of the group dispatched at once), three job
//! queues, one per priority (§5.1: "multiple QoS based job queues for each
//! recovery group"), a mapping to resource pools for the static and
//! partial-dynamic policies (Tables 2 and 3) and a recovery handler run during
//! group recovery.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::failure::Failure;
use crate::pool::PoolId;

/// Index of a recovery group in its runtime (dense, `0..groups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub(crate) u8);

impl GroupId {
    /// The dense index of the group.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    /// The group's bit in a group mask.
    pub(crate) fn bit(self) -> u64 {
        1u64 << self.0
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "group#{}", self.0)
    }
}

/// QoS priority of a task (paper Figure 6: high, medium and low job queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Served `high_loop_count` times per medium scan.
    High,
    /// Served `medium_loop_count` times per low scan.
    Medium,
    /// Served once per scheduling round.
    Low,
}

impl Priority {
    /// Number of priorities.
    pub const COUNT: usize = 3;
    /// All priorities, highest first.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Medium, Priority::Low];

    /// Dense index, 0 for high.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Medium => "medium",
            Priority::Low => "low",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The pools a group may use under the partial-dynamic policy's alternative
/// mapping (paper Table 3), taken under a lease when a pool runs out of work
/// in its primary mapping.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Alternative {
    /// Every pool may serve the group, without sigma (Table 3's "All": the
    /// group may "selectively violate" its recoverability constraint).
    #[default]
    AllPools,
    /// Strict isolation: the alternative mapping is the static one and sigma
    /// is still enforced (the paper isolates groups 4 and 5 this way).
    Isolated,
    /// These pools, without sigma.
    Pools(Vec<PoolId>),
}

/// Information handed to a group's recovery handler.
#[derive(Debug)]
pub struct GroupRecovery<'a> {
    /// The recovering group.
    pub group: GroupId,
    /// Its name.
    pub name: &'a str,
    /// The failure that started the recovery.
    pub failure: &'a Failure,
    /// Other tasks of the group that were running when recovery began (they
    /// were told to clean up and have finished by the time the handler runs,
    /// when the reactive policy is on).
    pub tasks_running: u32,
    /// Tasks of the group queued when recovery began (their dispatch is
    /// suspended until the handler returns, when the reactive policy is on).
    pub tasks_queued: usize,
}

/// A group's recovery handler: repairs the group's state after its tasks have
/// cleaned up. An `Err` (or a panic) is a failure during recovery and
/// escalates to system-level recovery.
pub type RecoveryHandler = Arc<dyn Fn(&GroupRecovery<'_>) -> Result<(), Failure> + Send + Sync>;

/// Specification of a recovery group, given to
/// [`RuntimeBuilder::group`](crate::RuntimeBuilder::group).
#[derive(Clone)]
pub struct GroupSpec {
    pub(crate) name: String,
    pub(crate) sigma: u32,
    pub(crate) pools: Vec<PoolId>,
    pub(crate) alternative: Alternative,
    pub(crate) handler: Option<RecoveryHandler>,
    pub(crate) fault_probability: f64,
    pub(crate) fault_recovery_time: Duration,
}

impl fmt::Debug for GroupSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GroupSpec")
            .field("name", &self.name)
            .field("sigma", &self.sigma)
            .field("pools", &self.pools)
            .field("alternative", &self.alternative)
            .field("handler", &self.handler.is_some())
            .field("fault_probability", &self.fault_probability)
            .field("fault_recovery_time", &self.fault_recovery_time)
            .finish()
    }
}

impl GroupSpec {
    /// A group named `name`, sigma 1, mapped to no pool (fine for the dynamic
    /// and performance policies; the static ones need [`GroupSpec::pools`]).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            sigma: 1,
            pools: Vec::new(),
            alternative: Alternative::AllPools,
            handler: None,
            fault_probability: 0.0,
            fault_recovery_time: Duration::ZERO,
        }
    }

    /// The recoverability constraint: at most `sigma` tasks of the group run
    /// at once (enforced by static and partial-dynamic, preferred by dynamic).
    pub fn sigma(mut self, sigma: u32) -> Self {
        self.sigma = sigma;
        self
    }

    /// The static mapping: the pools that serve this group (paper Table 2).
    pub fn pools(mut self, pools: impl IntoIterator<Item = PoolId>) -> Self {
        self.pools = pools.into_iter().collect();
        self
    }

    /// The partial-dynamic alternative mapping (paper Table 3).
    pub fn alternative(mut self, alternative: Alternative) -> Self {
        self.alternative = alternative;
        self
    }

    /// The handler run during group recovery, after the group's running
    /// tasks have cleaned up and before the group resumes.
    pub fn recovery_handler(
        mut self,
        handler: impl Fn(&GroupRecovery<'_>) -> Result<(), Failure> + Send + Sync + 'static,
    ) -> Self {
        self.handler = Some(Arc::new(handler));
        self
    }

    /// Fault injection (paper §6.3.3): each dispatch of a task of this group
    /// fails with `probability`, and each recovery is emulated to take
    /// `recovery_time`, as does every task of the group that is running or
    /// dispatched during that recovery. Adjustable at run time with
    /// [`Handle::inject`](crate::Handle::inject).
    pub fn inject_faults(mut self, probability: f64, recovery_time: Duration) -> Self {
        self.fault_probability = probability;
        self.fault_recovery_time = recovery_time;
        self
    }
}
