//! The invariant under crashes: a write acknowledged to a client is never
//! lost, and a read never returns data that was not written.
//!
//! A pipelined client writes self-identifying versions of tracks (each 4 KiB
//! block names its track and version and is filled from both), recording
//! when each write was issued and when it was acknowledged (one event clock),
//! while the server is SIGKILLed at a random moment. After the restart each
//! track must hold a version F that real-time order allows: no acknowledged
//! write of the track was issued after F was acknowledged (NBD orders only
//! writes that do not overlap in flight; an unacknowledged write may or may
//! not have landed). Never older data, never a torn block, never bytes
//! nobody wrote.
//!
//! Runs twice: restarting from the recovery box (rung 5; every restart must
//! be a fast restart), and with the box damaged before every restart
//! (truncated, a header bit flipped, or deleted: every restart must be a
//! hard restart, rung 6). `REBOUND_CRASH_KILLS` sets the kills per run
//! (default 150 and 100). Also on mirror and parity volumes losing a device
//! every few rounds (rung 7: kills while degraded and mid-rebuild), on a
//! parity volume whose device file is deleted after every kill (the RAID-5
//! write hole, closed by the partial parity log: without its replay this
//! failed 2 runs in 3 at 100 rounds), under every output commit scheme,
//! and on mirror and parity volumes with device errors armed.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Server;
use common::raw::{self, Raw};
use experiments::ledger::{TRACK, block, identify};

const TRACKS: u64 = 1024;

/// One write of a track: its version, when it was issued and acknowledged.
#[derive(Debug, Clone, Copy)]
struct Rec {
    version: u64,
    issued: u64,
    acked: Option<u64>,
}

/// The history of every track since its last verified state.
#[derive(Default)]
struct Ledger {
    clock: u64,
    tracks: HashMap<u64, Vec<Rec>>,
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
        });
    }

    fn ack(&mut self, track: u64, version: u64) {
        let now = self.tick();
        let rec = self
            .tracks
            .get_mut(&track)
            .and_then(|h| h.iter_mut().find(|r| r.version == version))
            .expect("acknowledged write was issued");
        rec.acked = Some(now);
    }

    /// Check what a track holds after a crash; it becomes the new base.
    fn check(&mut self, track: u64, found: Option<u64>) -> Result<bool, String> {
        let history = self.tracks.remove(&track).unwrap_or_default();
        let any_acked = history.iter().any(|r| r.acked.is_some());
        let verdict = match found {
            None if !any_acked => Ok(false),
            None => Err("holds nothing although writes were acknowledged".to_owned()),
            Some(v) => match history.iter().find(|r| r.version == v) {
                None => Err(format!("holds v{v}, which is not in its history")),
                Some(f) => match f.acked {
                    Some(a) => match history.iter().find(|w| w.acked.is_some() && w.issued > a) {
                        Some(w) => Err(format!(
                            "holds v{v} (acknowledged at {a}) but v{} was issued at {} and acknowledged",
                            w.version, w.issued
                        )),
                        None => Ok(true),
                    },
                    None => Ok(false),
                },
            },
        };
        if let Some(v) = found {
            self.tracks.insert(
                track,
                vec![Rec {
                    version: v,
                    issued: 0,
                    acked: Some(0),
                }],
            );
        }
        verdict.map_err(|e| format!("track {track} {e}; history {history:?}"))
    }
}

/// Writes in flight: cookie -> (track, version) per track written.
type InFlight = HashMap<u64, Vec<(u64, u64)>>;

