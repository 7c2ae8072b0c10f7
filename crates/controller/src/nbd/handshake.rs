//! The fixed newstyle handshake (proto.md "Fixed newstyle negotiation",
//! "Option types"): options EXPORT_NAME, ABORT, LIST, INFO, GO,
//! STRUCTURED_REPLY, and LIST_META_CONTEXT / SET_META_CONTEXT with the one
//! context `base:allocation` (for BLOCK_STATUS), and STARTTLS.
//!
//! TLS ([`TlsMode`]; proto.md "TLS support"): off, STARTTLS is answered
//! `NBD_REP_ERR_UNSUP` like any unknown option. On or required, STARTTLS
//! is acknowledged and negotiation stops with [`Outcome::StartTls`]; this
//! module never touches TLS itself: the caller runs the TLS handshake on
//! the socket and calls [`resume_after_tls`] on the secured stream, which
//! haggles again from a clean slate (no greeting, no client flags; nothing
//! agreed before TLS is kept). Required, every option before TLS except
//! STARTTLS and ABORT is answered `NBD_REP_ERR_TLS_REQD`, and EXPORT_NAME
//! (no error reply exists for it) ends the connection.
//!
//! ```text
//!   greeting, client flags
//!        |
//!   haggle (plaintext) --STARTTLS, ACK--> [caller: TLS handshake]
//!        |                                      |
//!        | GO / EXPORT_NAME              haggle (secured) --STARTTLS--> ERR_INVALID
//!        v                                      | GO / EXPORT_NAME
//!   transmission (plaintext)             transmission (over TLS)
//! ```
//!
//! The export is served under the name `""` (the default export) and under
//! its listed name (`--export-name`, default `rebound`), which LIST
//! returns with its description.
//!
//! Metadata context requests (LIST_META_CONTEXT, SET_META_CONTEXT):
//! ```text
//!   u32 export name length, export name, u32 query count,
//!   per query: u32 length, query (e.g. "base:allocation" or "base:")
//! ```
//! each matching context is answered `NBD_REP_META_CONTEXT` (u32 id, 0 for
//! LIST; name), then `NBD_REP_ACK`. SET replaces the previous selection,
//! and needs structured replies negotiated first.
//!
//! Bad input never crashes the server: a wrong magic, unknown client flags,
//! an option over [`OPTION_DATA_MAX`] bytes or more than [`OPTIONS_MAX`]
//! options end this connection (a hard disconnect, as the protocol allows);
//! malformed option data gets `NBD_REP_ERR_INVALID` and negotiation goes on;
//! an unknown export gets `NBD_REP_ERR_UNKNOWN` (or, for EXPORT_NAME, which
//! cannot report errors, a hard disconnect).

use std::io::{self, Read, Write};

use super::proto::{
    BASE_ALLOCATION, BASE_ALLOCATION_ID, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES,
    FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES, IHAVEOPT, NBDMAGIC, OPTION_REPLY_MAGIC, info, opt, rep,
    tflags,
};

/// Largest option payload accepted (NBD strings are at most 4 KiB).
pub const OPTION_DATA_MAX: u32 = 64 * 1024;
/// Most options accepted in one negotiation.
pub const OPTIONS_MAX: u32 = 256;

/// What the server tells clients about its export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Canonical name (listed by LIST; "" is accepted as an alias).
    pub name: String,
    /// Human-readable description.
    pub description: String,
    /// Export size.
    pub size_bytes: u64,
    /// Minimum block size (alignment of offsets and lengths).
    pub min_block_bytes: u32,
    /// Preferred block size.
    pub preferred_block_bytes: u32,
    /// Largest READ or WRITE payload.
    pub max_payload_bytes: u32,
    /// Writes, trims and zeroes are refused (`EPERM`).
    pub read_only: bool,
}

impl ExportInfo {
    /// Whether `requested` names this export ("" is the default export).
    pub fn matches(&self, requested: &[u8]) -> bool {
        requested.is_empty() || requested == self.name.as_bytes()
    }

    /// Transmission flags for a session.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let mut flags = tflags::HAS_FLAGS
            | tflags::SEND_FLUSH
            | tflags::SEND_FUA
            | tflags::SEND_TRIM
            | tflags::SEND_WRITE_ZEROES
            | tflags::CAN_MULTI_CONN
            | tflags::SEND_CACHE
            | tflags::SEND_FAST_ZERO;
        if structured {
            flags |= tflags::SEND_DF;
        }
        if self.read_only {
            flags |= tflags::READ_ONLY;
        }
        flags
    }
}

/// The result of a successful negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The `base:allocation` context was selected: BLOCK_STATUS answers.
    pub allocation: bool,
}

/// How negotiation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Enter the transmission phase.
    Transmission(Negotiated),
    /// The client aborted (NBD_OPT_ABORT) or listed and left.
    Aborted,
    /// STARTTLS was acknowledged: the caller runs the TLS server handshake
    /// on the raw socket, then [`resume_after_tls`] on the secured stream.
    StartTls {
        /// The client's NBD_FLAG_C_NO_ZEROES, from before TLS.
        no_zeroes: bool,
    },
}

