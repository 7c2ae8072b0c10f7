//! Every bound of Log(Lock) in one place. The paper's implementation fit in
//! 48 KB; these bounds keep the logs of one lock or actor small and make an
//! overflow an explicit, conservative outcome rather than unbounded growth.

/// Change-track log entries kept per lock: a ring of 32-byte slots (32 KiB
/// per lock ever tracked, allocated at its first tracking). Past it the
/// oldest entries are overwritten and restoration levels of trackers that
/// needed them are reported incomplete (every conflict assumed). The
/// paper's hottest lock, 15,244 accesses/s tracked for ~25 µs, logs about
/// one entry per tracking.
pub const CHANGE_LOG_ENTRIES_MAX: usize = 1024;
/// Commit (externally visible action) entries kept. Past it, committed
/// dependencies are assumed for conflicts older than the kept entries.
pub const COMMIT_LOG_ENTRIES_MAX: usize = 8192;
/// Undo entries per actor. Past it, undo capture stops and `rollback`
/// refuses (the caller takes system-level recovery).
pub const UNDO_LOG_ENTRIES_MAX: usize = 4096;
/// Locks one actor may track at once.
pub const TRACKED_PER_ACTOR_MAX: usize = 64;
/// Recovery points one actor may hold at once.
pub const RECOVERY_POINTS_MAX: usize = 64;
