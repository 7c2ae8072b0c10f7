//! Files the controller creates for its state (device files, the NVS, the
//! volume label, the partial parity log, the rename map): giving them their
//! full size up front, so that a full file system is found at start-up and
//! not by a write after a reply was sent; and syncing the directory that
//! holds a created or renamed file, so that the file itself survives a
//! power loss and not only its contents.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Give a new device (or NVS) file its full size, reserving the space where
/// the file system can (so a full disk is found now, not by a write later).
pub fn reserve(file: &File, capacity: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(capacity)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "device too large"))?;
    // SAFETY: fallocate takes a file descriptor we own (kept open by `file`
    // for the duration of the call) and integers; it touches no memory of ours.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // The file system cannot reserve space: a sparse file will do.
        Some(libc::EOPNOTSUPP) => file.set_len(capacity),
        _ => Err(err),
    }
}

/// Make the entries of directory `dir` durable (`fsync` on the directory).
///
/// Syncing a file makes its contents durable, not its name: a file just
/// created, or renamed into place, can vanish (or come back under its old
/// name) at a power loss until the directory holding it is synced too. Call
/// this after creating a state file and after a rename that replaces one.
/// The error names the directory.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    let named = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("{what} directory {}: {e}", dir.display()))
    };
    File::open(dir)
        .map_err(|e| named("cannot open", e))?
        .sync_all()
        .map_err(|e| named("cannot sync", e))
}

/// [`sync_dir`] on the directory holding `file` (the current directory for
/// a bare file name).
pub fn sync_parent(file: &Path) -> io::Result<()> {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => sync_dir(Path::new(".")),
    }
}

/// Whether `path` lives in memory (tmpfs or ramfs, as `/dev/shm` does):
/// what is there does not survive a power loss. Read from the longest
/// mount point in `/proc/self/mounts` holding the canonical path; `false`
/// when that cannot be told.
pub fn is_volatile(path: &Path) -> bool {
    let Ok(path) = path.canonicalize() else {
        return false;
    };
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    mounts
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let (_, point, kind) = (words.next()?, words.next()?, words.next()?);
            // Octal escapes (`\040` for a space) are rare in mount points;
            // such a mount simply never matches.
            path.starts_with(point).then_some((point.len(), kind))
        })
        .max_by_key(|&(len, _)| len)
        .is_some_and(|(_, kind)| matches!(kind, "tmpfs" | "ramfs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_is_volatile_and_proc_or_a_missing_path_is_not() {
        assert!(is_volatile(Path::new("/dev/shm")));
        assert!(!is_volatile(Path::new("/proc/self")));
        assert!(!is_volatile(Path::new("/nonexistent/path")));
    }

    #[test]
    fn sync_dir_succeeds_on_a_directory_and_names_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"x").unwrap();
        sync_dir(dir.path()).unwrap();
        sync_parent(&dir.path().join("f")).unwrap();
        sync_parent(Path::new("relative-file-name")).unwrap();
        let missing = dir.path().join("missing");
        let err = sync_dir(&missing).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let text = err.to_string();
        assert!(
            text.contains("cannot open directory") && text.contains(&*missing.to_string_lossy()),
            "the error names the directory: {text}"
        );
    }
}
