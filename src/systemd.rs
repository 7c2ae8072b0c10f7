//! Running under systemd: socket activation (`LISTEN_FDS`/`LISTEN_PID`:
//! serve NBD on the inherited listening socket, fd 3) and the service
//! notification protocol (`NOTIFY_SOCKET`: `READY=1`, `STATUS=...`,
//! `WATCHDOG=1` from a health check, `STOPPING=1`), written over a Unix
//! datagram socket (a path, or `@name` in the abstract namespace).

use std::net::TcpListener;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use controller::Controller;
use controller::host::socket::Listener;

/// The first file descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// A system recovery (rung 4) running longer than this is stuck: the
/// watchdog stops pinging and systemd restarts the server (rung 5).
pub const SYSTEM_RECOVERY_STUCK: Duration = Duration::from_secs(60);

/// Take the listening socket systemd passed, if `LISTEN_PID` names this
/// process. The variables are removed either way (a child must not take
/// them for its own). Must run before the process starts any thread.
pub fn take_listener() -> anyhow::Result<Option<Listener>> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
        // SAFETY: `serve` calls this first, before it starts any thread,
        // so nothing reads the environment concurrently.
        unsafe { std::env::remove_var(var) };
    }
    let (Some(pid), Some(fds)) = (pid, fds) else {
        return Ok(None);
    };
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    let n: u32 = fds
        .trim()
        .parse()
        .with_context(|| format!("LISTEN_FDS={fds:?} is not a count of file descriptors"))?;
    match n {
        0 => return Ok(None),
        1 => {}
        n => tracing::warn!(
            passed = n,
            "socket activation passed several sockets; serving on the first (fd 3) only"
        ),
    }
    let domain = check_listening_stream(LISTEN_FDS_START)?;
    let listener = if domain == libc::AF_UNIX {
        // SAFETY: fd 3 was handed to this process by its service manager
        // (LISTEN_PID is our pid); nothing else in the process owns or
        // closes it, so the listener takes sole ownership.
        let unix = unsafe { UnixListener::from_raw_fd(LISTEN_FDS_START) };
        let path = unix
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(Path::to_path_buf))
            .context("the Unix socket passed by systemd (fd 3) has no path (ListenStream= takes an absolute path)")?;
        // systemd owns the socket file: it is not removed at exit.
        Listener::Unix {
            listener: unix,
            path,
            bound: None,
        }
    } else {
        // SAFETY: as above: fd 3 is ours alone.
        let tcp = unsafe { TcpListener::from_raw_fd(LISTEN_FDS_START) };
        tcp.local_addr()
            .context("the socket passed by systemd (fd 3) is neither TCP nor a Unix socket (ListenStream= takes a port, an address:port or a path)")?;
        Listener::Tcp(tcp)
    };
    // SAFETY: fcntl on an fd we own, with valid commands; no memory is passed.
    unsafe {
        let flags = libc::fcntl(LISTEN_FDS_START, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(LISTEN_FDS_START, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
    Ok(Some(listener))
}

/// Whether `fd` is a listening stream socket: its address family.
fn check_listening_stream(fd: RawFd) -> anyhow::Result<libc::c_int> {
    let get = |opt: libc::c_int| -> std::io::Result<libc::c_int> {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `value`, a
        // c_int we own, and stores the length written in `len`.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&raw mut value).cast(),
                &raw mut len,
            )
        };
        if rc == 0 {
            Ok(value)
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let kind = get(libc::SO_TYPE).context("LISTEN_FDS names fd 3, which is not a socket")?;
    let listening = get(libc::SO_ACCEPTCONN).context("reading fd 3's state")?;
    if kind != libc::SOCK_STREAM || listening == 0 {
        bail!("the socket passed by systemd (fd 3) is not a listening stream socket");
    }
    get(libc::SO_DOMAIN).context("reading fd 3's address family")
}

/// The service manager's notification socket (`NOTIFY_SOCKET`).
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notifier, when `NOTIFY_SOCKET` is set.
    pub fn from_env() -> anyhow::Result<Option<Self>> {
        let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
            return Ok(None);
        };
        let bytes = path.as_bytes();
        let addr = if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)
        } else {
            SocketAddr::from_pathname(Path::new(&path))
        }
        .with_context(|| format!("NOTIFY_SOCKET={path:?} is not a socket address"))?;
        let socket = UnixDatagram::unbound().context("creating the notification socket")?;
        Ok(Some(Self { socket, addr }))
    }

    /// Send one notification (`READY=1`, `STATUS=...`); failures are
    /// logged: the service manager may be gone.
    pub fn send(&self, state: &str) {
        if let Err(e) = self.socket.send_to_addr(state.as_bytes(), &self.addr) {
            tracing::warn!(error = %e, state, "notifying the service manager");
        }
    }
}

