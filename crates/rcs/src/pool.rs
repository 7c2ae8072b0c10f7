//! Resource pools (paper §4.1): the worker threads partitioned into
//! independent units. Recovery-conscious scheduling maps pools to recovery
//! groups "thereby confining a recovery operation to the resources available
//! within the resource pool assigned to it". The default is one worker per
//! pool, as the paper's experiments (8 pools of 1 CPU).

use std::fmt;

/// Index of a resource pool in its runtime (dense, `0..pools`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolId(pub u16);

impl PoolId {
    /// The dense index of the pool.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pool#{}", self.0)
    }
}

/// How the workers are split into pools: `sizes[i]` workers in pool `i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolLayout {
    pub(crate) sizes: Vec<usize>,
}

impl PoolLayout {
    /// The pool of every worker, in worker order.
    pub(crate) fn pool_of_workers(&self) -> Vec<PoolId> {
        self.sizes
            .iter()
            .enumerate()
            .flat_map(|(pool, &size)| {
                let id = PoolId(u16::try_from(pool).expect("pool count bounded by POOLS_MAX"));
                std::iter::repeat_n(id, size)
            })
            .collect()
    }
}

/// A static mapping proportional to workload (paper §6.1: "each recovery group
/// is mapped to resource pools proportional to its ratio of the total task
/// workload"). Returns, for each group weight, the pools that serve it: groups
/// heavier than one pool's share get several pools, lighter ones are packed
/// (largest first) onto the least-loaded pool.
pub fn proportional_mapping(weights: &[f64], pools: usize) -> Vec<Vec<PoolId>> {
    assert!(pools > 0, "proportional_mapping needs at least one pool");
    let total: f64 = weights.iter().copied().filter(|w| *w > 0.0).sum();
    let share = if total > 0.0 {
        total / pools as f64
    } else {
        1.0
    };
    let mut load = vec![0.0f64; pools];
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]));
    let mut mapping = vec![Vec::new(); weights.len()];
    for g in order {
        let weight = weights[g].max(0.0);
        let wanted = ((weight / share).floor() as usize).clamp(1, pools);
        let mut by_load: Vec<usize> = (0..pools).collect();
        by_load.sort_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)));
        for &p in by_load.iter().take(wanted) {
            load[p] += weight / wanted as f64;
            mapping[g].push(PoolId(p as u16));
        }
        mapping[g].sort();
    }
    mapping
}
