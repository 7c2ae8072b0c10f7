//! `rebound node` and `rebound query`: the smart-storage system of
//! `crates/smartstore` from the command line (a storage node process; the
//! host that places TPC-H data and runs the paper's workloads).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use smartstore::access::{Credentials, Members, NodeAccess, NodeTls, Token};
use smartstore::codec::Codec;
use smartstore::devmodel::DeviceModel;
use smartstore::host::{
    Cluster, ClusterSpec, Launcher, Layout, Link, Progress, Query, QueryReport,
};
use smartstore::recovery::{FailMode, Fault, Scheme};
use smartstore::tpch;

/// Device models a node can charge its I/O to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// Real file I/O time.
    None,
    /// HP C2490A disk.
    Disk,
    /// MEMS-based device G1 (Table 1).
    MemsG1,
    /// MEMS-based device G2 (Table 1).
    MemsG2,
    /// MEMS-based device G3 (Table 1).
    MemsG3,
}

impl ModelArg {
    pub fn model(self) -> DeviceModel {
        let name = self
            .to_possible_value()
            .expect("no skipped variants")
            .get_name()
            .to_string();
        DeviceModel::parse(&name).expect("every variant is a model")
    }
}

/// Options of `rebound node`.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// Directory holding this node's partitions, checkpoints and parity (created if missing).
    #[arg(long, required_unless_present = "generate_token")]
    dir: Option<PathBuf>,
    /// Address to listen on for Arrow Flight (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: String,
    /// Device model this node charges its I/O to.
    #[arg(long, value_enum, default_value_t = ModelArg::None)]
    device_model: ModelArg,
    /// Memory of the node (the paper's nodes: 64 MB; K, M, G suffixes): it caches objects of its
    /// device in it, and a primitive whose input is larger streams and spills within it.
    #[arg(long, default_value = "64M")]
    memory: String,
    /// File holding the cluster token every call must carry (mode 0600, owned by this user;
    /// `--generate-token` writes one). Without it the node accepts any caller, and listens
    /// only on a loopback address unless --insecure.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Write a fresh random cluster token to this file (mode 0600; never overwritten) and exit.
    #[arg(long, conflicts_with_all = ["token_file", "dir"])]
    generate_token: Option<PathBuf>,
    /// Comma-separated addresses (host:port) of the cluster's nodes: the only ones this
    /// node's checkpoint, scatter and rebuild connect to. Without it or --members-file the
    /// node makes no transfers.
    #[arg(long, value_delimiter = ',', conflicts_with = "members_file")]
    members: Vec<String>,
    /// File of the cluster's node addresses (comma- or line-separated, mode 0600), read at
    /// each transfer.
    #[arg(long)]
    members_file: Option<PathBuf>,
    /// Largest put this node accepts; a larger one is refused while it streams. K, M, G
    /// suffixes.
    #[arg(long, default_value = "1G")]
    max_put_bytes: String,
    /// Serve Arrow Flight over TLS with the certificates in this directory (ca-cert.pem,
    /// server-cert.pem, server-key.pem; client-cert.pem and client-key.pem, if there, for
    /// reaching peers), and reach peers over TLS.
    #[arg(long)]
    tls_certificates: Option<PathBuf>,
    /// With --tls-certificates: demand a client certificate signed by ca-cert.pem (mutual
    /// TLS, which authenticates callers without a token).
    #[arg(long, requires = "tls_certificates")]
    tls_verify_peer: bool,
    /// Listen on a non-loopback address without --token-file or --tls-verify-peer: anyone who reaches the port
    /// reads and writes every object and runs plan fragments.
    #[arg(long)]
    insecure: bool,
}

/// A node's memory given to `flag`, in the one size grammar of every flag
/// (`64M`, `1GiB`).
fn parse_memory(flag: &str, s: &str) -> anyhow::Result<usize> {
    let bytes = controller::parse_size(s).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?;
    anyhow::ensure!(bytes > 0, "{flag}: a node needs some memory, not 0");
    usize::try_from(bytes).map_err(|_| anyhow::anyhow!("{flag} {s:?}: too large"))
}

