//! Scheduling properties of the four policies: sigma under static, the
//! static mapping, partial-dynamic leases, dynamic preference, QoS loop
//! counts and starvation bounds, policy switching.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Concurrency, spin_for, wait_until};
use proptest::prelude::*;
use rcs::{Alternative, GroupSpec, Policy, PoolId, Priority, QosLoops, Runtime};

const LONG: Duration = Duration::from_secs(20);

fn sigma_case(workers: usize, sigmas: Vec<u32>, tasks: usize, work_us: u64) {
    let mut b = Runtime::builder();
    b.workers(workers).policy(Policy::Static);
    // Every group may use every pool: only sigma limits concurrency.
    let all_pools: Vec<PoolId> = (0..workers as u16).map(PoolId).collect();
    let groups: Vec<_> = sigmas
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            b.group(
                GroupSpec::new(format!("g{i}"))
                    .sigma(s)
                    .pools(all_pools.clone()),
            )
        })
        .collect();
    let rt = b.build().unwrap();
    let h = rt.handle();
    let trackers: Vec<_> = groups.iter().map(|_| Concurrency::new()).collect();
    for n in 0..tasks {
        let g = n % groups.len();
        let tracker = Arc::clone(&trackers[g]);
        h.submit(groups[g], Priority::Medium, move |_| {
            let _in = tracker.enter();
            spin_for(Duration::from_micros(work_us));
            Ok(())
        })
        .unwrap();
    }
    assert!(rt.shutdown(LONG), "tasks did not finish");
    for (g, t) in trackers.iter().enumerate() {
        assert!(
            t.max() <= sigmas[g],
            "group {g} ran {} tasks at once with sigma {}",
            t.max(),
            sigmas[g]
        );
    }
}

#[test]
fn sigma_is_never_exceeded_under_static() {
    // Four workers and two groups of sigma 1 and 3: each group alone could
    // occupy every worker.
    sigma_case(4, vec![1, 3], 400, 50);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn sigma_is_never_exceeded_under_static_for_random_workloads(
        workers in 1usize..5,
        sigmas in prop::collection::vec(1u32..4, 1..5),
        tasks in 20usize..200,
        work_us in 0u64..40,
    ) {
        sigma_case(workers, sigmas, tasks, work_us);
    }
}

#[test]
fn static_policy_dispatches_a_group_only_on_its_pools() {
    let mut b = Runtime::builder();
    b.workers(3).policy(Policy::Static);
    let a = b.group(GroupSpec::new("a").sigma(4).pools([PoolId(0)]));
    let c = b.group(GroupSpec::new("c").sigma(4).pools([PoolId(1), PoolId(2)]));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let seen: Arc<Mutex<Vec<(usize, usize)>>> = Arc::default();
    for n in 0..600 {
        let (g, id) = if n % 2 == 0 { (0, a) } else { (1, c) };
        let seen = Arc::clone(&seen);
        h.submit(id, Priority::High, move |ctx| {
            spin_for(Duration::from_micros(5));
            seen.lock().unwrap().push((g, ctx.worker_index()));
            Ok(())
        })
        .unwrap();
    }
    assert!(rt.shutdown(LONG));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 600);
    for &(g, w) in seen.iter() {
        match g {
            0 => assert_eq!(w, 0, "group a (pool 0) ran on worker {w}"),
            _ => assert!(w == 1 || w == 2, "group c (pools 1, 2) ran on worker {w}"),
        }
    }
}

