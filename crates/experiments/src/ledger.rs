//! The ledger client: one pipelined NBD connection writing
//! self-identifying versions of tracks (each 4 KiB block names its track
//! and version and is filled from both), with a FLUSH every few writes,
//! recording when each write and FLUSH was issued and answered on one
//! event clock. After a power loss (or any fault) [`verify`] reads every
//! track back and says what was lost:
//!
//! - a write acknowledged before a FLUSH was issued is *covered* once that
//!   FLUSH is acknowledged; a track must never hold a version older than a
//!   covered write (one acknowledged before the covered write was issued;
//!   overlapping writes are unordered), nor zeroes once a write was
//!   covered;
//! - every block read must be a version of its track the client wrote (or
//!   the track's last verified version): never torn, foreign or invented.
//!
//! Without a crash, [`Ledger::cover_acknowledged`] covers every
//! acknowledged write: then nothing acknowledged may be missing.
//! `tests/power_loss.rs` and `rebound bench device-faults` use it.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use controller::nbd::proto::{REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, cmd};

use crate::nbd_client::NbdClient;

/// The track size the client writes in.
pub const TRACK: usize = 4096;

/// The block for (track, version).
pub fn block(track: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; TRACK];
    b[0..8].copy_from_slice(&track.to_le_bytes());
    b[8..16].copy_from_slice(&version.to_le_bytes());
    let mut x = track.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version.wrapping_add(1);
    for chunk in b[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// What a block holds: a version of its track (checked byte for byte), the
/// never-written zero block, or garbage.
pub fn identify(track: u64, data: &[u8]) -> Result<Option<u64>, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let t = u64::from_le_bytes(data[0..8].try_into().expect("8 bytes"));
    let v = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes"));
    if t != track || data != block(track, v).as_slice() {
        return Err(format!(
            "track {track} holds bytes no one wrote (header says track {t} v{v})"
        ));
    }
    Ok(Some(v))
}

/// One write of a track.
#[derive(Debug, Clone, Copy)]
struct Rec {
    version: u64,
    issued: u64,
    acked: Option<u64>,
    covered: bool,
}

/// Every track's writes since its last verified state.
#[derive(Debug, Default)]
pub struct Ledger {
    clock: u64,
    next_version: u64,
    tracks: HashMap<u64, Vec<Rec>>,
    /// The verified state of each track (its base), or none (zeroes).
    base: HashMap<u64, u64>,
}

impl Ledger {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn issue(&mut self, track: u64) -> u64 {
        self.next_version += 1;
        let version = self.next_version;
        let issued = self.tick();
        self.tracks.entry(track).or_default().push(Rec {
            version,
            issued,
            acked: None,
            covered: false,
        });
        version
    }

    fn ack(&mut self, track: u64, version: u64) {
        let now = self.tick();
        if let Some(rec) = self
            .tracks
            .get_mut(&track)
            .and_then(|h| h.iter_mut().find(|r| r.version == version))
        {
            rec.acked = Some(now);
        }
    }

    /// A FLUSH issued at `issued` was acknowledged: every write
    /// acknowledged before it is covered.
    fn flushed(&mut self, issued: u64) {
        for history in self.tracks.values_mut() {
            for r in history.iter_mut() {
                if r.acked.is_some_and(|a| a < issued) {
                    r.covered = true;
                }
            }
        }
    }

    /// Without a crash nothing acknowledged may be lost: cover every
    /// acknowledged write.
    pub fn cover_acknowledged(&mut self) {
        let now = self.tick();
        self.flushed(now);
    }

    /// Check what `track` holds; it becomes the base. Whether it held a
    /// covered version, or what is wrong.
    fn check(&mut self, track: u64, found: Option<u64>) -> Result<bool, String> {
        let history = self.tracks.remove(&track).unwrap_or_default();
        let base = self.base.get(&track).copied();
        let any_covered = history.iter().any(|r| r.covered);
        let verdict = match found {
            None if any_covered => Err("reads zeroes, but a write of it was flushed".to_owned()),
            None if base.is_some() => Err("reads zeroes over a verified version".to_owned()),
            None => Ok(false),
            Some(v) if Some(v) == base && !any_covered => Ok(false),
            Some(v) => match history.iter().find(|r| r.version == v) {
                None => Err(format!(
                    "holds v{v}, which is not in its history (base {base:?})"
                )),
                Some(f) => match history
                    .iter()
                    .find(|c| c.covered && f.acked.is_some_and(|a| a < c.issued))
                {
                    Some(c) => Err(format!("holds v{v}, older than the flushed v{}", c.version)),
                    None => Ok(any_covered),
                },
            },
        };
        match found {
            Some(v) => self.base.insert(track, v),
            None => self.base.remove(&track),
        };
        verdict.map_err(|e| format!("track {track} {e}; history {history:?}"))
    }
}

