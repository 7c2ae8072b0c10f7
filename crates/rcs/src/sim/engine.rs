//! The event loop of the simulator: a virtual clock, the pending events, the
//! job queues as plain data, and one [`PoolScheduler`] per virtual
//! processor making the runtime's decisions (see the [module doc](super)).
//!
//! Events, ordered by (time, sequence number) so runs are deterministic:
//!
//! - `Done`: a task's body ends on its processor (latency recorded, the
//!   client submits its next task); the processor then releases the task,
//!   or first holds it for the recovery time if a recovery of the task's
//!   group began while it ran.
//! - `Held`: a hold ends; the processor releases its task and asks for work.
//! - `RecoveryHeld`: a recovery leader's emulated recovery time ends; with
//!   reactive scheduling it waits for the group's other tasks to drain.
//! - `Trickle`: a light group's periodic task arrives.
//! - `Wake`: an idle processor that a submission woke asks for work.

use std::collections::VecDeque;

use hdrhistogram::Histogram;

use super::events::Events;
use super::{Clients, Invariants, SimConfig, SimReport};
use crate::admission::{Sigma, admits};
use crate::group::{Alternative, GroupSpec, Priority};
use crate::mapping::PoolTables;
use crate::policy::Policy;
use crate::pool::proportional_mapping;
use crate::scheduler::{JobQueues, PoolScheduler, Rules, Step};

/// A group whose weight is under this share gets a trickle, not clients.
const LIGHT_SHARE: f64 = 0.01;

#[derive(Debug, Clone)]
struct SimTask {
    id: u32,
    group: u8,
    priority: Priority,
    arrival: u64,
    service: u64,
    client: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Done,
    Held,
    RecoveryHeld,
    Trickle,
    Wake,
}

/// A task on a processor.
#[derive(Debug)]
struct Running {
    task: SimTask,
    /// The group's recovery epoch when the task started.
    epoch: u64,
    /// Dispatched while its group recovered (already held once).
    in_recovery: bool,
}

#[derive(Debug)]
struct GroupSim {
    sigma: u32,
    queues: [VecDeque<SimTask>; Priority::COUNT],
    head_since: [u64; Priority::COUNT],
    running: u32,
    epoch: u64,
    /// The recovery leader's processor, while a recovery runs.
    leader: Option<usize>,
    leader_waiting: bool,
}

/// Audit states of a task.
const QUEUED: u8 = 1;
const RUNNING: u8 = 2;
const DONE: u8 = 3;

#[derive(Debug, Default)]
struct Stats {
    completed: u64,
    dispatches: u64,
    dispatches_total: u64,
    per_group: Vec<u64>,
    recoveries: u64,
    held_ns: u64,
    busy_ns: u64,
    max_held: u32,
    max_head_wait: u64,
    events: u64,
    invariants: Invariants,
}

/// The world the schedulers see: queues, counts and the clock.
struct World<'a> {
    cfg: &'a SimConfig,
    reactive: bool,
    /// Groups whose sigma the policy enforces everywhere.
    enforced: u64,
    now: u64,
    measure_from: u64,
    seq: u64,
    /// One slot per processor, then one per group (its trickle, if light).
    events: Events<Ev>,
    /// The slot of the event being handled, until the handler schedules
    /// that slot again (or the loop empties it).
    handling: Option<usize>,
    groups: Vec<GroupSim>,
    ready: [u64; Priority::COUNT],
    shared: [VecDeque<SimTask>; Priority::COUNT],
    shared_head_since: [u64; Priority::COUNT],
    suspended: u64,
    recovering: u64,
    /// Groups running fewer tasks than their sigma, kept as `running`
    /// changes (see [`World::set_running`]).
    under_sigma: u64,
    running: Vec<Option<Running>>,
    /// Idle processors, one bit each.
    idle: Vec<u64>,
    /// Per group: processors that may dispatch it, one bit each.
    eligible: Vec<Vec<u64>>,
    /// The processor whose scheduler is choosing now: a dispatch starts
    /// the task it takes there (see [`World::ask`]).
    asking: usize,
    rng: fastrand::Rng,
    latency: Histogram<u64>,
    stats: Stats,
    audit: Vec<u8>,
    total_weight: f64,
    /// Per group, nanoseconds between two trickle tasks (light groups).
    trickle_period: Vec<u64>,
    /// Cumulative group weights, for drawing a group.
    cumulative: Vec<f64>,
}

