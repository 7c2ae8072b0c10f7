//! Who may talk to a storage node, where a node may send data, and how much
//! one put may bring in.
//!
//! A node serves its whole store (read, write, run fragments) to whoever
//! reaches its port, and its checkpoint, scatter and rebuild actions open
//! connections to addresses named in the request. Three limits keep that
//! to the cluster:
//!
//! - **The cluster token** ([`Token`]): one shared secret, read from a file
//!   that only its owner may read (mode 0600 or stricter, owned by the
//!   user running the node or host). Every Flight call carries it as
//!   `authorization: Bearer <token>` (the client's [`BearerToken`]); the
//!   node's [`TokenCheck`] interceptor compares it in constant time and
//!   answers any other call `unauthenticated`, counting and logging it.
//!   A node started without a token accepts every call: the `rebound node`
//!   command allows that only on a loopback address, with mutual TLS
//!   (which authenticates callers itself), or with `--insecure`.
//! - **The members** ([`Members`]): the addresses of the cluster's nodes,
//!   given to a node at start (a list, or a file the host rewrites when it
//!   learns its local nodes' ports). A transfer names only members; any
//!   other address is refused before a connection is opened, naming it. A
//!   node told no members makes no transfers at all.
//! - **TLS** ([`NodeTls`], optional): rustls through tonic, certificates
//!   in one directory (below); with `verify_peer` a caller must present a
//!   certificate of the cluster's CA (mutual TLS), which authenticates it
//!   on its own.
//! - **The put limit** ([`DEFAULT_MAX_PUT_BYTES`]): a put whose messages
//!   add up to more is refused while it streams, at the first message past
//!   the limit, so a node never buffers (or, for base data, which streams
//!   to the device, writes) more than that for one put.
//!
//! ## TLS certificates
//!
//! One directory, the layout qemu, nbdkit and rebound's NBD side use:
//!
//! | file | used by | what |
//! |---|---|---|
//! | `ca-cert.pem` | every process | the CA that signed every node's certificate (and clients' for mutual TLS) |
//! | `server-cert.pem`, `server-key.pem` | a node | the node's certificate (its SAN names the address clients dial) and key |
//! | `client-cert.pem`, `client-key.pem` | the host, a node reaching a peer | the client's certificate for mutual TLS; a node without them presents its server certificate (issue it for clientAuth too) |
//!
//! Key files must be private like a token file (mode 0600, this user's).
//! A client verifies the node's certificate against `ca-cert.pem` for the
//! host or IP address it dials. With `verify_peer` a node also demands a
//! client certificate signed by that CA: mutual TLS, which authenticates
//! callers on its own (a token may still be required on top).
//!
//! Invariants: a node with a token runs no handler for a call without it;
//! no transfer connects to an address outside the members it holds at the
//! time of the call.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

use crate::error::{Error, Result};

/// The default limit on the bytes of one put: 1 GiB, above a node's share
/// of `lineitem` at scale factor 5 on 4 nodes, below what a small node can
/// hold twice. Base data streams to the device as it arrives; other puts
/// (checkpoint copies, parity members, redistributed rows) are held in
/// memory until complete, which is what the limit bounds first. A host
/// that starts its own nodes gives them room for scale factor 10
/// ([`crate::host::LOCAL_MAX_PUT_BYTES`]).
pub const DEFAULT_MAX_PUT_BYTES: u64 = 1 << 30;

/// The shortest token accepted, in characters (a guessable token is no
/// authentication). A generated one has 64.
pub const TOKEN_CHARS_MIN: usize = 16;

/// Random bytes in a generated token (hex-encoded: twice as many characters).
const TOKEN_RANDOM_BYTES: usize = 32;

/// Refused calls each logged; past them only every power of two is.
const REFUSALS_LOGGED_ALL: u64 = 16;

/// The metadata header a token travels in.
const AUTHORIZATION: &str = "authorization";

