//! The admin socket (`--admin PATH.sock`, default `<data_dir>/admin.sock`):
//! a Unix stream socket through which `rebound status` and `rebound inject`
//! talk to a running server.
//!
//! # Protocol
//!
//! One request per connection: a single line of UTF-8 words, at most
//! [`REQUEST_BYTES_MAX`] bytes, ended by `\n`. The server answers with
//! lines of text and closes the connection. The first line is `ok` or
//! `error: <why>`.
//!
//! | request | effect |
//! |---|---|
//! | `status` | groups, recoveries by rung, recent recoveries (rcs's and the controller's) |
//! | `inject panic POINT [rate=P] [count=N]` | arm the named fault point to panic (rung 1: the request is redriven) |
//! | `inject fail POINT [rate=P] [count=N]` | arm it to fail with a state error (rung 1) |
//! | `inject delay POINT duration=D [rate=P] [count=N]` | arm it to stall: past `task_deadline` the watchdog ends the stall as a time-out |
//! | `inject hang POINT duration=D [rate=P] [count=N]` | arm it to hang for D, deaf to the deadline: past `hung_after` the watchdog recovers the task's group (rung 2), which cannot drain and escalates (rung 4) |
//! | `inject group-fault GROUP [rate=P] [duration=D]` | the scheduling paper's emulation: a fault per dispatch of GROUP with probability P, each recovery taking D (rung 2); `rate=0` stops it |
//! | `inject corrupt-frame TRACK` | damage the check word of the cache frame holding TRACK (4 KiB units): the next read rebuilds it (rung 1) |
//! | `inject unsolicited-completion [DEVICE]` | the device (default 0) reports a completion no submission is waiting for: ignored and counted (rung 1) |
//! | `inject corrupt-directory TRACK` | damage the in-memory directory entry of dirty TRACK (state corruption): the next read finds it naming a record the NVS does not hold; with output commit, rung 3 restores it from the checkpoint, else the read is answered EIO |
//! | `inject corrupt-record TRACK` | damage the data of dirty TRACK's NVS record and drop its cached copy (NVS memory corruption): the track's data is lost; reads and FLUSH answer EIO, recorded once (rung 1), until the track is written again |
//! | `inject lose-device DEVICE` | the failure model's lost device: every I/O to DEVICE fails from now on; a volume with redundancy (`--raid mirror` or `parity`) serves around it and rebuilds a replacement (rung 7); refused without redundancy |
//! | `inject rollback` | roll the controller back to its last checkpoint now (rung 3: needs `--output-commit`; quiesce, restore the checkpoint, drop held writes, run the open epoch's requests again); answers with its report |
//! | `inject system` | run a system-level recovery now (rung 4: quiesce, rebuild from the recovery box, redrive; connections stay up); answers with its report |
//! | `inject rebuild-error COUNT` | the next COUNT writes to a replacement device during a rebuild fail (a failing disk): the rebuild stops, says why in status, and tries again after a growing wait (rung 7) |
//! | `inject abandon-box` | invalidate the recovery box and stop keeping it (a corrupt box: rung 4 rebuilds from an NVS scan, the next start is a hard restart) |
//! | `inject crash` | abort the process (rung 5 at the next start) |
//! | `inject crash-damaged-box` | invalidate the recovery box, then abort (rung 6 at the next start) |
//! | `inject clear` | disarm every fault point and group injection |
//!
//! Fault points: `host.receive`, `cache.read`, `device.read`, `nvs.write`,
//! `cache.apply`, `device.fua`, `device.flush`, `device.zero`,
//! `host.reply` at stage entries (rung 1), `cache.apply.track` inside
//! `cache.apply` after each track enters the directory (not provably safe
//! to redrive: rung 4; see [`datapath`](crate::datapath)), and
//! `device.queue-full` (armed with `fail`: a device submission is refused
//! as if its queue were full, and the I/O backs off; see
//! [`devqueue`](crate::devqueue)), and `host.cb-leak` (armed with `fail`:
//! a request's control block is not given back, until an exhausted pool's
//! audit reclaims it; see [`ctlblock`](crate::ctlblock)). Defaults: `rate=1`,
//! `count=1` for fault points; `rate=1e-4`, `duration=20ms` for
//! group faults (the paper's numbers).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rcs::fault::{FaultAction, FaultConfig};

