//! A task past its deadline: the watchdog that turns a stall into a
//! time-out failure.
//!
//! The paper's taxonomy (§2.2) counts time-outs among the most common
//! transient faults: an operation that waits too long for an adapter or a
//! resource. A task cannot be interrupted from outside, so detection is
//! split in two:
//!
//! - each worker keeps a task clock: which of its tasks is running, and
//!   whether that task has been declared overdue;
//! - a watchdog thread (started when [`RuntimeBuilder::task_deadline`] is
//!   set) scans the clocks every quarter deadline (1 to 100 ms) and marks a
//!   task it has seen running for the deadline overdue, counting it in its
//!   group's `overdue` metric.
//!
//! An overdue task learns it at its next cooperative check
//! ([`TaskCtx::check`], or a stall emulated by a `Delay` fault point, which
//! waits in slices and stops at the mark): it fails with class
//! [`Timeout`](crate::FailureClass::Timeout) and unwinds through its
//! recovery points like any other failure, so the embedder's handlers
//! decide whether to retry, redrive or escalate.
//!
//! A task that never checks (a loop without a check, a call that never
//! returns) cannot learn it. With [`RuntimeBuilder::hung_after`] set, the
//! watchdog calls such a task hung once it has run that long and recovers
//! its group from outside: the group is suspended and its other tasks
//! clean up, and since the hung task never drains, the drain time-out
//! escalates to system level (the embedder's next rung), while the other
//! groups keep running.
//!
//! The clock is one atomic word per worker, `task << 1 | overdue`, where
//! `task` numbers the worker's tasks (never 0; 0 is idle), so the hot path
//! pays one store per task and reads no clock. The watchdog times how long
//! it has seen the same task number running, and marks it with a
//! compare-and-swap that fails if that task ended meanwhile: a new task is
//! never blamed for an old one's stall. A task is declared overdue after
//! running between one deadline and one deadline plus one scan interval.
//!
//! [`RuntimeBuilder::task_deadline`]: crate::RuntimeBuilder::task_deadline
//! [`RuntimeBuilder::hung_after`]: crate::RuntimeBuilder::hung_after
//! [`TaskCtx::check`]: crate::TaskCtx::check

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::failure::Failure;
use crate::runtime::Shared;

/// Shortest and longest interval between two watchdog scans.
const TICK_MIN: Duration = Duration::from_millis(1);
const TICK_MAX: Duration = Duration::from_millis(100);

/// One worker's clock of its current task.
#[derive(Debug, Default)]
pub(crate) struct TaskClock {
    /// `task << 1 | overdue`; 0 when no task runs.
    word: AtomicU64,
    /// Group index of the running task (valid while `word != 0`).
    group: AtomicUsize,
}

impl TaskClock {
    /// The worker's task number `task` (never 0) of `group` starts.
    #[inline]
    pub(crate) fn start(&self, group: usize, task: u64) {
        debug_assert!(task != 0 && task < 1 << 63);
        self.group.store(group, Ordering::Relaxed);
        self.word.store(task << 1, Ordering::Release);
    }

    /// The task ended.
    #[inline]
    pub(crate) fn stop(&self) {
        self.word.store(0, Ordering::Release);
    }

    /// Whether the running task was declared past its deadline.
    #[inline]
    pub(crate) fn is_overdue(&self) -> bool {
        self.word.load(Ordering::Relaxed) & 1 != 0
    }
}

/// What the watchdog last saw on one worker: the clock word, since when,
/// and whether it already started a recovery for that task.
#[derive(Debug, Clone, Copy)]
struct Seen {
    word: u64,
    since: Instant,
    escalated: bool,
}

impl Seen {
    fn new(now: Instant) -> Self {
        Self {
            word: 0,
            since: now,
            escalated: false,
        }
    }
}

/// What one look at a worker's clock found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Nothing to do.
    Fine,
    /// This look marked the task of this group overdue.
    Overdue(usize),
    /// The task of this group, already overdue, has run for `hung_after`
    /// without ending: it does not check, so its group must recover.
    Hung(usize),
}

/// Looks at `clock` at `now`; marks its task overdue when the same task
/// has been seen running for `deadline`, and calls it hung once it has
/// been seen running for `hung_after`.
fn observe(
    clock: &TaskClock,
    seen: &mut Seen,
    now: Instant,
    deadline: Duration,
    hung_after: Option<Duration>,
) -> Verdict {
    let w = clock.word.load(Ordering::Acquire);
    if w & !1 != seen.word & !1 {
        *seen = Seen {
            word: w,
            since: now,
            escalated: false,
        };
        return Verdict::Fine;
    }
    let running = now.duration_since(seen.since);
    if w == 0 || running < deadline {
        return Verdict::Fine;
    }
    let group = clock.group.load(Ordering::Relaxed);
    if w & 1 != 0 {
        seen.word = w;
        if !seen.escalated && hung_after.is_some_and(|h| running >= h) {
            seen.escalated = true;
            return Verdict::Hung(group);
        }
        return Verdict::Fine;
    }
    match clock
        .word
        .compare_exchange(w, w | 1, Ordering::AcqRel, Ordering::Relaxed)
    {
        Ok(_) => {
            seen.word = w | 1;
            Verdict::Overdue(group)
        }
        Err(_) => Verdict::Fine,
    }
}

/// Interval between two scans for `deadline`.
pub(crate) fn tick(deadline: Duration) -> Duration {
    (deadline / 4).clamp(TICK_MIN, TICK_MAX)
}

