//! What a query reports: its answer and, phase by phase, where its time
//! went (I/O as the device model charges it, compute, communication), the
//! breakdown of the paper's results (section 5).

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;

use crate::spec::Query;
use crate::wire::Stats;

/// Where one phase's time went: the busiest node's I/O, compute and
/// communication; what the host measured beyond that node's own work
/// (request round trips, fetching results) counts as communication.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// Phase name (`scan`, `checkpoint sort`, ...).
    pub name: String,
    /// Wall-clock time the host measured.
    pub wall_s: f64,
    /// I/O time as charged to the device model.
    pub io_s: f64,
    /// Compute time.
    pub compute_s: f64,
    /// Communication time.
    pub comm_s: f64,
    /// The busiest node.
    pub critical: String,
}

impl Phase {
    /// The phase's time as the model sees it.
    pub fn total_s(&self) -> f64 {
        self.io_s + self.compute_s + self.comm_s
    }

    /// A phase from each node's stats and the host's wall time.
    pub fn from_nodes(name: &str, wall_s: f64, nodes: &[(String, Stats)]) -> Phase {
        let (critical, s) = nodes
            .iter()
            .max_by(|a, b| a.1.busy_s().total_cmp(&b.1.busy_s()))
            .cloned()
            .unwrap_or_default();
        let measured = s.io_real_s + s.compute_s + s.comm_s;
        Phase {
            name: name.into(),
            wall_s,
            io_s: s.io_s,
            compute_s: s.compute_s,
            comm_s: s.comm_s + (wall_s - measured).max(0.0),
            critical,
        }
    }
}

/// A query's answer and where its time went.
#[derive(Debug)]
pub struct QueryReport {
    /// The query.
    pub query: Query,
    /// Result schema.
    pub schema: SchemaRef,
    /// Result rows.
    pub result: Vec<RecordBatch>,
    /// Phases in order.
    pub phases: Vec<Phase>,
}

impl QueryReport {
    /// Sum over phases of (I/O, compute, communication).
    pub fn breakdown(&self) -> (f64, f64, f64) {
        self.phases.iter().fold((0.0, 0.0, 0.0), |a, p| {
            (a.0 + p.io_s, a.1 + p.compute_s, a.2 + p.comm_s)
        })
    }
    /// Modelled execution time.
    pub fn total_s(&self) -> f64 {
        self.phases.iter().map(Phase::total_s).sum()
    }
    /// Wall-clock time.
    pub fn wall_s(&self) -> f64 {
        self.phases.iter().map(|p| p.wall_s).sum()
    }
    /// Rows in the result.
    pub fn rows(&self) -> usize {
        self.result.iter().map(|b| b.num_rows()).sum()
    }
    /// The phase table, one line per phase.
    pub fn phase_table(&self) -> String {
        let mut s = format!(
            "{:<30} {:>9} {:>9} {:>9} {:>9} {:>9}  {}\n",
            "phase", "wall s", "io s", "compute s", "comm s", "total s", "busiest"
        );
        for p in &self.phases {
            s.push_str(&format!(
                "{:<30} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}  {}\n",
                p.name,
                p.wall_s,
                p.io_s,
                p.compute_s,
                p.comm_s,
                p.total_s(),
                p.critical
            ));
        }
        let (io, c, m) = self.breakdown();
        s.push_str(&format!(
            "{:<30} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}\n",
            "total",
            self.wall_s(),
            io,
            c,
            m,
            self.total_s()
        ));
        s
    }
}
