//! # controller: the rebound storage controller
//!
//! A block storage server that speaks NBD. It caches reads, absorbs writes
//! in a non-volatile write cache (NVS), destages them to backend devices,
//! and runs every step of an I/O as short tasks of the component recovery
//! groups on the [`rcs`] runtime (DESIGN.md, "Controller components and
//! recovery groups").
//!
//! | module | component |
//! |---|---|
//! | [`admin`] | the admin socket: `rebound status`, `rebound inject` |
//! | [`nbd`], [`connection`] | host adapter: handshake, request framing, batched replies |
//! | [`datapath`] | the I/O path as tasks, stage by stage |
//! | [`ctlblock`] | request control blocks: a bounded pool, leaked blocks reclaimed by audit |
//! | [`cache`] | cache directory, CLOCK read cache, control-block check words |
//! | [`nvs`] | NVS: self-describing, checksummed records in a mapped file |
//! | [`destage`] | destage of dirty tracks, FLUSH and FUA; lost tracks |
//! | [`scrub`] | background check of the dirty NVS records: repair from the cache, or report the loss |
//! | [`device`], [`volume`], [`raid`] | backend devices; the volume's layout (striped, mirror, rotated parity), degraded service and rebuild of a lost device |
//! | [`devqueue`] | device submission queues: queue full (back off), unsolicited completions (ignored) |
//! | [`controller`] | composition, start-up (fast restart from the recovery box, or hard restart from an NVS scan), shutdown |
//! | [`journal`] | what the recovery box holds: volume table, dirty directory, destage cursor |
//! | [`recovery`] | the recovery log: every recovery, its rung, cause and duration |
//! | [`system`] | rung 4: in-process system-level recovery (quiesce, rebuild, redrive) |
//! | [`server`] | the listener |
//! | [`metrics`], [`http`] | counters, histograms, Prometheus endpoint |
//! | [`config`], [`limits`] | configuration and every bound |
//!
//! The invariant: a write acknowledged to a client is in the NVS (or on the
//! devices) before its reply is sent, and is never lost; a read never
//! returns data that was not written.

#![deny(unsafe_code)]

pub mod admin;
pub mod cache;
pub mod config;
pub mod connection;
pub mod controller;
pub mod ctlblock;
pub mod datapath;
pub mod destage;
#[allow(unsafe_code)]
pub mod device;
pub mod devqueue;
pub mod epoch;
pub mod http;
pub mod journal;
pub mod limits;
pub mod metrics;
pub mod nbd;
#[allow(unsafe_code)]
pub mod nvs;
pub mod ppl;
pub mod pseudodev;
pub mod raid;
pub mod recovery;
pub mod renamemap;
pub mod scrub;
pub mod server;
pub mod system;
pub mod timer;
pub mod volume;

pub use config::{
    Config, ConfigError, FlushPolicy, LatencyConfig, OutputCommit, parse_duration, parse_size,
};
pub use controller::{Controller, Groups, OpenError, RestartKind, StartupReport};
pub use server::Server;
