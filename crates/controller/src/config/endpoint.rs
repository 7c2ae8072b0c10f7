//! Where the NBD listener listens: a TCP address or a Unix socket path
//! (`listen = "127.0.0.1:10809"` or `listen = "unix:/run/rebound/nbd.sock"`),
//! and the NBD URI a client uses to reach it (`nbd://HOST:PORT/` or
//! `nbd+unix:///?socket=PATH`, the forms libnbd and qemu accept).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The listener's endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address (port 0: any free port).
    Tcp(SocketAddr),
    /// A Unix stream socket at this path.
    Unix(PathBuf),
}

/// The prefix that marks a Unix socket path.
const UNIX_PREFIX: &str = "unix:";

/// The longest Unix socket path (sun_path holds 108 bytes with its NUL).
pub const UNIX_PATH_MAX: usize = 107;

impl Endpoint {
    /// The URI a client connects with (export name `rebound`'s default
    /// export `""`).
    pub fn uri(&self) -> String {
        match self {
            Self::Tcp(a) => format!("nbd://{a}/"),
            Self::Unix(p) => format!("nbd+unix:///?socket={}", p.display()),
        }
    }

    /// The TCP address, if this is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(a) => Some(*a),
            Self::Unix(_) => None,
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp(a) => write!(f, "{a}"),
            Self::Unix(p) => write!(f, "{UNIX_PREFIX}{}", p.display()),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix(UNIX_PREFIX) {
            if path.is_empty() {
                return Err("unix: needs a socket path, e.g. unix:/run/rebound/nbd.sock".into());
            }
            if path.len() > UNIX_PATH_MAX {
                return Err(format!(
                    "the socket path {path} is longer than the {UNIX_PATH_MAX} bytes a Unix socket path may have"
                ));
            }
            if path.contains('\0') {
                return Err("the socket path contains a NUL byte".into());
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>().map(Self::Tcp).map_err(|_| {
            format!(
                "{s:?} is neither an address:port (127.0.0.1:10809, [::1]:10809) nor unix:/path/to.sock"
            )
        })
    }
}

impl Serialize for Endpoint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Endpoint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_and_unix_endpoints_parse_and_print_back() {
        for text in ["127.0.0.1:10809", "[::1]:0", "unix:/run/rebound/nbd.sock"] {
            let e: Endpoint = text.parse().unwrap();
            assert_eq!(e.to_string(), text);
        }
        assert_eq!(
            "unix:/tmp/a.sock".parse::<Endpoint>().unwrap().uri(),
            "nbd+unix:///?socket=/tmp/a.sock"
        );
        assert_eq!(
            "127.0.0.1:5".parse::<Endpoint>().unwrap().uri(),
            "nbd://127.0.0.1:5/"
        );
    }

    #[test]
    fn bad_endpoints_are_refused_with_what_was_expected() {
        for bad in ["", "localhost", "unix:", "10809", "tcp:1.2.3.4:5"] {
            let e = bad.parse::<Endpoint>().unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
        let long = format!("unix:/{}", "x".repeat(200));
        assert!(long.parse::<Endpoint>().unwrap_err().contains("107 bytes"));
    }
}
