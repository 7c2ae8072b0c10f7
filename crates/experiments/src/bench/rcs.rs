//! `rebound bench rcs`: the paper's good-path and bad-path experiment
//! (§6.3, Figures 11, 12, 14 and 15) on a synthetic workload.
//!
//! Workload: 16 recovery groups with the skew of Figure 9 (groups 4 and 5
//! carry most of the tasks, eight groups almost none). Each heavy group has
//! closed-loop clients in proportion to its weight; a client keeps one task
//! in flight: when its task completes it submits the next one. The light
//! groups get a trickle of tasks from the driver. A task spins for
//! `--task-us` microseconds. Throughput is tasks completed per second;
//! latency is from a task's submission to its completion.
//!
//! Bad path (§6.3.3): one task in 10,000 dispatches of group 5 fails, and its
//! recovery is emulated to take 20 ms; every task of group 5 running when the
//! recovery began or dispatched during it takes 20 ms as well. A failed
//! task's body is dropped unrun; its client redrives it (resubmits it with
//! its original submission time, so the latency includes the stall), as a
//! host redrives an I/O.
//!
//! Each configuration runs `--repeat` times, interleaved, and the median
//! throughput run is reported.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use crossbeam_utils::CachePadded;
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use rcs::{Alternative, GroupId, GroupSpec, Handle, Policy, Priority, Runtime, TaskCtx};

use super::CommonArgs;
use crate::report::{BarPanel, Table, bar_chart_png, progress, thousands};

/// Options of `rebound bench rcs`.
#[derive(Debug, Args)]
pub struct RcsArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Worker threads (default: the number of cores); one per resource pool.
    #[arg(long)]
    workers: Option<usize>,
    /// Closed-loop clients, i.e. tasks kept in flight by the heavy groups.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Busy work per task, in microseconds.
    #[arg(long, default_value_t = 3.0)]
    task_us: f64,
    /// Measured seconds per run [default: 4, or 1 with --quick].
    #[arg(long)]
    seconds: Option<f64>,
    /// Runs per configuration; the median is reported [default: 3, or 1 with --quick].
    #[arg(long)]
    repeat: Option<usize>,
    /// Fault probability per dispatch of group 5 on the bad path.
    #[arg(long, default_value_t = 1e-4)]
    fault_rate: f64,
    /// Emulated recovery time per fault, in milliseconds.
    #[arg(long, default_value_t = 20.0)]
    recovery_ms: f64,
    /// Only these configurations (comma-separated: performance, static,
    /// partial, dynamic, dynamic-proactive) [default: all].
    #[arg(long, value_delimiter = ',')]
    policy: Vec<String>,
    /// Only this path: good, bad or both.
    #[arg(long, default_value = "both", value_parser = ["good", "bad", "both"])]
    path: String,
}

/// Figure 9's skew: tasks per minute, relative. Group 5 is the faulty one
/// (the simulator's `figure9` workload is the same table).
const GROUPS: [(&str, f64); 16] = rcs::sim::FIGURE9;
const FAULTY: usize = 4;
/// Groups under this share of the weight get a trickle, not clients.
const LIGHT_SHARE: f64 = 0.01;
/// Trickle tasks per second per light group.
const TRICKLE_PER_SEC: u64 = 500;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Config {
    label: &'static str,
    policy: Policy,
    reactive: bool,
}

const CONFIGS: [Config; 5] = [
    Config {
        label: "performance",
        policy: Policy::Performance,
        reactive: false,
    },
    Config {
        label: "static",
        policy: Policy::Static,
        reactive: true,
    },
    Config {
        label: "partial",
        policy: Policy::Partial,
        reactive: true,
    },
    Config {
        label: "dynamic",
        policy: Policy::Dynamic,
        reactive: true,
    },
    Config {
        label: "dynamic-proactive",
        policy: Policy::Dynamic,
        reactive: false,
    },
];

