//! Task traces: what the runtime's groups asked of the processors, recorded
//! from a real run and replayed by the [simulator](crate::sim).
//!
//! With [`RuntimeBuilder::trace_tasks`](crate::RuntimeBuilder::trace_tasks)
//! on, every task's service time (its body, clean-ups included, not the
//! fault emulation's holds) is recorded in a histogram per group and
//! priority. Memory is fixed (one histogram per group and priority, 2
//! significant digits); recording costs two clock reads and an uncontended
//! lock per task, and nothing when off.
//!
//! # File format
//!
//! Text, one record per line; `#` starts a comment line:
//!
//! ```text
//! # rebound task trace v1
//! group,priority,service_ns,count
//! cache,high,2300,15012
//! cache,high,2400,14870
//! device,low,41000,312
//! ```
//!
//! Each record is one histogram bucket: `count` tasks of `group` at
//! `priority` (`high`, `medium` or `low`) took about `service_ns`
//! nanoseconds. The header line is required; records of one group may come
//! in any order; a group's share of all counts is its share of the
//! dispatches (the arrival mix). Group names are those of the runtime
//! (`[A-Za-z0-9_.-]+`, at most 64 groups).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufRead, Write};

use hdrhistogram::Histogram;
use parking_lot::Mutex;

use crate::group::Priority;
use crate::limits::GROUPS_MAX;

/// The first line a trace file starts with.
pub const TRACE_MAGIC: &str = "# rebound task trace v1";
const HEADER: &str = "group,priority,service_ns,count";
/// Longest service time a trace records (longer ones are clamped): 10 s.
const SERVICE_NS_MAX: u64 = 10_000_000_000;

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, SERVICE_NS_MAX, 2).expect("static histogram bounds are valid")
}

/// The recorder a runtime holds while tracing: a histogram per group and
/// priority.
pub(crate) struct Recorder {
    names: Vec<String>,
    histograms: Vec<Mutex<[Histogram<u64>; Priority::COUNT]>>,
}

impl Recorder {
    pub(crate) fn new(names: Vec<String>) -> Self {
        let histograms = names
            .iter()
            .map(|_| Mutex::new(std::array::from_fn(|_| histogram())))
            .collect();
        Self { names, histograms }
    }

    #[inline]
    pub(crate) fn record(&self, group: usize, priority: Priority, ns: u64) {
        let ns = ns.clamp(1, SERVICE_NS_MAX);
        let _ = self.histograms[group].lock()[priority.index()].record(ns);
    }

    pub(crate) fn snapshot(&self) -> TaskTrace {
        let mut trace = TaskTrace::default();
        for (name, h) in self.names.iter().zip(&self.histograms) {
            let h = h.lock();
            for p in Priority::ALL {
                for v in h[p.index()].iter_recorded() {
                    let ns = h[p.index()].highest_equivalent(v.value_iterated_to());
                    trace.add(name, p, ns, v.count_at_value());
                }
            }
        }
        trace
    }
}

/// One group's part of a trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupTrace {
    /// Per priority: `(service_ns, count)` buckets, ascending.
    pub buckets: [Vec<(u64, u64)>; Priority::COUNT],
}

impl GroupTrace {
    /// Tasks recorded, all priorities.
    pub fn tasks(&self) -> u64 {
        self.buckets.iter().flatten().map(|b| b.1).sum()
    }

    /// Mean service time in nanoseconds (0 when empty).
    pub fn mean_service_ns(&self) -> f64 {
        let tasks = self.tasks();
        if tasks == 0 {
            return 0.0;
        }
        let sum: f64 = self
            .buckets
            .iter()
            .flatten()
            .map(|&(ns, n)| ns as f64 * n as f64)
            .sum();
        sum / tasks as f64
    }
}

/// A task trace: per group (by name, in first-seen order), the service
/// times of its tasks per priority.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskTrace {
    /// Groups in the order they were first seen.
    pub groups: Vec<(String, GroupTrace)>,
}

/// Why a trace file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    /// The first line is not [`TRACE_MAGIC`].
    #[error("not a rebound task trace: the first line must be {TRACE_MAGIC:?}")]
    Magic,
    /// A line is malformed.
    #[error("line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// No task in the trace.
    #[error("the trace records no task")]
    Empty,
}

impl TaskTrace {
    fn group_mut(&mut self, name: &str) -> Option<&mut GroupTrace> {
        if let Some(i) = self.groups.iter().position(|(n, _)| n == name) {
            return Some(&mut self.groups[i].1);
        }
        if self.groups.len() == GROUPS_MAX {
            return None;
        }
        self.groups.push((name.to_owned(), GroupTrace::default()));
        self.groups.last_mut().map(|g| &mut g.1)
    }

    /// Add `count` tasks of `group` at `priority` that took `service_ns`.
    /// Panics past [`GROUPS_MAX`] groups (the runtime cannot have more).
    pub fn add(&mut self, group: &str, priority: Priority, service_ns: u64, count: u64) {
        let g = self
            .group_mut(group)
            .expect("a trace holds at most GROUPS_MAX groups");
        let buckets = &mut g.buckets[priority.index()];
        match buckets.binary_search_by_key(&service_ns, |b| b.0) {
            Ok(i) => buckets[i].1 += count,
            Err(i) => buckets.insert(i, (service_ns, count)),
        }
    }

    /// Tasks recorded, all groups.
    pub fn tasks(&self) -> u64 {
        self.groups.iter().map(|g| g.1.tasks()).sum()
    }

