//! `rebound status` and `rebound inject`: talk to a running server through
//! its admin socket (protocol in `controller::admin`). `status` exits 0
//! when the server is healthy, 1 when it is degraded, 2 when no server
//! answers.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};

/// Where the admin socket is.
#[derive(Debug, Clone, Args)]
pub struct AdminAddr {
    /// The server's admin socket [default: <data dir>/admin.sock].
    #[arg(long, value_name = "PATH.sock")]
    admin: Option<PathBuf>,
    /// The server's data directory, to find its default admin socket.
    #[arg(long, value_name = "DIR", default_value = "./rebound-data")]
    data_dir: PathBuf,
}

impl AdminAddr {
    fn path(&self) -> PathBuf {
        self.admin
            .clone()
            .unwrap_or_else(|| self.data_dir.join("admin.sock"))
    }
}

/// Options of `rebound status`.
#[derive(Debug, Args)]
#[command(
    after_help = "Exit status: 0 healthy, 1 degraded (a device lost or rebuilding, lost tracks, a recovery in progress, the recovery box abandoned), 2 no server answers at the admin socket."
)]
pub struct StatusArgs {
    #[command(flatten)]
    addr: AdminAddr,
    /// The same content as one JSON object (health, startup, groups,
    /// recoveries by rung, recent recoveries, devices, lost tracks, NVS fill).
    #[arg(long)]
    json: bool,
}

/// `rebound status`'s exit code when the server is degraded.
pub const EXIT_DEGRADED: u8 = 1;
/// `rebound status`'s exit code when no server answers.
pub const EXIT_UNREACHABLE: u8 = 2;

/// The faults `rebound inject` can trigger (names as on the command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[allow(clippy::enum_variant_names, reason = "group-fault is the fault's name")]
pub enum Fault {
    /// A panic at a data-path fault point (rung 1: the request is redriven).
    Panic,
    /// A failure (state error) at a fault point (rung 1).
    Fail,
    /// A stall at a fault point (a task past its deadline: ended as a
    /// time-out at --task-deadline).
    Delay,
    /// A hang at a fault point, deaf to the deadline (a hung task: its
    /// group is recovered at --hung-after).
    Hang,
    /// Faults per dispatch of a recovery group, each recovery taking
    /// --duration (rung 2; the scheduling paper's emulation).
    GroupFault,
    /// Damage the check word of the cache frame holding --track (rung 1:
    /// the next read rebuilds it from NVS or the device).
    CorruptFrame,
    /// Damage the in-memory directory entry of dirty --track (state
    /// corruption: rung 3 restores it from the checkpoint when the server
    /// runs with --output-commit)
    CorruptDirectory,
    /// Damage the data of dirty --track's NVS record and drop its cached
    /// copy (NVS memory corruption: the track's data is lost; reads and
    /// FLUSH answer EIO until it is written again)
    CorruptRecord,
    /// The device (--device, default 0) reports a completion no submission
    /// waits for (rung 1: ignored and counted).
    UnsolicitedCompletion,
    /// Lose backend device --device N: every I/O to it fails; a volume
    /// with --raid mirror or parity serves around it and rebuilds a
    /// replacement (rung 7); refused without redundancy.
    LoseDevice,
    /// The next --count writes to a replacement device during a rebuild
    /// fail (a failing disk): the rebuild stops and tries again (rung 7).
    RebuildError,
    /// Backend device --device N fails --op (read, write or sync) with
    /// --errno (eio [default] or enospc), with probability --rate, --count
    /// times [default: unlimited, until `inject clear`]; --torn lands half
    /// of a write first.
    DeviceError,
    /// Backend device --device N's I/O (or only --op) takes --duration
    /// longer, with probability --rate, until `inject clear`.
    DeviceLatency,
    /// End the server as at a power cut: device writes no sync covered
    /// are undone, the NVS is lost unless it is on persistent storage with
    /// --flush nvs, the recovery box is lost (the server must run with
    /// --power-loss-tracking).
    PowerLoss,
    /// Roll the controller back to its last checkpoint now (rung 3; the
    /// server must run with --output-commit: held writes dropped, the
    /// open epoch's requests run again)
    Rollback,
    /// Run an in-process system recovery now (rung 4: quiesce, rebuild
    /// from the recovery box, redrive; connections stay up).
    System,
    /// Invalidate the recovery box and stop keeping it (rung 4 then
    /// rebuilds from an NVS scan; the next start is a hard restart).
    AbandonBox,
    /// Abort the server process (rung 5 at the next start).
    Crash,
    /// Invalidate the recovery box, then abort (rung 6 at the next start).
    CrashDamagedBox,
    /// Disarm every fault.
    Clear,
}

