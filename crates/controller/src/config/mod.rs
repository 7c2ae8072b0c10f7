//! Configuration of `rebound serve`: every setting has a default, can be
//! given in a TOML file (`--config FILE`), and can be overridden by a flag.
//! [`Config::validate`] checks the whole configuration and names the
//! offending setting; nothing is silently adjusted.
//!
//! ```toml
//! listen = "127.0.0.1:10809"               # or "unix:/run/rebound/nbd.sock"
//! socket_mode = "0600"                     # mode of a unix: listener's socket file
//! data_dir = "./rebound-data"
//! volume_size = "1G"
//! devices = 1
//! raid = "none"                            # none | mirror (2+ devices) | parity (3+ devices); fixed once the volume exists
//! rebuild_rate = "0"                       # bytes/s a lost device's rebuild may write (0: unthrottled)
//! nvs = "/dev/shm/rebound-XXXXXXXX.nvs"   # default: derived from data_dir
//! nvs_size = "256M"
//! box = "/dev/shm/rebound-XXXXXXXX.box"   # default: derived from data_dir
//! cache_size = "256M"
//! cache_prefault = true                    # map the cache's memory in at start-up, in the background at low priority, nice 10 (false: as it fills)
//! workers = 0                              # 0: one per core
//! policy = "dynamic"
//! idle_spins = 16                          # rcs worker spin before parking
//! task_deadline = "2s"                     # a task running longer fails with a time-out (0s: off)
//! hung_after = "60s"                       # a task still running this long is hung: its group recovers
//!                                          # (default: 30 x task_deadline, at most 3600s; 0s: off)
//! metrics = "127.0.0.1:9109"               # optional
//! admin = "./rebound-data/admin.sock"      # default: <data_dir>/admin.sock
//! trace_tasks = "./tasks.trace"            # optional: record rcs task service times
//! flush = "devices"
//! discard = "keep"                         # TRIM/WRITE_ZEROES: keep (space stays allocated) | unmap (punch holes)
//! direct_io = false
//! device_error_limit = 3                   # write/sync errors before a redundant volume's device is lost
//! power_loss_tracking = false              # keep what a power cut would undo (`inject power-loss`; tests)
//! max_connections = 64                     # clients past their handshake
//! max_connections_per_peer = 0             # connections (negotiating or served) per client address (0: no cap)
//! max_handshakes = 128                     # negotiating at once; past it the oldest is dropped
//! handshake_timeout = "10s"                # the whole negotiation
//! idle_timeout = "0s"                      # close a connection with nothing in flight for this long (0s: never)
//! send_timeout = "60s"                     # close a client that reads no reply for this long
//! reply_budget = "64M"                     # per connection: bytes of admitted requests not yet replied; past it, stop reading
//! tcp_keepalive = "60s"                    # idle time before keepalive probes (0s: off)
//! tls = "off"                              # NBD STARTTLS: off | on (TLS and plaintext) | require (TLS only)
//! tls_certificates = "/etc/rebound/tls"    # ca-cert.pem, server-cert.pem, server-key.pem (qemu's and nbdkit's names)
//! tls_verify_peer = false                  # clients must show a certificate signed by ca-cert.pem
//! tls_psk = "/etc/rebound/keys.psk"        # pre-shared keys, psktool's format (identity:hexkey per line)
//! connection_threads = 4                   # per connection: read requests in turns, run them
//! sched_policy = "batch"                   # connection threads: batch (SCHED_BATCH: a client's send does not preempt it for them) | inherit
//! device_queue_depth = 32                  # per device; a full queue backs off (rung 1)
//! control_blocks = 4096                    # requests in flight, all connections
//! output_commit = "off"                    # rung 3: off | stall | buffering | logging | renaming
//! checkpoint_interval = "20ms"             # longest epoch when output_commit is on
//! commit_when_idle = true                  # also end an epoch early: idle with a client stalled on held output, half the clients' depth held, or output waited 1 ms
//! scrub_interval = "60s"                   # check every dirty NVS record's data this often (0s: off)
//! # faults armed at start (as `rebound inject` would; for experiments):
//! inject = ["panic cache.read rate=0.001 count=unlimited",
//!           "group-fault cache rate=1e-4 duration=20ms"]
//! log_level = "info"                      # error | warn | info | debug | trace (RUST_LOG wins when set)
//! log_format = "text"                      # text | json
//! log_file = "/var/log/rebound.log"        # optional (default: stderr); reopened on SIGHUP
//! [device_latency]
//! fixed_us = 0
//! per_kib_us = 0
//! ```

mod endpoint;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::backend::device::LatencyConfig;
pub use crate::backend::pseudodev::OutputCommit;
pub use crate::nbd::handshake::TlsMode;
pub use crate::sched::SchedPolicy;
pub use crate::units::{parse_duration, parse_size};
pub use endpoint::Endpoint;

use crate::limits::{
    CONNECTION_THREADS_MAX, CONNECTIONS_MAX, CONTROL_BLOCKS_MAX, DEVICE_QUEUE_DEPTH_MAX,
    DEVICES_MAX, MAX_PAYLOAD_BYTES, TRACK_BYTES, VOLUME_BYTES_MAX, WORKERS_MAX,
};

fn de_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Number(n) => Ok(n),
        Size::Text(s) => parse_size(&s).map_err(serde::de::Error::custom),
    }
}

