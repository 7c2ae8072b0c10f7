//! The process's memory allocator: blocks up to [`LARGE`] (64 KiB) from
//! mimalloc, larger ones from the system's (glibc's) allocator.
//!
//! Why mimalloc for the small ones: under output commit a request's
//! buffers (its control block and WRITE payload, kept so that a rollback
//! can run it again) are allocated by a connection's thread and freed by
//! the thread that commits the epoch, thousands at a time. glibc frees
//! such a block into the arena of the thread that allocated it, under that
//! arena's lock, and a 4 KiB block is past its per-thread cache, so it
//! also consolidates chunks: `perf record` put glibc's `malloc` and
//! `free` at about 0.75 µs of CPU per I/O under `buffering` at 8 x 256
//! random writes, against 0.15 µs without output commit. mimalloc puts a
//! block freed by another thread on its page's list without a lock: about
//! 0.25 µs there (docs/performance/output-commit.md).
//!
//! Why the system's for the large ones: `rebound node` tunes glibc so that
//! its column buffers stay in the heap when freed
//! (`smartstore::node::keep_heap_warm`, measured there), and with blocks
//! up to 1 MiB from mimalloc its TPC-H Q1 with narrow checkpoints took
//! about a quarter longer (`rebound bench smartstore`, alternated twice:
//! 0.25 to 0.27 s against 0.19 to 0.22 s); with 64 KiB, no difference.
//! The data path's blocks (requests, 4 KiB payloads and reads) are far
//! below it; NBD requests of more than 64 KiB keep glibc's behaviour.
//!
//! Which allocator owns a block follows from its size alone, and Rust
//! hands `dealloc` and `realloc` the layout the block was allocated with,
//! so a block always goes back to the allocator it came from; a `realloc`
//! across [`LARGE`] moves the block from one to the other.

use std::alloc::{GlobalAlloc, Layout, System};

use mimalloc::MiMalloc;

/// Blocks larger than this come from the system allocator.
pub const LARGE: usize = 64 << 10;

/// mimalloc up to [`LARGE`] bytes, the system allocator above.
#[derive(Debug)]
pub struct Split;

fn small(size: usize) -> bool {
    size <= LARGE
}

// SAFETY: every block is allocated and freed by the same allocator, both
// of which meet `GlobalAlloc`'s contract: the choice depends only on the
// layout's size, which the caller passes unchanged to `dealloc` and
// `realloc`; a `realloc` that changes the choice allocates the new block
// from the other allocator, copies the bytes both blocks have and frees
// the old block where it came from.
unsafe impl GlobalAlloc for Split {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `layout` (non-zero size) holds.
        unsafe {
            if small(layout.size()) {
                MiMalloc.alloc(layout)
            } else {
                System.alloc(layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        unsafe {
            if small(layout.size()) {
                MiMalloc.alloc_zeroed(layout)
            } else {
                System.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated with `layout`, hence by the
        // allocator its size names.
        unsafe {
            if small(layout.size()) {
                MiMalloc.dealloc(ptr, layout);
            } else {
                System.dealloc(ptr, layout);
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` was allocated with `layout` by the allocator its
        // size names; the caller promises `new_size` is non-zero and,
        // rounded up to `layout.align()`, does not overflow `isize`, so
        // the new layout is valid. When the allocator changes, the new
        // block is distinct from the old one and holds at least
        // `min(old, new)` bytes, and the old block is freed with its own
        // layout by its own allocator.
        unsafe {
            match (small(layout.size()), small(new_size)) {
                (true, true) => MiMalloc.realloc(ptr, layout, new_size),
                (false, false) => System.realloc(ptr, layout, new_size),
                _ => {
                    let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
                    let new = self.alloc(new_layout);
                    if !new.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    new
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LARGE;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn a_block_keeps_its_bytes_when_realloc_moves_it_across_the_large_threshold() {
        for (from, to) in [
            (4096, LARGE + 1),
            (LARGE, 3 * LARGE),
            (LARGE + 1, 4096),
            (3 * LARGE, LARGE),
            (LARGE, LARGE + 1),
        ] {
            let mut v = pattern(from);
            if to > from {
                v.reserve_exact(to - from);
                assert!(v.capacity() >= to);
                assert_eq!(v, pattern(from), "grown {from} -> {to}");
            } else {
                v.truncate(to);
                v.shrink_to_fit();
                assert_eq!(v, pattern(to), "shrunk {from} -> {to}");
            }
        }
    }

    #[test]
    fn zeroed_blocks_are_zero_on_both_sides_of_the_threshold() {
        for n in [1, 4096, LARGE, LARGE + 1, 4 * LARGE] {
            let v = vec![0u8; n];
            assert!(v.iter().all(|&b| b == 0), "{n} bytes");
        }
    }

    #[test]
    fn blocks_of_both_allocators_are_freed_on_other_threads() {
        let blocks: Vec<Vec<u8>> = [64, 4096, LARGE, LARGE + 4096]
            .iter()
            .map(|&n| pattern(n))
            .collect();
        let sums = std::thread::spawn(move || {
            blocks
                .into_iter()
                .map(|b| b.iter().map(|&x| u64::from(x)).sum::<u64>())
                .collect::<Vec<_>>()
        })
        .join()
        .expect("the freeing thread");
        let want: Vec<u64> = [64, 4096, LARGE, LARGE + 4096]
            .iter()
            .map(|&n| pattern(n).iter().map(|&x| u64::from(x)).sum())
            .collect();
        assert_eq!(sums, want);
    }
}
