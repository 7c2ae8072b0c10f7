//! `rebound sim rcs`: recovery-conscious scheduling at 2 to 1024 processors
//! by deterministic discrete-event simulation of the real scheduler code
//! (`rcs::sim`), for the processor counts this host does not have.
//!
//! Each run is one policy on one path (good: no faults; bad: the paper's
//! fault model, §6.3.3) at one processor count. Lists (`--cpus 2,8,64`)
//! run every combination. `--sweep` runs the four standard sweeps and
//! writes their tables, CSVs and plots under `--out`: throughput and
//! latency against processors (2 to 1024), the paper's Figure 10
//! (dispatches with 1, 4 and 16 groups), the fault rate, and the recovery
//! time.
//!
//! The default workload is a task trace recorded from `rebound serve`
//! under fio's cache-standard job (`bench/traces/cache-standard.trace`,
//! built into the binary; re-record with `rebound serve --trace-tasks
//! FILE`, see README). `--workload figure9` is the paper's 16-group skew of
//! `rebound bench rcs` instead.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use rcs::Policy;
use rcs::sim::{Clients, FaultModel, SimConfig, SimReport, Workload, simulate};
use rcs::trace::TaskTrace;

use crate::report::{Table, progress, thousands};

/// The controller trace built into the binary.
const CONTROLLER_TRACE: &str = include_str!("../../../bench/traces/cache-standard.trace");