/// Run one simulation.
pub fn simulate(cfg: &SimConfig) -> SimReport {
    let n_groups = cfg.workload.groups.len();
    assert!(
        (1..=crate::limits::GROUPS_MAX).contains(&n_groups),
        "1 to 64 groups"
    );
    assert!(cfg.cpus >= 1, "at least one processor");
    let (tables, sigma) = plan(cfg);
    let mut world = World::new(cfg, &tables, sigma);
    let mut scheds: Vec<PoolScheduler> = (0..cfg.cpus)
        .map(|c| PoolScheduler::new(c, c as u32))
        .collect();
    let rules = Rules {
        tables: &tables,
        qos: cfg.qos,
        lease_dispatches: cfg.lease_dispatches,
    };
    world.start_load();
    let end = world.measure_from + nanos(cfg.duration);
    while let Some((slot, t, _, ev)) = world.events.first() {
        if t > end {
            break;
        }
        world.now = t;
        world.stats.events += 1;
        world.handling = Some(slot);
        let who = world.who(slot, ev);
        match ev {
            Ev::Done => world.body_done(who, &mut scheds, rules),
            Ev::Held => world.release(who, &mut scheds, rules),
            Ev::RecoveryHeld => world.recovery_held(who, &mut scheds, rules),
            Ev::Trickle => world.trickle(who),
            Ev::Wake => world.ask(who, &mut scheds, rules),
        }
        if let Some(slot) = world.handling.take() {
            world.events.clear(slot);
        }
    }
    world.now = end;
    world.report()
}

/// A light group's trickle: its share of the dispatches the processors can
/// make when busy, as one task every this many nanoseconds.
fn trickle_periods(cfg: &SimConfig) -> Vec<u64> {
    let total: f64 = cfg.workload.groups.iter().map(|g| g.weight).sum();
    let per_dispatch = cfg.workload.mean_service_ns() + cfg.dispatch_ns as f64;
    cfg.workload
        .groups
        .iter()
        .map(|g| {
            let per_s = g.weight / total * cfg.cpus as f64 * 1e9 / per_dispatch.max(1.0);
            ((1e9 / per_s.max(1e-3)) as u64).max(1)
        })
        .collect()
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The static mapping, alternative mapping and sigma of `rebound bench
/// rcs`: proportional to weight; the two busiest groups isolated.
fn plan(cfg: &SimConfig) -> (PoolTables, Vec<u32>) {
    let weights: Vec<f64> = cfg.workload.groups.iter().map(|g| g.weight).collect();
    let total: f64 = weights.iter().sum();
    let mapping = proportional_mapping(&weights, cfg.cpus);
    let mut by_weight: Vec<usize> = (0..weights.len()).collect();
    by_weight.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let isolated = &by_weight[..by_weight.len().min(2)];
    let specs: Vec<GroupSpec> = cfg
        .workload
        .groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let spec = GroupSpec::new(g.name.clone()).pools(mapping[i].clone());
            if isolated.contains(&i) && weights.len() > 2 {
                spec.alternative(Alternative::Isolated)
            } else {
                spec
            }
        })
        .collect();
    let sigma = weights
        .iter()
        .map(|w| ((cfg.cpus as f64 * w / total).round() as u32).max(1))
        .collect();
    (PoolTables::new(&specs, cfg.cpus), sigma)
}

