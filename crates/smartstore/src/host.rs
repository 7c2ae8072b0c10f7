//! The host (section 2.3 of the smart-storage paper): it places the table on
//! the storage groups, sends each node its plan fragments, has the
//! intermediate results checkpointed to the mirror (or parity) group at the
//! granularity of a primitive (section 4.2), and merges what comes back.
//!
//! A cluster is a main storage group of `nodes` data nodes, its redundancy
//! (a mirror group of as many nodes, or one dedicated parity node) and
//! optionally a spare. Local clusters start their nodes as processes of the
//! `rebound` binary (`rebound node`) or, in tests, as in-process servers;
//! a cluster of remote nodes is given by address.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;

use crate::client::NodeClient;
use crate::devmodel::DeviceModel;
use crate::error::{Error, Result};
use crate::node::InProcessNode;
use crate::plan::{Fragment, Primitive};
use crate::recovery::{FailMode, Fault, Scheme};
use crate::redundancy::{column_groups, row_owner};
use crate::tpch;
use crate::wire::{CheckpointCmd, RebuildCmd, ScatterCmd, Stats};

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
}

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

/// How local nodes are started.
#[derive(Debug, Clone)]
pub enum Launcher {
    /// As processes: `<exe> node --dir D --listen 127.0.0.1:0 --device-model M`.
    Process(PathBuf),
    /// As servers on threads of this process.
    InProcess,
}

#[derive(Debug)]
enum Owned {
    Process(Child),
    InProcess(InProcessNode),
}

/// A running cluster, connected.
#[derive(Debug)]
pub struct Cluster {
    /// Its shape.
    pub spec: ClusterSpec,
    /// Main group, by index.
    pub main: Vec<NodeClient>,
    /// Mirror group (mirror layout).
    pub mirror: Vec<NodeClient>,
    /// Parity node (parity layout).
    pub parity: Option<NodeClient>,
    /// Spare node.
    pub spare: Option<NodeClient>,
    /// Local nodes' directories, in role order (empty for remote nodes).
    pub dirs: Vec<PathBuf>,
    owned: Vec<Owned>,
    /// Called with a line of news while a query loses a node and recovers.
    pub progress: Option<Progress>,
}

/// A callback for recovery news.
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// A node working on a query: its inputs, and which main node it stands
/// for (none after redistribution).
#[derive(Debug, Clone)]
struct Worker {
    client: NodeClient,
    inputs: Vec<String>,
    slot: Option<usize>,
}

/// Runs primitive `p` on every worker (or only worker `only`), each over
/// its own inputs; one result per worker run.
async fn run_on(
    workers: &mut [Worker],
    output: &str,
    p: &Primitive,
    materialize: bool,
    only: Option<usize>,
) -> Vec<Result<(String, Stats)>> {
    let calls = workers
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| only.is_none_or(|o| o == *i))
        .map(|(_, w)| {
            let f = Fragment {
                input: w.inputs[0].clone(),
                also: w.inputs[1..].to_vec(),
                output: output.into(),
                primitive: p.clone(),
                materialize,
            };
            async move {
                let s = w.client.run(&f).await?;
                Ok((w.client.label().to_string(), s))
            }
        });
    futures::future::join_all(calls).await
}

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

/// Names of the objects a query materialises.
pub mod names {
    /// The base table partition on a main node.
    pub const LINEITEM: &str = "lineitem";
    /// The column-wise copy on a mirror node.
    pub const LINEITEM_COLS: &str = "lineitem.cols";
    /// The parity of the base partitions.
    pub const LINEITEM_PARITY: &str = "lineitem.parity";
    /// Scan workload output.
    pub const SCAN_OUT: &str = "scan.out";
    /// Q1 primitive outputs, in plan order.
    pub const Q1_OUT: [&str; 3] = ["q1.scan", "q1.sort", "q1.agg"];
    /// Name of a checkpoint of `object` on a mirror node.
    pub fn ckpt(object: &str) -> String {
        format!("{object}.ckpt")
    }
    /// Name of the parity of `object` on the parity node.
    pub fn parity(object: &str) -> String {
        format!("{object}.parity")
    }
}

