//! `rebound`: the command-line interface of the rebound storage controller.
//!
//! Each subcommand lives in its own module (`bench` and `demo` in the
//! `experiments` crate); `main` only parses arguments and dispatches. See
//! `rebound --help`. Features: `smartstore` adds `node` and `query`,
//! `experiments` adds `bench` and `demo`; both are on by default, and
//! without them the binary is the server alone.

use clap::{Parser, Subcommand};

mod admin_cmd;
mod box_cmd;
mod serve;
#[cfg(feature = "smartstore")]
mod smartstore_cmd;
mod supervise;

/// rebound: a software storage controller that recovers from its own
/// software faults at the smallest safe scope instead of rebooting.
#[derive(Debug, Parser)]
#[command(name = "rebound", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a volume over NBD (the storage controller).
    Serve(Box<serve::ServeArgs>),
    /// Inspect a recovery box (validation verdict, types, items).
    #[command(name = "box")]
    Box(box_cmd::BoxArgs),
    /// Show a running server's groups, recoveries by rung and recent recoveries.
    Status(admin_cmd::StatusArgs),
    /// Inject a fault into a running server (through its admin socket).
    Inject(admin_cmd::InjectArgs),
    /// Run an experiment or benchmark; prints a table, full runs also write a PNG plot.
    #[cfg(feature = "experiments")]
    Bench(experiments::bench::BenchArgs),
    /// Simulate the scheduler at processor counts this host lacks (deterministic, the real policy code).
    #[cfg(feature = "experiments")]
    Sim(experiments::sim::SimArgs),
    /// Watch the recovery ladder: a server, a verifying client, one fault per rung (~20 s).
    #[cfg(feature = "experiments")]
    Demo(experiments::demo::DemoArgs),
    /// Serve one smart-storage node: table partitions and plan fragments over Arrow Flight.
    #[cfg(feature = "smartstore")]
    Node(smartstore_cmd::NodeArgs),
    /// Run the smart-storage workloads (Scan, TPC-H Q1) on storage nodes, local or given.
    #[cfg(feature = "smartstore")]
    Query(smartstore_cmd::QueryArgs),
}

fn main() -> std::process::ExitCode {
    init_tracing();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Box(args) => box_cmd::run(args),
        Command::Status(args) => admin_cmd::status(args),
        Command::Inject(args) => admin_cmd::inject(args),
        #[cfg(feature = "experiments")]
        Command::Bench(args) => experiments::bench::run(args),
        #[cfg(feature = "experiments")]
        Command::Sim(args) => experiments::sim::run(args),
        #[cfg(feature = "experiments")]
        Command::Demo(args) => experiments::demo::run(args),
        #[cfg(feature = "smartstore")]
        Command::Node(args) => smartstore_cmd::node(args),
        #[cfg(feature = "smartstore")]
        Command::Query(args) => smartstore_cmd::query(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("rebound: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr; `RUST_LOG` selects what (default: warnings).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
