//! `rebound bench cpu-floor`: where a server's CPU time per I/O goes at a
//! fixed offered load, rebound next to nbdkit's null plugin (which stores
//! nothing: the floor of the NBD protocol over loopback TCP).
//!
//! `bench/cpu-floor.sh` runs the loads (so it can also run by hand): the
//! server's CPU time from `/proc` over an unobserved window, then `perf
//! record -g` and a `perf stat` of its system calls over a second one.
//! This command sorts each profile's samples into cost categories by their
//! kernel call chains and thread names ([`classify`]), scales the shares
//! by the unobserved window's CPU time per I/O, and prints one table per
//! load (microseconds per I/O, per category and server) and the system
//! calls per I/O; a full run draws `cpu-floor.png`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use clap::Args;

use super::CommonArgs;
use crate::report::{BarPanel, stacked_bar_png};

/// Options of `rebound bench cpu-floor`.
#[derive(Debug, Args)]
pub struct CpuFloorArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Rounds (every server once per load and round; the round with the median CPU per I/O is reported) [default: 3, or 1 with --quick].
    #[arg(long)]
    rounds: Option<u32>,
    /// Seconds of each window (unobserved, then profiled) [default: 6, or 3 with --quick].
    #[arg(long)]
    runtime: Option<u32>,
    /// Print and plot the results of the last run in --out (its CSV files and profiles) instead of running.
    #[arg(long)]
    reuse: bool,
}

/// Where a sample of a server's CPU time went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Category {
    /// Waking the client's thread as a reply reaches its socket.
    WakingClient,
    /// The server's own threads going to sleep and being woken (the
    /// scheduler, futexes).
    Sleeping,
    /// The loopback TCP/IP stack, both directions.
    Tcp,
    /// The kernel copying payloads between sockets and the server's memory.
    SocketCopies,
    /// System call entry and exit, and other kernel work.
    OtherKernel,
    /// Reads of cache misses from the page cache.
    DiskReads,
    /// Copies in user space: cache frames, NVS records, replies.
    UserCopies,
    /// CRC32C of NVS records.
    Checksums,
    /// The rest of user space: protocol, cache, NVS, scheduling.
    OtherUser,
    /// Destage's device writes on the rcs workers (the `pwrite` and the
    /// record read before it).
    DestageWrites,
    /// Destage's device sync (`fdatasync`: the kernel's writeback).
    DestageSync,
}

impl Category {
    const ALL: [Category; 11] = [
        Category::WakingClient,
        Category::Sleeping,
        Category::Tcp,
        Category::SocketCopies,
        Category::OtherKernel,
        Category::DiskReads,
        Category::UserCopies,
        Category::Checksums,
        Category::OtherUser,
        Category::DestageWrites,
        Category::DestageSync,
    ];

    fn label(self) -> &'static str {
        match self {
            Category::WakingClient => "waking the client (reply reaches its socket)",
            Category::Sleeping => "server threads sleeping and being woken",
            Category::Tcp => "loopback TCP/IP",
            Category::SocketCopies => "kernel copies, socket <-> server memory",
            Category::OtherKernel => "system call entry and exit, other kernel",
            Category::DiskReads => "reads of misses (page cache)",
            Category::UserCopies => "user copies (frames, NVS records, replies)",
            Category::Checksums => "CRC32C of NVS records",
            Category::OtherUser => "user: protocol, cache, NVS",
            Category::DestageWrites => "destage: device writes (rcs workers)",
            Category::DestageSync => "destage: device sync (fdatasync writeback)",
        }
    }
}

/// The plot's stacks: the table's categories in five groups, so that
/// the legend fits above the bars.
const PLOT_GROUPS: [(&str, &[Category]); 5] = [
    (
        "wake-ups: the client's, the server's threads'",
        &[Category::WakingClient, Category::Sleeping],
    ),
    (
        "TCP/IP, system calls, socket copies",
        &[Category::Tcp, Category::SocketCopies, Category::OtherKernel],
    ),
    (
        "user space (protocol, cache, NVS, copies, CRC), miss reads",
        &[
            Category::DiskReads,
            Category::UserCopies,
            Category::Checksums,
            Category::OtherUser,
        ],
    ),
    ("destage: device writes", &[Category::DestageWrites]),
    ("destage: device sync (writeback)", &[Category::DestageSync]),
];

