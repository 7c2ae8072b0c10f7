//! What recording one reply's latency costs on the hot path: the
//! controller's lock-free bucketed histogram against what it replaced (an
//! hdrhistogram behind a mutex per command) and prometheus-client's own
//! `Histogram` (a `RwLock` write per observe). Alone on one thread, and
//! with every thread of the machine (at least 2) recording into the same
//! histogram, as workers replying to the same command do.
//!
//! `cargo bench -p controller --bench metrics_record`

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use controller::metrics::Histogram;
use controller::metrics::histogram::REQUEST_BOUNDS_NS;
use criterion::{Criterion, criterion_group, criterion_main};
use parking_lot::Mutex;

/// One way of recording a latency, shared by every thread.
trait Record: Sync {
    fn record(&self, d: Duration);
}

/// Before: microseconds into an hdrhistogram behind a mutex.
struct HdrMutex(Mutex<hdrhistogram::Histogram<u64>>);

impl Record for HdrMutex {
    fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        let _ = self.0.lock().record(us);
    }
}

/// prometheus-client's histogram (seconds as f64).
struct ClientHistogram(prometheus_client::metrics::histogram::Histogram);

impl Record for ClientHistogram {
    fn record(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

/// Now: the controller's lock-free histogram.
struct Atomic(Histogram);

impl Record for Atomic {
    fn record(&self, d: Duration) {
        self.0.observe(d);
    }
}

/// A spread of latencies, 20 µs to ~2.6 ms, as replies see them.
fn latency(i: u64) -> Duration {
    Duration::from_nanos(20_000 << (i % 8))
}

/// `iters` records split over `threads` threads started together; the
/// wall time of the whole.
fn contended(r: &dyn Record, threads: u64, iters: u64) -> Duration {
    let start = Barrier::new(threads as usize + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                start.wait();
                for i in 0..iters / threads {
                    r.record(black_box(latency(i)));
                }
            });
        }
        start.wait();
        let t = Instant::now();
        // The scope joins the threads before returning.
        t
    })
    .elapsed()
}

fn record(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().max(2)) as u64;
    let cases: [(&str, Box<dyn Record>); 3] = [
        (
            "hdrhistogram + mutex (before)",
            Box::new(HdrMutex(Mutex::new(
                hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap(),
            ))),
        ),
        (
            "prometheus-client Histogram (RwLock)",
            Box::new(ClientHistogram(
                prometheus_client::metrics::histogram::Histogram::new(
                    REQUEST_BOUNDS_NS.iter().map(|&b| b as f64 / 1e9),
                ),
            )),
        ),
        (
            "lock-free buckets (now)",
            Box::new(Atomic(Histogram::new(REQUEST_BOUNDS_NS))),
        ),
    ];
    let mut g = c.benchmark_group("record one reply's latency");
    g.measurement_time(Duration::from_secs(3));
    for (name, r) in &cases {
        g.bench_function(format!("{name}, 1 thread"), |b| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                r.record(black_box(latency(i)));
            });
        });
        g.bench_function(format!("{name}, {threads} threads"), |b| {
            b.iter_custom(|iters| contended(r.as_ref(), threads, iters.max(threads)));
        });
    }
    g.finish();
}

criterion_group!(benches, record);
criterion_main!(benches);
