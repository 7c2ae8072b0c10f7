//! Synchronisation primitives used by the lock-free protocol modules
//! ([`ready`](crate::ready), [`idle`](crate::idle), [`admission`](crate::admission)).
//!
//! Those modules take their atomics from `crate::sync` and nothing else, so the
//! loom model checker (`crates/rcs/tests/loom.rs`) can compile the very same
//! source files against `loom::sync::atomic` instead of `std::sync::atomic` and
//! explore every interleaving of their protocols. Run it with
//! `RUSTFLAGS="--cfg loom" cargo test -p rcs --test loom --release`
//! (`scripts/test.sh` does).

pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
