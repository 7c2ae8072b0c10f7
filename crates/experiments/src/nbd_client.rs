//! A small NBD client for `rebound demo`: fixed newstyle, NBD_OPT_GO on the
//! default export, simple replies, one request at a time. Real clients
//! (qemu-io, fio, nbdcopy) are what the tests and benchmarks use; the demo
//! needs one that reconnects by itself and checks every byte it reads.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::Context;
use controller::nbd::proto::{
    FLAG_C_FIXED_NEWSTYLE, IHAVEOPT, NBDMAGIC, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, cmd, opt, rep,
};

/// A connection in the transmission phase.
#[derive(Debug)]
pub struct NbdClient {
    s: TcpStream,
    cookie: u64,
}

impl NbdClient {
    /// Connect to `addr` and negotiate the default export.
    pub fn connect(addr: &str) -> anyhow::Result<Self> {
        let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.set_nodelay(true)?;
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).context("server greeting")?;
        anyhow::ensure!(
            u64::from_be_bytes(greeting[0..8].try_into()?) == NBDMAGIC,
            "not an NBD server"
        );
        s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes())?;
        // NBD_OPT_GO, empty export name, no info requests.
        let mut req = IHAVEOPT.to_be_bytes().to_vec();
        req.extend_from_slice(&opt::GO.to_be_bytes());
        req.extend_from_slice(&6u32.to_be_bytes());
        req.extend_from_slice(&[0u8; 6]);
        s.write_all(&req)?;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h).context("option reply")?;
            let kind = u32::from_be_bytes(h[12..16].try_into()?);
            let len = u32::from_be_bytes(h[16..20].try_into()?) as usize;
            let mut data = vec![0u8; len];
            s.read_exact(&mut data)?;
            if kind == rep::ACK {
                break;
            }
            anyhow::ensure!(kind < 1 << 31, "the server refused the export ({kind:#x})");
        }
        Ok(Self { s, cookie: 0 })
    }

    fn request(
        &mut self,
        kind: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> anyhow::Result<()> {
        self.cookie += 1;
        let mut b = Vec::with_capacity(28 + payload.len());
        b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&self.cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&length.to_be_bytes());
        b.extend_from_slice(payload);
        self.s.write_all(&b)?;
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).context("reply")?;
        anyhow::ensure!(
            u32::from_be_bytes(h[0..4].try_into()?) == SIMPLE_REPLY_MAGIC,
            "bad reply magic"
        );
        let error = u32::from_be_bytes(h[4..8].try_into()?);
        anyhow::ensure!(error == 0, "the server answered error {error}");
        anyhow::ensure!(
            u64::from_be_bytes(h[8..16].try_into()?) == self.cookie,
            "reply to another request"
        );
        Ok(())
    }

    /// The connection itself, for a client pipelining its own requests.
    pub fn into_stream(self) -> anyhow::Result<TcpStream> {
        Ok(self.s)
    }

    /// Write `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> anyhow::Result<()> {
        self.request(cmd::WRITE, offset, data.len() as u32, data)
    }

    /// Read `out.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, out: &mut [u8]) -> anyhow::Result<()> {
        self.request(cmd::READ, offset, out.len() as u32, &[])?;
        self.s.read_exact(out).context("read data")?;
        Ok(())
    }
}
