//! Shared harness for end-to-end tests: start the real `rebound serve`
//! process, find its address, stop it (SIGTERM) or kill it (SIGKILL), run
//! real NBD clients against it, and speak raw NBD for bad-input tests.
#![allow(dead_code)]

pub mod raw;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::time::{Duration, Instant};

use experiments::harness::{self, ServeCommand, ServerFiles};

/// A `rebound serve` process with its own data directory and NVS.
pub struct Server {
    proc: Option<harness::Server>,
    cmd: ServeCommand,
    files: ServerFiles,
    pub addr: String,
    /// The URI from the banner (`nbd://..` or `nbd+unix:///?socket=..`).
    pub banner_uri: String,
    pub dir: tempfile::TempDir,
    pub nvs: PathBuf,
    pub rbox: PathBuf,
    pub stderr_log: PathBuf,
}

/// A TCP port free right now on 127.0.0.1 (for servers that must come
/// back on the same port).
pub fn free_port() -> u16 {
    harness::free_port().expect("binding a probe socket")
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
        let files = ServerFiles::nvs_in_shm(dir.path(), "rebound-test");
        let stderr_log = dir.path().join("server.log");
        let mut cmd = ServeCommand::new(env!("CARGO_BIN_EXE_rebound"), &files)
            .log_to(&stderr_log)
            .ready_within(Duration::from_secs(30));
        if !extra.contains(&"--listen") {
            cmd = cmd.flag("--listen", "127.0.0.1:0");
        }
        cmd = cmd.flag("--volume-size", volume);
        // Small defaults keep start-up fast; a test's own flags win.
        for (flag, value) in [("--nvs-size", "96M"), ("--cache-size", "16M")] {
            if !extra.contains(&flag) {
                cmd = cmd.flag(flag, value);
            }
        }
        let mut s = Self {
            proc: None,
            cmd: cmd.args(extra.iter().copied()),
            nvs: files.nvs.clone(),
            rbox: files.rbox.clone(),
            files,
            addr: String::new(),
            banner_uri: String::new(),
            dir,
            stderr_log,
        };
        s.launch();
        s
    }

    fn launch(&mut self) {
        let proc = self.cmd.start().unwrap_or_else(|e| panic!("{e:#}"));
        self.addr = proc.addr().to_owned();
        self.banner_uri = proc.uri().to_owned();
        self.proc = Some(proc);
    }

    /// The admin socket (the default under the data directory).
    pub fn admin_path(&self) -> PathBuf {
        self.files.admin_socket()
    }

    /// Send a request to the admin socket: the answer, or the refusal.
    pub fn admin(&self, request: &str) -> Result<String, String> {
        controller::admin::request(&self.admin_path(), request)
    }

    /// The metrics endpoint (`--metrics`, port 0 allowed) as it bound it.
    pub fn metrics_addr(&self) -> String {
        let proc = self.proc.as_ref().expect("server running");
        proc.metrics_addr()
            .unwrap_or_else(|| panic!("no metrics address in the banner: {}", proc.banner()))
            .to_owned()
    }

    /// `nbd://ADDR/` (the default export), or `nbd+unix:///?socket=PATH`
    /// for a server listening on a Unix socket.
    pub fn uri(&self) -> String {
        if self.addr.is_empty() {
            self.banner_uri.clone()
        } else {
            format!("nbd://{}/", self.addr)
        }
    }

    /// The port.
    pub fn port(&self) -> String {
        self.addr.rsplit(':').next().unwrap().to_owned()
    }

    /// SIGTERM and wait (clean shutdown); the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        let proc = self.proc.take().expect("server running");
        proc.stop().unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// SIGKILL (a crash) and reap.
    pub fn kill9(&mut self) {
        self.proc.take().expect("server running").kill9();
    }

    /// Start again with the same data directory, NVS and flags.
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "stop or kill first");
        self.launch();
    }

    /// Change a flag's value for the next start (added if absent).
    #[allow(dead_code)]
    pub fn set_flag(&mut self, flag: &str, value: &str) {
        self.cmd.set_flag(flag, value);
    }

    /// Run `rebound serve` with this server's flags, expecting it to exit
    /// (a refused start): whether it succeeded, and its stderr.
    #[allow(dead_code)]
    pub fn start_refused(&self) -> (bool, String) {
        assert!(self.proc.is_none(), "stop or kill first");
        let out = self.cmd.run_to_exit().expect("running rebound serve");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The process id of the running server.
    pub fn pid(&self) -> u32 {
        self.proc.as_ref().expect("server running").pid()
    }

    /// Whether the process is still alive.
    pub fn alive(&mut self) -> bool {
        self.proc.as_mut().is_some_and(harness::Server::alive)
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

    /// Whether the server's stderr shows `needle` within `limit`: its lines
    /// reach the log file through a reader thread, a moment after the
    /// server wrote them.
    pub fn logs_within(&self, needle: &str, limit: Duration) -> bool {
        let since = Instant::now();
        loop {
            if self.log().contains(needle) {
                return true;
            }
            if since.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // harness::Server kills and reaps a running process when dropped.
        drop(self.proc.take());
        self.files.remove_nvs_and_box();
    }
}

/// The count of recoveries at `rung` (its name: task, group, system, ...)
/// in a `rebound status` answer.
pub fn rung_count(status: &str, rung: &str) -> u64 {
    harness::rung_count(status, rung)
        .unwrap_or_else(|| panic!("no count for rung {rung} in status:\n{status}"))
}

/// A finished command's stdout then stderr, as text.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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

/// Run qemu-io commands against `target` (its options and URI): the
/// output (stdout and stderr) and whether it succeeded.
pub fn qemu_io_run(target: &[&str], commands: &[&str]) -> (String, bool) {
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
    (text, out.status.success())
}

/// Run qemu-io commands against `uri`; panics with the output on any
/// failure message.
pub fn qemu_io(target: &[&str], commands: &[String]) -> String {
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    let (text, ok) = qemu_io_run(target, &commands);
    assert!(ok, "qemu-io failed: {text}");
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
    harness::scrape_metrics(addr).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The value of the sample `name` (with its labels) in exposition `text`.
pub fn sample(text: &str, name: &str) -> f64 {
    harness::metric_sample(text, name).unwrap_or_else(|_| panic!("no sample {name} in:\n{text}"))
}
