//! Task-level recovery (recovery points, clean-up blocks, strategies) and
//! escalation to group and system recovery, with reactive scheduling.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use common::{spin_for, wait_until};
use proptest::prelude::*;
use rcs::{
    Failure, FailureClass, GroupSpec, Outcome, Policy, Priority, RecoveryOutcome, RecoveryPoint,
    RecoveryScope, RetryPolicy, Runtime, Strategy, SystemCause, SystemFailure, TaskCtx,
};

const LONG: Duration = Duration::from_secs(20);

type Log = Arc<Mutex<Vec<String>>>;

fn log_push(log: &Log, s: impl Into<String>) {
    log.lock().unwrap().push(s.into());
}

/// Run `body` as one task on a fresh single-worker runtime and return what
/// it sent back plus the runtime's metrics and events.
fn run_one<T: Send + 'static>(
    spec: GroupSpec,
    body: impl FnOnce(&mut TaskCtx<'_>, mpsc::Sender<T>) -> Result<(), Failure> + Send + 'static,
) -> (
    Vec<T>,
    rcs::MetricsSnapshot,
    Vec<rcs::RecoveryEvent>,
    Vec<SystemFailure>,
) {
    let system: Arc<Mutex<Vec<SystemFailure>>> = Arc::default();
    let mut b = Runtime::builder();
    let sys = Arc::clone(&system);
    b.workers(1)
        .system_recovery(move |f| sys.lock().unwrap().push(f.clone()));
    let g = b.group(spec);
    let rt = b.build().unwrap();
    let h = rt.handle();
    let (tx, rx) = mpsc::channel();
    h.submit(g, Priority::High, move |ctx| body(ctx, tx))
        .unwrap();
    assert!(h.wait_idle(LONG));
    let metrics = h.metrics();
    let events = h.recent_events();
    drop(rt);
    let sent = rx.try_iter().collect();
    let system = system.lock().unwrap().clone();
    (sent, metrics, events, system)
}

const ESCALATE: RecoveryPoint = RecoveryPoint::new("escalate", Strategy::Escalate);

#[test]
fn cleanups_run_newest_first_exactly_once_on_failure() {
    let log: Log = Arc::default();
    let l = Arc::clone(&log);
    let (_, m, events, _) = run_one::<()>(GroupSpec::new("g"), move |ctx, _| {
        let r = ctx.recovery_point(&ESCALATE, |ctx| {
            for i in 1..=3 {
                let l = Arc::clone(&l);
                ctx.cleanup("step", move || log_push(&l, format!("undo {i}")));
            }
            Err::<(), _>(Failure::state("unsolicited completion"))
        });
        assert_eq!(r.unwrap_err().class(), FailureClass::State);
        Ok(())
    });
    assert_eq!(*log.lock().unwrap(), ["undo 3", "undo 2", "undo 1"]);
    assert_eq!(m.groups[0].completed, 1, "the task itself handled the Err");
    assert!(events.is_empty());
}