/// What `rebound node`'s flags allow: its token, members and put limit.
fn node_access(args: &NodeArgs) -> anyhow::Result<NodeAccess> {
    let token = match &args.token_file {
        Some(p) => Some(Token::read(p).context("--token-file")?),
        None => None,
    };
    let members = match (&args.members_file, args.members.is_empty()) {
        (Some(p), _) => {
            let m = Members::File(p.clone());
            m.addrs().context("--members-file")?;
            Some(m)
        }
        (None, false) => Some(Members::list(&args.members).context("--members")?),
        (None, true) => None,
    };
    let max_put_bytes = controller::parse_size(&args.max_put_bytes)
        .map_err(|e| anyhow::anyhow!("--max-put-bytes: {e}"))?;
    anyhow::ensure!(max_put_bytes > 0, "--max-put-bytes: must be above 0");
    let tls = match &args.tls_certificates {
        Some(dir) => Some(NodeTls::load(dir, args.tls_verify_peer).context("--tls-certificates")?),
        None => None,
    };
    Ok(NodeAccess {
        token,
        members,
        max_put_bytes,
        tls,
    })
}

/// Refuses to serve on a non-loopback address without a token: anyone who
/// reaches it could read and write every object and run plan fragments.
fn check_exposure(
    addr: std::net::SocketAddr,
    access: &NodeAccess,
    insecure: bool,
) -> anyhow::Result<()> {
    if access.authenticates() || addr.ip().is_loopback() {
        return Ok(());
    }
    anyhow::ensure!(
        insecure,
        "refusing to listen on {addr} without --token-file or --tls-verify-peer: anyone who reaches that address \
         could read and write every object of this node and run plan fragments on it. Give \
         --token-file (make one with `rebound node --generate-token PATH`), listen on \
         127.0.0.1, or pass --insecure"
    );
    tracing::warn!(
        "listening on {addr} without a cluster token (--insecure): any caller is served"
    );
    Ok(())
}

/// Serves one storage node until SIGINT or SIGTERM.
pub fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = &args.generate_token {
        Token::generate(path).context("--generate-token")?;
        println!("wrote a cluster token to {}", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    let dir = args.dir.clone().expect("clap requires --dir");
    let access = node_access(&args)?;
    if !smartstore::node::keep_heap_warm() {
        tracing::warn!("mallopt refused the heap thresholds; node runs with glibc's defaults");
    }
    let memory = parse_memory("--memory", &args.memory)?;
    let insecure = args.insecure;
    let node = smartstore::node::Node::open_with(&dir, args.device_model.model(), memory, access)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let addr = listener.local_addr()?;
        check_exposure(addr, node.access(), insecure)?;
        // The host reads this line to learn the port.
        println!("smartstore node listening on {addr}");
        std::io::stdout().flush()?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let stop = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
        };
        smartstore::node::serve(node, listener, stop).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Output formats of `rebound query`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// An aligned table.
    Table,
    /// A header line, then one line per row (TPC-H column order).
    Csv,
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// The paper's workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueryArg {
    /// A selective SELECT over lineitem (shipped in January 1994).
    Scan,
    /// TPC-H Q1: Scan, Sort, then the bundle Group-by + Aggregate + LocalSort.
    Q1,
}

/// Redundancy layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// A mirror group: row-wise in the main group, column-wise in the mirror.
    Mirror,
    /// One dedicated parity node (RAID-4).
    Parity,
}