use crate::controller::Controller;

/// Longest request line accepted.
pub const REQUEST_BYTES_MAX: usize = 1024;

/// Fault points of the data path.
pub const FAULT_POINTS: [&str; 12] = [
    "host.receive",
    "cache.read",
    "device.read",
    "nvs.write",
    "cache.apply",
    "cache.apply.track",
    "device.fua",
    "device.flush",
    "device.zero",
    "host.reply",
    "device.queue-full",
    "host.cb-leak",
];

/// A running admin socket; removes the socket file when dropped.
#[derive(Debug)]
pub struct AdminServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdminServer {
    /// Listen at `path`. A stale socket file (nobody listening) is replaced;
    /// one a live server answers on is refused.
    pub fn start(path: &Path, ctl: &Arc<Controller>) -> std::io::Result<Self> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{} is the admin socket of a running server", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, ctl) = (Arc::clone(&stop), Arc::clone(ctl));
            std::thread::Builder::new()
                .name("rebound-admin".into())
                .spawn(move || serve(&listener, &ctl, &stop))?
        };
        Ok(Self {
            path: path.to_owned(),
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(listener: &UnixListener, ctl: &Arc<Controller>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = handle(stream, ctl) {
                    tracing::debug!(error = %e, "admin connection");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn handle(stream: UnixStream, ctl: &Arc<Controller>) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    BufReader::new((&stream).take(REQUEST_BYTES_MAX as u64 + 1)).read_line(&mut line)?;
    let answer = if line.len() > REQUEST_BYTES_MAX || !line.ends_with('\n') {
        Err(format!(
            "a request is one line of at most {REQUEST_BYTES_MAX} bytes ending in a newline"
        ))
    } else {
        execute(line.trim(), ctl)
    };
    let oversized = line.len() > REQUEST_BYTES_MAX;
    let mut out = &stream;
    match answer {
        Ok(text) => write!(out, "ok\n{text}")?,
        Err(why) => writeln!(out, "error: {why}")?,
    }
    out.flush()?;
    if oversized {
        // Closing with unread input would reset the connection before the
        // client reads the answer: end our side, then discard what is left
        // (bounded) until the client closes.
        stream.shutdown(std::net::Shutdown::Write)?;
        stream.set_read_timeout(Some(Duration::from_millis(200)))?;
        let _ = std::io::copy(&mut (&stream).take(1 << 20), &mut std::io::sink());
    }
    if line.trim() == "inject crash" || line.trim() == "inject crash-damaged-box" {
        crash(ctl, line.trim() == "inject crash-damaged-box");
    }
    Ok(())
}

/// Die as a crash would (no destage, no clean shutdown).
fn crash(ctl: &Controller, damage_box: bool) -> ! {
    if damage_box {
        ctl.journal.abandon();
    }
    tracing::error!(damage_box, "crash injected through the admin socket");
    std::process::abort();
}

/// Run one request; the answer's text (after `ok`) or why it was refused.
pub fn execute(request: &str, ctl: &Arc<Controller>) -> Result<String, String> {
    let words: Vec<&str> = request.split_whitespace().collect();
    match words.as_slice() {
        ["status"] => Ok(status(ctl)),
        ["inject", rest @ ..] => inject(rest, ctl),
        [] => Err("empty request; try `status`".into()),
        [other, ..] => Err(format!(
            "unknown request {other:?}; requests: status, inject"
        )),
    }
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
        match self.get("duration") {
            None => default.ok_or_else(|| "duration=D is required (e.g. duration=20ms)".into()),
            Some(v) => parse_duration(v),
        }
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

/// Parse `20ms`, `1s`, `500us`, `2m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 20ms, 1s)"))?;
    let secs = match unit {
        "ns" => n / 1e9,
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => {
            return Err(format!(
                "{text:?}: unknown unit {unit:?} (use ns, us, ms, s, m)"
            ));
        }
    };
    if !secs.is_finite() || !(0.0..=3600.0).contains(&secs) {
        return Err(format!("{text:?} is outside 0..=1h"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn inject(words: &[&str], ctl: &Arc<Controller>) -> Result<String, String> {
    match words {
        [kind @ ("panic" | "fail" | "delay" | "hang"), point, opts @ ..] => {
            if !FAULT_POINTS.contains(point) {
                return Err(format!(
                    "unknown fault point {point:?}; points: {}",
                    FAULT_POINTS.join(", ")
                ));
            }
            let opts = Options::parse(opts, &["rate", "count", "duration"])?;
            let action = match *kind {
                "panic" => FaultAction::Panic,
                "fail" => FaultAction::Fail(rcs::FailureClass::State),
                "hang" => FaultAction::Hang(opts.duration(None)?),
                _ => FaultAction::Delay(opts.duration(None)?),
            };
            let config = FaultConfig {
                action,
                probability: opts.rate(1.0)?,
                count: opts.count()?,
            };
            rcs::fault::arm(point, config).map_err(|e| e.to_string())?;
            Ok(format!(
                "armed {kind} at {point} (rate {}, count {})\n",
                config.probability,
                config.count.map_or("unlimited".into(), |n| n.to_string())
            ))
        }
        ["group-fault", group, opts @ ..] => {
            let opts = Options::parse(opts, &["rate", "duration"])?;
            let metrics = ctl.runtime().metrics();
            let id = metrics.group(group).map(|g| g.id).ok_or_else(|| {
                let names: Vec<&str> = metrics.groups.iter().map(|g| g.name.as_str()).collect();
                format!("unknown group {group:?}; groups: {}", names.join(", "))
            })?;
            let rate = opts.rate(1e-4)?;
            let duration = opts.duration(Some(Duration::from_millis(20)))?;
            ctl.runtime()
                .inject(id, rate, duration)
                .map_err(|e| e.to_string())?;
            Ok(format!(
                "group {group}: fault probability {rate} per dispatch, recovery {duration:?} each\n"
            ))
        }
        ["corrupt-frame", track] => {
            let t: u64 = track
                .parse()
                .map_err(|_| format!("corrupt-frame TRACK: {track:?} is not a track number"))?;
            if ctl.cache.damage_frame(t) {
                Ok(format!(
                    "damaged the check word of the frame caching track {t}\n"
                ))
            } else {
                Err(format!(
                    "track {t} is not in the read cache (read it first)"
                ))
            }
        }
        ["corrupt-directory", track] => {
            let t: u64 = track.parse().map_err(|_| {
                format!("corrupt-directory TRACK: {track:?} is not a track number")
            })?;
            match ctl.cache.damage_directory(t) {
                Some(d) => Ok(format!(
                    "damaged the directory entry of track {t} (its record, slot {} seq {}, is now named wrongly)\n",
                    d.slot, d.seq
                )),
                None => Err(format!(
                    "track {t} has no dirty directory entry (write it first)"
                )),
            }
        }
        ["corrupt-record", track] => {
            let t: u64 = track.parse().map_err(|_| {
                format!("corrupt-record TRACK: {track:?} is not a track number")
            })?;
            match ctl.cache.damage_record(t, &ctl.nvs) {
                Some(d) => Ok(format!(
                    "damaged the data of track {t}'s NVS record (slot {}, seq {}) and dropped its cached copy\n",
                    d.slot, d.seq
                )),
                None => Err(format!(
                    "track {t} has no record in the NVS (write it, and hold its destage, first)"
                )),
            }
        }
        ["rollback"] => ctl
            .rollback("injected through the admin socket")
            .map(|report| format!("{report}\n"))
            .map_err(|e| e.to_string()),
        ["system"] => ctl
            .system_recover("injected through the admin socket")
            .map(|report| format!("{report}\n"))
            .map_err(|e| e.to_string()),
        ["unsolicited-completion", rest @ ..] => {
            let device = match rest {
                [] => 0,
                [d] => d
                    .parse::<usize>()
                    .ok()
                    .filter(|&d| d < ctl.queues.len())
                    .ok_or_else(|| {
                        format!(
                            "unsolicited-completion DEVICE: {d:?} is not a device number below {}",
                            ctl.queues.len()
                        )
                    })?,
                _ => return Err("unsolicited-completion takes at most a device number".into()),
            };
            let q = &ctl.queues[device];
            // A completion as a confused device would report it: a tag of
            // this queue, under a generation no submission ever had.
            let slot = q.depth() - 1;
            match q.complete_raw(slot, u64::MAX) {
                Err(e) => {
                    ctl.recoveries.record(
                        crate::recovery::Rung::Task,
                        format!("device {device}: {e} ignored"),
                        Duration::ZERO,
                        0,
                    );
                    Ok(format!("device {device}: {e} ignored and counted ({} so far)\n", q.unsolicited_count()))
                }
                Ok(()) => Err("the device queue accepted an unsolicited completion".into()),
            }
        }
        ["lose-device", d] => {
            let device = d
                .parse::<usize>()
                .map_err(|_| format!("lose-device DEVICE: {d:?} is not a device number"))?;
            ctl.volume.pull(device)?;
            Ok(format!(
                "device {device} lost: the volume serves degraded from its {} layout and rebuilds a replacement (see status)\n",
                ctl.volume.layout().raid()
            ))
        }
        ["rebuild-error", n] => {
            let count = n
                .parse::<u64>()
                .map_err(|_| format!("rebuild-error COUNT: {n:?} is not a count"))?;
            ctl.volume.inject_rebuild_errors(count);
            Ok(format!(
                "the next {count} writes to a replacement device during a rebuild fail: the rebuild stops and tries again (see status)\n"
            ))
        }
        ["abandon-box"] => {
            ctl.journal.abandon();
            Ok("recovery box invalidated: rung 4 now rebuilds from an NVS scan, and the next start is a hard restart\n".into())
        }
        ["crash"] => Ok("crashing now\n".into()),
        ["crash-damaged-box"] => Ok("invalidating the recovery box and crashing now\n".into()),
        ["clear"] => {
            rcs::fault::disarm_all();
            for g in ctl.runtime().metrics().groups {
                let _ = ctl.runtime().inject(g.id, 0.0, Duration::ZERO);
            }
            Ok("every fault point and group injection disarmed\n".into())
        }
        [] => Err(
            "inject what? faults: panic, fail, delay, group-fault, corrupt-frame, corrupt-directory, corrupt-record, unsolicited-completion, lose-device, rebuild-error, rollback, system, abandon-box, crash, crash-damaged-box, clear"
                .into(),
        ),
        [other, ..] => Err(format!(
            "unknown fault {other:?} (or missing its argument); faults: panic POINT, fail POINT, delay POINT, group-fault GROUP, corrupt-frame TRACK, corrupt-directory TRACK, corrupt-record TRACK, unsolicited-completion [DEVICE], lose-device DEVICE, rebuild-error COUNT, rollback, system, abandon-box, crash, crash-damaged-box, clear"
        )),
    }
}

fn status(ctl: &Controller) -> String {
    let mut out = String::new();
    let m = ctl.runtime().metrics();
    let startup = ctl.startup();
    let how = match &startup.kind {
        crate::RestartKind::Fresh => "new volume".to_owned(),
        crate::RestartKind::Fast => "fast restart (rung 5)".to_owned(),
        crate::RestartKind::Hard { reason } => format!("hard restart (rung 6: {reason})"),
    };
    let _ = writeln!(
        out,
        "serving nbd://{}/ : {} bytes; started by {how} in {:?}; {} dirty tracks; policy {}, {} pools; recovery box {}",
        ctl.config().listen,
        ctl.config().volume_size,
        startup.elapsed,
        ctl.dirty_tracks(),
        m.policy,
        m.pools.len(),
        if ctl.journal.healthy() {
            "kept current"
        } else {
            "abandoned (next restart is hard)"
        },
    );
    let _ = writeln!(out, "{}", ctl.scrub.describe(ctl.config().scrub_interval));
    let lost = crate::destage::lost_tracks(ctl);
    if !lost.is_empty() {
        let shown: Vec<String> = lost.iter().take(16).map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "lost tracks: {} (NVS record damaged, no cached copy; reads answer EIO until written again): {}{}",
            lost.len(),
            shown.join(", "),
            if lost.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
    }
    {
        let e = ctl.epochs();
        let st = e.stats();
        let _ = writeln!(
            out,
            "output commit (rung 3): {}{}",
            e.scheme().name(),
            if e.enabled() {
                format!(
                    ", epoch {} every {:?}; {} replies and {} device writes held; {} commits, {} rollbacks",
                    e.open(),
                    e.interval(),
                    e.held_replies(),
                    e.device.held(),
                    st.commits.load(std::sync::atomic::Ordering::Relaxed),
                    st.rollbacks.load(std::sync::atomic::Ordering::Relaxed)
                )
            } else {
                " (no epochs; rollback escalates to rung 4)".to_owned()
            }
        );
    }
    let _ = writeln!(
        out,
        "system recovery (rung 4): {}; {} requests in the pipeline",
        if ctl.system().is_running() {
            "RUNNING"
        } else {
            "idle"
        },
        ctl.system().in_pipeline()
    );
    let _ = writeln!(
        out,
        "writes failing inside cache.apply: {} rolled back alone (Log(Lock), rung 1), {} escalated (rung 4)",
        ctl.metrics.apply_rollbacks.load(Ordering::Relaxed),
        ctl.metrics.apply_escalations.load(Ordering::Relaxed)
    );
    let (exhausted, reclaimed, leaked) = ctl.blocks.counts();
    let _ = writeln!(
        out,
        "control blocks: {} of {} free; exhausted {exhausted} times; {reclaimed} leaked blocks reclaimed; {leaked} releases lost (injected)",
        ctl.blocks.available(),
        ctl.blocks.capacity()
    );
    let health = ctl.volume.health();
    let _ = writeln!(
        out,
        "volume: raid {} over {} devices{}",
        ctl.volume.layout().raid(),
        health.len(),
        if ctl.volume.degraded() {
            " (DEGRADED)"
        } else {
            ""
        }
    );
    for (i, h) in health.iter().enumerate() {
        let _ = match h.state {
            "rebuilding" => writeln!(
                out,
                "device {i} {}: rebuilding, {:.1}% ({} of {} slots){}",
                h.path.display(),
                h.rebuilt_slots as f64 * 100.0 / h.slots.max(1) as f64,
                h.rebuilt_slots,
                h.slots,
                h.stalled
                    .as_ref()
                    .map_or(String::new(), |w| format!("; {w}"))
            ),
            state => writeln!(
                out,
                "device {i} {}: {state}{}",
                h.path.display(),
                h.stalled
                    .as_ref()
                    .map_or(String::new(), |w| format!("; rebuild {w}"))
            ),
        };
    }
    for (i, q) in ctl.queues.iter().enumerate() {
        let _ = writeln!(
            out,
            "device {i} queue: {} of {} outstanding; {} times full; {} unsolicited completions ignored",
            q.outstanding(),
            q.depth(),
            q.full_count(),
            q.unsolicited_count()
        );
    }
    let _ = writeln!(out, "\ngroups:");
    let _ = writeln!(
        out,
        "  {:<12} {:>10} {:>12} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}",
        "group",
        "state",
        "dispatched",
        "failed",
        "aborted",
        "overdue",
        "injected",
        "recoveries",
        "queued"
    );
    for g in &m.groups {
        let _ = writeln!(
            out,
            "  {:<12} {:>10} {:>12} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}",
            g.name,
            if g.recovering {
                "RECOVERING"
            } else {
                "serving"
            },
            g.dispatched,
            g.failed,
            g.aborted,
            g.overdue,
            g.injected,
            g.recoveries,
            g.queued.iter().sum::<usize>()
        );
    }
    let log = ctl.recoveries();
    let group_recoveries: u64 = m.groups.iter().map(|g| g.recoveries).sum();
    let _ = writeln!(out, "\nrecoveries by rung:");
    for rung in crate::recovery::Rung::ALL {
        let n = if rung == crate::recovery::Rung::Group {
            group_recoveries
        } else {
            log.count(rung)
        };
        let _ = writeln!(out, "  {} {:<13} {n}", rung as u8, rung.name());
    }
    let _ = writeln!(out, "\nrecent recoveries (newest last):");
    let mut lines: Vec<(Duration, String)> = log
        .recent()
        .into_iter()
        .map(|r| {
            (
                r.at,
                format!(
                    "  +{:>10.3}s rung {} {:<13} {:>10.3?} {:>4} req  {}",
                    r.at.as_secs_f64(),
                    r.rung as u8,
                    r.rung.name(),
                    r.duration,
                    r.requests,
                    r.cause
                ),
            )
        })
        .collect();
    for e in ctl.runtime().recent_events() {
        lines.push((
            e.at,
            format!(
                "  +{:>10.3}s rung 2 group {:<7} {:>10.3?} {:>4} tsk  {} ({:?})",
                e.at.as_secs_f64(),
                e.group_name.as_deref().unwrap_or("?"),
                e.duration,
                e.tasks_running as usize + e.tasks_queued,
                e.cause,
                e.outcome
            ),
        ));
    }
    lines.sort_by_key(|(at, _)| *at);
    if lines.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for (_, l) in lines.iter().rev().take(20).rev() {
        let _ = writeln!(out, "{l}");
    }
    out
}

/// Send `request` to the admin socket at `path`; the server's answer.
/// `Err` carries the server's refusal (`error: ...`) or why it could not
/// be reached.
pub fn request(path: &Path, request: &str) -> Result<String, String> {
    let mut s = UnixStream::connect(path).map_err(|e| {
        format!(
            "cannot reach the admin socket {}: {e} (is `rebound serve` running with this --admin?)",
            path.display()
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    writeln!(s, "{request}").map_err(|e| format!("sending the request: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("reading the answer: {e}"))?;
    match answer.strip_prefix("ok\n") {
        Some(text) => Ok(text.to_owned()),
        None => Err(answer
            .trim_end()
            .strip_prefix("error: ")
            .unwrap_or(answer.trim_end())
            .to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_bad_ones_are_refused() {
        assert_eq!(parse_duration("20ms"), Ok(Duration::from_millis(20)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert!(parse_duration("20").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("ms").unwrap_err().contains("not a duration"));
        assert!(parse_duration("2h").is_err());
        assert!(parse_duration("99m").unwrap_err().contains("outside"));
    }

    #[test]
    fn options_refuse_unknown_keys_and_bad_values() {
        let o = Options::parse(&["rate=0.5", "count=3"], &["rate", "count"]).unwrap();
        assert_eq!(o.rate(1.0), Ok(0.5));
        assert_eq!(o.count(), Ok(Some(3)));
        assert!(Options::parse(&["speed=1"], &["rate"]).is_err());
        assert!(Options::parse(&["rate"], &["rate"]).is_err());
        let bad = Options::parse(&["rate=2", "count=0"], &["rate", "count"]).unwrap();
        assert!(bad.rate(1.0).unwrap_err().contains("probability"));
        assert!(bad.count().is_err());
    }
}