#[test]
fn cleanups_never_run_on_success() {
    let ran = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&ran);
    let (sent, _, _, _) = run_one(GroupSpec::new("g"), move |ctx, tx| {
        let out = ctx.recovery_point(&ESCALATE, |ctx| {
            let r = Arc::clone(&r);
            ctx.cleanup("never", move || {
                r.fetch_add(1, Ordering::SeqCst);
            });
            Ok(7)
        })?;
        tx.send(out).unwrap();
        // A top-level clean-up is dropped unrun when the task succeeds.
        let r = Arc::clone(&r);
        ctx.cleanup("top", move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        Ok(())
    });
    assert_eq!(sent, [Outcome::Done(7)]);
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

#[test]
fn a_panic_inside_a_recovery_point_is_a_failure_and_runs_cleanups() {
    let log: Log = Arc::default();
    let l = Arc::clone(&log);
    let (sent, _, _, _) = run_one(GroupSpec::new("g"), move |ctx, tx| {
        let l2 = Arc::clone(&l);
        let r = ctx.recovery_point(&ESCALATE, move |ctx| -> Result<(), Failure> {
            let l3 = Arc::clone(&l2);
            ctx.cleanup("undo", move || log_push(&l3, "undo"));
            panic!("control block exhausted");
        });
        tx.send(r.unwrap_err()).unwrap();
        Ok(())
    });
    assert_eq!(sent[0].class(), FailureClass::Panic);
    assert_eq!(sent[0].message(), "control block exhausted");
    assert_eq!(*log.lock().unwrap(), ["undo"]);
}

#[test]
fn retry_is_bounded_then_escalates() {
    static RETRY3: RecoveryPoint = RecoveryPoint::new(
        "retry3",
        Strategy::Retry(RetryPolicy::new(3, Duration::from_micros(1))),
    );
    let attempts = Arc::new(AtomicU64::new(0));
    let cleanups = Arc::new(AtomicU64::new(0));
    let (a, c) = (Arc::clone(&attempts), Arc::clone(&cleanups));
    let (_, m, events, _) = run_one::<()>(GroupSpec::new("g"), move |ctx, _| {
        let _ = ctx.recovery_point(&RETRY3, |ctx| -> Result<(), Failure> {
            a.fetch_add(1, Ordering::SeqCst);
            let c = Arc::clone(&c);
            ctx.cleanup("undo", move || {
                c.fetch_add(1, Ordering::SeqCst);
            });
            Err(Failure::internal_logic("queue full"))
        })?;
        Ok(())
    });
    assert_eq!(
        attempts.load(Ordering::SeqCst),
        4,
        "first run plus 3 retries"
    );
    assert_eq!(
        cleanups.load(Ordering::SeqCst),
        4,
        "one clean-up per failed run"
    );
    assert_eq!(m.groups[0].retried, 3);
    assert_eq!(m.groups[0].failed, 1);
    // Exhausted retries escalate past the task: group recovery.
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].scope, RecoveryScope::Group(m.groups[0].id));
    assert_eq!(events[0].outcome, RecoveryOutcome::Recovered);
}

#[test]
fn retry_stops_as_soon_as_the_body_succeeds() {
    static RETRY5: RecoveryPoint = RecoveryPoint::new(
        "retry5",
        Strategy::Retry(RetryPolicy::new(5, Duration::from_micros(1))),
    );
    let attempts = Arc::new(AtomicU64::new(0));
    let a = Arc::clone(&attempts);
    let (sent, m, events, _) = run_one(GroupSpec::new("g"), move |ctx, tx| {
        let out = ctx.recovery_point(&RETRY5, |_| {
            if a.fetch_add(1, Ordering::SeqCst) < 2 {
                Err(Failure::internal_logic("transient"))
            } else {
                Ok("done")
            }
        })?;
        tx.send(out).unwrap();
        Ok(())
    });
    assert_eq!(sent, [Outcome::Done("done")]);
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
    assert_eq!(m.groups[0].retried, 2);
    assert!(events.is_empty());
}

#[test]
fn strategies_follow_the_failure_class() {
    static POINT: RecoveryPoint = RecoveryPoint::new("mixed", Strategy::Escalate)
        .on(FailureClass::Range, Strategy::Ignore)
        .on(FailureClass::Domain, Strategy::Abort);
    let (sent, m, events, system) = run_one(GroupSpec::new("g"), move |ctx, tx| {
        let ignored = ctx.recovery_point(&POINT, |_| Err::<(), _>(Failure::range("overflow")))?;
        tx.send(format!("{ignored:?}")).unwrap();
        let _ = ctx.recovery_point(&POINT, |_| Err::<(), _>(Failure::domain("divide by zero")))?;
        tx.send("not reached".to_owned()).unwrap();
        Ok(())
    });
    assert_eq!(sent.len(), 1);
    assert!(sent[0].starts_with("Ignored"), "{sent:?}");
    assert_eq!(m.groups[0].ignored, 1);
    assert_eq!(
        m.groups[0].aborted, 1,
        "abort ends the task without recovery"
    );
    assert!(events.is_empty());
    assert!(system.is_empty());
}

