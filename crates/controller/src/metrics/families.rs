//! The metric families of one scrape: a prometheus-client [`Collector`]
//! over a snapshot of the controller's counters and [`Gauges`], encoding
//! every family with its name, help and type.
//!
//! Names are written here as the samples appear (`rebound_requests_total`);
//! OpenMetrics names a counter's family without `_total`, which
//! [`descriptor`] strips.

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;

use super::{Gauges, HistogramSnapshot, Own, RungTotals};

/// One scrape's values, encoded when the registry asks.
#[derive(Debug)]
pub(super) struct Exposition {
    pub(super) own: Own,
    pub(super) gauges: Gauges,
}

impl Collector for Exposition {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let build = [("version", env!("CARGO_PKG_VERSION"))];
        let info = e.encode_descriptor(
            "rebound_build",
            "Build information.",
            None,
            MetricType::Info,
        )?;
        Info::new(build).encode(info)?;
        self.requests(&mut e)?;
        for (name, kind, help, value) in self
            .connection_and_cache_samples()
            .into_iter()
            .chain(self.nvs_destage_and_queue_samples())
            .chain(self.recovery_and_volume_samples())
        {
            single(&mut e, name, kind, help, value)?;
        }
        ratios(&mut e, &self.gauges)?;
        rungs(&mut e, &self.gauges.rungs)?;
        device_errors(&mut e, &self.gauges)?;
        if let Some(r) = &self.gauges.rcs {
            rcs_groups(&mut e, r)?;
            rcs_times(&mut e, r, &self.gauges.group_recovery)?;
        }
        Ok(())
    }
}

/// A family's header; a counter's name loses its `_total`, which the
/// encoder puts back on the sample.
fn descriptor<'e>(
    e: &'e mut DescriptorEncoder,
    name: &'e str,
    kind: MetricType,
    help: &str,
) -> Result<prometheus_client::encoding::MetricEncoder<'e>, fmt::Error> {
    let family = match kind {
        MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
        _ => name,
    };
    e.encode_descriptor(family, help, None, kind)
}

/// A counter or gauge value.
#[derive(Debug, Clone, Copy)]
enum Value {
    Int(u64),
    Float(f64),
}

/// Encode `v` as a sample of a family of type `kind`.
fn encode_value(
    m: prometheus_client::encoding::MetricEncoder,
    kind: MetricType,
    v: Value,
) -> fmt::Result {
    match (kind, v) {
        (MetricType::Counter, Value::Int(v)) => ConstCounter::new(v).encode(m),
        (MetricType::Counter, Value::Float(v)) => ConstCounter::new(v).encode(m),
        (_, Value::Int(v)) => ConstGauge::new(v).encode(m),
        (_, Value::Float(v)) => ConstGauge::new(v).encode(m),
    }
}

/// A family of one unlabelled sample.
fn single(
    e: &mut DescriptorEncoder,
    name: &str,
    kind: MetricType,
    help: &str,
    v: Value,
) -> fmt::Result {
    encode_value(descriptor(e, name, kind, help)?, kind, v)
}

/// A family of one sample per label set.
fn labelled<L: EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    (name, kind, help): (&str, MetricType, &str),
    samples: impl IntoIterator<Item = (L, Value)>,
) -> fmt::Result {
    let mut m = descriptor(e, name, kind, help)?;
    for (labels, v) in samples {
        encode_value(m.encode_family(&labels)?, kind, v)?;
    }
    Ok(())
}

