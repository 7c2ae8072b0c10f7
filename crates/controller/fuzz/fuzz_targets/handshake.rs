//! Fuzz the NBD handshake (`nbd::handshake::negotiate`) with arbitrary
//! client byte streams over an in-memory connection. The first byte picks
//! the shape: odd, the rest is the client's raw bytes; even, the rest are
//! choice bytes built into a structured stream of options
//! (`controller::fuzzing::client_stream`), which reaches deep into option
//! parsing. It must never panic, never offer a read buffer over the option
//! limit, answer only well-formed option replies, and enter transmission
//! only for this export; `controller::fuzzing::handshake` lists every
//! property. The suite runs the same checker under proptest
//! (`src/tests/fuzz_handshake.rs`).
//!
//! Run: `cargo +nightly fuzz run handshake` in `crates/controller/fuzz`
//! (or `RUSTC_BOOTSTRAP=1 cargo fuzz run handshake` on a stable toolchain).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    controller::fuzzing::handshake(data);
});
