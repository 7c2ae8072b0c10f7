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
//! | `host.gate` | a finished request's reply on its way into the output gate (`delay` or `hang`; `fail` and `panic` there are ignored) |

use std::time::Duration;

use rcs::fault::{FaultAction, FaultConfig, FaultPoint};

/// A stage's entry: validation and routing.
pub static HOST_RECEIVE: FaultPoint = FaultPoint::new("host.receive");
/// A stage's entry: read hits.
pub static CACHE_READ: FaultPoint = FaultPoint::new("cache.read");
/// A stage's entry: BLOCK_STATUS (which tracks hold data).
pub static CACHE_STATUS: FaultPoint = FaultPoint::new("cache.status");
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
/// A finished request's reply on its way into the output gate (rung 3),
/// still counted in the pipeline; for stalls (a rollback must wait).
pub static HOST_GATE: FaultPoint = FaultPoint::new("host.gate");

/// Every fault point of the controller, in the order `rebound inject`
/// lists them.
pub static POINTS: [&FaultPoint; 14] = [
    &HOST_RECEIVE,
    &CACHE_READ,
    &CACHE_STATUS,
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
    &HOST_GATE,
];

/// The fault points' names.
pub fn point_names() -> Vec<&'static str> {
    POINTS.iter().map(|p| p.name()).collect()
}

/// The longest stall or recovery an injected fault may ask for.
pub const INJECTED_DURATION_MAX: Duration = Duration::from_secs(3600);

/// Which device operation a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceOp {
    /// `pread`.
    Read,
    /// `pwrite` (and zeroing, which writes).
    Write,
    /// `fdatasync`.
    Sync,
}

impl DeviceOp {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Sync => "sync",
        }
    }

    /// Parse the flag's spelling.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "read" => Ok(Self::Read),
            "write" => Ok(Self::Write),
            "sync" => Ok(Self::Sync),
            other => Err(format!("unknown device op {other:?} (read, write, sync)")),
        }
    }
}

/// The error an injected device fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Errno {
    /// `EIO`: a medium or transport error.
    Eio,
    /// `ENOSPC`: the file system under the device file is full.
    Enospc,
}

impl Errno {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Eio => "eio",
            Self::Enospc => "enospc",
        }
    }

    /// Parse the flag's spelling.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "eio" => Ok(Self::Eio),
            "enospc" => Ok(Self::Enospc),
            other => Err(format!("unknown errno {other:?} (eio, enospc)")),
        }
    }

    /// The error device `device` returns for `op`.
    pub fn error(self, device: usize, op: DeviceOp) -> std::io::Error {
        let code = match self {
            Self::Eio => libc::EIO,
            Self::Enospc => libc::ENOSPC,
        };
        let e = std::io::Error::from_raw_os_error(code);
        std::io::Error::new(
            e.kind(),
            format!("device {device}: {} failed: {e} (injected)", op.name()),
        )
    }
}

/// One fault armed on a device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceFault {
    /// `op` fails with `errno`, with probability `rate` per I/O, `count`
    /// times (`None`: until cleared). A torn write lands the first half of
    /// its sectors before failing.
    Error {
        /// The operation.
        op: DeviceOp,
        /// The error.
        errno: Errno,
        /// Probability per I/O.
        rate: f64,
        /// Times it fires (`None`: unlimited).
        count: Option<u64>,
        /// Writes only: part of the write lands first.
        torn: bool,
    },
    /// Every I/O (or only `op`) takes `delay` longer, with probability
    /// `rate`.
    Latency {
        /// The operation (`None`: all).
        op: Option<DeviceOp>,
        /// The added time.
        delay: Duration,
        /// Probability per I/O.
        rate: f64,
    },
}

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
    /// The environment's fault on backend device `device`: errors or
    /// latency at the backend door ([`crate::backend::faulty`]).
    Device {
        /// The device number.
        device: usize,
        /// What it does.
        fault: DeviceFault,
    },
    /// Cut the power: undo what no device sync covered, lose a volatile
    /// NVS and the recovery box, end the process.
    PowerLoss,
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
    /// Disarm every fault point, group injection and device fault.
    Clear,
}

/// What `inject` with no or a wrong fault answers.
const FAULTS: &str = "panic POINT, fail POINT, delay POINT, hang POINT, group-fault GROUP, corrupt-frame TRACK, corrupt-directory TRACK, corrupt-record TRACK, unsolicited-completion [DEVICE], lose-device DEVICE, rebuild-error COUNT, device-error DEVICE op=read|write|sync [errno=eio|enospc], device-latency DEVICE duration=D, power-loss, rollback, system, abandon-box, crash, crash-damaged-box, clear";

