//! The allocation map: which tracks of the volume may hold data, for
//! BLOCK_STATUS's `base:allocation` context (sparse copies with `qemu-img
//! convert` and `nbdcopy`, `nbdinfo --map`, `qemu-img map`), and for reads:
//! a cache miss on a track whose bit is clear is answered with zeroes
//! without a device read ([`crate::backend::volume::Volume::read_track`]).
//!
//! One bit per track, in a file mapped shared (`alloc.map` in the data
//! directory). A bit is set *before* a write of its track goes to the
//! devices (at output commit's door, [`crate::backend::pseudodev`], and in
//! [`crate::backend::volume::Volume::write_track`]) and cleared once
//! TRIM or WRITE_ZEROES zeroed the track on the devices. A track whose bit
//! is clear and that has no dirty NVS record reads as zeroes: it was never
//! written, or trimmed or zeroed since. The map errs only towards "data":
//!
//! - a set bit whose write never reached the device (a crash, a rollback)
//!   reports zeroes as data, which costs a copy its sparseness, nothing
//!   else;
//! - the map is synced (`msync`) with every device sync that follows a
//!   change of a bit ([`crate::backend::volume::Volume::sync_since`]), so
//!   a write made durable by FLUSH or FUA has its bit durable too; a process crash
//!   keeps every store (the mapping is shared, the page cache outlives
//!   the process);
//! - a failed `msync` is answered as a failed sync (the destage keeps its
//!   NVS records and writes them again), and every page of the map is
//!   written again before the next: Linux may mark the pages clean after a
//!   failed writeback and report the error once, so a retried `msync`
//!   would succeed without writing bits that are set in memory and will
//!   never be set again (the track's next write finds its bit set);
//! - a missing or damaged map of an existing volume is rebuilt with every
//!   bit set (a new volume's starts clear): a warning says so.
//!
//! After a power loss, a WRITE_ZEROES or TRIM that no FLUSH covered may
//! have its zeroing undone on the devices while its cleared bits survived;
//! reads and BLOCK_STATUS then keep answering zeroes, as the request asked,
//! where the devices hold the older data (NBD promises nothing about
//! unflushed requests across a power loss; both states are allowed).
//!
//! File format (little-endian):
//! ```text
//!  0  u64 magic "RBALLOC1"     8  u64 volume id      16  u64 tracks
//! 24  u32 crc32c of bytes 0..24                      28  u32 zero
//! 32  the bits: u64 words, bit (t % 64) of word (t / 64) is track t
//! ```

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::MmapMut;

/// The file's magic number ("RBALLOC1").
const MAGIC: u64 = u64::from_le_bytes(*b"RBALLOC1");
/// Bytes before the bits.
const HEADER_BYTES: usize = 32;
/// The map's file name in the data directory.
pub const FILE_NAME: &str = "alloc.map";

/// A volume's allocation map.
pub struct AllocMap {
    map: MmapMut,
    tracks: u64,
    path: PathBuf,
    /// A bit changed since the last [`AllocMap::sync`] took this flag:
    /// a sync with nothing changed skips the `msync` (and the device
    /// flush it costs), which on a volume written once over is every
    /// sync.
    changed: AtomicBool,
    /// `msync`s done (tests).
    flushes: AtomicU64,
    /// The next `msync` fails (tests: a failing disk cannot be had).
    #[cfg(test)]
    fail_next_flush: AtomicBool,
}

impl std::fmt::Debug for AllocMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocMap")
            .field("path", &self.path)
            .field("tracks", &self.tracks)
            .finish()
    }
}

fn words_for(tracks: u64) -> usize {
    tracks.div_ceil(64) as usize
}

