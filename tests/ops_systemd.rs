//! `rebound serve` under systemd: socket activation (the inherited socket
//! is served, `--listen` is not bound), the notification protocol (READY=1
//! only once the port serves, STATUS=, WATCHDOG=1, STOPPING=1), and the
//! unit files in dist/ pass `systemd-analyze verify`.

mod common;

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, qemu_io, tool};

/// Data directory, NVS and box of one test server; the NVS and box are
/// removed when dropped.
struct Files {
    dir: tempfile::TempDir,
    nvs: PathBuf,
    rbox: PathBuf,
}

impl Files {
    fn new(tag: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let name = dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let nvs = PathBuf::from(format!(
            "/dev/shm/rebound-{tag}-{}-{name}.nvs",
            std::process::id()
        ));
        Self {
            rbox: nvs.with_extension("box"),
            nvs,
            dir,
        }
    }

    fn serve_args(&self) -> Vec<String> {
        let data = self.dir.path().join("data");
        [
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--nvs",
            self.nvs.to_str().unwrap(),
            "--box",
            self.rbox.to_str().unwrap(),
            "--volume-size",
            "32M",
            "--nvs-size",
            "96M",
            "--cache-size",
            "16M",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.nvs);
        let _ = std::fs::remove_file(&self.rbox);
    }
}

fn sigterm_and_wait(child: &mut Child) -> std::process::ExitStatus {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `rebound serve` under systemd-socket-activate listening on `listen`
/// (an address or a socket path), with `extra` flags; returns once the
/// socket listens (systemd-socket-activate says so on the shared stderr).
fn activated(files: &Files, listen: &str, extra: &[&str]) -> Child {
    let child = Command::new(tool("systemd-socket-activate"))
        .args(["-l", listen, env!("CARGO_BIN_EXE_rebound")])
        .args(files.serve_args())
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(files.log()).unwrap())
        .spawn()
        .unwrap();
    wait_for(
        "systemd-socket-activate to listen",
        Duration::from_secs(30),
        || std::fs::read_to_string(files.log()).is_ok_and(|l| l.contains("Listening on")),
    );
    child
}

#[test]
fn socket_activation_serves_nbd_on_the_inherited_socket_without_binding_listen() {
    let files = Files::new("sockact");
    // --listen names a port someone else holds: binding it would fail, so
    // serving proves the inherited socket is used.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free_port();
    let mut child = activated(
        &files,
        &format!("127.0.0.1:{port}"),
        &["--listen", &taken.local_addr().unwrap().to_string()],
    );
    let uri = format!("nbd://127.0.0.1:{port}/");
    let out = qemu_io(
        &["-f", "raw", &uri],
        &["write -P 0xab 0 64k".into(), "read -P 0xab 0 64k".into()],
    );
    assert!(out.contains("read 65536/65536"), "{out}");
    let log = std::fs::read_to_string(files.log()).unwrap();
    assert!(
        log.contains(&format!(
            "serving 33554432 bytes on nbd://127.0.0.1:{port}/"
        )),
        "the banner names the inherited socket:\n{log}"
    );
    assert!(
        sigterm_and_wait(&mut child).success(),
        "{}",
        std::fs::read_to_string(files.log()).unwrap()
    );
}