/// The cluster's shared secret. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token from its text: visible ASCII, at least [`TOKEN_CHARS_MIN`]
    /// characters (surrounding white space, a trailing newline, dropped).
    pub fn new(text: &str) -> Result<Token> {
        let t = text.trim();
        if t.len() < TOKEN_CHARS_MIN {
            return Err(Error::Invalid(format!(
                "a cluster token needs at least {TOKEN_CHARS_MIN} characters, this one has {}",
                t.len()
            )));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::Invalid(
                "a cluster token is visible ASCII without spaces (base64 or hex)".into(),
            ));
        }
        Ok(Token(t.into()))
    }

    /// Reads the token in `path`, which must be a file of the user running
    /// this process that nobody else may read or write.
    pub fn read(path: &Path) -> Result<Token> {
        check_private(path, "token file")?;
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Token::new(&text).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
    }

    /// Writes a fresh random token to `path` (created with mode 0600; an
    /// existing file is never overwritten) and returns it.
    pub fn generate(path: &Path) -> Result<Token> {
        let mut random = [0u8; TOKEN_RANDOM_BYTES];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
            .map_err(|e| Error::io("/dev/urandom", e))?;
        let text: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let token = Token::new(&text)?;
        write_private(path, &format!("{text}\n"), false)?;
        Ok(token)
    }

    /// The token in `path`, or a fresh one written there when the file does
    /// not exist yet.
    pub fn read_or_generate(path: &Path) -> Result<Token> {
        if path.exists() {
            Token::read(path)
        } else {
            Token::generate(path)
        }
    }

    /// Whether `presented` is this token, in time independent of where
    /// they differ (only the length may show).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let want = self.0.as_bytes();
        if want.len() != presented.len() {
            return false;
        }
        let diff = want
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    fn header(&self) -> MetadataValue<Ascii> {
        format!("Bearer {}", self.0)
            .parse()
            .expect("a token is visible ASCII")
    }
}