/// Write until the connection breaks (the kill) or `stop` is set (then
/// every write in flight is answered first); returns the writes issued and
/// whether the connection broke.
fn write_until_killed(
    addr: &str,
    ledger: &Arc<Mutex<Ledger>>,
    next_version: &mut u64,
    seed: u64,
    stop: &AtomicBool,
) -> (u64, bool) {
    // The kill may land before the handshake completes: nothing issued.
    let Some(r) = Raw::try_go(addr) else {
        return (0, true);
    };
    let mut tx = r.s.try_clone().unwrap();
    let mut rx = r.s;
    let cookies: Arc<Mutex<InFlight>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (ledger, cookies, done) = (Arc::clone(ledger), Arc::clone(&cookies), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut h = [0u8; 16];
            while rx.read_exact(&mut h).is_ok() {
                let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
                let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
                assert_eq!(error, 0, "a write failed with error {error}");
                let writes = cookies
                    .lock()
                    .unwrap()
                    .remove(&cookie)
                    .expect("reply to a known cookie");
                let mut l = ledger.lock().unwrap();
                for (track, version) in writes {
                    l.ack(track, version);
                }
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let mut rng = seed | 1;
    let mut issued = 0;
    let mut cookie = 0u64;
    while !done.load(Ordering::SeqCst) {
        if stop.load(Ordering::SeqCst) {
            if cookies.lock().unwrap().is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        if cookies.lock().unwrap().len() >= 16 {
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
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
        cookie += 1;
        cookies.lock().unwrap().insert(cookie, writes);
        let mut req = Vec::with_capacity(28 + payload.len());
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&raw::CMD_WRITE.to_be_bytes());
        req.extend_from_slice(&cookie.to_be_bytes());
        req.extend_from_slice(&(first * TRACK as u64).to_be_bytes());
        req.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        req.extend_from_slice(&payload);
        if tx.write_all(&req).is_err() {
            break;
        }
        issued += 1;
    }
    let broke = done.load(Ordering::SeqCst);
    let _ = tx.shutdown(std::net::Shutdown::Both);
    reader.join().unwrap();
    (issued, broke)
}

/// After a restart: every track holds a version real-time order allows.
/// Returns the number of tracks found holding an acknowledged version.
fn verify(addr: &str, ledger: &mut Ledger) -> usize {
    let mut r = Raw::go(addr);
    let mut checked = 0;
    // Reads in batches of 64 in flight (replies come in any order): under
    // output commit each one waits for an epoch to commit.
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
            match ledger.check(track, found) {
                Ok(acked) => checked += usize::from(acked),
                Err(e) => panic!("{e}"),
            }
        }
    }
    r.request(raw::CMD_DISC, 0, 0, 0, 0);
    checked
}

/// What to do to the recovery box between the kill and the restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BoxDamage {
    /// Nothing: every restart must be a fast restart (rung 5).
    None,
    /// Truncate, flip a header bit, or delete it: every restart must be a
    /// hard restart (rung 6), still losing nothing acknowledged.
    Damage,
}

fn damage(path: &std::path::Path, kill: u32, rng: u64) {
    match kill % 3 {
        0 => {
            let len = std::fs::metadata(path).unwrap().len();
            let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            f.set_len(len / 2).unwrap();
        }
        1 => {
            let mut bytes = std::fs::read(path).unwrap();
            bytes[(rng % 64) as usize] ^= 1 << (rng % 8);
            std::fs::write(path, bytes).unwrap();
        }
        _ => std::fs::remove_file(path).unwrap(),
    }
}

fn crash_loop(kills: u32, box_damage: BoxDamage, extra: &[&str]) {
    crash_loop_with(kills, box_damage, extra, None);
}

/// The crash loop; with `lose_every = Some(n)`, every n-th round first
/// loses a device (`inject lose-device`, the devices in turn), so kills land
/// while the volume is degraded and while its replacement is rebuilt.
fn crash_loop_with(kills: u32, box_damage: BoxDamage, extra: &[&str], lose_every: Option<u32>) {
    let mut args = vec!["--cache-size", "256K", "--workers", "2"];
    args.extend_from_slice(extra);
    let mut server = Server::start("4M", &args);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut next_version = 0u64;
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut total_issued = 0;
    let mut total_checked = 0;
    let mut losses = 0;
    for kill in 0..kills {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let delay = Duration::from_micros(2_000 + rng % 40_000);
        if let Some(n) = lose_every
            && kill % n == 0
        {
            let device = (kill / n) % 3;
            match server.admin(&format!("inject lose-device {device}")) {
                Ok(answer) => {
                    assert!(answer.contains("lost"), "{answer}");
                    losses += 1;
                }
                // The previous loss is still being rebuilt.
                Err(e) => assert!(e.contains("lost or rebuilding"), "{e}"),
            }
        }
        let addr = server.addr.clone();
        let killer = std::thread::spawn(move || std::thread::sleep(delay));
        let writer = {
            let (ledger, addr) = (Arc::clone(&ledger), addr.clone());
            let mut v = next_version;
            let seed = rng;
            std::thread::spawn(move || {
                let (n, _) =
                    write_until_killed(&addr, &ledger, &mut v, seed, &AtomicBool::new(false));
                (n, v)
            })
        };
        killer.join().unwrap();
        server.kill9();
        let (issued, v) = writer.join().unwrap();
        next_version = v;
        total_issued += issued;
        if box_damage == BoxDamage::Damage {
            damage(&server.rbox, kill, rng);
        }
        server.restart();
        let banner = server.banner();
        match box_damage {
            BoxDamage::None => assert!(
                banner.contains("fast restart"),
                "restart {kill} was not fast: {banner}"
            ),
            BoxDamage::Damage => assert!(
                banner.contains("hard restart"),
                "restart {kill} was not hard: {banner}"
            ),
        }
        total_checked += verify_or_keep(&server, &ledger);
        assert!(
            kill < 3 || total_issued > 0,
            "the client never got to write"
        );
    }
    eprintln!(
        "{kills} kills ({box_damage:?}), {losses} devices lost, {total_issued} writes issued, {total_checked} acknowledged tracks verified"
    );
    if lose_every.is_some() {
        assert!(
            losses >= 2,
            "a device must be lost again after a rebuild that ran through kills ended"
        );
    }
    assert!(total_checked > 0, "nothing was verified");
}

