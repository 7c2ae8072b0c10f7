//! Track locks: a write that covers part of a track is a read-modify-write
//! of the whole track, and must not interleave with any other change of
//! that track.
//!
//! The controller's unit is the 4 KiB track (cache frames, NVS records,
//! destage), but a client may write any byte range (the Linux kernel's NBD
//! client uses 512-byte blocks). A partial write reads the track's current
//! data, merges its bytes in and writes the whole track back. If another
//! write, TRIM or WRITE_ZEROES of the same track were applied between the
//! read and the write-back, the write-back would put old bytes over it: an
//! acknowledged write lost. So every change of a track holds its lock from
//! the moment it is framed until its request is finished (its reply sent
//! or held in the output gate and then sent):
//!
//! - an aligned WRITE, TRIM or WRITE_ZEROES holds its tracks *shared*
//!   (aligned changes of one track may run concurrently, as before: the
//!   client cannot expect an order between requests it has in flight at
//!   once);
//! - a read-modify-write holds its partial tracks *exclusive*, from before
//!   its read of the old data until its merged write is finished.
//!
//! Reads take no lock. Locks are striped ([`STRIPES`] words; track `t`
//! uses stripe `t % STRIPES`) and taken in ascending stripe order, so two
//! requests never wait for each other in a cycle. Only the thread that
//! frames requests (a connection thread, never a worker of the task
//! runtime) ever waits for a lock, outside the admission gate of rung 4;
//! holders are requests in the pipeline, which finish without taking any
//! other track lock, so every wait ends. A waiting exclusive locker keeps
//! new shared lockers out of its stripe, so a stream of aligned writes
//! cannot starve it.
//!
//! The lock moves with its request through redrives (rung 1), parking
//! (rung 4) and rollback (rung 3): the request's work since its start may
//! run again, but no other change of the track can come between.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Lock words; a power of two.
pub const STRIPES: usize = 1024;

/// Set while an exclusive holder has, or waits for, the stripe.
const WRITER: u32 = 1 << 31;
/// Set while the exclusive holder has the stripe (no shared holders left).
const HELD: u32 = 1 << 30;
/// Shared holders in the low bits.
const READERS: u32 = HELD - 1;

/// How a request holds a track.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    /// A change of whole tracks.
    Shared,
    /// A read-modify-write.
    Exclusive,
}

/// The lock table of one engine.
pub struct TrackLocks {
    words: Box<[AtomicU32]>,
}

impl std::fmt::Debug for TrackLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self
            .words
            .iter()
            .filter(|w| w.load(Ordering::Relaxed) != 0)
            .count();
        f.debug_struct("TrackLocks")
            .field("stripes_in_use", &held)
            .finish()
    }
}

impl Default for TrackLocks {
    fn default() -> Self {
        Self {
            words: (0..STRIPES).map(|_| AtomicU32::new(0)).collect(),
        }
    }
}

/// Locks held by one request; released when dropped.
pub struct TrackLockGuard {
    table: Arc<TrackLocks>,
    /// (stripe, mode), ascending by stripe, one entry per stripe.
    held: Vec<(u32, Mode)>,
}

impl std::fmt::Debug for TrackLockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackLockGuard")
            .field("stripes", &self.held.len())
            .finish()
    }
}

/// The stripe of `track`.
fn stripe(track: u64) -> u32 {
    (track % STRIPES as u64) as u32
}

/// The stripes of tracks `[first, end)` in `mode`, plus `extra`, merged
/// (exclusive wins), ascending, each once.
fn plan(first: u64, end: u64, mode: Mode, extra: &[(u64, Mode)]) -> Vec<(u32, Mode)> {
    let mut v: Vec<(u32, Mode)> = if end.saturating_sub(first) >= STRIPES as u64 {
        (0..STRIPES as u32).map(|s| (s, mode)).collect()
    } else {
        (first..end).map(|t| (stripe(t), mode)).collect()
    };
    v.extend(extra.iter().map(|&(t, m)| (stripe(t), m)));
    // Exclusive sorts first within a stripe, so dedup keeps it.
    v.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    v.dedup_by_key(|e| e.0);
    v
}

impl TrackLocks {
    /// Lock tracks `[first, end)` in `mode` and each of `extra` in its own
    /// mode, waiting as long as it takes (see the module doc for why every
    /// wait ends).
    pub fn lock(
        self: &Arc<Self>,
        first: u64,
        end: u64,
        mode: Mode,
        extra: &[(u64, Mode)],
    ) -> TrackLockGuard {
        let held = plan(first, end, mode, extra);
        for &(stripe, m) in &held {
            let word = &self.words[stripe as usize];
            match m {
                Mode::Shared => lock_shared(word),
                Mode::Exclusive => lock_exclusive(word),
            }
        }
        TrackLockGuard {
            table: Arc::clone(self),
            held,
        }
    }

    /// Whether no lock is held or awaited (tests).
    pub fn idle(&self) -> bool {
        self.words.iter().all(|w| w.load(Ordering::Acquire) == 0)
    }
}

