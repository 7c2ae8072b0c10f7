//! `rebound bench box`: the recovery box's costs (paper, Tables 5 and 6) and
//! its peer, memcached's restartable cache (`bench/memcached-restart.sh`).
//!
//! In-process: insert+delete pairs of a 52-byte checksummed item, updates of
//! a 92-byte item (mean over many), and open+validate of boxes of 20,000 and
//! 1,000,000 items (median of a few). Then the peer script: restart time
//! after a clean shutdown and items left after kill -9, for both. Full runs
//! write `box.png`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use recobox::{CreateOptions, RecoveryBox, TypeSpec};

use super::CommonArgs;
use crate::report::{BarPanel, Table, bar_chart_png, thousands};

/// Options of `rebound bench box`.
#[derive(Debug, Args)]
pub struct BoxBenchArgs {
    #[command(flatten)]
    common: CommonArgs,
}

fn shm() -> anyhow::Result<tempfile::TempDir> {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .context("temporary directory")
}

fn per_op(n: u32, mut f: impl FnMut()) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed() / n
}

fn open_time(items: u32, repeats: usize) -> anyhow::Result<Duration> {
    let dir = shm()?;
    let path = dir.path().join("box");
    {
        let size = recobox::layout::data_start(8)
            + recobox::layout::region_bytes(52, items).context("size")?
            + 4096;
        let b = RecoveryBox::create(
            &path,
            CreateOptions {
                size_bytes: size,
                type_slots: 8,
            },
        )?;
        let t = b.init_type(TypeSpec::new(52, items))?;
        let item = [3u8; 52];
        let batch: Vec<&[u8]> = vec![&item; 1000];
        let mut left = items;
        while left > 0 {
            let n = left.min(1000);
            b.insert_many(t, &batch[..n as usize], None)?;
            left -= n;
        }
    }
    let mut times: Vec<Duration> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            let b = RecoveryBox::open(&path)?;
            anyhow::ensure!(b.open_report().items == u64::from(items), "lost items");
            Ok(t.elapsed())
        })
        .collect::<anyhow::Result<_>>()?;
    times.sort();
    Ok(times[times.len() / 2])
}

/// Run the benchmark.
pub fn run(args: BoxBenchArgs) -> anyhow::Result<std::process::ExitCode> {
    let quick = args.common.quick;
    let dir = shm()?;
    let b = RecoveryBox::create(&dir.path().join("box"), CreateOptions::default())?;
    let handles = b.init_type(TypeSpec::new(52, 20_000))?;
    let conns = b.init_type(TypeSpec::new(92, 16))?;
    for i in 0..1000u32 {
        b.insert(handles, &[i as u8; 52], None)?;
    }
    let conn = b.insert(conns, &[0; 92], None)?;
    let n = if quick { 200_000 } else { 2_000_000 };
    let item52 = [7u8; 52];
    let pair = per_op(n, || {
        let id = b.insert(handles, &item52, Some(1)).expect("insert");
        b.delete(id).expect("delete");
    });
    let mut item92 = [0u8; 92];
    let mut k = 0u64;
    let update = per_op(n, || {
        k += 1;
        item92[..8].copy_from_slice(&k.to_le_bytes());
        b.update(conn, &item92).expect("update");
    });
    let big = if quick { 200_000 } else { 1_000_000 };
    let open_small = open_time(20_000, 5)?;
    let open_big = open_time(big, 3)?;
    let mut t = Table::new(&["operation", "measured", "target", "paper (SPARCstation 2)"]);
    let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
    t.row(vec![
        "insert+delete 52 B, checksum".into(),
        format!("{} ns", pair.as_nanos()),
        "< 200 ns".into(),
        "28 µs".into(),
    ]);
    t.row(vec![
        "update 92 B, checksum".into(),
        format!("{} ns", update.as_nanos()),
        "< 150 ns".into(),
        "55 µs".into(),
    ]);
    t.row(vec![
        "open+validate 20,000 items".into(),
        ms(open_small),
        "< 5 ms".into(),
        "-".into(),
    ]);
    t.row(vec![
        format!("open+validate {} items", thousands(f64::from(big))),
        ms(open_big),
        if quick { "-".into() } else { "< 200 ms".into() },
        "-".into(),
    ]);
    println!(
        "recovery box costs (in /dev/shm; {} iterations per operation)",
        thousands(f64::from(n))
    );
    println!("{}", t.render());
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "targets: pair {}, update {}, open 20k {}{}",
        met(pair < Duration::from_nanos(200)),
        met(update < Duration::from_nanos(150)),
        met(open_small < Duration::from_millis(5)),
        if quick {
            String::new()
        } else {
            format!(", open 1M {}", met(open_big < Duration::from_millis(200)))
        }
    );
    let peer = peer(&args.common.out, quick)?;
    if !quick {
        let png = args.common.out.join("box.png");
        plot(&png, &peer)?;
        println!("plot: {}", png.display());
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Run the memcached comparison; returns (system, restart ms, items after kill -9).
fn peer(out: &Path, quick: bool) -> anyhow::Result<Vec<(String, f64, f64)>> {
    let script = super::repo_file("bench/memcached-restart.sh")?;
    let exe = std::env::current_exe()?;
    let status = Command::new("bash")
        .arg(script)
        .args([
            "--rounds",
            if quick { "1" } else { "3" },
            "--items",
            "20000",
        ])
        .arg("--rebound")
        .arg(&exe)
        .arg("--out")
        .arg(out)
        .status()
        .context("running bench/memcached-restart.sh")?;
    anyhow::ensure!(
        status.success(),
        "bench/memcached-restart.sh failed ({status})"
    );
    let csv = std::fs::read_to_string(out.join("memcached-restart.csv"))?;
    let mut rows: Vec<(String, Vec<f64>, f64)> = Vec::new();
    for line in csv.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        anyhow::ensure!(f.len() == 6, "malformed line {line:?}");
        let (ms, cold): (f64, f64) = (f[3].parse()?, f[5].parse()?);
        match rows.iter_mut().find(|r| r.0 == f[0]) {
            Some(r) => r.1.push(ms),
            None => rows.push((f[0].to_owned(), vec![ms], cold)),
        }
    }
    Ok(rows
        .into_iter()
        .map(|(s, mut t, c)| {
            t.sort_by(f64::total_cmp);
            (s, t[t.len() / 2], c)
        })
        .collect())
}

fn plot(png: &Path, peer: &[(String, f64, f64)]) -> anyhow::Result<()> {
    let categories: Vec<String> = peer.iter().map(|p| p.0.clone()).collect();
    bar_chart_png(
        png,
        "recovery box vs memcached restartable cache, 20,000 items",
        &[
            BarPanel {
                title: "restart after a clean shutdown".into(),
                y_label: "milliseconds".into(),
                categories: categories.clone(),
                series: vec![("restart time".into(), peer.iter().map(|p| p.1).collect())],
            },
            BarPanel {
                title: "state left after kill -9".into(),
                y_label: "items".into(),
                categories,
                series: vec![("items".into(), peer.iter().map(|p| p.2).collect())],
            },
        ],
    )
}
