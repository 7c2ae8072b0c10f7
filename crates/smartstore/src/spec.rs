//! What the host is asked for, before anything runs: the cluster's shape
//! (a main storage group, its redundancy layout and an optional spare) and
//! the workload. These are the plan-level types the recovery schemes check
//! a fault against and the host builds and runs.
//!
//! | type | paper |
//! |---|---|
//! | [`Layout::Mirror`] | mirror group, row-wise in the main group and column-wise in the mirror (section 3.1) |
//! | [`Layout::Parity`] | one dedicated parity node, RAID-4 (section 3.4) |
//! | [`Query`] | the Scan and TPC-H Q1 workloads (section 4) |
//! | [`ClusterSpec`] | storage groups of smart nodes (sections 2.2 and 3) |

use crate::devmodel::DeviceModel;
use crate::error::{Error, Result};

/// How the main group's data is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// A mirror group: row-wise partitions in the main group, column-wise
    /// in the mirror (section 3.1).
    Mirror,
    /// One dedicated parity node, RAID-4 (section 3.4).
    Parity,
}

impl Layout {
    /// Parses `mirror` or `parity`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mirror" => Ok(Layout::Mirror),
            "parity" => Ok(Layout::Parity),
            o => Err(Error::Invalid(format!(
                "unknown layout {o:?}: expected mirror or parity"
            ))),
        }
    }
    /// The name `parse` accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Layout::Mirror => "mirror",
            Layout::Parity => "parity",
        }
    }
}

/// The paper's workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    /// A selective SELECT over lineitem.
    Scan,
    /// TPC-H Q1 as Scan, Sort, Group-by+Aggregate+LocalSort.
    Q1,
}

impl Query {
    /// Parses `scan` or `q1`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "scan" => Ok(Query::Scan),
            "q1" => Ok(Query::Q1),
            o => Err(Error::Invalid(format!(
                "unknown query {o:?}: expected scan or q1"
            ))),
        }
    }
    /// The name `parse` accepts.
    pub fn name(&self) -> &'static str {
        match self {
            Query::Scan => "scan",
            Query::Q1 => "q1",
        }
    }
}

/// Shape of a cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterSpec {
    /// Data nodes in the main group (and in the mirror group).
    pub nodes: usize,
    /// Redundancy.
    pub layout: Layout,
    /// Whether a spare node stands by.
    pub spare: bool,
    /// Device model of every node.
    pub model: DeviceModel,
    /// Memory of every node the host starts (`rebound node --memory`):
    /// what it caches objects in, and a primitive's working memory once
    /// its input is larger (see `node::bounded`).
    pub memory: usize,
}

/// A node's memory unless told otherwise: the paper's 64 MB of on-device
/// memory (section 5).
pub const DEFAULT_NODE_MEMORY: usize = 64 << 20;

/// Largest group the host drives.
pub const MAX_NODES: usize = 32;

impl ClusterSpec {
    /// Checks the shape.
    pub fn check(&self) -> Result<()> {
        if self.nodes < 2 || self.nodes > MAX_NODES {
            return Err(Error::Invalid(format!(
                "{} data nodes: want 2 to {MAX_NODES} (redundancy needs at least 2)",
                self.nodes
            )));
        }
        Ok(())
    }

    /// Every node's role label, in the order addresses are given: main
    /// nodes, then mirror nodes or the parity node, then the spare.
    pub fn roles(&self) -> Vec<String> {
        let mut r: Vec<String> = (0..self.nodes).map(|i| format!("main {i}")).collect();
        match self.layout {
            Layout::Mirror => r.extend((0..self.nodes).map(|i| format!("mirror {i}"))),
            Layout::Parity => r.push("parity".into()),
        }
        if self.spare {
            r.push("spare".into());
        }
        r
    }
}
