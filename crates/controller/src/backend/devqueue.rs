//! The device queue: every device I/O holds a tagged slot of its device's
//! bounded submission queue (the adapter's queue in the papers' controller)
//! from submission to completion, and a completion must name an
//! outstanding tag of the current generation.
//!
//! Two of the papers' micro-recovery cases live here (rung 1, DESIGN.md's
//! failure model):
//!
//! - **Queue full** (an internal-logic condition): [`DeviceQueue::submit`]
//!   refuses when every slot is taken, or when the `device.queue-full`
//!   fault point fires. The caller backs off and retries without holding
//!   its worker: a staging read parks its request on the timer
//!   ([`backoff`]), a destage leaves its track to the destage tick, a FUA
//!   or FLUSH waits between attempts.
//! - **Unsolicited completion** (a state error): a completion whose tag is
//!   not outstanding, or is outstanding under another generation, is
//!   ignored and counted; it never releases a slot another I/O holds.
//!
//! Both are recorded as rung-1 recoveries by the controller.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// First back-off after a full queue.
pub const BACKOFF_MIN: Duration = Duration::from_micros(50);
/// Longest back-off.
pub const BACKOFF_MAX: Duration = Duration::from_millis(5);

/// The back-off before retry `attempt` (0-based): doubling from
/// [`BACKOFF_MIN`] up to [`BACKOFF_MAX`].
pub fn backoff(attempt: u32) -> Duration {
    BACKOFF_MIN
        .saturating_mul(1u32 << attempt.min(16))
        .min(BACKOFF_MAX)
}

/// An outstanding submission: the slot and its generation.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a tag must be completed, or its queue slot leaks"]
pub struct Tag {
    /// Slot in the queue.
    pub slot: u32,
    /// Generation of the slot when it was taken.
    pub generation: u64,
}

/// Why a submission was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("device queue full ({depth} outstanding)")]
pub struct QueueFull {
    /// The queue's depth.
    pub depth: u32,
}

/// A completion that matches no outstanding submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("unsolicited completion for tag {slot} generation {generation}")]
pub struct Unsolicited {
    /// The slot it named.
    pub slot: u32,
    /// The generation it named.
    pub generation: u64,
}

#[derive(Debug)]
struct Slots {
    /// Generation of each slot; odd while outstanding.
    generation: Vec<u64>,
    free: Vec<u32>,
}

/// One device's submission queue.
#[derive(Debug)]
pub struct DeviceQueue {
    depth: u32,
    slots: Mutex<Slots>,
    full: AtomicU64,
    unsolicited: AtomicU64,
}

impl DeviceQueue {
    /// A queue of `depth` slots (at least one).
    pub fn new(depth: u32) -> Self {
        assert!(depth > 0, "a device queue needs at least one slot");
        Self {
            depth,
            slots: Mutex::new(Slots {
                generation: vec![0; depth as usize],
                free: (0..depth).rev().collect(),
            }),
            full: AtomicU64::new(0),
            unsolicited: AtomicU64::new(0),
        }
    }

    /// Take a slot for one I/O.
    pub fn submit(&self) -> Result<Tag, QueueFull> {
        let full = QueueFull { depth: self.depth };
        if crate::faults::DEVICE_QUEUE_FULL.check().is_err() {
            self.full.fetch_add(1, Ordering::Relaxed);
            return Err(full);
        }
        let mut s = self.slots.lock();
        let Some(slot) = s.free.pop() else {
            drop(s);
            self.full.fetch_add(1, Ordering::Relaxed);
            return Err(full);
        };
        let g = &mut s.generation[slot as usize];
        debug_assert!((*g).is_multiple_of(2), "a free slot is not outstanding");
        *g += 1;
        Ok(Tag {
            slot,
            generation: *g,
        })
    }

    /// Complete the I/O of `tag` (consumes it).
    pub fn complete(&self, tag: Tag) {
        let (slot, generation) = (tag.slot, tag.generation);
        if let Err(e) = self.complete_raw(slot, generation) {
            // Our own tag must be outstanding: a bug, not a device fault.
            debug_assert!(false, "{e}");
        }
    }

    /// A completion as a device reports it: `slot` and `generation` as
    /// submitted. One that matches no outstanding submission is ignored
    /// and counted.
    pub fn complete_raw(&self, slot: u32, generation: u64) -> Result<(), Unsolicited> {
        let mut s = self.slots.lock();
        let current = s.generation.get(slot as usize).copied();
        if current != Some(generation) || generation.is_multiple_of(2) {
            drop(s);
            self.unsolicited.fetch_add(1, Ordering::Relaxed);
            return Err(Unsolicited { slot, generation });
        }
        s.generation[slot as usize] += 1;
        s.free.push(slot);
        Ok(())
    }

    /// The queue's depth.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Slots outstanding now.
    pub fn outstanding(&self) -> u32 {
        self.depth - self.slots.lock().free.len() as u32
    }

    /// Submissions refused as queue full so far.
    pub fn full_count(&self) -> u64 {
        self.full.load(Ordering::Relaxed)
    }

    /// Unsolicited completions ignored so far.
    pub fn unsolicited_count(&self) -> u64 {
        self.unsolicited.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_refuses_until_a_completion_frees_a_slot() {
        let q = DeviceQueue::new(2);
        let a = q.submit().unwrap();
        let b = q.submit().unwrap();
        assert_eq!(q.submit(), Err(QueueFull { depth: 2 }));
        assert_eq!(q.full_count(), 1);
        assert_eq!(q.outstanding(), 2);
        q.complete(a);
        let c = q.submit().unwrap();
        q.complete(b);
        q.complete(c);
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn unsolicited_and_stale_completions_are_ignored_and_never_free_a_slot() {
        let q = DeviceQueue::new(1);
        let a = q.submit().unwrap();
        let (slot, stale) = (a.slot, a.generation);
        // Unknown slot, even generation, wrong generation: all ignored.
        assert!(q.complete_raw(7, 1).is_err());
        assert!(q.complete_raw(slot, stale + 1).is_err());
        assert!(q.complete_raw(slot, stale + 2).is_err());
        assert_eq!(q.outstanding(), 1, "the real I/O still holds its slot");
        q.complete(a);
        // A late duplicate of a completion already seen is stale.
        assert!(q.complete_raw(slot, stale).is_err());
        let b = q.submit().unwrap();
        assert_ne!(b.generation, stale, "a reused slot has a new generation");
        assert!(q.complete_raw(slot, stale).is_err());
        assert_eq!(q.outstanding(), 1);
        q.complete(b);
        assert_eq!(q.unsolicited_count(), 5);
    }

    #[test]
    fn backoff_doubles_from_the_minimum_to_the_cap() {
        assert_eq!(backoff(0), BACKOFF_MIN);
        assert_eq!(backoff(1), BACKOFF_MIN * 2);
        assert_eq!(backoff(3), BACKOFF_MIN * 8);
        assert_eq!(backoff(40), BACKOFF_MAX);
    }
}
