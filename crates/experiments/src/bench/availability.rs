//! `rebound bench availability`: throughput per 100 ms around a fault, for
//! each rung the controller has, with fio's nbd engine as the load (the
//! paper's Figures 10 and 11: micro-recovery cost a 35% dip lasting 6 s;
//! system-level recovery 4 s of downtime plus 2 s to regain throughput).
//!
//! Cases, each on a fresh server process with the same load (fio randrw
//! 75% reads, 4 KiB, queue depth 16):
//!
//! - rung 1: a panic in 1 of 1,000 `cache.read` stages for the fault
//!   window; each failed request is redriven.
//! - rung 2: the scheduling paper's emulation in the cache group, 1 fault
//!   per 10,000 dispatches, each recovery taking 20 ms, for the window.
//! - rung 4: one in-process system recovery (`rebound inject system`):
//!   quiesce, rebuild the directory from the recovery box, redrive; fio's
//!   connection stays up. "recovery" is the server's own measure, from
//!   closing the admission gate to opening it again.
//! - rung 5: kill -9 mid-load, then `rebound serve` again (fast restart
//!   from the recovery box).
//! - rung 6: kill -9 mid-load, the recovery box deleted, then `rebound
//!   serve` again (hard restart: NVS scan).
//!
//! fio's nbd engine does not reconnect, so for the kill cases the load is
//! one fio run up to the kill and a new one after the restart; "restart"
//! is from the kill to the new server's start-up banner (it is accepting
//! and has replayed everything), and the plot's gap also holds fio's own
//! start-up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use super::{NVS_SIZE, experiment_server};
use crate::report::{Table, line_chart_png, thousands};

/// Options of `rebound bench availability`.
#[derive(Debug, Args)]
pub struct AvailabilityArgs {
    #[command(flatten)]
    common: CommonArgs,
}

/// Run timing of one case.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Load before the fault.
    before: Duration,
    /// Fault window (for injected faults).
    window: Duration,
    /// Load after the fault window (or after the restart).
    after: Duration,
}

/// Start fio for `runtime` writing a per-100 ms IOPS log under `prefix`.
pub(super) fn fio(port: u16, runtime: Duration, prefix: &Path) -> anyhow::Result<Child> {
    fio_sized(port, runtime, prefix, "1g")
}

/// [`fio`] over the first `size` of the export (fio's `--size`).
pub(super) fn fio_sized(
    port: u16,
    runtime: Duration,
    prefix: &Path,
    size: &str,
) -> anyhow::Result<Child> {
    Command::new("fio")
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri=nbd://127.0.0.1:{port}/"),
            "--rw=randrw",
            "--rwmixread=75",
            "--bs=4k",
            "--iodepth=16",
            &format!("--size={size}"),
            "--time_based=1",
            &format!("--runtime={}ms", runtime.as_millis()),
            "--log_avg_msec=100",
            &format!("--write_iops_log={}", prefix.display()),
            "--output=/dev/null",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting fio (apt-get install fio)")
}

/// Total IOPS per 100 ms bucket from fio's iops logs (read and write
/// lines summed), as (seconds since the log's start, IOPS).
pub(super) fn iops_series(prefix: &Path) -> anyhow::Result<Vec<(f64, f64)>> {
    let path = PathBuf::from(format!("{}_iops.1.log", prefix.display()));
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    // Bucket -> direction -> (sum, samples): fio's sampling drifts, so a
    // bucket can hold two samples of one direction; those are averaged,
    // then the directions summed.
    let mut buckets: std::collections::BTreeMap<u64, [(f64, u32); 3]> =
        std::collections::BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        if f.len() < 3 {
            continue;
        }
        let (Ok(ms), Ok(v), Ok(dir)) = (
            f[0].parse::<u64>(),
            f[1].parse::<f64>(),
            f[2].parse::<usize>(),
        ) else {
            continue;
        };
        let e = &mut buckets.entry(ms.div_ceil(100)).or_default()[dir.min(2)];
        e.0 += v;
        e.1 += 1;
    }
    Ok(buckets
        .into_iter()
        .map(|(b, dirs)| {
            let v = dirs
                .iter()
                .filter(|d| d.1 > 0)
                .map(|d| d.0 / f64::from(d.1))
                .sum();
            (b as f64 / 10.0, v)
        })
        .collect())
}

