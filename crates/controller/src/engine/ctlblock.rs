//! Request control blocks: a bounded pool (`--control-blocks`) from which
//! every request takes one block at admission and gives it back when it is
//! answered (the papers' controller allocates a task control block per
//! host I/O).
//!
//! The papers' micro-recovery case here is **control-block exhaustion**
//! (rung 1): a block whose release was lost (a fault in a clean-up path,
//! fault point `host.cb-leak`) stays taken by a request that no longer
//! exists, and enough of them starve admission. Every block records its
//! owner as a weak reference to the request's liveness token, so when the
//! pool runs dry the handler audits it: blocks whose owner is gone are
//! reclaimed (the resource recovery protocol's "release what the failed
//! actor still holds"); if every block belongs to a live request the pool
//! is merely busy, and admission retries later (back-pressure on the
//! client, as a full NVS gives).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// A request's liveness token: alive while the request is.
pub type Liveness = Arc<()>;

/// A taken block.
#[derive(Debug)]
pub struct Block {
    index: u32,
}

#[derive(Debug)]
struct Slots {
    free: Vec<u32>,
    owner: Vec<Option<Weak<()>>>,
}

/// What an exhausted pool's audit found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhausted {
    /// Leaked blocks were reclaimed; retry now.
    Reclaimed(u32),
    /// Every block belongs to a live request; retry later.
    Busy,
}

/// The pool.
#[derive(Debug)]
pub struct ControlBlocks {
    slots: Mutex<Slots>,
    reclaimed: AtomicU64,
    exhausted: AtomicU64,
    leaked: AtomicU64,
}

impl ControlBlocks {
    /// A pool of `capacity` blocks (at least one).
    pub fn new(capacity: u32) -> Self {
        assert!(capacity > 0, "a control-block pool needs a block");
        Self {
            slots: Mutex::new(Slots {
                free: (0..capacity).rev().collect(),
                owner: vec![None; capacity as usize],
            }),
            reclaimed: AtomicU64::new(0),
            exhausted: AtomicU64::new(0),
            leaked: AtomicU64::new(0),
        }
    }

    /// Take a block for the request whose token is `owner`; on an empty
    /// pool, the audit's verdict.
    pub fn acquire(&self, owner: &Liveness) -> Result<Block, Exhausted> {
        let mut s = self.slots.lock();
        if let Some(index) = s.free.pop() {
            debug_assert!(s.owner[index as usize].is_none());
            s.owner[index as usize] = Some(Arc::downgrade(owner));
            return Ok(Block { index });
        }
        self.exhausted.fetch_add(1, Ordering::Relaxed);
        // The audit: reclaim blocks whose request is gone.
        let mut reclaimed = 0;
        for i in 0..s.owner.len() {
            if s.owner[i].as_ref().is_some_and(|w| w.strong_count() == 0) {
                s.owner[i] = None;
                s.free.push(i as u32);
                reclaimed += 1;
            }
        }
        drop(s);
        if reclaimed == 0 {
            return Err(Exhausted::Busy);
        }
        self.reclaimed
            .fetch_add(u64::from(reclaimed), Ordering::Relaxed);
        Err(Exhausted::Reclaimed(reclaimed))
    }

    /// Give a block back (the request's clean-up). The `host.cb-leak`
    /// fault point loses the release.
    pub fn release(&self, block: Block) {
        if crate::faults::HOST_CB_LEAK.check().is_err() {
            self.leaked.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                block = block.index,
                "control block release lost (injected leak)"
            );
            return;
        }
        let mut s = self.slots.lock();
        debug_assert!(s.owner[block.index as usize].is_some());
        s.owner[block.index as usize] = None;
        s.free.push(block.index);
    }

    /// Blocks in the pool.
    pub fn capacity(&self) -> u32 {
        self.slots.lock().owner.len() as u32
    }

    /// Blocks free now.
    pub fn available(&self) -> u32 {
        self.slots.lock().free.len() as u32
    }

    /// Times the pool was found empty; blocks reclaimed by audits; releases
    /// lost to the leak fault point.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.exhausted.load(Ordering::Relaxed),
            self.reclaimed.load(Ordering::Relaxed),
            self.leaked.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_pool_reclaims_exactly_the_blocks_of_requests_that_are_gone() {
        let pool = ControlBlocks::new(3);
        let live = Arc::new(());
        let kept = pool.acquire(&live).unwrap();
        // Two requests take blocks and vanish without releasing (leaks).
        for _ in 0..2 {
            let gone = Arc::new(());
            // Dropped without `release`: the block leaks.
            let _leaked = pool.acquire(&gone).unwrap();
        }
        assert_eq!(pool.available(), 0);
        let next = Arc::new(());
        assert_eq!(pool.acquire(&next).unwrap_err(), Exhausted::Reclaimed(2));
        assert_eq!(pool.available(), 2);
        let a = pool.acquire(&next).unwrap();
        let b = pool.acquire(&next).unwrap();
        // Now every block belongs to a live request: busy, nothing taken.
        assert_eq!(pool.acquire(&next).unwrap_err(), Exhausted::Busy);
        pool.release(a);
        pool.release(b);
        pool.release(kept);
        assert_eq!(pool.available(), 3);
        assert_eq!(pool.counts(), (2, 2, 0));
    }
}
