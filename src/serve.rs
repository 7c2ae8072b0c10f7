//! `rebound serve`: run the storage controller, until SIGINT or SIGTERM;
//! SIGHUP reopens the log file and reloads the log level. Under systemd it
//! serves an inherited socket and reports readiness, status and a
//! watchdog ([`crate::systemd`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use controller::{Config, Controller, FlushPolicy, OutputCommit, Server};

/// Options of `rebound serve`. Each overrides the same key of `--config`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML configuration file (keys as the long options, with underscores).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where to listen for NBD clients: ADDR:PORT, or unix:PATH for a
    /// Unix socket (clients use nbd+unix:///?socket=PATH)
    /// [default: 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR|unix:PATH")]
    listen: Option<controller::config::Endpoint>,
    /// Mode of a unix: listener's socket file, octal [default: 0600].
    #[arg(long, value_name = "MODE", value_parser = controller::config::parse_mode)]
    socket_mode: Option<u32>,
    /// Directory of the volume label and device files [default: ./rebound-data].
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Volume size, e.g. 1G, 512M [default: 1G]. Fixed once the volume exists.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    volume_size: Option<u64>,
    /// Device files to stripe the volume over [default: 1].
    #[arg(long, value_name = "N")]
    devices: Option<u32>,
    /// Redundancy across the devices: none, mirror (2+ devices; two copies
    /// of every track) or parity (3+ devices; rotated parity). A lost
    /// device is then served around and rebuilt onto a replacement. Fixed
    /// once the volume exists [default: none].
    #[arg(long, value_name = "LAYOUT", value_parser = ["none", "mirror", "parity"])]
    raid: Option<String>,
    /// Most bytes per second a lost device's rebuild writes, e.g. 64M; 0
    /// rebuilds as fast as the devices allow [default: 0].
    #[arg(long, value_name = "SIZE", value_parser = size)]
    rebuild_rate: Option<u64>,
    /// NVS file [default: /dev/shm/rebound-<hash of data dir>.nvs].
    #[arg(long, value_name = "PATH")]
    nvs: Option<PathBuf>,
    /// Recovery box file [default: /dev/shm/rebound-<hash of data dir>.box].
    #[arg(long = "box", value_name = "PATH")]
    box_path: Option<PathBuf>,
    /// NVS size [default: 256M].
    #[arg(long, value_name = "SIZE", value_parser = size)]
    nvs_size: Option<u64>,
    /// Read cache size; at most the volume's size is used [default: 256M].
    #[arg(long, value_name = "SIZE", value_parser = size)]
    cache_size: Option<u64>,
    /// Map the cache's memory in at start-up, in the background at low
    /// priority (nice 10), so no request pays a page fault for a frame's first fill;
    /// false: mapped as it fills [default: true].
    #[arg(long, value_name = "BOOL")]
    cache_prefault: Option<bool>,
    /// Task runtime worker threads; 0 means one per core [default: 0].
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// Scheduling policy: performance, static, partial or dynamic [default: dynamic].
    #[arg(long, value_name = "POLICY")]
    policy: Option<String>,
    /// Scheduling rounds an idle worker spins before parking (more: lower
    /// latency, more CPU) [default: 16].
    #[arg(long, value_name = "N")]
    idle_spins: Option<u32>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Admin socket for `rebound status` and `rebound inject` [default: <data dir>/admin.sock].
    #[arg(long, value_name = "PATH.sock")]
    admin: Option<PathBuf>,
    /// Record every task's service time per recovery group and priority
    /// into FILE (rewritten every 2 s and at shutdown), the workload of
    /// `rebound sim rcs --trace FILE`.
    #[arg(long, value_name = "FILE")]
    trace_tasks: Option<PathBuf>,
    /// Run the server as a child process and start it again whenever it
    /// dies (a crash, kill -9): rung 5 (or 6) without an operator.
    #[arg(long)]
    supervise: bool,
    /// What FLUSH and FUA make durable: devices (destage + fdatasync) or nvs (msync) [default: devices].
    #[arg(long, value_name = "WHERE", value_parser = ["devices", "nvs"])]
    flush: Option<String>,
    /// What TRIM and WRITE_ZEROES do with the device files' space: keep
    /// it allocated (the range reads as zeroes; a later write to it cannot
    /// find the file system full) or unmap it (punch holes, giving the
    /// space back, except for WRITE_ZEROES with NO_HOLE) [default: keep].
    #[arg(long, value_name = "MODE", value_parser = ["keep", "unmap"])]
    discard: Option<String>,
    /// Open device files with O_DIRECT.
    #[arg(long)]
    direct_io: bool,
    /// Write or sync errors (ENOSPC aside) after which a device of a
    /// mirror or parity volume is declared lost and rebuilt [default: 3].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    device_error_limit: Option<u64>,
    /// Keep, per device, what a power cut would undo, so `rebound inject
    /// power-loss` can run (tests and benches: costs a read per device
    /// write).
    #[arg(long)]
    power_loss_tracking: bool,
    /// Most concurrent NBD clients past their handshake [default: 64].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Most connections, negotiating or served, from one client address;
    /// 0: no cap [default: 0].
    #[arg(long, value_name = "N")]
    max_connections_per_peer: Option<usize>,
    /// Most connections negotiating at once; a new one past it ends the
    /// oldest negotiation [default: 128].
    #[arg(long, value_name = "N")]
    max_handshakes: Option<usize>,
    /// Time for a client's whole handshake, however it trickles its
    /// bytes [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    handshake_timeout: Option<std::time::Duration>,
    /// Close a connection that sent nothing and has nothing in flight for
    /// this long; 0s: never [default: 0s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    idle_timeout: Option<std::time::Duration>,
    /// Disconnect a client that reads none of its replies for this long
    /// (its acknowledged writes are kept) [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    send_timeout: Option<std::time::Duration>,
    /// Per connection: bytes of requests admitted whose replies have not
    /// left; past it the connection's requests wait unread, e.g. 64M
    /// [default: 64M].
    #[arg(long, value_name = "SIZE", value_parser = size)]
    reply_budget: Option<u64>,
    /// Idle time before TCP keepalive probes find a vanished peer; 0s:
    /// off [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    tcp_keepalive: Option<std::time::Duration>,
    /// NBD over TLS (STARTTLS): off; on (TLS and plaintext clients); or
    /// require (TLS only: before it every option but STARTTLS and ABORT is
    /// refused, as nbdkit's --tls=require). on and require need
    /// --tls-certificates or --tls-psk [default: off].
    #[arg(long, value_name = "MODE", value_parser = controller::config::TlsMode::NAMES.to_vec())]
    tls: Option<String>,
    /// Directory of the server's X.509 credentials, as qemu and nbdkit
    /// name them: server-cert.pem, server-key.pem (mode 0600 or
    /// stricter), and ca-cert.pem for --tls-verify-peer.
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Clients must present a certificate signed by ca-cert.pem (in
    /// --tls-certificates).
    #[arg(long)]
    tls_verify_peer: bool,
    /// Pre-shared keys for TLS-PSK, psktool's format (identity:hexkey per
    /// line; mode 0600 or stricter).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Threads per connection: they take turns reading requests and run
    /// them, so one waiting on a device does not hold up the others
    /// [default: 4].
    #[arg(long, value_name = "N")]
    connection_threads: Option<usize>,
    /// Linux scheduling policy of the connections' threads: batch
    /// (SCHED_BATCH: a thread woken by a client's request does not preempt
    /// the client; it runs on an idle core at once, else when the client
    /// waits or its time slice ends, and reads every request that came
    /// meanwhile) or inherit (leave every thread under the policy the
    /// process was started with) [default: batch].
    #[arg(long, value_name = "POLICY", value_parser = controller::sched::SchedPolicy::NAMES.to_vec())]
    sched_policy: Option<String>,
    /// Outstanding reads and writes per backend device; a full queue makes
    /// an I/O back off and retry (rung 1) [default: 32].
    #[arg(long, value_name = "N")]
    device_queue_depth: Option<u32>,
    /// Request control blocks: requests in flight across all connections;
    /// admission waits for a free one, and leaked ones are reclaimed
    /// (rung 1) [default: 4096].
    #[arg(long, value_name = "N")]
    control_blocks: Option<u32>,
    /// Rung 3's output commit: off (no epochs; rollback escalates to rung
    /// 4), or stall (hold device writes in memory until their epoch
    /// commits), buffering (write to a buffer area, copy after commit),
    /// logging (save the old data, write in place) or renaming (write to a
    /// fresh location, remap at commit) [default: off].
    #[arg(long, value_name = "SCHEME", value_parser = ["off", "stall", "buffering", "logging", "renaming"])]
    output_commit: Option<String>,
    /// Epoch length under output commit: replies and device writes wait
    /// at most this long for their checkpoint, e.g. 20ms [default: 20ms].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    checkpoint_interval: Option<std::time::Duration>,
    /// How often the scrub checks the data of every dirty NVS record: a
    /// damaged one is repaired from its cached copy, or its track reported
    /// lost before a read or destage meets it; 0s: off [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    scrub_interval: Option<std::time::Duration>,
    /// A task running longer than this is declared past its deadline and
    /// fails with a time-out at its next check (a stalled step of a request
    /// is redriven); 0s turns the watchdog off [default: 2s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    task_deadline: Option<std::time::Duration>,
    /// A task still running this long never checked its time-out (hung):
    /// its recovery group is recovered (rung 2), escalating to rung 4 when
    /// the task cannot drain; must exceed --task-deadline; 0s: off
    /// [default: 30 x --task-deadline (60s), at most 3600s; off when
    /// --task-deadline is 0s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    hung_after: Option<std::time::Duration>,
    /// Under output commit, also end an epoch early: as soon as the
    /// controller is idle with a client stalled on held output (at most
    /// every 100 µs), when half of what the clients keep in flight is held,
    /// or once output has waited 1 ms, so no client waits a whole interval; false: commit only every interval (the paper's
    /// fixed epochs) [default: true].
    #[arg(long, value_name = "BOOL")]
    commit_when_idle: Option<bool>,
    /// Modelled device latency per I/O, microseconds (experiments) [default: 0].
    #[arg(long, value_name = "US")]
    device_latency_us: Option<u64>,
    /// Modelled device latency per KiB, microseconds (experiments) [default: 0].
    #[arg(long, value_name = "US")]
    device_latency_per_kib_us: Option<u64>,
    /// Serve the volume read-only: writes, trims and zeroes answer EPERM
    /// (advertised to clients as NBD_FLAG_READ_ONLY).
    #[arg(long)]
    read_only: bool,
    /// The export's listed name (NBD LIST and INFO); the default export ""
    /// is always served too [default: rebound].
    #[arg(long, value_name = "NAME")]
    export_name: Option<String>,
    /// The export's description (NBD LIST and INFO) [default: the volume's
    /// id and size].
    #[arg(long, value_name = "TEXT")]
    description: Option<String>,
    /// Arm a fault at start, as `rebound inject` would (repeatable; added
    /// to the file's `inject` list), e.g. --inject "panic cache.read
    /// rate=0.001 count=unlimited" or --inject "group-fault cache
    /// rate=1e-4 duration=20ms".
    #[arg(long, value_name = "FAULT")]
    inject: Vec<String>,
    /// What to log: error, warn, info (every recovery, and the listeners
    /// at start), debug (also task panics the runtime handles) or trace;
    /// RUST_LOG wins when set; SIGHUP reloads it from --config
    /// [default: info].
    #[arg(long, value_name = "LEVEL", value_parser = controller::LogLevel::NAMES.to_vec())]
    log_level: Option<String>,
    /// Log line format: text, or json (one object per line) [default: text].
    #[arg(long, value_name = "FORMAT", value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// Log to FILE instead of stderr (appended; reopened on SIGHUP, so
    /// logrotate can rename it away).
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
    /// Print the effective configuration (defaults, then --config, then
    /// the flags; derived paths written out) as TOML and exit.
    #[arg(long)]
    dump_config: bool,
}

