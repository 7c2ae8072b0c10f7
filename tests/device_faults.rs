//! The environment's faults through real clients: `rebound inject
//! device-error` (the command line, as an operator would) on a running
//! server, qemu-io as the client.
//!
//! - a device whose syncs fail: writes are acknowledged into the NVS, every
//!   FLUSH answers EIO (never once, then success), reads return the data,
//!   `rebound status` names the device; cleared, FLUSH succeeds and the
//!   data is on the device;
//! - a mirror device whose reads fail: every byte is served from the other
//!   copy and the device is not lost;
//! - a striped volume whose device writes fail: writes fill the NVS, then
//!   are refused at once with EIO instead of hanging.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, qemu_io, qemu_io_run};

/// `rebound inject ARGS --admin SOCKET`; its output, which must succeed.
fn inject(server: &Server, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .arg("inject")
        .args(args)
        .arg("--admin")
        .arg(server.admin_path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "rebound inject {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// qemu-io commands that may fail, with cache mode `cache` (writeback, or
/// writethrough for FUA writes): the output and whether it succeeded.
fn qemu_io_may_fail(uri: &str, cache: &str, commands: &[&str]) -> (String, bool) {
    qemu_io_run(&["-f", "raw", "-t", cache, uri], commands)
}

#[test]
fn a_failing_sync_fails_every_flush_until_it_heals_and_loses_nothing() {
    let server = Server::start("16M", &[]);
    let uri = server.uri();
    let answer = inject(
        &server,
        &[
            "device-error",
            "--device",
            "0",
            "--op",
            "sync",
            "--errno",
            "eio",
        ],
    );
    assert!(answer.contains("sync fails with EIO"), "{answer}");
    // Writeback: qemu-io's default (writethrough) would send FUA writes,
    // which fail with the sync too.
    qemu_io(
        &["-f", "raw", "-t", "writeback", &uri],
        &["write -P 0x5a 0 1M".into()],
    );
    let (text, _) = qemu_io_may_fail(&uri, "writethrough", &["write -P 0x5b 1M 4k"]);
    assert!(
        text.contains("write failed") && text.contains("Input/output error"),
        "a writethrough (FUA) write fails while syncs fail: {text}"
    );
    for attempt in 0..3 {
        // qemu-io's flush says nothing; its exit status tells.
        let (text, ok) = qemu_io_may_fail(&uri, "writeback", &["flush"]);
        assert!(!ok, "FLUSH {attempt} while syncs fail succeeded: {text}");
    }
    qemu_io(&["-f", "raw", &uri], &["read -P 0x5a 0 1M".into()]);
    let status = server.admin("status").unwrap();
    assert!(
        status.contains("errors: read 0, write 0, sync") && status.contains("injected"),
        "status names the failing device:\n{status}"
    );
    inject(&server, &["clear"]);
    // A FLUSH that joins a sync started before the clear shares its
    // failure (the sync gate is conservative: `backend/syncgate.rs`), so
    // the device heals at the first sync that starts after the clear.
    let healed = (0..10).any(|_| {
        let (_, ok) = qemu_io_may_fail(&uri, "writeback", &["flush"]);
        ok || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            false
        }
    });
    assert!(healed, "FLUSH still fails after the fault was cleared");
    qemu_io(
        &["-f", "raw", &uri],
        &["flush".into(), "read -P 0x5a 0 1M".into()],
    );
    let on_device = std::fs::read(server.dir.path().join("data/device0.img")).unwrap();
    assert!(
        on_device[..1 << 20].iter().all(|&b| b == 0x5a),
        "after the FLUSH the data is on the device"
    );
}

#[test]
fn a_mirror_device_failing_reads_is_served_around_and_kept() {
    // A small cache: the reads come from the devices.
    let server = Server::start(
        "32M",
        &["--devices", "2", "--raid", "mirror", "--cache-size", "256K"],
    );
    let uri = server.uri();
    qemu_io(
        &["-f", "raw", &uri],
        &["write -P 0x33 0 16M".into(), "flush".into()],
    );
    inject(&server, &["device-error", "--device", "1", "--op", "read"]);
    let (text, ok) = qemu_io_may_fail(&uri, "writeback", &["read -P 0x33 0 16M"]);
    assert!(ok && !text.contains("failed"), "{text}\n{}", server.log());
    let status = server.admin("status").unwrap();
    assert!(
        !status.contains("DEGRADED"),
        "read errors lose no device:\n{status}"
    );
    assert!(status.contains("errors: read "), "{status}");
}

#[test]
fn a_full_nvs_over_failing_devices_refuses_writes_promptly() {
    let server = Server::start("256M", &["--nvs-size", "72M"]);
    let uri = server.uri();
    inject(&server, &["device-error", "--device", "0", "--op", "write"]);
    let started = Instant::now();
    let (text, _) = qemu_io_may_fail(&uri, "writeback", &["write -P 0x11 0 128M"]);
    assert!(
        text.contains("write failed") && text.contains("Input/output error"),
        "a write the NVS cannot take fails: {text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "refused promptly ({:?})",
        started.elapsed()
    );
    // What the NVS took is still read back, and once the device heals
    // it reaches the device. The failed destages are retried at the next
    // destage tick (100 ms): until one succeeds the NVS is still full and
    // destage still failing, so a write in between is refused as before.
    inject(&server, &["clear"]);
    let healed = (0..25).any(|_| {
        let (_, ok) = qemu_io_may_fail(&uri, "writeback", &["write -P 0x22 0 1M", "flush"]);
        ok || {
            std::thread::sleep(Duration::from_millis(200));
            false
        }
    });
    assert!(healed, "writes still fail 5 s after the fault was cleared");
    qemu_io(&["-f", "raw", &uri], &["read -P 0x22 0 1M".into()]);
}
