//! Recovery points (paper §2.1): where control is transferred at the end of
//! a recovery procedure, each with the criterion the state must meet for
//! recovery to use it. Taken with [`Actor::recovery_point`]; the actor's
//! start is the default recovery point (criterion all don't-care).
//!
//! [`Actor::recovery_point`]: crate::Actor::recovery_point

use crate::criterion::RecoveryCriterion;
use crate::event::{ActorId, LockId};

/// A recovery point of one actor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryPoint {
    index: usize,
    actor: ActorId,
    /// Each lock tracked at the point, with its log's next sequence number.
    marks: Vec<(LockId, u64)>,
    criterion: RecoveryCriterion,
}

impl RecoveryPoint {
    pub(crate) fn new(
        index: usize,
        actor: ActorId,
        marks: Vec<(LockId, u64)>,
        criterion: RecoveryCriterion,
    ) -> Self {
        Self {
            index,
            actor,
            marks,
            criterion,
        }
    }

    /// Position among the actor's recovery points.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The actor that took it.
    pub fn actor(&self) -> ActorId {
        self.actor
    }

    /// The first sequence number of `lock`'s log after the point (0 for a
    /// lock tracked only since: its tracking start bounds it).
    pub fn mark(&self, lock: LockId) -> u64 {
        self.marks
            .iter()
            .find(|(l, _)| *l == lock)
            .map_or(0, |(_, m)| *m)
    }

    /// What the state must satisfy to recover to this point.
    pub fn criterion(&self) -> RecoveryCriterion {
        self.criterion
    }
}
