//! The text of `rebound status`: its health (the first line, `health:
//! healthy` or `health: degraded: why`), how the server started, the output commit
//! and system recovery rungs, control blocks, the volume's devices and
//! queues, every recovery group, recoveries by rung and the most recent
//! ones (newest last).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::controller::Controller;

/// The status report of a running controller.
pub fn render(ctl: &Controller) -> String {
    let mut out = String::new();
    let m = ctl.runtime().metrics();
    let _ = writeln!(out, "health: {}", crate::control::health::check(ctl).line());
    startup_line(&mut out, ctl, &m);
    scrub_and_lost_tracks(&mut out, ctl);
    output_commit(&mut out, ctl);
    system_recovery(&mut out, ctl);
    control_blocks(&mut out, ctl);
    volume_and_devices(&mut out, ctl);
    queues(&mut out, ctl);
    groups_table(&mut out, &m);
    recoveries_by_rung(&mut out, ctl, &m);
    recent_recoveries(&mut out, ctl);
    out
}

/// How the server started, and what it serves.
fn startup_line(out: &mut String, ctl: &Controller, m: &rcs::MetricsSnapshot) {
    let startup = ctl.startup();
    let how = match &startup.kind {
        crate::controller::RestartKind::Fresh => "new volume".to_owned(),
        crate::controller::RestartKind::Fast => "fast restart (rung 5)".to_owned(),
        crate::controller::RestartKind::Hard { reason } => {
            format!("hard restart (rung 6: {reason})")
        }
    };
    let _ = writeln!(
        out,
        "serving nbd://{}/ : {} bytes; started by {how} in {:?}; {} dirty tracks; policy {}, {} pools; recovery box {}",
        ctl.config().listen,
        ctl.config().volume_size,
        startup.elapsed,
        ctl.dirty_tracks(),
        m.policy,
        m.pools.len(),
        if ctl.journal.healthy() {
            "kept current"
        } else {
            "abandoned (next restart is hard)"
        },
    );
}

/// The scrub, and the tracks whose newest data is lost (if any).
fn scrub_and_lost_tracks(out: &mut String, ctl: &Controller) {
    let _ = writeln!(out, "{}", ctl.scrub.describe(ctl.config().scrub_interval));
    let lost = crate::engine::destage::lost_tracks(ctl);
    if !lost.is_empty() {
        let shown: Vec<String> = lost.iter().take(16).map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "lost tracks: {} (NVS record damaged, no cached copy; reads answer EIO until written again): {}{}",
            lost.len(),
            shown.join(", "),
            if lost.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
    }
}

/// Output commit (rung 3): the scheme, and its epochs if on.
fn output_commit(out: &mut String, ctl: &Controller) {
    let e = ctl.epochs();
    let st = e.stats();
    let _ = writeln!(
        out,
        "output commit (rung 3): {}{}",
        e.scheme().name(),
        if e.enabled() {
            format!(
                ", epoch {} every {:?}; {} replies and {} device writes held; {} commits, {} rollbacks; epochs ended early: {} when idle, {} at half the clients' depth held, {} when output waited {:?}; {} committed by the replying thread",
                e.open(),
                e.interval(),
                e.held_replies(),
                e.device.held(),
                st.commits.load(std::sync::atomic::Ordering::Relaxed),
                st.rollbacks.load(std::sync::atomic::Ordering::Relaxed),
                st.idle_commits.load(std::sync::atomic::Ordering::Relaxed),
                st.half_commits.load(std::sync::atomic::Ordering::Relaxed),
                st.wait_commits.load(std::sync::atomic::Ordering::Relaxed),
                crate::engine::epoch::OUTPUT_WAIT_MAX,
                st.here_commits.load(std::sync::atomic::Ordering::Relaxed),
            )
        } else {
            " (no epochs; rollback escalates to rung 4)".to_owned()
        }
    );
}

/// System recovery (rung 4), and writes failing inside `cache.apply`.
fn system_recovery(out: &mut String, ctl: &Controller) {
    let _ = writeln!(
        out,
        "system recovery (rung 4): {}; {} requests in the pipeline",
        if ctl.system().is_running() {
            "RUNNING"
        } else {
            "idle"
        },
        ctl.system().in_pipeline()
    );
    let _ = writeln!(
        out,
        "writes failing inside cache.apply: {} rolled back alone (Log(Lock), rung 1), {} escalated (rung 4)",
        ctl.metrics.apply_rollbacks.load(Ordering::Relaxed),
        ctl.metrics.apply_escalations.load(Ordering::Relaxed)
    );
}

/// The request control block pool.
fn control_blocks(out: &mut String, ctl: &Controller) {
    let (exhausted, reclaimed, leaked) = ctl.blocks.counts();
    let _ = writeln!(
        out,
        "control blocks: {} of {} free; exhausted {exhausted} times; {reclaimed} leaked blocks reclaimed; {leaked} releases lost (injected)",
        ctl.blocks.available(),
        ctl.blocks.capacity()
    );
}

