//! The handshake fed arbitrary client bytes, checked against a reference
//! walk of the same bytes.
//!
//! Invariants checked (each a panic when broken):
//! - `negotiate` never panics, whatever the client sends.
//! - Memory is bounded by the protocol limits, not by what the client
//!   declares: no read buffer the server offers is larger than
//!   [`OPTION_DATA_MAX`] (the option data buffer is the one allocation
//!   sized by the client), so a declared 4 GiB option is refused before
//!   anything is allocated or read for it.
//! - The outcome is the one the bytes call for: `Io` (end of input) when
//!   the client stops mid-message, `BadClientFlags`, `BadOptionMagic`,
//!   `OptionTooLarge`, `UnknownExport` and `TooManyOptions` exactly where
//!   the reference walk meets them, `Aborted` only on NBD_OPT_ABORT.
//! - Every byte the server wrote is well-formed: the 18-byte greeting,
//!   then per option a sequence of option replies (reply magic, the
//!   option echoed, a length the bytes that follow match) of types allowed
//!   for that option, ended by exactly one ACK or error reply; nothing is
//!   written after a refusal.
//! - `Transmission` only after a GO acknowledged for, or an EXPORT_NAME
//!   naming, this export (`""` or its name), with the structured-reply and
//!   `base:allocation` state the replies before it announced; after
//!   EXPORT_NAME, exactly the size, flags and (unless NO_ZEROES) 124 zeroes.

use std::io::{self, Cursor, Read, Write};

use super::client::client_stream;
use crate::nbd::handshake::{
    ExportInfo, HandshakeError, Negotiated, OPTION_DATA_MAX, OPTIONS_MAX, Outcome, negotiate,
};
use crate::nbd::proto::{
    BASE_ALLOCATION, BASE_ALLOCATION_ID, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES,
    FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, NBDMAGIC, OPTION_REPLY_MAGIC, info, opt, rep,
};

/// An in-memory connection: reads come from the client's bytes, writes
/// are collected; records the largest read buffer the server offered.
#[derive(Debug)]
pub struct Duplex {
    input: Cursor<Vec<u8>>,
    /// What the server wrote.
    pub output: Vec<u8>,
    /// The largest buffer passed to one `read` (bounds what was allocated
    /// for the client's declared lengths).
    pub read_buffer_max_bytes: usize,
}

impl Duplex {
    /// A connection whose client sends `input`, then hangs up.
    pub fn new(input: &[u8]) -> Self {
        Self {
            input: Cursor::new(input.to_vec()),
            output: Vec::new(),
            read_buffer_max_bytes: 0,
        }
    }

