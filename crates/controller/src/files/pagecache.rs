//! What the kernel's page cache holds for a mapping: whether each page is
//! dirty (to be written at the next `msync`), for the tests of what a
//! failed sync leaves behind ([`crate::backend::allocmap`],
//! [`crate::store::nvs`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// The granularity checked: a page of 4 KiB (larger pages are whole
/// multiples of it).
const PAGE: usize = 4096;
/// `/proc/kpageflags`' dirty bit.
const KPF_DIRTY: u64 = 1 << 4;

/// Whether each 4 KiB page of `bytes` (mapped) is dirty:
/// `/proc/self/pagemap` gives the page's frame, `/proc/kpageflags` its
/// flags. Both need root (which the tests run as); without it the frame
/// reads as zero and this panics rather than answer "clean". A large
/// folio's flags are the folio's, so a page shares its neighbours'.
pub(crate) fn pages_dirty(bytes: &[u8]) -> Vec<bool> {
    let mut pagemap = File::open("/proc/self/pagemap").unwrap();
    let mut flags = File::open("/proc/kpageflags").expect("/proc/kpageflags (needs root)");
    let read_u64 = |f: &mut File, at: u64| {
        let mut b = [0u8; 8];
        f.seek(SeekFrom::Start(at * 8)).unwrap();
        f.read_exact(&mut b).unwrap();
        u64::from_le_bytes(b)
    };
    let start = bytes.as_ptr() as usize / PAGE;
    let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(PAGE);
    (start..end)
        .map(|page| {
            let entry = read_u64(&mut pagemap, page as u64);
            if entry >> 63 == 0 {
                // Not in memory: a dirty page is never evicted.
                return false;
            }
            let frame = entry & ((1 << 55) - 1);
            assert_ne!(frame, 0, "page frame numbers need root");
            read_u64(&mut flags, frame) & KPF_DIRTY != 0
        })
        .collect()
}

/// A temporary directory on a disk file system (tmpfs keeps no dirty
/// state for a sync to clear): beside the test binary, in the build
/// directory.
pub(crate) fn disk_tempdir() -> tempfile::TempDir {
    let exe = std::env::current_exe().unwrap();
    let dir: &Path = exe.parent().unwrap();
    tempfile::tempdir_in(dir).unwrap()
}