/// One case's outcome.
struct CaseResult {
    name: &'static str,
    rung: &'static str,
    /// (seconds relative to the fault, IOPS per 100 ms).
    series: Vec<(f64, f64)>,
    good: f64,
    /// The worst 100 ms before the fault, % of the good-path mean (the
    /// machine's own noise).
    noise_pct: f64,
    worst_pct: f64,
    below_half: Duration,
    restart: Option<(Duration, String)>,
    /// An in-process recovery's own duration (rung 4).
    recovery: Option<Duration>,
}

/// The `total` of a rung-4 report (`... total 1.234ms`).
fn reported_total(answer: &str) -> Option<Duration> {
    let text = answer.split("total ").nth(1)?.trim();
    let unit_at = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (n, unit) = text.split_at(unit_at);
    let n: f64 = n.parse().ok()?;
    let secs = match unit.trim() {
        "ns" => n / 1e9,
        "µs" | "us" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

pub(super) fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0u32), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / f64::from(n) }
}

/// `part` as a percentage of `whole` (0 when either is not a number to
/// divide).
fn percent_of(part: f64, whole: f64) -> f64 {
    if whole > 0.0 && part.is_finite() {
        100.0 * part / whole
    } else {
        0.0
    }
}

/// The good-path mean of the 100 ms intervals before the fault (0.3 s
/// trimmed at both ends), and the worst of them (the host's own noise).
fn baseline(series: &[(f64, f64)], fault_at: f64) -> (f64, f64) {
    let pre = || {
        series
            .iter()
            .filter(|(s, _)| *s < -0.3 && *s > -fault_at + 0.3)
            .map(|p| p.1)
    };
    (mean(pre()), pre().fold(f64::INFINITY, f64::min))
}

/// An injected fault held for the window.
fn injected_case(
    name: &'static str,
    rung: &'static str,
    inject: &[&str],
    t: Timing,
    work: &Path,
    port: u16,
) -> anyhow::Result<CaseResult> {
    let dir = work.join(name.replace(' ', "-"));
    std::fs::create_dir_all(&dir)?;
    let server = experiment_server(&dir, port)?.start()?;
    let prefix = dir.join("fio");
    let mut load = fio(port, t.before + t.window + t.after, &prefix)?;
    std::thread::sleep(t.before);
    let mut recovery = None;
    for request in inject {
        let answer = server.admin(request)?;
        recovery = recovery.or(reported_total(&answer));
    }
    std::thread::sleep(t.window);
    server.admin("inject clear")?;
    let status = load.wait().context("waiting for fio")?;
    anyhow::ensure!(status.success(), "fio failed during {name} ({status})");
    let log = server.admin("status")?;
    server.stop()?;
    let fault_at = t.before.as_secs_f64();
    let series: Vec<(f64, f64)> = iops_series(&prefix)?
        .into_iter()
        .map(|(s, v)| (s - fault_at, v))
        .collect();
    let (good, noise) = baseline(&series, fault_at);
    let window_end = t.window.as_secs_f64() + 0.3;
    let during: Vec<f64> = series
        .iter()
        .filter(|(s, _)| *s > 0.0 && *s <= window_end)
        .map(|p| p.1)
        .collect();
    let worst = during.iter().copied().fold(f64::INFINITY, f64::min);
    let below = during.iter().filter(|v| **v < good / 2.0).count();
    tracing::debug!(%log, "status after {name}");
    Ok(CaseResult {
        name,
        rung,
        series,
        good,
        noise_pct: percent_of(noise, good),
        worst_pct: percent_of(worst, good),
        below_half: Duration::from_millis(100 * below as u64),
        restart: None,
        recovery,
    })
}

