//! The recovery ladder on the real server: faults injected through the
//! admin socket (`rebound inject`) are recovered at rung 1 (a failed stage's
//! request redriven) and rung 2 (group recovery) with no error reaching the
//! client; crashes are recovered at rung 5 (fast restart) or rung 6 (hard
//! restart, damaged box) by `--supervise`; qemu's NBD client rides through
//! kills with its reconnect-delay option. Every test verifies the data.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::{self, Raw};
use common::{Server, free_port, qemu_io, rung_count, tool, wait_status};

#[test]
fn a_failure_at_every_stage_is_recovered_at_rung_1_with_no_client_error() {
    let server = Server::start("64M", &["--cache-size", "1M"]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    // Data on the devices (destaged at FLUSH), so later reads miss the small
    // cache and go through device.read.
    qemu_io(&target, &["write -P 0x11 0 8M".into(), "flush".into()]);
    // Each point, armed to fail twice in a row (under the redrive bound of
    // three), then an operation that passes through it.
    let cases: [(&str, &str, &[&str]); 9] = [
        ("panic", "host.receive", &["read -P 0x11 0 64k"]),
        ("panic", "cache.read", &["read -P 0x11 64k 64k"]),
        ("fail", "device.read", &["read -P 0x11 7M 1M"]),
        (
            "panic",
            "nvs.write",
            &["write -P 0x22 1M 256k", "read -P 0x22 1M 256k"],
        ),
        (
            "fail",
            "cache.apply",
            &["write -P 0x33 2M 64k", "read -P 0x33 2M 64k"],
        ),
        (
            "panic",
            "device.fua",
            &["write -f -P 0x44 3M 64k", "read -P 0x44 3M 64k"],
        ),
        (
            "fail",
            "device.flush",
            &["write -P 0x45 3M 4k", "flush", "read -P 0x45 3M 4k"],
        ),
        (
            "panic",
            "device.zero",
            &["write -z 4M 64k", "read -P 0 4M 64k"],
        ),
        ("fail", "host.reply", &["read -P 0x11 6M 64k"]),
    ];
    let mut armed = 0;
    for (kind, point, ops) in cases {
        let answer = server
            .admin(&format!("inject {kind} {point} count=2"))
            .unwrap();
        assert!(answer.contains("armed"), "{answer}");
        armed += 2;
        let ops: Vec<String> = ops.iter().map(|s| (*s).to_owned()).collect();
        qemu_io(&target, &ops);
        let status = server.admin("status").unwrap();
        assert_eq!(
            rung_count(&status, "task"),
            armed,
            "both failures at {point} were recovered at rung 1:\n{status}"
        );
    }
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn a_stalled_step_past_the_task_deadline_times_out_and_is_redriven_at_rung_1() {
    let server = Server::start("16M", &["--task-deadline", "200ms"]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x5a 0 256k".into()]);
    // A read's cache step stalls for 30 s: the watchdog declares the task
    // past its deadline, the stall ends as a time-out, and the request is
    // redriven.
    let answer = server
        .admin("inject delay cache.read duration=30s count=1")
        .unwrap();
    assert!(answer.contains("armed"), "{answer}");
    let started = std::time::Instant::now();
    qemu_io(&target, &["read -P 0x5a 0 256k".into()]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the read waited out the stall ({took:?})"
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "task"), 1, "{status}");
    assert!(
        status.contains("stage cache.read failed; timeout:"),
        "{status}"
    );
    let overdue: u64 = status
        .lines()
        .find(|l| l.split_whitespace().next() == Some("cache"))
        .and_then(|l| l.split_whitespace().nth(5))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no overdue count for cache:\n{status}"));
    assert_eq!(overdue, 1, "{status}");
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn a_hung_step_that_never_checks_recovers_its_group_then_escalates_to_rung_4_losing_nothing() {
    let server = Server::start(
        "16M",
        &["--task-deadline", "100ms", "--hung-after", "500ms"],
    );
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x6b 0 256k".into()]);
    // A read's cache step hangs for 3 s, deaf to its deadline: at 500 ms
    // the watchdog recovers the cache group; the hung task cannot drain,
    // so the group recovery escalates to an in-process system recovery.
    let answer = server
        .admin("inject hang cache.read duration=3s count=1")
        .unwrap();
    assert!(answer.contains("armed hang"), "{answer}");
    qemu_io(&target, &["read -P 0x6b 0 256k".into()]);
    let status = wait_status(&server, "a system recovery", Duration::from_secs(30), |s| {
        rung_count(s, "system") >= 1
    });
    assert_eq!(rung_count(&status, "group"), 1, "{status}");
    assert_eq!(rung_count(&status, "system"), 1, "{status}");
    assert!(status.contains("hung"), "{status}");
    qemu_io(&target, &["read -P 0x6b 0 256k".into()]);
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn a_cache_frame_failing_its_check_word_is_rebuilt_at_rung_1() {
    let server = Server::start("16M", &[]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    // Track 10 (offset 40 KiB): written, then read, so a frame caches it.
    qemu_io(
        &target,
        &["write -P 0x3c 40k 4k".into(), "read -P 0x3c 40k 4k".into()],
    );
    let err = server.admin("inject corrupt-frame 999").unwrap_err();
    assert!(err.contains("not in the read cache"), "{err}");
    assert!(
        server
            .admin("inject corrupt-frame x")
            .unwrap_err()
            .contains("not a track number")
    );
    let answer = server.admin("inject corrupt-frame 10").unwrap();
    assert!(answer.contains("damaged"), "{answer}");
    // The damaged frame is never served: the read rebuilds it.
    qemu_io(
        &target,
        &["read -P 0x3c 40k 4k".into(), "read -P 0x3c 40k 4k".into()],
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "task"), 1, "{status}");
    assert!(
        status.contains("track 10 failed its check word"),
        "{status}"
    );
}

#[test]
fn a_request_failing_past_its_redrive_bound_escalates_to_rung_4_once_then_fails_losing_nothing() {
    let server = Server::start("16M", &[]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x55 0 64k".into()]);
    // Four failures in a row: the first and three redrives (rung 1), then
    // a system recovery (rung 4) redrives it once more, and it succeeds.
    server.admin("inject panic nvs.write count=4").unwrap();
    qemu_io(
        &target,
        &["write -P 0x66 0 64k".into(), "read -P 0x66 0 64k".into()],
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "task"), 3, "{status}");
    assert_eq!(rung_count(&status, "system"), 1, "{status}");
    // Five: rung 4 is tried once per request; the fifth failure is EIO.
    server.admin("inject panic nvs.write count=5").unwrap();
    let out = Command::new(tool("qemu-io"))
        .args(target)
        .args(["-c", "write -P 0x77 0 64k"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Input/output error"),
        "the failure after rung 4 is not redriven again: {text}"
    );
    // The failed write changed nothing; the old data is intact.
    qemu_io(&target, &["read -P 0x66 0 64k".into()]);
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "system"), 2, "{status}");
}

fn raw_write(c: &mut Raw, cookie: u64, offset: u64, byte: u8, len: usize) {
    c.request(raw::CMD_WRITE, 0, cookie, offset, len as u32);
    c.send(&vec![byte; len]);
}

fn raw_reply_ok(c: &mut Raw, cookie: u64, data_len: usize) -> Vec<u8> {
    let (got, error, data) = c.simple_reply(data_len);
    assert_eq!((got, error), (cookie, 0), "request {cookie} failed");
    data
}

/// A FLUSH waiting for its destage (here: the device queue refusing it
/// 200 times, so it backs off for about a second) holds no worker: with a
/// single worker, a read on another connection is answered meanwhile.
#[test]
fn a_flush_waiting_for_its_destage_holds_no_worker() {
    let server = Server::start("16M", &["--workers", "1"]);
    let mut w = Raw::go(&server.addr);
    raw_write(&mut w, 1, 0, 0x5a, 4096);
    raw_reply_ok(&mut w, 1, 0);
    server
        .admin("inject fail device.queue-full count=200")
        .unwrap();
    raw_write(&mut w, 2, 8192, 0x5b, 4096);
    raw_reply_ok(&mut w, 2, 0);
    let started = Instant::now();
    let addr = server.addr.clone();
    let flusher = std::thread::spawn(move || {
        let mut f = Raw::go(&addr);
        f.request(raw::CMD_FLUSH, 0, 3, 0, 0);
        raw_reply_ok(&mut f, 3, 0);
        started.elapsed()
    });
    std::thread::sleep(Duration::from_millis(50));
    let mut r = Raw::go(&server.addr);
    r.request(raw::CMD_READ, 0, 4, 0, 4096);
    let data = raw_reply_ok(&mut r, 4, 4096);
    let read_done = started.elapsed();
    assert!(data.iter().all(|&b| b == 0x5a));
    let flush_done = flusher.join().unwrap();
    assert!(
        flush_done >= Duration::from_millis(200),
        "the FLUSH did not have to wait ({flush_done:?}): the test proves nothing"
    );
    assert!(
        read_done < flush_done,
        "the read ({read_done:?}) waited for the FLUSH ({flush_done:?})"
    );
    server.admin("inject clear").unwrap();
}

#[test]
fn a_write_failing_inside_cache_apply_is_rolled_back_alone_through_log_lock_at_rung_1() {
    let server = Server::start("16M", &[]);
    let mut c = Raw::go(&server.addr);
    raw_write(&mut c, 1, 8192, 0xa1, 8192);
    raw_reply_ok(&mut c, 1, 0);
    // The second write panics after its first track entered the directory.
    // No other actor touched the shards it changed: Log(Lock) allows the
    // single-actor rollback, and the write is redriven (rung 1).
    server
        .admin("inject panic cache.apply.track count=1")
        .unwrap();
    raw_write(&mut c, 2, 8192, 0xb2, 8192);
    raw_reply_ok(&mut c, 2, 0);
    c.request(raw::CMD_READ, 0, 3, 8192, 8192);
    let data = raw_reply_ok(&mut c, 3, 8192);
    assert!(
        data.iter().all(|&b| b == 0xb2),
        "the redriven write landed whole"
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "task"), 1, "{status}");
    assert_eq!(rung_count(&status, "system"), 0, "{status}");
    assert!(status.contains("rolled back alone"), "{status}");
    assert!(
        status.contains("cache.apply: 1 rolled back alone (Log(Lock), rung 1), 0 escalated"),
        "{status}"
    );
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn a_dirty_read_of_a_partly_applied_write_rules_out_rollback_and_escalates_to_rung_4() {
    let server = Server::start("16M", &["--workers", "2"]);
    let mut writer = Raw::go(&server.addr);
    let mut reader = Raw::go(&server.addr);
    raw_write(&mut writer, 1, 0, 0x11, 8192);
    raw_reply_ok(&mut writer, 1, 0);
    // The write stalls after its first track (offset 0) entered the
    // directory; meanwhile another request reads that track (a dirty
    // read); then the write fails after its second track.
    server
        .admin("inject delay cache.apply.track duration=1s count=1")
        .unwrap();
    raw_write(&mut writer, 2, 0, 0x22, 8192);
    std::thread::sleep(Duration::from_millis(100));
    server
        .admin("inject panic cache.apply.track count=1")
        .unwrap();
    reader.request(raw::CMD_READ, 0, 7, 0, 4096);
    let seen = raw_reply_ok(&mut reader, 7, 4096);
    assert!(
        seen.iter().all(|&b| b == 0x22) || seen.iter().all(|&b| b == 0x11),
        "a read returns one write's data"
    );
    raw_reply_ok(&mut writer, 2, 0);
    writer.request(raw::CMD_READ, 0, 3, 0, 8192);
    let data = raw_reply_ok(&mut writer, 3, 8192);
    assert!(data.iter().all(|&b| b == 0x22), "the write landed whole");
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "system"), 1, "{status}");
    assert!(status.contains("DR=true"), "{status}");
    assert!(
        status.contains("cache.apply: 0 rolled back alone (Log(Lock), rung 1), 1 escalated"),
        "{status}"
    );
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn system_recovery_rebuilds_from_the_box_or_an_nvs_scan_and_the_data_survives() {
    let server = Server::start("16M", &[]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x21 0 1M".into()]);
    let answer = server.admin("inject system").unwrap();
    assert!(answer.contains("from the recovery box"), "{answer}");
    qemu_io(&target, &["read -P 0x21 0 1M".into()]);
    assert!(
        server
            .admin("inject abandon-box")
            .unwrap()
            .contains("invalidated")
    );
    let answer = server.admin("inject system").unwrap();
    assert!(answer.contains("from an NVS scan"), "{answer}");
    qemu_io(
        &target,
        &[
            "read -P 0x21 0 1M".into(),
            "write -P 0x22 1M 1M".into(),
            "read -P 0x22 1M 1M".into(),
        ],
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "system"), 2, "{status}");
    assert!(
        status.contains("abandoned (next restart is hard)"),
        "{status}"
    );
}

#[test]
fn faults_armed_by_the_configuration_file_and_flags_are_recovered_and_bad_ones_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("rebound.toml");
    std::fs::write(&cfg, "inject = [\"panic cache.read count=2\"]\n").unwrap();
    let server = Server::start(
        "16M",
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--inject",
            "fail nvs.write count=1",
        ],
    );
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(
        &target,
        &["write -P 0x5a 0 4k".into(), "read -P 0x5a 0 4k".into()],
    );
    let status = server.admin("status").unwrap();
    assert_eq!(rung_count(&status, "task"), 3, "{status}");
    assert!(server.log().contains("fault armed by the configuration"));
    // Options are checked when the fault is armed: the server refuses to
    // start, naming the setting.
    for (entry, expect) in [
        ("panic cache.read rate=2", "rate"),
        ("group-fault nosuchgroup", "unknown group"),
        ("delay cache.read", "duration"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(["serve", "--listen", "127.0.0.1:0", "--volume-size", "16M"])
            .args(["--nvs-size", "96M", "--cache-size", "1M"])
            .arg("--data-dir")
            .arg(dir.path().join("d"))
            .arg("--nvs")
            .arg(dir.path().join("nvs"))
            .arg("--box")
            .arg(dir.path().join("box"))
            .args(["--inject", entry])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{entry:?} accepted");
        assert!(
            err.contains("invalid setting inject") && err.contains(expect),
            "{entry:?}: {err}"
        );
    }
}

/// Sum of one counter over the status's `device N queue:` lines, e.g.
/// "times full".
fn queue_total(status: &str, what: &str) -> u64 {
    status
        .lines()
        .filter(|l| l.starts_with("device ") && l.contains(" queue: "))
        .filter_map(|l| {
            let before = l.split(what).next()?;
            before.split_whitespace().last()?.parse::<u64>().ok()
        })
        .sum()
}

#[test]
fn a_full_device_queue_backs_off_and_an_unsolicited_completion_is_ignored_at_rung_1() {
    let server = Server::start("64M", &["--cache-size", "1M", "--devices", "2"]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x31 0 8M".into(), "flush".into()]);
    let status = server.admin("status").unwrap();
    assert_eq!(queue_total(&status, "times full"), 0, "{status}");
    // Staging reads (the small cache misses) find the queue full three
    // times, back off and go on.
    server
        .admin("inject fail device.queue-full count=3")
        .unwrap();
    qemu_io(&target, &["read -P 0x31 0 64k".into()]);
    let status = server.admin("status").unwrap();
    assert_eq!(queue_total(&status, "times full"), 3, "{status}");
    assert!(status.contains("staging read of track"), "{status}");
    // Destage (in the background, or forced by the FLUSH) backs off too.
    server
        .admin("inject fail device.queue-full count=2")
        .unwrap();
    qemu_io(
        &target,
        &[
            "write -P 0x32 1M 64k".into(),
            "flush".into(),
            "read -P 0x32 1M 64k".into(),
        ],
    );
    let status = server.admin("status").unwrap();
    assert_eq!(queue_total(&status, "times full"), 5, "{status}");
    assert!(status.contains("destage"), "{status}");
    assert!(
        status.contains(" 0 dirty tracks"),
        "the FLUSH destaged everything:\n{status}"
    );
    // A completion nobody waits for is ignored, never frees a slot.
    let answer = server.admin("inject unsolicited-completion 1").unwrap();
    assert!(answer.contains("ignored"), "{answer}");
    let err = server.admin("inject unsolicited-completion 2").unwrap_err();
    assert!(err.contains("not a device number below 2"), "{err}");
    let status = server.admin("status").unwrap();
    assert_eq!(queue_total(&status, "unsolicited"), 1, "{status}");
    assert_eq!(
        queue_total(&status, "of"),
        0,
        "no slot outstanding at rest:\n{status}"
    );
    qemu_io(
        &target,
        &[
            "read -P 0x31 0 1M".into(),
            "read -P 0x32 1M 64k".into(),
            "read -P 0x31 2M 6M".into(),
        ],
    );
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn exhausted_control_blocks_are_reclaimed_from_leaks_or_admission_waits_for_live_requests() {
    let server = Server::start("16M", &["--control-blocks", "4"]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    // Four requests lose the release of their control block: the pool of
    // four is empty, and the next request's audit reclaims all four.
    server.admin("inject fail host.cb-leak count=4").unwrap();
    qemu_io(
        &target,
        &[
            "write -P 0x41 0 4k".into(),
            "write -P 0x42 4k 4k".into(),
            "read -P 0x41 0 4k".into(),
            "read -P 0x42 4k 4k".into(),
        ],
    );
    qemu_io(&target, &["read -P 0x41 0 4k".into()]);
    let status = server.admin("status").unwrap();
    assert!(status.contains("4 leaked blocks reclaimed"), "{status}");
    assert!(status.contains("4 releases lost"), "{status}");
    assert!(
        status.contains("leaked blocks (owners gone) reclaimed"),
        "{status}"
    );
    // No leak: 32 pipelined writes on one connection, 4 blocks. Admission
    // waits for live requests to finish; every write is answered.
    let mut c = Raw::go(&server.addr);
    for i in 0..32u64 {
        raw_write(&mut c, 100 + i, i * 4096, i as u8 + 1, 4096);
    }
    let mut answered = std::collections::HashSet::new();
    for _ in 0..32 {
        let (cookie, error, _) = c.simple_reply(0);
        assert_eq!(error, 0, "write {cookie} failed");
        answered.insert(cookie);
    }
    assert_eq!(answered.len(), 32);
    for i in 0..32u64 {
        c.request(raw::CMD_READ, 0, 200 + i, i * 4096, 4096);
        let data = raw_reply_ok(&mut c, 200 + i, 4096);
        assert!(data.iter().all(|&b| b == i as u8 + 1), "track {i}");
    }
    let status = server.admin("status").unwrap();
    assert!(status.contains("control blocks: 4 of 4 free"), "{status}");
    assert!(!server.log().contains("answering EIO"), "no request failed");
}

#[test]
fn injected_group_faults_are_recovered_at_rung_2_while_io_continues() {
    let metrics = format!("127.0.0.1:{}", common::free_port());
    let server = Server::start("64M", &["--cache-size", "2M", "--metrics", &metrics]);
    let uri = server.uri();
    let answer = server
        .admin("inject group-fault cache rate=0.02 duration=2ms")
        .unwrap();
    assert!(answer.contains("group cache"), "{answer}");
    let target = ["-f", "raw", uri.as_str()];
    let mut commands = Vec::new();
    for i in 0..64u64 {
        commands.push(format!("write -P {} {}k 64k", i % 250 + 1, i * 64));
    }
    for i in 0..64u64 {
        commands.push(format!("read -P {} {}k 64k", i % 250 + 1, i * 64));
    }
    for _ in 0..3 {
        qemu_io(&target, &commands);
    }
    let status = server.admin("status").unwrap();
    assert!(
        rung_count(&status, "group") > 0,
        "group recoveries ran:\n{status}"
    );
    assert!(status.contains("rung 2 group cache"), "{status}");
    // The emulation's cost is exposed: faults injected, and the processor
    // time their recoveries held (each at least its own 2 ms).
    let text = common::scrape(&metrics);
    let injected = common::sample(&text, "rebound_rcs_injected_total{group=\"cache\"}");
    let recoveries = common::sample(&text, "rebound_rcs_recoveries_total{group=\"cache\"}");
    let held = common::sample(
        &text,
        "rebound_rcs_emulated_recovery_seconds_total{group=\"cache\"}",
    );
    assert!(
        injected > 0.0 && recoveries > 0.0,
        "{injected} injected, {recoveries} recoveries"
    );
    // In microseconds: 9 holds of exactly 2 ms are 0.018 s, which is less
    // than the float 0.002 * 9.
    assert!(
        (held * 1e6).round() >= 2000.0 * recoveries,
        "{recoveries} recoveries of 2 ms held only {held} s"
    );
    let device = common::sample(&text, "rebound_rcs_injected_total{group=\"device\"}");
    assert_eq!(device, 0.0, "faults injected only where armed");
    server.admin("inject clear").unwrap();
}

#[test]
fn the_admin_socket_refuses_bad_requests_and_keeps_serving() {
    let server = Server::start("16M", &[]);
    for (request, why) in [
        ("", "empty"),
        ("launch missiles", "unknown request"),
        ("inject", "inject what"),
        ("inject panic", "unknown fault"),
        ("inject panic nowhere", "unknown fault point"),
        ("inject panic cache.read rate=2", "probability"),
        ("inject panic cache.read rate=x", "not a number"),
        ("inject panic cache.read count=0", "positive integer"),
        ("inject panic cache.read speed=1", "unknown option"),
        ("inject panic cache.read rate", "key=value"),
        ("inject delay cache.read", "duration=D is required"),
        ("inject delay cache.read duration=5parsecs", "unknown unit"),
        ("inject group-fault nosuch", "unknown group"),
    ] {
        let err = server.admin(request).expect_err(request);
        assert!(err.contains(why), "{request:?}: {err}");
    }
    // A request longer than the limit, and one without a newline.
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(server.admin_path()).unwrap();
    // The server stops reading past the limit: the rest may be refused.
    let _ = s.write_all(&vec![b'x'; 4096]);
    let _ = s.write_all(b"\n");
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(
        answer.starts_with("error:") && answer.contains("one line"),
        "{answer}"
    );
    drop(s);
    let mut s = std::os::unix::net::UnixStream::connect(server.admin_path()).unwrap();
    s.write_all(b"status").unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("error:"), "{answer}");
    assert!(server.admin("status").unwrap().contains("groups:"));
    let uri = server.uri();
    qemu_io(
        &["-f", "raw", uri.as_str()],
        &["write -P 7 0 4k".into(), "read -P 7 0 4k".into()],
    );
}

#[test]
fn a_second_server_cannot_take_a_live_admin_socket() {
    let server = Server::start("16M", &[]);
    let admin = server.admin_path();
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(server.dir.path().join("other"))
        .arg("--nvs")
        .arg(server.dir.path().join("other.nvs"))
        .arg("--box")
        .arg(server.dir.path().join("other.box"))
        .arg("--admin")
        .arg(&admin)
        .args([
            "--volume-size",
            "16M",
            "--nvs-size",
            "96M",
            "--cache-size",
            "4M",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("another server is using"), "{err}");
    assert!(
        server.admin("status").is_ok(),
        "the first server's socket is untouched"
    );
}

#[test]
fn supervise_restarts_a_crashed_server_fast_and_a_damaged_box_hard_losing_nothing() {
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::start("32M", &["--supervise", "--listen", &listen]);
    let uri = server.uri();
    let target = ["-f", "raw", uri.as_str()];
    qemu_io(&target, &["write -P 0x5a 0 2M".into()]);
    server.admin("inject crash").unwrap();
    let status = wait_status(&server, "a fast restart", Duration::from_secs(30), |s| {
        s.contains("fast restart (rung 5)")
    });
    assert_eq!(rung_count(&status, "fast-restart"), 1, "{status}");
    qemu_io(
        &target,
        &["read -P 0x5a 0 2M".into(), "write -P 0x5b 2M 1M".into()],
    );
    server.admin("inject crash-damaged-box").unwrap();
    let status = wait_status(&server, "a hard restart", Duration::from_secs(30), |s| {
        s.contains("hard restart (rung 6")
    });
    assert_eq!(rung_count(&status, "hard-restart"), 1, "{status}");
    qemu_io(
        &target,
        &["read -P 0x5a 0 2M".into(), "read -P 0x5b 2M 1M".into()],
    );
    let log = server.log();
    assert_eq!(log.matches("restarting").count(), 2, "{log}");
}

#[test]
fn qemu_io_with_reconnect_delay_rides_through_server_kills_without_an_error() {
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let mut server = Server::start("64M", &["--listen", &listen]);
    let opts = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},reconnect-delay=30"
    );
    let mut commands = Vec::new();
    for round in 0..6u64 {
        for i in 0..200u64 {
            let pattern = (round * 200 + i) % 251 + 1;
            commands.push(format!("write -P {pattern} {}k 64k", (i % 100) * 64));
        }
    }
    // The final pattern of each 64 KiB block: the last round wrote it.
    let mut verify = Vec::new();
    for i in 100..200u64 {
        let pattern = (5 * 200 + i) % 251 + 1;
        verify.push(format!("read -P {pattern} {}k 64k", (i % 100) * 64));
    }
    commands.extend(verify);
    let client = std::thread::spawn(move || {
        let mut cmd = Command::new(tool("qemu-io"));
        cmd.args(["--image-opts", &opts]);
        for c in &commands {
            cmd.args(["-c", c]);
        }
        cmd.output().expect("running qemu-io")
    });
    let mut kills = 0;
    std::thread::sleep(Duration::from_millis(300));
    while !client.is_finished() && kills < 3 {
        server.kill9();
        kills += 1;
        std::thread::sleep(Duration::from_millis(200));
        server.restart();
        std::thread::sleep(Duration::from_millis(400));
    }
    let out = client.join().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        !text.contains("failed") && !text.contains("error"),
        "{text}"
    );
    assert!(
        kills >= 1,
        "qemu-io finished before the first kill; make the run longer"
    );
    eprintln!("qemu-io rode through {kills} kills");
}

#[test]
fn a_killed_supervisor_takes_its_server_down() {
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let mut server = Server::start("16M", &["--supervise", "--listen", &listen]);
    assert!(server.admin("status").is_ok());
    server.kill9();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&listen).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the server outlived its supervisor:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        server.admin("status").is_err(),
        "no orphan answers on the admin socket"
    );
}