/// The watchdog thread's body: scans until the runtime shuts down.
pub(crate) fn watchdog(shared: Arc<Shared>, deadline: Duration, hung_after: Option<Duration>) {
    let tick = tick(deadline);
    let mut seen = vec![Seen::new(Instant::now()); shared.workers.len()];
    while !shared.shutdown.load(Ordering::SeqCst) {
        std::thread::sleep(tick);
        let now = Instant::now();
        for (index, (w, seen)) in shared.workers.iter().zip(&mut seen).enumerate() {
            match observe(&w.clock, seen, now, deadline, hung_after) {
                Verdict::Fine => {}
                Verdict::Overdue(g) => {
                    w.stats.groups[g].overdue.bump();
                    tracing::warn!(
                        worker = index,
                        group = %shared.groups[g].name,
                        deadline_ms = deadline.as_millis() as u64,
                        "task past its deadline: it fails with a time-out at its next check"
                    );
                }
                Verdict::Hung(g) => escalate_hung(&shared, index, g, now - seen.since),
            }
        }
    }
}

/// A task that ignored its overdue mark: recover its group from outside
/// (on a thread of its own, so the watchdog keeps scanning). The hung task
/// cannot drain, so with reactive scheduling the recovery's drain time-out
/// escalates to system level, the embedder's next rung.
fn escalate_hung(shared: &Arc<Shared>, worker: usize, g: usize, running: Duration) {
    let group = crate::group::GroupId(g as u8);
    let name = shared.groups[g].name.clone();
    tracing::error!(worker, group = %name, ?running,
        "task hung past its deadline without checking: recovering its group");
    let failure = Failure::timeout(format!(
        "a task of group {name} on worker {worker} hung: running for {running:?}, past its deadline, without checking"
    ));
    let sh = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("rcs-hung-recovery".into())
        .spawn(move || sh.recover_group(group, failure, 0));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the recovery of a hung task's group");
    }
}

/// Whether the task running on this thread (if any) is past its deadline.
pub fn current_task_overdue() -> bool {
    crate::task::WORKER.with(|w| {
        w.borrow()
            .as_ref()
            .is_some_and(|tls| tls.shared.workers[tls.index].clock.is_overdue())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_is_marked_once_after_being_seen_running_for_the_deadline() {
        let d = Duration::from_millis(10);
        let t0 = Instant::now();
        let c = TaskClock::default();
        let mut seen = Seen::new(t0);
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 5, d, None),
            Verdict::Fine,
            "idle"
        );
        c.start(3, 7);
        assert_eq!(
            observe(&c, &mut seen, t0 + d, d, None),
            Verdict::Fine,
            "first seen"
        );
        assert_eq!(
            observe(&c, &mut seen, t0 + d + d / 2, d, None),
            Verdict::Fine,
            "not yet"
        );
        assert!(!c.is_overdue());
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 2, d, None),
            Verdict::Overdue(3)
        );
        assert!(c.is_overdue());
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 9, d, None),
            Verdict::Fine,
            "marked once"
        );
        // The next task starts clean, and its time counts from when it is
        // first seen, not from the old task's.
        c.stop();
        c.start(1, 8);
        assert!(!c.is_overdue());
        assert_eq!(observe(&c, &mut seen, t0 + d * 10, d, None), Verdict::Fine);
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 10 + d / 2, d, None),
            Verdict::Fine
        );
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 11, d, None),
            Verdict::Overdue(1)
        );
    }

    #[test]
    fn a_task_that_ends_before_the_mark_is_not_marked() {
        let d = Duration::from_millis(10);
        let t0 = Instant::now();
        let c = TaskClock::default();
        let mut seen = Seen::new(t0);
        c.start(0, 1);
        assert_eq!(observe(&c, &mut seen, t0, d, None), Verdict::Fine);
        c.stop();
        c.start(0, 2);
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 3, d, None),
            Verdict::Fine,
            "another task"
        );
        assert!(!c.is_overdue());
    }

    #[test]
    fn an_overdue_task_still_running_at_hung_after_is_called_hung_once() {
        let d = Duration::from_millis(10);
        let hung = Some(d * 5);
        let t0 = Instant::now();
        let c = TaskClock::default();
        let mut seen = Seen::new(t0);
        c.start(2, 1);
        assert_eq!(observe(&c, &mut seen, t0, d, hung), Verdict::Fine);
        assert_eq!(observe(&c, &mut seen, t0 + d, d, hung), Verdict::Overdue(2));
        assert_eq!(observe(&c, &mut seen, t0 + d * 4, d, hung), Verdict::Fine);
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 5, d, hung),
            Verdict::Hung(2)
        );
        assert_eq!(
            observe(&c, &mut seen, t0 + d * 9, d, hung),
            Verdict::Fine,
            "once"
        );
        // Without hung_after an overdue task is never escalated.
        let mut seen = Seen::new(t0);
        c.stop();
        c.start(2, 2);
        assert_eq!(observe(&c, &mut seen, t0, d, None), Verdict::Fine);
        assert_eq!(observe(&c, &mut seen, t0 + d, d, None), Verdict::Overdue(2));
        assert_eq!(observe(&c, &mut seen, t0 + d * 50, d, None), Verdict::Fine);
    }

    #[test]
    fn the_scan_interval_is_a_quarter_deadline_within_bounds() {
        assert_eq!(tick(Duration::from_millis(200)), Duration::from_millis(50));
        assert_eq!(tick(Duration::from_micros(100)), TICK_MIN);
        assert_eq!(tick(Duration::from_secs(10)), TICK_MAX);
    }
}
