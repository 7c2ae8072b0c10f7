//! NBD over TLS (STARTTLS) against real clients: libnbd (nbdinfo, nbdcopy,
//! fio's nbd engine) and qemu (qemu-io with `tls-creds-x509` and
//! `tls-creds-psk`), both GnuTLS clients of the server's OpenSSL, with
//! X.509 certificates and pre-shared keys made at test time (the `openssl`
//! command, psktool), each against a real `rebound serve`; and the
//! credentials the server refuses to start with.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::raw::{IHAVEOPT, Raw};
use common::{Server, random_bytes, run_ok, text, tool};
use openssl::ssl::{SslConnector, SslMethod, SslStream, SslVerifyMode};

/// NBD_OPT_STARTTLS, NBD_OPT_EXPORT_NAME, NBD_REP_ERR_TLS_REQD.
const OPT_STARTTLS: u32 = 5;
const OPT_EXPORT_NAME: u32 = 1;
const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;

/// Throwaway credentials, laid out as qemu and libnbd look for them.
struct Pki {
    _dir: tempfile::TempDir,
    /// The server's: ca-cert.pem, server-cert.pem, server-key.pem.
    server: PathBuf,
    /// A client with a certificate the CA signed: ca-cert.pem,
    /// client-cert.pem, client-key.pem.
    client: PathBuf,
    /// A client that only verifies the server: ca-cert.pem.
    anonymous: PathBuf,
    /// A client with a self-signed certificate (no CA signed it).
    rogue: PathBuf,
    /// psktool's file with the identity `alice`, mode 0600.
    psk: PathBuf,
    /// A directory holding that file as `keys.psk` (qemu's layout).
    psk_dir: PathBuf,
    /// `alice` with another key.
    wrong_psk: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) {
    run_ok(Command::new(tool("openssl")).args(args).current_dir(dir));
}

/// An EC key and a certificate for `cn` signed by the CA in `dir`.
fn signed_cert(dir: &Path, out: &Path, name: &str, cn: &str, ext: &str) {
    let key = out.join(format!("{name}-key.pem"));
    let csr = dir.join(format!("{name}.csr"));
    let ext_file = dir.join(format!("{name}.ext"));
    std::fs::write(&ext_file, ext).unwrap();
    openssl(
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            csr.to_str().unwrap(),
        ],
        dir,
    );
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            csr.to_str().unwrap(),
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-set_serial",
            "7",
            "-days",
            "2",
            "-extfile",
            ext_file.to_str().unwrap(),
            "-out",
            out.join(format!("{name}-cert.pem")).to_str().unwrap(),
        ],
        dir,
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A self-signed EC certificate (a CA, or a client no CA signed).
fn self_signed(dir: &Path, cn: &str, key: &Path, cert: &Path) {
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ],
        dir,
    );
}

