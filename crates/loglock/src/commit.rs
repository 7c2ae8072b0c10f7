//! Externally visible actions (paper §2.1, the E events): a reply sent to a
//! host, a write issued to a device. They cannot be rolled back, so a
//! conflict followed by the conflicting actor's commit is a *committed
//! dependency* (CD), which rules out multi-actor rollback (SRP rule 2).
//!
//! Every thread counts its commits; each change-track event carries the
//! count of its thread at the time, so "T2 committed after its conflicting
//! access" is "T2's thread has a commit numbered above the one the access
//! carries", decided from T2's own program order without a global clock.
//! Commits go to one process-wide log, kept only while some actor tracks
//! something anywhere (nobody can need them otherwise), bounded by
//! [`COMMIT_LOG_ENTRIES_MAX`]: a tracker that started before an entry was
//! dropped assumes CD for any conflict.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::event::{ActorId, Event, EventKind, count_commit};
use crate::limits::COMMIT_LOG_ENTRIES_MAX;

/// Actors tracking at least one lock, process-wide.
pub(crate) static TRACKING_ACTORS: AtomicU32 = AtomicU32::new(0);

/// Commits recorded so far, process-wide (orders drops against tracker
/// starts).
pub(crate) static COMMIT_SEQ: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Default)]
pub(crate) struct CommitLog {
    pub entries: VecDeque<Event>,
    /// Highest commit sequence number dropped for space (0: none).
    pub dropped_through: u64,
}

pub(crate) static COMMITS: Mutex<CommitLog> = Mutex::new(CommitLog {
    entries: VecDeque::new(),
    dropped_through: 0,
});

/// Record an externally visible action by `actor`.
pub(crate) fn record_commit(actor: ActorId) {
    let count = count_commit();
    if TRACKING_ACTORS.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut log = COMMITS.lock();
    let seq = COMMIT_SEQ.fetch_add(1, Ordering::SeqCst);
    let e = Event::new(seq, actor, EventKind::Commit, 0, count);
    if log.entries.len() == COMMIT_LOG_ENTRIES_MAX
        && let Some(old) = log.entries.pop_front()
    {
        log.dropped_through = old.seq;
    }
    log.entries.push_back(e);
}

/// The commit sequence number a new tracker starts at.
pub(crate) fn commit_mark() -> u64 {
    COMMIT_SEQ.load(Ordering::SeqCst)
}

/// Called when the last tracking actor stops: nothing needs the commits.
pub(crate) fn purge_if_idle() {
    if TRACKING_ACTORS.load(Ordering::SeqCst) == 0 {
        let mut log = COMMITS.lock();
        if TRACKING_ACTORS.load(Ordering::SeqCst) == 0 {
            log.entries.clear();
            log.dropped_through = 0;
        }
    }
}
