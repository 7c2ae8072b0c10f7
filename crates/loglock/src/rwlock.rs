//! A tracked reader-writer lock: shared holds record reads, exclusive holds
//! record what they did (read or write), exactly as [`TrackedMutex`]. Old
//! values are saved for a tracking actor before its first modification.
//!
//! [`TrackedMutex`]: crate::TrackedMutex

use std::cell::Cell;
use std::fmt;
use std::hash::Hash;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::actor::{Access, Tracked, begin_access, first_write};
use crate::core::LockCore;
use crate::mutex::finish_access;
use crate::undo::{Restore, value_crc};

struct Inner<T> {
    core: Arc<LockCore>,
    data: RwLock<T>,
}

/// A reader-writer lock whose accesses Log(Lock) can track. Cloning shares
/// the lock.
pub struct TrackedRwLock<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for TrackedRwLock<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> fmt::Debug for TrackedRwLock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedRwLock")
            .field("name", &self.inner.core.name())
            .field("id", &self.inner.core.id())
            .finish_non_exhaustive()
    }
}

impl<T> Tracked for TrackedRwLock<T> {
    fn core(&self) -> &Arc<LockCore> {
        &self.inner.core
    }
}

impl<T: Clone + Hash + Send + Sync + 'static> TrackedRwLock<T> {
    /// A new tracked reader-writer lock.
    pub fn new(name: &'static str, value: T) -> Self {
        Self {
            inner: Arc::new(Inner {
                core: Arc::new(LockCore::new(name)),
                data: RwLock::new(value),
            }),
        }
    }

    fn access(&self, exclusive: bool) -> Option<Access> {
        if !self.inner.core.is_tracked() {
            return None;
        }
        Some(begin_access(&self.inner.core, exclusive))
    }

    /// Shared access: records a read while tracked.
    #[inline]
    pub fn read(&self) -> TrackedReadGuard<'_, T> {
        let guard = self.inner.data.read();
        TrackedReadGuard {
            core: &self.inner.core,
            guard,
            access: self.access(false),
            read: Cell::new(false),
        }
    }

    /// Exclusive access: records a read or a write while tracked.
    #[inline]
    pub fn write(&self) -> TrackedWriteGuard<'_, T> {
        let guard = self.inner.data.write();
        TrackedWriteGuard {
            lock: self,
            guard,
            access: self.access(true),
            read: Cell::new(false),
            written: false,
        }
    }
}

/// Shared guard of a [`TrackedRwLock`].
pub struct TrackedReadGuard<'a, T> {
    core: &'a LockCore,
    guard: RwLockReadGuard<'a, T>,
    access: Option<Access>,
    read: Cell<bool>,
}

impl<T: fmt::Debug> fmt::Debug for TrackedReadGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.guard, f)
    }
}

impl<T> Deref for TrackedReadGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        self.read.set(true);
        &self.guard
    }
}

impl<T> Drop for TrackedReadGuard<'_, T> {
    fn drop(&mut self) {
        if let Some(a) = self.access {
            finish_access(self.core, a, self.read.get(), false, false);
        }
    }
}

/// Exclusive guard of a [`TrackedRwLock`].
pub struct TrackedWriteGuard<'a, T: Clone + Hash + Send + Sync + 'static> {
    lock: &'a TrackedRwLock<T>,
    guard: RwLockWriteGuard<'a, T>,
    access: Option<Access>,
    read: Cell<bool>,
    written: bool,
}

impl<T: Clone + Hash + Send + Sync + 'static + fmt::Debug> fmt::Debug for TrackedWriteGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.guard, f)
    }
}

impl<T: Clone + Hash + Send + Sync + 'static> Deref for TrackedWriteGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        self.read.set(true);
        &self.guard
    }
}

impl<T: Clone + Hash + Send + Sync + 'static> DerefMut for TrackedWriteGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        let (lock, guard) = (self.lock, &self.guard);
        first_write(&mut self.written, self.access, lock.inner.core.id(), || {
            Box::new(RwUndo {
                target: lock.clone(),
                old: (**guard).clone(),
            })
        });
        &mut self.guard
    }
}

impl<T: Clone + Hash + Send + Sync + 'static> Drop for TrackedWriteGuard<'_, T> {
    fn drop(&mut self) {
        if let Some(a) = self.access {
            finish_access(
                &self.lock.inner.core,
                a,
                self.read.get(),
                self.written,
                true,
            );
        }
    }
}

struct RwUndo<T> {
    target: TrackedRwLock<T>,
    old: T,
}

impl<T: Clone + Hash + Send + Sync + 'static> Restore for RwUndo<T> {
    fn value_crc(&self) -> u32 {
        value_crc(&self.old)
    }
    fn restore_if(self: Box<Self>, still_safe: &mut dyn FnMut() -> bool) -> bool {
        let RwUndo { target, old } = *self;
        let mut g = target.write();
        if !still_safe() {
            return false;
        }
        g.written = true;
        *g.guard = old;
        true
    }
}
