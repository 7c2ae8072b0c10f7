//! Recovery criteria (paper §2.1): what the system state must satisfy
//! before recovery may use a recovery point. A 4-tuple over dirty reads,
//! lost updates, unrepeatable reads and residual resources; committed
//! dependencies are not part of it, they choose between strategies (§2.2).

use crate::level::RestorationLevel;

/// One element of a criterion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Requirement {
    /// The condition must have occurred.
    Required,
    /// The condition must not have occurred.
    Forbidden,
    /// Either (the default recovery point's criterion is all don't-care).
    #[default]
    DontCare,
}

impl Requirement {
    /// Whether an observed condition satisfies this requirement.
    pub fn admits(self, occurred: bool) -> bool {
        match self {
            Self::Required => occurred,
            Self::Forbidden => !occurred,
            Self::DontCare => true,
        }
    }
}

/// The 4-tuple ⟨DR, LU, UR, RR⟩ of a recovery point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RecoveryCriterion {
    /// Dirty reads.
    pub dr: Requirement,
    /// Lost updates.
    pub lu: Requirement,
    /// Unrepeatable reads.
    pub ur: Requirement,
    /// Residual resources.
    pub rr: Requirement,
}

impl RecoveryCriterion {
    /// The default recovery point's criterion: every element don't-care.
    pub const DONT_CARE: Self = Self {
        dr: Requirement::DontCare,
        lu: Requirement::DontCare,
        ur: Requirement::DontCare,
        rr: Requirement::DontCare,
    };

    /// The criterion for undoing a change alone: no other actor consumed or
    /// overwrote it (DR, LU forbidden) and nothing acquired is still held.
    pub const ISOLATED_ROLLBACK: Self = Self {
        dr: Requirement::Forbidden,
        lu: Requirement::Forbidden,
        ur: Requirement::DontCare,
        rr: Requirement::Forbidden,
    };

    /// Only resources matter (paper's R1/R3: release what was acquired).
    pub const RELEASE_RESOURCES: Self = Self {
        dr: Requirement::DontCare,
        lu: Requirement::DontCare,
        ur: Requirement::DontCare,
        rr: Requirement::Forbidden,
    };

    /// Whether `level` meets the criterion on every element (SRP rule 1).
    pub fn met_by(&self, level: &RestorationLevel) -> bool {
        self.met_on_state(level) && self.rr.admits(level.rr)
    }

    /// Whether `level` meets the DR, LU and UR elements (SRP rules 2, 3).
    pub fn met_on_state(&self, level: &RestorationLevel) -> bool {
        self.dr.admits(level.dr) && self.lu.admits(level.lu) && self.ur.admits(level.ur)
    }
}
