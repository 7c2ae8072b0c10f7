//! A well-behaved NBD client's side, by hand, against an in-process
//! server on a free port: for tests that send byte streams a real client
//! library would not (the framer fuzz) or count what the server does per
//! request (reply batching).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crate::controller::Controller;
use crate::host::listener::Server;
use crate::nbd::proto::{
    BASE_ALLOCATION, FLAG_C_FIXED_NEWSTYLE, FLAG_C_NO_ZEROES, IHAVEOPT, NBDMAGIC,
    OPTION_REPLY_MAGIC, opt, rep,
};

/// A server on a temp dir, on a free port.
pub(super) struct Served {
    /// The controller the server serves.
    pub(super) ctl: Arc<Controller>,
    server: Option<Server>,
    _dir: tempfile::TempDir,
}

impl Served {
    pub(super) fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctl = Controller::open(super::temp_config(dir.path())).expect("opening the controller");
        let listener = crate::host::socket::Listener::Tcp(
            TcpListener::bind("127.0.0.1:0").expect("binding a port"),
        );
        let server = Server::start_on(Arc::clone(&ctl), listener).expect("starting the server");
        Self {
            ctl,
            server: Some(server),
            _dir: dir,
        }
    }

    pub(super) fn connect(&self) -> TcpStream {
        let addr = self
            .server
            .as_ref()
            .expect("running")
            .local_addr()
            .expect("a TCP listener");
        let s = TcpStream::connect(addr).expect("connecting");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            let _ = s.shutdown();
        }
    }
}

/// How the client negotiates before its stream.
#[derive(Debug, Clone, Copy)]
pub(super) struct Session {
    pub(super) structured: bool,
    pub(super) allocation: bool,
    pub(super) go: bool,
}

fn send_option(s: &mut TcpStream, option: u32, data: &[u8]) {
    let mut o = IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&option.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    s.write_all(&o).expect("sending an option");
}

/// Read option replies up to the final one; panics unless it is an ACK.
fn expect_ack(s: &mut TcpStream, option: u32) {
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("an option reply");
        assert_eq!(h[..8], OPTION_REPLY_MAGIC.to_be_bytes());
        assert_eq!(h[8..12], option.to_be_bytes());
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut data).expect("the reply's data");
        if kind == rep::ACK {
            return;
        }
        assert_eq!(kind & (1 << 31), 0, "option {option} refused: {data:?}");
    }
}

/// A well-behaved client's handshake.
pub(super) fn negotiate(s: &mut TcpStream, session: Session) {
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("the greeting");
    assert_eq!(greeting[..8], NBDMAGIC.to_be_bytes());
    let flags = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    s.write_all(&flags.to_be_bytes()).unwrap();
    if session.structured {
        send_option(s, opt::STRUCTURED_REPLY, &[]);
        expect_ack(s, opt::STRUCTURED_REPLY);
        if session.allocation {
            let mut d = 0u32.to_be_bytes().to_vec();
            d.extend_from_slice(&1u32.to_be_bytes());
            d.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
            d.extend_from_slice(BASE_ALLOCATION.as_bytes());
            send_option(s, opt::SET_META_CONTEXT, &d);
            expect_ack(s, opt::SET_META_CONTEXT);
        }
    }
    if session.go {
        send_option(s, opt::GO, &[0, 0, 0, 0, 0, 0]);
        expect_ack(s, opt::GO);
    } else {
        send_option(s, opt::EXPORT_NAME, &[]);
        let mut export = [0u8; 10];
        s.read_exact(&mut export).expect("EXPORT_NAME's answer");
    }
}
