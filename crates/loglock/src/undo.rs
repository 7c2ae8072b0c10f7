//! The per-actor undo log (paper §4.1): old values saved before tracked
//! state is modified; undo restores them, newest first, so the state
//! returns to what it was when the recovery point was taken.
//!
//! Tracked locks capture the old value themselves, on the first mutable
//! access of each guard by an actor that tracks the lock, so a developer
//! cannot forget to log before modifying. Each entry carries a check word over
//! the lock id, its sequence number and a CRC-32C of the saved value, verified
//! before anything is restored: a damaged log restores nothing.

use std::hash::{Hash, Hasher};

use crate::event::LockId;

/// A [`Hasher`] that folds bytes into a CRC-32C: the checksum of a saved
/// value without serialising it.
#[derive(Debug, Default)]
pub(crate) struct CrcHasher(u32);

impl Hasher for CrcHasher {
    fn finish(&self) -> u64 {
        u64::from(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, bytes);
    }
}

pub(crate) fn value_crc<T: Hash>(v: &T) -> u32 {
    let mut h = CrcHasher::default();
    v.hash(&mut h);
    h.0
}

/// One saved old value and how to put it back.
pub(crate) trait Restore: Send {
    /// CRC of the saved value (recomputed at verification).
    fn value_crc(&self) -> u32;
    /// Take the target's lock; if `still_safe()` holds under it, put the
    /// old value back. Returns whether it did. The check and the write are
    /// one critical section, so no other actor can slip in between.
    fn restore_if(self: Box<Self>, still_safe: &mut dyn FnMut() -> bool) -> bool;
}

/// An undo log entry.
pub(crate) struct UndoRecord {
    pub lock: LockId,
    pub seq: u64,
    crc: u32,
    pub restore: Box<dyn Restore>,
}

impl std::fmt::Debug for UndoRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UndoRecord")
            .field("lock", &self.lock)
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

fn record_crc(lock: LockId, seq: u64, value: u32) -> u32 {
    crate::event::check_word(&[lock.0, seq, u64::from(value)])
}

impl UndoRecord {
    pub fn new(lock: LockId, seq: u64, restore: Box<dyn Restore>) -> Self {
        let crc = record_crc(lock, seq, restore.value_crc());
        Self {
            lock,
            seq,
            crc,
            restore,
        }
    }

    pub fn is_intact(&self) -> bool {
        self.crc == record_crc(self.lock, self.seq, self.restore.value_crc())
    }

    #[doc(hidden)]
    pub fn corrupt(&mut self) {
        self.crc ^= 1;
    }
}
