//! Controller metrics and their Prometheus text exposition (`--metrics`).
//!
//! Counters are relaxed atomics; latency histograms (microseconds, 1 µs to
//! 1 h) sit behind mutexes taken once per reply.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;

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

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds")
}

/// Counters and histograms of one controller.
#[derive(Debug)]
pub struct Metrics {
    requests: [AtomicU64; 6],
    errors: [AtomicU64; 6],
    bytes: [AtomicU64; 6],
    latency_us: [Mutex<Histogram<u64>>; 6],
    /// Connections open now.
    pub connections: AtomicU64,
    /// Connections accepted since start.
    pub connections_total: AtomicU64,
    /// Connections closed for a protocol violation.
    pub protocol_errors: AtomicU64,
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
            latency_us: std::array::from_fn(|_| Mutex::new(histogram())),
            connections: AtomicU64::new(0),
            connections_total: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
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
#[derive(Debug, Clone, Default)]
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
}

impl Metrics {
    /// Record a completed request.
    pub fn record(&self, op: Op, bytes: u64, ok: bool, latency: Duration) {
        let i = op as usize;
        self.requests[i].fetch_add(1, Ordering::Relaxed);
        if ok {
            self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.errors[i].fetch_add(1, Ordering::Relaxed);
        }
        let us = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let _ = self.latency_us[i].lock().record(us);
    }

    /// Requests of `op` completed so far.
    pub fn requests(&self, op: Op) -> u64 {
        self.requests[op as usize].load(Ordering::Relaxed)
    }

    /// Errors replied for `op`.
    pub fn errors(&self, op: Op) -> u64 {
        self.errors[op as usize].load(Ordering::Relaxed)
    }

