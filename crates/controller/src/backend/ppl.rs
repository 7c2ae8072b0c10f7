//! The partial parity log: closes the RAID-5 write hole of a parity volume
//! (DESIGN.md failure model: a crash, then a lost device).
//!
//! A track write of a parity stripe writes two slots, the data and then
//! the parity. A crash between them leaves the stripe torn: its parity no
//! longer the XOR of its data. The NVS redoes the interrupted write after
//! the restart, but if a device is lost first (its file missing at the
//! restart, or failing before the redo), a *different* member of the torn
//! stripe, one no write touched, would be rebuilt from the stale parity:
//! data acknowledged long ago, lost. Linux md's answer, followed here, is a
//! partial parity log: before the data slot is written, the log records
//! the stripe, the written member and the *partial parity*, the XOR of the
//! stripe's other data members (which a reconstruct-write reads anyway).
//! Whatever the crash left of the write, `partial XOR data` is the parity
//! of the stripe as its data slots are, so replaying the record after a
//! restart (before any rebuild) makes the stripe whole, and every member
//! the write did not touch can be rebuilt. The record is cleared when the
//! write returns, done or failed (a failed write's device is lost, and the
//! NVS redoes the write), so a record outlives its write only through a
//! crash, and the restart's replay then empties the log.
//!
//! Zeroing whole stripes writes every member without the stripe locks; an
//! intent record names the range first and is cleared after, and a replay
//! zeroes the range again (the zeroing was not acknowledged; the NVS replay
//! that follows writes back any dirty track of the range).
//!
//! Entries are written with `pwrite` and not synced: like the NVS mapping
//! and the device writes, they survive the process (the failure model's
//! crash), and a volume on media that must survive power loss syncs them
//! as it syncs the devices.
//!
//! File `ppl.log` in the volume's directory: `entries` fixed entries of
//! [`ENTRY_BYTES`], entry `i` at `i * ENTRY_BYTES`, little-endian:
//! ```text
//! 0   u32 magic "RPPL" (0x4C505052); anything else: an empty entry
//! 4   u32 kind: 1 track write, 2 zero run
//! 8   u64 kind 1: stripe      | kind 2: first track
//! 16  u64 kind 1: data device | kind 2: end track (exclusive)
//! 24  u32 zero
//! 28  u32 crc32c of bytes 0..28, then (kind 1) the partial parity
//! 32  [TRACK_BYTES] kind 1: the partial parity
//! ```
//! An entry failing its check (a torn write of the entry itself, whose
//! data write never started) is ignored.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::limits::TRACK_BYTES;

/// Bytes of one entry: the header and one track of partial parity.
pub const ENTRY_BYTES: usize = HEADER_BYTES + TRACK_BYTES;

const HEADER_BYTES: usize = 32;
const MAGIC: u32 = 0x4C50_5052;
const KIND_WRITE: u32 = 1;
const KIND_ZERO: u32 = 2;

/// What an entry says was in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Intent {
    /// A track write of `stripe`'s member on `device`; `partial` is the XOR
    /// of the stripe's other data members.
    Write {
        /// The stripe (its slot on every device).
        stripe: u64,
        /// The device of the member written.
        device: usize,
        /// The partial parity.
        partial: Vec<u8>,
    },
    /// Whole stripes of tracks `[first, end)` being zeroed.
    Zero {
        /// First track.
        first: u64,
        /// End track (exclusive).
        end: u64,
    },
}

/// An open partial parity log.
#[derive(Debug)]
pub struct PartialParityLog {
    file: File,
    path: PathBuf,
    entries: usize,
}

impl PartialParityLog {
    /// Opens `ppl.log` in `dir` with `entries` entries, creating it (all
    /// entries empty, `dir` synced so the new file lasts) when missing.
    pub fn open(dir: &Path, entries: usize) -> std::io::Result<Self> {
        let path = dir.join("ppl.log");
        let file = crate::files::open_state_file(&path, crate::files::Create::IfMissing)?;
        let len = (entries * ENTRY_BYTES) as u64;
        let had = file.metadata()?.len();
        if had < len {
            file.set_len(len)?;
        }
        if had == 0 {
            // Created: its name must last as long as its entries.
            crate::files::sync_dir(dir)?;
        }
        Ok(PartialParityLog {
            file,
            path,
            entries,
        })
    }

    /// The log's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of entries.
    pub fn entries(&self) -> usize {
        self.entries
    }

