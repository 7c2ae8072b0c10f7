//! NBD wire format: magic numbers, option and command codes, flags, error
//! values, and the fixed-size messages of the transmission phase.
//!
//! Reference: `doc/proto.md` of the NetworkBlockDevice/nbd repository. All
//! integers are big-endian ("network byte order").
//!
//! ```text
//! Request (client → server), 28 bytes, then `length` bytes of payload for WRITE:
//!   0  u32 magic 0x25609513        4  u16 command flags    6  u16 type
//!   8  u64 cookie                 16  u64 offset          24  u32 length
//!
//! Simple reply (server → client), 16 bytes, then data for a successful READ:
//!   0  u32 magic 0x67446698        4  u32 error            8  u64 cookie
//!
//! Structured reply chunk (only after NBD_OPT_STRUCTURED_REPLY), 20 bytes + payload:
//!   0  u32 magic 0x668e33ef        4  u16 flags (bit 0 DONE)   6  u16 type
//!   8  u64 cookie                 16  u32 payload length
//!   OFFSET_DATA payload: u64 offset, data
//!   ERROR payload:       u32 error, u16 message length, message
//!   BLOCK_STATUS payload: u32 metadata context id, then per extent
//!                         u32 length, u32 status flags (base:allocation:
//!                         bit 0 HOLE, bit 1 ZERO)
//!
//! Option request (handshake), 16 bytes + data:
//!   0  u64 magic "IHAVEOPT"        8  u32 option          12  u32 data length
//! Option reply, 20 bytes + data:
//!   0  u64 magic 0x3e889045565a9   8  u32 option          12  u32 reply type
//!  16  u32 data length
//! ```

/// "NBDMAGIC", first word the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle handshake magic, and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of option replies.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of requests.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of simple replies.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of structured reply chunks.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: fixed newstyle supported.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the 124 zero bytes after EXPORT_NAME may be omitted.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub mod tflags {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// The export is read-only: writes, trims and zeroes answer `EPERM`.
    pub const READ_ONLY: u16 = 1 << 1;
    /// FLUSH supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// FUA supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// TRIM supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// WRITE_ZEROES supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// The DF (don't fragment) read flag supported (structured replies only).
    pub const SEND_DF: u16 = 1 << 7;
    /// One cache shared by every connection: flushes are visible to all.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// NBD_CMD_CACHE supported.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// The FAST_ZERO flag of WRITE_ZEROES supported.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option codes.
pub mod opt {
    /// Choose the export and end negotiation (no error reporting).
    pub const EXPORT_NAME: u32 = 1;
    /// Abort negotiation.
    pub const ABORT: u32 = 2;
    /// List exports.
    pub const LIST: u32 = 3;
    /// Upgrade to TLS (not supported).
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and enter transmission.
    pub const GO: u32 = 7;
    /// Use structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts (`base:allocation` is the one offered).
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts for BLOCK_STATUS.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    /// Success / end of list.
    pub const ACK: u32 = 1;
    /// An export (LIST).
    pub const SERVER: u32 = 2;
    /// An information item (INFO, GO).
    pub const INFO: u32 = 3;
    /// A metadata context (LIST_META_CONTEXT, SET_META_CONTEXT).
    pub const META_CONTEXT: u32 = 4;
    /// Option not supported.
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    /// Refused by policy.
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    /// Syntactically invalid option.
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    /// The server requires TLS (STARTTLS) before this option.
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    /// The server is shutting down.
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
}

/// Information types (INFO, GO).
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// Canonical name.
    pub const NAME: u16 = 1;
    /// Description.
    pub const DESCRIPTION: u16 = 2;
    /// Block size constraints.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command types.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write (payload follows the header).
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Trim (discard).
    pub const TRIM: u16 = 4;
    /// Cache: prefetch a range into the read cache.
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
    /// Block status of a range in the selected metadata context.
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cflags {
    /// Force unit access.
    pub const FUA: u16 = 1 << 0;
    /// WRITE_ZEROES: do not punch a hole.
    pub const NO_HOLE: u16 = 1 << 1;
    /// READ: don't fragment the structured reply.
    pub const DF: u16 = 1 << 2;
    /// BLOCK_STATUS: one extent.
    pub const REQ_ONE: u16 = 1 << 3;
    /// WRITE_ZEROES: fail unless fast.
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk types.
pub mod chunk {
    /// No payload; only as the final chunk.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// Block status descriptors of one metadata context.
    pub const BLOCK_STATUS: u16 = 5;
    /// An error with a message.
    pub const ERROR: u16 = (1 << 15) + 1;
    /// Flag of the final chunk.
    pub const FLAG_DONE: u16 = 1 << 0;
}

/// NBD error values (the `error` field of replies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NbdError {
    /// Operation not permitted.
    Perm = 1,
    /// Input/output error.
    Io = 5,
    /// Cannot allocate memory.
    NoMem = 12,
    /// Invalid argument (bad range, alignment, flags, unknown command).
    Inval = 22,
    /// No space left (write past the end of the export).
    NoSpc = 28,
    /// Value too large (payload over the maximum).
    Overflow = 75,
    /// Operation not supported.
    NotSup = 95,
    /// The server is shutting down.
    Shutdown = 108,
}

