//! Rung 3: epochs, incremental checkpoints and output commit (paper:
//! revive-io-output-commit; DESIGN.md's ladder, rung 3).
//!
//! With `--output-commit` on, the controller's life is cut into epochs of
//! `--checkpoint-interval` (default 20 ms). Nothing produced in the open
//! epoch leaves the controller before the epoch commits:
//!
//! - **replies** to hosts wait in the output gate ([`Epochs::hold_reply`]);
//! - **device writes** go through the [pseudo-device](crate::backend::pseudodev)
//!   (held, buffered, or logged);
//! - **NVS slots** the directory stops naming are given back to the free
//!   list only at commit ([`Epochs::retire`]), so the checkpoint's records
//!   are never overwritten while it may be rolled back to.
//!
//! # The checkpoint
//!
//! The state a rollback restores is the cache directory's dirty part (the
//! track -> NVS record map; cached copies are only copies and are dropped,
//! the destage queue and NVS free list are derived from it). The cache notes
//! every track whose dirty entry changes ([`Cache::take_changes`]); a commit
//! copies only those entries into the checkpoint image: the checkpoint is
//! incremental, its cost proportional to what the epoch changed.
//!
//! A commit is a consistent cut: stages that change the directory hold the
//! epoch lock shared ([`Epochs::changing`]); the commit takes it
//! exclusively for the copy and the epoch switch (microseconds). The cut
//! is the checkpoint: the epoch is committed, and its held replies leave
//! at once, except those of FLUSH and FUA. Then, outside the lock, the
//! epoch's device outputs (`Outputs`) are released: its held device
//! writes go to their targets, the devices are synced, those destages
//! end, retired NVS slots go back, and only then do the FLUSH and FUA
//! replies leave, whose success promises the device writes. A write's
//! reply needs no device write: its data is in the NVS, whose record stays
//! valid (and named by the checkpoint) until its destage ends, exactly as
//! without output commit.
//!
//! # Who commits
//!
//! The checkpoint thread commits at the interval, and when the first held
//! reply has waited [`OUTPUT_WAIT_MAX`]. An epoch that ends early because
//! of a reply (the controller went idle, or half the clients' depth is
//! held) is committed by the thread that held that reply
//! (`Epochs::commit_here`): the cut and the release of the replies, with
//! no hand-off. Its device outputs, if it has any, wait in `behind` for
//! the checkpoint thread, which releases them in epoch order under
//! `behind_serial` while replying threads go on cutting epochs (`serial`).
//! A rollback takes `serial`, then first releases whatever is behind: those
//! epochs are committed, so their outputs must leave, and running a
//! committed FUA write again could undo a later write already
//! acknowledged.
//!
//! # Rollback
//!
//! [`crate::engine::system::rollback`] quiesces the pipeline (as rung 4 does),
//! drops the open epoch's held writes (or writes logged old data back),
//! puts every changed directory entry back to its checkpoint value, erases
//! the open epoch's NVS records, and runs every request of the open epoch
//! again from its start: its header and payload were kept. Hosts see only
//! a delay; no reply was sent for rolled-back work.
//!
//! [`Cache::take_changes`]: crate::store::cache::Cache::take_changes

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};
use rustc_hash::FxHashMap;

use crate::backend::pseudodev::PseudoDevice;
use crate::config::OutputCommit;
use crate::engine::Engine;
use crate::engine::request::Request;
use crate::nbd::proto::NbdError;
use crate::store::cache::Dirty;

/// A reply waiting for its epoch to commit.
pub(crate) struct HeldReply {
    epoch: u64,
    pub(crate) req: Box<Request>,
    pub(crate) result: Result<(), (NbdError, String)>,
}

/// What a committed epoch still owes after its cut released its replies:
/// its device writes, the FLUSH and FUA replies that wait for them, and
/// the NVS slots it retired ([`Epochs::release_outputs`]).
pub(crate) struct Outputs {
    epoch: u64,
    durable: Vec<HeldReply>,
    retired: Vec<(u64, u32)>,
    /// A FLUSH or FUA of the epoch wants a device sync.
    want_sync: bool,
}

/// Why a held reply ends its epoch now ([`Epochs::hold_reply`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// The epoch stays open.
    No,
    /// The controller went idle with a client stalled on held output.
    Idle,
    /// Half of what the clients keep in flight is held.
    Half,
}

/// Counters of the epoch machinery.
#[derive(Debug, Default)]
pub struct EpochStats {
    /// Epochs committed.
    pub commits: AtomicU64,
    /// Total time inside the exclusive part of commits, nanoseconds.
    pub cut_ns: AtomicU64,
    /// Longest exclusive part of a commit, nanoseconds.
    pub cut_ns_max: AtomicU64,
    /// Directory entries copied into the checkpoint.
    pub entries_copied: AtomicU64,
    /// Replies released by commits.
    pub replies_released: AtomicU64,
    /// Commits that ended their epoch early: the controller went idle
    /// with a client stalled on held output.
    pub idle_commits: AtomicU64,
    /// Commits that ended their epoch early: its first held reply had
    /// waited [`OUTPUT_WAIT_MAX`].
    pub wait_commits: AtomicU64,
    /// Commits that ended their epoch early: half of what the clients
    /// keep in flight was held ([`Epochs::half_depth_held`]).
    pub half_commits: AtomicU64,
    /// Commits run by the thread whose held reply ended the epoch
    /// (`Epochs::commit_here`), counted in the idle and half counts too.
    pub here_commits: AtomicU64,
    /// Device writes released by commits.
    pub writes_released: AtomicU64,
    /// Rollbacks.
    pub rollbacks: AtomicU64,
}

