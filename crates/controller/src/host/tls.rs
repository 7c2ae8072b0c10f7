//! NBD over TLS (proto.md "TLS support"): the server's credentials, the
//! TLS handshake after STARTTLS, and the per-connection *pump* that keeps
//! the transmission phase unaware of TLS.
//!
//! # Library
//!
//! OpenSSL 3, the system's, through the `openssl` crate: it has the
//! server-side TLS-PSK callbacks that psktool's key files need (rustls has
//! no external-PSK support), it is the distribution's library (security
//! fixes arrive with the OS, not with a rebuild of rebound), and it costs
//! no C compilation (`libssl-dev` and `pkg-config` at build time).
//!
//! # Credentials ([`TlsServer::load`], at start, before any client)
//!
//! - X.509 (`tls_certificates = DIR`, the file names qemu and nbdkit use):
//!   `server-cert.pem` (the certificate, then any chain), `server-key.pem`
//!   (refused unless its mode lets neither group nor others in, as ssh
//!   refuses a private key; and it must match the certificate);
//!   `ca-cert.pem`, read only with `tls_verify_peer`: clients must then
//!   present a certificate it signed.
//! - PSK (`tls_psk = FILE`, psktool's format, the same mode rule):
//!   `identity:hexkey` per line; TLS 1.3 with the key as an external PSK
//!   (OpenSSL's server callback; SHA-256 suites), or TLS 1.2 `PSK` suites.
//!
//! Every problem is an error naming the file (and the line of a PSK file).
//!
//! # Handshake
//!
//! After [`handshake::negotiate_tls`](crate::nbd::handshake::negotiate_tls)
//! acknowledged STARTTLS, [`TlsServer::accept`] runs the TLS server
//! handshake on the raw socket, non-blocking and waiting with `poll` for
//! no longer than the handshake's deadline (`handshake_timeout` covers the
//! whole negotiation, TLS included, however the client trickles its
//! bytes); option haggling then resumes over [`Secured`], the session
//! under the same deadline.
//!
//! # The pump (transmission over TLS)
//!
//! The transmission phase is written for a socket it shares between
//! threads (readers take turns, replies go out with `sendmsg`), which an
//! `SslStream` cannot be. So TLS ends in a pump: a `UnixStream::pair()`,
//! the connection served on one end as a [`Socket::Unix`], and one thread
//! per connection moving bytes between the other end and the TLS session
//! over the TCP socket. Both of its sockets are non-blocking and it waits
//! for either with one `poll`, so it holds the session alone (two blocking
//! threads would share the `SslStream` under a lock that a blocked
//! `SSL_read` would hold against the writer).
//!
//! ```text
//!   client ==TLS== TCP socket <-> [pump: down buf, up buf] <-> unix end ... unix end <-> connection
//! ```
//!
//! Invariants:
//! - Memory: each direction holds at most [`PUMP_BUFFER_BYTES`]; a full
//!   buffer stops reading that direction's source, so back-pressure
//!   reaches the client (TCP) and the connection (its send timeout) as
//!   without TLS.
//! - No deadlock: every pass tries every transfer that has data and room;
//!   it sleeps in `poll` only when each one is blocked, and on exactly
//!   what blocked it (`SSL_read` and `SSL_write` may each want either
//!   readiness); a retried `SSL_write` repeats the bytes of the one that
//!   blocked.
//! - Ending: the client closing (close_notify or EOF) shuts the
//!   connection's input after the bytes already received; the
//!   connection closing (its end of the pair) sends what it wrote, then
//!   close_notify, and the pump leaves. Once the connection has hung up
//!   (seen even while a full buffer keeps the pump from reading it: a
//!   client that takes no replies is cut by the connection's
//!   `send_timeout`), the client gets `send_timeout` without progress
//!   before the pump gives up, so no pump outlives its connection by more
//!   than that. A TLS error ends both sides and is logged with the peer.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use openssl::error::ErrorStack;
use openssl::pkey::PKey;
use openssl::ssl::{
    self, ErrorCode, Ssl, SslAcceptor, SslContext, SslMethod, SslMode, SslOptions, SslStream,
    SslVerifyMode,
};
use openssl::x509::{X509, X509Name};