/// Arguments of `rebound sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// Recovery-conscious scheduling on N virtual processors: throughput and latency per policy, good and bad path.
    Rcs(RcsSimArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Csv,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClientsKind {
    Roaming,
    Bound,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WorkloadKind {
    /// The task trace of the real controller under fio cache-standard.
    Controller,
    /// The paper's Figure 9 skew over 16 groups, fixed-length tasks.
    Figure9,
}

/// Options of `rebound sim rcs`.
#[derive(Debug, Args)]
pub struct RcsSimArgs {
    /// Virtual processors (comma-separated list: one run per value).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    cpus: Vec<usize>,
    /// Policies: performance, static, partial, dynamic, or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policy: Vec<String>,
    /// Recovery groups: the workload's groups collapsed into this many
    /// (comma-separated list) [default: all of the workload's].
    #[arg(long, value_delimiter = ',')]
    groups: Vec<usize>,
    /// Fault probability per dispatch of the faulty group on the bad path
    /// (comma-separated list; 0 runs the good path only).
    #[arg(long, value_delimiter = ',', default_value = "1e-4")]
    fault_rate: Vec<f64>,
    /// Emulated recovery time per fault (comma-separated list).
    #[arg(long, value_delimiter = ',', default_value = "20ms", value_parser = controller::units::parse_duration)]
    recovery: Vec<Duration>,
    /// Which path: good, bad or both.
    #[arg(long, default_value = "both", value_parser = ["good", "bad", "both"])]
    path: String,
    /// Simulated time measured per run (after a warm-up of a tenth of it,
    /// 100 ms to 10 s) [default: 60 s up to 8 processors, 480/N s above
    /// them (at least 1 s), 2 s with --quick].
    #[arg(long, value_parser = controller::units::parse_duration)]
    duration: Option<Duration>,
    /// Seed of every random choice (same seed, same output).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A task trace to replay instead of the built-in controller trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// The built-in workload when no --trace is given.
    #[arg(long, value_enum, default_value = "controller")]
    workload: WorkloadKind,
    /// Task length of --workload figure9, microseconds, or `paper`: the
    /// length at which the performance-oriented policy's bad path keeps the
    /// paper's 87.8 of 107 KIOps of its good path (Figures 11 and 14) on the
    /// paper's 8 processors, found by search and printed.
    /// [default: 3]
    #[arg(long, value_parser = parse_task_us)]
    task_us: Option<TaskUs>,
    /// The group that takes the faults [default: the workload's
    /// second-busiest, as the paper's group 5].
    #[arg(long)]
    fault_group: Option<String>,
    /// Closed-loop clients per processor.
    #[arg(long, default_value_t = 32)]
    clients_per_cpu: usize,
    /// How a client picks its next task's group: roaming (drawn by weight,
    /// as a request visits the controller's groups) or bound (its own
    /// group, as `rebound bench rcs`) [default: roaming for a trace,
    /// bound for figure9].
    #[arg(long, value_enum)]
    clients: Option<ClientsKind>,
    /// Processor time per dispatch outside the task, nanoseconds
    /// (calibrated on this host against `rebound bench rcs`; see README).
    #[arg(long, default_value_t = DISPATCH_NS)]
    dispatch_ns: u64,
    /// Time for an idle processor to wake, nanoseconds (calibrated as
    /// --dispatch-ns).
    #[arg(long, default_value_t = WAKE_NS)]
    wake_ns: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Run the standard sweeps (processors 2 to 1024, Figure 10, fault
    /// rate, recovery time) and write tables, CSVs and plots under --out.
    #[arg(long)]
    sweep: bool,
    /// Short runs (2 s simulated), for smoke checks.
    #[arg(long)]
    quick: bool,
    /// Directory for the sweeps' CSVs and plots.
    #[arg(long, default_value = "bench/out")]
    out: PathBuf,
}

/// `--task-us`: a fixed task length, or the one calibrated to the paper.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TaskUs {
    Fixed(f64),
    Paper,
}

fn parse_task_us(s: &str) -> Result<TaskUs, String> {
    if s == "paper" {
        return Ok(TaskUs::Paper);
    }
    let us: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is neither a number of microseconds nor `paper`"))?;
    if us.is_finite() && (0.001..=1e6).contains(&us) {
        Ok(TaskUs::Fixed(us))
    } else {
        Err(format!("{s}: must be within 0.001..=1000000"))
    }
}

/// The paper's bad-path throughput of the performance-oriented scheduler
/// against its good path (§6.3: 87.8 KIOps with faults in group 5, 107
/// KIOps without, 8-way controller). It is the one measured number that
/// pins down how much of the machine the faults take (how often a 20 ms
/// recovery is under way), which the text leaves to the task length.
const PAPER_PERFORMANCE_BAD_OVER_GOOD: f64 = 87.8 / 107.0;

/// Dispatch overhead calibrated on the 2-core development host: see
/// `docs/simulation.md`.
const DISPATCH_NS: u64 = 700;
/// Wake-up latency calibrated likewise.
const WAKE_NS: u64 = 5_000;

/// The columns of `--format csv`.
const CSV_HEADER: &str = "policy,path,cpus,groups,tasks_per_s,mean_latency_us,p99_latency_us";

/// One run to simulate.
#[derive(Debug, Clone)]
struct Run {
    policy: Policy,
    bad: bool,
    cpus: usize,
    groups: usize,
    fault_rate: f64,
    recovery: Duration,
}

/// A run and what it measured.
#[derive(Debug, Clone)]
struct Outcome {
    run: Run,
    report: SimReport,
    wall: Duration,
}

/// Run `rebound sim ...`.
pub fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    match args.which {
        Which::Rcs(a) => rcs_sim(&a),
    }
}

fn policies(names: &[String]) -> anyhow::Result<Vec<Policy>> {
    let mut out = Vec::new();
    for name in names {
        let named = if name == "all" {
            Policy::ALL.to_vec()
        } else {
            vec![name.parse::<Policy>().map_err(anyhow::Error::msg)?]
        };
        for p in named {
            if !out.contains(&p) {
                out.push(p);
            }
        }
    }
    anyhow::ensure!(!out.is_empty(), "--policy names no policy");
    Ok(out)
}

fn load_workload(args: &RcsSimArgs) -> anyhow::Result<Workload> {
    anyhow::ensure!(
        args.task_us.is_none() || (args.trace.is_none() && args.workload == WorkloadKind::Figure9),
        "--task-us applies only to --workload figure9 (a trace brings its own service times)"
    );
    let mut w = if let Some(path) = &args.trace {
        let file = std::fs::File::open(path)
            .with_context(|| format!("opening the trace {}", path.display()))?;
        let trace = TaskTrace::read_csv(std::io::BufReader::new(file))
            .with_context(|| format!("reading the trace {}", path.display()))?;
        Workload::from_trace(&trace, path.display().to_string())
    } else {
        match args.workload {
            WorkloadKind::Controller => {
                let trace = TaskTrace::read_csv(CONTROLLER_TRACE.as_bytes())
                    .context("the built-in controller trace")?;
                Workload::from_trace(
                    &trace,
                    "controller under fio cache-standard (built-in trace)",
                )
            }
            WorkloadKind::Figure9 => {
                let us = match args.task_us {
                    None => 3.0,
                    Some(TaskUs::Fixed(us)) => us,
                    Some(TaskUs::Paper) => calibrate_to_paper(args)?,
                };
                Workload::figure9(Duration::from_secs_f64(us / 1e6))
            }
        }
    };
    if let Some(name) = &args.fault_group {
        w.faulty = w
            .groups
            .iter()
            .position(|g| &g.name == name)
            .with_context(|| {
                let names: Vec<&str> = w.groups.iter().map(|g| g.name.as_str()).collect();
                format!(
                    "--fault-group {name:?} is not a group of the workload ({})",
                    names.join(", ")
                )
            })?;
    }
    Ok(w)
}

/// `--task-us paper`: the task length at which the paper's fault model
/// (group 5, 1 in 10,000 dispatches, 20 ms) costs the performance-oriented
/// policy what it cost in the paper, `PAPER_PERFORMANCE_BAD_OVER_GOOD` of
/// its good-path throughput, on the paper's 8 processors with all 16 groups
/// and the run's clients (whatever `--cpus` and `--groups` the runs then
/// use: the operating point is the paper's 8-way one). Each try simulates
/// the run's duration, at most 60 s.
///
/// The loss is close to inversely proportional to the task length (faults
/// come per dispatch and each recovery lasts the same), so the length is
/// rescaled by measured loss over wanted loss until the ratio is within
/// 0.002 of the paper's; the closest of at most eight tries is kept,
/// rounded to 0.01 us so that passing it as a number reproduces the runs.
fn calibrate_to_paper(args: &RcsSimArgs) -> anyhow::Result<f64> {
    const TRIES: usize = 8;
    const CPUS: usize = 8;
    const CLOSE_ENOUGH: f64 = 0.002;
    let want_loss = 1.0 - PAPER_PERFORMANCE_BAD_OVER_GOOD;
    let miss = |r: f64| (r - PAPER_PERFORMANCE_BAD_OVER_GOOD).abs();
    let bar = progress(TRIES as u64, "calibrating --task-us paper");
    let mut us: f64 = 40.0;
    let mut best: Option<(f64, f64)> = None;
    for _ in 0..TRIES {
        us = (us * 100.0).round() / 100.0;
        let workload = Workload::figure9(Duration::from_secs_f64(us / 1e6));
        let [good, bad] = [false, true].map(|bad| Run {
            policy: Policy::Performance,
            bad,
            cpus: CPUS,
            groups: workload.groups.len(),
            fault_rate: 1e-4,
            recovery: Duration::from_millis(20),
        });
        let cfg = |run: &Run| {
            let mut cfg = config(args, &workload, run);
            cfg.duration = cfg.duration.min(Duration::from_secs(60));
            cfg
        };
        let (good, bad) = std::thread::scope(|s| {
            let g = s.spawn(|| simulate(&cfg(&good)));
            let b = simulate(&cfg(&bad));
            (g.join().expect("a simulation thread panicked"), b)
        });
        bar.inc(1);
        let ratio = bad.tasks_per_s / good.tasks_per_s;
        if !ratio.is_finite() {
            // Nothing completed on the good path: too short a run. Longer
            // tasks only make that worse, so stop here.
            break;
        }
        if best.is_none_or(|(_, r)| miss(ratio) < miss(r)) {
            best = Some((us, ratio));
        }
        if miss(ratio) < CLOSE_ENOUGH {
            break;
        }
        let loss = (1.0 - ratio).max(1e-3);
        us = (us * loss / want_loss)
            .clamp(us / 4.0, us * 4.0)
            .clamp(0.01, 1e6);
    }
    bar.finish_and_clear();
    let (us, ratio) = best.context(
        "--task-us paper: the calibration runs completed no task; give a longer --duration",
    )?;
    let short = if miss(ratio) < CLOSE_ENOUGH {
        String::new()
    } else {
        format!(
            " (not within {CLOSE_ENOUGH} after {TRIES} tries: a longer --duration gives steadier runs)"
        )
    };
    let line = format!(
        "--task-us paper: {us:.2} us, at which performance keeps {ratio:.3} of its good-path throughput on the bad path at {CPUS} cpus (paper: 87.8 of 107 KIOps, {PAPER_PERFORMANCE_BAD_OVER_GOOD:.3}){short}"
    );
    if args.format == Format::Csv {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    Ok(us)
}

/// The flags that do not depend on the workload, checked before anything
/// is simulated (`--task-us paper` simulates while loading it).
fn validate_flags(args: &RcsSimArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.cpus.is_empty(), "--cpus names no processor count");
    for &c in &args.cpus {
        anyhow::ensure!(
            (1..=4096).contains(&c),
            "--cpus values must be within 1..=4096, not {c}"
        );
    }
    for &r in &args.fault_rate {
        anyhow::ensure!(
            (0.0..=1.0).contains(&r),
            "--fault-rate values must be within 0..=1, not {r}"
        );
    }
    for r in &args.recovery {
        anyhow::ensure!(!r.is_zero(), "--recovery must be more than 0");
    }
    if let Some(d) = args.duration {
        anyhow::ensure!(
            d >= Duration::from_millis(10) && d <= Duration::from_secs(24 * 3600),
            "--duration must be within 10ms..=24h"
        );
    }
    anyhow::ensure!(
        (1..=4096).contains(&args.clients_per_cpu),
        "--clients-per-cpu must be within 1..=4096"
    );
    anyhow::ensure!(
        !(args.task_us == Some(TaskUs::Paper) && args.fault_group.is_some()),
        "--task-us paper calibrates on the paper's faulty group (g5); it cannot be combined with --fault-group"
    );
    Ok(())
}

/// The flags checked against the workload.
fn validate(args: &RcsSimArgs, workload: &Workload) -> anyhow::Result<()> {
    for &g in &args.groups {
        anyhow::ensure!(
            (1..=workload.groups.len()).contains(&g),
            "--groups {g}: the workload has {} groups (collapse to 1..={})",
            workload.groups.len(),
            workload.groups.len()
        );
    }
    Ok(())
}

fn rcs_sim(args: &RcsSimArgs) -> anyhow::Result<ExitCode> {
    validate_flags(args)?;
    let workload = load_workload(args)?;
    validate(args, &workload)?;
    if args.sweep {
        return sweeps(args, &workload);
    }
    let policies = policies(&args.policy)?;
    let groups = if args.groups.is_empty() {
        vec![workload.groups.len()]
    } else {
        args.groups.clone()
    };
    let mut runs = Vec::new();
    for &cpus in &args.cpus {
        for &g in &groups {
            for &rate in &args.fault_rate {
                for &recovery in &args.recovery {
                    for bad in paths(&args.path, rate) {
                        for &policy in &policies {
                            runs.push(Run {
                                policy,
                                bad,
                                cpus,
                                groups: g,
                                fault_rate: rate,
                                recovery,
                            });
                        }
                    }
                }
            }
        }
    }
    let outcomes = simulate_all(args, &workload, &runs)?;
    match args.format {
        Format::Csv => print!("{}", csv(&outcomes)),
        Format::Table => {
            println!("{}", describe(args, &workload));
            println!("{}", table(&outcomes).render());
            println!("{}", speed(&outcomes));
            for line in verdicts(&outcomes) {
                println!("{line}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn clients_kind(args: &RcsSimArgs) -> ClientsKind {
    args.clients.unwrap_or(
        if args.trace.is_none() && args.workload == WorkloadKind::Figure9 {
            ClientsKind::Bound
        } else {
            ClientsKind::Roaming
        },
    )
}

fn paths(path: &str, rate: f64) -> Vec<bool> {
    match path {
        "good" => vec![false],
        "bad" if rate > 0.0 => vec![true],
        "bad" => vec![],
        _ if rate > 0.0 => vec![false, true],
        _ => vec![false],
    }
}

fn config(args: &RcsSimArgs, workload: &Workload, run: &Run) -> SimConfig {
    let w = workload.collapse(run.groups);
    // The same number of dispatches per run above 8 processors: 480/N s.
    let duration = args.duration.unwrap_or(if args.quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs_f64((480.0 / run.cpus.max(8) as f64).max(1.0))
    });
    let faulty = w.faulty;
    let mut cfg = SimConfig::new(run.cpus, run.policy, w);
    cfg.duration = duration;
    // Long enough for many recoveries to reach their steady state; a
    // tenth of a 30-minute run would add 3 simulated minutes for nothing.
    cfg.warmup = (duration / 10).clamp(Duration::from_millis(100), Duration::from_secs(10));
    cfg.seed = args.seed;
    cfg.clients_per_cpu = args.clients_per_cpu;
    cfg.clients = match clients_kind(args) {
        ClientsKind::Roaming => Clients::Roaming,
        ClientsKind::Bound => Clients::Bound,
    };
    cfg.dispatch_ns = args.dispatch_ns;
    cfg.wake_ns = args.wake_ns;
    cfg.fault = run.bad.then_some(FaultModel {
        group: faulty,
        rate: run.fault_rate,
        recovery: run.recovery,
    });
    cfg
}

/// Simulate every run, on as many threads as the host has cores (each run
/// is single-threaded and deterministic, so the order does not matter).
fn simulate_all(
    args: &RcsSimArgs,
    workload: &Workload,
    runs: &[Run],
) -> anyhow::Result<Vec<Outcome>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(runs.len().max(1));
    let bar = progress(runs.len() as u64, "simulating");
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = parking_lot::Mutex::new(vec![None; runs.len()]);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(run) = runs.get(i) else { break };
                    let cfg = config(args, workload, run);
                    let started = Instant::now();
                    let report = simulate(&cfg);
                    let outcome = Outcome {
                        run: run.clone(),
                        report,
                        wall: started.elapsed(),
                    };
                    results.lock()[i] = Some(outcome);
                    bar.inc(1);
                }
            });
        }
    });
    bar.finish_and_clear();
    let outcomes: Vec<Outcome> = results.into_inner().into_iter().flatten().collect();
    for o in &outcomes {
        let inv = &o.report.invariants;
        anyhow::ensure!(
            *inv == rcs::sim::Invariants::default(),
            "the simulation broke an invariant ({} {} at {} cpus): {inv:?}",
            o.run.policy,
            path_name(o.run.bad),
            o.run.cpus
        );
    }
    Ok(outcomes)
}

