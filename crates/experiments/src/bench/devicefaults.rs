//! `rebound bench device-faults`: the environment's faults on the real
//! controller, injected at the backend door (`rebound inject
//! device-error`, `device-latency`, `power-loss`).
//!
//! Per fault kind, on a 1 GiB volume over three file devices: fio's nbd
//! engine (randrw 75% reads, 4 KiB, QD16) runs on the first 1020 MiB while
//! the ledger client (`crate::ledger`) writes self-identifying tracks in
//! the last 4 MiB with a FLUSH every 8 requests. The fault is armed on
//! device 1 (device 0 for a sync error on a striped volume) for a window,
//! then cleared. The table gives IOPS before, during and after (after the
//! rebuild if the device was declared lost), FLUSHes answered with an
//! error during the fault and after it cleared, the time to declare the
//! device lost and to rebuild it once the fault cleared, and the
//! acknowledged writes lost (read back through the ledger: must be 0).
//!
//! Then the power-loss loop: `--cycles` times, a server with
//! `--power-loss-tracking` is cut (`inject power-loss`) while the ledger
//! client writes and FLUSHes, restarted, and every track checked: writes
//! covered by a completed FLUSH lost must be 0.

use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use super::availability::{iops_series, mean};
use crate::ledger::{self, Answered, Ledger, Region};
use crate::report::{Table, line_chart_png, thousands};

/// Options of `rebound bench device-faults`.
#[derive(Debug, Args)]
pub struct DeviceFaultsArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Power-loss cycles [default: 1000; 40 with --quick].
    #[arg(long, value_name = "N")]
    cycles: Option<u32>,
}

/// One fault kind.
struct Case {
    name: &'static str,
    raid: &'static str,
    /// The inject words (`None`: the fault-free peer).
    fault: Option<&'static str>,
}

const CASES: &[Case] = &[
    Case {
        name: "mirror, no fault (peer)",
        raid: "mirror",
        fault: None,
    },
    Case {
        name: "mirror, read EIO 1%",
        raid: "mirror",
        fault: Some("device-error 1 op=read rate=0.01"),
    },
    Case {
        name: "mirror, write EIO",
        raid: "mirror",
        fault: Some("device-error 1 op=write"),
    },
    Case {
        name: "mirror, write ENOSPC",
        raid: "mirror",
        fault: Some("device-error 1 op=write errno=enospc"),
    },
    Case {
        name: "mirror, latency 2 ms",
        raid: "mirror",
        fault: Some("device-latency 1 duration=2ms"),
    },
    Case {
        name: "parity, write EIO",
        raid: "parity",
        fault: Some("device-error 1 op=write"),
    },
    Case {
        name: "parity, torn write 5%",
        raid: "parity",
        fault: Some("device-error 1 op=write rate=0.05 torn=true"),
    },
    Case {
        name: "striped, sync EIO",
        raid: "none",
        fault: Some("device-error 0 op=sync"),
    },
];

/// The ledger client's tracks: the last 4 MiB of the 1 GiB volume.
const REGION: Region = Region {
    first: (1 << 30) / 4096 - 1024,
    count: 1024,
};

struct Outcome {
    name: &'static str,
    series: Vec<(f64, f64)>,
    before: f64,
    during: f64,
    after: f64,
    flush_errors: (u64, u64),
    declared: Option<Duration>,
    rebuilt: Option<Duration>,
    lost: usize,
}

/// fio on the first 1020 MiB (the ledger client has the rest).
fn fio(port: u16, runtime: Duration, prefix: &Path) -> anyhow::Result<Child> {
    super::availability::fio_sized(port, runtime, prefix, "1020m")
}

/// The ledger client on its own thread until `stop`.
fn client(
    addr: String,
    ledger: &Arc<Mutex<Ledger>>,
    stop: &Arc<AtomicBool>,
    seed: u64,
) -> std::thread::JoinHandle<Answered> {
    let (ledger, stop) = (Arc::clone(ledger), Arc::clone(stop));
    std::thread::spawn(move || ledger::write_until(&addr, REGION, &ledger, 8, seed, &stop))
}

