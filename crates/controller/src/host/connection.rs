//! One NBD connection: the handshake, then the transmission phase.
//!
//! A connection has a few threads (`connection_threads`; the host
//! adapter's hardware, in the papers' controller) that take the socket's
//! read side in turns. The thread holding it (the leader) frames one
//! request: a header and, for a WRITE, its payload; then, inside the
//! admission gate of rung 4 ([`crate::engine::system`]), reserves the
//! WRITE's NVS slots and enters the request in the pipeline; outside the
//! gate it runs the request as an affiliate of the task runtime
//! (`rcs::affiliate`), and reads the next one. It keeps the read side
//! while it runs the request and lets it go to a waiting thread only when
//! the request is about to wait for something slow
//! ([`crate::blocking::about_to_block`]: a device read that misses the page
//! cache, a sync, NVS space, a track lock): so on the good path one thread
//! receives, runs and answers, with no hand-off between threads. Of the
//! request's stages, each runs on this thread when its group admits it there, as it
//! would on a worker, and is queued for the workers otherwise (a group
//! recovering or with faults armed, sigma reached under the static
//! policies, a redrive, a modelled device delay). A thread waits for NVS
//! space itself, so a full NVS pushes back on the client through TCP (every
//! thread ends up waiting) and no worker ever waits for NVS space; it waits
//! outside the gate, so a system recovery never waits behind a full NVS.
//! While one thread waits (a device read, a flush), the others keep
//! reading: the thread that lets the read side go wakes one waiting
//! thread, and takes its turn again after its request.
//!
//! Replies never block the thread that finishes a request (a connection
//! thread, an rcs worker, the epoch thread releasing a commit): replies
//! queue on the connection's outbox and the first writer to find no one
//! sending writes the queue with one `sendmsg(MSG_DONTWAIT)`. What the
//! socket does not take then is left to the connection's *drainer*
//! thread, which waits for room (`poll`) and sends the rest; a client that
//! takes nothing for `send_timeout` is disconnected (its acknowledged
//! writes stay: they are in the NVS). So a slow or stalled reader costs
//! only its own connection, never a worker, the commit, or a recovery.
//!
//! Back-pressure: a connection's *charge* is the bytes of its admitted
//! requests whose replies have not left (a READ's data, a WRITE's payload,
//! plus a small per-request overhead). Before framing a request a reading
//! thread waits while the charge with this request's would pass
//! `reply_budget` (one request is always admitted), or while
//! [`INFLIGHT_PER_CONNECTION_MAX`] requests are unfinished; it reads
//! nothing meanwhile, so TCP flow control pushes back on the client. A
//! connection's memory is thus bounded by its budget plus one maximum
//! request plus its read buffer (see the README's memory bound).
//!
//! Idle connections: with `idle_timeout` set, a connection that sent
//! nothing and has nothing in flight for that long is closed; TCP
//! keepalive (`tcp_keepalive`) finds a peer that vanished.
//!
//! Bad input ends this connection only: a bad request magic (the stream
//! cannot be resynchronised), a write payload over [`DISCARD_PAYLOAD_MAX`].
//! A write over the maximum payload but under that bound is read, discarded
//! and answered `EOVERFLOW`; every other malformed request gets its NBD error.

use std::collections::VecDeque;
use std::io::{BufReader, IoSlice, Read};
use std::net::Shutdown;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use smallvec::SmallVec;

use crate::controller::Controller;
use crate::engine::ReplySink;
use crate::engine::request::Request;
use crate::host::socket::Socket;
use crate::host::tls::{Pump, Secured, TlsServer};
use crate::limits::{
    CONNECTION_READ_BUFFER_BYTES, DISCARD_PAYLOAD_MAX, INFLIGHT_PER_CONNECTION_MAX,
    MAX_PAYLOAD_BYTES, TRACK_BYTES,
};
use crate::nbd::handshake::{self, HandshakeError, Negotiated, Outcome, TlsMode};
use crate::nbd::proto::{self, NbdError, REQUEST_BYTES, RequestHeader, chunk, cmd};

/// What a request costs its connection's budget beyond its data: the
/// request and reply headers, the control block.
const REQUEST_OVERHEAD_BYTES: u64 = 64;

