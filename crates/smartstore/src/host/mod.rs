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
//!
//! A local cluster is closed to strangers: its host writes a fresh cluster
//! token (`cluster.token`, mode 0600) and the members file
//! (`cluster.members`: every node's address, rewritten once the nodes have
//! bound their ports) in the work directory, and starts every node with
//! both, so a node answers only calls carrying the token and sends
//! checkpoints only to the cluster's own nodes (see [`crate::access`]).
//!
//! This file is the cluster itself: starting or connecting its nodes,
//! placing the table, checkpointing to the redundancy group, losing a node.
//! Running a query primitive by primitive is in `query`, recovering a lost
//! node mid-query in `recover`, the report in `report`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;

use crate::access::{Credentials, Members, NodeAccess, Token, write_private};
use crate::client::NodeClient;
use crate::codec::Codec;
use crate::error::{Error, Result};
use crate::node::InProcessNode;
use crate::plan::{Fragment, Primitive};
use crate::recovery::FailMode;
use crate::redundancy::{column_groups, row_owner};
use crate::wire::{CheckpointCmd, PutCmd, Stats};

pub mod netns;
mod query;
mod recover;
mod report;

pub use netns::Link;

pub use report::{CheckpointCost, Phase, QueryReport};
// The plan-level types once lived here; their old paths stay.
pub use crate::spec::{ClusterSpec, DEFAULT_NODE_MEMORY, Layout, MAX_NODES, Query};

/// A first run number unlikely to meet one an earlier host left on the
/// same nodes: the clock's nanoseconds.
fn first_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// How local nodes are started.
#[derive(Debug, Clone)]
pub enum Launcher {
    /// As processes: `<exe> node --dir D --listen 127.0.0.1:0 --device-model M
    /// --token-file T --members-file F`.
    Process(PathBuf),
    /// As servers on threads of this process.
    InProcess,
    /// As processes, each in a network namespace of its own on a link of
    /// the given rate (see [`netns`]): "one node per host" on one machine.
    Netns(PathBuf, Link),
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
    /// The local nodes' network namespaces, if they have their own.
    net: Option<netns::Network>,
    /// Called with a line of news while a query loses a node and recovers.
    pub progress: Option<Progress>,
    /// How checkpoints are encoded (see [`crate::codec`]).
    pub codec: Codec,
    /// Run every primitive where the paper's plan puts it, materialising
    /// its output, even in a query without checkpoints (no node defers a
    /// primitive into its reader). Off by default; `rebound bench
    /// smartstore` turns it on to split Q1's checkpoint cost into what the
    /// checkpointed plan costs and what the checkpoints themselves cost.
    pub materialise: bool,
    /// The last query run's number (parity folds are per run).
    epoch: u64,
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
/// its own inputs; one result per worker run. Outputs stay in memory (a
/// checkpoint writes them to the device); `defer`: whether a node may
/// defer the primitive into its reader ([`Fragment::defer`]).
async fn run_on(
    workers: &mut [Worker],
    output: &str,
    p: &Primitive,
    defer: bool,
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
                materialize: false,
                defer,
            };
            async move {
                let s = w.client.run(&f).await?;
                Ok((w.client.label().to_string(), s))
            }
        });
    futures::future::join_all(calls).await
}