fn header(volume_id: u64, tracks: u64) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&volume_id.to_le_bytes());
    h[16..24].copy_from_slice(&tracks.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

impl AllocMap {
    /// Open the map of volume `volume_id` (`tracks` tracks) in `dir`.
    /// `new_volume`: the volume was just created (a missing map starts
    /// clear; for an existing volume it starts with every bit set).
    pub fn open(dir: &Path, volume_id: u64, tracks: u64, new_volume: bool) -> io::Result<Self> {
        let path = dir.join(FILE_NAME);
        let len = HEADER_BYTES + words_for(tracks) * 8;
        let expected = header(volume_id, tracks);
        let fits = match crate::files::read_state_file(&path) {
            Ok(b) => Some(b).filter(|b| b.len() == len),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            // A link, another user's file: refused, never replaced.
            Err(e) => return Err(e),
        };
        let problem = match &fits {
            None if !new_volume => Some("missing or of the wrong size"),
            Some(b) if b[..HEADER_BYTES] != expected && !new_volume => {
                Some("for another volume or damaged")
            }
            _ => None,
        };
        let usable = fits.is_some_and(|b| b[..HEADER_BYTES] == expected);
        if !usable {
            if let Some(why) = problem {
                tracing::warn!(
                    path = %path.display(),
                    "the allocation map is {why}: every track is reported as data until it is trimmed or zeroed"
                );
            }
            Self::create(dir, &path, &expected, len, !new_volume)?;
        }
        let file = crate::files::open_state_file(&path, crate::files::Create::Never)?;
        Self::map(file, tracks, path)
    }

    /// Write a fresh map (every bit `set` or clear) and put it in place.
    fn create(dir: &Path, path: &Path, header: &[u8], len: usize, set: bool) -> io::Result<()> {
        let tmp = dir.join(format!("{FILE_NAME}.tmp"));
        let mut bytes = vec![if set { 0xff } else { 0 }; len];
        bytes[..HEADER_BYTES].copy_from_slice(header);
        let mut f = crate::files::create_temporary(&tmp)?;
        io::Write::write_all(&mut f, &bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        crate::files::sync_dir(dir)
    }

    fn map(file: File, tracks: u64, path: PathBuf) -> io::Result<Self> {
        // SAFETY: the file is ours (created in the data directory, which
        // one controller serves at a time) and nobody truncates it while
        // mapped; its length was checked to hold the header and the bits.
        let map = unsafe { MmapMut::map_mut(&file)? };
        if map.len() < HEADER_BYTES + words_for(tracks) * 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} changed size while opening", path.display()),
            ));
        }
        Ok(Self {
            map,
            tracks,
            path,
            // The first sync flushes whatever opening wrote.
            changed: AtomicBool::new(true),
            flushes: AtomicU64::new(0),
            #[cfg(test)]
            fail_next_flush: AtomicBool::new(false),
        })
    }

    fn words(&self) -> &[AtomicU64] {
        let bytes = &self.map[HEADER_BYTES..HEADER_BYTES + words_for(self.tracks) * 8];
        debug_assert_eq!(bytes.as_ptr().align_offset(8), 0);
        // SAFETY: the mapping is page-aligned and the bits start 32 bytes
        // in, so the pointer is 8-aligned; the length is a whole number of
        // u64 words inside the mapping; AtomicU64 has u64's layout, and all
        // access to these words goes through atomics for the mapping's
        // life (which `&self` bounds).
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<AtomicU64>(), bytes.len() / 8) }
    }

    /// Track `track` may hold data from now on (before its write).
    pub fn set(&self, track: u64) {
        debug_assert!(track < self.tracks);
        let w = &self.words()[(track / 64) as usize];
        let bit = 1u64 << (track % 64);
        // Most writes find the bit set already: no store, no dirty page.
        if w.load(Ordering::Acquire) & bit == 0 {
            w.fetch_or(bit, Ordering::AcqRel);
            // After the bit: a sync that takes the flag flushes the bit.
            self.changed.store(true, Ordering::Release);
        }
    }

    /// Tracks `[first, end)` read as zeroes on the devices now.
    pub fn clear(&self, first: u64, end: u64) {
        let end = end.min(self.tracks);
        let words = self.words();
        let mut t = first;
        while t < end {
            let (w, lo) = ((t / 64) as usize, t % 64);
            let hi = (end - (t - lo)).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            if words[w].load(Ordering::Acquire) & mask != 0 {
                words[w].fetch_and(!mask, Ordering::AcqRel);
                self.changed.store(true, Ordering::Release);
            }
            t += hi - lo;
        }
    }

    /// Whether track `track` may hold data.
    pub fn may_hold_data(&self, track: u64) -> bool {
        track < self.tracks
            && self.words()[(track / 64) as usize].load(Ordering::Acquire) & (1 << (track % 64))
                != 0
    }

    /// Make the map durable (with a device sync).
    pub fn sync(&self) -> io::Result<()> {
        // A bit changed before this sync was asked for set the flag
        // before it (`set`, `clear`): taking it here, the `msync` below
        // covers that bit. One changed after the swap sets it again for
        // the next sync.
        if !self.changed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        self.flushes.fetch_add(1, Ordering::Relaxed);
        self.flush().map_err(|e| {
            // The kernel may have marked the pages clean: dirty them
            // again, then the next sync tries again.
            self.redirty();
            self.changed.store(true, Ordering::Release);
            io::Error::new(
                e.kind(),
                format!(
                    "cannot sync the allocation map {}: {e}",
                    self.path.display()
                ),
            )
        })
    }

    fn flush(&self) -> io::Result<()> {
        #[cfg(test)]
        if self.fail_next_flush.swap(false, Ordering::AcqRel) {
            return Err(io::Error::from_raw_os_error(5));
        }
        self.map.flush()
    }

    /// Store every word of the map again, so that every page of it is
    /// dirty and the next `msync` writes it whatever a failed writeback
    /// left of the pages' dirty state. A store to a page the kernel
    /// cleaned faults and dirties the page; a compare-exchange of a word
    /// with itself is such a store (`fetch_or(0)` may be compiled to a
    /// load) and loses no bit set concurrently (it fails and retries).
    /// The header shares the first page with the bits.
    fn redirty(&self) {
        for w in self.words() {
            let mut v = w.load(Ordering::Relaxed);
            while let Err(now) = w.compare_exchange_weak(v, v, Ordering::AcqRel, Ordering::Relaxed)
            {
                v = now;
            }
        }
    }

    /// `msync`s done so far.
    #[cfg(test)]
    fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_flushes_the_map_only_when_a_bit_changed_since_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let m = AllocMap::open(dir.path(), 7, 1000, true).unwrap();
        m.sync().unwrap();
        assert_eq!(m.flushes(), 1, "the first sync flushes what opening wrote");
        m.sync().unwrap();
        assert_eq!(m.flushes(), 1, "nothing changed");
        m.set(5);
        m.sync().unwrap();
        assert_eq!(m.flushes(), 2, "a bit set");
        m.set(5);
        m.sync().unwrap();
        assert_eq!(m.flushes(), 2, "setting a set bit changes nothing");
        m.clear(100, 200);
        m.sync().unwrap();
        assert_eq!(m.flushes(), 2, "clearing clear bits changes nothing");
        m.clear(0, 64);
        m.sync().unwrap();
        assert_eq!(m.flushes(), 3, "a bit cleared");
        assert!(!m.may_hold_data(5));
        drop(m);
        let m = AllocMap::open(dir.path(), 7, 1000, false).unwrap();
        assert!((0..1000).all(|t| !m.may_hold_data(t)), "the flushed map");
    }

    #[test]
    fn a_failed_sync_dirties_every_page_of_the_map_again_for_the_next() {
        use crate::files::pagecache::{disk_tempdir, pages_dirty};
        let dir = disk_tempdir();
        // Four pages of bits, and the header's.
        let tracks = 4 * 4096 * 8;
        let m = AllocMap::open(dir.path(), 7, tracks, true).unwrap();
        for t in (0..tracks).step_by(10_000) {
            m.set(t);
        }
        m.sync().unwrap();
        let pages = pages_dirty(&m.map);
        assert_eq!(pages.len(), 5);
        assert!(
            pages.iter().all(|d| !d),
            "after a successful msync no page of the map is dirty: {pages:?}"
        );
        // The kernel may have cleaned the pages in a failed writeback:
        // the next msync must still write them.
        m.changed.store(true, Ordering::Release);
        m.fail_next_flush.store(true, Ordering::Release);
        let e = m.sync().unwrap_err();
        assert!(
            e.to_string().contains("cannot sync the allocation map"),
            "{e}"
        );
        assert_eq!(
            pages_dirty(&m.map),
            vec![true; 5],
            "every page dirty again after the failed msync"
        );
        m.sync().unwrap();
        assert!(pages_dirty(&m.map).iter().all(|d| !d), "written");
        drop(m);
        let m = AllocMap::open(dir.path(), 7, tracks, false).unwrap();
        let held: Vec<u64> = (0..tracks).filter(|&t| m.may_hold_data(t)).collect();
        assert_eq!(held, (0..tracks).step_by(10_000).collect::<Vec<_>>());
    }

    #[test]
    fn bits_set_and_cleared_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let m = AllocMap::open(dir.path(), 7, 1000, true).unwrap();
            assert!(
                (0..1000).all(|t| !m.may_hold_data(t)),
                "a new volume is all holes"
            );
            for t in [0, 63, 64, 500, 999] {
                m.set(t);
            }
            m.clear(60, 500);
            m.sync().unwrap();
        }
        let m = AllocMap::open(dir.path(), 7, 1000, false).unwrap();
        let held: Vec<u64> = (0..1000).filter(|&t| m.may_hold_data(t)).collect();
        assert_eq!(held, [0, 500, 999]);
    }

    #[test]
    fn clearing_any_range_clears_exactly_that_range() {
        let dir = tempfile::tempdir().unwrap();
        let m = AllocMap::open(dir.path(), 1, 300, false).unwrap();
        for (first, end) in [(0, 1), (3, 64), (64, 128), (100, 229), (299, 300)] {
            m.clear(first, end);
        }
        for t in 0..300 {
            let cleared = [(0, 1), (3, 64), (64, 128), (100, 229), (299, 300)]
                .iter()
                .any(|&(a, b)| (a..b).contains(&t));
            assert_eq!(m.may_hold_data(t), !cleared, "track {t}");
        }
        assert!(!m.may_hold_data(300), "past the end");
    }

    #[test]
    fn a_missing_or_foreign_map_of_an_existing_volume_reports_every_track_as_data() {
        let dir = tempfile::tempdir().unwrap();
        let m = AllocMap::open(dir.path(), 1, 100, false).unwrap();
        assert!((0..100).all(|t| m.may_hold_data(t)));
        m.clear(0, 100);
        drop(m);
        // The same file, opened for another volume id.
        let m = AllocMap::open(dir.path(), 2, 100, false).unwrap();
        assert!((0..100).all(|t| m.may_hold_data(t)));
        drop(m);
        // Damage the header: rebuilt, all data.
        let path = dir.path().join(FILE_NAME);
        let mut b = std::fs::read(&path).unwrap();
        AllocMap::open(dir.path(), 2, 100, false)
            .unwrap()
            .clear(0, 100);
        b[26] ^= 1;
        std::fs::write(&path, &b).unwrap();
        let m = AllocMap::open(dir.path(), 2, 100, false).unwrap();
        assert!((0..100).all(|t| m.may_hold_data(t)));
        // A new volume's map starts clear whatever was there.
        drop(m);
        let m = AllocMap::open(dir.path(), 3, 100, true).unwrap();
        assert!((0..100).all(|t| !m.may_hold_data(t)));
    }
}