#[test]
fn nested_recovery_points_escalate_outward_running_each_frames_cleanups() {
    static OUTER: RecoveryPoint = RecoveryPoint::new("outer", Strategy::Ignore);
    let log: Log = Arc::default();
    let l = Arc::clone(&log);
    let (sent, _, events, _) = run_one(GroupSpec::new("g"), move |ctx, tx| {
        let outer = ctx.recovery_point(&OUTER, |ctx| {
            let l1 = Arc::clone(&l);
            ctx.cleanup("outer", move || log_push(&l1, "outer"));
            let l2 = Arc::clone(&l);
            let _ = ctx.recovery_point(&ESCALATE, move |ctx| -> Result<(), Failure> {
                let l3 = Arc::clone(&l2);
                ctx.cleanup("inner", move || log_push(&l3, "inner"));
                Err(Failure::state("bad state"))
            })?;
            Ok(())
        })?;
        tx.send(outer.is_done()).unwrap();
        Ok(())
    });
    assert_eq!(*log.lock().unwrap(), ["inner", "outer"]);
    assert_eq!(
        sent,
        [false],
        "the outer point ignored the escalated failure"
    );
    assert!(events.is_empty());
}

#[test]
fn an_abort_passes_through_every_enclosing_point_running_all_cleanups() {
    static OUTER_RETRY: RecoveryPoint = RecoveryPoint::new(
        "outer",
        Strategy::Retry(RetryPolicy::new(5, Duration::from_micros(1))),
    );
    static ABORT: RecoveryPoint = RecoveryPoint::new("abort", Strategy::Abort);
    let log: Log = Arc::default();
    let l = Arc::clone(&log);
    let (_, m, events, _) = run_one::<()>(GroupSpec::new("g"), move |ctx, _| {
        let l0 = Arc::clone(&l);
        ctx.cleanup("top", move || log_push(&l0, "top"));
        let _ = ctx.recovery_point(&OUTER_RETRY, |ctx| {
            let l1 = Arc::clone(&l);
            ctx.cleanup("outer", move || log_push(&l1, "outer"));
            let _ = ctx.recovery_point(&ABORT, |_| Err::<(), _>(Failure::domain("bad request")))?;
            Ok(())
        })?;
        Ok(())
    });
    assert_eq!(
        *log.lock().unwrap(),
        ["outer", "top"],
        "no retry of an abort"
    );
    assert_eq!(m.groups[0].aborted, 1);
    assert_eq!(m.groups[0].retried, 0);
    assert!(events.is_empty());
}

#[test]
fn a_failure_at_the_top_of_a_task_starts_group_recovery_and_runs_the_handler() {
    let handled = Arc::new(Mutex::new(None));
    let h2 = Arc::clone(&handled);
    let spec = GroupSpec::new("cache").recovery_handler(move |r| {
        *h2.lock().unwrap() = Some((r.name.to_owned(), r.failure.class()));
        Ok(())
    });
    let (_, m, events, system) =
        run_one::<()>(spec, |_, _| Err(Failure::internal_logic("bad LRC")));
    assert_eq!(
        *handled.lock().unwrap(),
        Some(("cache".to_owned(), FailureClass::InternalLogic))
    );
    assert_eq!(m.groups[0].recoveries, 1);
    assert_eq!(m.groups[0].recovery_time.count, 1);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].cause.message(), "bad LRC");
    assert!(system.is_empty());
}

#[test]
fn a_failing_recovery_handler_escalates_to_system_level() {
    let spec = GroupSpec::new("cache").recovery_handler(|_| Err(Failure::state("cannot repair")));
    let (_, m, events, system) =
        run_one::<()>(spec, |_, _| Err(Failure::internal_logic("bad LRC")));
    assert_eq!(system.len(), 1);
    assert_eq!(system[0].cause, SystemCause::HandlerFailed);
    assert_eq!(system[0].group, Some(m.groups[0].id));
    assert_eq!(system[0].failure.message(), "cannot repair");
    assert_eq!(m.system_escalations, 1);
    assert_eq!(
        events[0].outcome,
        RecoveryOutcome::Escalated(SystemCause::HandlerFailed)
    );
    assert_eq!(events[1].scope, RecoveryScope::System);
}

