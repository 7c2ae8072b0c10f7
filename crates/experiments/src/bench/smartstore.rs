//! `rebound bench smartstore`: the smart-storage system of
//! `crates/smartstore`, failure-free (the paper's scenario 0 of section 4).
//!
//! Scan and TPC-H Q1 at scale factor 1 on 4 data nodes, protected by a
//! mirror group (4 more nodes) or one parity node, every node a `rebound
//! node` process on this machine; with no device model, the HP C2490A disk
//! model and the MEMS G3 model. Each query's time splits into I/O, compute
//! and communication as in the paper's Figures 8 to 11 (the busiest node's,
//! per phase). Q1 runs with and without checkpointing each primitive's
//! output, so the cost of checkpointing is reported on its own.
//!
//! The peer is DuckDB (Python package) running Q1 over the same rows from
//! Parquet, on the same machine in the same run. Target: failure-free Q1
//! with no device model and checkpointing off within 2x DuckDB's time.

use std::path::Path;
use std::process::{Command, ExitCode};

use anyhow::Context;
use clap::Args;
use smartstore::codec::Codec;
use smartstore::devmodel::DeviceModel;
use smartstore::host::{
    Cluster, ClusterSpec, DEFAULT_NODE_MEMORY, Launcher, Layout, Link, Query, QueryReport,
};
use smartstore::recovery::{FailMode, Fault, Scheme};
use smartstore::tpch;

use super::CommonArgs;
use crate::report::{BarPanel, Table, progress, stacked_bar_png};

/// Options of `rebound bench smartstore`.
#[derive(Debug, Args)]
pub struct SmartstoreArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// TPC-H scale factor [default: 1; 2 with --recovery, so Q1's
    /// Group-by input (~100 MB per node) exceeds a node's 64 MB memory as in
    /// the paper: once checkpointed it leaves memory, and a recovery reads
    /// it back off the device; 0.05 with --quick].
    #[arg(long)]
    sf: Option<f64>,
    /// Runs of each query per configuration; the median is reported [default: 3, or 1 with --quick].
    #[arg(long)]
    runs: Option<u32>,
    /// Run the paper's recovery scenarios instead (section 4: Scan 0-2, Q1 0-4, a main node
    /// SIGKILLed at the paper's point) for each device model.
    #[arg(long)]
    recovery: bool,
    /// Run every node in a network namespace of its own, its link shaped to this rate by tc's
    /// token-bucket filter (e.g. 1gbit, 100mbit; unlimited: own stack, no shaping), as if each
    /// node were a host with a NIC of that speed. Needs root and iproute2 [default: all nodes on
    /// loopback].
    #[arg(long, value_parser = parse_link)]
    link: Option<Link>,
    /// Q1 at scale factor 10 instead (--sf to change it): the table generated and placed as a
    /// stream, 4 + 4 nodes, checkpoints off, against DuckDB from Parquet in interleaved rounds.
    #[arg(long, conflicts_with = "recovery")]
    scale: bool,
    /// With --scale: each node's memory (`rebound node --memory`; K, M, G suffixes), which
    /// bounds a primitive's working memory once its input is larger: the paper's 64 MB makes
    /// every Q1 primitive at sf 10 stream and spill; a size above a node's share runs them in
    /// memory.
    #[arg(long, default_value = "64M", value_parser = controller::parse_size, requires = "scale")]
    node_memory: u64,
}

mod scale;

fn parse_link(s: &str) -> Result<Link, String> {
    Link::parse(s).map_err(|e| e.to_string())
}

/// One measured configuration.
struct Row {
    layout: Layout,
    model: DeviceModel,
    workload: &'static str,
    /// The codec of its checkpoints (if it checkpoints).
    codec: Codec,
    report: QueryReport,
}

const DATA_NODES: usize = 4;

fn median_by_total(mut reports: Vec<QueryReport>) -> QueryReport {
    reports.sort_by(|a, b| a.wall_s().total_cmp(&b.wall_s()));
    let mid = reports.len() / 2;
    reports.swap_remove(mid)
}

/// The device models both modes measure.
const MODELS: [DeviceModel; 3] = [
    DeviceModel::None,
    DeviceModel::Disk,
    DeviceModel::Mems(smartstore::devmodel::G3),
];

