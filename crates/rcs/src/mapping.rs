//! Mapping tables (paper §5.1, "the list of recovery groups assigned to each
//! resource pool"): the static mapping (Table 2) and the partial-dynamic
//! alternative mapping (Table 3), as bit masks so a pool scheduler filters its
//! ready groups with one AND.

use crate::group::{Alternative, GroupSpec};
use crate::policy::Policy;
use crate::pool::PoolId;

/// Pool→groups and group→workers masks for every policy.
#[derive(Debug, Clone)]
pub(crate) struct Mapping {
    /// Per pool: groups of its static mapping.
    pub(crate) pool_primary: Vec<u64>,
    /// Per pool: groups of its alternative mapping (partial-dynamic).
    pub(crate) pool_alternative: Vec<u64>,
    /// Groups whose sigma still holds in the alternative mapping (isolated).
    pub(crate) strict: u64,
    /// Per group: workers of its static pools.
    pub(crate) group_workers_primary: Vec<u64>,
    /// Per group: workers of its static or alternative pools.
    pub(crate) group_workers_partial: Vec<u64>,
    /// Every worker.
    pub(crate) all_workers: u64,
    /// Index of the first group with no static pool, if any.
    pub(crate) first_unmapped: Option<usize>,
}

impl Mapping {
    /// Build the tables. Pool ids must already be validated.
    pub(crate) fn new(groups: &[GroupSpec], pool_of_worker: &[PoolId], pools: usize) -> Self {
        let mut workers_of_pool = vec![0u64; pools];
        for (w, pool) in pool_of_worker.iter().enumerate() {
            workers_of_pool[pool.index()] |= 1u64 << w;
        }
        let all_workers = workers_of_pool.iter().fold(0, |acc, m| acc | m);
        let mut mapping = Mapping {
            pool_primary: vec![0; pools],
            pool_alternative: vec![0; pools],
            strict: 0,
            group_workers_primary: vec![0; groups.len()],
            group_workers_partial: vec![0; groups.len()],
            all_workers,
            first_unmapped: None,
        };
        for (g, spec) in groups.iter().enumerate() {
            let bit = 1u64 << g;
            if spec.pools.is_empty() && mapping.first_unmapped.is_none() {
                mapping.first_unmapped = Some(g);
            }
            for pool in &spec.pools {
                mapping.pool_primary[pool.index()] |= bit;
                mapping.group_workers_primary[g] |= workers_of_pool[pool.index()];
            }
            let alternative: Vec<usize> = match &spec.alternative {
                Alternative::AllPools => (0..pools).collect(),
                Alternative::Isolated => {
                    mapping.strict |= bit;
                    spec.pools.iter().map(|p| p.index()).collect()
                }
                Alternative::Pools(list) => list.iter().map(|p| p.index()).collect(),
            };
            for pool in alternative {
                mapping.pool_alternative[pool] |= bit;
                mapping.group_workers_partial[g] |= workers_of_pool[pool];
            }
            mapping.group_workers_partial[g] |= mapping.group_workers_primary[g];
        }
        mapping
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
