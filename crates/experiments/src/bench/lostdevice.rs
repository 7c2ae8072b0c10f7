//! `rebound bench lost-device`: the failure model's lost device on the
//! real controller (rung 7, reconstruct). fio's nbd engine (randrw 75%
//! reads, 4 KiB, QD16, as `bench availability`) runs against a 1 GiB volume
//! over three devices; one device is lost (`rebound inject lose-device 1`)
//! and the volume serves degraded while a replacement is rebuilt. Per
//! layout, in one run on one machine:
//!
//! - the good path: IOPS of `none` (striping, the peer), `mirror` and
//!   `parity` before the loss, as ratios to `none`;
//! - the bad path: IOPS while degraded and rebuilding, and after, as % of
//!   that layout's good path; the worst 100 ms;
//! - the rebuild: its time (loss to the status no longer degraded) and
//!   rate, per GiB of replacement device; unthrottled, and throttled with
//!   `--rebuild-rate`, which trades rebuild time for client throughput.
//!
//! Device files live in a scratch directory (under /dev/shm when it can
//! be), so the numbers are the controller's CPU and locking costs, not a
//! disk's: a rebuild of real disks is bounded by their bandwidth.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use super::availability::{fio, iops_series, mean};
use crate::report::{Table, line_chart_png, thousands};

/// Options of `rebound bench lost-device`.
#[derive(Debug, Args)]
pub struct LostDeviceArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// The throttled case's rebuild rate (bytes per second).
    #[arg(long, default_value = "64M", value_parser = controller::parse_size)]
    throttled_rate: u64,
}

/// One case: a layout, and the rebuild rate when a device is lost.
struct Case {
    name: String,
    raid: &'static str,
    /// `None`: no device is lost (the good-path peer).
    rebuild_rate: Option<u64>,
}

struct Outcome {
    case: Case,
    series: Vec<(f64, f64)>,
    good: f64,
    during: f64,
    worst: f64,
    after: f64,
    rebuild: Option<Duration>,
    device_bytes: u64,
    status: String,
}

const DEVICES: u32 = 3;

