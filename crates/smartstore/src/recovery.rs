//! The four fault-recovery schemes of the smart-storage paper (section 3),
//! for a main-group node lost mid-query.
//!
//! | scheme | paper | after the loss |
//! |---|---|---|
//! | [`Scheme::Spare`] | 3.1, scenarios Scan-1 and Q1-1 | the lost node's data (the original partition, read in parallel from the column-wise mirror group; or its latest checkpoint, from its mirror node) is rebuilt on the spare, which takes the lost node's place |
//! | [`Scheme::Migrate`] | 3.2, Q1-2 | the remaining work (code only) moves to the mirror group, which holds the checkpoints |
//! | [`Scheme::Redistribute`] | 3.3, Q1-3 | the latest checkpointed results are spread over every surviving node of both groups, which all continue |
//! | [`Scheme::Parity`] | 3.4, Scan-2 and Q1-4 | the lost data is rebuilt on the spare by XOR of the survivors and the parity node |
//!
//! Q1 resumes from the last checkpointed primitive (section 4.2: "post-recovery
//! processing need only be backtracked by one primitive"); Scan restarts
//! from the beginning, as the paper's Scan scenarios do. The fault is
//! injected by the host just before the chosen primitive starts (the
//! paper's Q1 point is just before Group-by + Aggregate + LocalSort): the
//! node's process is killed (SIGKILL) or its directory made unreadable,
//! and the loss is detected when the node fails the primitive.

use crate::error::{Error, Result};
use crate::spec::{Layout, Query};

/// A recovery scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Mirror with a spare node (section 3.1).
    Spare,
    /// Mirror with load migration (section 3.2).
    Migrate,
    /// Mirror with load redistribution (section 3.3).
    Redistribute,
    /// Dedicated parity node with a spare (section 3.4).
    Parity,
}

impl Scheme {
    /// Parses `spare`, `migrate`, `redistribute` or `parity`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "spare" => Ok(Scheme::Spare),
            "migrate" => Ok(Scheme::Migrate),
            "redistribute" => Ok(Scheme::Redistribute),
            "parity" => Ok(Scheme::Parity),
            o => Err(Error::Invalid(format!(
                "unknown recovery scheme {o:?}: expected spare, migrate, redistribute or parity"
            ))),
        }
    }
    /// The name `parse` accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Scheme::Spare => "spare",
            Scheme::Migrate => "migrate",
            Scheme::Redistribute => "redistribute",
            Scheme::Parity => "parity",
        }
    }
    /// The layout the scheme needs.
    pub fn layout(&self) -> Layout {
        match self {
            Scheme::Parity => Layout::Parity,
            _ => Layout::Mirror,
        }
    }
    /// Whether the scheme rebuilds onto a spare node.
    pub fn needs_spare(&self) -> bool {
        matches!(self, Scheme::Spare | Scheme::Parity)
    }
}

/// How the node is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailMode {
    /// Its process is killed with SIGKILL.
    Kill,
    /// Its directory is made unreadable (moved away); the process lives on.
    Unreadable,
}

impl FailMode {
    /// Parses `kill` or `unreadable`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "kill" => Ok(FailMode::Kill),
            "unreadable" => Ok(FailMode::Unreadable),
            o => Err(Error::Invalid(format!(
                "unknown fail mode {o:?}: expected kill or unreadable"
            ))),
        }
    }
}

/// Q1's primitives, by index, as `--fail-at` names them.
pub const PRIMITIVES: [&str; 3] = ["scan", "sort", "agg-grp-sort"];

/// A fault to inject into one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The main-group node lost.
    pub node: usize,
    /// Index of the primitive just before which it is lost
    /// ([`PRIMITIVES`]).
    pub at: usize,
    /// How it is lost.
    pub mode: FailMode,
    /// How the query recovers.
    pub scheme: Scheme,
    /// Lose the node while its checkpoint of the previous primitive is
    /// still in flight (checkpoints run behind the next primitive), so the
    /// recovery starts from the checkpoint before it. Otherwise the node
    /// is lost once the previous checkpoint completed, the paper's point.
    pub mid_checkpoint: bool,
}

impl Fault {
    /// The paper's fault point for a query: Scan during its Scan; Q1 just
    /// before Group-by + Aggregate + LocalSort.
    pub fn default_at(query: Query) -> usize {
        match query {
            Query::Scan => 0,
            Query::Q1 => 2,
        }
    }

    /// Parses a `--fail-at` value.
    pub fn parse_at(s: &str) -> Result<usize> {
        PRIMITIVES.iter().position(|p| *p == s).ok_or_else(|| {
            Error::Invalid(format!(
                "unknown primitive {s:?}: expected {}",
                PRIMITIVES.join(", ")
            ))
        })
    }

