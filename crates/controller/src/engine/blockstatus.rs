//! BLOCK_STATUS in the `base:allocation` context: which parts of a range
//! hold data and which are holes that read as zeroes (proto.md
//! "`base:` metadata context").
//!
//! A track holds data if it has a dirty record in the NVS (an acknowledged
//! write not yet destaged: the cache directory names it) or if the
//! volume's allocation map says a write may have reached the devices
//! ([`crate::backend::allocmap`]). Every other track was never written, or
//! was trimmed or zeroed since, and is reported `HOLE | ZERO`. Both
//! sources err only towards "data", so a sparse copy (`qemu-img convert`,
//! `nbdcopy`) never skips a byte that was written.
//!
//! The reply has at most [`EXTENTS_MAX`] extents (one with
//! `NBD_CMD_FLAG_REQ_ONE`); the first starts at the request's offset and
//! none reaches past its end, as the protocol requires. A client asks again
//! from where the answer stopped.

// Every stage has the `Stage` signature: requests move between tasks boxed.
#![allow(clippy::boxed_local)]

use rcs::{Failure, TaskCtx};

use crate::engine::Engine;
use crate::engine::request::Request;
use crate::limits::TRACK_BYTES;
use crate::nbd::proto::{BASE_ALLOCATION_ID, alloc_state, cflags};

/// Most extents in one reply.
pub const EXTENTS_MAX: usize = 4096;

/// Whether track `track` may hold data.
fn holds_data(engine: &Engine, track: u64) -> bool {
    engine.cache.is_dirty(track) || engine.volume.may_hold_data(track)
}

/// The extents of `[offset, offset + length)`: (length, `base:allocation`
/// flags), at most `most`, merged where neighbours agree.
pub(crate) fn extents(
    offset: u64,
    length: u32,
    most: usize,
    holds: impl Fn(u64) -> bool,
) -> Vec<(u32, u32)> {
    let track = TRACK_BYTES as u64;
    let end = offset + u64::from(length);
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut at = offset;
    while at < end {
        let t = at / track;
        let next = ((t + 1) * track).min(end);
        let flags = if holds(t) {
            0
        } else {
            alloc_state::HOLE | alloc_state::ZERO
        };
        let len = (next - at) as u32;
        let full = out.len() == most;
        match out.last_mut() {
            Some((l, f)) if *f == flags => *l += len,
            _ if full => break,
            _ => out.push((len, flags)),
        }
        at = next;
    }
    out
}

/// The BLOCK_STATUS chunk's payload: the context id, then the extents.
pub(crate) fn encode(extents: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 8 * extents.len());
    out.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
    for &(len, flags) in extents {
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// cache: the stage answering BLOCK_STATUS.
pub(crate) fn block_status(_ctx: &mut TaskCtx<'_>, mut req: Box<Request>) -> Result<(), Failure> {
    let engine = std::sync::Arc::clone(req.ctl());
    let h = req.header;
    let most = if h.flags & cflags::REQ_ONE != 0 {
        1
    } else {
        EXTENTS_MAX
    };
    let found = extents(h.offset, h.length, most, |t| holds_data(&engine, t));
    req.data = encode(&found);
    req.reply(Ok(()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HZ: u32 = alloc_state::HOLE | alloc_state::ZERO;

    #[test]
    fn extents_start_at_the_offset_end_at_the_end_and_merge_alike_tracks() {
        // Tracks 1 and 2 hold data.
        let holds = |t: u64| t == 1 || t == 2;
        let e = extents(100, 5 * 4096, EXTENTS_MAX, holds);
        assert_eq!(e, [(3996, HZ), (8192, 0), (8292, HZ)]);
        assert_eq!(e.iter().map(|x| u64::from(x.0)).sum::<u64>(), 5 * 4096);
    }

    #[test]
    fn req_one_and_the_extent_bound_cut_the_answer_short() {
        let alternate = |t: u64| t.is_multiple_of(2);
        let one = extents(0, 8 * 4096, 1, alternate);
        assert_eq!(one, [(4096, 0)]);
        let three = extents(0, 8 * 4096, 3, alternate);
        assert_eq!(three, [(4096, 0), (4096, HZ), (4096, 0)]);
        // A single byte still gets one extent.
        assert_eq!(extents(4095, 1, EXTENTS_MAX, alternate), [(1, 0)]);
    }

    #[test]
    fn the_payload_is_the_context_id_then_length_flag_pairs() {
        let p = encode(&[(4096, 0), (512, HZ)]);
        assert_eq!(p.len(), 4 + 16);
        assert_eq!(&p[0..4], &BASE_ALLOCATION_ID.to_be_bytes());
        assert_eq!(&p[4..8], &4096u32.to_be_bytes());
        assert_eq!(&p[16..20], &HZ.to_be_bytes());
    }
}