/// Read track `t` (4 KiB) on a raw connection: its NBD error and data.
fn track_read(c: &mut Raw, cookie: u64, t: u64) -> (u32, Vec<u8>) {
    c.request(raw::CMD_READ, 0, cookie, t * 4096, 4096);
    let (got, error, data) = c.simple_reply(4096);
    assert_eq!(got, cookie);
    (error, data)
}

/// Write track `t` (4 KiB of `byte`) on a raw connection: its NBD error.
fn track_write(c: &mut Raw, cookie: u64, t: u64, byte: u8) -> u32 {
    c.request(raw::CMD_WRITE, 0, cookie, t * 4096, 4096);
    c.send(&[byte; 4096]);
    let (got, error, _) = c.simple_reply(0);
    assert_eq!(got, cookie);
    error
}

/// An NVS record whose data is damaged, with no cached copy, holds the
/// only copy of an acknowledged write: the track is lost. The loss is
/// recorded once (not once per destage tick), reads and FLUSH answer EIO
/// rather than the older data on the device, other tracks are untouched,
/// and the next write (or TRIM) of the track ends the loss.
#[test]
fn a_damaged_nvs_record_with_no_cached_copy_makes_its_track_lost_until_rewritten() {
    const EIO: u32 = 5;
    let server = Server::start("16M", &[]);
    let mut c = Raw::go(&server.addr);
    // Older data of track 7 on the device.
    assert_eq!(track_write(&mut c, 1, 7, 0x70), 0);
    c.request(raw::CMD_FLUSH, 0, 2, 0, 0);
    assert_eq!(c.simple_reply(0).1, 0);
    // Newer writes held in the NVS (the device queue refuses destage).
    server
        .admin("inject fail device.queue-full count=unlimited")
        .unwrap();
    assert!(
        server
            .admin("inject corrupt-record 9")
            .unwrap_err()
            .contains("no record in the NVS")
    );
    assert_eq!(track_write(&mut c, 3, 7, 0x77), 0);
    assert_eq!(track_write(&mut c, 4, 8, 0x88), 0);
    assert_eq!(track_write(&mut c, 30, 9, 0x99), 0);
    for t in [7, 9] {
        let answer = server.admin(&format!("inject corrupt-record {t}")).unwrap();
        assert!(answer.contains(&format!("track {t}")), "{answer}");
    }
    server.admin("inject clear").unwrap();
    // Destage writes track 8 and finds tracks 7 and 9 lost.
    let status = wait_status(
        &server,
        "tracks 7 and 9 lost",
        Duration::from_secs(20),
        |s| s.contains("lost tracks: 2 ") && s.contains(" 2 dirty tracks"),
    );
    assert!(status.contains(": 7, 9"), "{status}");
    // A TRIM over track 9 ends its loss: it reads as zeroes.
    c.request(raw::CMD_TRIM, 0, 31, 9 * 4096, 4096);
    assert_eq!(c.simple_reply(0).1, 0);
    let (error, data) = track_read(&mut c, 32, 9);
    assert_eq!(error, 0);
    assert!(
        data.iter().all(|&b| b == 0),
        "a trimmed track reads as zeroes"
    );
    let status = wait_status(
        &server,
        "track 9's loss to end",
        Duration::from_secs(20),
        |s| s.contains("lost tracks: 1 ") && s.contains(" 1 dirty tracks"),
    );
    assert!(
        status.contains("NVS record damaged, no cached copy"),
        "{status}"
    );
    let (error, _) = track_read(&mut c, 5, 7);
    assert_eq!(error, EIO, "a lost track never reads as its older data");
    let (error, data) = track_read(&mut c, 6, 8);
    assert_eq!(error, 0);
    assert!(data.iter().all(|&b| b == 0x88));
    c.request(raw::CMD_FLUSH, 0, 7, 0, 0);
    assert_eq!(
        c.simple_reply(0).1,
        EIO,
        "FLUSH cannot make track 7 durable"
    );
    // Many destage ticks later, the loss is still one record, and no
    // rollback or system recovery was tried for it.
    std::thread::sleep(Duration::from_millis(600));
    let status = server.admin("status").unwrap();
    assert_eq!(status.matches("track 7 lost").count(), 1, "{status}");
    assert_eq!(rung_count(&status, "system"), 0, "{status}");
    // A new write of the track supersedes the damaged record.
    assert_eq!(track_write(&mut c, 8, 7, 0x79), 0);
    let (error, data) = track_read(&mut c, 9, 7);
    assert_eq!(error, 0);
    assert!(data.iter().all(|&b| b == 0x79));
    c.request(raw::CMD_FLUSH, 0, 10, 0, 0);
    assert_eq!(c.simple_reply(0).1, 0);
    let status = wait_status(&server, "the loss to end", Duration::from_secs(20), |s| {
        !s.contains("lost tracks:") && s.contains(" 0 dirty tracks")
    });
    assert!(
        status.contains("track 7 lost"),
        "the event stays in the log: {status}"
    );
}