pub(crate) fn size(s: &str) -> Result<u64, String> {
    controller::parse_size(s)
}

fn duration(s: &str) -> Result<std::time::Duration, String> {
    controller::parse_duration(s)
}

impl ServeArgs {
    /// The configuration: defaults, then the file, then the flags.
    pub fn config(&self) -> anyhow::Result<Config> {
        let c = self.merged()?;
        c.validate()?;
        Ok(c)
    }

    /// The defaults, then the file, then the flags, not yet validated.
    fn merged(&self) -> anyhow::Result<Config> {
        let mut c = match &self.config {
            Some(path) => Config::from_file(path)?,
            None => Config::default(),
        };
        macro_rules! set {
            ($($field:ident),*) => {$(if let Some(v) = &self.$field { c.$field = v.clone().into(); })*};
        }
        set!(
            listen,
            data_dir,
            volume_size,
            devices,
            rebuild_rate,
            nvs_size,
            cache_size,
            cache_prefault,
            workers,
            policy,
            idle_spins,
            max_connections,
            max_connections_per_peer,
            max_handshakes,
            socket_mode,
            reply_budget,
            connection_threads,
            device_queue_depth,
            control_blocks,
            export_name,
            description
        );
        if self.read_only {
            c.read_only = true;
        }
        self.set_choices(&mut c)?;
        self.set_optional(&mut c);
        Ok(c)
    }