/// Back off between tries: spin a little, then sleep up to 100 µs.
fn pause(tries: &mut u32) {
    *tries += 1;
    if *tries < 64 {
        std::hint::spin_loop();
    } else {
        crate::blocking::about_to_block();
        std::thread::sleep(Duration::from_micros(u64::from((*tries - 63).min(100))));
    }
}

fn lock_shared(word: &AtomicU32) {
    let mut tries = 0;
    loop {
        let w = word.load(Ordering::Acquire);
        if w & WRITER == 0 {
            assert!(w & READERS < READERS, "track lock: too many shared holders");
            if word
                .compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
            continue;
        }
        pause(&mut tries);
    }
}

fn lock_exclusive(word: &AtomicU32) {
    let mut tries = 0;
    // Claim the stripe against other exclusive lockers and keep new shared
    // ones out...
    loop {
        let w = word.load(Ordering::Acquire);
        if w & WRITER == 0
            && word
                .compare_exchange_weak(w, w | WRITER, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            break;
        }
        pause(&mut tries);
    }
    // ...then wait for the shared holders to finish.
    loop {
        if word
            .compare_exchange_weak(WRITER, WRITER | HELD, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
        pause(&mut tries);
    }
}

impl Drop for TrackLockGuard {
    fn drop(&mut self) {
        for &(stripe, m) in self.held.iter().rev() {
            let word = &self.table.words[stripe as usize];
            match m {
                Mode::Shared => {
                    let before = word.fetch_sub(1, Ordering::AcqRel);
                    debug_assert!(before & READERS > 0, "shared unlock of a free stripe");
                }
                Mode::Exclusive => {
                    let before = word.swap(0, Ordering::AcqRel);
                    debug_assert_eq!(
                        before,
                        WRITER | HELD,
                        "exclusive unlock of a stripe not held"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn shared_holders_coexist_and_release_to_idle() {
        let t = Arc::new(TrackLocks::default());
        let a = t.lock(0, 4, Mode::Shared, &[]);
        let b = t.lock(2, 6, Mode::Shared, &[]);
        assert!(!t.idle());
        drop(a);
        drop(b);
        assert!(t.idle());
    }

    #[test]
    fn exclusive_waits_for_shared_holders_of_its_stripe() {
        let t = Arc::new(TrackLocks::default());
        let shared = t.lock(7, 8, Mode::Shared, &[]);
        let got = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (t, got) = (Arc::clone(&t), Arc::clone(&got));
            std::thread::spawn(move || {
                let g = t.lock(7, 8, Mode::Exclusive, &[]);
                got.store(true, Ordering::SeqCst);
                drop(g);
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !got.load(Ordering::SeqCst),
            "exclusive lock taken under a shared holder"
        );
        drop(shared);
        waiter.join().unwrap();
        assert!(got.load(Ordering::SeqCst));
        assert!(t.idle());
    }

    #[test]
    fn a_waiting_exclusive_locker_keeps_new_shared_lockers_out() {
        let t = Arc::new(TrackLocks::default());
        let first = t.lock(3, 4, Mode::Shared, &[]);
        let excl = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || drop(t.lock(3, 4, Mode::Exclusive, &[])))
        };
        // Wait until the exclusive locker has claimed the stripe.
        while t.words[3].load(Ordering::Acquire) & WRITER == 0 {
            std::thread::yield_now();
        }
        let late = Arc::new(AtomicBool::new(false));
        let reader = {
            let (t, late) = (Arc::clone(&t), Arc::clone(&late));
            std::thread::spawn(move || {
                let g = t.lock(3, 4, Mode::Shared, &[]);
                late.store(true, Ordering::SeqCst);
                drop(g);
            })
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !late.load(Ordering::SeqCst),
            "a shared locker overtook a waiting exclusive one"
        );
        drop(first);
        excl.join().unwrap();
        reader.join().unwrap();
        assert!(t.idle());
    }

    #[test]
    fn a_range_wider_than_the_table_locks_every_stripe_once() {
        let p = plan(
            5,
            5 + 3 * STRIPES as u64,
            Mode::Shared,
            &[(9, Mode::Exclusive)],
        );
        assert_eq!(p.len(), STRIPES);
        assert_eq!(p[9], (9, Mode::Exclusive));
        assert!(
            p.windows(2).all(|w| w[0].0 < w[1].0),
            "ascending, no repeats"
        );
    }

    #[test]
    fn concurrent_read_modify_writes_of_one_track_never_lose_a_byte() {
        // Each thread owns one byte of a shared "track" and increments it
        // by read-modify-write of the whole track under the lock.
        let t = Arc::new(TrackLocks::default());
        let track = Arc::new(parking_lot::Mutex::new([0u8; 8]));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (t, track) = (Arc::clone(&t), Arc::clone(&track));
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let g = t.lock(0, 0, Mode::Shared, &[(42, Mode::Exclusive)]);
                        let mut copy = *track.lock();
                        copy[i] = copy[i].wrapping_add(1);
                        std::thread::yield_now();
                        *track.lock() = copy;
                        drop(g);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        assert_eq!(&track.lock()[..4], &[200, 200, 200, 200]);
    }
}
