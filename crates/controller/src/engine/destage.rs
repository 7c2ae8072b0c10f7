//! Destage: write dirty tracks from the NVS to the devices, then free their
//! NVS records.
//!
//! Background destage runs as low-priority tasks of the `destage` group, at
//! most [`DESTAGE_TASKS_MAX`] at a time, each writing up to
//! [`DESTAGE_BATCH_TRACKS`] tracks before handing the worker back. A track is
//! queued when it becomes dirty (and again if rewritten during its
//! destage); a write, a commit and a device sync start a destage task
//! only once a whole batch is queued ([`kick_batch`]), and a task goes on
//! to the next batch only then, or while the NVS runs short of free slots;
//! a writer waiting for NVS space starts one at once, and a periodic tick
//! ([`TICK`]) requeues tracks whose destage failed and starts one for
//! whatever is queued, so the NVS drains when the host is idle and no
//! dirty track waits longer than about a tick.
//!
//! Ordering: the cache directory allows one destage per track at a time and
//! always destages the track's newest record, so an older write never
//! overwrites a newer one on the device. The record's slot is freed only
//! after the device write returned *and* a device sync that started after
//! it succeeded ([`settle`]; syncs are shared between destages by
//! [`crate::backend::syncgate`]; background destage hands its writes to
//! one syncer thread, [`start_syncer`], so a sync holds no worker): until
//! then the track stays destaging,
//! reads are served from the NVS and the cache, and the record stays. A
//! failed write or sync ends the destage unwritten: the track stays dirty,
//! its record stays, and it is written again from the NVS at the next
//! tick. There is no "EIO once, then success": FLUSH and FUA answer EIO
//! for as long as a covered track is not durably on a device. A system
//! recovery's quiesce (rung 3 or 4) does not wait for the syncer's sync
//! either: the destages of the writes it holds end unwritten
//! ([`revoke_unsynced`]) and their tracks destage again.
//!
//! A record that fails its checksum when read for destage is destaged from
//! the cache frame holding the same data, if there is one (the frame is a
//! copy made under the same lock when the record was applied).
//!
//! # Lost tracks
//!
//! If the record's header is intact and names the record but its data
//! fails the checksum ([`NvsError::Damaged`]: the NVS memory is damaged)
//! and no cached copy exists, the track's newest acknowledged data is gone:
//! nothing in the controller can bring it back, and retrying cannot help.
//! The track is *lost*: the loss is recorded once (rung 1, in the recovery
//! log and the `rebound_lost_tracks` gauge), reads of the track answer
//! `EIO` (never older data: a read never returns data that is not the
//! newest written), FLUSH answers `EIO` while the track is lost, and the
//! record stays where it is, so a fast restart finds the loss again. The
//! track keeps its place in the retry list at no I/O cost; the next write
//! of the whole track (tracks are the export's minimum block) or a
//! TRIM / WRITE_ZEROES over it supersedes the damaged record and ends the
//! loss.
//!
//! [`NvsError::Damaged`]: crate::store::nvs::NvsError::Damaged

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rcs::Priority;

use crate::engine::Engine;
use crate::limits::{DESTAGE_BATCH_TRACKS, DESTAGE_TASKS_MAX, TRACK_BYTES};
use crate::recovery::Rung;

/// Period of the destage tick.
pub const TICK: Duration = Duration::from_millis(100);
/// Longest a background destage write waits for the device sync that
/// frees its record: one sync covers what every destage wrote meanwhile.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(500);
/// How long a forced destage waits for another destage of the same track.
pub(crate) const FORCE_WAIT: Duration = Duration::from_secs(30);

/// A destage write that returned, not yet covered by a device sync: its
/// record stays until [`settle`] ends it.
#[derive(Debug)]
#[must_use = "a destage ends only when settled"]
pub(crate) struct Unsynced {
    track: u64,
    d: crate::store::cache::Dirty,
    /// Taken before the write ([`crate::backend::syncgate`]).
    ticket: u64,
}

/// The batches the syncer is syncing ([`DestageQueue::syncing`]).
#[derive(Debug)]
struct Syncing {
    /// Batches (each counted once in `inflight`).
    batches: u32,
    writes: Vec<Unsynced>,
}