/// One frame of a sample's call chain, leaf first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    kernel: bool,
    sym: String,
}

/// The category of one sample of thread `comm` with call chain `frames`
/// (leaf first). The thread decides destage's share; otherwise the first
/// rule that matches: a wake-up of the client (`sock_def_readable` under a
/// send), the scheduler, then what the leaf is.
pub(crate) fn classify(comm: &str, frames: &[Frame]) -> Category {
    // Thread names are cut at 15 bytes (rebound-worker-N, rebound-destage).
    if comm.starts_with("rebound-destag") {
        return Category::DestageSync;
    }
    if comm.starts_with("rebound-worke") {
        return Category::DestageWrites;
    }
    let kernel_has = |prefixes: &[&str]| {
        frames
            .iter()
            .any(|f| f.kernel && prefixes.iter().any(|p| f.sym.starts_with(p)))
    };
    if kernel_has(&["sock_def_readable"]) {
        return Category::WakingClient;
    }
    if kernel_has(&[
        "schedule",
        "__schedule",
        "finish_task_switch",
        "futex_",
        "do_futex",
    ]) {
        return Category::Sleeping;
    }
    let Some(leaf) = frames.first() else {
        return Category::OtherUser;
    };
    if leaf.kernel {
        if kernel_has(&[
            "filemap_read",
            "ext4_file_read_iter",
            "generic_file_read_iter",
        ]) {
            return Category::DiskReads;
        }
        if kernel_has(&[
            "_copy_to_iter",
            "_copy_from_iter",
            "copy_page_to_iter",
            "copy_page_from_iter",
            "skb_copy_datagram",
            "rep_movs_alternative",
            "memcpy_orig",
        ]) {
            return Category::SocketCopies;
        }
        if kernel_has(&[
            "tcp_",
            "ip_",
            "__ip",
            "net_",
            "__netif",
            "netif_",
            "loopback",
            "skb_",
            "__skb",
            "sock_",
            "sk_",
            "inet_",
            "__dev_",
            "dev_",
            "bbr_",
            "__tcp",
            "___sys_sendmsg",
            "__sys_",
        ]) {
            return Category::Tcp;
        }
        return Category::OtherKernel;
    }
    let s = leaf.sym.as_str();
    if s.contains("memmove") || s.contains("memcpy") || s.contains("copy_nonoverlapping") {
        Category::UserCopies
    } else if s.contains("crc32") {
        Category::Checksums
    } else {
        Category::OtherUser
    }
}

/// Samples per category in `perf script -F comm,ip,sym` output.
pub(crate) fn categorize(script: &str) -> BTreeMap<Category, u64> {
    let mut counts = BTreeMap::new();
    let mut comm: Option<&str> = None;
    let mut frames: Vec<Frame> = Vec::new();
    let mut flush = |comm: Option<&str>, frames: &mut Vec<Frame>| {
        if let Some(c) = comm {
            *counts.entry(classify(c, frames)).or_insert(0) += 1;
        }
        frames.clear();
    };
    for line in script.lines() {
        if line.trim().is_empty() {
            flush(comm.take(), &mut frames);
        } else if line.starts_with(['\t', ' ']) {
            let mut parts = line.split_whitespace();
            let addr = parts.next().unwrap_or("");
            let sym: Vec<&str> = parts.collect();
            frames.push(Frame {
                // Kernel text lies in the top half of the address space.
                kernel: addr.len() == 16 && addr.starts_with("ffff"),
                sym: sym.join(" "),
            });
        } else {
            flush(comm.take(), &mut frames);
            comm = line.split_whitespace().next();
        }
    }
    flush(comm, &mut frames);
    counts
}

/// One run of `floor.csv`.
#[derive(Debug, Clone)]
struct Run {
    server: String,
    load: u64,
    round: u32,
    ios: f64,
    cpu_seconds: f64,
    perf_file: String,
}