/// The volume's RAID layout and each device's state.
fn volume_and_devices(out: &mut String, ctl: &Controller) {
    let health = ctl.volume.health();
    let _ = writeln!(
        out,
        "volume: raid {} over {} devices{}",
        ctl.volume.layout().raid(),
        health.len(),
        if ctl.volume.degraded() {
            " (DEGRADED)"
        } else {
            ""
        }
    );
    for (i, h) in health.iter().enumerate() {
        let [r, w, s] = h.errors;
        let troubles = if r + w + s > 0 || h.armed > 0 {
            format!(
                "; errors: read {r}, write {w}, sync {s}{}{}",
                h.last_error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" (last: {e})")),
                if h.armed > 0 {
                    format!("; {} injected faults armed", h.armed)
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        };
        let _ = match h.state {
            "rebuilding" => writeln!(
                out,
                "device {i} {}: rebuilding, {:.1}% ({} of {} slots){}{troubles}",
                h.path.display(),
                h.rebuilt_slots as f64 * 100.0 / h.slots.max(1) as f64,
                h.rebuilt_slots,
                h.slots,
                h.stalled
                    .as_ref()
                    .map_or(String::new(), |w| format!("; {w}"))
            ),
            state => writeln!(
                out,
                "device {i} {}: {state}{}{troubles}",
                h.path.display(),
                h.stalled
                    .as_ref()
                    .map_or(String::new(), |w| format!("; rebuild {w}"))
            ),
        };
    }
}

/// Each device's submission queue.
fn queues(out: &mut String, ctl: &Controller) {
    for (i, q) in ctl.queues.iter().enumerate() {
        let _ = writeln!(
            out,
            "device {i} queue: {} of {} outstanding; {} times full; {} unsolicited completions ignored",
            q.outstanding(),
            q.depth(),
            q.full_count(),
            q.unsolicited_count()
        );
    }
}

/// Every recovery group, one row each.
fn groups_table(out: &mut String, m: &rcs::MetricsSnapshot) {
    let _ = writeln!(out, "\ngroups:");
    let _ = writeln!(
        out,
        "  {:<12} {:>10} {:>12} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}",
        "group",
        "state",
        "dispatched",
        "failed",
        "aborted",
        "overdue",
        "injected",
        "recoveries",
        "queued"
    );
    for g in &m.groups {
        let _ = writeln!(
            out,
            "  {:<12} {:>10} {:>12} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}",
            g.name,
            if g.recovering {
                "RECOVERING"
            } else {
                "serving"
            },
            g.dispatched,
            g.failed,
            g.aborted,
            g.overdue,
            g.injected,
            g.recoveries,
            g.queued.iter().sum::<usize>()
        );
    }
}

/// Recoveries by rung (group recoveries counted by rcs).
fn recoveries_by_rung(out: &mut String, ctl: &Controller, m: &rcs::MetricsSnapshot) {
    let log = ctl.recoveries();
    let group_recoveries: u64 = m.groups.iter().map(|g| g.recoveries).sum();
    let _ = writeln!(out, "\nrecoveries by rung:");
    for rung in crate::recovery::Rung::ALL {
        let n = if rung == crate::recovery::Rung::Group {
            group_recoveries
        } else {
            log.count(rung)
        };
        let _ = writeln!(out, "  {} {:<13} {n}", rung as u8, rung.name());
    }
}

/// The most recent recoveries of every rung, newest last.
fn recent_recoveries(out: &mut String, ctl: &Controller) {
    let log = ctl.recoveries();
    let _ = writeln!(out, "\nrecent recoveries (newest last):");
    let mut lines: Vec<(Duration, String)> = log
        .recent()
        .into_iter()
        .map(|r| {
            (
                r.at,
                format!(
                    "  +{:>10.3}s rung {} {:<13} {:>10.3?} {:>4} req  {}",
                    r.at.as_secs_f64(),
                    r.rung as u8,
                    r.rung.name(),
                    r.duration,
                    r.requests,
                    r.cause
                ),
            )
        })
        .collect();
    for e in ctl.runtime().recent_events() {
        lines.push((
            e.at,
            format!(
                "  +{:>10.3}s rung 2 group {:<7} {:>10.3?} {:>4} tsk  {} ({:?})",
                e.at.as_secs_f64(),
                e.group_name.as_deref().unwrap_or("?"),
                e.duration,
                e.tasks_running as usize + e.tasks_queued,
                e.cause,
                e.outcome
            ),
        ));
    }
    lines.sort_by_key(|(at, _)| *at);
    if lines.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for (_, l) in lines.iter().rev().take(20).rev() {
        let _ = writeln!(out, "{l}");
    }
}
