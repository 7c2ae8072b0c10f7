//! Every fault the controller can be made to suffer on demand, declared
//! once: the named fault points of the I/O path (rung 1; the scheduling
//! paper's recovery points, armed through `rcs::fault`), and the grammar of
//! `rebound inject`, the admin socket's `inject` request and the
//! configuration's `inject = [...]` entries, which all parse through
//! [`Fault::parse`] and are armed by one function,
//! [`crate::engine::inject::arm`].
//!
//! | fault point | where it fires |
//! |---|---|
//! | `host.receive`, `cache.read`, `device.read`, `nvs.write`, `cache.apply`, `device.fua`, `device.flush`, `device.zero`, `host.reply` | a stage's entry (rung 1: the request is redriven) |
//! | `cache.apply.track` | inside `cache.apply`, after each track enters the directory (not provably safe to redrive: Log(Lock) rolls it back, or rung 4) |
//! | `device.queue-full` | a device submission is refused as if its queue were full (armed with `fail`) |
//! | `host.cb-leak` | a request's control block is not given back (armed with `fail`) |

use std::time::Duration;

use rcs::fault::{FaultAction, FaultConfig, FaultPoint};

/// A stage's entry: validation and routing.
pub static HOST_RECEIVE: FaultPoint = FaultPoint::new("host.receive");
/// A stage's entry: read hits.
pub static CACHE_READ: FaultPoint = FaultPoint::new("cache.read");
/// A stage's entry: staging read misses.
pub static DEVICE_READ: FaultPoint = FaultPoint::new("device.read");
/// A stage's entry: writing a WRITE's NVS records.
pub static NVS_WRITE: FaultPoint = FaultPoint::new("nvs.write");
/// A stage's entry: applying a WRITE to the cache directory.
pub static CACHE_APPLY: FaultPoint = FaultPoint::new("cache.apply");
/// Inside `cache.apply`, after each track entered the directory.
pub static CACHE_APPLY_TRACK: FaultPoint = FaultPoint::new("cache.apply.track");
/// A stage's entry: FUA's destage and sync.
pub static DEVICE_FUA: FaultPoint = FaultPoint::new("device.fua");
/// A stage's entry: FLUSH.
pub static DEVICE_FLUSH: FaultPoint = FaultPoint::new("device.flush");
/// A stage's entry: TRIM and WRITE_ZEROES.
pub static DEVICE_ZERO: FaultPoint = FaultPoint::new("device.zero");
/// A stage's entry: sending the reply.
pub static HOST_REPLY: FaultPoint = FaultPoint::new("host.reply");
/// A device submission refused as if the queue were full.
pub static DEVICE_QUEUE_FULL: FaultPoint = FaultPoint::new("device.queue-full");
/// A request's control block not given back.
pub static HOST_CB_LEAK: FaultPoint = FaultPoint::new("host.cb-leak");

/// Every fault point of the controller, in the order `rebound inject`
/// lists them.
pub static POINTS: [&FaultPoint; 12] = [
    &HOST_RECEIVE,
    &CACHE_READ,
    &DEVICE_READ,
    &NVS_WRITE,
    &CACHE_APPLY,
    &CACHE_APPLY_TRACK,
    &DEVICE_FUA,
    &DEVICE_FLUSH,
    &DEVICE_ZERO,
    &HOST_REPLY,
    &DEVICE_QUEUE_FULL,
    &HOST_CB_LEAK,
];

/// The fault points' names.
pub fn point_names() -> Vec<&'static str> {
    POINTS.iter().map(|p| p.name()).collect()
}

/// The longest stall or recovery an injected fault may ask for.
pub const INJECTED_DURATION_MAX: Duration = Duration::from_secs(3600);

/// One fault to inject, as parsed from `inject ...` words.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Arm a named fault point (`panic`, `fail`, `delay`, `hang`).
    Point {
        /// `panic`, `fail`, `delay` or `hang`.
        kind: &'static str,
        /// The fault point's name (one of [`POINTS`]).
        point: &'static str,
        /// What it does, how often, how many times.
        config: FaultConfig,
    },
    /// The scheduling paper's emulation: a fault per dispatch of a group.
    GroupFault {
        /// The group's name.
        group: String,
        /// Probability per dispatch (0 stops it).
        rate: f64,
        /// Each recovery's duration.
        duration: Duration,
    },
    /// Damage the check word of the frame caching a track.
    CorruptFrame(u64),
    /// Damage a dirty track's directory entry.
    CorruptDirectory(u64),
    /// Damage a dirty track's NVS record and drop its cached copy.
    CorruptRecord(u64),
    /// A device reports a completion no submission waits for.
    UnsolicitedCompletion(usize),
    /// Every I/O to a device fails from now on.
    LoseDevice(usize),
    /// The next writes to a replacement device during a rebuild fail.
    RebuildError(u64),
    /// Roll back to the last checkpoint now (rung 3).
    Rollback,
    /// Run a system-level recovery now (rung 4).
    System,
    /// Invalidate the recovery box and stop keeping it.
    AbandonBox,
    /// Abort the process (rung 5 at the next start).
    Crash,
    /// Invalidate the recovery box, then abort (rung 6 at the next start).
    CrashDamagedBox,
    /// Disarm every fault point and group injection.
    Clear,
}