/// One attempt of a forced destage ([`try_force`]).
#[derive(Debug)]
pub(crate) enum Forced {
    /// The track's records up to now are on the device (or it was clean).
    Done,
    /// Its newest record was written: done once [`settle`]d.
    Written(Unsynced),
    /// Another destage of the track is in flight: try again shortly.
    InFlight,
    /// The device queue was full, or a degraded volume holds the write
    /// until its stripe is rebuilt: try again after a back-off.
    BackedOff(std::io::Error),
}

/// One attempt to destage `track` now, without waiting.
pub(crate) fn try_force(ctl: &Engine, track: u64) -> std::io::Result<Forced> {
    match one(ctl, track) {
        Ok(Outcome::Written(u)) => Ok(Forced::Written(u)),
        Ok(Outcome::Held) => Ok(Forced::Done),
        Ok(Outcome::Nothing) if !ctl.cache.is_dirty(track) => Ok(Forced::Done),
        Ok(Outcome::Nothing) => Ok(Forced::InFlight),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::ResourceBusy
            ) =>
        {
            Ok(Forced::BackedOff(e))
        }
        Err(e) => Err(e),
    }
}

/// Tracks waiting for destage.
#[derive(Debug, Default)]
pub struct DestageQueue {
    queue: Mutex<VecDeque<u64>>,
    failed: Mutex<Vec<u64>>,
    inflight: AtomicU32,
    /// Lost tracks (see the module doc): track -> sequence number of the
    /// damaged record.
    lost: Mutex<HashMap<u64, u64>>,
    /// The device error that ended the last destage, until one succeeds:
    /// a full NVS then fails writes at once instead of waiting for space
    /// no destage can free.
    failing: Mutex<Option<std::io::Error>>,
    /// Background destage writes waiting for the syncer ([`start_syncer`]),
    /// one list per batch (each counted in `inflight` until settled).
    unsynced: Mutex<Vec<Vec<Unsynced>>>,
    /// The batches the syncer took and is syncing now; `None` when it
    /// holds none, or a quiesce revoked them ([`revoke_unsynced`]). Only
    /// the syncer fills it, taking `unsynced`'s lock first.
    syncing: Mutex<Option<Syncing>>,
    unsynced_arrived: parking_lot::Condvar,
    /// Someone waits for the syncer (a FLUSH, a full NVS): sync now.
    hurry: std::sync::atomic::AtomicBool,
}

impl DestageQueue {
    /// Ask the syncer to sync what it holds now rather than at the end of
    /// its interval (a FLUSH waits for a track it holds; the NVS is full).
    pub(crate) fn hurry(&self) {
        self.hurry.store(true, Ordering::Release);
        let _pending = self.unsynced.lock();
        self.unsynced_arrived.notify_one();
    }

    /// Whether a hurry waits for the syncer to take it.
    #[cfg(test)]
    pub(crate) fn hurried(&self) -> bool {
        self.hurry.load(Ordering::Acquire)
    }

    /// Give a batch's writes to the syncer: the worker goes on, the sync
    /// that frees their records runs on the syncer's thread.
    fn hand_over(&self, written: Vec<Unsynced>) {
        if written.is_empty() {
            return;
        }
        // Counted until settled, so a quiesce (rung 4) waits for them.
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.unsynced.lock().push(written);
        self.unsynced_arrived.notify_one();
    }

    /// The device error failing destages now, if the last one failed.
    pub fn failing(&self) -> Option<(std::io::ErrorKind, String)> {
        self.failing
            .lock()
            .as_ref()
            .map(|e| (e.kind(), e.to_string()))
    }

    /// Record how the last destage (or output commit) ended.
    pub(crate) fn note_outcome(&self, error: Option<&std::io::Error>) {
        let mut failing = self.failing.lock();
        match error {
            None => *failing = None,
            Some(e) => *failing = Some(std::io::Error::new(e.kind(), e.to_string())),
        }
    }

    /// Queue a track (the cache directory dedupes).
    pub fn push(&self, track: u64) {
        self.queue.lock().push_back(track);
    }

