//! The cache's memory mapped in at start-up, off the request path.
//!
//! The cache's frames are anonymous memory the kernel maps in as it is
//! first written ([`crate::store::cache`]), so a server that starts (or
//! restarts: rungs 5 and 6 begin with an empty cache) pays a page fault
//! and a page clearing for each frame it fills, on the thread serving the
//! request that fills it. That is a few microseconds a frame on bare
//! metal, and more on a virtual machine whose host backs guest memory only
//! once it is touched (or takes freed pages back): profiled on the 2-core
//! test host, a fresh server at 20k IOPS offered spent a fifth of its CPU
//! time in `clear_page` under the frames' first copies, 0.37 faults per
//! I/O, against nothing for a server that stores nothing.
//!
//! So, with `cache_prefault` on (the default), one thread maps the whole
//! cache in right after start-up, [`PREFAULT_STEP_BYTES`] at a time
//! (`MADV_POPULATE_WRITE`, which writes no byte), at nice 10: start-up
//! does not wait for it, it takes a small share of a core that serving
//! wants (256 MiB is about 90 ms of one core here), and it stops when the
//! server does. Not `SCHED_IDLE`: the kernel holds the process's memory
//! map read-locked through each step, and a thread of that class,
//! preempted inside one on a busy host, may wait long before it runs
//! again, while any `mmap` or `munmap` of the server (a new connection's
//! thread stack, a large request's buffer) waits for it. The cache then
//! holds its memory from the start rather than as it fills: the memory
//! bound in the README counts the whole cache either way. A kernel
//! without `MADV_POPULATE_WRITE` (before 5.14) leaves the cache mapped as
//! it fills, as with `cache_prefault = false`.
//!
//! [`PREFAULT_STEP_BYTES`]: crate::store::cache::PREFAULT_STEP_BYTES

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use crate::engine::Engine;

/// The prefault thread's nice value: a weight of 110 against a serving
/// thread's 1,024 (sched(7)).
const PREFAULT_NICE: i32 = 10;

/// Start mapping the cache in, if configured.
pub(crate) fn start(engine: &Arc<Engine>) {
    if !engine.config.cache_prefault {
        return;
    }
    let weak = Arc::downgrade(engine);
    let spawned = std::thread::Builder::new()
        .name("rebound-prefault".into())
        .spawn(move || run(&weak));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no thread to map the cache in; it is mapped as it fills");
    }
}

/// Map the cache in step by step, holding the engine only for a step, so
/// a stopped server is neither kept alive nor waited for.
fn run(weak: &Weak<Engine>) {
    if let Err(e) = crate::sched::set_nice(PREFAULT_NICE) {
        tracing::debug!(error = %e, "prefault thread runs at normal priority");
    }
    let started = Instant::now();
    let mut bytes = 0usize;
    let mut step = 0;
    loop {
        let Some(engine) = weak.upgrade() else { return };
        if engine.stopping.load(Ordering::Relaxed) {
            return;
        }
        if step == engine.cache.prefault_steps() {
            tracing::info!(
                mib = bytes >> 20,
                ms = started.elapsed().as_millis() as u64,
                "cache memory mapped in"
            );
            return;
        }
        match engine.cache.prefault_step(step) {
            Ok(n) => bytes += n,
            Err(e) => {
                tracing::info!(error = %e, "cache memory is mapped as it fills");
                return;
            }
        }
        step += 1;
    }
}