    /// The flags that choose among named values (paths, layouts, schemes).
    fn set_choices(&self, c: &mut Config) -> anyhow::Result<()> {
        if let Some(v) = &self.nvs {
            c.nvs = Some(v.clone());
        }
        if let Some(v) = &self.raid {
            c.raid = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting raid: {e}"))?;
        }
        if let Some(v) = &self.sched_policy {
            c.sched_policy = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting sched_policy: {e}"))?;
        }
        if let Some(v) = &self.discard {
            c.discard = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting discard: {e}"))?;
        }
        if let Some(v) = &self.log_level {
            c.log_level = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting log_level: {e}"))?;
        }
        if let Some(v) = &self.log_format {
            c.log_format = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting log_format: {e}"))?;
        }
        if let Some(v) = &self.tls {
            c.tls = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("invalid setting tls: {e}"))?;
        }
        if let Some(v) = &self.output_commit {
            c.output_commit = controller::config::OutputCommitSetting(
                OutputCommit::parse(v)
                    .map_err(|e| anyhow::anyhow!("invalid setting output_commit: {e}"))?,
            );
        }
        Ok(())
    }

    /// The flags whose absence keeps the file's or the default value.
    fn set_optional(&self, c: &mut Config) {
        if let Some(v) = self.checkpoint_interval {
            c.checkpoint_interval = v;
        }
        if let Some(v) = self.scrub_interval {
            c.scrub_interval = v;
        }
        if let Some(v) = self.task_deadline {
            c.task_deadline = v;
        }
        for (flag, setting) in [
            (self.handshake_timeout, &mut c.handshake_timeout),
            (self.idle_timeout, &mut c.idle_timeout),
            (self.send_timeout, &mut c.send_timeout),
            (self.tcp_keepalive, &mut c.tcp_keepalive),
        ] {
            if let Some(v) = flag {
                *setting = v;
            }
        }
        if let Some(v) = self.hung_after {
            c.hung_after = Some(v);
        }
        if let Some(v) = self.commit_when_idle {
            c.commit_when_idle = v;
        }
        if let Some(v) = &self.box_path {
            c.box_path = Some(v.clone());
        }
        if let Some(v) = self.metrics {
            c.metrics = Some(v);
        }
        if let Some(v) = &self.admin {
            c.admin = Some(v.clone());
        }
        if let Some(v) = &self.log_file {
            c.log_file = Some(v.clone());
        }
        if let Some(v) = &self.trace_tasks {
            c.trace_tasks = Some(v.clone());
        }
        if let Some(v) = &self.tls_certificates {
            c.tls_certificates = Some(v.clone());
        }
        if let Some(v) = &self.tls_psk {
            c.tls_psk = Some(v.clone());
        }
        if self.tls_verify_peer {
            c.tls_verify_peer = true;
        }
        if let Some(v) = &self.flush {
            c.flush = if v == "nvs" {
                FlushPolicy::Nvs
            } else {
                FlushPolicy::Devices
            };
        }
        if self.direct_io {
            c.direct_io = true;
        }
        if let Some(v) = self.device_error_limit {
            c.device_error_limit = v;
        }
        if self.power_loss_tracking {
            c.power_loss_tracking = true;
        }
        if let Some(v) = self.device_latency_us {
            c.device_latency.fixed_us = v;
        }
        c.inject.extend(self.inject.iter().cloned());
        if let Some(v) = self.device_latency_per_kib_us {
            c.device_latency.per_kib_us = v;
        }
    }
}