use crate::config::{Config, TlsMode};
use crate::host::socket::{self, Socket};

/// Bytes the pump holds per direction.
pub const PUMP_BUFFER_BYTES: usize = 256 * 1024;
/// Longest PSK identity accepted (OpenSSL's `PSK_MAX_IDENTITY_LEN`).
const PSK_IDENTITY_MAX_BYTES: usize = 256;
/// Longest pre-shared key accepted (OpenSSL's limit is 512).
const PSK_KEY_MAX_BYTES: usize = 256;

/// Why the TLS credentials cannot be used (the server does not start).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// A file could not be read.
    #[error("{setting}: cannot read {}: {error}", path.display())]
    Read {
        /// The setting naming it.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// Why (in the message, not a source: chains would repeat it).
        error: io::Error,
    },
    /// A secret that group or others may read.
    #[error(
        "{setting}: {} has mode {mode:04o}, so group or others may access it; a private key must be readable only by its owner (chmod 600 {})",
        path.display(),
        path.display()
    )]
    TooOpen {
        /// The setting naming it.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A file's content is wrong.
    #[error("{setting}: {}: {message}", path.display())]
    Bad {
        /// The setting naming it.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong (with the line, for a PSK file).
        message: String,
    },
    /// OpenSSL refused a setting.
    #[error("setting up TLS: {0}")]
    Openssl(ErrorStack),
}

// Not `#[from]`: that would make the stack the error's source too, and
// error chains would print it twice.
impl From<ErrorStack> for TlsSetupError {
    fn from(e: ErrorStack) -> Self {
        Self::Openssl(e)
    }
}

/// The keys of a PSK file: identity to key.
#[derive(Clone, PartialEq, Eq)]
pub struct PskTable(HashMap<Vec<u8>, Vec<u8>>);

impl std::fmt::Debug for PskTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("PskTable")
            .field("identities", &self.0.len())
            .finish()
    }
}

impl PskTable {
    /// Parse psktool's format: one `identity:hexkey` per line (blank lines
    /// are skipped); an error says what is wrong and on which line (from 1).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line_no = n + 1;
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let (identity, hex) = line
                .rsplit_once(':')
                .ok_or_else(|| format!("line {line_no}: expected identity:hexkey"))?;
            if identity.is_empty() || identity.len() > PSK_IDENTITY_MAX_BYTES {
                return Err(format!(
                    "line {line_no}: the identity must be 1 to {PSK_IDENTITY_MAX_BYTES} bytes"
                ));
            }
            let key = decode_hex(hex.trim()).ok_or_else(|| {
                format!("line {line_no}: the key is not an even number of hexadecimal digits")
            })?;
            if key.is_empty() || key.len() > PSK_KEY_MAX_BYTES {
                return Err(format!(
                    "line {line_no}: the key must be 1 to {PSK_KEY_MAX_BYTES} bytes"
                ));
            }
            if keys.insert(identity.as_bytes().to_vec(), key).is_some() {
                return Err(format!(
                    "line {line_no}: identity {identity:?} appears twice"
                ));
            }
        }
        if keys.is_empty() {
            return Err("no keys (expected identity:hexkey lines, as psktool writes)".to_owned());
        }
        Ok(Self(keys))
    }

    /// The key of `identity`.
    pub fn key(&self, identity: &[u8]) -> Option<&[u8]> {
        self.0.get(identity).map(Vec::as_slice)
    }

    /// How many identities.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Read a secret file (a private key, a PSK file): refused when group or
