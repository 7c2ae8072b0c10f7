//! Rung 4: in-process system-level recovery (DESIGN.md's ladder; the
//! papers' "system-level recovery" without the reboot).
//!
//! When the controller's in-memory state can no longer be trusted but the
//! process is sound (a stage failed in the middle of changing the cache
//! directory, so no task-level redrive is provably safe; a request kept
//! failing past its redrive bound; or an operator asked), the controller
//! rebuilds that state in place, as a fast restart would, without losing
//! its process, its sockets or its clients:
//!
//! 1. **Quiesce.** The admission gate is closed: connection readers block
//!    before reserving NVS space, so clients see a delay, never an error.
//!    Every request already in the pipeline is *parked* at the entry of its
//!    next stage (a stage checks [`SystemRecovery::is_quiescing`] before its
//!    body begins), a FLUSH stops between tracks and parks, and destage
//!    stops between tracks. The recovery waits until no request is in a
//!    stage body and no destage task runs ([`QUIESCE_TIMEOUT`]; past it the
//!    process aborts and rung 5 takes over).
//! 2. **Rebuild** the cache directory, the destage queue and the NVS free
//!    list from the recovery box (checked item by item; the NVS must hold
//!    every record the box names, and every other slot is erased and freed)
//!    or, when the box is not trusted, from a scan of the NVS (rung 6's
//!    source, in process). Cached copies are dropped: they are only copies.
//! 3. **Redrive** every parked request from a stage where running it again
//!    is safe against the rebuilt state: reads from the cache lookup,
//!    writes not yet in the directory from the NVS write with fresh slots
//!    (their old records were erased or superseded), writes already in the
//!    directory from FUA or their reply, FLUSH, TRIM and WRITE_ZEROES from
//!    their start (each is idempotent). Then the gate opens.
//!
//! One system recovery runs at a time; a request that escalates while one
//! runs is parked and redriven by it. A request is escalated to rung 4 at
//! most once: if it fails again past its redrive bound it is answered EIO.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::engine::Engine;
use crate::engine::datapath;
use crate::engine::request::Request;
use crate::recovery::Rung;

/// Longest wait for the pipeline to drain before giving up on rung 4.
pub const QUIESCE_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for NVS space when redriving a parked write.
const RESERVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the rebuilt state came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildSource {
    /// The recovery box's dirty directory.
    RecoveryBox,
    /// A scan of the NVS (the box was not trusted).
    NvsScan,
}

/// What one system recovery did.
#[derive(Debug, Clone)]
pub struct SystemReport {
    /// Why it ran.
    pub cause: String,
    /// Where the directory came from.
    pub source: RebuildSource,
    /// Why the box was not used (scan only).
    pub box_refused: Option<String>,
    /// Dirty tracks in the rebuilt directory.
    pub dirty_tracks: u64,
    /// Requests parked and redriven.
    pub redriven: u64,
    /// Time to quiesce.
    pub quiesce: Duration,
    /// Time to rebuild.
    pub rebuild: Duration,
    /// Gate closed to gate open.
    pub total: Duration,
}

impl std::fmt::Display for SystemReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rung 4 system recovery ({}): rebuilt {} dirty tracks from {}; {} requests redriven; quiesce {:.3?}, rebuild {:.3?}, total {:.3?}",
            self.cause,
            self.dirty_tracks,
            match self.source {
                RebuildSource::RecoveryBox => "the recovery box".to_owned(),
                RebuildSource::NvsScan => format!(
                    "an NVS scan ({})",
                    self.box_refused.as_deref().unwrap_or("box not used")
                ),
            },
            self.redriven,
            self.quiesce,
            self.rebuild,
            self.total
        )
    }
}

/// Why a system recovery did not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SystemError {
    /// Another one is running.
    #[error("a system recovery is already running")]
    Busy,
    /// The controller is shutting down.
    #[error("the controller is shutting down")]
    Stopping,
    /// Rollback needs epochs (`--output-commit` other than off).
    #[error(
        "rollback needs output commit (serve with --output-commit stall, buffering or logging)"
    )]
    NoEpochs,
}