#[test]
fn socket_activation_serves_nbd_on_an_inherited_unix_socket() {
    let files = Files::new("sockact-unix");
    let sock = files.dir.path().join("nbd.sock");
    let mut child = activated(&files, &sock.to_string_lossy(), &[]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let out = qemu_io(
        &["-f", "raw", &uri],
        &["write -P 0xcd 0 64k".into(), "read -P 0xcd 0 64k".into()],
    );
    assert!(out.contains("read 65536/65536"), "{out}");
    let log = std::fs::read_to_string(files.log()).unwrap();
    assert!(
        log.contains(&format!("serving 33554432 bytes on {uri}")),
        "the banner names the inherited socket:\n{log}"
    );
    assert!(sigterm_and_wait(&mut child).success(), "{log}");
}

/// The notifications received until `until` is among them (or `limit`).
fn receive_until(sock: &UnixDatagram, limit: Duration, until: &str, got: &mut Vec<String>) {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    while !got.iter().any(|m| m.lines().any(|l| l == until)) {
        assert!(
            Instant::now() < deadline,
            "no {until} within {limit:?}; got {got:?}"
        );
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
}

/// Every notification received within `span`.
fn receive_for(sock: &UnixDatagram, span: Duration) -> Vec<String> {
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    let until = Instant::now() + span;
    while Instant::now() < until {
        if let Ok(n) = sock.recv(&mut buf) {
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    got
}

/// `rebound serve` notifying a datagram socket of the test's, with a
/// 200 ms watchdog: the socket and the server.
fn serve_notified(files: &Files) -> (UnixDatagram, Child) {
    let sock_path = files.dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(files.serve_args())
        .args(["--listen", "127.0.0.1:0"])
        .env("NOTIFY_SOCKET", &sock_path)
        .env("WATCHDOG_USEC", "200000")
        .stderr(std::fs::File::create(files.log()).unwrap())
        .spawn()
        .unwrap();
    (sock, child)
}

fn banner_port(log: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text
        .lines()
        .find(|l| l.contains("serving") && l.contains("nbd://"))?;
    let addr = line.split("nbd://").nth(1)?.split('/').next()?;
    addr.rsplit(':').next()?.parse().ok()
}

#[test]
fn notify_ready_comes_after_the_port_serves_then_status_watchdog_and_stopping() {
    let files = Files::new("notify");
    let (sock, mut child) = serve_notified(&files);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(60);
    let n = loop {
        assert!(Instant::now() < deadline, "no notification at all");
        if let Ok(n) = sock.recv(&mut buf) {
            break n;
        }
    };
    let first = String::from_utf8_lossy(&buf[..n]).into_owned();
    // The first notification is READY=1, and by then the port serves.
    assert!(first.lines().any(|l| l == "READY=1"), "{first}");
    let port = banner_port(&files.log()).expect("READY=1 came before the banner");
    TcpStream::connect(("127.0.0.1", port)).expect("READY=1 came before the port served");
    assert!(first.contains("STATUS=serving; new volume"), "{first}");
    got.push(first);
    receive_until(&sock, Duration::from_secs(10), "WATCHDOG=1", &mut got);
    assert!(
        got.iter().skip(1).any(|m| m.starts_with("STATUS=serving")),
        "the reporter says what happens: {got:?}"
    );
    // The watchdog keeps pinging.
    let pings_before = got.iter().filter(|m| *m == "WATCHDOG=1").count();
    let later = receive_for(&sock, Duration::from_secs(1));
    assert!(
        later.iter().filter(|m| *m == "WATCHDOG=1").count() >= 3,
        "pings every 100 ms: {later:?} after {pings_before}"
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    receive_until(&sock, Duration::from_secs(30), "STOPPING=1", &mut got);
    assert!(sigterm_and_wait(&mut child).success());
}

#[test]
fn the_watchdog_stops_pinging_when_the_health_check_gets_no_answer() {
    let files = Files::new("stuck");
    let (sock, mut child) = serve_notified(&files);
    let mut got = Vec::new();
    receive_until(&sock, Duration::from_secs(60), "WATCHDOG=1", &mut got);
    // The health check goes through the admin socket: take it away, as a
    // dead admin thread would leave it.
    std::fs::remove_file(files.dir.path().join("data").join("admin.sock")).unwrap();
    let mut buf = [0u8; 4096];
    let mut after = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !after.iter().any(|m: &String| m.starts_with("STATUS=stuck")) {
        assert!(Instant::now() < deadline, "no STATUS=stuck: {after:?}");
        if let Ok(n) = sock.recv(&mut buf) {
            after.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    // From then on, no ping: systemd's watchdog will restart the server.
    let quiet = receive_for(&sock, Duration::from_secs(1));
    assert!(
        !quiet.iter().any(|m| m == "WATCHDOG=1"),
        "pings went on while stuck: {quiet:?}"
    );
    assert!(sigterm_and_wait(&mut child).success());
}

#[test]
fn notify_reaches_an_abstract_namespace_socket() {
    use std::os::linux::net::SocketAddrExt;
    let files = Files::new("abstract");
    let name = format!("rebound-test-notify-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let sock = UnixDatagram::bind_addr(&addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_rebound"))
        .args(files.serve_args())
        .args(["--listen", "127.0.0.1:0"])
        .env("NOTIFY_SOCKET", format!("@{name}"))
        .stderr(std::fs::File::create(files.log()).unwrap())
        .spawn()
        .unwrap();
    let mut got = Vec::new();
    receive_until(&sock, Duration::from_secs(60), "READY=1", &mut got);
    assert!(sigterm_and_wait(&mut child).success());
    receive_until(&sock, Duration::from_secs(5), "STOPPING=1", &mut got);
}

#[test]
fn systemd_analyze_verifies_the_unit_files() {
    let Some(analyze) = ["/usr/bin/systemd-analyze", "/bin/systemd-analyze"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
    else {
        println!("skipped: systemd-analyze is not installed (Debian package systemd)");
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("dist");
    let dir = tempfile::tempdir().unwrap();
    // The unit names /usr/local/bin/rebound, which verify wants to exist:
    // check the same unit pointing at the binary under test.
    let service = std::fs::read_to_string(root.join("rebound.service"))
        .unwrap()
        .replace("/usr/local/bin/rebound", env!("CARGO_BIN_EXE_rebound"));
    std::fs::write(dir.path().join("rebound.service"), service).unwrap();
    std::fs::copy(
        root.join("rebound.socket"),
        dir.path().join("rebound.socket"),
    )
    .unwrap();
    let out = Command::new(analyze)
        .args(["verify", "--man=no"])
        .arg(dir.path().join("rebound.service"))
        .arg(dir.path().join("rebound.socket"))
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text += &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("rebound."),
        "systemd-analyze verify:\n{text}"
    );
    let unit = std::fs::read_to_string(root.join("rebound.service")).unwrap();
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "RemoveIPC=no",
        "PrivateDevices=no",
    ] {
        assert!(unit.contains(line), "rebound.service lacks {line}");
    }
    let mut socket = String::new();
    std::fs::File::open(root.join("rebound.socket"))
        .unwrap()
        .read_to_string(&mut socket)
        .unwrap();
    assert!(socket.contains("ListenStream=10809"), "{socket}");
}
