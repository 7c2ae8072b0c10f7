//! The admin socket (`--admin PATH.sock`, default `<data_dir>/admin.sock`):
//! a Unix stream socket through which `rebound status` and `rebound inject`
//! talk to a running server.
//!
//! # Protocol
//!
//! One request per connection: a single line of UTF-8 words, at most
//! [`REQUEST_BYTES_MAX`] bytes, ended by `\n`. The server answers with
//! lines of text and closes the connection. The first line is `ok` or
//! `error: <why>`.
//!
//! | request | effect |
//! |---|---|
//! | `status` | health, groups, recoveries by rung, recent recoveries (rcs's and the controller's) |
//! | `status json` | the same as one JSON object ([`crate::control::report`]) |
//! | `health` | `healthy` or `degraded: why; why` (one line) |
//! | `inject panic POINT [rate=P] [count=N]` | arm the named fault point to panic (rung 1: the request is redriven) |
//! | `inject fail POINT [rate=P] [count=N]` | arm it to fail with a state error (rung 1) |
//! | `inject delay POINT duration=D [rate=P] [count=N]` | arm it to stall: past `task_deadline` the watchdog ends the stall as a time-out |
//! | `inject hang POINT duration=D [rate=P] [count=N]` | arm it to hang for D, deaf to the deadline: past `hung_after` the watchdog recovers the task's group (rung 2), which cannot drain and escalates (rung 4) |
//! | `inject group-fault GROUP [rate=P] [duration=D]` | the scheduling paper's emulation: a fault per dispatch of GROUP with probability P, each recovery taking D (rung 2); `rate=0` stops it |
//! | `inject corrupt-frame TRACK` | damage the check word of the cache frame holding TRACK (4 KiB units): the next read rebuilds it (rung 1) |
//! | `inject unsolicited-completion [DEVICE]` | the device (default 0) reports a completion no submission is waiting for: ignored and counted (rung 1) |
//! | `inject corrupt-directory TRACK` | damage the in-memory directory entry of dirty TRACK (state corruption): the next read finds it naming a record the NVS does not hold; with output commit, rung 3 restores it from the checkpoint, else the read is answered EIO |
//! | `inject corrupt-record TRACK` | damage the data of dirty TRACK's NVS record and drop its cached copy (NVS memory corruption): the track's data is lost; reads and FLUSH answer EIO, recorded once (rung 1), until the track is written again |
//! | `inject lose-device DEVICE` | the failure model's lost device: every I/O to DEVICE fails from now on; a volume with redundancy (`--raid mirror` or `parity`) serves around it and rebuilds a replacement (rung 7); refused without redundancy |
//! | `inject rollback` | roll the controller back to its last checkpoint now (rung 3: needs `--output-commit`; quiesce, restore the checkpoint, drop held writes, run the open epoch's requests again); answers with its report |
//! | `inject system` | run a system-level recovery now (rung 4: quiesce, rebuild from the recovery box, redrive; connections stay up); answers with its report |
//! | `inject rebuild-error COUNT` | the next COUNT writes to a replacement device during a rebuild fail (a failing disk): the rebuild stops, says why in status, and tries again after a growing wait (rung 7) |
//! | `inject abandon-box` | invalidate the recovery box and stop keeping it (a corrupt box: rung 4 rebuilds from an NVS scan, the next start is a hard restart) |
//! | `inject crash` | abort the process (rung 5 at the next start) |
//! | `inject crash-damaged-box` | invalidate the recovery box, then abort (rung 6 at the next start) |
//! | `inject device-error DEVICE op=read\|write\|sync [errno=eio\|enospc] [rate=P] [count=N\|unlimited] [torn=true]` | the environment's fault at the backend door: DEVICE's op fails (default EIO, every time, until cleared); `torn=true` lands half of a write first |
//! | `inject device-latency DEVICE duration=D [op=...] [rate=P]` | DEVICE's I/O (or only op) takes D longer, until cleared |
//! | `inject power-loss` | the process ends as at a power cut: device writes no sync covered are undone at random, the NVS is lost unless it is persistent with `--flush nvs`, the recovery box is lost (needs `--power-loss-tracking`) |
//! | `inject clear` | disarm every fault point, group injection and device fault |
//!
//! # Who may use it
//!
//! The socket is created mode `0600` and every client's uid is checked
//! (`SO_PEERCRED`): only the server's own effective uid and root get an
//! answer; anyone else reads `error: permission denied: ...` and the
//! request is not run (a warning is logged). At start-up an existing path
//! is replaced only if it is a stale socket nobody answers; a live one is
//! another server's, and any other file is an error and is kept. On
//! shutdown the socket is removed only if it is still the one this server
//! bound. The rules are in [`crate::control::socket`].
//!
//! The fault points and the grammar of `inject` are declared once, in
//! [`crate::faults`]; [`crate::engine::inject::arm`] arms them. Defaults:
//! `rate=1`, `count=1` for fault points; `rate=1e-4`, `duration=20ms` for
//! group faults (the paper's numbers).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::controller::Controller;
use crate::faults::Fault;
use crate::sockfile::{self as socket, SocketFile};