/// Whether the handshake offers TLS (`tls` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// STARTTLS is answered `NBD_REP_ERR_UNSUP`.
    #[default]
    Off,
    /// STARTTLS is accepted; plaintext clients are served too.
    On,
    /// Nothing but STARTTLS and ABORT is answered before TLS
    /// (`NBD_REP_ERR_TLS_REQD`), as nbdkit's `--tls=require`.
    Require,
}

impl TlsMode {
    /// The valid values, as written in the TOML file and the flag.
    pub const NAMES: &'static [&'static str] = &["off", "on", "require"];
}

impl std::str::FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "on" => Ok(Self::On),
            "require" => Ok(Self::Require),
            other => Err(format!(
                "unknown TLS mode {other:?} (expected one of: {})",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// Why negotiation ended without a session (the connection is closed).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed or the client hung up.
    #[error("connection failed during the handshake: {0}")]
    Io(#[from] io::Error),
    /// Client flags the server did not offer.
    #[error("client sent unknown flags {0:#x}")]
    BadClientFlags(u32),
    /// An option without the IHAVEOPT magic.
    #[error("option with bad magic {0:#x}")]
    BadOptionMagic(u64),
    /// An option payload over [`OPTION_DATA_MAX`].
    #[error("option {option} carries {length} bytes, over the {OPTION_DATA_MAX}-byte limit")]
    OptionTooLarge {
        /// The option.
        option: u32,
        /// Its declared length.
        length: u32,
    },
    /// More than [`OPTIONS_MAX`] options.
    #[error("more than {OPTIONS_MAX} options in one negotiation")]
    TooManyOptions,
    /// NBD_OPT_EXPORT_NAME with a name we do not serve.
    #[error("NBD_OPT_EXPORT_NAME for unknown export {0:?}")]
    UnknownExport(String),
    /// The server refused to serve the client (why).
    #[error("refused: {0}")]
    Refused(String),
    /// NBD_OPT_EXPORT_NAME before STARTTLS on a server that requires TLS
    /// (EXPORT_NAME has no error reply: the connection is closed).
    #[error("NBD_OPT_EXPORT_NAME before STARTTLS on a server that requires TLS")]
    TlsRequired,
}

fn read_u32(s: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(s: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn reply(s: &mut impl Write, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    s.write_all(&out)
}

fn error_reply(s: &mut impl Write, option: u32, kind: u32, message: &str) -> io::Result<()> {
    reply(s, option, kind, message.as_bytes())
}

/// Run the server side of the handshake on `s`, without TLS.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
) -> Result<Outcome, HandshakeError> {
    negotiate_with(s, export, &mut || Ok(()))
}

/// [`negotiate`], asking `admit` before a client enters the transmission
/// phase (GO or EXPORT_NAME for a served export): an `Err` (why) refuses
/// GO with `NBD_REP_ERR_POLICY` and that message (negotiation goes on; the
/// client may retry or leave) and ends an EXPORT_NAME negotiation (it has
/// no error reply). The listener uses it to take a served-client slot.
pub fn negotiate_with<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Outcome, HandshakeError> {
    negotiate_tls(s, export, TlsMode::Off, admit)
}

/// [`negotiate_with`] under a TLS mode: with [`TlsMode::On`] or
/// [`TlsMode::Require`], STARTTLS is acknowledged and negotiation returns
/// [`Outcome::StartTls`]; the caller then runs the TLS server handshake on
/// the raw socket and continues with [`resume_after_tls`] on the secured
/// stream. Under [`TlsMode::Require`] every option before it but STARTTLS
/// and ABORT is answered `NBD_REP_ERR_TLS_REQD`, and EXPORT_NAME (which has
/// no error reply) ends the connection ([`HandshakeError::TlsRequired`]).
pub fn negotiate_tls<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
    tls: TlsMode,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Outcome, HandshakeError> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&hello)?;
    s.flush()?;
    let client_flags = read_u32(s)?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::BadClientFlags(client_flags));
    }
    let mut st = Haggle::new(client_flags & FLAG_C_NO_ZEROES != 0, tls, false);
    haggle(s, export, &mut st, admit)
}

/// Option haggling again on a stream just secured by TLS, after
/// [`Outcome::StartTls`]: no greeting is sent and no client flags are read
/// (the client sent them before TLS; `no_zeroes` is what they said). As
/// the protocol requires, nothing agreed before TLS carries over
/// (structured replies, metadata contexts); a second STARTTLS is
/// `NBD_REP_ERR_INVALID`. Options are counted afresh against
/// [`OPTIONS_MAX`], so one connection haggles at most twice that many.
pub fn resume_after_tls<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
    no_zeroes: bool,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Outcome, HandshakeError> {
    let mut st = Haggle::new(no_zeroes, TlsMode::Require, true);
    haggle(s, export, &mut st, admit)
}

/// What option haggling has agreed so far.
struct Haggle {
    no_zeroes: bool,
    tls: TlsMode,
    /// TLS is on: this haggling runs over the secured stream.
    secured: bool,
    structured: bool,
    allocation: bool,
}