#[test]
fn a_panicking_recovery_handler_escalates_to_system_level() {
    let spec = GroupSpec::new("cache").recovery_handler(|_| panic!("handler bug"));
    let (_, _, _, system) = run_one::<()>(spec, |_, _| Err(Failure::internal_logic("bad LRC")));
    assert_eq!(system.len(), 1);
    assert_eq!(system[0].cause, SystemCause::HandlerFailed);
    assert_eq!(system[0].failure.class(), FailureClass::Panic);
}

#[test]
fn a_failing_cleanup_block_is_a_failure_during_recovery() {
    let after = Arc::new(AtomicBool::new(false));
    let a = Arc::clone(&after);
    let (_, _, events, system) = run_one::<()>(GroupSpec::new("g"), move |ctx, _| {
        let a = Arc::clone(&a);
        ctx.cleanup("older", move || a.store(true, Ordering::SeqCst));
        ctx.cleanup("broken", || panic!("double free"));
        Err(Failure::state("fail"))
    });
    assert!(
        after.load(Ordering::SeqCst),
        "blocks below a failing one still run"
    );
    assert_eq!(system.len(), 1);
    assert_eq!(system[0].cause, SystemCause::TaskEscalated);
    assert!(system[0].failure.message().contains("broken"));
    assert!(
        events.iter().all(|e| e.scope == RecoveryScope::System),
        "no group recovery: the failure went to system level"
    );
}

#[test]
fn strategy_system_goes_straight_to_system_level() {
    static SYSTEM: RecoveryPoint = RecoveryPoint::new("corrupt", Strategy::System);
    let (_, m, _, system) = run_one::<()>(GroupSpec::new("g"), |ctx, _| {
        let _ = ctx.recovery_point(&SYSTEM, |_| {
            Err::<(), _>(Failure::internal_logic("directory corrupt"))
        })?;
        Ok(())
    });
    assert_eq!(system.len(), 1);
    assert_eq!(system[0].cause, SystemCause::TaskEscalated);
    assert_eq!(m.groups[0].recoveries, 0);
}

/// What the recovery handler saw during its 60 ms.
#[derive(Debug, Clone, Copy)]
struct Window {
    running_at_start: u64,
    starts: (u64, u64),
    other_done: (u64, u64),
}

/// Reactive RCS: while a group recovers, none of its tasks starts, running
/// ones have drained before the handler runs, and other groups keep going.
/// With reactive scheduling off, the same scenario does start tasks of the
/// recovering group (so the fence is what the first half measures).
#[test]
fn recovering_group_never_dispatches() {
    for reactive in [true, false] {
        let Window {
            running_at_start: running,
            starts: (s0, s1),
            other_done: (o0, o1),
        } = recovery_window(reactive);
        if reactive {
            assert_eq!(running, 0, "running tasks drained before the handler");
            assert_eq!(s1, s0, "{} tasks of the recovering group started", s1 - s0);
        } else {
            assert!(
                s1 > s0,
                "without the fence tasks of the group keep starting"
            );
        }
        assert!(o1 > o0, "the other group kept running during the recovery");
    }
}

