//! Mapping tables (paper §5.1, "the list of recovery groups assigned to each
//! resource pool"): the static mapping (Table 2) and the partial-dynamic
//! alternative mapping (Table 3), as bit masks so a pool scheduler filters its
//! ready groups with one AND.
//!
//! [`PoolTables`] is what a [pool scheduler](crate::scheduler) reads, for
//! any number of pools (the simulator runs up to 1024). [`Mapping`] adds the
//! runtime's per-group masks of worker threads, used to wake a parked worker
//! that may serve a group (at most [`WORKERS_MAX`](crate::limits::WORKERS_MAX)).

use crate::group::{Alternative, GroupSpec};
use crate::policy::Policy;
use crate::pool::PoolId;

/// Pool→groups masks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolTables {
    /// Per pool: groups of its static mapping.
    pub(crate) pool_primary: Vec<u64>,
    /// Per pool: groups of its alternative mapping (partial-dynamic).
    pub(crate) pool_alternative: Vec<u64>,
    /// Groups whose sigma still holds in the alternative mapping (isolated).
    pub(crate) strict: u64,
    /// Index of the first group with no static pool, if any.
    pub(crate) first_unmapped: Option<usize>,
}

impl PoolTables {
    /// Build the tables for `pools` pools. Pool ids must be validated.
    pub(crate) fn new(groups: &[GroupSpec], pools: usize) -> Self {
        let mut tables = PoolTables {
            pool_primary: vec![0; pools],
            pool_alternative: vec![0; pools],
            strict: 0,
            first_unmapped: None,
        };
        for (g, spec) in groups.iter().enumerate() {
            let bit = 1u64 << g;
            if spec.pools.is_empty() && tables.first_unmapped.is_none() {
                tables.first_unmapped = Some(g);
            }
            for pool in &spec.pools {
                tables.pool_primary[pool.index()] |= bit;
            }
            match &spec.alternative {
                Alternative::AllPools => {
                    for mask in &mut tables.pool_alternative {
                        *mask |= bit;
                    }
                }
                Alternative::Isolated => {
                    tables.strict |= bit;
                    for pool in &spec.pools {
                        tables.pool_alternative[pool.index()] |= bit;
                    }
                }
                Alternative::Pools(list) => {
                    for pool in list {
                        tables.pool_alternative[pool.index()] |= bit;
                    }
                }
            }
        }
        tables
    }

    /// Every pool serves every one of `groups` groups, primary and
    /// alternative (tests).
    #[cfg(test)]
    pub(crate) fn all_groups(groups: usize, pools: usize) -> Self {
        let all = if groups == 64 {
            u64::MAX
        } else {
            (1u64 << groups) - 1
        };
        PoolTables {
            pool_primary: vec![all; pools],
            pool_alternative: vec![all; pools],
            strict: 0,
            first_unmapped: None,
        }
    }

    /// The groups pool `pool` may dispatch under `policy`, and whether it
    /// enforces sigma for them.
    #[inline]
    pub(crate) fn pool_groups(&self, policy: Policy, pool: usize) -> (u64, bool) {
        match policy {
            Policy::Performance | Policy::Dynamic => (u64::MAX, false),
            Policy::Static => (self.pool_primary[pool], true),
            Policy::Partial => (self.pool_primary[pool] | self.pool_alternative[pool], true),
        }
    }
}

/// The tables plus group→workers masks for waking workers.
#[derive(Debug, Clone)]
pub(crate) struct Mapping {
    pub(crate) tables: PoolTables,
    /// Per group: workers of its static pools.
    pub(crate) group_workers_primary: Vec<u64>,
    /// Per group: workers of its static or alternative pools.
    pub(crate) group_workers_partial: Vec<u64>,
    /// Every worker.
    pub(crate) all_workers: u64,
}

impl Mapping {
    /// Build the tables. Pool ids must already be validated.
    pub(crate) fn new(groups: &[GroupSpec], pool_of_worker: &[PoolId], pools: usize) -> Self {
        let tables = PoolTables::new(groups, pools);
        let mut workers_of_pool = vec![0u64; pools];
        for (w, pool) in pool_of_worker.iter().enumerate() {
            workers_of_pool[pool.index()] |= 1u64 << w;
        }
        let all_workers = workers_of_pool.iter().fold(0, |acc, m| acc | m);
        let workers_where = |masks: &[u64], g: usize| {
            masks
                .iter()
                .zip(&workers_of_pool)
                .filter(|(mask, _)| *mask & (1u64 << g) != 0)
                .fold(0u64, |acc, (_, workers)| acc | workers)
        };
        let group_workers_primary: Vec<u64> = (0..groups.len())
            .map(|g| workers_where(&tables.pool_primary, g))
            .collect();
        let group_workers_partial = (0..groups.len())
            .map(|g| workers_where(&tables.pool_alternative, g) | group_workers_primary[g])
            .collect();
        Mapping {
            tables,
            group_workers_primary,
            group_workers_partial,
            all_workers,
        }
    }

    /// Workers that may dispatch a task of group `g` under `policy`.
    #[inline]
    pub(crate) fn eligible_workers(&self, policy: Policy, g: usize) -> u64 {
        match policy {
            Policy::Performance | Policy::Dynamic => self.all_workers,
            Policy::Static => self.group_workers_primary[g],
            Policy::Partial => self.group_workers_partial[g],
        }
    }
}
