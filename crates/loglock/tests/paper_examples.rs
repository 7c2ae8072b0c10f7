//! The paper's three failure scenarios (§1, Figures 1 to 3; handler of
//! Figure 5), run with real concurrent threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use loglock::{
    Actor, LogError, RecoveryCriterion, Requirement, ResourceAction, Strategy, Tracked,
    TrackedMutex, TrackedPool,
};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Actor ids unique across the tests of this binary (they share the
/// process-wide commit log).
fn fresh_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Figure 5's recovery handler for numActiveUsers: release the lock if held
/// (it never is here: guards drop on the failure path), then undo when no
/// one consumed the increment, else compensate with a matching decrement.
/// Returns whether it compensated.
fn num_active_users_handler(
    actor: &Actor,
    users: &TrackedMutex<u64>,
    r1: &loglock::RecoveryPoint,
) -> bool {
    let ownership = actor.resource_ownership(users);
    assert!(
        !ownership.holds_lock,
        "the guard was dropped before the handler"
    );
    let decision = actor.decide(r1, &[users]).unwrap();
    if decision.level.dr || decision.level.lu {
        assert!(!decision.single_actor_rollback());
        assert!(decision.strategies.contains(&Strategy::ErrorCompensation));
        *users.lock() -= 1;
        return true;
    }
    match actor.rollback(r1) {
        Ok(_) => false,
        // Someone consumed the value between the decision and the undo.
        Err(LogError::Interfered { .. }) => {
            *users.lock() -= 1;
            true
        }
        Err(e) => panic!("rollback failed: {e}"),
    }
}

const DR_LU_FORBIDDEN: RecoveryCriterion = RecoveryCriterion {
    dr: Requirement::Forbidden,
    lu: Requirement::Forbidden,
    ur: Requirement::DontCare,
    rr: Requirement::Forbidden,
};

#[test]
fn num_active_users_is_undone_when_no_other_actor_touched_it() {
    let users = TrackedMutex::new("numActiveUsers", 41u64);
    let actor = Actor::begin(fresh_id());
    actor.start_tracking(&users).unwrap();
    let r1 = actor.recovery_point(DR_LU_FORBIDDEN).unwrap();
    *users.lock() += 1;
    // failure: the handler runs
    let level = actor.restoration_level_since(&users, &r1).unwrap();
    assert!(!level.dr && !level.lu && !level.ur && !level.rr && !level.cd && level.complete);
    assert!(
        !num_active_users_handler(&actor, &users, &r1),
        "undo, not compensation"
    );
    assert_eq!(*users.lock(), 41, "the undo log restored the old value");
}

#[test]
fn num_active_users_is_compensated_when_another_thread_incremented_after() {
    let users = TrackedMutex::new("numActiveUsers", 10u64);
    let (wrote, other_done) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let t2 = {
        let (users, wrote, other_done) =
            (users.clone(), Arc::clone(&wrote), Arc::clone(&other_done));
        thread::spawn(move || {
            wrote.wait();
            *users.lock() += 1; // T2 logs in after T1's increment
            other_done.wait();
        })
    };
    let actor = Actor::begin(fresh_id());
    actor.start_tracking(&users).unwrap();
    let r1 = actor.recovery_point(DR_LU_FORBIDDEN).unwrap();
    *users.lock() += 1;
    wrote.wait();
    other_done.wait();
    t2.join().unwrap();
    let level = actor.restoration_level_since(&users, &r1).unwrap();
    assert!(
        level.dr && level.lu,
        "T1W -> T2W (a read-modify-write): {level:?}"
    );
    assert!(!level.cd, "T2 made nothing externally visible");
    // The naive undo would erase T2's login: the library refuses it.
    assert!(matches!(
        actor.rollback(&r1),
        Err(LogError::Interfered { .. })
    ));
    assert_eq!(*users.lock(), 12, "nothing was restored");
    *users.lock() -= 1; // the matching decrement
    assert_eq!(*users.lock(), 11, "T2's login survives, T1's is withdrawn");
}

#[test]
fn num_active_users_stays_exact_under_concurrent_failing_actors() {
    let users = TrackedMutex::new("numActiveUsers", 0u64);
    let threads = 4;
    let iterations = 3000;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let users = users.clone();
            thread::spawn(move || {
                let (mut logged_in, mut compensated, mut undone) = (0u64, 0u64, 0u64);
                let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                for _ in 0..iterations {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let actor = Actor::begin(fresh_id());
                    actor.start_tracking(&users).unwrap();
                    let r1 = actor.recovery_point(DR_LU_FORBIDDEN).unwrap();
                    let fail_before = rng.is_multiple_of(7);
                    let fail_after = rng.is_multiple_of(3);
                    if !fail_before {
                        *users.lock() += 1;
                        for _ in 0..(rng % 64) {
                            std::hint::spin_loop(); // rest of the login path
                        }
                    }
                    if fail_before || fail_after {
                        if num_active_users_handler(&actor, &users, &r1) {
                            compensated += 1;
                        } else {
                            undone += 1;
                        }
                    } else {
                        logged_in += 1;
                        actor.commit();
                    }
                    actor.stop_tracking(&users).unwrap();
                }
                (logged_in, compensated, undone)
            })
        })
        .collect();
    let (mut logged_in, mut compensated, mut undone) = (0, 0, 0);
    for h in handles {
        let (l, c, u) = h.join().unwrap();
        logged_in += l;
        compensated += c;
        undone += u;
    }
    assert_eq!(
        *users.lock(),
        logged_in,
        "every failed login withdrawn exactly once"
    );
    assert!(undone > 0, "some failures were undone alone");
    eprintln!("logged in {logged_in}, undone {undone}, compensated {compensated}");
    assert_eq!(users.core().log_len(), 0, "the change-track log was purged");
}