/// psktool's file for `alice` (0600), a copy as qemu's `keys.psk` in
/// `qemu_dir`, and a file giving `alice` another key.
fn psk_files(d: &Path, qemu_dir: &Path) -> (PathBuf, PathBuf) {
    let psk = d.join("keys.psk");
    run_ok(
        Command::new(tool("psktool"))
            .args(["-u", "alice", "-p"])
            .arg(&psk),
    );
    std::fs::set_permissions(&psk, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::copy(&psk, qemu_dir.join("keys.psk")).unwrap();
    let wrong = d.join("wrong.psk");
    std::fs::write(&wrong, format!("alice:{}\n", "5a".repeat(32))).unwrap();
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    (psk, wrong)
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sub = |name: &str| {
        let p = d.join(name);
        std::fs::create_dir(&p).unwrap();
        p
    };
    let (server, client, anonymous, rogue, psk_dir) = (
        sub("server"),
        sub("client"),
        sub("anonymous"),
        sub("rogue"),
        sub("qemu-psk"),
    );
    self_signed(
        d,
        "rebound test CA",
        &d.join("ca-key.pem"),
        &d.join("ca-cert.pem"),
    );
    let server_ext = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n";
    signed_cert(d, &server, "server", "localhost", server_ext);
    signed_cert(
        d,
        &client,
        "client",
        "client",
        "extendedKeyUsage=clientAuth\n",
    );
    for to in [&server, &client, &anonymous, &rogue] {
        std::fs::copy(d.join("ca-cert.pem"), to.join("ca-cert.pem")).unwrap();
    }
    let (rogue_key, rogue_cert) = (rogue.join("client-key.pem"), rogue.join("client-cert.pem"));
    self_signed(d, "rogue", &rogue_key, &rogue_cert);
    let (psk, wrong_psk) = psk_files(d, &psk_dir);
    Pki {
        _dir: dir,
        server,
        client,
        anonymous,
        rogue,
        psk,
        psk_dir,
        wrong_psk,
    }
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// libnbd's URI for TLS with the X.509 credentials in `dir`.
fn nbds_x509(server: &Server, dir: &Path) -> String {
    format!("nbds://{}/?tls-certificates={}", server.addr, path(dir))
}

/// nbdinfo on `uri` with libnbd's debug output (the server's error
/// messages are in it).
fn nbdinfo(uri: &str) -> Output {
    Command::new(tool("nbdinfo"))
        .env("LIBNBD_DEBUG", "1")
        .arg(uri)
        .output()
        .unwrap()
}

/// qemu-io options for a TLS connection with the credentials object `creds`.
fn qemu_tls(server: &Server, creds: String) -> Vec<String> {
    vec![
        "--object".into(),
        creds,
        "--image-opts".into(),
        format!(
            "driver=nbd,host=127.0.0.1,port={},tls-creds=tls0",
            server.port()
        ),
    ]
}

fn x509_creds(dir: &Path) -> String {
    format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", path(dir))
}

fn qemu_io_run(target: &[String], commands: &[&str]) -> (String, bool) {
    let target: Vec<&str> = target.iter().map(String::as_str).collect();
    common::qemu_io_run(&target, commands)
}

fn qemu_io_ok(target: &[String], commands: &[&str]) {
    let (out, ok) = qemu_io_run(target, commands);
    assert!(
        ok && !out.contains("fail") && !out.contains("error"),
        "qemu-io: {out}"
    );
}

#[test]
fn tls_required_serves_libnbd_and_qemu_over_tls_and_refuses_plaintext() {
    let pki = pki();
    let server = Server::start(
        "32M",
        &["--tls", "require", "--tls-certificates", path(&pki.server)],
    );
    // qemu writes and reads back over TLS.
    let qemu = qemu_tls(&server, x509_creds(&pki.anonymous));
    qemu_io_ok(&qemu, &["write -P 0xab 20M 1M", "read -P 0xab 20M 1M"]);
    // libnbd: nbdinfo sees TLS; nbdcopy writes 16 MiB (several connections,
    // many requests in flight: the pumps' buffers fill) and reads them back.
    let uri = nbds_x509(&server, &pki.anonymous);
    let out = nbdinfo(&uri);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("with TLS"), "{}", text(&out));
    let src = server.dir.path().join("src.img");
    let data = random_bytes(16 << 20, 25);
    std::fs::write(&src, &data).unwrap();
    run_ok(Command::new(tool("nbdcopy")).arg(&src).arg(&uri));
    let back = server.dir.path().join("back.img");
    run_ok(Command::new(tool("nbdcopy")).arg(&uri).arg(&back));
    let back = std::fs::read(&back).unwrap();
    assert!(
        back[..16 << 20] == data[..],
        "nbdcopy read back other bytes"
    );
    assert!(
        back[20 << 20..21 << 20].iter().all(|&b| b == 0xab),
        "qemu's write is there"
    );
    // Plaintext clients are told TLS is required, and the server goes on.
    let out = nbdinfo(&server.uri());
    assert!(
        !out.status.success(),
        "a plaintext client got in: {}",
        text(&out)
    );
    assert!(text(&out).contains("requires TLS"), "{}", text(&out));
    let (out, ok) = qemu_io_run(&["-f".into(), "raw".into(), server.uri()], &["read 0 4k"]);
    assert!(!ok, "plaintext qemu-io got in: {out}");
    let mut raw = Raw::connect(&server.addr);
    raw.send(&3u32.to_be_bytes());
    raw.option(7, &[0, 0, 0, 0, 0, 0]);
    let (option, kind, message) = raw.option_reply();
    assert_eq!((option, kind), (7, REP_ERR_TLS_REQD), "GO before TLS");
    assert!(String::from_utf8_lossy(&message).contains("STARTTLS"));
    raw.option(OPT_EXPORT_NAME, b"");
    assert!(raw.closed(), "EXPORT_NAME before TLS closes the connection");
    qemu_io_ok(&qemu, &["read -P 0xab 20M 1M"]);
}

#[test]
fn tls_on_serves_plaintext_and_tls_clients_the_same_volume() {
    let pki = pki();
    let server = Server::start(
        "32M",
        &["--tls", "on", "--tls-certificates", path(&pki.server)],
    );
    let plain = vec!["-f".to_owned(), "raw".to_owned(), server.uri()];
    let secured = qemu_tls(&server, x509_creds(&pki.anonymous));
    qemu_io_ok(&plain, &["write -P 0x11 0 1M"]);
    qemu_io_ok(&secured, &["read -P 0x11 0 1M", "write -P 0x22 1M 1M"]);
    qemu_io_ok(&plain, &["read -P 0x22 1M 1M"]);
    assert!(text(&nbdinfo(&server.uri())).contains("without TLS"));
    assert!(text(&nbdinfo(&nbds_x509(&server, &pki.anonymous))).contains("with TLS"));
    // STARTTLS on a raw plaintext connection is acknowledged.
    let mut raw = Raw::connect(&server.addr);
    raw.send(&3u32.to_be_bytes());
    raw.option(OPT_STARTTLS, &[]);
    assert_eq!(raw.option_reply().1, 1, "STARTTLS acknowledged");
}

#[test]
fn a_clean_shutdown_ends_a_connected_tls_client_and_keeps_its_writes() {
    use std::io::{BufRead, Write};
    let pki = pki();
    let mut server = Server::start(
        "32M",
        &["--tls", "require", "--tls-certificates", path(&pki.server)],
    );
    let qemu = qemu_tls(&server, x509_creds(&pki.anonymous));
    // An interactive qemu-io stays connected while its stdin is open.
    let mut child = Command::new(tool("qemu-io"))
        .args(&qemu)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "write -P 0x55 0 1M").unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("wrote") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "qemu-io left");
    }
    assert!(server.stop().success(), "{}", server.log());
    assert!(server.log().contains("clean shutdown"), "{}", server.log());
    drop(stdin);
    let _ = child.wait();
    server.restart();
    qemu_io_ok(
        &qemu_tls(&server, x509_creds(&pki.anonymous)),
        &["read -P 0x55 0 1M"],
    );
}

