//! `rebound status --json`: the content of `rebound status` as one
//! structured value (serialized as a JSON object): health, how the server
//! started, groups, recoveries per rung, recent recoveries, devices and
//! their state, lost tracks, NVS fill, output commit and system recovery.

use std::sync::atomic::Ordering;

use serde::Serialize;

use crate::control::health::{self, Health};
use crate::controller::Controller;
use crate::recovery::Rung;

/// Lost tracks listed by number (all are counted).
pub const LOST_TRACKS_LISTED: usize = 64;
/// Recent recoveries listed (newest last).
pub const RECENT_LISTED: usize = 20;

/// The whole report.
#[derive(Debug, Serialize)]
pub struct StatusReport {
    /// Healthy or degraded, and why.
    pub health: Health,
    /// The NBD address served.
    pub listen: String,
    /// Volume size, bytes.
    pub volume_size: u64,
    /// How the server started.
    pub startup: Startup,
    /// Dirty tracks (in the NVS, not yet destaged).
    pub dirty_tracks: u64,
    /// NVS slots used and in total.
    pub nvs: Nvs,
    /// Tracks whose newest data is lost.
    pub lost_tracks: LostTracks,
    /// Whether the recovery box is kept current.
    pub recovery_box_current: bool,
    /// Output commit (rung 3).
    pub output_commit: OutputCommit,
    /// System recovery (rung 4).
    pub system_recovery: SystemRecovery,
    /// RAID layout and devices.
    pub volume: Volume,
    /// rcs's recovery groups.
    pub groups: Vec<Group>,
    /// Recoveries per rung, 1 to 7.
    pub recoveries_by_rung: Vec<RungCount>,
    /// The most recent recoveries, oldest first.
    pub recent_recoveries: Vec<Recovery>,
}

/// How the server started.
#[derive(Debug, Serialize)]
pub struct Startup {
    /// `fresh`, `fast` or `hard`.
    pub kind: &'static str,
    /// 5 (fast) or 6 (hard); absent for a new volume.
    pub rung: Option<u8>,
    /// As `rebound status` writes it.
    pub description: String,
    /// Start-up recovery time, milliseconds.
    pub elapsed_ms: f64,
    /// Dirty tracks replayed from the NVS or the box.
    pub replayed_tracks: u64,
}

/// The NVS's fill.
#[derive(Debug, Serialize)]
pub struct Nvs {
    /// Slots holding records.
    pub slots_used: u64,
    /// Slots in total.
    pub slots: u64,
    /// `slots_used / slots`.
    pub fill_ratio: f64,
}

/// Lost tracks.
#[derive(Debug, Serialize)]
pub struct LostTracks {
    /// How many.
    pub count: usize,
    /// The first [`LOST_TRACKS_LISTED`].
    pub tracks: Vec<u64>,
}

/// Output commit's state.
#[derive(Debug, Serialize)]
pub struct OutputCommit {
    /// The scheme (`off` when disabled).
    pub scheme: &'static str,
    /// Epochs run.
    pub enabled: bool,
    /// Commits so far.
    pub commits: u64,
    /// Rollbacks so far.
    pub rollbacks: u64,
}

/// System recovery's state.
#[derive(Debug, Serialize)]
pub struct SystemRecovery {
    /// Whether one runs now.
    pub running: bool,
    /// Requests in the pipeline.
    pub in_pipeline: i64,
}

/// The volume.
#[derive(Debug, Serialize)]
pub struct Volume {
    /// `none`, `mirror` or `parity`.
    pub raid: String,
    /// A device lost or rebuilding.
    pub degraded: bool,
    /// Each device.
    pub devices: Vec<Device>,
}

/// One device.
#[derive(Debug, Serialize)]
pub struct Device {
    /// Its number.
    pub index: usize,
    /// Its file.
    pub path: String,
    /// `online`, `lost` or `rebuilding`.
    pub state: &'static str,
    /// Slots rebuilt (while rebuilding).
    pub rebuilt_slots: u64,
    /// Slots on the device.
    pub slots: u64,
    /// Why a rebuild is stopped, if it is.
    pub stalled: Option<String>,
    /// Errors seen: read, write, sync.
    pub errors: DeviceErrors,
    /// The last error.
    pub last_error: Option<String>,
    /// Injected faults armed on it.
    pub faults_armed: usize,
}

/// A device's error counts.
#[derive(Debug, Serialize)]
pub struct DeviceErrors {
    /// Reads.
    pub read: u64,
    /// Writes.
    pub write: u64,
    /// Syncs.
    pub sync: u64,
}

/// One recovery group.
#[derive(Debug, Serialize)]
pub struct Group {
    /// Its name.
    pub name: String,
    /// `serving` or `recovering`.
    pub state: &'static str,
    /// Tasks dispatched.
    pub dispatched: u64,
    /// Tasks failed.
    pub failed: u64,
    /// Tasks aborted.
    pub aborted: u64,
    /// Tasks past their deadline.
    pub overdue: u64,
    /// Faults injected.
    pub injected: u64,
    /// Group recoveries.
    pub recoveries: u64,
    /// Tasks queued.
    pub queued: usize,
}

/// Recoveries at one rung.
#[derive(Debug, Serialize)]
pub struct RungCount {
    /// 1 to 7.
    pub rung: u8,
    /// Its name (`task`, `group`, ...).
    pub name: &'static str,
    /// Recoveries so far.
    pub count: u64,
}

