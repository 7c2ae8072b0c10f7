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
use smartstore::devmodel::DeviceModel;
use smartstore::host::{Cluster, ClusterSpec, Launcher, Layout, Query, QueryReport};
use smartstore::tpch;

use super::CommonArgs;
use crate::report::{StackPanel, Table, progress, stacked_bar_png};

/// Options of `rebound bench smartstore`.
#[derive(Debug, Args)]
pub struct SmartstoreArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// TPC-H scale factor [default: 1, or 0.05 with --quick].
    #[arg(long)]
    sf: Option<f64>,
    /// Runs of each query per configuration; the median is reported [default: 3, or 1 with --quick].
    #[arg(long)]
    runs: Option<u32>,
}

/// One measured configuration.
struct Row {
    layout: Layout,
    model: DeviceModel,
    workload: &'static str,
    report: QueryReport,
}

const DATA_NODES: usize = 4;

fn median_by_total(mut reports: Vec<QueryReport>) -> QueryReport {
    reports.sort_by(|a, b| a.wall_s().total_cmp(&b.wall_s()));
    let mid = reports.len() / 2;
    reports.swap_remove(mid)
}

/// Runs the experiment.
pub fn run(args: SmartstoreArgs) -> anyhow::Result<ExitCode> {
    let quick = args.common.quick;
    let sf = args.sf.unwrap_or(if quick { 0.05 } else { 1.0 });
    tpch::check_sf(sf)?;
    let runs = args.runs.unwrap_or(if quick { 1 } else { 3 });
    anyhow::ensure!((1..=20).contains(&runs), "--runs must be within 1..=20");
    let exe = std::env::current_exe().context("locating this binary")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let scratch = tempfile::tempdir().context("scratch directory")?;

    eprintln!("generating lineitem at sf {sf} ...");
    let (schema, batches) = tpch::lineitem(sf)?;
    let total_rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let (want_q1, want_scan) = rt.block_on(async {
        let q1 = tpch::to_csv(&[tpch::q1_single(schema.clone(), batches.clone()).await?])?;
        let scan = tpch::to_csv(&tpch::scan_single(schema.clone(), batches.clone()).await?)?;
        anyhow::Ok((q1, scan))
    })?;

    let layouts = [Layout::Mirror, Layout::Parity];
    let models = [
        DeviceModel::None,
        DeviceModel::Disk,
        DeviceModel::Mems(smartstore::devmodel::G3),
    ];
    let bar = progress((layouts.len() * models.len()) as u64, "smartstore");
    let mut rows: Vec<Row> = Vec::new();
    let mut placements = Vec::new();
    for layout in layouts {
        for model in models {
            bar.set_message(format!("{} / {}", layout.name(), model.name()));
            let work = scratch
                .path()
                .join(format!("{}-{}", layout.name(), model.name()));
            let spec = ClusterSpec {
                nodes: DATA_NODES,
                layout,
                spare: false,
                model,
            };
            rt.block_on(async {
                let mut c = Cluster::launch(spec, &Launcher::Process(exe.clone()), &work).await?;
                placements.push((layout, model, c.place(schema.clone(), &batches).await?));
                for (workload, query, ckpt) in [
                    ("scan", Query::Scan, false),
                    ("q1, no checkpoints", Query::Q1, false),
                    ("q1", Query::Q1, true),
                ] {
                    let mut reports = Vec::new();
                    for _ in 0..runs {
                        let r = c.run_query(query, ckpt).await?;
                        let got = tpch::to_csv(&r.result)?;
                        let want = if query == Query::Q1 {
                            &want_q1
                        } else {
                            &want_scan
                        };
                        anyhow::ensure!(
                            &got == want,
                            "{workload} on {} / {}: wrong answer",
                            layout.name(),
                            model.name()
                        );
                        reports.push(r);
                    }
                    rows.push(Row {
                        layout,
                        model,
                        workload,
                        report: median_by_total(reports),
                    });
                }
                c.shutdown();
                anyhow::Ok(())
            })?;
            std::fs::remove_dir_all(&work).ok();
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    // The peer: DuckDB over the same rows, from Parquet.
    let duck = duckdb_q1(scratch.path(), &schema, &batches, if quick { 3 } else { 5 })?;

    println!(
        "\nsmartstore, failure-free (scenario 0): sf {sf} ({total_rows} lineitems), {DATA_NODES} data nodes + mirror group ({DATA_NODES} nodes) or parity node, \
         median of {runs} run(s); every answer checked against one DataFusion run"
    );
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
    for r in &rows {
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

    println!(
        "cost of checkpointing Q1's intermediate results (section 4.2): total with minus without"
    );
    let mut t = Table::new(&[
        "layout",
        "device model",
        "q1 without s",
        "q1 with s",
        "checkpoint cost s",
        "cost %",
    ]);
    for layout in layouts {
        for model in models {
            let find = |w: &str| {
                rows.iter()
                    .find(|r| r.layout == layout && r.model == model && r.workload == w)
                    .expect("measured")
            };
            let off = find("q1, no checkpoints").report.total_s();
            let on = find("q1").report.total_s();
            t.row(vec![
                layout.name().into(),
                model.name().into(),
                format!("{off:.3}"),
                format!("{on:.3}"),
                format!("{:.3}", on - off),
                format!("{:.0}%", (on - off) / off * 100.0),
            ]);
        }
    }
    println!("{}", t.render());

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
        "placement (generation excluded): {}",
        placements
            .iter()
            .map(|(l, m, s)| format!("{}/{} {s:.2} s", l.name(), m.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );

    if !quick {
        let mut panels = Vec::new();
        for model in models {
            let sel: Vec<&Row> = rows.iter().filter(|r| r.model == model).collect();
            let cats = sel
                .iter()
                .map(|r| {
                    format!(
                        "{}\n{}",
                        r.workload.replace(", no checkpoints", " no ckpt"),
                        r.layout.name()
                    )
                })
                .collect();
            let comp =
                |f: fn(&QueryReport) -> f64| sel.iter().map(|r| f(&r.report)).collect::<Vec<f64>>();
            panels.push(StackPanel {
                title: format!("device model: {}", model.name()),
                y_label: "execution time (s)".into(),
                categories: cats,
                components: vec![
                    ("I/O".into(), comp(|r| r.breakdown().0)),
                    ("compute".into(), comp(|r| r.breakdown().1)),
                    ("communication".into(), comp(|r| r.breakdown().2)),
                ],
            });
        }
        let png = args.common.out.join("smartstore.png");
        stacked_bar_png(
            &png,
            &format!("smartstore scenario 0 at sf {sf}: Scan and Q1, 4 data nodes"),
            &panels,
        )?;
        println!("plot: {}", png.display());
    }
    Ok(ExitCode::SUCCESS)
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
    let script = [
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/bench/duckdb_q1.py")),
        std::path::PathBuf::from("bench/duckdb_q1.py"),
    ]
    .into_iter()
    .find(|p| p.is_file())
    .context("bench/duckdb_q1.py not found (run from the repository)")?;
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
    let ipc = dir.join("lineitem.arrows");
    std::fs::write(&ipc, smartstore::object::ipc_encode(schema, batches)?)
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
