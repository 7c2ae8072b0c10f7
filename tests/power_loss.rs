//! The invariant under power loss: a write covered by a completed FLUSH is
//! never lost, and no read returns data that was not written.
//!
//! SIGKILL leaves the page cache, so the crash loops cannot show this:
//! here the server runs with `--power-loss-tracking` and is ended by
//! `rebound inject power-loss`, which undoes at random every device write
//! no completed `fdatasync` covered, loses the NVS (it lives in `/dev/shm`)
//! and the recovery box. The ledger client (`experiments::ledger`) writes
//! self-identifying versions of tracks with a FLUSH every few writes; after
//! every restart each track must hold a version no flushed write of it is
//! newer than, and nothing torn, foreign or invented.
//! `REBOUND_POWER_CYCLES` sets the cycles (default 100).

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Server;
use experiments::ledger::{self, Ledger, Region};

const REGION: Region = Region {
    first: 0,
    count: 1024,
};

/// `cycles` power losses, each after a random `5 ms + 0..spread` of the
/// ledger client's writes. While no flushed write has been verified yet
/// (on a loaded host a FLUSH can take longer than the whole window), up to
/// 20 more, each with half a second more, so that the check below is never
/// vacuous and never depends on the host's speed.
fn power_loss_loop(cycles: u32, extra: &[&str], spread: Duration) {
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
    let mut rng = 0x0bad_c0de_1234_5678u64;
    let (mut writes, mut flushes, mut covered) = (0, 0, 0);
    let mut cycle = 0;
    while cycle < cycles || (covered == 0 && cycle < cycles + 20) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let spread_us = u64::try_from(spread.as_micros()).unwrap().max(1);
        let longer = if cycle < cycles { 0 } else { 500_000 };
        let delay = Duration::from_micros(5_000 + rng % spread_us + longer);
        let client = {
            let (ledger, addr, seed) = (Arc::clone(&ledger), server.addr.clone(), rng);
            std::thread::spawn(move || {
                ledger::write_until(&addr, REGION, &ledger, 8, seed, &AtomicBool::new(false))
            })
        };
        std::thread::sleep(delay);
        match server.admin("inject power-loss") {
            Ok(answer) => assert!(answer.contains("power lost"), "{answer}"),
            // The process may end before the answer is read.
            Err(e) => assert!(!e.contains("power-loss needs"), "{e}"),
        }
        let answered = client.join().unwrap();
        assert_eq!(
            (answered.write_errors, answered.flush_errors),
            (0, 0),
            "no request fails before the power loss"
        );
        writes += answered.writes;
        flushes += answered.flushes;
        server.kill9();
        server.restart();
        let banner = server.banner();
        assert!(
            !banner.contains("fast restart"),
            "cycle {cycle}: the recovery box is lost with the power: {banner}"
        );
        let verified = ledger::verify(&server.addr, REGION, &mut ledger.lock().unwrap()).unwrap();
        assert!(
            verified.lost.is_empty(),
            "cycle {cycle}: {}",
            verified.lost.join("\n")
        );
        covered += verified.covered;
        cycle += 1;
    }
    eprintln!(
        "{cycle} power losses: {writes} writes and {flushes} FLUSHes acknowledged, {covered} flushed tracks verified"
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
    power_loss_loop(cycles, &[], Duration::from_millis(40));
}

#[test]
fn flushed_writes_survive_power_loss_on_a_mirror_and_under_output_commit() {
    power_loss_loop(
        25,
        &["--devices", "2", "--raid", "mirror"],
        Duration::from_millis(40),
    );
    // Under output commit a write is answered when its epoch commits (every
    // 20 ms), and a FLUSH covers only writes answered before it was sent:
    // a cycle must span several epochs for any write to be flushed.
    power_loss_loop(
        25,
        &["--output-commit", "stall"],
        Duration::from_millis(150),
    );
}

#[test]
fn power_loss_without_tracking_is_refused_and_the_server_keeps_serving() {
    let mut server = Server::start("4M", &[]);
    let e = server.admin("inject power-loss").unwrap_err();
    assert!(e.contains("--power-loss-tracking"), "{e}");
    assert!(server.alive(), "a refused power loss ends nothing");
}