/// [`verify`] after a restart; a failure first keeps the evidence
/// ([`keep_for_postmortem`]), then fails the test as it would have.
fn verify_or_keep(server: &Server, ledger: &Mutex<Ledger>) -> usize {
    let verified = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        verify(&server.addr, &mut ledger.lock().unwrap())
    }));
    verified.unwrap_or_else(|lost| {
        keep_for_postmortem(server);
        std::panic::resume_unwind(lost)
    })
}

/// A failed verification keeps the evidence: the NVS, the recovery box,
/// the server's log and its data directory (devices), copied to
/// `$REBOUND_POSTMORTEM_DIR` (default `/tmp/rebound-crash-loop-postmortem`).
fn keep_for_postmortem(server: &Server) {
    let dir = std::env::var_os("REBOUND_POSTMORTEM_DIR").map_or_else(
        || "/tmp/rebound-crash-loop-postmortem".into(),
        std::path::PathBuf::from,
    );
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let _ = std::fs::copy(&server.nvs, dir.join("nvs"));
    let _ = std::fs::copy(&server.rbox, dir.join("box"));
    let _ = std::fs::write(dir.join("server.log"), server.log());
    let _ = std::process::Command::new("cp")
        .arg("-r")
        .arg(server.dir.path())
        .arg(dir.join("data"))
        .status();
    eprintln!("evidence kept in {}", dir.display());
}

/// Send `request` (a rung 3 or 4 recovery) to the admin socket, asking
/// again while a recovery escalated from cache.apply still runs (refused
/// as already running; up to 5 s); the answer.
fn admin_when_no_recovery_runs(server: &Server, request: &str) -> String {
    (0..500)
        .find_map(|_| match server.admin(request) {
            Err(e) if e.contains("already running") => {
                std::thread::sleep(Duration::from_millis(10));
                None
            }
            other => Some(other),
        })
        .expect("the running recovery ended within 5 s")
        .unwrap()
}