/// A request's charge against the reply budget (the same at admission
/// and when its reply leaves: both see the client's header).
fn charge_of(h: &RequestHeader) -> u64 {
    REQUEST_OVERHEAD_BYTES
        + match h.kind {
            cmd::READ | cmd::WRITE => u64::from(h.length),
            _ => 0,
        }
}

/// A reply's header bytes: inline up to a structured READ's chunk header
/// (28 bytes), so a reply allocates nothing beyond its data; an error
/// chunk's message spills to the heap.
type Head = SmallVec<[u8; 32]>;

/// Most iovecs one `sendmsg` offers (128 replies: a commit releasing
/// thousands of held replies sends them in several calls).
const SEND_IOVECS_MAX: usize = 256;

/// Iovecs of one `sendmsg`, on the stack (4 KiB): a send of more than 32
/// replies (a commit releasing its held replies) allocated and freed a
/// heap list of up to 1,024 iovecs each time.
type Slices<'a> = SmallVec<[IoSlice<'a>; SEND_IOVECS_MAX]>;

struct Frame {
    head: Head,
    body: Vec<u8>,
    charge: u64,
}

impl Frame {
    fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }
}

#[derive(Default)]
struct Outbox {
    /// Replies not yet (wholly) sent, in order.
    pending: VecDeque<Frame>,
    /// Bytes of the first pending frame already sent.
    sent: usize,
    /// Someone owns the write side (a thread sending without blocking,
    /// or the drainer).
    sending: bool,
    /// The drainer owns it: the send buffer was full.
    draining: bool,
    /// The connection failed or was cut: replies are dropped.
    broken: bool,
    /// The connection is ending: the drainer leaves once nothing is queued.
    closing: bool,
}

/// A connection in the transmission phase.
pub struct Connection {
    pub(crate) ctl: Arc<Controller>,
    pub(crate) structured: bool,
    /// The client selected `base:allocation` (BLOCK_STATUS answers).
    pub(crate) allocation: bool,
    out: Socket,
    outbox: Mutex<Outbox>,
    /// Wakes the drainer.
    drain: Condvar,
    /// Wakes a reading thread waiting for budget (under `outbox`).
    room: Condvar,
    /// A reading thread waits on `room`.
    reader_waiting: AtomicBool,
    /// The leading reader holds the sender's role ([`ReplySink::cork`])
    /// while it runs requests that had already arrived together: their
    /// replies leave in one `sendmsg` when it has none left to run.
    reader_corked: AtomicBool,
    /// Requests admitted and not finished.
    inflight: AtomicU32,
    /// The most requests this client had in flight lately (halved each
    /// second it does not reach it again): its queue depth, as far as the
    /// server can tell. See [`Connection::stalled`].
    peak_inflight: AtomicU32,
    /// Milliseconds since `born` of the last halving of `peak_inflight`.
    peak_at_ms: AtomicU64,
    /// Bytes charged by admitted requests whose replies have not left.
    charged: AtomicU64,
    /// Milliseconds since `born` of the last bytes read from the client.
    last_read_ms: AtomicU64,
    born: Instant,
    id: u64,
}

impl Connection {
    fn new(ctl: Arc<Controller>, out: Socket, negotiated: Negotiated, id: u64) -> Self {
        Self {
            ctl,
            structured: negotiated.structured,
            allocation: negotiated.allocation,
            out,
            outbox: Mutex::new(Outbox::default()),
            drain: Condvar::new(),
            room: Condvar::new(),
            reader_waiting: AtomicBool::new(false),
            reader_corked: AtomicBool::new(false),
            inflight: AtomicU32::new(0),
            peak_inflight: AtomicU32::new(0),
            peak_at_ms: AtomicU64::new(0),
            charged: AtomicU64::new(0),
            last_read_ms: AtomicU64::new(0),
            born: Instant::now(),
            id,
        }
    }

    /// A connection past its handshake, replying on `out` (in-process tests
    /// of framing; no drainer runs, so replies must fit the send buffer).
    #[cfg(test)]
    pub(crate) fn for_tests(
        ctl: Arc<Controller>,
        out: std::net::TcpStream,
        structured: bool,
    ) -> Arc<Self> {
        let negotiated = Negotiated {
            structured,
            allocation: structured,
        };
        Arc::new(Self::new(ctl, Socket::Tcp(out), negotiated, 0))
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("structured", &self.structured)
            .field("inflight", &self.inflight.load(Ordering::Relaxed))
            .field("charged", &self.charged.load(Ordering::Relaxed))
            .finish()
    }
}