/// The scenario of [`recovering_group_never_dispatches`]: a feeder keeps
/// submitting short tasks to groups "a" and "other"; one task of "a" fails,
/// and "a"'s recovery handler records what started and finished during its
/// 60 ms.
fn recovery_window(reactive: bool) -> Window {
    let mut b = Runtime::builder();
    b.workers(2).policy(Policy::Dynamic).reactive(reactive);
    let starts = Arc::new(AtomicU64::new(0));
    let live = Arc::new(AtomicU64::new(0));
    let other_done = Arc::new(AtomicU64::new(0));
    let window: Arc<Mutex<Option<Window>>> = Arc::default();
    let (s, l, o, w) = (
        Arc::clone(&starts),
        Arc::clone(&live),
        Arc::clone(&other_done),
        Arc::clone(&window),
    );
    let a = b.group(GroupSpec::new("a").sigma(2).recovery_handler(move |_| {
        let running_at_start = l.load(Ordering::SeqCst);
        let (s0, o0) = (s.load(Ordering::SeqCst), o.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(60));
        let (s1, o1) = (s.load(Ordering::SeqCst), o.load(Ordering::SeqCst));
        *w.lock().unwrap() = Some(Window {
            running_at_start,
            starts: (s0, s1),
            other_done: (o0, o1),
        });
        Ok(())
    }));
    let other = b.group(GroupSpec::new("other").sigma(2));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let stop = Arc::new(AtomicBool::new(false));
    let feeder = {
        let (h, starts, live, other_done, stop) = (
            h.clone(),
            Arc::clone(&starts),
            Arc::clone(&live),
            Arc::clone(&other_done),
            Arc::clone(&stop),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let (s, l) = (Arc::clone(&starts), Arc::clone(&live));
                let _ = h.submit(a, Priority::Medium, move |_| {
                    s.fetch_add(1, Ordering::SeqCst);
                    l.fetch_add(1, Ordering::SeqCst);
                    spin_for(Duration::from_micros(30));
                    l.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                });
                let o = Arc::clone(&other_done);
                let _ = h.submit(other, Priority::Medium, move |_| {
                    spin_for(Duration::from_micros(30));
                    o.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                });
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(20));
    h.submit(a, Priority::High, |_| {
        Err(Failure::internal_logic("bad LRC"))
    })
    .unwrap();
    assert!(wait_until(LONG, || window.lock().unwrap().is_some()));
    stop.store(true, Ordering::SeqCst);
    feeder.join().unwrap();
    let seen = window.lock().unwrap().unwrap();
    drop(rt);
    seen
}

/// Running tasks of a recovering group are told (the cooperative check) and
/// unwind through their clean-ups; they are counted as cancelled.
#[test]
fn running_tasks_of_a_recovering_group_are_told_and_clean_up() {
    let mut b = Runtime::builder();
    b.workers(2).policy(Policy::Dynamic);
    let a = b.group(GroupSpec::new("a").sigma(2));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let cleaned = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicBool::new(false));
    let (c, s) = (Arc::clone(&cleaned), Arc::clone(&started));
    h.submit(a, Priority::High, move |ctx| {
        ctx.cleanup("release buffer", move || c.store(true, Ordering::SeqCst));
        s.store(true, Ordering::SeqCst);
        loop {
            ctx.check()?;
            std::thread::sleep(Duration::from_micros(100));
        }
    })
    .unwrap();
    assert!(wait_until(LONG, || started.load(Ordering::SeqCst)));
    h.submit(a, Priority::High, |_| Err(Failure::state("adapter reset")))
        .unwrap();
    assert!(h.wait_idle(LONG));
    assert!(cleaned.load(Ordering::SeqCst));
    let m = h.metrics();
    assert_eq!(m.groups[0].cancelled, 1);
    assert_eq!(m.groups[0].failed, 1);
    assert_eq!(m.groups[0].recoveries, 1);
    let events = h.recent_events();
    assert_eq!(events[0].tasks_running, 1);
}

#[test]
fn a_task_that_ignores_the_check_times_out_the_drain_and_escalates() {
    let system: Arc<Mutex<Vec<SystemFailure>>> = Arc::default();
    let sys = Arc::clone(&system);
    let mut b = Runtime::builder();
    b.workers(2)
        .drain_timeout(Duration::from_millis(20))
        .system_recovery(move |f| sys.lock().unwrap().push(f.clone()));
    let a = b.group(GroupSpec::new("a").sigma(2));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let started = Arc::new(AtomicBool::new(false));
    let s = Arc::clone(&started);
    h.submit(a, Priority::High, move |_| {
        s.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(150));
        Ok(())
    })
    .unwrap();
    assert!(wait_until(LONG, || started.load(Ordering::SeqCst)));
    h.submit(a, Priority::High, |_| Err(Failure::state("adapter reset")))
        .unwrap();
    assert!(h.wait_idle(LONG));
    let system = system.lock().unwrap();
    assert_eq!(system.len(), 1);
    assert_eq!(system[0].cause, SystemCause::DrainTimeout);
    drop(rt);
}

