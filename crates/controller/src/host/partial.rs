//! Requests at any byte offset and length: the host adapter turns a
//! request that covers part of a track into one on whole tracks, which is
//! all the stages take (cache frames, NVS records and destage are 4 KiB
//! tracks).
//!
//! The Linux kernel's NBD client sends 512-byte requests unless told
//! otherwise, and a client that did not negotiate block sizes may send
//! any byte range. So the export advertises a minimum block size of 1
//! (4 KiB preferred) and:
//!
//! - READ and CACHE read the whole tracks around the range; the reply
//!   carries the client's bytes only ([`Partial`] slices them);
//! - WRITE is a read-modify-write: under an exclusive lock on its partial
//!   edge tracks ([`crate::engine::tracklock`]) it reads their current
//!   data through the ordinary read path, merges the client's bytes in,
//!   and enters the pipeline as a whole-track WRITE, still holding the
//!   lock until it is finished. It is acknowledged only once the merged
//!   tracks' NVS records are written, as any write: a crash or any rung
//!   of the ladder before that loses nothing acknowledged, and redrives,
//!   parking and rollback run the merged write again from its kept
//!   payload with no other change of its tracks in between;
//! - WRITE_ZEROES zeroes the partial edge tracks by read-modify-write
//!   first (each an internal whole-track WRITE, waited for), then zeroes
//!   the whole tracks between as usual. With FAST_ZERO it answers
//!   `ENOTSUP` at once (it would write data, which is not fast);
//! - TRIM, advisory, discards the whole tracks inside the range and leaves
//!   the partial edges as they are.
//!
//! Every whole-track WRITE, TRIM and WRITE_ZEROES holds its tracks' locks
//! shared, so a read-modify-write never reads a track that a change
//! admitted before it has yet to apply. Reads take no lock. Waiting for a
//! lock, and for the old data of a read-modify-write, happens here on the
//! connection's thread, outside the admission gate of rung 4, never on a
//! worker.

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::engine::admission;
use crate::engine::datapath::{validate, whole_tracks};
use crate::engine::request::Request;
use crate::engine::tracklock::Mode;
use crate::engine::{Engine, ReplySink};
use crate::limits::{MAX_PAYLOAD_BYTES, TRACK_BYTES};
use crate::nbd::proto::{NbdError, RequestHeader, cflags, cmd};

const T: u64 = TRACK_BYTES as u64;

/// Admit a framed request, turning a partial-track one into a whole-track
/// one first (see the module doc). `slots`: the NVS slots a whole-track
/// WRITE needs, as framing found.
pub(crate) fn admit(
    engine: &Arc<Engine>,
    structured: bool,
    mut req: Box<Request>,
    slots: u32,
    affiliate: Option<&mut rcs::Affiliate>,
) {
    if req.header.kind == cmd::CACHE {
        // A prefetch hint: the first maximum payload of it is plenty.
        req.header.length = req.header.length.min(MAX_PAYLOAD_BYTES);
    }
    let h = req.header;
    let valid = req.early_error.is_none() && validate(&h, &engine.export, structured, 0).is_ok();
    if !valid || whole_tracks(&h) || h.length == 0 {
        if valid && matches!(h.kind, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES) && h.length > 0 {
            let (first, end) = covering(&h);
            req.track_lock = Some(engine.track_locks.lock(first, end, Mode::Shared, &[]));
        }
        // Invalid requests get their error from the stages' own check.
        admission::admit(engine, req, slots, affiliate);
        return;
    }
    match h.kind {
        cmd::READ | cmd::CACHE => expand_read(engine, req, affiliate),
        cmd::WRITE => read_modify_write(engine, req, affiliate),
        cmd::TRIM => trim_inside(engine, req, affiliate),
        cmd::WRITE_ZEROES => zero_partial(engine, req, affiliate),
        _ => unreachable!("whole_tracks holds for every other command"),
    }
}

/// Tracks `[first, end)` that `h`'s range touches.
fn covering(h: &RequestHeader) -> (u64, u64) {
    let end = h.offset + u64::from(h.length);
    (h.offset / T, end.div_ceil(T))
}

/// Tracks `[first, end)` that `h`'s range covers whole.
fn inside(h: &RequestHeader) -> (u64, u64) {
    let end = h.offset + u64::from(h.length);
    let first = h.offset.div_ceil(T);
    (first, (end / T).max(first))
}

/// The tracks at the range's edges that it covers only in part.
fn partial_edges(h: &RequestHeader) -> Vec<u64> {
    let (first, end) = covering(h);
    let stop = h.offset + u64::from(h.length);
    let mut edges = Vec::with_capacity(2);
    if !h.offset.is_multiple_of(T) || stop < (first + 1) * T {
        edges.push(first);
    }
    if !stop.is_multiple_of(T) && end - 1 != first {
        edges.push(end - 1);
    }
    edges
}

