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
use crate::node::{CheckpointCmd, InProcessNode, Stats};
use crate::plan::{Fragment, Primitive};
use crate::redundancy::{column_groups, row_owner};
use crate::tpch;

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
            "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9}  {}\n",
            "phase", "wall s", "io s", "compute s", "comm s", "total s", "busiest"
        );
        for p in &self.phases {
            s.push_str(&format!(
                "{:<20} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}  {}\n",
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
            "{:<20} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}\n",
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
        let n = self.spec.nodes;
        // (target address, object name there, parity member of members)
        type Target = (String, String, Option<(usize, usize)>);
        let targets: Vec<Target> = match self.spec.layout {
            Layout::Mirror => self
                .mirror
                .iter()
                .map(|m| (m.addr().to_string(), names::ckpt(object), None))
                .collect(),
            Layout::Parity => {
                let p = self
                    .parity
                    .as_ref()
                    .expect("parity layout has a parity node");
                (0..n)
                    .map(|i| (p.addr().to_string(), names::parity(object), Some((i, n))))
                    .collect()
            }
        };
        let calls = self
            .main
            .iter_mut()
            .zip(targets)
            .map(|(c, (target, as_name, parity))| {
                let cmd = CheckpointCmd {
                    object: object.into(),
                    target,
                    as_name,
                    parity,
                };
                async move {
                    let s = c.checkpoint(&cmd).await?;
                    Ok::<_, Error>((c.label().to_string(), s))
                }
            });
        futures::future::try_join_all(calls).await
    }

    /// Runs one primitive on every main node.
    /// `materialize` writes each output to the node's device.
    pub async fn run_all(
        &mut self,
        input: &str,
        output: &str,
        primitive: &Primitive,
        materialize: bool,
    ) -> Result<Vec<(String, Stats)>> {
        let f = Fragment {
            input: input.into(),
            output: output.into(),
            primitive: primitive.clone(),
            materialize,
        };
        let calls = self.main.iter_mut().map(|c| {
            let f = f.clone();
            async move {
                let s = c.run(&f).await?;
                Ok::<_, Error>((c.label().to_string(), s))
            }
        });
        futures::future::try_join_all(calls).await
    }

    /// Fetches `object` from every main node.
    pub async fn collect(&mut self, object: &str) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        let calls = self
            .main
            .iter_mut()
            .map(|c| async move { c.get_table(object, None, None).await });
        let parts = futures::future::try_join_all(calls).await?;
        let schema = parts[0].0.clone();
        Ok((schema, parts.into_iter().flat_map(|p| p.1).collect()))
    }

    /// Runs a workload, failure-free; `checkpoint` makes Q1 checkpoint each
    /// intermediate result to the redundancy group (section 4.2).
    pub async fn run_query(&mut self, query: Query, checkpoint: bool) -> Result<QueryReport> {
        let mut phases = Vec::new();
        match query {
            Query::Scan => {
                let t = Instant::now();
                let s = self
                    .run_all(
                        names::LINEITEM,
                        names::SCAN_OUT,
                        &tpch::scan_primitive(),
                        false,
                    )
                    .await?;
                phases.push(Phase::from_nodes("scan", t.elapsed().as_secs_f64(), &s));
                let t = Instant::now();
                let (schema, rows) = self.collect(names::SCAN_OUT).await?;
                let fetched = t.elapsed().as_secs_f64();
                let c = Instant::now();
                let result = tpch::order_scan(schema.clone(), rows).await?;
                phases.push(Phase {
                    name: "collect".into(),
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
            Query::Q1 => {
                let prims = tpch::q1_primitives();
                let labels = ["scan", "sort", "agg-grp-sort"];
                let mut input = names::LINEITEM;
                for (i, p) in prims.iter().enumerate() {
                    let out = names::Q1_OUT[i];
                    let t = Instant::now();
                    // Outputs that get checkpointed are materialised; the
                    // last one (a few rows per node) goes to the host.
                    let keep = checkpoint && i + 1 < prims.len();
                    let s = self.run_all(input, out, p, keep).await?;
                    phases.push(Phase::from_nodes(labels[i], t.elapsed().as_secs_f64(), &s));
                    if keep {
                        let t = Instant::now();
                        let s = self.checkpoint_all(out).await?;
                        phases.push(Phase::from_nodes(
                            &format!("checkpoint {}", labels[i]),
                            t.elapsed().as_secs_f64(),
                            &s,
                        ));
                    }
                    input = out;
                }
                let t = Instant::now();
                let (schema, partials) = self.collect(names::Q1_OUT[2]).await?;
                let fetched = t.elapsed().as_secs_f64();
                let c = Instant::now();
                let merged = tpch::q1_merge(schema, partials).await?;
                phases.push(Phase {
                    name: "merge".into(),
                    wall_s: t.elapsed().as_secs_f64(),
                    io_s: 0.0,
                    compute_s: c.elapsed().as_secs_f64(),
                    comm_s: fetched,
                    critical: "host".into(),
                });
                Ok(QueryReport {
                    query,
                    schema: merged.schema(),
                    result: vec![merged],
                    phases,
                })
            }
        }
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