impl Run {
    fn cpu_us_per_io(&self) -> f64 {
        self.cpu_seconds * 1e6 / self.ios.max(1.0)
    }
}

fn read_runs(csv: &Path) -> anyhow::Result<Vec<Run>> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    text.lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            anyhow::ensure!(
                f.len() == 6,
                "malformed line in {}: {line:?}",
                csv.display()
            );
            let bad = |what: &str| format!("bad {what} in {}: {line:?}", csv.display());
            Ok(Run {
                server: f[0].to_owned(),
                load: f[1].parse().with_context(|| bad("load"))?,
                round: f[2].parse().with_context(|| bad("round"))?,
                ios: f[3].parse().with_context(|| bad("I/O count"))?,
                cpu_seconds: f[4].parse().with_context(|| bad("CPU time"))?,
                perf_file: f[5].to_owned(),
            })
        })
        .collect()
}

/// System calls and context switches per run: `(server, load, round)` to
/// `(event, count)`.
type Calls = BTreeMap<(String, u64, u32), Vec<(String, u64)>>;

fn read_calls(csv: &Path) -> anyhow::Result<Calls> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut calls = Calls::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        anyhow::ensure!(
            f.len() == 5,
            "malformed line in {}: {line:?}",
            csv.display()
        );
        let bad = || format!("bad number in {}: {line:?}", csv.display());
        calls
            .entry((
                f[0].to_owned(),
                f[1].parse().with_context(bad)?,
                f[2].parse().with_context(bad)?,
            ))
            .or_default()
            .push((f[3].to_owned(), f[4].parse().with_context(bad)?));
    }
    Ok(calls)
}

/// The run with the median CPU per I/O of each (load, server), in the
/// script's order.
fn median_runs(runs: &[Run]) -> Vec<Run> {
    let mut keys: Vec<(u64, String)> = Vec::new();
    for r in runs {
        if !keys.contains(&(r.load, r.server.clone())) {
            keys.push((r.load, r.server.clone()));
        }
    }
    keys.into_iter()
        .map(|(load, server)| {
            let mut rs: Vec<&Run> = runs
                .iter()
                .filter(|r| r.load == load && r.server == server)
                .collect();
            rs.sort_by(|a, b| a.cpu_us_per_io().total_cmp(&b.cpu_us_per_io()));
            rs[(rs.len() - 1) / 2].clone()
        })
        .collect()
}

/// Microseconds per I/O in each category: the profile's shares times the
/// unobserved window's CPU per I/O.
fn split(run: &Run) -> anyhow::Result<BTreeMap<Category, f64>> {
    let out = Command::new("perf")
        .args(["script", "-F", "comm,ip,sym", "-i", &run.perf_file])
        .output()
        .context("running perf script")?;
    anyhow::ensure!(
        out.status.success(),
        "perf script -i {} failed: {}",
        run.perf_file,
        String::from_utf8_lossy(&out.stderr)
    );
    let counts = categorize(&String::from_utf8_lossy(&out.stdout));
    let total: u64 = counts.values().sum();
    anyhow::ensure!(total > 0, "{} holds no samples", run.perf_file);
    let per_io = run.cpu_us_per_io();
    Ok(counts
        .into_iter()
        .map(|(c, n)| (c, per_io * n as f64 / total as f64))
        .collect())
}

