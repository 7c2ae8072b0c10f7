//! The pool scheduler as a state machine: the QoS loop of Figures 6 and 7,
//! `ScanDispatch` under each policy of §5 (static, partial-dynamic with the
//! lease of Figure 8, dynamic, and the performance-oriented baseline), and
//! the re-check a processor makes before it idles.
//!
//! The scheduler decides; it owns no thread, no clock and no queue. What it
//! sees of the world is a [`JobQueues`]: which groups' queues may hold work,
//! which groups are suspended, how many tasks of a group run, and an
//! operation that admits and dispatches one task. Two worlds implement it:
//!
//! - the runtime's worker threads ([`crate::worker`]), over the lock-free
//!   queues, ready masks and admission counters, where a dispatch runs the
//!   task to its end before returning;
//! - the discrete-event simulator ([`crate::sim`]), over plain queues and a
//!   virtual clock, where a dispatch hands the task to a virtual processor
//!   that completes it later.
//!
//! So no policy is written twice: the simulator replays exactly the
//! decisions the runtime makes, at any number of processors.
//!
//! # The state machine
//!
//! A processor asks for work with [`PoolScheduler::next`]; each call
//! dispatches at most one task and returns [`Step::Dispatched`], or
//! [`Step::Idle`] when a whole QoS round found nothing. Between calls the
//! scheduler remembers where it is in the round (Figure 7):
//!
//! ```text
//! repeat medium_loop_count times (stop early when a pass found nothing):
//!     repeat high_loop_count times (stop at the first empty scan):
//!         ScanDispatch(high)
//!     ScanDispatch(medium)
//! ScanDispatch(low)
//! ```
//!
//! plus the round-robin cursor between groups (starvation freedom, §5.1)
//! and the partial-dynamic lease (Figure 8: "we set the lease-timer to a
//! single dispatch cycle").

use crate::admission::Sigma;
use crate::group::Priority;
use crate::mapping::PoolTables;
use crate::policy::{Policy, QosLoops};

/// What a pool scheduler sees of the job queues and groups, and the one
/// operation it asks for: dispatch.
pub(crate) trait JobQueues {
    /// Groups whose priority-`p` queue may hold work (a hint that may be
    /// stale-set, never stale-clear; see [`crate::ready`]).
    fn ready(&self, p: Priority) -> u64;
    /// Whether the performance policy's shared queue of priority `p` may
    /// hold work.
    fn shared_ready(&self, p: Priority) -> bool;
    /// Groups whose dispatch is suspended (reactive RCS).
    fn suspended(&self) -> u64;
    /// Tasks of group `g` running now.
    fn running(&self, g: u32) -> u32;
    /// Group `g`'s recoverability constraint sigma.
    fn sigma(&self, g: u32) -> u32;
    /// The groups of `mask` running fewer tasks than their sigma. A world
    /// that keeps this set as it goes (the simulator) answers in one step.
    #[inline]
    fn under_sigma(&self, mask: u64) -> u64 {
        let mut under = 0;
        let mut m = mask;
        while m != 0 {
            let g = m.trailing_zeros();
            m &= m - 1;
            if self.running(g) < self.sigma(g) {
                under |= 1u64 << g;
            }
        }
        under
    }
    /// Pop one task from the shared queue of priority `p` and dispatch it;
    /// false if the queue was empty.
    fn dispatch_shared(&mut self, p: Priority) -> bool;
    /// Admit one task of group `g` (sigma per `mode`, and the reactive
    /// fence), pop it from the priority-`p` queue and dispatch it; false
    /// if the queue was empty or admission refused.
    fn dispatch(&mut self, g: u32, p: Priority, mode: Sigma) -> bool;
    /// The partial-dynamic scheduler acquired a lease (for the metrics).
    fn lease_acquired(&mut self);
}

/// What every pool scheduler of one runtime (or simulation) shares.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rules<'a> {
    pub(crate) tables: &'a PoolTables,
    pub(crate) qos: QosLoops,
    pub(crate) lease_dispatches: u32,
}

/// The result of asking for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// One task was dispatched.
    Dispatched,
    /// A whole QoS round found nothing to dispatch.
    Idle,
}

/// Where a pool scheduler is in its QoS round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    High,
    Medium,
    Low,
}