fn path_name(bad: bool) -> &'static str {
    if bad { "bad" } else { "good" }
}

fn describe(args: &RcsSimArgs, w: &Workload) -> String {
    let names: Vec<String> = w
        .groups
        .iter()
        .map(|g| format!("{} {:.1}us", g.name, g.mean_service_ns() / 1e3))
        .collect();
    format!(
        "workload: {} ({} groups: {}; faulty group {}); {} {:?} clients per processor; dispatch {} ns, wake {} ns; seed {}",
        w.source,
        w.groups.len(),
        names.join(", "),
        w.groups[w.faulty].name,
        args.clients_per_cpu,
        clients_kind(args),
        args.dispatch_ns,
        args.wake_ns,
        args.seed
    )
}

/// The matching performance-oriented run of `o` (same path, processors,
/// groups and faults).
fn baseline<'a>(all: &'a [Outcome], o: &Outcome) -> Option<&'a Outcome> {
    all.iter().find(|b| {
        b.run.policy == Policy::Performance
            && b.run.bad == o.run.bad
            && b.run.cpus == o.run.cpus
            && b.run.groups == o.run.groups
            && b.run.fault_rate == o.run.fault_rate
            && b.run.recovery == o.run.recovery
    })
}

fn table(outcomes: &[Outcome]) -> Table {
    let mut t = Table::new(&[
        "policy",
        "path",
        "cpus",
        "groups",
        "fault rate",
        "recovery",
        "tasks/s",
        "mean us",
        "p99 us",
        "vs performance",
        "held/recovery",
        "util",
    ]);
    for o in outcomes {
        let r = &o.report;
        let vs = baseline(outcomes, o).map_or_else(String::new, |b| {
            format!(
                "{:.3}x, {:+.1}% lat",
                r.tasks_per_s / b.report.tasks_per_s,
                (r.mean_latency_us / b.report.mean_latency_us - 1.0) * 100.0
            )
        });
        t.row(vec![
            o.run.policy.to_string(),
            path_name(o.run.bad).to_owned(),
            o.run.cpus.to_string(),
            o.run.groups.to_string(),
            if o.run.bad {
                format!("{:e}", o.run.fault_rate)
            } else {
                "-".into()
            },
            if o.run.bad {
                format!("{:?}", o.run.recovery)
            } else {
                "-".into()
            },
            thousands(r.tasks_per_s.round()),
            format!("{:.1}", r.mean_latency_us),
            format!("{:.1}", r.p99_latency_us),
            vs,
            if o.run.bad {
                format!("{:.2}", r.held_per_recovery)
            } else {
                "-".into()
            },
            format!("{:.0}%", r.utilization * 100.0),
        ]);
    }
    t
}

