//! `rebound bench output-commit`: what rung 3's output commit costs (paper:
//! revive-io-output-commit, its Figures on throughput against the
//! checkpoint interval), and how long a rollback takes.
//!
//! For each checkpoint interval T and each row (off, measured at every T
//! as the peer of the rows beside it; stall, buffering, logging, renaming
//! with commits when idle; buffering with fixed epochs, the paper's
//! policy), a fresh `rebound serve` runs two fio jobs over NBD: cache-standard
//! (random 4 KiB, 3 reads to 1 write) and 100% random writes, at three
//! loads: one connection with one request in flight (a synchronous
//! client: every epoch ends with the controller idle), one with 32 (the
//! shared fio job's depth) and 8 connections with 256 each. The table
//! gives IOPS, mean and p99 completion
//! latency, the ratio to `off`, the growth of mean write latency
//! against the T/2 + 1 ms budget, and the server's CPU time per I/O (all
//! threads, from `/proc`, over each job) beside off's: at saturation on a
//! host whose client shares the cores, what holding output costs in CPU
//! is what it costs in IOPS. Then, at the default T, rollbacks are
//! injected under the cache-standard load and their durations reported.
//!
//! With fixed epochs a closed-loop client with Q requests in flight cannot
//! go faster than about Q / T: its whole batch completes early in an epoch
//! and waits for the commit (32 / 20 ms = 1,600 IOPS). The paper's servers
//! had enough clients in flight to hide the delay, as the 8 x 256 load
//! does; commits when idle (the default) end the epoch as soon as the
//! batch is done.

use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use super::experiment_server;
use super::fio::{Fio, fio, fio_ramped};
use super::threadcpu;
use crate::report::{Table, line_chart_png, thousands};

/// Options of `rebound bench output-commit`.
#[derive(Debug, Args)]
pub struct OutputCommitArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Seconds of fio per job and cell [default: 3, or 2 with --quick].
    #[arg(long)]
    runtime: Option<u32>,
    /// fio requests in flight per connection [default: three loads,
    /// 1 x 1, 1 x 32 and 8 x 256; --quick: 1 x 32].
    #[arg(long)]
    iodepth: Option<u32>,
    /// fio jobs (NBD connections), each with --iodepth in flight (give
    /// both or neither).
    #[arg(long)]
    jobs: Option<u32>,
    /// Rollbacks injected per scheme at T = 20 ms [default: 20, or 5 with
    /// --quick; 0: no rollback table].
    #[arg(long)]
    rollbacks: Option<u32>,
    /// Checkpoint intervals T to measure, in ms, comma-separated
    /// [default: 5,10,20,40,80,160; --quick: 20].
    #[arg(long, value_delimiter = ',')]
    intervals: Option<Vec<u64>>,
    /// Rows to measure, comma-separated, from off, stall, buffering,
    /// logging, renaming, fixed (buffering with fixed epochs) [default:
    /// all; off is always measured, as every row's peer].
    #[arg(long, value_delimiter = ',')]
    schemes: Option<Vec<String>>,
    /// Rounds: every cell is measured once per round, the rounds
    /// interleaved, and the table gives each cell's median [default: 3
    /// at T = 20 ms, whose cells the verdicts read, and 1 at the other
    /// T; --quick: 1].
    #[arg(long)]
    rounds: Option<u32>,
    /// Seconds each fio job runs, unmeasured, before its measured part,
    /// in the same fio run (`ramp_time`, no pause between them): the
    /// volume written, the NVS and cache filled and destage in the steady
    /// state the load keeps. 0 (the default) measures a fresh server on
    /// a fresh volume, whose never-written tracks are read without a
    /// device read.
    #[arg(long, default_value_t = 0)]
    warmup: u32,
}

/// The rows: off, each scheme with commits when idle (the default), and
/// buffering with fixed epochs only (the paper's policy).
const SCHEMES: [&str; 6] = ["off", "stall", "buffering", "logging", "renaming", FIXED];
/// Buffering with `--commit-when-idle false`.
const FIXED: &str = "buffering, fixed epochs";
const INTERVALS_MS: [u64; 6] = [5, 10, 20, 40, 80, 160];