/// others have any access to it, as ssh refuses a private key.
fn read_secret(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsSetupError> {
    let read_err = |error| TlsSetupError::Read {
        setting,
        path: path.to_owned(),
        error,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(TlsSetupError::Bad {
            setting,
            path: path.to_owned(),
            message: "not a regular file".to_owned(),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(TlsSetupError::TooOpen {
            setting,
            path: path.to_owned(),
            mode,
        });
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(read_err)?;
    Ok(bytes)
}

fn read_public(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsSetupError> {
    std::fs::read(path).map_err(|error| TlsSetupError::Read {
        setting,
        path: path.to_owned(),
        error,
    })
}

fn bad(setting: &'static str, path: &Path, message: impl Into<String>) -> TlsSetupError {
    TlsSetupError::Bad {
        setting,
        path: path.to_owned(),
        message: message.into(),
    }
}

/// The server side of TLS: the mode and a context with the credentials.
pub struct TlsServer {
    mode: TlsMode,
    ctx: SslContext,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl TlsServer {
    /// Load and check the credentials `config` names: `None` when TLS is
    /// off. Run at start, so that a bad file stops the server there.
    pub fn load(config: &Config) -> Result<Option<Arc<Self>>, TlsSetupError> {
        if config.tls == TlsMode::Off {
            return Ok(None);
        }
        let mut b = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())?;
        // - The server's order of suites wins, so TLS 1.3 picks
        //   TLS_AES_128_GCM_SHA256 (first in the list) when the client
        //   offers it: an external PSK from OpenSSL's server callback is
        //   bound to SHA-256, and in a client's own order (GnuTLS prefers
        //   AES-256-GCM-SHA384) the key would be skipped for the
        //   certificate, failing a PSK-only client.
        // - A clean close (close_notify) is not required of the client:
        //   GnuTLS clients often just close.
        // - No renegotiation (TLS 1.2): nothing needs it.
        b.set_options(
            SslOptions::IGNORE_UNEXPECTED_EOF
                | SslOptions::NO_RENEGOTIATION
                | SslOptions::CIPHER_SERVER_PREFERENCE,
        );
        // The pump retries a blocked write from its buffer, which may
        // have moved (compacted) since, and takes partial writes.
        b.set_mode(SslMode::ACCEPT_MOVING_WRITE_BUFFER | SslMode::ENABLE_PARTIAL_WRITE);
        // Sessions resumed under client-certificate checks need an id.
        b.set_session_id_context(b"rebound-nbd")?;
        if let Some(dir) = &config.tls_certificates {
            load_x509(&mut b, dir, config.tls_verify_peer)?;
        }
        if let Some(path) = &config.tls_psk {
            let text = read_secret("tls_psk", path)?;
            let text =
                String::from_utf8(text).map_err(|_| bad("tls_psk", path, "not UTF-8 text"))?;
            let table = PskTable::parse(&text).map_err(|m| bad("tls_psk", path, m))?;
            // TLS 1.2 PSK suites besides the certificate ones; TLS 1.3
            // takes the key through the same callback.
            b.set_cipher_list(&format!(
                "{}:ECDHE-PSK-AES128-CBC-SHA256:ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES128-GCM-SHA256:DHE-PSK-AES256-GCM-SHA384:PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384",
                MOZILLA_INTERMEDIATE_CIPHERS
            ))?;
            b.set_psk_server_callback(move |_ssl, identity, out| {
                let key = identity.and_then(|i| table.key(i));
                Ok(match key {
                    Some(k) if k.len() <= out.len() => {
                        out[..k.len()].copy_from_slice(k);
                        k.len()
                    }
                    // Unknown: 0 fails the PSK (or falls back to a
                    // certificate, where there is one).
                    _ => 0,
                })
            });
        }
        Ok(Some(Arc::new(Self {
            mode: config.tls,
            ctx: b.build().into_context(),
        })))
    }

    /// The mode the handshake runs under.
    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// Run the TLS server handshake on `socket` (after STARTTLS's ACK),
    /// finished by `until`. The socket is left non-blocking.
    pub fn accept(&self, socket: Socket, until: Instant) -> io::Result<SslStream<Socket>> {
        socket.set_nonblocking(true)?;
        let ssl = Ssl::new(&self.ctx).map_err(io::Error::other)?;
        let mut attempt = ssl.accept(socket);
        loop {
            match attempt {
                Ok(stream) => return Ok(stream),
                Err(ssl::HandshakeError::WouldBlock(mid)) => {
                    wait_for(mid.get_ref().as_raw_fd(), mid.error().code(), until)?;
                    attempt = mid.handshake();
                }
                Err(ssl::HandshakeError::Failure(mid)) => {
                    let verify = mid.ssl().verify_result();
                    let why = if verify.as_raw() == 0 {
                        mid.error().to_string()
                    } else {
                        format!(
                            "{} (client certificate: {})",
                            mid.error(),
                            verify.error_string()
                        )
                    };
                    return Err(io::Error::new(io::ErrorKind::InvalidData, why));
                }
                Err(ssl::HandshakeError::SetupFailure(e)) => return Err(io::Error::other(e)),
            }
        }
    }
}

/// `mozilla_intermediate_v5`'s TLS 1.2 suites (the PSK ones are added to them).
const MOZILLA_INTERMEDIATE_CIPHERS: &str = "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305:DHE-RSA-AES128-GCM-SHA256:DHE-RSA-AES256-GCM-SHA384";

/// The certificate, its key, and with `verify_peer` the CA clients'
/// certificates must be signed by.
fn load_x509(
    b: &mut ssl::SslAcceptorBuilder,
    dir: &Path,
    verify_peer: bool,
) -> Result<(), TlsSetupError> {
    const SETTING: &str = "tls_certificates";
    let cert_path = dir.join("server-cert.pem");
    let key_path = dir.join("server-key.pem");
    let certs = X509::stack_from_pem(&read_public(SETTING, &cert_path)?)
        .map_err(|e| bad(SETTING, &cert_path, format!("not a PEM certificate: {e}")))?;
    let mut certs = certs.into_iter();
    let leaf = certs
        .next()
        .ok_or_else(|| bad(SETTING, &cert_path, "holds no certificate"))?;
    b.set_certificate(&leaf)?;
    for extra in certs {
        b.add_extra_chain_cert(extra)?;
    }
    let key = PKey::private_key_from_pem(&read_secret(SETTING, &key_path)?)
        .map_err(|e| bad(SETTING, &key_path, format!("not a PEM private key: {e}")))?;
    // OpenSSL compares the key with the certificate as it takes it.
    b.set_private_key(&key)
        .and_then(|()| b.check_private_key())
        .map_err(|_| {
            bad(
                SETTING,
                &key_path,
                format!("does not match the certificate in {}", cert_path.display()),
            )
        })?;
    if verify_peer {
        let ca_path = dir.join("ca-cert.pem");
        let cas = X509::stack_from_pem(&read_public(SETTING, &ca_path)?)
            .map_err(|e| bad(SETTING, &ca_path, format!("not a PEM certificate: {e}")))?;
        if cas.is_empty() {
            return Err(bad(SETTING, &ca_path, "holds no certificate"));
        }
        for ca in cas {
            b.cert_store_mut().add_cert(ca)?;
        }
        b.set_client_ca_list(X509Name::load_client_ca_file(&ca_path)?);
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(())
}

/// Wait until `fd` is ready for what OpenSSL asked (`WANT_READ` or
/// `WANT_WRITE`), at the latest by `until` (then `TimedOut`).
fn wait_for(fd: i32, want: ErrorCode, until: Instant) -> io::Result<()> {
    let events = if want == ErrorCode::WANT_WRITE {
        libc::POLLOUT
    } else if want == ErrorCode::WANT_READ {
        libc::POLLIN
    } else {
        return Err(io::Error::other(format!("unexpected TLS state {want:?}")));
    };
    let left = super::connection::time_left(until)?;
    let mut pfd = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    if socket::poll(&mut pfd, Some(left))? == 0 {
        return Err(super::connection::handshake_timed_out());
    }
    Ok(())
}

/// The peer closed the TCP connection without ending the session
/// (`SSL_ERROR_SYSCALL` with no OS error): an end of file, as OpenSSL's
/// own `Read` takes it.
fn is_bare_eof(e: &ssl::Error) -> bool {
    e.code() == ErrorCode::SYSCALL && e.io_error().is_none()
}

/// An `ssl::Error` as the `io::Error` it carries, or one describing it.
fn io_error(e: ssl::Error) -> io::Error {
    if is_bare_eof(&e) {
        return io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the client closed the connection without ending the TLS session",
        );
    }
    e.into_io_error()
        .unwrap_or_else(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// The TLS session during the rest of the negotiation: blocking reads and
/// writes that give up at the handshake's deadline.
pub struct Secured<'a> {
    ssl: &'a mut SslStream<Socket>,
    until: Instant,
}

impl<'a> Secured<'a> {
    /// `ssl` until `until`.
    pub fn new(ssl: &'a mut SslStream<Socket>, until: Instant) -> Self {
        Self { ssl, until }
    }
}

impl std::fmt::Debug for Secured<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secured")
            .field("until", &self.until)
            .finish()
    }
}

impl Read for Secured<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.ssl.ssl_read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => return Ok(0),
                Err(e) if matches!(e.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE) => {
                    wait_for(self.ssl.get_ref().as_raw_fd(), e.code(), self.until)?;
                }
                Err(e) => return Err(io_error(e)),
            }
        }
    }
}