/// The layouts the failure-free mode measures.
const LAYOUTS: [Layout; 2] = [Layout::Mirror, Layout::Parity];

/// A failure-free workload: name, query, checkpoints, their codec, and
/// whether every primitive is materialised where the paper's plan puts it
/// even without checkpoints ([`smartstore::host::Cluster::materialise`]).
type Workload = (&'static str, Query, bool, Codec, bool);

/// The failure-free workloads.
const WORKLOADS: [Workload; 3] = [
    ("scan", Query::Scan, false, Codec::Narrow, false),
    ("q1, no checkpoints", Query::Q1, false, Codec::Narrow, false),
    ("q1", Query::Q1, true, Codec::Narrow, false),
];

/// Q1 without checkpoints but with the plan checkpoints need: the Scan and
/// the Sort materialised on every node, nothing deferred into the
/// aggregation. Measured on the layouts with no device model, it splits
/// the checkpoint cost into the plan's share and the checkpoints' own.
const PLAN_ONLY: &str = "q1, paper's plan, no checkpoints";

/// The workloads measured on the layouts with no device model only: the
/// plan row, and (full runs only) Q1 with checkpoints in the other codecs.
const PLAN_WORKLOAD: Workload = (PLAN_ONLY, Query::Q1, false, Codec::Narrow, true);
const CODEC_WORKLOADS: [Workload; 3] = [
    (
        "q1, plain checkpoints",
        Query::Q1,
        true,
        Codec::Plain,
        false,
    ),
    ("q1, lz4 checkpoints", Query::Q1, true, Codec::Lz4, false),
    ("q1, zstd checkpoints", Query::Q1, true, Codec::Zstd, false),
];

/// Target of the checkpoint issue: Q1 with checkpoints on answers within
/// this factor of Q1 without (no device model).
const CHECKPOINT_TARGET: f64 = 1.25;

/// How long placing the table took on one layout and device model.
type Placement = (Layout, DeviceModel, f64);

/// Runs the experiment.
pub fn run(args: SmartstoreArgs) -> anyhow::Result<ExitCode> {
    if args.recovery {
        return run_recovery(args);
    }
    if args.scale {
        return scale::run(&args);
    }
    let quick = args.common.quick;
    let runs = args.runs.unwrap_or(if quick { 1 } else { 3 });
    anyhow::ensure!((1..=20).contains(&runs), "--runs must be within 1..=20");
    let setup = Setup::new(&args)?;
    let total_rows: usize = setup.batches.iter().map(|b| b.num_rows()).sum();
    let (rows, placements) = measure(&setup, runs, !quick)?;

    // The peer: DuckDB over the same rows, from Parquet.
    let duck = duckdb_q1(
        setup.scratch.path(),
        &setup.schema,
        &setup.batches,
        if quick { 3 } else { 5 },
    )?;

    let sf = setup.sf;
    println!(
        "\nsmartstore, failure-free (scenario 0): sf {sf} ({total_rows} lineitems), {DATA_NODES} data nodes + mirror group ({DATA_NODES} nodes) or parity node, \
         {}, median of {runs} interleaved run(s); every answer checked against one DataFusion run",
        setup.network()
    );
    print_breakdown(&rows);
    print_checkpoint_cost(&rows);
    print_peer(&rows, &duck, setup.single_s, &placements);
    if !quick {
        plot_failure_free(&args.common.out, sf, &rows)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Every layout and device model on a fresh cluster: each workload `runs`
/// times (the median kept), and the time placing the table took.
fn measure(setup: &Setup, runs: u32, codecs: bool) -> anyhow::Result<(Vec<Row>, Vec<Placement>)> {
    let bar = progress((LAYOUTS.len() * MODELS.len()) as u64, "smartstore");
    let mut rows: Vec<Row> = Vec::new();
    let mut placements = Vec::new();
    for layout in LAYOUTS {
        for model in MODELS {
            bar.set_message(format!("{} / {}", layout.name(), model.name()));
            let work = setup
                .scratch
                .path()
                .join(format!("{}-{}", layout.name(), model.name()));
            let spec = ClusterSpec {
                nodes: DATA_NODES,
                layout,
                spare: false,
                model,
                memory: DEFAULT_NODE_MEMORY,
            };
            let mut workloads = WORKLOADS.to_vec();
            if model == DeviceModel::None {
                workloads.push(PLAN_WORKLOAD);
                if codecs {
                    workloads.extend(CODEC_WORKLOADS);
                }
            }
            let (placed, measured) = setup
                .rt
                .block_on(measure_cluster(setup, spec, &work, runs, &workloads))?;
            placements.push((layout, model, placed));
            rows.extend(measured);
            std::fs::remove_dir_all(&work).ok();
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok((rows, placements))
}

/// One cluster: place the table, run every workload `runs` times in
/// interleaved rounds (each round runs each workload once), check each
/// answer; the placement's seconds and a row per workload, its median run.
async fn measure_cluster(
    setup: &Setup,
    spec: ClusterSpec,
    work: &Path,
    runs: u32,
    workloads: &[Workload],
) -> anyhow::Result<(f64, Vec<Row>)> {
    let (layout, model) = (spec.layout, spec.model);
    let mut c = Cluster::launch(spec, &setup.launcher(), work).await?;
    let placed = c.place(setup.schema.clone(), &setup.batches).await?;
    let mut reports: Vec<Vec<QueryReport>> = workloads.iter().map(|_| Vec::new()).collect();
    for _ in 0..runs {
        for (i, &(workload, query, ckpt, codec, materialise)) in workloads.iter().enumerate() {
            c.codec = codec;
            c.materialise = materialise;
            let r = c.run_query(query, ckpt).await?;
            anyhow::ensure!(
                tpch::to_csv(&r.result)? == setup.want(query),
                "{workload} on {} / {}: wrong answer",
                layout.name(),
                model.name()
            );
            reports[i].push(r);
        }
    }
    c.shutdown();
    let rows = workloads
        .iter()
        .zip(reports)
        .map(|(w, reports)| Row {
            layout,
            model,
            workload: w.0,
            codec: w.3,
            report: median_by_total(reports),
        })
        .collect();
    Ok((placed, rows))
}

/// Each row's time split into I/O, compute and communication.
fn print_breakdown(rows: &[Row]) {
    let mut t = Table::new(&[
        "layout",
        "device model",
        "workload",
        "I/O s",
        "compute s",
        "comm s",
        "total s",
        "wall s",
    ]);
    for r in rows {
        let (io, c, m) = r.report.breakdown();
        t.row(vec![
            r.layout.name().into(),
            r.model.name().into(),
            r.workload.into(),
            format!("{io:.3}"),
            format!("{c:.3}"),
            format!("{m:.3}"),
            format!("{:.3}", r.report.total_s()),
            format!("{:.3}", r.report.wall_s()),
        ]);
    }
    println!("{}", t.render());
}

/// Q1 with checkpoints against Q1 without, per layout, device model and
/// codec: the answer's time (wall with no device model, modelled with
/// one), and where the checkpoints, which run behind the next primitive,
/// spent theirs.
fn print_checkpoint_cost(rows: &[Row]) {
    println!(
        "cost of checkpointing Q1's intermediate results (section 4.2), each checkpoint running behind \
         the next primitive: Q1 with checkpoints against Q1 without (wall time with no device model, \
         modelled time with one); checkpoint times are the busiest node's, summed over Scan's and Sort's"
    );
    let mut t = Table::new(&[
        "layout",
        "device model",
        "codec",
        "q1 without s",
        "q1 with s",
        "ratio",
        "plan s",
        "plan/without",
        "with/plan",
        "settled s",
        "encode s",
        "device s",
        "send s",
        "fold s",
        "MB in memory",
        "MB sent",
    ]);
    let mut verdicts = Vec::new();
    for layout in LAYOUTS {
        for model in MODELS {
            let sel = |r: &&Row| r.layout == layout && r.model == model;
            let Some(off) = rows
                .iter()
                .filter(sel)
                .find(|r| r.workload == "q1, no checkpoints")
            else {
                continue;
            };
            let time = |r: &QueryReport| match model {
                DeviceModel::None => r.wall_s(),
                _ => r.total_s(),
            };
            let base = time(&off.report);
            // The checkpointed plan with nothing checkpointed (no device
            // model only).
            let plan = rows
                .iter()
                .filter(sel)
                .find(|r| r.workload == PLAN_ONLY)
                .map(|r| time(&r.report));
            for on in rows.iter().filter(sel).filter(|r| {
                r.workload.starts_with("q1")
                    && r.workload != off.workload
                    && r.workload != PLAN_ONLY
            }) {
                let with = time(&on.report);
                t.row(checkpoint_cost_row(on, base, with, plan));
                if model == DeviceModel::None && on.workload == "q1" {
                    verdicts.push(checkpoint_verdict(layout, base, with, plan));
                }
            }
        }
    }
    println!("{}", t.render());
    println!(
        "Q1 with {} checkpoints within {CHECKPOINT_TARGET}x of Q1 without (no device model, wall): {}",
        Codec::default().name(),
        verdicts.join(", ")
    );
}

/// One row of the checkpoint-cost table: Q1 with checkpoints (`on`,
/// `with` seconds) against Q1 without (`base`) and against the plan
/// checkpoints need with nothing checkpointed (`plan`, if measured).
fn checkpoint_cost_row(on: &Row, base: f64, with: f64, plan: Option<f64>) -> Vec<String> {
    let c = on.report.checkpoint_cost();
    let split = |f: &dyn Fn(f64) -> String| plan.map_or_else(|| "-".to_string(), f);
    vec![
        on.layout.name().into(),
        on.model.name().into(),
        on.codec.name().into(),
        format!("{base:.3}"),
        format!("{with:.3}"),
        format!("{:.2}x", with / base),
        split(&|p| format!("{p:.3}")),
        split(&|p| format!("{:.2}x", p / base)),
        split(&|p| format!("{:.2}x", with / p)),
        format!("{:.3}", on.report.settled_s),
        format!("{:.3}", c.encode_s),
        format!("{:.3}", c.device_s),
        format!("{:.3}", c.transfer_s),
        format!("{:.3}", c.fold_s),
        format!("{:.1}", c.raw_bytes as f64 / 1e6),
        format!("{:.1}", c.sent_bytes as f64 / 1e6),
    ]
}

/// The checkpoint target's verdict for one layout, split into the plan's
/// share and the checkpoints' own when the plan was measured.
fn checkpoint_verdict(layout: Layout, base: f64, with: f64, plan: Option<f64>) -> String {
    let ratio = with / base;
    let split = plan.map_or_else(String::new, |p| {
        format!(
            "; the plan checkpoints need {:.2}x, the checkpoints on it {:.2}x",
            p / base,
            with / p
        )
    });
    format!(
        "{}: {ratio:.2}x ({}{split})",
        layout.name(),
        if ratio <= CHECKPOINT_TARGET {
            "met"
        } else {
            "MISSED"
        }
    )
}

/// Our Q1 against DuckDB's, the single-process decomposition, and the
/// placements' times.
fn print_peer(rows: &[Row], duck: &Duck, single_s: f64, placements: &[Placement]) {
    let ours = rows
        .iter()
        .find(|r| {
            r.layout == Layout::Mirror
                && r.model == DeviceModel::None
                && r.workload == "q1, no checkpoints"
        })
        .expect("measured")
        .report
        .wall_s();
    let ratio = ours / duck.median_s;
    println!(
        "peer: DuckDB Q1 from Parquet, same rows, {} threads: median {:.3} s; rebound Q1 (mirror, no model, no checkpoints): {:.3} s = {:.2}x DuckDB (target <= 2x: {})",
        duck.threads,
        duck.median_s,
        ours,
        ratio,
        if ratio <= 2.0 { "met" } else { "MISSED" }
    );
    println!(
        "decomposition: DataFusion in this process, one partition, Q1 over the whole table in memory \
         (hash aggregate, no Sort, no nodes): {single_s:.3} s = {:.2}x DuckDB",
        single_s / duck.median_s
    );
    println!(
        "placement (generation excluded): {}",
        placements
            .iter()
            .map(|(l, m, s)| format!("{}/{} {s:.2} s", l.name(), m.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

/// I/O, compute and communication stacked per workload and layout, a
/// panel per device model.
fn plot_failure_free(out: &Path, sf: f64, rows: &[Row]) -> anyhow::Result<()> {
    let mut panels = Vec::new();
    for model in MODELS {
        let sel: Vec<&Row> = rows
            .iter()
            .filter(|r| r.model == model && WORKLOADS.iter().any(|w| w.0 == r.workload))
            .collect();
        let cats = sel
            .iter()
            .map(|r| {
                let w = match r.workload {
                    "scan" => "Scan",
                    "q1" => "Q1",
                    _ => "Q1 nc",
                };
                format!("{w} {}", &r.layout.name()[..3])
            })
            .collect();
        panels.push(breakdown_panel(model, cats, &sel, |r| &r.report));
    }
    let png = out.join("smartstore.png");
    stacked_bar_png(
        &png,
        &format!(
            "smartstore scenario 0 at sf {sf}: Scan and Q1 (nc: no checkpoints), 4 data nodes, mirror or parity"
        ),
        &panels,
    )?;
    println!("plot: {}", png.display());
    Ok(())
}

/// A panel of I/O, compute and communication stacked per category.
fn breakdown_panel<T>(
    model: DeviceModel,
    categories: Vec<String>,
    sel: &[&T],
    report: fn(&T) -> &QueryReport,
) -> BarPanel {
    let comp = |f: fn(&QueryReport) -> f64| sel.iter().map(|r| f(report(r))).collect::<Vec<f64>>();
    BarPanel {
        title: format!("device model: {}", model.name()),
        y_label: "execution time (s)".into(),
        categories,
        series: vec![
            ("I/O".into(), comp(|r| r.breakdown().0)),
            ("compute".into(), comp(|r| r.breakdown().1)),
            ("communication".into(), comp(|r| r.breakdown().2)),
        ],
    }
}

/// What both modes start from: the data, the reference answers, a
/// runtime and a scratch directory for the nodes.
struct Setup {
    sf: f64,
    exe: std::path::PathBuf,
    rt: tokio::runtime::Runtime,
    scratch: tempfile::TempDir,
    schema: arrow::datatypes::SchemaRef,
    batches: Vec<arrow::record_batch::RecordBatch>,
    want_q1: String,
    want_scan: String,
    /// Seconds Q1 took in one DataFusion process.
    single_s: f64,
    /// Each node's link, when nodes have network stacks of their own.
    link: Option<Link>,
}

impl Setup {
    /// How the nodes are started: processes on loopback, or each in a
    /// network namespace of its own on a shaped link.
    fn launcher(&self) -> Launcher {
        match self.link {
            Some(l) => Launcher::Netns(self.exe.clone(), l),
            None => Launcher::Process(self.exe.clone()),
        }
    }

    /// How the nodes talk, for table headers and plot titles.
    fn network(&self) -> String {
        match self.link {
            Some(l) => format!("each node in its own network namespace, {} links", l.name()),
            None => "nodes on loopback".into(),
        }
    }

    /// The reference answer of `query`, as CSV.
    fn want(&self, query: Query) -> &str {
        if query == Query::Q1 {
            &self.want_q1
        } else {
            &self.want_scan
        }
    }

    fn new(args: &SmartstoreArgs) -> anyhow::Result<Setup> {
        let sf = args.sf.unwrap_or(match (args.common.quick, args.recovery) {
            (true, _) => 0.05,
            // At sf 1 the compact intermediates (~51 MB per node) fit the
            // node's memory, so no scheme reads the Group-by input off the
            // device and redistribution has no I/O to save.
            (false, true) => 2.0,
            (false, false) => 1.0,
        });
        tpch::check_sf(sf)?;
        let exe = std::env::current_exe().context("locating this binary")?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let scratch = tempfile::tempdir().context("scratch directory")?;
        eprintln!("generating lineitem at sf {sf} ...");
        let (schema, batches) = tpch::lineitem(sf)?;
        let (want_q1, want_scan, single_s) = references(&rt, &schema, &batches)?;
        Ok(Setup {
            sf,
            exe,
            rt,
            scratch,
            schema,
            batches,
            want_q1,
            want_scan,
            single_s,
            link: args.link,
        })
    }
}

/// The answers every run is checked against (Q1 and Scan in one DataFusion
/// process, as CSV), and the seconds that Q1 took.
fn references(
    rt: &tokio::runtime::Runtime,
    schema: &arrow::datatypes::SchemaRef,
    batches: &[arrow::record_batch::RecordBatch],
) -> anyhow::Result<(String, String, f64)> {
    rt.block_on(async {
        let t = std::time::Instant::now();
        let q1 = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.to_vec()).await?])?;
        let single_s = t.elapsed().as_secs_f64();
        let scan = tpch::to_csv(&tpch::scan_single(schema.clone(), batches.to_vec()).await?)?;
        anyhow::Ok((q1, scan, single_s))
    })
}

/// Installs the DuckDB peer (Python packages) when missing.
fn ensure_duckdb() -> anyhow::Result<()> {
    let ok = Command::new("python3")
        .args(["-c", "import duckdb, pyarrow"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("installing the DuckDB peer: pip install duckdb pyarrow");
        let st = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "duckdb", "pyarrow"])
            .status()
            .context("running pip")?;
        anyhow::ensure!(
            st.success(),
            "pip install duckdb pyarrow failed: the peer is required"
        );
    }
    Ok(())
}

/// DuckDB's result.
struct Duck {
    median_s: f64,
    threads: u64,
}

fn duckdb_q1(
    dir: &Path,
    schema: &arrow::datatypes::SchemaRef,
    batches: &[arrow::record_batch::RecordBatch],
    runs: u32,
) -> anyhow::Result<Duck> {
    let script = super::repo_file("bench/duckdb_q1.py")?;
    ensure_duckdb()?;
    let ipc = dir.join("lineitem.arrows");
    // DuckDB reads the same rows in the plain types (it keeps DECIMAL(15,2)
    // in 64 bits itself).
    let plain = batches
        .iter()
        .map(smartstore::ops::plain_types)
        .collect::<Result<Vec<_>, _>>()?;
    let schema = plain.first().map_or(schema.clone(), |b| b.schema());
    std::fs::write(&ipc, smartstore::object::ipc_encode(&schema, &plain)?)
        .context("writing the peer's input")?;
    let out = Command::new("python3")
        .arg(&script)
        .arg(&ipc)
        .arg(dir)
        .arg(runs.to_string())
        .output()
        .context("running DuckDB")?;
    anyhow::ensure!(
        out.status.success(),
        "DuckDB peer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("DuckDB peer output")?;
    Ok(Duck {
        median_s: v["median_s"].as_f64().context("median_s")?,
        threads: v["threads"].as_u64().unwrap_or(0),
    })
}

/// One of the paper's scenarios (section 4).
#[derive(Debug, Clone, Copy)]
struct Scenario {
    query: Query,
    number: u8,
    scheme: Option<Scheme>,
}

impl Scenario {
    fn layout(&self) -> Layout {
        self.scheme.map_or(Layout::Mirror, |s| s.layout())
    }
    fn label(&self) -> String {
        format!(
            "{}-{} {}",
            if self.query == Query::Scan {
                "Scan"
            } else {
                "Q1"
            },
            self.number,
            self.scheme.map_or("normal", |s| s.name())
        )
    }
}

const SCENARIOS: [Scenario; 8] = [
    Scenario {
        query: Query::Scan,
        number: 0,
        scheme: None,
    },
    Scenario {
        query: Query::Scan,
        number: 1,
        scheme: Some(Scheme::Spare),
    },
    Scenario {
        query: Query::Scan,
        number: 2,
        scheme: Some(Scheme::Parity),
    },
    Scenario {
        query: Query::Q1,
        number: 0,
        scheme: None,
    },
    Scenario {
        query: Query::Q1,
        number: 1,
        scheme: Some(Scheme::Spare),
    },
    Scenario {
        query: Query::Q1,
        number: 2,
        scheme: Some(Scheme::Migrate),
    },
    Scenario {
        query: Query::Q1,
        number: 3,
        scheme: Some(Scheme::Redistribute),
    },
    Scenario {
        query: Query::Q1,
        number: 4,
        scheme: Some(Scheme::Parity),
    },
];

/// The node the scenarios lose (the paper's D1).
const LOST: usize = 1;

fn phase_sum(r: &QueryReport, name: &str, f: fn(&smartstore::host::Phase) -> f64) -> f64 {
    r.phases.iter().filter(|p| p.name == name).map(f).sum()
}

/// A value, or "-" for scenario 0 (no recovery).
fn dash(scenario: u8, v: f64) -> String {
    if scenario == 0 {
        "-".into()
    } else {
        format!("{v:.3}")
    }
}

/// One scenario measured on one device model.
type Measured = (DeviceModel, Scenario, QueryReport);

/// The report of scenario `n` of `q` on model `m`.
fn find(results: &[Measured], m: DeviceModel, q: Query, n: u8) -> &QueryReport {
    &results
        .iter()
        .find(|(mm, s, _)| *mm == m && s.query == q && s.number == n)
        .expect("measured")
        .2
}

/// `rebound bench smartstore --recovery`: the scenarios of section 4.
fn run_recovery(args: SmartstoreArgs) -> anyhow::Result<ExitCode> {
    let setup = Setup::new(&args)?;
    let bar = progress((MODELS.len() * SCENARIOS.len()) as u64, "scenarios");
    let mut results: Vec<Measured> = Vec::new();
    for model in MODELS {
        for sc in SCENARIOS {
            bar.set_message(format!("{} / {}", model.name(), sc.label()));
            results.push((model, sc, scenario(&setup, model, sc)?));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    let sf = setup.sf;
    println!(
        "\nsmartstore recovery scenarios (paper section 4): sf {sf}, {DATA_NODES} data nodes, {}, main {LOST} SIGKILLed \
         (Scan: during its scan; Q1: just before Group-by+Aggregate+LocalSort), checkpoints on; every answer equals the failure-free one",
        setup.network()
    );
    print_scenarios(&results);
    print_findings(&results);
    if !args.common.quick {
        for q in [Query::Scan, Query::Q1] {
            plot_scenarios(&args.common.out, sf, q, &results, args.link)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One scenario on a fresh cluster with device model `model`: its report,
/// the answer checked against the failure-free one.
fn scenario(setup: &Setup, model: DeviceModel, sc: Scenario) -> anyhow::Result<QueryReport> {
    let work = setup.scratch.path().join(format!(
        "{}-{}-{}",
        model.name(),
        sc.query.name(),
        sc.number
    ));
    let spec = ClusterSpec {
        nodes: DATA_NODES,
        layout: sc.layout(),
        spare: sc.scheme.is_some_and(|s| s.needs_spare()),
        model,
        memory: DEFAULT_NODE_MEMORY,
    };
    let report = setup.rt.block_on(async {
        let mut c = Cluster::launch(spec, &setup.launcher(), &work).await?;
        c.place(setup.schema.clone(), &setup.batches).await?;
        let fault = sc.scheme.map(|scheme| Fault {
            mid_checkpoint: false,
            node: LOST,
            at: Fault::default_at(sc.query),
            mode: FailMode::Kill,
            scheme,
        });
        let r = c.run_query_with(sc.query, true, fault).await?;
        c.shutdown();
        anyhow::Ok(r)
    })?;
    anyhow::ensure!(
        tpch::to_csv(&report.result)? == setup.want(sc.query),
        "{} / {}: the answer differs from the failure-free one",
        model.name(),
        sc.label()
    );
    std::fs::remove_dir_all(&work).ok();
    Ok(report)
}

/// Every scenario's time split, its recovery, and its cost against
/// scenario 0.
fn print_scenarios(results: &[Measured]) {
    let mut t = Table::new(&[
        "device model",
        "scenario",
        "I/O s",
        "compute s",
        "comm s",
        "total s",
        "recovery s",
        "post-recovery I/O s",
        "vs scenario 0",
    ]);
    for (m, sc, r) in results {
        let (io, c, comm) = r.breakdown();
        let post = if sc.query == Query::Q1 {
            "agg-grp-sort (after recovery)"
        } else {
            "scan (after recovery)"
        };
        t.row(vec![
            m.name().into(),
            sc.label(),
            format!("{io:.3}"),
            format!("{c:.3}"),
            format!("{comm:.3}"),
            format!("{:.3}", r.total_s()),
            dash(sc.number, phase_sum(r, "recovery", |p| p.total_s())),
            dash(sc.number, phase_sum(r, post, |p| p.io_s)),
            format!(
                "{:.2}x",
                r.total_s() / find(results, *m, sc.query, 0).total_s()
            ),
        ]);
    }
    println!("{}", t.render());
}

/// The paper's findings, checked on our numbers.
fn print_findings(results: &[Measured]) {
    let get = |m: DeviceModel, q: Query, n: u8| find(results, m, q, n);
    println!("paper's findings against ours:");
    for m in MODELS {
        let scan_par = get(m, Query::Scan, 2).total_s() / get(m, Query::Scan, 1).total_s();
        let q1_par = get(m, Query::Q1, 4).total_s() / get(m, Query::Q1, 1).total_s();
        println!(
            "  {:>8}: parity recovery slower than mirror+spare (Fig. 8/10)? Scan {:.2}x, Q1 {:.2}x of mirror+spare: {}",
            m.name(),
            scan_par,
            q1_par,
            if scan_par > 1.0 && q1_par > 1.0 {
                "yes, as the paper"
            } else {
                "NOT as the paper"
            }
        );
        let post = "agg-grp-sort (after recovery)";
        let gb_spare = phase_sum(get(m, Query::Q1, 1), post, |p| p.io_s);
        let gb_redis = phase_sum(get(m, Query::Q1, 3), post, |p| p.io_s);
        let comm_redis = get(m, Query::Q1, 3).breakdown().2;
        let comm_spare = get(m, Query::Q1, 1).breakdown().2;
        let cut = if gb_spare > 0.0 {
            (1.0 - gb_redis / gb_spare) * 100.0
        } else {
            0.0
        };
        println!(
            "  {:>8}: redistribution cuts post-recovery Group-by I/O by {cut:.0}% vs spare (paper: 75-80%), communication {:.2}x of spare's (paper: pays in communication)",
            m.name(),
            comm_redis / comm_spare.max(1e-9)
        );
        let q1: Vec<(u8, f64)> = (1..=4)
            .map(|n| (n, get(m, Query::Q1, n).total_s()))
            .collect();
        let best = q1
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("4 schemes");
        println!(
            "  {:>8}: cheapest Q1 recovery: scenario {} ({}); spare/migrate = {:.2}",
            m.name(),
            best.0,
            SCENARIOS[3 + best.0 as usize]
                .scheme
                .expect("faulted")
                .name(),
            q1[0].1 / q1[1].1
        );
    }
    let none_best = (1..=4)
        .map(|n| get(DeviceModel::None, Query::Q1, n).total_s())
        .fold(f64::INFINITY, f64::min);
    let ratio = none_best / get(DeviceModel::None, Query::Q1, 0).total_s();
    println!(
        "target: Q1 with a node failure under the best scheme, no device model: {ratio:.2}x the failure-free time (target <= 1.3x: {})",
        if ratio <= 1.3 { "met" } else { "MISSED" }
    );
}

/// The scenarios of query `q`: I/O, compute and communication stacked per
/// scenario, a panel per device model.
fn plot_scenarios(
    out: &Path,
    sf: f64,
    q: Query,
    results: &[Measured],
    link: Option<Link>,
) -> anyhow::Result<()> {
    let panels = MODELS
        .iter()
        .map(|m| {
            let sel: Vec<&Measured> = results
                .iter()
                .filter(|(mm, s, _)| mm == m && s.query == q)
                .collect();
            let categories = sel.iter().map(|r| r.1.label()).collect();
            breakdown_panel(*m, categories, &sel, |r| &r.2)
        })
        .collect::<Vec<_>>();
    let suffix = link.map_or(String::new(), |l| format!("-{}", l.name()));
    let png = out.join(format!("smartstore-recovery-{}{suffix}.png", q.name()));
    let title = format!(
        "{} recovery scenarios at sf {sf} (as the paper's Figures {}){}",
        if q == Query::Scan { "Scan" } else { "TPC-H Q1" },
        if q == Query::Scan {
            "8 and 10"
        } else {
            "9 and 11"
        },
        link.map_or(String::new(), |l| format!(", {} node links", l.name())),
    );
    stacked_bar_png(&png, &title, &panels)?;
    println!("plot: {}", png.display());
    Ok(())
}
