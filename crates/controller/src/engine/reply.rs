//! [`ReplySink`]: the one way a finished request reaches its client.
//!
//! The engine never names a connection: a request carries an
//! `Arc<dyn ReplySink>`, as a task in tokio reaches its scheduler through
//! `task::Schedule`. The host layer's connection implements it with its
//! reply outbox; tests implement it to watch replies in-process.
//!
//! Contract: every request admitted against a sink ends with exactly one
//! [`ReplySink::finish_request`], after its reply was queued with
//! [`ReplySink::send_reply`] (or without any reply when the connection is
//! being torn down).

use crate::nbd::proto::{NbdError, RequestHeader};

/// Where the replies of one client's requests go.
pub trait ReplySink: Send + Sync + std::fmt::Debug {
    /// Whether the client negotiated structured replies (errors carry a
    /// message, READ data leaves in a chunk).
    fn structured(&self) -> bool;

    /// Queue the reply to `header` (with `data` for a successful READ) and
    /// send it, or leave it to whoever is sending.
    fn send_reply(
        &self,
        header: &RequestHeader,
        result: Result<(), (NbdError, &str)>,
        data: Vec<u8>,
    );

    /// A request of this client is finished (replied to, or abandoned).
    fn finish_request(&self);

    /// Whether the client selected the `base:allocation` metadata context
    /// (BLOCK_STATUS answers only then).
    fn allocation(&self) -> bool {
        false
    }

    /// Take the sender's role if no one has it, so replies queued until
    /// [`ReplySink::uncork`] leave together (an epoch's commit releases
    /// many). Returns whether the role was taken; only then call `uncork`.
    fn cork(&self) -> bool;

    /// Send what queued since a successful [`ReplySink::cork`].
    fn uncork(&self);
}

/// Whether two sinks are the same client (by address, ignoring vtables).
pub(crate) fn same_sink(
    a: &std::sync::Arc<dyn ReplySink>,
    b: &std::sync::Arc<dyn ReplySink>,
) -> bool {
    std::ptr::addr_eq(std::sync::Arc::as_ptr(a), std::sync::Arc::as_ptr(b))
}
