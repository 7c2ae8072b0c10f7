//! # host: the host adapter's sockets
//!
//! The listener and each NBD connection in its transmission phase: framing
//! requests, handing them to the engine, and the connection's reply
//! outbox, which implements the engine's [`ReplySink`](crate::engine::ReplySink)
//! (DESIGN.md, "Controller components": host adapter).
//!
//! Imports: the `Controller`, the engine's narrow interfaces (requests,
//! [`ReplySink`](crate::engine::ReplySink)), `nbd` and leaves. Never `control`.
//!
//! | module | concept |
//! |---|---|
//! | [`socket`] | a client's socket and its listener: TCP or Unix, non-blocking sends |
//! | [`listener`] | accepting clients: negotiating ones bounded and timed, served ones by `--max-connections` |
//! | [`connection`] | one connection: handshake, framing, admission, the reply outbox and its drainer |
//! | [`partial`] | requests at any byte alignment turned into whole-track ones (read-modify-write) |
//! | [`tls`] | NBD over TLS: credentials (X.509, PSK), the handshake after STARTTLS, the per-connection pump |

pub mod connection;
pub mod listener;
pub mod partial;
// System calls std lacks: sendmsg(MSG_DONTWAIT), poll, setsockopt.
#[allow(unsafe_code)]
pub mod socket;
pub mod tls;