/// Epochs, the checkpoint image and the output gate.
pub struct Epochs {
    scheme: OutputCommit,
    interval: Duration,
    /// Commit as soon as output waits and the pipeline is idle.
    when_idle: bool,
    /// Set when output waits and the pipeline went idle; wakes the
    /// checkpoint thread.
    idle_kick: Mutex<bool>,
    /// A kick is on its way to the checkpoint thread: further ones skip
    /// the lock and the wake-up (the pipeline can go idle tens of
    /// thousands of times a second).
    kick_pending: AtomicBool,
    /// The pending kick came from half the clients' depth held, not from
    /// the controller going idle (counted apart).
    half_kick: AtomicBool,
    /// When the open epoch's first reply was held (nanoseconds since
    /// `born`; 0: none held yet): with commits when idle, the epoch also
    /// ends [`OUTPUT_WAIT_MAX`] after it.
    first_held_ns: AtomicU64,
    /// When the checkpoint thread wakes next (nanoseconds since `born`),
    /// `u64::MAX` while it is not asleep on a known deadline: a first
    /// held reply wakes it only if that is later than the reply may wait
    /// (`Epochs::hold_reply`).
    wakes_at_ns: AtomicU64,
    /// When an epoch last got its first held reply (nanoseconds since
    /// `born`): while that is under an interval ago, the checkpoint thread
    /// sleeps at most [`OUTPUT_WAIT_MAX`], so the next first held reply
    /// need not wake it.
    output_seen_ns: AtomicU64,
    born: Instant,
    /// Connections reading requests, and those of them with no whole
    /// request left to read ([`Epochs::reader_drains`]): the controller
    /// is idle only when every one is drained and no request is in the
    /// pipeline. A pipeline that empties between two bursts of arrivals
    /// is not idle: committing there ends epochs of a few replies each.
    readers: AtomicI64,
    readers_drained: AtomicI64,
    /// Drained readers whose client was stalled on this server when they
    /// drained: only output such a client waits for makes an idle commit
    /// worth its cost.
    readers_stalled: AtomicI64,
    /// The requests the connections' clients have had in flight here
    /// lately, summed (each connection's recent peak,
    /// [`Epochs::client_depth`]): once half of it is held, the epoch ends
    /// ([`HALF_DEPTH_MIN`]).
    client_depth: AtomicI64,
    kicked: Condvar,
    /// Shared by stages changing the directory; exclusive for a cut.
    lock: RwLock<()>,
    /// One commit or rollback at a time.
    pub(crate) serial: Mutex<()>,
    /// When the last commit cut its epoch (nanoseconds since `born`):
    /// epochs that end early are at least [`EPOCH_MIN`] apart
    /// ([`IDLE_EPOCH_MIN`] for an idle commit).
    last_cut_ns: AtomicU64,
    /// Device outputs of committed epochs not yet released, oldest first
    /// (`Epochs::commit_here` leaves them to the checkpoint thread; a
    /// commit queues its own before it releases them): released in order
    /// under `behind_serial` ([`Epochs::release_behind`]).
    behind: Mutex<std::collections::VecDeque<Outputs>>,
    /// Held while a committed epoch's device outputs are released (taken
    /// after `serial` by whoever holds both): they leave in epoch order,
    /// and a rollback waits for the one being released.
    pub(crate) behind_serial: Mutex<()>,
    /// A rollback waits for `serial`: replying threads leave the epoch to
    /// it instead of taking `serial` ahead of it
    /// (`Epochs::commit_here`).
    pub(crate) preempt: AtomicBool,
    /// A rollback is about to drop every held device write: a commit
    /// writing held writes that no FLUSH or FUA waits for stops between
    /// tracks and leaves the rest held ([`Epochs::release_behind`]).
    abandon_writes: AtomicBool,
    open: AtomicU64,
    committed: Mutex<u64>,
    advanced: Condvar,
    image: Mutex<FxHashMap<u64, Dirty>>,
    replies: Mutex<Vec<HeldReply>>,
    /// The memory of a released epoch's reply list, for the next epoch's
    /// (a fresh list grew by reallocation through every epoch).
    spare_replies: Mutex<Vec<HeldReply>>,
    retired: Mutex<Vec<(u64, u32)>>,
    /// Tracks whose directory entry was found inconsistent: a rollback
    /// restores them from the checkpoint even if no change was noted.
    suspects: Mutex<Vec<u64>>,
    /// A FUA or FLUSH is waiting: the commit syncs the devices before it
    /// releases replies.
    sync_needed: AtomicBool,
    pub(crate) device: PseudoDevice,
    pub(crate) stats: EpochStats,
}

