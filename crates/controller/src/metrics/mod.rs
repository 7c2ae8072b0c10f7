//! Controller metrics and their OpenMetrics exposition (`--metrics`),
//! encoded by prometheus-client.
//!
//! Counters are relaxed atomics bumped where things happen; request
//! latency per command is a bucketed [`Histogram`] (10 µs to 10 s, lock
//! free), so `rate()` over a window shows an incident as it happens. A
//! scrape takes a snapshot of these and of the rest of the controller
//! ([`Gauges`]) and encodes it through a prometheus-client collector
//! ([`families`]).

mod families;
pub mod histogram;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use histogram::{Histogram, HistogramSnapshot};

/// The content type of [`Metrics::render`]'s text (OpenMetrics 1.0).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Kinds of request, for per-command counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// READ.
    Read,
    /// WRITE.
    Write,
    /// FLUSH.
    Flush,
    /// TRIM.
    Trim,
    /// WRITE_ZEROES.
    WriteZeroes,
    /// Anything else (rejected).
    Other,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::Trim,
        Op::WriteZeroes,
        Op::Other,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
            Op::Other => "other",
        }
    }
}

/// Counters and histograms of one controller.
#[derive(Debug)]
pub struct Metrics {
    requests: [AtomicU64; 6],
    errors: [AtomicU64; 6],
    bytes: [AtomicU64; 6],
    latency: [Histogram; 6],
    /// Connections open now.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// Connections closed for a protocol violation.
    pub protocol_errors: AtomicU64,
    /// Connections that did not finish their handshake in time.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed because the client read no reply for
    /// `send_timeout`.
    pub slow_clients: AtomicU64,
    /// `sendmsg` calls that carried replies: replies leave in batches (a
    /// burst of requests read together, an epoch's commit), so requests
    /// over this counter is the replies each call carried.
    pub reply_sends: AtomicU64,
    /// Tracks written to the devices by destage.
    pub destaged_tracks: AtomicU64,
    /// Destage attempts that failed (retried).
    pub destage_errors: AtomicU64,
    /// Writes that failed inside `cache.apply` and Log(Lock) let roll back
    /// alone (rung 1).
    pub apply_rollbacks: AtomicU64,
    /// Writes that failed inside `cache.apply` where another request had
    /// touched their shards (escalated to rung 4).
    pub apply_escalations: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Default::default(),
            errors: Default::default(),
            bytes: Default::default(),
            latency: std::array::from_fn(|_| Histogram::new(histogram::REQUEST_BOUNDS_NS)),
            connections: AtomicU64::new(0),
            connections_total: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            handshake_timeouts: AtomicU64::new(0),
            slow_clients: AtomicU64::new(0),
            reply_sends: AtomicU64::new(0),
            destaged_tracks: AtomicU64::new(0),
            destage_errors: AtomicU64::new(0),
            apply_rollbacks: AtomicU64::new(0),
            apply_escalations: AtomicU64::new(0),
        }
    }
}

/// Point-in-time values the exposition needs from the rest of the controller.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// Cache hits, NVS hits, misses.
    pub cache: (u64, u64, u64),
    /// Frames that failed their check word.
    pub frames_rebuilt: u64,
    /// NVS slots in use and in total.
    pub nvs: (u64, u64),
    /// Dirty tracks.
    pub dirty_tracks: u64,
    /// Tracks whose newest data is lost (a damaged NVS record, no cached
    /// copy; see [`crate::engine::destage`]).
    pub lost_tracks: u64,
    /// Scrub: NVS records checked, and damaged ones repaired from the cache.
    pub scrub: (u64, u64),
    /// rcs metrics.
    pub rcs: Option<rcs::MetricsSnapshot>,
    /// Group recovery times, one per group of `rcs` in its order.
    pub group_recovery: Vec<HistogramSnapshot>,
    /// Per rung: name, recoveries, seconds spent, requests affected.
    pub rungs: Vec<RungTotals>,
    /// Device submissions refused as queue full, and unsolicited
    /// completions ignored (all devices).
    pub device_queue: (u64, u64),
    /// Request control blocks free, and leaked blocks reclaimed so far.
    pub control_blocks: (u64, u64),
    /// Devices lost or rebuilding, and replacement slots still to rebuild.
    pub volume: (u64, u64),
    /// Per device: errors seen on read, write, sync.
    pub device_errors: Vec<[u64; 3]>,
}

/// One rung's recovery totals for the exposition.
#[derive(Debug, Clone)]
pub struct RungTotals {
    /// Rung number (1-7).
    pub rung: u8,
    /// Rung name (`task`, `group`, ...).
    pub name: &'static str,
    /// Recoveries.
    pub count: u64,
    /// Time spent recovering, seconds.
    pub seconds: f64,
    /// Requests affected.
    pub requests: u64,
    /// How long each recovery took.
    pub durations: HistogramSnapshot,
}

impl Default for RungTotals {
    fn default() -> Self {
        Self {
            rung: 0,
            name: "",
            count: 0,
            seconds: 0.0,
            requests: 0,
            durations: HistogramSnapshot::empty(histogram::RECOVERY_BOUNDS_NS),
        }
    }
}

/// The controller's own counters at one scrape.
#[derive(Debug, Clone)]
struct Own {
    /// Per [`Op`]: requests, errors, bytes, latency.
    ops: Vec<(Op, [u64; 3], HistogramSnapshot)>,
    connections: u64,
    connections_total: u64,
    protocol_errors: u64,
    handshake_timeouts: u64,
    slow_clients: u64,
    reply_sends: u64,
    destaged_tracks: u64,
    destage_errors: u64,
    apply_rollbacks: u64,
    apply_escalations: u64,
}