/// A lost track stays lost across a crash: the fast restart (rung 5) adopts
/// the damaged record the recovery box names, and the hard restart (rung 6,
/// damaged box) keeps it from its NVS scan instead of letting the device's
/// older data stand in. The first read after each restart answers EIO.
#[test]
fn a_lost_track_stays_lost_across_fast_and_hard_restarts() {
    const EIO: u32 = 5;
    let port = free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let server = Server::start("16M", &["--supervise", "--listen", &listen]);
    let mut c = Raw::go(&server.addr);
    assert_eq!(track_write(&mut c, 1, 7, 0x70), 0);
    c.request(raw::CMD_FLUSH, 0, 2, 0, 0);
    assert_eq!(c.simple_reply(0).1, 0);
    server
        .admin("inject fail device.queue-full count=unlimited")
        .unwrap();
    assert_eq!(track_write(&mut c, 3, 7, 0x77), 0);
    assert_eq!(track_write(&mut c, 4, 8, 0x88), 0);
    server.admin("inject corrupt-record 7").unwrap();
    drop(c);
    for (crash, kind) in [
        ("inject crash", "fast restart (rung 5)"),
        ("inject crash-damaged-box", "hard restart (rung 6"),
    ] {
        // The restarted server destages freely: track 8 may reach the
        // device, track 7 cannot.
        server.admin(crash).unwrap();
        wait_status(&server, kind, Duration::from_secs(30), |s| s.contains(kind));
        let mut c = Raw::go(&server.addr);
        let (error, _) = track_read(&mut c, 10, 7);
        assert_eq!(
            error, EIO,
            "after the {kind}, track 7 is not its older data"
        );
        let (error, data) = track_read(&mut c, 11, 8);
        assert_eq!(error, 0);
        assert!(data.iter().all(|&b| b == 0x88), "after the {kind}");
        let status = wait_status(&server, "the loss", Duration::from_secs(20), |s| {
            s.contains("lost tracks: 1 ")
        });
        assert!(status.contains("track 7 lost"), "{status}");
    }
    // Rewritten, the track is whole again.
    let mut c = Raw::go(&server.addr);
    assert_eq!(track_write(&mut c, 20, 7, 0x7a), 0);
    let (error, data) = track_read(&mut c, 21, 7);
    assert_eq!(error, 0);
    assert!(data.iter().all(|&b| b == 0x7a));
}

