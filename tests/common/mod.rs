//! Shared harness for end-to-end tests: start the real `rebound serve`
//! process, find its address, stop it (SIGTERM) or kill it (SIGKILL), run
//! real NBD clients against it, and speak raw NBD for bad-input tests.
#![allow(dead_code)]

pub mod raw;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A `rebound serve` process with its own data directory and NVS.
pub struct Server {
    child: Option<Child>,
    pub addr: String,
    pub dir: tempfile::TempDir,
    pub nvs: PathBuf,
    pub rbox: PathBuf,
    args: Vec<String>,
    pub stderr_log: PathBuf,
}

/// A TCP port free right now on 127.0.0.1 (for servers that must come
/// back on the same port).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding a probe socket")
        .port()
}

/// Path of a client binary, or a panic telling how to get it.
pub fn tool(name: &str) -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!("{name} is not installed; scripts/test.sh installs the NBD clients the tests need");
}

impl Server {
    /// Start a server with a volume of `volume` (e.g. "256M") and extra flags.
    pub fn start(volume: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let nvs = PathBuf::from(format!(
            "/dev/shm/rebound-test-{}-{}.nvs",
            std::process::id(),
            dir.path().file_name().unwrap().to_string_lossy()
        ));
        let rbox = nvs.with_extension("box");
        let mut args: Vec<String> = vec!["serve".into()];
        if !extra.contains(&"--listen") {
            args.extend(["--listen".into(), "127.0.0.1:0".into()]);
        }
        args.extend([
            "--data-dir".into(),
            dir.path().join("data").to_string_lossy().into_owned(),
            "--nvs".into(),
            nvs.to_string_lossy().into_owned(),
            "--box".into(),
            rbox.to_string_lossy().into_owned(),
            "--volume-size".into(),
            volume.into(),
        ]);
        // Small defaults keep start-up fast; a test's own flags win.
        for (flag, value) in [("--nvs-size", "96M"), ("--cache-size", "16M")] {
            if !extra.contains(&flag) {
                args.extend([flag.to_owned(), value.to_owned()]);
            }
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let stderr_log = dir.path().join("server.log");
        let mut s = Self {
            child: None,
            addr: String::new(),
            dir,
            nvs,
            rbox,
            args,
            stderr_log,
        };
        s.launch();
        s
    }

    fn launch(&mut self) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning rebound serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = self.stderr_log.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .ok();
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(f) = file.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if !sent && let Some(rest) = line.split("on nbd://").nth(1) {
                    let addr = rest.split('/').next().unwrap_or_default().to_owned();
                    let _ = tx.send(addr);
                    sent = true;
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                let log = std::fs::read_to_string(&self.stderr_log).unwrap_or_default();
                panic!("rebound serve did not start; its stderr:\n{log}")
            });
        self.addr = addr;
        self.child = Some(child);
    }

    /// The admin socket (the default under the data directory).
    pub fn admin_path(&self) -> PathBuf {
        self.dir.path().join("data").join("admin.sock")
    }

    /// Send a request to the admin socket: the answer, or the refusal.
    pub fn admin(&self, request: &str) -> Result<String, String> {
        controller::admin::request(&self.admin_path(), request)
    }

    /// `nbd://ADDR/` (the default export).
    pub fn uri(&self) -> String {
        format!("nbd://{}/", self.addr)
    }

    /// The port.
    pub fn port(&self) -> String {
        self.addr.rsplit(':').next().unwrap().to_owned()
    }

    /// SIGTERM and wait (clean shutdown); the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("server running");
        let pid = child.id() as i32;
        // SAFETY: kill(2) with a pid we spawned and own; no memory involved.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill(SIGTERM) failed");
        wait_timeout(&mut child, Duration::from_secs(60))
            .expect("server did not stop after SIGTERM")
    }

    /// SIGKILL (a crash) and reap.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("server running");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Start again with the same data directory, NVS and flags.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill first");
        self.launch();
    }

    /// Change a flag's value for the next start (added if absent).
    #[allow(dead_code)]
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        match self.args.iter().position(|a| a == flag) {
            Some(i) => self.args[i + 1] = value.to_owned(),
            None => self.args.extend([flag.to_owned(), value.to_owned()]),
        }
    }

    /// Run `rebound serve` with this server's flags, expecting it to exit
    /// (a refused start): whether it succeeded, and its stderr.
    #[allow(dead_code)]
    pub fn start_refused(&self) -> (bool, String) {
        assert!(self.child.is_none(), "stop or kill first");
        let out = Command::new(env!("CARGO_BIN_EXE_rebound"))
            .args(&self.args)
            .output()
            .expect("running rebound serve");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Whether the process is still alive.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// The start-up banner of the current process (its last "serving" line).
    pub fn banner(&self) -> String {
        // The reader thread appends lines as they come; wait for this start's.
        self.log()
            .lines()
            .rfind(|l| l.contains("serving"))
            .unwrap_or_default()
            .to_owned()
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.nvs);
        let _ = std::fs::remove_file(&self.rbox);
    }
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The count of recoveries at `rung` (its name: task, group, system, ...)
/// in a `rebound status` answer.
pub fn rung_count(status: &str, rung: &str) -> u64 {
    status
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(rung))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count for rung {rung} in status:\n{status}"))
}

/// Run a command; panic with its output unless it succeeds.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawning a client");
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Deterministic pseudo-random bytes.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Run qemu-io commands against `uri`; panics with the output on any
/// failure message.
pub fn qemu_io(target: &[&str], commands: &[String]) -> String {
    let mut cmd = Command::new(tool("qemu-io"));
    cmd.args(target);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = cmd.output().expect("running qemu-io");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "qemu-io failed: {text}");
    assert!(
        !text.contains("failed") && !text.contains("error"),
        "qemu-io reported an error: {text}"
    );
    text
}

/// Wait (up to `limit`) until the server's status satisfies `want`; that
/// status. Panics naming `what`, with the last status and the server log.
pub fn wait_status(
    server: &Server,
    what: &str,
    limit: Duration,
    want: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(s) = server.admin("status")
            && want(&s)
        {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{}\n{}",
            server.admin("status").unwrap_or_default(),
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET /metrics` from a server's Prometheus endpoint (`--metrics ADDR`).
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// The value of the sample `name` (with its labels) in exposition `text`.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}