impl<'a> World<'a> {
    fn new(cfg: &'a SimConfig, tables: &PoolTables, sigma: Vec<u32>) -> Self {
        let words = cfg.cpus.div_ceil(64);
        let n_groups = cfg.workload.groups.len();
        let eligible = (0..n_groups)
            .map(|g| {
                let mut mask = vec![0u64; words];
                for c in 0..cfg.cpus {
                    if tables.pool_groups(cfg.policy, c).0 & (1u64 << g) != 0 {
                        mask[c / 64] |= 1u64 << (c % 64);
                    }
                }
                mask
            })
            .collect();
        let enforced = match cfg.policy {
            Policy::Static => u64::MAX,
            Policy::Partial => tables.strict,
            Policy::Performance | Policy::Dynamic => 0,
        };
        let mut idle = vec![0u64; words];
        for c in 0..cfg.cpus {
            idle[c / 64] |= 1u64 << (c % 64);
        }
        World {
            cfg,
            reactive: cfg.reactive && cfg.policy != Policy::Performance,
            enforced,
            now: 0,
            measure_from: nanos(cfg.warmup),
            seq: 0,
            events: Events::new(cfg.cpus + n_groups, Ev::Wake),
            handling: None,
            groups: sigma
                .into_iter()
                .map(|sigma| GroupSim {
                    sigma,
                    queues: Default::default(),
                    head_since: [0; Priority::COUNT],
                    running: 0,
                    epoch: 0,
                    leader: None,
                    leader_waiting: false,
                })
                .collect(),
            ready: [0; Priority::COUNT],
            shared: Default::default(),
            shared_head_since: [0; Priority::COUNT],
            suspended: 0,
            recovering: 0,
            // Nothing runs yet, and every sigma is at least 1.
            under_sigma: u64::MAX >> (64 - n_groups),
            running: (0..cfg.cpus).map(|_| None).collect(),
            idle,
            eligible,
            asking: 0,
            rng: fastrand::Rng::with_seed(cfg.seed),
            latency: Histogram::new_with_bounds(1, 3_600_000_000_000, 2)
                .expect("static histogram bounds are valid"),
            stats: Stats {
                per_group: vec![0; n_groups],
                ..Stats::default()
            },
            audit: Vec::new(),
            total_weight: cfg.workload.groups.iter().map(|g| g.weight).sum(),
            trickle_period: trickle_periods(cfg),
            cumulative: cfg
                .workload
                .groups
                .iter()
                .scan(0.0, |acc, g| {
                    *acc += g.weight;
                    Some(*acc)
                })
                .collect(),
        }
    }

    /// The event slot of processor `who`, or of group `who`'s trickle.
    #[inline]
    fn slot(&self, who: usize, ev: Ev) -> usize {
        if ev == Ev::Trickle {
            self.cfg.cpus + who
        } else {
            who
        }
    }

    /// The processor (or the trickle's group) an event slot belongs to.
    #[inline]
    fn who(&self, slot: usize, ev: Ev) -> usize {
        if ev == Ev::Trickle {
            slot - self.cfg.cpus
        } else {
            slot
        }
    }

    /// Schedule `ev` for processor `who` (for group `who` if a trickle).
    fn schedule(&mut self, at: u64, who: usize, ev: Ev) {
        self.seq += 1;
        let slot = self.slot(who, ev);
        if self.handling == Some(slot) {
            // The event being handled is replaced, not kept.
            self.handling = None;
            self.events.replace(slot, at, self.seq, ev);
        } else {
            self.events.set(slot, at, self.seq, ev);
        }
    }

    #[inline]
    fn measuring(&self) -> bool {
        self.now >= self.measure_from
    }

    /// The clients' first tasks and the light groups' trickles.
    fn start_load(&mut self) {
        let weights: Vec<f64> = self.cfg.workload.groups.iter().map(|g| g.weight).collect();
        let total: f64 = weights.iter().sum();
        let heavy: f64 = weights.iter().filter(|&&w| w / total >= LIGHT_SHARE).sum();
        let clients = self.cfg.clients_per_cpu * self.cfg.cpus;
        if self.cfg.clients == Clients::Roaming {
            for _ in 0..clients {
                let g = self.draw_group();
                let task = self.new_task(g, true);
                self.submit(task, None);
            }
            return;
        }
        for (g, &w) in weights.iter().enumerate() {
            if w / total < LIGHT_SHARE {
                let offset = (self.trickle_period[g] as f64 * self.rng.f64()) as u64;
                self.schedule(offset, g, Ev::Trickle);
                continue;
            }
            let n = ((clients as f64 * w / heavy).round() as usize).max(1);
            for _ in 0..n {
                let task = self.new_task(g, true);
                self.submit(task, None);
            }
        }
    }

    fn new_task(&mut self, g: usize, client: bool) -> SimTask {
        let (priority, service) = self.cfg.workload.groups[g].sample(&mut self.rng);
        let id = if self.cfg.audit {
            self.audit.push(QUEUED);
            u32::try_from(self.audit.len() - 1).expect("audit runs are short")
        } else {
            0
        };
        SimTask {
            id,
            group: g as u8,
            priority,
            arrival: self.now,
            service,
            client,
        }
    }

    fn audit(&mut self, id: u32, from: u8, to: u8) {
        if self.cfg.audit {
            let state = &mut self.audit[id as usize];
            if *state != from {
                self.stats.invariants.audit_errors += 1;
            }
            *state = to;
        }
    }

    fn trickle(&mut self, g: usize) {
        let task = self.new_task(g, false);
        self.submit(task, None);
        self.schedule(self.now + self.trickle_period[g], g, Ev::Trickle);
    }