/// The slot of the NVS record of `track` (the first slot naming it).
fn nvs_slot(nvs: &std::path::Path, track: u64) -> Option<u64> {
    let bytes = std::fs::read(nvs).unwrap();
    bytes[4096..]
        .chunks_exact(64 + 4096)
        .position(|s| {
            &s[0..4] == b"RBNV" && u64::from_le_bytes(s[16..24].try_into().unwrap()) == track
        })
        .map(|p| p as u64)
}

/// The scrub checks the dirty NVS records in the background: a record
/// whose data is damaged is repaired in place from the cache frame holding
/// the same data (so the destage that follows writes what was written),
/// and one with no such frame makes its track lost before any read or
/// destage meets it.
#[test]
fn the_scrub_repairs_a_damaged_record_from_the_cache_or_reports_the_loss() {
    use std::os::unix::fs::FileExt;
    let server = Server::start("16M", &["--scrub-interval", "100ms"]);
    let mut c = Raw::go(&server.addr);
    server
        .admin("inject fail device.queue-full count=unlimited")
        .unwrap();
    assert_eq!(track_write(&mut c, 1, 3, 0x33), 0);
    assert_eq!(track_write(&mut c, 2, 4, 0x44), 0);
    // Track 3's record is damaged in the NVS; its frame (made when the
    // write was applied) still holds the data.
    let slot = nvs_slot(&server.nvs, 3).expect("track 3 has a record");
    let data_at = 4096 + slot * (64 + 4096) + 64;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&server.nvs)
        .unwrap();
    f.write_all_at(&[0x00; 16], data_at + 100).unwrap();
    let status = wait_status(&server, "the repair", Duration::from_secs(20), |s| {
        s.contains("1 repaired from the cache")
    });
    assert!(!status.contains("lost tracks:"), "{status}");
    let mut back = vec![0u8; 4096];
    f.read_exact_at(&mut back, data_at).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x33),
        "the record holds the written data again"
    );
    // Track 4's record is damaged and its frame dropped: with destage held
    // (no destage reads it) and no read, the scrub finds the loss.
    server.admin("inject corrupt-record 4").unwrap();
    // The track joins the lost list a moment before the scrub counts it
    // and the recovery log names it: wait for all three.
    let status = wait_status(&server, "the loss", Duration::from_secs(20), |s| {
        s.contains("lost tracks: 1 ") && s.contains("track 4 lost") && s.contains(", 1 lost;")
    });
    assert!(status.contains("track 4 lost"), "{status}");
    assert!(status.contains("found by the scrub"), "{status}");
    assert!(status.contains(", 1 lost;"), "{status}");
    // Destage goes on: track 3 reaches the device as written.
    server.admin("inject clear").unwrap();
    let (error, data) = track_read(&mut c, 3, 3);
    assert_eq!(error, 0);
    assert!(data.iter().all(|&b| b == 0x33));
    wait_status(&server, "track 3's destage", Duration::from_secs(20), |s| {
        s.contains(" 1 dirty tracks")
    });
    let dev = std::fs::File::open(server.dir.path().join("data/device0.img")).unwrap();
    dev.read_exact_at(&mut back, 3 * 4096).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x33),
        "the device holds what was written"
    );
}

