//! Actors: the recoverable threads of the paper (§4), or tasks of any
//! runtime. Log(Lock) finds the current actor through a thread-local that
//! the runtime sets around each piece of recoverable work with
//! [`Actor::begin`]; rcs tasks get one from the controller.
//!
//! An actor owns its tracking set, its undo log and its recovery points.
//! When it ends (the [`Actor`] scope drops), it stops tracking every lock
//! it still tracks and its undo log is purged ("undo logs ... can be purged
//! when a recoverable thread completes execution", §4.2).
//!
//! Threads that run no actor still touch tracked locks: their accesses are
//! recorded under an implicit per-thread id (with
//! [`IMPLICIT_ACTOR_BIT`](crate::IMPLICIT_ACTOR_BIT)), since they are the
//! "other threads" whose reads and writes make the conflicts.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::commit::{TRACKING_ACTORS, commit_mark, purge_if_idle, record_commit};
use crate::core::LockCore;
use crate::criterion::RecoveryCriterion;
use crate::error::LogError;
use crate::event::{ActorId, IMPLICIT_ACTOR_BIT, LockId};
use crate::limits::{RECOVERY_POINTS_MAX, TRACKED_PER_ACTOR_MAX, UNDO_LOG_ENTRIES_MAX};
use crate::recovery_point::RecoveryPoint;
use crate::undo::{Restore, UndoRecord};

#[derive(Debug)]
pub(crate) struct Tracking {
    pub core: Arc<LockCore>,
    /// First sequence number of `core` the actor sees.
    pub start: u64,
    /// Commit sequence number at the start.
    pub commit_start: u64,
    /// `ActorState::point_gen` when an old value of this lock was last
    /// saved: until a new recovery point, later modifications need no
    /// undo entry (rollback restores the oldest one since the point).
    pub captured_gen: u64,
}

/// Where an actor's tracking of a lock started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TrackingStart {
    pub start: u64,
    pub commit_start: u64,
}

#[derive(Debug)]
pub(crate) struct PointMark {
    pub index: usize,
    pub undo_mark: usize,
}

/// What the current actor owns.
#[derive(Debug)]
pub(crate) struct ActorState {
    pub id: ActorId,
    pub tracked: Vec<Tracking>,
    pub undo: Vec<UndoRecord>,
    /// Undo capture was refused for space: rollback is no longer exact.
    pub undo_overflow: bool,
    pub points: Vec<PointMark>,
    pub next_point: usize,
    /// Tracked locks (by id) this actor holds right now, once per hold.
    pub held: Vec<LockId>,
    /// Numbers undo entries (covered by their check words).
    pub undo_seq: u64,
    /// Advanced by every recovery point, rollback and leave.
    pub point_gen: u64,
}

/// Tracked locks mirrored in [`Fast`]; an actor tracking more takes the
/// slower path through its state.
const FAST_LOCKS: usize = 8;

/// The hot part of the current actor, readable without borrowing its
/// state: who runs here (0: no actor), how many locks it tracks, and for
/// the first [`FAST_LOCKS`] of them the lock id and the recovery-point
/// generation of its last undo capture. Rebuilt by [`sync_fast`] after
/// every change of the state it mirrors.
#[derive(Debug)]
struct Fast {
    id: Cell<ActorId>,
    tracking: Cell<usize>,
    ids: [Cell<u64>; FAST_LOCKS],
    captured: [Cell<u64>; FAST_LOCKS],
    point_gen: Cell<u64>,
}

thread_local! {
    static ACTOR: RefCell<Option<ActorState>> = const { RefCell::new(None) };
    static FAST: Fast = const {
        Fast {
            id: Cell::new(0),
            tracking: Cell::new(0),
            ids: [const { Cell::new(0) }; FAST_LOCKS],
            captured: [const { Cell::new(0) }; FAST_LOCKS],
            point_gen: Cell::new(0),
        }
    };
    static IMPLICIT: Cell<ActorId> = const { Cell::new(0) };
}

static NEXT_IMPLICIT: AtomicU64 = AtomicU64::new(1);

fn implicit_id() -> ActorId {
    IMPLICIT.with(|c| {
        let mut id = c.get();
        if id == 0 {
            id = IMPLICIT_ACTOR_BIT | NEXT_IMPLICIT.fetch_add(1, Ordering::Relaxed);
            c.set(id);
        }
        id
    })
}