/// Refuses `path` unless it is a regular file owned by this process's user
/// (or root) and neither readable nor writable by group or others.
pub fn check_private(path: &Path, what: &str) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::Invalid(format!(
            "{what} {} is not a regular file",
            path.display()
        )));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(Error::Invalid(format!(
            "{what} {} belongs to uid {}, not to this user (uid {uid}): refused",
            path.display(),
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(Error::Invalid(format!(
            "{what} {} has mode {mode:04o}: other users may read or change it; \
             refused (chmod 600 {})",
            path.display(),
            path.display()
        )));
    }
    Ok(())
}

/// Writes `text` to `path` with mode 0600: in place of an existing file
/// (through a rename, so a reader sees the old or the new text) when
/// `replace`, else only when the file does not exist.
pub fn write_private(path: &Path, text: &str, replace: bool) -> Result<()> {
    let target = if replace {
        let mut t = path.as_os_str().to_owned();
        t.push(".new");
        PathBuf::from(t)
    } else {
        path.to_path_buf()
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(!replace)
        .create(replace)
        .truncate(replace)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&target)
        .map_err(|e| Error::io(&target, e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Error::io(&target, e))?;
    if replace {
        std::fs::rename(&target, path).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// The addresses of a cluster's nodes: the only ones a node's transfers
/// connect to.
#[derive(Debug, Clone)]
pub enum Members {
    /// A fixed list (`--members`).
    List(Vec<String>),
    /// A file of addresses, separated by commas or lines, read at each
    /// transfer (`--members-file`; the host rewrites it when it learns its
    /// local nodes' ports). It must be private like a token file: who
    /// writes it decides where data goes.
    File(PathBuf),
}

impl Members {
    /// A list from `host:port` addresses (each checked).
    pub fn list(addrs: &[String]) -> Result<Members> {
        addrs
            .iter()
            .filter(|a| !a.trim().is_empty())
            .map(|a| canonical(a))
            .collect::<Result<Vec<_>>>()
            .map(Members::List)
    }

    /// The member addresses now.
    pub fn addrs(&self) -> Result<Vec<String>> {
        match self {
            Members::List(l) => Ok(l.clone()),
            Members::File(path) => {
                check_private(path, "members file")?;
                let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
                text.split([',', '\n'])
                    .map(str::trim)
                    .filter(|a| !a.is_empty() && !a.starts_with('#'))
                    .map(canonical)
                    .collect::<Result<Vec<_>>>()
                    .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
            }
        }
    }
}

/// `addr` in one spelling per address: a socket address as Rust prints it
/// (so `[::1]:7400` and `[0:0:0:0:0:0:0:1]:7400` agree), a host name in
/// lower case.
fn canonical(addr: &str) -> Result<String> {
    let addr = addr.trim();
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return Ok(sa.to_string());
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(addr.to_ascii_lowercase())
        }
        _ => Err(Error::Invalid(format!(
            "{addr:?} is not a member address (host:port)"
        ))),
    }
}

/// What a node accepts and whom it talks to.
#[derive(Debug, Clone)]
pub struct NodeAccess {
    /// Calls must carry this token (none: every call is accepted).
    pub token: Option<Token>,
    /// Where transfers may connect (none: no transfers).
    pub members: Option<Members>,
    /// The most bytes one put may bring in.
    pub max_put_bytes: u64,
    /// TLS on its Flight service and to its peers (none: plaintext).
    pub tls: Option<NodeTls>,
}

impl Default for NodeAccess {
    fn default() -> Self {
        NodeAccess {
            token: None,
            members: None,
            max_put_bytes: DEFAULT_MAX_PUT_BYTES,
            tls: None,
        }
    }
}

impl NodeAccess {
    /// Refuses a transfer to or from `addr` unless it is a member.
    pub fn check_member(&self, addr: &str) -> Result<()> {
        let Some(members) = &self.members else {
            return Err(Error::Refused(format!(
                "{addr} is not a member of this cluster (this node was started without \
                 --members or --members-file, so it makes no transfers)"
            )));
        };
        let want = canonical(addr).map_err(|e| Error::Refused(e.to_string()))?;
        if members.addrs()?.contains(&want) {
            Ok(())
        } else {
            Err(Error::Refused(format!(
                "{addr} is not a member of this cluster"
            )))
        }
    }

    /// The credentials this node presents to its peers: its own token,
    /// and its TLS client side.
    pub fn credentials(&self) -> Credentials {
        Credentials {
            token: self.token.clone(),
            tls: self.tls.as_ref().map(|t| t.client.clone()),
        }
    }

    /// Whether callers are authenticated (a token, or mutual TLS).
    pub fn authenticates(&self) -> bool {
        self.token.is_some() || self.tls.as_ref().is_some_and(|t| t.verify_peer)
    }
}

/// What a client presents to a node.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// The cluster token, sent on every call.
    pub token: Option<Token>,
    /// TLS (none: plaintext).
    pub tls: Option<ClientTlsConfig>,
}

impl Credentials {
    /// Presenting `token`.
    pub fn token(token: Token) -> Credentials {
        Credentials {
            token: Some(token),
            tls: None,
        }
    }

    /// The client-side interceptor adding them to each call.
    pub fn interceptor(&self) -> BearerToken {
        BearerToken(self.token.as_ref().map(Token::header))
    }
}

/// A client interceptor: `authorization: Bearer <token>` on every call.
#[derive(Debug, Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.0 {
            request.metadata_mut().insert(AUTHORIZATION, h.clone());
        }
        Ok(request)
    }
}

/// The node's interceptor: a call without the cluster token never reaches
/// a handler. Refusals are counted ([`TokenCheck::refused`]) and logged.
#[derive(Debug, Clone)]
pub struct TokenCheck {
    token: Option<Token>,
    refused: Arc<AtomicU64>,
}