/// One processor's scheduler state: its pool, its place in the QoS round,
/// its round-robin cursor and its lease.
#[derive(Debug, Clone)]
pub(crate) struct PoolScheduler {
    pool: usize,
    cursor: u32,
    lease_left: u32,
    phase: Phase,
    high_scans: u32,
    medium_scans: u32,
    found_high: bool,
    found_in_round: bool,
}

impl PoolScheduler {
    /// The scheduler of a processor of pool `pool`; `cursor` staggers the
    /// round-robin start between processors.
    pub(crate) fn new(pool: usize, cursor: u32) -> Self {
        Self {
            pool,
            cursor,
            lease_left: 0,
            phase: Phase::High,
            high_scans: 0,
            medium_scans: 0,
            found_high: false,
            found_in_round: false,
        }
    }

    /// Whether the next call to [`PoolScheduler::next`] starts a new round.
    #[inline]
    pub(crate) fn at_round_start(&self) -> bool {
        self.phase == Phase::High && self.medium_scans == 0 && self.high_scans == 0
    }

    /// Dispatch at most one task: go on with the QoS round where the last
    /// call left it. [`Step::Idle`] when a whole round found nothing (the
    /// next call starts a fresh round).
    #[inline]
    pub(crate) fn next<Q: JobQueues>(&mut self, q: &mut Q, policy: Policy, r: Rules<'_>) -> Step {
        loop {
            match self.phase {
                Phase::High => {
                    if self.medium_scans >= r.qos.medium_loop_count {
                        self.phase = Phase::Low;
                    } else if self.high_scans < r.qos.high_loop_count
                        && self.scan_dispatch(q, policy, r, Priority::High)
                    {
                        self.high_scans += 1;
                        self.found_high = true;
                        self.found_in_round = true;
                        return Step::Dispatched;
                    } else {
                        self.phase = Phase::Medium;
                    }
                }
                Phase::Medium => {
                    let found_medium = self.scan_dispatch(q, policy, r, Priority::Medium);
                    self.medium_scans += 1;
                    let again = (self.found_high || found_medium)
                        && self.medium_scans < r.qos.medium_loop_count;
                    self.found_high = false;
                    self.high_scans = 0;
                    self.phase = if again { Phase::High } else { Phase::Low };
                    if found_medium {
                        self.found_in_round = true;
                        return Step::Dispatched;
                    }
                }
                Phase::Low => {
                    let found_low = self.scan_dispatch(q, policy, r, Priority::Low);
                    let round_found = self.found_in_round || found_low;
                    self.phase = Phase::High;
                    self.medium_scans = 0;
                    self.found_in_round = false;
                    if found_low {
                        return Step::Dispatched;
                    }
                    if !round_found {
                        return Step::Idle;
                    }
                }
            }
        }
    }

    /// `ScanDispatch(queue)`: dispatch at most one task of priority `p`.
    ///
    /// Inlined into the round: a round makes two or three scans per
    /// dispatch, and as a call each paid more in its prologue than the
    /// scan of an empty queue costs (7% of the simulator's instructions).
    #[inline(always)]
    fn scan_dispatch<Q: JobQueues>(
        &mut self,
        q: &mut Q,
        policy: Policy,
        r: Rules<'_>,
        p: Priority,
    ) -> bool {
        match policy {
            Policy::Performance => q.shared_ready(p) && q.dispatch_shared(p),
            Policy::Static => {
                let groups = r.tables.pool_primary[self.pool];
                self.dispatch_mapped(q, p, groups, u64::MAX)
            }
            Policy::Partial => self.dispatch_partial(q, r, p),
            Policy::Dynamic => self.dispatch_dynamic(q, p),
        }
    }

    /// Static scan over `groups`, enforcing sigma for the groups in
    /// `enforce`, round-robin from the cursor.
    fn dispatch_mapped<Q: JobQueues>(
        &mut self,
        q: &mut Q,
        p: Priority,
        groups: u64,
        enforce: u64,
    ) -> bool {
        let mut candidates = q.ready(p) & groups & !q.suspended();
        while candidates != 0 {
            let g = next_round_robin(candidates, self.cursor);
            candidates &= !(1u64 << g);
            let mode = if enforce & (1u64 << g) != 0 {
                Sigma::Enforce
            } else {
                Sigma::Count
            };
            if q.dispatch(g, p, mode) {
                self.cursor = g + 1;
                return true;
            }
        }
        false
    }

