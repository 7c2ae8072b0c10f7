//! The connection driven in-process: requests written to a socket by
//! hand, framed by `next_request` as a connection thread would, against a
//! controller on a temp dir; and a served connection's reply batching.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::client::{Served, Session, negotiate};

use crate::controller::Controller;
use crate::host::connection::{Connection, Violation, next_request};
use crate::limits::{DISCARD_PAYLOAD_MAX, MAX_PAYLOAD_BYTES, TRACK_BYTES};
use crate::nbd::proto::{NbdError, REQUEST_BYTES, SIMPLE_REPLY_MAGIC, cmd};

/// A controller, a connection to frame for, and the socket a client
/// writes requests to.
struct Framing {
    ctl: Arc<Controller>,
    conn: Arc<Connection>,
    client: TcpStream,
    server: TcpStream,
    _dir: tempfile::TempDir,
}

impl Framing {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = super::temp_config(dir.path());
        let ctl = Controller::open(config).expect("opening the controller");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let conn = Connection::for_tests(Arc::clone(&ctl), server.try_clone().unwrap(), true);
        Self {
            ctl,
            conn,
            client,
            server,
            _dir: dir,
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.client.write_all(bytes).unwrap();
    }

    fn frame(&self) -> Result<Option<Framed>, Violation> {
        let mut raw = [0u8; REQUEST_BYTES];
        let mut r = &self.server;
        next_request(&self.conn, &mut r, &mut raw).map(|framed| {
            framed.map(|(req, slots)| {
                let seen = (
                    req.header.cookie,
                    slots,
                    req.early_error.map(|(e, _)| e),
                    req.payload.len(),
                );
                req.abandon();
                seen
            })
        })
    }
}

impl Drop for Framing {
    fn drop(&mut self) {
        let _ = self.ctl.shutdown();
    }
}

/// What framing made of one request: its cookie, the NVS slots it needs,
/// the error decided before validation, and its payload's length.
type Framed = (u64, u32, Option<NbdError>, usize);

/// A request header as a client writes it.
fn header(kind: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(REQUEST_BYTES);
    h.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h.extend_from_slice(&kind.to_be_bytes());
    h.extend_from_slice(&cookie.to_be_bytes());
    h.extend_from_slice(&offset.to_be_bytes());
    h.extend_from_slice(&length.to_be_bytes());
    h
}

#[test]
fn a_write_is_framed_with_its_payload_and_the_nvs_slots_it_needs() {
    let mut f = Framing::new();
    f.send(&header(cmd::WRITE, 7, 0, 2 * TRACK_BYTES as u32));
    f.send(&vec![0xab; 2 * TRACK_BYTES]);
    f.send(&header(cmd::READ, 8, 4096, 4096));
    assert_eq!(f.frame().unwrap(), Some((7, 2, None, 2 * TRACK_BYTES)));
    assert_eq!(
        f.frame().unwrap(),
        Some((8, 0, None, 0)),
        "the next request follows"
    );
}

#[test]
fn an_unaligned_or_out_of_range_write_reserves_no_slots() {
    let mut f = Framing::new();
    f.send(&header(cmd::WRITE, 1, 512, 4096));
    f.send(&[1u8; 4096]);
    f.send(&header(cmd::WRITE, 2, 16 << 20, 4096));
    f.send(&[2u8; 4096]);
    assert_eq!(f.frame().unwrap(), Some((1, 0, None, 4096)));
    assert_eq!(f.frame().unwrap(), Some((2, 0, None, 4096)));
}

#[test]
fn a_write_over_the_maximum_payload_is_read_and_refused_and_the_stream_goes_on() {
    let mut f = Framing::new();
    let len = MAX_PAYLOAD_BYTES + 4096;
    assert!(len <= DISCARD_PAYLOAD_MAX);
    f.send(&header(cmd::WRITE, 3, 0, len));
    let body = vec![0u8; len as usize];
    let mut client = f.client.try_clone().unwrap();
    let writer = std::thread::spawn(move || client.write_all(&body).unwrap());
    assert_eq!(
        f.frame().unwrap(),
        Some((3, 0, Some(NbdError::Overflow), 0))
    );
    writer.join().unwrap();
    f.send(&header(cmd::FLUSH, 4, 0, 0));
    assert_eq!(f.frame().unwrap(), Some((4, 0, None, 0)));
}

