//! Shared harness for the rcs integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Poll `condition` until it holds or `timeout` passes; whether it held.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Busy for `d` (a task's "work").
pub fn spin_for(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

/// Tracks how many tasks of something run at once, and the most ever seen.
#[derive(Debug, Default)]
pub struct Concurrency {
    live: AtomicU32,
    max: AtomicU32,
}

impl Concurrency {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Enter; returns a guard that leaves on drop.
    pub fn enter(self: &Arc<Self>) -> ConcurrencyGuard {
        let now = self.live.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        ConcurrencyGuard(Arc::clone(self))
    }

    pub fn max(&self) -> u32 {
        self.max.load(Ordering::SeqCst)
    }

    pub fn live(&self) -> u32 {
        self.live.load(Ordering::SeqCst)
    }
}

pub struct ConcurrencyGuard(Arc<Concurrency>);

impl Drop for ConcurrencyGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}
