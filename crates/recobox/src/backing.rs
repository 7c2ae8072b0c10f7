//! The memory a box lives in: a shared mapping of its file.
//!
//! Concurrent operations on different types touch disjoint byte ranges of
//! the mapping (each type's entry and region), each under that type's lock;
//! the header is touched under the header lock. So the mapping is held as a
//! raw pointer, and [`Backing::slice_mut`] hands out a slice for a range whose
//! exclusive use the caller guarantees by holding the lock that owns it.

use std::fs::File;

use memmap2::MmapRaw;

/// A shared, writable mapping of a box file.
pub(crate) struct Backing {
    map: MmapRaw,
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backing")
            .field("len", &self.map.len())
            .finish()
    }
}

// SAFETY: `Backing` is a pointer to a shared file mapping that lives as long
// as the value. Sending it to another thread moves no data; every access
// goes through `slice`/`slice_mut`, whose callers guarantee exclusive (or
// shared read-only) use of the range by holding the lock that owns it.
unsafe impl Send for Backing {}
// SAFETY: as above: concurrent callers access disjoint ranges, each under
// its own lock, so shared references to `Backing` cause no data race.
unsafe impl Sync for Backing {}

impl Backing {
    /// Map `file` shared, read-write.
    pub(crate) fn map(file: &File) -> std::io::Result<Self> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Self { map })
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// A mutable view of `[at, at + len)`.
    ///
    /// # Safety
    ///
    /// The range must lie inside the mapping, and for as long as the slice
    /// lives no other reference to any byte of it may exist (the caller
    /// holds the lock that owns the range, or is the only thread).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, at: usize, len: usize) -> &mut [u8] {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.len()),
            "range outside the box"
        );
        // SAFETY: in bounds (asserted above, and the mapping is `len()`
        // bytes of valid, initialised memory); exclusive by the caller's
        // contract, so creating a unique reference is sound.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), len) }
    }

    /// Flush the mapping to its file (`msync`).
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        self.map.flush()
    }
}
