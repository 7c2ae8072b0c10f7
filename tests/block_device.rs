//! rebound as the block device people deploy: requests at any byte
//! alignment (the kernel client's 512-byte blocks, clients that never
//! negotiated block sizes), read-only exports, export names,
//! BLOCK_STATUS for `nbdinfo --map`, `qemu-img map` and sparse copies,
//! CACHE and FAST_ZERO; each through a real client or a raw one, against a
//! real `rebound serve` process, killed with SIGKILL where it matters.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Server, random_bytes, run_ok, tool};

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A client that enters transmission with NBD_OPT_EXPORT_NAME, as the
/// oldest clients (and the kernel's `nbd-client` without `-g`'s GO) do:
/// no block sizes negotiated, no structured replies.
struct ExportNameClient {
    s: TcpStream,
    size: u64,
    flags: u16,
}

impl ExportNameClient {
    fn connect(addr: &str, name: &str) -> Self {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[0..8], b"NBDMAGIC");
        // Fixed newstyle, no zeroes.
        s.write_all(&3u32.to_be_bytes()).unwrap();
        let mut opt = 0x4948_4156_454F_5054u64.to_be_bytes().to_vec();
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
        opt.extend_from_slice(name.as_bytes());
        s.write_all(&opt).unwrap();
        let mut info = [0u8; 10];
        s.read_exact(&mut info).expect("EXPORT_NAME answer");
        Self {
            s,
            size: u64::from_be_bytes(info[0..8].try_into().unwrap()),
            flags: u16::from_be_bytes([info[8], info[9]]),
        }
    }

    fn send(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, len: u32, data: &[u8]) {
        let mut b = Vec::with_capacity(28 + data.len());
        b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    /// A simple reply: (cookie, error).
    fn reply_head(&mut self) -> (u64, u32) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("reply");
        assert_eq!(&h[0..4], &0x6744_6698u32.to_be_bytes());
        (
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
        )
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.send(1, 0, 7, offset, data.len() as u32, data);
        self.reply_head().1
    }

    fn zero(&mut self, offset: u64, len: u32) -> u32 {
        self.send(6, 0, 8, offset, len, &[]);
        self.reply_head().1
    }

    fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        self.send(0, 0, 9, offset, len, &[]);
        let (cookie, error) = self.reply_head();
        assert_eq!((cookie, error), (9, 0), "read of {len} bytes at {offset}");
        let mut data = vec![0u8; len as usize];
        self.s.read_exact(&mut data).unwrap();
        data
    }
}

/// An offset and length for a partial-track request: sector-sized (the
/// kernel client) half the time, any bytes otherwise.
fn odd_range(rng: &mut Rng, window: u64) -> (u64, u32) {
    if rng.below(2) == 0 {
        let off = rng.below(window / 512 - 16) * 512;
        (off, (1 + rng.below(16)) as u32 * 512)
    } else {
        let off = rng.below(window - 9000);
        (off, 1 + rng.below(9000) as u32)
    }
}