impl ReplySink for Connection {
    fn structured(&self) -> bool {
        self.structured
    }

    /// Queue the reply to `h` and send (or leave it to the current sender).
    fn send_reply(&self, h: &RequestHeader, result: Result<(), (NbdError, &str)>, data: Vec<u8>) {
        let mut head = Head::new();
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
                head.extend(h.offset.to_be_bytes());
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
        self.push(Frame {
            head,
            body,
            charge: charge_of(h),
        });
    }

    /// Take the sender's role if no one has it: replies pushed until
    /// [`ReplySink::uncork`] queue up and leave in one `sendmsg` (a commit
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
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        self.wake_reader();
    }

    fn allocation(&self) -> bool {
        self.allocation
    }
}

/// How far a non-blocking send got.
enum Sent {
    /// Everything handed over went.
    All,
    /// The send buffer filled first.
    Blocked,
}

impl Connection {
    /// The leading reader: hold replies back (see `reader_corked`).
    fn reader_cork(&self) {
        if !self.reader_corked.load(Ordering::Relaxed) && self.cork() {
            self.reader_corked.store(true, Ordering::Relaxed);
        }
    }

    /// The leading reader: send the replies it held back.
    fn reader_uncork(&self) {
        if self.reader_corked.swap(false, Ordering::Relaxed) {
            self.uncork();
        }
    }

    fn push(&self, frame: Frame) {
        let mut outbox = self.outbox.lock();
        if outbox.broken {
            drop(outbox);
            self.release(frame.charge);
            return;
        }
        outbox.pending.push_back(frame);
        if outbox.sending {
            return;
        }
        outbox.sending = true;
        self.send_pending(outbox);
    }