fn serve_flags(row: &str, t_ms: u64) -> Vec<String> {
    let (scheme, when_idle) = if row == FIXED {
        ("buffering", "false")
    } else {
        (row, "true")
    };
    vec![
        "--output-commit".into(),
        scheme.into(),
        "--checkpoint-interval".into(),
        format!("{t_ms}ms"),
        "--commit-when-idle".into(),
        when_idle.into(),
    ]
}

/// Parse a `Duration` as `{:.3?}` prints it.
fn parse_debug_duration(s: &str) -> Option<Duration> {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_alphabetic() || c == 'µ')?);
    let v: f64 = num.parse().ok()?;
    let secs = match unit {
        "ns" => v * 1e-9,
        "µs" => v * 1e-6,
        "ms" => v * 1e-3,
        "s" => v,
        _ => return None,
    };
    Some(Duration::from_secs_f64(secs))
}

/// One rollback's times and counts, as the server reported them.
#[derive(Debug, Clone, Copy)]
struct RollbackTimes {
    quiesce: Duration,
    restore: Duration,
    total: Duration,
    /// Held device writes dropped.
    dropped: u64,
    /// Destage writes whose device sync the rollback did not wait for.
    unsynced: u64,
}

/// The count written just before `phrase` in a rollback's answer
/// (`..., 7 held device writes dropped, ...`).
fn count_before(answer: &str, phrase: &str) -> Option<u64> {
    let (before, _) = answer.split_once(&format!(" {phrase}"))?;
    before.rsplit([' ', ',']).next()?.parse().ok()
}

fn field(answer: &str, name: &str) -> Option<Duration> {
    let rest = answer.split(&format!("{name} ")).nth(1)?;
    let value = rest.split([',', ' ', '\n']).next()?;
    parse_debug_duration(value.trim())
}

/// Rollbacks under fio cache-standard: their durations.
fn rollbacks(
    scheme: &str,
    count: u32,
    depth: (u32, u32),
    work: &std::path::Path,
    port: u16,
) -> anyhow::Result<Vec<RollbackTimes>> {
    let dir = tempfile::tempdir_in(work)?;
    let server = experiment_server(dir.path(), port)?
        .args(serve_flags(scheme, 20))
        .start()?;
    let runtime = (count / 2 + 2).max(2);
    let load = std::thread::spawn(move || fio(port, "cache-standard", runtime, depth));
    std::thread::sleep(Duration::from_millis(700));
    let mut out = Vec::new();
    for _ in 0..count {
        let answer = server.admin("inject rollback")?;
        let times = (|| {
            Some(RollbackTimes {
                quiesce: field(&answer, "quiesce")?,
                restore: field(&answer, "restore")?,
                total: field(&answer, "total")?,
                dropped: count_before(&answer, "held device writes dropped")?,
                unsynced: count_before(&answer, "destage writes left unsynced")?,
            })
        })()
        .with_context(|| format!("no times in {answer:?}"))?;
        out.push(times);
        std::thread::sleep(Duration::from_millis(400));
    }
    let fio = load.join().expect("fio thread")?;
    anyhow::ensure!(fio.iops > 0.0, "no I/O during the rollbacks");
    server.stop()?;
    Ok(out)
}

/// One load: connections x requests in flight per connection.
#[derive(Debug, Clone, Copy)]
struct Load {
    jobs: u32,
    iodepth: u32,
}

impl Load {
    fn name(self) -> String {
        format!("{}x{}", self.jobs, self.iodepth)
    }
}

type Cell<'a> = (&'a str, u64, [Fio; 2]);

/// The interval whose cells the verdicts read (the targets are
/// at T = 20 ms).
const VERDICT_T_MS: u64 = 20;
/// Rounds at [`VERDICT_T_MS`] by default: one 3 s cell from a fresh
/// server moves by 5 to 10 % between runs of the same binary on a shared
/// 2-core host, more than the 5 % a verdict reads.
const VERDICT_ROUNDS: u32 = 3;