impl std::fmt::Debug for Epochs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epochs")
            .field("scheme", &self.scheme)
            .field("interval", &self.interval)
            .field("open", &self.open.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Epochs {
    /// Epochs for `scheme` (off: no epochs) every `interval` over
    /// `volume`; the buffering and renaming schemes keep their areas in
    /// `dir`.
    pub fn new(
        scheme: OutputCommit,
        interval: Duration,
        when_idle: bool,
        dir: &std::path::Path,
        volume: &crate::backend::volume::Volume,
    ) -> std::io::Result<Self> {
        Ok(Self {
            scheme,
            interval,
            when_idle,
            idle_kick: Mutex::new(false),
            kick_pending: AtomicBool::new(false),
            half_kick: AtomicBool::new(false),
            first_held_ns: AtomicU64::new(0),
            wakes_at_ns: AtomicU64::new(u64::MAX),
            output_seen_ns: AtomicU64::new(0),
            born: Instant::now(),
            readers: AtomicI64::new(0),
            readers_drained: AtomicI64::new(0),
            readers_stalled: AtomicI64::new(0),
            client_depth: AtomicI64::new(0),
            kicked: Condvar::new(),
            lock: RwLock::new(()),
            serial: Mutex::new(()),
            last_cut_ns: AtomicU64::new(0),
            behind: Mutex::new(std::collections::VecDeque::new()),
            behind_serial: Mutex::new(()),
            preempt: AtomicBool::new(false),
            abandon_writes: AtomicBool::new(false),
            open: AtomicU64::new(1),
            committed: Mutex::new(0),
            advanced: Condvar::new(),
            image: Mutex::new(FxHashMap::default()),
            replies: Mutex::new(Vec::new()),
            spare_replies: Mutex::new(Vec::new()),
            retired: Mutex::new(Vec::new()),
            suspects: Mutex::new(Vec::new()),
            sync_needed: AtomicBool::new(false),
            device: PseudoDevice::new(scheme, dir, volume)?,
            stats: EpochStats::default(),
        })
    }

    /// Whether epochs, output commit and rollback are on.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.scheme != OutputCommit::Off
    }

    /// The scheme.
    pub fn scheme(&self) -> OutputCommit {
        self.scheme
    }

    /// The checkpoint interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The open epoch.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Acquire)
    }

    /// Held replies now.
    pub fn held_replies(&self) -> usize {
        self.replies.lock().len()
    }

    /// Committed epochs whose device outputs wait for the checkpoint
    /// thread (`Epochs::commit_here`).
    pub fn outputs_behind(&self) -> usize {
        self.behind.lock().len()
    }

    /// Counters.
    pub fn stats(&self) -> &EpochStats {
        &self.stats
    }

    /// Held shared while a stage changes the cache directory, so a commit
    /// never cuts through a change. `None` when epochs are off.
    #[inline]
    pub(crate) fn changing(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.enabled().then(|| self.lock.read())
    }

    /// A connection starts reading requests (`true`) or stops (`false`).
    pub(crate) fn reader(&self, open: bool) {
        self.readers
            .fetch_add(if open { 1 } else { -1 }, Ordering::AcqRel);
    }

    /// A connection's reader has no whole request left to read: it is
    /// about to wait for its client. `stalled`: that client has all it can
    /// have in flight here (`Connection::stalled`). With `pipeline_empty`,
    /// the reader that drains last makes the controller idle, and held
    /// output is due now (with commits when idle on) if some client is
    /// stalled on it: [`Due::Idle`], which the reader ends itself
    /// ([`Epochs::end_due`]).
    pub(crate) fn reader_drains(&self, stalled: bool, pipeline_empty: bool) -> Due {
        if stalled {
            self.readers_stalled.fetch_add(1, Ordering::AcqRel);
        }
        self.readers_drained.fetch_add(1, Ordering::AcqRel);
        if self.when_idle && pipeline_empty && self.idle() && self.held_replies() > 0 {
            Due::Idle
        } else {
            Due::No
        }
    }

    /// A drained reader (see [`Epochs::reader_drains`], with the
    /// `stalled` it gave) has read a request again.
    pub(crate) fn reader_reads(&self, stalled: bool) {
        if stalled {
            self.readers_stalled.fetch_sub(1, Ordering::AcqRel);
        }
        self.readers_drained.fetch_sub(1, Ordering::AcqRel);
    }

    /// A connection's recent peak of requests in flight changed by
    /// `delta` (and by minus its peak when it closes).
    pub(crate) fn client_depth(&self, delta: i64) {
        self.client_depth.fetch_add(delta, Ordering::AcqRel);
    }

    /// Whether the controller is idle for a commit: every connection's
    /// reader is drained and some client is stalled on held output (see
    /// [`Epochs::reader_drains`]); true with no connection (requests
    /// submitted in-process).
    pub(crate) fn idle(&self) -> bool {
        let readers = self.readers.load(Ordering::Acquire);
        readers == 0
            || (self.readers_drained.load(Ordering::Acquire) >= readers
                && self.readers_stalled.load(Ordering::Acquire) > 0)
    }

    /// The controller went idle with output waiting: wake the checkpoint
    /// thread (once until it takes the kick).
    fn kick_idle(&self) {
        if self.kick_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.idle_kick.lock() = true;
        self.kicked.notify_one();
    }

    /// Put a finished request's reply in the output gate; `idle`: no
    /// request is left in the pipeline and the controller is idle (see
    /// [`Epochs::idle`]). Returns whether the epoch should end now rather
    /// than at its interval (with commits when idle on: the controller is
    /// idle, or this reply makes half of the clients' depth held,
    /// [`Epochs::half_depth_held`]); the caller then ends it
    /// ([`Epochs::end_due`]).
    pub(crate) fn hold_reply(
        &self,
        req: Box<Request>,
        result: Result<(), (NbdError, String)>,
        idle: bool,
    ) -> Due {
        let held = {
            let _shared = self.lock.read();
            let epoch = self.open();
            let mut replies = self.replies.lock();
            replies.push(HeldReply { epoch, req, result });
            replies.len()
        };
        if !self.when_idle {
            return Due::No;
        }
        if idle {
            return Due::Idle;
        }
        if self.half_depth_held(held) {
            return Due::Half;
        }
        if held == 1 {
            // The epoch's first held output: the checkpoint thread ends
            // the epoch at most OUTPUT_WAIT_MAX from now. It is woken for
            // that only if it sleeps past then: at queue depth 1 every
            // write is an epoch's first held reply, and a wake-up each
            // (the epoch ended by an idle commit long before) cost more
            // than the commit. Both sides order their store before their
            // load (`SeqCst`): either the thread, computing its wake,
            // sees this epoch's first held reply, or this sees the wake
            // it computed without it (or `u64::MAX` while it computes).
            let first = self.since_born();
            self.output_seen_ns.store(first, Ordering::Relaxed);
            self.first_held_ns.store(first, Ordering::SeqCst);
            let due = first + OUTPUT_WAIT_MAX.as_nanos() as u64;
            if self.wakes_at_ns.load(Ordering::SeqCst) > due {
                let _kick = self.idle_kick.lock();
                self.kicked.notify_one();
            }
        }
        Due::No
    }

    /// End the epoch `due` says is due (from [`Epochs::hold_reply`] or
    /// [`Epochs::reader_drains`]; nothing for [`Due::No`]): on the calling
    /// thread ([`Epochs::commit_here`]), or, when that may not, by the
    /// checkpoint thread ([`Epochs::kick`]). The caller holds no lock of
    /// the engine's and has left the pipeline.
    pub(crate) fn end_due(&self, ctl: &Arc<Engine>, due: Due) {
        if !self.commit_here(ctl, due) {
            self.kick(due);
        }
    }

    /// Have the checkpoint thread end the epoch (`due`: why), at most
    /// [`EPOCH_MIN`] after the last cut ([`IDLE_EPOCH_MIN`] when idle).
    fn kick(&self, due: Due) {
        match due {
            Due::No => {}
            Due::Idle => self.kick_idle(),
            Due::Half => {
                self.half_kick.store(true, Ordering::Release);
                self.kick_idle();
            }
        }
    }

    /// End the epoch on the calling thread, whose held reply made it due
    /// (or, for [`Due::Idle`] from [`Epochs::reader_drains`], the reader
    /// that found the controller idle): the cut and the release of its
    /// replies, at once. Handing the commit
    /// to the checkpoint thread cost the held replies that thread's
    /// wake-up, 40 to 100 µs on the 2-core host with both cores busy, and
    /// the device writes of the commit before (a kick waits for them).
    /// The epoch's device outputs ([`Outputs`]) are released here too if
    /// they hold no device write, FLUSH or FUA; otherwise the checkpoint
    /// thread releases them, in epoch order, so a replying thread does not
    /// write to a device (but for the rare held write described below).
    /// Returns false, having done nothing, when the
    /// last cut is under `due`'s shortest epoch old ([`EPOCH_MIN`], or
    /// [`IDLE_EPOCH_MIN`] when idle), another commit or a rollback
    /// holds `serial`, or a rollback waits for it: the caller then kicks
    /// the checkpoint thread. The caller holds no lock of the engine's and
    /// has left the pipeline.
    fn commit_here(&self, ctl: &Arc<Engine>, due: Due) -> bool {
        if due == Due::No {
            return false;
        }
        let now = self.since_born();
        if now < self.last_cut_ns.load(Ordering::Acquire) + due.epoch_min().as_nanos() as u64 {
            return false;
        }
        if ctl.stopping.load(Ordering::Acquire) {
            // Shutdown's last commit may have run: leave it to the thread.
            return false;
        }
        let Some(_serial) = self.serial.try_lock() else {
            return false;
        };
        if self.preempt.load(Ordering::Acquire) {
            return false;
        }
        {
            // This cut answers every kick sent so far (their replies are
            // held now); one sent after this still counts.
            let mut kick = self.idle_kick.lock();
            *kick = false;
            self.kick_pending.store(false, Ordering::Release);
            self.half_kick.store(false, Ordering::Release);
        }
        let why = match due {
            Due::Half => &self.stats.half_commits,
            _ => &self.stats.idle_commits,
        };
        why.fetch_add(1, Ordering::Relaxed);
        self.stats.here_commits.fetch_add(1, Ordering::Relaxed);
        let outputs = self.cut_and_release(ctl);
        if outputs.durable.is_empty() && !outputs.want_sync {
            // Nothing to sync: release the rest here too if nothing is
            // written either, and no earlier epoch's outputs are on their
            // way (order). `behind_serial` first: every device commit runs
            // under it, so the check below never waits for device writes.
            // (A destage that read the epoch before the cut may still add
            // a held write of it after the check: this thread then writes
            // that one track.)
            if let Some(_behind) = self.behind_serial.try_lock()
                && self.behind.lock().is_empty()
                && self.device.holds_none()
            {
                self.release_outputs(ctl, outputs);
                return true;
            }
        }
        self.behind.lock().push_back(outputs);
        let _kick = self.idle_kick.lock();
        self.kicked.notify_one();
        true
    }

    /// Nanoseconds since `born` (at least 1).
    fn since_born(&self) -> u64 {
        (self.born.elapsed().as_nanos() as u64).max(1)
    }

    /// Whether `held` replies are half of what the clients keep in flight
    /// here (and at least [`HALF_DEPTH_MIN`]): the epoch ends now, so the
    /// clients get half their requests back and send more while the
    /// controller runs the other half. Ending only when the whole batch is
    /// done makes client and controller take turns: with the client on
    /// the same cores, a third of the throughput (1 x 32) was lost so.
    /// Counted at exactly half, so a burst kicks once.
    fn half_depth_held(&self, held: usize) -> bool {
        let depth = self.client_depth.load(Ordering::Acquire);
        held >= HALF_DEPTH_MIN && held as i64 == depth / 2
    }

    /// Whether epochs also end early, when output waits and the pipeline
    /// is idle.
    pub fn commits_when_idle(&self) -> bool {
        self.when_idle
    }

    /// Give NVS slots back at the commit of the open epoch (their records
    /// are invalidated already; the checkpoint may still name them).
    pub(crate) fn retire(&self, ctl: &Engine, slots: &[u32]) {
        if slots.is_empty() {
            return;
        }
        if !self.enabled() {
            ctl.nvs.release(slots);
            return;
        }
        let _shared = self.lock.read();
        let epoch = self.open();
        self.retired
            .lock()
            .extend(slots.iter().map(|&slot| (epoch, slot)));
    }

    /// The directory entry of `track` was found inconsistent (it names a
    /// record the NVS does not hold): the next rollback restores it.
    pub(crate) fn suspect(&self, track: u64) {
        self.suspects.lock().push(track);
    }

    /// Take the suspects (a rollback).
    pub(crate) fn take_suspects(&self) -> Vec<u64> {
        std::mem::take(&mut *self.suspects.lock())
    }

    /// A FUA or FLUSH reply is held: sync the devices at the commit.
    pub(crate) fn need_sync(&self) {
        self.sync_needed.store(true, Ordering::Release);
    }

    /// The checkpoint image's record for `track`.
    pub(crate) fn image_of(&self, track: u64) -> Option<Dirty> {
        self.image.lock().get(&track).copied()
    }

    /// Replace the image with the whole directory (start-up, after rung 4).
    pub(crate) fn rebase(&self, ctl: &Engine) {
        let mut image = self.image.lock();
        image.clear();
        ctl.cache.take_changes(|_, _| {});
        for (track, d) in ctl.cache.dirty_records() {
            image.insert(track, d);
        }
    }

    /// Commit the open epoch (the checkpoint thread; shutdown): the cut
    /// and its replies under `serial`, then its device outputs (and any
    /// left behind before it) under `behind_serial` only, so a replying
    /// thread can end the next epoch while they are written. Returns the
    /// epoch committed.
    pub(crate) fn commit(&self, ctl: &Arc<Engine>) -> u64 {
        let epoch = {
            let _serial = self.serial.lock();
            self.cut_into_behind(ctl)
        };
        self.release_behind(ctl);
        epoch
    }

    /// The cut: copy the epoch's directory changes into the checkpoint
    /// image and open the next epoch, under the cut lock; the epoch is then
    /// committed. Returns it, its held replies and its retired slots.
    fn cut(&self, ctl: &Engine) -> (u64, Vec<HeldReply>, Vec<(u64, u32)>) {
        let cut_started = Instant::now();
        self.last_cut_ns.store(self.since_born(), Ordering::Release);
        let (epoch, replies, retired) = {
            let _cut = self.lock.write();
            let epoch = self.open();
            let mut image = self.image.lock();
            let mut copied = 0u64;
            ctl.cache.take_changes(|track, d| {
                copied += 1;
                match d {
                    Some(d) => image.insert(track, d),
                    None => image.remove(&track),
                };
            });
            drop(image);
            self.stats
                .entries_copied
                .fetch_add(copied, Ordering::Relaxed);
            let spare = std::mem::take(&mut *self.spare_replies.lock());
            let replies = std::mem::replace(&mut *self.replies.lock(), spare);
            let retired = std::mem::take(&mut *self.retired.lock());
            self.first_held_ns.store(0, Ordering::Release);
            self.open.store(epoch + 1, Ordering::Release);
            (epoch, replies, retired)
        };
        let cut = cut_started.elapsed().as_nanos() as u64;
        self.stats.cut_ns.fetch_add(cut, Ordering::Relaxed);
        self.stats.cut_ns_max.fetch_max(cut, Ordering::Relaxed);
        // The cut is the checkpoint: `epoch` is committed. Count it before
        // any of its replies leave, so whoever reads a released reply also
        // sees the commit that released it.
        *self.committed.lock() = epoch;
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        self.advanced.notify_all();
        (epoch, replies, retired)
    }

    /// [`Epochs::commit`] with `serial` held by the caller (rung 4 before
    /// its rebuild): every device output is released on return.
    pub(crate) fn commit_serial(&self, ctl: &Arc<Engine>) -> u64 {
        let epoch = self.cut_into_behind(ctl);
        self.release_behind(ctl);
        epoch
    }

    /// The cut and its replies ([`Epochs::cut_and_release`]), with the
    /// epoch's device outputs queued behind those of earlier epochs;
    /// `serial` held by the caller. Returns the epoch committed.
    fn cut_into_behind(&self, ctl: &Engine) -> u64 {
        let outputs = self.cut_and_release(ctl);
        let epoch = outputs.epoch;
        self.behind.lock().push_back(outputs);
        epoch
    }

    /// A rollback (`true`, before it releases what is behind) is about to
    /// drop every held device write: the held writes of committed epochs
    /// that no FLUSH or FUA waits for need not reach their devices first
    /// (their records are still dirty and destage again), so a commit
    /// writing them stops between tracks instead of making the rollback
    /// wait for all of them. `false` once the rollback dropped them.
    pub(crate) fn abandon_writes(&self, abandon: bool) {
        self.abandon_writes.store(abandon, Ordering::Release);
    }

    /// Release the device outputs of committed epochs, oldest first,
    /// under `behind_serial` (the checkpoint thread; a commit; a rollback
    /// before it restores anything).
    pub(crate) fn release_behind(&self, ctl: &Arc<Engine>) {
        let _behind = self.behind_serial.lock();
        loop {
            let Some(outputs) = self.behind.lock().pop_front() else {
                return;
            };
            self.release_outputs(ctl, outputs);
        }
    }

    /// The cut, then the epoch's replies that promise nothing about the
    /// devices leave (the paper's network output is released at the
    /// checkpoint's commit; a write's data is safe in the NVS, whose record
    /// the checkpoint names until the write reaches its target). Returns
    /// what the epoch still owes: only a FLUSH or FUA waits for the device
    /// writes and the sync.
    fn cut_and_release(&self, ctl: &Engine) -> Outputs {
        let (epoch, mut replies, retired) = self.cut(ctl);
        let durable = if replies.iter().any(|r| r.req.promises_durability()) {
            let durable;
            (durable, replies) = replies
                .into_iter()
                .partition(|r| r.req.promises_durability());
            durable
        } else {
            Vec::new()
        };
        self.stats
            .replies_released
            .fetch_add(replies.len() as u64, Ordering::Relaxed);
        release_replies(epoch, &mut replies, None);
        let mut spare = self.spare_replies.lock();
        if spare.capacity() < replies.capacity() {
            *spare = replies;
        }
        drop(spare);
        let want_sync = self.sync_needed.swap(false, Ordering::AcqRel);
        Outputs {
            epoch,
            durable,
            retired,
            want_sync,
        }
    }

    /// Release a committed epoch's device outputs, in order: device writes,
    /// their destages, slots, durability, the FLUSH and FUA replies. No
    /// rollback stops them: the epoch is committed (a FLUSH or FUA run
    /// again after a rollback could undo a write acknowledged since).
    fn release_outputs(&self, ctl: &Arc<Engine>, outputs: Outputs) {
        let Outputs {
            epoch,
            mut durable,
            retired,
            want_sync,
        } = outputs;
        let ticket = ctl.volume.sync_ticket();
        // Writes no FLUSH or FUA waits for may stay held for a rollback to
        // drop (`abandon_writes`): their records are still dirty.
        let abandonable = durable.is_empty() && !want_sync;
        let (writes, written) = self.device.commit(&ctl.volume, epoch, || {
            abandonable && self.abandon_writes.load(Ordering::Acquire)
        });
        if let Err(e) = &written {
            tracing::error!(error = %e, epoch, "output commit: some held writes stay held");
        }
        // The released writes are durable (and their records may go) only
        // once a device sync covers them. A FUA or FLUSH held in the epoch
        // needs that sync now; renaming's map must be synced with its data.
        // Otherwise the destage syncer, hurried, covers them with its next
        // sync (`hand_over_held`).
        // Rung 4 commits while quiescing, just before it rebuilds the
        // directory: the syncer must not end destages under its rebuild,
        // so that commit syncs and ends them itself.
        let defer = !want_sync
            && durable.is_empty()
            && self.scheme != OutputCommit::Renaming
            && !ctl.system.is_quiescing();
        let any_output = want_sync || !writes.is_empty();
        let synced = if any_output && !defer {
            ctl.volume.sync().and_then(|()| self.device.sync())
        } else {
            Ok(())
        };
        if let Err(e) = &synced {
            tracing::error!(error = %e, epoch, "output commit: device sync failed; the epoch's writes stay dirty");
        }
        self.stats
            .writes_released
            .fetch_add(writes.len() as u64, Ordering::Relaxed);
        if defer {
            crate::engine::destage::hand_over_held(
                ctl,
                writes.into_iter().map(|h| (h.track, h.destage)),
                ticket,
            );
        } else {
            for h in writes {
                crate::engine::destage::end_held(ctl, h.track, h.destage, synced.is_ok());
            }
        }
        // What FLUSH and FUA replies of this epoch promised: every write
        // held up to the epoch on a device, durably.
        let durability = match (&written, &synced) {
            (Ok(()), Ok(())) => None,
            (Err(e), _) | (_, Err(e)) => Some(e.to_string()),
        };
        if any_output || written.is_err() {
            // A FLUSH waiting on a held write that failed answers EIO.
            ctl.destage
                .note_outcome(written.as_ref().err().or(synced.as_ref().err()));
        }
        let slots: Vec<u32> = retired.into_iter().map(|(_, s)| s).collect();
        ctl.nvs.release(&slots);
        self.stats
            .replies_released
            .fetch_add(durable.len() as u64, Ordering::Relaxed);
        release_replies(epoch, &mut durable, durability.as_deref());
        // Destages ended by this commit may have requeued tracks: start a
        // task for them as a write would, once a whole batch is queued
        // (the tick starts one for fewer). Kicking for any queued track
        // made every commit destage the tracks its epoch had just
        // dirtied: at queue depth 1, a destage, a held write and a device
        // sync per client write.
        crate::engine::destage::kick_batch(ctl);
    }

    /// Rollback, under `serial` and with the pipeline quiesced: take the
    /// open epoch's held replies (their requests run again), forget its
    /// retired slots (the NVS free list is rebuilt), and hold the cut lock
    /// for the restore.
    ///
    /// The rollback released the committed epochs' device outputs first
    /// ([`Epochs::release_behind`]): none is left behind.
    pub(crate) fn begin_rollback(&self) -> (u64, RollbackCut<'_>, Vec<HeldReply>) {
        let cut = self.lock.write();
        let behind = std::mem::take(&mut *self.behind.lock());
        debug_assert!(
            behind.is_empty(),
            "a rollback began with committed epochs' device outputs unreleased"
        );
        let mut replies = Vec::new();
        for outputs in behind {
            // Unreachable (`serial` is held since they were released); if
            // it were reached, their FLUSH and FUA requests run again
            // rather than never being answered.
            tracing::error!(
                epoch = outputs.epoch,
                "rollback: a committed epoch's device outputs were not released"
            );
            replies.extend(outputs.durable);
        }
        let epoch = self.open();
        replies.extend(std::mem::take(&mut *self.replies.lock()));
        self.retired.lock().clear();
        (epoch, RollbackCut { _cut: cut }, replies)
    }

    /// After rung 4 rebuilt the directory: forget retired slots (the NVS
    /// free list was rebuilt) and rebase the image.
    pub(crate) fn after_rebuild(&self, ctl: &Engine) {
        self.retired.lock().clear();
        self.rebase(ctl);
    }
}

