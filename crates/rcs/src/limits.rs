//! Every bound of the runtime in one place (STYLE: "bound every queue, keep the
//! `*_max` limits in one constants module"). Memory for queues is allocated
//! when the runtime is built; nothing grows without bound afterwards.

use std::time::Duration;

/// Recovery groups per runtime: group sets are `u64` bit masks.
pub const GROUPS_MAX: usize = 64;
/// Worker threads per runtime: the idle set is a `u64` bit mask.
pub const WORKERS_MAX: usize = 64;
/// Affiliate slots per runtime (threads outside the pools that run tasks).
pub const AFFILIATES_MAX: usize = 4096;
/// Resource pools per runtime (a pool has at least one worker).
pub const POOLS_MAX: usize = WORKERS_MAX;
/// Default capacity of one job queue (one group, one priority).
pub const QUEUE_CAPACITY_DEFAULT: usize = 4096;
/// Largest accepted capacity of one job queue.
pub const QUEUE_CAPACITY_MAX: usize = 1 << 20;
/// Largest accepted QoS loop count (Figures 6 and 7).
pub const LOOP_COUNT_MAX: u32 = 1024;
/// Largest accepted recoverability constraint sigma.
pub const SIGMA_MAX: u32 = 1 << 16;
/// Default scheduling rounds a worker spins through without work before it
/// parks ([`RuntimeBuilder::idle_spins`](crate::RuntimeBuilder::idle_spins)).
pub const IDLE_SPINS_DEFAULT: u32 = 8;
/// Largest accepted idle spin count.
pub const IDLE_SPINS_MAX: u32 = 1 << 16;
/// Longest a parked worker sleeps before re-checking on its own: a last
/// line of defence, since every wake-up the protocol needs is explicit
/// (a submission, a group's recovery ending, an affiliate releasing a
/// group at its sigma bound). It is what an idle runtime costs: each of
/// its workers wakes this often.
pub const PARK_TIMEOUT: Duration = Duration::from_millis(100);
/// Recovery events kept for [`Handle::recent_events`](crate::Handle::recent_events).
pub const RECOVERY_EVENTS_MAX: usize = 256;
/// Largest accepted retry bound of a recovery point.
pub const RETRY_ATTEMPTS_MAX: u32 = 1_000;
/// Task dispatches between two flushes of a worker's busy-time streak.
pub const BUSY_FLUSH_DISPATCHES: u32 = 1024;
/// Distinct `(task kind, lock)` observations kept for scope refinement.
pub const OBSERVATIONS_MAX: usize = 65_536;