/// What FLUSH and FUA make durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FlushPolicy {
    /// Destage the covered writes to the devices and `fdatasync` them
    /// (survives a host crash when the devices do).
    #[default]
    Devices,
    /// The NVS is the non-volatile medium (as in a controller with
    /// battery-backed NVS): `msync` the NVS region and reply.
    Nvs,
}

/// What TRIM and WRITE_ZEROES do with the device files' space (both make
/// the range read as zeroes either way).
///
/// The device files are preallocated so that a full file system is found
/// at start-up ([`crate::files::reserve`]); a hole punched by a TRIM gives
/// that space back, and a later destage into the range would allocate it
/// again and could fail with `ENOSPC` after the write was acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Discard {
    /// Keep the space allocated (`FALLOC_FL_ZERO_RANGE`, or writing
    /// zeroes where the file system lacks it): no write to the range can
    /// later find the file system full.
    #[default]
    Keep,
    /// Give the space back to the file system (`FALLOC_FL_PUNCH_HOLE`),
    /// except for a WRITE_ZEROES with `NBD_CMD_FLAG_NO_HOLE`. For thin
    /// provisioning, where the operator watches the file system's space.
    Unmap,
}

impl Discard {
    /// The valid values, as written in the TOML file and the flag.
    pub const NAMES: &'static [&'static str] = &["keep", "unmap"];

    /// Whether zeroing a range keeps its space allocated; `no_hole`: the
    /// request forbids a hole (WRITE_ZEROES with `NBD_CMD_FLAG_NO_HOLE`).
    pub fn keeps_allocation(self, no_hole: bool) -> bool {
        match self {
            Self::Keep => true,
            Self::Unmap => no_hole,
        }
    }
}

impl std::str::FromStr for Discard {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "keep" => Ok(Self::Keep),
            "unmap" => Ok(Self::Unmap),
            other => Err(format!(
                "unknown discard mode {other:?} (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

impl<'de> Deserialize<'de> for OutputCommitSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        OutputCommit::parse(&s)
            .map(OutputCommitSetting)
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for OutputCommitSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.name())
    }
}

/// [`OutputCommit`] as written in the TOML file (an unknown scheme is
/// refused with the list of known ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutputCommitSetting(pub OutputCommit);

fn de_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse_duration(&s).map_err(serde::de::Error::custom)
}

/// A size as the configuration writes it: `256M` where a unit divides it.
fn ser_size<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if *v != 0 && v.trailing_zeros() >= shift {
            return s.serialize_str(&format!("{}{unit}", v >> shift));
        }
    }
    s.serialize_str(&v.to_string())
}

/// A duration as the configuration writes it (`20ms`, `2s`, `1.5s`).
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        "0s".into()
    } else if ns.is_multiple_of(1_000_000_000) {
        format!("{}s", d.as_secs())
    } else if ns.is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else if ns.is_multiple_of(1_000) {
        format!("{}us", d.as_micros())
    } else {
        format!("{ns}ns")
    }
}

fn ser_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_duration(*d))
}

fn ser_opt_duration<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => ser_duration(d, s),
        None => s.serialize_none(),
    }
}

/// A file mode: an octal string ("0600", "660") or an integer.
fn de_mode<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Mode {
        Text(String),
        Number(u32),
    }
    match Mode::deserialize(d)? {
        Mode::Number(n) => Ok(n),
        Mode::Text(t) => parse_mode(&t).map_err(serde::de::Error::custom),
    }
}

fn ser_mode<S: serde::Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:04o}"))
}

/// An octal file mode ("0600", "660", "0o600").
pub fn parse_mode(text: &str) -> Result<u32, String> {
    let digits = text.trim_start_matches("0o");
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{text:?} is not an octal file mode such as 0600"))
}

fn de_opt_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    de_duration(d).map(Some)
}

/// How many task deadlines a task runs before it is called hung, when
/// `hung_after` is not set: 60 s at the default deadline of 2 s, far past
/// any step of a request (microseconds to a few milliseconds) and any
/// device call short of a device that stopped answering.
pub const HUNG_AFTER_DEADLINES: u32 = 30;