    /// Write the trace in the format of the module doc.
    pub fn write_csv(&self, mut w: impl Write) -> std::io::Result<()> {
        writeln!(w, "{TRACE_MAGIC}")?;
        writeln!(w, "{HEADER}")?;
        for (name, g) in &self.groups {
            for p in Priority::ALL {
                for &(ns, count) in &g.buckets[p.index()] {
                    writeln!(w, "{name},{p},{ns},{count}")?;
                }
            }
        }
        w.flush()
    }

    /// Read a trace in the format of the module doc.
    pub fn read_csv(r: impl BufRead) -> Result<Self, TraceError> {
        let mut trace = TaskTrace::default();
        let mut lines = r.lines().enumerate();
        let first = lines.next().map(|(_, line)| line).transpose()?;
        if first.as_deref().map(str::trim_end) != Some(TRACE_MAGIC) {
            return Err(TraceError::Magic);
        }
        let mut header = false;
        for (i, line) in lines {
            let line = line?;
            let text = line.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let bad = |reason: String| TraceError::Line {
                line: i + 1,
                reason,
            };
            if !header {
                if text != HEADER {
                    return Err(bad(format!("expected the header {HEADER:?}")));
                }
                header = true;
                continue;
            }
            let (group, priority, ns, count) = parse_record(text).map_err(bad)?;
            trace
                .group_mut(group)
                .ok_or_else(|| bad(format!("more than {GROUPS_MAX} groups")))?;
            trace.add(group, priority, ns, count);
        }
        if trace.tasks() == 0 {
            return Err(TraceError::Empty);
        }
        Ok(trace)
    }

    /// Per group, tasks and mean service time (for reports).
    pub fn summary(&self) -> BTreeMap<String, (u64, f64)> {
        self.groups
            .iter()
            .map(|(n, g)| (n.clone(), (g.tasks(), g.mean_service_ns())))
            .collect()
    }
}

fn parse_record(text: &str) -> Result<(&str, Priority, u64, u64), String> {
    let fields: Vec<&str> = text.split(',').map(str::trim).collect();
    let [group, priority, ns, count] = fields[..] else {
        return Err(format!(
            "expected 4 comma-separated fields ({HEADER}), found {}",
            fields.len()
        ));
    };
    let valid_name = !group.is_empty()
        && group
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !valid_name {
        return Err(format!("bad group name {group:?}"));
    }
    let priority = match priority {
        "high" => Priority::High,
        "medium" => Priority::Medium,
        "low" => Priority::Low,
        other => return Err(format!("bad priority {other:?} (high, medium or low)")),
    };
    let ns: u64 = ns
        .parse()
        .ok()
        .filter(|&n| (1..=SERVICE_NS_MAX).contains(&n))
        .ok_or_else(|| format!("bad service_ns {ns:?} (1..={SERVICE_NS_MAX})"))?;
    let count: u64 = count
        .parse()
        .map_err(|_| format!("bad count {count:?} (a whole number)"))?;
    Ok((group, priority, ns, count))
}

impl fmt::Display for TaskTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (name, g) in &self.groups {
            writeln!(
                f,
                "{name}: {} tasks, mean {:.2} us",
                g.tasks(),
                g.mean_service_ns() / 1e3
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_survives_a_write_and_read_round_trip() {
        let mut t = TaskTrace::default();
        t.add("cache", Priority::High, 2300, 10);
        t.add("cache", Priority::High, 2300, 5);
        t.add("device", Priority::Low, 41_000, 3);
        let mut buf = Vec::new();
        t.write_csv(&mut buf).unwrap();
        let back = TaskTrace::read_csv(&buf[..]).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.groups[0].1.buckets[0], [(2300, 15)]);
        assert_eq!(back.tasks(), 18);
    }

    #[test]
    fn a_recorder_snapshot_keeps_each_group_and_priority_apart() {
        let r = Recorder::new(vec!["a".into(), "b".into()]);
        for _ in 0..100 {
            r.record(0, Priority::High, 1000);
        }
        r.record(1, Priority::Low, 50_000);
        let t = r.snapshot();
        assert_eq!(t.groups[0].1.tasks(), 100);
        assert!((t.groups[0].1.mean_service_ns() - 1000.0).abs() < 20.0);
        assert_eq!(t.groups[1].1.buckets[2].len(), 1);
        assert!(t.groups[1].1.buckets[0].is_empty());
    }

    #[test]
    fn malformed_traces_are_refused_with_the_line_and_reason() {
        let cases: [(&str, &str); 7] = [
            (
                "group,priority,service_ns,count\n",
                "not a rebound task trace",
            ),
            (
                "# rebound task trace v1\na,b,c\n",
                "line 2: expected the header",
            ),
            (
                "# rebound task trace v1\ngroup,priority,service_ns,count\ncache,urgent,10,1\n",
                "line 3: bad priority",
            ),
            (
                "# rebound task trace v1\ngroup,priority,service_ns,count\ncache,high,0,1\n",
                "bad service_ns",
            ),
            (
                "# rebound task trace v1\ngroup,priority,service_ns,count\ncache,high,10,-1\n",
                "bad count",
            ),
            (
                "# rebound task trace v1\ngroup,priority,service_ns,count\nca che,high,10,1\n",
                "bad group name",
            ),
            (
                "# rebound task trace v1\ngroup,priority,service_ns,count\n",
                "records no task",
            ),
        ];
        for (text, expected) in cases {
            let err = TaskTrace::read_csv(text.as_bytes())
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }
}