    /// As the sender: send pending frames without blocking until none are
    /// left (the role ends) or the socket takes no more (the role passes
    /// to the drainer).
    fn send_pending<'a>(&'a self, mut outbox: MutexGuard<'a, Outbox>) {
        loop {
            if outbox.pending.is_empty() {
                outbox.sending = false;
                if outbox.closing {
                    // The drainer waits for the last sender to leave.
                    self.drain.notify_one();
                }
                return;
            }
            let mut batch = std::mem::take(&mut outbox.pending);
            let mut sent = std::mem::take(&mut outbox.sent);
            drop(outbox);
            let result = self.send_some(&mut batch, &mut sent);
            outbox = self.outbox.lock();
            restore(&mut outbox, batch, sent);
            match result {
                Err(e) => return self.cut(outbox, &format!("reply write failed: {e}")),
                Ok(Sent::Blocked) => {
                    outbox.draining = true;
                    self.drain.notify_one();
                    return;
                }
                Ok(Sent::All) => {}
            }
        }
    }

    /// One `sendmsg` of (the start of) `batch`, `sent` bytes of its first
    /// frame gone already: drops the frames that went, releasing their
    /// charges.
    fn send_some(&self, batch: &mut VecDeque<Frame>, sent: &mut usize) -> std::io::Result<Sent> {
        let mut slices = Slices::new();
        let mut offered = 0usize;
        let mut skip = *sent;
        for f in batch.iter() {
            if slices.len() + 2 > SEND_IOVECS_MAX {
                break;
            }
            for part in [&f.head[..], &f.body[..]] {
                let from = skip.min(part.len());
                skip -= from;
                if from < part.len() {
                    slices.push(IoSlice::new(&part[from..]));
                    offered += part.len() - from;
                }
            }
        }
        // Counted before the call: a client that has its reply sees it
        // counted.
        self.ctl.metrics.reply_sends.fetch_add(1, Ordering::Relaxed);
        let n = self.out.send_nonblocking(&slices)?;
        drop(slices);
        let mut left = n + *sent;
        let mut released = 0;
        while let Some(f) = batch.front() {
            if left < f.len() {
                break;
            }
            left -= f.len();
            released += f.charge;
            batch.pop_front();
        }
        *sent = left;
        self.release(released);
        Ok(if n < offered {
            Sent::Blocked
        } else {
            Sent::All
        })
    }

    /// The drainer: while the send buffer is full, wait for room (up to
    /// `send_timeout`) and send; cut the client that reads nothing.
    fn drainer(&self) {
        let limit = self.ctl.config.send_timeout;
        let mut outbox = self.outbox.lock();
        loop {
            // Closing: leave once no one is sending (a commit's corked
            // replies may still be on their way after the last request
            // finished) and everything went.
            let done_sending = |o: &Outbox| o.closing && !o.sending;
            while !outbox.draining && !outbox.broken && !done_sending(&outbox) {
                self.drain.wait(&mut outbox);
            }
            if outbox.broken || !outbox.draining {
                debug_assert!(outbox.broken || outbox.pending.is_empty());
                return;
            }
            let mut batch = std::mem::take(&mut outbox.pending);
            let mut sent = std::mem::take(&mut outbox.sent);
            drop(outbox);
            let result = match self.out.wait_writable(limit) {
                Ok(true) => self.send_some(&mut batch, &mut sent).map(Some),
                Ok(false) => Ok(None),
                Err(e) => Err(e),
            };
            outbox = self.outbox.lock();
            restore(&mut outbox, batch, sent);
            match result {
                Err(e) => {
                    self.cut(outbox, &format!("reply write failed: {e}"));
                    outbox = self.outbox.lock();
                }
                Ok(None) => {
                    self.ctl
                        .metrics
                        .slow_clients
                        .fetch_add(1, Ordering::Relaxed);
                    self.cut(
                        outbox,
                        &format!(
                            "the client read no reply for {limit:?} (send_timeout); disconnecting it (its acknowledged writes are kept)"
                        ),
                    );
                    outbox = self.outbox.lock();
                }
                Ok(Some(_)) if outbox.pending.is_empty() => {
                    outbox.draining = false;
                    outbox.sending = false;
                }
                Ok(Some(_)) => {}
            }
        }
    }

    /// End the connection: drop queued replies, shut the socket so its
    /// readers stop, wake everyone waiting.
    fn cut(&self, mut outbox: MutexGuard<'_, Outbox>, why: &str) {
        if !outbox.broken {
            tracing::warn!(conn = self.id, "{why}; closing the connection");
        }
        outbox.broken = true;
        outbox.sending = false;
        outbox.draining = false;
        outbox.sent = 0;
        let dropped: u64 = outbox.pending.drain(..).map(|f| f.charge).sum();
        let _ = self.out.shutdown(Shutdown::Both);
        self.drain.notify_all();
        drop(outbox);
        self.release(dropped);
    }

    /// Replies carrying `bytes` of charge have left (or were dropped).
    fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.charged.fetch_sub(bytes, Ordering::SeqCst);
            self.wake_reader();
        }
    }

    fn wake_reader(&self) {
        if self.reader_waiting.load(Ordering::SeqCst) {
            let _g = self.outbox.lock();
            self.room.notify_all();
        }
    }

    /// Wait until a request charging `charge` fits the budget and the
    /// in-flight cap, then admit it: `false` if the connection was cut.
    fn admit(&self, charge: u64) -> bool {
        let budget = self.ctl.config.reply_budget;
        let fits = || {
            let charged = self.charged.load(Ordering::SeqCst);
            self.inflight.load(Ordering::SeqCst) < INFLIGHT_PER_CONNECTION_MAX
                && (charged == 0 || charged + charge <= budget)
        };
        if !fits() {
            // Replies held back must leave for room to come; another
            // thread may read meanwhile (it waits here too).
            crate::blocking::about_to_block();
            let mut outbox = self.outbox.lock();
            self.reader_waiting.store(true, Ordering::SeqCst);
            while !outbox.broken && !fits() {
                self.room.wait_for(&mut outbox, Duration::from_millis(100));
            }
            self.reader_waiting.store(false, Ordering::SeqCst);
            if outbox.broken {
                return false;
            }
        }
        self.charged.fetch_add(charge, Ordering::SeqCst);
        let now = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        let was = self.peak_inflight.fetch_max(now, Ordering::Relaxed);
        if now > was {
            self.ctl.engine().epochs.client_depth(i64::from(now - was));
        }
        true
    }

    /// Whether the client waits on this server for all it can have in
    /// flight: its reader is drained and the requests it has here are
    /// (about) as many as it has had in flight lately. A client that
    /// keeps most of its queue depth elsewhere (in its own queues, in the
    /// network) is not stalled, and output waiting for a commit does not
    /// hold it up.
    fn stalled(&self) -> bool {
        let now_ms = self.born.elapsed().as_millis() as u64;
        let inflight = self.inflight.load(Ordering::SeqCst);
        let mut peak = self.peak_inflight.load(Ordering::Relaxed);
        if now_ms.saturating_sub(self.peak_at_ms.load(Ordering::Relaxed)) >= 1000 {
            self.peak_at_ms.store(now_ms, Ordering::Relaxed);
            let halved = (peak / 2).max(inflight);
            // Exchanged, not stored: an admission raising the peak
            // meanwhile keeps it, and the output gate's sum of peaks
            // (`Epochs::client_depth`) moves by exactly what changed.
            match self.peak_inflight.compare_exchange(
                peak,
                halved,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.ctl
                        .engine()
                        .epochs
                        .client_depth(i64::from(halved) - i64::from(peak));
                    peak = halved;
                }
                Err(now) => peak = now,
            }
        }
        inflight > 0 && inflight >= peak - peak / 4
    }

    fn wait_idle(&self) {
        while self.inflight.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Nothing in flight and nothing read for `idle_timeout`.
    fn idle_expired(&self) -> bool {
        let limit = self.ctl.config.idle_timeout;
        let since = self.born.elapsed().saturating_sub(Duration::from_millis(
            self.last_read_ms.load(Ordering::Relaxed),
        ));
        !limit.is_zero()
            && since >= limit
            && self.inflight.load(Ordering::SeqCst) == 0
            && self.charged.load(Ordering::SeqCst) == 0
    }
}