/// One recent recovery.
#[derive(Debug, Serialize)]
pub struct Recovery {
    /// Seconds since the server started.
    pub at_s: f64,
    /// 1 to 7.
    pub rung: u8,
    /// The rung's name, or `group NAME` for a group recovery.
    pub what: String,
    /// How long it took, milliseconds.
    pub duration_ms: f64,
    /// Requests (or tasks, for a group) it affected.
    pub affected: u64,
    /// What failed.
    pub cause: String,
}

/// The report of a running controller.
pub fn report(ctl: &Controller) -> StatusReport {
    let g = ctl.gauges();
    let lost = crate::engine::destage::lost_tracks(ctl);
    let e = ctl.epochs();
    StatusReport {
        health: health::check(ctl),
        listen: ctl.config().listen.to_string(),
        volume_size: ctl.config().volume_size,
        startup: startup(ctl),
        dirty_tracks: ctl.dirty_tracks(),
        nvs: Nvs {
            slots_used: g.nvs.0,
            slots: g.nvs.1,
            fill_ratio: g.nvs.0 as f64 / g.nvs.1.max(1) as f64,
        },
        lost_tracks: LostTracks {
            count: lost.len(),
            tracks: lost.iter().take(LOST_TRACKS_LISTED).copied().collect(),
        },
        recovery_box_current: ctl.journal.healthy(),
        output_commit: OutputCommit {
            scheme: e.scheme().name(),
            enabled: e.enabled(),
            commits: e.stats().commits.load(Ordering::Relaxed),
            rollbacks: e.stats().rollbacks.load(Ordering::Relaxed),
        },
        system_recovery: SystemRecovery {
            running: ctl.system().is_running(),
            in_pipeline: ctl.system().in_pipeline(),
        },
        volume: volume(ctl),
        groups: groups(ctl),
        recoveries_by_rung: Rung::ALL
            .iter()
            .zip(health::recoveries_per_rung(ctl))
            .map(|(&rung, count)| RungCount {
                rung: rung as u8,
                name: rung.name(),
                count,
            })
            .collect(),
        recent_recoveries: recent(ctl),
    }
}

/// The report as one JSON object.
pub fn render_json(ctl: &Controller) -> String {
    serde_json::to_string_pretty(&report(ctl)).unwrap_or_else(|e| format!("{{\"error\": {e:?}}}"))
}

fn startup(ctl: &Controller) -> Startup {
    let s = ctl.startup();
    let (kind, rung) = match &s.kind {
        crate::controller::RestartKind::Fresh => ("fresh", None),
        crate::controller::RestartKind::Fast => ("fast", Some(5)),
        crate::controller::RestartKind::Hard { .. } => ("hard", Some(6)),
    };
    Startup {
        kind,
        rung,
        description: health::startup_kind(ctl),
        elapsed_ms: s.elapsed.as_secs_f64() * 1e3,
        replayed_tracks: s.replayed_tracks,
    }
}

fn volume(ctl: &Controller) -> Volume {
    let devices = ctl
        .volume
        .health()
        .into_iter()
        .enumerate()
        .map(|(index, h)| Device {
            index,
            path: h.path.display().to_string(),
            state: h.state,
            rebuilt_slots: h.rebuilt_slots,
            slots: h.slots,
            stalled: h.stalled,
            errors: DeviceErrors {
                read: h.errors[0],
                write: h.errors[1],
                sync: h.errors[2],
            },
            last_error: h.last_error.map(|e| e.to_string()),
            faults_armed: h.armed,
        })
        .collect();
    Volume {
        raid: ctl.volume.layout().raid().to_string(),
        degraded: ctl.volume.degraded(),
        devices,
    }
}

fn groups(ctl: &Controller) -> Vec<Group> {
    ctl.runtime()
        .metrics()
        .groups
        .iter()
        .map(|g| Group {
            name: g.name.to_string(),
            state: if g.recovering {
                "recovering"
            } else {
                "serving"
            },
            dispatched: g.dispatched,
            failed: g.failed,
            aborted: g.aborted,
            overdue: g.overdue,
            injected: g.injected,
            recoveries: g.recoveries,
            queued: g.queued.iter().sum(),
        })
        .collect()
}

fn recent(ctl: &Controller) -> Vec<Recovery> {
    let mut all: Vec<Recovery> = ctl
        .recoveries()
        .recent()
        .into_iter()
        .map(|r| Recovery {
            at_s: r.at.as_secs_f64(),
            rung: r.rung as u8,
            what: r.rung.name().to_owned(),
            duration_ms: r.duration.as_secs_f64() * 1e3,
            affected: r.requests,
            cause: r.cause,
        })
        .collect();
    for e in ctl.runtime().recent_events() {
        all.push(Recovery {
            at_s: e.at.as_secs_f64(),
            rung: 2,
            what: format!("group {}", e.group_name.as_deref().unwrap_or("?")),
            duration_ms: e.duration.as_secs_f64() * 1e3,
            affected: e.tasks_running as u64 + e.tasks_queued as u64,
            cause: format!("{} ({:?})", e.cause, e.outcome),
        });
    }
    all.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    let skip = all.len().saturating_sub(RECENT_LISTED);
    all.split_off(skip)
}