    /// Put the unstarted rest of a batch back at the queue's head, in
    /// order.
    fn put_back(&self, tracks: Vec<u64>) {
        let mut q = self.queue.lock();
        for &t in tracks.iter().rev() {
            q.push_front(t);
        }
    }

    fn pop_batch(&self) -> Vec<u64> {
        let mut q = self.queue.lock();
        let n = q.len().min(DESTAGE_BATCH_TRACKS);
        q.drain(..n).collect()
    }

    /// Tracks queued.
    pub fn len(&self) -> usize {
        self.queue.lock().len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Destage tasks queued or running.
    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Forget every queued and failed track (rung 4 requeues the rebuilt
    /// directory's dirty tracks).
    pub(crate) fn reset(&self) {
        self.queue.lock().clear();
        self.failed.lock().clear();
    }
}

/// `track`'s newest record (`slot`, `seq`) failed its data checksum and no
/// cached copy exists: the track is lost (see the module doc). Recorded
/// once per record; `found_by` names who found it. Whether this call
/// recorded it (false: known already).
pub(crate) fn note_lost(ctl: &Engine, track: u64, slot: u32, seq: u64, found_by: &str) -> bool {
    if ctl.destage.lost.lock().insert(track, seq) == Some(seq) {
        return false;
    }
    tracing::error!(
        track,
        slot,
        seq,
        found_by,
        "acknowledged data lost: the track's NVS record failed its data checksum and no cached copy exists"
    );
    ctl.recoveries.record(
        Rung::Task,
        format!(
            "track {track} lost: its NVS record (slot {slot}, seq {seq}) failed its data checksum and no cached copy exists (found by {found_by}); reads answer EIO until the track is written again"
        ),
        Duration::ZERO,
        0,
    );
    true
}

/// Tracks lost now, lowest first: the damaged record is still the track's
/// newest (losses that a later write or zeroing ended are forgotten).
pub(crate) fn lost_tracks(ctl: &Engine) -> Vec<u64> {
    let mut lost = ctl.destage.lost.lock();
    lost.retain(|&t, &mut seq| ctl.cache.newest_record(t).is_some_and(|d| d.seq == seq));
    let mut tracks: Vec<u64> = lost.keys().copied().collect();
    tracks.sort_unstable();
    tracks
}

/// After a write: start a destage task only once a whole batch is queued;
/// the [`TICK`] starts one for fewer, and a writer waiting for NVS space
/// kicks at once. A write is acknowledged from the NVS, so waiting costs no
/// safety, and a destage task per batch instead of per write spares a
/// worker wake-up per write.
pub(crate) fn kick_batch(ctl: &Arc<Engine>) {
    if ctl.destage.len() >= DESTAGE_BATCH_TRACKS {
        kick(ctl);
    }
}

/// Whether a destage task goes on to another batch: a whole batch is
/// queued, or the NVS is running short of free slots (as for the
/// syncer's hurry; writers waiting for space also kick at once).
fn batch_due(ctl: &Engine) -> bool {
    (ctl.destage.len() >= DESTAGE_BATCH_TRACKS || ctl.nvs.free_slots() <= ctl.nvs.slot_count() / 4)
        && !ctl.epochs.device.full()
}

/// Start a destage task if there is work and room for one.
pub(crate) fn kick(ctl: &Arc<Engine>) {
    let q = &ctl.destage;
    if ctl.system.is_quiescing() {
        // Rung 4 is rebuilding the directory; it kicks destage when done.
        return;
    }
    if ctl.epochs.device.full() {
        // Output commit holds as many writes as it may: the commit that
        // takes them off kicks again (`Epochs::release_outputs`).
        return;
    }
    loop {
        let n = q.inflight.load(Ordering::Acquire);
        if n >= DESTAGE_TASKS_MAX || q.is_empty() {
            return;
        }
        if q.inflight
            .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            break;
        }
    }
    let c = Arc::clone(ctl);
    let submitted = ctl.rt.submit_named(
        ctl.groups.destage,
        Priority::Low,
        "destage.batch",
        move |_ctx| {
            batch(&c);
            Ok(())
        },
    );
    if submitted.is_err() {
        q.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One destage task: a batch, then either another task or stop.
fn batch(ctl: &Arc<Engine>) {
    let mut tracks = ctl.destage.pop_batch().into_iter();
    let mut written = Vec::new();
    while let Some(track) = tracks.next() {
        if ctl.system.is_quiescing() {
            // Stop between tracks; the rebuilt queue has the rest.
            break;
        }
        if ctl.epochs.device.full() {
            // Output commit holds as many writes as it may: the rest of
            // the batch waits in the queue for the commit's kick.
            ctl.destage
                .put_back(std::iter::once(track).chain(tracks).collect());
            break;
        }
        match one(ctl, track) {
            Ok(Outcome::Written(u)) => written.push(u),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Rung 1: the device queue is full; back off until the
                // tick, with the rest of the batch.
                let mut failed = ctl.destage.failed.lock();
                failed.push(track);
                let deferred = 1 + tracks.len();
                failed.extend(tracks);
                drop(failed);
                ctl.recoveries.record(
                    Rung::Task,
                    format!("{e}: {deferred} destages deferred to the next tick"),
                    TICK,
                    0,
                );
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                // A degraded volume holds this write until its stripe is
                // rebuilt (`volume`); `end` queued it for the next tick.
                tracing::debug!(track, error = %e, "destage waits for the rebuild");
            }
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                // A lost track (recorded once by `note_lost`): it waits in
                // the retry list for a write that supersedes it.
                tracing::debug!(track, error = %e, "destage of a lost track skipped");
            }
            Err(e) => {
                // `end` queued it for the next tick.
                tracing::warn!(track, error = %e, "destage failed; will retry");
            }
        }
    }
    ctl.destage.hand_over(written);
    let q = &ctl.destage;
    // Go on while a batch is due (`batch_due`). Going on for
    // any queued track kept a chain of tasks alive on a trickle of
    // writes: at queue depth 1, a task (and under output commit a held
    // write, a commit's hand-over and a sync) per client write.
    if !q.is_empty()
        && batch_due(ctl)
        && !ctl.stopping.load(Ordering::Relaxed)
        && !ctl.system.is_quiescing()
    {
        let c = Arc::clone(ctl);
        let resubmitted = ctl.rt.submit_named(
            ctl.groups.destage,
            Priority::Low,
            "destage.batch",
            move |_ctx| {
                batch(&c);
                Ok(())
            },
        );
        if resubmitted.is_ok() {
            return;
        }
    }
    q.inflight.fetch_sub(1, Ordering::AcqRel);
}

/// What [`one`] did.
enum Outcome {
    /// Nothing: the track is clean, or its destage is in flight.
    Nothing,
    /// Output commit holds the write; its epoch's commit ends the destage.
    Held,
    /// Written; ended by [`settle`].
    Written(Unsynced),
}

/// Make the destage writes `written` durable (one device sync, shared with
/// whoever syncs at the same time) and end them: written if the sync
/// succeeded, else back to dirty (their records stay; the tick writes them
/// again).
pub(crate) fn settle(ctl: &Engine, written: Vec<Unsynced>) -> std::io::Result<()> {
    if written.is_empty() {
        return Ok(());
    }
    let synced = ctl.volume.sync_since(oldest_ticket(&written));
    finish(ctl, written, synced)
}

/// The ticket a sync covering every write of `written` must start after.
fn oldest_ticket(written: &[Unsynced]) -> u64 {
    written.iter().map(|u| u.ticket).min().unwrap_or(0)
}

/// End the destage writes `written` after the sync that covers them
/// ended with `synced`.
fn finish(
    ctl: &Engine,
    written: Vec<Unsynced>,
    synced: std::io::Result<()>,
) -> std::io::Result<()> {
    ctl.destage.note_outcome(synced.as_ref().err());
    if synced.is_err() {
        ctl.metrics
            .destage_errors
            .fetch_add(written.len() as u64, Ordering::Relaxed);
    }
    for u in written {
        end(ctl, u.track, u.d, synced.is_ok());
    }
    synced
}

/// Destage `track` if it is dirty and no destage of it is in flight.
/// A full device queue is [`std::io::ErrorKind::WouldBlock`]: nothing was
/// done, retry later.
fn one(ctl: &Engine, track: u64) -> std::io::Result<Outcome> {
    let (queue_index, queue) = ctl.queue(track);
    let tag = queue.submit().map_err(|full| {
        std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!("device {queue_index} {full}"),
        )
    })?;
    let begun = {
        let _changing = ctl.epochs.changing();
        ctl.cache.begin_destage(track)
    };
    let Some(d) = begun else {
        queue.complete(tag);
        return Ok(Outcome::Nothing);
    };
    let ticket = ctl.volume.sync_ticket();
    let written = read_record(ctl, track, d).and_then(|buf| {
        ctl.epochs
            .device
            .write(&ctl.volume, track, d, buf, ctl.epochs.open())
    });
    queue.complete(tag);
    if written.is_ok() && ctl.epochs.device.holds_writes() {
        // Output commit: the write is held; the commit that puts it on the
        // device (and syncs it) ends the destage (`end_held`).
        return Ok(Outcome::Held);
    }
    match written {
        Ok(()) => Ok(Outcome::Written(Unsynced { track, d, ticket })),
        Err(e) => {
            end(ctl, track, d, false);
            if !matches!(
                e.kind(),
                std::io::ErrorKind::ResourceBusy | std::io::ErrorKind::InvalidData
            ) {
                ctl.metrics.destage_errors.fetch_add(1, Ordering::Relaxed);
                ctl.destage.note_outcome(Some(&e));
            }
            Err(e)
        }
    }
}

