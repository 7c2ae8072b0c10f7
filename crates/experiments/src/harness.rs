//! The one way tests and experiments start a `rebound serve` process.
//!
//! [`ServeCommand`] says which binary (benches: [`std::env::current_exe`];
//! tests: `env!("CARGO_BIN_EXE_rebound")`), where the server's files live
//! ([`ServerFiles`]) and which flags it gets; [`ServeCommand::start`] runs it,
//! waits for its banner (`rebound: serving ... on nbd://ADDR/ ...`, printed
//! once the admin socket answers) and hands back a [`Server`]: its address,
//! admin requests, SIGTERM ([`Server::stop`]) or SIGKILL ([`Server::kill9`]).
//! A `Server` dropped while running is killed and reaped, so an experiment
//! that fails half-way (`?`) leaves no process behind.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long [`Server::stop`] waits for a clean shutdown before SIGKILL.
const STOP_WITHIN: Duration = Duration::from_secs(60);

/// A scratch directory for an experiment, under /dev/shm when it can be.
pub fn scratch_dir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .context("scratch directory")
}

/// A loopback TCP port free right now (a server binds it next).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET /metrics` from a server's Prometheus endpoint (`--metrics ADDR`).
pub fn scrape_metrics(addr: &str) -> anyhow::Result<String> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr)
        .with_context(|| format!("connecting to the metrics endpoint {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .context("reading the metrics exposition")?;
    Ok(text)
}

/// The value of sample `name` (labels included) in a Prometheus exposition.
pub fn metric_sample(text: &str, name: &str) -> anyhow::Result<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .with_context(|| format!("no sample {name} in the server's metrics"))
}

/// The count of recoveries at `rung` (its name: task, group, system, ...)
/// in a `rebound status` answer; `None` when the answer has no such row.
pub fn rung_count(status: &str, rung: &str) -> Option<u64> {
    status
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(rung))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|n| n.parse().ok())
}

/// Where a server keeps its data directory, NVS and recovery box.
#[derive(Debug, Clone)]
pub struct ServerFiles {
    /// `--data-dir` (the volume label, device files, the admin socket).
    pub data: PathBuf,
    /// `--nvs`.
    pub nvs: PathBuf,
    /// `--box`.
    pub rbox: PathBuf,
}

impl ServerFiles {
    /// All three under `dir` (`data`, `nvs`, `box`): the experiments'
    /// layout, in a [`scratch_dir`] that takes them along when it goes.
    pub fn under(dir: &Path) -> Self {
        Self {
            data: dir.join("data"),
            nvs: dir.join("nvs"),
            rbox: dir.join("box"),
        }
    }

    /// The data directory under `dir`; the NVS and box in /dev/shm, named
    /// `<prefix>-<this process>-<dir's name>.nvs` (and `.box`): the tests'
    /// layout. They outlive `dir`: [`ServerFiles::remove_nvs_and_box`].
    pub fn nvs_in_shm(dir: &Path, prefix: &str) -> Self {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        let nvs = PathBuf::from(format!(
            "/dev/shm/{prefix}-{}-{name}.nvs",
            std::process::id()
        ));
        Self {
            data: dir.join("data"),
            rbox: nvs.with_extension("box"),
            nvs,
        }
    }

    /// The admin socket (the server's default, under the data directory).
    pub fn admin_socket(&self) -> PathBuf {
        self.data.join("admin.sock")
    }

    /// Remove the NVS and recovery box files (missing ones are fine).
    pub fn remove_nvs_and_box(&self) {
        let _ = std::fs::remove_file(&self.nvs);
        let _ = std::fs::remove_file(&self.rbox);
    }
}

/// A `rebound serve` command line, ready to start (again and again).
#[derive(Debug, Clone)]
pub struct ServeCommand {
    exe: PathBuf,
    args: Vec<String>,
    admin: PathBuf,
    log: Option<PathBuf>,
    ready_within: Duration,
}

impl ServeCommand {
    /// `exe serve --data-dir .. --nvs .. --box ..`; waits up to 60 s for
    /// the banner, stderr read but not kept.
    pub fn new(exe: impl Into<PathBuf>, files: &ServerFiles) -> Self {
        let path = |p: &Path| p.to_string_lossy().into_owned();
        Self {
            exe: exe.into(),
            args: vec![
                "serve".into(),
                "--data-dir".into(),
                path(&files.data),
                "--nvs".into(),
                path(&files.nvs),
                "--box".into(),
                path(&files.rbox),
            ],
            admin: files.admin_socket(),
            log: None,
            ready_within: Duration::from_secs(60),
        }
    }

    /// Set `flag` to `value`: replaced if given already, added if not.
    #[must_use]
    pub fn flag(mut self, flag: &str, value: impl Into<String>) -> Self {
        self.set_flag(flag, value);
        self
    }

