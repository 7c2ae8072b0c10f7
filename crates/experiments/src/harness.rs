//! A `rebound serve` process for experiments: a 1 GiB volume with its
//! data, NVS and recovery box in a scratch directory, started from this
//! binary and reached through its admin socket.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// A scratch directory for an experiment, under /dev/shm when it can be.
pub fn scratch_dir() -> anyhow::Result<tempfile::TempDir> {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .context("scratch directory")
}

/// A loopback TCP port free right now (the server binds it next).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `GET /metrics` from a server's Prometheus endpoint (`--metrics ADDR`).
pub fn scrape_metrics(addr: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
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

/// Wait until the server behind the admin socket at `path` answers
/// `status` (a server just started), at most `timeout`.
pub fn wait_ready(path: &std::path::Path, timeout: std::time::Duration) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    while controller::admin::request(path, "status").is_err() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the server did not answer on {} within {timeout:?}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// NVS size of experiment servers.
pub const NVS_SIZE: &str = "256M";

/// A running server.
#[derive(Debug)]
pub struct ServerProc {
    child: Child,
    dir: PathBuf,
}

impl ServerProc {
    fn args(dir: &Path, port: u16) -> Vec<String> {
        vec![
            "serve".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--data-dir".into(),
            dir.join("data").display().to_string(),
            "--nvs".into(),
            dir.join("nvs").display().to_string(),
            "--box".into(),
            dir.join("box").display().to_string(),
            "--volume-size".into(),
            "1G".into(),
            "--nvs-size".into(),
            NVS_SIZE.into(),
            "--cache-size".into(),
            "128M".into(),
        ]
    }

    /// Start and wait for the banner; the time that took and the banner.
    pub fn start(dir: &Path, port: u16) -> anyhow::Result<(Self, Duration, String)> {
        Self::start_with(dir, port, &[])
    }

    /// [`ServerProc::start`] with extra `rebound serve` flags.
    pub fn start_with(
        dir: &Path,
        port: u16,
        extra: &[String],
    ) -> anyhow::Result<(Self, Duration, String)> {
        let exe = std::env::current_exe().context("locating this binary")?;
        let started = Instant::now();
        let mut child = Command::new(exe)
            .args(Self::args(dir, port))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting rebound serve")?;
        let stderr = child.stderr.take().context("server stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("serving") {
                    let _ = tx.send(line);
                }
            }
        });
        let banner = rx
            .recv_timeout(Duration::from_secs(60))
            .context("the server did not start within 60 s")?;
        let ready = started.elapsed();
        Ok((
            Self {
                child,
                dir: dir.to_owned(),
            },
            ready,
            banner,
        ))
    }

    pub fn admin(&self, request: &str) -> anyhow::Result<String> {
        controller::admin::request(&self.dir.join("data").join("admin.sock"), request)
            .map_err(anyhow::Error::msg)
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn stop(mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory involved.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Drop for ServerProc {
    /// An experiment that fails half-way (`?`) must not leave its server
    /// running: killed and reaped unless already stopped.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