/// The id of whoever runs on this thread: the current actor, else the
/// thread's implicit id.
pub fn current_actor() -> ActorId {
    match FAST.with(|f| f.id.get()) {
        0 => implicit_id(),
        id => id,
    }
}

/// Mirror `state` (or no actor) into [`Fast`].
pub(crate) fn sync_fast(state: Option<&ActorState>) {
    FAST.with(|f| match state {
        None => {
            f.id.set(0);
            f.tracking.set(0);
        }
        Some(s) => {
            f.id.set(s.id);
            f.tracking.set(s.tracked.len());
            f.point_gen.set(s.point_gen);
            for i in 0..FAST_LOCKS {
                match s.tracked.get(i) {
                    Some(t) => {
                        f.ids[i].set(t.core.id().0);
                        f.captured[i].set(t.captured_gen);
                    }
                    None => f.ids[i].set(0),
                }
            }
        }
    });
}

/// Run `f` on the current actor's state.
pub(crate) fn with_actor<R>(f: impl FnOnce(&mut ActorState) -> R) -> Result<R, LogError> {
    ACTOR.with(|a| match a.try_borrow_mut() {
        Ok(mut a) => a.as_mut().map(f).ok_or(LogError::NoActor),
        Err(_) => Err(LogError::NoActor),
    })
}

/// Who is accessing a tracked lock (known only while the lock is tracked).
///
/// Two words, so it comes back from [`begin_access`] in registers: the
/// flags as separate `bool`s were returned through memory and read back as
/// one wider load, a store-forwarding stall that cost more than the rest
/// of the access (seen with `perf annotate` on the criterion bench).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Access {
    pub actor: ActorId,
    flags: u8,
}

impl Access {
    /// The accessing actor tracks the lock (so it holds it, for RR).
    const TRACKS: u8 = 1;
    /// Its first modification must save the old value.
    const CAPTURE: u8 = 2;
    /// The structure is held exclusively (the hold is noted in the lock's
    /// core, not in the actor's state).
    const EXCLUSIVE: u8 = 4;

    #[inline]
    fn new(actor: ActorId, tracks: bool, capture: bool, exclusive: bool) -> Self {
        let flags = (u8::from(tracks) * Self::TRACKS)
            | (u8::from(capture) * Self::CAPTURE)
            | (u8::from(exclusive) * Self::EXCLUSIVE);
        Self { actor, flags }
    }

    /// The accessing actor tracks the lock.
    #[inline]
    pub fn tracks(self) -> bool {
        self.flags & Self::TRACKS != 0
    }

    /// Its first modification must save the old value.
    #[inline]
    pub fn capture(self) -> bool {
        self.flags & Self::CAPTURE != 0
    }

    /// The structure is held exclusively.
    #[inline]
    pub fn exclusive(self) -> bool {
        self.flags & Self::EXCLUSIVE != 0
    }
}

/// Start an access to a tracked lock: who is it, and note the hold.
#[inline]
pub(crate) fn begin_access(core: &LockCore, exclusive: bool) -> Access {
    let lock = core.id();
    let fast = FAST.with(|f| {
        let (id, tracking) = (f.id.get(), f.tracking.get());
        if tracking == 0 {
            // The common case: another actor tracks the lock, this one is
            // only being recorded.
            let actor = if id == 0 { implicit_id() } else { id };
            return Some((actor, false, false));
        }
        if tracking > FAST_LOCKS {
            return None;
        }
        let found = (0..tracking).find(|&i| f.ids[i].get() == lock.0);
        Some(match found {
            Some(i) => (id, true, f.captured[i].get() != f.point_gen.get()),
            None => (id, false, false),
        })
    });
    let (actor, tracks, capture) = fast.unwrap_or_else(|| {
        with_actor(|s| {
            let gen_now = s.point_gen;
            match s.tracked.iter().find(|t| t.core.id() == lock) {
                Some(t) => (s.id, true, t.captured_gen != gen_now),
                None => (s.id, false, false),
            }
        })
        .unwrap_or_else(|_| (implicit_id(), false, false))
    });
    if tracks {
        if exclusive {
            core.set_holder(actor);
        } else {
            let _ = with_actor(|s| s.held.push(lock));
        }
    }
    Access::new(actor, tracks, capture, exclusive)
}

