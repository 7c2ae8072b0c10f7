//! # engine: the I/O path and the recovery ladder's in-process rungs
//!
//! The state the stages share ([`Engine`]), a request and its stages as
//! tasks of the component recovery groups on the rcs runtime (*Enhancing
//! Storage System Availability on Multi-Core Architectures with
//! Recovery-Conscious Scheduling*, Seshadri et al., FAST 2008; Log(Lock)
//! micro-recovery for rung 1), destage and scrub, rung 3's epochs and
//! output commit, rung 4's system-level recovery and rollback (the ladder:
//! `docs/ladder.md`).
//!
//! Imports: `config`, `backend`, `store`, `nbd` and leaves. A cycle may
//! exist inside this layer (a stage calls destage, system recovery redrives
//! requests), nowhere else. Nothing here names the `Controller`, a
//! connection or the admin socket: replies leave through [`ReplySink`].
//!
//! | module | concept |
//! |---|---|
//! | [`state`] | [`Engine`]: the shared state every stage, destage and recovery needs |
//! | [`admission`] | a framed request takes a control block and NVS space, enters the pipeline |
//! | [`reply`] | [`ReplySink`]: how a finished request reaches its connection |
//! | [`datapath`] | the I/O path as tasks, stage by stage |
//! | [`request`] | a request in flight; its clean-up block decides rung 1 redrives |
//! | [`ctlblock`] | request control blocks: a bounded pool, leaked blocks reclaimed by audit |
//! | [`tracklock`] | track locks: a partial-track write's read-modify-write against every other change of the track |
//! | [`blockstatus`] | BLOCK_STATUS: which tracks hold data (`base:allocation`) |
//! | [`destage`] | destage of dirty tracks, FLUSH and FUA; lost tracks |
//! | [`scrub`] | background check of the dirty NVS records |
//! | [`prefault`] | the cache's memory mapped in at start-up, in the background at low priority |
//! | [`epoch`] | rung 3: epochs, checkpoints, output commit, rollback |
//! | [`system`] | rung 4: quiesce, rebuild, redrive, in process |
//! | [`inject`] | arming a [`Fault`](crate::faults::Fault) on a running engine |

pub mod admission;
pub mod blockstatus;
pub mod ctlblock;
pub mod datapath;
pub mod destage;
pub mod epoch;
pub mod inject;
pub mod prefault;
pub mod reply;
pub mod request;
pub mod scrub;
pub mod state;
pub mod system;
pub mod tracklock;

pub use reply::ReplySink;
pub use state::{Engine, Groups};