impl Haggle {
    fn new(no_zeroes: bool, tls: TlsMode, secured: bool) -> Self {
        Self {
            no_zeroes,
            tls,
            secured,
            structured: false,
            allocation: false,
        }
    }

    fn negotiated(&self) -> Negotiated {
        Negotiated {
            structured: self.structured,
            allocation: self.allocation && self.structured,
        }
    }

    /// TLS must come first and has not.
    fn tls_missing(&self) -> bool {
        self.tls == TlsMode::Require && !self.secured
    }
}

/// Read and answer options until one ends the haggling.
fn haggle<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
    st: &mut Haggle,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Outcome, HandshakeError> {
    for _ in 0..OPTIONS_MAX {
        let magic = read_u64(s)?;
        if magic != IHAVEOPT {
            return Err(HandshakeError::BadOptionMagic(magic));
        }
        let option = read_u32(s)?;
        let length = read_u32(s)?;
        if length > OPTION_DATA_MAX {
            return Err(HandshakeError::OptionTooLarge { option, length });
        }
        let mut data = vec![0u8; length as usize];
        s.read_exact(&mut data)?;
        match one_option(s, export, st, option, &data, admit)? {
            Step::Continue => s.flush()?,
            Step::Go => {
                s.flush()?;
                return Ok(Outcome::Transmission(st.negotiated()));
            }
            // Flushed already where it matters (EXPORT_NAME, STARTTLS);
            // an ABORT's client may be gone.
            Step::End(outcome) => return Ok(outcome),
        }
    }
    Err(HandshakeError::TooManyOptions)
}

/// Answer one option.
fn one_option<S: Read + Write>(
    s: &mut S,
    export: &ExportInfo,
    st: &mut Haggle,
    option: u32,
    data: &[u8],
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Result<Step, HandshakeError> {
    if st.tls_missing() && option != opt::STARTTLS && option != opt::ABORT {
        if option == opt::EXPORT_NAME {
            return Err(HandshakeError::TlsRequired);
        }
        error_reply(s, option, rep::ERR_TLS_REQD, TLS_REQUIRED_MESSAGE)?;
        return Ok(Step::Continue);
    }
    Ok(match option {
        opt::EXPORT_NAME => {
            let negotiated = st.negotiated();
            if export.matches(data) {
                admit().map_err(HandshakeError::Refused)?;
            }
            let outcome = export_name(s, export, data, st.no_zeroes, negotiated)?;
            Step::End(outcome)
        }
        opt::ABORT => {
            // The client may already be gone; a failed ACK is fine.
            let _ = reply(s, option, rep::ACK, &[]);
            Step::End(Outcome::Aborted)
        }
        opt::LIST => list(s, export, data),
        opt::INFO | opt::GO => info_or_go(s, export, option, data, st.structured, admit)?,
        opt::STRUCTURED_REPLY => {
            if data.is_empty() {
                st.structured = true;
                reply(s, option, rep::ACK, &[])?;
            } else {
                let msg = "STRUCTURED_REPLY takes no data";
                error_reply(s, option, rep::ERR_INVALID, msg)?;
            }
            Step::Continue
        }
        opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
            meta_context(s, export, option, data, st.structured, &mut st.allocation)?
        }
        opt::STARTTLS => start_tls(s, st, data)?,
        _ => {
            error_reply(s, option, rep::ERR_UNSUP, "option not supported")?;
            Step::Continue
        }
    })
}

/// The message of `NBD_REP_ERR_TLS_REQD`.
const TLS_REQUIRED_MESSAGE: &str =
    "this server requires TLS: negotiate NBD_OPT_STARTTLS first (an nbds:// URI, or tls-creds)";

/// NBD_OPT_STARTTLS: refused when TLS is off, already on, or given data;
/// otherwise acknowledged, and the TLS handshake comes next.
fn start_tls<S: Write>(s: &mut S, st: &Haggle, data: &[u8]) -> io::Result<Step> {
    let refusal = if st.tls == TlsMode::Off {
        Some((rep::ERR_UNSUP, "TLS is not enabled on this server (--tls)"))
    } else if st.secured {
        Some((rep::ERR_INVALID, "TLS is already negotiated"))
    } else if !data.is_empty() {
        Some((rep::ERR_INVALID, "STARTTLS takes no data"))
    } else {
        None
    };
    if let Some((kind, msg)) = refusal {
        error_reply(s, opt::STARTTLS, kind, msg)?;
        return Ok(Step::Continue);
    }
    reply(s, opt::STARTTLS, rep::ACK, &[])?;
    // Nothing more is sent in plaintext: the TLS handshake comes next.
    s.flush()?;
    Ok(Step::End(Outcome::StartTls {
        no_zeroes: st.no_zeroes,
    }))
}

enum Step {
    Continue,
    /// GO succeeded: enter transmission with what was agreed.
    Go,
    /// Haggling is over (EXPORT_NAME, ABORT, STARTTLS).
    End(Outcome),
}