#[test]
fn a_client_stalled_inside_the_tls_handshake_is_closed_at_the_handshake_timeout() {
    let pki = pki();
    let server = Server::start(
        "32M",
        &[
            "--tls",
            "require",
            "--tls-certificates",
            path(&pki.server),
            "--handshake-timeout",
            "1s",
        ],
    );
    let start = std::time::Instant::now();
    let mut raw = Raw::connect(&server.addr);
    raw.send(&3u32.to_be_bytes());
    raw.option(OPT_STARTTLS, &[]);
    assert_eq!(raw.option_reply().1, 1, "STARTTLS acknowledged");
    // No ClientHello follows.
    assert!(raw.closed(), "the server waits past its handshake timeout");
    let waited = start.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(10),
        "closed after {waited:?}"
    );
    assert!(
        server.logs_within(
            "did not finish its handshake in time",
            std::time::Duration::from_secs(5)
        ),
        "{}",
        server.log()
    );
    let good = qemu_tls(&server, x509_creds(&pki.anonymous));
    qemu_io_ok(&good, &["write -P 0x66 0 4k", "read -P 0x66 0 4k"]);
}

#[test]
fn verify_peer_admits_only_clients_with_a_certificate_the_ca_signed() {
    let pki = pki();
    let server = Server::start(
        "32M",
        &[
            "--tls",
            "require",
            "--tls-certificates",
            path(&pki.server),
            "--tls-verify-peer",
        ],
    );
    for (who, dir) in [
        ("no certificate", &pki.anonymous),
        ("a self-signed one", &pki.rogue),
    ] {
        let out = nbdinfo(&nbds_x509(&server, dir));
        assert!(
            !out.status.success(),
            "a client with {who} got in: {}",
            text(&out)
        );
        let (out, ok) = qemu_io_run(&qemu_tls(&server, x509_creds(dir)), &["read 0 4k"]);
        assert!(!ok, "qemu with {who} got in: {out}");
    }
    let out = nbdinfo(&nbds_x509(&server, &pki.client));
    assert!(out.status.success(), "{}", text(&out));
    let qemu = qemu_tls(&server, x509_creds(&pki.client));
    qemu_io_ok(&qemu, &["write -P 0x33 0 64k", "read -P 0x33 0 64k"]);
    let log = server.log();
    assert!(
        log.contains("TLS failed during the handshake") && log.contains("127.0.0.1"),
        "{log}"
    );
}