fn csv(outcomes: &[Outcome]) -> String {
    let mut s = format!("{CSV_HEADER}\n");
    for o in outcomes {
        let r = &o.report;
        s.push_str(&format!(
            "{},{},{},{},{:.1},{:.2},{:.2}\n",
            o.run.policy,
            path_name(o.run.bad),
            o.run.cpus,
            o.run.groups,
            r.tasks_per_s,
            r.mean_latency_us,
            r.p99_latency_us
        ));
    }
    s
}

fn speed(outcomes: &[Outcome]) -> String {
    let dispatches: u64 = outcomes.iter().map(|o| o.report.dispatches_total).sum();
    let wall: f64 = outcomes.iter().map(|o| o.wall.as_secs_f64()).sum();
    format!(
        "simulator speed: {} dispatches per real second per thread ({} dispatches in {:.1} s of run time)",
        thousands((dispatches as f64 / wall.max(1e-9)).round()),
        thousands(dispatches as f64),
        wall
    )
}

/// The paper's targets where the runs allow checking them.
fn verdicts(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    for o in outcomes.iter().filter(|o| o.run.policy == Policy::Dynamic) {
        let Some(b) = baseline(outcomes, o) else {
            continue;
        };
        let x = o.report.tasks_per_s / b.report.tasks_per_s;
        let lat = o.report.mean_latency_us / b.report.mean_latency_us - 1.0;
        let line = if o.run.bad {
            // The paper's own terms (§6.3.3): performance's 87.8 KIOps is
            // 16.3% below dynamic's 105 (dynamic 1.196x), and its 16.6 ms
            // mean response time 22.9% above dynamic's 13.5 ms (dynamic
            // -18.7%). The targets: at least 1.16x and -20%.
            let over = b.report.mean_latency_us / o.report.mean_latency_us - 1.0;
            format!(
                "{} cpus, bad path: dynamic vs performance throughput {x:.3}x (target >= 1.16x: {}; paper 1.196x), mean latency {:+.1}% (target <= -20%: {}; paper -18.7%), i.e. performance's mean latency {:+.1}% over dynamic's (paper +22.9%)",
                o.run.cpus,
                if x >= 1.16 { "met" } else { "missed" },
                lat * 100.0,
                if lat <= -0.20 { "met" } else { "missed" },
                over * 100.0
            )
        } else {
            format!(
                "{} cpus, good path: dynamic vs performance throughput {x:.3}x (paper: within 2%: {})",
                o.run.cpus,
                if (x - 1.0).abs() <= 0.02 {
                    "met"
                } else {
                    "missed"
                }
            )
        };
        lines.push(line);
    }
    lines
}