/// Pipeline writes of disjoint byte ranges that share tracks, then check
/// every byte: a read-modify-write that interleaved with another change
/// of its track would put old bytes back.
fn disjoint_writes_in_shared_tracks(
    c: &mut ExportNameClient,
    model: &mut [u8],
    rng: &mut Rng,
    round: u64,
) {
    let base = rng.below(model.len() as u64 / 4096 - 4) * 4096;
    // 16 disjoint 512-byte sectors of 2 tracks, in a random order, some
    // with a few bytes cut off either end.
    let mut sectors: Vec<u64> = (0..16).collect();
    for i in (1..sectors.len()).rev() {
        sectors.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut sent = Vec::new();
    for (k, s) in sectors.into_iter().enumerate() {
        let cut = rng.below(3) * 7;
        let off = base + s * 512 + cut;
        let data = random_bytes(512 - 2 * cut as usize, round * 100 + k as u64);
        c.send(1, 0, 1000 + k as u64, off, data.len() as u32, &data);
        sent.push((off, data));
    }
    for _ in 0..sent.len() {
        let (cookie, error) = c.reply_head();
        assert_eq!(error, 0, "pipelined partial write {cookie} failed");
    }
    for (off, data) in sent {
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    let got = c.read(base, 8192);
    assert!(
        got == model[base as usize..base as usize + 8192],
        "round {round}: concurrent partial writes to shared tracks lost bytes"
    );
}

/// One random partial-track operation against the model, checked by a
/// read of its range.
fn random_op(c: &mut ExportNameClient, model: &mut [u8], rng: &mut Rng, seed: u64) {
    let (off, len) = odd_range(rng, model.len() as u64);
    let range = off as usize..off as usize + len as usize;
    match rng.below(4) {
        0 => {
            assert_eq!(c.zero(off, len), 0, "zero {len} at {off}");
            model[range.clone()].fill(0);
        }
        1 => {}
        _ => {
            let data = random_bytes(len as usize, seed);
            assert_eq!(c.write(off, &data), 0, "write {len} at {off}");
            model[range.clone()].copy_from_slice(&data);
        }
    }
    assert!(c.read(off, len) == model[range], "read {len} at {off}");
}

#[test]
fn partial_track_requests_from_an_export_name_client_match_a_model_across_sigkill() {
    let mut server = Server::start("16M", &[]);
    let window = 2usize << 20;
    let mut model = vec![0u8; window];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for life in 0..3u64 {
        let mut c = ExportNameClient::connect(&server.addr, "");
        assert_eq!(c.size, 16 << 20);
        // Everything acknowledged before the kill is there, byte for byte.
        assert!(
            c.read(0, window as u32) == model,
            "life {life}: acknowledged partial writes lost across SIGKILL"
        );
        for i in 0..150 {
            random_op(&mut c, &mut model, &mut rng, life * 1000 + i);
            if i % 25 == 0 {
                disjoint_writes_in_shared_tracks(&mut c, &mut model, &mut rng, life * 10 + i);
            }
        }
        server.kill9();
        server.restart();
    }
    let mut c = ExportNameClient::connect(&server.addr, "rebound");
    assert!(c.read(0, window as u32) == model);
}

/// Run a Python script with libnbd's bindings (`h` is a handle, as in
/// nbdsh); panic with its output unless it succeeds.
fn nbdsh(script: &str) -> String {
    let out = Command::new("/usr/bin/python3")
        .args(["-c", &format!("import nbd\nh = nbd.NBD()\n{script}")])
        .output()
        .expect("running /usr/bin/python3 with libnbd (python3-libnbd)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "libnbd script failed:\n{text}");
    text
}

#[test]
fn libnbd_without_block_size_negotiation_or_strict_mode_reads_and_writes_any_bytes() {
    let server = Server::start("16M", &[]);
    let out = nbdsh(&format!(
        r#"
h.set_strict_mode(0)
h.set_request_block_size(False)
h.connect_uri("{uri}")
assert h.get_block_size(nbd.SIZE_MINIMUM) == 1, h.get_block_size(nbd.SIZE_MINIMUM)
assert h.get_block_size(nbd.SIZE_PREFERRED) == 4096
import random
rnd = random.Random(5)
model = bytearray(1 << 20)
h.pwrite(bytes(model), 0)
for i in range(300):
    off = rnd.randrange(0, len(model) - 10000)
    n = rnd.choice([512, 1024, 1, 3, 4095, 4097, rnd.randrange(1, 10000)])
    if rnd.random() < 0.7:
        data = rnd.randbytes(n)
        h.pwrite(data, off)
        model[off:off + n] = data
    else:
        h.zero(n, off)
        model[off:off + n] = bytes(n)
    assert h.pread(n, off) == model[off:off + n], (i, off, n)
assert h.pread(len(model), 0) == model
h.flush()
print("ok", h.get_size())
"#,
        uri = server.uri()
    ));
    assert!(out.contains("ok 16777216"), "{out}");
}

#[test]
fn a_read_only_export_refuses_every_change_with_eperm_and_serves_reads() {
    let mut server = Server::start("16M", &[]);
    let mut c = ExportNameClient::connect(&server.addr, "");
    assert_eq!(c.write(0, &[0x5a; 8192]), 0);
    drop(c);
    assert!(server.stop().success());
    // The same volume again, read-only (through the TOML key).
    let config = server.dir.path().join("ro.toml");
    std::fs::write(&config, "read_only = true\n").unwrap();
    server.set_flag("--config", config.to_str().unwrap());
    server.restart();
    let info = run_ok(
        Command::new(tool("nbdinfo"))
            .arg("--json")
            .arg(server.uri()),
    );
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains("\"is_read_only\": true"), "{text}");
    let mut c = ExportNameClient::connect(&server.addr, "");
    assert_ne!(c.flags & (1 << 1), 0, "NBD_FLAG_READ_ONLY advertised");
    const EPERM: u32 = 1;
    assert_eq!(c.write(4096, &[1u8; 4096]), EPERM, "WRITE");
    assert_eq!(c.write(100, &[1u8; 10]), EPERM, "partial WRITE");
    assert_eq!(c.zero(0, 8192), EPERM, "WRITE_ZEROES");
    c.send(4, 0, 11, 0, 4096, &[]);
    assert_eq!(c.reply_head(), (11, EPERM), "TRIM");
    // The session goes on, and nothing changed.
    assert_eq!(c.read(0, 8192), vec![0x5a; 8192]);
    let out = Command::new(tool("qemu-io"))
        .args(["-f", "raw", "-c", "write -P 1 0 4k"])
        .arg(server.uri())
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success()
            && (said.contains("not permitted")
                || said.contains("Permission denied")
                || said.contains("read-only")),
        "qemu-io was not refused: {said}"
    );
    // The flag form of the same setting.
    let ro = Server::start("16M", &["--read-only"]);
    let mut c = ExportNameClient::connect(&ro.addr, "");
    assert_eq!(c.write(0, &[1u8; 512]), EPERM);
}

#[test]
fn export_names_are_listed_with_their_description_and_unknown_names_refused() {
    let server = Server::start(
        "16M",
        &["--export-name", "disk0", "--description", "scratch disk"],
    );
    let out = run_ok(
        Command::new(tool("nbdinfo"))
            .arg("--list")
            .arg(format!("nbd://{}", server.addr)),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"disk0\""), "{text}");
    assert!(text.contains("scratch disk"), "{text}");
    for name in ["", "disk0"] {
        let out = run_ok(
            Command::new(tool("nbdinfo"))
                .arg("--size")
                .arg(format!("nbd://{}/{name}", server.addr)),
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "16777216");
    }
    let out = Command::new(tool("nbdinfo"))
        .arg("--size")
        .arg(format!("nbd://{}/rebound", server.addr))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "an export name not served was accepted"
    );
    // A bad name is refused at start, naming the setting.
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(["serve", "--export-name", "", "--data-dir"])
        .arg(server.dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("export_name"));
}

