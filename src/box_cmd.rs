//! `rebound box ...`: look inside a recovery box.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use recobox::{CreateOptions, RecoveryBox, TypeSpec};

use texttable::{Table, thousands};

/// `rebound box`.
#[derive(Debug, Args)]
pub struct BoxArgs {
    #[command(subcommand)]
    command: BoxCommand,
}

#[derive(Debug, Subcommand)]
enum BoxCommand {
    /// Validate a box without changing it: types, item counts, space used and
    /// the verdict. Exit status 1 when the box cannot be trusted.
    Inspect {
        /// The box file.
        file: PathBuf,
    },
    /// Create a box, fill it with test items (52 bytes each, with checksums)
    /// and keep it open until killed; for experiments (e.g. kill -9 it, then
    /// inspect).
    Fill {
        /// The box file (replaced).
        file: PathBuf,
        /// Items to insert.
        #[arg(long, default_value_t = 20_000)]
        items: u32,
    },
}

/// Run `rebound box ...`.
pub fn run(args: BoxArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        BoxCommand::Inspect { file } => inspect(&file),
        BoxCommand::Fill { file, items } => fill(&file, items),
    }
}

fn inspect(file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let report = recobox::inspect(file).with_context(|| format!("reading {}", file.display()))?;
    println!(
        "recovery box {} ({} bytes)",
        file.display(),
        thousands(report.file_bytes as f64)
    );
    match report.verdict {
        Ok(c) => {
            let mut t = Table::new(&[
                "type",
                "app id",
                "item bytes",
                "items",
                "capacity",
                "checksums",
                "region bytes",
            ]);
            for ty in &c.types {
                t.row(vec![
                    ty.id.to_string(),
                    ty.app_type_id.map_or("-".into(), |a| a.to_string()),
                    ty.item_bytes.to_string(),
                    thousands(f64::from(ty.count)),
                    thousands(f64::from(ty.max_items)),
                    if ty.checksum { "yes" } else { "no" }.into(),
                    thousands(ty.region_bytes as f64),
                ]);
            }
            println!("{}", t.render());
            println!(
                "{} of {} type slots used; data area: {} bytes used, {} free",
                c.types.len(),
                c.type_slots,
                thousands(c.data_used_bytes as f64),
                thousands(c.data_free_bytes as f64)
            );
            if c.interrupted_ops > 0 {
                println!(
                    "{} interrupted operation(s) would be rolled back on open",
                    c.interrupted_ops
                );
            }
            println!("verdict: trusted");
            Ok(ExitCode::SUCCESS)
        }
        Err(u) => {
            println!("verdict: NOT trusted: {u}");
            Ok(ExitCode::FAILURE)
        }
    }
}

fn fill(file: &std::path::Path, items: u32) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        items > 0 && items <= recobox::MAX_ITEMS_MAX,
        "--items must be within 1..={}",
        recobox::MAX_ITEMS_MAX
    );
    let size = recobox::layout::data_start(8)
        + recobox::layout::region_bytes(52, items).context("too many items")?
        + 4096;
    let b = RecoveryBox::create(
        file,
        CreateOptions {
            size_bytes: size,
            type_slots: 8,
        },
    )?;
    let t = b.init_type(TypeSpec::new(52, items).app_id(1))?;
    let item = [0x5au8; 52];
    let batch: Vec<&[u8]> = vec![&item; 1000];
    let mut left = items;
    while left > 0 {
        let n = left.min(1000);
        b.insert_many(t, &batch[..n as usize], None)?;
        left -= n;
    }
    println!(
        "filled {} with {items} items; holding it open (kill me)",
        file.display()
    );
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
