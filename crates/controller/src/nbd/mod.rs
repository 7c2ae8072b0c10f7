//! The NBD protocol: wire format ([`proto`]) and the handshake
//! ([`handshake`]); the transmission phase is in
//! [`connection`](crate::host::connection) and [`datapath`](crate::engine::datapath).

pub mod handshake;
pub mod proto;