impl Write for Secured<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            match self.ssl.ssl_write(buf) {
                Ok(n) => return Ok(n),
                Err(e) if matches!(e.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE) => {
                    wait_for(self.ssl.get_ref().as_raw_fd(), e.code(), self.until)?;
                }
                Err(e) => return Err(io_error(e)),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A bounded byte queue: bytes are appended at `end` and taken from `start`.
struct Buf {
    data: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Buf {
    fn new(capacity: usize) -> Self {
        Self {
            data: vec![0u8; capacity].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    fn is_full(&self) -> bool {
        self.end - self.start == self.data.len()
    }

    fn filled(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    /// Room to append into, moving the bytes to the front when the tail
    /// has none.
    fn space(&mut self) -> &mut [u8] {
        if self.is_empty() {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.data.len() && self.start > 0 {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.data[self.end..]
    }

    fn appended(&mut self, n: usize) {
        assert!(self.end + n <= self.data.len(), "appended past the buffer");
        self.end += n;
    }

    fn taken(&mut self, n: usize) {
        assert!(
            self.start + n <= self.end,
            "took more than the buffer holds"
        );
        self.start += n;
    }
}

/// A connection's TLS pump thread.
#[derive(Debug)]
pub struct Pump {
    thread: JoinHandle<()>,
}

impl Pump {
    /// Serve the session `ssl` (its socket non-blocking) through a socket
    /// pair: the end the connection is served on, and the pump's thread.
    /// `linger`: how long the client gets to take the last replies once
    /// the connection closed.
    pub fn start(
        ssl: SslStream<Socket>,
        peer: String,
        id: u64,
        linger: Duration,
    ) -> io::Result<(Socket, Self)> {
        let (served, ours) = UnixStream::pair()?;
        ours.set_nonblocking(true)?;
        ssl.get_ref().set_nonblocking(true)?;
        let mut state = PumpState {
            ssl,
            plain: ours,
            down: Buf::new(PUMP_BUFFER_BYTES),
            up: Buf::new(PUMP_BUFFER_BYTES),
            write_retry: 0,
            client_done: false,
            server_done: false,
            input_shut: false,
            plain_hup: false,
            tls_events: 0,
            plain_events: 0,
        };
        let thread = std::thread::Builder::new()
            .name(format!("nbd-tls-{id}"))
            .spawn(move || match state.run(linger) {
                Ok(()) => tracing::debug!(conn = id, %peer, "TLS session ended"),
                Err(e) if is_hang_up(&e) => {
                    tracing::debug!(conn = id, %peer, error = %e, "the client left the TLS session");
                }
                Err(e) => {
                    tracing::warn!(conn = id, %peer, error = %e, "TLS session failed; connection closed");
                }
            })?;
        Ok((Socket::Unix(served), Self { thread }))
    }

    /// Wait for the pump to finish (the connection closed its end).
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

/// A client that went away (not a TLS error worth a warning).
fn is_hang_up(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
    )
}

/// The pump's state: the session, the pair's end, the two buffers.
struct PumpState {
    ssl: SslStream<Socket>,
    /// The pump's end of the pair.
    plain: UnixStream,
    /// Client to connection: decrypted, not yet passed on.
    down: Buf,
    /// Connection to client: not yet encrypted and sent.
    up: Buf,
    /// Bytes of an `SSL_write` that blocked, to repeat (0: none).
    write_retry: usize,
    /// The client closed its side of the session.
    client_done: bool,
    /// The connection closed its end of the pair.
    server_done: bool,
    /// The connection's input is shut (the client's bytes all passed on).
    input_shut: bool,
    /// poll saw the connection hang up (its end may still hold replies).
    plain_hup: bool,
    /// What the TLS socket and the pair's end wait for this pass.
    tls_events: i16,
    plain_events: i16,
}

impl PumpState {
    /// Move bytes until both sides are done.
    fn run(&mut self, linger: Duration) -> io::Result<()> {
        loop {
            self.tls_events = 0;
            self.plain_events = 0;
            let mut moved = self.tls_to_down()?;
            moved |= self.down_to_plain()?;
            moved |= self.plain_to_up()?;
            moved |= self.up_to_tls()?;
            if self.client_done && self.down.is_empty() && !self.input_shut {
                // The connection reads its end of input after the last bytes.
                let _ = self.plain.shutdown(Shutdown::Write);
                self.input_shut = true;
            }
            if self.server_done && self.up.is_empty() {
                self.close_session();
                return Ok(());
            }
            if moved {
                continue;
            }
            self.wait(linger)?;
        }
    }

    /// Sleep until what blocked is ready. Hang-ups are watched on both
    /// sockets even when nothing is asked of them (a full buffer stops
    /// reading its source): the connection hanging up (it cut a client
    /// that takes no replies) starts the `linger` clock, after which a
    /// pass that moves nothing ends the pump; the client's socket failing
    /// ends it at once. A socket already known to have hung up is left out
    /// unless waited on: poll reports a hang-up whether asked or not, which
    /// would spin.
    fn wait(&mut self, linger: Duration) -> io::Result<()> {
        let watch_plain = !self.server_done && (self.plain_events != 0 || !self.plain_hup);
        let mut fds = [
            libc::pollfd {
                fd: self.ssl.get_ref().as_raw_fd(),
                events: self.tls_events,
                revents: 0,
            },
            libc::pollfd {
                fd: if watch_plain {
                    self.plain.as_raw_fd()
                } else {
                    -1
                },
                events: self.plain_events,
                revents: 0,
            },
        ];
        let limit = (self.server_done || self.plain_hup).then_some(linger);
        if socket::poll(&mut fds, limit)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no reply for send_timeout after the connection closed",
            ));
        }
        let hung_up = |revents: i16| revents & (libc::POLLHUP | libc::POLLERR) != 0;
        if hung_up(fds[1].revents) {
            self.plain_hup = true;
        }
        if self.tls_events == 0 && hung_up(fds[0].revents) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "the client's connection failed",
            ));
        }
        Ok(())
    }

