//! `rebound serve --supervise`: run the server as a child process and start
//! it again whenever it dies abnormally (a crash, an injected abort, kill
//! -9), so rung 5 (fast restart from the recovery box) or rung 6 (hard
//! restart) happens without an operator.
//!
//! The supervisor forwards SIGINT and SIGTERM (and SIGHUP) to the server and exits with
//! it after a clean shutdown. If the supervisor itself dies, the kernel
//! sends the server SIGTERM (`PR_SET_PDEATHSIG`): no orphan keeps the port. A server that exits with an error code soon
//! after starting (a bad configuration, a busy port) is not restarted: that
//! would only repeat the error. More than [`RESTARTS_PER_MINUTE_MAX`]
//! restarts within a minute also stop the supervisor.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use controller::Config;

/// Restarts allowed within one minute.
pub const RESTARTS_PER_MINUTE_MAX: usize = 20;
/// A server that fails with an error code sooner than this after starting
/// is not restarted (its error would repeat).
const EARLY_FAILURE: Duration = Duration::from_secs(3);

/// Supervise `rebound serve` with the same arguments minus `--supervise`.
pub fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("locating the rebound executable")?;
    let args: Vec<OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--supervise")
        .collect();
    let crate::serve::Signals { stop, hangup } = crate::serve::Signals::install()?;
    let mut restarts: Vec<Instant> = Vec::new();
    loop {
        let started = Instant::now();
        let supervisor = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        let mut command = Command::new(&exe);
        command.args(&args);
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (prctl, getppid, _exit). It
        // asks the kernel to SIGTERM the server when the supervisor dies
        // (even by SIGKILL), so a dead supervisor never leaves an orphaned
        // server holding the port, NVS and box; if the supervisor is
        // already gone, the child exits at once.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != supervisor {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = command.spawn().context("starting the server process")?;
        eprintln!(
            "rebound supervisor: server pid {} (admin {})",
            child.id(),
            config.admin_path().display()
        );
        let status = loop {
            if let Some(status) = child.try_wait().context("waiting for the server")? {
                break status;
            }
            if hangup.swap(false, Ordering::Relaxed) {
                // SAFETY: kill(2) with a pid we spawned and have not reaped,
                // and a valid signal number; it touches no memory.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGHUP);
                }
            }
            if stop.load(Ordering::Relaxed) {
                // SAFETY: kill(2) with a pid we spawned and have not reaped,
                // and a valid signal number; it touches no memory.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                }
                let status = child.wait().context("waiting for the server")?;
                eprintln!("rebound supervisor: server stopped ({status})");
                return Ok(if status.success() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.success() {
            eprintln!("rebound supervisor: server exited cleanly");
            return Ok(ExitCode::SUCCESS);
        }
        if status.code().is_some() && started.elapsed() < EARLY_FAILURE {
            anyhow::bail!("the server failed right after starting ({status}); not restarting");
        }
        let now = Instant::now();
        restarts.retain(|t| now.duration_since(*t) < Duration::from_secs(60));
        if restarts.len() >= RESTARTS_PER_MINUTE_MAX {
            anyhow::bail!(
                "the server died {} times within a minute; giving up",
                restarts.len()
            );
        }
        restarts.push(now);
        eprintln!(
            "rebound supervisor: server died ({status}) after {:.1?}; restarting",
            started.elapsed()
        );
    }
}
