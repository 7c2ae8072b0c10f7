//! Opening the box's file so that no other local user can read or plant
//! it (the controller's `files` module has the same rules; this crate keeps
//! its own small copy so that it depends on no other workspace crate).
//!
//! What [`open_private`] guarantees:
//! - the file is opened with `O_NOFOLLOW`: a symbolic link at the path is
//!   refused with an error naming it ("is a symbolic link; refusing to
//!   follow it"), and its target is never opened, created or truncated;
//! - a created file has mode `0600`, whatever the umask;
//! - `O_TRUNC` is never used: the caller shortens the file only after
//!   the checks passed;
//! - the descriptor is `fstat`ed after the open: anything but a regular
//!   file, or a file owned by another uid than the process's effective
//!   uid, is refused with an error naming the path and the reason.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// Mode of a box file this crate creates.
pub const FILE_MODE: u32 = 0o600;

/// Open `path` read-write (created `0600` when `create` and missing) by
/// the rules of the module docs.
pub(crate) fn open_private(path: &Path, create: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| refusal(path, e))?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is not a regular file; refusing to use it",
                path.display()
            ),
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is owned by uid {}, not by this process's uid {me}; refusing to use it",
                path.display(),
                meta.uid()
            ),
        ));
    }
    Ok(file)
}

/// A symbolic link at `path` (`ELOOP` from `O_NOFOLLOW`) said in words.
fn refusal(path: &Path, e: io::Error) -> io::Error {
    let link = e.raw_os_error() == Some(libc::ELOOP)
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if link {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is a symbolic link; refusing to follow it",
                path.display()
            ),
        )
    } else {
        e
    }
}