/// Send a committed epoch's replies, one writev per connection, taking
/// them out of `replies` (the caller keeps its memory); with
/// `durability` (why the epoch's device writes failed), a FLUSH or FUA
/// that would have succeeded answers EIO instead.
fn release_replies(epoch: u64, replies: &mut Vec<HeldReply>, durability: Option<&str>) {
    // One writev per connection for the whole epoch's replies.
    let mut corked: Vec<Arc<dyn crate::engine::ReplySink>> = Vec::new();
    for r in replies.iter() {
        let conn = &r.req.conn;
        if !corked
            .iter()
            .any(|c| crate::engine::reply::same_sink(c, conn))
            && conn.cork()
        {
            corked.push(Arc::clone(conn));
        }
    }
    for r in replies.drain(..) {
        debug_assert!(r.epoch <= epoch);
        let result = match durability {
            Some(why) if r.result.is_ok() && r.req.promises_durability() => Err((
                NbdError::Io,
                format!("output commit: the epoch's device writes failed: {why}"),
            )),
            _ => r.result,
        };
        r.req.reply_committed(result);
    }
    for c in corked {
        c.uncork();
    }
}

/// The exclusive cut lock, held through a rollback's restore.
pub(crate) struct RollbackCut<'a> {
    _cut: parking_lot::RwLockWriteGuard<'a, ()>,
}