#[derive(Debug, Clone)]
struct RunResult {
    throughput: f64,
    mean_us: f64,
    p99_us: f64,
    recoveries: u64,
}

/// State shared by the tasks of one run (leaked: tasks borrow it for
/// `'static` without a reference count on the hot path).
struct Bench {
    handle: Handle,
    work: Duration,
    measuring: AtomicBool,
    stop: AtomicBool,
    completed: Vec<CachePadded<AtomicU64>>,
    latency_ns: Vec<Mutex<Histogram<u64>>>,
}

thread_local! {
    static REDRIVING: Cell<bool> = const { Cell::new(false) };
}

/// One task in flight for a client; redriven if dropped unrun.
struct Client {
    bench: &'static Bench,
    group: GroupId,
    submitted: Instant,
    resubmit: bool,
    ran: bool,
}

impl Client {
    fn body(
        mut self,
    ) -> impl FnOnce(&mut TaskCtx<'_>) -> Result<(), rcs::Failure> + Send + 'static {
        move |ctx| {
            self.ran = true;
            self.execute(ctx);
            Ok(())
        }
    }

    fn execute(&self, ctx: &TaskCtx<'_>) {
        let bench = self.bench;
        let end = Instant::now() + bench.work;
        while Instant::now() < end {
            std::hint::spin_loop();
        }
        let w = ctx.worker_index();
        if bench.measuring.load(Ordering::Relaxed) {
            let ns = u64::try_from(self.submitted.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let _ = bench.latency_ns[w].lock().record(ns.max(1));
            bench.completed[w].fetch_add(1, Ordering::Relaxed);
        }
        if self.resubmit && !bench.stop.load(Ordering::Relaxed) {
            let next = Client {
                bench,
                group: self.group,
                submitted: Instant::now(),
                resubmit: true,
                ran: false,
            };
            let _ = ctx.submit(self.group, Priority::Medium, next.body());
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if self.ran || self.bench.stop.load(Ordering::Relaxed) || REDRIVING.with(Cell::get) {
            return;
        }
        // The task failed before running: redrive it, keeping its submission time.
        REDRIVING.with(|r| r.set(true));
        let again = Client {
            bench: self.bench,
            group: self.group,
            submitted: self.submitted,
            resubmit: self.resubmit,
            ran: false,
        };
        let _ = self
            .bench
            .handle
            .submit(self.group, Priority::Medium, again.body());
        REDRIVING.with(|r| r.set(false));
    }
}

struct Plan {
    workers: usize,
    clients_per_group: Vec<usize>,
    light: Vec<usize>,
    mapping: Vec<Vec<rcs::PoolId>>,
    sigma: Vec<u32>,
    seconds: f64,
    warmup: Duration,
    task: Duration,
    fault_rate: f64,
    recovery: Duration,
}

impl Plan {
    fn new(args: &RcsArgs) -> anyhow::Result<Self> {
        let workers = args
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        anyhow::ensure!(
            (1..=rcs::limits::WORKERS_MAX).contains(&workers),
            "--workers must be in 1..={}",
            rcs::limits::WORKERS_MAX
        );
        anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
        anyhow::ensure!(
            args.task_us.is_finite() && args.task_us >= 0.0 && args.task_us <= 1e6,
            "--task-us must be within 0..=1000000"
        );
        anyhow::ensure!(
            (0.0..=1.0).contains(&args.fault_rate),
            "--fault-rate must be within 0..=1"
        );
        anyhow::ensure!(
            args.recovery_ms.is_finite() && (0.0..=10_000.0).contains(&args.recovery_ms),
            "--recovery-ms must be within 0..=10000"
        );
        let seconds = args
            .seconds
            .unwrap_or(if args.common.quick { 1.0 } else { 4.0 });
        anyhow::ensure!(
            seconds.is_finite() && (0.1..=3600.0).contains(&seconds),
            "--seconds must be within 0.1..=3600"
        );
        let total: f64 = GROUPS.iter().map(|g| g.1).sum();
        let heavy_total: f64 = GROUPS
            .iter()
            .filter(|g| g.1 / total >= LIGHT_SHARE)
            .map(|g| g.1)
            .sum();
        let mut clients_per_group = Vec::new();
        let mut light = Vec::new();
        for (i, &(_, w)) in GROUPS.iter().enumerate() {
            if w / total < LIGHT_SHARE {
                clients_per_group.push(0);
                light.push(i);
            } else {
                let n = (args.clients as f64 * w / heavy_total).round() as usize;
                clients_per_group.push(n.max(1));
            }
        }
        let weights: Vec<f64> = GROUPS.iter().map(|g| g.1).collect();
        let mapping = rcs::proportional_mapping(&weights, workers);
        let sigma = weights
            .iter()
            .map(|w| ((workers as f64 * w / total).round() as u32).max(1))
            .collect();
        Ok(Self {
            workers,
            clients_per_group,
            light,
            mapping,
            sigma,
            seconds,
            warmup: Duration::from_secs_f64((seconds * 0.2).clamp(0.2, 1.0)),
            task: Duration::from_secs_f64(args.task_us / 1e6),
            fault_rate: args.fault_rate,
            recovery: Duration::from_secs_f64(args.recovery_ms / 1e3),
        })
    }

    fn runtime(&self, cfg: Config, faulty: bool) -> anyhow::Result<(Runtime, Vec<GroupId>)> {
        let mut b = Runtime::builder();
        b.workers(self.workers)
            .policy(cfg.policy)
            .reactive(cfg.reactive)
            .queue_capacity(4096)
            .drain_timeout(Duration::from_secs(5))
            .thread_name("bench-rcs");
        let ids = GROUPS
            .iter()
            .enumerate()
            .map(|(i, &(name, _))| {
                let mut spec = GroupSpec::new(name)
                    .sigma(self.sigma[i])
                    .pools(self.mapping[i].clone());
                // Partial-dynamic isolates groups 4 and 5, as the paper (§6.1).
                if i == 3 || i == 4 {
                    spec = spec.alternative(Alternative::Isolated);
                }
                if faulty && i == FAULTY {
                    spec = spec.inject_faults(self.fault_rate, self.recovery);
                }
                b.group(spec)
            })
            .collect();
        Ok((b.build().context("building the runtime")?, ids))
    }

    /// The state one run's clients share (leaked: its tasks hold it).
    fn leak_bench(&self, runtime: &Runtime) -> &'static Bench {
        Box::leak(Box::new(Bench {
            handle: runtime.handle(),
            work: self.task,
            measuring: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            completed: (0..self.workers)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            latency_ns: (0..self.workers)
                .map(|_| {
                    Mutex::new(
                        Histogram::new_with_bounds(1, 600_000_000_000, 3)
                            .expect("static histogram bounds"),
                    )
                })
                .collect(),
        }))
    }

    /// Warm up, then measure until the end while the light groups get
    /// their open-loop trickle: the time measured.
    fn trickle(&self, bench: &'static Bench, ids: &[GroupId]) -> Duration {
        let started = Instant::now();
        let measure_from = started + self.warmup;
        let end = measure_from + Duration::from_secs_f64(self.seconds);
        let tick = Duration::from_micros(1_000_000 / TRICKLE_PER_SEC);
        let mut next_tick = started;
        let mut measuring_since = None;
        while Instant::now() < end {
            let now = Instant::now();
            if measuring_since.is_none() && now >= measure_from {
                bench.measuring.store(true, Ordering::Relaxed);
                measuring_since = Some(now);
            }
            if now >= next_tick {
                for &g in &self.light {
                    let client = Client {
                        bench,
                        group: ids[g],
                        submitted: Instant::now(),
                        resubmit: false,
                        ran: false,
                    };
                    let _ = bench.handle.submit(ids[g], Priority::Medium, client.body());
                }
                next_tick += tick;
            }
            std::thread::sleep(
                next_tick
                    .saturating_duration_since(Instant::now())
                    .min(tick),
            );
        }
        bench.measuring.store(false, Ordering::Relaxed);
        measuring_since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    fn run_once(&self, cfg: Config, faulty: bool) -> anyhow::Result<RunResult> {
        let (runtime, ids) = self.runtime(cfg, faulty)?;
        let bench = self.leak_bench(&runtime);
        for (i, &n) in self.clients_per_group.iter().enumerate() {
            for _ in 0..n {
                let client = Client {
                    bench,
                    group: ids[i],
                    submitted: Instant::now(),
                    resubmit: true,
                    ran: false,
                };
                bench
                    .handle
                    .submit(ids[i], Priority::Medium, client.body())
                    .context("submitting the initial clients")?;
            }
        }
        let elapsed = self.trickle(bench, &ids);
        bench.stop.store(true, Ordering::Relaxed);
        let metrics = bench.handle.metrics();
        drop(runtime);
        let completed: u64 = bench
            .completed
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum();
        let mut latency = Histogram::<u64>::new_with_bounds(1, 600_000_000_000, 3)
            .expect("static histogram bounds");
        for h in &bench.latency_ns {
            latency.add(&*h.lock()).expect("same bounds");
        }
        Ok(RunResult {
            throughput: completed as f64 / elapsed.as_secs_f64().max(1e-9),
            mean_us: latency.mean() / 1e3,
            p99_us: latency.value_at_quantile(0.99) as f64 / 1e3,
            recoveries: metrics.groups[FAULTY].recoveries,
        })
    }
}

fn median(mut runs: Vec<RunResult>) -> Option<RunResult> {
    runs.sort_by(|a, b| a.throughput.total_cmp(&b.throughput));
    runs.get(runs.len() / 2).cloned()
}

/// Results indexed `[config][path]`, `None` where filtered out.
type Results = Vec<[Option<RunResult>; 2]>;

fn selection(args: &RcsArgs) -> anyhow::Result<(Vec<bool>, [bool; 2])> {
    for name in &args.policy {
        anyhow::ensure!(
            CONFIGS.iter().any(|c| c.label == name),
            "unknown --policy {name:?} (expected performance, static, partial, dynamic or dynamic-proactive)"
        );
    }
    let configs = CONFIGS
        .iter()
        .map(|c| args.policy.is_empty() || args.policy.iter().any(|p| p == c.label))
        .collect();
    let paths = match args.path.as_str() {
        "good" => [true, false],
        "bad" => [false, true],
        _ => [true, true],
    };
    Ok((configs, paths))
}

/// Run the experiment.
pub fn run(args: RcsArgs) -> anyhow::Result<std::process::ExitCode> {
    let plan = Plan::new(&args)?;
    let repeat = args.repeat.unwrap_or(if args.common.quick { 1 } else { 3 });
    anyhow::ensure!(
        (1..=100).contains(&repeat),
        "--repeat must be within 1..=100"
    );
    let (configs, paths) = selection(&args)?;
    println!(
        "rcs good path / bad path: {} groups, {} workers ({} pools), {} clients, task {} µs, \
         bad path: fault p={} per dispatch of g5, recovery {} ms; {} s per run, median of {}",
        GROUPS.len(),
        plan.workers,
        plan.workers,
        plan.clients_per_group.iter().sum::<usize>(),
        args.task_us,
        plan.fault_rate,
        args.recovery_ms,
        plan.seconds,
        repeat
    );
    let steps = configs.iter().filter(|&&c| c).count() * paths.iter().filter(|&&p| p).count();
    let bar = progress((repeat * steps) as u64, "bench rcs");
    let mut runs: Vec<[Vec<RunResult>; 2]> = vec![[Vec::new(), Vec::new()]; CONFIGS.len()];
    for _ in 0..repeat {
        for (c, cfg) in CONFIGS.iter().enumerate().filter(|(c, _)| configs[*c]) {
            for (p, faulty) in [false, true]
                .into_iter()
                .enumerate()
                .filter(|(p, _)| paths[*p])
            {
                let path = if faulty { "bad" } else { "good" };
                bar.set_message(format!("{} {path}", cfg.label));
                runs[c][p].push(plan.run_once(*cfg, faulty)?);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    let results: Results = runs
        .into_iter()
        .map(|[good, bad]| [median(good), median(bad)])
        .collect();
    print_table(&results);
    print_targets(&results);
    let complete = results.iter().all(|r| r.iter().all(Option::is_some));
    if !args.common.quick && complete {
        let path = args.common.out.join("rcs.png");
        plot(&path, &results)?;
        println!("plot: {}", path.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn print_table(results: &Results) {
    let perf = &results[0];
    let mut t = Table::new(&[
        "policy",
        "path",
        "tasks/s",
        "vs perf",
        "mean µs",
        "p99 µs",
        "recoveries",
    ]);
    for (cfg, r) in CONFIGS.iter().zip(results) {
        for (p, path) in ["good", "bad"].iter().enumerate() {
            let Some(run) = &r[p] else { continue };
            let ratio = perf[p].as_ref().map_or("-".to_owned(), |base| {
                format!("{:.3}", run.throughput / base.throughput)
            });
            t.row(vec![
                cfg.label.to_owned(),
                (*path).to_owned(),
                thousands(run.throughput),
                ratio,
                format!("{:.1}", run.mean_us),
                format!("{:.0}", run.p99_us),
                run.recoveries.to_string(),
            ]);
        }
    }
    println!("{}", t.render());
}

/// Print the targets with the measured ratios (a missed target is a
/// finding, reported as such, not an error).
fn print_targets(results: &Results) {
    let check = |ok: bool| if ok { "met" } else { "MISSED" };
    if let (Some(perf), Some(dynamic)) = (&results[0][0], &results[3][0]) {
        let good = dynamic.throughput / perf.throughput;
        println!(
            "good path: dynamic = {good:.3}x performance throughput (target >= 0.98: {})",
            check(good >= 0.98)
        );
    }
    if let (Some(perf), Some(dynamic)) = (&results[0][1], &results[3][1]) {
        let bad = dynamic.throughput / perf.throughput;
        let latency = 1.0 - dynamic.mean_us / perf.mean_us;
        println!(
            "bad path:  dynamic = {bad:.3}x performance throughput (target >= 1.16: {}), \
             mean latency {:.1}% lower (paper, 8-way: 105 against 87.8 KIOps = 1.196x; 13.5 against \
             16.6 ms = 18.7% lower, i.e. performance's 22.9% higher)",
            check(bad >= 1.16),
            latency * 100.0
        );
    }
}

fn plot(path: &std::path::Path, results: &Results) -> anyhow::Result<()> {
    let categories: Vec<String> = CONFIGS.iter().map(|c| c.label.to_owned()).collect();
    let value = |r: &Option<RunResult>, f: fn(&RunResult) -> f64| r.as_ref().map_or(0.0, f);
    let series = |f: fn(&RunResult) -> f64| -> Vec<(String, Vec<f64>)> {
        vec![
            (
                "good path".to_owned(),
                results.iter().map(|r| value(&r[0], f)).collect(),
            ),
            (
                "bad path (faults in g5)".to_owned(),
                results.iter().map(|r| value(&r[1], f)).collect(),
            ),
        ]
    };
    bar_chart_png(
        path,
        "rcs: throughput and latency per scheduling policy, good vs bad path",
        &[
            BarPanel {
                title: "throughput".into(),
                y_label: "tasks per second".into(),
                categories: categories.clone(),
                series: series(|r| r.throughput),
            },
            BarPanel {
                title: "mean latency".into(),
                y_label: "microseconds".into(),
                categories,
                series: series(|r| r.mean_us),
            },
        ],
    )
}