/// A directory entry naming a record its NVS slot does not hold (state
/// corruption) is found by the scrub, which escalates: without output
/// commit a system recovery (rung 4) rebuilds the directory from the
/// recovery box, so the track reads as written; without the scrub that
/// read would be answered EIO.
#[test]
fn the_scrub_escalates_a_corrupt_directory_entry_before_a_read_meets_it() {
    let server = Server::start("16M", &["--scrub-interval", "100ms"]);
    let mut c = Raw::go(&server.addr);
    server
        .admin("inject fail device.queue-full count=unlimited")
        .unwrap();
    assert_eq!(track_write(&mut c, 1, 5, 0x55), 0);
    let answer = server.admin("inject corrupt-directory 5").unwrap();
    assert!(answer.contains("track 5"), "{answer}");
    let status = wait_status(
        &server,
        "the scrub's escalation",
        Duration::from_secs(20),
        |s| rung_count(s, "system") == 1 && s.contains(" 1 inconsistent"),
    );
    assert!(
        status.contains("the scrub found 1 directory entries"),
        "{status}"
    );
    let (error, data) = track_read(&mut c, 2, 5);
    assert_eq!(error, 0, "{}", server.admin("status").unwrap());
    assert!(data.iter().all(|&b| b == 0x55));
    server.admin("inject clear").unwrap();
    wait_status(&server, "the destage", Duration::from_secs(20), |s| {
        s.contains(" 0 dirty tracks")
    });
}