/// Put what a send left back at the front of the queue.
fn restore(outbox: &mut Outbox, mut batch: VecDeque<Frame>, sent: usize) {
    if batch.is_empty() {
        // All of it went: its queue's memory takes the next replies (a
        // fresh queue allocated again at every send).
        debug_assert_eq!(sent, 0, "a sent queue has no partly sent frame");
        if outbox.pending.is_empty() && outbox.pending.capacity() < batch.capacity() {
            outbox.pending = batch;
        }
        return;
    }
    if outbox.broken {
        // Cut meanwhile: what was left unsent is dropped (the connection
        // admits nothing more, so its charge no longer matters).
        return;
    }
    batch.append(&mut outbox.pending);
    outbox.pending = batch;
    outbox.sent = sent;
}

/// A socket read under the handshake's deadline: every read and write
/// gets the time left, so the whole negotiation ends by the deadline
/// however the client trickles its bytes.
struct Deadline<'a> {
    s: &'a Socket,
    until: Instant,
}

impl Deadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        time_left(self.until)
    }
}

/// The time left until the handshake's deadline `until`; past it,
/// [`handshake_timed_out`].
pub(super) fn time_left(until: Instant) -> std::io::Result<Duration> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(handshake_timed_out());
    }
    Ok(left)
}

/// The error every step of the negotiation (TLS included) reports once
/// the handshake's deadline has passed.
pub(super) fn handshake_timed_out() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the handshake did not finish in time (handshake_timeout)",
    )
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        (&*self.s).read(buf)
    }
}

impl std::io::Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        (&*self.s).write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A negotiated client, ready for the transmission phase.
#[derive(Debug)]
pub struct Negotiation {
    /// The socket to serve: the client's, or after STARTTLS the
    /// plaintext end of its TLS pump.
    pub socket: Socket,
    /// What was agreed.
    pub negotiated: Negotiated,
    /// The TLS pump, to join once the connection is served.
    pub pump: Option<Pump>,
}