impl Fault {
    /// Parse the words after `inject`.
    pub fn parse(words: &[&str]) -> Result<Self, String> {
        Ok(match words {
            [
                kind @ ("panic" | "fail" | "delay" | "hang"),
                point,
                opts @ ..,
            ] => Self::parse_point(kind, point, opts)?,
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
            [kind @ ("device-error" | "device-latency"), d, opts @ ..] => {
                Self::parse_device(kind, d, opts)?
            }
            ["power-loss"] => Self::PowerLoss,
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

    /// `panic|fail|delay|hang POINT [rate=P] [count=N] [duration=D]`.
    fn parse_point(kind: &str, point: &str, opts: &[&str]) -> Result<Self, String> {
        let point = POINTS
            .iter()
            .map(|p| p.name())
            .find(|name| *name == point)
            .ok_or_else(|| {
                format!(
                    "unknown fault point {point:?}; points: {}",
                    point_names().join(", ")
                )
            })?;
        let opts = Options::parse(opts, &["rate", "count", "duration"])?;
        let (kind, action) = match kind {
            "panic" => ("panic", FaultAction::Panic),
            "fail" => ("fail", FaultAction::Fail(rcs::FailureClass::State)),
            "hang" => ("hang", FaultAction::Hang(opts.duration(None)?)),
            _ => ("delay", FaultAction::Delay(opts.duration(None)?)),
        };
        Ok(Self::Point {
            kind,
            point,
            config: FaultConfig {
                action,
                probability: opts.rate(1.0)?,
                count: opts.count()?,
            },
        })
    }

    /// `device-error DEVICE ...` and `device-latency DEVICE ...`.
    fn parse_device(kind: &str, d: &str, opts: &[&str]) -> Result<Self, String> {
        if kind == "device-latency" {
            let opts = Options::parse(opts, &["op", "rate", "duration"])?;
            return Ok(Self::Device {
                device: number(d, "device-latency DEVICE", "a device number")?,
                fault: DeviceFault::Latency {
                    op: opts.get("op").map(DeviceOp::parse).transpose()?,
                    delay: opts.duration(None)?,
                    rate: opts.rate(1.0)?,
                },
            });
        }
        let opts = Options::parse(opts, &["op", "errno", "rate", "count", "torn"])?;
        let op = DeviceOp::parse(
            opts.get("op")
                .ok_or("device-error needs op=read|write|sync (the operation that fails)")?,
        )?;
        let torn = match opts.get("torn") {
            None | Some("false") => false,
            Some("true") if op == DeviceOp::Write => true,
            Some("true") => return Err("torn=true tears writes only (op=write)".into()),
            Some(v) => return Err(format!("torn={v:?} must be true or false")),
        };
        Ok(Self::Device {
            device: number(d, "device-error DEVICE", "a device number")?,
            fault: DeviceFault::Error {
                op,
                errno: Errno::parse(opts.get("errno").unwrap_or("eio"))?,
                rate: opts.rate(1.0)?,
                count: opts.count_or(None)?,
                torn,
            },
        })
    }

    /// Whether the configuration may arm it at start-up: the fault points
    /// and the group emulation (the rest act once, on a running server).
    pub fn armable_at_start(&self) -> bool {
        matches!(
            self,
            Self::Point { .. } | Self::GroupFault { .. } | Self::Device { .. }
        )
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
        self.count_or(Some(1))
    }

    fn count_or(&self, default: Option<u64>) -> Result<Option<u64>, String> {
        match self.get("count") {
            None => Ok(default),
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
    fn device_faults_parse_with_defaults_and_refuse_bad_words() {
        let f = Fault::parse(&["device-error", "2", "op=sync", "errno=enospc", "rate=0.25"]);
        assert_eq!(
            f.unwrap(),
            Fault::Device {
                device: 2,
                fault: DeviceFault::Error {
                    op: DeviceOp::Sync,
                    errno: Errno::Enospc,
                    rate: 0.25,
                    count: None,
                    torn: false,
                },
            },
            "a failing device keeps failing until cleared"
        );
        let f = Fault::parse(&["device-error", "0", "op=write", "count=3", "torn=true"]).unwrap();
        let Fault::Device {
            fault: DeviceFault::Error {
                errno, count, torn, ..
            },
            ..
        } = f
        else {
            panic!("{f:?}")
        };
        assert_eq!((errno, count, torn), (Errno::Eio, Some(3), true));
        let f = Fault::parse(&["device-latency", "1", "duration=50ms"]).unwrap();
        assert_eq!(
            f,
            Fault::Device {
                device: 1,
                fault: DeviceFault::Latency {
                    op: None,
                    delay: Duration::from_millis(50),
                    rate: 1.0,
                },
            }
        );
        let err = |w: &[&str]| Fault::parse(w).unwrap_err();
        assert!(err(&["device-error", "0"]).contains("needs op="));
        assert!(err(&["device-error", "0", "op=erase"]).contains("read, write, sync"));
        assert!(err(&["device-error", "0", "op=read", "errno=eperm"]).contains("eio, enospc"));
        assert!(err(&["device-error", "0", "op=read", "torn=true"]).contains("writes only"));
        assert!(err(&["device-error", "x", "op=read"]).contains("not a device number"));
        assert!(err(&["device-latency", "0"]).contains("duration=D is required"));
        assert!(Fault::parse(&["power-loss"]).unwrap() == Fault::PowerLoss);
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
        assert!(!Fault::parse(&["power-loss"]).unwrap().armable_at_start());
        assert!(
            Fault::parse(&["device-error", "0", "op=write"])
                .unwrap()
                .armable_at_start()
        );
        assert!(
            !Fault::parse(&["lose-device", "0"])
                .unwrap()
                .armable_at_start()
        );
    }
}
