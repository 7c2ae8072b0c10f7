//! Files the controller creates for its state (device files, the NVS):
//! giving them their full size up front, so that a full file system is
//! found at start-up and not by a write after a reply was sent.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;

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