/// `--sweep`: the four standard sweeps, each a table, a CSV and a plot.
fn sweeps(args: &RcsSimArgs, workload: &Workload) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    sweep_cpus(args, workload)?;
    sweep_groups(args, workload)?;
    sweep_faults(args, workload)?;
    Ok(ExitCode::SUCCESS)
}

/// The sweeps' reference point: dynamic, bad path, 8 processors, every
/// group, the paper's fault model.
fn reference(workload: &Workload) -> Run {
    Run {
        policy: Policy::Dynamic,
        bad: true,
        cpus: 8,
        groups: workload.groups.len(),
        fault_rate: 1e-4,
        recovery: Duration::from_millis(20),
    }
}

/// Throughput and latency against processors, every policy, both paths.
fn sweep_cpus(args: &RcsSimArgs, workload: &Workload) -> anyhow::Result<()> {
    let cpus: Vec<usize> = if args.quick {
        vec![2, 8, 64]
    } else {
        (1..=10).map(|i| 1usize << i).collect()
    };
    let mut runs = Vec::new();
    for &c in &cpus {
        for bad in [false, true] {
            for policy in Policy::ALL {
                runs.push(Run {
                    cpus: c,
                    bad,
                    policy,
                    ..reference(workload)
                });
            }
        }
    }
    let outcomes = simulate_all(args, workload, &runs)?;
    write_sweep(args, workload, "sim-rcs-cpus", &outcomes)?;
    plot_by(
        &args.out.join("sim-rcs-cpus.png"),
        "Simulated RCS: throughput and mean latency against processors",
        &outcomes,
        |o| o.run.cpus as f64,
        "processors (log scale)",
        true,
    )
}