/// End the destage of record `d` of `track`.
fn end(ctl: &Engine, track: u64, d: crate::store::cache::Dirty, written: bool) {
    let end = {
        let _changing = ctl.epochs.changing();
        ctl.cache.end_destage(&ctl.nvs, track, d, written)
    };
    if let Some(slot) = end.free {
        // Invalidated by end_destage, under the track's lock; given back
        // now, or at the epoch's commit under output commit.
        ctl.epochs.retire(ctl, &[slot]);
    }
    if end.queue && written {
        ctl.destage.push(track);
    }
    if written {
        ctl.metrics.destaged_tracks.fetch_add(1, Ordering::Relaxed);
    } else {
        ctl.destage.failed.lock().push(track);
    }
}

/// A held destage write reached its device at its epoch's commit (or, with
/// `written` false, was dropped by a rollback): end its destage.
pub(crate) fn end_held(ctl: &Engine, track: u64, d: crate::store::cache::Dirty, written: bool) {
    end(ctl, track, d, written);
}

/// Held destage writes a commit put on their devices, with no FLUSH or FUA
/// waiting for them: the syncer makes them durable and ends their destages,
/// so a commit does not wait for a device sync itself. The syncer is
/// hurried when there are writes: it syncs back to back while commits hand
/// writes over, each sync shared by every batch that arrived meanwhile, so
/// committed tracks do not stay dirty for its interval. A rollback restores
/// every track still dirty (its quiesce no longer waits for their sync,
/// [`revoke_unsynced`]): measured under 8 x 256 when it did, waiting for
/// the interval made rollbacks take 60 ms, a sync every 8 commits 8 to
/// 15 ms, back-to-back syncs 1 to 3 ms. `ticket` was taken before the
/// writes.
pub(crate) fn hand_over_held(
    ctl: &Engine,
    written: impl IntoIterator<Item = (u64, crate::store::cache::Dirty)>,
    ticket: u64,
) {
    let written: Vec<Unsynced> = written
        .into_iter()
        .map(|(track, d)| Unsynced { track, d, ticket })
        .collect();
    if written.is_empty() {
        // A commit that released replies only (a read-only load's every
        // commit) has nothing for the syncer: hurrying it anyway woke it
        // once per commit to find nothing, and its wake-up preempted the
        // checkpoint thread.
        return;
    }
    ctl.destage.hand_over(written);
    ctl.destage.hurry();
}