/// kill -9 mid-load, optionally damaging the box, then restart.
fn kill_case(
    name: &'static str,
    rung: &'static str,
    damage_box: bool,
    t: Timing,
    work: &Path,
    port: u16,
) -> anyhow::Result<CaseResult> {
    let dir = work.join(name.replace(' ', "-"));
    std::fs::create_dir_all(&dir)?;
    let server = experiment_server(&dir, port)?.start()?;
    let before = dir.join("fio-before");
    let mut load = fio(port, t.before * 4, &before)?;
    std::thread::sleep(t.before);
    let killed = Instant::now();
    server.kill9();
    let reaped = killed.elapsed();
    if damage_box {
        std::fs::remove_file(dir.join("box")).context("deleting the recovery box")?;
    }
    let server = experiment_server(&dir, port)?.start()?;
    let (ready, banner) = (server.ready_after(), server.banner().to_owned());
    let restart = killed.elapsed();
    eprintln!("{name}: killed and reaped in {reaped:?}; new process ready in {ready:?}; {banner}");
    let _ = load.wait();
    let after = dir.join("fio-after");
    let started_fio = killed.elapsed();
    let mut load = fio(port, t.after, &after)?;
    let status = load.wait().context("waiting for fio")?;
    anyhow::ensure!(status.success(), "fio after the restart failed ({status})");
    server.stop()?;
    let good_series = iops_series(&before).unwrap_or_default();
    let fault_at = t.before.as_secs_f64();
    let mut series: Vec<(f64, f64)> = good_series
        .iter()
        .filter(|(s, _)| *s <= fault_at)
        .map(|(s, v)| (s - fault_at, *v))
        .collect();
    let (good, noise) = baseline(&series, fault_at);
    series.push((0.0, 0.0));
    let offset = started_fio.as_secs_f64();
    let post = iops_series(&after)?;
    if let Some(first) = post.first() {
        series.push((offset + first.0 - 0.1, 0.0));
    }
    series.extend(post.iter().map(|(s, v)| (offset + s, *v)));
    let how = banner
        .split("; ")
        .find(|p| p.contains("restart"))
        .unwrap_or("?")
        .split(':')
        .next()
        .unwrap_or("?")
        .to_owned();
    Ok(CaseResult {
        name,
        rung,
        series,
        good,
        noise_pct: percent_of(noise, good),
        worst_pct: 0.0,
        below_half: restart,
        restart: Some((restart, how)),
        recovery: None,
    })
}

/// The hard restart's worst case: a full NVS (every slot holds a record,
/// the high-water mark at the top) reopened with fresh mappings, as a
/// restarted process would, and scanned; time per GiB.
fn full_scan_per_gib(work: &Path) -> anyhow::Result<(Duration, u32)> {
    use controller::nvs::Nvs;
    let size = controller::parse_size(NVS_SIZE).map_err(anyhow::Error::msg)?;
    let path = work.join("full.nvs");
    let tracks = 1 << 18;
    {
        let (nvs, _) = Nvs::open_or_create(&path, size, 7, tracks)?;
        let data = vec![0x5au8; controller::limits::TRACK_BYTES];
        let mut seq = 1;
        while let Ok(slots) = nvs.reserve(256, Duration::from_millis(1)) {
            for s in slots {
                nvs.write_record(s, seq, seq % tracks, &data);
                seq += 1;
            }
        }
    }
    let (nvs, _) = Nvs::open_or_create(&path, size, 7, tracks)?;
    let report = nvs.scan();
    let slots = nvs.slot_count();
    let bytes = f64::from(slots) * (controller::limits::TRACK_BYTES + 64) as f64;
    let per_gib = report.elapsed.as_secs_f64() * (1u64 << 30) as f64 / bytes;
    Ok((Duration::from_secs_f64(per_gib), slots))
}

/// What a case does to the server.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// These admin requests, held for the fault window.
    Inject(&'static [&'static str]),
    /// kill -9 mid-load (and the recovery box deleted), then start again.
    Kill { damage_box: bool },
}

/// The cases: name, rung, fault.
const CASES: [(&str, &str, Fault); 5] = [
    (
        "task fault",
        "1 (redrive)",
        Fault::Inject(&["inject panic cache.read rate=0.001 count=unlimited"]),
    ),
    (
        "group fault",
        "2 (group recovery)",
        Fault::Inject(&["inject group-fault cache rate=0.0001 duration=20ms"]),
    ),
    (
        "system recovery",
        "4 (in-process)",
        Fault::Inject(&["inject system"]),
    ),
    (
        "kill -9",
        "5 (fast restart)",
        Fault::Kill { damage_box: false },
    ),
    (
        "kill -9, box deleted",
        "6 (hard restart)",
        Fault::Kill { damage_box: true },
    ),
];

