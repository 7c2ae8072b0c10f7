//! Workloads for the simulator: which groups ask for processors, how often,
//! at which priority, and for how long.
//!
//! Two sources:
//!
//! - [`Workload::from_trace`]: a [task trace](crate::trace) recorded from
//!   the real controller (`rebound serve --trace-tasks FILE` under fio's
//!   cache-standard job). A group's share of the dispatches is its share of
//!   the trace's tasks; a task's priority and service time are drawn from
//!   the group's recorded histogram.
//! - [`Workload::figure9`]: the synthetic load of `rebound bench rcs`, the
//!   paper's Figure 9 skew over 16 groups (groups 4 and 5 carry most of the
//!   tasks, eight almost none), every task the same length, medium priority.
//!
//! [`Workload::collapse`] merges groups into fewer, larger ones, as the
//! paper does for Figure 10 ("by collapsing multiple groups into a single
//! larger group").

use std::sync::Arc;
use std::time::Duration;

use crate::group::Priority;
use crate::trace::TaskTrace;

/// Figure 9's skew: tasks per minute, relative (group 5 is the faulty one).
pub const FIGURE9: [(&str, f64); 16] = [
    ("g1", 1.2),
    ("g2", 0.9),
    ("g3", 0.8),
    ("g4", 6.5),
    ("g5", 5.0),
    ("g6", 0.6),
    ("g7", 0.5),
    ("g8", 0.4),
    ("g9", 0.02),
    ("g10", 0.02),
    ("g11", 0.02),
    ("g12", 0.02),
    ("g13", 0.02),
    ("g14", 0.02),
    ("g15", 0.02),
    ("g16", 0.02),
];

/// One source of tasks inside a (possibly merged) group: a share of the
/// group's tasks with its own priority mix and service times.
#[derive(Debug, Clone)]
struct Part {
    weight: f64,
    /// Per priority: `(service_ns, cumulative count)`, ascending.
    buckets: [Arc<[(u64, u64)]>; Priority::COUNT],
    /// Tasks per priority.
    per_priority: [u64; Priority::COUNT],
}

impl Part {
    fn tasks(&self) -> u64 {
        self.per_priority.iter().sum()
    }

    fn sample(&self, rng: &mut fastrand::Rng) -> (Priority, u64) {
        let mut pick = rng.u64(..self.tasks());
        for p in Priority::ALL {
            let n = self.per_priority[p.index()];
            if pick < n {
                let b = &self.buckets[p.index()];
                if let [(only, _)] = b[..] {
                    // One service time (the synthetic workloads).
                    return (p, only);
                }
                let i = b.partition_point(|&(_, cum)| cum <= pick);
                return (p, b[i].0);
            }
            pick -= n;
        }
        unreachable!("pick < tasks()")
    }

    fn mean_ns(&self) -> f64 {
        let mut sum = 0.0;
        for b in &self.buckets {
            let mut prev = 0;
            for &(ns, cum) in b.iter() {
                sum += ns as f64 * (cum - prev) as f64;
                prev = cum;
            }
        }
        sum / self.tasks().max(1) as f64
    }
}

/// One recovery group of a workload.
#[derive(Debug, Clone)]
pub struct WorkloadGroup {
    /// Its name.
    pub name: String,
    /// Its share of all dispatches (relative).
    pub weight: f64,
    parts: Vec<Part>,
}

impl WorkloadGroup {
    /// Draw a task: its priority and service time in nanoseconds.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> (Priority, u64) {
        if self.parts.len() == 1 {
            return self.parts[0].sample(rng);
        }
        // The group's weight is its parts' weights summed (see `collapse`).
        let mut x = rng.f64() * self.weight;
        for part in &self.parts {
            if x < part.weight {
                return part.sample(rng);
            }
            x -= part.weight;
        }
        self.parts[self.parts.len() - 1].sample(rng)
    }

    /// Mean service time in nanoseconds.
    pub fn mean_service_ns(&self) -> f64 {
        let total: f64 = self.parts.iter().map(|p| p.weight).sum();
        self.parts
            .iter()
            .map(|p| p.weight / total * p.mean_ns())
            .sum()
    }
}

/// The groups of a workload and where it came from.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Where the workload came from (for reports).
    pub source: String,
    /// The groups, in order.
    pub groups: Vec<WorkloadGroup>,
    /// The group the paper's fault model faults by default: the paper
    /// faults group 5, its second-busiest.
    pub faulty: usize,
}

