//! `rebound demo`: watch the recovery ladder in one command.
//!
//! Starts `rebound serve --supervise` on a scratch volume, runs a client
//! that writes version-stamped blocks and checks every block it reads back
//! (reconnecting by itself when the server goes away), and injects one
//! fault per rung through the admin socket:
//!
//! | at | fault | rung |
//! |---|---|---|
//! | 3 s | panics in `cache.read` and inside `cache.apply`, failures in `nvs.write` | 1: the failed stage's request is redriven (inside `cache.apply` after a Log(Lock) rollback; rung 3 if another request touched the write's shards) |
//! | 6 s | the scheduling paper's fault emulation in the cache group, for 2 s | 2: group recovery |
//! | 8 s | a rollback on request | 3: back to the last epoch checkpoint, the open epoch's requests run again (the server runs with `--output-commit buffering`) |
//! | 9 s | a system recovery on request | 4: in-process system recovery, connections up |
//! | 10 s | the process aborts | 5: fast restart from the recovery box (by the supervisor) |
//! | 14 s | the recovery box is invalidated, then the process aborts | 6: hard restart from an NVS scan |
//! | 17 s | a device is lost (the volume is RAID-5 over three devices) | 7: reads and writes served around it, a replacement rebuilt |
//!
//! A line per second shows the client's throughput; the final table shows,
//! per rung, the recoveries the server counted, the client's longest wait
//! for one request, and the acknowledged writes lost (read back at the end:
//! it must be 0).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use parking_lot::Mutex;

use crate::harness::{ServeCommand, Server, ServerFiles};
use crate::nbd_client::NbdClient;
use crate::report::{Table, thousands};

/// Options of `rebound demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Keep the scratch directory (server log, data) and print its path.
    #[arg(long)]
    keep: bool,
}

const TRACKS: u64 = 4096;
const BLOCK: usize = 4096;

fn block(track: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    for (i, chunk) in b.chunks_mut(16).enumerate() {
        chunk[..8].copy_from_slice(&track.to_le_bytes());
        chunk[8..].copy_from_slice(&(version ^ i as u64).to_le_bytes());
    }
    b
}

/// The version a block holds, if it is one of ours for `track`.
fn version_of(track: u64, b: &[u8]) -> Option<u64> {
    let v = u64::from_le_bytes(b[8..16].try_into().ok()?);
    (b == block(track, v).as_slice()).then_some(v)
}

/// What the client knows about each track.
#[derive(Debug, Default, Clone, Copy)]
struct TrackState {
    acked: u64,
    /// A write whose reply never came (a crash): it may or may not be there.
    maybe: u64,
}

struct Load {
    ops: AtomicU64,
    bad_reads: AtomicU64,
    /// Longest time one request waited, in µs, since the last reset.
    longest_us: AtomicU64,
    stop: AtomicBool,
    tracks: Mutex<Vec<TrackState>>,
}