/// `nbdinfo --map --json`'s extents: (offset, length, type).
fn map_of(uri: &str) -> Vec<(u64, u64, u64)> {
    let out = run_ok(Command::new(tool("nbdinfo")).args(["--map", "--json", uri]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nbdinfo --map --json");
    v.as_array()
        .expect("a list of extents")
        .iter()
        .map(|e| {
            (
                e["offset"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["type"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn block_status_shows_written_tracks_as_data_and_the_rest_as_holes_across_restarts() {
    let mut server = Server::start("16M", &[]);
    run_ok(Command::new(tool("qemu-io")).args([
        "-f",
        "raw",
        "-c",
        "write -P 0x11 0 64k",
        "-c",
        "write -P 0x22 1M 4k",
        "-c",
        "write -P 0x33 2M 100",
        "-c",
        "write -z 16k 16k",
        "-c",
        "discard 48k 8k",
        &server.uri(),
    ]));
    let m = 1 << 20;
    let expected: Vec<(u64, u64, u64)> = vec![
        (0, 16384, 0),
        (16384, 16384, 3),
        (32768, 16384, 0),
        (49152, 8192, 3),
        (57344, 8192, 0),
        (65536, m - 65536, 3),
        (m, 4096, 0),
        (m + 4096, m - 4096, 3),
        (2 * m, 4096, 0),
        (2 * m + 4096, 14 * m - 4096, 3),
    ];
    assert_eq!(map_of(&server.uri()), expected, "after writes (in the NVS)");
    // After a crash (from the NVS and the recovery box) and after a clean
    // stop (destaged: from the allocation map), the same map.
    server.kill9();
    server.restart();
    assert_eq!(map_of(&server.uri()), expected, "after SIGKILL");
    assert!(server.stop().success());
    server.restart();
    assert_eq!(map_of(&server.uri()), expected, "after a clean stop");
    let out = run_ok(Command::new(tool("qemu-img")).args([
        "map",
        "-f",
        "raw",
        "--output=json",
        &server.uri(),
    ]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let holes: Vec<(u64, u64)> = v
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == false)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        holes,
        [
            (16384, 16384),
            (49152, 8192),
            (65536, m - 65536),
            (m + 4096, m - 4096),
            (2 * m + 4096, 14 * m - 4096)
        ]
    );
}

#[test]
fn a_sparse_nbdcopy_copies_exactly_what_a_full_copy_does() {
    let server = Server::start("256M", &[]);
    let src = server.dir.path().join("scattered.img");
    // 64 scattered 64 KiB extents of data in 256 MiB.
    let mut image = vec![0u8; 256 << 20];
    for k in 0..64usize {
        let at = k * (4 << 20) + (k % 7) * 8192;
        image[at..at + 65536].copy_from_slice(&random_bytes(65536, k as u64));
    }
    std::fs::write(&src, &image).unwrap();
    run_ok(
        Command::new(tool("qemu-img"))
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(server.uri()),
    );
    let copy = |name: &str, extra: &[&str]| {
        let out = server.dir.path().join(name);
        let started = Instant::now();
        run_ok(
            Command::new(tool("nbdcopy"))
                .args(extra)
                .arg(server.uri())
                .arg(&out),
        );
        let took = started.elapsed();
        let bytes = std::fs::read(&out).unwrap();
        (out, took, bytes)
    };
    let (_, sparse_time, sparse) = copy("sparse.img", &[]);
    let (_, full_time, full) = copy("full.img", &["--no-extents"]);
    assert!(sparse == image, "the sparse copy differs from the source");
    assert!(full == image, "the full copy differs from the source");
    println!(
        "nbdcopy of a 256 MiB export holding 4 MiB: sparse {:.3} s, full (--no-extents) {:.3} s, ratio {:.2}",
        sparse_time.as_secs_f64(),
        full_time.as_secs_f64(),
        full_time.as_secs_f64() / sparse_time.as_secs_f64()
    );
}

#[test]
fn cache_prefetches_and_fast_zero_is_fast_or_refused() {
    let server = Server::start("16M", &[]);
    let out = nbdsh(&format!(
        r#"
h.connect_uri("{uri}")
assert h.can_cache() and h.can_fast_zero()
h.pwrite(b"B" * 65536, 0)
h.cache(65536, 0)
h.cache(3000, 100)
h.cache(16 << 20, 0)
h.zero(8192, 4096, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(8192, 4096) == bytes(8192)
try:
    h.zero(100, 1, nbd.CMD_FLAG_FAST_ZERO)
    raise SystemExit("a partial-track FAST_ZERO was not refused")
except nbd.Error as e:
    assert e.errnum == 95, e
assert h.pread(100, 1) == b"B" * 100
print("ok")
"#,
        uri = server.uri()
    ));
    assert!(out.contains("ok"), "{out}");
}

#[test]
fn block_status_is_refused_without_the_context_and_answers_req_one_with_one_extent() {
    let server = Server::start("16M", &[]);
    let out = nbdsh(&format!(
        r#"
h.set_strict_mode(0)
h.add_meta_context("base:allocation")
h.connect_uri("{uri}")
assert h.can_meta_context("base:allocation")
h.pwrite(b"" * 4096, 8192)
seen = []
def f(ctx, off, entries, err):
    seen.append(list(entries))
    return 0
h.block_status(16384, 0, f, nbd.CMD_FLAG_REQ_ONE)
assert seen[-1] == [8192, 3], seen
h.block_status(16384, 0, f)
assert seen[-1] == [8192, 3, 4096, 0, 4096, 3], seen
h.block_status(100, 8200, f)
assert seen[-1] == [100, 0], seen
g = nbd.NBD()
g.set_strict_mode(0)
g.connect_uri("{uri}")
try:
    g.block_status(4096, 0, f)
    raise SystemExit("BLOCK_STATUS without a context was answered")
except nbd.Error as e:
    assert e.errnum == 22, e
print("ok")
"#,
        uri = server.uri()
    ));
    assert!(out.contains("ok"), "{out}");
}
