//! rebound's experiments, kept out of the product: the benches behind
//! `rebound bench ...`, `rebound demo`, report tables and plots, a small NBD
//! client, and [`harness`], the one way tests and benches start a `rebound
//! serve` process.
//!
//! The `rebound` binary only wires [`bench::BenchArgs`] and
//! [`demo::DemoArgs`] into its command line; the benches and the demo start
//! servers (and smart-storage nodes) from [`std::env::current_exe`], so they
//! run inside the `rebound` binary built with its `experiments` feature.

pub mod bench;
pub mod demo;
pub mod harness;
pub mod ledger;
pub mod nbd_client;
pub mod report;
pub mod sim;