/// Options of `rebound inject`.
#[derive(Debug, Args)]
pub struct InjectArgs {
    #[command(flatten)]
    addr: AdminAddr,
    /// What to inject.
    #[arg(value_enum)]
    fault: Fault,
    /// Fault point (panic, fail, delay): host.receive, cache.read,
    /// device.read, nvs.write, cache.apply, device.fua, device.flush,
    /// device.zero, host.reply (stage entries: rung 1), cache.apply.track
    /// (inside cache.apply: rung 4), device.queue-full (with fail: the
    /// device queue refuses, the I/O backs off: rung 1).
    #[arg(long, value_name = "POINT")]
    point: Option<String>,
    /// Recovery group (group-fault): host, cache, nvs, device, destage, background.
    #[arg(long, value_name = "G")]
    group: Option<String>,
    /// Track (4 KiB unit of the volume) to damage (corrupt-frame: its cache
    /// frame; corrupt-directory: its dirty entry; corrupt-record: its NVS
    /// record and cached copy).
    #[arg(long, value_name = "N")]
    track: Option<u64>,
    /// Backend device number (unsolicited-completion [default: 0],
    /// lose-device, device-error, device-latency).
    #[arg(long, value_name = "N")]
    device: Option<u32>,
    /// Device operation (device-error; device-latency [default: every I/O]).
    #[arg(long, value_name = "OP", value_parser = ["read", "write", "sync"])]
    op: Option<String>,
    /// The error a failing device returns (device-error) [default: eio].
    #[arg(long, value_name = "ERRNO", value_parser = ["eio", "enospc"])]
    errno: Option<String>,
    /// A failing write lands half of its sectors first (device-error --op write).
    #[arg(long)]
    torn: bool,
    /// Probability per evaluation or dispatch [default: 1 at a point, 1e-4 for a group].
    #[arg(long, value_name = "P")]
    rate: Option<f64>,
    /// Delay, or each group recovery's time, e.g. 20ms.
    #[arg(long, value_name = "D")]
    duration: Option<String>,
    /// Times a point fires before disarming, or "unlimited" [default: 1].
    #[arg(long, value_name = "N")]
    count: Option<String>,
}

impl InjectArgs {
    /// The words of `device-error` and `device-latency`.
    fn device_fault(&self) -> anyhow::Result<String> {
        let needs = |what: &Option<String>, flag: &str| -> anyhow::Result<String> {
            what.clone()
                .ok_or_else(|| anyhow::anyhow!("{:?} needs {flag}", self.fault))
        };
        let d = needs(&self.device.map(|d| d.to_string()), "--device N")?;
        if self.fault == Fault::DeviceLatency {
            let op = self
                .op
                .as_ref()
                .map_or(String::new(), |op| format!(" op={op}"));
            return Ok(format!("device-latency {d}{op}"));
        }
        let mut line = format!(
            "device-error {d} op={}",
            needs(&self.op, "--op read|write|sync")?
        );
        if let Some(e) = &self.errno {
            line += &format!(" errno={e}");
        }
        if self.torn {
            line += " torn=true";
        }
        Ok(line)
    }