/// A request in flight: its writes, or a FLUSH issued at a tick.
enum Pending {
    Writes(Vec<(u64, u64)>),
    Flush(u64),
}

type Pendings = Arc<Mutex<HashMap<u64, Pending>>>;

/// What one connection of the client got answered.
#[derive(Debug, Default, Clone, Copy)]
pub struct Answered {
    /// Writes acknowledged.
    pub writes: u64,
    /// FLUSHes acknowledged.
    pub flushes: u64,
    /// Writes answered with an error.
    pub write_errors: u64,
    /// FLUSHes answered with an error.
    pub flush_errors: u64,
}

/// The tracks the client writes: `[first, first + count)`.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// First track.
    pub first: u64,
    /// Tracks.
    pub count: u64,
}

/// One request's frame.
fn frame(kind: u16, cookie: u64, offset: u64, payload: &[u8], length: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(28 + payload.len());
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&length.to_be_bytes());
    b.extend_from_slice(payload);
    b
}

/// Read replies until the connection breaks, entering them in the ledger.
fn spawn_reader(
    mut rx: TcpStream,
    ledger: &Arc<Mutex<Ledger>>,
    pending: &Pendings,
    done: &Arc<AtomicBool>,
) -> std::thread::JoinHandle<Answered> {
    let (ledger, pending, done) = (Arc::clone(ledger), Arc::clone(pending), Arc::clone(done));
    std::thread::spawn(move || {
        let mut a = Answered::default();
        let mut h = [0u8; 16];
        while rx.read_exact(&mut h).is_ok() {
            if u32::from_be_bytes(h[0..4].try_into().expect("4 bytes")) != SIMPLE_REPLY_MAGIC {
                break;
            }
            let error = u32::from_be_bytes(h[4..8].try_into().expect("4 bytes"));
            let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
            let Some(p) = pending.lock().expect("pending").remove(&cookie) else {
                break;
            };
            let mut l = ledger.lock().expect("ledger");
            match (p, error) {
                (Pending::Writes(ws), 0) => {
                    a.writes += 1;
                    for (t, v) in ws {
                        l.ack(t, v);
                    }
                }
                (Pending::Writes(_), _) => a.write_errors += 1,
                (Pending::Flush(issued), 0) => {
                    a.flushes += 1;
                    l.flushed(issued);
                }
                (Pending::Flush(_), _) => a.flush_errors += 1,
            }
        }
        done.store(true, Ordering::SeqCst);
        a
    })
}

