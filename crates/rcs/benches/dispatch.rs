//! Dispatch throughput of empty tasks (paper §6.3.1, Figure 10: "the number
//! of dispatches are almost identical" with 1, 4 and 16 recovery groups),
//! under each policy, with tokio's multi-thread runtime as the reference.
//!
//! One iteration submits `BATCH` empty tasks from the benchmark thread
//! (round-robin over the groups) and waits until all have run. tokio is
//! measured the same way (`Runtime::spawn` from outside the runtime), and
//! also spawning from inside a task (its fast path, the worker-local queue).
//! Both runtimes get the same number of worker threads (the core count).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rcs::{GroupSpec, Policy, PoolId, Priority, Runtime};

const BATCH: u64 = 10_000;
static DONE: AtomicU64 = AtomicU64::new(0);

fn workers() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

fn wait_for(target: u64) {
    let mut spins = 0u32;
    while DONE.load(Ordering::Acquire) < target {
        spins += 1;
        if spins.is_multiple_of(64) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

fn rcs_runtime(policy: Policy, groups: usize) -> (Runtime, Vec<rcs::GroupId>) {
    let workers = workers();
    let mut b = Runtime::builder();
    b.workers(workers)
        .policy(policy)
        .queue_capacity(BATCH as usize + 1024);
    let ids = (0..groups)
        .map(|g| {
            b.group(
                GroupSpec::new(format!("g{g}"))
                    .sigma(workers as u32)
                    .pools([PoolId((g % workers) as u16)]),
            )
        })
        .collect();
    (b.build().expect("valid benchmark runtime"), ids)
}

fn bench_rcs(c: &mut Criterion) {
    let mut group = c.benchmark_group("dispatch");
    group.throughput(Throughput::Elements(BATCH));
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    for policy in Policy::ALL {
        for groups in [1usize, 4, 16] {
            let (runtime, ids) = rcs_runtime(policy, groups);
            let handle = runtime.handle();
            group.bench_function(BenchmarkId::new(policy.name(), groups), |b| {
                b.iter(|| {
                    let target = DONE.load(Ordering::Acquire) + BATCH;
                    for n in 0..BATCH as usize {
                        handle
                            .submit(ids[n % groups], Priority::Medium, |_| {
                                DONE.fetch_add(1, Ordering::Release);
                                Ok(())
                            })
                            .expect("queue has room for a batch");
                    }
                    wait_for(target);
                });
            });
            drop(runtime);
        }
    }
    group.finish();
}

fn bench_tokio(c: &mut Criterion) {
    let mut group = c.benchmark_group("dispatch");
    group.throughput(Throughput::Elements(BATCH));
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_secs(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers())
        .build()
        .expect("tokio runtime");
    group.bench_function("tokio/spawn-from-outside", |b| {
        b.iter(|| {
            let target = DONE.load(Ordering::Acquire) + BATCH;
            for _ in 0..BATCH {
                rt.spawn(async {
                    DONE.fetch_add(1, Ordering::Release);
                });
            }
            wait_for(target);
        });
    });
    group.bench_function("tokio/spawn-from-task", |b| {
        b.iter(|| {
            let target = DONE.load(Ordering::Acquire) + BATCH;
            rt.spawn(async {
                for _ in 0..BATCH {
                    tokio::spawn(async {
                        DONE.fetch_add(1, Ordering::Release);
                    });
                }
            });
            wait_for(target);
        });
    });
    group.finish();
}

criterion_group!(benches, bench_rcs, bench_tokio);
criterion_main!(benches);