/// End an access begun with [`begin_access`].
#[inline]
pub(crate) fn end_access(core: &LockCore, a: Access) {
    if !a.tracks() {
        return;
    }
    if a.exclusive() {
        core.set_holder(0);
    } else {
        let lock = core.id();
        let _ = with_actor(|s| {
            if let Some(i) = s.held.iter().rposition(|l| *l == lock) {
                s.held.swap_remove(i);
            }
        });
    }
}

/// Whether `actor` holds the structure of `core` (exclusively, or shared
/// as the current actor).
pub(crate) fn holds(core: &LockCore, actor: ActorId) -> bool {
    core.holder() == actor || with_actor(|s| s.held.contains(&core.id())).unwrap_or(false)
}

/// A guard's first modification: if the accessing actor must save the old
/// value (it tracks the lock and has not saved one since its latest
/// recovery point), build the undo entry and save it.
#[inline]
pub(crate) fn first_write(
    written: &mut bool,
    access: Option<Access>,
    lock: LockId,
    old: impl FnOnce() -> Box<dyn Restore>,
) {
    if !*written {
        *written = true;
        if let Some(a) = access
            && a.capture()
        {
            save_undo(lock, old());
        }
    }
}

/// Save an old value in the current actor's undo log.
fn save_undo(lock: LockId, restore: Box<dyn Restore>) {
    let _ = with_actor(|s| {
        if s.undo.len() >= UNDO_LOG_ENTRIES_MAX {
            s.undo_overflow = true;
            return;
        }
        s.undo_seq += 1;
        s.undo.push(UndoRecord::new(lock, s.undo_seq, restore));
        let gen_now = s.point_gen;
        if let Some(t) = s.tracked.iter_mut().find(|t| t.core.id() == lock) {
            t.captured_gen = gen_now;
        }
        sync_fast(Some(s));
    });
}

/// A recoverable actor, current on this thread until dropped.
///
/// ```
/// use loglock::{Actor, TrackedMutex};
/// let users = TrackedMutex::new("numActiveUsers", 0u32);
/// let actor = Actor::begin(7);
/// actor.start_tracking(&users).unwrap();
/// *users.lock() += 1;
/// let level = actor.restoration_level(&users).unwrap();
/// assert!(!level.dr && !level.lu, "nobody else touched it");
/// ```
#[derive(Debug)]
pub struct Actor {
    id: ActorId,
    previous: Option<ActorState>,
    _not_send: PhantomData<*const ()>,
}

impl Actor {
    /// Make `id` the current actor on this thread. Ids must be unique among
    /// live actors and below 2^63. An actor already current on this thread
    /// is suspended and comes back when this one ends.
    pub fn begin(id: ActorId) -> Self {
        assert!(id & IMPLICIT_ACTOR_BIT == 0, "actor ids must be below 2^63");
        let previous = ACTOR.with(|a| {
            a.borrow_mut().replace(ActorState {
                id,
                tracked: Vec::new(),
                undo: Vec::new(),
                undo_overflow: false,
                points: Vec::new(),
                next_point: 0,
                held: Vec::new(),
                undo_seq: 0,
                point_gen: 0,
            })
        });
        ACTOR.with(|a| sync_fast(a.borrow().as_ref()));
        Self {
            id,
            previous,
            _not_send: PhantomData,
        }
    }

