//! Files the controller creates for its state (device files, the NVS, the
//! volume label, the partial parity log, the rename map, the allocation
//! map, the log file): opening them so that no other local user can read
//! or plant them, giving them their full size up front, so that a full
//! file system is found at start-up and not by a write after a reply was
//! sent; and syncing the directory that holds a created or renamed file,
//! so that the file itself survives a power loss and not only its contents.
//!
//! # Who may touch the state (the contract of this module)
//!
//! The NVS and the devices hold every acknowledged write, so they are the
//! server's alone:
//!
//! - [`private_dir`]: the data directory is created `0700`. An existing one
//!   must be a directory owned by the server's effective uid; one that is
//!   readable or writable by group or others is **tightened** to `0700`
//!   with a warning rather than refused: data directories made by earlier
//!   versions (under the umask, typically `0755`) then keep working after
//!   an upgrade, and the server already owns the directory, so changing its
//!   mode takes nothing from anyone who had a right to it.
//! - [`open_state_file`] / [`open_with`]: every state file is opened with
//!   `O_NOFOLLOW` (a symbolic link at the path is refused, never followed,
//!   so its target is untouched), created with mode `0600` (`O_EXCL` where
//!   the caller knows the file is new, [`Create::New`]), and never opened
//!   with `O_TRUNC` (a file is only shortened after it passed the checks).
//!   After the open the descriptor is `fstat`ed: a file that is not a
//!   regular file, or is owned by another uid than the server's effective
//!   uid, is refused. Every refusal is an error naming the path and why.
//! - [`read_state_file`]: the same checks for a file only read (the label,
//!   the allocation map, the ahead logs); `O_NONBLOCK` so that a FIFO
//!   planted at the path is refused instead of blocking the open.
//!
//! The admin socket's own rules (mode `0600`, the peer's uid) are in
//! [`crate::control::admin`].

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

#[cfg(test)]
pub(crate) mod pagecache;

/// The mode of every state file the server creates.
pub const FILE_MODE: u32 = 0o600;

/// The mode of the data directory.
pub const DIR_MODE: u32 = 0o700;

/// Whether [`open_state_file`] may create the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Create {
    /// The file must exist (`NotFound` otherwise).
    Never,
    /// Created (mode `0600`) when missing, opened when present.
    IfMissing,
    /// The caller knows the file is new: `O_CREAT | O_EXCL`, so an existing
    /// file or link at the path is an error, never opened.
    New,
}

/// The server's effective uid: the owner every state file must have.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Options for a state file opened read-write: mode `0600` when created,
/// `O_NOFOLLOW | O_CLOEXEC` plus `extra_flags` (such as `O_DIRECT`), the
/// creation rule of `create`, never `O_TRUNC`. Callers may add `append` or
/// drop `write`; open them with [`open_with`] to get the ownership checks.
pub fn state_options(create: Create, extra_flags: i32) -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true)
        .write(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | extra_flags);
    match create {
        Create::Never => {}
        Create::IfMissing => {
            o.create(true);
        }
        Create::New => {
            o.create_new(true);
        }
    }
    o
}

/// Open the state file `path` read-write by the rules of the module docs:
/// no symbolic link followed, created `0600` per `create`, and refused
/// unless it is a regular file owned by the server's effective uid. The
/// error names `path`; a missing file keeps the kind `NotFound`.
pub fn open_state_file(path: &Path, create: Create) -> io::Result<File> {
    open_with(path, &state_options(create, 0))
}

/// Open `path` with `options` (from [`state_options`]), then check the
/// descriptor as [`open_state_file`] does.
pub fn open_with(path: &Path, options: &OpenOptions) -> io::Result<File> {
    let file = options.open(path).map_err(|e| refusal(path, e))?;
    check_owned_regular(&file, path)?;
    Ok(file)
}

/// The whole of the state file `path`, opened read-only with `O_NOFOLLOW |
/// O_NONBLOCK` and checked as [`open_state_file`] does (a missing file keeps
/// the kind `NotFound`).
pub fn read_state_file(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| refusal(path, e))?;
    check_owned_regular(&file, path)?;
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut file, &mut bytes).map_err(|e| named(path, e))?;
    Ok(bytes)
}

/// Create the temporary file `tmp` (to be renamed over a state file): a
/// leftover of an interrupted write (or a link planted there) is removed,
/// never followed, then the file is created new ([`Create::New`]). What is
/// at `tmp` and cannot be removed (a directory) is an error naming it.
pub fn create_temporary(tmp: &Path) -> io::Result<File> {
    match std::fs::remove_file(tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(named(tmp, e)),
    }
    open_state_file(tmp, Create::New)
}

/// Refuse (an error naming `path`) a descriptor that is not a regular file
/// or is owned by another uid than the server's effective one.
pub fn check_owned_regular(file: &File, path: &Path) -> io::Result<()> {
    let meta = file.metadata().map_err(|e| named(path, e))?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a regular file ({}); refusing to use it as a state file",
                path.display(),
                kind_of(&meta.file_type())
            ),
        ));
    }
    let me = euid();
    if meta.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is owned by uid {}, not by this server's uid {me}; refusing to use it",
                path.display(),
                meta.uid()
            ),
        ));
    }
    Ok(())
}

