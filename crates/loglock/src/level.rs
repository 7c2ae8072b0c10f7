//! Restoration levels (paper §2.1): the 5-tuple ⟨DR, LU, UR, RR, CD⟩ that
//! captures the failure context of an actor T1, computed from the
//! change-track log of a lock and the commit log (§4.1,
//! `getRestorationLevel`), and resource ownership (`getResourceOwnership`).
//!
//! Patterns, with → the happened-before order
//! and T2 any other actor, over events after T1 started tracking (or after
//! the recovery point asked about):
//!
//! | flag | pattern |
//! |---|---|
//! | DR | T1W → T2R → T1F |
//! | LU | T1W → T2W → T1F |
//! | UR | T1R → T2W → T1F |
//! | RR | T1 holds the lock, or T1A → T1F without T1Re |
//! | CD | one of the DR, LU, UR patterns, then T2E (T2 commits) |
//!
//! → on one lock is the lock's sequence order; T2's access → T2E is T2's
//! program order (its thread's commit count, see [`commit`](crate::commit)).
//!
//! A mutable access may read as well as write, so a W event also counts as
//! an R. A log that dropped entries the question needs (overflow) answers
//! conservatively: every conflict and CD assumed, `complete == false`.

use std::collections::HashMap;

use crate::actor::{Actor, Tracked, with_actor};
use crate::commit::COMMITS;
use crate::core::LockCore;
use crate::error::LogError;
use crate::event::{ActorId, Event, EventKind, LockId};
use crate::recovery_point::RecoveryPoint;

/// The restoration level of an actor with respect to one structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RestorationLevel {
    /// Dirty read: another actor consumed a value this actor wrote.
    pub dr: bool,
    /// Lost update: another actor overwrote a value this actor wrote.
    pub lu: bool,
    /// Unrepeatable read: another actor overwrote a value this actor read.
    pub ur: bool,
    /// Residual resources: this actor still holds the lock or pool items it
    /// acquired.
    pub rr: bool,
    /// Committed dependency: an actor in one of the conflicts above has
    /// since made its result externally visible.
    pub cd: bool,
    /// False when the logs overflowed and the flags are assumed, not seen.
    pub complete: bool,
}

impl RestorationLevel {
    /// Whether any actor interacted with this one (DR, LU or UR).
    pub fn interacted(&self) -> bool {
        self.dr || self.lu || self.ur
    }

    /// The level over several structures: a condition holds if it holds on
    /// any of them.
    pub fn merge(self, other: Self) -> Self {
        Self {
            dr: self.dr || other.dr,
            lu: self.lu || other.lu,
            ur: self.ur || other.ur,
            rr: self.rr || other.rr,
            cd: self.cd || other.cd,
            complete: self.complete && other.complete,
        }
    }
}

/// `getResourceOwnership(lock)`: what the actor holds of a structure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// The lock (or pool).
    pub lock: LockId,
    /// Whether the actor holds the lock itself right now.
    pub holds_lock: bool,
    /// Pool items the actor owns right now.
    pub items: Vec<usize>,
}

impl Ownership {
    /// Whether the actor holds anything of the structure.
    pub fn holds_anything(&self) -> bool {
        self.holds_lock || !self.items.is_empty()
    }
}

/// Compute the level from the logs for `actor`, considering events with
/// sequence numbers from `from` on; `commit_from` is the commit sequence
/// number the actor's tracking started at.
fn compute(
    actor: ActorId,
    window: Window,
    lock: &(impl Tracked + ?Sized),
) -> Result<RestorationLevel, LogError> {
    compute_on(actor, window, lock.core(), &lock.owned_items(actor))
}

/// The part of the logs a restoration level looks at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    /// First change-track sequence number.
    pub from: u64,
    /// Commit sequence number at the tracking start.
    pub commit_from: u64,
    /// Whether the actor wrote the structure in the window, when the
    /// caller knows; otherwise the actor's undo log from `undo_from` on
    /// says (used only when change-track entries were lost).
    pub wrote: Option<bool>,
    pub undo_from: usize,
}

/// [`compute`] on a lock's core.
pub(crate) fn compute_on(
    actor: ActorId,
    window: Window,
    core: &LockCore,
    owned: &[usize],
) -> Result<RestorationLevel, LogError> {
    let Window {
        from, commit_from, ..
    } = window;
    let mut level = RestorationLevel {
        complete: true,
        ..RestorationLevel::default()
    };
    let snap = core.snapshot(from);
    if snap.corrupt {
        return Err(LogError::Corrupt("change-track"));
    }
    if snap.lost {
        // Other actors' accesses may be missing: assume every conflict,
        // except that DR and LU need a write of this actor, which its own
        // undo log knows about.
        let wrote = window
            .wrote
            .unwrap_or_else(|| wrote_per_undo_log(window.undo_from, core));
        level.dr = wrote;
        level.lu = wrote;
        level.ur = true;
        level.cd = true;
        level.complete = false;
    }
    let scan = scan_conflicts(actor, &snap.events, &mut level);
    if !scan.witness.is_empty() && !level.cd {
        committed_dependency(&scan.witness, commit_from, &mut level)?;
    }
    // Residual: still owned now (the pool's ownership is the truth) and
    // acquired in the window (or possibly so, when entries were lost); or
    // the lock itself still held.
    level.rr = owned
        .iter()
        .any(|i| snap.lost || scan.acquired.contains(&(*i as u64)))
        || crate::actor::holds(core, actor);
    Ok(level)
}