/// Negotiate with a new client within `handshake_timeout` (the TLS
/// handshake after STARTTLS included): the socket to serve and what was
/// agreed, or `None` (the client left, aborted, broke the protocol, failed
/// TLS or ran out of time; logged).
///
/// `tls`: the server's TLS credentials and mode (`None`: TLS off).
/// `admit` is asked before the client enters transmission (see
/// [`handshake::negotiate_with`]).
pub fn negotiate(
    ctl: &Controller,
    socket: Socket,
    id: u64,
    tls: Option<&TlsServer>,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Option<Negotiation> {
    let until = Instant::now() + ctl.config.handshake_timeout;
    let mode = tls.map_or(TlsMode::Off, TlsServer::mode);
    // Named once: a socket the client reset no longer knows its peer.
    let peer = socket.peer_name();
    let mut hs = Deadline { s: &socket, until };
    match handshake::negotiate_tls(&mut hs, &ctl.export, mode, admit) {
        Ok(Outcome::Transmission(negotiated)) => {
            let _ = socket.set_read_timeout(None);
            let _ = socket.set_write_timeout(None);
            Some(Negotiation {
                socket,
                negotiated,
                pump: None,
            })
        }
        Ok(Outcome::StartTls { no_zeroes }) => {
            let tls = tls.expect("STARTTLS is acknowledged only with TLS on");
            let to = Peer { id, name: peer };
            secure(ctl, socket, &to, tls, no_zeroes, until, admit)
        }
        Ok(Outcome::Aborted) => None,
        Err(e) => {
            failed(ctl, &socket, &Peer { id, name: peer }, e);
            None
        }
    }
}

/// After STARTTLS: the TLS handshake, the rest of the negotiation over it,
/// then the pump that carries the transmission phase.
fn secure(
    ctl: &Controller,
    socket: Socket,
    peer: &Peer,
    tls: &TlsServer,
    no_zeroes: bool,
    until: Instant,
    admit: &mut dyn FnMut() -> Result<(), String>,
) -> Option<Negotiation> {
    let handle = socket.try_clone().ok()?;
    let mut session = match tls.accept(socket, until) {
        Ok(s) => s,
        Err(e) => {
            failed(ctl, &handle, peer, HandshakeError::Io(e));
            return None;
        }
    };
    let mut secured = Secured::new(&mut session, until);
    let negotiated = match handshake::resume_after_tls(&mut secured, &ctl.export, no_zeroes, admit)
    {
        Ok(Outcome::Transmission(n)) => n,
        Ok(Outcome::Aborted | Outcome::StartTls { .. }) => return None,
        Err(e) => {
            failed(ctl, &handle, peer, e);
            return None;
        }
    };
    let id = peer.id;
    match Pump::start(session, peer.name.clone(), id, ctl.config.send_timeout) {
        Ok((socket, pump)) => Some(Negotiation {
            socket,
            negotiated,
            pump: Some(pump),
        }),
        Err(e) => {
            tracing::warn!(conn = id, error = %e, "cannot start the TLS pump; closing the connection");
            None
        }
    }
}

/// A connection, for log lines.
struct Peer {
    id: u64,
    name: String,
}

/// Log why a negotiation failed and close the connection.
fn failed(ctl: &Controller, socket: &Socket, to: &Peer, e: HandshakeError) {
    let (id, peer) = (to.id, &to.name);
    match e {
        HandshakeError::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) =>
        {
            ctl.metrics
                .handshake_timeouts
                .fetch_add(1, Ordering::Relaxed);
            let limit = ctl.config.handshake_timeout;
            tracing::info!(conn = id, %peer, ?limit, "the client did not finish its handshake in time; closing");
        }
        HandshakeError::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            // TLS refused the client (a bad or missing certificate, a
            // wrong key) or the session broke.
            tracing::warn!(conn = id, %peer, error = %e, "TLS failed during the handshake; closing the connection");
        }
        HandshakeError::Io(e) => {
            tracing::debug!(conn = id, error = %e, "client left during the handshake");
            return;
        }
        HandshakeError::Refused(why) => {
            tracing::warn!(conn = id, %peer, "{why}; closing the connection");
        }
        HandshakeError::TlsRequired => {
            tracing::info!(conn = id, %peer, "EXPORT_NAME without TLS on a server that requires it; closing the connection");
        }
        e => {
            tracing::warn!(conn = id, error = %e, "handshake failed; closing the connection");
            ctl.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    let _ = socket.shutdown(Shutdown::Both);
}

/// Serve one negotiated client until it disconnects.
pub fn serve(ctl: Arc<Controller>, socket: Socket, negotiated: Negotiated, id: u64) {
    let Ok(out) = socket.try_clone() else { return };
    let idle = ctl.config.idle_timeout;
    if !idle.is_zero() {
        // Reads wake this often to check for idleness.
        let _ = socket.set_read_timeout(Some(idle.min(Duration::from_secs(1))));
    }
    let conn = Arc::new(Connection::new(ctl, out, negotiated, id));
    // This thread and the connection's others (they inherit it) are woken
    // by the client's bytes: they do not preempt it (`crate::sched`).
    crate::sched::enter(conn.ctl.config.sched_policy);
    let input = Mutex::new(Input {
        r: BufReader::with_capacity(
            CONNECTION_READ_BUFFER_BYTES,
            Patient {
                s: &socket,
                conn: &conn,
            },
        ),
        done: false,
        drained: None,
    });
    let threads = conn.ctl.config.connection_threads.max(1);
    let lead = Arc::new(Lead::default());
    let reason = std::thread::scope(|scope| {
        let drainer = std::thread::Builder::new()
            .name(format!("nbd-send-{id}"))
            .spawn_scoped(scope, || conn.drainer());
        if let Err(e) = &drainer {
            tracing::warn!(conn = id, error = %e, "could not start the connection's sender; closing");
            return Ok(());
        }
        // Counted by the output gate while it reads (commits when idle).
        let epochs = &conn.ctl.engine().epochs;
        epochs.reader(true);
        let helpers: Vec<_> = (1..threads)
            .filter_map(|k| {
                let spawned = std::thread::Builder::new()
                    .name(format!("nbd-conn-{id}.{k}"))
                    .spawn_scoped(scope, || read_loop(&conn, &input, &lead));
                // Without the thread the connection is served by fewer.
                spawned
                    .inspect_err(|e| tracing::warn!(conn = id, error = %e, "could not start a connection thread"))
                    .ok()
            })
            .collect();
        let mut reason = read_loop(&conn, &input, &lead);
        for h in helpers {
            let theirs = h.join().unwrap_or(Ok(()));
            if reason.is_ok() {
                reason = theirs;
            }
        }
        if let Some(stalled) = input.lock().drained.take() {
            epochs.reader_reads(stalled);
        }
        epochs.reader(false);
        conn.wait_idle();
        // Its clients' depth leaves the sum with it.
        epochs.client_depth(-i64::from(conn.peak_inflight.swap(0, Ordering::Relaxed)));
        // Every reply is queued: let the drainer finish sending and leave.
        let mut outbox = conn.outbox.lock();
        outbox.closing = true;
        conn.drain.notify_all();
        drop(outbox);
        reason
    });
    if let Err(e) = reason {
        tracing::warn!(conn = id, error = %e, "closing the connection");
        conn.ctl
            .metrics
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
    }
    let _ = socket.shutdown(Shutdown::Both);
}

/// The connection's socket as its readers see it: a read that times out
/// (the idle check's tick) is retried until the connection is idle past
/// `idle_timeout`; every byte read is activity.
struct Patient<'a> {
    s: &'a Socket,
    conn: &'a Connection,
}