impl Metrics {
    /// Record a completed request: three relaxed atomic adds and a
    /// histogram observation (two more), no lock.
    #[inline]
    pub fn record(&self, op: Op, bytes: u64, ok: bool, latency: Duration) {
        let i = op as usize;
        self.requests[i].fetch_add(1, Ordering::Relaxed);
        if ok {
            self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.errors[i].fetch_add(1, Ordering::Relaxed);
        }
        self.latency[i].observe(latency);
    }

    /// Requests of `op` completed so far.
    pub fn requests(&self, op: Op) -> u64 {
        self.requests[op as usize].load(Ordering::Relaxed)
    }

    /// Errors replied for `op`.
    pub fn errors(&self, op: Op) -> u64 {
        self.errors[op as usize].load(Ordering::Relaxed)
    }

    /// Render the exposition: OpenMetrics text ([`CONTENT_TYPE`]), ending
    /// in `# EOF`.
    pub fn render(&self, g: &Gauges) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(families::Exposition {
            own: self.own(),
            gauges: g.clone(),
        }));
        let mut out = String::with_capacity(16 << 10);
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// A snapshot of the counters kept here.
    fn own(&self) -> Own {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Own {
            ops: Op::ALL
                .iter()
                .map(|&op| {
                    let i = op as usize;
                    let counts = [
                        load(&self.requests[i]),
                        load(&self.errors[i]),
                        load(&self.bytes[i]),
                    ];
                    (op, counts, self.latency[i].snapshot())
                })
                .collect(),
            connections: load(&self.connections),
            connections_total: load(&self.connections_total),
            protocol_errors: load(&self.protocol_errors),
            handshake_timeouts: load(&self.handshake_timeouts),
            slow_clients: load(&self.slow_clients),
            reply_sends: load(&self.reply_sends),
            destaged_tracks: load(&self.destaged_tracks),
            destage_errors: load(&self.destage_errors),
            apply_rollbacks: load(&self.apply_rollbacks),
            apply_escalations: load(&self.apply_escalations),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gauges() -> Gauges {
        let mut durations = HistogramSnapshot::empty(histogram::RECOVERY_BOUNDS_NS);
        let live = Histogram::new(histogram::RECOVERY_BOUNDS_NS);
        live.observe(Duration::from_micros(750));
        live.observe(Duration::from_micros(750));
        durations.merge(&live.snapshot());
        Gauges {
            cache: (3, 1, 4),
            nvs: (10, 100),
            volume: (1, 300),
            lost_tracks: 2,
            scrub: (40, 1),
            device_errors: vec![[0, 5, 0]],
            rungs: vec![RungTotals {
                rung: 4,
                name: "system",
                count: 2,
                seconds: 0.0015,
                requests: 17,
                durations,
            }],
            ..Gauges::default()
        }
    }

    #[test]
    fn exposition_has_counters_histograms_and_ratios() {
        let m = Metrics::default();
        m.record(Op::Read, 4096, true, Duration::from_micros(120));
        m.record(Op::Write, 4096, false, Duration::from_micros(80));
        let text = m.render(&gauges());
        for want in [
            "rebound_build_info{version=\"",
            "rebound_recoveries_total{rung=\"4\",name=\"system\"} 2\n",
            "rebound_recovery_seconds_total{rung=\"4\",name=\"system\"} 0.0015\n",
            "rebound_recovery_requests_total{rung=\"4\",name=\"system\"} 17\n",
            "rebound_recovery_duration_seconds_count{rung=\"4\",name=\"system\"} 2\n",
            "rebound_recovery_duration_seconds_bucket{le=\"0.0001\",rung=\"4\",name=\"system\"} 0\n",
            "rebound_recovery_duration_seconds_bucket{le=\"0.001\",rung=\"4\",name=\"system\"} 2\n",
            "rebound_requests_total{op=\"read\"} 1\n",
            "rebound_request_errors_total{op=\"write\"} 1\n",
            "rebound_bytes_total{op=\"read\"} 4096\n",
            "rebound_request_duration_seconds_count{op=\"read\"} 1\n",
            "rebound_request_duration_seconds_bucket{le=\"0.0001\",op=\"read\"} 0\n",
            "rebound_request_duration_seconds_bucket{le=\"0.00025\",op=\"read\"} 1\n",
            "rebound_request_duration_seconds_bucket{le=\"+Inf\",op=\"read\"} 1\n",
            "rebound_request_duration_seconds_count{op=\"flush\"} 0\n",
            "rebound_cache_hit_ratio 0.5\n",
            "rebound_nvs_fill_ratio 0.1\n",
            "rebound_volume_devices_degraded 1\n",
            "rebound_volume_rebuild_slots_remaining 300\n",
            "rebound_lost_tracks 2\n",
            "rebound_scrub_records_checked_total 40\n",
            "rebound_scrub_records_repaired_total 1\n",
            "rebound_device_errors_total{device=\"0\",op=\"write\"} 5\n",
            "# TYPE rebound_request_duration_seconds histogram\n",
            "# TYPE rebound_requests counter\n",
        ] {
            assert!(text.contains(want), "no {want:?} in:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }

    #[test]
    fn every_family_is_declared_once() {
        let text = Metrics::default().render(&gauges());
        let mut families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        let n = families.len();
        families.sort_unstable();
        families.dedup();
        assert_eq!(families.len(), n, "a family declared twice:\n{text}");
    }
}
