//! # controller: the rebound storage controller
//!
//! A block storage server that speaks NBD. It caches reads, absorbs writes
//! in a non-volatile write cache (NVS), destages them to backend devices,
//! and runs every step of an I/O as short tasks of the component recovery
//! groups on the [`rcs`] runtime (DESIGN.md, "Controller components and
//! recovery groups").
//!
//! # Layers
//!
//! Imports run one way, bottom to top; a cycle may exist only inside
//! [`engine`]. `tests/layers.rs` fails on a forbidden `use`.
//!
//! ```text
//!   host/ (listener, connections)     control/ (admin socket, status, metrics)
//!          \                              /
//!           controller.rs  (Controller: start-up, shutdown; owns the runtime)
//!                        |
//!           engine/  (Engine, requests and stages, destage, scrub,
//!                     epochs, system recovery, inject)
//!                        |
//!           config/  (Config, validation)
//!                        |
//!           backend/ (devices, RAID, partial parity log, volume,
//!                     output commit's pseudo-device: the door to the volume)
//!                        |
//!           store/   (NVS, cache directory, recovery-box journal)
//!                        |
//!   leaves: limits, units, files, recovery (the log), timer, metrics, faults, nbd/,
//!           blocking
//! ```
//!
//! | module | concept |
//! |---|---|
//! | [`nbd`] | NBD wire format and handshake |
//! | [`store`] | NVS, cache, recovery-box journal |
//! | [`backend`] | devices, RAID, volume, output commit's pseudo-device |
//! | [`config`] | configuration and its validation |
//! | [`engine`] | the I/O path as tasks; destage, scrub; rungs 1, 3 and 4 |
//! | [`controller`] | composition, start-up (fast restart from the recovery box, or hard restart from an NVS scan), shutdown |
//! | [`host`] | the listener and connections |
//! | [`control`] | admin socket, status, metrics endpoint |
//! | [`faults`] | every injectable fault, declared once |
//! | [`files`] | opening the state files privately (0600, `O_NOFOLLOW`, owner and type checked), the 0700 data directory, preallocation, directory syncs |
//! | [`sockfile`] | Unix socket files (admin, `unix:` NBD listener): bound at their mode and never wider, only a stale socket replaced, removed only while ours; the peer's uid |
//! | [`recovery`] | the recovery log: every recovery, its rung, cause and duration |
//! | [`metrics`] | counters and histograms, their Prometheus text |
//! | [`units`] | the one size and duration grammar |
//! | [`limits`] | every bound |
//! | [`timer`] | the controller's timer thread |
//! | [`blocking`] | "this thread is about to block": a connection's reading thread lets the read side go only then |
//! | `fuzzing` | (feature `fuzzing`, and the tests) the fuzz targets' entry points and property checkers |
//!
//! The invariant: a write acknowledged to a client is in the NVS (or on the
//! devices) before its reply is sent, and is never lost; a read never
//! returns data that was not written.

#![deny(unsafe_code)]

pub mod backend;
pub mod blocking;
pub mod config;
pub mod control;
pub mod controller;
pub mod engine;
pub mod faults;
#[allow(unsafe_code)]
pub mod files;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod host;
pub mod limits;
pub mod metrics;
pub mod nbd;
pub mod recovery;
// sched_setscheduler(2), with its SAFETY notes.
#[allow(unsafe_code)]
pub mod sched;
// getsockopt(SO_PEERCRED) and renameat2, each with its SAFETY note.
#[allow(unsafe_code)]
pub mod sockfile;
pub mod store;
pub mod timer;
pub mod units;

pub use config::{
    Config, ConfigError, FlushPolicy, LatencyConfig, LogFormat, LogLevel, OutputCommit,
};
pub use controller::{Controller, OpenError, RestartKind, StartupReport};
pub use engine::{Engine, Groups};
pub use host::listener::Server;
pub use units::{parse_duration, parse_size};

// The paths the `rebound` binary and the experiments use, kept while they
// move to the layered ones.
#[cfg(test)]
mod tests;

pub use backend::raid;
pub use control::{admin, http};
pub use store::nvs;