/// The configuration of one controller.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the NBD listener listens (TCP address or `unix:PATH`).
    pub listen: Endpoint,
    /// Mode of the socket file of a `unix:` listener (octal, e.g. "0600").
    #[serde(deserialize_with = "de_mode", serialize_with = "ser_mode")]
    pub socket_mode: u32,
    /// Directory holding the volume label and the device files.
    pub data_dir: PathBuf,
    /// Size of the exported volume (a multiple of 4 KiB).
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub volume_size: u64,
    /// Backend device files the volume is striped over (track by track).
    pub devices: u32,
    /// Redundancy across the devices ([`crate::backend::raid`]).
    pub raid: crate::backend::raid::Raid,
    /// Bytes per second a lost device's rebuild may write (0: unthrottled).
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub rebuild_rate: u64,
    /// Path of the NVS file (default: under /dev/shm, named after `data_dir`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvs: Option<PathBuf>,
    /// Size of the NVS.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub nvs_size: u64,
    /// Path of the recovery box (default: under /dev/shm, named after `data_dir`).
    #[serde(rename = "box", skip_serializing_if = "Option::is_none")]
    pub box_path: Option<PathBuf>,
    /// Size of the read cache; a cache larger than the volume gets one
    /// frame per track of the volume and no more.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub cache_size: u64,
    /// Map the cache's memory in at start-up, by a background thread at
    /// low priority ([`crate::engine::prefault`]), so no request pays a
    /// page fault for a frame's first fill; false: mapped as it fills.
    pub cache_prefault: bool,
    /// rcs worker threads (0: one per core).
    pub workers: usize,
    /// rcs scheduling policy.
    pub policy: String,
    /// Scheduling rounds an idle rcs worker spins before parking.
    pub idle_spins: u32,
    /// How long a task may run before the rcs watchdog declares it past its
    /// deadline: it then fails with a time-out at its next check or stall
    /// and is handled like any task failure (a redrive at rung 1). Zero:
    /// no watchdog.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub task_deadline: Duration,
    /// A task still running this long ignored its time-out (it never
    /// checks): the watchdog recovers its group (rung 2), which cannot drain
    /// and escalates to rung 4; if rung 4 cannot quiesce either, the process
    /// aborts and rung 5 restarts it. `None` (the default): see
    /// [`Config::hung_after`]; zero: off. No step of a request waits inside
    /// its task (FLUSH, FUA, TRIM and WRITE_ZEROES wait between tasks), so
    /// only a device call that does not return for this long trips it.
    #[serde(
        deserialize_with = "de_opt_duration",
        serialize_with = "ser_opt_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub hung_after: Option<Duration>,
    /// Prometheus endpoint (`http://ADDR/metrics`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<SocketAddr>,
    /// Admin socket for `rebound status` and `rebound inject` (default:
    /// `<data_dir>/admin.sock`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin: Option<PathBuf>,
    /// Record every task's service time per group and priority and write
    /// the trace here (every 2 s and at shutdown) for `rebound sim rcs
    /// --trace` (format: `rcs::trace`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_tasks: Option<PathBuf>,
    /// What FLUSH and FUA make durable.
    pub flush: FlushPolicy,
    /// What TRIM and WRITE_ZEROES do with the device files' space.
    pub discard: Discard,
    /// Open device files with `O_DIRECT`.
    pub direct_io: bool,
    /// Write or sync errors (not `ENOSPC`) after which a device of a
    /// redundant volume is declared lost.
    pub device_error_limit: u64,
    /// Keep, per device, what a power cut would undo, so `rebound inject
    /// power-loss` can run (tests and benches: it costs a read per device
    /// write).
    pub power_loss_tracking: bool,
    /// Most concurrent NBD connections.
    pub max_connections: usize,
    /// Threads per connection: they take turns reading requests and run
    /// them (see `connection`).
    pub connection_threads: usize,
    /// The Linux scheduling policy of the connections' threads
    /// ([`crate::sched`]).
    pub sched_policy: SchedPolicy,
    /// Most connections (negotiating or served) from one client address;
    /// 0: no cap. Unix-socket clients are one peer.
    pub max_connections_per_peer: usize,
    /// Most connections negotiating at once; a new one past it ends the
    /// oldest negotiation (a well-behaved client negotiates in
    /// milliseconds, so the oldest is the likeliest to be stalled).
    pub max_handshakes: usize,
    /// How long the whole negotiation may take, however the client
    /// trickles its bytes.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub handshake_timeout: Duration,
    /// Close a served connection that sent nothing and has nothing in
    /// flight for this long; zero: never.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub idle_timeout: Duration,
    /// Close a client that has read none of its replies for this long
    /// (its acknowledged writes are kept).
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub send_timeout: Duration,
    /// Per connection: bytes of admitted requests whose replies have not
    /// left (a READ counts its data, a WRITE its payload). Past it the
    /// connection's requests are not read until replies drain.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub reply_budget: u64,
    /// Idle time before TCP keepalive probes start (then every 10 s, 6
    /// probes): a vanished peer is found; zero: no keepalive.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub tcp_keepalive: Duration,
    /// NBD STARTTLS ([`TlsMode`]): `on` or `require` needs
    /// `tls_certificates` or `tls_psk`.
    pub tls: TlsMode,
    /// Directory of the server's X.509 credentials, named as qemu and
    /// nbdkit name them: `server-cert.pem`, `server-key.pem` (mode 0600 or
    /// stricter) and, for `tls_verify_peer`, `ca-cert.pem`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_certificates: Option<PathBuf>,
    /// Clients must present a certificate signed by `ca-cert.pem`
    /// (a PSK client is authenticated by its key instead).
    pub tls_verify_peer: bool,
    /// Pre-shared keys, psktool's format: `identity:hexkey` per line
    /// (mode 0600 or stricter).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_psk: Option<PathBuf>,
    /// Outstanding reads and writes per backend device (its submission
    /// queue); a full queue makes the I/O back off and retry.
    pub device_queue_depth: u32,
    /// Request control blocks: requests in flight across all connections
    /// (admission waits for a free one; leaked ones are reclaimed).
    pub control_blocks: u32,
    /// Rung 3's output commit scheme (`off`: no epochs, no rollback).
    pub output_commit: OutputCommitSetting,
    /// Epoch length: how often the controller's state is checkpointed and
    /// held output released (when `output_commit` is on).
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub checkpoint_interval: Duration,
    /// Also end an epoch early: when the controller is idle with a client
    /// stalled on held output (at most every 100 µs), when half of what
    /// the clients keep in flight is held, or once output has
    /// waited 1 ms ([`crate::engine::epoch::OUTPUT_WAIT_MAX`]), instead of
    /// only every interval.
    pub commit_when_idle: bool,
    /// How often the scrub checks the data of every dirty NVS record
    /// ([`crate::engine::scrub`]); zero: off.
    #[serde(deserialize_with = "de_duration", serialize_with = "ser_duration")]
    pub scrub_interval: Duration,
    /// Modelled device latency.
    pub device_latency: LatencyConfig,
    /// Refuse every change: writes, trims and zeroes answer `EPERM`
    /// (NBD_FLAG_READ_ONLY is advertised).
    pub read_only: bool,
    /// The export's listed name (LIST, INFO); the default export `""` is
    /// always served too.
    pub export_name: String,
    /// The export's description (LIST, INFO); empty: the volume's id and
    /// size.
    pub description: String,
    /// Faults armed at start, each as the words after `rebound inject`
    /// on the admin socket: `panic|fail|delay POINT [rate= count=
    /// duration=]` or `group-fault GROUP [rate= duration=]`.
    pub inject: Vec<String>,
    /// What the server logs ([`LogLevel`]); `RUST_LOG` wins when set.
    pub log_level: LogLevel,
    /// How log lines are written ([`LogFormat`]).
    pub log_format: LogFormat,
    /// Log to this file instead of stderr (reopened on SIGHUP, so it can
    /// be rotated by renaming it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_file: Option<PathBuf>,
}

