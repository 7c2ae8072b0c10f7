//! `rebound bench loglock`: recovery success of Log(Lock) (paper §5.5,
//! Table 5): the percentage of recoverable threads whose restoration level,
//! taken just before `stop_tracking`, meets their recovery criterion.
//!
//! Each row is one of the paper's hot locks with its access rate and
//! tracking duration (Table 5's CPU cycles at the paper's 3 GHz). Four "I/O
//! threads" access the lock as Poisson arrivals adding up to the row's rate;
//! every access is a recoverable thread: an actor that starts tracking the
//! lock, takes a recovery point whose criterion forbids dirty reads and lost
//! updates (the paper's R4), modifies the state, runs for the tracking
//! duration, then asks [`Actor::decide`] whether single-actor rollback would
//! still be allowed. The paper reports over 99%.
//!
//! Each lock runs twice: free-running, and with its recoverable threads in
//! one recovery group of sigma 1 (rung 2, recovery-conscious scheduling:
//! "dependent threads serialized", paper §4.3), which the paper proposes to
//! raise single-thread recovery success.
//!
//! Then the same question on the real controller: `rebound serve` under
//! fio's cache-standard mix while 1% of writes fail inside `cache.apply`
//! (after part of the write entered the cache directory). Each such write's
//! task tracks the cache shards it changed; the table counts how many
//! Log(Lock) let roll back alone (rung 1) and how many had to escalate
//! (rung 4) because another request had touched a shard they changed.
//!
//! The paper gives the rates of two locks (resource pool 14,107/s, fiber
//! channel 15,244/s) and the range (12.5/s to 15,244/s); the I/O-state
//! rate, 5,000/s, is our assumption and says so in the table.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use loglock::{Actor, RecoveryCriterion, Requirement, TrackedMutex};

use super::CommonArgs;
use crate::report::{BarPanel, Table, bar_chart_png, progress, thousands};

/// Options of `rebound bench loglock`.
#[derive(Debug, Args)]
pub struct LoglockArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Seconds per lock (default 10, or 1.5 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Threads accessing each lock.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    threads: u32,
}

/// One row of the paper's Table 5.
struct LockRow {
    name: &'static str,
    rate: f64,
    rate_from_paper: bool,
    cycles: u32,
}

const ROWS: [LockRow; 5] = [
    LockRow {
        name: "timer",
        rate: 12.5,
        rate_from_paper: true,
        cycles: 7258,
    },
    LockRow {
        name: "IO state (short)",
        rate: 5000.0,
        rate_from_paper: false,
        cycles: 2894,
    },
    LockRow {
        name: "IO state (long)",
        rate: 5000.0,
        rate_from_paper: false,
        cycles: 69830,
    },
    LockRow {
        name: "resource pool",
        rate: 14107.0,
        rate_from_paper: true,
        cycles: 34642,
    },
    LockRow {
        name: "fiber channel",
        rate: 15244.0,
        rate_from_paper: true,
        cycles: 20228,
    },
];

/// The paper's machine ran at 3.00 GHz.
const PAPER_HZ: f64 = 3.0e9;

/// The paper's R4: no dirty reads or lost updates, nothing held.
const CRITERION: RecoveryCriterion = RecoveryCriterion {
    dr: Requirement::Forbidden,
    lu: Requirement::Forbidden,
    ur: Requirement::DontCare,
    rr: Requirement::Forbidden,
};

#[derive(Debug, Default)]
struct Outcome {
    trackings: u64,
    met: u64,
    dr: u64,
    lu: u64,
    incomplete: u64,
    decide_ns: u64,
    achieved_rate: f64,
}

static NEXT_ACTOR: AtomicU64 = AtomicU64::new(1);