/// Every node of a group, node `i` standing for main node `i`, working on
/// `input`.
fn group_workers(group: &[NodeClient], input: &str) -> Vec<Worker> {
    group
        .iter()
        .enumerate()
        .map(|(i, c)| Worker {
            client: c.clone(),
            inputs: vec![input.to_string()],
            slot: Some(i),
        })
        .collect()
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
        std::fs::create_dir_all(work).map_err(|e| Error::io(work, e))?;
        let files = ClusterFiles {
            token: work.join("cluster.token"),
            members: work.join("cluster.members"),
        };
        let token = Token::read_or_generate(&files.token)?;
        // Empty until the nodes have their ports: no transfers before.
        write_private(&files.members, "", true)?;
        let roles = spec.roles();
        let net = match launcher {
            Launcher::Netns(_, link) => Some(netns::Network::create(roles.len(), *link)?),
            _ => None,
        };
        let mut owned = Vec::new();
        let mut addrs = Vec::new();
        let mut dirs = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            let dir = work.join(role.replace(' ', "-"));
            let (o, addr) = match launcher {
                Launcher::InProcess => {
                    let access = NodeAccess {
                        token: Some(token.clone()),
                        members: Some(Members::File(files.members.clone())),
                        max_put_bytes: LOCAL_MAX_PUT_BYTES,
                        ..NodeAccess::default()
                    };
                    let n =
                        InProcessNode::start_with_memory(&dir, spec.model, access, spec.memory)?;
                    let a = n.addr.clone();
                    (Owned::InProcess(n), a)
                }
                Launcher::Process(exe) => {
                    let (child, a) = spawn_node(exe, &dir, &spec, role, &files, None)?;
                    (Owned::Process(child), a)
                }
                Launcher::Netns(exe, _) => {
                    let net = net.as_ref().expect("created above");
                    let at = Some((net.namespace(i), net.addr(Some(i))));
                    let (child, a) = spawn_node(exe, &dir, &spec, role, &files, at)?;
                    (Owned::Process(child), a)
                }
            };
            owned.push(o);
            addrs.push(addr);
            dirs.push(dir);
        }
        write_private(&files.members, &(addrs.join("\n") + "\n"), true)?;
        let mut c = Cluster::connect_with(spec, &addrs, &Credentials::token(token)).await?;
        c.owned = owned;
        c.dirs = dirs;
        c.net = net;
        Ok(c)
    }

    /// Connects to running nodes that accept calls without a token, given
    /// in role order (see [`ClusterSpec::roles`]).
    pub async fn connect(spec: ClusterSpec, addrs: &[String]) -> Result<Cluster> {
        Cluster::connect_with(spec, addrs, &Credentials::default()).await
    }

    /// Connects to running nodes, given in role order, presenting
    /// `credentials` on every call.
    pub async fn connect_with(
        spec: ClusterSpec,
        addrs: &[String],
        credentials: &Credentials,
    ) -> Result<Cluster> {
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
            let mut c = NodeClient::connect_with(addr, &label, credentials).await?;
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
            net: None,
            progress: None,
            codec: Codec::default(),
            materialise: false,
            epoch: first_epoch(),
        })
    }

    /// Places the table: row blocks round-robin on the main group, the
    /// column-wise copy on the mirror group, or the partitions' parity on
    /// the parity node. Returns the wall time.
    pub async fn place(&mut self, schema: SchemaRef, batches: &[RecordBatch]) -> Result<f64> {
        let blocks: Vec<Result<RecordBatch>> = batches.iter().cloned().map(Ok).collect();
        self.place_stream(schema, futures::stream::iter(blocks))
            .await
    }

    /// [`Cluster::place`] for a table that arrives as a stream of row
    /// blocks in order (see [`blocking_source`]): each block goes to its
    /// main node, and its column groups to the mirror nodes, as it comes,
    /// and every node writes it as it arrives, so neither the host nor a
    /// node ever holds the table (scale factor 10 is 60 million rows). The
    /// parity layout folds the partitions once they are all placed. An
    /// error in the stream fails the placement, and a node stores nothing
    /// of a put cut short.
    pub async fn place_stream(
        &mut self,
        schema: SchemaRef,
        blocks: impl futures::Stream<Item = Result<RecordBatch>> + Unpin,
    ) -> Result<f64> {
        let t = Instant::now();
        let n = self.spec.nodes;
        let groups: Vec<Vec<usize>> = match self.spec.layout {
            Layout::Mirror => column_groups(schema.fields().len(), n)
                .into_iter()
                .map(|g| g.collect())
                .collect(),
            Layout::Parity => Vec::new(),
        };
        /// Row blocks a put may have queued ahead of its node.
        const QUEUED: usize = 4;
        let mut to_main = Vec::with_capacity(n);
        let mut to_mirror = Vec::with_capacity(groups.len());
        let mut puts = Vec::new();
        for c in self.main.iter_mut() {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<RecordBatch>>(QUEUED);
            to_main.push(tx);
            let put = PutCmd::Table {
                name: names::LINEITEM.into(),
                sync: true,
            };
            puts.push(c.put_table_stream(put, schema.clone(), receiver_stream(rx)));
        }
        for (c, cols) in self.mirror.iter_mut().zip(&groups) {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<RecordBatch>>(QUEUED);
            to_mirror.push(tx);
            let put = PutCmd::Table {
                name: names::LINEITEM_COLS.into(),
                sync: true,
            };
            let s = std::sync::Arc::new(schema.project(cols).expect("columns in range"));
            puts.push(c.put_table_stream(put, s, receiver_stream(rx)));
        }
        let feed = async move {
            let senders: Vec<_> = to_main.iter().chain(&to_mirror).collect();
            let fed = feed_blocks(blocks, &to_main, &to_mirror, &groups).await;
            if let Err(stop) = &fed {
                // Every put still running ends without its end marker, so
                // no node commits a partial table.
                for tx in senders {
                    let _ = tx.send(Err(Error::Invalid(stop.to_string()))).await;
                }
            }
            fed
        };
        // Every put runs to its end, failed ones included: a node answers
        // a put cut short only once it has dropped its spools, so when this
        // returns no node holds any part of the table (a put dropped
        // unanswered would leave its node cleaning up after the caller).
        let (placed, fed) = futures::join!(futures::future::join_all(puts), feed);
        match fed {
            Ok(()) => {
                for put in placed {
                    put?;
                }
            }
            // The put whose channel closed failed first: its error is the
            // cause, the others only saw the placement stop.
            Err(stop @ FeedStop::PutEnded(i)) => {
                return Err(match placed.into_iter().nth(i) {
                    Some(Err(cause)) => cause,
                    _ => Error::Invalid(stop.to_string()),
                });
            }
            Err(FeedStop::Source(why)) => return Err(Error::Invalid(why)),
        }
        if self.spec.layout == Layout::Parity {
            self.checkpoint_all(names::LINEITEM).await?;
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
        group_workers(&self.main, input)
    }

    /// Checkpoints each worker's `object` to the redundancy slot of the
    /// main node it stands for.
    async fn checkpoint_workers(
        &mut self,
        workers: &mut [Worker],
        object: &str,
    ) -> Result<Vec<(String, Stats)>> {
        self.epoch += 1;
        let calls = workers.iter_mut().map(|w| {
            let cmd = self.checkpoint_cmd(w, object, self.epoch);
            async move {
                let s = w.client.checkpoint(&cmd).await?;
                Ok::<_, Error>((w.client.label().to_string(), s))
            }
        });
        futures::future::try_join_all(calls).await
    }

    /// The command that checkpoints worker `w`'s `object` to the redundancy
    /// slot of the main node it stands for, in run `epoch`.
    fn checkpoint_cmd(&self, w: &Worker, object: &str, epoch: u64) -> CheckpointCmd {
        let n = self.spec.nodes;
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
        CheckpointCmd {
            object: object.into(),
            target,
            as_name,
            parity,
            codec: self.codec,
            epoch,
        }
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

    /// The process ids of the local nodes started as processes, in role
    /// order (for reading their resource use from `/proc`).
    pub fn local_pids(&self) -> Vec<u32> {
        self.owned
            .iter()
            .filter_map(|o| match o {
                Owned::Process(c) => Some(c.id()),
                Owned::InProcess(_) => None,
            })
            .collect()
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
        // The nodes are gone: their namespaces, veths and bridge go too.
        self.net = None;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Why [`feed_blocks`] stopped before the source's end.
#[derive(Debug)]
enum FeedStop {
    /// The put behind sender `i` (main nodes first, then mirror nodes)
    /// ended early: it failed.
    PutEnded(usize),
    /// The source of row blocks failed.
    Source(String),
}

impl std::fmt::Display for FeedStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FeedStop::PutEnded(_) => f.write_str("placement stopped: a node's put ended early"),
            FeedStop::Source(why) => f.write_str(why),
        }
    }
}

