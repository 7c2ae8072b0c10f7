//! The server's Unix socket files and their peers: who may bind them,
//! replace them, remove them and talk to them. Two sockets use it: the
//! admin socket (`control::admin`), which can crash the server (`inject
//! crash`) and damage cached data on purpose (`inject corrupt-record`), so
//! it is as private as the state files; and a `unix:` NBD listener
//! (`host::socket`), which serves the whole volume.
//!
//! - [`bind_private`] binds the socket with its mode (`0600` for the admin
//!   socket, `socket_mode` for NBD) and never wider,
//!   not even for an instant: it binds inside a fresh `0700` directory
//!   beside the target (nobody else can reach a socket in there), sets the
//!   mode, then renames it into place with `RENAME_NOREPLACE`, so a file
//!   that appeared at the path meanwhile is never replaced. (A umask
//!   around `bind` would do it too, but the umask is per process and
//!   would race with files other threads create.)
//! - What is already at the path is replaced only when it is a stale
//!   socket: a Unix socket that nobody answers (`connect` fails with
//!   `ECONNREFUSED`, the socket of a server that died). A socket that
//!   answers is another server's ("another server is using PATH"); a
//!   regular file, a directory, a symbolic link or anything else is an
//!   error naming it, and is never deleted.
//! - [`stop_accepting`] wakes a thread blocked in `accept` (shutdown(2)),
//!   so an accept loop needs no polling to notice it should end.
//! - [`peer_uid`] reads the uid of a connected client (`SO_PEERCRED`);
//!   [`may_use`] allows the server's own effective uid and root only. The
//!   mode already keeps others from connecting; the check also holds when
//!   the mode is widened by hand or the socket is passed on.
//! - [`SocketFile::remove_if_ours`] removes the path only while it is
//!   still the socket this server bound (same device and inode), never a
//!   socket a later server bound at the same path.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The mode of the admin socket.
pub const ADMIN_SOCKET_MODE: u32 = 0o600;

/// The socket file this server bound: its path and identity.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Remove the path if it is still the socket we bound (same device and
    /// inode); anything else there is left alone.
    pub fn remove_if_ours(&self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && m.dev() == self.dev && m.ino() == self.ino);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Listen at `path` with `mode` (see the module docs): a stale socket
/// there is replaced; a live one, or anything that is not a socket, is an
/// error naming the path. `what` names the socket in messages ("admin
/// socket", with `hint` telling how to choose another path).
pub fn bind_private(
    path: &Path,
    mode: u32,
    what: &str,
    hint: &str,
) -> io::Result<(UnixListener, SocketFile)> {
    clear_stale(path, what, hint)?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} path {} has no file name", path.display()),
        )
    })?;
    let staging = Staging::new(&parent)?;
    let inner = staging.0.join(name);
    let listener = UnixListener::bind(&inner).map_err(|e| named(path, "cannot bind", e))?;
    std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(mode))?;
    rename_noreplace(&inner, path).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists {
            io::Error::new(
                e.kind(),
                format!(
                    "{} appeared while binding the {what}; not replacing it",
                    path.display()
                ),
            )
        } else {
            named(path, &format!("cannot move the {what} to"), e)
        }
    })?;
    let meta = std::fs::symlink_metadata(path)?;
    Ok((
        listener,
        SocketFile {
            path: path.to_owned(),
            dev: meta.dev(),
            ino: meta.ino(),
        },
    ))
}

/// A fresh `0700` directory to bind in, removed (with what is left in it)
/// when dropped.
struct Staging(PathBuf);

