//! Bad input over the wire: each malformed handshake or request gets the
//! right NBD error, or a closed connection for that client only; the server
//! and its other clients keep going and nothing written is lost.

mod common;

use std::io::Write;
use std::process::Command;

use common::raw::{self, Raw};
use common::{Server, run_ok, tool};

/// Another client still works: write a pattern and read it back.
fn healthy(server: &Server, offset_mib: u32) {
    let pattern = format!("{:#x}", 0x40 + offset_mib);
    run_ok(
        Command::new(tool("qemu-io"))
            .args(["-f", "raw", "-c"])
            .arg(format!("write -P {pattern} {offset_mib}M 64k"))
            .arg("-c")
            .arg(format!("read -P {pattern} {offset_mib}M 64k"))
            .arg(server.uri()),
    );
}

#[test]
fn malformed_handshakes_close_only_that_connection() {
    let mut server = Server::start("32M", &[]);
    // Unknown client flags.
    let mut r = Raw::connect(&server.addr);
    r.send(&0x8000_0000u32.to_be_bytes());
    assert!(r.closed());
    // An option without the IHAVEOPT magic.
    let mut r = Raw::connect(&server.addr);
    r.send(&1u32.to_be_bytes());
    r.send(&[0xde; 16]);
    assert!(r.closed());
    // An option declaring an absurd length.
    let mut r = Raw::connect(&server.addr);
    r.send(&1u32.to_be_bytes());
    let mut opt = raw::IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&raw::OPT_GO.to_be_bytes());
    opt.extend_from_slice(&u32::MAX.to_be_bytes());
    r.send(&opt);
    assert!(r.closed());
    // A client that hangs up in the middle of the handshake.
    let mut r = Raw::connect(&server.addr);
    r.send(&1u32.to_be_bytes());
    r.send(&raw::IHAVEOPT.to_be_bytes()[..5]);
    drop(r);
    healthy(&server, 1);
    assert!(server.alive());
}

#[test]
fn an_unknown_option_is_unsupported_and_negotiation_goes_on() {
    let server = Server::start("32M", &[]);
    let mut r = Raw::connect(&server.addr);
    r.send(&1u32.to_be_bytes());
    r.option(4242, b"whatever");
    let (option, kind, _) = r.option_reply();
    assert_eq!((option, kind), (4242, (1 << 31) + 1), "NBD_REP_ERR_UNSUP");
    let mut data = 0u32.to_be_bytes().to_vec();
    data.extend_from_slice(&0u16.to_be_bytes());
    r.option(raw::OPT_GO, &data);
    let mut acked = false;
    for _ in 0..8 {
        if r.option_reply().1 == raw::REP_ACK {
            acked = true;
            break;
        }
    }
    assert!(acked, "GO after an unknown option");
    r.request(raw::CMD_READ, 0, 5, 0, 4096);
    assert_eq!(r.simple_reply(4096).1, 0);
}

#[test]
fn requests_out_of_range_or_unknown_get_errors_and_the_session_goes_on() {
    let server = Server::start("64M", &[]);
    let size: u64 = 64 << 20;
    let mut r = Raw::go(&server.addr);
    let cases: [(u16, u16, u64, u32, u32); 8] = [
        (raw::CMD_READ, 0, size, 4096, raw::EINVAL), // past the end
        (raw::CMD_READ, 0, size - 4096, 8192, raw::EINVAL), // straddles the end
        (raw::CMD_READ, 0, u64::MAX - 4095, 8192, raw::EINVAL), // offset overflows
        (raw::CMD_READ, 0, size - 100, 200, raw::EINVAL), // unaligned, past the end
        (raw::CMD_READ, 0, 0, 40 << 20, raw::EOVERFLOW), // over the max payload
        (99, 0, 0, 0, raw::EINVAL),                  // unknown command
        (raw::CMD_READ, 1 << 9, 0, 4096, raw::EINVAL), // unknown flag
        (raw::CMD_FLUSH, 0, 4096, 0, raw::EINVAL),   // flush with a range
    ];
    for (i, &(kind, flags, offset, len, expected)) in cases.iter().enumerate() {
        r.request(kind, flags, i as u64, offset, len);
        let (cookie, error, _) = r.simple_reply(0);
        assert_eq!((cookie, error), (i as u64, expected), "case {i}");
    }
    // A write past the end: its payload is consumed, ENOSPC, and the
    // stream stays in sync.
    r.request(raw::CMD_WRITE, 0, 100, size, 4096);
    r.send(&[0x77; 4096]);
    assert_eq!(r.simple_reply(0), (100, raw::ENOSPC, vec![]));
    // A write over the maximum payload (but not absurd): read, discarded,
    // EOVERFLOW.
    r.request(raw::CMD_WRITE, 0, 101, 0, 40 << 20);
    r.send(&vec![0x66; 40 << 20]);
    assert_eq!(r.simple_reply(0), (101, raw::EOVERFLOW, vec![]));
    // The session still works, and nothing above was written.
    r.request(raw::CMD_READ, 0, 102, 0, 4096);
    let (_, error, data) = r.simple_reply(4096);
    assert_eq!(error, 0);
    assert!(data.iter().all(|&b| b == 0), "a refused write changed data");
    r.request(raw::CMD_DISC, 0, 103, 0, 0);
    assert!(r.closed());
}

#[test]
fn a_bad_request_magic_closes_that_connection_only() {
    let mut server = Server::start("32M", &[]);
    let mut r = Raw::go(&server.addr);
    r.send(&[0xff; 28]);
    assert!(r.closed());
    let mut r = Raw::go(&server.addr);
    // A write payload beyond any sane bound ends the connection too.
    r.request(raw::CMD_WRITE, 0, 1, 0, u32::MAX);
    assert!(r.closed());
    healthy(&server, 2);
    assert!(server.alive());
}

#[test]
fn a_client_that_disconnects_mid_write_loses_nothing_already_acknowledged() {
    let mut server = Server::start("32M", &[]);
    let mut r = Raw::go(&server.addr);
    // An acknowledged write.
    r.request(raw::CMD_WRITE, 0, 1, 8192, 4096);
    r.send(&[0xa5; 4096]);
    assert_eq!(r.simple_reply(0), (1, 0, vec![]));
    // A write to the same place, cut off half way through its payload.
    r.request(raw::CMD_WRITE, 0, 2, 8192, 8192);
    r.send(&[0x5a; 5000]);
    r.s.flush().unwrap();
    drop(r);
    // Many more half-writes: no NVS slot may leak (the server keeps
    // accepting full writes afterwards).
    for _ in 0..200 {
        let mut r = Raw::go(&server.addr);
        r.request(raw::CMD_WRITE, 0, 3, 1 << 20, 1 << 20);
        r.send(&[1; 100]);
    }
    let mut r = Raw::go(&server.addr);
    r.request(raw::CMD_READ, 0, 4, 8192, 8192);
    let (_, error, data) = r.simple_reply(8192);
    assert_eq!(error, 0);
    assert!(
        data[..4096].iter().all(|&b| b == 0xa5),
        "acknowledged data changed"
    );
    assert!(
        data[4096..].iter().all(|&b| b == 0),
        "an unfinished write was applied"
    );
    healthy(&server, 3);
    assert!(server.alive());
}