/// The data of record `d` of `track`, to destage: from the NVS, or the
/// cache's copy when the NVS record is corrupt.
fn read_record(
    ctl: &Engine,
    track: u64,
    d: crate::store::cache::Dirty,
) -> std::io::Result<Vec<u8>> {
    match ctl.nvs.record_data(d.slot, track, d.seq) {
        Ok(data) => Ok(data),
        Err(e) => {
            let mut buf = vec![0u8; TRACK_BYTES];
            if ctl.cache.dirty_copy(track, d, &mut buf) {
                tracing::error!(track, error = %e, "NVS record corrupt; destaging the cached copy");
                Ok(buf)
            } else if let crate::store::nvs::NvsError::Damaged { slot, seq, .. } = e {
                let _ = note_lost(ctl, track, slot, seq, "destage");
                Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            } else {
                Err(std::io::Error::other(e))
            }
        }
    }
}

/// Destage `track` now, waiting for a destage of it already in flight.
/// Done when this call destaged the track's newest record (at least as new
/// as any write acknowledged before the call: to be [`settle`]d) or the
/// track is clean.
pub(crate) fn force(ctl: &Engine, track: u64) -> std::io::Result<Option<Unsynced>> {
    let deadline = Instant::now() + FORCE_WAIT;
    let mut waits = 0;
    loop {
        match try_force(ctl, track)? {
            Forced::Done => return Ok(None),
            Forced::Written(u) => return Ok(Some(u)),
            Forced::InFlight => ctl.destage.hurry(),
            Forced::BackedOff(e) => {
                // Rung 1: the device queue is full (or a degraded volume
                // holds the write until its stripe is rebuilt); back off
                // and retry.
                let wait = crate::backend::devqueue::backoff(waits);
                if waits == 0 {
                    ctl.recoveries.record(
                        Rung::Task,
                        format!("{e}: forced destage of track {track} backed off"),
                        wait,
                        1,
                    );
                }
                waits += 1;
                if Instant::now() + wait >= deadline {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, e));
                }
                std::thread::sleep(wait);
                continue;
            }
        }
        if ctl.system.is_quiescing() {
            // A recovery waits for this stage to leave; it parks and runs
            // again once the state is rebuilt.
            return Err(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "a recovery is quiescing the controller",
            ));
        }
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("track {track} stayed dirty for {FORCE_WAIT:?}"),
            ));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Destage every track dirty now (FLUSH, clean shutdown). Stops with
