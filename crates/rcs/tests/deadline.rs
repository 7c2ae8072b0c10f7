//! A task past its deadline (§2.2 time-outs): the watchdog marks it, and the
//! task fails with class `Timeout` at its next cooperative check or stall.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use rcs::fault::{self, FaultAction, FaultConfig};
use rcs::{FailureClass, GroupSpec, Priority, Runtime, fault_point};

const LONG: Duration = Duration::from_secs(20);
const DEADLINE: Duration = Duration::from_millis(40);

fn runtime(deadline: Option<Duration>) -> (Runtime, rcs::GroupId) {
    let mut b = Runtime::builder();
    b.workers(2).task_deadline(deadline);
    let g = b.group(GroupSpec::new("io"));
    (b.build().unwrap(), g)
}

#[test]
fn a_task_that_runs_past_its_deadline_fails_with_a_time_out_at_its_next_check() {
    let (rt, g) = runtime(Some(DEADLINE));
    let h = rt.handle();
    let (tx, rx) = mpsc::channel();
    h.submit(g, Priority::High, move |ctx| {
        let started = Instant::now();
        // A loop that would run for 10 s, checking as it goes.
        while started.elapsed() < Duration::from_secs(10) {
            if let Err(f) = ctx.check() {
                tx.send((f.class(), started.elapsed())).unwrap();
                return Err(f);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    })
    .unwrap();
    let (class, after) = rx.recv_timeout(LONG).unwrap();
    assert_eq!(class, FailureClass::Timeout);
    assert!(after >= DEADLINE, "declared overdue after only {after:?}");
    assert!(h.wait_idle(LONG));
    let m = h.metrics();
    assert_eq!(m.groups[g.index()].overdue, 1);
    assert_eq!(m.groups[g.index()].failed, 1);
}

#[test]
fn a_stall_at_a_fault_point_ends_at_the_deadline_as_a_time_out() {
    let (rt, g) = runtime(Some(DEADLINE));
    let h = rt.handle();
    fault::arm(
        "deadline.stall",
        FaultConfig::once(FaultAction::Delay(Duration::from_secs(30))),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    h.submit(g, Priority::High, move |_ctx| {
        let started = Instant::now();
        let r = fault_point!("deadline.stall");
        tx.send((r.as_ref().err().map(|f| f.class()), started.elapsed()))
            .unwrap();
        r
    })
    .unwrap();
    let (class, after) = rx.recv_timeout(LONG).unwrap();
    assert_eq!(class, Some(FailureClass::Timeout));
    assert!(
        after >= DEADLINE && after < Duration::from_secs(10),
        "the 30 s stall ended after {after:?}"
    );
    assert!(h.wait_idle(LONG));
    assert_eq!(h.metrics().groups[g.index()].overdue, 1);
}

#[test]
fn tasks_within_their_deadline_are_never_marked() {
    let (rt, g) = runtime(Some(DEADLINE));
    let h = rt.handle();
    let (tx, rx) = mpsc::channel();
    for _ in 0..2_000 {
        let tx = tx.clone();
        h.submit(g, Priority::High, move |ctx| {
            tx.send(ctx.check().is_ok()).unwrap();
            Ok(())
        })
        .unwrap();
    }
    drop(tx);
    assert!(h.wait_idle(LONG));
    assert!(rx.iter().all(|ok| ok));
    let m = h.metrics();
    assert_eq!(m.groups[g.index()].overdue, 0);
    assert_eq!(m.groups[g.index()].completed, 2_000);
}

#[test]
fn without_a_deadline_a_long_task_runs_to_its_end() {
    let (rt, g) = runtime(None);
    let h = rt.handle();
    let (tx, rx) = mpsc::channel();
    h.submit(g, Priority::High, move |ctx| {
        let started = Instant::now();
        while started.elapsed() < DEADLINE * 4 {
            ctx.check()?;
            std::thread::sleep(Duration::from_millis(1));
        }
        tx.send(()).unwrap();
        Ok(())
    })
    .unwrap();
    rx.recv_timeout(LONG).unwrap();
    assert!(h.wait_idle(LONG));
    assert_eq!(h.metrics().groups[g.index()].overdue, 0);
}

#[test]
fn a_zero_deadline_is_refused() {
    let mut b = Runtime::builder();
    b.task_deadline(Some(Duration::ZERO));
    b.group(GroupSpec::new("io"));
    let e = b.build().unwrap_err().to_string();
    assert!(e.contains("deadline"), "{e}");
}

#[test]
fn a_task_hung_past_its_deadline_recovers_its_group_and_escalates_when_it_cannot_drain() {
    let system: std::sync::Arc<std::sync::Mutex<Vec<rcs::SystemFailure>>> = Default::default();
    let sys = std::sync::Arc::clone(&system);
    let mut b = Runtime::builder();
    b.workers(2)
        .task_deadline(Some(DEADLINE))
        .hung_after(Some(DEADLINE * 5))
        .drain_timeout(Duration::from_millis(100))
        .system_recovery(move |f| sys.lock().unwrap().push(f.clone()));
    let g = b.group(GroupSpec::new("io"));
    let other = b.group(GroupSpec::new("cache"));
    let rt = b.build().unwrap();
    let h = rt.handle();
    // A task that never checks: only a recovery around it can act.
    h.submit(g, Priority::High, |_ctx| {
        std::thread::sleep(Duration::from_millis(1_500));
        Ok(())
    })
    .unwrap();
    let system_seen = |s: &std::sync::Mutex<Vec<rcs::SystemFailure>>| !s.lock().unwrap().is_empty();
    let started = Instant::now();
    while !system_seen(&system) && started.elapsed() < LONG {
        std::thread::sleep(Duration::from_millis(5));
    }
    let failures = system.lock().unwrap().clone();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].cause, rcs::SystemCause::DrainTimeout);
    assert_eq!(failures[0].failure.class(), FailureClass::Timeout);
    assert!(
        started.elapsed() < Duration::from_millis(1_400),
        "escalated only after the task ended"
    );
    // The other group kept serving meanwhile.
    let (tx, rx) = mpsc::channel();
    h.submit(other, Priority::High, move |_ctx| {
        tx.send(()).unwrap();
        Ok(())
    })
    .unwrap();
    rx.recv_timeout(LONG).unwrap();
    assert!(h.wait_idle(LONG));
    let m = h.metrics();
    assert_eq!(m.groups[g.index()].overdue, 1);
    assert_eq!(m.groups[g.index()].recoveries, 1);
    let events = h.recent_events();
    assert!(
        events
            .iter()
            .any(|e| e.cause.class() == FailureClass::Timeout && e.cause.message().contains("hung")),
        "{events:?}"
    );
}

#[test]
fn hung_after_needs_a_shorter_deadline() {
    for (deadline, hung) in [(None, 100), (Some(100), 100), (Some(200), 100)] {
        let mut b = Runtime::builder();
        b.task_deadline(deadline.map(Duration::from_millis))
            .hung_after(Some(Duration::from_millis(hung)));
        b.group(GroupSpec::new("io"));
        let e = b.build().unwrap_err().to_string();
        assert!(e.contains("hung_after"), "{e}");
    }
}
