//! Misuse, overflow and corruption: each gets a clear error or a
//! conservative answer, and nothing is restored from a log that cannot be
//! trusted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;

use loglock::limits::{
    CHANGE_LOG_ENTRIES_MAX, RECOVERY_POINTS_MAX, TRACKED_PER_ACTOR_MAX, UNDO_LOG_ENTRIES_MAX,
};
use loglock::{
    Actor, LogError, PoolError, RecoveryCriterion, Tracked, TrackedMutex, TrackedPool,
    TrackedRwLock,
};

static NEXT_ID: AtomicU64 = AtomicU64::new(2_000_000);

fn fresh_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn tracking_misuse_is_refused_by_name() {
    let m = TrackedMutex::new("m", 0u8);
    let a = Actor::begin(fresh_id());
    assert_eq!(
        a.stop_tracking(&m),
        Err(LogError::NotTracking(m.core().id()))
    );
    assert_eq!(
        a.restoration_level(&m),
        Err(LogError::NotTracking(m.core().id()))
    );
    a.start_tracking(&m).unwrap();
    assert_eq!(
        a.start_tracking(&m),
        Err(LogError::AlreadyTracking(m.core().id()))
    );
    let locks: Vec<_> = (0..TRACKED_PER_ACTOR_MAX)
        .map(|_| TrackedMutex::new("x", 0u8))
        .collect();
    for l in &locks[..TRACKED_PER_ACTOR_MAX - 1] {
        a.start_tracking(l).unwrap();
    }
    assert_eq!(
        a.start_tracking(locks.last().unwrap()),
        Err(LogError::TooManyTracked(TRACKED_PER_ACTOR_MAX))
    );
    let msg = LogError::NotTracking(m.core().id()).to_string();
    assert!(msg.contains("not tracked"), "{msg}");
}

#[test]
fn a_suspended_actor_cannot_act_while_another_is_current() {
    let m = TrackedMutex::new("m", 0u8);
    let outer = Actor::begin(fresh_id());
    let inner = Actor::begin(fresh_id());
    assert_eq!(
        outer.start_tracking(&m),
        Err(LogError::NotCurrent(outer.id()))
    );
    inner.start_tracking(&m).unwrap();
    drop(inner);
    assert!(
        !m.core().is_tracked(),
        "the inner actor's end stopped its tracking"
    );
    outer.start_tracking(&m).unwrap();
    assert!(m.core().is_tracked());
}

#[test]
fn recovery_point_misuse_is_refused() {
    let a = Actor::begin(fresh_id());
    let b = Actor::begin(fresh_id());
    let p = b.recovery_point(RecoveryCriterion::DONT_CARE).unwrap();
    b.leave(p.clone()).unwrap();
    assert_eq!(
        b.rollback(&p),
        Err(LogError::UnknownRecoveryPoint(p.index()))
    );
    assert_eq!(
        b.leave(p.clone()),
        Err(LogError::UnknownRecoveryPoint(p.index()))
    );
    for _ in 0..RECOVERY_POINTS_MAX {
        b.recovery_point(RecoveryCriterion::DONT_CARE).unwrap();
    }
    assert_eq!(
        b.recovery_point(RecoveryCriterion::DONT_CARE),
        Err(LogError::TooManyRecoveryPoints(RECOVERY_POINTS_MAX))
    );
    drop(b);
    drop(a);
}

#[test]
fn pool_misuse_is_refused_and_loses_no_item() {
    let pool = TrackedPool::new("buffers", 2);
    let id = pool.core().id();
    let a = pool.acquire().unwrap();
    let b = pool.acquire().unwrap();
    assert_eq!(pool.acquire(), Err(PoolError::Exhausted(id)));
    assert_eq!(
        pool.release(7),
        Err(PoolError::UnknownItem { pool: id, item: 7 })
    );
    let p = pool.clone();
    let other = thread::spawn(move || p.release(a)).join().unwrap();
    assert_eq!(
        other,
        Err(PoolError::NotOwner { pool: id, item: a }),
        "another thread cannot release my item"
    );
    assert_eq!(pool.available(), 0);
    pool.release(a).unwrap();
    assert_eq!(
        pool.release(a),
        Err(PoolError::NotOwner { pool: id, item: a }),
        "double release"
    );
    assert_eq!(pool.release_all_owned(), vec![b]);
    assert_eq!(pool.available(), 2);
}

#[test]
fn an_overflowed_change_log_reports_every_conflict_and_incomplete() {
    let m = TrackedMutex::new("hot", 0u64);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    // Another thread reads far more often than the log holds, all before
    // T1's write: no real conflict, but the log lost entries T1 needs.
    let m2 = m.clone();
    thread::spawn(move || {
        for _ in 0..CHANGE_LOG_ENTRIES_MAX + 10 {
            let _ = *m2.lock();
        }
    })
    .join()
    .unwrap();
    *m.lock() += 1;
    let l = a.restoration_level(&m).unwrap();
    assert!(!l.complete);
    assert!(l.dr && l.lu && l.ur && l.cd, "conservative: {l:?}");
    assert_eq!(m.core().log_len(), CHANGE_LOG_ENTRIES_MAX);
    a.stop_tracking(&m).unwrap();
    assert_eq!(m.core().log_len(), 0, "purged at the last stop");
}