/// How much the server logs: `error`, `warn`, `info` (the default:
/// every recovery, the listeners at start) , `debug` (also task panics
/// the runtime handles), `trace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Errors and warnings.
    Warn,
    /// Also every recovery (the default).
    #[default]
    Info,
    /// Also what the runtime handles silently (task panics, redrives).
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// The valid values, as written in the TOML file and the flag.
    pub const NAMES: &'static [&'static str] = &["error", "warn", "info", "debug", "trace"];

    /// The name, as a `tracing` filter directive takes it.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl std::str::FromStr for LogLevel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match Self::NAMES.iter().position(|n| *n == s) {
            Some(0) => Ok(Self::Error),
            Some(1) => Ok(Self::Warn),
            Some(2) => Ok(Self::Info),
            Some(3) => Ok(Self::Debug),
            Some(_) => Ok(Self::Trace),
            None => Err(format!(
                "unknown log level {s:?} (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event (the default).
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields).
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!(
                "unknown log format {other:?} (expected one of: text, json)"
            )),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: Endpoint::Tcp("127.0.0.1:10809".parse().expect("static address")),
            socket_mode: 0o600,
            data_dir: PathBuf::from("./rebound-data"),
            volume_size: 1 << 30,
            devices: 1,
            raid: crate::backend::raid::Raid::None,
            rebuild_rate: 0,
            nvs: None,
            nvs_size: 256 << 20,
            box_path: None,
            cache_size: 256 << 20,
            workers: 0,
            policy: "dynamic".to_owned(),
            // Measured with fio cache-standard: spinning ~100 µs before
            // parking saves a futex wake-up per request under load.
            // Requests run on their connections' threads (affiliates), so
            // workers mostly take background work (destage, redrives): a
            // long spin before parking only burns CPU (measured: 1024
            // spins cost about 1.5 µs per I/O at 20k IOPS, with no gain at
            // saturation).
            idle_spins: 16,
            // Far above any step of a request (microseconds to a few ms,
            // a modelled device included), well below a client's patience.
            task_deadline: Duration::from_secs(2),
            hung_after: None,
            metrics: None,
            admin: None,
            trace_tasks: None,
            flush: FlushPolicy::Devices,
            discard: Discard::Keep,
            direct_io: false,
            device_error_limit: crate::backend::volume::DEVICE_ERROR_LIMIT,
            power_loss_tracking: false,
            max_connections: 64,
            connection_threads: 4,
            sched_policy: SchedPolicy::Batch,
            max_connections_per_peer: 0,
            max_handshakes: 128,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::ZERO,
            send_timeout: Duration::from_secs(60),
            reply_budget: 64 << 20,
            tcp_keepalive: Duration::from_secs(60),
            tls: TlsMode::Off,
            tls_certificates: None,
            tls_verify_peer: false,
            tls_psk: None,
            device_queue_depth: 32,
            control_blocks: 4096,
            output_commit: OutputCommitSetting::default(),
            checkpoint_interval: Duration::from_millis(20),
            commit_when_idle: true,
            cache_prefault: true,
            scrub_interval: Duration::from_secs(60),
            device_latency: LatencyConfig::default(),
            read_only: false,
            export_name: "rebound".to_owned(),
            description: String::new(),
            inject: Vec::new(),
            log_level: LogLevel::Info,
            log_format: LogFormat::Text,
            log_file: None,
        }
    }
}

/// A configuration problem, naming the setting.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this configuration.
    #[error("invalid configuration file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key and line).
        message: String,
    },
    /// A setting out of range.
    #[error("invalid setting {setting}: {message}")]
    Invalid {
        /// The setting's name.
        setting: &'static str,
        /// What is wrong.
        message: String,
    },
}

fn invalid(setting: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting,
        message: message.into(),
    }
}

impl Config {
    /// Load a TOML file (missing keys take their defaults).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// The NVS path: configured, or `/dev/shm/rebound-<hash of data_dir>.nvs`.
    pub fn nvs_path(&self) -> PathBuf {
        self.nvs
            .clone()
            .unwrap_or_else(|| shm_path(&self.data_dir, "nvs"))
    }

    /// The recovery box path: configured, or `/dev/shm/rebound-<hash of data_dir>.box`.
    pub fn box_path(&self) -> PathBuf {
        self.box_path
            .clone()
            .unwrap_or_else(|| shm_path(&self.data_dir, "box"))
    }