/// Run the server until SIGINT or SIGTERM, then shut down cleanly.
pub fn run(args: ServeArgs) -> anyhow::Result<std::process::ExitCode> {
    let mut config = args.config()?;
    if args.dump_config {
        let text = config.effective().to_toml().map_err(anyhow::Error::msg)?;
        print!("{text}");
        return Ok(std::process::ExitCode::SUCCESS);
    }
    // Before any thread starts: it clears the environment variables.
    let inherited = if args.supervise {
        None
    } else {
        crate::systemd::take_listener()?
    };
    let logging = crate::logging::Logging::init(&config)?;
    if args.supervise {
        return crate::supervise::run(&config);
    }
    if let Some(l) = &inherited {
        config.listen = l.endpoint().context("the inherited socket's address")?;
    }
    let signals = Signals::install()?;
    let notifier = crate::systemd::Notifier::from_env()?.map(Arc::new);
    let running = Running::start(&config, inherited)?;
    running.banner(&config);
    let reporter = match &notifier {
        Some(n) => {
            n.send(&format!(
                "READY=1\nSTATUS=serving; {}",
                controller::control::health::startup_kind(&running.ctl)
            ));
            Some(crate::systemd::Reporter::start(
                Arc::clone(n),
                Arc::clone(&running.ctl),
                running.admin.path().to_owned(),
            )?)
        }
        None => None,
    };
    let mut ticks = 0u32;
    while !signals.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        ticks += 1;
        if ticks.is_multiple_of(20) {
            write_task_trace(&config, &running.ctl);
        }
        if signals.hangup.swap(false, Ordering::Relaxed) {
            reload(&args, &config, &logging);
        }
    }
    if let Some(n) = &notifier {
        n.send("STOPPING=1\nSTATUS=shutting down: destaging dirty tracks");
    }
    drop(reporter);
    write_task_trace(&config, &running.ctl);
    running.shutdown()
}