#[test]
fn an_overflowed_undo_log_refuses_rollback_and_changes_nothing() {
    let m = TrackedMutex::new("m", 0u64);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    let p = a
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    // One old value is saved per lock per recovery point: nest a point
    // around each modification.
    for _ in 0..UNDO_LOG_ENTRIES_MAX + 1 {
        let inner = a.recovery_point(RecoveryCriterion::DONT_CARE).unwrap();
        *m.lock() += 1;
        a.leave(inner).unwrap();
    }
    assert_eq!(a.undo_len(), UNDO_LOG_ENTRIES_MAX);
    assert_eq!(
        a.rollback(&p),
        Err(LogError::UndoOverflow(UNDO_LOG_ENTRIES_MAX))
    );
    assert_eq!(*m.lock(), UNDO_LOG_ENTRIES_MAX as u64 + 1);
}

#[test]
fn a_rollback_after_the_change_log_wrapped_is_refused_as_possibly_interfered() {
    let m = TrackedMutex::new("m", 0u64);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    let p = a
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    for _ in 0..CHANGE_LOG_ENTRIES_MAX + 1 {
        *m.lock() += 1;
    }
    assert_eq!(a.undo_len(), 1, "one old value per lock per recovery point");
    let level = a.restoration_level_since(&m, &p).unwrap();
    assert!(!level.complete && level.dr && level.lu, "{level:?}");
    assert!(matches!(a.rollback(&p), Err(LogError::Interfered { .. })));
    assert_eq!(*m.lock(), CHANGE_LOG_ENTRIES_MAX as u64 + 1);
}

#[test]
fn a_corrupt_change_log_entry_is_detected() {
    let m = TrackedMutex::new("m", 0u64);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    *m.lock() += 1;
    m.core().corrupt_newest_entry();
    assert_eq!(
        a.restoration_level(&m),
        Err(LogError::Corrupt("change-track"))
    );
}

#[test]
fn a_corrupt_undo_entry_restores_nothing() {
    let m = TrackedMutex::new("m", 5u64);
    let r = TrackedRwLock::new("r", 50u64);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    a.start_tracking(&r).unwrap();
    let p = a
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    *m.lock() = 6;
    *r.write() = 60;
    a.corrupt_newest_undo();
    assert_eq!(a.rollback(&p), Err(LogError::Corrupt("undo")));
    assert_eq!((*m.lock(), *r.read()), (6, 60), "neither value restored");
}

#[test]
fn rollback_restores_the_value_at_the_recovery_point_across_locks() {
    let m = TrackedMutex::new("m", 1u64);
    let r = TrackedRwLock::new("r", vec![1u8, 2]);
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    a.start_tracking(&r).unwrap();
    *m.lock() = 2; // before the point: stays
    let p = a
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    *m.lock() = 3;
    *m.lock() = 4;
    r.write().push(3);
    r.write().push(4);
    assert_eq!(a.undo_len(), 3, "one old value per lock per recovery point");
    assert_eq!(a.rollback(&p), Ok(2), "two structures restored");
    assert_eq!(*m.lock(), 2);
    assert_eq!(*r.read(), vec![1, 2]);
    assert_eq!(a.undo_len(), 1, "the entry before the point stays");
}

#[test]
fn untracked_locks_record_nothing_and_reads_under_rwlock_are_not_conflicts() {
    let r = TrackedRwLock::new("r", 0u32);
    {
        let _ = *r.read();
        *r.write() += 1;
    }
    assert_eq!(r.core().log_len(), 0, "untracked: no log");
    let a = Actor::begin(fresh_id());
    a.start_tracking(&r).unwrap();
    let _ = *r.read();
    let r2 = r.clone();
    thread::spawn(move || {
        let _ = *r2.read();
    })
    .join()
    .unwrap();
    let l = a.restoration_level(&r).unwrap();
    assert!(
        !l.dr && !l.lu && !l.ur,
        "R then R conflicts with nothing: {l:?}"
    );
    let r3 = r.clone();
    thread::spawn(move || *r3.write() += 1).join().unwrap();
    assert!(
        a.restoration_level(&r).unwrap().ur,
        "R then another's W is UR"
    );
}

#[test]
fn change_track_entries_are_kept_for_the_remaining_tracker_and_purged_after_the_last() {
    let m = TrackedMutex::new("m", 0u64);
    let (go, done) = (
        std::sync::mpsc::channel::<()>(),
        std::sync::mpsc::channel::<()>(),
    );
    let m2 = m.clone();
    let t = thread::spawn(move || {
        let b = Actor::begin(fresh_id());
        b.start_tracking(&m2).unwrap();
        *m2.lock() += 1;
        go.0.send(()).unwrap();
        done.1.recv().unwrap();
        let l = b.restoration_level(&m2).unwrap();
        b.stop_tracking(&m2).unwrap();
        l
    });
    go.1.recv().unwrap();
    let a = Actor::begin(fresh_id());
    a.start_tracking(&m).unwrap();
    *m.lock() += 1;
    a.stop_tracking(&m).unwrap();
    assert!(
        m.core().log_len() >= 2,
        "marked, not purged: the other tracker needs them"
    );
    done.0.send(()).unwrap();
    let l = t.join().unwrap();
    assert!(l.lu, "the other tracker still saw the overwrite");
    assert_eq!(m.core().log_len(), 0, "purged at the last stop");
    assert!(!m.core().is_tracked());
}