/// Shortest epoch when commits when idle are on: bounds the commit rate.
const EPOCH_MIN: Duration = Duration::from_micros(100);

/// Shortest epoch ended because the controller went idle with a client
/// stalled on held output ([`Due::Idle`]). Such a commit only comes once
/// every request read so far has its reply held, so the clients' own
/// round trips bound its rate; [`EPOCH_MIN`] on top of that set the floor
/// of a write's latency at queue depth 1 (a client that sends its next
/// write 60 µs after the last reply waited another 40 µs for the commit,
/// and the checkpoint thread's wake-up). The small floor left only stops a
/// burst of idle commits of a few replies each.
const IDLE_EPOCH_MIN: Duration = Duration::from_micros(20);

impl Due {
    /// The shortest epoch a commit for this reason may end.
    fn epoch_min(self) -> Duration {
        match self {
            Self::Idle => IDLE_EPOCH_MIN,
            Self::No | Self::Half => EPOCH_MIN,
        }
    }
}

/// Fewest held replies for which half the clients' depth ends an epoch
/// ([`Epochs::half_depth_held`]): below it a commit per half batch costs
/// more than the overlap it buys.
const HALF_DEPTH_MIN: usize = 8;

/// With commits when idle on, the longest a held reply waits for its
/// epoch to end while no client is stalled on the controller (a load that
/// keeps many requests in flight). Without it such a load sees fixed
/// epochs: every reply of an epoch leaves in one burst at its end, the
/// clients answer in one burst, and on few cores the controller and its
/// clients take turns instead of running side by side. Commits are
/// incremental and cost microseconds, so ending epochs this early is cheap.
pub const OUTPUT_WAIT_MAX: Duration = Duration::from_millis(1);

