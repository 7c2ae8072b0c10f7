//! The controller's health, as `rebound status` reports it (its exit
//! code), the admin socket's `health` request answers it and the systemd
//! notifier summarises it: healthy, or degraded with the reasons (a device
//! lost or rebuilding, lost tracks, a recovery in progress, an abandoned
//! recovery box).

use std::fmt::Write as _;

use crate::controller::{Controller, RestartKind};
use crate::recovery::Rung;

/// Healthy, or degraded for the reasons given.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Health {
    /// `healthy` or `degraded`.
    pub state: &'static str,
    /// Why it is degraded (empty when healthy).
    pub reasons: Vec<String>,
}

impl Health {
    /// Whether nothing is wrong.
    pub fn healthy(&self) -> bool {
        self.reasons.is_empty()
    }

    /// One line: `healthy` or `degraded: why; why`.
    pub fn line(&self) -> String {
        if self.healthy() {
            "healthy".into()
        } else {
            format!("degraded: {}", self.reasons.join("; "))
        }
    }
}

/// The controller's health now.
pub fn check(ctl: &Controller) -> Health {
    let mut reasons = Vec::new();
    if ctl.system().is_running() {
        reasons.push("system recovery (rung 4) in progress".to_owned());
    }
    let m = ctl.runtime().metrics();
    for g in m.groups.iter().filter(|g| g.recovering) {
        reasons.push(format!("group {} recovering (rung 2)", g.name));
    }
    for (i, h) in ctl.volume.health().iter().enumerate() {
        match h.state {
            "online" => {}
            "rebuilding" => reasons.push(format!(
                "device {i} rebuilding ({:.1}%)",
                h.rebuilt_slots as f64 * 100.0 / h.slots.max(1) as f64
            )),
            state => reasons.push(format!("device {i} {state}")),
        }
    }
    let lost = crate::engine::destage::lost_tracks(ctl).len();
    if lost > 0 {
        reasons.push(format!("{lost} lost tracks"));
    }
    if !ctl.journal.healthy() {
        reasons.push("recovery box abandoned (the next restart is hard)".to_owned());
    }
    Health {
        state: if reasons.is_empty() {
            "healthy"
        } else {
            "degraded"
        },
        reasons,
    }
}

/// How the controller started, as a rung: `new volume`, `fast restart
/// (rung 5)` or `hard restart (rung 6: why)`.
pub fn startup_kind(ctl: &Controller) -> String {
    match &ctl.startup().kind {
        RestartKind::Fresh => "new volume".to_owned(),
        RestartKind::Fast => "fast restart (rung 5)".to_owned(),
        RestartKind::Hard { reason } => format!("hard restart (rung 6: {reason})"),
    }
}

/// Recoveries per rung, 1 to 7 (group recoveries counted by rcs).
pub fn recoveries_per_rung(ctl: &Controller) -> [u64; 7] {
    let m = ctl.runtime().metrics();
    let log = ctl.recoveries();
    Rung::ALL.map(|rung| match rung {
        Rung::Group => m.groups.iter().map(|g| g.recoveries).sum(),
        rung => log.count(rung),
    })
}

/// A one-line summary for systemd's `STATUS=`: what happens now, how the
/// server started, and the recoveries per rung so far.
pub fn summary(ctl: &Controller) -> String {
    let health = check(ctl);
    let mut out = if health.healthy() {
        "serving".to_owned()
    } else {
        format!("serving, {}", health.line())
    };
    let _ = write!(out, "; {}", startup_kind(ctl));
    let counts = recoveries_per_rung(ctl);
    if counts.iter().any(|&n| n > 0) {
        let per: Vec<String> = counts
            .iter()
            .zip(1..)
            .filter(|(n, _)| **n > 0)
            .map(|(n, rung)| format!("rung {rung}: {n}"))
            .collect();
        let _ = write!(out, "; recoveries {}", per.join(", "));
    }
    out
}