/// Partial-dynamic: a pool with no work in its static mapping takes a lease
/// on the alternative mapping and runs a busy group's tasks; an isolated
/// group never leaves its pools.
#[test]
fn partial_dynamic_leases_idle_pools_to_busy_groups_but_not_isolated_ones() {
    for (isolated, expect_borrowed) in [(false, true), (true, false)] {
        let mut b = Runtime::builder();
        b.workers(2).policy(Policy::Partial);
        let alternative = if isolated {
            Alternative::Isolated
        } else {
            Alternative::AllPools
        };
        let busy = b.group(
            GroupSpec::new("busy")
                .sigma(1)
                .pools([PoolId(0)])
                .alternative(alternative),
        );
        let _quiet = b.group(GroupSpec::new("quiet").sigma(1).pools([PoolId(1)]));
        let rt = b.build().unwrap();
        let h = rt.handle();
        let on_worker1 = Arc::new(AtomicU64::new(0));
        let tracker = Concurrency::new();
        for _ in 0..400 {
            let on_worker1 = Arc::clone(&on_worker1);
            let tracker = Arc::clone(&tracker);
            h.submit(busy, Priority::Medium, move |ctx| {
                let _in = tracker.enter();
                spin_for(Duration::from_micros(20));
                if ctx.worker_index() == 1 {
                    on_worker1.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
            .unwrap();
        }
        let metrics = h.metrics();
        assert!(rt.shutdown(LONG));
        let borrowed = on_worker1.load(Ordering::Relaxed);
        if expect_borrowed {
            assert!(
                borrowed > 0,
                "the idle pool never ran the busy group's tasks"
            );
            assert!(metrics.pools[1].leases > 0 || borrowed > 0);
        } else {
            assert_eq!(borrowed, 0, "an isolated group ran outside its pool");
            assert_eq!(tracker.max(), 1, "an isolated group exceeded sigma");
        }
    }
}

/// Dynamic RCS prefers groups under sigma: with two workers and two flooded
/// groups of sigma 1, a worker that could pick either picks the one not
/// already running, so a group rarely runs twice at once. The performance
/// policy, which ignores groups, does it often.
#[test]
fn dynamic_prefers_groups_under_sigma() {
    let overlap = |policy: Policy| -> f64 {
        let mut b = Runtime::builder();
        b.workers(2).policy(policy).queue_capacity(4096);
        let a = b.group(GroupSpec::new("a").sigma(1));
        let c = b.group(GroupSpec::new("c").sigma(1));
        let rt = b.build().unwrap();
        let h = rt.handle();
        let tracker = Concurrency::new();
        let overlapping = Arc::new(AtomicU64::new(0));
        // Queue everything first, then let the workers go.
        let gate = Arc::new(std::sync::Barrier::new(3));
        for _ in 0..2 {
            let gate = Arc::clone(&gate);
            h.submit(c, Priority::High, move |_| {
                gate.wait();
                Ok(())
            })
            .unwrap();
        }
        assert!(wait_until(LONG, || h.metrics().groups[1].running == 2
            || h.metrics().groups[1].dispatched == 2));
        // Only while group c still has plenty queued does a worker have a
        // choice; once c runs dry, running a twice is right (fewest running).
        let c_left = Arc::new(AtomicU64::new(1000));
        let measured = Arc::new(AtomicU64::new(0));
        // Submitted in pairs (a, a, c, c, ...): a FIFO that ignores groups
        // hands both workers the same group, while strictly alternating
        // submissions could let two workers in lockstep never overlap.
        for n in 0..2000 {
            let is_a = (n / 2) % 2 == 0;
            let (g, tracker, overlapping, c_left, measured) = (
                if is_a { a } else { c },
                Arc::clone(&tracker),
                Arc::clone(&overlapping),
                Arc::clone(&c_left),
                Arc::clone(&measured),
            );
            h.submit(g, Priority::Medium, move |_| {
                if is_a {
                    let guard = tracker.enter();
                    if c_left.load(Ordering::SeqCst) > 20 {
                        measured.fetch_add(1, Ordering::Relaxed);
                        if tracker.live() > 1 {
                            overlapping.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    spin_for(Duration::from_micros(20));
                    drop(guard);
                } else {
                    spin_for(Duration::from_micros(20));
                    c_left.fetch_sub(1, Ordering::SeqCst);
                }
                Ok(())
            })
            .unwrap();
        }
        gate.wait();
        assert!(rt.shutdown(LONG));
        let measured = measured.load(Ordering::Relaxed).max(1);
        overlapping.load(Ordering::Relaxed) as f64 / measured as f64
    };
    let dynamic = overlap(Policy::Dynamic);
    let performance = overlap(Policy::Performance);
    assert!(
        dynamic < 0.05,
        "dynamic ran group a twice at once for {:.1}% of its tasks",
        dynamic * 100.0
    );
    assert!(
        performance > dynamic,
        "performance ({performance}) should overlap more than dynamic ({dynamic})"
    );
}

/// Figures 6 and 7: under a never-ending flood of high-priority work, a
/// low-priority task is still dispatched within the QoS bound, under every
/// policy.
#[test]
fn low_priority_work_is_dispatched_within_the_qos_loop_bound() {
    for policy in Policy::ALL {
        let qos = QosLoops {
            high_loop_count: 3,
            medium_loop_count: 2,
        };
        let mut b = Runtime::builder();
        b.workers(1).policy(policy).qos(qos);
        let g = b.group(GroupSpec::new("g").sigma(8).pools([PoolId(0)]));
        let rt = b.build().unwrap();
        let h = rt.handle();
        let dispatches = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // A self-perpetuating flood: every high task submits two more
        // (bounded by the queue), so high work never runs out.
        fn flood(
            h: rcs::Handle,
            g: rcs::GroupId,
            dispatches: Arc<AtomicU64>,
            stop: Arc<std::sync::atomic::AtomicBool>,
        ) {
            let (h2, d2, s2) = (h.clone(), Arc::clone(&dispatches), Arc::clone(&stop));
            let _ = h.submit(g, Priority::High, move |_| {
                d2.fetch_add(1, Ordering::SeqCst);
                if !s2.load(Ordering::SeqCst) {
                    flood(h2.clone(), g, Arc::clone(&d2), Arc::clone(&s2));
                    flood(h2, g, d2, s2);
                }
                Ok(())
            });
        }
        for _ in 0..64 {
            flood(h.clone(), g, Arc::clone(&dispatches), Arc::clone(&stop));
        }
        std::thread::sleep(Duration::from_millis(20));
        let waits: Arc<Mutex<Vec<u64>>> = Arc::default();
        for _ in 0..20 {
            let n = waits.lock().unwrap().len();
            // The probe is submitted by a task on the single worker, so no
            // dispatch can slip in between reading the count and submitting.
            let probe = || {
                let (d, w, h2) = (Arc::clone(&dispatches), Arc::clone(&waits), h.clone());
                h.submit(g, Priority::High, move |_| {
                    let submitted_at = d.load(Ordering::SeqCst);
                    h2.submit(g, Priority::Low, move |_| {
                        let started_at = d.load(Ordering::SeqCst);
                        w.lock().unwrap().push(started_at - submitted_at);
                        Ok(())
                    })
                    .unwrap();
                    Ok(())
                })
            };
            // The flood keeps the high queue full: retry until it has room.
            assert!(wait_until(LONG, || probe().is_ok()));
            assert!(wait_until(LONG, || waits.lock().unwrap().len() > n));
        }
        stop.store(true, Ordering::SeqCst);
        drop(rt);
        let bound = u64::from(qos.low_scan_interval()) + 1;
        let worst = *waits.lock().unwrap().iter().max().unwrap();
        assert!(
            worst <= bound,
            "{policy}: a low task waited {worst} high dispatches; bound {bound}"
        );
    }
}

/// Round-robin between the groups sharing a pool: with every group always
/// having queued work, no group waits more than one turn of the others.
#[test]
fn every_group_with_queued_work_is_dispatched_within_one_round_robin_turn() {
    const GROUPS: usize = 8;
    for policy in Policy::ALL {
        let mut b = Runtime::builder();
        b.workers(1).policy(policy);
        let ids: Vec<_> = (0..GROUPS)
            .map(|i| b.group(GroupSpec::new(format!("g{i}")).sigma(4).pools([PoolId(0)])))
            .collect();
        let rt = b.build().unwrap();
        let h = rt.handle();
        let order: Arc<Mutex<Vec<usize>>> = Arc::default();
        // A gate holds the single worker while every group's chain is queued.
        let gate = Arc::new(std::sync::Barrier::new(2));
        {
            let gate = Arc::clone(&gate);
            h.submit(ids[0], Priority::High, move |_| {
                gate.wait();
                Ok(())
            })
            .unwrap();
        }
        fn chain(
            h: rcs::Handle,
            g: rcs::GroupId,
            idx: usize,
            left: u32,
            order: Arc<Mutex<Vec<usize>>>,
        ) {
            let h2 = h.clone();
            h.submit(g, Priority::Medium, move |_| {
                order.lock().unwrap().push(idx);
                if left > 0 {
                    chain(h2, g, idx, left - 1, order);
                }
                Ok(())
            })
            .unwrap();
        }
        for (i, &g) in ids.iter().enumerate() {
            chain(h.clone(), g, i, 50, Arc::clone(&order));
        }
        gate.wait();
        assert!(rt.shutdown(LONG));
        let order = order.lock().unwrap();
        assert_eq!(order.len(), GROUPS * 51);
        // Only look at the part where every group still had work.
        let steady = &order[..GROUPS * 50];
        let mut last = [None::<usize>; GROUPS];
        for (pos, &g) in steady.iter().enumerate() {
            if let Some(prev) = last[g] {
                assert!(
                    pos - prev <= GROUPS,
                    "{policy}: group {g} waited {} dispatches with work queued",
                    pos - prev
                );
            }
            last[g] = Some(pos);
        }
    }
}

/// Switching policy at run time moves queued tasks between the shared
/// queues and the group queues; none is lost or run twice.
#[test]
fn switching_policy_keeps_every_queued_task() {
    for (from, to) in [
        (Policy::Performance, Policy::Dynamic),
        (Policy::Dynamic, Policy::Performance),
        (Policy::Static, Policy::Performance),
        (Policy::Performance, Policy::Partial),
    ] {
        let mut b = Runtime::builder();
        b.workers(1).policy(from);
        let g = b.group(GroupSpec::new("g").sigma(2).pools([PoolId(0)]));
        let other = b.group(GroupSpec::new("other").sigma(2).pools([PoolId(0)]));
        let rt = b.build().unwrap();
        let h = rt.handle();
        let gate = Arc::new(std::sync::Barrier::new(2));
        {
            let gate = Arc::clone(&gate);
            h.submit(other, Priority::High, move |_| {
                gate.wait();
                Ok(())
            })
            .unwrap();
        }
        assert!(wait_until(LONG, || h.metrics().dispatched() == 1));
        let ran: Arc<Mutex<Vec<u32>>> = Arc::default();
        for n in 0..300u32 {
            let ran = Arc::clone(&ran);
            let target = if n % 3 == 0 { other } else { g };
            let prio = Priority::ALL[n as usize % 3];
            h.submit(target, prio, move |_| {
                ran.lock().unwrap().push(n);
                Ok(())
            })
            .unwrap();
        }
        h.set_policy(to).unwrap();
        assert_eq!(h.policy(), to);
        gate.wait();
        assert!(rt.shutdown(LONG), "{from} -> {to}: tasks stranded");
        let mut ran = ran.lock().unwrap().clone();
        ran.sort_unstable();
        assert_eq!(ran, (0..300).collect::<Vec<_>>(), "{from} -> {to}");
    }
}

#[test]
fn switching_to_a_static_policy_needs_a_complete_mapping() {
    let mut b = Runtime::builder();
    b.workers(1).policy(Policy::Dynamic);
    b.group(GroupSpec::new("mapped").pools([PoolId(0)]));
    b.group(GroupSpec::new("unmapped"));
    let rt = b.build().unwrap();
    let h = rt.handle();
    for policy in [Policy::Static, Policy::Partial] {
        let err = h.set_policy(policy).unwrap_err();
        assert!(err.to_string().contains("unmapped"), "{err}");
        assert_eq!(h.policy(), Policy::Dynamic);
    }
    h.set_policy(Policy::Performance).unwrap();
}

#[test]
fn a_full_queue_refuses_instead_of_dropping() {
    let mut b = Runtime::builder();
    b.workers(1).queue_capacity(4);
    let g = b.group(GroupSpec::new("g"));
    let rt = b.build().unwrap();
    let h = rt.handle();
    let gate = Arc::new(std::sync::Barrier::new(2));
    {
        let gate = Arc::clone(&gate);
        h.submit(g, Priority::High, move |_| {
            gate.wait();
            Ok(())
        })
        .unwrap();
    }
    assert!(wait_until(LONG, || h.metrics().dispatched() == 1));
    let done = Arc::new(AtomicU64::new(0));
    let mut accepted = 0;
    let mut refused = 0;
    for _ in 0..10 {
        let done = Arc::clone(&done);
        match h.submit(g, Priority::Low, move |_| {
            done.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }) {
            Ok(()) => accepted += 1,
            Err(rcs::SubmitError::QueueFull { group, priority }) => {
                assert_eq!((group, priority), (g, Priority::Low));
                refused += 1;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!((accepted, refused), (4, 6));
    gate.wait();
    assert!(rt.shutdown(LONG));
    assert_eq!(done.load(Ordering::SeqCst), 4, "every accepted task ran");
}

#[test]
fn metrics_count_dispatches_per_group_and_pool() {
    let mut b = Runtime::builder();
    b.workers(2).policy(Policy::Static);
    let a = b.group(GroupSpec::new("a").pools([PoolId(0)]));
    let c = b.group(GroupSpec::new("c").pools([PoolId(1)]));
    let rt = b.build().unwrap();
    let h = rt.handle();
    for _ in 0..30 {
        h.submit(a, Priority::High, |_| Ok(())).unwrap();
    }
    for _ in 0..20 {
        h.submit(c, Priority::Low, |_| {
            Err(rcs::Failure::domain("bad input").abort())
        })
        .unwrap();
    }
    assert!(h.wait_idle(LONG));
    let m = h.metrics();
    assert_eq!(m.group("a").unwrap().completed, 30);
    assert_eq!(m.group("c").unwrap().aborted, 20);
    assert_eq!(m.pools[0].dispatched, 30);
    assert_eq!(m.pools[1].dispatched, 20);
    assert_eq!(m.dispatched(), 50);
    assert_eq!(m.policy, Policy::Static);
    drop(rt);
}