impl Read for Patient<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match (&*self.s).read(buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.conn.idle_expired() {
                        tracing::info!(
                            conn = self.conn.id,
                            idle_timeout = ?self.conn.ctl.config.idle_timeout,
                            "connection idle; closing it"
                        );
                        return Err(e);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                r => {
                    if matches!(r, Ok(n) if n > 0) {
                        let ms = self.conn.born.elapsed().as_millis() as u64;
                        self.conn.last_read_ms.store(ms, Ordering::Relaxed);
                    }
                    return r;
                }
            }
        }
    }
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
    r: BufReader<Patient<'a>>,
    /// The client disconnected or violated the protocol: stop reading.
    done: bool,
    /// No whole request is buffered: the next read may wait for the
    /// client (`Some(stalled)`, counted by the output gate:
    /// `Epochs::reader_drains`).
    drained: Option<bool>,
}

/// Which of a connection's threads holds the read side.
#[derive(Default)]
struct Lead {
    state: Mutex<LeadState>,
    turn: Condvar,
}

#[derive(Default)]
struct LeadState {
    /// A thread holds the read side.
    held: bool,
    /// The connection stopped reading (disconnect or violation).
    closed: bool,
}

impl Lead {
    /// Wait for the read side; `false` once the connection stopped reading.
    fn take(&self) -> bool {
        let mut s = self.state.lock();
        while s.held && !s.closed {
            self.turn.wait(&mut s);
        }
        if s.closed {
            return false;
        }
        s.held = true;
        true
    }

    /// Give the read side to a waiting thread (if any waits; else to the
    /// next that asks).
    fn let_go(&self) {
        self.state.lock().held = false;
        self.turn.notify_one();
    }

    /// Stop reading: every thread leaves after its current request.
    fn close(&self) {
        self.state.lock().closed = true;
        self.turn.notify_all();
    }
}

