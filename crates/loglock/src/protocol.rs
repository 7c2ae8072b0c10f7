//! The restoration protocols (paper §2.2): given a restoration level, the
//! actor's resource ownership and a recovery point's criterion, which
//! recovery strategies are allowed and which resource actions must come
//! first.
//!
//! - Resource recovery protocol (RRP): state may be restored to a point only
//!   if the level meets the criterion on RR; otherwise the actor first
//!   releases (or acquires) resources to meet it.
//! - State recovery protocol (SRP):
//!   1. single-actor recovery needs the level to meet the criterion on every
//!      element;
//!   2. if it misses on DR, LU or UR and CD occurred: only error
//!      compensation or system-level recovery;
//!   3. if it misses on DR, LU or UR and CD did not occur: multi-actor
//!      rollback, error compensation or system-level recovery.
//!
//! Committed dependencies cannot be rolled back; error compensation (a
//! matching roll-forward action, like the paper's decrement of
//! numActiveUsers) and system-level recovery are always allowed.

use crate::criterion::RecoveryCriterion;
use crate::event::LockId;
use crate::level::{Ownership, RestorationLevel};

/// A recovery strategy (paper §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Strategy {
    /// Undo the failed actor's changes alone and resume at the point.
    SingleActorRollback,
    /// Roll back the failed actor and the actors that depend on it.
    MultiActorRollback,
    /// Roll forward: a compensating action (e.g. a matching decrement).
    ErrorCompensation,
    /// Give up on micro-recovery: system-level recovery.
    SystemLevel,
}

/// A resource action the RRP requires before state restoration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourceAction {
    /// Release the lock itself.
    ReleaseLock(LockId),
    /// Release pool items.
    ReleaseItems {
        /// The pool.
        pool: LockId,
        /// The items.
        items: Vec<usize>,
    },
    /// The criterion requires residual resources the actor does not hold:
    /// acquire them again before restoring.
    Reacquire(LockId),
}

/// RRP: the resource actions needed for the level to meet `criterion` on
/// RR (empty when it already does).
pub fn resource_recovery(
    level: &RestorationLevel,
    ownership: &[Ownership],
    criterion: &RecoveryCriterion,
) -> Vec<ResourceAction> {
    if criterion.rr.admits(level.rr) {
        return Vec::new();
    }
    let mut actions = Vec::new();
    if level.rr {
        for o in ownership {
            if o.holds_lock {
                actions.push(ResourceAction::ReleaseLock(o.lock));
            }
            if !o.items.is_empty() {
                actions.push(ResourceAction::ReleaseItems {
                    pool: o.lock,
                    items: o.items.clone(),
                });
            }
        }
    } else {
        actions.extend(ownership.iter().map(|o| ResourceAction::Reacquire(o.lock)));
    }
    actions
}

/// SRP: the strategies allowed for `level` against `criterion`, in order
/// of preference (smallest scope first). Resource conditions are the RRP's
/// business and are assumed handled (see [`decide`]).
pub fn state_recovery(level: &RestorationLevel, criterion: &RecoveryCriterion) -> Vec<Strategy> {
    use Strategy::*;
    if criterion.met_on_state(level) {
        // Rule 1 (with RR settled by the RRP).
        vec![
            SingleActorRollback,
            MultiActorRollback,
            ErrorCompensation,
            SystemLevel,
        ]
    } else if level.cd {
        // Rule 2.
        vec![ErrorCompensation, SystemLevel]
    } else {
        // Rule 3.
        vec![MultiActorRollback, ErrorCompensation, SystemLevel]
    }
}

/// What a recovery handler may do at a recovery point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The level the decision was made on.
    pub level: RestorationLevel,
    /// Resource actions to take first (RRP).
    pub resource_actions: Vec<ResourceAction>,
    /// Allowed strategies, smallest scope first (SRP).
    pub strategies: Vec<Strategy>,
}

impl Decision {
    /// Whether the failed actor may simply roll back alone (after the
    /// resource actions).
    pub fn single_actor_rollback(&self) -> bool {
        self.strategies.first() == Some(&Strategy::SingleActorRollback)
    }

    /// Whether the level met the criterion as observed, resources included
    /// (the paper's "recovery success").
    pub fn criterion_met(&self) -> bool {
        self.single_actor_rollback() && self.resource_actions.is_empty()
    }
}

/// RRP then SRP.
pub fn decide(
    level: &RestorationLevel,
    ownership: &[Ownership],
    criterion: &RecoveryCriterion,
) -> Decision {
    Decision {
        level: *level,
        resource_actions: resource_recovery(level, ownership, criterion),
        strategies: state_recovery(level, criterion),
    }
}

impl crate::Actor {
    /// The recovery handler's question at `point`: the merged restoration
    /// level over `locks` since the point, the actor's ownership of them,
    /// and what RRP and SRP allow.
    pub fn decide(
        &self,
        point: &crate::RecoveryPoint,
        locks: &[&dyn crate::Tracked],
    ) -> Result<Decision, crate::LogError> {
        let mut level = RestorationLevel {
            complete: true,
            ..RestorationLevel::default()
        };
        let mut ownership = Vec::with_capacity(locks.len());
        for lock in locks {
            level = level.merge(self.restoration_level_since(*lock, point)?);
            ownership.push(self.resource_ownership(*lock));
        }
        Ok(decide(&level, &ownership, &point.criterion()))
    }
}
