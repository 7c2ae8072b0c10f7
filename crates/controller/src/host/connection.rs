//! One NBD connection: the handshake, then the transmission phase.
//!
//! A connection has a few threads (`connection_threads`; the host
//! adapter's hardware, in the papers' controller) that take the socket's
//! read side in turns. The thread holding it frames one request: a header
//! and, for a WRITE, its payload; it lets the read side go, then, inside the
//! admission gate of rung 4 ([`crate::engine::system`]), reserves the WRITE's NVS
//! slots and enters the request in the pipeline; outside the gate it runs
//! the request as an affiliate of the task runtime (`rcs::affiliate`):
//! each stage runs on this thread when its group admits it there, as it
//! would on a worker, and is queued for the workers otherwise (a group
//! recovering or with faults armed, sigma reached under the static
//! policies, a redrive, a modelled device delay). A thread waits for NVS
//! space itself, so a full NVS pushes back on the client through TCP (every
//! thread ends up waiting) and no worker ever waits for NVS space; it waits
//! outside the gate, so a system recovery never waits behind a full NVS.
//! While one thread waits (a device read, a flush), the others keep
//! reading.
//!
//! Replies are written by whichever task finishes a request. Replies queue
//! on the connection; the first writer to find no one sending becomes the
//! sender and writes the whole queue with one `writev`, so replies from
//! concurrent requests leave in batches.
//!
//! Bad input ends this connection only: a bad request magic (the stream
//! cannot be resynchronised), a write payload over [`DISCARD_PAYLOAD_MAX`].
//! A write over the maximum payload but under that bound is read, discarded
//! and answered `EOVERFLOW`; every other malformed request gets its NBD error.