/// Lose device 1 and wait (up to `longest`) until the volume is no longer
/// degraded: the time from `lost_at`.
fn lose_and_rebuild(
    server: &crate::harness::Server,
    lost_at: Instant,
    longest: Duration,
) -> anyhow::Result<Duration> {
    let answer = server.admin("inject lose-device 1")?;
    anyhow::ensure!(answer.contains("lost"), "inject lose-device: {answer}");
    loop {
        let status = server.admin("status")?;
        if !status.contains("DEGRADED") {
            return Ok(lost_at.elapsed());
        }
        anyhow::ensure!(
            lost_at.elapsed() < longest,
            "the rebuild did not end within {longest:?}:\n{status}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_case(case: Case, work: &Path, port: u16, quick: bool) -> anyhow::Result<Outcome> {
    let dir = work.join(case.name.replace([' ', ','], "-"));
    std::fs::create_dir_all(&dir)?;
    let mut extra = vec![
        "--devices".to_owned(),
        DEVICES.to_string(),
        "--raid".to_owned(),
        case.raid.to_owned(),
    ];
    if let Some(rate) = case.rebuild_rate {
        extra.extend(["--rebuild-rate".to_owned(), rate.to_string()]);
    }
    let server = super::experiment_server(&dir, port)?.args(extra).start()?;
    // fio warms the cache and fills the NVS first; the good path is the
    // `measure` before the loss.
    let warm = Duration::from_millis(if quick { 2000 } else { 5000 });
    let measure = Duration::from_millis(if quick { 1500 } else { 4000 });
    let before = warm + measure;
    let after = Duration::from_millis(if quick { 1000 } else { 3000 });
    let longest = Duration::from_secs(if quick { 60 } else { 300 });
    let prefix = dir.join("fio");
    let mut load = fio(port, before + longest + after, &prefix)?;
    std::thread::sleep(before);
    let lost_at = Instant::now();
    let rebuild = match case.rebuild_rate {
        Some(_) => Some(lose_and_rebuild(&server, lost_at, longest)?),
        None => None,
    };
    let window = rebuild.unwrap_or(Duration::from_millis(if quick { 1000 } else { 3000 }));
    std::thread::sleep(after);
    let ran = before + window + after;
    // fio ends its jobs, writes its logs and exits 128 on SIGINT.
    // SAFETY: kill(2) on our own child's pid; no memory involved.
    unsafe {
        libc::kill(load.id() as libc::pid_t, libc::SIGINT);
    }
    let st = load.wait().context("waiting for fio")?;
    anyhow::ensure!(
        st.success() || st.code() == Some(128),
        "fio failed in {} ({st})",
        case.name
    );
    let status = server.admin("status")?;
    server.stop()?;
    let t0 = before.as_secs_f64();
    let series: Vec<(f64, f64)> = iops_series(&prefix)?
        .into_iter()
        .map(|(s, v)| (s - t0, v))
        .filter(|(s, _)| *s <= (ran.as_secs_f64() - t0))
        .collect();
    let w = window.as_secs_f64();
    let pick = |lo: f64, hi: f64| {
        series
            .iter()
            .filter(move |(s, _)| *s > lo && *s <= hi)
            .map(|p| p.1)
    };
    let good = mean(pick(-measure.as_secs_f64(), -0.2));
    let during = mean(pick(0.0, w));
    let worst = pick(0.0, w.max(0.1)).fold(f64::INFINITY, f64::min);
    let after_mean = mean(pick(w + 0.3, w + after.as_secs_f64() - 0.1));
    let layout = controller::raid::Layout::new(
        case.raid.parse().map_err(anyhow::Error::msg)?,
        DEVICES,
        (1u64 << 30) / 4096,
    );
    Ok(Outcome {
        case,
        series,
        good,
        during,
        worst,
        after: after_mean,
        rebuild,
        device_bytes: layout.device_bytes(),
        status,
    })
}

/// Run the experiment.
pub fn run(args: LostDeviceArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    let mut cases = vec![
        Case {
            name: "none (striping, peer)".into(),
            raid: "none",
            rebuild_rate: None,
        },
        Case {
            name: "mirror".into(),
            raid: "mirror",
            rebuild_rate: Some(0),
        },
        Case {
            name: "parity".into(),
            raid: "parity",
            rebuild_rate: Some(0),
        },
    ];
    if !quick {
        for raid in ["mirror", "parity"] {
            cases.push(Case {
                name: format!("{raid}, rebuild {} MiB/s", args.throttled_rate >> 20),
                raid,
                rebuild_rate: Some(args.throttled_rate),
            });
        }
    }
    let bar = crate::report::progress(cases.len() as u64, "cases");
    let mut out = Vec::new();
    for case in cases {
        bar.set_message(case.name.clone());
        out.push(run_case(case, work.path(), port, quick)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_table(&out);
    println!(
        "fio randrw 75% reads, 4 KiB, QD16 on a 1 GiB volume over {DEVICES} file devices (scratch dir); device 1 lost at 0 s"
    );
    for o in out.iter().filter(|o| o.rebuild.is_some()) {
        let line = o
            .status
            .lines()
            .find(|l| l.contains("device 1 rebuilt"))
            .map(str::trim)
            .unwrap_or("(no rebuild record in the status)");
        println!("{}: {line}", o.case.name);
    }
    if !quick {
        let png = args.common.out.join("lost-device.png");
        line_chart_png(
            &png,
            "throughput while a device is lost and rebuilt (fio randrw 4 KiB, QD16; loss at 0 s)",
            "seconds from the loss",
            "IOPS (100 ms windows)",
            &out.iter()
                .map(|o| (o.case.name.clone(), o.series.clone()))
                .collect::<Vec<_>>(),
        )?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The table: each layout's good path, degraded service and rebuild.
fn print_table(out: &[Outcome]) {
    let peer = out.first().map_or(0.0, |o| o.good);
    let mut table = Table::new(&[
        "layout",
        "good-path IOPS",
        "vs none",
        "degraded+rebuild IOPS",
        "% of good",
        "worst 100 ms",
        "after rebuild",
        "rebuild",
        "s per GiB of device",
    ]);
    let pct = |x: f64, of: f64| {
        if of > 0.0 && x.is_finite() {
            format!("{:.0}%", 100.0 * x / of)
        } else {
            "-".to_owned()
        }
    };
    for o in out {
        let lost = o.rebuild.is_some();
        table.row(vec![
            o.case.name.clone(),
            thousands(o.good.round()),
            format!("{:.2}x", if peer > 0.0 { o.good / peer } else { 0.0 }),
            if lost {
                thousands(o.during.round())
            } else {
                "-".into()
            },
            if lost {
                pct(o.during, o.good)
            } else {
                "-".into()
            },
            if lost {
                pct(o.worst, o.good)
            } else {
                "-".into()
            },
            if lost {
                pct(o.after, o.good)
            } else {
                "-".into()
            },
            o.rebuild
                .map_or("-".into(), |d| format!("{:.2} s", d.as_secs_f64())),
            o.rebuild.map_or("-".into(), |d| {
                format!(
                    "{:.2}",
                    d.as_secs_f64() / (o.device_bytes as f64 / f64::from(1u32 << 30))
                )
            }),
        ]);
    }
    println!("{}", table.render());
}