    /// Run `f` on this actor's state; it must be the current actor.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut ActorState) -> R) -> Result<R, LogError> {
        let id = self.id;
        with_actor(|s| {
            if s.id == id {
                Ok(f(s))
            } else {
                Err(LogError::NotCurrent(id))
            }
        })?
    }

    /// This actor's id.
    pub fn id(&self) -> ActorId {
        self.id
    }

    /// `startTracking(lock)`: record every access to the structure `lock`
    /// protects from now on, by every actor, until `stop_tracking`.
    pub fn start_tracking(&self, lock: &(impl Tracked + ?Sized)) -> Result<(), LogError> {
        let core = lock.core();
        let id = self.id;
        self.with(|s| {
            if s.tracked.iter().any(|t| t.core.id() == core.id()) {
                return Err(LogError::AlreadyTracking(core.id()));
            }
            if s.tracked.len() == TRACKED_PER_ACTOR_MAX {
                return Err(LogError::TooManyTracked(TRACKED_PER_ACTOR_MAX));
            }
            if s.tracked.is_empty() {
                TRACKING_ACTORS.fetch_add(1, Ordering::SeqCst);
            }
            let commit_start = commit_mark();
            let start = core.add_tracker(id);
            s.tracked.push(Tracking {
                core: Arc::clone(core),
                start,
                commit_start,
                captured_gen: u64::MAX,
            });
            sync_fast(Some(s));
            Ok(())
        })?
    }

    /// `stopTracking(lock)`: this actor no longer needs the lock's log. Its
    /// entries are marked and purged once no other tracker needs them.
    pub fn stop_tracking(&self, lock: &(impl Tracked + ?Sized)) -> Result<(), LogError> {
        let core = lock.core();
        let last = self.with(|s| {
            let i = s
                .tracked
                .iter()
                .position(|t| t.core.id() == core.id())
                .ok_or(LogError::NotTracking(core.id()))?;
            s.tracked.swap_remove(i);
            sync_fast(Some(s));
            Ok(s.tracked.is_empty())
        })??;
        core.remove_tracker(self.id);
        if last {
            TRACKING_ACTORS.fetch_sub(1, Ordering::SeqCst);
            purge_if_idle();
        }
        Ok(())
    }

    /// Whether this actor tracks `lock`.
    pub fn is_tracking(&self, lock: &(impl Tracked + ?Sized)) -> bool {
        let id = lock.core().id();
        self.with(|s| s.tracked.iter().any(|t| t.core.id() == id))
            .unwrap_or(false)
    }

    /// The sequence number at which this actor started tracking `lock`.
    pub(crate) fn tracking_start(&self, lock: LockId) -> Result<TrackingStart, LogError> {
        self.with(|s| {
            s.tracked
                .iter()
                .find(|t| t.core.id() == lock)
                .map(|t| TrackingStart {
                    start: t.start,
                    commit_start: t.commit_start,
                })
                .ok_or(LogError::NotTracking(lock))
        })?
    }

    /// Record an externally visible action (a reply sent, a device write
    /// issued): it cannot be rolled back, and makes any conflict this actor
    /// caused before it a committed dependency for the other actor.
    pub fn commit(&self) {
        record_commit(self.id);
    }

    /// Take a recovery point with its criterion: where control returns
    /// after recovery, and what the state must satisfy to roll back to it.
    pub fn recovery_point(&self, criterion: RecoveryCriterion) -> Result<RecoveryPoint, LogError> {
        self.with(|s| {
            if s.points.len() == RECOVERY_POINTS_MAX {
                return Err(LogError::TooManyRecoveryPoints(RECOVERY_POINTS_MAX));
            }
            let index = s.next_point;
            s.next_point += 1;
            s.point_gen += 1;
            sync_fast(Some(s));
            s.points.push(PointMark {
                index,
                undo_mark: s.undo.len(),
            });
            // Where each tracked lock's log stands: events from these on
            // happened after the point.
            let marks = s
                .tracked
                .iter()
                .map(|t| (t.core.id(), t.core.head()))
                .collect();
            Ok(RecoveryPoint::new(index, self.id, marks, criterion))
        })?
    }

    /// Leave the context of `point`: it and every later point go out of
    /// scope; their undo entries stay with the enclosing point (the actor's
    /// start is the default recovery point) and are purged when the actor
    /// ends.
    pub fn leave(&self, point: RecoveryPoint) -> Result<(), LogError> {
        self.with(|s| {
            let i = s
                .points
                .iter()
                .position(|p| p.index == point.index())
                .ok_or(LogError::UnknownRecoveryPoint(point.index()))?;
            s.points.truncate(i);
            s.point_gen += 1;
            sync_fast(Some(s));
            Ok(())
        })?
    }

    /// Undo every change saved since `point`: each structure modified
    /// since the point gets back its value at the point (its oldest saved
    /// value; newer ones are superseded). Returns how many structures were
    /// restored.
    ///
    /// Every entry's checksum is verified before any is applied; a damaged
    /// or overflowed log restores nothing. Each structure is restored only
    /// if, under its lock, no other actor has read or overwritten this
    /// actor's changes since the point (no DR, no LU): otherwise the undo
    /// would lose their work, and the rollback stops with
    /// [`LogError::Interfered`] (the caller compensates or escalates). The
    /// check and the restore are one critical section per structure.
    ///
    /// The actor must not hold any of the locks involved (release them
    /// first, as the resource recovery protocol says).
    pub fn rollback(&self, point: &RecoveryPoint) -> Result<usize, LogError> {
        let entries = self.with(|s| {
            let mark = s
                .points
                .iter()
                .find(|p| p.index == point.index())
                .ok_or(LogError::UnknownRecoveryPoint(point.index()))?
                .undo_mark;
            if s.undo_overflow {
                return Err(LogError::UndoOverflow(UNDO_LOG_ENTRIES_MAX));
            }
            if s.undo[mark..].iter().any(|u| !u.is_intact()) {
                return Err(LogError::Corrupt("undo"));
            }
            s.point_gen += 1;
            sync_fast(Some(s));
            Ok(s.undo.split_off(mark))
        })??;
        // The oldest entry per structure is its value at the point.
        let mut oldest: Vec<UndoRecord> = Vec::new();
        for e in entries {
            if !oldest.iter().any(|o| o.lock == e.lock) {
                oldest.push(e);
            }
        }
        let mut restored = 0;
        // Restore outside the actor borrow: restoring takes the tracked
        // locks, which consult the actor state.
        for e in oldest.into_iter().rev() {
            let lock = e.lock;
            let tracking = self.with(|s| {
                s.tracked
                    .iter()
                    .find(|t| t.core.id() == lock)
                    .map(|t| (Arc::clone(&t.core), t.start, t.commit_start))
            })?;
            let mut still_safe = || match &tracking {
                Some((core, start, commit_start)) => {
                    let from = (*start).max(point.mark(lock));
                    let window = crate::level::Window {
                        from,
                        commit_from: *commit_start,
                        wrote: Some(true),
                        undo_from: 0,
                    };
                    crate::level::compute_on(self.id, window, core, &[])
                        .is_ok_and(|l| !l.dr && !l.lu)
                }
                // No longer tracked: interference cannot be ruled out.
                None => false,
            };
            if !e.restore.restore_if(&mut still_safe) {
                return Err(LogError::Interfered { lock, restored });
            }
            restored += 1;
        }
        Ok(restored)
    }

    /// Where `point`'s undo entries start.
    pub(crate) fn undo_mark(&self, point: &RecoveryPoint) -> Result<usize, LogError> {
        self.with(|s| {
            s.points
                .iter()
                .find(|p| p.index == point.index())
                .map(|p| p.undo_mark)
                .ok_or(LogError::UnknownRecoveryPoint(point.index()))
        })?
    }

    /// Undo entries currently held.
    pub fn undo_len(&self) -> usize {
        self.with(|s| s.undo.len()).unwrap_or(0)
    }

    /// Damage the newest undo entry (tests of checksum verification).
    #[doc(hidden)]
    pub fn corrupt_newest_undo(&self) {
        let _ = self.with(|s| {
            if let Some(u) = s.undo.last_mut() {
                u.corrupt();
            }
        });
    }
}

impl Drop for Actor {
    fn drop(&mut self) {
        let previous = self.previous.take();
        sync_fast(previous.as_ref());
        let ended = ACTOR.with(|a| std::mem::replace(&mut *a.borrow_mut(), previous));
        if let Some(state) = ended {
            let tracked = !state.tracked.is_empty();
            for t in &state.tracked {
                t.core.remove_tracker(state.id);
            }
            if tracked {
                TRACKING_ACTORS.fetch_sub(1, Ordering::SeqCst);
                purge_if_idle();
            }
            // The undo log is purged with `state`.
        }
    }
}

/// A structure whose accesses Log(Lock) can track: [`TrackedMutex`],
/// [`TrackedRwLock`], [`TrackedPool`].
///
/// [`TrackedMutex`]: crate::TrackedMutex
/// [`TrackedRwLock`]: crate::TrackedRwLock
/// [`TrackedPool`]: crate::TrackedPool
pub trait Tracked {
    /// The shared identity, tracker count and change-track log.
    fn core(&self) -> &Arc<LockCore>;

    /// Items of the structure `actor` owns (pools; none for locks).
    fn owned_items(&self, actor: ActorId) -> Vec<usize> {
        let _ = actor;
        Vec::new()
    }
}