    /// The admin socket path: configured, or `<data_dir>/admin.sock`.
    pub fn admin_path(&self) -> PathBuf {
        self.admin
            .clone()
            .unwrap_or_else(|| self.data_dir.join("admin.sock"))
    }

    /// Tracks in the volume.
    pub fn volume_tracks(&self) -> u64 {
        self.volume_size / TRACK_BYTES as u64
    }

    /// The rcs policy.
    pub fn rcs_policy(&self) -> Result<rcs::Policy, ConfigError> {
        self.policy
            .parse()
            .map_err(|e: String| invalid("policy", e))
    }

    /// When a running task is called hung (`None`: never): `hung_after`
    /// as set (zero: never), else [`HUNG_AFTER_DEADLINES`] task deadlines,
    /// at most 3600 s, and never while the task deadline is off (the
    /// watchdog that calls a task hung is the deadline's).
    pub fn hung_after(&self) -> Option<Duration> {
        match self.hung_after {
            Some(set) => Some(set).filter(|d| !d.is_zero()),
            None if self.task_deadline.is_zero() => None,
            None => {
                Some((self.task_deadline * HUNG_AFTER_DEADLINES).min(Duration::from_secs(3600)))
                    .filter(|&h| h > self.task_deadline)
            }
        }
    }

    /// The configuration as the server uses it: the paths and thresholds
    /// derived from other settings written out (NVS, box, admin socket,
    /// `hung_after`, `0s` when off).
    pub fn effective(&self) -> Self {
        Self {
            nvs: Some(self.nvs_path()),
            box_path: Some(self.box_path()),
            admin: Some(self.admin_path()),
            hung_after: Some(self.hung_after().unwrap_or(Duration::ZERO)),
            ..self.clone()
        }
    }