    /// A group drawn by weight (roaming clients).
    fn draw_group(&mut self) -> usize {
        let x = self.rng.f64() * self.total_weight;
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.cumulative.len() - 1)
    }

    #[inline]
    fn is_eligible(&self, g: usize, cpu: usize) -> bool {
        self.eligible[g][cpu / 64] & (1u64 << (cpu % 64)) != 0
    }

    /// Queue a task, and wake an idle eligible processor as the runtime's
    /// `submit_task` does.
    fn submit(&mut self, task: SimTask, submitter: Option<usize>) {
        let g = usize::from(task.group);
        let p = task.priority.index();
        let queue = if self.cfg.policy == Policy::Performance {
            if self.shared[p].is_empty() {
                self.shared_head_since[p] = self.now;
            }
            &mut self.shared[p]
        } else {
            let group = &mut self.groups[g];
            if group.queues[p].is_empty() {
                group.head_since[p] = self.now;
            }
            self.ready[p] |= 1u64 << g;
            &mut group.queues[p]
        };
        let was_set = !queue.is_empty();
        queue.push_back(task);
        let runs_it_later = submitter.is_some_and(|c| self.is_eligible(g, c));
        if was_set || !runs_it_later {
            self.wake_one(g);
        }
    }

    fn wake_one(&mut self, g: usize) {
        for w in 0..self.idle.len() {
            let m = self.idle[w] & self.eligible[g][w];
            if m != 0 {
                let cpu = w * 64 + m.trailing_zeros() as usize;
                self.idle[w] &= !(1u64 << (cpu % 64));
                self.schedule(self.now + self.cfg.wake_ns, cpu, Ev::Wake);
                return;
            }
        }
    }

    fn wake_all(&mut self, g: usize) {
        for w in 0..self.idle.len() {
            let mut m = self.idle[w] & self.eligible[g][w];
            self.idle[w] &= !m;
            while m != 0 {
                let cpu = w * 64 + m.trailing_zeros() as usize;
                m &= m - 1;
                self.schedule(self.now + self.cfg.wake_ns, cpu, Ev::Wake);
            }
        }
    }

    /// Processor `cpu` asks its scheduler for work.
    fn ask(&mut self, cpu: usize, scheds: &mut [PoolScheduler], rules: Rules<'_>) {
        debug_assert!(self.running[cpu].is_none());
        let policy = self.cfg.policy;
        // A dispatch starts its task on `cpu` itself: the task goes from its
        // queue to the processor without a stop between.
        self.asking = cpu;
        for _ in 0..2 {
            if scheds[cpu].next(self, policy, rules) == Step::Dispatched {
                debug_assert!(self.running[cpu].is_some(), "a dispatch starts a task");
                return;
            }
            if !scheds[cpu].has_work(self, policy, rules) {
                self.idle[cpu / 64] |= 1u64 << (cpu % 64);
                return;
            }
        }
        self.stats.invariants.idle_with_work += 1;
        self.idle[cpu / 64] |= 1u64 << (cpu % 64);
    }

    /// A dispatched task starts on `cpu` (fault emulation as
    /// [`crate::execute`]).
    fn start(&mut self, cpu: usize, task: SimTask) {
        let g = usize::from(task.group);
        let bit = 1u64 << g;
        self.audit(task.id, QUEUED, RUNNING);
        let measuring = self.measuring();
        self.stats.dispatches_total += 1;
        if measuring {
            self.stats.dispatches += 1;
            self.stats.per_group[g] += 1;
        }
        let fault = self.cfg.fault.filter(|f| f.group == g);
        let recovery = fault.map_or(0, |f| nanos(f.recovery));
        let mut until = self.now + self.cfg.dispatch_ns;
        let in_recovery = fault.is_some() && self.recovering & bit != 0;
        if in_recovery {
            until += recovery;
            self.hold(recovery);
        }
        if self.recovering & bit != 0 {
            self.stats.max_held = self.stats.max_held.max(self.groups[g].running);
        }
        let injected = fault.is_some_and(|f| self.rng.f64() < f.rate);
        let epoch = self.groups[g].epoch;
        if injected {
            // The body is dropped unrun; its client redrives it.
            self.audit(task.id, RUNNING, QUEUED);
            let again = task.clone();
            self.running[cpu] = Some(Running {
                task,
                epoch,
                in_recovery: true,
            });
            self.submit(again, None);
            if self.recovering & bit != 0 {
                self.busy(until);
                self.schedule(until, cpu, Ev::Held);
            } else {
                self.begin_recovery(g, cpu);
                self.hold(recovery);
                self.busy(until + recovery);
                self.schedule(until + recovery, cpu, Ev::RecoveryHeld);
            }
            return;
        }
        let done = until + task.service;
        self.busy(done);
        self.running[cpu] = Some(Running {
            task,
            epoch,
            in_recovery,
        });
        self.schedule(done, cpu, Ev::Done);
    }

    /// Count processor time from now until `until` as busy.
    fn busy(&mut self, until: u64) {
        if self.measuring() {
            self.stats.busy_ns += until - self.now;
        }
    }

    fn hold(&mut self, ns: u64) {
        if self.measuring() {
            self.stats.held_ns += ns;
        }
    }

    fn begin_recovery(&mut self, g: usize, leader: usize) {
        let bit = 1u64 << g;
        self.recovering |= bit;
        if self.reactive {
            self.suspended |= bit;
        }
        let group = &mut self.groups[g];
        group.epoch += 1;
        group.leader = Some(leader);
        self.stats.max_held = self.stats.max_held.max(group.running);
        if self.measuring() {
            self.stats.recoveries += 1;
        }
    }

    /// A task's body ended on `cpu`.
    fn body_done(&mut self, cpu: usize, scheds: &mut [PoolScheduler], rules: Rules<'_>) {
        // The task stays on its processor until released.
        let r = self.running[cpu].as_ref().expect("a Done event has a task");
        let g = usize::from(r.task.group);
        let (id, arrival, client) = (r.task.id, r.task.arrival, r.task.client);
        // Held once already if it was dispatched during a recovery.
        let hold = !r.in_recovery && self.groups[g].epoch != r.epoch;
        if self.measuring() {
            self.stats.completed += 1;
            let _ = self.latency.record((self.now - arrival).max(1));
        }
        self.audit(id, RUNNING, DONE);
        if client {
            let next_group = match self.cfg.clients {
                Clients::Bound => g,
                Clients::Roaming => self.draw_group(),
            };
            let next = self.new_task(next_group, true);
            self.submit(next, Some(cpu));
        }
        let fault = self.cfg.fault.filter(|f| f.group == g);
        if let Some(f) = fault
            && hold
        {
            // A recovery of its group began while it ran: it takes the
            // recovery time too.
            let d = nanos(f.recovery);
            self.hold(d);
            self.busy(self.now + d);
            self.schedule(self.now + d, cpu, Ev::Held);
            return;
        }
        self.release(cpu, scheds, rules);
    }

    /// The task on `cpu` leaves it (admission released); `cpu` asks for work.
    fn release(&mut self, cpu: usize, scheds: &mut [PoolScheduler], rules: Rules<'_>) {
        let r = self.running[cpu]
            .take()
            .expect("a released processor had a task");
        let g = usize::from(r.task.group);
        debug_assert!(self.groups[g].running > 0);
        self.set_running(g, self.groups[g].running - 1);
        if self.groups[g].leader_waiting && self.groups[g].running <= 1 {
            self.end_recovery(g, scheds, rules);
        }
        self.ask(cpu, scheds, rules);
    }

    /// The leader's recovery time is spent.
    fn recovery_held(&mut self, cpu: usize, scheds: &mut [PoolScheduler], rules: Rules<'_>) {
        let g = usize::from(
            self.running[cpu]
                .as_ref()
                .expect("a recovery leader holds its task")
                .task
                .group,
        );
        if self.reactive && self.groups[g].running > 1 {
            // Wait for the group's other running tasks to drain.
            self.groups[g].leader_waiting = true;
            return;
        }
        self.end_recovery(g, scheds, rules);
    }

    fn end_recovery(&mut self, g: usize, scheds: &mut [PoolScheduler], rules: Rules<'_>) {
        let bit = 1u64 << g;
        let group = &mut self.groups[g];
        let leader = group.leader.take().expect("a recovery has a leader");
        group.leader_waiting = false;
        for p in 0..Priority::COUNT {
            group.head_since[p] = self.now;
        }
        self.shared_head_since = [self.now; Priority::COUNT];
        self.recovering &= !bit;
        self.suspended &= !bit;
        self.wake_all(g);
        // The leader's own task is released last, as `execute` does.
        self.release(leader, scheds, rules);
    }

    fn report(&self) -> SimReport {
        let seconds = self.cfg.duration.as_secs_f64();
        let recovery_ns = self.cfg.fault.map_or(0, |f| nanos(f.recovery));
        let mut invariants = self.stats.invariants.clone();
        if self.cfg.audit {
            invariants.audit_errors += self.audit.iter().filter(|&&s| s == 0).count() as u64;
        }
        SimReport {
            tasks_per_s: self.stats.completed as f64 / seconds,
            mean_latency_us: self.latency.mean() / 1e3,
            p99_latency_us: self.latency.value_at_quantile(0.99) as f64 / 1e3,
            dispatches_per_s: self.stats.dispatches as f64 / seconds,
            dispatches_per_group: self.stats.per_group.clone(),
            recoveries: self.stats.recoveries,
            held_per_recovery: if self.stats.recoveries == 0 || recovery_ns == 0 {
                0.0
            } else {
                self.stats.held_ns as f64 / (self.stats.recoveries as f64 * recovery_ns as f64)
            },
            max_held_in_recovery: self.stats.max_held,
            utilization: self.stats.busy_ns as f64 / (seconds * 1e9 * self.cfg.cpus as f64),
            max_head_wait_us: self.stats.max_head_wait as f64 / 1e3,
            dispatches_total: self.stats.dispatches_total,
            events: self.stats.events,
            invariants,
        }
    }

    /// Group `g` now runs `n` tasks.
    #[inline]
    fn set_running(&mut self, g: usize, n: u32) {
        let group = &mut self.groups[g];
        group.running = n;
        let bit = 1u64 << g;
        if n < group.sigma {
            self.under_sigma |= bit;
        } else {
            self.under_sigma &= !bit;
        }
    }

    fn head_wait(&mut self, since: u64) {
        self.stats.max_head_wait = self.stats.max_head_wait.max(self.now - since);
    }
}