/// What to measure: rows, intervals and rounds.
struct Plan<'a> {
    schemes: Vec<&'a str>,
    intervals: Vec<u64>,
    /// Rounds at every T.
    rounds: u32,
    /// Rounds at [`VERDICT_T_MS`] (at least `rounds`).
    verdict_rounds: u32,
    /// Seconds of unmeasured fio before each measured job.
    warmup: u32,
}

fn measure<'a>(
    load: Load,
    plan: &Plan<'a>,
    runtime: u32,
    work: &std::path::Path,
    port: u16,
) -> anyhow::Result<Vec<Cell<'a>>> {
    let depth = (load.iodepth, load.jobs);
    let mut runs: Vec<Cell<'a>> = Vec::new();
    // Off runs at every T too, next to the schemes it is compared with:
    // this host's throughput drifts by more than the effect measured.
    // Rounds are interleaved for the same reason.
    let rounds: u64 = plan
        .intervals
        .iter()
        .map(|&t| u64::from(plan.rounds_at(t)))
        .sum();
    let bar = crate::report::progress(plan.schemes.len() as u64 * rounds, "cells");
    let most = plan.intervals.iter().map(|&t| plan.rounds_at(t)).max();
    for round in 1..=most.unwrap_or(0) {
        for &t in plan
            .intervals
            .iter()
            .filter(|&&t| round <= plan.rounds_at(t))
        {
            for &scheme in &plan.schemes {
                bar.set_message(format!(
                    "load {}, round {round}/{}, {scheme}, T = {t} ms",
                    load.name(),
                    plan.rounds_at(t)
                ));
                let dir = tempfile::tempdir_in(work)?;
                let flags = if scheme == "off" {
                    Vec::new()
                } else {
                    serve_flags(scheme, t)
                };
                let server = experiment_server(dir.path(), port)?.args(flags).start()?;
                let pid = server.pid();
                let mixed = measured(pid, port, "cache-standard", plan.warmup, runtime, depth)?;
                let write = measured(pid, port, "write", plan.warmup, runtime, depth)?;
                server.stop()?;
                runs.push((scheme, t, [mixed, write]));
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    Ok(medians(&runs))
}

/// One fio job of a cell, after `warmup` seconds of it unmeasured (in the
/// same fio run: [`fio_ramped`]), with the server's CPU per I/O over the
/// measured part (its threads' ticks at the start and the end). The start
/// is taken `warmup` seconds after fio is started, so the CPU window
/// begins fio's start-up time (its connections: tens of milliseconds)
/// before the measured part, the same for every row.
fn measured(
    pid: u32,
    port: u16,
    job: &str,
    warmup: u32,
    runtime: u32,
    depth: (u32, u32),
) -> anyhow::Result<Fio> {
    std::thread::scope(|s| {
        let start = s.spawn(|| {
            std::thread::sleep(Duration::from_secs(warmup.into()));
            threadcpu::ticks(pid)
        });
        let run = fio_ramped(port, job, warmup, runtime, depth);
        let end = threadcpu::ticks(pid);
        let start = start
            .join()
            .expect("the CPU sampling thread does not panic")?;
        let mut run = run?;
        (run.server_cpu_us, run.server_roles_us) = threadcpu::split_per_io(&start, &end?, run.ios);
        Ok(run)
    })
}

/// One cell per (row, T): the median of its rounds, each figure on its own.
fn medians<'a>(runs: &[Cell<'a>]) -> Vec<Cell<'a>> {
    let mut cells: Vec<Cell<'a>> = Vec::new();
    for &(scheme, t, _) in runs {
        if cells.iter().any(|(s, ct, _)| *s == scheme && *ct == t) {
            continue;
        }
        let mine: Vec<[Fio; 2]> = runs
            .iter()
            .filter(|(s, ct, _)| *s == scheme && *ct == t)
            .map(|c| c.2)
            .collect();
        let job = |j: usize| Fio {
            iops: median(mine.iter().map(|r| r[j].iops)),
            mean_us: median(mine.iter().map(|r| r[j].mean_us)),
            p99_us: median(mine.iter().map(|r| r[j].p99_us)),
            ios: 0,
            server_cpu_us: median(mine.iter().map(|r| r[j].server_cpu_us)),
            server_roles_us: std::array::from_fn(|role| {
                median(mine.iter().map(|r| r[j].server_roles_us[role]))
            }),
            client_cpu_us: median(mine.iter().map(|r| r[j].client_cpu_us)),
        };
        cells.push((scheme, t, [job(0), job(1)]));
    }
    cells
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The `off` cell measured at `t`.
fn off_at(cells: &[Cell<'_>], t: u64) -> [Fio; 2] {
    cells
        .iter()
        .find(|(s, ct, _)| *s == "off" && *ct == t)
        .map(|c| c.2)
        .expect("off runs at every T")
}

fn report(load: Load, cells: &[Cell<'_>], runtime: u32, plan: &Plan<'_>) {
    let mut cells = cells.to_vec();
    // Rows by scheme, then T.
    cells.sort_by_key(|(s, t, _)| (SCHEMES.iter().position(|x| x == s), *t));
    let cells = cells;
    let mut table = Table::new(&[
        "scheme",
        "T ms",
        "mixed IOPS",
        "vs off",
        "mixed mean µs",
        "mixed p99 µs",
        "write IOPS",
        "vs off",
        "write mean µs",
        "write p99 µs",
        "write mean growth",
        "budget T/2+1ms",
        "mixed CPU µs/IO",
        "write CPU µs/IO",
        "fio CPU µs/IO mixed, write",
    ]);
    for (scheme, t, [m, w]) in &cells {
        let off = off_at(&cells, *t);
        let growth_ms = (w.mean_us - off[1].mean_us) / 1000.0;
        let budget_ms = *t as f64 / 2.0 + 1.0;
        let on = *scheme != "off";
        table.row(vec![
            (*scheme).to_owned(),
            t.to_string(),
            thousands(m.iops),
            format!("{:.3}x", m.iops / off[0].iops),
            format!("{:.0}", m.mean_us),
            format!("{:.0}", m.p99_us),
            thousands(w.iops),
            format!("{:.3}x", w.iops / off[1].iops),
            format!("{:.0}", w.mean_us),
            format!("{:.0}", w.p99_us),
            if on {
                format!("{growth_ms:+.2} ms")
            } else {
                "-".into()
            },
            if on {
                let verdict = if growth_ms <= budget_ms {
                    "met"
                } else {
                    "missed"
                };
                format!("{budget_ms:.1} ms {verdict}")
            } else {
                "-".into()
            },
            cpu_vs(m.server_cpu_us, off[0].server_cpu_us, on),
            cpu_vs(w.server_cpu_us, off[1].server_cpu_us, on),
            format!("{:.1}, {:.1}", m.client_cpu_us, w.client_cpu_us),
        ]);
    }
    let warmup = match plan.warmup {
        0 => "from a fresh server and volume".to_string(),
        w => format!("each after {w} s of the same job unmeasured, without a pause"),
    };
    println!(
        "load {}: fio over NBD, {} connection(s) x {} requests in flight, {runtime} s per job ({warmup}), {}",
        load.name(),
        load.jobs,
        load.iodepth,
        plan.rounds_text()
    );
    println!("{}", table.render());
    verdicts(&cells);
    println!(
        "the server's CPU per I/O by thread role, µs (from /proc; in parentheses the difference from off's at the same T):\n{}",
        roles_table(&cells).render()
    );
    println!(
        "  (a closed-loop client is bounded by requests in flight / (T/2 .. T + service time) once replies wait for commits: {} IOPS at T = 20 ms)\n",
        thousands(f64::from(load.jobs * load.iodepth) / 0.020)
    );
}

/// Where each cell's server CPU per I/O goes, by thread role
/// ([`threadcpu`]), for both jobs: which threads a scheme makes work
/// harder than off's.
fn roles_table(cells: &[Cell<'_>]) -> Table {
    let mut headers = vec!["scheme".to_owned(), "T ms".to_owned()];
    for job in ["mixed", "write"] {
        headers.push(format!("{job} µs/IO"));
        headers.extend(threadcpu::ROLES.iter().map(|r| format!("{job}: {r}")));
    }
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut table = Table::new(&headers);
    for (scheme, t, jobs) in cells {
        let off = off_at(cells, *t);
        let mut row = vec![(*scheme).to_owned(), t.to_string()];
        for (j, job) in jobs.iter().enumerate() {
            row.push(format!("{:.1}", job.server_cpu_us));
            for (role, us) in job.server_roles_us.iter().enumerate() {
                row.push(if *scheme == "off" {
                    format!("{us:.2}")
                } else {
                    format!("{us:.2} ({:+.2})", us - off[j].server_roles_us[role])
                });
            }
        }
        table.row(row);
    }
    table
}

/// Each held scheme's verdict at T = 20 ms against off, with the server's
/// and fio's CPU per I/O beside off's.
fn verdicts(cells: &[Cell<'_>]) {
    for scheme in ["buffering", "stall", "logging", "renaming", FIXED] {
        if let Some((_, _, [m, w])) = cells.iter().find(|(s, t, _)| *s == scheme && *t == 20) {
            let off = off_at(cells, 20);
            let worst = (m.iops / off[0].iops).min(w.iops / off[1].iops);
            println!(
                "  {scheme} at T = 20 ms: {worst:.3}x of off, worse job (target for buffering: >= 0.95x: {}); the server's CPU per I/O {:.2}x off's (mixed), {:.2}x (write); fio's {:.2}x, {:.2}x",
                if worst >= 0.95 { "met" } else { "missed" },
                m.server_cpu_us / off[0].server_cpu_us,
                w.server_cpu_us / off[1].server_cpu_us,
                m.client_cpu_us / off[0].client_cpu_us,
                w.client_cpu_us / off[1].client_cpu_us,
            );
        }
    }
}

/// A row's server CPU per I/O, and its ratio to off's beside it.
fn cpu_vs(cpu: f64, off: f64, on: bool) -> String {
    if on {
        format!("{cpu:.1} ({:.2}x)", cpu / off)
    } else {
        format!("{cpu:.1}")
    }
}

fn plots(out: &std::path::Path, load: Load, cells: &[Cell<'_>]) -> anyhow::Result<()> {
    let series = |job: usize, f: fn(&Fio) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        SCHEMES
            .iter()
            .map(|s| {
                let mut pts: Vec<(f64, f64)> = cells
                    .iter()
                    .filter(|(n, _, _)| n == s)
                    .map(|(_, t, r)| (*t as f64, f(&r[job])))
                    .collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                ((*s).to_owned(), pts)
            })
            .filter(|(_, pts)| !pts.is_empty())
            .collect()
    };
    let png = out.join(format!("output-commit-{}.png", load.name()));
    line_chart_png(
        &png,
        &format!(
            "output commit: fio cache-standard IOPS against T ({} connections x {} in flight)",
            load.jobs, load.iodepth
        ),
        "checkpoint interval T (ms)",
        "IOPS",
        &series(0, |r| r.iops),
    )?;
    let png2 = out.join(format!("output-commit-latency-{}.png", load.name()));
    line_chart_png(
        &png2,
        &format!(
            "output commit: mean 4 KiB random-write latency against T ({} x {})",
            load.jobs, load.iodepth
        ),
        "checkpoint interval T (ms)",
        "mean write latency (µs)",
        &series(1, |r| r.mean_us),
    )?;
    println!("plots: {} and {}", png.display(), png2.display());
    Ok(())
}

/// The rows, intervals and rounds the flags ask for.
fn plan(args: &OutputCommitArgs, quick: bool) -> anyhow::Result<Plan<'static>> {
    if let Some(rounds) = args.rounds {
        anyhow::ensure!(
            (1..=100).contains(&rounds),
            "--rounds must be within 1..=100"
        );
    }
    let intervals = args.intervals.clone().unwrap_or_else(|| {
        if quick {
            vec![20]
        } else {
            INTERVALS_MS.to_vec()
        }
    });
    for &t in &intervals {
        anyhow::ensure!(
            (1..=10_000).contains(&t),
            "--intervals: {t} ms is outside 1..=10000"
        );
    }
    let mut schemes = vec![SCHEMES[0]];
    match &args.schemes {
        None => schemes = SCHEMES.to_vec(),
        Some(names) => {
            for name in names {
                let row = match name.as_str() {
                    "fixed" => FIXED,
                    other => *SCHEMES[..5].iter().find(|s| **s == other).ok_or_else(|| {
                        anyhow::anyhow!(
                            "--schemes: unknown row {other:?} (off, stall, buffering, logging, renaming, fixed)"
                        )
                    })?,
                };
                if !schemes.contains(&row) {
                    schemes.push(row);
                }
            }
        }
    }
    anyhow::ensure!(
        args.warmup <= 3600,
        "--warmup must be within 0..=3600 seconds"
    );
    let (rounds, verdict_rounds) = match args.rounds {
        Some(n) => (n, n),
        None if quick => (1, 1),
        None => (1, VERDICT_ROUNDS),
    };
    Ok(Plan {
        schemes,
        intervals,
        rounds,
        verdict_rounds,
        warmup: args.warmup,
    })
}

impl Plan<'_> {
    /// Rounds of the cells at `t`.
    fn rounds_at(&self, t: u64) -> u32 {
        if t == VERDICT_T_MS {
            self.verdict_rounds
        } else {
            self.rounds
        }
    }

    /// How a load's table was measured, for its heading.
    fn rounds_text(&self) -> String {
        let mut counts = self.intervals.iter().map(|&t| self.rounds_at(t));
        let first = counts.next().unwrap_or(self.rounds);
        if counts.all(|n| n == first) {
            format!("median of {first} interleaved round(s)")
        } else {
            format!(
                "median of {} interleaved rounds at T = {VERDICT_T_MS} ms (the verdicts'), {} at the other T",
                self.verdict_rounds, self.rounds
            )
        }
    }
}

/// Run the experiment.
pub fn run(args: OutputCommitArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let runtime = args.runtime.unwrap_or(if quick { 2 } else { 3 });
    let rollback_count = args.rollbacks.unwrap_or(if quick { 5 } else { 20 });
    anyhow::ensure!(
        (1..=3600).contains(&runtime),
        "--runtime must be within 1..=3600"
    );
    anyhow::ensure!(
        (0..=1000).contains(&rollback_count),
        "--rollbacks must be within 0..=1000"
    );
    let plan = plan(&args, quick)?;
    let loads: Vec<Load> = match (args.jobs, args.iodepth) {
        (Some(jobs), Some(iodepth)) => vec![Load { jobs, iodepth }],
        (None, None) if quick => vec![Load {
            jobs: 1,
            iodepth: 32,
        }],
        (None, None) => vec![
            Load {
                jobs: 1,
                iodepth: 1,
            },
            Load {
                jobs: 1,
                iodepth: 32,
            },
            Load {
                jobs: 8,
                iodepth: 256,
            },
        ],
        _ => anyhow::bail!("give both --jobs and --iodepth, or neither"),
    };
    for l in &loads {
        anyhow::ensure!((1..=64).contains(&l.jobs), "--jobs must be within 1..=64");
        anyhow::ensure!(
            (1..=256).contains(&l.iodepth),
            "--iodepth must be within 1..=256 (the server's requests in flight per connection)"
        );
    }
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    for &load in &loads {
        let cells = measure(load, &plan, runtime, work.path(), port)?;
        report(load, &cells, runtime, &plan);
        if !quick && plan.intervals.len() > 1 {
            plots(&args.common.out, load, &cells)?;
        }
    }

    if rollback_count > 0 {
        let load = *loads.last().expect("at least one load");
        rollback_table(load, rollback_count, work.path(), port)?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The mean of a count over rollbacks.
fn mean_count(d: &[RollbackTimes], f: fn(&RollbackTimes) -> u64) -> f64 {
    d.iter().map(f).sum::<u64>() as f64 / d.len().max(1) as f64
}

/// Rollbacks per scheme under `load`: their durations against the target.
fn rollback_table(load: Load, count: u32, work: &std::path::Path, port: u16) -> anyhow::Result<()> {
    let mut rb = Table::new(&[
        "scheme",
        "rollbacks",
        "quiesce mean ms",
        "restore mean ms",
        "total mean ms",
        "total max ms",
        "target < 50 ms",
        "held writes dropped, mean",
        "left unsynced, mean",
    ]);
    for scheme in &SCHEMES[1..5] {
        let d = rollbacks(scheme, count, (load.iodepth, load.jobs), work, port)?;
        let mean = |f: fn(&RollbackTimes) -> Duration| {
            d.iter().map(|t| f(t).as_secs_f64() * 1000.0).sum::<f64>() / d.len() as f64
        };
        let max = d
            .iter()
            .map(|t| t.total.as_secs_f64() * 1000.0)
            .fold(0.0, f64::max);
        rb.row(vec![
            (*scheme).to_owned(),
            d.len().to_string(),
            format!("{:.2}", mean(|t| t.quiesce)),
            format!("{:.2}", mean(|t| t.restore)),
            format!("{:.2}", mean(|t| t.total)),
            format!("{max:.2}"),
            if max < 50.0 { "met" } else { "missed" }.to_owned(),
            format!("{:.0}", mean_count(&d, |t| t.dropped)),
            format!("{:.0}", mean_count(&d, |t| t.unsynced)),
        ]);
    }
    println!(
        "rollback (rung 3) under fio cache-standard, load {}, T = 20 ms (quiesce + restore + re-run submitted):\n{}",
        load.name(),
        rb.render()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: OutputCommitArgs,
    }

    fn plan_of(flags: &[&str]) -> anyhow::Result<(u32, u32, u32)> {
        let cli = Cli::try_parse_from(std::iter::once("oc").chain(flags.iter().copied()))?;
        let plan = plan(&cli.args, cli.args.common.quick)?;
        Ok((plan.rounds_at(5), plan.rounds_at(20), plan.rounds_at(160)))
    }

    #[test]
    fn the_verdicts_interval_gets_three_rounds_by_default_and_rounds_overrides_every_interval() {
        assert_eq!(plan_of(&[]).unwrap(), (1, 3, 1));
        assert_eq!(plan_of(&["--quick"]).unwrap(), (1, 1, 1));
        assert_eq!(plan_of(&["--rounds", "2"]).unwrap(), (2, 2, 2));
        assert_eq!(plan_of(&["--quick", "--rounds", "5"]).unwrap(), (5, 5, 5));
        let err = plan_of(&["--rounds", "0"]).unwrap_err().to_string();
        assert!(err.contains("--rounds must be within 1..=100"), "{err}");
    }

    #[test]
    fn the_heading_names_the_rounds_each_interval_had() {
        let heading = |flags: &[&str]| {
            let cli =
                Cli::try_parse_from(std::iter::once("oc").chain(flags.iter().copied())).unwrap();
            plan(&cli.args, false).unwrap().rounds_text()
        };
        assert_eq!(
            heading(&[]),
            "median of 3 interleaved rounds at T = 20 ms (the verdicts'), 1 at the other T"
        );
        assert_eq!(
            heading(&["--intervals", "20"]),
            "median of 3 interleaved round(s)"
        );
        assert_eq!(
            heading(&["--intervals", "5,10"]),
            "median of 1 interleaved round(s)"
        );
        assert_eq!(
            heading(&["--rounds", "4"]),
            "median of 4 interleaved round(s)"
        );
    }

    #[test]
    fn a_rollback_answer_gives_its_times_and_counts() {
        let answer = "rung 3 rollback (inject): epoch 10 rolled back, 0 directory entries restored, 7 held device writes dropped, 1 destage writes left unsynced, 0 requests run again; quiesce 150.666ms (commit 150.601ms, gate 3.581µs, drain 60.586µs), restore 1.461ms, total 152.194ms";
        assert_eq!(count_before(answer, "held device writes dropped"), Some(7));
        assert_eq!(
            count_before(answer, "destage writes left unsynced"),
            Some(1)
        );
        assert_eq!(count_before(answer, "requests run again"), Some(0));
        assert_eq!(count_before(answer, "tracks lost"), None);
        assert_eq!(field(answer, "restore"), Some(Duration::from_micros(1461)));
        assert_eq!(field(answer, "total").map(|d| d.as_micros()), Some(152_194));
    }
}
