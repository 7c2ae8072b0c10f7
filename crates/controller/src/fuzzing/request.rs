//! Request headers of the transmission phase fed arbitrary bytes: parsed
//! by [`RequestHeader::parse`], then classified by the engine's validation
//! (`engine::datapath::validate`, the check every request passes before
//! a stage runs), as `proto.md` ("Request message", "Request types",
//! "Error values") and the module docs of `nbd/proto.rs` document it.
//!
//! Invariants checked (each a panic when broken):
//! - Parsing never panics; it refuses exactly the headers whose magic is
//!   not `NBD_REQUEST_MAGIC`, and a parsed header encodes back to the same
//!   28 bytes (every field read from its documented offset).
//! - Validation never panics, and its verdict follows the documented
//!   rules: an unknown command (DISC included: the framer ends the stream
//!   on it before validation) or a flag the command does not take is
//!   `EINVAL`; FLUSH is accepted only with offset and length 0; a read-only
//!   export refuses WRITE, TRIM and WRITE_ZEROES with `EPERM`;
//!   BLOCK_STATUS needs structured replies and a length; a range past the
//!   export's end (or one overflowing `u64`) is `ENOSPC` for WRITE and
//!   `EINVAL` otherwise; a READ over the maximum payload (plus the slack
//!   of an expanded partial read) is `EOVERFLOW`; everything else is
//!   accepted.
//! - An accepted request lies inside the export and, for a READ, inside
//!   the payload bound: nothing accepted can address or allocate more.

use crate::engine::datapath::validate;
use crate::limits::MAX_PAYLOAD_BYTES;
use crate::nbd::handshake::ExportInfo;
use crate::nbd::proto::{NbdError, REQUEST_BYTES, REQUEST_MAGIC, RequestHeader, cflags, cmd};

/// The cargo-fuzz entry point. Shape: one byte of session settings (bit 0
/// structured replies, bit 1 a read-only export, bit 2 the slack of an
/// expanded partial read, bits 3..=4 the export's size: 16 MiB, 1 TiB, 16
/// TiB or 4 KiB), then the 28 header bytes (short inputs are padded with
/// zeroes); returns [`check_request`]'s verdict, panics on a violation.
pub fn request_header(data: &[u8]) -> Option<Result<(), NbdError>> {
    let (&settings, rest) = data.split_first()?;
    let mut raw = [0u8; REQUEST_BYTES];
    let n = rest.len().min(REQUEST_BYTES);
    raw[..n].copy_from_slice(&rest[..n]);
    let size_bytes = [16 << 20, 1 << 40, 1 << 44, 4096][usize::from(settings >> 3) & 3];
    let export = ExportInfo {
        size_bytes,
        read_only: settings & 2 != 0,
        ..super::test_export()
    };
    let slack = if settings & 4 != 0 { 8192 } else { 0 };
    check_request(&raw, &export, settings & 1 != 0, slack)
}

/// Parse `raw` and validate it for `export`; check every property and
/// return the verdict (`None`: the header was refused for its magic).
///
/// # Panics
/// When a property fails (see the module docs).
pub fn check_request(
    raw: &[u8; REQUEST_BYTES],
    export: &ExportInfo,
    structured: bool,
    slack: u32,
) -> Option<Result<(), NbdError>> {
    let magic_ok = raw[..4] == REQUEST_MAGIC.to_be_bytes();
    let Some(h) = RequestHeader::parse(raw) else {
        assert!(!magic_ok, "a header with the request magic was refused");
        return None;
    };
    assert!(magic_ok, "a header with a bad magic was parsed: {h:?}");
    assert_eq!(&h.encode(), raw, "parse then encode gives the bytes back");
    let got = validate(&h, export, structured, slack).map_err(|(e, _)| e);
    let want = documented(&h, export, structured, slack);
    assert_eq!(got, want, "validation of {h:?} (structured {structured})");
    if got.is_ok() {
        let end = h.offset.checked_add(u64::from(h.length));
        assert!(
            end.is_some_and(|e| e <= export.size_bytes),
            "accepted past the end"
        );
        if h.kind == cmd::READ {
            assert!(
                h.length <= MAX_PAYLOAD_BYTES.saturating_add(slack),
                "accepted over the payload bound"
            );
        }
    }
    Some(got)
}

/// The verdict the protocol documents, rule by rule in the order the
/// server applies them (the first rule that applies decides).
fn documented(
    h: &RequestHeader,
    export: &ExportInfo,
    structured: bool,
    slack: u32,
) -> Result<(), NbdError> {
    // Per command: the flags it takes (proto.md, "Command flags").
    const TAKES: [(u16, u16); 6] = [
        (cmd::WRITE, cflags::FUA),
        (cmd::FLUSH, cflags::FUA),
        (cmd::TRIM, cflags::FUA),
        (cmd::CACHE, 0),
        (
            cmd::WRITE_ZEROES,
            cflags::FUA | cflags::NO_HOLE | cflags::FAST_ZERO,
        ),
        (cmd::BLOCK_STATUS, cflags::REQ_ONE),
    ];
    let takes = if h.kind == cmd::READ {
        // DF only where structured replies can honour it.
        Some(cflags::FUA | if structured { cflags::DF } else { 0 })
    } else {
        TAKES.iter().find(|(k, _)| *k == h.kind).map(|(_, f)| *f)
    };
    let Some(takes) = takes else {
        return Err(NbdError::Inval);
    };
    let changes = matches!(h.kind, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    let end = u128::from(h.offset) + u128::from(h.length);
    if h.flags | takes != takes {
        Err(NbdError::Inval)
    } else if h.kind == cmd::FLUSH {
        if (h.offset, h.length) == (0, 0) {
            Ok(())
        } else {
            Err(NbdError::Inval)
        }
    } else if changes && export.read_only {
        Err(NbdError::Perm)
    } else if h.kind == cmd::BLOCK_STATUS && (!structured || h.length == 0) {
        Err(NbdError::Inval)
    } else if end > u128::from(export.size_bytes) {
        Err(if h.kind == cmd::WRITE {
            NbdError::NoSpc
        } else {
            NbdError::Inval
        })
    } else if h.kind == cmd::READ
        && u64::from(h.length) > u64::from(MAX_PAYLOAD_BYTES) + u64::from(slack)
    {
        Err(NbdError::Overflow)
    } else {
        Ok(())
    }
}
