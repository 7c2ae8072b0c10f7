//! The scheduling policy of the server's threads (`sched_policy`).
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
//! commit off, 92k to 97k IOPS. The README's bench sections give the
//! measured tables.
//!
//! The policy applies to the whole process: [`apply`] sets it on every
//! thread that exists (`/proc/self/task`), and threads started later
//! inherit it from their creator. `rebound serve` applies it before it
//! starts the controller; in-process users (tests, benches) leave their
//! threads alone.

use std::io;

use serde::{Deserialize, Serialize};

/// The Linux scheduling policy of the server's threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedPolicy {
    /// `SCHED_BATCH`: a woken thread does not preempt the running task
    /// (the default; see the module doc).
    #[default]
    Batch,
    /// `SCHED_OTHER`, the default policy of Linux threads.
    Normal,
}

impl SchedPolicy {
    /// The valid values, as written in the TOML file and the flag.
    pub const NAMES: &'static [&'static str] = &["batch", "normal"];

    /// The name, as the configuration writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Normal => "normal",
        }
    }

    /// The policy's number, as `sched_setscheduler(2)` and the 41st field
    /// of `/proc/PID/task/TID/stat` give it.
    pub fn number(self) -> i32 {
        match self {
            Self::Batch => libc::SCHED_BATCH,
            Self::Normal => libc::SCHED_OTHER,
        }
    }
}

impl std::str::FromStr for SchedPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "batch" => Ok(Self::Batch),
            "normal" => Ok(Self::Normal),
            other => Err(format!(
                "unknown scheduling policy {other:?} (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// Put every thread of this process under `policy`; threads started
/// afterwards inherit it. Returns how many threads were set. A thread
/// that ended meanwhile is skipped; any other refusal is returned (the
/// threads set before it keep the new policy).
pub fn apply(policy: SchedPolicy) -> io::Result<usize> {
    let mut set = 0;
    for entry in std::fs::read_dir("/proc/self/task")? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        match set_thread(tid, policy) {
            Ok(()) => set += 1,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(set)
}

/// Put thread `tid` (0: the calling thread) under `policy`.
pub fn set_thread(tid: libc::pid_t, policy: SchedPolicy) -> io::Result<()> {
    // Both policies take priority 0 (sched(7)); the nice value stays.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads one sched_param from the reference
    // we pass, which lives across the call; it touches no other memory.
    #[allow(unsafe_code)]
    let rc = unsafe { libc::sched_setscheduler(tid, policy.number(), &param) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The policy number of thread `tid` (0: the calling thread).
pub fn thread_policy(tid: libc::pid_t) -> io::Result<i32> {
    // SAFETY: sched_getscheduler takes a thread id and touches no memory.
    #[allow(unsafe_code)]
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
    fn a_thread_set_to_batch_reports_batch_and_back_to_normal() {
        // A thread of its own, so the test harness's threads keep theirs.
        std::thread::spawn(|| {
            assert_eq!(thread_policy(0).unwrap(), libc::SCHED_OTHER);
            set_thread(0, SchedPolicy::Batch).unwrap();
            assert_eq!(thread_policy(0).unwrap(), libc::SCHED_BATCH);
            // A thread started by a batch thread inherits the policy.
            let child = std::thread::spawn(|| thread_policy(0).unwrap());
            assert_eq!(child.join().unwrap(), libc::SCHED_BATCH);
            set_thread(0, SchedPolicy::Normal).unwrap();
            assert_eq!(thread_policy(0).unwrap(), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn policy_names_parse_and_a_bad_one_lists_the_valid_ones() {
        for name in SchedPolicy::NAMES {
            assert_eq!(name.parse::<SchedPolicy>().unwrap().name(), *name);
        }
        let err = "fifo".parse::<SchedPolicy>().unwrap_err();
        assert!(
            err.contains("\"fifo\"") && err.contains("batch, normal"),
            "{err}"
        );
    }

    #[test]
    fn setting_a_thread_that_does_not_exist_fails_with_esrch() {
        let err = set_thread(libc::pid_t::MAX, SchedPolicy::Batch).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ESRCH));
    }
}
