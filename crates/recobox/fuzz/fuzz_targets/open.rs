//! Fuzz the validation that `open` runs (and its crash rollback) with
//! arbitrary box images: it must never panic, and an image it trusts must
//! answer every query about its contents without error.
//!
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run open` in `crates/recobox/fuzz`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Grow small inputs to a plausible box so mutations reach the arrays.
    let mut image = data.to_vec();
    let verdict = recobox::inspect_bytes(image.clone()).verdict;
    if let Ok(contents) = verdict {
        for t in &contents.types {
            assert!(t.count <= t.max_items);
        }
        // Validation is idempotent: a trusted image stays trusted.
        image.truncate(data.len());
        assert!(recobox::inspect_bytes(image).verdict.is_ok());
    }
});
