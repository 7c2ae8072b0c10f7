//! Implicit dependencies and recovery-scope refinement (paper §3.1, Figure 3).
//!
//! "One approach to identifying implicit dependencies at runtime is by
//! observing patterns of hardware and software lock acquisitions. We can group
//! the tasks that share locks into the same recovery scope [...]. Tasks T1, T2
//! and T4 are accessing overlapping sets of locks during their execution and
//! thus are grouped into one recovery scope. Similarly, tasks T3 and T5 are
//! grouped into another recovery scope."
//!
//! Observations are `(task kind, explicit group, lock)`. [`refine`] joins the
//! task kinds that share a lock (union-find, transitively) and splits the
//! developer-specified groups along those components: each proposed scope is
//! the set of kinds of one explicit group that are connected through locks.
//! Locks shared across explicit groups are reported separately as
//! cross-group dependencies (the paper: "some dependencies may have been
//! overlooked"), for the developer to merge groups or accept the risk; the
//! proposal never merges explicit groups by itself.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use parking_lot::Mutex;

use crate::group::GroupId;
use crate::limits::OBSERVATIONS_MAX;

/// A proposed recovery scope: kinds of one explicit group connected by locks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefinedScope<K> {
    /// The explicit group the scope refines.
    pub group: GroupId,
    /// Its task kinds, sorted.
    pub kinds: Vec<K>,
    /// The locks they share or use, sorted.
    pub locks: Vec<u64>,
}

/// A lock used by tasks of more than one explicit group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrossGroupDependency<K> {
    /// The lock.
    pub lock: u64,
    /// The `(group, kind)` pairs that used it, sorted.
    pub users: Vec<(GroupId, K)>,
}

/// The proposal computed from observations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refinement<K> {
    /// Proposed scopes, sorted by group then first kind.
    pub scopes: Vec<RefinedScope<K>>,
    /// Locks shared across explicit groups, sorted by lock.
    pub cross_group: Vec<CrossGroupDependency<K>>,
}

/// Union-find over dense node indices.
struct DisjointSets {
    parent: Vec<usize>,
}

impl DisjointSets {
    fn new(n: usize) -> Self {
        Self {
            parent: (0..n).collect(),
        }
    }

    fn find(&mut self, mut x: usize) -> usize {
        while self.parent[x] != x {
            self.parent[x] = self.parent[self.parent[x]];
            x = self.parent[x];
        }
        x
    }

    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            self.parent[ra.max(rb)] = ra.min(rb);
        }
    }
}

/// Compute the refinement from `(kind, group, lock)` observations.
pub fn refine<K: Ord + Clone>(
    observations: impl IntoIterator<Item = (K, GroupId, u64)>,
) -> Refinement<K> {
    // Nodes are (group, kind): the same kind submitted to two groups is two
    // tasks as far as recovery scopes go.
    let mut locks_of: BTreeMap<(GroupId, K), BTreeSet<u64>> = BTreeMap::new();
    let mut users_of: BTreeMap<u64, BTreeSet<(GroupId, K)>> = BTreeMap::new();
    for (kind, group, lock) in observations {
        locks_of
            .entry((group, kind.clone()))
            .or_default()
            .insert(lock);
        users_of.entry(lock).or_default().insert((group, kind));
    }
    let nodes: Vec<(GroupId, K)> = locks_of.keys().cloned().collect();
    let index: BTreeMap<&(GroupId, K), usize> =
        nodes.iter().enumerate().map(|(i, n)| (n, i)).collect();
    let mut sets = DisjointSets::new(nodes.len());
    for users in users_of.values() {
        let mut it = users.iter().map(|u| index[u]);
        if let Some(first) = it.next() {
            for other in it {
                sets.union(first, other);
            }
        }
    }
    // A scope is (component, explicit group).
    let mut scopes: BTreeMap<(GroupId, usize), (BTreeSet<K>, BTreeSet<u64>)> = BTreeMap::new();
    for (i, node) in nodes.iter().enumerate() {
        let root = sets.find(i);
        let entry = scopes.entry((node.0, root)).or_default();
        entry.0.insert(node.1.clone());
        entry.1.extend(locks_of[node].iter().copied());
    }
    let mut scopes: Vec<RefinedScope<K>> = scopes
        .into_iter()
        .map(|((group, _), (kinds, locks))| RefinedScope {
            group,
            kinds: kinds.into_iter().collect(),
            locks: locks.into_iter().collect(),
        })
        .collect();
    scopes.sort_by(|a, b| (a.group, &a.kinds).cmp(&(b.group, &b.kinds)));
    let cross_group = users_of
        .into_iter()
        .filter(|(_, users)| {
            let groups: BTreeSet<GroupId> = users.iter().map(|(g, _)| *g).collect();
            groups.len() > 1
        })
        .map(|(lock, users)| CrossGroupDependency {
            lock,
            users: users.into_iter().collect(),
        })
        .collect();
    Refinement {
        scopes,
        cross_group,
    }
}

/// The runtime's observation store (bounded; observations beyond
/// [`OBSERVATIONS_MAX`] distinct ones are counted and dropped).
#[derive(Debug, Default)]
pub(crate) struct DependencyTracker {
    seen: Mutex<HashSet<(&'static str, GroupId, u64)>>,
    dropped: std::sync::atomic::AtomicU64,
}

impl DependencyTracker {
    pub(crate) fn observe(&self, kind: &'static str, group: GroupId, lock: u64) {
        let mut seen = self.seen.lock();
        if seen.len() >= OBSERVATIONS_MAX && !seen.contains(&(kind, group, lock)) {
            self.dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        }
        seen.insert((kind, group, lock));
    }

    pub(crate) fn refinement(&self) -> Refinement<&'static str> {
        let seen: Vec<_> = self.seen.lock().iter().copied().collect();
        refine(seen)
    }
}
