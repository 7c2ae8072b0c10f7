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
//! Each run is a fresh server. A round runs every path under both
//! policies, the two policies of a path back to back (a pair; which goes
//! first alternates by round), so the host's slow drifts fall on both; the
//! table reports the median of each cell and the median and range of the
//! per-round ratios to the performance-oriented policy.
//!
//! The table also shows the mechanism, read from the server's metrics: the
//! faulted group's faults per second and the processors one recovery held
//! (its emulated recovery time summed over the tasks that held it, in units
//! of 20 ms: 1 when only the failing task's processor is held, as reactive
//! scheduling intends; more when the policy dispatches the recovering
//! group). The gain the paper reports is that difference in held processor
//! time: with `W` processors held per recovery under the performance
//! policy and 1 under dynamic, and recoveries occupying a fraction `x` of
//! the time, at best `(1 - x/W) / (1 - x)` when the rest of the work can use
//! the free processors (paper: `W` = 8, `x` ≈ 0.16: 1.17x).
//!
//! Paper (8-way controller): under faults dynamic delivered 105 KIOps
//! against performance-oriented's 87.8 (1.196x; performance 16.3% lower),
//! at 13.5 against 16.6 ms mean response time (18.7% lower; performance's
//! 22.9% higher).

use std::path::Path;
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
    /// Paired rounds per cell (medians reported, with the range of the
    /// per-round ratios) [default: 5, or 1 with --quick].
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

/// What one run measured: fio's numbers and, from the server's metrics,
/// the faulted group's fault emulation.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    iops: f64,
    mean_us: f64,
    /// Faults injected in the faulted group, per second of the run.
    faults_per_s: f64,
    /// Processor time held per recovery, in units of the emulated recovery
    /// time: 1 when a recovery holds only its own processor, up to the
    /// number of processors that dispatch the group during it.
    held_per_recovery: f64,
}

/// Emulated recovery time of the bad path (the paper's 20 ms).
const RECOVERY_MS: f64 = 20.0;

/// One run: `faulted` is the group given the fault emulation (None: the
/// good path).
fn one(
    policy: &str,
    faulted: Option<&str>,
    runtime: u32,
    shape: Shape,
    work: &Path,
    port: u16,
) -> anyhow::Result<Sample> {
    let dir = tempfile::tempdir_in(work)?;
    let metrics = format!("127.0.0.1:{}", crate::harness::free_port()?);
    let server = super::experiment_server(dir.path(), port)?
        .flag("--metrics", &metrics)
        .flag("--cache-size", "256M")
        .flag("--policy", policy)
        .flag("--workers", shape.workers.to_string())
        .ready_within(Duration::from_secs(30))
        .start()?;
    let result = (|| {
        if let Some(group) = faulted {
            server.admin(&format!(
                "inject group-fault {group} rate=0.0001 duration={RECOVERY_MS}ms"
            ))?;
        }
        let r = super::fio::fio(port, "cache-standard", runtime, (32, shape.connections))?;
        let mut sample = Sample {
            iops: r.iops,
            mean_us: r.mean_us,
            ..Sample::default()
        };
        if let Some(group) = faulted {
            let text = crate::harness::scrape_metrics(&metrics)?;
            let value = |name: &str| {
                crate::harness::metric_sample(&text, &format!("{name}{{group=\"{group}\"}}"))
            };
            let recoveries = value("rebound_rcs_recoveries_total")?;
            let held_s = value("rebound_rcs_emulated_recovery_seconds_total")?;
            sample.faults_per_s = value("rebound_rcs_injected_total")? / f64::from(runtime);
            sample.held_per_recovery = if recoveries > 0.0 {
                held_s * 1000.0 / RECOVERY_MS / recoveries
            } else {
                0.0
            };
        }
        Ok(sample)
    })();
    server.stop()?;
    result
}

/// A path's name in the table and plot.
fn label(path: Option<&str>) -> String {
    match path {
        None => "good".to_owned(),
        Some(g) => format!("bad: {g} faulted"),
    }
}

/// The median; of an even count, the mean of the two middle values.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// Median and range of a list of ratios, as `1.234x (1.10..1.31)`.
fn ratio_cell(ratios: &[f64], show: impl Fn(f64) -> String) -> String {
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mid = median(ratios.to_vec());
    if ratios.len() > 1 {
        format!("{} ({}..{})", show(mid), show(lo), show(hi))
    } else {
        show(mid)
    }
}

/// Check the flags; the faulted groups.
fn validate(args: &BadPathArgs, rounds: u32, runtime: u32) -> anyhow::Result<Vec<&str>> {
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
    Ok(groups)
}