/// The paper's Figure 10: dispatches with 1, 4 and 16 groups, dynamic,
/// good path.
fn sweep_groups(args: &RcsSimArgs, workload: &Workload) -> anyhow::Result<()> {
    let all = workload.groups.len();
    let runs: Vec<Run> = [1, 4, 16]
        .into_iter()
        .filter(|&g| g <= all)
        .map(|g| Run {
            groups: g,
            bad: false,
            ..reference(workload)
        })
        .collect();
    let outcomes = simulate_all(args, workload, &runs)?;
    write_sweep(args, workload, "sim-rcs-figure10", &outcomes)?;
    print_figure10(&outcomes);
    let png = args.out.join("sim-rcs-figure10.png");
    crate::report::bar_chart_png(
        &png,
        "Figure 10, simulated: dispatches/min, 8 cpus",
        &[crate::report::BarPanel {
            title: String::new(),
            y_label: "dispatches per minute".into(),
            categories: outcomes
                .iter()
                .map(|o| format!("{} group(s)", o.run.groups))
                .collect(),
            series: vec![(
                "dynamic".into(),
                outcomes
                    .iter()
                    .map(|o| o.report.dispatches_per_s * 60.0)
                    .collect(),
            )],
        }],
    )?;
    println!("plot: {}", png.display());
    Ok(())
}

