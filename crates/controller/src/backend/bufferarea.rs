//! The buffer area of output commit's `buffering` scheme (paper:
//! revive-io-output-commit, §3: "data written to the memory and the disk
//! buffer"; [`crate::backend::pseudodev`] holds the memory copy): a file
//! of track-sized slots beside the devices, one per held write, written
//! when the write is held and freed at its epoch's commit or rollback.
//! The slot, in the page cache, is also the held write's memory copy: the
//! commit writes the target from it and reads of the track are served
//! from it. A restart does not read it (it finds the data in the NVS), so
//! it is emptied at every start.
//!
//! The first [`BUFFER_MAPPED_SLOTS`] slots are mapped shared: a held
//! write is copied into the page cache there without a system call.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::limits::TRACK_BYTES;

/// The area's file name in the data directory.
pub const FILE_NAME: &str = "output-commit.buffer";

/// The buffer area of `buffering`: a file of track-sized slots. Slots are
/// handed out under the pseudo-device's lock; their data is written
/// outside it ([`BufferFile`]), so destage writes to the area run in
/// parallel and do not hold up reads or a commit.
#[derive(Debug)]
pub(crate) struct BufferArea {
    /// The area's file.
    pub(crate) path: PathBuf,
    /// Slots given back, handed out again first.
    pub(crate) free: Vec<u32>,
    /// Slots ever handed out.
    pub(crate) slots: u32,
}

impl BufferArea {
    /// A free slot.
    pub(crate) fn alloc(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.slots += 1;
            self.slots - 1
        })
    }

    /// Where `slot` starts in the file.
    pub(crate) fn offset(slot: u32) -> u64 {
        u64::from(slot) * TRACK_BYTES as u64
    }
}

/// Slots of the buffer area mapped into memory: a write to one of them is
/// a copy into the page cache, as a `pwrite` would make, without the
/// system call (measured: 0.5 to 0.6 µs less of the rcs workers' CPU per
/// I/O under random writes). Slots past them, which only more held
/// writes at once than this could need, are written with `pwrite`.
/// The file's space for them (64 MiB) is allocated at start-up.
pub(crate) const BUFFER_MAPPED_SLOTS: u32 = 16_384;

/// The buffer area's file and its mapped slots.
#[derive(Debug)]
pub(crate) struct BufferFile {
    file: File,
    map: memmap2::MmapRaw,
}

impl BufferFile {
    /// Create (or empty) the area's file in `dir`, its mapped slots'
    /// space allocated now, so that a full disk is an error here rather
    /// than a `SIGBUS` at a store into a hole of the mapping.
    pub(crate) fn create(dir: &Path) -> std::io::Result<(Self, PathBuf)> {
        let path = dir.join(FILE_NAME);
        // Emptied only once it passed the checks (never O_TRUNC).
        let file = crate::files::open_state_file(&path, crate::files::Create::IfMissing)?;
        file.set_len(0)?;
        crate::files::reserve(&file, BufferArea::offset(BUFFER_MAPPED_SLOTS))?;
        let map = memmap2::MmapOptions::new().map_raw(&file)?;
        Ok((Self { file, map }, path))
    }

    /// Write `data` (one track) to `slot`, held by the caller alone from
    /// its allocation to its release.
    pub(crate) fn write(&self, slot: u32, data: &[u8]) -> std::io::Result<()> {
        debug_assert_eq!(data.len(), TRACK_BYTES);
        let at = BufferArea::offset(slot) as usize;
        if at + TRACK_BYTES > self.map.len() {
            return self.file.write_all_at(data, at as u64);
        }
        // SAFETY: `[at, at + TRACK_BYTES)` lies inside the mapping (checked
        // above), which lives as long as `self`; the slot belongs to one
        // held write from `BufferArea::alloc` until its release, so no
        // other thread reads or writes these bytes meanwhile (nothing in
        // this process reads the area back; the kernel may write the pages
        // back at any time, as after a `pwrite`); `data` is a separate
        // allocation, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(at),
                TRACK_BYTES,
            );
        }
        Ok(())
    }

    /// `f` of the data in `slot` (one track), written by [`Self::write`]
    /// and held by the caller alone until its release.
    pub(crate) fn with_slot<R>(&self, slot: u32, f: impl FnOnce(&[u8]) -> R) -> std::io::Result<R> {
        let at = BufferArea::offset(slot) as usize;
        if at + TRACK_BYTES > self.map.len() {
            let mut buf = vec![0u8; TRACK_BYTES];
            self.file.read_exact_at(&mut buf, at as u64)?;
            return Ok(f(&buf));
        }
        // SAFETY: `[at, at + TRACK_BYTES)` lies inside the mapping (checked
        // above), which lives as long as `self`, and the slice does not
        // outlive this call; the slot's one holder wrote it before and
        // neither writes nor frees it during this call (a slot is written
        // once, after its allocation, and given back only after its
        // commit or rollback, which hold it alone), so nothing changes
        // these bytes while they are borrowed.
        let data = unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), TRACK_BYTES) };
        Ok(f(data))
    }

    /// Copy `slot`'s data into `out` (one track).
    pub(crate) fn read(&self, slot: u32, out: &mut [u8]) -> std::io::Result<()> {
        self.with_slot(slot, |data| out.copy_from_slice(data))
    }
}
