//! The invariant under power loss: a write covered by a completed FLUSH is
//! never lost, and no read returns data that was not written.
//!
//! SIGKILL leaves the page cache, so the crash loops cannot show this:
//! here the server runs with `--power-loss-tracking` and is ended by
//! `rebound inject power-loss`, which undoes at random every device write
//! no completed `fdatasync` covered, loses the NVS (it lives in `/dev/shm`)
//! and the recovery box. A pipelined client writes self-identifying
//! versions of tracks and sends a FLUSH every few writes, keeping a ledger:
//! a write acknowledged before a FLUSH was issued is *covered* once that
//! FLUSH is acknowledged. After every restart each track must hold a
//! version that no covered write of it is known to be newer than (none
//! acknowledged before a covered write was issued; overlapping writes are
//! unordered), and not zeroes once one was covered,
//! and an uncovered write may or may not have survived, but never torn,
//! foreign or invented. `REBOUND_POWER_CYCLES` sets the cycles (default
//! 100).

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Server;
use common::blocks::{TRACK, block, identify};
use common::raw::{self, Raw};

const TRACKS: u64 = 1024;

/// One write of a track.
#[derive(Debug, Clone, Copy)]
struct Rec {
    version: u64,
    issued: u64,
    acked: Option<u64>,
    covered: bool,
}

/// Every track's writes since its last verified state, and the FLUSHes.
#[derive(Default)]
struct Ledger {
    clock: u64,
    tracks: HashMap<u64, Vec<Rec>>,
    /// The verified state of each track (its base), or none (zeroes).
    base: HashMap<u64, u64>,
}

impl Ledger {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn issue(&mut self, track: u64, version: u64) {
        let issued = self.tick();
        self.tracks.entry(track).or_default().push(Rec {
            version,
            issued,
            acked: None,
            covered: false,
        });
    }

    fn ack(&mut self, track: u64, version: u64) {
        let now = self.tick();
        let rec = self
            .tracks
            .get_mut(&track)
            .and_then(|h| h.iter_mut().find(|r| r.version == version))
            .expect("an acknowledged write was issued");
        rec.acked = Some(now);
    }

    /// A FLUSH issued at `issued` was acknowledged: every write
    /// acknowledged before it is covered.
    fn flushed(&mut self, issued: u64) {
        for history in self.tracks.values_mut() {
            for r in history.iter_mut() {
                if r.acked.is_some_and(|a| a < issued) {
                    r.covered = true;
                }
            }
        }
    }

    /// Check what `track` holds after a power loss; it becomes the base.
    /// Whether it held a covered version.
    fn check(&mut self, track: u64, found: Option<u64>) -> Result<bool, String> {
        let history = self.tracks.remove(&track).unwrap_or_default();
        let base = self.base.get(&track).copied();
        let newest_covered = history
            .iter()
            .filter(|r| r.covered)
            .max_by_key(|r| r.issued);
        let verdict = match (found, newest_covered) {
            (None, Some(c)) => Err(format!("reads zeroes, but v{} was flushed", c.version)),
            (None, None) if base.is_some() => Err("reads zeroes over a verified version".into()),
            (None, None) => Ok(false),
            (Some(v), _) if Some(v) == base && newest_covered.is_none() => Ok(false),
            (Some(v), c) => match history.iter().find(|r| r.version == v) {
                None => Err(format!(
                    "holds v{v}, which is not in its history (base {base:?})"
                )),
                // Older than a flushed write: acknowledged before that
                // write was issued (overlapping writes are unordered).
                Some(f) => match history
                    .iter()
                    .find(|c| c.covered && f.acked.is_some_and(|a| a < c.issued))
                {
                    Some(c) => Err(format!("holds v{v}, older than the flushed v{}", c.version)),
                    None => Ok(c.is_some()),
                },
            },
        };
        match found {
            Some(v) => self.base.insert(track, v),
            None => self.base.remove(&track),
        };
        verdict.map_err(|e| format!("track {track} {e}; history {history:?}"))
    }
}

/// A request in flight: its writes, or a FLUSH issued at a tick.
enum Pending {
    Writes(Vec<(u64, u64)>),
    Flush(u64),
}

type Pendings = Arc<Mutex<HashMap<u64, Pending>>>;

/// Read replies until the connection breaks, entering them in the ledger;
/// the writes and FLUSHes acknowledged.
fn spawn_reader(
    mut rx: std::net::TcpStream,
    ledger: &Arc<Mutex<Ledger>>,
    pending: &Pendings,
    done: &Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64)> {
    let (ledger, pending, done) = (Arc::clone(ledger), Arc::clone(pending), Arc::clone(done));
    std::thread::spawn(move || {
        let (mut writes, mut flushes) = (0, 0);
        let mut h = [0u8; 16];
        while rx.read_exact(&mut h).is_ok() {
            let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
            let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
            assert_eq!(error, 0, "request {cookie} failed with error {error}");
            let p = pending
                .lock()
                .unwrap()
                .remove(&cookie)
                .expect("a known cookie");
            let mut l = ledger.lock().unwrap();
            match p {
                Pending::Writes(ws) => {
                    writes += 1;
                    for (t, v) in ws {
                        l.ack(t, v);
                    }
                }
                Pending::Flush(issued) => {
                    flushes += 1;
                    l.flushed(issued);
                }
            }
        }
        done.store(true, Ordering::SeqCst);
        (writes, flushes)
    })
}