/// Hands each row block of `blocks` to its main node's put (row blocks
/// round-robin) and its column groups to the mirror nodes' puts. Stops at
/// the first error of the source, or when a put has stopped taking
/// blocks (its channel closed); says why.
async fn feed_blocks(
    mut blocks: impl futures::Stream<Item = Result<RecordBatch>> + Unpin,
    to_main: &[tokio::sync::mpsc::Sender<Result<RecordBatch>>],
    to_mirror: &[tokio::sync::mpsc::Sender<Result<RecordBatch>>],
    groups: &[Vec<usize>],
) -> std::result::Result<(), FeedStop> {
    use futures::StreamExt;
    let source = |e: &dyn std::fmt::Display| FeedStop::Source(e.to_string());
    let mut b = 0usize;
    while let Some(block) = blocks.next().await {
        let block = block.map_err(|e| source(&e))?;
        for (m, (tx, cols)) in to_mirror.iter().zip(groups).enumerate() {
            let part = block.project(cols).map_err(|e| source(&e))?;
            tx.send(Ok(part))
                .await
                .map_err(|_| FeedStop::PutEnded(to_main.len() + m))?;
        }
        let owner = row_owner(b, to_main.len());
        to_main[owner]
            .send(Ok(block))
            .await
            .map_err(|_| FeedStop::PutEnded(owner))?;
        b += 1;
    }
    Ok(())
}