/// Options of `rebound query`.
#[derive(Debug, Args)]
pub struct QueryArgs {
    /// TPC-H scale factor of the generated data (0 < sf <= 10; 1 is about 6 million lineitems).
    #[arg(long, default_value_t = 0.1)]
    sf: f64,
    /// Data nodes per storage group.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// How the main group's data is protected [default: parity for --recovery parity, else mirror].
    #[arg(long, value_enum)]
    layout: Option<LayoutArg>,
    /// Workload.
    #[arg(long, value_enum, default_value_t = QueryArg::Q1)]
    query: QueryArg,
    /// Device model every local node charges its I/O to.
    #[arg(long, value_enum, default_value_t = ModelArg::None)]
    device_model: ModelArg,
    /// Result format on stdout.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Checkpoint each Q1 primitive's output to the mirror or parity group (paper §4.2).
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    checkpoint: OnOff,
    /// Comma-separated addresses of running nodes (`rebound node`), in role order: main
    /// nodes, then mirror nodes or the parity node. Without it, local nodes are started.
    #[arg(long, value_delimiter = ',')]
    node_addrs: Vec<String>,
    /// The cluster token of the nodes given by --node-addrs (mode 0600). Local nodes get a
    /// fresh token of their own.
    #[arg(long, requires = "node_addrs")]
    token_file: Option<PathBuf>,
    /// Reach the nodes of --node-addrs over TLS: ca-cert.pem verifies them, client-cert.pem
    /// and client-key.pem (if there) are presented for mutual TLS.
    #[arg(long, requires = "node_addrs")]
    tls_certificates: Option<PathBuf>,
    /// Directory for local nodes' data (default: a temporary directory, removed at exit).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Also run the query in one DataFusion process over the whole table and fail if the answers
    /// differ; Q1 at scale factor 1 is also compared with the TPC-H reference answer.
    #[arg(long)]
    verify: bool,
    /// Do not print the phase breakdown (I/O, compute, communication) on stderr.
    #[arg(long)]
    quiet: bool,
    /// Memory of each local node (`rebound node --memory`; K, M, G suffixes): it caches
    /// objects in it, and a primitive whose input is larger streams and spills within it.
    #[arg(long, default_value = "64M", conflicts_with = "node_addrs")]
    node_memory: String,
    /// Lose this main-group node during the query (local nodes only) and recover it.
    #[arg(long)]
    fail_node: Option<usize>,
    /// Lose it just before this primitive [default: the paper's point: scan for Scan,
    /// agg-grp-sort for Q1].
    #[arg(long, value_enum, requires = "fail_node")]
    fail_at: Option<FailAtArg>,
    /// How the node is lost: its process SIGKILLed, or its directory made unreadable.
    #[arg(long, value_enum, default_value_t = FailModeArg::Kill, requires = "fail_node")]
    fail_mode: FailModeArg,
    /// Recovery scheme (paper §3): spare (mirror + spare node), migrate (work moves to the
    /// mirror group), redistribute (checkpoints spread over all survivors), parity (XOR onto a
    /// spare) [default: spare, or parity with --layout parity].
    #[arg(long, value_enum, requires = "fail_node")]
    recovery: Option<RecoveryArg>,
    /// Lose the node while its checkpoint of the previous primitive is still in flight
    /// (checkpoints run behind the next primitive): recovery then starts from the checkpoint
    /// before it and runs the lost node's part of the previous primitive again.
    #[arg(long, requires = "fail_node")]
    fail_mid_checkpoint: bool,
    /// How checkpoints are encoded, once, for the device and the mirror or parity node: plain
    /// (Arrow IPC as in memory), narrow (integer and decimal columns stored as offsets from
    /// their minimum in 1, 2 or 4 bytes), lz4 or zstd (narrow, then Arrow IPC buffer
    /// compression).
    #[arg(long, default_value = "narrow")]
    checkpoint_codec: Codec,
    /// Run every local node in a network namespace of its own, its link shaped to this rate by
    /// tc's token-bucket filter (e.g. 1gbit, 100mbit; unlimited: own stack, no shaping), as if
    /// each node were a host with a NIC of that speed. Needs root and iproute2 [default: local
    /// nodes on loopback].
    #[arg(long, value_parser = parse_link, conflicts_with = "node_addrs")]
    link: Option<Link>,
}

fn parse_link(s: &str) -> Result<Link, String> {
    Link::parse(s).map_err(|e| e.to_string())
}

/// Primitives a fault can precede.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailAtArg {
    Scan,
    Sort,
    AggGrpSort,
}

/// How a node is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailModeArg {
    /// SIGKILL the node's process.
    Kill,
    /// Move the node's directory away; the process keeps answering.
    Unreadable,
}

/// Recovery schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RecoveryArg {
    Spare,
    Migrate,
    Redistribute,
    Parity,
}