fn export_name<S: Write>(
    s: &mut S,
    export: &ExportInfo,
    name: &[u8],
    no_zeroes: bool,
    negotiated: Negotiated,
) -> Result<Outcome, HandshakeError> {
    if !export.matches(name) {
        return Err(HandshakeError::UnknownExport(
            String::from_utf8_lossy(name).into_owned(),
        ));
    }
    let mut out = Vec::with_capacity(134);
    out.extend_from_slice(&export.size_bytes.to_be_bytes());
    out.extend_from_slice(
        &export
            .transmission_flags(negotiated.structured)
            .to_be_bytes(),
    );
    if !no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
    s.write_all(&out)?;
    s.flush()?;
    Ok(Outcome::Transmission(negotiated))
}

/// Parse LIST/SET_META_CONTEXT data: the export name and the queries.
fn parse_meta_request(data: &[u8]) -> Option<(&[u8], Vec<&[u8]>)> {
    let be32 = |b: &[u8], at: usize| -> Option<usize> {
        Some(u32::from_be_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?) as usize)
    };
    let name_len = be32(data, 0)?;
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let mut at = 4 + name_len;
    let count = be32(data, at)?;
    at += 4;
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = be32(data, at)?;
        queries.push(data.get(at + 4..(at + 4).checked_add(len)?)?);
        at += 4 + len;
    }
    (at == data.len()).then_some((name, queries))
}

/// LIST_META_CONTEXT and SET_META_CONTEXT: `base:allocation` is the one
/// context; SET records whether it is selected in `allocation`.
fn meta_context<S: Write>(
    s: &mut S,
    export: &ExportInfo,
    option: u32,
    data: &[u8],
    structured: bool,
    allocation: &mut bool,
) -> io::Result<Step> {
    let Some((name, queries)) = parse_meta_request(data) else {
        error_reply(
            s,
            option,
            rep::ERR_INVALID,
            "malformed metadata context request",
        )?;
        return Ok(Step::Continue);
    };
    if !export.matches(name) {
        let msg = format!("unknown export {:?}", String::from_utf8_lossy(name));
        error_reply(s, option, rep::ERR_UNKNOWN, &msg)?;
        return Ok(Step::Continue);
    }
    let set = option == opt::SET_META_CONTEXT;
    if set && !structured {
        let msg = "SET_META_CONTEXT needs structured replies (NBD_OPT_STRUCTURED_REPLY) first";
        error_reply(s, option, rep::ERR_INVALID, msg)?;
        return Ok(Step::Continue);
    }
    let wanted = if queries.is_empty() {
        // LIST with no query lists every context; SET with none selects none.
        !set
    } else {
        queries
            .iter()
            .any(|q| *q == BASE_ALLOCATION.as_bytes() || *q == b"base:")
    };
    if set {
        *allocation = wanted;
    }
    if wanted {
        let id = if set { BASE_ALLOCATION_ID } else { 0 };
        let mut payload = id.to_be_bytes().to_vec();
        payload.extend_from_slice(BASE_ALLOCATION.as_bytes());
        reply(s, option, rep::META_CONTEXT, &payload)?;
    }
    reply(s, option, rep::ACK, &[])?;
    Ok(Step::Continue)
}

fn list<S: Write>(s: &mut S, export: &ExportInfo, data: &[u8]) -> Step {
    let result = if !data.is_empty() {
        error_reply(s, opt::LIST, rep::ERR_INVALID, "LIST takes no data")
    } else {
        let name = export.name.as_bytes();
        let mut entry = Vec::with_capacity(4 + name.len() + export.description.len());
        entry.extend_from_slice(&(name.len() as u32).to_be_bytes());
        entry.extend_from_slice(name);
        entry.extend_from_slice(export.description.as_bytes());
        reply(s, opt::LIST, rep::SERVER, &entry).and_then(|()| reply(s, opt::LIST, rep::ACK, &[]))
    };
    match result {
        Ok(()) => Step::Continue,
        // The next read will report the broken connection.
        Err(_) => Step::Continue,
    }
}

/// Parse INFO/GO data: name length, name, count, info requests.
fn parse_info_request(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let rest = &data[4 + name_len..];
    let count = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
    let items = rest.get(2..)?;
    if items.len() != count * 2 {
        return None;
    }
    let requests = items
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Some((name, requests))
}

