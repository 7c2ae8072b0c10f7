//! Logging of `rebound`: where log lines go (stderr, a file reopened on
//! SIGHUP, or journald's stream), their format (text or JSON) and their
//! level (`--log-level`, reloadable on SIGHUP; `RUST_LOG` wins when set).
//!
//! Under systemd (`JOURNAL_STREAM` names our stderr) text lines carry no
//! timestamp (the journal stamps them) and start with the syslog priority
//! prefix (`<3>` error ... `<7>` debug) that journald reads as the
//! entry's priority, so `journalctl -p warning` works.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use anyhow::Context;
use controller::{Config, LogFormat, LogLevel};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

/// The filter of every command but `serve`: warnings, or `RUST_LOG`.
pub fn init_default() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// The log file, reopened on SIGHUP (after a rename by logrotate, a new
/// file takes the following lines).
#[derive(Debug)]
struct LogFile {
    path: PathBuf,
    file: Mutex<File>,
}

impl LogFile {
    fn lock(&self) -> MutexGuard<'_, File> {
        self.file.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opened as every state file is (mode 0600, no symbolic link
    /// followed, refused unless it is our own regular file), appending.
    fn open(path: &Path) -> std::io::Result<File> {
        let mut opts = controller::files::state_options(controller::files::Create::IfMissing, 0);
        opts.append(true);
        controller::files::open_with(path, &opts)
    }
}

/// Where the formatter writes: stderr or the log file.
#[derive(Debug, Clone)]
struct Sink(Option<Arc<LogFile>>);

/// One event's writer (the formatter writes each event with one call).
#[derive(Debug)]
enum SinkWriter {
    Stderr(std::io::Stderr),
    File(Arc<LogFile>),
}

impl Write for SinkWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Stderr(e) => e.write(buf),
            Self::File(f) => f.lock().write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Stderr(e) => e.write_all(buf),
            Self::File(f) => f.lock().write_all(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Stderr(e) => e.flush(),
            Self::File(f) => f.lock().flush(),
        }
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = SinkWriter;

    fn make_writer(&'a self) -> Self::Writer {
        match &self.0 {
            Some(f) => SinkWriter::File(Arc::clone(f)),
            None => SinkWriter::Stderr(std::io::stderr()),
        }
    }
}

/// Text lines for journald: the syslog priority prefix, then the line.
struct SyslogPrefixed<F>(F);

impl<S, N, F> FormatEvent<S, N> for SyslogPrefixed<F>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let priority = match *event.metadata().level() {
            tracing::Level::ERROR => 3,
            tracing::Level::WARN => 4,
            tracing::Level::INFO => 6,
            _ => 7,
        };
        write!(writer, "<{priority}>")?;
        self.0.format_event(ctx, writer, event)
    }
}

/// The running server's logging: its level can be changed and its file
/// reopened.
#[derive(Debug)]
pub struct Logging {
    filter: reload::Handle<EnvFilter, Registry>,
    file: Option<Arc<LogFile>>,
    from_env: bool,
}

type Boxed = Box<
    dyn Layer<tracing_subscriber::layer::Layered<reload::Layer<EnvFilter, Registry>, Registry>>
        + Send
        + Sync,
>;

/// Whether stderr is the journal's stream (`JOURNAL_STREAM=dev:inode`).
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    stream.to_string_lossy() == format!("{}:{}", meta.dev(), meta.ino())
}

/// The filter: `RUST_LOG` when set, else the configured level.
fn filter(level: LogLevel) -> (EnvFilter, bool) {
    match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => (EnvFilter::new(v), true),
        _ => (EnvFilter::new(level.name()), false),
    }
}

impl Logging {
    /// Set up `serve`'s logging from its configuration.
    pub fn init(config: &Config) -> anyhow::Result<Self> {
        let file = match &config.log_file {
            Some(path) => Some(Arc::new(LogFile {
                path: path.clone(),
                file: Mutex::new(
                    LogFile::open(path)
                        .with_context(|| format!("opening the log file {}", path.display()))?,
                ),
            })),
            None => None,
        };
        let sink = Sink(file.clone());
        let (env_filter, from_env) = filter(config.log_level);
        let (filter_layer, handle) = reload::Layer::new(env_filter);
        let journal = file.is_none() && stderr_is_journal();
        let ansi =
            file.is_none() && !journal && std::io::IsTerminal::is_terminal(&std::io::stderr());
        let fmt_layer: Boxed = match (config.log_format, journal) {
            (LogFormat::Json, _) => {
                Box::new(tracing_subscriber::fmt::layer().json().with_writer(sink))
            }
            (LogFormat::Text, true) => Box::new(
                tracing_subscriber::fmt::layer()
                    .with_writer(sink)
                    .with_ansi(false)
                    .event_format(SyslogPrefixed(
                        tracing_subscriber::fmt::format()
                            .without_time()
                            .with_ansi(false),
                    )),
            ),
            (LogFormat::Text, false) => Box::new(
                tracing_subscriber::fmt::layer()
                    .with_writer(sink)
                    .with_ansi(ansi),
            ),
        };
        tracing_subscriber::registry()
            .with(filter_layer)
            .with(fmt_layer)
            .try_init()
            .context("setting up logging")?;
        Ok(Self {
            filter: handle,
            file,
            from_env,
        })
    }

    /// Reopen the log file (if logging to one); the path, if any.
    pub fn reopen(&self) -> anyhow::Result<Option<&Path>> {
        let Some(f) = &self.file else {
            return Ok(None);
        };
        let fresh = LogFile::open(&f.path)
            .with_context(|| format!("reopening the log file {}", f.path.display()))?;
        *f.lock() = fresh;
        Ok(Some(&f.path))
    }

    /// Log at `level` from now on; false if `RUST_LOG` rules instead.
    pub fn set_level(&self, level: LogLevel) -> anyhow::Result<bool> {
        if self.from_env {
            return Ok(false);
        }
        self.filter
            .reload(EnvFilter::new(level.name()))
            .context("changing the log level")?;
        Ok(true)
    }
}