    /// Client bytes the server has read.
    pub fn consumed_bytes(&self) -> u64 {
        self.input.position()
    }
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_buffer_max_bytes = self.read_buffer_max_bytes.max(buf.len());
        self.input.read(buf)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The export the fuzz targets negotiate for.
pub fn test_export() -> ExportInfo {
    ExportInfo {
        name: "rebound".into(),
        description: "fuzz".into(),
        size_bytes: 16 << 20,
        min_block_bytes: 1,
        preferred_block_bytes: 4096,
        max_payload_bytes: 32 << 20,
        read_only: false,
    }
}

/// The cargo-fuzz entry point. Shape: one mode byte, then either (mode
/// odd) the client's raw bytes, or (mode even) choice bytes that
/// [`client_stream`] turns into a structured client stream. Negotiates
/// with that client and checks every property; panics on a violation.
pub fn handshake(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let client = if mode & 1 == 1 {
        rest.to_vec()
    } else {
        client_stream(rest)
    };
    let _ = check_handshake(&client, &test_export());
}

/// Negotiate for `export` with `client` as the client's bytes, check every
/// property against the reference walk, and return the outcome.
///
/// # Panics
/// When a property fails (see the module docs).
pub fn check_handshake(client: &[u8], export: &ExportInfo) -> Result<Outcome, HandshakeError> {
    let mut duplex = Duplex::new(client);
    let result = negotiate(&mut duplex, export);
    assert!(
        duplex.read_buffer_max_bytes <= OPTION_DATA_MAX as usize,
        "a read buffer of {} bytes, over the {OPTION_DATA_MAX}-byte option limit",
        duplex.read_buffer_max_bytes
    );
    let mut server = Bytes(&duplex.output);
    let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    assert_eq!(server.take(18), Some(&greeting[..]), "the greeting");
    let mut unread = Bytes(client);
    let expected = walk(&mut unread, &mut server, export);
    assert!(
        server.0.is_empty(),
        "{} bytes written after the last reply: {:02x?}",
        server.0.len(),
        server.0
    );
    expected.check(&result);
    // Negotiation reads up to the end of the message that ends it and not
    // a byte more: a refused length is not read, and what follows GO or
    // EXPORT_NAME belongs to the transmission phase.
    assert_eq!(
        duplex.consumed_bytes(),
        (client.len() - unread.0.len()) as u64,
        "client bytes read by negotiate"
    );
    result
}

/// A cursor over bytes, big-endian.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            // A short message: the server reads (and may consume) what
            // is there, then meets the end.
            self.0 = &[];
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// What the reference walk says negotiation must end in.
#[derive(Debug)]
enum Expected {
    /// The client's bytes ran out mid-message.
    Eof,
    /// A protocol violation ends the connection (the error's name).
    Refused(&'static str),
    Aborted,
    Transmission(Negotiated),
}

impl Expected {
    fn check(&self, got: &Result<Outcome, HandshakeError>) {
        let ok = match (self, got) {
            (Self::Eof, Err(HandshakeError::Io(e))) => e.kind() == io::ErrorKind::UnexpectedEof,
            (Self::Refused(name), Err(e)) => error_name(e) == *name,
            (Self::Aborted, Ok(Outcome::Aborted)) => true,
            (Self::Transmission(n), Ok(Outcome::Transmission(m))) => n == m,
            _ => false,
        };
        assert!(ok, "expected {self:?}, negotiate returned {got:?}");
    }
}

fn error_name(e: &HandshakeError) -> &'static str {
    match e {
        HandshakeError::Io(_) => "Io",
        HandshakeError::BadClientFlags(_) => "BadClientFlags",
        HandshakeError::BadOptionMagic(_) => "BadOptionMagic",
        HandshakeError::OptionTooLarge { .. } => "OptionTooLarge",
        HandshakeError::TooManyOptions => "TooManyOptions",
        HandshakeError::UnknownExport(_) => "UnknownExport",
        HandshakeError::Refused(_) => "Refused",
        HandshakeError::TlsRequired => "TlsRequired",
    }
}

/// The negotiation state the server's replies have announced.
#[derive(Debug, Default)]
struct Announced {
    structured: bool,
    allocation: bool,
}

impl Announced {
    fn negotiated(&self) -> Negotiated {
        Negotiated {
            structured: self.structured,
            allocation: self.allocation && self.structured,
        }
    }
}

/// Walk the client's bytes as the protocol reads them, consuming the
/// server's replies to each option and checking their form; return the
/// outcome the bytes call for.
fn walk(client: &mut Bytes<'_>, server: &mut Bytes<'_>, export: &ExportInfo) -> Expected {
    let Some(flags) = client.u32() else {
        return Expected::Eof;
    };
    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Expected::Refused("BadClientFlags");
    }
    let no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
    let mut state = Announced::default();
    for _ in 0..OPTIONS_MAX {
        let Some(magic) = client.u64() else {
            return Expected::Eof;
        };
        if magic != IHAVEOPT {
            return Expected::Refused("BadOptionMagic");
        }
        let (Some(option), Some(length)) = (client.u32(), client.u32()) else {
            return Expected::Eof;
        };
        if length > OPTION_DATA_MAX {
            return Expected::Refused("OptionTooLarge");
        }
        let Some(data) = client.take(length as usize) else {
            return Expected::Eof;
        };
        if option == opt::EXPORT_NAME {
            return export_name(server, export, data, no_zeroes, &state);
        }
        let (replies, last) = replies_to(server, option);
        if option == opt::ABORT {
            assert!(replies.is_empty() && last.0 == rep::ACK, "ABORT is ACKed");
            return Expected::Aborted;
        }
        if let Some(outcome) = after_option(option, data, &replies, last.0, export, &mut state) {
            return outcome;
        }
    }
    Expected::Refused("TooManyOptions")
}

/// EXPORT_NAME: the export's size and flags (and 124 zeroes unless
/// NO_ZEROES) if the name is this export's, else a hard disconnect.
fn export_name(
    server: &mut Bytes<'_>,
    export: &ExportInfo,
    name: &[u8],
    no_zeroes: bool,
    state: &Announced,
) -> Expected {
    if !export.matches(name) {
        return Expected::Refused("UnknownExport");
    }
    let negotiated = state.negotiated();
    let size = server.u64().expect("EXPORT_NAME answers the export's size");
    assert_eq!(size, export.size_bytes, "EXPORT_NAME's export size");
    let flags = server.take(2).expect("EXPORT_NAME answers the flags");
    assert_eq!(
        flags,
        export
            .transmission_flags(negotiated.structured)
            .to_be_bytes(),
        "EXPORT_NAME's transmission flags"
    );
    if !no_zeroes {
        let zeroes = server.take(124).expect("124 zero bytes after EXPORT_NAME");
        assert!(zeroes.iter().all(|b| *b == 0), "the padding is zeroes");
    }
    Expected::Transmission(negotiated)
}