    /// [`ServeCommand::flag`] in place (e.g. between two starts).
    pub fn set_flag(&mut self, flag: &str, value: impl Into<String>) {
        match self.args.iter().position(|a| a == flag) {
            Some(i) => self.args[i + 1] = value.into(),
            None => self.args.extend([flag.to_owned(), value.into()]),
        }
    }

    /// Append arguments as they are (flags with their values, switches).
    #[must_use]
    pub fn args<S: Into<String>>(mut self, extra: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(extra.into_iter().map(Into::into));
        self
    }

    /// Append every line the server writes to stderr to `path` (across
    /// starts).
    #[must_use]
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.log = Some(path.into());
        self
    }

    /// How long [`ServeCommand::start`] waits for the banner.
    #[must_use]
    pub fn ready_within(mut self, limit: Duration) -> Self {
        self.ready_within = limit;
        self
    }

    /// The full argument list (`serve ...`).
    pub fn arg_list(&self) -> &[String] {
        &self.args
    }

    /// Start the server and wait for its banner. A server that exits or
    /// stays silent is killed, and the error carries its stderr when
    /// [`ServeCommand::log_to`] keeps it.
    pub fn start(&self) -> anyhow::Result<Server> {
        let started = Instant::now();
        let mut child = Command::new(&self.exe)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} serve", self.exe.display()))?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let banner = self.watch_stderr(stderr).recv_timeout(self.ready_within);
        let Ok(banner) = banner else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(match &self.log {
                Some(log) => anyhow::anyhow!(
                    "rebound serve did not start; its stderr:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                ),
                None => {
                    anyhow::anyhow!("rebound serve did not start within {:?}", self.ready_within)
                }
            });
        };
        let addr = banner
            .split("on nbd://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_default()
            .to_owned();
        let uri = banner
            .split(" on ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .unwrap_or_default()
            .to_owned();
        Ok(Server {
            child,
            addr,
            uri,
            banner,
            ready_after: started.elapsed(),
            admin: self.admin.clone(),
        })
    }

    /// A thread that drains the server's stderr into the log (if any) and
    /// sends its banner line once.
    fn watch_stderr(&self, stderr: std::process::ChildStderr) -> std::sync::mpsc::Receiver<String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut log = self.log.as_ref().and_then(|path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok()
        });
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(f) = log.as_mut() {
                    let _ = writeln!(f, "{line}");
                }
                if !sent && (line.contains("on nbd://") || line.contains("on nbd+unix://")) {
                    let _ = tx.send(line);
                    sent = true;
                }
            }
        });
        rx
    }

    /// Run the command to its end (a start expected to be refused): its
    /// status and output.
    pub fn run_to_exit(&self) -> anyhow::Result<Output> {
        Command::new(&self.exe)
            .args(&self.args)
            .output()
            .with_context(|| format!("running {} serve", self.exe.display()))
    }
}

/// A running `rebound serve` process.
#[derive(Debug)]
pub struct Server {
    child: Child,
    addr: String,
    uri: String,
    banner: String,
    ready_after: Duration,
    admin: PathBuf,
}

impl Server {
    /// The NBD address it listens on (`127.0.0.1:PORT`; empty for a Unix
    /// socket).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The NBD URI clients connect with (`nbd://127.0.0.1:PORT/` or
    /// `nbd+unix:///?socket=PATH`), from its banner.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Its process id (to send it a signal).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The metrics endpoint it bound (`127.0.0.1:PORT`, the port chosen by
    /// the system when `--metrics` gave port 0), read from its banner; `None`
    /// without `--metrics`.
    pub fn metrics_addr(&self) -> Option<&str> {
        self.banner
            .split("metrics at http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
    }

    /// Its start-up banner.
    pub fn banner(&self) -> &str {
        &self.banner
    }

    /// How long it took from spawning to the banner.
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// A request to its admin socket: the answer, or the refusal.
    pub fn admin(&self, request: &str) -> anyhow::Result<String> {
        controller::admin::request(&self.admin, request).map_err(anyhow::Error::msg)
    }

    /// Whether the process is still alive.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM (a clean shutdown) and wait for it: its exit status. Killed
    /// (and an error) if it has not exited within a minute.
    pub fn stop(mut self) -> anyhow::Result<ExitStatus> {
        let pid = libc::pid_t::try_from(self.child.id()).context("the server's pid")?;
        // SAFETY: kill(2) on our own child's pid; no memory involved.
        let rc = unsafe { libc::kill(pid, libc::SIGTERM) };
        anyhow::ensure!(rc == 0, "kill(SIGTERM) failed");
        let deadline = Instant::now() + STOP_WITHIN;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                anyhow::bail!("the server did not stop within {STOP_WITHIN:?} after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL (a crash) and reap.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    /// Killed and reaped unless already stopped.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
