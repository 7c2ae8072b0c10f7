//! Model checking of the lock-free protocols with loom.
//!
//! The protocol modules are compiled here a second time, from the same
//! source files, with `crate::sync` mapped to loom's atomics; loom then runs
//! every interleaving (within its bounds) of small scenarios.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p rcs --test loom --release`.
//!
//! Invariants checked:
//! - ready masks: after a push and a concurrent failed pop, a non-empty
//!   queue has its ready bit set (no work is ever hidden from the workers);
//! - idle set with the fused submit path: a worker that parks is unparked by
//!   a concurrent producer, or its re-check sees the producer's work, whether
//!   the ready bit started clear or stale (no lost wake-up: loom reports a
//!   worker parked forever as a deadlock);
//! - release at the sigma bound: a worker that parks because the only
//!   queued task belongs to a group at its bound is woken by the affiliate
//!   that releases the group, or its re-check sees the freed slot;
//! - admission: a dispatcher that passed admission concurrently with a
//!   recovery's suspension is seen by the recovery's drain check; under
//!   sigma = 1, two dispatchers never both pass.
#![cfg(loom)]

#[allow(dead_code)]
mod sync {
    pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
}

#[allow(dead_code)]
#[path = "../src/admission.rs"]
mod admission;
#[allow(dead_code)]
#[path = "../src/idle.rs"]
mod idle;
#[allow(dead_code)]
#[path = "../src/ready.rs"]
mod ready;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use loom::thread;

/// A queue modelled by its length.
struct Queue {
    len: AtomicUsize,
}

impl Queue {
    fn push(&self) {
        self.len.fetch_add(1, Ordering::SeqCst);
    }
    fn pop(&self) -> bool {
        let mut n = self.len.load(Ordering::SeqCst);
        while n > 0 {
            match self
                .len
                .compare_exchange(n, n - 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(actual) => n = actual,
            }
        }
        false
    }
    fn is_empty(&self) -> bool {
        self.len.load(Ordering::SeqCst) == 0
    }
}

#[test]
fn ready_mask_never_loses_work() {
    loom::model(|| {
        let mask = Arc::new(ready::ReadyMask::new());
        let queue = Arc::new(Queue {
            len: AtomicUsize::new(0),
        });
        // A stale bit: set although the queue is empty.
        mask.mark(1);
        let producer = {
            let (mask, queue) = (Arc::clone(&mask), Arc::clone(&queue));
            thread::spawn(move || {
                queue.push();
                mask.mark(1);
            })
        };
        let consumer = {
            let (mask, queue) = (Arc::clone(&mask), Arc::clone(&queue));
            thread::spawn(move || {
                if !queue.pop() {
                    mask.clear_if_empty(1, || queue.is_empty());
                }
            })
        };
        producer.join().unwrap();
        consumer.join().unwrap();
        if !queue.is_empty() {
            assert_eq!(mask.load() & 1, 1, "a non-empty queue lost its ready bit");
        }
    });
}

/// The fused submit path (`mark_then` + `claim_one`), with the ready
/// bit starting either clear or stale-set.
#[test]
fn fused_submit_wakes_a_parking_worker_or_it_sees_work() {
    for stale_bit in [false, true] {
        loom::model(move || {
            let mask = Arc::new(ready::ReadyMask::new());
            let idle = Arc::new(idle::IdleSet::new());
            let queue = Arc::new(Queue {
                len: AtomicUsize::new(0),
            });
            if stale_bit {
                mask.mark(1);
            }
            let worker = {
                let (mask, idle, queue) =
                    (Arc::clone(&mask), Arc::clone(&idle), Arc::clone(&queue));
                thread::spawn(move || {
                    loop {
                        if queue.pop() {
                            return;
                        }
                        mask.clear_if_empty(1, || queue.is_empty());
                        idle.announce(1);
                        if mask.load() & 1 == 0 {
                            thread::park();
                        }
                        idle.retract(1);
                    }
                })
            };
            queue.push();
            mask.mark_then(1, |_| {
                if idle.claim_one(1).is_some() {
                    worker.thread().unpark();
                }
            });
            worker.join().unwrap();
        });
    }
}

#[test]
fn admission_is_fenced_by_suspension() {
    loom::model(|| {
        let group = Arc::new(admission::Admission::new());
        let suspended = Arc::new(AtomicU64::new(0));
        let dispatcher = {
            let (group, suspended) = (Arc::clone(&group), Arc::clone(&suspended));
            thread::spawn(move || group.admit(4, admission::Sigma::Count, &suspended, 1))
        };
        admission::Admission::suspend(&suspended, 1);
        let seen_running = group.running();
        let admitted = dispatcher.join().unwrap();
        if admitted {
            assert_eq!(seen_running, 1, "an admitted task escaped the drain check");
        }
    });
}

#[test]
fn sigma_one_admits_one_task() {
    loom::model(|| {
        let group = Arc::new(admission::Admission::new());
        let suspended = Arc::new(AtomicU64::new(0));
        let spawn = || {
            let (group, suspended) = (Arc::clone(&group), Arc::clone(&suspended));
            thread::spawn(move || group.admit(1, admission::Sigma::Enforce, &suspended, 1))
        };
        let (a, b) = (spawn(), spawn());
        let admitted = [a.join().unwrap(), b.join().unwrap()];
        assert_eq!(admitted.iter().filter(|&&x| x).count(), 1);
        assert_eq!(group.running(), 1);
    });
}

/// An affiliate (a thread outside the pools) ends the task that held a
/// sigma = 1 group at its bound while a worker, finding the group's queued
/// task inadmissible, parks: the release path (`Executor::run_admitted`,
/// then `Shared::released_at_bound`) must wake it, or the worker's re-check
/// (`PoolScheduler::has_work` under an enforcing policy) must see the slot.
#[test]
fn release_at_bound_wakes_a_parking_worker_or_it_sees_the_slot() {
    loom::model(|| {
        let mask = Arc::new(ready::ReadyMask::new());
        let idle = Arc::new(idle::IdleSet::new());
        let group = Arc::new(admission::Admission::new());
        let suspended = Arc::new(AtomicU64::new(0));
        let queue = Arc::new(Queue {
            len: AtomicUsize::new(0),
        });
        // The affiliate's task holds the group's only slot; one task waits.
        assert!(group.admit(1, admission::Sigma::Enforce, &suspended, 1));
        queue.push();
        mask.mark(1);
        let worker = {
            let (mask, idle, group, suspended, queue) = (
                Arc::clone(&mask),
                Arc::clone(&idle),
                Arc::clone(&group),
                Arc::clone(&suspended),
                Arc::clone(&queue),
            );
            thread::spawn(move || {
                loop {
                    if group.admit(1, admission::Sigma::Enforce, &suspended, 1) {
                        if queue.pop() {
                            return;
                        }
                        group.release();
                    }
                    idle.announce(1);
                    let has_work = mask.load() & 1 != 0 && group.running() < 1;
                    if !has_work {
                        thread::park();
                    }
                    idle.retract(1);
                }
            })
        };
        let before = group.release();
        if before >= 1 {
            loom::sync::atomic::fence(Ordering::SeqCst);
            if mask.load() & 1 != 0 && idle.claim_one(1).is_some() {
                worker.thread().unpark();
            }
        }
        worker.join().unwrap();
    });
}