impl Cluster {
    /// Starts a local cluster under `work` (one directory per node).
    pub async fn launch(spec: ClusterSpec, launcher: &Launcher, work: &Path) -> Result<Cluster> {
        spec.check()?;
        let roles = spec.roles();
        let mut owned = Vec::new();
        let mut addrs = Vec::new();
        let mut dirs = Vec::new();
        for role in &roles {
            let dir = work.join(role.replace(' ', "-"));
            let (o, addr) = match launcher {
                Launcher::InProcess => {
                    let n = InProcessNode::start(&dir, spec.model)?;
                    let a = n.addr.clone();
                    (Owned::InProcess(n), a)
                }
                Launcher::Process(exe) => {
                    let (child, a) = spawn_node(exe, &dir, spec.model, role)?;
                    (Owned::Process(child), a)
                }
            };
            owned.push(o);
            addrs.push(addr);
            dirs.push(dir);
        }
        let mut c = Cluster::connect(spec, &addrs).await?;
        c.owned = owned;
        c.dirs = dirs;
        Ok(c)
    }

    /// Connects to running nodes, given in role order (see
    /// [`ClusterSpec::roles`]).
    pub async fn connect(spec: ClusterSpec, addrs: &[String]) -> Result<Cluster> {
        spec.check()?;
        let roles = spec.roles();
        if addrs.len() != roles.len() {
            return Err(Error::Invalid(format!(
                "{} node addresses given; {} data nodes with {} layout{} need {}: {}",
                addrs.len(),
                spec.nodes,
                spec.layout.name(),
                if spec.spare { " and a spare" } else { "" },
                roles.len(),
                roles.join(", ")
            )));
        }
        let mut clients = Vec::new();
        for (role, addr) in roles.iter().zip(addrs) {
            let label = format!("{role} ({addr})");
            let mut c = NodeClient::connect(addr, &label).await?;
            c.ping().await?;
            clients.push(c);
        }
        let mut it = clients.into_iter();
        let main: Vec<NodeClient> = it.by_ref().take(spec.nodes).collect();
        let (mirror, parity) = match spec.layout {
            Layout::Mirror => (it.by_ref().take(spec.nodes).collect(), None),
            Layout::Parity => (Vec::new(), it.next()),
        };
        let spare = if spec.spare { it.next() } else { None };
        Ok(Cluster {
            spec,
            main,
            mirror,
            parity,
            spare,
            dirs: Vec::new(),
            owned: Vec::new(),
            progress: None,
        })
    }