/// The watchdog interval systemd asked for (`WATCHDOG_USEC`, for this
/// process if `WATCHDOG_PID` is set): pings go at half of it.
pub fn watchdog_interval() -> Option<Duration> {
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.trim().parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.trim().parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

/// The thread that keeps systemd informed: `STATUS=` when the summary
/// changes, `WATCHDOG=1` every half interval while the health check
/// answers.
#[derive(Debug)]
pub struct Reporter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reporter {
    /// Start reporting for `ctl`, whose admin socket is `admin`.
    pub fn start(
        notifier: Arc<Notifier>,
        ctl: Arc<Controller>,
        admin: std::path::PathBuf,
    ) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("rebound-notify".into())
                .spawn(move || report(&notifier, &ctl, &admin, &stop))
                .context("starting the notification thread")?
        };
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether the ladder is stuck: the admin socket does not answer a health
/// request within `limit`, or a system recovery has run longer than
/// [`SYSTEM_RECOVERY_STUCK`] (`since`: when this one was first seen).
fn stuck(
    ctl: &Controller,
    admin: &Path,
    limit: Duration,
    since: &mut Option<Instant>,
) -> Option<String> {
    if let Err(e) = controller::admin::request_within(admin, "health", limit) {
        return Some(format!("the admin socket does not answer: {e}"));
    }
    if ctl.system().is_running() {
        let start = *since.get_or_insert_with(Instant::now);
        if start.elapsed() > SYSTEM_RECOVERY_STUCK {
            return Some(format!(
                "a system recovery has run for {:?}",
                start.elapsed()
            ));
        }
    } else {
        *since = None;
    }
    None
}

fn report(notifier: &Notifier, ctl: &Controller, admin: &Path, stop: &AtomicBool) {
    let watchdog = watchdog_interval().map(|w| w / 2);
    let tick = watchdog
        .unwrap_or(Duration::from_secs(1))
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(10));
    let mut last_status = String::new();
    let mut last_ping: Option<Instant> = None;
    let mut system_since = None;
    let mut was_stuck = false;
    while !stop.load(Ordering::SeqCst) {
        let summary = controller::control::health::summary(ctl);
        if summary != last_status {
            notifier.send(&format!("STATUS={summary}"));
            last_status = summary;
        }
        if let Some(every) = watchdog
            && last_ping.is_none_or(|t| t.elapsed() >= every)
        {
            match stuck(
                ctl,
                admin,
                every.min(Duration::from_secs(5)),
                &mut system_since,
            ) {
                None => {
                    notifier.send("WATCHDOG=1");
                    last_ping = Some(Instant::now());
                    was_stuck = false;
                }
                Some(why) if !was_stuck => {
                    tracing::error!(%why, "the recovery ladder looks stuck: no more watchdog pings");
                    notifier.send(&format!("STATUS=stuck: {why}"));
                    // Say the summary again once it answers.
                    last_status.clear();
                    was_stuck = true;
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(tick);
    }
}