impl Workload {
    /// The paper's Figure 9 skew over 16 groups, every task `task` long,
    /// medium priority (the load of `rebound bench rcs`).
    pub fn figure9(task: Duration) -> Self {
        let ns = u64::try_from(task.as_nanos()).unwrap_or(u64::MAX).max(1);
        let groups = FIGURE9
            .iter()
            .map(|&(name, weight)| WorkloadGroup {
                name: name.to_owned(),
                weight,
                parts: vec![Part {
                    weight,
                    buckets: [
                        Arc::from(Vec::new()),
                        Arc::from(vec![(ns, 1)]),
                        Arc::from(Vec::new()),
                    ],
                    per_priority: [0, 1, 0],
                }],
            })
            .collect();
        Workload {
            source: format!("figure 9 skew, {} us tasks", ns as f64 / 1e3),
            groups,
            faulty: 4,
        }
    }

    /// The workload a task trace recorded. Groups with no task are left out.
    pub fn from_trace(trace: &TaskTrace, source: impl Into<String>) -> Self {
        let groups: Vec<WorkloadGroup> = trace
            .groups
            .iter()
            .filter(|(_, g)| g.tasks() > 0)
            .map(|(name, g)| {
                let buckets = g.buckets.clone().map(|b| {
                    let mut cum = 0;
                    let v: Vec<(u64, u64)> = b
                        .iter()
                        .map(|&(ns, n)| {
                            cum += n;
                            (ns, cum)
                        })
                        .collect();
                    Arc::from(v)
                });
                let per_priority = g.buckets.clone().map(|b| b.iter().map(|x| x.1).sum());
                let weight = g.tasks() as f64;
                WorkloadGroup {
                    name: name.clone(),
                    weight,
                    parts: vec![Part {
                        weight,
                        buckets,
                        per_priority,
                    }],
                }
            })
            .collect();
        let mut by_weight: Vec<usize> = (0..groups.len()).collect();
        by_weight.sort_by(|&a, &b| groups[b].weight.total_cmp(&groups[a].weight));
        let faulty = by_weight.get(1).or(by_weight.first()).copied().unwrap_or(0);
        Workload {
            source: source.into(),
            groups,
            faulty,
        }
    }

    /// Merge the groups into `n` larger ones (contiguous runs of groups, as
    /// even as possible); the faulty group becomes the one that holds it.
    /// `n` at least the group count changes nothing.
    pub fn collapse(&self, n: usize) -> Self {
        let len = self.groups.len();
        if n == 0 || n >= len {
            return self.clone();
        }
        let target = |i: usize| i * n / len;
        let mut groups: Vec<WorkloadGroup> = (0..n)
            .map(|_| WorkloadGroup {
                name: String::new(),
                weight: 0.0,
                parts: Vec::new(),
            })
            .collect();
        for (i, g) in self.groups.iter().enumerate() {
            let merged = &mut groups[target(i)];
            if !merged.name.is_empty() {
                merged.name.push('+');
            }
            merged.name.push_str(&g.name);
            merged.weight += g.weight;
            merged.parts.extend(g.parts.iter().cloned());
        }
        Workload {
            source: format!("{} collapsed to {n} groups", self.source),
            groups,
            faulty: target(self.faulty),
        }
    }

    /// Mean service time over all dispatches, in nanoseconds.
    pub fn mean_service_ns(&self) -> f64 {
        let total: f64 = self.groups.iter().map(|g| g.weight).sum();
        self.groups
            .iter()
            .map(|g| g.weight / total * g.mean_service_ns())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figure9_faults_group_5_and_collapsing_keeps_it_faulty() {
        let w = Workload::figure9(Duration::from_micros(3));
        assert_eq!(w.groups.len(), 16);
        assert_eq!(w.groups[w.faulty].name, "g5");
        let four = w.collapse(4);
        assert_eq!(four.groups.len(), 4);
        assert_eq!(four.faulty, 1);
        assert!(four.groups[1].name.contains("g5"));
        let total: f64 = four.groups.iter().map(|g| g.weight).sum();
        let orig: f64 = w.groups.iter().map(|g| g.weight).sum();
        assert!((total - orig).abs() < 1e-9);
        assert_eq!(w.collapse(1).groups.len(), 1);
    }

    #[test]
    fn a_trace_workload_samples_what_was_recorded() {
        let mut t = TaskTrace::default();
        t.add("host", Priority::High, 1000, 300);
        t.add("cache", Priority::Medium, 5000, 100);
        t.add("cache", Priority::Low, 9000, 100);
        t.add("device", Priority::Low, 20_000, 10);
        let w = Workload::from_trace(&t, "test");
        assert_eq!(w.groups[w.faulty].name, "cache", "second-busiest");
        let mut rng = fastrand::Rng::with_seed(1);
        let mut lows = 0;
        for _ in 0..1000 {
            let (p, ns) = w.groups[1].sample(&mut rng);
            match p {
                Priority::Medium => assert_eq!(ns, 5000),
                Priority::Low => {
                    assert_eq!(ns, 9000);
                    lows += 1;
                }
                Priority::High => panic!("cache recorded no high task"),
            }
        }
        assert!((400..600).contains(&lows), "{lows}");
        assert!((w.groups[1].mean_service_ns() - 7000.0).abs() < 1.0);
    }
}