/// Fault rate and recovery time at 8 processors, performance vs dynamic.
fn sweep_faults(args: &RcsSimArgs, workload: &Workload) -> anyhow::Result<()> {
    let pair = |f: &dyn Fn(&mut Run)| {
        [Policy::Performance, Policy::Dynamic].map(|policy| {
            let mut r = Run {
                policy,
                ..reference(workload)
            };
            f(&mut r);
            r
        })
    };
    let runs: Vec<Run> = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3]
        .into_iter()
        .flat_map(|rate| pair(&|r| r.fault_rate = rate))
        .collect();
    let outcomes = simulate_all(args, workload, &runs)?;
    write_sweep(args, workload, "sim-rcs-fault-rate", &outcomes)?;
    plot_by(
        &args.out.join("sim-rcs-fault-rate.png"),
        "Simulated RCS at 8 processors: against the fault rate (per dispatch)",
        &outcomes,
        |o| o.run.fault_rate,
        "fault probability per dispatch (log scale)",
        true,
    )?;
    let runs: Vec<Run> = [5, 10, 20, 40, 80]
        .into_iter()
        .flat_map(|ms| pair(&|r| r.recovery = Duration::from_millis(ms)))
        .collect();
    let outcomes = simulate_all(args, workload, &runs)?;
    write_sweep(args, workload, "sim-rcs-recovery", &outcomes)?;
    plot_by(
        &args.out.join("sim-rcs-recovery.png"),
        "Simulated RCS at 8 processors: against the recovery time",
        &outcomes,
        |o| o.run.recovery.as_secs_f64() * 1e3,
        "recovery time, ms",
        false,
    )
}