/// Run the measurement and print where the time goes.
pub fn run(args: CpuFloorArgs) -> anyhow::Result<std::process::ExitCode> {
    let exe = std::env::current_exe().context("locating this binary")?;
    let (rounds, runtime) = if args.common.quick {
        (args.rounds.unwrap_or(1), args.runtime.unwrap_or(3))
    } else {
        (args.rounds.unwrap_or(3), args.runtime.unwrap_or(6))
    };
    anyhow::ensure!((1..=50).contains(&rounds), "--rounds must be within 1..=50");
    anyhow::ensure!(
        (1..=600).contains(&runtime),
        "--runtime must be within 1..=600"
    );
    let out = &args.common.out;
    if !args.reuse {
        measure(&exe, out, rounds, runtime)?;
    }
    let all = read_runs(&out.join("floor.csv"))?;
    anyhow::ensure!(
        !all.is_empty(),
        "{} holds no runs",
        out.join("floor.csv").display()
    );
    let rounds = all.iter().map(|r| r.round).max().unwrap_or(1);
    let runs = median_runs(&all);
    let calls = read_calls(&out.join("floor-syscalls.csv"))?;
    let mut loads: Vec<u64> = runs.iter().map(|r| r.load).collect();
    loads.dedup();
    let mut panels = Vec::new();
    for load in loads {
        let at: Vec<&Run> = runs.iter().filter(|r| r.load == load).collect();
        let splits = at
            .iter()
            .map(|r| split(r))
            .collect::<anyhow::Result<Vec<_>>>()?;
        print_load(load, rounds, &at, &splits, &calls);
        panels.push(BarPanel {
            title: format!("{load} IOPS offered"),
            y_label: "server CPU µs per I/O".into(),
            categories: at.iter().map(|r| r.server.clone()).collect(),
            series: PLOT_GROUPS
                .iter()
                .map(|(label, cats)| {
                    let sum = |s: &BTreeMap<Category, f64>| {
                        cats.iter().map(|c| s.get(c).copied().unwrap_or(0.0)).sum()
                    };
                    ((*label).to_owned(), splits.iter().map(sum).collect())
                })
                .collect(),
        });
    }
    if !args.common.quick {
        let png = out.join("cpu-floor.png");
        stacked_bar_png(
            &png,
            "where the server's CPU time per I/O goes (fio cache-standard at a fixed rate; perf, cpu-clock)",
            &panels,
        )?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Run `bench/cpu-floor.sh` with this binary.
fn measure(exe: &Path, out: &Path, rounds: u32, runtime: u32) -> anyhow::Result<()> {
    let status = Command::new("bash")
        .arg(super::repo_file("bench/cpu-floor.sh")?)
        .arg("--rebound")
        .arg(exe)
        .arg("--out")
        .arg(out)
        .args([
            "--rounds",
            &rounds.to_string(),
            "--runtime",
            &runtime.to_string(),
        ])
        .status()
        .context("running bench/cpu-floor.sh")?;
    anyhow::ensure!(status.success(), "bench/cpu-floor.sh failed ({status})");
    Ok(())
}

fn print_load(
    load: u64,
    rounds: u32,
    at: &[&Run],
    splits: &[BTreeMap<Category, f64>],
    calls: &Calls,
) {
    println!();
    println!(
        "server CPU µs per I/O at {load} IOPS offered, by category (perf shares of the median round of {rounds}, scaled by the CPU per I/O from /proc)"
    );
    print!("{:<46}", "category");
    for r in at {
        print!("{:>14}", r.server);
    }
    println!();
    for c in Category::ALL {
        if splits
            .iter()
            .all(|s| s.get(&c).copied().unwrap_or(0.0) < 0.005)
        {
            continue;
        }
        print!("{:<46}", c.label());
        for s in splits {
            print!("{:>14.2}", s.get(&c).copied().unwrap_or(0.0));
        }
        println!();
    }
    print!("{:<46}", "total (/proc)");
    for r in at {
        print!("{:>14.2}", r.cpu_us_per_io());
    }
    println!();
    println!("system calls and context switches per I/O (perf stat, the profiled window)");
    let per_run: Vec<BTreeMap<&str, f64>> = at
        .iter()
        .map(|r| {
            calls
                .get(&(r.server.clone(), r.load, r.round))
                .map(|v| {
                    v.iter()
                        .map(|(e, n)| (e.as_str(), *n as f64 / r.ios.max(1.0)))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect();
    let mut events: Vec<&str> = per_run.iter().flat_map(|m| m.keys().copied()).collect();
    events.sort_unstable();
    events.dedup();
    for e in events {
        if per_run
            .iter()
            .all(|m| m.get(e).copied().unwrap_or(0.0) < 0.0005)
        {
            continue;
        }
        print!("{e:<46}");
        for m in &per_run {
            print!("{:>14.3}", m.get(e).copied().unwrap_or(0.0));
        }
        println!();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = "\
nbd-conn-3.1 
\tffffffff81a00001 _raw_spin_unlock_irqrestore
\tffffffff81a00002 try_to_wake_up
\tffffffff81a00003 sock_def_readable
\tffffffff81a00004 tcp_data_queue
\tffffffff81a00005 tcp_sendmsg_locked
\t          10ac4d __libc_sendmsg

nbd-conn-3.1 
\tffffffff813a2413 finish_task_switch.isra.0
\tffffffff821f8914 __schedule
\tffffffff821f94c3 schedule_timeout
\t          10bc00 __libc_recv

nbd-conn-3.1 
\t         49a03d6 __memmove_avx512_unaligned_erms

nbd-conn-3.1 
\tffffffff8201ce5b tcp_ack
\tffffffff8201fec3 tcp_rcv_established

nbd-conn-3.1 
\tffffffff8201aaaa _copy_from_iter
\tffffffff8201bbbb tcp_sendmsg_locked

nbd-conn-3.1 
\t         4aa0000 crc32c::hw_x86_64::crc_u64_parallel3

rebound-destage 
\tffffffff8201cccc filemap_get_folios_tag

rebound-worker- 
\t         4bb0000 controller::engine::destage::one

nbdkit 
\t         4cc0000 null_pread
";

    #[test]
    fn samples_are_sorted_by_thread_and_kernel_call_chain() {
        let c = categorize(SCRIPT);
        let n = |cat| c.get(&cat).copied().unwrap_or(0);
        assert_eq!(n(Category::WakingClient), 1);
        assert_eq!(n(Category::Sleeping), 1);
        assert_eq!(n(Category::UserCopies), 1);
        assert_eq!(n(Category::Tcp), 1);
        assert_eq!(n(Category::SocketCopies), 1);
        assert_eq!(n(Category::Checksums), 1);
        assert_eq!(n(Category::DestageSync), 1);
        assert_eq!(n(Category::DestageWrites), 1);
        assert_eq!(n(Category::OtherUser), 1);
        assert_eq!(c.values().sum::<u64>(), 9, "every sample counted once");
    }

    #[test]
    fn every_category_is_in_exactly_one_plot_group() {
        for c in Category::ALL {
            let groups = PLOT_GROUPS.iter().filter(|(_, cs)| cs.contains(&c)).count();
            assert_eq!(groups, 1, "{c:?}");
        }
    }

    #[test]
    fn a_wake_up_of_the_client_counts_before_the_scheduler_under_it() {
        let f = |kernel, sym: &str| Frame {
            kernel,
            sym: sym.into(),
        };
        let chain = [
            f(true, "finish_task_switch.isra.0"),
            f(true, "schedule"),
            f(true, "sock_def_readable"),
        ];
        assert_eq!(classify("nbd-conn-0.0", &chain), Category::WakingClient);
        assert_eq!(classify("nbd-conn-0.0", &chain[..2]), Category::Sleeping);
        assert_eq!(classify("rebound-destage", &chain), Category::DestageSync);
    }

    #[test]
    fn the_median_round_is_chosen_per_load_and_server() {
        let run = |server: &str, load, round, cpu| Run {
            server: server.into(),
            load,
            round,
            ios: 1e6,
            cpu_seconds: cpu,
            perf_file: String::new(),
        };
        let runs = [
            run("rebound", 20000, 1, 30.0),
            run("rebound", 20000, 2, 10.0),
            run("rebound", 20000, 3, 20.0),
            run("nbdkit-null", 20000, 1, 5.0),
        ];
        let m = median_runs(&runs);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].server.as_str(), m[0].round), ("rebound", 3));
        assert!((m[0].cpu_us_per_io() - 20.0).abs() < 1e-9);
        assert_eq!((m[1].server.as_str(), m[1].round), ("nbdkit-null", 1));
    }
}