impl TokenCheck {
    /// Checking for `token` (none: accepting every call).
    pub fn new(token: Option<Token>) -> TokenCheck {
        TokenCheck {
            token,
            refused: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Calls refused so far (shared by every clone).
    pub fn refused(&self) -> Arc<AtomicU64> {
        self.refused.clone()
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get(AUTHORIZATION)
            .map(|v| v.as_bytes().strip_prefix(b"Bearer ").unwrap_or(b""));
        let why = match presented {
            Some(p) if token.matches(p) => return Ok(request),
            Some(_) => "wrong cluster token",
            None => "no cluster token (authorization: Bearer <token>)",
        };
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        // The first refusals, then one per power of two: a client hammering
        // the node cannot flood its log.
        if n <= REFUSALS_LOGGED_ALL || n.is_power_of_two() {
            let peer = request
                .remote_addr()
                .map_or_else(|| "unknown peer".to_string(), |a| a.to_string());
            tracing::warn!("refused a call from {peer}: {why} ({n} refused so far)");
        }
        Err(Status::unauthenticated(format!(
            "{why}: this storage node accepts only calls carrying its cluster token \
             (--token-file)"
        )))
    }
}

/// The CA certificate's file name.
pub const CA_CERT: &str = "ca-cert.pem";
/// The node's certificate's file name.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The node's key's file name.
pub const SERVER_KEY: &str = "server-key.pem";
/// A client's certificate's file name (mutual TLS).
pub const CLIENT_CERT: &str = "client-cert.pem";
/// A client's key's file name (mutual TLS).
pub const CLIENT_KEY: &str = "client-key.pem";

/// A node's TLS: how it serves, and how it reaches its peers.
#[derive(Clone)]
pub struct NodeTls {
    /// Its server side.
    pub server: ServerTlsConfig,
    /// Its client side, for transfers.
    pub client: ClientTlsConfig,
    /// Whether callers must present a certificate of the CA.
    pub verify_peer: bool,
}

impl std::fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTls")
            .field("verify_peer", &self.verify_peer)
            .finish_non_exhaustive()
    }
}

fn read(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let path = dir.join(name);
    std::fs::read(&path).map_err(|e| Error::io(path, e))
}

fn read_key(dir: &Path, name: &str) -> Result<Vec<u8>> {
    check_private(&dir.join(name), "TLS key")?;
    read(dir, name)
}

impl NodeTls {
    /// A node's TLS from the certificates in `dir`.
    pub fn load(dir: &Path, verify_peer: bool) -> Result<NodeTls> {
        let ca = Certificate::from_pem(read(dir, CA_CERT)?);
        let identity = Identity::from_pem(read(dir, SERVER_CERT)?, read_key(dir, SERVER_KEY)?);
        let mut server = ServerTlsConfig::new().identity(identity);
        if verify_peer {
            server = server.client_ca_root(ca);
        }
        let mut client = client_config(dir)?;
        if !dir.join(CLIENT_CERT).exists() {
            // Its own certificate for mutual TLS with its peers.
            client = client.identity(Identity::from_pem(
                read(dir, SERVER_CERT)?,
                read_key(dir, SERVER_KEY)?,
            ));
        }
        Ok(NodeTls {
            server,
            client,
            verify_peer,
        })
    }
}

/// A client's TLS from the certificates in `dir`: the CA, and the client's
/// certificate when the directory has one.
pub fn client_config(dir: &Path) -> Result<ClientTlsConfig> {
    let mut client =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(dir, CA_CERT)?));
    if dir.join(CLIENT_CERT).exists() {
        client = client.identity(Identity::from_pem(
            read(dir, CLIENT_CERT)?,
            read_key(dir, CLIENT_KEY)?,
        ));
    }
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_themselves() {
        let t = Token::new("0123456789abcdef0123").unwrap();
        assert!(t.matches(b"0123456789abcdef0123"));
        assert!(!t.matches(b"0123456789abcdef0124"));
        assert!(!t.matches(b"0123456789abcdef012"));
        assert!(!t.matches(b""));
        assert!(Token::new("short").is_err());
        assert!(Token::new("has a space in the middle").is_err());
        assert_eq!(format!("{t:?}"), "Token(..)");
    }

    #[test]
    fn a_generated_token_is_private_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        let t = Token::generate(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        assert_eq!(Token::read(&p).unwrap(), t);
        assert!(Token::generate(&p).is_err(), "never overwrites");
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let e = Token::read(&p).unwrap_err().to_string();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
    }

    #[test]
    fn members_are_compared_in_one_spelling() {
        let access = NodeAccess {
            members: Some(Members::list(&["[::1]:7400".into(), "Node1:7400".into()]).unwrap()),
            ..NodeAccess::default()
        };
        access.check_member("[0:0:0:0:0:0:0:1]:7400").unwrap();
        access.check_member("node1:7400").unwrap();
        let e = access.check_member("node2:7400").unwrap_err().to_string();
        assert!(
            e.contains("node2:7400 is not a member of this cluster"),
            "{e}"
        );
        let e = NodeAccess::default()
            .check_member("node1:7400")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a member"), "{e}");
        assert!(Members::list(&["nowhere".into()]).is_err());
    }
}