impl JobQueues for World<'_> {
    #[inline]
    fn ready(&self, p: Priority) -> u64 {
        self.ready[p.index()]
    }

    #[inline]
    fn shared_ready(&self, p: Priority) -> bool {
        !self.shared[p.index()].is_empty()
    }

    #[inline]
    fn suspended(&self) -> u64 {
        self.suspended
    }

    #[inline]
    fn running(&self, g: u32) -> u32 {
        self.groups[g as usize].running
    }

    #[inline]
    fn sigma(&self, g: u32) -> u32 {
        self.groups[g as usize].sigma
    }

    #[inline]
    fn under_sigma(&self, mask: u64) -> u64 {
        debug_assert_eq!(
            self.under_sigma & mask,
            (0..64)
                .filter(|&g| mask & (1u64 << g) != 0)
                .filter(|&g| self.running(g) < self.sigma(g))
                .fold(0, |m, g| m | 1u64 << g),
        );
        self.under_sigma & mask
    }

    fn dispatch_shared(&mut self, p: Priority) -> bool {
        let p = p.index();
        let Some(task) = self.shared[p].pop_front() else {
            return false;
        };
        self.head_wait(self.shared_head_since[p]);
        self.shared_head_since[p] = self.now;
        let g = usize::from(task.group);
        self.set_running(g, self.groups[g].running + 1);
        self.start(self.asking, task);
        true
    }

    fn dispatch(&mut self, g: u32, p: Priority, mode: Sigma) -> bool {
        let bit = 1u64 << g;
        let gi = g as usize;
        let pi = p.index();
        let group = &self.groups[gi];
        if group.queues[pi].is_empty() {
            self.ready[pi] &= !bit;
            return false;
        }
        if !admits(group.running, group.sigma, mode) {
            return false;
        }
        if self.reactive && self.suspended & bit != 0 {
            // The reactive fence; the scans filter suspended groups first,
            // so reaching it means a scan did not.
            self.stats.invariants.dispatched_while_suspended += 1;
            return false;
        }
        let since = group.head_since[pi];
        self.head_wait(since);
        let group = &mut self.groups[gi];
        let task = group.queues[pi].pop_front().expect("checked non-empty");
        group.head_since[pi] = self.now;
        if group.queues[pi].is_empty() {
            self.ready[pi] &= !bit;
        }
        self.set_running(gi, self.groups[gi].running + 1);
        let group = &self.groups[gi];
        if self.enforced & bit != 0 && group.running > group.sigma {
            self.stats.invariants.sigma_exceeded += 1;
        }
        self.start(self.asking, task);
        true
    }

    fn lease_acquired(&mut self) {}
}