#[test]
fn a_second_failure_joins_the_recovery_in_progress() {
    let mut b = Runtime::builder();
    b.workers(2);
    let handler_runs = Arc::new(AtomicU64::new(0));
    let hr = Arc::clone(&handler_runs);
    let a = b.group(GroupSpec::new("a").sigma(2).recovery_handler(move |_| {
        hr.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        Ok(())
    }));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let barrier = Arc::new(std::sync::Barrier::new(2));
    for _ in 0..2 {
        let barrier = Arc::clone(&barrier);
        h.submit(a, Priority::High, move |_| {
            barrier.wait();
            Err(Failure::state("both fail"))
        })
        .unwrap();
    }
    assert!(h.wait_idle(LONG));
    assert_eq!(handler_runs.load(Ordering::SeqCst), 1);
    assert_eq!(h.metrics().groups[0].failed, 2);
    assert_eq!(h.metrics().groups[0].recoveries, 1);
    drop(rt);
}

#[test]
fn recover_group_from_outside_runs_the_handler_and_records_an_event() {
    let mut b = Runtime::builder();
    b.workers(1);
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    let a = b.group(GroupSpec::new("a").recovery_handler(move |info| {
        assert_eq!(info.tasks_running, 0);
        r.store(true, Ordering::SeqCst);
        Ok(())
    }));
    let rt = b.build().unwrap();
    let h = rt.handle();
    h.recover_group(a, Failure::internal_logic("monitor saw a stuck queue"))
        .unwrap();
    assert!(ran.load(Ordering::SeqCst));
    assert_eq!(h.recent_events().len(), 1);
    // A group id from another runtime's builder is unknown here.
    let mut other = Runtime::builder();
    let foreign = (0..10)
        .map(|i| other.group(GroupSpec::new(format!("x{i}"))))
        .last()
        .unwrap();
    assert_eq!(
        h.recover_group(foreign, Failure::state("x")),
        Err(rcs::ControlError::UnknownGroup(foreign))
    );
    assert_eq!(
        h.submit(foreign, Priority::Low, |_| Ok(())),
        Err(rcs::SubmitError::UnknownGroup(foreign))
    );
    drop(rt);
}

