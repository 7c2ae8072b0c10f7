//! `rebound`: the command-line interface of the rebound storage controller.
//!
//! Each subcommand lives in its own module (`bench` and `demo` in the
//! `experiments` crate); `main` only parses arguments and dispatches. See
//! `rebound --help`. Features: `smartstore` adds `node` and `query`,
//! `experiments` adds `bench` and `demo`; both are on by default, and
//! without them the binary is the server alone.

use clap::{CommandFactory, Parser, Subcommand};

/// Small blocks from mimalloc, large ones from glibc's (see `alloc`).
#[global_allocator]
static GLOBAL: alloc::Split = alloc::Split;

mod admin_cmd;
mod alloc;
mod box_cmd;
mod logging;
mod reset_cmd;
mod serve;
#[cfg(feature = "smartstore")]
mod smartstore_cmd;
mod supervise;
mod systemd;

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
    /// Delete a volume (data directory files, NVS, recovery box) so the next serve starts fresh.
    Reset(reset_cmd::ResetArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) to stdout, e.g. `rebound man > rebound.1`.
    Man,
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
    let cli = Cli::parse();
    // `serve` sets up its own logging (--log-level, --log-format, --log-file).
    if !matches!(cli.command, Command::Serve(_)) {
        logging::init_default();
    }
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Reset(args) => reset_cmd::run(args),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "rebound",
                &mut std::io::stdout(),
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Man => man(),
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

/// `rebound man`: the manual page of `rebound` and its subcommands.
fn man() -> anyhow::Result<std::process::ExitCode> {
    let mut out = std::io::stdout().lock();
    let cmd = Cli::command();
    clap_mangen::Man::new(cmd.clone()).render(&mut out)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("rebound-{}", sub.get_name());
        let sub = sub.clone().display_name(name);
        clap_mangen::Man::new(sub).render(&mut out)?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}
