//! Implicit-dependency refinement (§3.1, Figure 3).

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use rcs::refine::refine;
use rcs::{GroupSpec, Priority, Runtime};

fn gid(n: usize) -> rcs::GroupId {
    let mut b = Runtime::builder();
    (0..=n)
        .map(|i| b.group(GroupSpec::new(format!("g{i}"))))
        .last()
        .unwrap()
}

/// Figure 3: five tasks of one developer-specified scope; T1, T2 and T4
/// share locks, T3 and T5 share locks: two refined scopes.
#[test]
fn figure_3_tasks_sharing_locks_share_a_scope() {
    let g = gid(0);
    let (l1, l2, l3, l4, l5) = (1, 2, 3, 4, 5);
    let obs = [
        ("T1", g, l1),
        ("T1", g, l2),
        ("T2", g, l2),
        ("T2", g, l3),
        ("T3", g, l4),
        ("T4", g, l3),
        ("T4", g, l1),
        ("T5", g, l4),
        ("T5", g, l5),
    ];
    let r = refine(obs);
    let scopes: Vec<Vec<&str>> = r.scopes.iter().map(|s| s.kinds.clone()).collect();
    assert_eq!(scopes, [vec!["T1", "T2", "T4"], vec!["T3", "T5"]]);
    assert_eq!(r.scopes[0].locks, [1, 2, 3]);
    assert!(r.cross_group.is_empty());
}

#[test]
fn locks_shared_across_explicit_groups_are_reported_not_merged() {
    let (a, c) = (gid(0), gid(1));
    let r = refine([("read", a, 10), ("destage", c, 10), ("destage", c, 11)]);
    assert_eq!(r.scopes.len(), 2, "explicit groups are never merged");
    assert_eq!(r.cross_group.len(), 1);
    assert_eq!(r.cross_group[0].lock, 10);
    assert_eq!(r.cross_group[0].users, [(a, "read"), (c, "destage")]);
}

/// The runtime hook: tasks report lock use, the handle proposes scopes.
#[test]
fn observed_lock_use_inside_tasks_feeds_the_proposal() {
    let mut b = Runtime::builder();
    b.workers(1).observe_dependencies(true);
    let g = b.group(GroupSpec::new("cache"));
    let rt = b.build().unwrap();
    let h = rt.handle();
    for (kind, locks) in [("T1", &[1u64, 2][..]), ("T2", &[2]), ("T3", &[9])] {
        h.submit_named(g, Priority::Medium, kind, move |ctx| {
            for &l in locks {
                ctx.observe_lock(l);
            }
            Ok(())
        })
        .unwrap();
    }
    // The free function works from code that has no TaskCtx.
    h.submit_named(g, Priority::Medium, "T4", |_| {
        rcs::observe_lock(9);
        assert_eq!(rcs::current_task().map(|(_, k)| k), Some("T4"));
        Ok(())
    })
    .unwrap();
    assert!(h.wait_idle(std::time::Duration::from_secs(10)));
    let r = h.refinement();
    let scopes: Vec<Vec<&str>> = r.scopes.iter().map(|s| s.kinds.clone()).collect();
    assert_eq!(scopes, [vec!["T1", "T2"], vec!["T3", "T4"]]);
    assert!(rcs::current_task().is_none(), "not a worker thread");
}

/// Reference: two nodes are in one scope iff they are in the same explicit
/// group and connected by a chain of shared locks (BFS over the graph).
fn brute_force(obs: &[(u8, usize, u64)]) -> BTreeSet<BTreeSet<(usize, u8)>> {
    let mut locks: BTreeMap<(usize, u8), BTreeSet<u64>> = BTreeMap::new();
    for &(k, g, l) in obs {
        locks.entry((g, k)).or_default().insert(l);
    }
    let nodes: Vec<_> = locks.keys().copied().collect();
    let mut seen = BTreeSet::new();
    let mut components = Vec::new();
    for &start in &nodes {
        if !seen.insert(start) {
            continue;
        }
        let mut comp = BTreeSet::from([start]);
        let mut frontier = vec![start];
        while let Some(n) = frontier.pop() {
            for &m in &nodes {
                if !seen.contains(&m) && !locks[&n].is_disjoint(&locks[&m]) {
                    seen.insert(m);
                    comp.insert(m);
                    frontier.push(m);
                }
            }
        }
        components.push(comp);
    }
    let mut scopes = BTreeSet::new();
    for comp in components {
        let mut by_group: BTreeMap<usize, BTreeSet<(usize, u8)>> = BTreeMap::new();
        for n in comp {
            by_group.entry(n.0).or_default().insert(n);
        }
        scopes.extend(by_group.into_values());
    }
    scopes
}

proptest! {
    #[test]
    fn refinement_equals_connected_components_split_by_group(
        obs in prop::collection::vec((0u8..8, 0usize..3, 0u64..10), 0..40)
    ) {
        let ids: Vec<rcs::GroupId> = (0..3).map(gid).collect();
        let r = refine(obs.iter().map(|&(k, g, l)| (k, ids[g], l)));
        let got: BTreeSet<BTreeSet<(usize, u8)>> = r
            .scopes
            .iter()
            .map(|s| s.kinds.iter().map(|&k| (s.group.index(), k)).collect())
            .collect();
        prop_assert_eq!(got, brute_force(&obs));
        // Every cross-group lock really has users in two groups.
        for dep in &r.cross_group {
            let groups: BTreeSet<_> = dep.users.iter().map(|(g, _)| *g).collect();
            prop_assert!(groups.len() > 1);
        }
    }
}
