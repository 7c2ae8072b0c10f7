//! A tracked mutex (paper §4.1: Log(Lock) "traps lock/unlock calls"): a
//! parking_lot mutex whose guard notes whether the protected state was read
//! or modified, and, while some actor tracks the lock, records that access
//! in the lock's change-track log at unlock and saves the old value in the
//! undo log of a tracking actor before its first modification.
//!
//! Untracked cost: one relaxed load after acquiring, one branch at unlock.

use std::cell::Cell;
use std::fmt;
use std::hash::Hash;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::actor::end_access;
use crate::actor::{Access, Tracked, begin_access, first_write};
use crate::core::LockCore;
use crate::event::EventKind;
use crate::undo::{Restore, value_crc};

struct Inner<T> {
    core: Arc<LockCore>,
    data: Mutex<T>,
}

/// A mutex whose accesses Log(Lock) can track. Cloning shares the lock.
///
/// `T: Clone + Hash` so the undo log can save old values and checksum them.
pub struct TrackedMutex<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for TrackedMutex<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for TrackedMutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedMutex")
            .field("name", &self.inner.core.name())
            .field("id", &self.inner.core.id())
            .finish_non_exhaustive()
    }
}

impl<T> Tracked for TrackedMutex<T> {
    fn core(&self) -> &Arc<LockCore> {
        &self.inner.core
    }
}

impl<T: Clone + Hash + Send + 'static> TrackedMutex<T> {
    /// A new tracked mutex; `name` appears in reports.
    pub fn new(name: &'static str, value: T) -> Self {
        Self {
            inner: Arc::new(Inner {
                core: Arc::new(LockCore::new(name)),
                data: Mutex::new(value),
            }),
        }
    }

    /// Acquire the lock.
    #[inline]
    pub fn lock(&self) -> TrackedMutexGuard<'_, T> {
        let guard = self.inner.data.lock();
        let access = if self.inner.core.is_tracked() {
            Some(self.begin_access())
        } else {
            None
        };
        TrackedMutexGuard {
            mutex: self,
            guard,
            access,
            read: Cell::new(false),
            written: false,
        }
    }

    #[cold]
    fn begin_access(&self) -> Access {
        begin_access(&self.inner.core, true)
    }

    /// The lock's identity and log.
    pub fn core(&self) -> &Arc<LockCore> {
        &self.inner.core
    }
}

/// Puts an old value back into a tracked mutex.
struct MutexUndo<T> {
    target: TrackedMutex<T>,
    old: T,
}

impl<T: Clone + Hash + Send + 'static> Restore for MutexUndo<T> {
    fn value_crc(&self) -> u32 {
        value_crc(&self.old)
    }
    fn restore_if(self: Box<Self>, still_safe: &mut dyn FnMut() -> bool) -> bool {
        let MutexUndo { target, old } = *self;
        let mut g = target.lock();
        if !still_safe() {
            return false;
        }
        // The restore is itself a modification other trackers must see, but
        // it must not log a new undo entry.
        g.written = true;
        *g.guard = old;
        true
    }
}

/// The guard of a [`TrackedMutex`].
pub struct TrackedMutexGuard<'a, T: Clone + Hash + Send + 'static> {
    mutex: &'a TrackedMutex<T>,
    guard: MutexGuard<'a, T>,
    access: Option<Access>,
    read: Cell<bool>,
    written: bool,
}

impl<T: Clone + Hash + Send + 'static + fmt::Debug> fmt::Debug for TrackedMutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.guard, f)
    }
}

impl<T: Clone + Hash + Send + 'static> Deref for TrackedMutexGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        self.read.set(true);
        &self.guard
    }
}

impl<T: Clone + Hash + Send + 'static> DerefMut for TrackedMutexGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        let (mutex, guard) = (self.mutex, &self.guard);
        first_write(
            &mut self.written,
            self.access,
            mutex.inner.core.id(),
            || {
                Box::new(MutexUndo {
                    target: mutex.clone(),
                    old: (**guard).clone(),
                })
            },
        );
        &mut self.guard
    }
}

impl<T: Clone + Hash + Send + 'static> Drop for TrackedMutexGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        if let Some(a) = self.access {
            finish_access(
                &self.mutex.inner.core,
                a,
                self.read.get(),
                self.written,
                true,
            );
        }
    }
}

/// Record an access at unlock (the data lock still held, so sequence order
/// is lock order). `exclusive`: the caller holds the structure exclusively.
pub(crate) fn finish_access(
    core: &LockCore,
    a: Access,
    read: bool,
    written: bool,
    exclusive: bool,
) {
    let kind = if written {
        EventKind::Write
    } else {
        EventKind::Read
    };
    // A guard that neither read nor wrote touched nothing.
    if written || read {
        if exclusive {
            core.record(a.actor, kind, 0);
        } else {
            core.record_shared(a.actor, kind, 0);
        }
    }
    end_access(core, a);
}
