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
    /// Ran behind the query's critical path (a checkpoint overlapping the
    /// next primitive): not part of the query's time.
    pub background: bool,
    /// For a checkpoint phase, where its cost went.
    pub checkpoint: Option<CheckpointCost>,
    /// Rows the phase produced, summed over its nodes: 0 for a primitive a
    /// node deferred into its reader (it runs, and counts, there).
    pub rows: u64,
}

/// Where checkpointing one primitive's output went (section 4.2): the
/// times are the busiest node's, the bytes the sum over every node.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CheckpointCost {
    /// Encoding the output once (see [`crate::codec`]).
    pub encode_s: f64,
    /// Writing it to the owner's device and to the receiver's.
    pub device_s: f64,
    /// Sending it to the mirror or parity node.
    pub transfer_s: f64,
    /// Folding it into the parity on the parity node.
    pub fold_s: f64,
    /// In-memory bytes checkpointed.
    pub raw_bytes: u64,
    /// Encoded bytes sent (and written on each side).
    pub sent_bytes: u64,
}

impl Phase {
    /// The phase's time as the model sees it.
    pub fn total_s(&self) -> f64 {
        self.io_s + self.compute_s + self.comm_s
    }

    /// A phase from each node's stats and the host's wall time.
    pub fn from_nodes(name: &str, wall_s: f64, nodes: &[(String, Stats)]) -> Phase {
        let (critical, s) = busiest(nodes);
        let measured = s.io_real_s + s.compute_s + s.comm_s;
        Phase {
            name: name.into(),
            wall_s,
            io_s: s.io_s,
            compute_s: s.compute_s,
            comm_s: s.comm_s + (wall_s - measured).max(0.0),
            critical,
            background: false,
            checkpoint: None,
            rows: nodes.iter().map(|n| n.1.rows_out).sum(),
        }
    }

    /// A checkpoint that ran behind the next primitive, from `wall_s` after
    /// it started until it settled.
    pub fn checkpoint(name: &str, wall_s: f64, nodes: &[(String, Stats)]) -> Phase {
        let mut p = Phase::from_nodes(name, wall_s, nodes);
        let (_, busiest) = busiest(nodes);
        p.background = true;
        p.checkpoint = Some(CheckpointCost {
            encode_s: busiest.encode_s,
            device_s: busiest.io_s,
            transfer_s: busiest.comm_s,
            fold_s: busiest.fold_s,
            raw_bytes: nodes.iter().map(|n| n.1.raw_bytes).sum(),
            sent_bytes: nodes.iter().map(|n| n.1.bytes_moved).sum(),
        });
        p
    }
}

/// The node that was busy longest, and its stats (none: defaults).
fn busiest(nodes: &[(String, Stats)]) -> (String, Stats) {
    nodes
        .iter()
        .max_by(|a, b| a.1.busy_s().total_cmp(&b.1.busy_s()))
        .cloned()
        .unwrap_or_default()
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
    /// Wall-clock time from the query's start until its last checkpoint
    /// settled (at least the answer's time).
    pub settled_s: f64,
}

impl QueryReport {
    /// The phases on the query's critical path.
    pub fn critical_path(&self) -> impl Iterator<Item = &Phase> {
        self.phases.iter().filter(|p| !p.background)
    }
    /// The checkpoints that ran behind the next primitive.
    pub fn background(&self) -> impl Iterator<Item = &Phase> {
        self.phases.iter().filter(|p| p.background)
    }
    /// Sum over the critical path's phases of (I/O, compute,
    /// communication).
    pub fn breakdown(&self) -> (f64, f64, f64) {
        self.critical_path().fold((0.0, 0.0, 0.0), |a, p| {
            (a.0 + p.io_s, a.1 + p.compute_s, a.2 + p.comm_s)
        })
    }
    /// Modelled execution time.
    pub fn total_s(&self) -> f64 {
        self.critical_path().map(Phase::total_s).sum()
    }
    /// Wall-clock time until the answer.
    pub fn wall_s(&self) -> f64 {
        self.critical_path().map(|p| p.wall_s).sum()
    }
    /// The checkpoints' cost, summed over the primitives checkpointed.
    pub fn checkpoint_cost(&self) -> CheckpointCost {
        self.phases
            .iter()
            .filter_map(|p| p.checkpoint)
            .fold(CheckpointCost::default(), |a, c| CheckpointCost {
                encode_s: a.encode_s + c.encode_s,
                device_s: a.device_s + c.device_s,
                transfer_s: a.transfer_s + c.transfer_s,
                fold_s: a.fold_s + c.fold_s,
                raw_bytes: a.raw_bytes + c.raw_bytes,
                sent_bytes: a.sent_bytes + c.sent_bytes,
            })
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
        for p in self.critical_path() {
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
        let mut behind = self.background().peekable();
        if behind.peek().is_some() {
            s.push_str(&format!(
                "\n{:<30} {:>9} {:>9} {:>9} {:>9} {:>9}  {:>12} {:>12}\n",
                "behind the query",
                "wall s",
                "encode s",
                "device s",
                "send s",
                "fold s",
                "MB in memory",
                "MB sent"
            ));
            for p in behind {
                let c = p.checkpoint.unwrap_or_default();
                s.push_str(&format!(
                    "{:<30} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}  {:>12.1} {:>12.1}\n",
                    p.name,
                    p.wall_s,
                    c.encode_s,
                    c.device_s,
                    c.transfer_s,
                    c.fold_s,
                    c.raw_bytes as f64 / 1e6,
                    c.sent_bytes as f64 / 1e6
                ));
            }
            s.push_str(&format!(
                "answer after {:.3} s; every checkpoint settled after {:.3} s\n",
                self.wall_s(),
                self.settled_s
            ));
        }
        s
    }
}
