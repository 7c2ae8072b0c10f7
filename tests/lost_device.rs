//! The failure model's lost device on the real server: a volume with
//! redundancy (`--raid mirror` or `parity`) loses a device (`rebound inject
//! lose-device`), keeps serving every byte through qemu-io, rebuilds a
//! replacement (rung 7, reconstruct), and keeps everything across kill -9,
//! including a kill in the middle of the rebuild, which the restart
//! resumes from the prefix its label records.

mod common;

use std::time::Duration;

use common::{Server, qemu_io, rung_count, wait_status};

const REBUILD_WAIT: Duration = Duration::from_secs(120);

#[test]
fn a_lost_device_is_served_around_and_rebuilt_losing_nothing() {
    for (raid, devices) in [("mirror", "2"), ("parity", "3")] {
        // A 1 MiB cache: the reads below come from the devices.
        let mut server = Server::start(
            "48M",
            &["--devices", devices, "--raid", raid, "--cache-size", "1M"],
        );
        let uri = server.uri();
        let target = ["-f", "raw", uri.as_str()];
        qemu_io(&target, &["write -P 0x41 0 32M".into(), "flush".into()]);
        // Through the command line, as an operator would.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(["inject", "lose-device", "--device", "1", "--admin"])
            .arg(server.admin_path())
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{answer}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(answer.contains("device 1 lost"), "{answer}");
        // Degraded (then rebuilding) reads and writes.
        qemu_io(
            &target,
            &[
                "read -P 0x41 0 32M".into(),
                "write -P 0x42 8M 8M".into(),
                "write -P 0x43 40M 8M".into(),
                "flush".into(),
                "read -P 0x42 8M 8M".into(),
            ],
        );
        let status = wait_status(&server, "the rebuild", REBUILD_WAIT, |s| {
            !s.contains("DEGRADED")
        });
        assert!(
            status.contains(&format!("volume: raid {raid} over {devices} devices")),
            "{status}"
        );
        assert!(rung_count(&status, "reconstruct") >= 2, "{status}");
        assert!(status.contains("device 1 lost"), "{status}");
        assert!(status.contains("device 1 rebuilt"), "{status}");
        let data = server.dir.path().join("data");
        assert!(data.join("device1.failed.img").exists());
        let label = std::fs::read_to_string(data.join("volume.toml")).unwrap();
        assert!(!label.contains("degraded"), "{label}");
        // Nothing acknowledged is lost across a crash; the data now comes
        // from the rebuilt device too.
        server.kill9();
        server.restart();
        let uri = server.uri();
        let target = ["-f", "raw", uri.as_str()];
        qemu_io(
            &target,
            &[
                "read -P 0x41 0 8M".into(),
                "read -P 0x42 8M 8M".into(),
                "read -P 0x41 16M 16M".into(),
                "read -P 0x43 40M 8M".into(),
            ],
        );
        assert!(!server.log().contains("answering EIO"), "{}", server.log());
    }
}

#[test]
fn a_kill_in_the_middle_of_a_rebuild_resumes_it_after_the_restart() {
    // Rebuild throttled to 8 MiB/s over 32 MiB per device: about 4 s, so
    // the kill lands in the middle.
    let mut server = Server::start(
        "64M",
        &[
            "--devices",
            "3",
            "--raid",
            "parity",
            "--cache-size",
            "1M",
            "--rebuild-rate",
            "8M",
        ],
    );
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x51 0 64M".into(), "flush".into()]);
    server.admin("inject lose-device 2").unwrap();
    wait_status(&server, "some rebuild progress", REBUILD_WAIT, |s| {
        s.lines()
            .any(|l| l.starts_with("device 2 ") && l.contains("rebuilding") && !l.contains(" 0 of"))
    });
    server.kill9();
    let label =
        std::fs::read_to_string(server.dir.path().join("data").join("volume.toml")).unwrap();
    assert!(
        label.contains("[[degraded]]") && label.contains("device = 2"),
        "{label}"
    );
    server.restart();
    let status = server.admin("status").unwrap();
    assert!(status.contains("DEGRADED"), "{status}");
    assert!(
        server.log().contains("resuming the rebuild"),
        "{}",
        server.log()
    );
    // Served while the rebuild goes on, and after it.
    let uri = server.uri();
    qemu_io(&["-f", "raw", uri.as_str()], &["read -P 0x51 0 64M".into()]);
    server.set_flag("--rebuild-rate", "0");
    server.kill9();
    server.restart();
    wait_status(&server, "the resumed rebuild", REBUILD_WAIT, |s| {
        !s.contains("DEGRADED")
    });
    let uri = server.uri();
    qemu_io(&["-f", "raw", uri.as_str()], &["read -P 0x51 0 64M".into()]);
}

