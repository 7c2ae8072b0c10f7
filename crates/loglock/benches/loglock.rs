//! What tracking costs an acquire+release (paper §5.4: "fewer than 200
//! assembly instructions were added to the code path" of a tracked lock).
//!
//! Peers in the same run: a plain parking_lot mutex; a TrackedMutex nobody
//! tracks (target: within 5% of plain); one tracked by another actor (this
//! thread's accesses are logged); one tracked by the accessing actor itself
//! (logged, and the first write of each guard saves an undo value; the
//! actor restarts every 64 accesses, a tracking duration of a few µs as in
//! the paper's Table 5). Target: tracked under 2x plain. Each uncontended
//! and contended (a second thread hammering the same lock).

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use loglock::{Actor, TrackedMutex};
use parking_lot::Mutex;

/// How the tracked mutex is set up.
#[derive(Clone, Copy)]
enum Mode {
    Plain,
    Untracked,
    TrackedByOther,
    TrackedBySelf,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain parking_lot",
            Self::Untracked => "untracked",
            Self::TrackedByOther => "tracked by another actor",
            Self::TrackedBySelf => "tracked by this actor",
        }
    }
}

/// `n` acquire + increment + release on the lock of `mode`; returns the
/// time taken on this thread.
fn run(mode: Mode, plain: &Mutex<u64>, tracked: &TrackedMutex<u64>, n: u64) -> Duration {
    let start = Instant::now();
    match mode {
        Mode::Plain => {
            for _ in 0..n {
                *plain.lock() += 1;
            }
        }
        Mode::Untracked | Mode::TrackedByOther => {
            for _ in 0..n {
                *tracked.lock() += 1;
            }
        }
        Mode::TrackedBySelf => {
            let mut id = 1u64 << 40;
            let mut i = 0;
            while i < n {
                id += 1;
                let actor = Actor::begin(id);
                actor.start_tracking(tracked).unwrap();
                for _ in 0..64.min(n - i) {
                    *tracked.lock() += 1;
                    i += 1;
                }
            }
        }
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    for contended in [false, true] {
        let mut g = c.benchmark_group(if contended {
            "acquire+release contended"
        } else {
            "acquire+release uncontended"
        });
        g.measurement_time(Duration::from_secs(3));
        for mode in [
            Mode::Plain,
            Mode::Untracked,
            Mode::TrackedByOther,
            Mode::TrackedBySelf,
        ] {
            let plain = Mutex::new(0u64);
            let tracked = TrackedMutex::new("bench", 0u64);
            // Another actor, on its own thread, tracks the lock for the
            // whole measurement (TrackedByOther) or nothing.
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                let (ready_tx, ready_rx) = std::sync::mpsc::channel();
                let (tracked_ref, stop_ref) = (&tracked, &stop);
                s.spawn(move || {
                    let actor = Actor::begin(1);
                    if matches!(mode, Mode::TrackedByOther) {
                        actor.start_tracking(tracked_ref).unwrap();
                    }
                    ready_tx.send(()).unwrap();
                    while !stop_ref.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                });
                ready_rx.recv().unwrap();
                g.bench_function(mode.name(), |b| {
                    b.iter_custom(|n| {
                        if !contended {
                            return run(mode, &plain, &tracked, n);
                        }
                        let busy = AtomicBool::new(true);
                        std::thread::scope(|s| {
                            s.spawn(|| {
                                let other = if matches!(mode, Mode::TrackedBySelf) {
                                    Mode::TrackedByOther
                                } else {
                                    mode
                                };
                                while busy.load(Ordering::Relaxed) {
                                    black_box(run(other, &plain, &tracked, 64));
                                }
                            });
                            let t = run(mode, &plain, &tracked, n);
                            busy.store(false, Ordering::Relaxed);
                            t
                        })
                    });
                });
                stop.store(true, Ordering::Relaxed);
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
