//! The controller against real NBD clients: qemu-img, qemu-io, nbdinfo,
//! nbdcopy and fio's nbd engine, each against a real `rebound serve`
//! process.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::{self, Raw};
use common::{Server, random_bytes, run_ok, tool};

#[test]
fn qemu_img_convert_then_compare_round_trips_a_multi_mib_image() {
    let server = Server::start("64M", &[]);
    let src = server.dir.path().join("src.img");
    std::fs::write(&src, random_bytes(12 << 20, 7)).unwrap();
    run_ok(
        Command::new(tool("qemu-img"))
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(server.uri()),
    );
    // The export is larger than the image: compare the image's length.
    let out = run_ok(
        Command::new(tool("qemu-img"))
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(server.uri()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("identical") || text.contains("Images are identical"),
        "{text}"
    );
    // A changed byte is detected (the comparison is real).
    let mut bytes = std::fs::read(&src).unwrap();
    bytes[5 << 20] ^= 0xff;
    std::fs::write(&src, bytes).unwrap();
    let out = Command::new(tool("qemu-img"))
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(server.uri())
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "qemu-img compare missed a difference"
    );
}

#[test]
fn qemu_io_patterns_write_zeroes_and_discard_read_back() {
    let server = Server::start("64M", &[]);
    let script = [
        "write -P 0xab 0 1M",
        "write -P 0x5c 1M 64k",
        "read -P 0xab 0 1M",
        "read -P 0x5c 1M 64k",
        "read -P 0 2M 64k",
        "write -z 64k 128k",
        "read -P 0 64k 128k",
        "read -P 0xab 192k 4k",
        "discard 512k 64k",
        "read -P 0 512k 64k",
        "write -P 0x11 512k 4k",
        "read -P 0x11 512k 4k",
        "flush",
        "write -f -P 0x22 8M 8k",
        "read -P 0x22 8M 8k",
    ];
    let mut cmd = Command::new(tool("qemu-io"));
    cmd.args(["-f", "raw"]);
    for c in script {
        cmd.args(["-c", c]);
    }
    let out = run_ok(cmd.arg(server.uri()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("Pattern verification failed"), "{text}");
    assert_eq!(text.matches("read ").count(), 8, "{text}");
}

#[test]
fn nbdinfo_reports_size_block_sizes_and_capabilities() {
    let server = Server::start("128M", &[]);
    let out = run_ok(
        Command::new(tool("nbdinfo"))
            .arg("--json")
            .arg(server.uri()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for expected in [
        "\"export-size\": 134217728",
        "\"block_size_minimum\": 1",
        "\"block_size_preferred\": 4096",
        "\"can_cache\": true",
        "\"can_fast_zero\": true",
        "\"block_size_maximum\": 33554432",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_multi_conn\": true",
    ] {
        assert!(text.contains(expected), "missing {expected} in {text}");
    }
    let out = run_ok(
        Command::new(tool("nbdinfo"))
            .arg("--list")
            .arg(format!("nbd://{}", server.addr)),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("rebound"));
    // The named export works too; an unknown one is refused.
    run_ok(Command::new(tool("nbdinfo")).arg(format!("nbd://{}/rebound", server.addr)));
    let out = Command::new(tool("nbdinfo"))
        .arg(format!("nbd://{}/nonexistent", server.addr))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent"));
}

#[test]
fn nbdcopy_copies_in_and_out_exactly() {
    let server = Server::start("32M", &[]);
    let src = server.dir.path().join("in.img");
    let back = server.dir.path().join("out.img");
    let data = random_bytes(32 << 20, 99);
    std::fs::write(&src, &data).unwrap();
    run_ok(Command::new(tool("nbdcopy")).arg(&src).arg(server.uri()));
    run_ok(Command::new(tool("nbdcopy")).arg(server.uri()).arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy read back different bytes"
    );
}

fn fio(server: &Server, extra: &[&str]) -> std::process::Output {
    let job = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/fio/verify.fio");
    run_ok(
        Command::new(tool("fio"))
            .env("PORT", server.port())
            // fio saves its verify state in the working directory.
            .current_dir(server.dir.path())
            .arg(job)
            .args(extra),
    )
}

#[test]
fn fio_verify_passes_and_still_verifies_after_a_clean_restart() {
    let mut server = Server::start("256M", &[]);
    let out = fio(&server, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("err= 0"), "{text}");
    assert!(
        server.stop().success(),
        "clean shutdown failed:\n{}",
        server.log()
    );
    assert!(server.log().contains("clean shutdown"));
    server.restart();
    let out = fio(&server, &["--verify_only"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("err= 0"), "{text}");
}

#[test]
fn concurrent_connections_each_see_their_own_writes() {
    let server = Server::start("64M", &[]);
    let clients: Vec<_> = (0..8u8)
        .map(|i| {
            let uri = server.uri();
            std::thread::spawn(move || {
                let off = format!("{}M", i * 4);
                let pattern = format!("{:#x}", 0x10 + i);
                let out = Command::new(tool("qemu-io"))
                    .args(["-f", "raw", "-c"])
                    .arg(format!("write -P {pattern} {off} 2M"))
                    .arg("-c")
                    .arg(format!("read -P {pattern} {off} 2M"))
                    .arg(uri)
                    .output()
                    .unwrap();
                (
                    out.status.success(),
                    String::from_utf8_lossy(&out.stdout).into_owned(),
                )
            })
        })
        .collect();
    for c in clients {
        let (ok, text) = c.join().unwrap();
        assert!(ok && !text.contains("verification failed"), "{text}");
    }
}

#[test]
fn connection_threads_run_their_requests_stages_and_read_back_exactly() {
    for threads in ["1", "8"] {
        let addr = format!("127.0.0.1:{}", common::free_port());
        let server = Server::start(
            "64M",
            &["--connection-threads", threads, "--metrics", &addr],
        );
        let mut cmd = Command::new(tool("qemu-io"));
        cmd.args(["-f", "raw"]);
        for c in [
            "aio_write -P 0x31 0 256k",
            "aio_write -P 0x32 256k 256k",
            "aio_write -P 0x33 512k 256k",
            "aio_flush",
            "read -P 0x31 0 256k",
            "read -P 0x32 256k 256k",
            "read -P 0x33 512k 256k",
        ] {
            cmd.args(["-c", c]);
        }
        let out = run_ok(cmd.arg(server.uri()));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.contains("verification failed"), "{threads}: {text}");
        let metrics = common::scrape(&addr);
        let affiliated = common::sample(&metrics, "rebound_rcs_affiliated_total");
        let host = common::sample(&metrics, "rebound_rcs_completed_total{group=\"host\"}");
        // Every request's host stages ran on its connection thread (no
        // faults armed, dynamic policy).
        assert!(
            affiliated >= host && host >= 6.0,
            "{threads}: {affiliated} affiliated, {host} host tasks"
        );
    }
}

/// Send FLUSH then READ on one connection while the device's syncs take
/// `delay`: the cookies in the order their replies came, and how long the
/// READ's took.
fn flush_then_read(threads: &str, delay: Duration) -> (Vec<u64>, Duration) {
    let server = Server::start("32M", &["--connection-threads", threads]);
    let mut c = Raw::go(&server.addr);
    c.request(raw::CMD_WRITE, 0, 1, 0, 4096);
    c.send(&[0x5a; 4096]);
    assert_eq!(c.simple_reply(0).1, 0, "write");
    server
        .admin(&format!(
            "inject device-latency 0 op=sync duration={}ms",
            delay.as_millis()
        ))
        .unwrap();
    let sent = Instant::now();
    c.request(raw::CMD_FLUSH, 0, 2, 0, 0);
    c.request(raw::CMD_READ, 0, 3, 0, 4096);
    let mut order = Vec::new();
    let mut read_took = Duration::ZERO;
    for _ in 0..2 {
        // A READ's reply carries its data; the FLUSH's none.
        let (cookie, error) = c.reply_header();
        assert_eq!(error, 0, "cookie {cookie}");
        if cookie == 3 {
            read_took = sent.elapsed();
            assert_eq!(c.data(4096), vec![0x5a; 4096]);
        }
        order.push(cookie);
    }
    (order, read_took)
}

#[test]
fn a_request_waiting_for_the_device_does_not_hold_up_its_connections_next_request() {
    // The thread running the FLUSH lets the read side go when the sync
    // starts: another thread reads the READ and answers it from the cache.
    let delay = Duration::from_millis(1500);
    let (order, read_took) = flush_then_read("4", delay);
    assert_eq!(order, [3, 2], "the READ's reply came first");
    assert!(read_took < delay, "READ answered after {read_took:?}");
    // With one thread per connection nobody else reads: the READ waits.
    let (order, read_took) = flush_then_read("1", delay);
    assert_eq!(order, [2, 3]);
    assert!(read_took >= delay, "READ answered after {read_took:?}");
}
