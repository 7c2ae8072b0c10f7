//! `rebound bench smartstore --scale`: TPC-H Q1 at scale factor 10 (60
//! million lineitems) on 4 + 4 nodes, failure-free and checkpoints off,
//! against DuckDB from Parquet in the same run.
//!
//! Nothing holds the table: it is generated twice as a stream of row
//! blocks. The first pass feeds DuckDB's Parquet file (written by the peer
//! as the blocks arrive on its stdin) and the single-process reference
//! answer ([`tpch::q1_streamed`]: DataFusion over a million rows at a time,
//! partial sums merged). The second pass places the table on the nodes
//! ([`Cluster::place_stream`]), each node writing its share to its device
//! as it arrives. Each side runs Q1 once to warm up (not counted); then
//! rounds interleave one DuckDB Q1 and one rebound Q1;
//! every rebound answer must equal the reference, and DuckDB's sums and
//! counts must equal it too. Reported: generation, placement, the Parquet
//! conversion, each process's peak resident memory, the data on the nodes'
//! devices, Q1's phases and the ratio to DuckDB (target: at most 1.5x).

use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::Context;
use arrow::record_batch::RecordBatch;
use smartstore::devmodel::DeviceModel;
use smartstore::host::{Cluster, ClusterSpec, Launcher, Layout, Query, QueryReport};
use smartstore::tpch;

use super::{DATA_NODES, SmartstoreArgs, ensure_duckdb, median_by_total};
use crate::report::{BarPanel, Table, progress, stacked_bar_png};

/// Target: rebound's Q1 within this factor of DuckDB's.
const DUCKDB_TARGET: f64 = 1.5;

/// Runs the experiment.
pub(super) fn run(args: &SmartstoreArgs) -> anyhow::Result<ExitCode> {
    let quick = args.common.quick;
    let sf = args.sf.unwrap_or(if quick { 0.05 } else { 10.0 });
    tpch::check_sf(sf)?;
    let runs = args.runs.unwrap_or(if quick { 1 } else { 3 });
    anyhow::ensure!((1..=20).contains(&runs), "--runs must be within 1..=20");
    ensure_duckdb()?;
    let script = crate::bench::repo_file("bench/duckdb_q1_serve.py")?;
    let exe = std::env::current_exe().context("locating this binary")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let scratch = tempfile::tempdir().context("scratch directory")?;
    let parquet = scratch.path().join("lineitem.parquet");

    let first = first_pass(&rt, sf, &script, &parquet)?;
    let mut duck = Duck::start(&script, &parquet)?;

    let launcher = match args.link {
        Some(l) => Launcher::Netns(exe, l),
        None => Launcher::Process(exe),
    };
    let spec = ClusterSpec {
        nodes: DATA_NODES,
        layout: Layout::Mirror,
        spare: false,
        model: DeviceModel::None,
        memory: usize::try_from(args.node_memory).context("--node-memory")?,
    };
    let work = scratch.path().join("cluster");
    let measured = rt.block_on(async {
        let mut c = Cluster::launch(spec, &launcher, &work).await?;
        let (schema, blocks) = tpch::lineitem_blocks(sf)?;
        let bar = progress(first.rows, "placing lineitem");
        let shown = bar.clone();
        let blocks = blocks.inspect(move |b| {
            if let Ok(b) = b {
                shown.inc(b.num_rows() as u64);
            }
        });
        let placed_s = c
            .place_stream(schema, smartstore::host::blocking_source(blocks))
            .await?;
        bar.finish_and_clear();
        let disk: Vec<u64> = c.dirs.iter().map(|d| dir_bytes(d)).collect();
        // One Q1 first, checked and not counted, as the peer warms up with
        // one: the nodes' first query faults in its memory.
        let warm = c.run_query(Query::Q1, false).await?;
        anyhow::ensure!(
            tpch::to_csv(&warm.result)? == first.want,
            "rebound's Q1 differs from the single-process run"
        );
        let bar = progress(u64::from(runs), "Q1 rounds (DuckDB, rebound)");
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for _ in 0..runs {
            theirs.push(duck.q1(&first.want)?);
            let r = c.run_query(Query::Q1, false).await?;
            anyhow::ensure!(
                tpch::to_csv(&r.result)? == first.want,
                "rebound's Q1 differs from the single-process run"
            );
            ours.push(r);
            bar.inc(1);
        }
        bar.finish_and_clear();
        let node_peaks: Vec<u64> = c.local_pids().into_iter().map(peak_rss).collect();
        c.shutdown();
        anyhow::Ok(Measured {
            placed_s,
            disk,
            node_peaks,
            ours,
            theirs,
        })
    })?;
    duck.stop();
    let host_peak = peak_rss(std::process::id());
    report(args, sf, runs, &first, &duck, measured, host_peak)
}