/// One option reply: (type, data).
type Reply<'a> = (u32, &'a [u8]);

/// The server's replies to `option`: the non-final ones and the final
/// one (ACK or an error), each checked for magic, echo and length.
fn replies_to<'a>(server: &mut Bytes<'a>, option: u32) -> (Vec<Reply<'a>>, Reply<'a>) {
    let mut replies = Vec::new();
    loop {
        let magic = server.u64().expect("an option reply is due");
        assert_eq!(magic, OPTION_REPLY_MAGIC, "option reply magic");
        let echoed = server.u32().expect("the option echoed");
        assert_eq!(echoed, option, "the reply echoes the option");
        let kind = server.u32().expect("the reply type");
        let length = server.u32().expect("the reply length");
        let data = server
            .take(length as usize)
            .unwrap_or_else(|| panic!("a reply declaring {length} bytes is cut short"));
        if kind == rep::ACK || kind & (1 << 31) != 0 {
            if kind == rep::ACK {
                assert!(data.is_empty(), "ACK carries no data");
            }
            return (replies, (kind, data));
        }
        let allowed = match option {
            opt::LIST => rep::SERVER,
            opt::INFO | opt::GO => rep::INFO,
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => rep::META_CONTEXT,
            _ => 0,
        };
        assert_eq!(kind, allowed, "reply type {kind:#x} to option {option}");
        replies.push((kind, data));
    }
}

/// Check the replies to a completed option against its data, update the
/// announced state; `Some` when negotiation ends here.
fn after_option(
    option: u32,
    data: &[u8],
    replies: &[Reply<'_>],
    last: u32,
    export: &ExportInfo,
    state: &mut Announced,
) -> Option<Expected> {
    let acked = last == rep::ACK;
    match option {
        opt::STRUCTURED_REPLY => {
            assert_eq!(
                acked,
                data.is_empty(),
                "STRUCTURED_REPLY without data is ACKed"
            );
            state.structured |= acked;
        }
        opt::LIST => {
            assert_eq!(acked, data.is_empty(), "LIST without data is answered");
            if acked {
                assert_eq!(replies.len(), 1, "LIST lists the one export");
                let name = export.name.as_bytes();
                assert_eq!(&replies[0].1[..4], &(name.len() as u32).to_be_bytes());
                assert_eq!(&replies[0].1[4..4 + name.len()], name);
            }
        }
        opt::INFO | opt::GO => {
            if acked {
                check_info(replies, data, export, state.structured);
                if option == opt::GO {
                    return Some(Expected::Transmission(state.negotiated()));
                }
            }
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
            for (_, context) in replies {
                let id = if option == opt::SET_META_CONTEXT {
                    BASE_ALLOCATION_ID
                } else {
                    0
                };
                let expected = [&id.to_be_bytes()[..], BASE_ALLOCATION.as_bytes()].concat();
                assert_eq!(*context, &expected[..], "the one context offered");
            }
            assert!(replies.len() <= 1, "one context at most");
            if option == opt::SET_META_CONTEXT && acked {
                assert!(
                    state.structured,
                    "SET_META_CONTEXT needs structured replies"
                );
                state.allocation = !replies.is_empty();
            }
        }
        _ => assert!(!acked, "option {option} is not supported, yet ACKed"),
    }
    None
}

/// An acknowledged INFO or GO: named this export, and answered its size,
/// flags and block sizes (and name or description when asked for).
fn check_info(replies: &[Reply<'_>], data: &[u8], export: &ExportInfo, structured: bool) {
    let name_len = u32::from_be_bytes(data[..4].try_into().expect("4 bytes")) as usize;
    let name = &data[4..4 + name_len];
    assert!(export.matches(name), "INFO/GO ACKed for export {name:?}");
    let item = |kind: u16| {
        replies
            .iter()
            .find(|(_, d)| d.starts_with(&kind.to_be_bytes()))
            .map(|(_, d)| &d[2..])
    };
    let mut ex = export.size_bytes.to_be_bytes().to_vec();
    ex.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
    assert_eq!(item(info::EXPORT), Some(&ex[..]), "INFO_EXPORT");
    assert_eq!(
        item(info::BLOCK_SIZE).map(<[u8]>::len),
        Some(12),
        "INFO_BLOCK_SIZE"
    );
    let requests = &data[4 + name_len + 2..];
    let asked = |kind: u16| requests.chunks(2).any(|c| c == kind.to_be_bytes());
    if asked(info::NAME) {
        assert_eq!(item(info::NAME), Some(export.name.as_bytes()), "INFO_NAME");
    }
    if asked(info::DESCRIPTION) {
        let d = export.description.as_bytes();
        assert_eq!(item(info::DESCRIPTION), Some(d), "INFO_DESCRIPTION");
    }
}
