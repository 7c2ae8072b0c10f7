//! CRC-32C (Castagnoli) of box metadata and items.
//!
//! Every operation computes several checksums of a few dozen bytes (the op
//! record, item info, the dynamic part of a type entry, the item itself).
//! For inputs that short the `crc32c` crate's per-call cost (dispatch and
//! its block-oriented loop) dominated an insert+delete pair (perf: 66% of
//! the time in `crc32c`). On x86-64 with SSE4.2 this module computes them
//! inline with the CPU's `crc32` instruction, 8 bytes at a time (the tail
//! 4, 2 and 1 at a time); everything
//! else, and every other CPU, uses the crate. Both give the standard
//! CRC-32C (initial value and final xor `0xFFFF_FFFF`), checked against
//! each other in the tests.

/// Inputs up to this length take the inline path.
const INLINE_MAX: usize = 256;

/// The CRC-32C of `b`.
#[inline]
pub(crate) fn crc32c(b: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if b.len() <= INLINE_MAX && std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: `crc32c_sse42` only requires SSE4.2, detected just
            // above; it reads `b` through safe slice operations.
            return unsafe { crc32c_sse42(b) };
        }
    }
    crc32c::crc32c(b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(b: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u16, _mm_crc32_u32, _mm_crc32_u64};
    let mut c = u64::from(u32::MAX);
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().expect("8-byte chunk"));
        c = _mm_crc32_u64(c, v);
    }
    let mut c = c as u32;
    // The tail in at most three steps (each `crc32` is a 3-cycle
    // dependency; most records here end in 4 bytes).
    let mut rest = words.remainder();
    if rest.len() >= 4 {
        c = _mm_crc32_u32(
            c,
            u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")),
        );
        rest = &rest[4..];
    }
    if rest.len() >= 2 {
        c = _mm_crc32_u16(
            c,
            u16::from_le_bytes(rest[..2].try_into().expect("2 bytes")),
        );
        rest = &rest[2..];
    }
    if let Some(&byte) = rest.first() {
        c = _mm_crc32_u8(c, byte);
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inline_crc_equals_the_crate_for_every_length_and_content() {
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut buf = vec![0u8; 600];
        for b in buf.iter_mut() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            *b = rng as u8;
        }
        for len in 0..buf.len() {
            for start in [0, 1, 3, 7] {
                let s = &buf[start..(start + len).min(buf.len())];
                assert_eq!(crc32c(s), crc32c::crc32c(s), "length {}", s.len());
            }
        }
        // The standard check value of CRC-32C.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