    /// Render the Prometheus text format.
    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::with_capacity(8192);
        self.render_requests(&mut out);
        write_samples(&mut out, self.connection_and_cache_samples(g));
        write_samples(&mut out, self.nvs_destage_and_queue_samples(g));
        write_samples(&mut out, self.recovery_and_volume_samples(g));
        render_ratios(&mut out, g);
        render_rungs(&mut out, g);
        render_device_errors(&mut out, g);
        if let Some(r) = &g.rcs {
            render_rcs(&mut out, r);
        }
        out
    }

    /// The per-command families (requests, errors, bytes, latency): their
    /// headers first, then every command's samples.
    fn render_requests(&self, out: &mut String) {
        let mut family = |name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        family(
            "rebound_requests_total",
            "counter",
            "NBD requests completed, by command.",
        );
        family(
            "rebound_request_errors_total",
            "counter",
            "NBD requests answered with an error.",
        );
        family(
            "rebound_bytes_total",
            "counter",
            "Payload bytes moved, by command.",
        );
        family(
            "rebound_request_latency_seconds",
            "summary",
            "Request latency from receipt to reply.",
        );
        let mut lines = String::new();
        for op in Op::ALL {
            let i = op as usize;
            let l = op.name();
            let _ = writeln!(
                lines,
                "rebound_requests_total{{op=\"{l}\"}} {}",
                self.requests[i].load(Ordering::Relaxed)
            );
            let _ = writeln!(
                lines,
                "rebound_request_errors_total{{op=\"{l}\"}} {}",
                self.errors[i].load(Ordering::Relaxed)
            );
            let _ = writeln!(
                lines,
                "rebound_bytes_total{{op=\"{l}\"}} {}",
                self.bytes[i].load(Ordering::Relaxed)
            );
            let h = self.latency_us[i].lock();
            for q in [0.5, 0.9, 0.99, 0.999] {
                let v = if h.is_empty() {
                    0
                } else {
                    h.value_at_quantile(q)
                };
                let _ = writeln!(
                    lines,
                    "rebound_request_latency_seconds{{op=\"{l}\",quantile=\"{q}\"}} {}",
                    v as f64 / 1e6
                );
            }
            let _ = writeln!(
                lines,
                "rebound_request_latency_seconds_count{{op=\"{l}\"}} {}",
                h.len()
            );
            let sum = h.mean() * h.len() as f64 / 1e6;
            let _ = writeln!(
                lines,
                "rebound_request_latency_seconds_sum{{op=\"{l}\"}} {sum}"
            );
        }
        out.push_str(&lines);
    }

    /// Connections, and how reads were served.
    fn connection_and_cache_samples(&self, g: &Gauges) -> [Sample; 7] {
        [
            (
                "rebound_connections",
                "gauge",
                "Open NBD connections.",
                self.connections.load(Ordering::Relaxed),
            ),
            (
                "rebound_connections_total",
                "counter",
                "NBD connections accepted.",
                self.connections_total.load(Ordering::Relaxed),
            ),
            (
                "rebound_protocol_errors_total",
                "counter",
                "Connections closed for protocol violations.",
                self.protocol_errors.load(Ordering::Relaxed),
            ),
            (
                "rebound_cache_hits_total",
                "counter",
                "Reads served from cache frames.",
                g.cache.0,
            ),
            (
                "rebound_cache_nvs_hits_total",
                "counter",
                "Reads served from NVS records.",
                g.cache.1,
            ),
            (
                "rebound_cache_misses_total",
                "counter",
                "Reads staged from the devices.",
                g.cache.2,
            ),
            (
                "rebound_cache_frames_rebuilt_total",
                "counter",
                "Cache control blocks that failed their check word.",
                g.frames_rebuilt,
            ),
        ]
    }

    /// The NVS, destage, and the device queues.
    fn nvs_destage_and_queue_samples(&self, g: &Gauges) -> [Sample; 6] {
        [
            (
                "rebound_nvs_slots_used",
                "gauge",
                "NVS slots holding records.",
                g.nvs.0,
            ),
            ("rebound_nvs_slots", "gauge", "NVS slots in total.", g.nvs.1),
            (
                "rebound_dirty_tracks",
                "gauge",
                "Tracks with data not yet destaged.",
                g.dirty_tracks,
            ),
            (
                "rebound_destaged_tracks_total",
                "counter",
                "Tracks destaged to the devices.",
                self.destaged_tracks.load(Ordering::Relaxed),
            ),
            (
                "rebound_device_queue_full_total",
                "counter",
                "Device submissions refused because the queue was full (the I/O backed off).",
                g.device_queue.0,
            ),
            (
                "rebound_device_unsolicited_completions_total",
                "counter",
                "Device completions that matched no outstanding submission (ignored).",
                g.device_queue.1,
            ),
        ]
    }

    /// Control blocks, Log(Lock) rollbacks and escalations, the volume,
    /// lost tracks, scrub and destage errors.
    fn recovery_and_volume_samples(&self, g: &Gauges) -> [Sample; 10] {
        [
            (
                "rebound_control_blocks_free",
                "gauge",
                "Request control blocks free.",
                g.control_blocks.0,
            ),
            (
                "rebound_control_blocks_reclaimed_total",
                "counter",
                "Leaked request control blocks reclaimed by an exhausted pool's audit.",
                g.control_blocks.1,
            ),
            (
                "rebound_loglock_rollbacks_total",
                "counter",
                "Writes failing inside cache.apply that Log(Lock) let roll back alone (rung 1).",
                self.apply_rollbacks.load(Ordering::Relaxed),
            ),
            (
                "rebound_loglock_escalations_total",
                "counter",
                "Writes failing inside cache.apply whose shards another request had touched (rung 4).",
                self.apply_escalations.load(Ordering::Relaxed),
            ),
            (
                "rebound_volume_devices_degraded",
                "gauge",
                "Devices of the volume lost or being rebuilt onto a replacement.",
                g.volume.0,
            ),
            (
                "rebound_volume_rebuild_slots_remaining",
                "gauge",
                "4 KiB slots of replacement devices still to rebuild.",
                g.volume.1,
            ),
            (
                "rebound_lost_tracks",
                "gauge",
                "Tracks whose newest acknowledged data is lost: the NVS record failed its data checksum and no cached copy exists (reads answer EIO until the track is written again).",
                g.lost_tracks,
            ),
            (
                "rebound_scrub_records_checked_total",
                "counter",
                "Dirty NVS records whose data the scrub checked.",
                g.scrub.0,
            ),
            (
                "rebound_scrub_records_repaired_total",
                "counter",
                "Damaged NVS records the scrub repaired from their cached copy.",
                g.scrub.1,
            ),
            (
                "rebound_destage_errors_total",
                "counter",
                "Destage attempts that failed.",
                self.destage_errors.load(Ordering::Relaxed),
            ),
        ]
    }
}