/// Read requests until the client disconnects (Ok) or violates the
/// protocol (Err), and run them. I/O errors are a disconnect.
///
/// Each of the connection's threads runs this loop: it waits for the read
/// side, then frames a request (its payload too) and runs it itself as an
/// affiliate of the runtime: every stage whose group admits it runs on
/// this thread (no hand-off to a worker on the good path; see
/// `rcs::affiliate`), the rest are queued for the workers. It reads the
/// next request as long as it holds the read side, which it lets go when a
/// request is about to wait ([`crate::blocking`]): while one thread waits
/// (a device read, an fsync, NVS space), another reads on.
fn read_loop(
    conn: &Arc<Connection>,
    input: &Mutex<Input<'_>>,
    lead: &Arc<Lead>,
) -> Result<(), Violation> {
    let ctl = &conn.ctl;
    let g = ctl.groups;
    let mut affiliate = ctl.rt.affiliate(&[g.host, g.cache, g.nvs, g.device]);
    let mut raw = [0u8; REQUEST_BYTES];
    let let_go: crate::blocking::LetGo = {
        let (lead, conn) = (Arc::clone(lead), Arc::clone(conn));
        Arc::new(move || {
            conn.reader_uncork();
            lead.let_go();
        })
    };
    let reason = 'reading: loop {
        if !lead.take() {
            break Ok(());
        }
        crate::blocking::lead(Arc::clone(&let_go));
        while crate::blocking::leading() {
            let (req, slots) = {
                let mut input = input.lock();
                if input.done {
                    break 'reading Ok(());
                }
                // Requests that arrived together are answered together:
                // replies held back (below) leave before the reader waits
                // for the socket.
                if !whole_request_buffered(input.r.buffer()) {
                    conn.reader_uncork();
                    if input.drained.is_none() {
                        let stalled = conn.stalled();
                        input.drained = Some(stalled);
                        let engine = ctl.engine();
                        let due = engine
                            .epochs
                            .reader_drains(stalled, engine.system.in_pipeline() == 0);
                        // The controller went idle with output held: end
                        // the epoch here, before waiting for the client,
                        // rather than wake the checkpoint thread for it
                        // (a wake-up and two thread switches per commit;
                        // at queue depth 1, per write).
                        engine.epochs.end_due(engine, due);
                    }
                }
                let read = next_request(conn, &mut input.r, &mut raw);
                if let Some(stalled) = input.drained.take() {
                    ctl.engine().epochs.reader_reads(stalled);
                }
                // While the next request is already here whole, hold this
                // one's reply back: a burst that one read brought leaves
                // in one `sendmsg` (and wakes the client once), its first
                // reply included.
                if whole_request_buffered(input.r.buffer()) {
                    conn.reader_cork();
                }
                if !matches!(read, Ok(Some(_))) {
                    input.done = true;
                }
                match read {
                    Ok(Some(framed)) => framed,
                    Ok(None) => break 'reading Ok(()),
                    Err(v) => break 'reading Err(v),
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
    };
    // Whoever stops reading stops the others (each after its request).
    if crate::blocking::resign().is_some() {
        conn.reader_uncork();
    }
    lead.close();
    reason
}

/// Whether `buffered` (the start of the unread stream) holds a whole
/// request: its header and, for a WRITE, its payload.
fn whole_request_buffered(buffered: &[u8]) -> bool {
    let Some(raw) = buffered.first_chunk::<REQUEST_BYTES>() else {
        return false;
    };
    match RequestHeader::parse(raw) {
        Some(h) if h.kind == cmd::WRITE => buffered.len() - REQUEST_BYTES >= h.length as usize,
        _ => true,
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
    if !conn.admit(charge_of(&header)) {
        // Cut (a client that read no reply for send_timeout): stop.
        return Ok(None);
    }
    let sink: Arc<dyn ReplySink> = Arc::clone(conn) as Arc<dyn ReplySink>;
    let mut req = Box::new(Request::new(Arc::clone(conn.ctl.engine()), sink, header));
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
    // Read into uninitialised capacity (`read_to_end` through the
    // connection's `BufReader` copies without zeroing first).
    let mut payload = Vec::with_capacity(len as usize);
    match r.take(u64::from(len)).read_to_end(&mut payload) {
        Ok(n) if n == len as usize => {}
        _ => return Ok(None),
    }
    req.payload = payload;
    Ok(Some(if aligned && in_range {
        len / TRACK_BYTES as u32
    } else {
        0
    }))
}