    /// Checks the fault fits the query and the cluster.
    pub fn check(
        &self,
        query: Query,
        layout: Layout,
        nodes: usize,
        checkpoint: bool,
    ) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        if self.node >= nodes {
            return bad(format!(
                "--fail-node {}: the main group has nodes 0 to {}",
                self.node,
                nodes - 1
            ));
        }
        if self.scheme.layout() != layout {
            return bad(format!(
                "recovery {} needs --layout {}",
                self.scheme.name(),
                self.scheme.layout().name()
            ));
        }
        match query {
            Query::Scan => {
                if self.at != 0 {
                    return bad("Scan has one primitive: --fail-at scan".into());
                }
                if !self.scheme.needs_spare() {
                    return bad(format!(
                        "recovery {} moves checkpointed intermediate results, which Scan has none of: \
                         Scan recovers with spare or parity (the paper's Scan scenarios 1 and 2)",
                        self.scheme.name()
                    ));
                }
            }
            Query::Q1 => {
                if self.at > 0 && !checkpoint {
                    return bad(
                        "recovering Q1 after its first primitive needs --checkpoint on".into(),
                    );
                }
                if self.at == 0 && !self.scheme.needs_spare() {
                    return bad(format!(
                        "recovery {} needs a checkpointed primitive: fail at sort or agg-grp-sort",
                        self.scheme.name()
                    ));
                }
                if self.mid_checkpoint && self.at == 0 {
                    return bad(
                        "--fail-mid-checkpoint needs a checkpoint in flight: fail at sort or agg-grp-sort"
                            .into(),
                    );
                }
                if self.mid_checkpoint && self.at == 1 && !self.scheme.needs_spare() {
                    return bad(format!(
                        "recovery {} moves a completed checkpoint, and losing a node during Scan's \
                         checkpoint leaves none: fail at agg-grp-sort, or recover with spare or parity",
                        self.scheme.name()
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(scheme: Scheme, at: usize) -> Fault {
        Fault {
            mid_checkpoint: false,
            node: 1,
            at,
            mode: FailMode::Kill,
            scheme,
        }
    }

    #[test]
    fn faults_that_do_not_fit_the_query_or_layout_are_refused_with_the_reason() {
        let cases = [
            (
                f(Scheme::Parity, 2),
                Query::Q1,
                Layout::Mirror,
                true,
                "needs --layout parity",
            ),
            (
                f(Scheme::Spare, 2),
                Query::Q1,
                Layout::Parity,
                true,
                "needs --layout mirror",
            ),
            (
                f(Scheme::Migrate, 0),
                Query::Scan,
                Layout::Mirror,
                true,
                "Scan recovers with spare or parity",
            ),
            (
                f(Scheme::Spare, 1),
                Query::Scan,
                Layout::Mirror,
                true,
                "--fail-at scan",
            ),
            (
                f(Scheme::Spare, 2),
                Query::Q1,
                Layout::Mirror,
                false,
                "--checkpoint on",
            ),
            (
                f(Scheme::Redistribute, 0),
                Query::Q1,
                Layout::Mirror,
                true,
                "fail at sort or agg-grp-sort",
            ),
        ];
        for (fault, q, l, ckpt, want) in cases {
            let e = fault.check(q, l, 4, ckpt).unwrap_err().to_string();
            assert!(e.contains(want), "{fault:?}: {e}");
        }
        let e = Fault {
            node: 4,
            ..f(Scheme::Spare, 2)
        }
        .check(Query::Q1, Layout::Mirror, 4, true)
        .unwrap_err()
        .to_string();
        assert!(e.contains("nodes 0 to 3"), "{e}");
        f(Scheme::Spare, 0)
            .check(Query::Q1, Layout::Mirror, 4, false)
            .unwrap();
        f(Scheme::Redistribute, 2)
            .check(Query::Q1, Layout::Mirror, 4, true)
            .unwrap();
        assert_eq!(Fault::parse_at("agg-grp-sort").unwrap(), 2);
        assert!(
            Fault::parse_at("join")
                .unwrap_err()
                .to_string()
                .contains("scan, sort, agg-grp-sort")
        );
    }

    #[test]
    fn a_mid_checkpoint_fault_needs_a_checkpoint_in_flight_and_one_to_fall_back_to() {
        let mid = |scheme, at| Fault {
            mid_checkpoint: true,
            ..f(scheme, at)
        };
        let e = mid(Scheme::Spare, 0)
            .check(Query::Q1, Layout::Mirror, 4, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a checkpoint in flight"), "{e}");
        // Lost during Scan's checkpoint, migration and redistribution have
        // no completed checkpoint to move; the spare rebuilds the partition.
        for scheme in [Scheme::Migrate, Scheme::Redistribute] {
            let e = mid(scheme, 1)
                .check(Query::Q1, Layout::Mirror, 4, true)
                .unwrap_err()
                .to_string();
            assert!(e.contains("leaves none"), "{e}");
            mid(scheme, 2)
                .check(Query::Q1, Layout::Mirror, 4, true)
                .unwrap();
        }
        mid(Scheme::Spare, 1)
            .check(Query::Q1, Layout::Mirror, 4, true)
            .unwrap();
        mid(Scheme::Parity, 1)
            .check(Query::Q1, Layout::Parity, 4, true)
            .unwrap();
    }
}