    fn header(kind: u32, a: u64, b: u64, payload: &[u8]) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&a.to_le_bytes());
        h[16..24].copy_from_slice(&b.to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&h[..28]), payload);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Records a track write of `stripe`'s member on `device` with its
    /// partial parity, in entry `entry`.
    pub fn record_write(
        &self,
        entry: usize,
        stripe: u64,
        device: usize,
        partial: &[u8],
    ) -> std::io::Result<()> {
        assert!(entry < self.entries, "entry {entry} of {}", self.entries);
        assert_eq!(partial.len(), TRACK_BYTES, "one track of partial parity");
        let mut e = Vec::with_capacity(ENTRY_BYTES);
        e.extend_from_slice(&Self::header(KIND_WRITE, stripe, device as u64, partial));
        e.extend_from_slice(partial);
        self.file.write_all_at(&e, (entry * ENTRY_BYTES) as u64)
    }

    /// Records the zeroing of tracks `[first, end)` in entry `entry`.
    pub fn record_zero(&self, entry: usize, first: u64, end: u64) -> std::io::Result<()> {
        assert!(entry < self.entries, "entry {entry} of {}", self.entries);
        let h = Self::header(KIND_ZERO, first, end, &[]);
        self.file.write_all_at(&h, (entry * ENTRY_BYTES) as u64)
    }

    /// Empties entry `entry` (its write is complete).
    pub fn clear(&self, entry: usize) -> std::io::Result<()> {
        assert!(entry < self.entries, "entry {entry} of {}", self.entries);
        self.file
            .write_all_at(&[0u8; 4], (entry * ENTRY_BYTES) as u64)
    }

    /// Every entry that passes its check, in entry order.
    pub fn intents(&self) -> std::io::Result<Vec<Intent>> {
        let len = self.file.metadata()?.len() as usize;
        let mut out = Vec::new();
        let mut e = vec![0u8; ENTRY_BYTES];
        for i in 0..len / ENTRY_BYTES {
            self.file.read_exact_at(&mut e, (i * ENTRY_BYTES) as u64)?;
            let word = |at: usize| u32::from_le_bytes(e[at..at + 4].try_into().expect("4 bytes"));
            let long = |at: usize| u64::from_le_bytes(e[at..at + 8].try_into().expect("8 bytes"));
            if word(0) != MAGIC {
                continue;
            }
            let (kind, a, b) = (word(4), long(8), long(16));
            let payload: &[u8] = if kind == KIND_WRITE {
                &e[HEADER_BYTES..]
            } else {
                &[]
            };
            if Self::header(kind, a, b, payload)[..] != e[..HEADER_BYTES] {
                tracing::warn!(entry = i, path = %self.path.display(), "partial parity log entry fails its check; ignored");
                continue;
            }
            out.push(match kind {
                KIND_WRITE => Intent::Write {
                    stripe: a,
                    device: b as usize,
                    partial: payload.to_vec(),
                },
                KIND_ZERO => Intent::Zero { first: a, end: b },
                _ => continue,
            });
        }
        Ok(out)
    }

    /// Empties every entry (after a replay) and sizes the file to
    /// `entries` entries.
    pub fn reset(&self) -> std::io::Result<()> {
        self.file.set_len(0)?;
        self.file.set_len((self.entries * ENTRY_BYTES) as u64)?;
        self.file.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn track(seed: u8) -> Vec<u8> {
        (0..TRACK_BYTES).map(|i| (i as u8) ^ seed).collect()
    }

    #[test]
    fn recorded_intents_read_back_and_cleared_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let log = PartialParityLog::open(dir.path(), 8).unwrap();
        assert!(log.intents().unwrap().is_empty());
        log.record_write(3, 77, 2, &track(5)).unwrap();
        log.record_zero(7, 10, 40).unwrap();
        log.record_write(1, 9, 0, &track(6)).unwrap();
        log.clear(1).unwrap();
        assert_eq!(
            log.intents().unwrap(),
            vec![
                Intent::Write {
                    stripe: 77,
                    device: 2,
                    partial: track(5)
                },
                Intent::Zero { first: 10, end: 40 },
            ]
        );
        // Survives reopening; a reset empties it.
        drop(log);
        let log = PartialParityLog::open(dir.path(), 8).unwrap();
        assert_eq!(log.intents().unwrap().len(), 2);
        log.reset().unwrap();
        assert!(log.intents().unwrap().is_empty());
        assert_eq!(
            std::fs::metadata(log.path()).unwrap().len(),
            (8 * ENTRY_BYTES) as u64
        );
    }

    #[test]
    fn an_entry_failing_its_check_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let log = PartialParityLog::open(dir.path(), 4).unwrap();
        log.record_write(0, 1, 1, &track(1)).unwrap();
        log.record_write(2, 2, 0, &track(2)).unwrap();
        // A torn entry: its partial parity half written.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(log.path())
            .unwrap();
        f.write_all_at(&[0xAA; 100], (HEADER_BYTES + 1000) as u64)
            .unwrap();
        assert_eq!(
            log.intents().unwrap(),
            vec![Intent::Write {
                stripe: 2,
                device: 0,
                partial: track(2)
            }]
        );
    }
}
