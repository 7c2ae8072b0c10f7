//! For random interleavings of two actors' read, write, acquire, release
//! and commit events, executed on two real threads in the schedule's order,
//! the restoration level Log(Lock) computes equals the one read off the
//! schedule directly from the paper's happened-before patterns (§2.1).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;

use loglock::{Actor, RestorationLevel, TrackedMutex, TrackedPool};
use proptest::prelude::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    Acquire,
    Release,
    Commit,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Read),
        3 => Just(Op::Write),
        1 => Just(Op::Acquire),
        1 => Just(Op::Release),
        1 => Just(Op::Commit),
    ]
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1_000_000);

enum Cmd {
    Do(Op),
    Level(mpsc::Sender<(RestorationLevel, RestorationLevel)>),
    End,
}

/// One actor's thread: performs the ops it is sent, in order, acking each.
fn actor_thread(
    tracks: bool,
    state: TrackedMutex<u64>,
    pool: TrackedPool,
    cmds: mpsc::Receiver<Cmd>,
    ack: mpsc::Sender<()>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let actor = Actor::begin(NEXT_ID.fetch_add(1, Ordering::Relaxed));
        if tracks {
            actor.start_tracking(&state).unwrap();
            actor.start_tracking(&pool).unwrap();
        }
        let mut owned = Vec::new();
        for cmd in cmds {
            match cmd {
                Cmd::Do(Op::Read) => {
                    let _ = *state.lock();
                }
                Cmd::Do(Op::Write) => *state.lock() += 1,
                Cmd::Do(Op::Acquire) => owned.push(pool.acquire().unwrap()),
                Cmd::Do(Op::Release) => {
                    if let Some(i) = owned.pop() {
                        pool.release(i).unwrap();
                    }
                }
                Cmd::Do(Op::Commit) => actor.commit(),
                Cmd::Level(reply) => {
                    let l = actor.restoration_level(&state).unwrap();
                    let p = actor.restoration_level(&pool).unwrap();
                    reply.send((l, p)).unwrap();
                }
                Cmd::End => break,
            }
            ack.send(()).unwrap();
        }
    })
}

/// The paper's patterns, evaluated on the schedule by brute force over
/// ordered pairs and triples of positions. Actor 0 is T1 (tracking from the
/// start, failing at the end); actor 1 is T2. A write may read, so W
/// matches R as well.
fn reference(schedule: &[(usize, Op)]) -> RestorationLevel {
    let is =
        |i: usize, actor: usize, ops: &[Op]| schedule[i].0 == actor && ops.contains(&schedule[i].1);
    let n = schedule.len();
    const R: &[Op] = &[Op::Read, Op::Write];
    const W: &[Op] = &[Op::Write];
    let pair = |a: &[Op], b: &[Op]| (0..n).any(|i| (i + 1..n).any(|j| is(i, 0, a) && is(j, 1, b)));
    let committed = |a: &[Op], b: &[Op]| {
        (0..n).any(|i| {
            (i + 1..n)
                .any(|j| (j + 1..n).any(|k| is(i, 0, a) && is(j, 1, b) && is(k, 1, &[Op::Commit])))
        })
    };
    // Residual resources: T1's acquisitions outnumber its (effective)
    // releases at the end.
    let mut held = 0i32;
    for &(a, op) in schedule {
        if a == 0 {
            match op {
                Op::Acquire => held += 1,
                Op::Release if held > 0 => held -= 1,
                _ => {}
            }
        }
    }
    RestorationLevel {
        dr: pair(W, R),
        lu: pair(W, W),
        ur: pair(R, W),
        rr: held > 0,
        cd: committed(W, R) || committed(W, W) || committed(R, W),
        complete: true,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_computed_level_equals_the_schedules_happened_before_patterns(
        schedule in proptest::collection::vec((0usize..2, op()), 0..24),
        t2_is_actor in any::<bool>(),
    ) {
        let state = TrackedMutex::new("state", 0u64);
        let pool = TrackedPool::new("pool", 32);
        let (ack_tx, ack_rx) = mpsc::channel();
        let (t1_tx, t1_rx) = mpsc::channel();
        let (t2_tx, t2_rx) = mpsc::channel();
        let t1 = actor_thread(true, state.clone(), pool.clone(), t1_rx, ack_tx.clone());
        let t2 = if t2_is_actor {
            actor_thread(false, state.clone(), pool.clone(), t2_rx, ack_tx)
        } else {
            // A thread with no actor: its accesses count under its implicit
            // id, and `loglock::commit` stands for its externally visible
            // action.
            let (state, pool) = (state.clone(), pool.clone());
            thread::spawn(move || {
                let mut owned = Vec::new();
                for cmd in t2_rx {
                    match cmd {
                        Cmd::Do(Op::Read) => { let _ = *state.lock(); }
                        Cmd::Do(Op::Write) => *state.lock() += 1,
                        Cmd::Do(Op::Acquire) => owned.push(pool.acquire().unwrap()),
                        Cmd::Do(Op::Release) => if let Some(i) = owned.pop() { pool.release(i).unwrap() },
                        Cmd::Do(Op::Commit) => loglock::commit(),
                        Cmd::Level(_) | Cmd::End => break,
                    }
                    ack_tx.send(()).unwrap();
                }
            })
        };
        for &(actor, op) in &schedule {
            let tx = if actor == 0 { &t1_tx } else { &t2_tx };
            tx.send(Cmd::Do(op)).unwrap();
            ack_rx.recv().unwrap();
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        t1_tx.send(Cmd::Level(reply_tx)).unwrap();
        let (state_level, pool_level) = reply_rx.recv().unwrap();
        ack_rx.recv().unwrap();
        t1_tx.send(Cmd::End).unwrap();
        t2_tx.send(Cmd::End).unwrap();
        t1.join().unwrap();
        t2.join().unwrap();

        let want = reference(&schedule);
        prop_assert_eq!(
            (state_level.dr, state_level.lu, state_level.ur, state_level.cd),
            (want.dr, want.lu, want.ur, want.cd),
            "state level for {:?}", schedule
        );
        prop_assert!(!state_level.rr, "the mutex is never held when asked");
        prop_assert_eq!(pool_level.rr, want.rr, "pool residual resources for {:?}", schedule);
        prop_assert!(state_level.complete && pool_level.complete);
    }
}
