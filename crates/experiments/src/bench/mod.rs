//! `rebound bench ...`: experiments and benchmarks. Each one prints a table;
//! full runs (without `--quick`) also write a PNG plot under `--out`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::harness::{ServeCommand, ServerFiles};

mod availability;
mod badpath;
mod controller;
mod cpufloor;
mod devicefaults;
mod fio;
mod loglock;
mod lostdevice;
mod outputcommit;
mod rcs;
mod recobox;
mod smartstore;
mod threadcpu;

/// Arguments shared by every experiment.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, Subcommand)]
enum Which {
    /// Throughput per 100 ms around a fault at each rung (fio load).
    Availability(availability::AvailabilityArgs),
    /// The controller under the scheduling paper's fault emulation: dynamic vs performance policy.
    Badpath(badpath::BadPathArgs),
    /// Recovery-conscious scheduling, good path and bad path (paper §6.3), per policy.
    Rcs(rcs::RcsArgs),
    /// Log(Lock): how often the restoration level meets the recovery criterion (paper Table 5).
    Loglock(loglock::LoglockArgs),
    /// The recovery box: operation costs, open+validate, restart vs memcached -e.
    #[command(name = "box")]
    Box(recobox::BoxBenchArgs),
    /// The controller over NBD vs nbdkit (file, memory) and qemu-nbd, fio cache-standard.
    Controller(controller::ControllerArgs),
    /// Where the server's CPU time per I/O goes at a fixed offered load, rebound next to nbdkit's null plugin (perf).
    CpuFloor(cpufloor::CpuFloorArgs),
    /// The environment's faults (device errors, latency, power loss): IOPS, FLUSH errors, declare and rebuild times, data lost.
    DeviceFaults(devicefaults::DeviceFaultsArgs),
    /// A lost device: degraded service and rebuild per RAID layout, vs striping (fio load).
    LostDevice(lostdevice::LostDeviceArgs),
    /// Rung 3's output commit: throughput and latency against the checkpoint interval per scheme; rollback time.
    OutputCommit(outputcommit::OutputCommitArgs),
    /// Smart storage nodes: Scan and TPC-H Q1 per layout and device model, I/O / compute / communication; DuckDB peer.
    Smartstore(smartstore::SmartstoreArgs),
}

/// Options every experiment accepts.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Short run for smoke checks (under a minute); prints the table, writes no plot.
    #[arg(long)]
    pub quick: bool,
    /// Directory for plots and raw results.
    #[arg(long, default_value = "bench/out")]
    pub out: PathBuf,
}

/// NVS size of the experiments' servers.
pub(crate) const NVS_SIZE: &str = "256M";

/// The experiments' server, from this binary: a 1 GiB volume (NVS
/// [`NVS_SIZE`], 128 MiB cache) with its files under `dir`, on `port`.
fn experiment_server(dir: &Path, port: u16) -> anyhow::Result<ServeCommand> {
    let exe = std::env::current_exe().context("locating this binary")?;
    Ok(ServeCommand::new(exe, &ServerFiles::under(dir))
        .flag("--listen", format!("127.0.0.1:{port}"))
        .flag("--volume-size", "1G")
        .flag("--nvs-size", NVS_SIZE)
        .flag("--cache-size", "128M"))
}

/// A file the experiments need from the repository (`bench/controller.sh`,
/// ...): beside the sources this binary was built from, or under the
/// working directory.
fn repo_file(relative: &str) -> anyhow::Result<PathBuf> {
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    [built_from.join(relative), PathBuf::from(relative)]
        .into_iter()
        .find(|p| p.is_file())
        .with_context(|| format!("{relative} not found (run from the repository)"))
}

/// Run the selected experiment.
pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    match args.which {
        Which::Rcs(a) => rcs::run(a),
        Which::Availability(a) => availability::run(a),
        Which::Badpath(a) => badpath::run(a),
        Which::Controller(a) => controller::run(a),
        Which::CpuFloor(a) => cpufloor::run(a),
        Which::Box(a) => recobox::run(a),
        Which::Loglock(a) => loglock::run(a),
        Which::OutputCommit(a) => outputcommit::run(a),
        Which::LostDevice(a) => lostdevice::run(a),
        Which::DeviceFaults(a) => devicefaults::run(a),
        Which::Smartstore(a) => smartstore::run(a),
    }
}