/// Start the checkpoint thread: commits every interval (and, with commits
/// when idle, as soon as output waits and the pipeline is idle, at most
/// every [`EPOCH_MIN`], or once output has waited [`OUTPUT_WAIT_MAX`])
/// until the controller is gone.
pub(crate) fn start(ctl: &Arc<Engine>) -> std::io::Result<()> {
    if !ctl.epochs.enabled() {
        return Ok(());
    }
    let weak: Weak<Engine> = Arc::downgrade(ctl);
    let interval = ctl.epochs.interval;
    std::thread::Builder::new()
        .name("rebound-epoch".into())
        .spawn(move || {
            loop {
                let commit_now = {
                    let Some(ctl) = weak.upgrade() else { return };
                    let e = &ctl.epochs;
                    let mut kick = e.idle_kick.lock();
                    loop {
                        // Not asleep on a known deadline until the wait
                        // below: a first held reply meanwhile wakes us.
                        e.wakes_at_ns.store(u64::MAX, Ordering::SeqCst);
                        let now = Instant::now();
                        let last =
                            e.born + Duration::from_nanos(e.last_cut_ns.load(Ordering::Acquire));
                        let deadline = last + interval;
                        // The open epoch's output has waited long enough.
                        let waited = match e.first_held_ns.load(Ordering::SeqCst) {
                            0 => None,
                            ns => Some(e.born + Duration::from_nanos(ns) + OUTPUT_WAIT_MAX),
                        }
                        .filter(|_| e.when_idle)
                        .map(|w| w.max(last + EPOCH_MIN));
                        let deadline = waited.map_or(deadline, |w| w.min(deadline));
                        // A kick's shortest epoch: an idle kick's is shorter
                        // than a half kick's (`Due::epoch_min`).
                        let kick_min = if e.half_kick.load(Ordering::Acquire) {
                            Due::Half
                        } else {
                            Due::Idle
                        }
                        .epoch_min();
                        if now >= deadline || (*kick && now >= last + kick_min) {
                            // Under the lock, so a kick on its way sets it
                            // again.
                            e.kick_pending.store(false, Ordering::Release);
                            let half = e.half_kick.swap(false, Ordering::AcqRel);
                            if now < last + interval {
                                let why = if *kick && half {
                                    &e.stats.half_commits
                                } else if *kick {
                                    &e.stats.idle_commits
                                } else {
                                    &e.stats.wait_commits
                                };
                                why.fetch_add(1, Ordering::Relaxed);
                            }
                            *kick = false;
                            break true;
                        }
                        if !e.behind.lock().is_empty() {
                            // A replying thread committed an epoch and
                            // left its device outputs to us (it pushes
                            // them before it notifies, under this lock).
                            break false;
                        }
                        let mut until = if *kick { last + kick_min } else { deadline };
                        let seen =
                            e.born + Duration::from_nanos(e.output_seen_ns.load(Ordering::Relaxed));
                        if e.when_idle && waited.is_none() && now < seen + interval {
                            // Output came lately and may come again: be
                            // awake by the time a reply held now must
                            // leave, so its holder need not wake us (a
                            // wake-up per write at queue depth 1, against
                            // at most one per OUTPUT_WAIT_MAX here).
                            until = until.min(now + OUTPUT_WAIT_MAX);
                        }
                        // Wake at least every 50 ms to notice a shutdown.
                        let wait = (until - now).min(Duration::from_millis(50));
                        e.wakes_at_ns.store(
                            (now + wait).duration_since(e.born).as_nanos() as u64,
                            Ordering::SeqCst,
                        );
                        e.kicked.wait_for(&mut kick, wait);
                        if ctl.is_closed() {
                            return;
                        }
                    }
                };
                let Some(ctl) = weak.upgrade() else { return };
                if ctl.is_closed() {
                    return;
                }
                if commit_now {
                    ctl.epochs.commit(&ctl);
                } else {
                    ctl.epochs.release_behind(&ctl);
                }
            }
        })?;
    Ok(())
}