/// The query, the cluster and the fault `rebound query`'s flags ask for,
/// checked against each other.
fn plan(args: &QueryArgs) -> anyhow::Result<(Query, ClusterSpec, Option<Fault>)> {
    tpch::check_sf(args.sf)?;
    let query = match args.query {
        QueryArg::Scan => Query::Scan,
        QueryArg::Q1 => Query::Q1,
    };
    let layout = match args.layout {
        Some(LayoutArg::Mirror) => Layout::Mirror,
        Some(LayoutArg::Parity) => Layout::Parity,
        None if args.recovery == Some(RecoveryArg::Parity) => Layout::Parity,
        None => Layout::Mirror,
    };
    let fault = args.fail_node.map(|node| Fault {
        mid_checkpoint: args.fail_mid_checkpoint,
        node,
        at: match args.fail_at {
            Some(FailAtArg::Scan) => 0,
            Some(FailAtArg::Sort) => 1,
            Some(FailAtArg::AggGrpSort) => 2,
            None => Fault::default_at(query),
        },
        mode: match args.fail_mode {
            FailModeArg::Kill => FailMode::Kill,
            FailModeArg::Unreadable => FailMode::Unreadable,
        },
        scheme: match (args.recovery, layout) {
            (Some(RecoveryArg::Spare), _) => Scheme::Spare,
            (Some(RecoveryArg::Migrate), _) => Scheme::Migrate,
            (Some(RecoveryArg::Redistribute), _) => Scheme::Redistribute,
            (Some(RecoveryArg::Parity), _) | (None, Layout::Parity) => Scheme::Parity,
            (None, Layout::Mirror) => Scheme::Spare,
        },
    });
    let spec = ClusterSpec {
        nodes: args.nodes,
        layout,
        spare: fault.is_some_and(|f| f.scheme.needs_spare()),
        model: args.device_model.model(),
        memory: parse_memory("--node-memory", &args.node_memory)?,
    };
    spec.check()?;
    if let Some(f) = &fault {
        f.check(query, layout, args.nodes, args.checkpoint == OnOff::On)?;
        anyhow::ensure!(
            args.node_addrs.is_empty(),
            "--fail-node needs local nodes (started by the host), not --node-addrs"
        );
    }
    Ok((query, spec, fault))
}