fn kills(default: u32) -> u32 {
    std::env::var("REBOUND_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn acknowledged_writes_survive_repeated_sigkill_with_fast_restart() {
    crash_loop(kills(150), BoxDamage::None, &[]);
}

#[test]
fn acknowledged_writes_survive_sigkill_when_the_recovery_box_is_damaged() {
    crash_loop(kills(100), BoxDamage::Damage, &[]);
}

/// Rung 4 under load: one connection writes throughout while the server
/// runs system recoveries on request, with the recovery box abandoned half
/// way (rebuilt from an NVS scan from then on); writes also fail in the
/// middle of `cache.apply` (each rolled back alone through Log(Lock) at
/// rung 1, or escalated to rung 4 when another request touched a shard it
/// changed). The connection
/// never breaks, no write is answered with an error, and every track then
/// holds a version real-time order allows.
#[test]
fn acknowledged_writes_survive_system_recoveries_with_the_connection_up() {
    let server = Server::start("4M", &["--cache-size", "256K", "--workers", "2"]);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (ledger, addr, stop) = (Arc::clone(&ledger), server.addr.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut v = 0;
            write_until_killed(&addr, &ledger, &mut v, 0x5eed, &stop)
        })
    };
    let rounds = 30;
    let mut injected = 0;
    let mut escalations = 0;
    for round in 0..rounds {
        std::thread::sleep(Duration::from_millis(20));
        if round == rounds / 2 {
            let answer = server.admin("inject abandon-box").unwrap();
            assert!(answer.contains("invalidated"), "{answer}");
        }
        if round % 3 == 2 {
            server
                .admin("inject panic cache.apply.track count=1")
                .unwrap();
            escalations += 1;
            continue;
        }
        // A failure escalated from cache.apply may still be in its own
        // rung 4 (longer on a loaded machine): this one waits its turn.
        let answer = admin_when_no_recovery_runs(&server, "inject system");
        assert!(answer.contains("rung 4 system recovery"), "{answer}");
        eprintln!("{}", answer.trim());
        if round >= rounds / 2 {
            assert!(answer.contains("NVS scan"), "{answer}");
        } else {
            assert!(answer.contains("from the recovery box"), "{answer}");
        }
        injected += 1;
    }
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::SeqCst);
    let (issued, broke) = writer.join().unwrap();
    assert!(!broke, "the connection broke during system recoveries");
    assert!(issued > 0, "the client never got to write");
    let status = server.admin("status").unwrap();
    let system = common::rung_count(&status, "system");
    let task = common::rung_count(&status, "task");
    // Each write failing inside cache.apply was either rolled back alone
    // through Log(Lock) and redriven (rung 1), or escalated (rung 4): to a
    // recovery of its own, or parked and redriven by an injected one
    // already running (then it adds no count). A lost escalation would
    // leave its request unanswered: the writer's drain and the check of
    // every track below catch that.
    assert!(system >= injected, "{status}");
    let own = task + (system - injected);
    assert!(
        own <= escalations && escalations - own <= injected,
        "{injected} injected system recoveries, {escalations} failures inside cache.apply:\n{status}"
    );
    let checked = verify(&server.addr, &mut ledger.lock().unwrap());
    eprintln!(
        "{system} system recoveries, {issued} writes issued, {checked} acknowledged tracks verified"
    );
    assert!(checked > 0, "nothing was verified");
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

/// Rung 5 under output commit (rung 3's epochs): replies and device writes
/// held at the kill, NVS slots whose release waits for a commit, and a
/// destage whose held write never reached the device all come back from
/// the recovery box and the NVS. A short epoch makes kills land in every
/// phase of the commit.
#[test]
fn acknowledged_writes_survive_sigkill_under_every_output_commit_scheme() {
    for scheme in ["stall", "buffering", "logging", "renaming"] {
        crash_loop(
            kills(150) / 6,
            BoxDamage::None,
            &["--output-commit", scheme, "--checkpoint-interval", "2ms"],
        );
    }
}

/// A lost device (rung 7) under the crash loop: on a mirror and on a
/// parity volume a device is lost every few rounds, with the rebuild
/// throttled so kills land while it runs; every restart resumes the rebuild
/// from its label, and every acknowledged write reads back (through the
/// 256 KiB cache, so mostly from the degraded devices) as its newest
/// version. Once more on parity under output commit's `logging` scheme,
/// whose undo reads the old data through the degraded volume.
#[test]
fn acknowledged_writes_survive_sigkill_while_a_device_is_lost_and_rebuilt() {
    for (raid, commit) in [
        ("mirror", &[][..]),
        ("parity", &[][..]),
        (
            "parity",
            &["--output-commit", "logging", "--checkpoint-interval", "2ms"][..],
        ),
    ] {
        let mut args = vec!["--devices", "3", "--raid", raid, "--rebuild-rate", "4M"];
        args.extend_from_slice(commit);
        crash_loop_with(kills(150) / 4, BoxDamage::None, &args, Some(8));
    }
}