/// What `inject` with no or a wrong fault answers.
const FAULTS: &str = "panic POINT, fail POINT, delay POINT, hang POINT, group-fault GROUP, corrupt-frame TRACK, corrupt-directory TRACK, corrupt-record TRACK, unsolicited-completion [DEVICE], lose-device DEVICE, rebuild-error COUNT, rollback, system, abandon-box, crash, crash-damaged-box, clear";

impl Fault {
    /// Parse the words after `inject`.
    pub fn parse(words: &[&str]) -> Result<Self, String> {
        Ok(match words {
            [
                kind @ ("panic" | "fail" | "delay" | "hang"),
                point,
                opts @ ..,
            ] => {
                let point = POINTS
                    .iter()
                    .map(|p| p.name())
                    .find(|name| name == point)
                    .ok_or_else(|| {
                        format!(
                            "unknown fault point {point:?}; points: {}",
                            point_names().join(", ")
                        )
                    })?;
                let opts = Options::parse(opts, &["rate", "count", "duration"])?;
                let (kind, action) = match *kind {
                    "panic" => ("panic", FaultAction::Panic),
                    "fail" => ("fail", FaultAction::Fail(rcs::FailureClass::State)),
                    "hang" => ("hang", FaultAction::Hang(opts.duration(None)?)),
                    _ => ("delay", FaultAction::Delay(opts.duration(None)?)),
                };
                Self::Point {
                    kind,
                    point,
                    config: FaultConfig {
                        action,
                        probability: opts.rate(1.0)?,
                        count: opts.count()?,
                    },
                }
            }
            ["group-fault", group, opts @ ..] => {
                let opts = Options::parse(opts, &["rate", "duration"])?;
                Self::GroupFault {
                    group: (*group).to_owned(),
                    rate: opts.rate(1e-4)?,
                    duration: opts.duration(Some(Duration::from_millis(20)))?,
                }
            }
            ["corrupt-frame", t] => {
                Self::CorruptFrame(number(t, "corrupt-frame TRACK", "a track number")?)
            }
            ["corrupt-directory", t] => {
                Self::CorruptDirectory(number(t, "corrupt-directory TRACK", "a track number")?)
            }
            ["corrupt-record", t] => {
                Self::CorruptRecord(number(t, "corrupt-record TRACK", "a track number")?)
            }
            ["unsolicited-completion"] => Self::UnsolicitedCompletion(0),
            ["unsolicited-completion", d] => Self::UnsolicitedCompletion(number(
                d,
                "unsolicited-completion DEVICE",
                "a device number",
            )?),
            ["unsolicited-completion", ..] => {
                return Err("unsolicited-completion takes at most a device number".into());
            }
            ["lose-device", d] => {
                Self::LoseDevice(number(d, "lose-device DEVICE", "a device number")?)
            }
            ["rebuild-error", n] => {
                Self::RebuildError(number(n, "rebuild-error COUNT", "a count")?)
            }
            ["rollback"] => Self::Rollback,
            ["system"] => Self::System,
            ["abandon-box"] => Self::AbandonBox,
            ["crash"] => Self::Crash,
            ["crash-damaged-box"] => Self::CrashDamagedBox,
            ["clear"] => Self::Clear,
            [] => return Err(format!("inject what? faults: {FAULTS}")),
            [other, ..] => {
                return Err(format!(
                    "unknown fault {other:?} (or missing its argument); faults: {FAULTS}"
                ));
            }
        })
    }

    /// Whether the configuration may arm it at start-up: the fault points
    /// and the group emulation (the rest act once, on a running server).
    pub fn armable_at_start(&self) -> bool {
        matches!(self, Self::Point { .. } | Self::GroupFault { .. })
    }
}