/// Whether the calling actor's undo log, from `undo_from` on, holds a write
/// of `core`'s structure (true if the undo log overflowed, or the thread
/// state cannot be read: a write is then assumed).
fn wrote_per_undo_log(undo_from: usize, core: &LockCore) -> bool {
    with_actor(|s| {
        s.undo_overflow
            || s.undo[undo_from.min(s.undo.len())..]
                .iter()
                .any(|u| u.lock == core.id())
    })
    .unwrap_or(true)
}

/// What [`scan_conflicts`] saw besides the flags.
struct ConflictScan {
    /// Earliest witness of a conflict per other actor, as the commit count
    /// of its thread at the time (for CD).
    witness: HashMap<ActorId, u32>,
    /// Items this actor acquired in the window.
    acquired: Vec<u64>,
}

/// The DR, LU and UR patterns over the change-track `events` (in sequence
/// order): set the flags in `level`, and note the conflicting actors and
/// the items `actor` acquired.
fn scan_conflicts(actor: ActorId, events: &[Event], level: &mut RestorationLevel) -> ConflictScan {
    let mut witness: HashMap<ActorId, u32> = HashMap::new();
    let mut acquired: Vec<u64> = Vec::new();
    let (mut first_r, mut first_w) = (u64::MAX, u64::MAX);
    for e in events {
        if e.actor == actor {
            match e.kind {
                EventKind::Read => first_r = first_r.min(e.seq),
                EventKind::Write => {
                    first_r = first_r.min(e.seq);
                    first_w = first_w.min(e.seq);
                }
                EventKind::Acquire => acquired.push(e.item),
                EventKind::Release | EventKind::Commit => {}
            }
            continue;
        }
        let reads = matches!(e.kind, EventKind::Read | EventKind::Write);
        let writes = e.kind == EventKind::Write;
        let mut conflict = false;
        if reads && e.seq > first_w {
            level.dr = true;
            conflict = true;
        }
        if writes && e.seq > first_w {
            level.lu = true;
            conflict = true;
        }
        if writes && e.seq > first_r {
            level.ur = true;
            conflict = true;
        }
        if conflict {
            witness.entry(e.actor).or_insert(e.commits);
        }
    }
    ConflictScan { witness, acquired }
}

/// CD from the commit log: whether an actor of a conflict (`witness`)
/// committed after it; assumed, and `complete` cleared, when the log has
/// dropped commits from `commit_from` on.
fn committed_dependency(
    witness: &HashMap<ActorId, u32>,
    commit_from: u64,
    level: &mut RestorationLevel,
) -> Result<(), LogError> {
    let commits = COMMITS.lock();
    if commits.entries.iter().any(|c| !c.is_intact()) {
        return Err(LogError::Corrupt("commit"));
    }
    if commits.dropped_through >= commit_from {
        level.cd = true;
        level.complete = false;
    } else {
        level.cd = commits.entries.iter().any(|c| {
            witness
                .get(&c.actor)
                .is_some_and(|at| c.commits.wrapping_sub(*at) as i32 > 0)
        });
    }
    Ok(())
}

impl Actor {
    /// `getRestorationLevel(lock)`: the restoration level of this actor
    /// for the structure `lock` protects, since it started tracking it.
    /// Call it before `stop_tracking`.
    pub fn restoration_level(
        &self,
        lock: &(impl Tracked + ?Sized),
    ) -> Result<RestorationLevel, LogError> {
        let t = self.tracking_start(lock.core().id())?;
        let window = Window {
            from: t.start,
            commit_from: t.commit_start,
            wrote: None,
            undo_from: 0,
        };
        compute(self.id(), window, lock)
    }

    /// The restoration level counting only events after `point` (and after
    /// tracking started).
    pub fn restoration_level_since(
        &self,
        lock: &(impl Tracked + ?Sized),
        point: &RecoveryPoint,
    ) -> Result<RestorationLevel, LogError> {
        let t = self.tracking_start(lock.core().id())?;
        let from = t.start.max(point.mark(lock.core().id()));
        let window = Window {
            from,
            commit_from: t.commit_start,
            wrote: None,
            undo_from: self.undo_mark(point)?,
        };
        compute(self.id(), window, lock)
    }

    /// `getResourceOwnership(lock)`: whether this actor holds the lock and
    /// which pool items it owns.
    pub fn resource_ownership(&self, lock: &(impl Tracked + ?Sized)) -> Ownership {
        let core = lock.core();
        Ownership {
            lock: core.id(),
            holds_lock: crate::actor::holds(core, self.id()),
            items: lock.owned_items(self.id()),
        }
    }
}
