//! Arming a [`Fault`] on a running engine: the one function behind the
//! admin socket's `inject`, the configuration's `inject = [...]` and the
//! in-process tests. Returns the line `rebound inject` prints, or why the
//! fault cannot be armed on this engine (an unknown group, a track not
//! cached, a volume without redundancy, ...).
//!
//! `crash` and `crash-damaged-box` only answer here: the admin socket
//! aborts the process after the answer has left (see
//! [`crate::control::admin`]).

use std::sync::Arc;
use std::time::Duration;

use crate::backend::faulty::DeviceFault;
use crate::config::FlushPolicy;
use crate::engine::Engine;
use crate::faults::Fault;
use crate::recovery::Rung;

/// Arm `fault` on `engine`; the answer's text.
pub fn arm(engine: &Arc<Engine>, fault: &Fault) -> Result<String, String> {
    match fault {
        Fault::Point {
            kind,
            point,
            config,
        } => {
            rcs::fault::arm(point, *config).map_err(|e| e.to_string())?;
            Ok(format!(
                "armed {kind} at {point} (rate {}, count {})\n",
                config.probability,
                config.count.map_or("unlimited".into(), |n| n.to_string())
            ))
        }
        Fault::GroupFault {
            group,
            rate,
            duration,
        } => group_fault(engine, group, *rate, *duration),
        Fault::CorruptFrame(t) => corrupt_frame(engine, *t),
        Fault::CorruptDirectory(t) => corrupt_directory(engine, *t),
        Fault::CorruptRecord(t) => corrupt_record(engine, *t),
        Fault::Rollback => engine
            .rollback("injected through the admin socket")
            .map(|report| format!("{report}\n"))
            .map_err(|e| e.to_string()),
        Fault::System => engine
            .system_recover("injected through the admin socket")
            .map(|report| format!("{report}\n"))
            .map_err(|e| e.to_string()),
        Fault::UnsolicitedCompletion(device) => unsolicited_completion(engine, *device),
        Fault::LoseDevice(device) => {
            engine.volume.pull(*device)?;
            Ok(format!(
                "device {device} lost: the volume serves degraded from its {} layout and rebuilds a replacement (see status)\n",
                engine.volume.layout().raid()
            ))
        }
        Fault::RebuildError(count) => {
            engine.volume.inject_rebuild_errors(*count);
            Ok(format!(
                "the next {count} writes to a replacement device during a rebuild fail: the rebuild stops and tries again (see status)\n"
            ))
        }
        Fault::Device { device, fault } => {
            engine.volume.arm_device_fault(*device, *fault)?;
            Ok(format!(
                "device {device}: {} (see status)\n",
                describe(fault)
            ))
        }
        Fault::PowerLoss => power_loss(engine),
        Fault::AbandonBox => {
            engine.journal.abandon();
            Ok("recovery box invalidated: rung 4 now rebuilds from an NVS scan, and the next start is a hard restart\n".into())
        }
        Fault::Crash => Ok("crashing now\n".into()),
        Fault::CrashDamagedBox => Ok("invalidating the recovery box and crashing now\n".into()),
        Fault::Clear => {
            rcs::fault::disarm_all();
            for g in engine.runtime().metrics().groups {
                let _ = engine.runtime().inject(g.id, 0.0, Duration::ZERO);
            }
            engine.volume.clear_device_faults();
            Ok("every fault point, group injection and device fault disarmed\n".into())
        }
    }
}

/// A device fault in words.
fn describe(fault: &DeviceFault) -> String {
    let times =
        |count: &Option<u64>| count.map_or("until cleared".into(), |n| format!("{n} times"));
    match fault {
        DeviceFault::Error {
            op,
            errno,
            rate,
            count,
            torn,
        } => format!(
            "{}{} fails with {} (probability {rate}, {})",
            if *torn { "torn " } else { "" },
            op.name(),
            errno.name().to_uppercase(),
            times(count)
        ),
        DeviceFault::Latency { op, delay, rate } => format!(
            "{} takes {delay:?} longer (probability {rate}, until cleared)",
            op.map_or("every I/O", |o| o.name())
        ),
    }
}