fn spin_for(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn run_row(row: &LockRow, threads: u32, seconds: f64, serialize: bool) -> Outcome {
    let lock = TrackedMutex::new(row.name, 0u64);
    // sigma = 1: one recoverable thread of the group at a time.
    let group = parking_lot::Mutex::new(());
    let tracking = Duration::from_secs_f64(f64::from(row.cycles) / PAPER_HZ);
    let per_thread_rate = row.rate / f64::from(threads);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let totals = Arc::new(parking_lot::Mutex::new(Outcome::default()));
    std::thread::scope(|s| {
        for t in 0..threads {
            let (lock, totals, group) = (lock.clone(), Arc::clone(&totals), &group);
            s.spawn(move || {
                let mut rng =
                    0x2545_f491_4f6c_dd1du64 ^ (u64::from(t) + 1).wrapping_mul(0x9e37_79b9);
                let mut uniform = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    (rng >> 11) as f64 / (1u64 << 53) as f64
                };
                let mut out = Outcome::default();
                let mut next = Instant::now();
                loop {
                    // Poisson arrivals: exponential gaps.
                    let gap = -(1.0 - uniform()).ln() / per_thread_rate;
                    next += Duration::from_secs_f64(gap);
                    if next >= deadline {
                        break;
                    }
                    let now = Instant::now();
                    if next > now {
                        let wait = next - now;
                        if wait > Duration::from_micros(200) {
                            std::thread::sleep(wait - Duration::from_micros(100));
                        }
                        while Instant::now() < next {
                            std::hint::spin_loop();
                        }
                    }
                    let admitted = serialize.then(|| group.lock());
                    let actor = Actor::begin(NEXT_ACTOR.fetch_add(1, Ordering::Relaxed));
                    actor.start_tracking(&lock).expect("start tracking");
                    let point = actor.recovery_point(CRITERION).expect("recovery point");
                    *lock.lock() += 1;
                    spin_for(tracking);
                    let t0 = Instant::now();
                    let decision = actor.decide(&point, &[&lock]).expect("decide");
                    out.decide_ns += t0.elapsed().as_nanos() as u64;
                    actor.stop_tracking(&lock).expect("stop tracking");
                    out.trackings += 1;
                    out.met += u64::from(decision.criterion_met());
                    out.dr += u64::from(decision.level.dr);
                    out.lu += u64::from(decision.level.lu);
                    out.incomplete += u64::from(!decision.level.complete);
                    drop(actor);
                    drop(admitted);
                }
                let mut all = totals.lock();
                all.trackings += out.trackings;
                all.met += out.met;
                all.dr += out.dr;
                all.lu += out.lu;
                all.incomplete += out.incomplete;
                all.decide_ns += out.decide_ns;
            });
        }
    });
    let mut out = std::mem::take(&mut *totals.lock());
    out.achieved_rate = out.trackings as f64 / seconds;
    out
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// Run the experiment.
pub fn run(args: LoglockArgs) -> anyhow::Result<std::process::ExitCode> {
    let seconds = args
        .seconds
        .unwrap_or(if args.common.quick { 1.0 } else { 8.0 });
    anyhow::ensure!(
        seconds > 0.0 && seconds.is_finite(),
        "--seconds must be positive"
    );
    eprintln!(
        "loglock recovery success: {} locks x {seconds} s, {} threads each, criterion DR/LU/RR forbidden",
        ROWS.len(),
        args.threads
    );
    let bar = progress(2 * ROWS.len() as u64, "runs");
    let mut results = Vec::new();
    let mut serialized = Vec::new();
    for row in &ROWS {
        bar.set_message(row.name);
        results.push(run_row(row, args.threads, seconds, false));
        bar.inc(1);
        serialized.push(run_row(row, args.threads, seconds, true));
        bar.inc(1);
    }
    bar.finish_and_clear();
    print_rows(&results, &serialized);
    let cache = controller_case(if args.common.quick { 2 } else { 10 })?;
    let failures = print_controller_case(&cache);
    anyhow::ensure!(failures > 0, "no write failed inside cache.apply");
    if !args.common.quick {
        let png = args.common.out.join("loglock.png");
        bar_chart_png(
            &png,
            "Log(Lock) recovery success (restoration level meets criterion)",
            &[BarPanel {
                title: format!("{} threads per lock, {seconds} s each", args.threads),
                y_label: "criterion met (%)".into(),
                categories: ROWS.iter().map(|r| r.name.to_owned()).collect(),
                series: vec![
                    (
                        "free-running".into(),
                        results.iter().map(|o| pct(o.met, o.trackings)).collect(),
                    ),
                    (
                        "RCS, sigma = 1".into(),
                        serialized.iter().map(|o| pct(o.met, o.trackings)).collect(),
                    ),
                ],
            }],
        )?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The table of every lock, free-running and with RCS, and the overall
/// share that met the criterion.
fn print_rows(results: &[Outcome], serialized: &[Outcome]) {
    let mut table = Table::new(&[
        "lock",
        "access rate /s",
        "achieved /s",
        "tracking µs",
        "trackings",
        "DR %",
        "LU %",
        "incomplete",
        "decide ns",
        "criterion met %",
        "met %, RCS sigma=1",
    ]);
    for ((row, o), r) in ROWS.iter().zip(results).zip(serialized) {
        table.row(vec![
            row.name.to_owned(),
            format!(
                "{}{}",
                if row.rate.fract() == 0.0 {
                    thousands(row.rate)
                } else {
                    format!("{}", row.rate)
                },
                if row.rate_from_paper {
                    ""
                } else {
                    " (assumed)"
                }
            ),
            thousands(o.achieved_rate.round()),
            format!("{:.1}", f64::from(row.cycles) / PAPER_HZ * 1e6),
            thousands(o.trackings as f64),
            format!("{:.2}", pct(o.dr, o.trackings)),
            format!("{:.2}", pct(o.lu, o.trackings)),
            o.incomplete.to_string(),
            thousands((o.decide_ns / o.trackings.max(1)) as f64),
            format!("{:.2}", pct(o.met, o.trackings)),
            format!("{:.2}", pct(r.met, r.trackings)),
        ]);
    }
    println!("{}", table.render());
    let total: u64 = results.iter().map(|o| o.trackings).sum();
    let met: u64 = results.iter().map(|o| o.met).sum();
    let s_total: u64 = serialized.iter().map(|o| o.trackings).sum();
    let s_met: u64 = serialized.iter().map(|o| o.met).sum();
    println!(
        "overall: {:.2}% of {} recoverable threads met the criterion free-running, {:.2}% of {} with RCS sigma=1 (paper: over 99%)",
        pct(met, total),
        thousands(total as f64),
        pct(s_met, s_total),
        thousands(s_total as f64)
    );
}

/// The controller case's table; the writes that failed inside cache.apply.
fn print_controller_case(cache: &ControllerCase) -> u64 {
    let failures = cache.rollbacks + cache.escalations;
    let mut t = Table::new(&[
        "fio IOPS",
        "writes failing in cache.apply",
        "rolled back alone (rung 1)",
        "escalated (rung 4)",
        "rung-4 recoveries",
        "criterion met %",
    ]);
    t.row(vec![
        thousands(cache.iops.round()),
        thousands(failures as f64),
        thousands(cache.rollbacks as f64),
        thousands(cache.escalations as f64),
        thousands(cache.system as f64),
        format!("{:.2}", pct(cache.rollbacks, failures)),
    ]);
    println!(
        "\nLog(Lock) in the controller's cache: fio cache-standard (QD32) for {} s, 1% of writes panicking inside cache.apply",
        cache.seconds
    );
    println!("{}", t.render());
    failures
}

/// The controller case's counts.
struct ControllerCase {
    seconds: u32,
    iops: f64,
    rollbacks: u64,
    escalations: u64,
    system: u64,
}

/// `rebound serve` under fio cache-standard for `seconds` while 1% of the
/// writes panic inside `cache.apply`; what Log(Lock) decided.
fn controller_case(seconds: u32) -> anyhow::Result<ControllerCase> {
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    let server = super::experiment_server(work.path(), port)?.start()?;
    server.admin("inject panic cache.apply.track rate=0.01 count=unlimited")?;
    let run = super::badpath::fio_run(port, seconds);
    let status = server.admin("status");
    server.stop()?;
    let (iops, _) = run?;
    let status = status?;
    let line = status
        .lines()
        .find(|l| l.starts_with("writes failing inside cache.apply:"))
        .context("no cache.apply line in the server's status")?;
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    // "... N rolled back alone (Log(Lock), rung 1), M escalated (rung 4)"
    let [rollbacks, _, escalations, _] = numbers[..] else {
        anyhow::bail!("unexpected status line {line:?}");
    };
    let system = status
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("system"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|n| n.parse().ok())
        .context("no rung 4 count in the server's status")?;
    Ok(ControllerCase {
        seconds,
        iops,
        rollbacks,
        escalations,
        system,
    })
}