/// What the first generation pass gave.
struct FirstPass {
    rows: u64,
    /// Seconds inside the generator.
    generate_s: f64,
    /// Wall seconds of the pass (generation, the reference, the peer's
    /// Parquet writing, overlapped).
    pass_s: f64,
    /// Q1's reference answer, as CSV.
    want: String,
    /// The peer's Parquet conversion: seconds and bytes.
    parquet_s: f64,
    parquet_bytes: u64,
}

/// Generates the table once: every block goes, in plain types, to the
/// peer's conversion to Parquet, and to the single-process reference.
fn first_pass(
    rt: &tokio::runtime::Runtime,
    sf: f64,
    script: &Path,
    parquet: &Path,
) -> anyhow::Result<FirstPass> {
    let mut convert = peer(script, "convert", parquet)?;
    let stdin = convert.stdin.take().expect("piped");
    let (schema, mut blocks) = tpch::lineitem_blocks(sf)?;
    let bar = progress(
        tpch::lineitem_rows_estimate(sf),
        "generating lineitem (Parquet for DuckDB, reference answer)",
    );
    let shown = bar.clone();
    let (tx, rx) = std::sync::mpsc::sync_channel::<smartstore::Result<RecordBatch>>(4);
    let t = Instant::now();
    let generator = std::thread::spawn(move || -> anyhow::Result<(f64, u64)> {
        let mut generate_s = 0.0;
        let mut rows = 0u64;
        let mut stdin = Some(BufWriter::with_capacity(1 << 20, stdin));
        let mut ipc = None;
        loop {
            let t = Instant::now();
            let Some(block) = blocks.next() else { break };
            generate_s += t.elapsed().as_secs_f64();
            let block = block?;
            // DuckDB reads the plain types (it keeps DECIMAL(15,2) in 64
            // bits itself).
            let plain = smartstore::ops::plain_types(&block)?;
            let w = match &mut ipc {
                Some(w) => w,
                None => ipc.insert(arrow::ipc::writer::StreamWriter::try_new(
                    stdin.take().expect("once"),
                    &plain.schema(),
                )?),
            };
            w.write(&plain).context("sending rows to the DuckDB peer")?;
            rows += block.num_rows() as u64;
            shown.inc(block.num_rows() as u64);
            if tx.send(Ok(block)).is_err() {
                anyhow::bail!("the reference run stopped");
            }
        }
        if let Some(mut w) = ipc {
            w.finish()?;
            w.into_inner()?.flush()?;
        }
        Ok((generate_s, rows))
    });
    let reference = rt.block_on(tpch::q1_streamed(schema, rx.into_iter()));
    let (generate_s, rows) = generator
        .join()
        .map_err(|_| anyhow::anyhow!("the generator panicked"))??;
    let want = tpch::to_csv(&[reference?])?;
    let out = convert
        .wait_with_output()
        .context("DuckDB peer's conversion")?;
    let pass_s = t.elapsed().as_secs_f64();
    bar.finish_and_clear();
    anyhow::ensure!(
        out.status.success(),
        "DuckDB peer's conversion failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("DuckDB peer's conversion output")?;
    anyhow::ensure!(
        v["rows"].as_u64() == Some(rows),
        "the peer's Parquet holds {} rows, {rows} were generated",
        v["rows"]
    );
    Ok(FirstPass {
        rows,
        generate_s,
        pass_s,
        want,
        parquet_s: v["seconds"].as_f64().unwrap_or(0.0),
        parquet_bytes: v["bytes"].as_u64().unwrap_or(0),
    })
}

/// Starts the DuckDB peer's `mode` over `parquet`, talking over pipes.
fn peer(script: &Path, mode: &str, parquet: &Path) -> anyhow::Result<std::process::Child> {
    Command::new("python3")
        .arg(script)
        .arg(mode)
        .arg(parquet)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the DuckDB peer ({mode})"))
}

/// The DuckDB peer: one process, one Q1 per request.
struct Duck {
    child: std::process::Child,
    input: Option<std::process::ChildStdin>,
    output: BufReader<std::process::ChildStdout>,
    threads: u64,
}

impl Duck {
    fn start(script: &Path, parquet: &Path) -> anyhow::Result<Duck> {
        let mut child = peer(script, "serve", parquet)?;
        let input = child.stdin.take();
        let output = BufReader::new(child.stdout.take().expect("piped"));
        let mut d = Duck {
            child,
            input,
            output,
            threads: 0,
        };
        let ready = d.line()?;
        d.threads = ready["threads"].as_u64().unwrap_or(0);
        Ok(d)
    }

    fn line(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        self.output.read_line(&mut line)?;
        anyhow::ensure!(!line.is_empty(), "the DuckDB peer exited");
        let v: serde_json::Value = serde_json::from_str(&line).context("DuckDB peer output")?;
        if let Some(e) = v.get("error") {
            anyhow::bail!("DuckDB peer: {e}");
        }
        Ok(v)
    }

    /// Runs Q1 once; checks DuckDB's sums and counts against the reference
    /// (`want`, our CSV); returns its seconds.
    fn q1(&mut self, want: &str) -> anyhow::Result<f64> {
        let input = self.input.as_mut().context("the DuckDB peer was stopped")?;
        input.write_all(b"q1\n")?;
        input.flush()?;
        let v = self.line()?;
        let got: Vec<Vec<String>> = v["rows"]
            .as_array()
            .context("DuckDB rows")?
            .iter()
            .map(|r| {
                r.as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| match c {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .collect()
            })
            .collect();
        // Ours: flag, status, the four sums, three averages, the count.
        let expect: Vec<Vec<String>> = want
            .lines()
            .skip(1)
            .map(|l| {
                let c: Vec<&str> = l.split(',').collect();
                [0, 1, 2, 3, 4, 5, 9]
                    .iter()
                    .map(|&i| c.get(i).copied().unwrap_or("").to_string())
                    .collect()
            })
            .collect();
        anyhow::ensure!(
            got == expect,
            "DuckDB's Q1 differs from the single-process run: {got:?} against {expect:?}"
        );
        v["seconds"].as_f64().context("DuckDB seconds")
    }

    fn stop(&mut self) {
        self.input = None;
        let _ = self.child.wait();
    }
}

/// What the cluster part measured.
struct Measured {
    placed_s: f64,
    /// Bytes in each node's directory, role order.
    disk: Vec<u64>,
    /// Each node's peak resident memory (bytes), role order.
    node_peaks: Vec<u64>,
    ours: Vec<QueryReport>,
    theirs: Vec<f64>,
}

/// Peak resident memory of process `pid` (`VmHWM`), in bytes; 0 when it
/// cannot be read.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Bytes of the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

fn mb(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / 1e6)
}

/// The generation, placement and memory tables; `memory` is each node's
/// `--memory`.
fn print_setup(first: &FirstPass, m: &Measured, host_peak: u64, memory: u64) {
    let n = DATA_NODES;
    let main_disk: u64 = m.disk[..n].iter().sum();
    let mirror_disk: u64 = m.disk[n..].iter().sum();
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
    let mut t = Table::new(&["step", "seconds", "what"]);
    t.row(vec![
        "generate".into(),
        format!("{:.1}", first.generate_s),
        "inside the generator (tpchgen), first pass".into(),
    ]);
    t.row(vec![
        "first pass".into(),
        format!("{:.1}", first.pass_s),
        "generation + single-process reference + DuckDB's Parquet, overlapped".into(),
    ]);
    t.row(vec![
        "parquet".into(),
        format!("{:.1}", first.parquet_s),
        format!(
            "the peer writing {} MB of Parquet as rows arrive",
            mb(first.parquet_bytes)
        ),
    ]);
    t.row(vec![
        "place".into(),
        format!("{:.1}", m.placed_s),
        "second generation, streamed to the nodes, each writing its share to its device".into(),
    ]);
    println!("{}", t.render());
    let mut t = Table::new(&["process", "peak resident MB", "data on device MB"]);
    t.row(vec![
        "host (this process)".into(),
        mb(host_peak),
        "-".into(),
    ]);
    for (i, (peak, disk)) in m.node_peaks.iter().zip(&m.disk).enumerate() {
        let role = if i < n {
            format!("main {i}")
        } else {
            format!("mirror {}", i - n)
        };
        t.row(vec![role, mb(*peak), mb(*disk)]);
    }
    println!("{}", t.render());
    println!(
        "nodes' data: main group {} MB, mirror group {} MB; largest node peak {} MB \
         (each node's --memory {} MiB: a primitive whose input is larger streams and spills; \
         with checkpoints off the Sort, and a Scan that would stream, are deferred into the \
         AggGrpSort, which reads their input unsorted: their phases take milliseconds)",
        mb(main_disk),
        mb(mirror_disk),
        mb(max(&m.node_peaks)),
        memory >> 20
    );
}

fn report(
    args: &SmartstoreArgs,
    sf: f64,
    runs: u32,
    first: &FirstPass,
    duck: &Duck,
    m: Measured,
    host_peak: u64,
) -> anyhow::Result<ExitCode> {
    let n = DATA_NODES;
    println!(
        "\nsmartstore at scale: Q1 at sf {sf} ({} lineitems) on {n} data nodes + {n} mirror nodes, \
         no device model, checkpoints off, median of {runs} interleaved round(s) with DuckDB \
         after one warm-up query each",
        first.rows
    );
    print_setup(first, &m, host_peak, args.node_memory);
    let ours_each: Vec<String> = m
        .ours
        .iter()
        .map(|r| format!("{:.3}", r.wall_s()))
        .collect();
    let theirs_each: Vec<String> = m.theirs.iter().map(|s| format!("{s:.3}")).collect();
    let ours = median_by_total(m.ours);
    let mut theirs = m.theirs.clone();
    theirs.sort_by(f64::total_cmp);
    let duck_s = theirs[theirs.len() / 2];
    println!("rebound Q1, the median round:\n{}", ours.phase_table());
    let ratio = ours.wall_s() / duck_s;
    let mut t = Table::new(&["system", "Q1 median s", "rounds s"]);
    t.row(vec![
        format!("rebound ({n} + {n} nodes)"),
        format!("{:.3}", ours.wall_s()),
        ours_each.join(" "),
    ]);
    t.row(vec![
        format!("DuckDB ({} threads, Parquet)", duck.threads),
        format!("{duck_s:.3}"),
        theirs_each.join(" "),
    ]);
    println!("{}", t.render());
    println!(
        "every rebound answer equal to the single-process run, and DuckDB's sums and counts too"
    );
    println!(
        "rebound Q1 = {ratio:.2}x DuckDB (target <= {DUCKDB_TARGET}x: {})",
        if ratio <= DUCKDB_TARGET {
            "met"
        } else {
            "MISSED"
        }
    );
    if !args.common.quick {
        plot(
            &args.common.out,
            sf,
            &ours,
            duck_s,
            duck.threads,
            args.node_memory,
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Q1's phases stacked for rebound, next to DuckDB's one bar.
fn plot(
    out: &Path,
    sf: f64,
    ours: &QueryReport,
    duck_s: f64,
    threads: u64,
    memory: u64,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    let categories = vec![
        format!("rebound, {DATA_NODES}+{DATA_NODES} nodes"),
        format!("DuckDB, {threads} threads"),
    ];
    let mut series: Vec<(String, Vec<f64>)> = ours
        .critical_path()
        .map(|p| (p.name.clone(), vec![p.wall_s, 0.0]))
        .collect();
    series.push(("DuckDB Q1".into(), vec![0.0, duck_s]));
    let png: PathBuf = out.join("smartstore-scale.png");
    stacked_bar_png(
        &png,
        &format!(
            "TPC-H Q1 at sf {sf}, checkpoints off, no device model, node memory {} MiB",
            memory >> 20
        ),
        &[BarPanel {
            title: "median round".into(),
            y_label: "wall time (s)".into(),
            categories,
            series,
        }],
    )?;
    println!("plot: {}", png.display());
    Ok(())
}