/// Write (a FLUSH every few writes) until the connection breaks; the
/// writes and FLUSHes acknowledged.
fn write_until_power_loss(
    addr: &str,
    ledger: &Arc<Mutex<Ledger>>,
    next_version: &mut u64,
    seed: u64,
) -> (u64, u64) {
    let Some(r) = Raw::try_go(addr) else {
        return (0, 0);
    };
    let mut tx = r.s.try_clone().unwrap();
    let rx = r.s;
    let pending: Pendings = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(rx, ledger, &pending, &done);
    let mut rng = seed | 1;
    let mut cookie = 0u64;
    while !done.load(Ordering::SeqCst) {
        if pending.lock().unwrap().len() >= 16 {
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        cookie += 1;
        let mut req = Vec::new();
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        if rng.is_multiple_of(8) {
            let issued = ledger.lock().unwrap().tick();
            pending
                .lock()
                .unwrap()
                .insert(cookie, Pending::Flush(issued));
            req.extend_from_slice(&raw::CMD_FLUSH.to_be_bytes());
            req.extend_from_slice(&cookie.to_be_bytes());
            req.extend_from_slice(&[0u8; 12]);
        } else {
            let tracks = 1 + (rng >> 60) % 3;
            let first = (rng >> 8) % (TRACKS - tracks);
            let mut payload = Vec::with_capacity(tracks as usize * TRACK);
            let mut writes = Vec::new();
            {
                let mut l = ledger.lock().unwrap();
                for t in first..first + tracks {
                    *next_version += 1;
                    payload.extend_from_slice(&block(t, *next_version));
                    writes.push((t, *next_version));
                    l.issue(t, *next_version);
                }
            }
            pending
                .lock()
                .unwrap()
                .insert(cookie, Pending::Writes(writes));
            req.extend_from_slice(&raw::CMD_WRITE.to_be_bytes());
            req.extend_from_slice(&cookie.to_be_bytes());
            req.extend_from_slice(&(first * TRACK as u64).to_be_bytes());
            req.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            req.extend_from_slice(&payload);
        }
        if tx.write_all(&req).is_err() {
            break;
        }
    }
    let _ = tx.shutdown(std::net::Shutdown::Both);
    reader.join().unwrap()
}

/// Every track after a restart; the tracks holding a flushed version.
fn verify(addr: &str, ledger: &mut Ledger) -> usize {
    let mut r = Raw::go(addr);
    let mut covered = 0;
    let tracks: Vec<u64> = (0..TRACKS).collect();
    for batch in tracks.chunks(64) {
        for &track in batch {
            r.request(raw::CMD_READ, 0, track, track * TRACK as u64, TRACK as u32);
        }
        let mut got = HashMap::new();
        for _ in batch {
            let (cookie, error, data) = r.simple_reply(TRACK);
            assert_eq!(error, 0, "read of track {cookie} failed");
            got.insert(cookie, data);
        }
        for &track in batch {
            let data = got.remove(&track).expect("every read is answered once");
            let found = identify(track, &data).unwrap_or_else(|e| panic!("{e}"));
            covered += usize::from(ledger.check(track, found).unwrap_or_else(|e| panic!("{e}")));
        }
    }
    r.request(raw::CMD_DISC, 0, 0, 0, 0);
    covered
}

fn power_loss_loop(cycles: u32, extra: &[&str]) {
    let mut args = vec![
        "--cache-size",
        "256K",
        "--workers",
        "2",
        "--power-loss-tracking",
    ];
    args.extend_from_slice(extra);
    let mut server = Server::start("4M", &args);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut next_version = 0u64;
    let mut rng = 0x0bad_c0de_1234_5678u64;
    let (mut writes, mut flushes, mut covered) = (0, 0, 0);
    for cycle in 0..cycles {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let delay = Duration::from_micros(5_000 + rng % 40_000);
        let client = {
            let (ledger, addr) = (Arc::clone(&ledger), server.addr.clone());
            let mut v = next_version;
            let seed = rng;
            std::thread::spawn(move || {
                let acked = write_until_power_loss(&addr, &ledger, &mut v, seed);
                (acked, v)
            })
        };
        std::thread::sleep(delay);
        match server.admin("inject power-loss") {
            Ok(answer) => assert!(answer.contains("power lost"), "{answer}"),
            // The process may end before the answer is read.
            Err(e) => assert!(!e.contains("power-loss needs"), "{e}"),
        }
        let ((w, f), v) = client.join().unwrap();
        next_version = v;
        writes += w;
        flushes += f;
        server.kill9();
        server.restart();
        let banner = server.banner();
        assert!(
            !banner.contains("fast restart"),
            "cycle {cycle}: the recovery box is lost with the power: {banner}"
        );
        covered += verify(&server.addr, &mut ledger.lock().unwrap());
    }
    eprintln!(
        "{cycles} power losses: {writes} writes and {flushes} FLUSHes acknowledged, {covered} flushed tracks verified"
    );
    assert!(
        flushes > 0 && covered > 0,
        "nothing was flushed and verified"
    );
}

#[test]
fn flushed_writes_survive_power_loss_cycles() {
    let cycles = std::env::var("REBOUND_POWER_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    power_loss_loop(cycles, &[]);
}

#[test]
fn flushed_writes_survive_power_loss_on_a_mirror_and_under_output_commit() {
    power_loss_loop(25, &["--devices", "2", "--raid", "mirror"]);
    power_loss_loop(25, &["--output-commit", "stall"]);
}

#[test]
fn power_loss_without_tracking_is_refused_and_the_server_keeps_serving() {
    let mut server = Server::start("4M", &[]);
    let e = server.admin("inject power-loss").unwrap_err();
    assert!(e.contains("--power-loss-tracking"), "{e}");
    assert!(server.alive(), "a refused power loss ends nothing");
}