impl NbdError {
    /// The wire value.
    pub fn code(self) -> u32 {
        self as u32
    }
}

/// The one metadata context offered to BLOCK_STATUS.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in META_CONTEXT replies and BLOCK_STATUS chunks.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// `base:allocation` status flags of a BLOCK_STATUS extent.
pub mod alloc_state {
    /// Nothing is stored for the extent (never written, trimmed or zeroed).
    pub const HOLE: u32 = 1 << 0;
    /// The extent reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
}

/// Size of a request header.
pub const REQUEST_BYTES: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_HEADER_BYTES: usize = 20;

const _: () = assert!(REQUEST_BYTES == 4 + 2 + 2 + 8 + 8 + 4);
const _: () = assert!(SIMPLE_REPLY_BYTES == 4 + 4 + 8);
const _: () = assert!(CHUNK_HEADER_BYTES == 4 + 2 + 2 + 8 + 4);

/// A request header as read off the wire (not yet validated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// Opaque cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Byte length.
    pub length: u32,
}

impl RequestHeader {
    /// Parse a header; `None` if the magic is wrong (the stream cannot be
    /// resynchronised: the connection must be closed).
    pub fn parse(b: &[u8; REQUEST_BYTES]) -> Option<Self> {
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u16_at = |i: usize| u16::from_be_bytes(b[i..i + 2].try_into().expect("2 bytes"));
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != REQUEST_MAGIC {
            return None;
        }
        Some(Self {
            flags: u16_at(4),
            kind: u16_at(6),
            cookie: u64_at(8),
            offset: u64_at(16),
            length: u32_at(24),
        })
    }

    /// Encode (used by tests and the benchmark client).
    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Append a simple reply header (to a `Vec`, or to the inline head of a
/// reply frame: any byte sink).
pub fn put_simple_reply(out: &mut impl Extend<u8>, cookie: u64, error: u32) {
    out.extend(SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend(error.to_be_bytes());
    out.extend(cookie.to_be_bytes());
}

/// Append a structured chunk header.
pub fn put_chunk_header(
    out: &mut impl Extend<u8>,
    cookie: u64,
    flags: u16,
    kind: u16,
    length: u32,
) {
    out.extend(STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend(flags.to_be_bytes());
    out.extend(kind.to_be_bytes());
    out.extend(cookie.to_be_bytes());
    out.extend(length.to_be_bytes());
}

/// Append a final ERROR chunk with a message (truncated to 4096 bytes).
pub fn put_error_chunk(out: &mut impl Extend<u8>, cookie: u64, error: NbdError, message: &str) {
    let mut msg = message.as_bytes();
    if msg.len() > 4096 {
        msg = &msg[..4096];
    }
    put_chunk_header(
        out,
        cookie,
        chunk::FLAG_DONE,
        chunk::ERROR,
        (6 + msg.len()) as u32,
    );
    out.extend(error.code().to_be_bytes());
    out.extend((msg.len() as u16).to_be_bytes());
    out.extend(msg.iter().copied());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_roundtrips_and_rejects_bad_magic() {
        let h = RequestHeader {
            flags: cflags::FUA,
            kind: cmd::WRITE,
            cookie: 0xdead_beef_0102_0304,
            offset: 1 << 40,
            length: 4096,
        };
        let mut b = h.encode();
        assert_eq!(RequestHeader::parse(&b), Some(h));
        b[0] ^= 1;
        assert_eq!(RequestHeader::parse(&b), None);
    }

    #[test]
    fn error_chunk_truncates_long_messages() {
        let mut out = Vec::new();
        put_error_chunk(&mut out, 7, NbdError::Inval, &"x".repeat(5000));
        assert_eq!(out.len(), CHUNK_HEADER_BYTES + 6 + 4096);
        assert_eq!(&out[16..20], &(6u32 + 4096).to_be_bytes());
    }
}