/// `h` moved to whole tracks `[first, end)`.
fn on_tracks(h: &RequestHeader, first: u64, end: u64) -> RequestHeader {
    RequestHeader {
        offset: first * T,
        length: u32::try_from((end - first) * T).expect("a request's tracks fit its length"),
        ..*h
    }
}

/// Hand the request on as `header`, replying to the client as it asked.
fn retarget(req: &mut Request, header: RequestHeader) {
    let client = req.header;
    // Only a READ's range grows outwards; a TRIM's or WRITE_ZEROES' shrinks.
    let skip = client.offset.saturating_sub(header.offset) as usize;
    req.conn = Arc::new(Partial {
        inner: Arc::clone(&req.conn),
        client,
        skip,
    });
    req.header = header;
    req.expanded = true;
}

fn expand_read(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    affiliate: Option<&mut rcs::Affiliate>,
) {
    let (first, end) = covering(&req.header);
    let header = on_tracks(&req.header, first, end);
    retarget(&mut req, header);
    admission::admit(engine, req, 0, affiliate);
}

fn trim_inside(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    affiliate: Option<&mut rcs::Affiliate>,
) {
    let (first, end) = inside(&req.header);
    req.track_lock = Some(engine.track_locks.lock(first, end, Mode::Shared, &[]));
    let header = on_tracks(&req.header, first, end);
    retarget(&mut req, header);
    admission::admit(engine, req, 0, affiliate);
}