fn run_load(addr: &str, load: &Load) {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_version = 0u64;
    let mut conn: Option<NbdClient> = None;
    let mut buf = vec![0u8; BLOCK];
    while !load.stop.load(Ordering::Relaxed) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let track = rng % TRACKS;
        let read = rng >> 62 == 0;
        let started = Instant::now();
        let c = loop {
            if let Some(c) = conn.as_mut() {
                break c;
            }
            if load.stop.load(Ordering::Relaxed) {
                return;
            }
            match NbdClient::connect(addr) {
                Ok(c) => conn = Some(c),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        let result = if read {
            c.read(track * BLOCK as u64, &mut buf).map(|()| {
                let st = load.tracks.lock()[track as usize];
                let ok = match version_of(track, &buf) {
                    Some(v) => v == st.acked || v == st.maybe,
                    None => st.acked == 0 && buf.iter().all(|&b| b == 0),
                };
                if !ok {
                    load.bad_reads.fetch_add(1, Ordering::Relaxed);
                }
            })
        } else {
            next_version += 1;
            let r = c.write(track * BLOCK as u64, &block(track, next_version));
            let mut tracks = load.tracks.lock();
            match r {
                Ok(()) => tracks[track as usize].acked = next_version,
                Err(_) => tracks[track as usize].maybe = next_version,
            }
            r
        };
        match result {
            Ok(()) => {
                load.ops.fetch_add(1, Ordering::Relaxed);
                let us = started.elapsed().as_micros() as u64;
                load.longest_us.fetch_max(us, Ordering::Relaxed);
            }
            Err(_) => conn = None,
        }
    }
}

/// Read every track back: acknowledged writes that are gone.
fn verify(addr: &str, load: &Load) -> anyhow::Result<u64> {
    let mut c = NbdClient::connect(addr)?;
    let tracks = load.tracks.lock().clone();
    let mut buf = vec![0u8; BLOCK];
    let mut lost = 0;
    for (t, st) in tracks.iter().enumerate() {
        c.read(t as u64 * BLOCK as u64, &mut buf)?;
        let ok = match version_of(t as u64, &buf) {
            Some(v) => v == st.acked || (v == st.maybe && st.maybe > st.acked),
            None => st.acked == 0,
        };
        lost += u64::from(!ok);
    }
    Ok(lost)
}

/// The recoveries `status` counts at `rung`; 0 when it has no count (a
/// status lost with a crash).
fn rung_count(status: &str, rung: &str) -> u64 {
    crate::harness::rung_count(status, rung).unwrap_or(0)
}

/// One fault of the demo.
#[derive(Debug)]
struct Phase {
    /// Seconds from the start.
    at: u64,
    rung: &'static str,
    fault: &'static str,
    /// The admin requests that inject it.
    requests: &'static [&'static str],
}

const PHASES: [Phase; 7] = [
    Phase {
        at: 3,
        rung: "1 task",
        fault: "panics in cache.read and inside cache.apply, failures in nvs.write",
        requests: &[
            "inject panic cache.read rate=0.02 count=100",
            "inject fail nvs.write rate=0.02 count=100",
            "inject panic cache.apply.track rate=0.02 count=20",
        ],
    },
    Phase {
        at: 6,
        rung: "2 group",
        fault: "group faults in cache (1 in 1,000 dispatches, 20 ms)",
        requests: &["inject group-fault cache rate=0.001 duration=20ms"],
    },
    Phase {
        at: 8,
        rung: "3 rollback",
        fault: "rollback to the last checkpoint on request",
        requests: &["inject clear", "inject rollback"],
    },
    Phase {
        at: 9,
        rung: "4 system",
        fault: "in-process system recovery on request",
        requests: &["inject system"],
    },
    Phase {
        at: 10,
        rung: "5 fast restart",
        fault: "the process aborts",
        requests: &["inject crash"],
    },
    Phase {
        at: 14,
        rung: "6 hard restart",
        fault: "recovery box invalidated, process aborts",
        requests: &["inject crash-damaged-box"],
    },
    Phase {
        at: 17,
        rung: "7 reconstruct",
        fault: "device 1 lost; served around, rebuilt",
        requests: &["inject lose-device 1"],
    },
];

/// Seconds the demo runs.
const END_S: u64 = 20;

