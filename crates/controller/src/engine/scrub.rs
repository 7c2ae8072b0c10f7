//! The scrub: background verification of the NVS records that hold dirty
//! data (DESIGN.md's background component: "scrub, rebuild, statistics").
//!
//! A dirty record may be the only copy of an acknowledged write until its
//! destage; under output commit, a degraded volume or a full device queue
//! it can wait there a long time. Damage to it is otherwise found only when
//! a read or the destage meets it, by which time the cache frame that holds
//! the same data may be gone. So every `scrub_interval` (default 60 s,
//! `0s`: off) a pass checks the data checksum of every dirty record the
//! cache directory names, [`SCRUB_BATCH`] records per low-priority task of
//! the `background` group:
//!
//! - intact: counted;
//! - data damaged ([`NvsError::Damaged`]), and a cache frame holds the
//!   record's data (it is the track's newest record): the record is
//!   repaired in place from the frame's copy, only if the slot still holds
//!   that record and the copy matches the data checksum in its header, so
//!   the record becomes exactly what was written (rung 1, recorded);
//! - data damaged and no such frame: the track is lost
//!   ([`crate::engine::destage::note_lost`]): reads answer `EIO` from now on, not
//!   after the data has been served from a frame that is then evicted;
//! - the slot does not hold the record the directory names
//!   ([`NvsError::Corrupt`]) while the directory still names it: the
//!   in-memory directory is what is wrong (state corruption). The scrub
//!   escalates, as a read that meets it does: a rollback (rung 3, the
//!   entry marked suspect so the checkpoint's value is put back) under
//!   output commit, else a system recovery (rung 4), which rebuilds the
//!   directory from the recovery box or the NVS. Found by the scrub, the
//!   damage is repaired before any read is answered `EIO` for it.
//!
//! A pass works on a snapshot of the directory: a record destaged or
//! superseded meanwhile is skipped (its track's newest record is checked
//! again before anything is decided). A pass stops early when a system
//! recovery (rung 4) quiesces the controller or the server stops; the next
//! pass starts an interval after a pass ends.
//!
//! [`NvsError::Damaged`]: crate::store::nvs::NvsError::Damaged
//! [`NvsError::Corrupt`]: crate::store::nvs::NvsError::Corrupt

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rcs::Priority;

use crate::engine::Engine;
use crate::recovery::Rung;
use crate::store::cache::Dirty;
use crate::store::nvs::NvsError;

/// Records checked by one scrub task before it hands its worker back.
pub const SCRUB_BATCH: usize = 1024;

/// What the scrub has done since start.
#[derive(Debug, Default)]
pub struct ScrubStats {
    /// Passes completed.
    pub passes: AtomicU64,
    /// Records whose data was checked.
    pub checked: AtomicU64,
    /// Damaged records repaired from a cache frame.
    pub repaired: AtomicU64,
    /// Damaged records with no copy (their tracks are lost).
    pub lost: AtomicU64,
    /// Directory entries naming a record their slot does not hold.
    pub inconsistent: AtomicU64,
}

impl ScrubStats {
    /// One line for `rebound status`.
    pub fn describe(&self, interval: Duration) -> String {
        if interval.is_zero() {
            return "scrub: off".to_owned();
        }
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "scrub: every {interval:?}; {} passes, {} records checked; damaged: {} repaired from the cache, {} lost; {} inconsistent directory entries",
            n(&self.passes),
            n(&self.checked),
            n(&self.repaired),
            n(&self.lost),
            n(&self.inconsistent),
        )
    }
}

/// Start the scrub's timer (nothing when `scrub_interval` is zero).
pub(crate) fn start(ctl: &Arc<Engine>) {
    let interval = ctl.config.scrub_interval;
    if !interval.is_zero() {
        schedule(Arc::downgrade(ctl), ctl, interval);
    }
}

fn schedule(weak: Weak<Engine>, ctl: &Engine, interval: Duration) {
    ctl.timer.after(interval, move || {
        let Some(ctl) = weak.upgrade() else { return };
        if ctl.stopping.load(Ordering::Relaxed) {
            return;
        }
        submit(Pass {
            ctl: Arc::clone(&ctl),
            records: None,
            started: Instant::now(),
            handed_on: false,
        });
    });
}

/// The rest of a pass, owned by one task at a time. However its task ends
/// (the pass done or cut short, a panic, the task dropped unrun by a group
/// recovery, a refused submission), dropping it schedules the next pass,
/// unless it was handed on to a following task: the scrub never stops
/// while the server runs.
struct Pass {
    ctl: Arc<Engine>,
    /// Records still to check (from the end); `None`: take a snapshot of
    /// the directory first.
    records: Option<Vec<(u64, Dirty)>>,
    started: Instant,
    handed_on: bool,
}

