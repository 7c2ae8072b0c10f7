//! `rebound node` and `rebound query`: the smart-storage system of
//! `crates/smartstore` from the command line (a storage node process; the
//! host that places TPC-H data and runs the paper's workloads).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, ValueEnum};
use smartstore::devmodel::DeviceModel;
use smartstore::host::{Cluster, ClusterSpec, Launcher, Layout, Query, QueryReport};
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
    #[arg(long)]
    dir: PathBuf,
    /// Address to listen on for Arrow Flight (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: String,
    /// Device model this node charges its I/O to.
    #[arg(long, value_enum, default_value_t = ModelArg::None)]
    device_model: ModelArg,
}

/// Serves one storage node until SIGINT or SIGTERM.
pub fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let node = smartstore::node::Node::open(&args.dir, args.device_model.model())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        let addr = listener.local_addr()?;
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
    /// How the main group's data is protected.
    #[arg(long, value_enum, default_value_t = LayoutArg::Mirror)]
    layout: LayoutArg,
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
}

/// Runs `rebound query`.
pub fn query(args: QueryArgs) -> anyhow::Result<ExitCode> {
    tpch::check_sf(args.sf)?;
    let spec = ClusterSpec {
        nodes: args.nodes,
        layout: match args.layout {
            LayoutArg::Mirror => Layout::Mirror,
            LayoutArg::Parity => Layout::Parity,
        },
        spare: false,
        model: args.device_model.model(),
    };
    spec.check()?;
    let query = match args.query {
        QueryArg::Scan => Query::Scan,
        QueryArg::Q1 => Query::Q1,
    };
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
        let t = std::time::Instant::now();
        let (schema, batches) = tpch::lineitem(args.sf)?;
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        note(format!(
            "generated lineitem at sf {}: {rows} rows in {:.2} s",
            args.sf,
            t.elapsed().as_secs_f64()
        ));
        let mut cluster = if args.node_addrs.is_empty() {
            let exe = std::env::current_exe().context("locating the rebound binary")?;
            Cluster::launch(spec, &Launcher::Process(exe), &work).await?
        } else {
            Cluster::connect(spec, &args.node_addrs).await?
        };
        let placed = cluster.place(schema.clone(), &batches).await?;
        note(format!(
            "placed on {} data nodes + {}: {placed:.2} s",
            spec.nodes,
            match spec.layout {
                Layout::Mirror => format!("{} mirror nodes (column-wise)", spec.nodes),
                Layout::Parity => "1 parity node".to_string(),
            }
        ));
        let report = cluster
            .run_query(query, args.checkpoint == OnOff::On)
            .await?;
        cluster.shutdown();
        note(format!(
            "{} on {} nodes, device model {}, checkpoint {}:\n{}",
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
            let want = match query {
                Query::Q1 => vec![tpch::q1_single(schema, batches).await?],
                Query::Scan => tpch::scan_single(schema, batches).await?,
            };
            if tpch::to_csv(&want)? != tpch::to_csv(&report.result)? {
                anyhow::bail!(
                    "the distributed answer differs from a single-process DataFusion run"
                );
            }
            note("verified: equal to a single-process DataFusion run".into());
            if query == Query::Q1 && args.sf == 1.0 {
                let got = tpch::to_csv(&report.result)?;
                let rows: Vec<&str> = got.lines().skip(1).collect();
                if rows != tpch::Q1_SF1_ANSWER {
                    anyhow::bail!("Q1 differs from the TPC-H reference answer at scale factor 1");
                }
                note(
                    "verified: equal to the TPC-H reference answer of Q1 at scale factor 1".into(),
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
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
