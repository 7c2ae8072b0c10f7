//! Rung 3's output commit on the real server (paper:
//! revive-io-output-commit): replies and device writes of an open epoch stay
//! inside the controller until the epoch commits, and a rollback takes them
//! back. Long epochs here make "before the commit" a wide window.

mod common;

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::Server;
use common::raw::{self, Raw};

const TRACK: u64 = 4096;

fn device_track(server: &Server, track: u64) -> Vec<u8> {
    let f = std::fs::File::open(server.dir.path().join("data/device0.img")).unwrap();
    let mut b = vec![0u8; TRACK as usize];
    f.read_exact_at(&mut b, track * TRACK).unwrap();
    b
}

fn status_field(status: &str, before: &str, after: &str) -> u64 {
    let line = status
        .lines()
        .find(|l| l.starts_with("output commit"))
        .unwrap_or_else(|| panic!("no output commit line: {status}"));
    let at = line.find(before).expect("field") + before.len();
    let rest = &line[at..];
    rest[..rest.find(after).expect("field end")]
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{line}"))
}

fn write(c: &mut Raw, cookie: u64, track: u64, byte: u8) {
    c.request(raw::CMD_WRITE, 0, cookie, track * TRACK, TRACK as u32);
    c.send(&vec![byte; TRACK as usize]);
}

fn reply_ok(c: &mut Raw, cookie: u64, len: usize) -> Vec<u8> {
    let (got, error, data) = c.simple_reply(len);
    assert_eq!((got, error), (cookie, 0), "request {cookie} failed");
    data
}

/// Under stall and buffering, a destage write of the open epoch is held:
/// the device keeps the committed data until the commit, a rollback drops
/// the held write, and the write (run again) still lands and is answered.
#[test]
fn under_stall_and_buffering_a_device_never_holds_data_of_a_rolled_back_epoch() {
    for scheme in ["stall", "buffering"] {
        let server = Server::start(
            "16M",
            &["--output-commit", scheme, "--checkpoint-interval", "2s"],
        );
        let mut c = Raw::go(&server.addr);
        // 0x11 committed and on the device (FLUSH is answered after the
        // commit that wrote and synced it).
        write(&mut c, 1, 5, 0x11);
        reply_ok(&mut c, 1, 0);
        c.request(raw::CMD_FLUSH, 0, 2, 0, 0);
        reply_ok(&mut c, 2, 0);
        assert!(device_track(&server, 5).iter().all(|&b| b == 0x11));
        let epoch = status_field(&server.admin("status").unwrap(), "epoch ", " every");
        // 0x22 in the open epoch: applied, destaged into the pseudo-device,
        // held there.
        write(&mut c, 3, 5, 0x22);
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            let status = server.admin("status").unwrap();
            if status_field(&status, "replies and ", " device writes held") == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{scheme}: no write held: {status}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(
            device_track(&server, 5).iter().all(|&b| b == 0x11),
            "{scheme}: the device got data of an uncommitted epoch"
        );
        let answer = server.admin("inject rollback").unwrap();
        assert!(
            answer.contains(&format!("epoch {epoch} rolled back")),
            "{scheme}: the epoch committed under the test (slow machine?): {answer}"
        );
        assert!(
            answer.contains("1 held device writes dropped"),
            "{scheme}: {answer}"
        );
        assert!(
            device_track(&server, 5).iter().all(|&b| b == 0x11),
            "{scheme}: the rolled-back write reached the device"
        );
        // The write runs again and is answered once, at a later commit.
        reply_ok(&mut c, 3, 0);
        c.request(raw::CMD_READ, 0, 4, 5 * TRACK, TRACK as u32);
        assert!(
            reply_ok(&mut c, 4, TRACK as usize)
                .iter()
                .all(|&b| b == 0x22)
        );
        let status = server.admin("status").unwrap();
        assert_eq!(common::rung_count(&status, "rollback"), 1, "{status}");
    }
}

/// A reply waits for its epoch to commit: with a long epoch a write is not
/// answered before the commit, and is answered after it.
#[test]
fn a_reply_waits_in_the_output_gate_until_its_epoch_commits() {
    let server = Server::start(
        "16M",
        &[
            "--output-commit",
            "buffering",
            "--checkpoint-interval",
            "1s",
        ],
    );
    let mut c = Raw::go(&server.addr);
    // Align with a commit first.
    write(&mut c, 1, 0, 0x01);
    reply_ok(&mut c, 1, 0);
    let started = Instant::now();
    write(&mut c, 2, 1, 0x02);
    let held = {
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut held = 0;
        while Instant::now() < deadline && held == 0 {
            held = status_field(&server.admin("status").unwrap(), "; ", " replies");
            std::thread::sleep(Duration::from_millis(2));
        }
        held
    };
    assert_eq!(held, 1, "the reply waits in the gate");
    reply_ok(&mut c, 2, 0);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(500),
        "answered after {waited:?}, before its epoch could commit"
    );
}

/// Rollback needs epochs: without output commit the admin socket says so
/// and the server keeps serving.
#[test]
fn rollback_without_output_commit_is_refused_clearly() {
    let server = Server::start("16M", &[]);
    let err = server.admin("inject rollback").unwrap_err();
    assert!(err.contains("rollback needs output commit"), "{err}");
    let mut c = Raw::go(&server.addr);
    write(&mut c, 1, 0, 0x5a);
    reply_ok(&mut c, 1, 0);
    let status = server.admin("status").unwrap();
    assert!(status.contains("output commit (rung 3): off"), "{status}");
}
