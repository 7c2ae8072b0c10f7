//! Recovering a main node lost mid-query, by the four schemes of the
//! smart-storage paper (section 3; the schemes and the fault are described
//! in [`crate::recovery`]): rebuild its data on the spare from the mirror
//! group or from parity (3.1, 3.4), move the work to the mirror group
//! (3.2), or spread the last checkpoint over every survivor (3.3).

use std::time::Instant;

use super::{Cluster, Phase, Worker, group_workers, names};
use crate::client::NodeClient;
use crate::error::{Error, Result};
use crate::recovery::{Fault, Scheme};
use crate::wire::{RebuildCmd, ScatterCmd};

/// Who works on after a recovery.
pub(super) enum Replacement {
    /// One node, rebuilt, stands in for the lost one; the others go on.
    One(Box<Worker>),
    /// A new working set, which has no redundancy group of its own.
    All(Vec<Worker>),
}

/// What a recovery did: its phase, and who works on.
pub(super) struct Recovery {
    pub phase: Phase,
    pub workers: Replacement,
}

impl Cluster {
    /// Recovers from losing main `f.node` with `f.scheme`, before a
    /// primitive that reads `src` (`base`: the table partition itself, not
    /// a checkpointed result).
    pub(super) async fn recover(&self, f: Fault, src: &str, base: bool) -> Result<Recovery> {
        let t = Instant::now();
        match f.scheme {
            Scheme::Spare | Scheme::Parity => {
                let (worker, phase) = self.rebuild_on_spare(f, src, base, t).await?;
                Ok(Recovery {
                    phase,
                    workers: Replacement::One(Box::new(worker)),
                })
            }
            Scheme::Migrate => {
                let workers = self.migrate(src);
                Ok(Recovery {
                    phase: Phase::from_nodes("recovery", t.elapsed().as_secs_f64(), &[]),
                    workers: Replacement::All(workers),
                })
            }
            Scheme::Redistribute => {
                let (workers, phase) = self.redistribute(f.node, src, t).await?;
                Ok(Recovery {
                    phase,
                    workers: Replacement::All(workers),
                })
            }
        }
    }

    /// Spare and parity schemes: rebuilds the lost node's `src` on the
    /// spare, which takes its place. `t` is when the recovery started.
    async fn rebuild_on_spare(
        &self,
        f: Fault,
        src: &str,
        base: bool,
        t: Instant,
    ) -> Result<(Worker, Phase)> {
        let lost_slot = f.node;
        let cmd = self.rebuild_cmd(f.scheme, lost_slot, src, base);
        let mut sp = self.spare.clone().expect("checked above");
        self.progress(&format!(
            "rebuilding main {lost_slot}'s {src} on the spare ({})",
            sp.addr()
        ));
        let s = sp.rebuild(&cmd).await?;
        let phase = Phase::from_nodes(
            "recovery",
            t.elapsed().as_secs_f64(),
            &[(sp.label().to_string(), s)],
        );
        let worker = Worker {
            client: sp,
            inputs: vec![src.to_string()],
            slot: Some(lost_slot),
        };
        Ok((worker, phase))
    }

    /// Load migration: the mirror group, which holds the checkpoints of
    /// `src`, takes over the work.
    fn migrate(&self, src: &str) -> Vec<Worker> {
        group_workers(&self.mirror, &names::ckpt(src))
    }

    /// Load redistribution: every main node's `src` (the lost one's from
    /// its checkpoint on the mirror) is scattered over every survivor of
    /// both groups, which all work on. `t` is when the recovery started.
    async fn redistribute(
        &self,
        lost: usize,
        src: &str,
        t: Instant,
    ) -> Result<(Vec<Worker>, Phase)> {
        let n = self.spec.nodes;
        let mut survivors: Vec<NodeClient> = (0..n)
            .filter(|&i| i != lost)
            .map(|i| self.main[i].clone())
            .collect();
        survivors.extend(self.mirror.iter().cloned());
        let targets: Vec<String> = survivors.iter().map(|c| c.addr().to_string()).collect();
        let pieces: Vec<String> = (0..n).map(|p| format!("{src}.piece{p}")).collect();
        self.progress(&format!(
            "redistributing {src} over {} surviving nodes",
            targets.len()
        ));
        let scatters = (0..n).map(|p| {
            let (mut holder, object) = if p == lost {
                (self.mirror[p].clone(), names::ckpt(src))
            } else {
                (self.main[p].clone(), src.to_string())
            };
            let cmd = ScatterCmd {
                object,
                targets: targets.clone(),
                as_name: pieces[p].clone(),
            };
            async move {
                let s = holder.scatter(&cmd).await?;
                Ok::<_, Error>((holder.label().to_string(), s))
            }
        });
        let s = futures::future::try_join_all(scatters).await?;
        let phase = Phase::from_nodes("recovery", t.elapsed().as_secs_f64(), &s);
        let workers = survivors
            .into_iter()
            .map(|c| Worker {
                client: c,
                inputs: pieces.clone(),
                slot: None,
            })
            .collect();
        Ok((workers, phase))
    }

    /// The rebuild of main `lost`'s object `src` on the spare.
    fn rebuild_cmd(&self, scheme: Scheme, lost: usize, src: &str, base: bool) -> RebuildCmd {
        match (scheme, base) {
            (Scheme::Parity, _) => RebuildCmd::Parity {
                parity: (
                    self.parity
                        .as_ref()
                        .expect("parity layout")
                        .addr()
                        .to_string(),
                    names::parity(src),
                ),
                survivors: (0..self.spec.nodes)
                    .filter(|&i| i != lost)
                    .map(|i| (i, self.main[i].addr().to_string(), src.to_string()))
                    .collect(),
                member: lost,
                name: src.to_string(),
            },
            // The original partition: a parallel read of the column-wise
            // mirror group (section 3.1).
            (_, true) => RebuildCmd::MirrorColumns {
                sources: self.mirror.iter().map(|m| m.addr().to_string()).collect(),
                cols_object: names::LINEITEM_COLS.into(),
                member: lost,
                name: src.to_string(),
            },
            // The latest checkpoint: one mirror node sends it.
            (_, false) => RebuildCmd::Copy {
                source: self.mirror[lost].addr().to_string(),
                object: names::ckpt(src),
                name: src.to_string(),
            },
        }
    }
}