    /// Figure 8: the static mapping first; without work there, the
    /// alternative mapping under a lease.
    fn dispatch_partial<Q: JobQueues>(&mut self, q: &mut Q, r: Rules<'_>, p: Priority) -> bool {
        let primary = r.tables.pool_primary[self.pool];
        let alternative = r.tables.pool_alternative[self.pool];
        let strict = r.tables.strict;
        if self.lease_left > 0 {
            if self.dispatch_mapped(q, p, alternative, strict) {
                self.lease_left -= 1;
                return true;
            }
            self.lease_left = 0;
        }
        if self.dispatch_mapped(q, p, primary, u64::MAX) {
            return true;
        }
        // AcquireLease()
        self.lease_left = r.lease_dispatches;
        q.lease_acquired();
        if self.dispatch_mapped(q, p, alternative, strict) {
            self.lease_left -= 1;
            return true;
        }
        self.lease_left = 0;
        false
    }

    /// §5.3: prefer groups under sigma; otherwise the fewest running.
    #[inline]
    fn dispatch_dynamic<Q: JobQueues>(&mut self, q: &mut Q, p: Priority) -> bool {
        let ready = q.ready(p) & !q.suspended();
        if ready == 0 {
            return false;
        }
        let under = q.under_sigma(ready);
        let mut candidates = ready & under;
        while candidates != 0 {
            let g = next_round_robin(candidates, self.cursor);
            candidates &= !(1u64 << g);
            if q.dispatch(g, p, Sigma::Count) {
                self.cursor = g + 1;
                return true;
            }
        }
        let mut saturated = ready & !under;
        while saturated != 0 {
            let g = fewest_running(q, saturated);
            saturated &= !(1u64 << g);
            if q.dispatch(g, p, Sigma::Count) {
                self.cursor = g + 1;
                return true;
            }
        }
        false
    }

    /// The re-check before idling: whether this pool could dispatch
    /// something now. Groups at sigma under an enforcing policy do not
    /// count: the processor that runs their task picks up their queue
    /// when it finishes.
    pub(crate) fn has_work<Q: JobQueues>(&self, q: &Q, policy: Policy, r: Rules<'_>) -> bool {
        if Priority::ALL.iter().any(|&p| q.shared_ready(p)) {
            return true;
        }
        let (groups, enforce) = r.tables.pool_groups(policy, self.pool);
        let suspended = q.suspended();
        Priority::ALL.iter().any(|&p| {
            let mut ready = q.ready(p) & groups & !suspended;
            if enforce {
                let mut m = ready;
                while m != 0 {
                    let g = m.trailing_zeros();
                    m &= !(1u64 << g);
                    if q.running(g) >= q.sigma(g) {
                        ready &= !(1u64 << g);
                    }
                }
            }
            ready != 0
        })
    }
}

/// The next group of `mask` at or after `cursor`, cyclically.
#[inline]
pub(crate) fn next_round_robin(mask: u64, cursor: u32) -> u32 {
    debug_assert!(mask != 0);
    let c = cursor % 64;
    (mask.rotate_right(c).trailing_zeros() + c) % 64
}