/// A histogram family, one histogram per label set.
fn histograms<'h, L: EncodeLabelSet>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, &'h HistogramSnapshot)>,
) -> fmt::Result {
    let mut m = descriptor(e, name, MetricType::Histogram, help)?;
    for (labels, h) in samples {
        h.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// One single-sample family: name, type, help, value.
type Sample = (&'static str, MetricType, &'static str, Value);

const COUNTER: MetricType = MetricType::Counter;
const GAUGE: MetricType = MetricType::Gauge;

impl Exposition {
    /// The per-command families: requests, errors, bytes, latency.
    fn requests(&self, e: &mut DescriptorEncoder) -> fmt::Result {
        for (i, name, help) in [
            (
                0,
                "rebound_requests_total",
                "NBD requests completed, by command.",
            ),
            (
                1,
                "rebound_request_errors_total",
                "NBD requests answered with an error.",
            ),
            (2, "rebound_bytes_total", "Payload bytes moved, by command."),
        ] {
            let samples = self
                .own
                .ops
                .iter()
                .map(|(op, counts, _)| ([("op", op.name())], Value::Int(counts[i])));
            labelled(e, (name, COUNTER, help), samples)?;
        }
        histograms(
            e,
            "rebound_request_duration_seconds",
            "Request latency from receipt to reply, by command.",
            self.own
                .ops
                .iter()
                .map(|(op, _, h)| ([("op", op.name())], h)),
        )
    }

    /// Connections, and how reads were served.
    fn connection_and_cache_samples(&self) -> [Sample; 10] {
        let (o, g) = (&self.own, &self.gauges);
        [
            (
                "rebound_connections",
                GAUGE,
                "Open NBD connections.",
                Value::Int(o.connections),
            ),
            (
                "rebound_connections_accepted_total",
                COUNTER,
                "NBD connections accepted.",
                Value::Int(o.connections_total),
            ),
            (
                "rebound_protocol_errors_total",
                COUNTER,
                "Connections closed for protocol violations.",
                Value::Int(o.protocol_errors),
            ),
            (
                "rebound_handshake_timeouts_total",
                COUNTER,
                "Connections closed for not finishing their handshake within handshake_timeout.",
                Value::Int(o.handshake_timeouts),
            ),
            (
                "rebound_slow_clients_total",
                COUNTER,
                "Connections closed because the client read no reply for send_timeout.",
                Value::Int(o.slow_clients),
            ),
            (
                "rebound_reply_sends_total",
                COUNTER,
                "sendmsg calls that carried replies (requests over this: replies per call).",
                Value::Int(o.reply_sends),
            ),
            (
                "rebound_cache_hits_total",
                COUNTER,
                "Reads served from cache frames.",
                Value::Int(g.cache.0),
            ),
            (
                "rebound_cache_nvs_hits_total",
                COUNTER,
                "Reads served from NVS records.",
                Value::Int(g.cache.1),
            ),
            (
                "rebound_cache_misses_total",
                COUNTER,
                "Reads staged from the devices.",
                Value::Int(g.cache.2),
            ),
            (
                "rebound_cache_frames_rebuilt_total",
                COUNTER,
                "Cache control blocks that failed their check word.",
                Value::Int(g.frames_rebuilt),
            ),
        ]
    }

    /// The NVS, destage, and the device queues.
    fn nvs_destage_and_queue_samples(&self) -> [Sample; 6] {
        let g = &self.gauges;
        [
            (
                "rebound_nvs_slots_used",
                GAUGE,
                "NVS slots holding records.",
                Value::Int(g.nvs.0),
            ),
            (
                "rebound_nvs_slots",
                GAUGE,
                "NVS slots in total.",
                Value::Int(g.nvs.1),
            ),
            (
                "rebound_dirty_tracks",
                GAUGE,
                "Tracks with data not yet destaged.",
                Value::Int(g.dirty_tracks),
            ),
            (
                "rebound_destaged_tracks_total",
                COUNTER,
                "Tracks destaged to the devices.",
                Value::Int(self.own.destaged_tracks),
            ),
            (
                "rebound_device_queue_full_total",
                COUNTER,
                "Device submissions refused because the queue was full (the I/O backed off).",
                Value::Int(g.device_queue.0),
            ),
            (
                "rebound_device_unsolicited_completions_total",
                COUNTER,
                "Device completions that matched no outstanding submission (ignored).",
                Value::Int(g.device_queue.1),
            ),
        ]
    }

    /// Control blocks, Log(Lock) rollbacks and escalations, the volume,
    /// lost tracks, scrub and destage errors.
    fn recovery_and_volume_samples(&self) -> [Sample; 10] {
        let (o, g) = (&self.own, &self.gauges);
        [
            (
                "rebound_control_blocks_free",
                GAUGE,
                "Request control blocks free.",
                Value::Int(g.control_blocks.0),
            ),
            (
                "rebound_control_blocks_reclaimed_total",
                COUNTER,
                "Leaked request control blocks reclaimed by an exhausted pool's audit.",
                Value::Int(g.control_blocks.1),
            ),
            (
                "rebound_loglock_rollbacks_total",
                COUNTER,
                "Writes failing inside cache.apply that Log(Lock) let roll back alone (rung 1).",
                Value::Int(o.apply_rollbacks),
            ),
            (
                "rebound_loglock_escalations_total",
                COUNTER,
                "Writes failing inside cache.apply whose shards another request had touched (rung 4).",
                Value::Int(o.apply_escalations),
            ),
            (
                "rebound_volume_devices_degraded",
                GAUGE,
                "Devices of the volume lost or being rebuilt onto a replacement.",
                Value::Int(g.volume.0),
            ),
            (
                "rebound_volume_rebuild_slots_remaining",
                GAUGE,
                "4 KiB slots of replacement devices still to rebuild.",
                Value::Int(g.volume.1),
            ),
            (
                "rebound_lost_tracks",
                GAUGE,
                "Tracks whose newest acknowledged data is lost: the NVS record failed its data checksum and no cached copy exists (reads answer EIO until the track is written again).",
                Value::Int(g.lost_tracks),
            ),
            (
                "rebound_scrub_records_checked_total",
                COUNTER,
                "Dirty NVS records whose data the scrub checked.",
                Value::Int(g.scrub.0),
            ),
            (
                "rebound_scrub_records_repaired_total",
                COUNTER,
                "Damaged NVS records the scrub repaired from their cached copy.",
                Value::Int(g.scrub.1),
            ),
            (
                "rebound_destage_errors_total",
                COUNTER,
                "Destage attempts that failed.",
                Value::Int(o.destage_errors),
            ),
        ]
    }
}

/// The cache hit ratio and the NVS fill ratio.
fn ratios(e: &mut DescriptorEncoder, g: &Gauges) -> fmt::Result {
    let reads = g.cache.0 + g.cache.1 + g.cache.2;
    let hit = if reads == 0 {
        0.0
    } else {
        (g.cache.0 + g.cache.1) as f64 / reads as f64
    };
    let fill = if g.nvs.1 == 0 {
        0.0
    } else {
        g.nvs.0 as f64 / g.nvs.1 as f64
    };
    single(
        e,
        "rebound_cache_hit_ratio",
        GAUGE,
        "Reads served without a device read, over the process lifetime.",
        Value::Float(hit),
    )?;
    single(
        e,
        "rebound_nvs_fill_ratio",
        GAUGE,
        "Fraction of NVS slots in use.",
        Value::Float(fill),
    )
}

/// Device errors by device and operation (the failing device, named).
fn device_errors(e: &mut DescriptorEncoder, g: &Gauges) -> fmt::Result {
    let samples = g.device_errors.iter().enumerate().flat_map(|(d, errors)| {
        ["read", "write", "sync"]
            .into_iter()
            .zip(*errors)
            .map(move |(op, n)| {
                (
                    [("device", d.to_string()), ("op", op.to_owned())],
                    Value::Int(n),
                )
            })
    });
    labelled(
        e,
        (
            "rebound_device_errors_total",
            COUNTER,
            "Errors the backend devices returned, by device and operation.",
        ),
        samples,
    )
}

/// Recoveries, time spent, requests affected and each recovery's
/// duration, by rung of the ladder.
fn rungs(e: &mut DescriptorEncoder, rungs: &[RungTotals]) -> fmt::Result {
    let labels = |r: &RungTotals| [("rung", r.rung.to_string()), ("name", r.name.to_owned())];
    for (name, help, value) in [
        (
            "rebound_recoveries_total",
            "Recoveries performed, by rung of the recovery ladder.",
            (|r: &RungTotals| Value::Int(r.count)) as fn(&RungTotals) -> Value,
        ),
        (
            "rebound_recovery_seconds_total",
            "Time spent recovering, by rung (0 for redrives, whose cost is request latency).",
            |r| Value::Float(r.seconds),
        ),
        (
            "rebound_recovery_requests_total",
            "Requests affected by recoveries, by rung.",
            |r| Value::Int(r.requests),
        ),
    ] {
        labelled(
            e,
            (name, COUNTER, help),
            rungs.iter().map(|r| (labels(r), value(r))),
        )?;
    }
    histograms(
        e,
        "rebound_recovery_duration_seconds",
        "How long each recovery took, by rung (redrives count 0: their cost is request latency).",
        rungs.iter().map(|r| (labels(r), &r.durations)),
    )
}

/// A per-group rcs metric: name, help, and how to read it.
type GroupField = (&'static str, &'static str, fn(&rcs::GroupMetrics) -> u64);

/// The rcs runtime's per-group counters and gauges.
fn rcs_groups(e: &mut DescriptorEncoder, r: &rcs::MetricsSnapshot) -> fmt::Result {
    for (name, help, f) in group_fields() {
        let kind = if name.ends_with("_total") {
            COUNTER
        } else {
            GAUGE
        };
        let samples = r
            .groups
            .iter()
            .map(|g| ([("group", g.name.as_str())], Value::Int(f(g))));
        labelled(e, (name, kind, help), samples)?;
    }
    Ok(())
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
fn rcs_times(
    e: &mut DescriptorEncoder,
    r: &rcs::MetricsSnapshot,
    recovery: &[HistogramSnapshot],
) -> fmt::Result {
    single(
        e,
        "rebound_rcs_affiliated_total",
        COUNTER,
        "Tasks run by connection threads themselves (counted in their groups too).",
        Value::Int(r.affiliated),
    )?;
    histograms(
        e,
        "rebound_rcs_recovery_seconds",
        "Group recovery time, by recovery group.",
        r.groups
            .iter()
            .zip(recovery)
            .map(|(g, h)| ([("group", g.name.as_str())], h)),
    )?;
    labelled(
        e,
        (
            "rebound_rcs_emulated_recovery_seconds_total",
            COUNTER,
            "Processor time held by the fault emulation's recoveries (the failing task's, and every task of the group running at the start of or dispatched during one).",
        ),
        r.groups.iter().map(|g| {
            (
                [("group", g.name.as_str())],
                Value::Float(g.emulated_hold.as_secs_f64()),
            )
        }),
    )?;
    labelled(
        e,
        (
            "rebound_rcs_pool_busy_seconds_total",
            COUNTER,
            "Time each resource pool spent busy.",
        ),
        r.pools.iter().map(|p| {
            (
                [("pool", p.id.0.to_string())],
                Value::Float(p.busy.as_secs_f64()),
            )
        }),
    )
}