/// Longest request line accepted.
pub const REQUEST_BYTES_MAX: usize = 1024;

/// A running admin socket; removes the socket file when dropped (if it is
/// still the one it bound).
#[derive(Debug)]
pub struct AdminServer {
    file: SocketFile,
    stop: Arc<AtomicBool>,
    /// Shared with the accept thread, which blocks in `accept`; dropping
    /// the server shuts it down to wake that thread (no polling: an idle
    /// server's admin thread never wakes).
    listener: Arc<UnixListener>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdminServer {
    /// Listen at `path` with mode 0600 ([`socket::bind_private`]). A stale
    /// socket (nobody listening) is replaced; a live one is refused
    /// ("another server is using PATH"), and so is anything that is not a
    /// socket, which is never deleted.
    pub fn start(path: &Path, ctl: &Arc<Controller>) -> std::io::Result<Self> {
        let (listener, file) = socket::bind_private(
            path,
            socket::ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )?;
        listener.set_nonblocking(false)?;
        let listener = Arc::new(listener);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, ctl, listener) = (Arc::clone(&stop), Arc::clone(ctl), Arc::clone(&listener));
            std::thread::Builder::new()
                .name("rebound-admin".into())
                .spawn(move || serve(&listener, &ctl, &stop))?
        };
        Ok(Self {
            file,
            stop,
            listener,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        socket::stop_accepting(&self.listener);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.file.remove_if_ours();
    }
}

fn serve(listener: &UnixListener, ctl: &Arc<Controller>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = handle(stream, ctl) {
                    tracing::debug!(error = %e, "admin connection");
                }
            }
            Err(_) if stop.load(Ordering::SeqCst) => return,
            Err(e) => {
                tracing::warn!(error = %e, "admin socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle(stream: UnixStream, ctl: &Arc<Controller>) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new((&stream).take(REQUEST_BYTES_MAX as u64 + 1)).read_line(&mut line)?;
    let answer = if line.len() > REQUEST_BYTES_MAX || !line.ends_with('\n') {
        Err(format!(
            "a request is one line of at most {REQUEST_BYTES_MAX} bytes ending in a newline"
        ))
    } else if let Err(refused) = check_peer(&stream) {
        Err(refused)
    } else {
        execute(line.trim(), ctl)
    };
    let oversized = line.len() > REQUEST_BYTES_MAX;
    let mut out = &stream;
    let answered_ok = answer.is_ok();
    match answer {
        Ok(text) => write!(out, "ok\n{text}")?,
        Err(why) => writeln!(out, "error: {why}")?,
    }
    out.flush()?;
    if oversized {
        // Closing with unread input would reset the connection before the
        // client reads the answer: end our side, then discard what is left
        // (bounded) until the client closes.
        stream.shutdown(std::net::Shutdown::Write)?;
        stream.set_read_timeout(Some(Duration::from_millis(200)))?;
        let _ = std::io::copy(&mut (&stream).take(1 << 20), &mut std::io::sink());
    }
    if line.trim() == "inject power-loss" && answered_ok {
        tracing::error!("power loss injected through the admin socket: ending now");
        std::process::abort();
    }
    // Only an answered request crashes: a refused peer's never does.
    if answered_ok && (line.trim() == "inject crash" || line.trim() == "inject crash-damaged-box") {
        crash(ctl, line.trim() == "inject crash-damaged-box");
    }
    Ok(())
}

/// Refuse a client that is neither the server's uid nor root (read after
/// its request, so that it reads the refusal rather than a reset).
fn check_peer(stream: &UnixStream) -> Result<(), String> {
    let uid = socket::peer_uid(stream).map_err(|e| format!("cannot tell who is asking: {e}"))?;
    if socket::may_use(uid) {
        return Ok(());
    }
    tracing::warn!(
        peer_uid = uid,
        "admin request refused: only the server's uid or root may use the admin socket"
    );
    Err(format!(
        "permission denied: uid {uid} may not use this admin socket (only uid {} or root)",
        crate::files::euid()
    ))
}

/// Die as a crash would (no destage, no clean shutdown).
fn crash(ctl: &Controller, damage_box: bool) -> ! {
    if damage_box {
        ctl.journal.abandon();
    }
    tracing::error!(damage_box, "crash injected through the admin socket");
    std::process::abort();
}

/// Run one request; the answer's text (after `ok`) or why it was refused.
pub fn execute(request: &str, ctl: &Arc<Controller>) -> Result<String, String> {
    let words: Vec<&str> = request.split_whitespace().collect();
    match words.as_slice() {
        ["status"] => Ok(crate::control::status::render(ctl)),
        ["status", "json"] => Ok(crate::control::report::render_json(ctl) + "\n"),
        ["health"] => Ok(crate::control::health::check(ctl).line() + "\n"),
        ["inject", rest @ ..] => crate::engine::inject::arm(ctl.engine(), &Fault::parse(rest)?),
        [] => Err("empty request; try `status`".into()),
        [other, ..] => Err(format!(
            "unknown request {other:?}; requests: status, status json, health, inject"
        )),
    }
}

/// Send `request` to the admin socket at `path`; the server's answer.
/// `Err` carries the server's refusal (`error: ...`) or why it could not
/// be reached.
pub fn request(path: &Path, request: &str) -> Result<String, String> {
    request_within(path, request, Duration::from_secs(10)).map_err(|e| match e {
        AdminError::Unreachable(why) | AdminError::Refused(why) => why,
    })
}

/// Why a request got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminError {
    /// No server answers at the socket (or not within the time).
    Unreachable(String),
    /// The server refused the request (`error: ...`).
    Refused(String),
}

impl std::fmt::Display for AdminError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unreachable(why) | Self::Refused(why) => f.write_str(why),
        }
    }
}

/// [`request`], waiting at most `limit` for the answer, and telling an
/// unreachable server from a refusal.
pub fn request_within(path: &Path, request: &str, limit: Duration) -> Result<String, AdminError> {
    let unreachable = |e: std::io::Error| {
        AdminError::Unreachable(format!(
            "cannot reach the admin socket {}: {e} (is `rebound serve` running with this --admin?)",
            path.display()
        ))
    };
    let mut s = UnixStream::connect(path).map_err(unreachable)?;
    s.set_read_timeout(Some(limit)).map_err(unreachable)?;
    s.set_write_timeout(Some(limit)).map_err(unreachable)?;
    writeln!(s, "{request}").map_err(unreachable)?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(unreachable)?;
    match answer.strip_prefix("ok\n") {
        Some(text) => Ok(text.to_owned()),
        None => Err(AdminError::Refused(
            answer
                .trim_end()
                .strip_prefix("error: ")
                .unwrap_or(answer.trim_end())
                .to_owned(),
        )),
    }
}