/// Answer `req` with `error` (through the stages, as any reply).
fn refuse(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    error: (NbdError, &'static str),
    affiliate: Option<&mut rcs::Affiliate>,
) {
    req.early_error = Some(error);
    req.payload = Vec::new();
    admission::admit(engine, req, 0, affiliate);
}

fn read_modify_write(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    mut affiliate: Option<&mut rcs::Affiliate>,
) {
    let h = req.header;
    let (first, end) = covering(&h);
    let edges = partial_edges(&h);
    let exclusive: Vec<(u64, Mode)> = edges.iter().map(|&t| (t, Mode::Exclusive)).collect();
    let guard = engine
        .track_locks
        .lock(first, end, Mode::Shared, &exclusive);
    let mut merged = vec![0u8; ((end - first) * T) as usize];
    for &t in &edges {
        match read_now(engine, t, affiliate.as_deref_mut()) {
            Ok(old) => merged[((t - first) * T) as usize..][..TRACK_BYTES].copy_from_slice(&old),
            Err(e) => {
                drop(guard);
                let why = "reading the rest of a partially written track failed";
                refuse(engine, req, (e, why), affiliate);
                return;
            }
        }
    }
    let skip = (h.offset - first * T) as usize;
    merged[skip..skip + req.payload.len()].copy_from_slice(&req.payload);
    req.payload = merged;
    req.track_lock = Some(guard);
    retarget(&mut req, on_tracks(&h, first, end));
    admission::admit(engine, req, (end - first) as u32, affiliate);
}

fn zero_partial(
    engine: &Arc<Engine>,
    mut req: Box<Request>,
    mut affiliate: Option<&mut rcs::Affiliate>,
) {
    let h = req.header;
    if h.flags & cflags::FAST_ZERO != 0 {
        let why = "zeroing part of a track writes data: not fast";
        refuse(engine, req, (NbdError::NotSup, why), affiliate);
        return;
    }
    let (first, end) = inside(&h);
    let edges = partial_edges(&h);
    let exclusive: Vec<(u64, Mode)> = edges.iter().map(|&t| (t, Mode::Exclusive)).collect();
    let guard = engine
        .track_locks
        .lock(first, end, Mode::Shared, &exclusive);
    let stop = h.offset + u64::from(h.length);
    for &t in &edges {
        let zeroed = read_now(engine, t, affiliate.as_deref_mut()).and_then(|mut data| {
            let lo = h.offset.max(t * T) - t * T;
            let hi = stop.min((t + 1) * T) - t * T;
            data[lo as usize..hi as usize].fill(0);
            write_now(
                engine,
                t,
                h.flags & cflags::FUA,
                data,
                affiliate.as_deref_mut(),
            )
        });
        if let Err(e) = zeroed {
            drop(guard);
            let why = "zeroing part of a track failed";
            refuse(engine, req, (e, why), affiliate);
            return;
        }
    }
    req.track_lock = Some(guard);
    let header = RequestHeader {
        flags: h.flags & !cflags::FAST_ZERO,
        ..on_tracks(&h, first, end)
    };
    retarget(&mut req, header);
    admission::admit(engine, req, 0, affiliate);
}

/// Read track `track` through the ordinary read path and wait for it.
fn read_now(
    engine: &Arc<Engine>,
    track: u64,
    affiliate: Option<&mut rcs::Affiliate>,
) -> Result<Vec<u8>, NbdError> {
    let header = RequestHeader {
        flags: 0,
        kind: cmd::READ,
        cookie: 0,
        offset: track * T,
        length: TRACK_BYTES as u32,
    };
    let sink = Arc::new(Collect::default());
    let req = Box::new(Request::new(Arc::clone(engine), sink.clone(), header));
    admission::admit(engine, req, 0, affiliate);
    sink.wait()
}

/// Write track `track` through the ordinary write path and wait for it.
fn write_now(
    engine: &Arc<Engine>,
    track: u64,
    flags: u16,
    data: Vec<u8>,
    affiliate: Option<&mut rcs::Affiliate>,
) -> Result<Vec<u8>, NbdError> {
    let header = RequestHeader {
        flags,
        kind: cmd::WRITE,
        cookie: 0,
        offset: track * T,
        length: TRACK_BYTES as u32,
    };
    let sink = Arc::new(Collect::default());
    let mut req = Box::new(Request::new(Arc::clone(engine), sink.clone(), header));
    req.payload = data;
    admission::admit(engine, req, 1, affiliate);
    sink.wait()
}

/// The sink of a request the host adapter expanded: replies go to the
/// client's connection under the client's header, a READ's data cut to
/// the bytes it asked for.
#[derive(Debug)]
struct Partial {
    inner: Arc<dyn ReplySink>,
    client: RequestHeader,
    /// Where the client's bytes start in the expanded READ's data.
    skip: usize,
}

impl ReplySink for Partial {
    fn structured(&self) -> bool {
        self.inner.structured()
    }

    fn send_reply(
        &self,
        _header: &RequestHeader,
        result: Result<(), (NbdError, &str)>,
        mut data: Vec<u8>,
    ) {
        if result.is_ok() && self.client.kind == cmd::READ {
            data.drain(..self.skip.min(data.len()));
            data.truncate(self.client.length as usize);
        }
        self.inner.send_reply(&self.client, result, data);
    }

    fn finish_request(&self) {
        self.inner.finish_request();
    }

    fn cork(&self) -> bool {
        self.inner.cork()
    }

    fn uncork(&self) {
        self.inner.uncork();
    }

    fn allocation(&self) -> bool {
        self.inner.allocation()
    }
}

/// What an internal request answered: a READ's data, or the error.
type Answer = Result<Vec<u8>, NbdError>;

/// The sink of the host adapter's own requests: keeps the result for the
/// thread waiting on it.
#[derive(Debug, Default)]
struct Collect {
    /// (finished, the answer).
    state: Mutex<(bool, Option<Answer>)>,
    done: Condvar,
}

impl Collect {
    /// Wait for the request to finish; no reply at all is an I/O error.
    fn wait(&self) -> Answer {
        let mut s = self.state.lock();
        if !s.0 {
            drop(s);
            crate::blocking::about_to_block();
            s = self.state.lock();
        }
        while !s.0 {
            self.done.wait(&mut s);
        }
        s.1.take().unwrap_or(Err(NbdError::Io))
    }
}

impl ReplySink for Collect {
    fn structured(&self) -> bool {
        false
    }

    fn send_reply(
        &self,
        _header: &RequestHeader,
        result: Result<(), (NbdError, &str)>,
        data: Vec<u8>,
    ) {
        self.state.lock().1 = Some(result.map(|()| data).map_err(|(e, _)| e));
    }

    fn finish_request(&self) {
        self.state.lock().0 = true;
        self.done.notify_all();
    }

    fn cork(&self) -> bool {
        false
    }

    fn uncork(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags: 0,
            kind: cmd::WRITE,
            cookie: 9,
            offset,
            length,
        }
    }

    #[test]
    fn edges_are_the_partly_covered_end_tracks() {
        assert_eq!(partial_edges(&h(512, 512)), [0]);
        assert_eq!(partial_edges(&h(4096 - 512, 1024)), [0, 1]);
        assert_eq!(partial_edges(&h(512, 3 * 4096)), [0, 3]);
        assert_eq!(partial_edges(&h(4096, 4096 + 512)), [2]);
        assert_eq!(partial_edges(&h(100, 4096 - 100)), [0]);
        assert!(partial_edges(&h(4096, 8192)).is_empty());
    }

    #[test]
    fn covering_and_inside_round_out_and_in() {
        assert_eq!(covering(&h(512, 512)), (0, 1));
        assert_eq!(covering(&h(4000, 200)), (0, 2));
        assert_eq!(inside(&h(512, 512)), (1, 1), "no whole track inside");
        assert_eq!(inside(&h(512, 3 * 4096)), (1, 3));
        assert_eq!(inside(&h(0, 4096 + 1)), (0, 1));
    }
}