impl Drop for Pass {
    fn drop(&mut self) {
        let ctl = &self.ctl;
        if !self.handed_on && !ctl.stopping.load(Ordering::Relaxed) {
            schedule(Arc::downgrade(ctl), ctl, ctl.config.scrub_interval);
        }
    }
}

/// Run (the rest of) a pass as a low-priority task of the background group.
fn submit(pass: Pass) {
    let rt = pass.ctl.rt.clone();
    let group = pass.ctl.groups.background;
    // Refused (shutting down, queue full): the closure and its pass are
    // dropped, which schedules the next pass.
    let _ = rt.submit_named(group, Priority::Low, "scrub.batch", move |_ctx| {
        batch(pass);
        Ok(())
    });
}

fn batch(mut pass: Pass) {
    let ctl = Arc::clone(&pass.ctl);
    let stats = &ctl.scrub;
    let mut records = pass
        .records
        .take()
        .unwrap_or_else(|| ctl.cache.dirty_records());
    let mut inconsistent = Vec::new();
    let mut cut_short = false;
    for _ in 0..SCRUB_BATCH {
        if ctl.stopping.load(Ordering::Relaxed) || ctl.system.is_quiescing() {
            cut_short = true;
            break;
        }
        let Some((track, d)) = records.pop() else {
            break;
        };
        if !check(&ctl, track, d) {
            inconsistent.push(track);
        }
    }
    if !inconsistent.is_empty() {
        // State corruption: the rest of the pass would check a directory
        // about to be rebuilt. The next pass checks the rebuilt one.
        for &t in &inconsistent {
            ctl.epochs.suspect(t);
        }
        crate::engine::system::escalate(
            &ctl,
            format!(
                "the scrub found {} directory entries naming records their NVS slots do not hold (first: track {})",
                inconsistent.len(),
                inconsistent[0]
            ),
        );
        cut_short = true;
    }
    if cut_short {
        return;
    }
    if records.is_empty() {
        stats.passes.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(elapsed = ?pass.started.elapsed(), "scrub pass done");
        return;
    }
    pass.handed_on = true;
    submit(Pass {
        ctl: Arc::clone(&ctl),
        records: Some(records),
        started: pass.started,
        handed_on: false,
    });
}

/// Check one record the directory named when the pass began. False: the
/// directory entry is inconsistent (escalate).
fn check(ctl: &Engine, track: u64, d: Dirty) -> bool {
    let stats = &ctl.scrub;
    let still_newest = || ctl.cache.newest_record(track) == Some(d);
    match ctl.nvs.verify_record(d.slot, track, d.seq) {
        Ok(()) => {
            stats.checked.fetch_add(1, Ordering::Relaxed);
        }
        Err(NvsError::Damaged { slot, seq, .. }) => {
            stats.checked.fetch_add(1, Ordering::Relaxed);
            // The frame's copy; written back only if the slot still holds
            // this record and the copy matches its data checksum, so a
            // record superseded or freed meanwhile is left alone.
            let mut copy = vec![0u8; crate::limits::TRACK_BYTES];
            if ctl.cache.dirty_copy(track, d, &mut copy)
                && ctl.nvs.repair_record(slot, track, seq, &copy)
            {
                stats.repaired.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    track,
                    slot,
                    seq,
                    "scrub: NVS record failed its data checksum; repaired from its cached copy"
                );
                ctl.recoveries.record(
                    Rung::Task,
                    format!(
                        "scrub: the NVS record of track {track} (slot {slot}, seq {seq}) failed its data checksum; repaired from its cached copy"
                    ),
                    Duration::ZERO,
                    0,
                );
            } else if still_newest()
                && crate::engine::destage::note_lost(ctl, track, slot, seq, "the scrub")
            {
                stats.lost.fetch_add(1, Ordering::Relaxed);
            }
        }
        Err(e) => {
            // Destaged or superseded since the snapshot: nothing to check.
            if still_newest() {
                stats.checked.fetch_add(1, Ordering::Relaxed);
                stats.inconsistent.fetch_add(1, Ordering::Relaxed);
                tracing::error!(track, slot = d.slot, seq = d.seq, error = %e,
                    "scrub: a directory entry names a record its NVS slot does not hold");
                return false;
            }
        }
    }
    true
}