fn write_sweep(
    args: &RcsSimArgs,
    workload: &Workload,
    name: &str,
    outcomes: &[Outcome],
) -> anyhow::Result<()> {
    println!("{name}: {}", describe(args, workload));
    println!("{}", table(outcomes).render());
    for line in verdicts(outcomes) {
        println!("{line}");
    }
    println!("{}", speed(outcomes));
    let path = args.out.join(format!("{name}.csv"));
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    writeln!(f, "fault_rate,recovery_ms,held_per_recovery,{CSV_HEADER}")?;
    for (o, line) in outcomes.iter().zip(csv(outcomes).lines().skip(1)) {
        writeln!(
            f,
            "{},{},{:.3},{line}",
            o.run.fault_rate,
            o.run.recovery.as_secs_f64() * 1e3,
            o.report.held_per_recovery
        )?;
    }
    println!("csv: {}", path.display());
    Ok(())
}

fn print_figure10(outcomes: &[Outcome]) {
    let Some(max) = outcomes
        .iter()
        .map(|o| o.report.dispatches_per_s)
        .reduce(f64::max)
    else {
        return;
    };
    let min = outcomes
        .iter()
        .map(|o| o.report.dispatches_per_s)
        .fold(f64::INFINITY, f64::min);
    let spread = (max / min - 1.0) * 100.0;
    println!(
        "figure 10: dispatches per minute with {} groups: {}; spread {spread:.2}% (paper: within 2%: {})",
        outcomes
            .iter()
            .map(|o| o.run.groups.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        outcomes
            .iter()
            .map(|o| thousands((o.report.dispatches_per_s * 60.0).round()))
            .collect::<Vec<_>>()
            .join(" / "),
        if spread <= 2.0 { "met" } else { "missed" }
    );
}

/// Two panels (throughput, mean latency), one line per policy and path.
fn plot_by(
    png: &Path,
    title: &str,
    outcomes: &[Outcome],
    x: impl Fn(&Outcome) -> f64,
    x_label: &str,
    log_x: bool,
) -> anyhow::Result<()> {
    let mut throughput = Vec::new();
    let mut latency = Vec::new();
    for policy in Policy::ALL {
        for bad in [false, true] {
            let pts: Vec<&Outcome> = outcomes
                .iter()
                .filter(|o| o.run.policy == policy && o.run.bad == bad)
                .collect();
            if pts.is_empty() {
                continue;
            }
            let name = format!("{policy} ({} path)", path_name(bad));
            throughput.push((
                name.clone(),
                pts.iter()
                    .map(|o| (x(o), o.report.tasks_per_s / o.run.cpus as f64))
                    .collect(),
            ));
            latency.push((
                name,
                pts.iter()
                    .map(|o| (x(o), o.report.mean_latency_us))
                    .collect(),
            ));
        }
    }
    crate::report::two_panel_line_png(
        png,
        title,
        x_label,
        log_x,
        ("tasks per second per processor", &throughput),
        ("mean latency, us", &latency),
    )?;
    println!("plot: {}", png.display());
    Ok(())
}
