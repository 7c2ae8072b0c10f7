//! A hostile client's handshake stream, built from choice bytes (the way
//! the `arbitrary` crate builds values): each decision (client flags, the
//! next option, a name, whether a length is right) reads a few bytes, and
//! once the bytes run out every decision takes its zero, shortest answer.
//! Fewer or smaller choice bytes therefore give a shorter, simpler stream,
//! so proptest's shrinking of the bytes (and libFuzzer's mutation of them)
//! works on the stream's structure, and most streams get past the flags
//! into the options, where the parsing is.
//!
//! A stream: client flags (mostly valid), rarely a flood of options past
//! `OPTIONS_MAX`, then options drawn from every option the server knows
//! and unknown ones, each with data of its own shape (INFO/GO requests,
//! metadata context queries, names of this export and of others), a wrong
//! magic now and then, outer and inner lengths right, off by a little, or
//! anything (4 GiB included); then bytes of the transmission phase; the
//! whole cut at a chosen point in one stream of four.

use crate::nbd::proto::{FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, IHAVEOPT, opt};

/// Choice bytes, read front to back; zero once exhausted.
#[derive(Debug)]
pub struct Choices<'a>(&'a [u8]);

impl<'a> Choices<'a> {
    /// Choices read from `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self(bytes)
    }

    /// Whether every byte has been used.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    fn u32(&mut self) -> u32 {
        u32::from_be_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    /// A number below `n` (`n` at most 256).
    fn below(&mut self, n: u32) -> u32 {
        debug_assert!((1..=256).contains(&n));
        u32::from(self.byte()) % n
    }

    /// The index of an arm chosen by weight (weights sum to at most 256);
    /// exhausted choices pick the first arm.
    fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u32 = weights.iter().sum();
        let mut pick = self.below(total);
        for (i, w) in weights.iter().enumerate() {
            if pick < *w {
                return i;
            }
            pick -= w;
        }
        unreachable!("pick < total")
    }

    /// Up to `max` raw bytes.
    fn bytes(&mut self, max: u32) -> Vec<u8> {
        let n = self.below(max + 1) as usize;
        (0..n).map(|_| self.byte()).collect()
    }

    /// A length field for data of `valid` bytes: mostly right.
    fn length(&mut self, valid: usize) -> u32 {
        let valid = valid as u32;
        match self.weighted(&[24, 3, 2, 1]) {
            0 => valid,
            1 => valid.wrapping_add_signed(i32::from(self.byte() as i8)),
            2 => self.u32(),
            _ => u32::MAX,
        }
    }

    fn name(&mut self) -> Vec<u8> {
        match self.weighted(&[3, 3, 1, 1]) {
            0 => Vec::new(),
            1 => b"rebound".to_vec(),
            2 => b"other".to_vec(),
            _ => self.bytes(12),
        }
    }
}

/// INFO and GO data: name length, name, request count, requests.
fn info_data(c: &mut Choices<'_>) -> Vec<u8> {
    let name = c.name();
    let mut d = c.length(name.len()).to_be_bytes().to_vec();
    d.extend_from_slice(&name);
    let requests: Vec<u16> = (0..c.below(5))
        .map(|_| {
            if c.below(5) == 0 {
                u16::from_be_bytes([c.byte(), c.byte()])
            } else {
                c.below(5) as u16
            }
        })
        .collect();
    d.extend_from_slice(&(c.length(requests.len()) as u16).to_be_bytes());
    for r in requests {
        d.extend_from_slice(&r.to_be_bytes());
    }
    d
}

/// LIST/SET_META_CONTEXT data: name length, name, query count, queries.
fn meta_data(c: &mut Choices<'_>) -> Vec<u8> {
    let name = c.name();
    let mut d = c.length(name.len()).to_be_bytes().to_vec();
    d.extend_from_slice(&name);
    let queries = c.below(4) as usize;
    d.extend_from_slice(&c.length(queries).to_be_bytes());
    for _ in 0..queries {
        let query = match c.weighted(&[3, 1, 1, 1]) {
            0 => b"base:allocation".to_vec(),
            1 => b"base:".to_vec(),
            2 => b"qemu:dirty-bitmap:x".to_vec(),
            _ => c.bytes(20),
        };
        d.extend_from_slice(&c.length(query.len()).to_be_bytes());
        d.extend_from_slice(&query);
    }
    d
}

/// Data for an option that takes none (mostly none).
fn no_data(c: &mut Choices<'_>) -> Vec<u8> {
    if c.below(5) == 0 {
        c.bytes(16)
    } else {
        Vec::new()
    }
}

/// One option: magic, code, declared length, data.
fn option(c: &mut Choices<'_>, out: &mut Vec<u8>) {
    // Weights: STRUCTURED_REPLY, EXPORT_NAME, ABORT, LIST, INFO, GO,
    // LIST_META_CONTEXT, SET_META_CONTEXT, STARTTLS, unknown.
    let (code, data) = match c.weighted(&[3, 1, 1, 2, 3, 2, 3, 3, 1, 1]) {
        0 => (opt::STRUCTURED_REPLY, no_data(c)),
        1 => (opt::EXPORT_NAME, c.name()),
        2 => (opt::ABORT, no_data(c)),
        3 => (opt::LIST, no_data(c)),
        4 => (opt::INFO, info_data(c)),
        5 => (opt::GO, info_data(c)),
        6 => (opt::LIST_META_CONTEXT, meta_data(c)),
        7 => (opt::SET_META_CONTEXT, meta_data(c)),
        8 => (opt::STARTTLS, no_data(c)),
        _ => (c.u32(), c.bytes(16)),
    };
    let magic = if c.below(40) == 39 {
        u64::from(c.u32()) << 32 | u64::from(c.u32())
    } else {
        IHAVEOPT
    };
    out.extend_from_slice(&magic.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&c.length(data.len()).to_be_bytes());
    out.extend_from_slice(&data);
}

/// The client stream `choices` describe (see the module docs).
pub fn client_stream(choices: &[u8]) -> Vec<u8> {
    let mut c = Choices::new(choices);
    let cut = (c.below(4) == 3).then(|| u16::from_be_bytes([c.byte(), c.byte()]));
    let flags = if c.below(24) == 23 {
        c.u32()
    } else {
        c.below((FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) + 1)
    };
    let mut s = flags.to_be_bytes().to_vec();
    if c.below(200) == 199 {
        for _ in 0..(250 + c.below(10)) {
            s.extend_from_slice(&IHAVEOPT.to_be_bytes());
            s.extend_from_slice(&opt::STRUCTURED_REPLY.to_be_bytes());
            s.extend_from_slice(&0u32.to_be_bytes());
        }
    }
    for _ in 0..12 {
        if c.is_empty() {
            break;
        }
        option(&mut c, &mut s);
    }
    // Whatever is left: the first bytes of the transmission phase.
    s.extend_from_slice(c.0);
    if let Some(at) = cut {
        s.truncate(usize::from(at) % (s.len() + 1));
    }
    s
}