/// What one rollback (rung 3) did.
#[derive(Debug, Clone)]
pub struct RollbackReport {
    /// Why it ran.
    pub cause: String,
    /// The epoch rolled back (its work runs again).
    pub epoch: u64,
    /// Directory entries put back to their checkpoint value.
    pub restored_tracks: u64,
    /// Held device writes dropped (stall, buffering) or logged writes
    /// undone on the devices (logging).
    pub dropped_writes: u64,
    /// Requests run again: held replies plus requests in the pipeline.
    pub rerun: u64,
    /// Destage writes whose device sync the quiesce did not wait for:
    /// their tracks stayed dirty and destage again.
    pub unsynced_revoked: u64,
    /// Time to quiesce (the three parts below).
    pub quiesce: Duration,
    /// Waiting for a commit in progress to finish its outputs.
    pub commit_wait: Duration,
    /// Closing the admission gate (readers inside it leave).
    pub gate_wait: Duration,
    /// Draining the pipeline (requests park, destage stops).
    pub drain: Duration,
    /// Time to restore the checkpoint.
    pub restore: Duration,
    /// Gate closed to gate open.
    pub total: Duration,
    /// The checkpoint could not be restored and the state was rebuilt as
    /// rung 4 does instead: why, and from what.
    pub fell_back: Option<String>,
}

impl std::fmt::Display for RollbackReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rung 3 rollback ({}): epoch {} rolled back, {} directory entries restored, {} held device writes dropped, {} destage writes left unsynced, {} requests run again; quiesce {:.3?} (commit {:.3?}, gate {:.3?}, drain {:.3?}), restore {:.3?}, total {:.3?}",
            self.cause,
            self.epoch,
            self.restored_tracks,
            self.dropped_writes,
            self.unsynced_revoked,
            self.rerun,
            self.quiesce,
            self.commit_wait,
            self.gate_wait,
            self.drain,
            self.restore,
            self.total
        )?;
        if let Some(why) = &self.fell_back {
            write!(f, "; rollback refused, rung 4 instead: {why}")?;
        }
        Ok(())
    }
}

/// The state rung 4 needs: the admission gate, the quiesce flag, the count
/// of requests in the pipeline and the parked requests.
#[derive(Debug, Default)]
pub struct SystemRecovery {
    gate: RwLock<()>,
    quiescing: AtomicBool,
    running: AtomicBool,
    pipeline: AtomicI64,
    /// Boxed: requests move between tasks boxed and are resubmitted as is.
    #[allow(clippy::vec_box)]
    parked: Mutex<Vec<Box<Request>>>,
}

impl SystemRecovery {
    /// Held (shared) by a connection reader from reserving NVS slots for a
    /// request to submitting it; a system recovery holds it exclusively.
    pub(crate) fn admission(&self) -> RwLockReadGuard<'_, ()> {
        if let Some(open) = self.gate.try_read() {
            return open;
        }
        crate::blocking::about_to_block();
        self.gate.read()
    }

    /// Whether stages must park their requests instead of running them.
    #[inline]
    pub(crate) fn is_quiescing(&self) -> bool {
        self.quiescing.load(Ordering::Acquire)
    }

    /// Whether a system recovery is running now.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// A request entered the pipeline.
    pub(crate) fn entered(&self) {
        self.pipeline.fetch_add(1, Ordering::AcqRel);
    }

    /// A request left the pipeline (answered, abandoned or parked).
    pub(crate) fn left(&self) {
        let before = self.pipeline.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "pipeline count went negative");
    }

    /// Requests in the pipeline now.
    pub fn in_pipeline(&self) -> i64 {
        self.pipeline.load(Ordering::Acquire)
    }

    /// Park a request (its `at` is where it resumes).
    pub(crate) fn park(&self, mut req: Box<Request>) {
        req.prepare_to_park();
        self.parked.lock().push(req);
    }
}