/// Figure 2: a write command takes a temporary buffer from a pool after
/// recovery point R3; on failure the resource recovery protocol releases it.
fn write_command(pool: &TrackedPool, fail: bool) -> Result<(), Vec<ResourceAction>> {
    let actor = Actor::begin(fresh_id());
    actor.start_tracking(pool).unwrap();
    let r3 = actor
        .recovery_point(RecoveryCriterion::RELEASE_RESOURCES)
        .unwrap();
    let temp = loop {
        match pool.acquire() {
            Ok(i) => break i,
            Err(_) => thread::yield_now(),
        }
    };
    if fail {
        let decision = actor.decide(&r3, &[pool]).unwrap();
        assert!(decision.level.rr, "the temporary resource is residual");
        let actions = decision.resource_actions.clone();
        for a in &actions {
            match a {
                ResourceAction::ReleaseItems { pool: id, items } => {
                    assert_eq!(*id, pool.core().id());
                    assert_eq!(items, &vec![temp]);
                    for &i in items {
                        pool.release(i).unwrap();
                    }
                }
                other => panic!("unexpected action {other:?}"),
            }
        }
        let after = actor.decide(&r3, &[pool]).unwrap();
        assert!(
            after.criterion_met(),
            "after the RRP actions the criterion holds: {after:?}"
        );
        return Err(actions);
    }
    pool.release(temp).unwrap();
    actor.stop_tracking(pool).unwrap();
    Ok(())
}

#[test]
fn the_write_commands_temporary_resource_is_released_on_rollback_and_never_leaks() {
    let pool = TrackedPool::new("temp buffers", 8);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut failures = 0;
                for i in 0..2000u32 {
                    if write_command(&pool, (i + t) % 3 == 0).is_err() {
                        failures += 1;
                    }
                }
                failures
            })
        })
        .collect();
    let failures: u32 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(failures > 2000);
    assert_eq!(pool.available(), 8, "no buffer leaked");
    assert!((0..8).all(|i| pool.owner(i).is_none()));
}

#[test]
fn a_held_lock_is_a_residual_resource_until_released() {
    let location = TrackedMutex::new("MetadataLocation", 7u32);
    let actor = Actor::begin(fresh_id());
    actor.start_tracking(&location).unwrap();
    let r4 = actor
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    let mut g = location.lock();
    *g = 8;
    // The failure is detected inside the critical section.
    let decision = actor.decide(&r4, &[&location]).unwrap();
    assert!(decision.level.rr);
    assert_eq!(
        decision.resource_actions,
        vec![ResourceAction::ReleaseLock(location.core().id())]
    );
    drop(g);
    let decision = actor.decide(&r4, &[&location]).unwrap();
    assert!(decision.criterion_met());
    assert_eq!(actor.rollback(&r4), Ok(1));
    assert_eq!(*location.lock(), 7);
}

/// Figure 3: T1 moves the metadata to a new location and fails; T2 may have
/// read the new location meanwhile, and may have made it externally visible.
fn metadata_location(t2_reads: bool, t2_commits: bool) -> (loglock::Decision, u32) {
    let location = TrackedMutex::new("MetadataLocation", 100u32);
    let (moved, t2_done) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let t2 = {
        let (location, moved, t2_done) =
            (location.clone(), Arc::clone(&moved), Arc::clone(&t2_done));
        thread::spawn(move || {
            let t2 = Actor::begin(fresh_id());
            moved.wait();
            if t2_reads {
                let at = *location.lock();
                assert_eq!(at, 200, "T2 sees T1's dirty location");
                if t2_commits {
                    t2.commit(); // e.g. replies to a host with data found there
                }
            }
            t2_done.wait();
        })
    };
    let t1 = Actor::begin(fresh_id());
    t1.start_tracking(&location).unwrap();
    let r4 = t1
        .recovery_point(RecoveryCriterion::ISOLATED_ROLLBACK)
        .unwrap();
    *location.lock() = 200;
    moved.wait();
    t2_done.wait();
    t2.join().unwrap();
    let decision = t1.decide(&r4, &[&location]).unwrap();
    if decision.single_actor_rollback() {
        t1.rollback(&r4).unwrap();
    }
    let now = *location.lock();
    (decision, now)
}

#[test]
fn metadata_location_is_undone_when_nobody_read_it() {
    let (d, now) = metadata_location(false, false);
    assert!(d.criterion_met());
    assert_eq!(d.strategies[0], Strategy::SingleActorRollback);
    assert_eq!(now, 100, "the undo log put the old location back");
}

#[test]
fn metadata_location_read_by_another_actor_needs_multi_actor_rollback_srp_rule_3() {
    let (d, now) = metadata_location(true, false);
    assert!(d.level.dr && !d.level.cd);
    assert_eq!(
        d.strategies,
        vec![
            Strategy::MultiActorRollback,
            Strategy::ErrorCompensation,
            Strategy::SystemLevel
        ]
    );
    assert_eq!(now, 200, "nothing undone");
}

#[test]
fn metadata_location_read_and_committed_allows_only_compensation_srp_rule_2() {
    let (d, now) = metadata_location(true, true);
    assert!(d.level.dr && d.level.cd);
    assert_eq!(
        d.strategies,
        vec![Strategy::ErrorCompensation, Strategy::SystemLevel]
    );
    assert_eq!(now, 200);
}