#[test]
fn psk_clients_connect_beside_certificates_over_tls_1_3_and_1_2_and_a_wrong_key_is_refused() {
    let pki = pki();
    // Both kinds of credentials on one server: a PSK client must not be
    // pushed to the certificate (TLS 1.3 binds the key to SHA-256).
    let server = Server::start(
        "32M",
        &[
            "--tls",
            "require",
            "--tls-psk",
            path(&pki.psk),
            "--tls-certificates",
            path(&pki.server),
        ],
    );
    let psk_uri = |file: &Path, user: &str| {
        format!("nbds://{user}@{}/?tls-psk-file={}", server.addr, path(file))
    };
    let out = nbdinfo(&psk_uri(&pki.psk, "alice"));
    assert!(
        out.status.success() && text(&out).contains("with TLS"),
        "{}",
        text(&out)
    );
    let qemu = qemu_tls(
        &server,
        format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            path(&pki.psk_dir)
        ),
    );
    qemu_io_ok(&qemu, &["write -P 0x44 0 1M", "read -P 0x44 0 1M"]);
    let out = nbdinfo(&psk_uri(&pki.wrong_psk, "alice"));
    assert!(!out.status.success(), "a wrong key got in: {}", text(&out));
    assert!(
        nbdinfo(&nbds_x509(&server, &pki.anonymous))
            .status
            .success()
    );
    qemu_io_ok(&qemu, &["read -P 0x44 0 1M"]);
    // TLS 1.2's PSK suites too (GnuTLS priority strings, as qemu takes
    // them), and TLS 1.2 with the certificate.
    for kx in ["PSK", "ECDHE-PSK"] {
        let tls12 = qemu_tls(
            &server,
            format!(
                "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice,priority=NORMAL:-VERS-ALL:+VERS-TLS1.2:-KX-ALL:+{kx}",
                path(&pki.psk_dir)
            ),
        );
        qemu_io_ok(&tls12, &["read -P 0x44 0 64k"]);
    }
    let x509_12 = format!(
        "{},priority=NORMAL:-VERS-TLS1.3",
        x509_creds(&pki.anonymous)
    );
    qemu_io_ok(&qemu_tls(&server, x509_12), &["read -P 0x44 0 64k"]);
}

#[test]
fn fio_verifies_its_writes_through_an_nbds_uri() {
    let pki = pki();
    let server = Server::start(
        "64M",
        &["--tls", "require", "--tls-certificates", path(&pki.server)],
    );
    // fio's engine cannot name local files in a URI (libnbd refuses
    // tls-certificates there unless the program allows it), so it
    // encrypts without checking the server's certificate; the other tests
    // check it. `require` proves the session is TLS.
    let job = server.dir.path().join("tls.fio");
    std::fs::write(
        &job,
        format!(
            "[global]\nioengine=nbd\nuri=nbds://{}/?tls-verify-peer=false\nbs=4k\niodepth=16\n\
             size=32m\nverify=crc32c\nverify_fatal=1\ndo_verify=1\nrandrepeat=1\n\
             [verify]\nrw=randwrite\n",
            server.addr
        ),
    )
    .unwrap();
    let out = run_ok(
        Command::new(tool("fio"))
            .current_dir(server.dir.path())
            .arg(&job),
    );
    let out = text(&out);
    assert!(out.contains("err= 0"), "{out}");
}

/// A raw client over TLS: STARTTLS, the TLS handshake (the server's
/// certificate not checked), then GO on the default export.
fn raw_tls_go(addr: &str) -> SslStream<TcpStream> {
    let mut raw = Raw::connect(addr);
    raw.send(&3u32.to_be_bytes());
    raw.option(OPT_STARTTLS, &[]);
    assert_eq!(raw.option_reply().1, 1, "STARTTLS acknowledged");
    let mut b = SslConnector::builder(SslMethod::tls_client()).unwrap();
    b.set_verify(SslVerifyMode::NONE);
    let mut tls = b
        .build()
        .connect("localhost", raw.s)
        .expect("TLS handshake");
    let mut go = IHAVEOPT.to_be_bytes().to_vec();
    go.extend_from_slice(&7u32.to_be_bytes());
    go.extend_from_slice(&6u32.to_be_bytes());
    go.extend_from_slice(&[0; 6]);
    tls.write_all(&go).unwrap();
    loop {
        let mut h = [0u8; 20];
        tls.read_exact(&mut h).unwrap();
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        tls.read_exact(&mut data).unwrap();
        match u32::from_be_bytes(h[12..16].try_into().unwrap()) {
            1 => return tls,
            kind => assert!(kind < 1 << 31, "GO over TLS refused: {kind:#x}"),
        }
    }
}