/// The number of completed scrub passes in a `rebound status` answer.
fn scrub_passes(status: &str) -> u64 {
    let line = status
        .lines()
        .find(|l| l.starts_with("scrub: every"))
        .unwrap_or_else(|| panic!("no scrub line: {status}"));
    let at = line.find("; ").expect("passes field") + 2;
    line[at..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// A scrub task dropped unrun (here every dispatch of the background
/// group fails: rung 2 recovers the group and drops its tasks) does not
/// stop the scrub: once the faults stop, passes complete again.
#[test]
fn the_scrub_survives_its_tasks_being_dropped_by_group_recovery() {
    let server = Server::start("16M", &["--scrub-interval", "100ms"]);
    let mut c = Raw::go(&server.addr);
    assert_eq!(track_write(&mut c, 1, 1, 0x11), 0);
    wait_status(&server, "a first pass", Duration::from_secs(20), |s| {
        scrub_passes(s) >= 1
    });
    server
        .admin("inject group-fault background rate=1 duration=1ms")
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let before = scrub_passes(&server.admin("status").unwrap());
    std::thread::sleep(Duration::from_millis(500));
    let status = server.admin("status").unwrap();
    assert!(
        scrub_passes(&status) <= before + 1,
        "passes went on while every scrub task failed: {status}"
    );
    server.admin("inject clear").unwrap();
    wait_status(&server, "passes again", Duration::from_secs(20), |s| {
        scrub_passes(s) >= before + 2
    });
}
