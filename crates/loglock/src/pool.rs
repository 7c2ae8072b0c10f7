//! Tracked resource pools (paper §2.1, the A and Re events): a fixed set of
//! items (control blocks, buffers, temporary resources) handed out by index
//! with an owner, so recovery can find and release what a failed actor
//! still holds (the resource recovery protocol) and nothing leaks.
//!
//! Ownership is always kept (it costs nothing beyond the pool's own mutex);
//! acquire and release events go to the change-track log only while the
//! pool is tracked.

use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::actor::{Tracked, current_actor};
use crate::core::LockCore;
use crate::error::PoolError;
use crate::event::{ActorId, EventKind};

#[derive(Debug)]
struct State {
    free: Vec<usize>,
    owner: Vec<Option<ActorId>>,
}

struct Inner {
    core: Arc<LockCore>,
    state: Mutex<State>,
}

/// A pool of `capacity` items with owners. Cloning shares the pool.
#[derive(Clone)]
pub struct TrackedPool {
    inner: Arc<Inner>,
}

impl fmt::Debug for TrackedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedPool")
            .field("name", &self.inner.core.name())
            .field("id", &self.inner.core.id())
            .field("available", &self.available())
            .finish_non_exhaustive()
    }
}

impl Tracked for TrackedPool {
    fn core(&self) -> &Arc<LockCore> {
        &self.inner.core
    }

    fn owned_items(&self, actor: ActorId) -> Vec<usize> {
        let st = self.inner.state.lock();
        (0..st.owner.len())
            .filter(|i| st.owner[*i] == Some(actor))
            .collect()
    }
}

impl TrackedPool {
    /// A pool of items `0..capacity`, all free.
    pub fn new(name: &'static str, capacity: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                core: Arc::new(LockCore::new(name)),
                state: Mutex::new(State {
                    free: (0..capacity).rev().collect(),
                    owner: vec![None; capacity],
                }),
            }),
        }
    }

    /// Take a free item for the current actor.
    pub fn acquire(&self) -> Result<usize, PoolError> {
        let actor = current_actor();
        let mut st = self.inner.state.lock();
        let item = st
            .free
            .pop()
            .ok_or(PoolError::Exhausted(self.inner.core.id()))?;
        debug_assert!(st.owner[item].is_none(), "a free item has no owner");
        st.owner[item] = Some(actor);
        if self.inner.core.is_tracked() {
            self.inner
                .core
                .record(actor, EventKind::Acquire, item as u64);
        }
        Ok(item)
    }

    /// Give back an item the current actor owns.
    pub fn release(&self, item: usize) -> Result<(), PoolError> {
        let actor = current_actor();
        let mut st = self.inner.state.lock();
        let pool = self.inner.core.id();
        match st.owner.get(item) {
            None => return Err(PoolError::UnknownItem { pool, item }),
            Some(o) if *o != Some(actor) => return Err(PoolError::NotOwner { pool, item }),
            Some(_) => {}
        }
        st.owner[item] = None;
        st.free.push(item);
        if self.inner.core.is_tracked() {
            self.inner
                .core
                .record(actor, EventKind::Release, item as u64);
        }
        Ok(())
    }

    /// Release every item the current actor owns (the resource recovery
    /// protocol's action for residual resources); returns them.
    pub fn release_all_owned(&self) -> Vec<usize> {
        let owned = self.owned_items(current_actor());
        for &i in &owned {
            self.release(i).expect("owned items release");
        }
        owned
    }

    /// Who owns `item`.
    pub fn owner(&self, item: usize) -> Option<ActorId> {
        self.inner.state.lock().owner.get(item).copied().flatten()
    }

    /// Free items.
    pub fn available(&self) -> usize {
        self.inner.state.lock().free.len()
    }

    /// Items in all.
    pub fn capacity(&self) -> usize {
        self.inner.state.lock().owner.len()
    }
}
