//! The scheduling policy of the connections' threads (`sched_policy`).
//!
//! A client's request wakes a thread of ours (its connection's reader).
//! Under Linux's default policy (`SCHED_OTHER`) the woken thread may
//! preempt whoever woke it: on a host where clients and server share the
//! cores, a client sending a request is switched out for our reader, which
//! runs that one request, finds nothing more, sleeps, and hands the core
//! back; the next request repeats it. Two context switches per request on
//! each side, and requests read one at a time. Under `SCHED_BATCH` (see
//! sched(7)) a woken thread of ours does not preempt the running task: it
//! runs on an idle core at once, as before, and otherwise when the client
//! blocks (waiting for replies) or its time slice ends, and then reads
//! every request that arrived meanwhile in one go. The priority (nice
//! value) and the share of CPU are unchanged; only wake-up preemption
//! goes.
//!
//! Measured on the 2-core host (fio's nbd engine, 4 KiB, 75% reads,
//! buffering output commit): 8 clients x 256 in flight went from 55k to
//! 92k IOPS and the server's CPU per I/O from 18.7 to 9.1 µs; with output
//! commit off, 92k to 97k IOPS. `docs/performance/` gives the
//! measured tables.
//!
//! Only the threads a client's bytes wake take the policy: each
//! connection's threads (its readers and its sender) set it on themselves
//! when the connection enters the transmission phase ([`enter`]). The
//! threads woken by time or by the controller itself (the checkpoint
//! thread with its 1 ms output deadline, the timer, the destage syncer,
//! the task runtime's workers, recovery) keep the policy the process was
//! started with, so their wake-ups still preempt; so does everything under
//! `inherit`, which leaves an operator's `chrt` or systemd
//! `CPUSchedulingPolicy=` alone.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

/// The Linux scheduling policy of the connections' threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedPolicy {
    /// `SCHED_BATCH`: a woken connection thread does not preempt the
    /// running task (the default; see the module doc).
    #[default]
    Batch,
    /// Leave every thread under the policy the process was started with.
    Inherit,
}

impl SchedPolicy {
    /// The valid values, as written in the TOML file and the flag.
    pub const NAMES: &'static [&'static str] = &["batch", "inherit"];

    /// The name, as the configuration writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Inherit => "inherit",
        }
    }
}

impl std::str::FromStr for SchedPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "batch" => Ok(Self::Batch),
            "inherit" => Ok(Self::Inherit),
            other => Err(format!(
                "unknown scheduling policy {other:?} (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// The calling thread, a connection's, takes `policy` (nothing for
/// `inherit`). A refusal (a sandbox without `sched_setscheduler`) is
/// logged once per process; the thread runs on under the policy it has.
pub fn enter(policy: SchedPolicy) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let number = match policy {
        SchedPolicy::Batch => libc::SCHED_BATCH,
        SchedPolicy::Inherit => return,
    };
    if let Err(e) = set_thread(0, number)
        && !WARNED.swap(true, Ordering::Relaxed)
    {
        tracing::warn!(
            policy = policy.name(),
            error = %e,
            "could not set the connection threads' scheduling policy; they run under the inherited one"
        );
    }
}

/// Put thread `tid` (0: the calling thread) under policy `number`
/// (`libc::SCHED_*`, priority 0: `SCHED_OTHER` or `SCHED_BATCH`).
pub fn set_thread(tid: libc::pid_t, number: i32) -> io::Result<()> {
    // Both policies take priority 0 (sched(7)); the nice value stays.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads one sched_param from the reference
    // we pass, which lives across the call; it touches no other memory.
    let rc = unsafe { libc::sched_setscheduler(tid, number, &param) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's nice value becomes `nice` (-20 to 19; on Linux a
/// nice value is per thread).
pub fn set_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid and setpriority take integers and touch no memory.
    let rc = unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The policy number of thread `tid` (0: the calling thread).
pub fn thread_policy(tid: libc::pid_t) -> io::Result<i32> {
    // SAFETY: sched_getscheduler takes a thread id and touches no memory.
    let rc = unsafe { libc::sched_getscheduler(tid) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_entering_batch_reports_batch_and_inherit_leaves_it_alone() {
        // Threads of their own, so the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let before = thread_policy(0).unwrap();
            enter(SchedPolicy::Inherit);
            assert_eq!(thread_policy(0).unwrap(), before, "inherit changes nothing");
            enter(SchedPolicy::Batch);
            assert_eq!(thread_policy(0).unwrap(), libc::SCHED_BATCH);
            // A thread started by a batch thread inherits the policy.
            let child = std::thread::spawn(|| thread_policy(0).unwrap());
            assert_eq!(child.join().unwrap(), libc::SCHED_BATCH);
            set_thread(0, libc::SCHED_OTHER).unwrap();
            assert_eq!(thread_policy(0).unwrap(), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }

    /// Nice is per thread: the thread that sets it has it, the process's
    /// other threads keep theirs.
    #[test]
    fn set_nice_changes_the_calling_thread_only() {
        fn nice_of(tid: i32) -> i32 {
            let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
            // Field 19, counted after the parenthesised command name.
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            after.split(' ').nth(16).unwrap().parse().unwrap()
        }
        // SAFETY: gettid takes nothing and touches no memory.
        let here = unsafe { libc::gettid() };
        let before = nice_of(here);
        let (tid, nice) = std::thread::spawn(|| {
            set_nice(10).unwrap();
            // SAFETY: as above.
            let tid = unsafe { libc::gettid() };
            (tid, nice_of(tid))
        })
        .join()
        .unwrap();
        assert_ne!(tid, here);
        assert_eq!(nice, 10);
        assert_eq!(
            nice_of(here),
            before,
            "the calling thread of the test kept its nice value"
        );
    }

    #[test]
    fn policy_names_parse_and_a_bad_one_lists_the_valid_ones() {
        for name in SchedPolicy::NAMES {
            assert_eq!(name.parse::<SchedPolicy>().unwrap().name(), *name);
        }
        let err = "fifo".parse::<SchedPolicy>().unwrap_err();
        assert!(
            err.contains("\"fifo\"") && err.contains("batch, inherit"),
            "{err}"
        );
    }

    #[test]
    fn setting_a_thread_that_does_not_exist_fails_with_esrch() {
        let err = set_thread(libc::pid_t::MAX, libc::SCHED_BATCH).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH));
    }
}
