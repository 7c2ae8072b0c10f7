//! A server's CPU time from `/proc`, in all and by thread role, per
//! completed I/O: where a scheme's cost goes (`rebound bench
//! output-commit` splits each cell by these roles).
//!
//! The roles come from the names the controller gives its threads: the
//! rcs runtime's workers (`rebound-worker-N`: destage's device writes and
//! reads of misses), the checkpoint thread (`rebound-epoch`: commits and
//! the release of committed device writes) and the destage syncer
//! (`rebound-destage-sync`, `fdatasync` and writeback). Everything else is
//! the connections' threads (protocol, cache, NVS record, replies, and
//! under output commit the commits their replies end) plus the few other
//! threads (timer, admin, scrub). That role is the process's total less
//! the three: the connection threads end with fio's connections, and
//! `/proc` forgets an ended thread's time, while the process's total
//! (`/proc/PID/stat`) keeps it.

use anyhow::Context;

/// The roles, in the order of [`Ticks::roles`] and of the split.
pub(super) const ROLES: [&str; 4] = [
    "connections and other",
    "rcs workers",
    "checkpoint thread",
    "destage syncer",
];

/// The role of a thread by its name as `/proc/PID/task/TID/comm` gives it
/// (at most 15 bytes): an index into [`ROLES`].
pub(super) fn role_of(comm: &str) -> usize {
    let comm = comm.trim_end();
    if comm.starts_with("rebound-worker") {
        1
    } else if comm == "rebound-epoch" {
        2
    } else if comm.starts_with("rebound-destage") {
        3
    } else {
        0
    }
}

/// CPU clock ticks (user and system) a process has used so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Ticks {
    /// Every thread's, ended ones included.
    pub total: u64,
    /// The live threads' by role (index 0: the live rest).
    pub roles: [u64; 4],
}

/// Fields 14 and 15 (utime, stime) of a `/proc/.../stat` line.
fn stat_ticks(path: &str) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    parse_stat_ticks(&stat).with_context(|| format!("{path}: no utime and stime in {stat:?}"))
}

fn parse_stat_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: count
    // after the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(field(14)? + field(15)?)
}

/// The process's ticks so far, in all and by its live threads' roles.
pub(super) fn ticks(pid: u32) -> anyhow::Result<Ticks> {
    let total = stat_ticks(&format!("/proc/{pid}/stat"))?;
    let mut roles = [0u64; 4];
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
        let task = entry?.path();
        // A thread may end between the listing and the reads: skip it.
        let Ok(comm) = std::fs::read_to_string(task.join("comm")) else {
            continue;
        };
        let Ok(t) = stat_ticks(&task.join("stat").to_string_lossy()) else {
            continue;
        };
        roles[role_of(&comm)] += t;
    }
    Ok(Ticks { total, roles })
}

/// Microseconds of CPU per I/O for `ticks` clock ticks over `ios` I/Os.
pub(super) fn per_io(ticks: u64, ios: u64) -> f64 {
    // SAFETY: sysconf reads a constant of the system and touches no
    // memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    ticks as f64 * 1e6 / hz as f64 / ios.max(1) as f64
}

/// The server's CPU per I/O between two samples over `ios` I/Os: in all,
/// and by role (index 0, connections and other: the total less the
/// controller's own threads, which live through the job).
pub(super) fn split_per_io(before: &Ticks, after: &Ticks, ios: u64) -> (f64, [f64; 4]) {
    let total = after.total.saturating_sub(before.total);
    let mut split = [0.0; 4];
    let mut own = 0;
    for (role, us) in split.iter_mut().enumerate().skip(1) {
        let t = after.roles[role].saturating_sub(before.roles[role]);
        own += t;
        *us = per_io(t, ios);
    }
    split[0] = per_io(total.saturating_sub(own), ios);
    (per_io(total, ios), split)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_given_their_role_by_the_names_the_controller_gives_them() {
        assert_eq!(role_of("rebound-worker-3\n"), 1);
        assert_eq!(role_of("rebound-worker-"), 1);
        assert_eq!(role_of("rebound-epoch\n"), 2);
        assert_eq!(role_of("rebound-destage\n"), 3, "the syncer's 15-byte name");
        for other in [
            "nbd-conn-3.1",
            "rebound-timer",
            "rebound-admin",
            "rebound",
            "",
        ] {
            assert_eq!(role_of(other), 0, "{other:?}");
        }
    }

    #[test]
    fn connections_get_the_total_less_the_controllers_own_threads() {
        let before = Ticks {
            total: 1_000,
            roles: [400, 300, 200, 100],
        };
        // Connection threads that ended took their ticks out of the live
        // rest (role 0 fell), but the total kept them.
        let after = Ticks {
            total: 1_700,
            roles: [50, 500, 250, 200],
        };
        let hz = per_io(1, 1);
        let (total, split) = split_per_io(&before, &after, 10);
        assert!((total - 700.0 * hz / 10.0).abs() < 1e-9);
        assert!((split[1] - 200.0 * hz / 10.0).abs() < 1e-9);
        assert!((split[2] - 50.0 * hz / 10.0).abs() < 1e-9);
        assert!((split[3] - 100.0 * hz / 10.0).abs() < 1e-9);
        assert!(
            (split[0] - 350.0 * hz / 10.0).abs() < 1e-9,
            "700 in all less 350 of the controller's threads"
        );
        assert!((split.iter().sum::<f64>() - total).abs() < 1e-9);
    }

    #[test]
    fn a_stat_line_with_a_parenthesised_name_gives_utime_plus_stime() {
        let line = "42 (a) b)) S 1 42 42 0 -1 4194304 100 0 0 0 17 5 0 0 20 0 9 0 1000 0 0";
        assert_eq!(parse_stat_ticks(line), Some(22));
        assert_eq!(parse_stat_ticks("42 (x) S 1"), None, "too short");
        assert_eq!(parse_stat_ticks("no parenthesis"), None);
    }

    #[test]
    fn a_busy_process_has_ticks_in_all_and_in_its_live_rest() {
        fn thread_cpu() -> std::time::Duration {
            // SAFETY: an all-zero timespec is valid for clock_gettime to fill.
            let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
            // SAFETY: `ts` is a valid, writable timespec for the call.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
            std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        }
        let start = thread_cpu();
        let mut x = 0u64;
        // At least six clock ticks (10 ms each at the usual 100 Hz) of
        // this thread's own CPU time, however busy the host is.
        while thread_cpu() - start < std::time::Duration::from_millis(60) {
            for i in 0..100_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
        }
        std::hint::black_box(x);
        let t = ticks(std::process::id()).unwrap();
        assert!(t.total > 0, "{t:?}");
        assert!(t.roles[0] > 0, "this thread is live and busy: {t:?}");
        assert_eq!(
            t.roles[1] + t.roles[2] + t.roles[3],
            0,
            "no controller threads in a test: {t:?}"
        );
    }
}