/// The signals `serve` (and its supervisor) act on.
pub(crate) struct Signals {
    /// SIGINT or SIGTERM: shut down.
    pub(crate) stop: Arc<AtomicBool>,
    /// SIGHUP: reopen the log file, reload the log level.
    pub(crate) hangup: Arc<AtomicBool>,
}

impl Signals {
    pub(crate) fn install() -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(signal, Arc::clone(&stop))
                .context("installing signal handlers")?;
        }
        let hangup = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&hangup))
            .context("installing the SIGHUP handler")?;
        Ok(Self { stop, hangup })
    }
}

/// The settings SIGHUP applies to a running server; every other key needs
/// a restart.
pub const RELOADABLE: &[&str] = &["log_level"];

/// SIGHUP: reopen the log file, read the configuration again (the file,
/// then the flags) and apply what can change safely: the log level. Keys
/// that changed but need a restart are named in a warning.
fn reload(args: &ServeArgs, running: &Config, logging: &crate::logging::Logging) {
    match logging.reopen() {
        Ok(Some(path)) => tracing::info!(path = %path.display(), "SIGHUP: log file reopened"),
        Ok(None) => {}
        Err(e) => eprintln!("rebound: SIGHUP: {e:#}"),
    }
    let fresh = match args.config() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "SIGHUP: the configuration is invalid; nothing reloaded");
            return;
        }
    };
    match logging.set_level(fresh.log_level) {
        Ok(true) => tracing::info!(level = fresh.log_level.name(), "SIGHUP: log level set"),
        Ok(false) => tracing::info!("SIGHUP: RUST_LOG is set and decides what is logged"),
        Err(e) => tracing::error!(error = %format!("{e:#}"), "SIGHUP"),
    }
    let changed = changed_keys(&running.effective(), &fresh.effective());
    let needs_restart: Vec<&str> = changed
        .iter()
        .map(String::as_str)
        .filter(|k| !RELOADABLE.contains(k) && *k != "log_file")
        .collect();
    if !needs_restart.is_empty() {
        tracing::warn!(
            keys = needs_restart.join(", "),
            "SIGHUP: these settings changed but apply only after a restart"
        );
    }
}

/// The top-level keys whose values differ between two configurations.
fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    let table = |c: &Config| -> toml::Table {
        c.to_toml()
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or_default()
    };
    let (a, b) = (table(a), table(b));
    let mut keys: Vec<String> = a
        .keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// The running parts of a server.
struct Running {
    ctl: Arc<Controller>,
    metrics: Option<controller::http::MetricsServer>,
    server: Server,
    admin: controller::admin::AdminServer,
}