#[test]
fn a_bad_magic_or_a_payload_past_the_discard_bound_ends_the_connection() {
    let mut f = Framing::new();
    let mut bad = header(cmd::READ, 5, 0, 4096);
    bad[0] ^= 0xff;
    f.send(&bad);
    assert!(matches!(f.frame(), Err(Violation::BadMagic)));
    let mut f = Framing::new();
    f.send(&header(cmd::WRITE, 6, 0, DISCARD_PAYLOAD_MAX + 1));
    assert!(
        matches!(f.frame(), Err(Violation::PayloadTooLarge(n)) if n == DISCARD_PAYLOAD_MAX + 1)
    );
}

#[test]
fn disc_and_a_closed_socket_end_the_stream_without_an_error() {
    let mut f = Framing::new();
    f.send(&header(cmd::DISC, 9, 0, 0));
    assert_eq!(f.frame().unwrap(), None);
    let f = Framing::new();
    f.client.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(f.frame().unwrap(), None);
}

/// Read one simple reply to a request of `cookie` and its `data` bytes.
fn simple_reply(s: &mut TcpStream, cookie: u64, data: usize) -> Vec<u8> {
    let mut r = [0u8; 16];
    s.read_exact(&mut r).expect("a reply");
    assert_eq!(r[..4], SIMPLE_REPLY_MAGIC.to_be_bytes(), "a simple reply");
    assert_eq!(r[4..8], [0; 4], "reply to {cookie} is an error");
    assert_eq!(u64::from_be_bytes(r[8..].try_into().unwrap()), cookie);
    let mut d = vec![0u8; data];
    s.read_exact(&mut d).expect("the read's data");
    d
}

/// Requests that reach the server in one read are answered in one
/// `sendmsg`: the first one's reply waits for the others' instead of
/// leaving alone, so the client is woken once per burst, not twice.
#[test]
fn requests_read_together_are_answered_with_one_send() {
    let served = Served::start();
    let mut s = served.connect();
    let session = Session {
        structured: false,
        allocation: false,
        go: true,
    };
    negotiate(&mut s, session);
    // Tracks written first, so the reads hit the cache: a read that had
    // to wait for a device would send what is held before waiting.
    const READS: u64 = 3;
    let data: Vec<u8> = (0..READS as usize * TRACK_BYTES)
        .map(|i| (i % 251) as u8)
        .collect();
    let mut write = header(cmd::WRITE, 1, 0, data.len() as u32);
    write.extend_from_slice(&data);
    s.write_all(&write).unwrap();
    simple_reply(&mut s, 1, 0);
    let sends = || served.ctl.metrics.reply_sends.load(Ordering::Relaxed);
    let before = sends();
    // Whole-track reads in one segment; their replies (12 KiB and
    // headers) fit a new socket's send buffer (16 KiB), so one call can
    // take them all.
    let burst: Vec<u8> = (0..READS)
        .flat_map(|i| {
            header(
                cmd::READ,
                10 + i,
                i * TRACK_BYTES as u64,
                TRACK_BYTES as u32,
            )
        })
        .collect();
    s.write_all(&burst).unwrap();
    for i in 0..READS {
        let back = simple_reply(&mut s, 10 + i, TRACK_BYTES);
        let at = i as usize * TRACK_BYTES;
        assert_eq!(
            back,
            data[at..at + TRACK_BYTES],
            "read {i} returned what was written"
        );
    }
    assert_eq!(
        sends() - before,
        1,
        "{READS} requests read together left in one sendmsg"
    );
}