/// Write 1 to 3 tracks per request (16 in flight), a FLUSH one request in
/// `flush_every`, until the connection breaks or `stop` is set (then what
/// is in flight is answered first).
pub fn write_until(
    addr: &str,
    region: Region,
    ledger: &Arc<Mutex<Ledger>>,
    flush_every: u64,
    seed: u64,
    stop: &AtomicBool,
) -> Answered {
    let Ok(client) = NbdClient::connect(addr) else {
        return Answered::default();
    };
    let Ok(mut tx) = client.into_stream() else {
        return Answered::default();
    };
    let Ok(rx) = tx.try_clone() else {
        return Answered::default();
    };
    let _ = rx.set_read_timeout(None);
    let pending: Pendings = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let reader = spawn_reader(rx, ledger, &pending, &done);
    let mut rng = seed | 1;
    let mut cookie = 0u64;
    while !done.load(Ordering::SeqCst) {
        let in_flight = pending.lock().expect("pending").len();
        if stop.load(Ordering::SeqCst) {
            if in_flight == 0 {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        if in_flight >= 16 {
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        cookie += 1;
        let req = if rng.is_multiple_of(flush_every) {
            let issued = ledger.lock().expect("ledger").tick();
            pending
                .lock()
                .expect("pending")
                .insert(cookie, Pending::Flush(issued));
            frame(cmd::FLUSH, cookie, 0, &[], 0)
        } else {
            let tracks = (1 + (rng >> 60) % 3).min(region.count);
            let first = region.first + (rng >> 8) % (region.count - tracks + 1);
            let mut payload = Vec::with_capacity(tracks as usize * TRACK);
            let mut writes = Vec::new();
            {
                let mut l = ledger.lock().expect("ledger");
                for t in first..first + tracks {
                    let v = l.issue(t);
                    payload.extend_from_slice(&block(t, v));
                    writes.push((t, v));
                }
            }
            pending
                .lock()
                .expect("pending")
                .insert(cookie, Pending::Writes(writes));
            let len = payload.len() as u32;
            frame(cmd::WRITE, cookie, first * TRACK as u64, &payload, len)
        };
        if tx.write_all(&req).is_err() {
            break;
        }
    }
    let _ = tx.shutdown(std::net::Shutdown::Both);
    reader.join().unwrap_or_default()
}

/// What [`verify`] found.
#[derive(Debug, Default)]
pub struct Verified {
    /// Tracks holding a covered (flushed) version.
    pub covered: u64,
    /// What was lost or wrong, one line per track.
    pub lost: Vec<String>,
}

/// Read every track of `region` back (64 reads in flight) and check it
/// against the ledger; each becomes its track's base.
pub fn verify(addr: &str, region: Region, ledger: &mut Ledger) -> anyhow::Result<Verified> {
    let mut s = NbdClient::connect(addr)?.into_stream()?;
    let mut out = Verified::default();
    let tracks: Vec<u64> = (region.first..region.first + region.count).collect();
    for batch in tracks.chunks(64) {
        for &t in batch {
            s.write_all(&frame(cmd::READ, t, t * TRACK as u64, &[], TRACK as u32))?;
        }
        let mut got = HashMap::new();
        for _ in batch {
            let mut h = [0u8; 16];
            s.read_exact(&mut h).context("read reply")?;
            let error = u32::from_be_bytes(h[4..8].try_into()?);
            let cookie = u64::from_be_bytes(h[8..16].try_into()?);
            anyhow::ensure!(error == 0, "read of track {cookie} failed ({error})");
            let mut data = vec![0u8; TRACK];
            s.read_exact(&mut data).context("read data")?;
            got.insert(cookie, data);
        }
        for &t in batch {
            let data = got.remove(&t).context("a read answered twice")?;
            let verdict = identify(t, &data).and_then(|found| ledger.check(t, found));
            match verdict {
                Ok(covered) => out.covered += u64::from(covered),
                Err(e) => out.lost.push(e),
            }
        }
    }
    s.write_all(&frame(cmd::DISC, 0, 0, &[], 0))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_identify_their_track_and_version_and_refuse_the_rest() {
        assert_eq!(identify(7, &block(7, 3)), Ok(Some(3)));
        assert_eq!(identify(7, &[0u8; TRACK]), Ok(None));
        assert!(identify(8, &block(7, 3)).is_err(), "foreign");
        let mut torn = block(7, 3);
        torn[2048..].copy_from_slice(&block(7, 4)[2048..]);
        assert!(identify(7, &torn).is_err(), "torn");
    }

    #[test]
    fn a_version_older_than_a_flushed_write_is_a_loss_and_overlap_is_not() {
        let mut l = Ledger::default();
        let v1 = l.issue(1);
        l.ack(1, v1);
        let v2 = l.issue(1);
        l.ack(1, v2);
        let flush = l.tick();
        l.flushed(flush);
        assert!(l.check(1, Some(v1)).unwrap_err().contains("older"));
        // Two writes in flight together: either may be the last.
        let a = l.issue(2);
        let b = l.issue(2);
        l.ack(2, b);
        l.ack(2, a);
        l.cover_acknowledged();
        assert_eq!(l.check(2, Some(b)), Ok(true));
        let c = l.issue(3);
        l.ack(3, c);
        l.cover_acknowledged();
        assert!(l.check(3, None).unwrap_err().contains("zeroes"));
    }
}
