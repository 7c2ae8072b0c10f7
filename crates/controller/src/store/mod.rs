//! # store: where acknowledged data and the controller's metadata live
//!
//! The layer the rest of the controller stands on (DESIGN.md, "Controller
//! layers"): the NVS (the non-volatile write cache: a write is acknowledged
//! once its record is here), the cache directory and read cache, and the
//! journal of the recovery box (*The Recovery Box: Using Fast Recovery to
//! Provide High Availability in the UNIX Environment*, Baker and Sullivan,
//! USENIX Summer 1992).
//!
//! Imports: leaves only (`limits`, `recovery`, `timer`, `metrics`, `nbd`,
//! `faults` and the leaf crates). Nothing here names a backend device, a
//! request, a connection or the admin socket.
//!
//! | module | concept |
//! |---|---|
//! | [`nvs`] | NVS records: self-describing, checksummed, in a mapped file; the scan of a hard restart |
//! | [`cache`] | the cache directory (dirty state per track), CLOCK read cache, control-block check words |
//! | [`journal`] | what the recovery box holds: volume identity, dirty directory, destage cursor |

// madvise(MADV_POPULATE_WRITE) for the prefault (and mincore in its
// test), each with its SAFETY note.
#[allow(unsafe_code)]
pub mod cache;
pub mod journal;
#[allow(unsafe_code)]
pub mod nvs;