    /// Places the table: row blocks round-robin on the main group, the
    /// column-wise copy on the mirror group, or the partitions' parity on
    /// the parity node. Returns the wall time.
    pub async fn place(&mut self, schema: SchemaRef, batches: &[RecordBatch]) -> Result<f64> {
        let t = Instant::now();
        let n = self.spec.nodes;
        let mut parts: Vec<Vec<RecordBatch>> = vec![Vec::new(); n];
        for (b, batch) in batches.iter().enumerate() {
            parts[row_owner(b, n)].push(batch.clone());
        }
        let puts = self.main.iter_mut().zip(parts).map(|(c, part)| {
            let schema = schema.clone();
            async move { c.put_table(names::LINEITEM, schema, part).await }
        });
        futures::future::try_join_all(puts).await?;
        match self.spec.layout {
            Layout::Mirror => {
                let groups = column_groups(schema.fields().len(), n);
                let puts = self.mirror.iter_mut().zip(groups).map(|(c, g)| {
                    let cols: Vec<usize> = g.collect();
                    let s = std::sync::Arc::new(schema.project(&cols).expect("columns in range"));
                    let b: Vec<RecordBatch> = batches
                        .iter()
                        .map(|b| b.project(&cols).expect("columns in range"))
                        .collect();
                    async move { c.put_table(names::LINEITEM_COLS, s, b).await }
                });
                futures::future::try_join_all(puts).await?;
            }
            Layout::Parity => {
                self.checkpoint_all(names::LINEITEM).await?;
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Checkpoints every main node's `object` to its mirror node, or into
    /// the parity node's parity.
    pub async fn checkpoint_all(&mut self, object: &str) -> Result<Vec<(String, Stats)>> {
        let mut workers = self.main_workers(object);
        self.checkpoint_workers(&mut workers, object).await
    }

    /// Every main node, working on `input`.
    fn main_workers(&self, input: &str) -> Vec<Worker> {
        self.main
            .iter()
            .enumerate()
            .map(|(i, c)| Worker {
                client: c.clone(),
                inputs: vec![input.to_string()],
                slot: Some(i),
            })
            .collect()
    }

    /// Runs a workload, failure-free; `checkpoint` makes Q1 checkpoint each
    /// intermediate result to the redundancy group (section 4.2).
    pub async fn run_query(&mut self, query: Query, checkpoint: bool) -> Result<QueryReport> {
        self.run_query_with(query, checkpoint, None).await
    }

    /// Runs a workload, losing a node as `fault` says and recovering with
    /// its scheme (see [`crate::recovery`]).
    pub async fn run_query_with(
        &mut self,
        query: Query,
        checkpoint: bool,
        fault: Option<Fault>,
    ) -> Result<QueryReport> {
        if let Some(f) = &fault {
            f.check(query, self.spec.layout, self.spec.nodes, checkpoint)?;
            if f.scheme.needs_spare() && self.spare.is_none() {
                return Err(Error::Invalid(format!(
                    "recovery {} needs a spare node",
                    f.scheme.name()
                )));
            }
            if self.owned.is_empty() {
                return Err(Error::Invalid(
                    "--fail-node needs local nodes (started by the host), not --node-addrs".into(),
                ));
            }
        }
        let mut phases = Vec::new();
        let mut workers = self.main_workers(names::LINEITEM);
        // After migration or redistribution the working set has no
        // redundancy group of its own: no further checkpoints.
        let mut degraded = false;
        let (prims, outs, labels): (Vec<Primitive>, Vec<&str>, Vec<&str>) = match query {
            Query::Scan => (
                vec![tpch::scan_primitive()],
                vec![names::SCAN_OUT],
                vec!["scan"],
            ),
            Query::Q1 => (
                tpch::q1_primitives().to_vec(),
                names::Q1_OUT.to_vec(),
                crate::recovery::PRIMITIVES.to_vec(),
            ),
        };
        for k in 0..prims.len() {
            if let Some(f) = fault.filter(|f| f.at == k) {
                self.progress(&format!(
                    "fault: losing main {} ({:?}) just before {}",
                    f.node, f.mode, labels[k]
                ));
                self.fail_node(f.node, f.mode)?;
            }
            let keep = checkpoint && k + 1 < prims.len() && !degraded;
            let t = Instant::now();
            let results = run_on(&mut workers, outs[k], &prims[k], keep, None).await;
            let mut lost = Vec::new();
            let mut done = Vec::new();
            for (w, r) in results.into_iter().enumerate() {
                match r {
                    Ok(s) => done.push(s),
                    Err(e) if e.is_node_lost() => lost.push((w, e)),
                    Err(e) => return Err(e),
                }
            }
            if lost.is_empty() {
                phases.push(Phase::from_nodes(
                    labels[k],
                    t.elapsed().as_secs_f64(),
                    &done,
                ));
            } else {
                let Some(f) = fault else {
                    return Err(lost.remove(0).1);
                };
                if lost.len() > 1 || workers[lost[0].0].slot != Some(f.node) {
                    let which: Vec<String> = lost.iter().map(|(_, e)| e.to_string()).collect();
                    return Err(Error::Invalid(format!(
                        "the schemes recover one lost main node; lost: {}",
                        which.join("; ")
                    )));
                }
                let (w, e) = lost.remove(0);
                phases.push(Phase::from_nodes(
                    &format!("{} (node lost)", labels[k]),
                    t.elapsed().as_secs_f64(),
                    &done,
                ));
                self.progress(&format!(
                    "detected: {e}; recovering with {}",
                    f.scheme.name()
                ));
                let t = Instant::now();
                let src = if k == 0 { names::LINEITEM } else { outs[k - 1] };
                let rerun_all = match f.scheme {
                    Scheme::Spare | Scheme::Parity => {
                        let lost_slot = f.node;
                        let cmd = self.rebuild_cmd(f.scheme, lost_slot, src, k == 0);
                        let spare = self.spare.clone().expect("checked above");
                        self.progress(&format!(
                            "rebuilding main {lost_slot}'s {src} on the spare ({})",
                            spare.addr()
                        ));
                        let mut sp = spare.clone();
                        let s = sp.rebuild(&cmd).await?;
                        phases.push(Phase::from_nodes(
                            "recovery",
                            t.elapsed().as_secs_f64(),
                            &[(sp.label().to_string(), s)],
                        ));
                        workers[w] = Worker {
                            client: sp,
                            inputs: vec![src.to_string()],
                            slot: Some(lost_slot),
                        };
                        // Scan restarts from the beginning (the paper's Scan
                        // scenarios); Q1 reruns the interrupted primitive on
                        // the spare only.
                        query == Query::Scan
                    }
                    Scheme::Migrate => {
                        workers = self
                            .mirror
                            .iter()
                            .enumerate()
                            .map(|(j, m)| Worker {
                                client: m.clone(),
                                inputs: vec![names::ckpt(src)],
                                slot: Some(j),
                            })
                            .collect();
                        degraded = true;
                        phases.push(Phase::from_nodes(
                            "recovery",
                            t.elapsed().as_secs_f64(),
                            &[],
                        ));
                        true
                    }
                    Scheme::Redistribute => {
                        let n = self.spec.nodes;
                        let mut survivors: Vec<NodeClient> = (0..n)
                            .filter(|&i| i != f.node)
                            .map(|i| self.main[i].clone())
                            .collect();
                        survivors.extend(self.mirror.iter().cloned());
                        let targets: Vec<String> =
                            survivors.iter().map(|c| c.addr().to_string()).collect();
                        let pieces: Vec<String> =
                            (0..n).map(|p| format!("{src}.piece{p}")).collect();
                        self.progress(&format!(
                            "redistributing {src} over {} surviving nodes",
                            targets.len()
                        ));
                        let scatters = (0..n).map(|p| {
                            let (mut holder, object) = if p == f.node {
                                (self.mirror[p].clone(), names::ckpt(src))
                            } else {
                                (self.main[p].clone(), src.to_string())
                            };
                            let cmd = ScatterCmd {
                                object,
                                targets: targets.clone(),
                                as_name: pieces[p].clone(),
                            };
                            async move {
                                let s = holder.scatter(&cmd).await?;
                                Ok::<_, Error>((holder.label().to_string(), s))
                            }
                        });
                        let s = futures::future::try_join_all(scatters).await?;
                        phases.push(Phase::from_nodes("recovery", t.elapsed().as_secs_f64(), &s));
                        workers = survivors
                            .into_iter()
                            .map(|c| Worker {
                                client: c,
                                inputs: pieces.clone(),
                                slot: None,
                            })
                            .collect();
                        degraded = true;
                        true
                    }
                };
                let keep = checkpoint && k + 1 < prims.len() && !degraded;
                let t = Instant::now();
                let only = (!rerun_all).then_some(w);
                let results = run_on(&mut workers, outs[k], &prims[k], keep, only).await;
                let named = results.into_iter().collect::<Result<Vec<_>>>()?;
                phases.push(Phase::from_nodes(
                    &format!("{} (after recovery)", labels[k]),
                    t.elapsed().as_secs_f64(),
                    &named,
                ));
                self.progress("recovered; continuing");
            }
            for w in workers.iter_mut() {
                w.inputs = vec![outs[k].to_string()];
            }
            if checkpoint && k + 1 < prims.len() && !degraded {
                let t = Instant::now();
                let s = self.checkpoint_workers(&mut workers, outs[k]).await?;
                phases.push(Phase::from_nodes(
                    &format!("checkpoint {}", labels[k]),
                    t.elapsed().as_secs_f64(),
                    &s,
                ));
            }
        }
        let last = outs[outs.len() - 1];
        let t = Instant::now();
        let calls = workers
            .iter_mut()
            .map(|w| async move { w.client.get_table(last, None, None).await });
        let parts = futures::future::try_join_all(calls).await?;
        let fetched = t.elapsed().as_secs_f64();
        let schema = parts[0].0.clone();
        let rows: Vec<RecordBatch> = parts.into_iter().flat_map(|p| p.1).collect();
        let c = Instant::now();
        let (schema, result) = match query {
            Query::Scan => (schema.clone(), tpch::order_scan(schema, rows).await?),
            Query::Q1 => {
                let merged = tpch::q1_merge(schema, rows).await?;
                (merged.schema(), vec![merged])
            }
        };
        phases.push(Phase {
            name: if query == Query::Scan {
                "collect"
            } else {
                "merge"
            }
            .into(),
            wall_s: t.elapsed().as_secs_f64(),
            io_s: 0.0,
            compute_s: c.elapsed().as_secs_f64(),
            comm_s: fetched,
            critical: "host".into(),
        });
        Ok(QueryReport {
            query,
            schema,
            result,
            phases,
        })
    }

    /// The rebuild of main `lost`'s object `src` on the spare.
    fn rebuild_cmd(&self, scheme: Scheme, lost: usize, src: &str, base: bool) -> RebuildCmd {
        match (scheme, base) {
            (Scheme::Parity, _) => RebuildCmd::Parity {
                parity: (
                    self.parity
                        .as_ref()
                        .expect("parity layout")
                        .addr()
                        .to_string(),
                    names::parity(src),
                ),
                survivors: (0..self.spec.nodes)
                    .filter(|&i| i != lost)
                    .map(|i| (i, self.main[i].addr().to_string(), src.to_string()))
                    .collect(),
                member: lost,
                name: src.to_string(),
            },
            // The original partition: a parallel read of the column-wise
            // mirror group (section 3.1).
            (_, true) => RebuildCmd::MirrorColumns {
                sources: self.mirror.iter().map(|m| m.addr().to_string()).collect(),
                cols_object: names::LINEITEM_COLS.into(),
                member: lost,
                name: src.to_string(),
            },
            // The latest checkpoint: one mirror node sends it.
            (_, false) => RebuildCmd::Copy {
                source: self.mirror[lost].addr().to_string(),
                object: names::ckpt(src),
                name: src.to_string(),
            },
        }
    }

    /// Checkpoints each worker's `object` to the redundancy slot of the
    /// main node it stands for.
    async fn checkpoint_workers(
        &mut self,
        workers: &mut [Worker],
        object: &str,
    ) -> Result<Vec<(String, Stats)>> {
        let n = self.spec.nodes;
        let calls = workers.iter_mut().map(|w| {
            let slot = w.slot.expect("checkpointing workers stand for main nodes");
            let (target, as_name, parity) = match self.spec.layout {
                Layout::Mirror => (
                    self.mirror[slot].addr().to_string(),
                    names::ckpt(object),
                    None,
                ),
                Layout::Parity => (
                    self.parity
                        .as_ref()
                        .expect("parity layout")
                        .addr()
                        .to_string(),
                    names::parity(object),
                    Some((slot, n)),
                ),
            };
            let cmd = CheckpointCmd {
                object: object.into(),
                target,
                as_name,
                parity,
            };
            async move {
                let s = w.client.checkpoint(&cmd).await?;
                Ok::<_, Error>((w.client.label().to_string(), s))
            }
        });
        futures::future::try_join_all(calls).await
    }

    /// Loses main node `i`: kills its process (or stops its in-process
    /// server), or moves its directory away.
    pub fn fail_node(&mut self, i: usize, mode: FailMode) -> Result<()> {
        let label = format!("main {i}");
        match mode {
            FailMode::Unreadable => {
                let dir = self
                    .dirs
                    .get(i)
                    .ok_or_else(|| Error::Invalid(format!("{label} is not local")))?;
                let away = dir.with_extension("lost");
                std::fs::rename(dir, &away).map_err(|e| Error::io(dir, e))?;
            }
            FailMode::Kill => match self.owned.get_mut(i) {
                Some(Owned::Process(c)) => {
                    c.kill()
                        .map_err(|e| Error::node(&label, format!("kill: {e}")))?;
                    let _ = c.wait();
                }
                Some(Owned::InProcess(n)) => n.halt(),
                None => return Err(Error::Invalid(format!("{label} is not local"))),
            },
        }
        Ok(())
    }

    fn progress(&self, msg: &str) {
        if let Some(p) = &self.progress {
            (p.0)(msg);
        }
        tracing::info!("{msg}");
    }

    /// Stops local nodes (processes are killed).
    pub fn shutdown(&mut self) {
        for o in self.owned.drain(..) {
            match o {
                Owned::Process(mut c) => {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                Owned::InProcess(n) => n.stop(),
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts `exe node` and reads the address it prints.
fn spawn_node(exe: &Path, dir: &Path, model: DeviceModel, role: &str) -> Result<(Child, String)> {
    let mut child = Command::new(exe)
        .arg("node")
        .arg("--dir")
        .arg(dir)
        .args(["--listen", "127.0.0.1:0", "--device-model", model.name()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| Error::node(role, format!("could not start {}: {e}", exe.display())))?;
    let stdout = child.stdout.take().expect("piped");
    let mut line = String::new();
    let read = BufReader::new(stdout).read_line(&mut line);
    let addr = line.trim().rsplit(' ').next().unwrap_or("").to_string();
    if read.is_err() || !line.starts_with("smartstore node listening on ") || addr.is_empty() {
        let _ = child.kill();
        let status = child.wait().ok();
        return Err(Error::node(
            role,
            format!("did not start (said {:?}, exit {status:?})", line.trim()),
        ));
    }
    Ok((child, addr))
}