    /// Note what an `SSL_read` or `SSL_write` that could not go on waits for.
    fn tls_blocked(&mut self, e: &ssl::Error) -> bool {
        match e.code() {
            ErrorCode::WANT_READ => self.tls_events |= libc::POLLIN,
            ErrorCode::WANT_WRITE => self.tls_events |= libc::POLLOUT,
            _ => return false,
        }
        true
    }

    /// Decrypt the client's bytes into `down` while it has room.
    fn tls_to_down(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while !self.client_done && !self.down.is_full() {
            match self.ssl.ssl_read(self.down.space()) {
                Ok(n) => {
                    self.down.appended(n);
                    moved = true;
                }
                Err(e) if e.code() == ErrorCode::ZERO_RETURN || is_bare_eof(&e) => {
                    self.client_done = true;
                    moved = true;
                }
                Err(e) if self.tls_blocked(&e) => break,
                Err(e) => return Err(io_error(e)),
            }
        }
        Ok(moved)
    }

    /// Pass `down` to the connection.
    fn down_to_plain(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while !self.down.is_empty() && !self.server_done {
            match (&self.plain).write(self.down.filled()) {
                Ok(n) => {
                    self.down.taken(n);
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.plain_events |= libc::POLLOUT;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The connection is gone: what the client sent is moot.
                Err(_) => {
                    self.server_done = true;
                    moved = true;
                }
            }
        }
        Ok(moved)
    }

    /// Take the connection's replies into `up` while it has room.
    fn plain_to_up(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while !self.server_done && !self.up.is_full() {
            match (&self.plain).read(self.up.space()) {
                Ok(0) => {
                    self.server_done = true;
                    moved = true;
                }
                Ok(n) => {
                    self.up.appended(n);
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.plain_events |= libc::POLLIN;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.server_done = true;
                    moved = true;
                }
            }
        }
        Ok(moved)
    }

    /// Encrypt `up` to the client; a blocked write is repeated with the
    /// same bytes.
    fn up_to_tls(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while !self.up.is_empty() {
            let len = match self.write_retry {
                0 => self.up.filled().len(),
                n => n,
            };
            match self.ssl.ssl_write(&self.up.filled()[..len]) {
                Ok(n) => {
                    self.up.taken(n);
                    self.write_retry = 0;
                    moved = true;
                }
                Err(e) if self.tls_blocked(&e) => {
                    self.write_retry = len;
                    break;
                }
                Err(e) => return Err(io_error(e)),
            }
        }
        Ok(moved)
    }

    /// Tell the client the session ends (close_notify), without waiting
    /// for its answer.
    fn close_session(&mut self) {
        let _ = self.ssl.shutdown();
        let _ = self.ssl.get_ref().shutdown(Shutdown::Write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_in_psktool_format_parse_to_identities_and_keys() {
        let t = PskTable::parse("alice:00ff10\n\nbob:DEADbeef\r\n").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.key(b"alice"), Some(&[0x00, 0xff, 0x10][..]));
        assert_eq!(t.key(b"bob"), Some(&[0xde, 0xad, 0xbe, 0xef][..]));
        assert_eq!(t.key(b"carol"), None);
        // An identity may hold ':' (the key is after the last one).
        let t = PskTable::parse("user:host:0102").unwrap();
        assert_eq!(t.key(b"user:host"), Some(&[1, 2][..]));
        assert!(!format!("{t:?}").contains("0102"), "Debug never shows keys");
    }

    #[test]
    fn bad_psk_lines_are_refused_with_their_line_number() {
        for (text, want) in [
            ("alice:00\nbob\n", "line 2: expected identity:hexkey"),
            ("alice:0g\n", "line 1: the key is not"),
            ("alice:123\n", "line 1: the key is not"),
            (":0011\n", "line 1: the identity"),
            ("alice:\n", "line 1: the key must be"),
            ("a:00\n\na:11\n", "line 3: identity \"a\" appears twice"),
            ("\n\n", "no keys"),
        ] {
            let err = PskTable::parse(text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let long = format!("alice:{}", "ab".repeat(PSK_KEY_MAX_BYTES + 1));
        assert!(PskTable::parse(&long).unwrap_err().contains("line 1"));
    }

    #[test]
    fn a_secret_readable_by_others_is_refused_naming_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.psk");
        std::fs::write(&path, "alice:00\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_secret("tls_psk", &path).unwrap_err().to_string();
        assert!(
            err.contains("keys.psk") && err.contains("0644") && err.contains("chmod 600"),
            "{err}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_secret("tls_psk", &path).unwrap(), b"alice:00\n");
        let err = read_secret("tls_psk", &dir.path().join("nope")).unwrap_err();
        assert!(err.to_string().contains("cannot read"), "{err}");
    }

    #[test]
    fn the_buffer_is_bounded_and_keeps_order_across_compaction() {
        let mut b = Buf::new(8);
        b.space()[..6].copy_from_slice(b"abcdef");
        b.appended(6);
        b.taken(4);
        assert_eq!(b.filled(), b"ef");
        // The tail has 2 bytes of room; more room comes from moving "ef".
        assert_eq!(b.space().len(), 2);
        b.appended(0);
        let room = b.space();
        assert_eq!(room.len(), 2);
        room.copy_from_slice(b"gh");
        b.appended(2);
        assert!(!b.is_full());
        let room = b.space();
        assert_eq!(room.len(), 4, "compacted to the front");
        room.copy_from_slice(b"ijkl");
        b.appended(4);
        assert!(b.is_full());
        assert_eq!(b.filled(), b"efghijkl");
    }
}