#[test]
fn a_tls_client_that_reads_no_replies_is_cut_and_its_session_ends() {
    let pki = pki();
    let mut server = Server::start(
        "256M",
        &[
            "--tls",
            "require",
            "--tls-certificates",
            path(&pki.server),
            "--send-timeout",
            "1s",
        ],
    );
    let mut tls = raw_tls_go(&server.addr);
    tls.get_ref()
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    // 32 MiB READs, pipelined, and not one reply read: the replies fill
    // the client's socket, the pump's buffer and the connection's socket.
    for cookie in 0..64u64 {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&((cookie % 7) << 25).to_be_bytes());
        b.extend_from_slice(&(32u32 << 20).to_be_bytes());
        if tls.write_all(&b).is_err() {
            break;
        }
    }
    // The connection cuts the client after send_timeout (1 s); the pump
    // then gives it send_timeout more and closes the session.
    // Neither waits for the client to read.
    std::thread::sleep(Duration::from_secs(4));
    let log = server.log();
    assert!(
        log.contains("send_timeout") && log.contains("took no reply"),
        "{log}"
    );
    // Nothing is left running: a clean shutdown does not wait on it.
    let stopping = Instant::now();
    assert!(server.stop().success(), "{}", server.log());
    assert!(stopping.elapsed() < Duration::from_secs(10));
    // What the client can still read (what the sockets held) ends.
    let started = Instant::now();
    tls.get_ref()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut sink = vec![0u8; 1 << 20];
    let mut total = 0usize;
    loop {
        match tls.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(e) => {
                assert_ne!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock,
                    "never closed: {e}"
                );
                break;
            }
        }
    }
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(total < 256 << 20, "{total} bytes: the client was not cut");
}

/// `rebound serve` with these flags in a fresh directory: whether it
/// started, its stderr, and whether it created the data directory.
fn serve_refused(args: &[&str]) -> (bool, String, bool) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--data-dir", path(&data)])
        .args([
            "--nvs",
            path(&dir.path().join("x.nvs")),
            "--box",
            path(&dir.path().join("x.box")),
        ])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), err, data.exists())
}

/// `rebound serve` with `args` exits with `expect` in its message,
/// before creating its data directory.
fn assert_refused(args: &[&str], expect: &str) {
    let (ok, err, created) = serve_refused(args);
    assert!(!ok, "{args:?} started");
    assert!(
        err.contains(expect),
        "{args:?}: wanted {expect:?} in:\n{err}"
    );
    assert!(
        !created,
        "{args:?}: the data directory was created before the refusal"
    );
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn bad_certificates_stop_the_server_at_start_naming_the_file() {
    let pki = pki();
    let broken = tempfile::tempdir().unwrap();
    let b = broken.path();
    let key = b.join("server-key.pem");
    let on = ["--tls", "on", "--tls-certificates", path(b)];
    assert_refused(&["--tls", "require"], "tls_certificates");
    let missing = b.join("missing");
    assert_refused(
        &["--tls", "on", "--tls-certificates", path(&missing)],
        "missing/server-cert.pem: No such file",
    );
    std::fs::copy(
        pki.server.join("server-cert.pem"),
        b.join("server-cert.pem"),
    )
    .unwrap();
    assert_refused(&on, "server-key.pem");
    std::fs::copy(pki.server.join("server-key.pem"), &key).unwrap();
    chmod(&key, 0o644);
    assert_refused(&on, "server-key.pem has mode 0644");
    std::fs::copy(pki.client.join("client-key.pem"), &key).unwrap();
    chmod(&key, 0o600);
    assert_refused(&on, "server-key.pem: does not match the certificate");
    std::fs::copy(pki.server.join("server-key.pem"), &key).unwrap();
    chmod(&key, 0o600);
    assert_refused(&[&on[..], &["--tls-verify-peer"]].concat(), "ca-cert.pem");
    // The same files pass once complete: the server starts.
    let server = Server::start("32M", &on);
    assert!(nbdinfo(&server.uri()).status.success());
}

#[test]
fn bad_psk_files_stop_the_server_at_start_naming_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let psk = dir.path().join("keys.psk");
    let on = ["--tls", "on", "--tls-psk", path(&psk)];
    assert_refused(&on, "keys.psk: No such file");
    std::fs::write(&psk, "alice:00ff\nbob=0011\n").unwrap();
    chmod(&psk, 0o600);
    assert_refused(&on, "keys.psk: line 2: expected identity:hexkey");
    std::fs::write(&psk, "alice:00ff\nbob:0011\n").unwrap();
    chmod(&psk, 0o640);
    assert_refused(&on, "keys.psk has mode 0640");
    chmod(&psk, 0o600);
    let server = Server::start("32M", &on);
    assert!(nbdinfo(&server.uri()).status.success());
}
