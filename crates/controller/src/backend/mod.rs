//! # backend: the volume and its devices, behind one door
//!
//! Everything below the cache (DESIGN.md, "Controller layers"): backend
//! devices and their submission queues, the volume's redundancy (striping,
//! mirror, rotated parity with a partial parity log) with degraded service
//! and rebuild of a lost device (the smart-storage paper's data
//! reconstruction, *Fault Recovery Designs for Processor-Embedded
//! Distributed Storage Architectures*, applied to a controller's devices),
//! and output commit's pseudo-device (*ReViveI/O: Efficient Handling of I/O
//! in Highly-Available Rollback-Recovery Servers*, HPCA 2006).
//!
//! [`pseudodev::PseudoDevice`] is the one door to the volume for the
//! engine: read, write, zero, unmap and sync pass through it, so output
//! commit holds device writes until their epoch commits.
//!
//! Imports: `store` and leaves. Never the engine, host or control layers.
//!
//! | module | concept |
//! |---|---|
//! | [`allocmap`] | which tracks may hold data (BLOCK_STATUS `base:allocation`), synced with the devices |
//! | [`device`] | a backend device (file, `pread`/`pwrite`, optional `O_DIRECT`) and its latency model |
//! | [`faulty`] | the environment's faults at the door: device errors, torn writes, latency, power loss |
//! | [`devqueue`] | device submission queues: queue full, unsolicited completions (rung 1) |
//! | [`raid`] | where a track's copies or stripe live (none, mirror, parity) |
//! | [`ppl`] | the partial parity log closing the RAID-5 write hole |
//! | [`volume`] | label, devices, degraded I/O, rebuild of a lost device (rung 7) |
//! | [`renamemap`] | output commit's rename area and its durable map |
//! | [`syncgate`] | group commit of device syncs, keeping `fdatasync`'s error semantics |
//! | [`pseudodev`] | output commit's pseudo-device: the door to the volume (rung 3) |
//! | [`bufferarea`] | `buffering`'s buffer area: a file of slots, the first mapped |

#[allow(unsafe_code)]
pub mod allocmap;
#[allow(unsafe_code)]
pub mod bufferarea;
#[allow(unsafe_code)]
pub mod device;
pub mod devqueue;
pub mod faulty;
pub mod ppl;
pub mod pseudodev;
pub mod raid;
pub mod renamemap;
pub mod syncgate;
pub mod volume;
