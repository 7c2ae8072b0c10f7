//! `rebound bench controller`: rebound against nbdkit (file and memory
//! plugins) and qemu-nbd with fio's cache-standard job, all in one run.
//!
//! The measurement is `bench/controller.sh` (so it can also run by hand);
//! this command runs it with this binary, prints its table, and on a full
//! run draws `controller.png` from its CSV.

use std::path::Path;
use std::process::Command;

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use crate::report::{BarPanel, bar_chart_png};

/// Options of `rebound bench controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Rounds (every server once per round; the median is reported) [default: 3, or 1 with --quick].
    #[arg(long)]
    rounds: Option<u32>,
    /// Seconds of fio per server and round [default: 20, or 5 with --quick].
    #[arg(long)]
    runtime: Option<u32>,
}

/// Run the comparison.
pub fn run(args: ControllerArgs) -> anyhow::Result<std::process::ExitCode> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut cmd = Command::new("bash");
    cmd.arg(super::repo_file("bench/controller.sh")?)
        .arg("--rebound")
        .arg(&exe)
        .arg("--out")
        .arg(&args.common.out);
    if args.common.quick {
        cmd.arg("--quick");
    }
    if let Some(r) = args.rounds {
        anyhow::ensure!((1..=50).contains(&r), "--rounds must be within 1..=50");
        cmd.arg("--rounds").arg(r.to_string());
    }
    if let Some(t) = args.runtime {
        anyhow::ensure!((1..=3600).contains(&t), "--runtime must be within 1..=3600");
        cmd.arg("--runtime").arg(t.to_string());
    }
    let status = cmd.status().context("running bench/controller.sh")?;
    anyhow::ensure!(status.success(), "bench/controller.sh failed ({status})");
    if !args.common.quick {
        let png = args.common.out.join("controller.png");
        plot(&args.common.out.join("controller.csv"), &png)?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Median IOPS, read p99, write p99 and CPU µs per I/O per server, in the
/// script's order.
fn medians(csv: &Path) -> anyhow::Result<Vec<(String, [f64; 4])>> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut per: Vec<(String, Vec<[f64; 4]>)> = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        anyhow::ensure!(
            f.len() == 8,
            "malformed line in {}: {line:?}",
            csv.display()
        );
        let num = |i: usize| -> anyhow::Result<f64> {
            f[i].parse()
                .with_context(|| format!("bad number {:?} in {}", f[i], csv.display()))
        };
        let row = [num(2)?, num(3)?, num(4)?, num(7)?];
        match per.iter_mut().find(|(s, _)| s == f[0]) {
            Some((_, rows)) => rows.push(row),
            None => per.push((f[0].to_owned(), vec![row])),
        }
    }
    Ok(per
        .into_iter()
        .map(|(s, mut rows)| {
            rows.sort_by(|a, b| a[0].total_cmp(&b[0]));
            let m = rows[(rows.len() - 1) / 2];
            (s, m)
        })
        .collect())
}

fn plot(csv: &Path, png: &Path) -> anyhow::Result<()> {
    let m = medians(csv)?;
    let categories: Vec<String> = m.iter().map(|(s, _)| s.clone()).collect();
    bar_chart_png(
        png,
        "cache-standard over NBD (fio, 4 KiB random 75% read, iodepth 32): rebound (TCP, Unix socket, TLS) vs peers",
        &[
            BarPanel {
                title: "throughput".into(),
                y_label: "IOPS".into(),
                categories: categories.clone(),
                series: vec![("IOPS".into(), m.iter().map(|(_, v)| v[0]).collect())],
            },
            BarPanel {
                title: "p99 completion latency".into(),
                y_label: "microseconds".into(),
                categories,
                series: vec![
                    ("read p99".into(), m.iter().map(|(_, v)| v[1]).collect()),
                    ("write p99".into(), m.iter().map(|(_, v)| v[2]).collect()),
                ],
            },
            BarPanel {
                title: "server CPU per I/O (all threads, /proc)".into(),
                y_label: "microseconds".into(),
                categories: m.iter().map(|(s, _)| s.clone()).collect(),
                series: vec![("CPU µs/IO".into(), m.iter().map(|(_, v)| v[3]).collect())],
            },
        ],
    )
}
