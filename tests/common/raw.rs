//! A minimal raw NBD client for tests that need to send what real clients
//! never send (bad magic, unknown commands, ranges past the end).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const REP_ACK: u32 = 1;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
#[allow(dead_code)]
pub const CMD_TRIM: u16 = 4;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;

pub struct Raw {
    pub s: TcpStream,
}

impl Raw {
    /// Connect and read the server's greeting.
    pub fn connect(addr: &str) -> Self {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut r = Self { s };
        let mut greeting = [0u8; 18];
        r.s.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[0..8], b"NBDMAGIC");
        r
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
    }

    /// Send small writes at once (`TCP_NODELAY`), as NBD clients do:
    /// otherwise a request sent in two parts waits for the delayed ACK of
    /// the first (40 ms a request).
    pub fn no_delay(&mut self) {
        self.s.set_nodelay(true).expect("TCP_NODELAY");
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        self.send(&v);
    }

    /// Read one option reply: (option, type, data).
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).expect("option reply");
        let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; n];
        self.s.read_exact(&mut data).unwrap();
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            data,
        )
    }

    /// [`Raw::go`], or `None` if the server went away during the handshake.
    pub fn try_go(addr: &str) -> Option<Self> {
        let s = TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
        let mut r = Self { s };
        let mut greeting = [0u8; 18];
        r.s.read_exact(&mut greeting).ok()?;
        r.s.write_all(&3u32.to_be_bytes()).ok()?;
        let mut data = 0u32.to_be_bytes().to_vec();
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&OPT_GO.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(&data);
        r.s.write_all(&v).ok()?;
        loop {
            let mut h = [0u8; 20];
            r.s.read_exact(&mut h).ok()?;
            let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let mut d = vec![0u8; n];
            r.s.read_exact(&mut d).ok()?;
            match u32::from_be_bytes(h[12..16].try_into().unwrap()) {
                REP_ACK => return Some(r),
                kind if kind >= 1 << 31 => return None,
                _ => {}
            }
        }
    }

    /// Fixed newstyle, NBD_OPT_GO on the default export: ready to transmit.
    pub fn go(addr: &str) -> Self {
        let mut r = Self::connect(addr);
        r.send(&3u32.to_be_bytes());
        let mut data = 0u32.to_be_bytes().to_vec();
        data.extend_from_slice(&0u16.to_be_bytes());
        r.option(OPT_GO, &data);
        loop {
            let (_, kind, _) = r.option_reply();
            if kind == REP_ACK {
                return r;
            }
            assert!(kind < 1 << 31, "GO failed with reply type {kind:#x}");
        }
    }

    pub fn request(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        self.send(&b);
    }

    /// Read a simple reply's header: (cookie, error). A successful READ's
    /// data follows ([`Raw::data`]).
    pub fn reply_header(&mut self) -> (u64, u32) {
        let (cookie, error, _) = self.simple_reply(0);
        (cookie, error)
    }

    /// The next `len` bytes (a READ's data after its reply header).
    pub fn data(&mut self, len: usize) -> Vec<u8> {
        let mut data = vec![0u8; len];
        self.s.read_exact(&mut data).expect("read data");
        data
    }

    /// Read a simple reply: (cookie, error); `data_len` bytes follow a
    /// successful read.
    pub fn simple_reply(&mut self, data_len: usize) -> (u64, u32, Vec<u8>) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).expect("simple reply");
        assert_eq!(
            &h[0..4],
            &0x6744_6698u32.to_be_bytes(),
            "simple reply magic"
        );
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let mut data = vec![0u8; if error == 0 { data_len } else { 0 }];
        self.s.read_exact(&mut data).unwrap();
        (cookie, error, data)
    }

    /// Whether the server closed the connection (EOF) within the timeout.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}