#[test]
fn losing_a_device_without_redundancy_or_out_of_range_is_refused_and_serving_goes_on() {
    let server = Server::start("16M", &["--devices", "2"]);
    let e = server.admin("inject lose-device 0").unwrap_err();
    assert!(e.contains("no redundancy"), "{e}");
    let server2 = Server::start("16M", &["--devices", "2", "--raid", "mirror"]);
    for bad in [
        "inject lose-device 2",
        "inject lose-device x",
        "inject lose-device",
    ] {
        let e = server2.admin(bad).unwrap_err();
        assert!(e.contains("device"), "{bad}: {e}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["inject", "lose-device", "--admin"])
        .arg(server2.admin_path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device N"), "{err}");
    for s in [&server, &server2] {
        let uri = s.uri();
        qemu_io(
            &["-f", "raw", uri.as_str()],
            &["write -P 0x61 0 1M".into(), "read -P 0x61 0 1M".into()],
        );
        assert!(!s.admin("status").unwrap().contains("DEGRADED"));
    }
}

#[test]
fn a_raid_layout_needs_enough_devices_and_cannot_change_under_a_volume() {
    let mut server = Server::start("16M", &["--devices", "3", "--raid", "parity"]);
    server.stop();
    server.set_flag("--raid", "mirror");
    let (started, log) = server.start_refused();
    assert!(!started, "{log}");
    assert!(log.contains("raid = parity"), "{log}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["serve", "--devices", "2", "--raid", "parity", "--data-dir"])
        .arg(server.dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("raid parity needs at least 3 devices"),
        "{err}"
    );
}

#[test]
fn a_device_file_gone_while_stopped_is_rebuilt_with_redundancy_and_refused_without() {
    let mut server = Server::start("16M", &["--devices", "3", "--raid", "mirror"]);
    let uri = server.uri();
    qemu_io(
        &["-f", "raw", uri.as_str()],
        &["write -P 0x71 0 16M".into()],
    );
    server.stop();
    let data = server.dir.path().join("data");
    std::fs::remove_file(data.join("device0.img")).unwrap();
    server.restart();
    assert!(
        server.log().contains("device file missing"),
        "{}",
        server.log()
    );
    wait_status(&server, "the rebuild", REBUILD_WAIT, |s| {
        !s.contains("DEGRADED")
    });
    let uri = server.uri();
    qemu_io(&["-f", "raw", uri.as_str()], &["read -P 0x71 0 16M".into()]);
    server.stop();

    let mut plain = Server::start("16M", &["--devices", "2"]);
    plain.stop();
    std::fs::remove_file(plain.dir.path().join("data").join("device1.img")).unwrap();
    let (started, log) = plain.start_refused();
    assert!(!started, "{log}");
    assert!(
        log.contains("device1.img") && log.contains("missing"),
        "{log}"
    );
}

/// A replacement whose writes fail for a while (`rebound inject
/// rebuild-error`, a full or failing disk) stops the rebuild: status says
/// why and when it tries again, the recovery log records it (rung 7), and
/// the rebuild then completes with every byte intact.
#[test]
fn a_rebuild_stopped_by_a_failing_replacement_tries_again_and_completes() {
    let server = Server::start(
        "16M",
        &["--devices", "3", "--raid", "parity", "--cache-size", "1M"],
    );
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x51 0 16M".into(), "flush".into()]);
    let armed = server.admin("inject rebuild-error 3").unwrap();
    assert!(armed.contains("the next 3 writes"), "{armed}");
    server.admin("inject lose-device 2").unwrap();
    // The device's own line says why and when (the recovery log does too).
    let stopped = wait_status(&server, "a stopped rebuild", REBUILD_WAIT, |s| {
        s.lines()
            .any(|l| l.starts_with("device 2 ") && l.contains("trying again in"))
    });
    assert!(stopped.contains("injected write error"), "{stopped}");
    qemu_io(&target, &["read -P 0x51 0 16M".into()]);
    let status = wait_status(&server, "the rebuild", REBUILD_WAIT, |s| {
        !s.contains("DEGRADED")
    });
    assert!(status.contains("rebuild of device 2 stopped"), "{status}");
    assert!(status.contains("device 2 rebuilt"), "{status}");
    let device = status
        .lines()
        .find(|l| l.starts_with("device 2 ") && !l.contains(" queue: "))
        .expect("device 2's line");
    assert!(device.ends_with(": online"), "{status}");
    // Three stops and a completed rebuild, besides the loss: rung 7.
    assert!(rung_count(&status, "reconstruct") >= 5, "{status}");
    qemu_io(&target, &["read -P 0x51 0 16M".into()]);
    assert!(!server.log().contains("answering EIO"), "{}", server.log());
}