    /// The request line for the admin socket.
    fn request(&self) -> anyhow::Result<String> {
        let mut line = String::from("inject ");
        let needs = |what: &Option<String>, flag: &str| -> anyhow::Result<String> {
            what.clone()
                .ok_or_else(|| anyhow::anyhow!("{:?} needs {flag}", self.fault))
        };
        match self.fault {
            Fault::Panic | Fault::Fail | Fault::Delay | Fault::Hang => {
                let name = match self.fault {
                    Fault::Panic => "panic",
                    Fault::Fail => "fail",
                    Fault::Hang => "hang",
                    _ => "delay",
                };
                line += &format!("{name} {}", needs(&self.point, "--point POINT")?);
            }
            Fault::GroupFault => {
                line += &format!("group-fault {}", needs(&self.group, "--group G")?);
            }
            Fault::CorruptFrame => {
                let t = self.track.map(|t| t.to_string());
                line += &format!("corrupt-frame {}", needs(&t, "--track N")?);
            }
            Fault::CorruptDirectory => {
                let t = self.track.map(|t| t.to_string());
                line += &format!("corrupt-directory {}", needs(&t, "--track N")?);
            }
            Fault::CorruptRecord => {
                let t = self.track.map(|t| t.to_string());
                line += &format!("corrupt-record {}", needs(&t, "--track N")?);
            }
            Fault::UnsolicitedCompletion => {
                line += "unsolicited-completion";
                if let Some(d) = self.device {
                    line += &format!(" {d}");
                }
            }
            Fault::LoseDevice => {
                let d = self.device.map(|d| d.to_string());
                line += &format!("lose-device {}", needs(&d, "--device N")?);
            }
            Fault::RebuildError => {
                line += &format!("rebuild-error {}", needs(&self.count, "--count N")?);
                return Ok(line);
            }
            Fault::DeviceError | Fault::DeviceLatency => line += &self.device_fault()?,
            Fault::PowerLoss => line += "power-loss",
            Fault::Rollback => line += "rollback",
            Fault::System => line += "system",
            Fault::AbandonBox => line += "abandon-box",
            Fault::Crash => line += "crash",
            Fault::CrashDamagedBox => line += "crash-damaged-box",
            Fault::Clear => line += "clear",
        }
        if let Some(r) = self.rate {
            line += &format!(" rate={r}");
        }
        if let Some(d) = &self.duration {
            line += &format!(" duration={d}");
        }
        if let Some(c) = &self.count {
            line += &format!(" count={c}");
        }
        Ok(line)
    }
}

/// `rebound status`: the report, and the exit code of the server's health.
pub fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let request = if args.json { "status json" } else { "status" };
    let answer = match controller::admin::request_within(
        &args.addr.path(),
        request,
        std::time::Duration::from_secs(10),
    ) {
        Ok(answer) => answer,
        Err(e) => {
            // Unreachable, or an answer that is no status: no report either way.
            eprintln!("rebound: error: {e}");
            return Ok(ExitCode::from(EXIT_UNREACHABLE));
        }
    };
    print!("{answer}");
    let healthy = if args.json {
        let v: serde_json::Value =
            serde_json::from_str(&answer).map_err(|e| anyhow::anyhow!("the server's JSON: {e}"))?;
        v["health"]["state"] == "healthy"
    } else {
        answer.lines().any(|l| l == "health: healthy")
    };
    Ok(if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_DEGRADED)
    })
}

/// `rebound inject`.
pub fn inject(args: InjectArgs) -> anyhow::Result<ExitCode> {
    let line = args.request()?;
    let answer =
        controller::admin::request(&args.addr.path(), &line).map_err(anyhow::Error::msg)?;
    print!("{answer}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{FromArgMatches, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        inject: InjectArgs,
    }

    fn line(argv: &[&str]) -> anyhow::Result<String> {
        let m = <Cli as clap::CommandFactory>::command()
            .no_binary_name(true)
            .try_get_matches_from(argv)?;
        Cli::from_arg_matches(&m)?.inject.request()
    }

    #[test]
    fn device_faults_become_admin_requests_the_controller_parses() {
        let cases = [
            (
                &[
                    "device-error",
                    "--device",
                    "1",
                    "--op",
                    "write",
                    "--errno",
                    "enospc",
                    "--rate",
                    "0.5",
                ][..],
                "inject device-error 1 op=write errno=enospc rate=0.5",
            ),
            (
                &[
                    "device-error",
                    "--device",
                    "0",
                    "--op",
                    "write",
                    "--torn",
                    "--count",
                    "2",
                ][..],
                "inject device-error 0 op=write torn=true count=2",
            ),
            (
                &["device-latency", "--device", "2", "--duration", "50ms"][..],
                "inject device-latency 2 duration=50ms",
            ),
            (&["power-loss"][..], "inject power-loss"),
            (
                &["rebuild-error", "--count", "3"][..],
                "inject rebuild-error 3",
            ),
        ];
        for (argv, want) in cases {
            let got = line(argv).unwrap();
            assert_eq!(got, want);
            let words: Vec<&str> = got.split_whitespace().skip(1).collect();
            controller::faults::Fault::parse(&words).unwrap();
        }
    }

    #[test]
    fn a_device_fault_without_its_device_or_op_is_refused() {
        let e = line(&["device-error", "--op", "read"]).unwrap_err();
        assert!(e.to_string().contains("--device N"), "{e}");
        let e = line(&["device-error", "--device", "0"]).unwrap_err();
        assert!(e.to_string().contains("--op"), "{e}");
        let e = line(&["device-error", "--device", "0", "--op", "trim"]).unwrap_err();
        assert!(e.to_string().contains("read"), "{e}");
    }
}