/// Create the data directory `dir` (and missing parents) `0700`, or check
/// an existing one: it must be a directory owned by the server's effective
/// uid (else an error naming it); group or other permissions are removed
/// with a warning (see the module docs for why tightened, not refused).
pub fn private_dir(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|e| named(dir, e))?;
    let meta = std::fs::metadata(dir).map_err(|e| named(dir, e))?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("data directory {} is not a directory", dir.display()),
        ));
    }
    let me = euid();
    if meta.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "data directory {} is owned by uid {}, not by this server's uid {me}; refusing to use it",
                dir.display(),
                meta.uid()
            ),
        ));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(DIR_MODE))
            .map_err(|e| named(dir, e))?;
        tracing::warn!(
            dir = %dir.display(),
            "data directory was mode {mode:04o}, readable by other users: tightened to 0700"
        );
    }
    Ok(())
}

/// `e` with `path` in its message, the kind kept.
fn named(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// An open's error, telling a symbolic link at the path (`ELOOP` from
/// `O_NOFOLLOW`, or `EEXIST` from `O_EXCL` on a link) from other failures.
fn refusal(path: &Path, e: io::Error) -> io::Error {
    let link = matches!(e.raw_os_error(), Some(libc::ELOOP | libc::EEXIST))
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if link {
        return io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is a symbolic link; refusing to follow it",
                path.display()
            ),
        );
    }
    named(path, e)
}

/// A file type in words, for refusals.
fn kind_of(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_char_device() {
        "a character device"
    } else {
        "not a regular file"
    }
}

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

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    #[test]
    fn a_created_state_file_is_0600_not_the_umask_default() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        // Under the usual umask 022 a plain create gives 0644; 0600 is
        // asked for, and a umask only ever removes bits.
        let f = open_state_file(&path, Create::New).unwrap();
        drop(f);
        assert_eq!(mode_of(&path), 0o600);
        let again = open_state_file(&path, Create::IfMissing).unwrap();
        drop(again);
        assert_eq!(mode_of(&path), 0o600);
    }

    #[test]
    fn a_new_state_file_refuses_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        std::fs::write(&path, b"old").unwrap();
        let err = open_state_file(&path, Create::New).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
    }

    #[test]
    fn a_symlink_at_a_state_path_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"precious").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &dangling).unwrap();
        for (path, create) in [
            (&link, Create::Never),
            (&link, Create::IfMissing),
            (&link, Create::New),
            (&dangling, Create::IfMissing),
            (&dangling, Create::New),
        ] {
            let err = open_state_file(path, create).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains(&*path.to_string_lossy())
                    && text.contains("is a symbolic link; refusing to follow it"),
                "{create:?}: {text}"
            );
        }
        let err = read_state_file(&link).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        assert_eq!(mode_of(&target), 0o644);
        assert!(
            !dir.path().join("nowhere").exists(),
            "nothing created through the link"
        );
    }

    #[test]
    fn a_state_file_owned_by_another_user_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state");
        std::fs::write(&path, b"theirs").unwrap();
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        for err in [
            open_state_file(&path, Create::IfMissing).unwrap_err(),
            read_state_file(&path).unwrap_err(),
        ] {
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
            let text = err.to_string();
            assert!(
                text.contains(&*path.to_string_lossy()) && text.contains("owned by uid 65534"),
                "{text}"
            );
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"theirs");
    }

    #[test]
    fn a_directory_or_fifo_at_a_state_path_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let err = read_state_file(&sub).unwrap_err();
        assert!(
            err.to_string().contains("not a regular file (a directory)"),
            "{err}"
        );
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path and a mode; no memory of ours kept.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Read-only, without O_NONBLOCK, this open would wait for a writer.
        let err = read_state_file(&fifo).unwrap_err();
        assert!(
            err.to_string().contains("not a regular file (a FIFO)"),
            "{err}"
        );
        let err = open_state_file(&fifo, Create::IfMissing).unwrap_err();
        assert!(err.to_string().contains(&*fifo.to_string_lossy()), "{err}");
    }

    #[test]
    fn a_missing_state_file_keeps_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing");
        assert_eq!(
            open_state_file(&path, Create::Never).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        assert_eq!(
            read_state_file(&path).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn private_dir_creates_0700_and_tightens_a_wide_one() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("a/b");
        private_dir(&data).unwrap();
        assert_eq!(mode_of(&data), 0o700);
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&data).unwrap();
        assert_eq!(mode_of(&data), 0o700);
    }

    #[test]
    fn private_dir_refuses_a_directory_of_another_user_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("theirs");
        std::fs::create_dir(&data).unwrap();
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&data, Some(65534), Some(65534)).unwrap();
        let err = private_dir(&data).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&*data.to_string_lossy()) && text.contains("owned by uid 65534"),
            "{text}"
        );
        assert_eq!(
            mode_of(&data),
            0o755,
            "another user's directory is left alone"
        );
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(private_dir(&file).is_err());
    }
}