/// Arm the case's fault for `window`, then clear it; when the volume
/// became degraded (the device declared lost), from arming.
fn fault_window(
    server: &crate::harness::Server,
    case: &Case,
    window: Duration,
) -> anyhow::Result<Option<Duration>> {
    let t0 = Instant::now();
    if let Some(words) = case.fault {
        let answer = server.admin(&format!("inject {words}"))?;
        anyhow::ensure!(answer.starts_with("device"), "inject {words}: {answer}");
    }
    let mut declared = None;
    while t0.elapsed() < window {
        if declared.is_none() && server.admin("status")?.contains("DEGRADED") {
            declared = Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    server.admin("inject clear")?;
    Ok(declared)
}

/// Wait (up to `longest`) until the volume is no longer degraded.
fn wait_rebuilt(
    server: &crate::harness::Server,
    case: &Case,
    longest: Duration,
) -> anyhow::Result<Duration> {
    let cleared = Instant::now();
    loop {
        if !server.admin("status")?.contains("DEGRADED") {
            return Ok(cleared.elapsed());
        }
        anyhow::ensure!(
            cleared.elapsed() < longest,
            "{}: still degraded {longest:?} after the fault cleared",
            case.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// End fio: it ends its jobs, writes its logs and exits 128 on SIGINT.
fn stop_fio(load: &mut Child, case: &str) -> anyhow::Result<()> {
    // SAFETY: kill(2) on our own child's pid; no memory involved.
    unsafe {
        libc::kill(load.id() as libc::pid_t, libc::SIGINT);
    }
    let st = load.wait().context("waiting for fio")?;
    anyhow::ensure!(
        st.success() || st.code() == Some(128),
        "fio failed in {case} ({st})"
    );
    Ok(())
}

/// Phases of one case, in milliseconds.
struct Phases {
    warm: u64,
    before: u64,
    fault: u64,
    after: u64,
    longest: u64,
}

fn run_case(case: &Case, work: &Path, port: u16, p: &Phases) -> anyhow::Result<Outcome> {
    let dir = work.join(case.name.replace([' ', ',', '%'], "-"));
    std::fs::create_dir_all(&dir)?;
    let server = super::experiment_server(&dir, port)?
        .args(["--devices", "3", "--raid", case.raid])
        .start()?;
    let ms = Duration::from_millis;
    let prefix = dir.join("fio");
    let mut load = fio(
        port,
        ms(p.warm + p.before + p.fault + p.longest + p.after),
        &prefix,
    )?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let during_client = client(server.addr().to_owned(), &ledger, &stop, 0x5eed);
    std::thread::sleep(ms(p.warm + p.before));
    let t0 = Instant::now();
    let declared = fault_window(&server, case, ms(p.fault))?;
    stop.store(true, Ordering::SeqCst);
    let during = during_client.join().unwrap_or_default();
    let rebuilt = match declared {
        None => None,
        Some(_) => Some(wait_rebuilt(&server, case, ms(p.longest))?),
    };
    let window = t0.elapsed();
    stop.store(false, Ordering::SeqCst);
    let after_client = client(server.addr().to_owned(), &ledger, &stop, 0xafe7);
    std::thread::sleep(ms(p.after));
    stop.store(true, Ordering::SeqCst);
    let after = after_client.join().unwrap_or_default();
    stop_fio(&mut load, case.name)?;
    let mut l = ledger.lock().expect("ledger");
    l.cover_acknowledged();
    let verified = ledger::verify(server.addr(), REGION, &mut l)?;
    for line in verified.lost.iter().take(5) {
        eprintln!("{}: LOST {line}", case.name);
    }
    server.stop()?;
    let start = (p.warm + p.before) as f64 / 1000.0;
    let series: Vec<(f64, f64)> = iops_series(&prefix)?
        .into_iter()
        .map(|(s, v)| (s - start, v))
        .filter(|(s, _)| *s <= window.as_secs_f64() + p.after as f64 / 1000.0)
        .collect();
    let pick = |lo: f64, hi: f64| {
        series
            .iter()
            .filter(move |(s, _)| *s > lo && *s <= hi)
            .map(|x| x.1)
    };
    let w = window.as_secs_f64();
    Ok(Outcome {
        name: case.name,
        before: mean(pick(-(p.before as f64) / 1000.0, -0.1)),
        during: mean(pick(0.1, p.fault as f64 / 1000.0)),
        after: mean(pick(w + 0.2, w + p.after as f64 / 1000.0)),
        series,
        flush_errors: (during.flush_errors, after.flush_errors),
        declared,
        rebuilt,
        lost: verified.lost.len(),
    })
}

/// The power-loss loop's totals.
#[derive(Debug, Default)]
struct PowerLoss {
    cycles: u32,
    writes: u64,
    flushes: u64,
    covered: u64,
    lost: usize,
}

fn power_loss_loop(cycles: u32, work: &Path, port: u16) -> anyhow::Result<PowerLoss> {
    let dir = work.join("power-loss");
    std::fs::create_dir_all(&dir)?;
    let exe = std::env::current_exe().context("locating this binary")?;
    let cmd = crate::harness::ServeCommand::new(exe, &crate::harness::ServerFiles::under(&dir))
        .flag("--listen", format!("127.0.0.1:{port}"))
        .flag("--volume-size", "4M")
        .flag("--nvs-size", "96M")
        .flag("--cache-size", "256K")
        .flag("--workers", "2")
        .args(["--power-loss-tracking"]);
    let region = Region {
        first: 0,
        count: 1024,
    };
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut out = PowerLoss::default();
    let bar = crate::report::progress(u64::from(cycles), "power losses");
    let mut rng = 0x0bad_c0de_1234_5678u64;
    for _ in 0..cycles {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let server = cmd.start()?;
        let addr = server.addr().to_owned();
        let (l, seed) = (Arc::clone(&ledger), rng);
        let writer = std::thread::spawn(move || {
            ledger::write_until(&addr, region, &l, 8, seed, &AtomicBool::new(false))
        });
        std::thread::sleep(Duration::from_micros(5_000 + rng % 40_000));
        // The process ends right after answering, or before.
        let _ = server.admin("inject power-loss");
        let answered = writer.join().unwrap_or_default();
        server.kill9();
        let server = cmd.start()?;
        let verified = ledger::verify(server.addr(), region, &mut ledger.lock().expect("ledger"))?;
        for line in verified.lost.iter().take(5) {
            eprintln!("power loss: LOST {line}");
        }
        server.kill9();
        out.cycles += 1;
        out.writes += answered.writes;
        out.flushes += answered.flushes;
        out.covered += verified.covered;
        out.lost += verified.lost.len();
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// Run the experiment.
pub fn run(args: DeviceFaultsArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let work = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    let phases = if quick {
        Phases {
            warm: 1000,
            before: 1000,
            fault: 1500,
            after: 1000,
            longest: 60_000,
        }
    } else {
        Phases {
            warm: 3000,
            before: 2000,
            fault: 3000,
            after: 2000,
            longest: 300_000,
        }
    };
    let bar = crate::report::progress(CASES.len() as u64, "fault kinds");
    let mut out = Vec::new();
    for case in CASES {
        bar.set_message(case.name);
        out.push(run_case(case, work.path(), port, &phases)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let cycles = args.cycles.unwrap_or(if quick { 40 } else { 1000 });
    let power = power_loss_loop(cycles, work.path(), port)?;
    print_tables(&out, &power);
    println!(
        "fio randrw 75% reads, 4 KiB, QD16 on 1020 MiB of a 1 GiB volume over 3 file devices (scratch dir); the ledger client writes the last 4 MiB with a FLUSH every 8 requests; fault armed at 0 s for {:.1} s, then cleared",
        phases.fault as f64 / 1000.0
    );
    if !quick {
        let png = args.common.out.join("device-faults.png");
        line_chart_png(
            &png,
            "throughput around a device fault (fio randrw 4 KiB, QD16; armed at 0 s)",
            "seconds from arming the fault",
            "IOPS (100 ms windows)",
            &out.iter()
                .map(|o| (o.name.to_owned(), o.series.clone()))
                .collect::<Vec<_>>(),
        )?;
        println!("plot: {}", png.display());
    }
    let lost = out.iter().map(|o| o.lost).sum::<usize>() + power.lost;
    anyhow::ensure!(lost == 0, "{lost} acknowledged or flushed writes were lost");
    Ok(std::process::ExitCode::SUCCESS)
}

fn print_tables(out: &[Outcome], power: &PowerLoss) {
    let mut table = Table::new(&[
        "fault (device 1; striped: device 0)",
        "IOPS before",
        "during",
        "after",
        "FLUSH errors during",
        "after",
        "declared lost",
        "rebuilt after clear",
        "acked writes lost",
    ]);
    let pct = |x: f64, of: f64| {
        if of > 0.0 && x.is_finite() {
            format!("{} ({:.0}%)", thousands(x.round()), 100.0 * x / of)
        } else {
            "-".to_owned()
        }
    };
    let secs = |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.2} s", d.as_secs_f64()));
    for o in out {
        table.row(vec![
            o.name.to_owned(),
            thousands(o.before.round()),
            pct(o.during, o.before),
            pct(o.after, o.before),
            o.flush_errors.0.to_string(),
            o.flush_errors.1.to_string(),
            secs(o.declared),
            secs(o.rebuilt),
            o.lost.to_string(),
        ]);
    }
    println!("{}", table.render());
    let mut t = Table::new(&[
        "power losses",
        "writes acked",
        "FLUSHes acked",
        "flushed tracks verified",
        "flushed writes lost",
    ]);
    t.row(vec![
        power.cycles.to_string(),
        thousands(power.writes as f64),
        thousands(power.flushes as f64),
        thousands(power.covered as f64),
        power.lost.to_string(),
    ]);
    println!("{}", t.render());
}
