//! Fuzz the transmission phase's request header: parsing
//! (`nbd::proto::RequestHeader::parse`) and the classification every
//! request passes before a stage runs (the engine's validation). Shape: one
//! byte of session settings (structured replies, read-only export, the
//! slack of an expanded read, the export's size), then the 28 header bytes.
//! It must never panic, refuse exactly the bad magics, round-trip every
//! field, and classify each header as the protocol documents;
//! `controller::fuzzing::request` lists every property. The suite runs the
//! same checker under proptest (`src/tests/fuzz_framer.rs`, with
//! whole request streams sent to a live server over TCP).
//!
//! Run: `cargo +nightly fuzz run request_header` in `crates/controller/fuzz`
//! (or `RUSTC_BOOTSTRAP=1 cargo fuzz run request_header` on a stable
//! toolchain).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = controller::fuzzing::request_header(data);
});