/// Run the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<std::process::ExitCode> {
    let dir = crate::harness::scratch_dir()?;
    let port = crate::harness::free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let files = ServerFiles::under(dir.path());
    let server = ServeCommand::new(std::env::current_exe()?, &files)
        .args(["--supervise"])
        .flag("--listen", &addr)
        .flag("--volume-size", "256M")
        .flag("--nvs-size", "96M")
        .flag("--cache-size", "8M")
        .flag("--output-commit", "buffering")
        .flag("--devices", "3")
        .flag("--raid", "parity")
        .log_to(dir.path().join("server.log"))
        .ready_within(Duration::from_secs(30))
        .start()
        .context("starting rebound serve --supervise")?;
    println!(
        "rebound demo: server (supervised) on nbd://{addr}/, admin {}",
        files.admin_socket().display()
    );
    println!("a client writes and verifies 4 KiB blocks; one fault per rung follows\n");

    let load = Arc::new(Load {
        ops: AtomicU64::new(0),
        bad_reads: AtomicU64::new(0),
        longest_us: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        tracks: Mutex::new(vec![TrackState::default(); TRACKS as usize]),
    });
    let client = {
        let (load, addr) = (Arc::clone(&load), addr.clone());
        std::thread::spawn(move || run_load(&addr, &load))
    };
    let (rows, counted_before_crash) = run_phases(&server, &load);
    load.stop.store(true, Ordering::Relaxed);
    client
        .join()
        .map_err(|_| anyhow::anyhow!("the client thread panicked"))?;
    let lost = verify(&addr, &load)?;
    let after = server.admin("status").unwrap_or_default();
    print_table(&rows, &counted_before_crash, &after, lost);
    println!(
        "{} requests served; {} reads returned data never written or older than acknowledged",
        thousands(load.ops.load(Ordering::Relaxed) as f64),
        load.bad_reads.load(Ordering::Relaxed)
    );
    server.stop()?;
    if args.keep {
        let kept = dir.keep();
        println!("scratch directory kept: {} (server.log)", kept.display());
    }
    let bad = load.bad_reads.load(Ordering::Relaxed);
    Ok(if lost == 0 && bad == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

/// Inject each phase's fault at its time, printing the client's
/// throughput every second: per phase, the client's longest wait for one
/// request (µs) while it was current; and the server's status just before
/// the first crash (the counts of rungs 1 to 4 die with the process).
fn run_phases(server: &Server, load: &Load) -> (Vec<(&'static Phase, u64)>, String) {
    let start = Instant::now();
    let mut last_ops = 0;
    let mut rows = Vec::new();
    let mut counted_before_crash = String::new();
    let mut current: Option<&'static Phase> = None;
    for second in 1..=END_S {
        let target = start + Duration::from_secs(second);
        // Phases due within this second.
        for p in PHASES.iter().filter(|p| p.at == second - 1) {
            if p.rung.starts_with('5') {
                counted_before_crash = server.admin("status").unwrap_or_default();
            }
            if let Some(c) = current.take() {
                rows.push((c, load.longest_us.swap(0, Ordering::Relaxed)));
            }
            load.longest_us.store(0, Ordering::Relaxed);
            for r in p.requests {
                // A crash request may lose its answer with the process.
                let _ = server.admin(r);
            }
            if !p.rung.is_empty() {
                current = Some(p);
            }
        }
        std::thread::sleep(target.saturating_duration_since(Instant::now()));
        let ops = load.ops.load(Ordering::Relaxed);
        let note = current.map_or(String::new(), |c| {
            format!("  [rung {}: {}]", c.rung, c.fault)
        });
        println!(
            "{second:>4} s {:>10} ops/s{note}",
            thousands((ops - last_ops) as f64)
        );
        last_ops = ops;
    }
    if let Some(c) = current.take() {
        rows.push((c, load.longest_us.swap(0, Ordering::Relaxed)));
    }
    (rows, counted_before_crash)
}

/// Per rung, the recoveries the server counted (rungs 1 to 4 from the
/// status before the first crash) and the client's longest wait; the
/// acknowledged writes lost.
fn print_table(rows: &[(&Phase, u64)], before: &str, after: &str, lost: u64) {
    let mut table = Table::new(&[
        "rung",
        "fault",
        "recoveries",
        "longest client wait",
        "acknowledged writes lost",
    ]);
    for (phase, longest) in rows {
        let count = match phase.rung.split_whitespace().next() {
            Some("1") => rung_count(before, "task"),
            Some("2") => rung_count(before, "group"),
            Some("3") => rung_count(before, "rollback"),
            Some("4") => rung_count(before, "system"),
            Some("5") => 1,
            Some("6") => rung_count(after, "hard-restart"),
            // The loss and the end of its rebuild.
            Some("7") => rung_count(after, "reconstruct"),
            _ => 0,
        };
        table.row(vec![
            phase.rung.to_owned(),
            phase.fault.to_owned(),
            count.to_string(),
            format!("{:.1} ms", *longest as f64 / 1000.0),
            "-".into(),
        ]);
    }
    table.row(vec![
        "all".into(),
        format!("{} tracks read back", TRACKS),
        "".into(),
        "".into(),
        lost.to_string(),
    ]);
    println!("\n{}", table.render());
}
