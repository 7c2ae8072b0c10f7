//! `rebound reset`: remove a volume so the next `serve` on its data
//! directory starts a new one: the files rebound keeps in the data
//! directory (label, device files, parity log, allocation map, output-commit files, a
//! stale admin socket), its NVS and its recovery box. Refused while a
//! server runs on it; nothing else is touched (the directory itself and
//! any other file in it stay).

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;

/// Options of `rebound reset`.
#[derive(Debug, Args)]
pub struct ResetArgs {
    /// The volume's data directory (as given to `rebound serve`).
    #[arg(long, value_name = "DIR")]
    data_dir: PathBuf,
    /// Its NVS file [default: /dev/shm/rebound-<hash of data dir>.nvs].
    #[arg(long, value_name = "PATH")]
    nvs: Option<PathBuf>,
    /// Its recovery box [default: /dev/shm/rebound-<hash of data dir>.box].
    #[arg(long = "box", value_name = "PATH")]
    box_path: Option<PathBuf>,
    /// Its admin socket, to tell whether a server runs [default: <data dir>/admin.sock].
    #[arg(long, value_name = "PATH.sock")]
    admin: Option<PathBuf>,
    /// Do not ask for confirmation.
    #[arg(long)]
    yes: bool,
}

/// Whether `name` is a file `rebound serve` keeps in a data directory.
pub fn is_volume_file(name: &str) -> bool {
    let device = |rest: &str| {
        rest.strip_prefix("device").is_some_and(|n| {
            let n = n
                .strip_suffix(".failed.img")
                .or_else(|| n.strip_suffix(".img"))
                .or_else(|| n.strip_suffix(".ahead"));
            n.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    matches!(
        name,
        "volume.toml"
            | "volume.toml.tmp"
            | "ppl.log"
            | "alloc.map"
            | "alloc.map.tmp"
            | "output-commit.buffer"
            | "output-commit.map"
            | "output-commit.rename"
            | "admin.sock"
    ) || device(name)
}

/// The files to remove: the data directory's volume files, then the NVS
/// and box if present. Refuses a directory that is not a data directory.
fn plan(args: &ResetArgs, nvs: &Path, rbox: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let dir = &args.data_dir;
    let mut files = Vec::new();
    let mut others = 0usize;
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries {
                let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
                let name = entry.file_name();
                match name.to_str() {
                    Some(n) if is_volume_file(n) => files.push(entry.path()),
                    _ => others += 1,
                }
            }
            if !dir.join("volume.toml").exists()
                && (others > 0 || files.is_empty())
                && !nvs.exists()
                && !rbox.exists()
            {
                bail!(
                    "{} is not a rebound data directory (it has no volume label, volume.toml); nothing removed",
                    dir.display()
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            bail!(
                "{} is not a directory, so not a rebound data directory",
                dir.display()
            )
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    }
    files.sort();
    files.extend(
        [nvs, rbox]
            .into_iter()
            .filter(|p| p.exists())
            .map(Path::to_path_buf),
    );
    if files.is_empty() {
        bail!(
            "nothing to reset: {} does not exist and there is no NVS ({}) or recovery box ({})",
            dir.display(),
            nvs.display(),
            rbox.display()
        );
    }
    Ok(files)
}

/// Refuse while a server runs: its admin socket answers, or it holds the
/// NVS's lock (the returned file keeps the lock until the reset is done).
fn refuse_if_running(admin: &Path, nvs: &Path) -> anyhow::Result<Option<std::fs::File>> {
    if std::os::unix::net::UnixStream::connect(admin).is_ok() {
        bail!(
            "a server is running on this volume (its admin socket {} answers); stop it first",
            admin.display()
        );
    }
    let file = match controller::files::open_state_file(nvs, controller::files::Create::Never) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("opening the NVS {}", nvs.display())),
    };
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "a server is running on this volume (it holds the NVS {}); stop it first",
            nvs.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("locking the NVS {}", nvs.display()))
        }
    }
}

/// Ask on the terminal; only `y` or `yes` goes on.
fn confirm(files: &[PathBuf]) -> anyhow::Result<bool> {
    let mut err = std::io::stderr();
    writeln!(err, "rebound reset will delete, for good:")?;
    for f in files {
        writeln!(err, "  {}", f.display())?;
    }
    if !std::io::stdin().is_terminal() {
        writeln!(
            err,
            "(standard input is not a terminal; reading the answer from it)"
        )?;
    }
    write!(err, "Delete these files? [y/N] ")?;
    err.flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES"))
}

/// `rebound reset`.
pub fn run(args: ResetArgs) -> anyhow::Result<ExitCode> {
    let nvs = args
        .nvs
        .clone()
        .unwrap_or_else(|| controller::config::shm_path(&args.data_dir, "nvs"));
    let rbox = args
        .box_path
        .clone()
        .unwrap_or_else(|| controller::config::shm_path(&args.data_dir, "box"));
    let admin = args
        .admin
        .clone()
        .unwrap_or_else(|| args.data_dir.join("admin.sock"));
    let files = plan(&args, &nvs, &rbox)?;
    let _lock = refuse_if_running(&admin, &nvs)?;
    if !args.yes && !confirm(&files)? {
        eprintln!("rebound: reset not confirmed; nothing removed");
        return Ok(ExitCode::FAILURE);
    }
    for f in &files {
        std::fs::remove_file(f).with_context(|| format!("removing {}", f.display()))?;
        println!("removed {}", f.display());
    }
    println!(
        "reset {}: the next `rebound serve` there creates a new volume",
        args.data_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_files_serve_keeps_are_volume_files() {
        for name in [
            "volume.toml",
            "device0.img",
            "device12.img",
            "device1.failed.img",
            "device2.ahead",
            "ppl.log",
            "output-commit.map",
            "admin.sock",
        ] {
            assert!(is_volume_file(name), "{name}");
        }
        for name in [
            "device.img",
            "devicex.img",
            "notes.txt",
            "volume.toml.bak",
            "device0.img.orig",
            "..",
        ] {
            assert!(!is_volume_file(name), "{name}");
        }
    }
}