/// [`std::io::ErrorKind::Interrupted`] when a system recovery (rung 4)
/// starts quiescing: the FLUSH is parked and runs again after it.
pub(crate) fn destage_all(ctl: &Engine) -> std::io::Result<()> {
    let mut written = Vec::new();
    let forced = (|| {
        for track in ctl.cache.dirty_snapshot() {
            if ctl.system.is_quiescing() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Interrupted,
                    "a system recovery is quiescing the controller",
                ));
            }
            written.extend(force(ctl, track)?);
        }
        Ok(())
    })();
    // Settled however the forcing ended: what was written is ended.
    let settled = settle(ctl, written);
    forced.and(settled)
}

/// Start the syncer: one thread that takes the background destage writes
/// every batch hands over, syncs the devices once for all of them (shared
/// with whoever syncs at the same time) and ends their destages. A sync
/// can take milliseconds on a disk; on the syncer it holds no worker of
/// the runtime, and one sync covers every batch written meanwhile. It
/// stops when the engine is dropped.
pub(crate) fn start_syncer(ctl: &Arc<Engine>) -> std::io::Result<()> {
    let weak = Arc::downgrade(ctl);
    std::thread::Builder::new()
        .name("rebound-destage-sync".into())
        .spawn(move || {
            while let Some(ctl) = weak.upgrade() {
                let Some(ticket) = take_unsynced(&ctl) else {
                    continue;
                };
                let synced = ctl.volume.sync_since(ticket);
                // A quiesce may have revoked them while the sync ran: it
                // ended their destages unwritten, and the sync's outcome
                // is nobody's.
                let Some(Syncing { batches, writes }) = ctl.destage.syncing.lock().take() else {
                    continue;
                };
                if let Err(e) = finish(&ctl, writes, synced) {
                    tracing::warn!(error = %e, "device sync after destage failed; the tracks stay dirty and will be written again");
                }
                ctl.destage.inflight.fetch_sub(batches, Ordering::AcqRel);
                // Destages ended here may have requeued tracks: a task for
                // them once a whole batch is queued, as after a write (the
                // tick starts one for fewer). Kicking for any queued track
                // fed a loop under output commit: each sync started a
                // destage of the few tracks written since, the next commit
                // handed those over, and that hurried the next sync.
                kick_batch(&ctl);
            }
        })
        .map(|_| ())
}