/// The items a channel receives, as a stream.
fn receiver_stream<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

/// Runs a blocking source of row blocks (a generator: CPU work) on a
/// thread of its own and hands its blocks over as a stream, a few ahead
/// of the consumer: [`Cluster::place_stream`]'s input.
pub fn blocking_source(
    blocks: impl Iterator<Item = Result<RecordBatch>> + Send + 'static,
) -> impl futures::Stream<Item = Result<RecordBatch>> + Send + Unpin + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || {
        for b in blocks {
            let failed = b.is_err();
            if tx.blocking_send(b).is_err() || failed {
                return;
            }
        }
    });
    Box::pin(receiver_stream(rx))
}

/// A local cluster's token and members files.
struct ClusterFiles {
    token: PathBuf,
    members: PathBuf,
}

/// The put limit of the nodes a host starts itself (private to it, behind
/// its cluster token): room for one node's share of `lineitem` at scale
/// factor 10 (about 1.7 GB on each of 4 main nodes, up to 2.5 GB of
/// columns on a mirror node), which streams to the device as it arrives.
/// A node started on its own keeps `rebound node`'s default of 1 GiB.
pub const LOCAL_MAX_PUT_BYTES: u64 = 8 << 30;

/// Starts `exe node` and reads the address it prints.
fn spawn_node(
    exe: &Path,
    dir: &Path,
    spec: &ClusterSpec,
    role: &str,
    files: &ClusterFiles,
    netns: Option<(String, String)>,
) -> Result<(Child, String)> {
    let (mut cmd, listen) = match &netns {
        // `ip netns exec` execs the node: the child is the node itself.
        Some((ns, addr)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            (c, format!("{addr}:0"))
        }
        None => (Command::new(exe), "127.0.0.1:0".to_string()),
    };
    let mut child = cmd
        .arg("node")
        .arg("--dir")
        .arg(dir)
        .args(["--listen", &listen, "--device-model", spec.model.name()])
        .args(["--memory", &spec.memory.to_string()])
        .arg("--token-file")
        .arg(&files.token)
        .arg("--members-file")
        .arg(&files.members)
        .args(["--max-put-bytes", &LOCAL_MAX_PUT_BYTES.to_string()])
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