impl Running {
    /// Open the controller (start-up recovery), then serve NBD (on the
    /// inherited socket, if any), metrics and the admin socket.
    fn start(
        config: &Config,
        inherited: Option<controller::host::socket::Listener>,
    ) -> anyhow::Result<Self> {
        // The TLS files are checked before the volume is touched (the
        // listener loads them again when it starts).
        controller::host::tls::TlsServer::load(config).context("TLS credentials")?;
        let ctl = Controller::open(config.clone()).context("starting the controller")?;
        let metrics = match config.metrics {
            Some(addr) => Some(
                controller::http::MetricsServer::start(addr, &ctl)
                    .with_context(|| format!("serving metrics on {addr}"))?,
            ),
            None => None,
        };
        let server = match inherited {
            Some(l) => Server::start_on(Arc::clone(&ctl), l)
                .context("serving on the socket passed by systemd")?,
            None => Server::start(Arc::clone(&ctl))
                .with_context(|| format!("listening on {}", config.listen))?,
        };
        let admin = controller::admin::AdminServer::start(&config.admin_path(), &ctl)
            .with_context(|| format!("admin socket {}", config.admin_path().display()))?;
        Ok(Self {
            ctl,
            metrics,
            server,
            admin,
        })
    }

    /// The start-up line on stderr.
    fn banner(&self, config: &Config) {
        let startup = self.ctl.startup();
        let how = match &startup.kind {
            controller::RestartKind::Fresh => "new volume".to_owned(),
            controller::RestartKind::Fast => "fast restart from the recovery box".to_owned(),
            controller::RestartKind::Hard { reason } => {
                format!("hard restart (NVS scan; {reason})")
            }
        };
        eprintln!(
            "rebound: serving {} bytes on {} (data {}, NVS {}, box {}, admin {}); {how}: {} dirty tracks in {:?}{}",
            config.volume_size,
            self.server.endpoint().uri(),
            config.data_dir.display(),
            config.nvs_path().display(),
            config.box_path().display(),
            self.admin.path().display(),
            startup.replayed_tracks,
            startup.elapsed,
            self.metrics
                .as_ref()
                .map(|m| format!("; metrics at http://{}/metrics", m.local_addr()))
                .unwrap_or_default()
        );
    }

    /// Answer in-flight requests, destage, sync, stop.
    fn shutdown(self) -> anyhow::Result<std::process::ExitCode> {
        eprintln!(
            "rebound: shutting down: answering in-flight requests, destaging {} dirty tracks",
            self.ctl.dirty_tracks()
        );
        drop(self.admin);
        self.server
            .shutdown()
            .context("destaging and syncing at shutdown")?;
        drop(self.metrics);
        eprintln!("rebound: clean shutdown");
        Ok(std::process::ExitCode::SUCCESS)
    }
}

/// Write the task trace, if one is recorded: to a temporary file renamed
/// over the target, so a reader never sees half a trace. Failures are
/// logged, not fatal: the trace is a diagnostic.
fn write_task_trace(config: &controller::Config, ctl: &Controller) {
    let Some(path) = &config.trace_tasks else {
        return;
    };
    let Some(trace) = ctl.engine().runtime().task_trace() else {
        return;
    };
    let tmp = path.with_extension("trace.tmp");
    let written = controller::files::create_temporary(&tmp)
        .and_then(|f| trace.write_csv(std::io::BufWriter::new(f)))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "writing the task trace");
    }
}

#[cfg(test)]
mod tests {
    use clap::{Args, FromArgMatches};

    use super::*;