/// Cut the power (the admin socket ends the process after the answer):
/// undo the device writes no sync covered, lose the NVS unless it is on
/// persistent storage with `--flush nvs` (persistent memory: its stores
/// survive), and lose the recovery box (it lives in memory).
fn power_loss(engine: &Engine) -> Result<String, String> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    let (back, kept) = engine.volume.power_cut(seed)?;
    let nvs = engine.nvs.path();
    let nvs_survives = engine.config.flush == FlushPolicy::Nvs && !crate::files::is_volatile(nvs);
    let mut lost = Vec::new();
    if !nvs_survives {
        lost.push(nvs.to_owned());
    }
    lost.push(engine.config.box_path());
    for path in &lost {
        if let Err(e) = std::fs::remove_file(path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(format!("power loss: removing {}: {e}", path.display()));
        }
    }
    tracing::error!(back, kept, nvs_survives, "power loss injected");
    Ok(format!(
        "power lost: {back} device blocks written since their last sync put back, {kept} kept; NVS {}; recovery box lost\n",
        if nvs_survives {
            "kept (persistent, --flush nvs)"
        } else {
            "lost"
        }
    ))
}

/// Make `group`'s tasks fail at dispatch with probability `rate`, each
/// recovery taking `duration` (the fault emulation).
fn group_fault(
    engine: &Engine,
    group: &str,
    rate: f64,
    duration: Duration,
) -> Result<String, String> {
    let metrics = engine.runtime().metrics();
    let id = metrics.group(group).map(|g| g.id).ok_or_else(|| {
        let names: Vec<&str> = metrics.groups.iter().map(|g| g.name.as_str()).collect();
        format!("unknown group {group:?}; groups: {}", names.join(", "))
    })?;
    engine
        .runtime()
        .inject(id, rate, duration)
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "group {group}: fault probability {rate} per dispatch, recovery {duration:?} each\n"
    ))
}

/// Damage the check word of the frame caching track `t`.
fn corrupt_frame(engine: &Engine, t: u64) -> Result<String, String> {
    if engine.cache.damage_frame(t) {
        Ok(format!(
            "damaged the check word of the frame caching track {t}\n"
        ))
    } else {
        Err(format!(
            "track {t} is not in the read cache (read it first)"
        ))
    }
}

/// Damage dirty track `t`'s directory entry.
fn corrupt_directory(engine: &Engine, t: u64) -> Result<String, String> {
    match engine.cache.damage_directory(t) {
        Some(d) => Ok(format!(
            "damaged the directory entry of track {t} (its record, slot {} seq {}, is now named wrongly)\n",
            d.slot, d.seq
        )),
        None => Err(format!(
            "track {t} has no dirty directory entry (write it first)"
        )),
    }
}

/// Damage the data of track `t`'s NVS record and drop its cached copy.
fn corrupt_record(engine: &Engine, t: u64) -> Result<String, String> {
    match engine.cache.damage_record(t, &engine.nvs) {
        Some(d) => Ok(format!(
            "damaged the data of track {t}'s NVS record (slot {}, seq {}) and dropped its cached copy\n",
            d.slot, d.seq
        )),
        None => Err(format!(
            "track {t} has no record in the NVS (write it, and hold its destage, first)"
        )),
    }
}

/// A completion as a confused device would report it: a tag of the
/// device's queue, under a generation no submission ever had.
fn unsolicited_completion(engine: &Engine, device: usize) -> Result<String, String> {
    let q = engine.queues.get(device).ok_or_else(|| {
        format!(
            "unsolicited-completion DEVICE: {device} is not a device number below {}",
            engine.queues.len()
        )
    })?;
    let slot = q.depth() - 1;
    match q.complete_raw(slot, u64::MAX) {
        Err(e) => {
            engine.recoveries.record(
                Rung::Task,
                format!("device {device}: {e} ignored"),
                Duration::ZERO,
                0,
            );
            Ok(format!(
                "device {device}: {e} ignored and counted ({} so far)\n",
                q.unsolicited_count()
            ))
        }
        Ok(()) => Err("the device queue accepted an unsolicited completion".into()),
    }
}
