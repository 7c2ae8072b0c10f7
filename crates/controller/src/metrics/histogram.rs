//! Bucketed histograms for the OpenMetrics exposition: a lock-free live
//! [`Histogram`] (one relaxed atomic add per bucket hit, one for the sum,
//! on a per-thread stripe; no lock on the reply path) and the
//! [`HistogramSnapshot`] a scrape encodes through prometheus-client.
//!
//! prometheus-client's own `Histogram` takes a write lock (a `RwLock`
//! around the buckets) on every `observe`, which every worker replying to
//! the same command would contend on; this one keeps the same exposition
//! and pays two atomic adds on a cache line its thread rarely shares.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// Request latency bucket bounds, nanoseconds: 1-2.5-5 steps from 10 µs
/// to 10 s (anything longer lands in `+Inf`).
pub const REQUEST_BOUNDS_NS: &[u64] = &[
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Recovery duration bucket bounds, nanoseconds: 10 µs (a redrive, which
/// records 0) to 5 min (a restart or a rebuild).
pub const RECOVERY_BOUNDS_NS: &[u64] = &[
    10_000,
    100_000,
    1_000_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
    30_000_000_000,
    60_000_000_000,
    300_000_000_000,
];

/// Stripes of a live [`Histogram`]: each thread adds into one, chosen once
/// per thread, so workers replying at once do not pull the same cache line
/// back and forth; a scrape sums them.
const STRIPES: usize = 8;

thread_local! {
    /// This thread's stripe.
    static STRIPE: usize = {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) as usize % STRIPES
    };
}

/// A live histogram of durations over fixed bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds_ns: &'static [u64],
    /// `STRIPES` stripes of `stride` counters: one per bound, then `+Inf`
    /// (observations in each bucket alone; the exposition accumulates
    /// them), then the sum in nanoseconds. The stride leaves at least a
    /// cache line (8 counters) between two stripes' counters.
    cells: Box<[AtomicU64]>,
    stride: usize,
}

impl Histogram {
    /// An empty histogram over `bounds_ns` (ascending upper bounds).
    pub fn new(bounds_ns: &'static [u64]) -> Self {
        debug_assert!(bounds_ns.is_sorted());
        let stride = (bounds_ns.len() + 2 + 8).next_multiple_of(8);
        Self {
            bounds_ns,
            cells: (0..STRIPES * stride).map(|_| AtomicU64::new(0)).collect(),
            stride,
        }
    }

    /// Count one observation: two relaxed atomic adds on this thread's
    /// stripe, no lock.
    #[inline]
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = self.bounds_ns.partition_point(|&b| b < ns);
        let stripe = STRIPE.with(|s| *s) * self.stride;
        self.cells[stripe + i].fetch_add(1, Ordering::Relaxed);
        self.cells[stripe + self.bounds_ns.len() + 1].fetch_add(ns, Ordering::Relaxed);
    }

    /// The counts now, summed over the stripes. Read counter by counter
    /// while writers go on, so the sum may be a few observations ahead of
    /// or behind the buckets; the count is the buckets' total, so `+Inf`
    /// always equals `_count`.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let n = self.bounds_ns.len() + 1;
        let mut counts = vec![0u64; n];
        let mut sum_ns = 0u64;
        for stripe in self.cells.chunks(self.stride) {
            for (c, cell) in counts.iter_mut().zip(stripe) {
                *c += cell.load(Ordering::Relaxed);
            }
            sum_ns = sum_ns.wrapping_add(stripe[n].load(Ordering::Relaxed));
        }
        HistogramSnapshot {
            bounds_ns: self.bounds_ns,
            counts,
            sum_seconds: sum_ns as f64 / 1e9,
        }
    }
}

/// A histogram's counts at one instant, ready to encode.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    bounds_ns: &'static [u64],
    counts: Vec<u64>,
    sum_seconds: f64,
}

impl HistogramSnapshot {
    /// An empty snapshot over `bounds_ns`.
    pub fn empty(bounds_ns: &'static [u64]) -> Self {
        Self {
            bounds_ns,
            counts: vec![0; bounds_ns.len() + 1],
            sum_seconds: 0.0,
        }
    }

    /// The recorded values of an hdrhistogram kept in microseconds (rcs's
    /// group recovery times), bucketed over `bounds_ns`.
    pub fn from_micros(h: &hdrhistogram::Histogram<u64>, bounds_ns: &'static [u64]) -> Self {
        let mut s = Self::empty(bounds_ns);
        for v in h.iter_recorded() {
            let ns = v.value_iterated_to().saturating_mul(1000);
            let i = bounds_ns.partition_point(|&b| b < ns);
            s.counts[i] += v.count_at_value();
            s.sum_seconds += v.value_iterated_to() as f64 / 1e6 * v.count_at_value() as f64;
        }
        s
    }

    /// Add `other` (over the same bounds) into this one.
    pub fn merge(&mut self, other: &Self) {
        debug_assert_eq!(self.bounds_ns, other.bounds_ns);
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum_seconds += other.sum_seconds;
    }

    /// Observations counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Sum of the observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_seconds
    }
}

impl prometheus_client::metrics::TypedMetric for HistogramSnapshot {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for HistogramSnapshot {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // prometheus-client writes `f64::MAX` as `le="+Inf"`.
        let buckets: Vec<(f64, u64)> = self
            .bounds_ns
            .iter()
            .map(|&b| b as f64 / 1e9)
            .chain(std::iter::once(f64::MAX))
            .zip(self.counts.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(self.sum_seconds, self.count(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_at_or_above_them() {
        let h = Histogram::new(REQUEST_BOUNDS_NS);
        h.observe(Duration::ZERO);
        h.observe(Duration::from_micros(10));
        h.observe(Duration::from_micros(11));
        h.observe(Duration::from_secs(60));
        let s = h.snapshot();
        assert_eq!(s.counts[0], 2, "0 and exactly 10 µs are <= 10 µs");
        assert_eq!(s.counts[1], 1);
        assert_eq!(s.counts[REQUEST_BOUNDS_NS.len()], 1, "+Inf");
        assert_eq!(s.count(), 4);
        assert!((s.sum_seconds() - 60.000_021).abs() < 1e-9);
    }

    #[test]
    fn every_thread_s_observations_are_counted() {
        let h = Histogram::new(REQUEST_BOUNDS_NS);
        std::thread::scope(|s| {
            for t in 0..(2 * STRIPES as u64) {
                let h = &h;
                s.spawn(move || {
                    for _ in 0..100 {
                        h.observe(Duration::from_micros(20 + t % 5));
                    }
                });
            }
        });
        let s = h.snapshot();
        assert_eq!(s.count(), 1600);
        assert_eq!(s.counts[1], 1600, "20-24 µs: above 10 µs, at most 25 µs");
    }

    #[test]
    fn an_hdr_histogram_in_microseconds_is_bucketed_and_merged() {
        let mut hdr = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        hdr.record_n(20_000, 3).unwrap(); // 20 ms
        hdr.record(2).unwrap(); // 2 µs
        let mut s = HistogramSnapshot::from_micros(&hdr, RECOVERY_BOUNDS_NS);
        assert_eq!(s.counts[0], 1);
        assert_eq!(s.counts[5], 3, "20 ms is <= 25 ms");
        s.merge(&s.clone());
        assert_eq!(s.count(), 8);
        // hdrhistogram keeps 3 significant digits: the sum is as close.
        assert!((s.sum_seconds() - 2.0 * 0.060_002).abs() < 2.0 * 0.060_002 * 1e-3);
    }
}
