//! `rebound bench badpath`: the scheduling paper's good-path / bad-path
//! experiment (§6.3) on the real controller instead of a synthetic load.
//!
//! fio's cache-standard mix (random 4 KiB, 3 reads to 1 write, QD32) against
//! `rebound serve` under the performance-oriented policy and the dynamic
//! one. On a bad path one group gets the paper's fault emulation: 1 fault
//! per 10,000 dispatches, each recovery taking 20 ms, as does every task of
//! the group running or dispatched during it (`inject group-fault GROUP
//! rate=1e-4 duration=20ms`). The paper faults "a candidate task belonging
//! to recovery group 5", its second-busiest group; here there is one bad
//! path per group of `--groups`: by default `cache` (our second-busiest,
//! and on every request's path, so suspending it stalls every request) and
//! `device` (staging misses, FUA, FLUSH: off the path of read hits and
//! absorbed writes, as the paper's group 5 was off some requests' path).
//! Each cell runs `--rounds` times, interleaved, on a fresh server; the
//! table reports medians and the ratios to the performance-oriented
//! policy. Paper: dynamic gained 16.3% throughput and cut mean latency
//! 22.9% under faults.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use crate::report::{BarPanel, Table, bar_chart_png, thousands};

/// Options of `rebound bench badpath`.
#[derive(Debug, Args)]
pub struct BadPathArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Rounds per cell (median reported) [default: 3, or 1 with --quick].
    #[arg(long)]
    rounds: Option<u32>,
    /// Seconds of fio per cell and round [default: 15, or 3 with --quick].
    #[arg(long)]
    runtime: Option<u32>,
    /// rcs workers of the server; 0: one per core (the paper's runs used 4
    /// and 8).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// fio jobs, one NBD connection each, QD32 apiece (more cores need
    /// more load to stay busy).
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// The recovery groups that take the faults on the bad path, one bad
    /// path per group (comma-separated). `cache` is on every request's
    /// path; `device` (staging misses, FUA, FLUSH) on a read miss's.
    #[arg(long, value_delimiter = ',', default_value = "cache,device")]
    groups: Vec<String>,
}

/// The load and server shape of one run.
#[derive(Debug, Clone, Copy)]
struct Shape {
    workers: usize,
    connections: u32,
}

const POLICIES: [&str; 2] = ["performance", "dynamic"];

/// IOPS and mean completion latency (µs) of one fio cache-standard run
/// (QD32, one connection).
pub(super) fn fio_run(port: u16, runtime: u32) -> anyhow::Result<(f64, f64)> {
    let r = super::fio::fio(port, "cache-standard", runtime, (32, 1))?;
    Ok((r.iops, r.mean_us))
}

