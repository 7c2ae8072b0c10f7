//! A client's socket and the listener it came from: TCP or a Unix stream
//! socket (its file bound by [`crate::sockfile`]), one type for the rest
//! of the host adapter, and the system calls the reply path needs that
//! `std` does not offer: a `sendmsg` that never blocks (`MSG_DONTWAIT`, per
//! call, so the connection's reading threads keep blocking reads on the
//! same socket), a bounded wait for room in the send buffer (`poll`), and
//! a general [`poll`] for the TLS layer's non-blocking sockets.

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use crate::config::Endpoint;
use crate::sockfile::SocketFile;

/// A client connection.
#[derive(Debug)]
pub enum Socket {
    /// Over TCP.
    Tcp(TcpStream),
    /// Over a Unix stream socket (a `unix:` listener, or the plaintext end
    /// of a TLS session).
    Unix(UnixStream),
}

impl Socket {
    /// Another handle on the same socket.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    /// Shut down one or both directions.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        }
    }

    /// Time limit of each blocking read (`None`: none).
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_read_timeout(t),
            Self::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// Time limit of each blocking write (`None`: none).
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_write_timeout(t),
            Self::Unix(s) => s.set_write_timeout(t),
        }
    }

    /// Non-blocking reads and writes on (`true`) or off (the TLS layer's
    /// socket, which waits with [`poll`] itself).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.set_nonblocking(on),
            Self::Unix(s) => s.set_nonblocking(on),
        }
    }

    /// The peer's address, for the per-peer cap: every Unix-socket client
    /// is one peer (`None`).
    pub fn peer_ip(&self) -> Option<IpAddr> {
        match self {
            Self::Tcp(s) => s.peer_addr().ok().map(|a| a.ip()),
            Self::Unix(_) => None,
        }
    }

    /// The peer, for log lines.
    pub fn peer_name(&self) -> String {
        match self {
            Self::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "?".to_owned(), |a| a.to_string()),
            Self::Unix(_) => "unix".to_owned(),
        }
    }

    /// Tune a freshly accepted socket: no Nagle delay (replies are
    /// batched already), and TCP keepalive after `keepalive` idle (zero:
    /// off) so a vanished peer is found.
    pub fn tune(&self, keepalive: Duration) {
        let Self::Tcp(s) = self else { return };
        let _ = s.set_nodelay(true);
        if keepalive.is_zero() {
            return;
        }
        let idle = libc::c_int::try_from(keepalive.as_secs().max(1)).unwrap_or(libc::c_int::MAX);
        for (level, opt, value) in [
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle),
            (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6),
        ] {
            // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from
            // `value`, a c_int on our stack, on a socket we own.
            let rc = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    level,
                    opt,
                    (&raw const value).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                tracing::debug!(error = %io::Error::last_os_error(), opt, "setting TCP keepalive failed");
            }
        }
    }

    /// Send as much of `slices` as the send buffer takes now, without
    /// blocking: the bytes sent (`Ok(0)` when the buffer is full).
    pub fn send_nonblocking(&self, slices: &[IoSlice<'_>]) -> io::Result<usize> {
        let iov_max = 1024;
        let n = slices.len().min(iov_max);
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec (std guarantees it on Unix);
        // sendmsg only reads the `n` iovecs and the bytes they describe,
        // all borrowed from `slices` for the call.
        msg.msg_iov = slices.as_ptr().cast_mut().cast();
        msg.msg_iovlen = n as _;
        loop {
            // SAFETY: `msg` points at `n` valid iovecs (see above); the fd
            // is this socket's, open for the duration of the call.
            let rc = unsafe {
                libc::sendmsg(
                    self.as_raw_fd(),
                    &raw const msg,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(e),
            }
        }
    }

    /// Wait up to `limit` for room in the send buffer: whether there is
    /// (false: the client read nothing for that long).
    pub fn wait_writable(&self, limit: Duration) -> io::Result<bool> {
        let mut pfd = [libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLOUT,
            revents: 0,
        }];
        // POLLERR/POLLHUP count as writable: the next send reports it.
        Ok(poll(&mut pfd, Some(limit))? > 0)
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Self::Tcp(s) => s.as_raw_fd(),
            Self::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl Read for &Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).read(buf),
            Socket::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).write(buf),
            Socket::Unix(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).write_vectored(bufs),
            Socket::Unix(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// Owned forms, for a stream that owns its socket (the TLS session).
impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Wait until one of `fds` is ready or `limit` passes (`None`: no
/// limit): how many are ready (0: the time ran out). A negative fd is
/// skipped, as poll(2) does; `EINTR` is retried with the whole limit.
pub fn poll(fds: &mut [libc::pollfd], limit: Option<Duration>) -> io::Result<usize> {
    let ms = limit.map_or(-1, |l| {
        // Round up: a wait of 0.4 ms must not become a busy poll(0).
        let ms = l.as_micros().div_ceil(1000);
        libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
    });
    loop {
        // SAFETY: poll reads and writes exactly `fds.len()` pollfds, all in
        // the slice we borrow mutably for the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A listening socket.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A Unix stream socket.
    Unix {
        /// The socket.
        listener: UnixListener,
        /// Its path.
        path: PathBuf,
        /// The socket file this listener bound, removed when it goes
        /// (`None`: inherited from systemd, which owns the file).
        bound: Option<SocketFile>,
    },
}

impl Listener {
    /// Bind `endpoint`; a Unix socket file gets `mode` and never more
    /// ([`crate::sockfile::bind_private`]): an existing path is replaced
    /// only when it is a socket no one answers on (a dead server's); a
    /// live socket or any other file is an error naming it.
    pub fn bind(endpoint: &Endpoint, mode: u32) -> io::Result<Self> {
        match endpoint {
            Endpoint::Tcp(a) => TcpListener::bind(a).map(Self::Tcp),
            Endpoint::Unix(path) => {
                let (listener, file) = crate::sockfile::bind_private(
                    path,
                    mode,
                    "NBD socket",
                    "choose another --listen unix:PATH",
                )?;
                Ok(Self::Unix {
                    listener,
                    path: path.clone(),
                    bound: Some(file),
                })
            }
        }
    }

    /// Where it listens.
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        Ok(match self {
            Self::Tcp(l) => Endpoint::Tcp(l.local_addr()?),
            Self::Unix { path, .. } => Endpoint::Unix(path.clone()),
        })
    }

    /// Accept the next client.
    pub fn accept(&self) -> io::Result<Socket> {
        match self {
            Self::Tcp(l) => l.accept().map(|(s, _)| Socket::Tcp(s)),
            Self::Unix { listener, .. } => listener.accept().map(|(s, _)| Socket::Unix(s)),
        }
    }

    /// Connect to it once (to wake a blocked accept at shutdown).
    pub fn poke(endpoint: &Endpoint) {
        match endpoint {
            Endpoint::Tcp(a) => {
                let _ = TcpStream::connect_timeout(&wake_addr(*a), Duration::from_secs(1));
            }
            Endpoint::Unix(p) => {
                let _ = UnixStream::connect(p);
            }
        }
    }

    /// Blocking accepts.
    pub fn set_blocking(&self) -> io::Result<()> {
        match self {
            Self::Tcp(l) => l.set_nonblocking(false),
            Self::Unix { listener, .. } => listener.set_nonblocking(false),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix {
            bound: Some(file), ..
        } = self
        {
            file.remove_if_ours();
        }
    }
}

/// The address to connect to for `a`: a wildcard bind is reached on
/// loopback.
fn wake_addr(a: SocketAddr) -> SocketAddr {
    let ip = match a.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::from([127, 0, 0, 1]),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, a.port())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_unix_listener_gets_its_mode_and_replaces_only_a_stale_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let e = Endpoint::Unix(path.clone());
        let l = Listener::bind(&e, 0o600).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // A live socket is not taken over.
        let err = Listener::bind(&e, 0o600).unwrap_err();
        assert!(err.to_string().contains("another server"), "{err}");
        drop(l);
        assert!(!path.exists(), "the listener removes its own socket");
        // A stale one (a dead server's: bound, closed, left behind) is.
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let l2 = Listener::bind(&e, 0o660).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o660);
        drop(l2);
        assert!(!path.exists());
    }

    #[test]
    fn a_regular_file_at_the_socket_path_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        std::fs::write(&path, b"keep me").unwrap();
        let err = Listener::bind(&Endpoint::Unix(path.clone()), 0o600).unwrap_err();
        assert!(err.to_string().contains("is a regular file"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
    }

    #[test]
    fn a_nonblocking_send_into_a_full_buffer_sends_nothing_and_poll_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let s = Socket::Unix(a);
        let chunk = vec![7u8; 1 << 16];
        let mut total = 0;
        loop {
            let n = s.send_nonblocking(&[IoSlice::new(&chunk)]).unwrap();
            if n == 0 {
                break;
            }
            total += n;
            assert!(total < 1 << 30, "the peer never reads: the buffer fills");
        }
        assert!(!s.wait_writable(Duration::from_millis(50)).unwrap());
    }
}
