//! The NBD protocol: wire format ([`proto`]) and the handshake
//! ([`handshake`]); the transmission phase is in
//! [`connection`](crate::connection) and [`datapath`](crate::datapath).

pub mod handshake;
pub mod proto;