/// Among the groups of `mask`, the one with the fewest running tasks (the
/// lowest index on a tie).
fn fewest_running<Q: JobQueues>(q: &Q, mask: u64) -> u32 {
    let mut best = (u32::MAX, mask.trailing_zeros());
    let mut m = mask;
    while m != 0 {
        let g = m.trailing_zeros();
        m &= !(1u64 << g);
        let running = q.running(g);
        if running < best.0 {
            best = (running, g);
        }
    }
    best.1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A world of plain queues whose dispatch just records what it took.
    struct Recorder {
        queued: [[u32; Priority::COUNT]; 4],
        sigma: [u32; 4],
        running: [u32; 4],
        taken: Vec<(u32, Priority)>,
    }

    impl JobQueues for Recorder {
        fn ready(&self, p: Priority) -> u64 {
            (0..4)
                .filter(|&g| self.queued[g][p.index()] > 0)
                .fold(0, |m, g| m | 1 << g)
        }
        fn shared_ready(&self, _p: Priority) -> bool {
            false
        }
        fn suspended(&self) -> u64 {
            0
        }
        fn running(&self, g: u32) -> u32 {
            self.running[g as usize]
        }
        fn sigma(&self, g: u32) -> u32 {
            self.sigma[g as usize]
        }
        fn dispatch_shared(&mut self, _p: Priority) -> bool {
            false
        }
        fn dispatch(&mut self, g: u32, p: Priority, mode: Sigma) -> bool {
            let g = g as usize;
            if self.queued[g][p.index()] == 0
                || !crate::admission::admits(self.running[g], self.sigma[g], mode)
            {
                return false;
            }
            self.queued[g][p.index()] -= 1;
            self.taken.push((g as u32, p));
            true
        }
        fn lease_acquired(&mut self) {}
    }

    fn rules(tables: &PoolTables) -> Rules<'_> {
        Rules {
            tables,
            qos: QosLoops {
                high_loop_count: 2,
                medium_loop_count: 2,
            },
            lease_dispatches: 1,
        }
    }

    #[test]
    fn one_round_follows_figure_7_high_high_medium_high_high_medium_low() {
        let tables = PoolTables::all_groups(4, 1);
        let mut q = Recorder {
            queued: [[10, 10, 10], [0; 3], [0; 3], [0; 3]],
            sigma: [8; 4],
            running: [0; 4],
            taken: Vec::new(),
        };
        let mut s = PoolScheduler::new(0, 0);
        for _ in 0..7 {
            assert_eq!(
                s.next(&mut q, Policy::Dynamic, rules(&tables)),
                Step::Dispatched
            );
        }
        let order: Vec<Priority> = q.taken.iter().map(|t| t.1).collect();
        use Priority::{High as H, Low as L, Medium as M};
        assert_eq!(order, [H, H, M, H, H, M, L]);
        assert!(s.at_round_start());
    }

    #[test]
    fn a_round_that_finds_nothing_is_idle_and_the_next_starts_over() {
        let tables = PoolTables::all_groups(4, 1);
        let mut q = Recorder {
            queued: [[0, 0, 1], [0; 3], [0; 3], [0; 3]],
            sigma: [8; 4],
            running: [0; 4],
            taken: Vec::new(),
        };
        let mut s = PoolScheduler::new(0, 0);
        assert_eq!(
            s.next(&mut q, Policy::Dynamic, rules(&tables)),
            Step::Dispatched
        );
        assert_eq!(s.next(&mut q, Policy::Dynamic, rules(&tables)), Step::Idle);
        assert!(s.at_round_start());
        q.queued[1][0] = 1;
        assert_eq!(
            s.next(&mut q, Policy::Dynamic, rules(&tables)),
            Step::Dispatched
        );
        assert_eq!(q.taken, [(0, Priority::Low), (1, Priority::High)]);
    }

    #[test]
    fn dynamic_prefers_groups_under_sigma_then_the_fewest_running() {
        let tables = PoolTables::all_groups(4, 1);
        let mut q = Recorder {
            queued: [[5, 0, 0], [5, 0, 0], [5, 0, 0], [0; 3]],
            sigma: [1, 1, 4, 1],
            running: [3, 1, 4, 0],
            taken: Vec::new(),
        };
        let mut s = PoolScheduler::new(0, 0);
        // Every ready group is at or over sigma: group 1 runs the fewest.
        s.next(&mut q, Policy::Dynamic, rules(&tables));
        q.sigma[0] = 8;
        // Now group 0 is under sigma and wins despite running the most.
        s.next(&mut q, Policy::Dynamic, rules(&tables));
        assert_eq!(q.taken, [(1, Priority::High), (0, Priority::High)]);
    }

    #[test]
    fn static_never_dispatches_a_group_at_sigma_and_then_idles() {
        let mut tables = PoolTables::all_groups(4, 1);
        tables.pool_primary[0] = 0b0011;
        let mut q = Recorder {
            queued: [[5, 0, 0], [0, 0, 0], [5, 0, 0], [0; 3]],
            sigma: [1; 4],
            running: [1, 0, 0, 0],
            taken: Vec::new(),
        };
        let mut s = PoolScheduler::new(0, 0);
        assert_eq!(s.next(&mut q, Policy::Static, rules(&tables)), Step::Idle);
        assert!(!s.has_work(&q, Policy::Static, rules(&tables)));
        assert!(
            q.taken.is_empty(),
            "group 0 is at sigma, group 2 is not mapped here"
        );
    }

    #[test]
    fn round_robin_visits_every_ready_group_from_the_cursor() {
        assert_eq!(next_round_robin(0b1010, 0), 1);
        assert_eq!(next_round_robin(0b1010, 2), 3);
        assert_eq!(next_round_robin(0b1010, 4), 1);
        assert_eq!(next_round_robin(1 << 63, 64), 63);
    }
}
