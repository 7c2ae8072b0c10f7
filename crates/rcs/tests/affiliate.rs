//! Affiliated threads (caller-runs): tasks of an affiliate's groups run on
//! the calling thread when admission allows, with the same recovery
//! machinery as on a worker; everything else is queued for the pools.

mod common;

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use common::wait_until;
use rcs::{Failure, GroupSpec, Policy, Priority, Runtime};

const LONG: Duration = Duration::from_secs(20);

type Seen = Arc<Mutex<Vec<(&'static str, ThreadId)>>>;

fn note(seen: &Seen, what: &'static str) {
    seen.lock()
        .unwrap()
        .push((what, std::thread::current().id()));
}

fn runtime(policy: Policy, affiliates: usize) -> (Runtime, rcs::GroupId, rcs::GroupId) {
    let mut b = Runtime::builder();
    b.workers(1).policy(policy).affiliates(affiliates);
    let host = b.group(GroupSpec::new("host").sigma(1).pools([rcs::PoolId(0)]));
    let device = b.group(GroupSpec::new("device").sigma(1).pools([rcs::PoolId(0)]));
    (b.build().unwrap(), host, device)
}

#[test]
fn an_affiliate_runs_its_groups_tasks_and_their_follow_ups_on_the_calling_thread() {
    for policy in [Policy::Performance, Policy::Dynamic, Policy::Static] {
        let (rt, host, device) = runtime(policy, 1);
        let h = rt.handle();
        let mut aff = h.affiliate(&[host]).expect("a slot is free");
        let seen: Seen = Arc::default();
        let s = Arc::clone(&seen);
        aff.run_named(host, Priority::High, "first", move |ctx| {
            note(&s, "first");
            let s2 = Arc::clone(&s);
            ctx.submit_named(host, Priority::High, "follow-up", move |_| {
                note(&s2, "follow-up");
                Ok(())
            })
            .expect("accepted");
            let s3 = Arc::clone(&s);
            ctx.submit_named(device, Priority::High, "device", move |_| {
                note(&s3, "device");
                Ok(())
            })
            .expect("accepted");
            Ok(())
        })
        .unwrap();
        assert!(h.wait_idle(LONG));
        let me = std::thread::current().id();
        let seen = seen.lock().unwrap().clone();
        let on = |what: &str| seen.iter().find(|(w, _)| *w == what).map(|(_, t)| *t);
        assert_eq!(on("first"), Some(me), "{policy:?}: the task ran here");
        assert_eq!(
            on("follow-up"),
            Some(me),
            "{policy:?}: the follow-up ran here"
        );
        let device_thread = on("device").expect("the device task ran");
        assert_ne!(
            device_thread, me,
            "{policy:?}: another group's task went to the pool"
        );
        let m = h.metrics();
        assert_eq!(m.affiliated, 2, "{policy:?}");
        assert_eq!(m.group("host").unwrap().completed, 2);
        assert_eq!(m.group("device").unwrap().completed, 1);
        drop(aff);
        drop(rt);
    }
}

#[test]
fn a_group_with_faults_armed_is_left_to_the_pool_scheduler() {
    let (rt, host, _) = runtime(Policy::Dynamic, 1);
    let h = rt.handle();
    // Probability 0 but an emulated recovery time: armed, never fires.
    h.inject(host, 0.0, Duration::from_millis(1)).unwrap();
    let mut aff = h.affiliate(&[host]).unwrap();
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    aff.run_named(host, Priority::High, "t", move |_| {
        note(&s, "t");
        Ok(())
    })
    .unwrap();
    assert!(wait_until(LONG, || !seen.lock().unwrap().is_empty()));
    assert_ne!(seen.lock().unwrap()[0].1, std::thread::current().id());
    assert_eq!(h.metrics().affiliated, 0);
}

#[test]
fn a_failing_task_on_an_affiliate_starts_its_group_recovery() {
    let mut b = Runtime::builder();
    let handled = Arc::new(Mutex::new(0));
    let h2 = Arc::clone(&handled);
    b.workers(1).affiliates(1);
    let host = b.group(GroupSpec::new("host").recovery_handler(move |_| {
        *h2.lock().unwrap() += 1;
        Ok(())
    }));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let mut aff = h.affiliate(&[host]).unwrap();
    aff.run_named(host, Priority::High, "bad", |_| {
        Err(Failure::internal_logic("bad LRC"))
    })
    .unwrap();
    // Recovery ran on this thread, before run_named returned.
    assert_eq!(*handled.lock().unwrap(), 1);
    let m = h.metrics();
    let g = m.group("host").unwrap();
    assert_eq!((g.failed, g.recoveries, g.running), (1, 1, 0));
    // A panic is a task failure too, caught on this thread.
    aff.run_named(host, Priority::High, "panics", |_| panic!("oops"))
        .unwrap();
    assert_eq!(h.metrics().group("host").unwrap().recoveries, 2);
}

#[test]
fn affiliate_slots_are_bounded_and_given_back_on_drop() {
    let (rt, host, _) = runtime(Policy::Dynamic, 1);
    let h = rt.handle();
    let first = h.affiliate(&[host]);
    assert!(first.is_some());
    assert!(h.affiliate(&[host]).is_none(), "one slot only");
    drop(first);
    assert!(h.affiliate(&[host]).is_some(), "the slot came back");
    let (rt0, host0, _) = runtime(Policy::Dynamic, 0);
    assert!(rt0.handle().affiliate(&[host0]).is_none(), "none built");
    drop(rt);
}

#[test]
fn a_worker_thread_cannot_claim_an_affiliate() {
    let (rt, host, _) = runtime(Policy::Dynamic, 1);
    let h = rt.handle();
    let got = Arc::new(Mutex::new(None));
    let g2 = Arc::clone(&got);
    let h2 = h.clone();
    h.submit(host, Priority::High, move |_| {
        *g2.lock().unwrap() = Some(h2.affiliate(&[host]).is_some());
        Ok(())
    })
    .unwrap();
    assert!(h.wait_idle(LONG));
    assert_eq!(*got.lock().unwrap(), Some(false));
}

#[test]
fn under_the_static_policy_an_affiliate_respects_sigma() {
    let (rt, host, _) = runtime(Policy::Static, 2);
    let h = rt.handle();
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    // A task of `host` (sigma 1) holds its one admission on another thread.
    let holder = {
        let h = h.clone();
        std::thread::spawn(move || {
            let mut aff = h.affiliate(&[host]).unwrap();
            aff.run_named(host, Priority::High, "holder", move |_| {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                Ok(())
            })
            .unwrap();
        })
    };
    started_rx.recv().unwrap();
    let mut aff = h.affiliate(&[host]).unwrap();
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    aff.run_named(host, Priority::High, "second", move |_| {
        note(&s, "second");
        Ok(())
    })
    .unwrap();
    // Sigma is reached: the task was queued, not run here; it runs on the
    // worker once the holder finishes.
    assert!(seen.lock().unwrap().is_empty());
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    assert!(wait_until(LONG, || !seen.lock().unwrap().is_empty()));
    assert_ne!(seen.lock().unwrap()[0].1, std::thread::current().id());
}