fn info_item(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + payload.len());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn info_or_go<S: Write>(
    s: &mut S,
    export: &ExportInfo,
    option: u32,
    data: &[u8],
    structured: bool,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> io::Result<Step> {
    let Some((name, requests)) = parse_info_request(data) else {
        error_reply(s, option, rep::ERR_INVALID, "malformed INFO/GO request")?;
        return Ok(Step::Continue);
    };
    if !export.matches(name) {
        let msg = format!(
            "unknown export {:?}; this server exports \"\" and {:?}",
            String::from_utf8_lossy(name),
            export.name
        );
        error_reply(s, option, rep::ERR_UNKNOWN, &msg)?;
        return Ok(Step::Continue);
    }
    if option == opt::GO
        && let Err(why) = admit()
    {
        error_reply(s, option, rep::ERR_POLICY, &why)?;
        return Ok(Step::Continue);
    }
    let mut ex = Vec::with_capacity(10);
    ex.extend_from_slice(&export.size_bytes.to_be_bytes());
    ex.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
    reply(s, option, rep::INFO, &info_item(info::EXPORT, &ex))?;
    // Our constraints are not the defaults, so they are always sent.
    let mut bs = Vec::with_capacity(12);
    bs.extend_from_slice(&export.min_block_bytes.to_be_bytes());
    bs.extend_from_slice(&export.preferred_block_bytes.to_be_bytes());
    bs.extend_from_slice(&export.max_payload_bytes.to_be_bytes());
    reply(s, option, rep::INFO, &info_item(info::BLOCK_SIZE, &bs))?;
    if requests.contains(&info::NAME) {
        reply(
            s,
            option,
            rep::INFO,
            &info_item(info::NAME, export.name.as_bytes()),
        )?;
    }
    if requests.contains(&info::DESCRIPTION) {
        let d = export.description.as_bytes();
        reply(s, option, rep::INFO, &info_item(info::DESCRIPTION, d))?;
    }
    reply(s, option, rep::ACK, &[])?;
    Ok(if option == opt::GO {
        Step::Go
    } else {
        Step::Continue
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted client: reads come from `input`, writes go to `output`.
    struct Script {
        input: io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Script {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn export() -> ExportInfo {
        ExportInfo {
            name: "rebound".into(),
            description: "test".into(),
            size_bytes: 1 << 20,
            min_block_bytes: 4096,
            preferred_block_bytes: 4096,
            max_payload_bytes: 1 << 25,
            read_only: false,
        }
    }

    fn option(code: u32, data: &[u8]) -> Vec<u8> {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&code.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    fn go(name: &str, infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    fn run(client_flags: u32, options: &[Vec<u8>]) -> (Result<Outcome, HandshakeError>, Vec<u8>) {
        let mut input = client_flags.to_be_bytes().to_vec();
        for o in options {
            input.extend_from_slice(o);
        }
        let mut s = Script {
            input: io::Cursor::new(input),
            output: Vec::new(),
        };
        let r = negotiate(&mut s, &export());
        (r, s.output)
    }

    /// Option replies after the 18-byte greeting: (option, type, data).
    fn replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        replies_from(&out[18..])
    }

    /// Option replies from the start of `b` (a resumed negotiation sends
    /// no greeting).
    fn replies_from(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while b.len() >= 20 {
            assert_eq!(&b[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
            let o = u32::from_be_bytes(b[8..12].try_into().unwrap());
            let t = u32::from_be_bytes(b[12..16].try_into().unwrap());
            let n = u32::from_be_bytes(b[16..20].try_into().unwrap()) as usize;
            v.push((o, t, b[20..20 + n].to_vec()));
            b = &b[20 + n..];
        }
        v
    }

    #[test]
    fn go_with_structured_replies_enters_transmission_with_block_sizes() {
        let both = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
        let (r, out) = run(
            both,
            &[
                option(opt::STRUCTURED_REPLY, &[]),
                option(opt::GO, &go("", &[info::BLOCK_SIZE, info::NAME])),
            ],
        );
        assert_eq!(
            r.unwrap(),
            Outcome::Transmission(Negotiated {
                structured: true,
                allocation: false
            })
        );
        let reps = replies(&out);
        assert_eq!(reps[0], (opt::STRUCTURED_REPLY, rep::ACK, vec![]));
        let export_info = &reps[1].2;
        assert_eq!(&export_info[0..2], &info::EXPORT.to_be_bytes());
        assert_eq!(&export_info[2..10], &(1u64 << 20).to_be_bytes());
        let flags = u16::from_be_bytes([export_info[10], export_info[11]]);
        assert_ne!(
            flags & tflags::SEND_DF,
            0,
            "DF offered with structured replies"
        );
        assert!(
            reps.iter()
                .any(|r| r.2.starts_with(&info::BLOCK_SIZE.to_be_bytes()))
        );
        assert!(
            reps.iter()
                .any(|r| r.2 == [&info::NAME.to_be_bytes()[..], b"rebound"].concat())
        );
        assert_eq!(reps.last().unwrap().1, rep::ACK);
    }

    #[test]
    fn unknown_export_gets_err_unknown_and_negotiation_continues() {
        let (r, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::GO, &go("other", &[])),
                option(opt::GO, &go("rebound", &[])),
            ],
        );
        assert!(matches!(r.unwrap(), Outcome::Transmission(_)));
        let reps = replies(&out);
        assert_eq!(reps[0].1, rep::ERR_UNKNOWN);
        assert!(String::from_utf8_lossy(&reps[0].2).contains("other"));
    }

    #[test]
    fn malformed_go_data_gets_err_invalid() {
        let mut bad = go("rebound", &[info::NAME]);
        bad.pop();
        let (r, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::GO, &bad), option(opt::ABORT, &[])],
        );
        assert_eq!(r.unwrap(), Outcome::Aborted);
        let reps = replies(&out);
        assert_eq!(reps[0].1, rep::ERR_INVALID);
        assert_eq!(reps[1], (opt::ABORT, rep::ACK, vec![]));
    }

    #[test]
    fn name_length_past_the_data_is_invalid_not_a_panic() {
        let mut bad = u32::MAX.to_be_bytes().to_vec();
        bad.extend_from_slice(b"xx");
        let (_, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::INFO, &bad), option(opt::ABORT, &[])],
        );
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    }

    #[test]
    fn unknown_and_tls_options_are_unsupported() {
        let (_, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::STARTTLS, &[]),
                option(999, b"junk"),
                option(opt::SET_META_CONTEXT, b"xxxx"),
                option(opt::ABORT, &[]),
            ],
        );
        let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
        assert_eq!(
            kinds,
            [rep::ERR_UNSUP, rep::ERR_UNSUP, rep::ERR_INVALID, rep::ACK]
        );
    }

    #[test]
    fn list_names_the_export_then_acks() {
        let (_, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::LIST, &[]), option(opt::ABORT, &[])],
        );
        let reps = replies(&out);
        assert_eq!(reps[0].1, rep::SERVER);
        assert_eq!(&reps[0].2[4..11], b"rebound");
        assert_eq!(reps[1].1, rep::ACK);
        let (_, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::LIST, b"x"), option(opt::ABORT, &[])],
        );
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    }

    #[test]
    fn export_name_sends_size_flags_and_zeroes_unless_no_zeroes() {
        for (flags, tail) in [
            (FLAG_C_FIXED_NEWSTYLE, 124),
            (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 0),
        ] {
            let (r, out) = run(flags, &[option(opt::EXPORT_NAME, b"")]);
            assert!(matches!(r.unwrap(), Outcome::Transmission(_)));
            assert_eq!(out.len(), 18 + 8 + 2 + tail);
        }
        let (r, _) = run(FLAG_C_FIXED_NEWSTYLE, &[option(opt::EXPORT_NAME, b"nope")]);
        assert!(matches!(r, Err(HandshakeError::UnknownExport(n)) if n == "nope"));
    }

    #[test]
    fn protocol_violations_end_the_connection() {
        let (r, _) = run(1 << 5, &[]);
        assert!(matches!(r, Err(HandshakeError::BadClientFlags(_))));
        let mut bad_magic = option(opt::LIST, &[]);
        bad_magic[0] ^= 0xff;
        let (r, _) = run(FLAG_C_FIXED_NEWSTYLE, &[bad_magic]);
        assert!(matches!(r, Err(HandshakeError::BadOptionMagic(_))));
        let mut huge = IHAVEOPT.to_be_bytes().to_vec();
        huge.extend_from_slice(&opt::GO.to_be_bytes());
        huge.extend_from_slice(&(OPTION_DATA_MAX + 1).to_be_bytes());
        let (r, _) = run(FLAG_C_FIXED_NEWSTYLE, &[huge]);
        assert!(matches!(r, Err(HandshakeError::OptionTooLarge { .. })));
        let many: Vec<_> = (0..=OPTIONS_MAX)
            .map(|_| option(opt::STRUCTURED_REPLY, &[]))
            .collect();
        let (r, _) = run(FLAG_C_FIXED_NEWSTYLE, &many);
        assert!(matches!(r, Err(HandshakeError::TooManyOptions)));
        // A client that hangs up mid-option.
        let mut cut = option(opt::GO, &go("", &[]));
        cut.truncate(20);
        let (r, _) = run(FLAG_C_FIXED_NEWSTYLE, &[cut]);
        assert!(matches!(r, Err(HandshakeError::Io(_))));
    }

    fn meta(name: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    #[test]
    fn set_meta_context_selects_base_allocation_after_structured_replies() {
        let (r, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::STRUCTURED_REPLY, &[]),
                option(opt::LIST_META_CONTEXT, &meta("", &[])),
                option(
                    opt::SET_META_CONTEXT,
                    &meta("rebound", &["qemu:dirty-bitmap:x", "base:allocation"]),
                ),
                option(opt::GO, &go("", &[])),
            ],
        );
        assert_eq!(
            r.unwrap(),
            Outcome::Transmission(Negotiated {
                structured: true,
                allocation: true
            })
        );
        let reps = replies(&out);
        let listed = [&0u32.to_be_bytes()[..], BASE_ALLOCATION.as_bytes()].concat();
        assert_eq!(reps[1], (opt::LIST_META_CONTEXT, rep::META_CONTEXT, listed));
        assert_eq!(reps[2].1, rep::ACK);
        let selected = [
            &BASE_ALLOCATION_ID.to_be_bytes()[..],
            BASE_ALLOCATION.as_bytes(),
        ]
        .concat();
        assert_eq!(
            reps[3],
            (opt::SET_META_CONTEXT, rep::META_CONTEXT, selected)
        );
        assert_eq!(reps[4].1, rep::ACK);
    }

    #[test]
    fn meta_contexts_refuse_unstructured_unknown_exports_and_bad_data() {
        let (r, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::SET_META_CONTEXT, &meta("", &["base:allocation"])),
                option(opt::LIST_META_CONTEXT, &meta("nope", &[])),
                option(opt::LIST_META_CONTEXT, &meta("", &["other:thing"])),
                option(opt::GO, &go("", &[])),
            ],
        );
        assert_eq!(
            r.unwrap(),
            Outcome::Transmission(Negotiated {
                structured: false,
                allocation: false
            })
        );
        let kinds: Vec<u32> = replies(&out).iter().map(|r| r.1).collect();
        // SET before structured replies: invalid; unknown export; a query
        // matching nothing is just an ACK.
        assert_eq!(
            &kinds[..4],
            [rep::ERR_INVALID, rep::ERR_UNKNOWN, rep::ACK, rep::INFO]
        );
        let mut bad = meta("", &["base:allocation"]);
        bad.push(0);
        let (_, out) = run(
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::LIST_META_CONTEXT, &bad),
                option(opt::ABORT, &[]),
            ],
        );
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    }

    #[test]
    fn a_read_only_export_says_so_in_its_transmission_flags() {
        let mut e = export();
        assert_eq!(e.transmission_flags(false) & tflags::READ_ONLY, 0);
        e.read_only = true;
        assert_ne!(e.transmission_flags(false) & tflags::READ_ONLY, 0);
        assert_ne!(e.transmission_flags(true) & tflags::SEND_FAST_ZERO, 0);
        assert_ne!(e.transmission_flags(true) & tflags::SEND_CACHE, 0);
    }

    /// Negotiate under `tls`: the outcome, what the server sent, and how
    /// many of the client's bytes it read.
    fn run_tls(
        tls: TlsMode,
        client_flags: u32,
        options: &[Vec<u8>],
    ) -> (Result<Outcome, HandshakeError>, Vec<u8>, usize) {
        let mut input = client_flags.to_be_bytes().to_vec();
        input.extend(options.concat());
        let mut s = Script {
            input: io::Cursor::new(input),
            output: Vec::new(),
        };
        let r = negotiate_tls(&mut s, &export(), tls, &mut || Ok(()));
        (r, s.output, s.input.position() as usize)
    }

    /// Haggle on a stream just secured (after STARTTLS).
    fn run_resumed(
        no_zeroes: bool,
        options: &[Vec<u8>],
    ) -> (Result<Outcome, HandshakeError>, Vec<u8>) {
        let mut s = Script {
            input: io::Cursor::new(options.concat()),
            output: Vec::new(),
        };
        let r = resume_after_tls(&mut s, &export(), no_zeroes, &mut || Ok(()));
        (r, s.output)
    }

    #[test]
    fn starttls_is_acked_and_nothing_after_it_is_read_in_plaintext() {
        for mode in [TlsMode::On, TlsMode::Require] {
            let before = option(opt::STARTTLS, &[]);
            let after = option(opt::GO, &go("", &[]));
            let flags = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
            let (r, out, read) = run_tls(mode, flags, &[before.clone(), after]);
            assert_eq!(r.unwrap(), Outcome::StartTls { no_zeroes: true });
            assert_eq!(replies(&out), [(opt::STARTTLS, rep::ACK, vec![])]);
            assert_eq!(read, 4 + before.len(), "the GO is left for the TLS layer");
        }
    }

    #[test]
    fn tls_on_still_serves_a_plaintext_client() {
        let (r, _, _) = run_tls(
            TlsMode::On,
            FLAG_C_FIXED_NEWSTYLE,
            &[
                option(opt::STRUCTURED_REPLY, &[]),
                option(opt::GO, &go("", &[])),
            ],
        );
        assert_eq!(
            r.unwrap(),
            Outcome::Transmission(Negotiated {
                structured: true,
                allocation: false
            })
        );
    }

    #[test]
    fn tls_required_refuses_every_option_but_starttls_and_abort_before_tls() {
        let refused = [
            option(opt::LIST, &[]),
            option(opt::INFO, &go("", &[])),
            option(opt::GO, &go("", &[])),
            option(opt::STRUCTURED_REPLY, &[]),
            option(opt::LIST_META_CONTEXT, &meta("", &[])),
            option(999, b"junk"),
        ];
        let mut script = refused.to_vec();
        script.push(option(opt::STARTTLS, &[]));
        let (r, out, _) = run_tls(TlsMode::Require, FLAG_C_FIXED_NEWSTYLE, &script);
        assert_eq!(r.unwrap(), Outcome::StartTls { no_zeroes: false });
        let reps = replies(&out);
        assert_eq!(reps.len(), refused.len() + 1);
        for (i, r) in reps[..refused.len()].iter().enumerate() {
            assert_eq!(r.1, rep::ERR_TLS_REQD, "option {i} answered {r:?}");
            assert!(String::from_utf8_lossy(&r.2).contains("requires TLS"));
        }
        assert_eq!(reps.last().unwrap(), &(opt::STARTTLS, rep::ACK, vec![]));
        // ABORT is still honoured before TLS.
        let (r, out, _) = run_tls(
            TlsMode::Require,
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::ABORT, &[])],
        );
        assert_eq!(r.unwrap(), Outcome::Aborted);
        assert_eq!(replies(&out), [(opt::ABORT, rep::ACK, vec![])]);
    }

    #[test]
    fn export_name_before_tls_closes_a_tls_required_connection() {
        let (r, out, _) = run_tls(
            TlsMode::Require,
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::EXPORT_NAME, b"")],
        );
        assert!(matches!(r, Err(HandshakeError::TlsRequired)), "{r:?}");
        assert_eq!(out.len(), 18, "nothing but the greeting was sent");
    }

    #[test]
    fn starttls_with_data_is_invalid_and_haggling_goes_on() {
        let (r, out, _) = run_tls(
            TlsMode::On,
            FLAG_C_FIXED_NEWSTYLE,
            &[option(opt::STARTTLS, b"x"), option(opt::ABORT, &[])],
        );
        assert_eq!(r.unwrap(), Outcome::Aborted);
        assert_eq!(replies(&out)[0].1, rep::ERR_INVALID);
    }

    #[test]
    fn resumed_haggling_sends_no_greeting_forgets_state_and_refuses_a_second_starttls() {
        // Before TLS the client had structured replies; after it, it asks
        // only GO: nothing carries over.
        let (r, out) = run_resumed(
            true,
            &[option(opt::STARTTLS, &[]), option(opt::GO, &go("", &[]))],
        );
        assert_eq!(
            r.unwrap(),
            Outcome::Transmission(Negotiated {
                structured: false,
                allocation: false
            })
        );
        let reps = replies_from(&out);
        assert_eq!(reps[0].0, opt::STARTTLS);
        assert_eq!(reps[0].1, rep::ERR_INVALID);
        assert_eq!(reps[1].1, rep::INFO);
        assert_eq!(reps.last().unwrap().1, rep::ACK);
        // EXPORT_NAME after TLS honours the no-zeroes flag sent before it.
        for (no_zeroes, tail) in [(false, 124), (true, 0)] {
            let (r, out) = run_resumed(no_zeroes, &[option(opt::EXPORT_NAME, b"rebound")]);
            assert!(matches!(r.unwrap(), Outcome::Transmission(_)));
            assert_eq!(out.len(), 8 + 2 + tail);
        }
    }

    #[test]
    fn tls_modes_parse_from_their_names_only() {
        for (name, mode) in TlsMode::NAMES
            .iter()
            .zip([TlsMode::Off, TlsMode::On, TlsMode::Require])
        {
            assert_eq!(name.parse::<TlsMode>().unwrap(), mode);
        }
        let err = "yes".parse::<TlsMode>().unwrap_err();
        assert!(err.contains("off, on, require"), "{err}");
    }

    /// An option a client might send: a known code or another, with up
    /// to 24 bytes of data.
    fn any_option() -> impl proptest::strategy::Strategy<Value = (u32, Vec<u8>)> {
        use proptest::prelude::*;
        let code = prop_oneof![
            Just(opt::EXPORT_NAME),
            Just(opt::ABORT),
            Just(opt::STARTTLS),
            Just(opt::GO),
            Just(opt::INFO),
            Just(opt::LIST),
            Just(opt::STRUCTURED_REPLY),
            Just(opt::SET_META_CONTEXT),
            0u32..64,
        ];
        (code, proptest::collection::vec(any::<u8>(), 0..24))
    }

    /// Whether `reply` may be sent before TLS by a server requiring it:
    /// TLS required, a STARTTLS with data refused, or (as the last) the
    /// ACK of a STARTTLS or an ABORT.
    fn allowed_before_tls(reply: &(u32, u32, Vec<u8>), last: bool) -> bool {
        let (option, kind) = (reply.0, reply.1);
        let ends = kind == rep::ACK && (option == opt::STARTTLS || option == opt::ABORT);
        kind == rep::ERR_TLS_REQD
            || (option == opt::STARTTLS && kind == rep::ERR_INVALID)
            || (ends && last)
    }

    proptest::proptest! {
        /// Invariants checked, for any options a client sends before TLS
        /// to a server that requires it: nothing but `NBD_REP_ERR_TLS_REQD`
        /// is answered until STARTTLS (ABORT aside, which ends it), no
        /// option reaches transmission, and EXPORT_NAME closes.
        #[test]
        fn before_tls_a_tls_required_server_only_says_tls_required(
            script in proptest::collection::vec(any_option(), 0..12)
        ) {
            let options: Vec<Vec<u8>> = script.iter().map(|(o, d)| option(*o, d)).collect();
            let (r, out, _) = run_tls(TlsMode::Require, FLAG_C_FIXED_NEWSTYLE, &options);
            let reps = replies(&out);
            for (i, reply) in reps.iter().enumerate() {
                let last = i + 1 == reps.len();
                proptest::prop_assert!(allowed_before_tls(reply, last), "{:?} before TLS", reply);
            }
            let first_end = script.iter().position(|(o, d)| {
                *o == opt::EXPORT_NAME || *o == opt::ABORT || (*o == opt::STARTTLS && d.is_empty())
            });
            let ended_right = match first_end.map(|i| script[i].0) {
                Some(opt::EXPORT_NAME) => matches!(r, Err(HandshakeError::TlsRequired)),
                Some(opt::ABORT) => matches!(r, Ok(Outcome::Aborted)),
                Some(_) => matches!(r, Ok(Outcome::StartTls { .. })),
                // The client ran out of bytes: never transmission.
                None => matches!(r, Err(HandshakeError::Io(_))),
            };
            proptest::prop_assert!(ended_right, "ended with {:?}", r);
        }
    }
}