/// Take the batches handed over into [`DestageQueue::syncing`], once the
/// first has waited [`SYNC_INTERVAL`] (one sync then covers every batch
/// written meanwhile), or at once when someone waits or the NVS runs short
/// of free slots; returns the ticket their sync must start after, or
/// `None` after a tick without any.
fn take_unsynced(ctl: &Engine) -> Option<u64> {
    let q = &ctl.destage;
    let mut pending = q.unsynced.lock();
    if pending.is_empty() {
        q.unsynced_arrived.wait_for(&mut pending, TICK);
        if pending.is_empty() {
            return None;
        }
    }
    let until = Instant::now() + SYNC_INTERVAL;
    while !q.hurry.swap(false, Ordering::AcqRel)
        && ctl.nvs.free_slots() > ctl.nvs.slot_count() / 4
        && !ctl.stopping.load(Ordering::Relaxed)
        && !ctl.system.is_quiescing()
    {
        let now = Instant::now();
        if now >= until {
            break;
        }
        q.unsynced_arrived.wait_for(&mut pending, until - now);
    }
    let taken = std::mem::take(&mut *pending);
    let batches = taken.len() as u32;
    let writes: Vec<Unsynced> = taken.into_iter().flatten().collect();
    let ticket = oldest_ticket(&writes);
    let mut syncing = q.syncing.lock();
    debug_assert!(syncing.is_none(), "the syncer took batches twice");
    *syncing = Some(Syncing { batches, writes });
    Some(ticket)
}

/// A system recovery (rung 3 or 4) is quiescing: end the destage of every
/// background write waiting for the syncer, and of those it is syncing now,
/// unwritten, instead of waiting for their sync. Their records stay and
/// their tracks stay dirty (the recovery queues every dirty track), so a
/// later destage writes them again; the data already written is the same
/// or older than what it will write. A sync on the quiesce's path (the
/// syncer's backlog written back) is what a rollback took longest for.
/// Returns the writes revoked.
pub(crate) fn revoke_unsynced(ctl: &Engine) -> u64 {
    let q = &ctl.destage;
    let (pending, syncing) = {
        let mut pending = q.unsynced.lock();
        (std::mem::take(&mut *pending), q.syncing.lock().take())
    };
    let mut batches = pending.len() as u32;
    let mut writes: Vec<Unsynced> = pending.into_iter().flatten().collect();
    if let Some(s) = syncing {
        batches += s.batches;
        writes.extend(s.writes);
    }
    let revoked = writes.len() as u64;
    for u in writes {
        let end = {
            let _changing = ctl.epochs.changing();
            ctl.cache.end_destage(&ctl.nvs, u.track, u.d, false)
        };
        debug_assert!(end.free.is_none(), "an unwritten destage freed a slot");
    }
    if batches > 0 {
        q.inflight.fetch_sub(batches, Ordering::AcqRel);
    }
    revoked
}

/// Start the periodic tick (it stops when the controller is dropped or
/// stopping).
pub(crate) fn start_tick(ctl: &Arc<Engine>) {
    schedule_tick(Arc::downgrade(ctl), &ctl.timer);
}

fn schedule_tick(weak: Weak<Engine>, timer: &crate::timer::Timer) {
    timer.after(TICK, move || {
        let Some(ctl) = weak.upgrade() else { return };
        if ctl.stopping.load(Ordering::Relaxed) {
            return;
        }
        let failed = std::mem::take(&mut *ctl.destage.failed.lock());
        for t in failed {
            ctl.destage.push(t);
        }
        kick(&ctl);
        schedule_tick(Arc::downgrade(&ctl), &ctl.timer);
    });
}