/// Runs `rebound query`.
/// Generates `lineitem` and places it on the cluster as a stream of row
/// blocks: neither this process nor a node holds it whole.
async fn place(
    cluster: &mut smartstore::host::Cluster,
    args: &QueryArgs,
    spec: smartstore::host::ClusterSpec,
    note: &impl Fn(String),
) -> anyhow::Result<()> {
    let (schema, blocks) = tpch::lineitem_blocks(args.sf)?;
    let bar = rows_progress(args.sf, args.quiet, "generating and placing lineitem");
    let rows = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = {
        let (bar, rows) = (bar.clone(), rows.clone());
        blocks.inspect(move |b| {
            if let Ok(b) = b {
                bar.inc(b.num_rows() as u64);
                rows.fetch_add(b.num_rows() as u64, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    let placed = cluster
        .place_stream(schema, smartstore::host::blocking_source(counted))
        .await?;
    bar.finish_and_clear();
    note(format!(
        "generated lineitem at sf {} ({} rows) and placed it on {} data nodes + {}: {placed:.2} s",
        args.sf,
        rows.load(std::sync::atomic::Ordering::Relaxed),
        spec.nodes,
        match spec.layout {
            Layout::Mirror => format!("{} mirror nodes (column-wise)", spec.nodes),
            Layout::Parity => "1 parity node".to_string(),
        }
    ));
    Ok(())
}

pub fn query(args: QueryArgs) -> anyhow::Result<ExitCode> {
    let (query, spec, fault) = plan(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let tmp;
    let work = match &args.work_dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::tempdir().context("temporary work directory")?;
            tmp.path().to_path_buf()
        }
    };
    rt.block_on(async {
        let note = |s: String| {
            if !args.quiet {
                eprintln!("{s}");
            }
        };
        let mut cluster = start_or_connect(&args, spec, &work).await?;
        cluster.codec = args.checkpoint_codec;
        let spinner = indicatif::ProgressBar::new_spinner();
        if fault.is_some() && !args.quiet {
            cluster.progress = Some(recovery_progress(&spinner));
        }
        place(&mut cluster, &args, spec, &note).await?;
        let report = cluster
            .run_query_with(query, args.checkpoint == OnOff::On, fault)
            .await;
        spinner.finish_and_clear();
        cluster.shutdown();
        let report = report?;
        let lost = match &fault {
            Some(f) => format!(
                ", main {} lost before {}, recovery {}",
                f.node,
                smartstore::recovery::PRIMITIVES[f.at],
                f.scheme.name()
            ),
            None => String::new(),
        };
        note(format!(
            "{} on {} nodes, device model {}, checkpoint {}{lost}:\n{}",
            query.name(),
            spec.nodes,
            spec.model.name(),
            if args.checkpoint == OnOff::On {
                "on"
            } else {
                "off"
            },
            report.phase_table()
        ));
        print_result(&report, args.format)?;
        if args.verify {
            verify(query, args.sf, &report, &note).await?;
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Local nodes started under `work` (with a fresh token), or the running
/// ones of `--node-addrs` reached with `--token-file`'s token.
async fn start_or_connect(
    args: &QueryArgs,
    spec: ClusterSpec,
    work: &std::path::Path,
) -> anyhow::Result<Cluster> {
    if args.node_addrs.is_empty() {
        let exe = std::env::current_exe().context("locating the rebound binary")?;
        let launcher = match args.link {
            Some(link) => Launcher::Netns(exe, link),
            None => Launcher::Process(exe),
        };
        return Ok(Cluster::launch(spec, &launcher, work).await?);
    }
    let credentials = Credentials {
        token: match &args.token_file {
            Some(p) => Some(Token::read(p).context("--token-file")?),
            None => None,
        },
        tls: match &args.tls_certificates {
            Some(d) => Some(smartstore::access::client_config(d).context("--tls-certificates")?),
            None => None,
        },
    };
    Ok(Cluster::connect_with(spec, &args.node_addrs, &credentials).await?)
}

fn print_result(report: &QueryReport, format: Format) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match format {
        Format::Csv => out.write_all(tpch::to_csv(&report.result)?.as_bytes())?,
        Format::Table => {
            let t = arrow::util::pretty::pretty_format_batches(&report.result)?;
            writeln!(out, "{t}")?;
            writeln!(out, "{} rows", report.rows())?;
        }
    }
    Ok(())
}

/// The recovery's steps on `spinner` (on stderr when it is hidden).
fn recovery_progress(spinner: &indicatif::ProgressBar) -> Progress {
    let sp = spinner.clone();
    Progress(std::sync::Arc::new(move |m: &str| {
        sp.enable_steady_tick(std::time::Duration::from_millis(100));
        sp.set_message(m.to_string());
        if sp.is_hidden() {
            eprintln!("recovery: {m}");
        } else {
            sp.println(format!("recovery: {m}"));
        }
    }))
}

/// `--verify`: the distributed answer equals a single-process DataFusion
/// run, and at scale factor 1 the TPC-H reference answer of Q1.
/// A progress bar over the estimated rows of `lineitem` at `sf` (hidden
/// when `quiet` or when stderr is not a terminal).
fn rows_progress(sf: f64, quiet: bool, what: &str) -> indicatif::ProgressBar {
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(tpch::lineitem_rows_estimate(sf))
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg}: {human_pos}/~{human_len} rows {bar:30} {elapsed}",
        )
        .expect("template"),
    );
    bar.set_message(what.to_string());
    bar
}

async fn verify(
    query: Query,
    sf: f64,
    report: &smartstore::host::QueryReport,
    note: &impl Fn(String),
) -> anyhow::Result<()> {
    // The reference regenerates the table and runs over it as it comes.
    let (schema, blocks) = tpch::lineitem_blocks(sf)?;
    let bar = rows_progress(sf, false, "verifying against a single-process run");
    let blocks = blocks.inspect(|b| {
        if let Ok(b) = b {
            bar.inc(b.num_rows() as u64);
        }
    });
    let want = match query {
        Query::Q1 => vec![tpch::q1_streamed(schema, blocks).await?],
        Query::Scan => tpch::scan_streamed(schema, blocks).await?,
    };
    bar.finish_and_clear();
    if tpch::to_csv(&want)? != tpch::to_csv(&report.result)? {
        anyhow::bail!("the distributed answer differs from a single-process DataFusion run");
    }
    note("verified: equal to a single-process DataFusion run".into());
    if query == Query::Q1 && sf == 1.0 {
        let got = tpch::to_csv(&report.result)?;
        let rows: Vec<&str> = got.lines().skip(1).collect();
        if rows != tpch::Q1_SF1_ANSWER {
            anyhow::bail!("Q1 differs from the TPC-H reference answer at scale factor 1");
        }
        note("verified: equal to the TPC-H reference answer of Q1 at scale factor 1".into());
    }
    Ok(())
}