/// One single-sample family: name, kind, help, value.
type Sample = (&'static str, &'static str, &'static str, u64);

/// Write each single-sample family with its header.
fn write_samples(out: &mut String, samples: impl IntoIterator<Item = Sample>) {
    for (name, kind, help, value) in samples {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
}

/// The cache hit ratio and the NVS fill ratio.
fn render_ratios(out: &mut String, g: &Gauges) {
    let reads = g.cache.0 + g.cache.1 + g.cache.2;
    let ratio = if reads == 0 {
        0.0
    } else {
        (g.cache.0 + g.cache.1) as f64 / reads as f64
    };
    let _ = writeln!(
        out,
        "# HELP rebound_cache_hit_ratio Reads served without a device read.\n# TYPE rebound_cache_hit_ratio gauge\nrebound_cache_hit_ratio {ratio}"
    );
    let fill = if g.nvs.1 == 0 {
        0.0
    } else {
        g.nvs.0 as f64 / g.nvs.1 as f64
    };
    let _ = writeln!(
        out,
        "# HELP rebound_nvs_fill_ratio Fraction of NVS slots in use.\n# TYPE rebound_nvs_fill_ratio gauge\nrebound_nvs_fill_ratio {fill}"
    );
}

/// Device errors by device and operation (the failing device, named).
fn render_device_errors(out: &mut String, g: &Gauges) {
    let name = "rebound_device_errors_total";
    let _ = writeln!(
        out,
        "# HELP {name} Errors the backend devices returned, by device and operation.\n# TYPE {name} counter"
    );
    for (d, errors) in g.device_errors.iter().enumerate() {
        for (op, n) in ["read", "write", "sync"].iter().zip(errors) {
            let _ = writeln!(out, "{name}{{device=\"{d}\",op=\"{op}\"}} {n}");
        }
    }
}

/// Recoveries, time spent and requests affected, by rung of the ladder.
fn render_rungs(out: &mut String, g: &Gauges) {
    for (name, help, value) in [
        (
            "rebound_recoveries_total",
            "Recoveries performed, by rung of the recovery ladder.",
            (|r: &RungTotals| r.count.to_string()) as fn(&RungTotals) -> String,
        ),
        (
            "rebound_recovery_seconds_total",
            "Time spent recovering, by rung (0 for redrives, whose cost is request latency).",
            |r| r.seconds.to_string(),
        ),
        (
            "rebound_recovery_requests_total",
            "Requests affected by recoveries, by rung.",
            |r| r.requests.to_string(),
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for r in &g.rungs {
            let _ = writeln!(
                out,
                "{name}{{rung=\"{}\",name=\"{}\"}} {}",
                r.rung,
                r.name,
                value(r)
            );
        }
    }
}

/// A per-group rcs metric: name, help, and how to read it.
type GroupField = (&'static str, &'static str, fn(&rcs::GroupMetrics) -> u64);

/// The rcs runtime's families: per-group counters and gauges, affiliated
/// tasks, recovery times, emulated recovery, and pool busy time.
fn render_rcs(out: &mut String, r: &rcs::MetricsSnapshot) {
    for (name, help, f) in group_fields() {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for g in &r.groups {
            let _ = writeln!(out, "{name}{{group=\"{}\"}} {}", g.name, f(g));
        }
    }
    render_rcs_times(out, r);
}

/// Every per-group rcs counter and gauge that is one number per group.
fn group_fields() -> [GroupField; 10] {
    [
        (
            "rebound_rcs_dispatched_total",
            "Tasks dispatched, by recovery group.",
            |g| g.dispatched,
        ),
        (
            "rebound_rcs_completed_total",
            "Tasks completed, by recovery group.",
            |g| g.completed,
        ),
        (
            "rebound_rcs_failed_total",
            "Tasks failed to group or system level.",
            |g| g.failed,
        ),
        (
            "rebound_rcs_aborted_total",
            "Tasks aborted by a recovery point.",
            |g| g.aborted,
        ),
        (
            "rebound_rcs_retried_total",
            "Recovery-point retries.",
            |g| g.retried,
        ),
        (
            "rebound_rcs_overdue_total",
            "Tasks declared past their deadline by the watchdog.",
            |g| g.overdue,
        ),
        (
            "rebound_rcs_recoveries_total",
            "Group recoveries completed.",
            |g| g.recoveries,
        ),
        (
            "rebound_rcs_injected_total",
            "Faults injected at dispatch by the group's fault emulation (inject group-fault).",
            |g| g.injected,
        ),
        ("rebound_rcs_running", "Tasks running now.", |g| {
            u64::from(g.running)
        }),
        ("rebound_rcs_queued", "Tasks queued now.", |g| {
            g.queued.iter().sum::<usize>() as u64
        }),
    ]
}

/// Affiliated tasks, group recovery times, the fault emulation's held
/// time, and pool busy time.
fn render_rcs_times(out: &mut String, r: &rcs::MetricsSnapshot) {
    let _ = writeln!(
        out,
        "# HELP rebound_rcs_affiliated_total Tasks run by connection threads themselves (counted in their groups too).\n# TYPE rebound_rcs_affiliated_total counter\nrebound_rcs_affiliated_total {}",
        r.affiliated
    );
    let _ = writeln!(
        out,
        "# HELP rebound_rcs_recovery_seconds Group recovery time.\n# TYPE rebound_rcs_recovery_seconds summary"
    );
    for g in &r.groups {
        let t = &g.recovery_time;
        let _ = writeln!(
            out,
            "rebound_rcs_recovery_seconds{{group=\"{}\",quantile=\"0.99\"}} {}",
            g.name,
            t.p99.as_secs_f64()
        );
        let _ = writeln!(
            out,
            "rebound_rcs_recovery_seconds_count{{group=\"{}\"}} {}",
            g.name, t.count
        );
    }
    let _ = writeln!(
        out,
        "# HELP rebound_rcs_emulated_recovery_seconds_total Processor time held by the fault emulation's recoveries (the failing task's, and every task of the group running at the start of or dispatched during one).\n# TYPE rebound_rcs_emulated_recovery_seconds_total counter"
    );
    for g in &r.groups {
        let _ = writeln!(
            out,
            "rebound_rcs_emulated_recovery_seconds_total{{group=\"{}\"}} {}",
            g.name,
            g.emulated_hold.as_secs_f64()
        );
    }
    let _ = writeln!(
        out,
        "# HELP rebound_rcs_pool_busy_seconds_total Time each resource pool spent busy.\n# TYPE rebound_rcs_pool_busy_seconds_total counter"
    );
    for p in &r.pools {
        let _ = writeln!(
            out,
            "rebound_rcs_pool_busy_seconds_total{{pool=\"{}\"}} {}",
            p.id.0,
            p.busy.as_secs_f64()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_counters_quantiles_and_ratios() {
        let m = Metrics::default();
        m.record(Op::Read, 4096, true, Duration::from_micros(120));
        m.record(Op::Write, 4096, false, Duration::from_micros(80));
        let text = m.render(&Gauges {
            cache: (3, 1, 4),
            nvs: (10, 100),
            volume: (1, 300),
            lost_tracks: 2,
            scrub: (40, 1),
            rungs: vec![RungTotals {
                rung: 4,
                name: "system",
                count: 2,
                seconds: 0.0015,
                requests: 17,
            }],
            ..Gauges::default()
        });
        assert!(text.contains("rebound_recoveries_total{rung=\"4\",name=\"system\"} 2"));
        assert!(text.contains("rebound_recovery_seconds_total{rung=\"4\",name=\"system\"} 0.0015"));
        assert!(text.contains("rebound_recovery_requests_total{rung=\"4\",name=\"system\"} 17"));
        assert!(text.contains("rebound_requests_total{op=\"read\"} 1"));
        assert!(text.contains("rebound_request_errors_total{op=\"write\"} 1"));
        assert!(text.contains("rebound_bytes_total{op=\"read\"} 4096"));
        assert!(text.contains("rebound_cache_hit_ratio 0.5"));
        assert!(text.contains("rebound_nvs_fill_ratio 0.1"));
        assert!(text.contains("rebound_volume_devices_degraded 1"));
        assert!(text.contains("rebound_volume_rebuild_slots_remaining 300"));
        assert!(text.contains("rebound_lost_tracks 2"));
        assert!(text.contains("rebound_scrub_records_checked_total 40"));
        assert!(text.contains("rebound_scrub_records_repaired_total 1"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }
}
