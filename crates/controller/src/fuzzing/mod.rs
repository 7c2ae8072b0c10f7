//! Fuzzing the NBD front end: entry points for the cargo-fuzz targets in
//! `crates/controller/fuzz` and the property checkers that the suite's
//! proptest tests (`src/tests/fuzz_handshake.rs`, `src/tests/fuzz_framer.rs`)
//! run on generated inputs. Built with the feature `fuzzing` (the fuzz
//! crate turns it on) and in the crate's own tests.
//!
//! Each entry point takes the raw bytes a fuzzer produces, runs the code
//! under test on them, and panics when a property fails: a panic is the
//! finding for libFuzzer and the failure (then shrunk) for proptest.
//!
//! | entry point | code under test | properties |
//! |---|---|---|
//! | [`handshake`] (raw bytes, or a [`client_stream`] built from them) | [`negotiate`](crate::nbd::handshake::negotiate) over an in-memory duplex | see [`handshake`](mod@handshake) |
//! | [`request_header`] | [`RequestHeader::parse`](crate::nbd::proto::RequestHeader::parse), the engine's request validation | see [`request`] |

pub mod client;
pub mod handshake;
pub mod request;

pub use client::client_stream;
pub use handshake::{Duplex, check_handshake, handshake, test_export};
pub use request::{check_request, request_header};

/// The environment variable scaling every fuzz test's case count: a
/// factor (`0.1` for a quick run, `10` for a long one); unset means 1, the
/// suite's default.
pub const CASES_ENV: &str = "REBOUND_FUZZ_CASES";

/// `base` cases scaled by [`CASES_ENV`] (at least 1).
///
/// # Panics
/// When the variable is set but is not a non-negative number.
pub fn cases(base: u32) -> u32 {
    let factor = match std::env::var(CASES_ENV) {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .unwrap_or_else(|| panic!("{CASES_ENV}={v:?} is not a non-negative number")),
        Err(_) => 1.0,
    };
    ((f64::from(base) * factor).round() as u32).max(1)
}