    /// The configuration as a TOML file `--config` accepts.
    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    /// Check every setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_inject()?;
        self.validate_volume_geometry()?;
        if self.device_error_limit == 0 {
            return Err(invalid(
                "device_error_limit",
                "must be at least 1 (errors before a device is declared lost)",
            ));
        }
        self.validate_admin_path()?;
        self.validate_devices_fit_volume()?;
        self.validate_nvs_and_cache_sizes()?;
        self.validate_threads_and_queues()?;
        self.validate_timing()?;
        self.validate_connections()?;
        self.validate_export()?;
        self.validate_tls()?;
        self.validate_device_latency()
    }

    /// TLS settings agree with each other; the files themselves are read
    /// and checked when the listener starts (`host::tls`).
    fn validate_tls(&self) -> Result<(), ConfigError> {
        let credentials = self.tls_certificates.is_some() || self.tls_psk.is_some();
        if self.tls == TlsMode::Off {
            if credentials || self.tls_verify_peer {
                return Err(invalid(
                    "tls",
                    "is off, but TLS credentials or tls_verify_peer are set: set tls = \"on\" or \"require\", or remove them",
                ));
            }
            return Ok(());
        }
        if !credentials {
            return Err(invalid(
                "tls",
                "on or require needs tls_certificates (a directory with server-cert.pem and server-key.pem) or tls_psk (a psktool key file)",
            ));
        }
        if self.tls_verify_peer && self.tls_certificates.is_none() {
            return Err(invalid(
                "tls_verify_peer",
                "needs tls_certificates (its ca-cert.pem verifies the clients' certificates)",
            ));
        }
        Ok(())
    }

    /// The export's name and description are NBD strings: UTF-8 without
    /// NUL, at most 4096 bytes; the name is not empty (`""` is always
    /// served as the default export).
    fn validate_export(&self) -> Result<(), ConfigError> {
        for (setting, text) in [
            ("export_name", &self.export_name),
            ("description", &self.description),
        ] {
            if text.len() > 4096 || text.contains('\0') {
                return Err(invalid(
                    setting,
                    "must be at most 4096 bytes of UTF-8 without NUL characters",
                ));
            }
        }
        if self.export_name.is_empty() {
            return Err(invalid(
                "export_name",
                "must not be empty (the default export \"\" is always served besides it)",
            ));
        }
        Ok(())
    }

    /// Faults to arm at start: each parses, and is one start can arm.
    fn validate_inject(&self) -> Result<(), ConfigError> {
        for entry in &self.inject {
            let words: Vec<&str> = entry.split_whitespace().collect();
            let fault = crate::faults::Fault::parse(&words)
                .map_err(|e| invalid("inject", format!("{entry:?}: {e}")))?;
            if !fault.armable_at_start() {
                return Err(invalid(
                    "inject",
                    format!(
                        "{entry:?}: at start only `panic|fail|delay|hang POINT [rate=P] [count=N] [duration=D]` `group-fault GROUP [rate=P] [duration=D]` and `device-error`/`device-latency DEVICE ...` can be armed"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The volume's size, and its devices for the RAID level.
    fn validate_volume_geometry(&self) -> Result<(), ConfigError> {
        let track = TRACK_BYTES as u64;
        if self.volume_size == 0 || !self.volume_size.is_multiple_of(track) {
            return Err(invalid(
                "volume_size",
                format!(
                    "{} is not a positive multiple of {track} bytes",
                    self.volume_size
                ),
            ));
        }
        if self.volume_size > VOLUME_BYTES_MAX {
            return Err(invalid(
                "volume_size",
                format!(
                    "{} exceeds the {VOLUME_BYTES_MAX}-byte maximum",
                    self.volume_size
                ),
            ));
        }
        if self.devices == 0 || self.devices > DEVICES_MAX {
            return Err(invalid("devices", format!("must be in 1..={DEVICES_MAX}")));
        }
        if self.devices < self.raid.min_devices() {
            return Err(invalid(
                "devices",
                format!(
                    "raid {} needs at least {} devices, not {}",
                    self.raid,
                    self.raid.min_devices(),
                    self.devices
                ),
            ));
        }
        Ok(())
    }

    /// The admin socket's path fits a Unix socket address.
    fn validate_admin_path(&self) -> Result<(), ConfigError> {
        // sun_path holds 108 bytes with the terminating NUL.
        let admin = self.admin_path();
        if admin.as_os_str().len() > 107 {
            return Err(invalid(
                "admin",
                format!(
                    "{} is longer than the 107 bytes a Unix socket path may have",
                    admin.display()
                ),
            ));
        }
        Ok(())
    }

    /// Every device holds at least one track of the volume.
    fn validate_devices_fit_volume(&self) -> Result<(), ConfigError> {
        if u64::from(self.devices) > self.volume_tracks() {
            return Err(invalid(
                "devices",
                "more devices than 4 KiB tracks in the volume",
            ));
        }
        Ok(())
    }

    /// The NVS and cache sizes.
    fn validate_nvs_and_cache_sizes(&self) -> Result<(), ConfigError> {
        let track = TRACK_BYTES as u64;
        let min_nvs = 2 * (MAX_PAYLOAD_BYTES as u64) + (1 << 20);
        if self.nvs_size < min_nvs {
            return Err(invalid(
                "nvs_size",
                format!(
                    "{} is too small: the NVS must hold two maximum-size writes ({} bytes at least)",
                    self.nvs_size, min_nvs
                ),
            ));
        }
        if self.nvs_size > (1u64 << 40) {
            return Err(invalid("nvs_size", "above 1 TiB"));
        }
        if self.cache_size < 64 * track || self.cache_size > (1u64 << 40) {
            return Err(invalid("cache_size", "must be between 256 KiB and 1 TiB"));
        }
        Ok(())
    }

    /// Workers, the rcs policy, idle spins, control blocks and device
    /// queue depth.
    fn validate_threads_and_queues(&self) -> Result<(), ConfigError> {
        if self.workers > WORKERS_MAX {
            return Err(invalid("workers", format!("at most {WORKERS_MAX}")));
        }
        self.rcs_policy()?;
        if self.idle_spins > rcs::limits::IDLE_SPINS_MAX {
            return Err(invalid(
                "idle_spins",
                format!("at most {}", rcs::limits::IDLE_SPINS_MAX),
            ));
        }
        if self.control_blocks == 0 || self.control_blocks > CONTROL_BLOCKS_MAX {
            return Err(invalid(
                "control_blocks",
                format!("must be in 1..={CONTROL_BLOCKS_MAX}"),
            ));
        }
        if self.device_queue_depth == 0 || self.device_queue_depth > DEVICE_QUEUE_DEPTH_MAX {
            return Err(invalid(
                "device_queue_depth",
                format!("must be in 1..={DEVICE_QUEUE_DEPTH_MAX}"),
            ));
        }
        Ok(())
    }

    /// Task deadline, hung threshold, checkpoint and scrub intervals.
    fn validate_timing(&self) -> Result<(), ConfigError> {
        if !self.task_deadline.is_zero()
            && (self.task_deadline < Duration::from_millis(1)
                || self.task_deadline > Duration::from_secs(3600))
        {
            return Err(invalid(
                "task_deadline",
                "must be 0s (off) or between 1ms and 3600s",
            ));
        }
        if let Some(hung) = self.hung_after
            && !hung.is_zero()
            && (self.task_deadline.is_zero()
                || hung <= self.task_deadline
                || hung > Duration::from_secs(3600))
        {
            return Err(invalid(
                "hung_after",
                "must be 0s (off) or longer than task_deadline (which must be on) and at most 3600s",
            ));
        }
        if self.checkpoint_interval < Duration::from_micros(100)
            || self.checkpoint_interval > Duration::from_secs(10)
        {
            return Err(invalid(
                "checkpoint_interval",
                "must be between 100us and 10s",
            ));
        }
        if !self.scrub_interval.is_zero()
            && (self.scrub_interval < Duration::from_millis(100)
                || self.scrub_interval > Duration::from_secs(86_400))
        {
            return Err(invalid(
                "scrub_interval",
                "must be 0s (off) or between 100ms and 86400s",
            ));
        }
        Ok(())
    }

    /// Connection limits and connection threads.
    fn validate_connections(&self) -> Result<(), ConfigError> {
        if self.max_connections == 0 || self.max_connections > CONNECTIONS_MAX {
            return Err(invalid(
                "max_connections",
                format!("must be in 1..={CONNECTIONS_MAX}"),
            ));
        }
        if self.connection_threads == 0 || self.connection_threads > CONNECTION_THREADS_MAX {
            return Err(invalid(
                "connection_threads",
                format!("must be in 1..={CONNECTION_THREADS_MAX}"),
            ));
        }
        if self.max_connections_per_peer > CONNECTIONS_MAX {
            return Err(invalid(
                "max_connections_per_peer",
                format!("must be in 0..={CONNECTIONS_MAX} (0: no cap)"),
            ));
        }
        if self.max_handshakes == 0 || self.max_handshakes > CONNECTIONS_MAX {
            return Err(invalid(
                "max_handshakes",
                format!("must be in 1..={CONNECTIONS_MAX}"),
            ));
        }
        self.validate_connection_timing()?;
        if self.socket_mode & !0o777 != 0 || self.socket_mode & 0o600 != 0o600 {
            return Err(invalid(
                "socket_mode",
                format!(
                    "{:#o} must be permission bits (at most 0777) that let the server's user read and write (0600 at least)",
                    self.socket_mode
                ),
            ));
        }
        Ok(())
    }

    /// The connections' time limits and reply budget.
    fn validate_connection_timing(&self) -> Result<(), ConfigError> {
        let secs = |d: Duration| d.as_secs_f64();
        if !(0.1..=3600.0).contains(&secs(self.handshake_timeout)) {
            return Err(invalid(
                "handshake_timeout",
                "must be between 100ms and 3600s",
            ));
        }
        if !self.idle_timeout.is_zero() && !(1.0..=604_800.0).contains(&secs(self.idle_timeout)) {
            return Err(invalid(
                "idle_timeout",
                "must be 0s (never) or between 1s and 604800s",
            ));
        }
        if !(0.1..=86_400.0).contains(&secs(self.send_timeout)) {
            return Err(invalid("send_timeout", "must be between 100ms and 86400s"));
        }
        if !self.tcp_keepalive.is_zero() && !(1.0..=86_400.0).contains(&secs(self.tcp_keepalive)) {
            return Err(invalid(
                "tcp_keepalive",
                "must be 0s (off) or between 1s and 86400s",
            ));
        }
        if self.reply_budget < 1 << 20 || self.reply_budget > 1 << 40 {
            return Err(invalid("reply_budget", "must be between 1M and 1T"));
        }
        Ok(())
    }

    /// The emulated device latency.
    fn validate_device_latency(&self) -> Result<(), ConfigError> {
        if self.device_latency.fixed_us > 10_000_000 || self.device_latency.per_kib_us > 1_000_000 {
            return Err(invalid(
                "device_latency",
                "above 10 s per I/O or 1 s per KiB",
            ));
        }
        Ok(())
    }
}

/// `/dev/shm/rebound-<crc32c of the canonical data dir>.<ext>`.
pub fn shm_path(data_dir: &Path, ext: &str) -> PathBuf {
    let canonical = std::fs::canonicalize(data_dir).unwrap_or_else(|_| {
        std::env::current_dir()
            .map(|cwd| cwd.join(data_dir))
            .unwrap_or_else(|_| data_dir.to_owned())
    });
    let hash = crc32c::crc32c(canonical.to_string_lossy().as_bytes());
    PathBuf::from(format!("/dev/shm/rebound-{hash:08x}.{ext}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units_and_reject_garbage() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size(" 2t ").unwrap(), 2 << 40);
        for bad in ["", "G", "1X", "-1", "99999999999999999999", "20000000T"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn defaults_are_valid_and_toml_overrides_them() {
        Config::default().validate().unwrap();
        let c: Config = toml::from_str(
            "volume_size = \"64M\"\nnvs_size = 134217728\n[device_latency]\nfixed_us = 100\n",
        )
        .unwrap();
        assert_eq!(c.volume_size, 64 << 20);
        assert_eq!(c.nvs_size, 128 << 20);
        assert_eq!(c.device_latency.fixed_us, 100);
        assert_eq!(c.listen, Config::default().listen);
        c.validate().unwrap();
    }

    #[test]
    fn export_name_and_description_are_nbd_strings() {
        let c: Config =
            toml::from_str("read_only = true\nexport_name = \"disk0\"\ndescription = \"scratch\"")
                .unwrap();
        assert!(c.read_only);
        assert_eq!(c.export_name, "disk0");
        c.validate().unwrap();
        for (key, value) in [
            ("export_name", String::new()),
            ("export_name", "a\0b".to_owned()),
            ("description", "x".repeat(4097)),
        ] {
            let mut c = Config::default();
            match key {
                "export_name" => c.export_name = value,
                _ => c.description = value,
            }
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_setting() {
        let err = toml::from_str::<Config>("volume_sise = \"1G\"").unwrap_err();
        assert!(err.to_string().contains("volume_sise"), "{err}");
        let err = toml::from_str::<Config>("cache_size = \"lots\"").unwrap_err();
        assert!(err.to_string().contains("lots"), "{err}");
        let err = toml::from_str::<Config>("raid = \"raid5\"").unwrap_err();
        assert!(
            err.to_string().contains("raid5") && err.to_string().contains("parity"),
            "{err}"
        );
        let mut c = Config {
            volume_size: 1000,
            ..Config::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("volume_size") && e.contains("4096"), "{e}");
        c.volume_size = 1 << 30;
        c.devices = 2;
        c.raid = crate::backend::raid::Raid::Parity;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("raid parity needs at least 3 devices"), "{e}");
        c.devices = 3;
        c.validate().unwrap();
        c.policy = "fast".into();
        assert!(c.validate().unwrap_err().to_string().contains("policy"));
        c.policy = "static".into();
        c.nvs_size = 1 << 20;
        assert!(c.validate().unwrap_err().to_string().contains("nvs_size"));
        c.nvs_size = 256 << 20;
        c.devices = 0;
        assert!(c.validate().unwrap_err().to_string().contains("devices"));
    }

    #[test]
    fn tls_settings_must_agree_and_name_what_is_missing() {
        let c: Config = toml::from_str("tls = \"require\"").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("tls_certificates") && e.contains("tls_psk"),
            "{e}"
        );
        let c: Config =
            toml::from_str("tls = \"on\"\ntls_psk = \"/k.psk\"\ntls_verify_peer = true").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("tls_verify_peer") && e.contains("ca-cert.pem"),
            "{e}"
        );
        let c: Config = toml::from_str("tls_certificates = \"/etc/tls\"").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("setting tls: is off"), "{e}");
        let c: Config = toml::from_str(
            "tls = \"require\"\ntls_certificates = \"/etc/tls\"\ntls_verify_peer = true",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.tls, TlsMode::Require);
        let err = toml::from_str::<Config>("tls = \"yes\"").unwrap_err();
        assert!(err.to_string().contains("require"), "{err}");
    }

    #[test]
    fn discard_keeps_allocation_by_default_and_unmap_punches_unless_no_hole() {
        let c = Config::default();
        assert_eq!(c.discard, Discard::Keep);
        assert!(c.discard.keeps_allocation(false), "TRIM keeps the space");
        assert!(c.discard.keeps_allocation(true));
        let c: Config = toml::from_str("discard = \"unmap\"").unwrap();
        assert_eq!(c.discard, Discard::Unmap);
        assert!(!c.discard.keeps_allocation(false), "TRIM punches a hole");
        assert!(c.discard.keeps_allocation(true), "NO_HOLE is honoured");
        let c: Config = toml::from_str("discard = \"keep\"").unwrap();
        assert_eq!(c.discard, Discard::Keep);
        assert_eq!("unmap".parse::<Discard>(), Ok(Discard::Unmap));
    }

    #[test]
    fn a_bad_discard_mode_is_refused_with_the_valid_ones() {
        let err = toml::from_str::<Config>("discard = \"trim\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("trim") && err.contains("keep") && err.contains("unmap"),
            "{err}"
        );
        let err = "trim".parse::<Discard>().unwrap_err();
        assert!(
            err.contains("\"trim\"") && err.contains("keep, unmap"),
            "{err}"
        );
    }

    #[test]
    fn sched_policy_is_batch_by_default_and_a_bad_one_is_refused_from_toml() {
        assert_eq!(Config::default().sched_policy, SchedPolicy::Batch);
        let c: Config = toml::from_str("sched_policy = \"inherit\"").unwrap();
        assert_eq!(c.sched_policy, SchedPolicy::Inherit);
        let err = toml::from_str::<Config>("sched_policy = \"fifo\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fifo") && err.contains("batch") && err.contains("inherit"),
            "{err}"
        );
    }

    #[test]
    fn default_nvs_path_lives_in_shm_and_depends_on_the_data_dir() {
        let a = Config::default().nvs_path();
        let b = Config {
            data_dir: "/tmp/other".into(),
            ..Config::default()
        }
        .nvs_path();
        assert!(a.starts_with("/dev/shm"));
        assert_ne!(a, b);
    }

    #[test]
    fn the_effective_configuration_round_trips_through_toml() {
        for text in [
            "",
            "volume_size = \"96M\"\ncheckpoint_interval = \"1.5s\"\nhung_after = \"90s\"\nlog_level = \"debug\"\nlog_format = \"json\"\nmetrics = \"127.0.0.1:9\"\noutput_commit = \"renaming\"\nraid = \"mirror\"\ndevices = 2\nflush = \"nvs\"\nrebuild_rate = 12345\n[device_latency]\nfixed_us = 3\n",
        ] {
            let c: Config = toml::from_str(text).unwrap();
            let dumped = c.effective().to_toml().unwrap();
            let back: Config = toml::from_str(&dumped).unwrap_or_else(|e| panic!("{e}\n{dumped}"));
            assert_eq!(back, c.effective(), "{dumped}");
            back.validate().unwrap();
        }
        let err = toml::from_str::<Config>("log_level = \"loud\"").unwrap_err();
        assert!(err.to_string().contains("loud"), "{err}");
        assert_eq!("warn".parse::<LogLevel>(), Ok(LogLevel::Warn));
        assert!(
            "loud"
                .parse::<LogLevel>()
                .unwrap_err()
                .contains("error, warn, info")
        );
        assert_eq!(format_duration(Duration::from_micros(1500)), "1500us");
    }

    #[test]
    fn hung_after_defaults_to_thirty_deadlines_and_follows_the_deadline_off() {
        let mut c = Config::default();
        assert_eq!(c.hung_after(), Some(Duration::from_secs(60)));
        c.task_deadline = Duration::from_millis(100);
        assert_eq!(c.hung_after(), Some(Duration::from_secs(3)));
        c.task_deadline = Duration::from_secs(600);
        assert_eq!(c.hung_after(), Some(Duration::from_secs(3600)), "capped");
        c.task_deadline = Duration::from_secs(3600);
        assert_eq!(c.hung_after(), None, "no room above the deadline: off");
        c.task_deadline = Duration::ZERO;
        assert_eq!(c.hung_after(), None, "the deadline's watchdog is off");
        assert!(c.validate().is_ok());
        c.task_deadline = Duration::from_secs(2);
        c.hung_after = Some(Duration::ZERO);
        assert_eq!(c.hung_after(), None, "0s: off");
        c.hung_after = Some(Duration::from_secs(5));
        assert_eq!(c.hung_after(), Some(Duration::from_secs(5)));
        let toml: Config = toml::from_str("hung_after = \"90s\"").unwrap();
        assert_eq!(toml.hung_after(), Some(Duration::from_secs(90)));
        c.hung_after = Some(Duration::from_secs(1));
        assert!(c.validate().is_err(), "not above the deadline");
    }
}