impl Staging {
    fn new(parent: &Path) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = parent.join(format!(".rebound-sock-{}-{nanos}", std::process::id()));
        // Not recursive: an existing entry of that name is an error, never
        // a directory someone else prepared.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| named(&dir, "cannot make the private directory", e))?;
        Ok(Self(dir))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Remove a stale socket at `path`; refuse a live one or a non-socket.
fn clear_stale(path: &Path, what_socket: &str, hint: &str) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(named(path, "cannot inspect", e)),
    };
    let t = meta.file_type();
    if !t.is_socket() {
        let what = if t.is_symlink() {
            "a symbolic link"
        } else if t.is_dir() {
            "a directory"
        } else if t.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is {what}, not a stale {what_socket}; refusing to replace it (remove it, or {hint})",
                path.display()
            ),
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("another server is using {}", path.display()),
        )),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            tracing::info!(path = %path.display(), "replacing the stale {what_socket} of a server that is gone");
            std::fs::remove_file(path).map_err(|e| named(path, "cannot remove the stale socket", e))
        }
        Err(e) => Err(named(path, "cannot tell whether a server answers on", e)),
    }
}

/// `rename(from, to)` failing with `AlreadyExists` if `to` exists.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: two NUL-terminated paths that outlive the call; renameat2
    // keeps no pointer to them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The uid of the process at the other end of `stream` (`SO_PEERCRED`).
pub fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes passed; the
    // kernel writes at most `len` bytes into `cred`; the descriptor is
    // owned by `stream` for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    debug_assert_eq!(len as usize, std::mem::size_of::<libc::ucred>());
    Ok(cred.uid)
}

/// Wake every thread blocked in `accept` on `listener`, now and later: on
/// Linux, shutdown(2) of a listening socket makes its accepts fail with
/// `EINVAL`. How a server stops a blocking accept loop without polling.
pub fn stop_accepting(listener: &UnixListener) {
    // SAFETY: the descriptor is owned by `listener`, alive for the call;
    // shutdown(2) changes the socket's state only and does not close or
    // reuse the descriptor.
    let _ = unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
}

/// Whether a client of uid `uid` may use the admin socket: the server's
/// own effective uid, or root.
pub fn may_use(uid: u32) -> bool {
    uid == 0 || uid == crate::files::euid()
}

fn named(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    }

    #[test]
    fn a_bound_socket_is_0600_and_leaves_no_staging_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.sock");
        let (_listener, file) = bind_private(
            &path,
            ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )
        .unwrap();
        assert_eq!(mode_of(&path), ADMIN_SOCKET_MODE);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "only the socket: {left:?}");
        UnixStream::connect(&path).expect("the socket answers where it was put");
        file.remove_if_ours();
        assert!(!path.exists());
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists(), "a listener's drop leaves its file: stale");
        let (live, _file) = bind_private(
            &path,
            ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )
        .unwrap();
        let err = bind_private(
            &path,
            ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert_eq!(
            err.to_string(),
            format!("another server is using {}", path.display())
        );
        drop(live);
    }

    #[test]
    fn a_file_directory_or_link_at_the_socket_path_is_kept_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"keep me").unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        for (path, what) in [
            (&file, "a regular file"),
            (&sub, "a directory"),
            (&link, "a symbolic link"),
        ] {
            let err = bind_private(
                path,
                ADMIN_SOCKET_MODE,
                "admin socket",
                "choose another --admin path",
            )
            .unwrap_err()
            .to_string();
            assert!(
                err.contains(&*path.to_string_lossy()) && err.contains(what),
                "{err}"
            );
            assert!(std::fs::symlink_metadata(path).is_ok(), "{path:?} kept");
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    }

    #[test]
    fn remove_if_ours_leaves_a_socket_bound_by_someone_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.sock");
        let (first, file) = bind_private(
            &path,
            ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )
        .unwrap();
        // Another server took the path over after ours was moved away
        // (kept, so that its inode number is not reused at once).
        drop(first);
        std::fs::rename(&path, dir.path().join("moved.sock")).unwrap();
        let (_second, _) = bind_private(
            &path,
            ADMIN_SOCKET_MODE,
            "admin socket",
            "choose another --admin path",
        )
        .unwrap();
        file.remove_if_ours();
        assert!(path.exists(), "the newer server's socket stays");
    }

    #[test]
    fn peer_uid_is_our_own_uid_and_may_use_allows_it_and_root_only() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(peer_uid(&a).unwrap(), crate::files::euid());
        assert!(may_use(crate::files::euid()));
        assert!(may_use(0));
        assert!(!may_use(65534) || crate::files::euid() == 65534);
    }
}
