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
        let png = args.common.out.join("controller-cpu.png");
        plot_cpu(&args.common.out.join("controller-cpu.csv"), &png)?;
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

/// Servers, offered loads, and per load the median CPU µs per I/O of each
/// server.
type CpuMedians = (Vec<String>, Vec<u64>, Vec<Vec<f64>>);

/// Median CPU µs per I/O per (server, offered load) from
/// `controller-cpu.csv`, servers and loads in the script's order.
fn cpu_medians(csv: &Path) -> anyhow::Result<CpuMedians> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut servers: Vec<String> = Vec::new();
    let mut loads: Vec<u64> = Vec::new();
    let mut runs: Vec<(usize, usize, f64)> = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        anyhow::ensure!(
            f.len() == 9,
            "malformed line in {}: {line:?}",
            csv.display()
        );
        let load: u64 = f[1]
            .parse()
            .with_context(|| format!("bad load {:?} in {}", f[1], csv.display()))?;
        let cpu: f64 = f[4]
            .parse()
            .with_context(|| format!("bad number {:?} in {}", f[4], csv.display()))?;
        let si = servers.iter().position(|s| s == f[0]).unwrap_or_else(|| {
            servers.push(f[0].to_owned());
            servers.len() - 1
        });
        let li = loads.iter().position(|l| *l == load).unwrap_or_else(|| {
            loads.push(load);
            loads.len() - 1
        });
        runs.push((si, li, cpu));
    }
    let medians = loads
        .iter()
        .enumerate()
        .map(|(li, _)| {
            (0..servers.len())
                .map(|si| {
                    let mut v: Vec<f64> = runs
                        .iter()
                        .filter(|r| r.0 == si && r.1 == li)
                        .map(|r| r.2)
                        .collect();
                    v.sort_by(f64::total_cmp);
                    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
                })
                .collect()
        })
        .collect();
    Ok((servers, loads, medians))
}

fn plot_cpu(csv: &Path, png: &Path) -> anyhow::Result<()> {
    let (servers, loads, medians) = cpu_medians(csv)?;
    bar_chart_png(
        png,
        "server CPU per I/O at fixed offered loads",
        &[BarPanel {
            title: "fio cache-standard at rate_iops; all threads, /proc; nbdkit-null: the floor"
                .into(),
            y_label: "microseconds".into(),
            categories: servers,
            series: loads
                .iter()
                .zip(medians)
                .map(|(l, m)| (format!("{l} IOPS offered"), m))
                .collect(),
        }],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_medians_take_the_middle_round_per_server_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("controller-cpu.csv");
        std::fs::write(
            &csv,
            "server,load,round,iops,cpu_us_per_io,read_p99_us,write_p99_us,user_us_per_io,sys_us_per_io\n\
             rebound,20000,1,19990,30.0,1,1,10.0,20.0\n\
             nbdkit-null,20000,1,19990,20.0,1,1,1.0,19.0\n\
             rebound,20000,2,19990,10.0,1,1,4.0,6.0\n\
             rebound,20000,3,19990,50.0,1,1,20.0,30.0\n\
             rebound,60000,1,59000,25.0,1,1,5.0,20.0\n",
        )
        .unwrap();
        let (servers, loads, m) = cpu_medians(&csv).unwrap();
        assert_eq!(servers, ["rebound", "nbdkit-null"]);
        assert_eq!(loads, [20000, 60000]);
        assert_eq!(m[0], [30.0, 20.0]);
        // A server without runs at a load plots as 0.
        assert_eq!(m[1], [25.0, 0.0]);
    }

    #[test]
    fn a_malformed_cpu_csv_line_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("controller-cpu.csv");
        std::fs::write(&csv, "header\nrebound,20000,1\n").unwrap();
        let err = cpu_medians(&csv).unwrap_err().to_string();
        assert!(err.contains("controller-cpu.csv"), "{err}");
        // A line of the layout before the user and system columns.
        std::fs::write(&csv, "header\nrebound,20000,1,19990,30.0,1,1\n").unwrap();
        let err = cpu_medians(&csv).unwrap_err().to_string();
        assert!(err.contains("controller-cpu.csv"), "{err}");
    }
}