use std::io::{BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::controller::Controller;
use crate::engine::ReplySink;
use crate::engine::request::Request;
use crate::limits::{
    CONNECTION_READ_BUFFER_BYTES, DISCARD_PAYLOAD_MAX, HANDSHAKE_TIMEOUT_SECS,
    INFLIGHT_PER_CONNECTION_MAX, MAX_PAYLOAD_BYTES, TRACK_BYTES,
};
use crate::nbd::handshake::{self, HandshakeError, Outcome};
use crate::nbd::proto::{self, NbdError, REQUEST_BYTES, RequestHeader, chunk, cmd};

struct Frame {
    head: Vec<u8>,
    body: Vec<u8>,
}

#[derive(Default)]
struct Outbox {
    pending: Vec<Frame>,
    sending: bool,
    broken: bool,
}

/// A connection in the transmission phase.
pub struct Connection {
    pub(crate) ctl: Arc<Controller>,
    pub(crate) structured: bool,
    /// The client selected `base:allocation` (BLOCK_STATUS answers).
    pub(crate) allocation: bool,
    out: TcpStream,
    outbox: Mutex<Outbox>,
    inflight: AtomicU32,
    id: u64,
}

impl Connection {
    /// A connection past its handshake, replying on `out` (in-process tests
    /// of framing).
    #[cfg(test)]
    pub(crate) fn for_tests(ctl: Arc<Controller>, out: TcpStream, structured: bool) -> Arc<Self> {
        Arc::new(Self {
            ctl,
            structured,
            allocation: structured,
            out,
            outbox: Mutex::new(Outbox::default()),
            inflight: AtomicU32::new(0),
            id: 0,
        })
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("structured", &self.structured)
            .field("inflight", &self.inflight.load(Ordering::Relaxed))
            .finish()
    }
}

impl ReplySink for Connection {
    fn structured(&self) -> bool {
        self.structured
    }

    /// Queue the reply to `h` and send (or leave it to the current sender).
    fn send_reply(&self, h: &RequestHeader, result: Result<(), (NbdError, &str)>, data: Vec<u8>) {
        let mut head = Vec::with_capacity(32);
        let body = match (h.kind == cmd::READ && self.structured, result) {
            (false, Ok(())) if h.kind == cmd::BLOCK_STATUS && self.structured => {
                proto::put_chunk_header(
                    &mut head,
                    h.cookie,
                    chunk::FLAG_DONE,
                    chunk::BLOCK_STATUS,
                    data.len() as u32,
                );
                data
            }
            (true, Ok(())) => {
                proto::put_chunk_header(
                    &mut head,
                    h.cookie,
                    chunk::FLAG_DONE,
                    chunk::OFFSET_DATA,
                    8 + data.len() as u32,
                );
                head.extend_from_slice(&h.offset.to_be_bytes());
                data
            }
            (true, Err((e, msg))) => {
                proto::put_error_chunk(&mut head, h.cookie, e, msg);
                Vec::new()
            }
            (false, Ok(())) => {
                proto::put_simple_reply(&mut head, h.cookie, 0);
                if h.kind == cmd::READ {
                    data
                } else {
                    Vec::new()
                }
            }
            (false, Err((e, _))) => {
                proto::put_simple_reply(&mut head, h.cookie, e.code());
                Vec::new()
            }
        };
        self.push(Frame { head, body });
    }

    /// Take the sender's role if no one has it: replies pushed until
    /// [`ReplySink::uncork`] queue up and leave in one `writev` (a commit
    /// releasing an epoch's replies). Returns whether the role was taken.
    fn cork(&self) -> bool {
        let mut outbox = self.outbox.lock();
        if outbox.sending || outbox.broken {
            return false;
        }
        outbox.sending = true;
        true
    }

    /// Send what queued since [`ReplySink::cork`] returned true.
    fn uncork(&self) {
        let outbox = self.outbox.lock();
        debug_assert!(outbox.sending);
        self.send_pending(outbox);
    }

    /// A request of this connection is finished.
    fn finish_request(&self) {
        self.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    fn allocation(&self) -> bool {
        self.allocation
    }
}

impl Connection {
    fn push(&self, frame: Frame) {
        let mut outbox = self.outbox.lock();
        if outbox.broken {
            return;
        }
        outbox.pending.push(frame);
        if outbox.sending {
            return;
        }
        outbox.sending = true;
        self.send_pending(outbox);
    }

    /// As the sender: write pending frames until none are left.
    fn send_pending<'a>(&'a self, mut outbox: parking_lot::MutexGuard<'a, Outbox>) {
        loop {
            let batch = std::mem::take(&mut outbox.pending);
            drop(outbox);
            let written = write_frames(&self.out, &batch);
            outbox = self.outbox.lock();
            if let Err(e) = written {
                tracing::debug!(conn = self.id, error = %e, "reply write failed; closing");
                outbox.broken = true;
                outbox.pending.clear();
                outbox.sending = false;
                let _ = self.out.shutdown(Shutdown::Both);
                return;
            }
            if outbox.pending.is_empty() {
                outbox.sending = false;
                return;
            }
        }
    }

    fn wait_idle(&self) {
        while self.inflight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn write_frames(mut out: &TcpStream, frames: &[Frame]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(frames.len() * 2);
    for f in frames {
        slices.push(IoSlice::new(&f.head));
        if !f.body.is_empty() {
            slices.push(IoSlice::new(&f.body));
        }
    }
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = out.write_vectored(rest)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Serve one client socket until it disconnects.
pub fn serve(ctl: Arc<Controller>, stream: TcpStream, id: u64) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(HANDSHAKE_TIMEOUT_SECS)));
    let mut hs = &stream;
    let negotiated = match handshake::negotiate(&mut hs, &ctl.export) {
        Ok(Outcome::Transmission(n)) => n,
        Ok(Outcome::Aborted) => return,
        Err(HandshakeError::Io(e)) => {
            tracing::debug!(conn = id, error = %e, "client left during the handshake");
            return;
        }
        Err(e) => {
            tracing::warn!(conn = id, error = %e, "handshake failed; closing the connection");
            ctl.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    let _ = stream.set_read_timeout(None);
    let Ok(out) = stream.try_clone() else { return };
    let conn = Arc::new(Connection {
        ctl,
        structured: negotiated.structured,
        allocation: negotiated.allocation,
        out,
        outbox: Mutex::new(Outbox::default()),
        inflight: AtomicU32::new(0),
        id,
    });
    let input = Mutex::new(Input {
        r: BufReader::with_capacity(CONNECTION_READ_BUFFER_BYTES, &stream),
        done: false,
    });
    let threads = conn.ctl.config.connection_threads.max(1);
    let reason = std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .filter_map(|k| {
                let spawned = std::thread::Builder::new()
                    .name(format!("nbd-conn-{id}.{k}"))
                    .spawn_scoped(scope, || read_loop(&conn, &input));
                // Without the thread the connection is served by fewer.
                spawned
                    .inspect_err(|e| tracing::warn!(conn = id, error = %e, "could not start a connection thread"))
                    .ok()
            })
            .collect();
        let mut reason = read_loop(&conn, &input);
        for h in helpers {
            let theirs = h.join().unwrap_or(Ok(()));
            if reason.is_ok() {
                reason = theirs;
            }
        }
        reason
    });
    conn.wait_idle();
    if let Err(e) = reason {
        tracing::warn!(conn = id, error = %e, "closing the connection");
        conn.ctl
            .metrics
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Why the reader stopped for a protocol violation.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Violation {
    #[error("request with a bad magic number")]
    BadMagic,
    #[error("write payload of {0} bytes is over the {DISCARD_PAYLOAD_MAX}-byte limit")]
    PayloadTooLarge(u32),
}

/// The read side of a connection, taken in turns by its threads.
struct Input<'a> {
    r: BufReader<&'a TcpStream>,
    /// The client disconnected or violated the protocol: stop reading.
    done: bool,
}

/// Read requests until the client disconnects (Ok) or violates the
/// protocol (Err), and run them. I/O errors are a disconnect.
///
/// Each of the connection's threads runs this loop: it takes the read side,
/// frames one request (its payload too), lets the read side go to the next
/// thread and runs the request itself as an affiliate of the runtime: every
/// stage whose group admits it runs on this thread (no hand-off to a worker
/// on the good path; see `rcs::affiliate`), the rest are queued for the
/// workers. While one thread waits (a device read, an fsync, NVS space),
/// the others keep reading.
fn read_loop(conn: &Arc<Connection>, input: &Mutex<Input<'_>>) -> Result<(), Violation> {
    let ctl = &conn.ctl;
    let g = ctl.groups;
    let mut affiliate = ctl.rt.affiliate(&[g.host, g.cache, g.nvs, g.device]);
    let mut raw = [0u8; REQUEST_BYTES];
    loop {
        let (req, slots) = {
            let mut input = input.lock();
            if input.done {
                return Ok(());
            }
            let read = next_request(conn, &mut input.r, &mut raw);
            if !matches!(read, Ok(Some(_))) {
                input.done = true;
            }
            match read {
                Ok(Some(framed)) => framed,
                Ok(None) => return Ok(()),
                Err(v) => return Err(v),
            }
        };
        crate::host::partial::admit(
            ctl.engine(),
            conn.structured,
            req,
            slots,
            affiliate.as_mut(),
        );
    }
}

/// Frame the next request and the NVS slots it needs. `Ok(None)`: the
/// client disconnected (or sent DISC).
pub(crate) fn next_request(
    conn: &Arc<Connection>,
    r: &mut impl Read,
    raw: &mut [u8; REQUEST_BYTES],
) -> Result<Option<(Box<Request>, u32)>, Violation> {
    if r.read_exact(raw).is_err() {
        return Ok(None);
    }
    let header = RequestHeader::parse(raw).ok_or(Violation::BadMagic)?;
    if header.kind == cmd::DISC {
        return Ok(None);
    }
    while conn.inflight.load(Ordering::Acquire) >= INFLIGHT_PER_CONNECTION_MAX {
        std::thread::sleep(Duration::from_micros(20));
    }
    let sink: Arc<dyn ReplySink> = Arc::clone(conn) as Arc<dyn ReplySink>;
    let mut req = Box::new(Request::new(Arc::clone(conn.ctl.engine()), sink, header));
    conn.inflight.fetch_add(1, Ordering::AcqRel);
    let mut slots = 0;
    if header.kind == cmd::WRITE && header.length > 0 {
        match read_write_payload(&conn.ctl, &mut req, r) {
            Ok(Some(n)) => slots = n,
            Ok(None) => {
                // Disconnected mid-payload: nothing to answer.
                req.abandon();
                return Ok(None);
            }
            Err(v) => {
                // A hard disconnect: no reply.
                req.abandon();
                return Err(v);
            }
        }
    }
    Ok(Some((req, slots)))
}

/// Read a WRITE's payload; the NVS slots it needs (none when it will be
/// refused). `Ok(None)`: the client went away.
fn read_write_payload(
    ctl: &Arc<Controller>,
    req: &mut Request,
    r: &mut impl Read,
) -> Result<Option<u32>, Violation> {
    let len = req.header.length;
    if len > MAX_PAYLOAD_BYTES {
        if len > DISCARD_PAYLOAD_MAX {
            return Err(Violation::PayloadTooLarge(len));
        }
        let copied = std::io::copy(&mut r.take(u64::from(len)), &mut std::io::sink());
        req.early_error = Some((NbdError::Overflow, "write larger than the maximum payload"));
        return Ok(copied.is_ok_and(|n| n == u64::from(len)).then_some(0));
    }
    let aligned = (len as usize).is_multiple_of(TRACK_BYTES)
        && req.header.offset.is_multiple_of(TRACK_BYTES as u64);
    let in_range = req
        .header
        .offset
        .checked_add(u64::from(len))
        .is_some_and(|end| end <= ctl.export.size_bytes);
    let mut payload = vec![0u8; len as usize];
    if r.read_exact(&mut payload).is_err() {
        return Ok(None);
    }
    req.payload = payload;
    Ok(Some(if aligned && in_range {
        len / TRACK_BYTES as u32
    } else {
        0
    }))
}