/// Run the experiment.
pub fn run(args: AvailabilityArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let t = if quick {
        Timing {
            before: Duration::from_millis(1500),
            window: Duration::from_millis(1000),
            after: Duration::from_millis(1000),
        }
    } else {
        Timing {
            before: Duration::from_secs(3),
            window: Duration::from_secs(2),
            after: Duration::from_secs(3),
        }
    };
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    let bar = crate::report::progress(CASES.len() as u64, "cases");
    let mut results = Vec::new();
    for (name, rung, fault) in CASES {
        let number = rung.split(' ').next().unwrap_or(rung);
        bar.set_message(format!("rung {number}"));
        results.push(match fault {
            Fault::Inject(requests) => injected_case(name, rung, requests, t, work.path(), port)?,
            Fault::Kill { damage_box } => kill_case(name, rung, damage_box, t, work.path(), port)?,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    let (scan_per_gib, scanned_slots) = full_scan_per_gib(work.path())?;
    print_table(&results, scan_per_gib);
    for r in &results {
        if let Some((_, how)) = &r.restart {
            println!("{}: the restarted server reported: {how}", r.name);
        }
    }
    println!(
        "hard restart worst case: a full {NVS_SIZE} NVS ({scanned_slots} records) scans at {:.0} ms per GiB; a restart reads only the slots below the high-water mark",
        scan_per_gib.as_secs_f64() * 1e3
    );
    println!(
        "paper: micro-recovery a 35% dip for 6 s; system-level recovery 4 s down + 2 s to regain throughput"
    );
    if !quick {
        let png = args.common.out.join("availability.png");
        line_chart_png(
            &png,
            "throughput around a fault (fio randrw 4 KiB, QD16; fault at 0 s)",
            "seconds from the fault",
            "IOPS (100 ms windows)",
            &results
                .iter()
                .map(|r| (format!("{} (rung {})", r.name, r.rung), r.series.clone()))
                .collect::<Vec<_>>(),
        )?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// A case's restart (or in-process recovery) time, its target, and whether
/// it met it.
fn verdict(r: &CaseResult, scan_per_gib: Duration) -> (String, String, String) {
    let within_200ms = |d: Duration| {
        if d <= Duration::from_millis(200) {
            "yes"
        } else {
            "no"
        }
    };
    match (&r.restart, r.rung.starts_with('5')) {
        (Some((d, _)), true) => (
            format!("{:.0} ms", d.as_secs_f64() * 1e3),
            "back within 200 ms".to_owned(),
            within_200ms(*d).to_owned(),
        ),
        (Some((d, _)), false) => (
            format!("{:.0} ms", d.as_secs_f64() * 1e3),
            "bounded by the NVS scan".to_owned(),
            format!(
                "full scan {:.0} ms per GiB",
                scan_per_gib.as_secs_f64() * 1e3
            ),
        ),
        (None, _) => match r.recovery {
            Some(d) => (
                format!("{:.1} ms in process", d.as_secs_f64() * 1e3),
                "back within 200 ms".to_owned(),
                within_200ms(d).to_owned(),
            ),
            None => (
                "-".to_owned(),
                "no 100 ms under 50%".to_owned(),
                if r.below_half.is_zero() { "yes" } else { "no" }.to_owned(),
            ),
        },
    }
}

/// The table of every case.
fn print_table(results: &[CaseResult], scan_per_gib: Duration) {
    let mut table = Table::new(&[
        "case",
        "rung",
        "good-path IOPS",
        "worst 100 ms, no fault",
        "worst 100 ms",
        "time < 50%",
        "restart",
        "target",
        "met",
    ]);
    for r in results {
        let (restart, target, met) = verdict(r, scan_per_gib);
        table.row(vec![
            r.name.to_owned(),
            r.rung.to_owned(),
            thousands(r.good.round()),
            format!("{:.0}%", r.noise_pct),
            if r.restart.is_some() {
                "0% (down)".to_owned()
            } else {
                format!("{:.0}%", r.worst_pct)
            },
            format!("{:.1} s", r.below_half.as_secs_f64()),
            restart,
            target,
            met,
        ]);
    }
    println!("{}", table.render());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iops_buckets_average_a_directions_repeated_samples_and_sum_directions() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("fio");
        std::fs::write(
            dir.path().join("fio_iops.1.log"),
            "100, 1000, 0, 0, 0\n100, 300, 1, 0, 0\n201, 1200, 0, 0, 0\n299, 1400, 0, 0, 0\n300, 500, 1, 0, 0\n",
        )
        .unwrap();
        let s = iops_series(&prefix).unwrap();
        assert_eq!(s, vec![(0.1, 1300.0), (0.3, 1800.0)]);
    }

    #[test]
    fn the_rung_4_reports_total_is_parsed_in_every_unit() {
        let report = "rung 4 system recovery (x): rebuilt 3 dirty tracks from the recovery box; 2 requests redriven; quiesce 40.9µs, rebuild 641.7µs, total 704.676µs\n";
        assert_eq!(
            reported_total(report),
            Some(Duration::from_secs_f64(704.676e-6))
        );
        assert_eq!(
            reported_total("... total 1.5ms"),
            Some(Duration::from_micros(1500))
        );
        assert_eq!(reported_total("... total 2s"), Some(Duration::from_secs(2)));
        assert_eq!(reported_total("no total here"), None);
        assert_eq!(reported_total("total 3 parsecs"), None);
    }
}