/// The RAID-5 write hole under the crash loop: the server is SIGKILLed in
/// the middle of writing (destage rewrites parity stripes throughout), and
/// while it is down a device file is deleted, so the restart finds the
/// device lost and rebuilds it from stripes a kill may have left torn (the
/// data slot of a write new, its parity old). The partial parity log's
/// replay at the restart makes them whole first: every acknowledged write
/// reads back as its newest version, also on the rebuilt device.
#[test]
fn acknowledged_writes_survive_sigkill_then_a_device_file_lost_while_down() {
    let mut server = Server::start(
        "4M",
        &[
            "--cache-size",
            "256K",
            "--workers",
            "2",
            "--devices",
            "3",
            "--raid",
            "parity",
        ],
    );
    let data = server.dir.path().join("data");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut next_version = 0u64;
    let mut rng = 0x0ddb_a11c_afe5_eed5u64;
    let (mut issued, mut checked) = (0, 0);
    let rounds = kills(150) / 6;
    for round in 0..rounds {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let delay = Duration::from_micros(5_000 + rng % 40_000);
        let writer = {
            let (ledger, addr) = (Arc::clone(&ledger), server.addr.clone());
            let (mut v, seed) = (next_version, rng);
            std::thread::spawn(move || {
                let (n, _) =
                    write_until_killed(&addr, &ledger, &mut v, seed, &AtomicBool::new(false));
                (n, v)
            })
        };
        std::thread::sleep(delay);
        server.kill9();
        let (n, v) = writer.join().unwrap();
        (issued, next_version) = (issued + n, v);
        let lost = round % 3;
        std::fs::remove_file(data.join(format!("device{lost}.img"))).unwrap();
        server.restart();
        assert!(
            server.log().contains("device file missing"),
            "round {round}: {}",
            server.log()
        );
        common::wait_status(&server, "the rebuild", Duration::from_secs(60), |s| {
            !s.contains("DEGRADED")
        });
        checked += verify_or_keep(&server, &ledger);
    }
    eprintln!(
        "{rounds} kills each followed by a lost device file, {issued} writes issued, {checked} acknowledged tracks verified"
    );
    assert!(issued > 0, "the client never got to write");
}

/// Rung 3 under load, for each output commit scheme: one connection writes
/// throughout while the server rolls back to its last checkpoint on
/// request, and writes fail in the middle of `cache.apply` (rolled back
/// alone through Log(Lock) at rung 1, or, when another request touched a
/// shard they changed, escalated: rung 3 now, not rung 4). The connection
/// never breaks, no write is answered with an error, no system recovery
/// runs, and every track then holds a version real-time order allows: no
/// acknowledgement was sent for work a rollback took away.
#[test]
fn acknowledged_writes_survive_rollbacks_with_the_connection_up() {
    for scheme in ["stall", "buffering", "logging", "renaming"] {
        let server = Server::start(
            "4M",
            &[
                "--cache-size",
                "256K",
                "--workers",
                "2",
                "--output-commit",
                scheme,
                "--checkpoint-interval",
                "5ms",
            ],
        );
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (ledger, addr, stop) =
                (Arc::clone(&ledger), server.addr.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut v = 0;
                write_until_killed(&addr, &ledger, &mut v, 0xfeed, &stop)
            })
        };
        let rounds = 24;
        let mut injected = 0;
        for round in 0..rounds {
            std::thread::sleep(Duration::from_millis(15));
            if round % 4 == 3 {
                server
                    .admin("inject panic cache.apply.track count=1")
                    .unwrap();
                continue;
            }
            // A panic inside cache.apply may have escalated to rung 4: a
            // rollback asked meanwhile is refused as already running.
            let answer = admin_when_no_recovery_runs(&server, "inject rollback");
            assert!(answer.contains("rung 3 rollback"), "{answer}");
            injected += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::SeqCst);
        let (issued, broke) = writer.join().unwrap();
        assert!(!broke, "{scheme}: the connection broke during rollbacks");
        assert!(issued > 0, "{scheme}: the client never got to write");
        let status = server.admin("status").unwrap();
        let rollbacks = common::rung_count(&status, "rollback");
        assert!(rollbacks >= injected, "{scheme}: {status}");
        assert_eq!(
            common::rung_count(&status, "system"),
            0,
            "{scheme}: escalations take rung 3 under output commit:\n{status}"
        );
        let checked = verify(&server.addr, &mut ledger.lock().unwrap());
        eprintln!(
            "{scheme}: {rollbacks} rollbacks, {issued} writes issued, {checked} acknowledged tracks verified"
        );
        assert!(checked > 0, "{scheme}: nothing was verified");
        assert!(
            !server.log().contains("answering EIO"),
            "{scheme}: no request failed"
        );
    }
}

/// The environment's faults under the crash loop: a mirror and a parity
/// volume whose device 1 fails 2% of its writes and 5% of its reads
/// (armed at every start through `--inject`), killed at random. Reads are
/// served from the redundancy, repeated write errors declare the device
/// lost and rebuild it, and no acknowledged write is ever lost.
#[test]
fn acknowledged_writes_survive_sigkill_with_device_errors_armed() {
    for (raid, devices) in [("mirror", "2"), ("parity", "3")] {
        crash_loop(
            kills(150) / 5,
            BoxDamage::None,
            &[
                "--raid",
                raid,
                "--devices",
                devices,
                "--inject",
                "device-error 1 op=write rate=0.02",
                "--inject",
                "device-error 1 op=read rate=0.05",
            ],
        );
    }
}