    /// A value for each `serve` flag that differs from its default. A new
    /// flag without one here fails the test below.
    const VALUES: &[(&str, Option<&str>)] = &[
        ("listen", Some("127.0.0.1:1")),
        ("data_dir", Some("/tmp/rebound-flags")),
        ("volume_size", Some("2GiB")),
        ("devices", Some("3")),
        ("raid", Some("mirror")),
        ("rebuild_rate", Some("1M")),
        ("nvs", Some("/tmp/rebound-flags.nvs")),
        ("box_path", Some("/tmp/rebound-flags.box")),
        ("nvs_size", Some("128M")),
        ("cache_size", Some("64M")),
        ("cache_prefault", Some("false")),
        ("workers", Some("3")),
        ("policy", Some("static")),
        ("idle_spins", Some("7")),
        ("metrics", Some("127.0.0.1:2")),
        ("admin", Some("/tmp/rebound-flags.sock")),
        ("trace_tasks", Some("/tmp/rebound-flags.trace")),
        ("flush", Some("nvs")),
        ("discard", Some("unmap")),
        ("direct_io", None),
        ("device_error_limit", Some("5")),
        ("power_loss_tracking", None),
        ("max_connections", Some("5")),
        ("max_connections_per_peer", Some("3")),
        ("max_handshakes", Some("9")),
        ("handshake_timeout", Some("3s")),
        ("idle_timeout", Some("30s")),
        ("send_timeout", Some("7s")),
        ("reply_budget", Some("8M")),
        ("tcp_keepalive", Some("20s")),
        ("tls", Some("require")),
        ("tls_certificates", Some("/tmp/rebound-flags-tls")),
        ("tls_verify_peer", None),
        ("tls_psk", Some("/tmp/rebound-flags.psk")),
        ("socket_mode", Some("0660")),
        ("connection_threads", Some("2")),
        ("sched_policy", Some("inherit")),
        ("device_queue_depth", Some("8")),
        ("control_blocks", Some("100")),
        ("output_commit", Some("stall")),
        ("checkpoint_interval", Some("1.5s")),
        ("scrub_interval", Some("5s")),
        ("task_deadline", Some("3s")),
        ("hung_after", Some("100s")),
        ("commit_when_idle", Some("false")),
        ("device_latency_us", Some("5")),
        ("device_latency_per_kib_us", Some("6")),
        ("inject", Some("panic cache.read")),
        ("read_only", None),
        ("export_name", Some("disk0")),
        ("description", Some("scratch")),
        ("log_level", Some("debug")),
        ("log_format", Some("json")),
        ("log_file", Some("/tmp/rebound-flags.log")),
    ];

    /// Flags that steer the process, not the configuration.
    const NOT_CONFIGURATION: &[&str] = &["config", "supervise", "dump_config"];

    fn parse(argv: &[String]) -> ServeArgs {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve").no_binary_name(true));
        let matches = cmd.try_get_matches_from(argv).expect("parsing the flags");
        ServeArgs::from_arg_matches(&matches).expect("reading the flags")
    }

    #[test]
    fn every_serve_flag_reaches_the_configuration() {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve"));
        let default = parse(&[]).merged().unwrap();
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if NOT_CONFIGURATION.contains(&id) || id == "help" {
                continue;
            }
            let Some((_, value)) = VALUES.iter().find(|(name, _)| *name == id) else {
                panic!("serve flag --{id} has no test value in VALUES");
            };
            let long = arg.get_long().expect("every serve flag is long");
            let mut argv = vec![format!("--{long}")];
            argv.extend(value.map(str::to_owned));
            let merged = parse(&argv).merged().expect("merging the flag");
            assert_ne!(
                merged, default,
                "--{long} changes nothing in the configuration"
            );
        }
    }

    #[test]
    fn the_sched_policy_flag_defaults_to_batch_and_refuses_an_unknown_policy() {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve").no_binary_name(true));
        let err = cmd
            .try_get_matches_from(["--sched-policy", "fifo"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("fifo") && err.contains("batch") && err.contains("inherit"),
            "{err}"
        );
        assert_eq!(
            parse(&[]).merged().unwrap().sched_policy,
            controller::sched::SchedPolicy::Batch
        );
        let c = parse(&["--sched-policy".into(), "inherit".into()])
            .merged()
            .unwrap();
        assert_eq!(c.sched_policy, controller::sched::SchedPolicy::Inherit);
    }

    #[test]
    fn a_bad_discard_flag_is_refused_with_the_valid_values() {
        let cmd = ServeArgs::augment_args(clap::Command::new("serve").no_binary_name(true));
        let err = cmd
            .try_get_matches_from(["--discard", "trim"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("trim") && err.contains("keep") && err.contains("unmap"),
            "{err}"
        );
        let c = parse(&["--discard".into(), "unmap".into()])
            .merged()
            .unwrap();
        assert_eq!(c.discard, controller::config::Discard::Unmap);
        assert_eq!(
            parse(&[]).merged().unwrap().discard,
            controller::config::Discard::Keep,
            "keep by default"
        );
    }

    #[test]
    fn sizes_and_durations_take_the_one_grammar_in_flags() {
        let args = parse(&[
            "--volume-size".into(),
            "1GiB".into(),
            "--checkpoint-interval".into(),
            "1.5s".into(),
        ]);
        let c = args.merged().unwrap();
        assert_eq!(c.volume_size, 1 << 30);
        assert_eq!(c.checkpoint_interval, Duration::from_millis(1500));
    }
}