fn number<T: std::str::FromStr>(text: &str, what: &str, expected: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| format!("{what}: {text:?} is not {expected}"))
}

/// `key=value` options after the positional words.
struct Options<'a> {
    pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Options<'a> {
    fn parse(words: &[&'a str], allowed: &[&str]) -> Result<Self, String> {
        let mut pairs = Vec::new();
        for w in words {
            let (k, v) = w
                .split_once('=')
                .ok_or_else(|| format!("expected key=value, got {w:?}"))?;
            if !allowed.contains(&k) {
                return Err(format!(
                    "unknown option {k:?}; allowed: {}",
                    allowed.join(", ")
                ));
            }
            pairs.push((k, v));
        }
        Ok(Self { pairs })
    }

    fn get(&self, key: &str) -> Option<&'a str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
    }

    fn rate(&self, default: f64) -> Result<f64, String> {
        match self.get("rate") {
            None => Ok(default),
            Some(v) => {
                let p: f64 = v
                    .parse()
                    .map_err(|_| format!("rate={v:?} is not a number"))?;
                if (0.0..=1.0).contains(&p) {
                    Ok(p)
                } else {
                    Err(format!("rate={v} must be a probability within 0..=1"))
                }
            }
        }
    }

    fn duration(&self, default: Option<Duration>) -> Result<Duration, String> {
        let d = match self.get("duration") {
            None => default.ok_or("duration=D is required (e.g. duration=20ms)")?,
            Some(v) => crate::units::parse_duration(v)?,
        };
        if d > INJECTED_DURATION_MAX {
            return Err(format!("duration {d:?} is outside 0..=1h"));
        }
        Ok(d)
    }

    fn count(&self) -> Result<Option<u64>, String> {
        match self.get("count") {
            None => Ok(Some(1)),
            Some("unlimited") => Ok(None),
            Some(v) => match v.parse::<u64>() {
                Ok(0) | Err(_) => Err(format!(
                    "count={v:?} must be a positive integer or unlimited"
                )),
                Ok(n) => Ok(Some(n)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_point_name_is_unique() {
        let mut names = point_names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), POINTS.len());
    }

    #[test]
    fn point_faults_parse_with_defaults_and_options() {
        let f = Fault::parse(&[
            "delay",
            "cache.read",
            "duration=1.5s",
            "rate=0.5",
            "count=unlimited",
        ])
        .unwrap();
        let Fault::Point {
            kind,
            point,
            config,
        } = f
        else {
            panic!("not a point fault: {f:?}");
        };
        assert_eq!((kind, point), ("delay", "cache.read"));
        assert_eq!(
            config.action,
            FaultAction::Delay(Duration::from_millis(1500))
        );
        assert_eq!(config.probability, 0.5);
        assert_eq!(config.count, None);
        let Fault::Point { config, .. } = Fault::parse(&["panic", "host.reply"]).unwrap() else {
            panic!()
        };
        assert_eq!((config.probability, config.count), (1.0, Some(1)));
    }

    #[test]
    fn bad_faults_are_refused_with_what_was_expected() {
        let err = |w: &[&str]| Fault::parse(w).unwrap_err();
        assert!(err(&["panic", "nowhere"]).contains("unknown fault point"));
        assert!(err(&["delay", "cache.read"]).contains("duration=D is required"));
        assert!(err(&["delay", "cache.read", "duration=2h"]).contains("outside"));
        assert!(err(&["panic", "cache.read", "speed=1"]).contains("unknown option"));
        assert!(err(&["panic", "cache.read", "rate=2"]).contains("probability"));
        assert!(err(&["panic", "cache.read", "count=0"]).contains("positive integer"));
        assert!(err(&["panic", "cache.read", "rate"]).contains("key=value"));
        assert!(err(&["corrupt-frame", "x"]).contains("not a track number"));
        assert!(err(&["unsolicited-completion", "1", "2"]).contains("at most a device"));
        assert!(err(&[]).starts_with("inject what?"));
        assert!(err(&["melt"]).contains("unknown fault \"melt\""));
    }

    #[test]
    fn only_point_and_group_faults_are_armable_at_start() {
        assert!(
            Fault::parse(&["group-fault", "cache"])
                .unwrap()
                .armable_at_start()
        );
        assert!(
            Fault::parse(&["fail", "host.cb-leak"])
                .unwrap()
                .armable_at_start()
        );
        assert!(!Fault::parse(&["crash"]).unwrap().armable_at_start());
        assert!(
            !Fault::parse(&["lose-device", "0"])
                .unwrap()
                .armable_at_start()
        );
    }
}