/// One run: `faulted` is the group given the fault emulation (None: the
/// good path).
fn one(
    policy: &str,
    faulted: Option<&str>,
    runtime: u32,
    shape: Shape,
    work: &Path,
    port: u16,
) -> anyhow::Result<(f64, f64)> {
    let dir = tempfile::tempdir_in(work)?;
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .arg("--nvs")
        .arg(dir.path().join("nvs"))
        .arg("--box")
        .arg(dir.path().join("box"))
        .args([
            "--volume-size",
            "1G",
            "--nvs-size",
            "256M",
            "--cache-size",
            "256M",
        ])
        .args(["--policy", policy])
        .args(["--workers", &shape.workers.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting rebound serve")?;
    let admin = dir.path().join("data").join("admin.sock");
    crate::admin_cmd::wait_ready(&admin, Duration::from_secs(30))?;
    if let Some(group) = faulted {
        controller::admin::request(
            &admin,
            &format!("inject group-fault {group} rate=0.0001 duration=20ms"),
        )
        .map_err(anyhow::Error::msg)?;
    }
    let result = super::fio::fio(port, "cache-standard", runtime, (32, shape.connections))
        .map(|r| (r.iops, r.mean_us));
    // SAFETY: kill(2) on our own child's pid; no memory involved.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let _ = child.wait();
    result
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Run the experiment.
pub fn run(args: BadPathArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let rounds = args.rounds.unwrap_or(if quick { 1 } else { 3 });
    let runtime = args.runtime.unwrap_or(if quick { 3 } else { 15 });
    anyhow::ensure!((1..=50).contains(&rounds), "--rounds must be within 1..=50");
    anyhow::ensure!(
        (1..=3600).contains(&runtime),
        "--runtime must be within 1..=3600"
    );
    anyhow::ensure!(
        args.workers <= controller::limits::WORKERS_MAX,
        "--workers must be within 0..={}",
        controller::limits::WORKERS_MAX
    );
    anyhow::ensure!(
        (1..=64).contains(&args.connections),
        "--connections must be within 1..=64"
    );
    let groups: Vec<&str> = args.groups.iter().map(String::as_str).collect();
    anyhow::ensure!(
        !groups.is_empty() && groups.len() <= 6,
        "--groups must name 1 to 6 groups"
    );
    for g in &groups {
        anyhow::ensure!(
            ["host", "cache", "nvs", "device", "destage", "background"].contains(g),
            "unknown group {g:?} in --groups (host, cache, nvs, device, destage, background)"
        );
    }
    let shape = Shape {
        workers: args.workers,
        connections: args.connections,
    };
    // Paths: the good path, then one bad path per faulted group.
    let paths: Vec<Option<&str>> = std::iter::once(None)
        .chain(groups.iter().map(|g| Some(*g)))
        .collect();
    let label = |path: Option<&str>| match path {
        None => "good".to_owned(),
        Some(g) => format!("bad: {g} faulted"),
    };
    let work = super::server::scratch_dir()?;
    let port = super::server::free_port()?;
    // cells[policy][path] = samples
    let mut cells = vec![vec![(Vec::new(), Vec::new()); paths.len()]; POLICIES.len()];
    let bar = crate::report::progress(
        u64::from(rounds) * (POLICIES.len() * paths.len()) as u64,
        "runs",
    );
    for _ in 0..rounds {
        for (p, policy) in POLICIES.iter().enumerate() {
            for (b, path) in paths.iter().enumerate() {
                bar.set_message(format!("{policy}, {} path", label(*path)));
                let (iops, lat) = one(policy, *path, runtime, shape, work.path(), port)?;
                cells[p][b].0.push(iops);
                cells[p][b].1.push(lat);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let med: Vec<Vec<(f64, f64)>> = cells
        .into_iter()
        .map(|row| {
            row.into_iter()
                .map(|(i, l)| (median(i), median(l)))
                .collect()
        })
        .collect();
    let mut table = Table::new(&[
        "policy",
        "path",
        "IOPS",
        "mean latency µs",
        "IOPS vs performance",
        "latency vs performance",
    ]);
    for (p, policy) in POLICIES.iter().enumerate() {
        for (b, path) in paths.iter().enumerate() {
            let (iops, lat) = med[p][b];
            let (base_iops, base_lat) = med[0][b];
            table.row(vec![
                (*policy).to_owned(),
                label(*path),
                thousands(iops.round()),
                format!("{lat:.0}"),
                format!("{:.3}x", iops / base_iops),
                format!("{:+.1}%", 100.0 * (lat / base_lat - 1.0)),
            ]);
        }
    }
    println!("{}", table.render());
    let good = med[1][0].0 / med[0][0].0;
    println!(
        "dynamic vs performance, good path: {good:.3}x (target: no worse than 0.98x: {})",
        if good >= 0.98 { "met" } else { "missed" },
    );
    for (b, path) in paths.iter().enumerate().skip(1) {
        let bad = med[1][b].0 / med[0][b].0;
        let lat = 1.0 - med[1][b].1 / med[0][b].1;
        println!(
            "dynamic vs performance, faults in {}: throughput {bad:.3}x (target >= 1.16x: {}), mean latency {:+.1}% (target <= -20%: {})",
            path.unwrap_or("?"),
            if bad >= 1.16 { "met" } else { "missed" },
            -100.0 * lat,
            if lat >= 0.20 { "met" } else { "missed" },
        );
    }
    println!(
        "({rounds} round(s) of {runtime} s per cell, median; server workers {}, {} fio connection(s) at QD32; {} cores here; faults: 1 per 10,000 dispatches of the group, 20 ms each; paper: +16.3% throughput, -22.9% mean latency, on 4- and 8-way machines)",
        if shape.workers == 0 {
            "one per core".to_owned()
        } else {
            shape.workers.to_string()
        },
        shape.connections,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if !quick {
        let png = args.common.out.join("badpath.png");
        let categories: Vec<String> = paths.iter().map(|p| label(*p)).collect();
        let series = |f: fn(&(f64, f64)) -> f64| -> Vec<(String, Vec<f64>)> {
            POLICIES
                .iter()
                .enumerate()
                .map(|(p, n)| ((*n).to_owned(), med[p].iter().map(f).collect()))
                .collect()
        };
        bar_chart_png(
            &png,
            "controller under the scheduling paper's fault emulation (fio cache-standard)",
            &[
                BarPanel {
                    title: "throughput".into(),
                    y_label: "IOPS".into(),
                    categories: categories.clone(),
                    series: series(|c| c.0),
                },
                BarPanel {
                    title: "mean latency".into(),
                    y_label: "µs".into(),
                    categories,
                    series: series(|c| c.1),
                },
            ],
        )?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}