/// Run the experiment.
pub fn run(args: BadPathArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let rounds = args.rounds.unwrap_or(if quick { 1 } else { 5 });
    let runtime = args.runtime.unwrap_or(if quick { 3 } else { 15 });
    let groups = validate(&args, rounds, runtime)?;
    let shape = Shape {
        workers: args.workers,
        connections: args.connections,
    };
    // Paths: the good path, then one bad path per faulted group.
    let paths: Vec<Option<&str>> = std::iter::once(None)
        .chain(groups.iter().map(|g| Some(*g)))
        .collect();
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    // runs[policy][path] = one sample per round; the two policies of a
    // round and path run back to back (a pair), first one then the other
    // in turns, so the host's slow drifts fall on both.
    let mut runs = vec![vec![Vec::new(); paths.len()]; POLICIES.len()];
    let bar = crate::report::progress(
        u64::from(rounds) * (POLICIES.len() * paths.len()) as u64,
        "runs",
    );
    for round in 0..rounds {
        for (b, path) in paths.iter().enumerate() {
            for k in 0..POLICIES.len() {
                let p = (k + round as usize) % POLICIES.len();
                let policy = POLICIES[p];
                bar.set_message(format!(
                    "round {}, {policy}, {} path",
                    round + 1,
                    label(*path)
                ));
                runs[p][b].push(one(policy, *path, runtime, shape, work.path(), port)?);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    report(&args, &runs, &paths, rounds, runtime, shape)
}

/// Every run's sample, `[policy][path][round]`.
#[derive(Debug, Clone, Copy)]
struct Runs<'a>(&'a [Vec<Vec<Sample>>]);

impl Runs<'_> {
    /// The median of `f` over the rounds of policy `p` on path `b`.
    fn med(self, p: usize, b: usize, f: fn(&Sample) -> f64) -> f64 {
        median(self.0[p][b].iter().map(f).collect())
    }

    /// Per round, dynamic (index 1) against performance (index 0).
    fn per_round(self, b: usize, f: fn(&Sample, &Sample) -> f64) -> Vec<f64> {
        self.0[1][b]
            .iter()
            .zip(&self.0[0][b])
            .map(|(d, p)| f(d, p))
            .collect()
    }

    fn iops_ratios(self, b: usize) -> Vec<f64> {
        self.per_round(b, |d, p| d.iops / p.iops)
    }

    fn latency_changes(self, b: usize) -> Vec<f64> {
        self.per_round(b, |d, p| d.mean_us / p.mean_us - 1.0)
    }
}

/// Print the table and the verdicts; write the plot (full runs).
fn report(
    args: &BadPathArgs,
    runs: &[Vec<Vec<Sample>>],
    paths: &[Option<&str>],
    rounds: u32,
    runtime: u32,
    shape: Shape,
) -> anyhow::Result<std::process::ExitCode> {
    let r = Runs(runs);
    print_table(r, paths);
    print_verdicts(r, paths);
    println!(
        "({rounds} paired round(s) of {runtime} s per cell: medians, and the range of the per-round ratios in brackets; server workers {}, {} fio connection(s) at QD32; {} cores here; faults: 1 per 10,000 dispatches of the group, {RECOVERY_MS} ms each; processors held per recovery: the emulated recovery time the group's tasks held, per recovery, in units of {RECOVERY_MS} ms; paper, 8-way: dynamic 1.196x throughput, 18.7% lower mean latency)",
        if shape.workers == 0 {
            "one per core".to_owned()
        } else {
            shape.workers.to_string()
        },
        shape.connections,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if !args.common.quick {
        let csv = args.common.out.join("badpath.csv");
        write_csv(&csv, runs, paths)?;
        println!("per-round samples: {}", csv.display());
        let png = args.common.out.join("badpath.png");
        plot(&png, r, paths)?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The table: per policy and path, medians and the ratios to performance.
fn print_table(r: Runs<'_>, paths: &[Option<&str>]) {
    let mut table = Table::new(&[
        "policy",
        "path",
        "IOPS",
        "mean latency µs",
        "IOPS vs performance",
        "latency vs performance",
        "faults/s",
        "processors held per recovery",
    ]);
    for (p, policy) in POLICIES.iter().enumerate() {
        for (b, path) in paths.iter().enumerate() {
            let (vs_iops, vs_lat) = if p == 0 {
                ("1.000x".to_owned(), "+0.0%".to_owned())
            } else {
                (
                    ratio_cell(&r.iops_ratios(b), |x| format!("{x:.3}x")),
                    ratio_cell(&r.latency_changes(b), |x| format!("{:+.1}%", 100.0 * x)),
                )
            };
            let (faults, held) = match path {
                None => ("-".to_owned(), "-".to_owned()),
                Some(_) => (
                    format!("{:.1}", r.med(p, b, |s| s.faults_per_s)),
                    format!("{:.2}", r.med(p, b, |s| s.held_per_recovery)),
                ),
            };
            table.row(vec![
                (*policy).to_owned(),
                label(*path),
                thousands(r.med(p, b, |s| s.iops).round()),
                format!("{:.0}", r.med(p, b, |s| s.mean_us)),
                vs_iops,
                vs_lat,
                faults,
                held,
            ]);
        }
    }
    println!("{}", table.render());
}

/// Dynamic against performance per path, against the paper's targets and
/// the ceiling its model allows here.
fn print_verdicts(r: Runs<'_>, paths: &[Option<&str>]) {
    let good = median(r.iops_ratios(0));
    println!(
        "dynamic vs performance, good path: {good:.3}x (target: no worse than 0.98x: {})",
        if good >= 0.98 { "met" } else { "missed" },
    );
    for (b, path) in paths.iter().enumerate().skip(1) {
        let bad = median(r.iops_ratios(b));
        let lat = median(r.latency_changes(b));
        // The most dynamic can gain here: recoveries occupy a fraction x of
        // the time and hold W processors under performance, 1 under dynamic.
        let x = r.med(0, b, |s| s.faults_per_s) * RECOVERY_MS / 1000.0;
        let held = r.med(0, b, |s| s.held_per_recovery).max(1.0);
        println!(
            "ceiling by the paper's model, faults in {}: recoveries take {:.1}% of the time and hold {held:.2} processors under performance: at most {:.3}x for dynamic (target needs 1.16x: on a host with about 8 processors, as the paper's)",
            path.unwrap_or("?"),
            100.0 * x,
            (1.0 - x / held) / (1.0 - x).max(f64::EPSILON),
        );
        println!(
            "dynamic vs performance, faults in {}: throughput {bad:.3}x (target >= 1.16x: {}), mean latency {:+.1}% (target <= -20%: {})",
            path.unwrap_or("?"),
            if bad >= 1.16 { "met" } else { "missed" },
            100.0 * lat,
            if lat <= -0.20 { "met" } else { "missed" },
        );
    }
}

/// Throughput, mean latency and processors held per recovery, per path and
/// policy.
fn plot(png: &Path, r: Runs<'_>, paths: &[Option<&str>]) -> anyhow::Result<()> {
    // Paths from index `first` on (1: the bad paths only).
    let categories =
        |first: usize| -> Vec<String> { paths[first..].iter().map(|p| label(*p)).collect() };
    let series = |first: usize, f: fn(&Sample) -> f64| -> Vec<(String, Vec<f64>)> {
        POLICIES
            .iter()
            .enumerate()
            .map(|(p, n)| {
                (
                    (*n).to_owned(),
                    (first..paths.len()).map(|b| r.med(p, b, f)).collect(),
                )
            })
            .collect()
    };
    bar_chart_png(
        png,
        "controller under the scheduling paper's fault emulation (fio cache-standard)",
        &[
            BarPanel {
                title: "throughput".into(),
                y_label: "IOPS".into(),
                categories: categories(0),
                series: series(0, |s| s.iops),
            },
            BarPanel {
                title: "mean latency".into(),
                y_label: "µs".into(),
                categories: categories(0),
                series: series(0, |s| s.mean_us),
            },
            BarPanel {
                title: "processors held per recovery".into(),
                y_label: "× 20 ms per recovery".into(),
                categories: categories(1),
                series: series(1, |s| s.held_per_recovery),
            },
        ],
    )
}

/// Every run's sample, one line each, so rounds of several runs can be
/// pooled: `policy,path,round,iops,mean_us,faults_per_s,held_per_recovery`.
fn write_csv(csv: &Path, runs: &[Vec<Vec<Sample>>], paths: &[Option<&str>]) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let mut text = String::from("policy,path,round,iops,mean_us,faults_per_s,held_per_recovery\n");
    for (p, policy) in POLICIES.iter().enumerate() {
        for (b, path) in paths.iter().enumerate() {
            for (round, s) in runs[p][b].iter().enumerate() {
                let _ = writeln!(
                    text,
                    "{policy},{},{},{:.0},{:.1},{:.2},{:.3}",
                    path.unwrap_or("good"),
                    round + 1,
                    s.iops,
                    s.mean_us,
                    s.faults_per_s,
                    s.held_per_recovery
                );
            }
        }
    }
    std::fs::create_dir_all(csv.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(csv, text).with_context(|| format!("writing {}", csv.display()))
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![7.0]), 7.0);
    }
}