/// Escalate from a task (the request is already parked): no task-level
/// recovery is safe, so the in-memory state is restored on its own thread,
/// unless a recovery is running: from the last checkpoint (rung 3) when
/// output commit is on, else (or if the rollback cannot run) rebuilt from
/// the recovery box (rung 4).
pub(crate) fn escalate(ctl: &Arc<Engine>, cause: String) {
    if ctl.system.running.load(Ordering::Acquire) {
        return;
    }
    let c = Arc::clone(ctl);
    let spawned = std::thread::Builder::new()
        .name("rebound-recovery".into())
        .spawn(move || {
            if c.epochs.enabled() {
                match rollback(&c, &cause) {
                    Ok(report) => {
                        tracing::warn!("{report}");
                        return;
                    }
                    Err(SystemError::Busy) => return,
                    Err(e) => tracing::error!(error = %e, "rollback did not run; rung 4"),
                }
            }
            match recover(&c, &cause) {
                Ok(report) => tracing::warn!("{report}"),
                Err(SystemError::Busy) => {}
                Err(e) => tracing::error!(error = %e, "system recovery did not run"),
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the system recovery thread; aborting (rung 5 takes over)");
        std::process::abort();
    }
}

/// Run a system recovery now (on the calling thread, which must not be a
/// worker of the runtime).
pub fn recover(ctl: &Arc<Engine>, cause: &str) -> Result<SystemReport, SystemError> {
    let sys = &ctl.system;
    if sys.running.swap(true, Ordering::AcqRel) {
        return Err(SystemError::Busy);
    }
    let result = run(ctl, cause);
    sys.running.store(false, Ordering::Release);
    // Requests parked after the last sweep (none are expected: the gate and
    // the flag are cleared in order) are redriven rather than stranded.
    let late = std::mem::take(&mut *sys.parked.lock());
    for req in late {
        resume(ctl, req);
    }
    result
}

fn run(ctl: &Arc<Engine>, cause: &str) -> Result<SystemReport, SystemError> {
    if ctl.stopping.load(Ordering::SeqCst) {
        return Err(SystemError::Stopping);
    }
    let sys = &ctl.system;
    let started = Instant::now();
    tracing::warn!(cause, "rung 4: system recovery starts; quiescing");
    let serial = ctl.epochs.serial.lock();
    // Committed epochs' device outputs leave before the quiesce, so none
    // is being released (and none handed to the syncer) under the rebuild;
    // no more can be queued while `serial` is held.
    ctl.epochs.release_behind(ctl);
    let gate = sys.gate.write();
    sys.quiescing.store(true, Ordering::SeqCst);
    // Destage writes left unsynced stay dirty; the rebuild queues them.
    let _ = quiesce(ctl, started, "rung 4");
    let quiesced = Instant::now();
    let parked = std::mem::take(&mut *sys.parked.lock());
    if ctl.epochs.enabled() {
        // The rebuild keeps the current state, not the checkpoint: release
        // what the open epoch holds (device writes first, then replies).
        ctl.epochs.commit_serial(ctl);
    }

    let (source, box_refused) = rebuild(ctl);
    let dirty_tracks = ctl.cache.dirty_tracks();
    drop(serial);
    let rebuilt = Instant::now();

    // Redrive.
    sys.quiescing.store(false, Ordering::SeqCst);
    crate::engine::destage::kick(ctl);
    let redriven = parked.len() as u64;
    for req in parked {
        resume(ctl, req);
    }
    drop(gate);
    let report = SystemReport {
        cause: cause.to_owned(),
        source,
        box_refused,
        dirty_tracks,
        redriven,
        quiesce: quiesced - started,
        rebuild: rebuilt - quiesced,
        total: started.elapsed(),
    };
    ctl.recoveries.record(
        Rung::System,
        format!(
            "{cause}; directory rebuilt from {}",
            match source {
                RebuildSource::RecoveryBox => "the recovery box",
                RebuildSource::NvsScan => "an NVS scan",
            }
        ),
        report.total,
        redriven,
    );
    Ok(report)
}

/// Rebuild the cache directory, destage queue and NVS free list from the
/// recovery box or, when the box is not trusted, an NVS scan (the pipeline
/// is quiesced). Returns the source and why the box was refused.
fn rebuild(ctl: &Engine) -> (RebuildSource, Option<String>) {
    ctl.cache.reset();
    ctl.destage.reset();
    let mut box_refused = None;
    let mut source = RebuildSource::NvsScan;
    match ctl.journal.reread(ctl.identity) {
        Ok(rec) => {
            let referenced = crate::store::journal::BoxJournal::referenced(&rec.dirty);
            let next_seq = rec.next_seq.max(ctl.nvs.last_seq() + 1);
            match ctl.nvs.adopt(&referenced, next_seq) {
                Ok(()) => {
                    let mut dirty = rec.dirty;
                    dirty.sort_by_key(|&(_, d, _)| d.seq);
                    for (track, d, handle) in dirty {
                        ctl.cache.adopt_dirty(track, d, handle);
                        ctl.destage.push(track);
                    }
                    source = RebuildSource::RecoveryBox;
                }
                Err(e) => box_refused = Some(format!("the NVS disagrees with the box: {e}")),
            }
        }
        Err(e) => box_refused = Some(e.to_string()),
    }
    if source == RebuildSource::NvsScan {
        // The box stops being used: the next restart rebuilds it.
        ctl.journal.abandon();
        ctl.cache.reset();
        ctl.destage.reset();
        let scan = ctl.nvs.scan();
        let mut records = scan.records;
        records.sort_by_key(|r| r.seq);
        let mut free = Vec::new();
        for r in &records {
            let applied = ctl.cache.recover_dirty(r.track, r.slot, r.seq);
            free.extend(applied.free);
            if applied.queue {
                ctl.destage.push(r.track);
            }
        }
        ctl.nvs.free(&free);
    }
    ctl.epochs.after_rebuild(ctl);
    (source, box_refused)
}

/// Wait until no request is in a stage body and no destage task runs.
/// Destage writes waiting for the syncer's device sync (or in it) are not
/// waited for: their destages end unwritten
/// ([`crate::engine::destage::revoke_unsynced`]), again on every turn, as
/// a destage task stopping may hand over what it wrote. Returns how many
/// were revoked.
fn quiesce(ctl: &Engine, started: Instant, rung: &str) -> u64 {
    let sys = &ctl.system;
    let deadline = started + QUIESCE_TIMEOUT;
    let mut revoked = 0;
    loop {
        revoked += crate::engine::destage::revoke_unsynced(ctl);
        if sys.in_pipeline() == 0 && ctl.destage.inflight() == 0 {
            return revoked;
        }
        if Instant::now() >= deadline {
            tracing::error!(
                in_pipeline = sys.in_pipeline(),
                destaging = ctl.destage.inflight(),
                "{rung}: the pipeline did not drain in {QUIESCE_TIMEOUT:?}; aborting (rung 5 takes over)"
            );
            std::process::abort();
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Rung 3: roll the controller's in-memory state back to the last
/// checkpoint and run the open epoch's requests again (see
/// [`crate::engine::epoch`]). Runs on the calling thread, which must not be a
/// worker of the runtime.
pub fn rollback(ctl: &Arc<Engine>, cause: &str) -> Result<RollbackReport, SystemError> {
    if !ctl.epochs.enabled() {
        return Err(SystemError::NoEpochs);
    }
    let sys = &ctl.system;
    if sys.running.swap(true, Ordering::AcqRel) {
        return Err(SystemError::Busy);
    }
    let result = run_rollback(ctl, cause);
    sys.running.store(false, Ordering::Release);
    let late = std::mem::take(&mut *sys.parked.lock());
    for mut req in late {
        req.rewind();
        resume(ctl, req);
    }
    result
}

fn run_rollback(ctl: &Arc<Engine>, cause: &str) -> Result<RollbackReport, SystemError> {
    if ctl.stopping.load(Ordering::SeqCst) {
        return Err(SystemError::Stopping);
    }
    let sys = &ctl.system;
    let started = Instant::now();
    tracing::warn!(cause, "rung 3: rollback starts; quiescing");
    // No commit may run from here: the checkpoint is what we go back to.
    // Replying threads leave `serial` to us while we wait for it.
    ctl.epochs.preempt.store(true, Ordering::Release);
    let serial = ctl.epochs.serial.lock();
    ctl.epochs.preempt.store(false, Ordering::Release);
    // Epochs committed before it are not rolled back: their FLUSH and FUA
    // replies leave first, after the device writes they wait for. Held
    // writes nothing waits for stay held and are dropped below (a commit
    // writing them stops between tracks): their records are still dirty.
    // This takes as long as the devices take (a slow device makes it
    // long), so the quiesce's time-out counts from its end.
    ctl.epochs.abandon_writes(true);
    ctl.epochs.release_behind(ctl);
    let committed = Instant::now();
    let gate = sys.gate.write();
    let gated = Instant::now();
    sys.quiescing.store(true, Ordering::SeqCst);
    let unsynced_revoked = quiesce(ctl, committed, "rung 3");
    let quiesced = Instant::now();
    let parked = std::mem::take(&mut *sys.parked.lock());
    let (epoch, cut, held) = ctl.epochs.begin_rollback();

    // Devices: no write of the open epoch may stay. Held writes of earlier
    // epochs not yet written (issued just after their epoch's cut) are
    // dropped too: their records are still dirty and destage again.
    let dropped_writes = drop_device_writes(ctl, epoch);
    ctl.epochs.abandon_writes(false);
    // The directory, then the NVS: every record the restored directory
    // names is valid again; every other one (the open epoch's) is erased
    // and its slot freed.
    let (restored_tracks, records, referenced) = restore_directory(ctl);
    drop(cut);
    // If the NVS does not hold what the checkpoint names, the checkpoint
    // cannot be trusted: rebuild as rung 4 does, still quiesced.
    let fell_back = adopt_or_rebuild(ctl, records, &referenced);
    let restored = Instant::now();
    ctl.epochs.stats.rollbacks.fetch_add(1, Ordering::Relaxed);

    // Run the epoch's requests again: those whose replies were held and
    // those in the pipeline.
    let mut rerun: Vec<Box<Request>> = held.into_iter().map(|h| h.req).collect();
    rerun.extend(parked);
    let count = rerun.len() as u64;
    sys.quiescing.store(false, Ordering::SeqCst);
    drop(serial);
    crate::engine::destage::kick(ctl);
    for mut req in rerun {
        req.rewind();
        resume(ctl, req);
    }
    drop(gate);
    let report = RollbackReport {
        cause: cause.to_owned(),
        epoch,
        restored_tracks,
        dropped_writes,
        rerun: count,
        unsynced_revoked,
        quiesce: quiesced - started,
        commit_wait: committed - started,
        gate_wait: gated - committed,
        drain: quiesced - gated,
        restore: restored - quiesced,
        total: started.elapsed(),
        fell_back: fell_back.clone(),
    };
    record_rollback(ctl, &report);
    Ok(report)
}

/// Rung 3's device step: drop the held writes from `epoch` on (all of
/// them when the device holds writes), undo logged ones, and end their
/// destages unfinished. Returns how many held writes were dropped.
fn drop_device_writes(ctl: &Arc<Engine>, epoch: u64) -> u64 {
    let device = &ctl.epochs.device;
    let from = if device.holds_writes() { 0 } else { epoch };
    let (dropped, undone) = device.rollback(&ctl.volume, from);
    if let Err(e) = &undone {
        tracing::error!(error = %e, "rung 3: a logged device write could not be undone");
    }
    let dropped_writes = dropped.len() as u64;
    for h in dropped {
        let end = ctl.cache.end_destage(&ctl.nvs, h.track, h.destage, false);
        debug_assert!(end.free.is_none());
    }
    dropped_writes
}

/// Rung 3's directory step: restore the checkpoint's directory entries.
/// Returns the entries restored, the dirty records the restored directory
/// names, and those records as the NVS must hold them.
fn restore_directory(
    ctl: &Arc<Engine>,
) -> (
    u64,
    Vec<(u64, crate::store::cache::Dirty)>,
    Vec<crate::store::nvs::ScannedRecord>,
) {
    for track in ctl.epochs.take_suspects() {
        ctl.cache.mark_changed(track);
    }
    let restored_tracks = ctl
        .cache
        .roll_back_changes(&ctl.nvs, |t| ctl.epochs.image_of(t));
    let records = ctl.cache.dirty_records();
    let referenced: Vec<crate::store::nvs::ScannedRecord> = records
        .iter()
        .map(|&(track, d)| crate::store::nvs::ScannedRecord {
            slot: d.slot,
            seq: d.seq,
            track,
        })
        .collect();
    (restored_tracks, records, referenced)
}

/// Rung 3's NVS step: the NVS adopts the records the restored directory
/// names and destage queues them in sequence order; if it cannot, rebuild
/// as rung 4 does. Returns why rung 3 fell back, if it did.
fn adopt_or_rebuild(
    ctl: &Arc<Engine>,
    records: Vec<(u64, crate::store::cache::Dirty)>,
    referenced: &[crate::store::nvs::ScannedRecord],
) -> Option<String> {
    match ctl.nvs.adopt(referenced, ctl.nvs.last_seq() + 1) {
        Ok(()) => {
            ctl.destage.reset();
            let mut sorted = records;
            sorted.sort_by_key(|&(_, d)| d.seq);
            for (track, _) in sorted {
                ctl.destage.push(track);
            }
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "rung 3: the NVS disagrees with the checkpoint; rebuilding as rung 4");
            let (source, _) = rebuild(ctl);
            Some(format!(
                "the NVS disagrees with the checkpoint ({e}); rebuilt from {}",
                match source {
                    RebuildSource::RecoveryBox => "the recovery box",
                    RebuildSource::NvsScan => "an NVS scan",
                }
            ))
        }
    }
}

/// Log a rollback as rung 3, or as rung 4 when it fell back to a rebuild.
fn record_rollback(ctl: &Arc<Engine>, report: &RollbackReport) {
    let RollbackReport {
        cause,
        epoch,
        restored_tracks,
        dropped_writes,
        rerun: count,
        ..
    } = report;
    match &report.fell_back {
        None => ctl.recoveries.record(
            Rung::Rollback,
            format!(
                "{cause}; epoch {epoch} rolled back ({restored_tracks} entries restored, {dropped_writes} held writes dropped)"
            ),
            report.total,
            *count,
        ),
        Some(why) => ctl.recoveries.record(
            Rung::System,
            format!("{cause}; rollback refused: {why}"),
            report.total,
            *count,
        ),
    }
}

/// Give a parked request what it needs to run again and submit it.
fn resume(ctl: &Arc<Engine>, mut req: Box<Request>) {
    let needed = req.slots_to_reserve();
    if needed > 0 {
        let waited = Instant::now();
        loop {
            match ctl.nvs.reserve(needed, Duration::from_millis(100)) {
                Ok(slots) => {
                    req.slots = slots;
                    break;
                }
                Err(crate::store::nvs::NvsError::Timeout(_))
                    if waited.elapsed() < RESERVE_TIMEOUT =>
                {
                    crate::engine::destage::kick(ctl);
                }
                Err(e) => {
                    tracing::error!(error = %e, "no NVS space to redrive a parked write");
                    // Dropped unanswered with no stage to go back to: its
                    // clean-up block answers EIO.
                    req.give_up();
                    return;
                }
            }
        }
    }
    datapath::resume(req);
}