/// Fault injection (§6.3.3): failures at the configured rate per dispatch,
/// each followed by a group recovery that takes the emulated time.
#[test]
fn injected_faults_fire_at_the_configured_rate_and_take_the_recovery_time() {
    let mut b = Runtime::builder();
    b.workers(1);
    let a = b.group(GroupSpec::new("a").inject_faults(0.01, Duration::from_millis(2)));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let redriven = Arc::new(AtomicU64::new(0));
    struct Redrive(Arc<AtomicU64>, bool);
    impl Drop for Redrive {
        fn drop(&mut self) {
            if !self.1 {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    for _ in 0..5000 {
        let guard = Redrive(Arc::clone(&redriven), false);
        h.submit(a, Priority::Medium, move |_| {
            let mut guard = guard; // take the whole guard, not just its field
            guard.1 = true;
            Ok(())
        })
        .unwrap_or_else(|_| panic!("queue full"));
        if h.metrics().groups[0].queued[1] > 3000 {
            assert!(h.wait_idle(LONG));
        }
    }
    assert!(h.wait_idle(LONG));
    let m = h.metrics();
    let g = &m.groups[0];
    assert_eq!(g.dispatched, 5000);
    assert_eq!(g.injected, g.failed);
    assert_eq!(
        g.injected,
        redriven.load(Ordering::SeqCst),
        "failed bodies are dropped unrun"
    );
    assert!(
        (15..=90).contains(&g.injected),
        "{} faults in 5000 dispatches at 1%",
        g.injected
    );
    assert_eq!(g.recoveries, g.injected);
    assert!(g.recovery_time.p50 >= Duration::from_millis(2));
    // One worker: it is the recovery's leader, so no task of the group runs
    // or is dispatched during a recovery, and each one holds exactly d.
    assert_eq!(
        g.emulated_hold,
        Duration::from_millis(2) * g.recoveries as u32
    );
    h.inject(a, 0.0, Duration::ZERO).unwrap();
    assert!(h.inject(a, 1.5, Duration::ZERO).is_err());
    drop(rt);
}

/// Processor time one emulated recovery holds (§6.3.3) under `policy`: a
/// recovery of `d` started from outside, and one task of the group submitted
/// while it runs, with two workers free to dispatch it.
fn hold_of_one_recovery(policy: Policy, d: Duration) -> (Duration, bool) {
    let mut b = Runtime::builder();
    b.workers(2).policy(policy);
    let a = b.group(GroupSpec::new("a").inject_faults(0.0, d));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let leader = {
        let h = h.clone();
        std::thread::spawn(move || h.recover_group(a, Failure::state("emulated")).unwrap())
    };
    assert!(wait_until(LONG, || h.metrics().groups[0].recovering));
    let ran_in_recovery = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran_in_recovery);
    let probe = h.clone();
    h.submit(a, Priority::High, move |_| {
        r.store(probe.metrics().groups[0].recovering, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    leader.join().unwrap();
    assert!(h.wait_idle(LONG));
    let hold = h.metrics().groups[0].emulated_hold;
    drop(rt);
    (hold, ran_in_recovery.load(Ordering::SeqCst))
}

/// The mechanism behind the paper's bad-path numbers: without reactive
/// scheduling a task dispatched during its group's recovery holds its
/// processor for the recovery time too; with it (dynamic) the task waits and
/// the recovery holds only its own processor.
#[test]
fn a_recovery_holds_a_second_processor_under_performance_but_not_under_dynamic() {
    let d = Duration::from_millis(150);
    let (perf, _) = hold_of_one_recovery(Policy::Performance, d);
    assert!(
        perf >= 2 * d,
        "performance: {perf:?} held, expected >= {:?}",
        2 * d
    );
    let (dynamic, ran_in_recovery) = hold_of_one_recovery(Policy::Dynamic, d);
    assert_eq!(dynamic, d, "dynamic: only the leader's recovery time");
    assert!(
        !ran_in_recovery,
        "dynamic dispatched the group during its recovery"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    /// For random nestings of recovery points, each registering clean-ups,
    /// with a failure raised at a random depth: exactly the clean-ups of the
    /// frames the failure unwound run, each once, newest first.
    #[test]
    fn cleanups_of_unwound_frames_run_once_newest_first(
        blocks in prop::collection::vec(0usize..4, 1..6),
        fail_depth in 0usize..6,
    ) {
        let depth = blocks.len();
        let fail_at = fail_depth.min(depth - 1);
        let log: Log = Arc::default();
        let l = Arc::clone(&log);
        let b2 = blocks.clone();
        run_one::<()>(GroupSpec::new("g"), move |ctx, _| {
            fn nest(ctx: &mut TaskCtx<'_>, level: usize, blocks: &[usize], fail_at: usize, log: &Log) -> Result<(), Failure> {
                let _ = ctx.recovery_point(&ESCALATE, |ctx| {
                    for i in 0..blocks[level] {
                        let l = Arc::clone(log);
                        ctx.cleanup("b", move || log_push(&l, format!("{level}.{i}")));
                    }
                    if level == fail_at {
                        return Err(Failure::state("fail"));
                    }
                    nest(ctx, level + 1, blocks, fail_at, log)
                })?;
                Ok(())
            }
            let _ = nest(ctx, 0, &b2, fail_at, &l);
            Ok(())
        });
        let mut expected = Vec::new();
        for level in (0..=fail_at).rev() {
            for i in (0..blocks[level]).rev() {
                expected.push(format!("{level}.{i}"));
            }
        }
        prop_assert_eq!(log.lock().unwrap().clone(), expected);
    }
}
