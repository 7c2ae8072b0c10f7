//! Running a query on the cluster, primitive by primitive (section 2.3 of
//! the smart-storage paper: the host distributes the plan to the nodes and
//! merges their results), checkpointing each intermediate result to the
//! redundancy group when asked (section 4.2), injecting the fault a run
//! asks for and resuming after the recovery by one primitive.

use std::time::Instant;

use tokio::task::JoinHandle;

use arrow::record_batch::RecordBatch;

use super::recover::Replacement;
use super::{Cluster, Phase, QueryReport, Worker, names, run_on};
use crate::client::NodeClient;
use crate::error::{Error, Result};
use crate::plan::Primitive;
use crate::recovery::Fault;
use crate::spec::Query;
use crate::tpch;
use crate::wire::CheckpointCmd;
use crate::wire::Stats;

/// A query in flight: its plan, who works on it, what it has done.
struct InFlight {
    query: Query,
    checkpoint: bool,
    /// Whether a node may defer a primitive into its reader: only when no
    /// checkpoint needs the primitive's output, and the cluster does not
    /// ask for the paper's plan as it is ([`Cluster::materialise`]).
    defer: bool,
    fault: Option<Fault>,
    /// The primitives, in order.
    prims: Vec<Primitive>,
    /// The object each primitive materialises.
    outs: Vec<&'static str>,
    /// Each primitive's name in phases and news.
    labels: Vec<&'static str>,
    workers: Vec<Worker>,
    /// After migration or redistribution the working set has no
    /// redundancy group of its own: no further checkpoints.
    degraded: bool,
    phases: Vec<Phase>,
    /// The checkpoint running behind the current primitive, if any.
    pending: Option<Pending>,
    /// This run's number (parity folds are per run).
    epoch: u64,
}

/// One primitive's checkpoint, running on every worker behind the next
/// primitive (section 4.2, off the critical path).
struct Pending {
    /// The primitive whose output it checkpoints.
    k: usize,
    started: Instant,
    /// One task per worker, in the workers' order.
    tasks: Vec<Task>,
}

/// One worker's checkpoint task: its label and stats.
type Task = JoinHandle<Result<(String, Stats)>>;

/// How a pending checkpoint ended: each worker's result, in order.
type Settled = Vec<Result<(String, Stats)>>;

impl InFlight {
    /// Whether primitive `k`'s output is checkpointed (which also writes it
    /// to the owner's device).
    fn keeps(&self, k: usize) -> bool {
        self.checkpoint && k + 1 < self.prims.len() && !self.degraded
    }
}

/// A query's primitives, the objects they materialise, and their labels.
fn plan(query: Query) -> (Vec<Primitive>, Vec<&'static str>, Vec<&'static str>) {
    match query {
        Query::Scan => (
            vec![tpch::scan_primitive()],
            vec![names::SCAN_OUT],
            vec!["scan"],
        ),
        Query::Q1 => (
            tpch::q1_primitives().to_vec(),
            names::Q1_OUT.to_vec(),
            crate::recovery::PRIMITIVES.to_vec(),
        ),
    }
}

/// One primitive's results: the nodes that finished and the workers whose
/// node was lost; any other error ends the query.
type Outcome = (Vec<(String, Stats)>, Vec<(usize, Error)>);

fn split_lost(results: Vec<Result<(String, Stats)>>) -> Result<Outcome> {
    let mut lost = Vec::new();
    let mut done = Vec::new();
    for (w, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) => done.push(s),
            Err(e) if e.is_node_lost() => lost.push((w, e)),
            Err(e) => return Err(e),
        }
    }
    Ok((done, lost))
}

impl Cluster {
    /// Runs a workload, failure-free; `checkpoint` makes Q1 checkpoint each
    /// intermediate result to the redundancy group (section 4.2).
    pub async fn run_query(&mut self, query: Query, checkpoint: bool) -> Result<QueryReport> {
        self.run_query_with(query, checkpoint, None).await
    }

    /// Runs a workload, losing a node as `fault` says and recovering with
    /// its scheme (see [`crate::recovery`]).
    pub async fn run_query_with(
        &mut self,
        query: Query,
        checkpoint: bool,
        fault: Option<Fault>,
    ) -> Result<QueryReport> {
        if let Some(f) = &fault {
            self.check_fault(f, query, checkpoint)?;
        }
        let start = Instant::now();
        let (prims, outs, labels) = plan(query);
        self.epoch += 1;
        let mut q = InFlight {
            query,
            checkpoint,
            defer: !checkpoint && !self.materialise,
            fault,
            prims,
            outs,
            labels,
            workers: self.main_workers(names::LINEITEM),
            degraded: false,
            phases: Vec::new(),
            pending: None,
            epoch: self.epoch,
        };
        let run = self.run_all(&mut q).await;
        // Whatever happened, no checkpoint task outlives the query. One that
        // fails once the answer is there costs only the protection it was
        // to give: the answer stands, and its phase counts the nodes lost.
        for r in self.wait_pending(&mut q).await {
            if let Err(e) = r {
                tracing::warn!("a checkpoint behind the query's answer failed: {e}");
            }
        }
        let mut report = run?;
        report.phases = std::mem::take(&mut q.phases);
        report.settled_s = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Runs every primitive, each checkpoint behind the next primitive,
    /// and collects the answer.
    async fn run_all(&mut self, q: &mut InFlight) -> Result<QueryReport> {
        for k in 0..q.prims.len() {
            self.run_primitive(q, k).await?;
            for w in q.workers.iter_mut() {
                w.inputs = vec![q.outs[k].to_string()];
            }
            if q.keeps(k) {
                // At most one checkpoint in flight: memory holds the output
                // being checkpointed and the one being computed.
                self.settle(q).await?;
                self.start_checkpoint(q, k)?;
            }
        }
        collect(q).await
    }

    /// Starts checkpointing every worker's output of primitive `k` behind
    /// the next primitive. A fault planned to land while this checkpoint
    /// is in flight loses its node here: the others' checkpoints are under
    /// way, the lost node's never completes.
    fn start_checkpoint(&mut self, q: &mut InFlight, k: usize) -> Result<()> {
        let victim = q.fault.filter(|f| f.mid_checkpoint && f.at == k + 1);
        let victim_at = victim.and_then(|f| q.workers.iter().position(|w| w.slot == Some(f.node)));
        let calls: Vec<(NodeClient, CheckpointCmd)> = q
            .workers
            .iter()
            .map(|w| (w.client.clone(), self.checkpoint_cmd(w, q.outs[k], q.epoch)))
            .collect();
        let spawn = |(mut client, cmd): (NodeClient, CheckpointCmd)| {
            tokio::spawn(async move {
                let s = client.checkpoint(&cmd).await?;
                Ok((client.label().to_string(), s))
            })
        };
        let mut tasks: Vec<Option<Task>> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| (victim_at != Some(i)).then(|| spawn(c.clone())))
            .collect();
        if let Some(f) = victim {
            self.progress(&format!(
                "fault: losing main {} ({:?}) while its checkpoint of {} is in flight",
                f.node, f.mode, q.labels[k]
            ));
            self.fail_node(f.node, f.mode)?;
        }
        for (t, c) in tasks.iter_mut().zip(calls) {
            if t.is_none() {
                *t = Some(spawn(c));
            }
        }
        q.pending = Some(Pending {
            k,
            started: Instant::now(),
            tasks: tasks.into_iter().map(|t| t.expect("spawned")).collect(),
        });
        Ok(())
    }

    /// Waits for the pending checkpoint, records its phase, and returns
    /// each worker's result (empty when none was pending).
    async fn wait_pending(&self, q: &mut InFlight) -> Settled {
        let Some(p) = q.pending.take() else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(p.tasks.len());
        for t in p.tasks {
            out.push(match t.await {
                Ok(r) => r,
                Err(e) => Err(Error::Invalid(format!("checkpoint task: {e}"))),
            });
        }
        let done: Vec<(String, Stats)> = out
            .iter()
            .filter_map(|r| r.as_ref().ok().cloned())
            .collect();
        let failed = out.len() - done.len();
        let name = match failed {
            0 => format!("checkpoint {}", q.labels[p.k]),
            n => format!("checkpoint {} ({n} lost)", q.labels[p.k]),
        };
        q.phases.push(Phase::checkpoint(
            &name,
            p.started.elapsed().as_secs_f64(),
            &done,
        ));
        out
    }

    /// Waits for the pending checkpoint to complete everywhere.
    async fn settle(&self, q: &mut InFlight) -> Result<()> {
        for r in self.wait_pending(q).await {
            r?;
        }
        Ok(())
    }

    /// Checks this cluster can inject `f` and recover from it.
    fn check_fault(&self, f: &Fault, query: Query, checkpoint: bool) -> Result<()> {
        f.check(query, self.spec.layout, self.spec.nodes, checkpoint)?;
        if f.scheme.needs_spare() && self.spare.is_none() {
            return Err(Error::Invalid(format!(
                "recovery {} needs a spare node",
                f.scheme.name()
            )));
        }
        if self.owned.is_empty() {
            return Err(Error::Invalid(
                "--fail-node needs local nodes (started by the host), not --node-addrs".into(),
            ));
        }
        Ok(())
    }

    /// Runs primitive `k` on every worker, losing the fault's node just
    /// before it when the fault says so, and recovering when a node is lost.
    async fn run_primitive(&mut self, q: &mut InFlight, k: usize) -> Result<()> {
        // A mid-checkpoint fault already struck when the checkpoint started.
        if let Some(f) = q.fault.filter(|f| f.at == k && !f.mid_checkpoint) {
            // The paper's point: the previous checkpoint is complete.
            self.settle(q).await?;
            self.progress(&format!(
                "fault: losing main {} ({:?}) just before {}",
                f.node, f.mode, q.labels[k]
            ));
            self.fail_node(f.node, f.mode)?;
        }
        let t = Instant::now();
        // Without checkpoints a node may defer a primitive into its reader.
        let results = run_on(&mut q.workers, q.outs[k], &q.prims[k], q.defer, None).await;
        let (done, lost) = split_lost(results)?;
        if lost.is_empty() {
            q.phases.push(Phase::from_nodes(
                q.labels[k],
                t.elapsed().as_secs_f64(),
                &done,
            ));
            return Ok(());
        }
        self.resume_after_loss(q, k, t, &done, lost).await
    }

    /// Primitive `k`, started at `t`, lost a node: recovers with the
    /// fault's scheme, then reruns `k` where the scheme says.
    async fn resume_after_loss(
        &mut self,
        q: &mut InFlight,
        k: usize,
        t: Instant,
        done: &[(String, Stats)],
        mut lost: Vec<(usize, Error)>,
    ) -> Result<()> {
        let Some(f) = q.fault else {
            return Err(lost.remove(0).1);
        };
        if lost.len() > 1 || q.workers[lost[0].0].slot != Some(f.node) {
            let which: Vec<String> = lost.iter().map(|(_, e)| e.to_string()).collect();
            return Err(Error::Invalid(format!(
                "the schemes recover one lost main node; lost: {}",
                which.join("; ")
            )));
        }
        let (w, e) = lost.remove(0);
        q.phases.push(Phase::from_nodes(
            &format!("{} (node lost)", q.labels[k]),
            t.elapsed().as_secs_f64(),
            done,
        ));
        self.progress(&format!(
            "detected: {e}; recovering with {}",
            f.scheme.name()
        ));
        // Recovery starts from the lost node's last checkpoint that
        // completed: the previous primitive's, unless the node was lost
        // while that one was still in flight; then the one before it (at
        // most one checkpoint is ever in flight), and the lost node's part
        // of the previous primitive runs again.
        let settled = self.wait_pending(q).await;
        let lost_ckpt = settled.get(w).is_some_and(|r| r.is_err());
        for (i, r) in settled.into_iter().enumerate() {
            if i != w {
                r?;
            }
        }
        let from = if lost_ckpt { k.checked_sub(1) } else { Some(k) };
        let (src, base) = match from {
            Some(j) if j >= 1 => (q.outs[j - 1], false),
            _ => (names::LINEITEM, true),
        };
        let catch_up = from.map_or(0, |j| k - j);
        if catch_up > 0 {
            self.progress(&format!(
                "main {}'s checkpoint of {} did not complete: recovering from {}",
                f.node,
                q.labels[k - 1],
                if base { "its partition" } else { src }
            ));
        }
        let recovery = self.recover(f, src, base).await?;
        q.phases.push(recovery.phase);
        let rerun_all = match recovery.workers {
            Replacement::One(worker) => {
                q.workers[w] = *worker;
                // Scan restarts from the beginning (the paper's Scan
                // scenarios); Q1 reruns the interrupted primitive on the
                // spare only.
                q.query == Query::Scan
            }
            Replacement::All(workers) => {
                q.workers = workers;
                q.degraded = true;
                true
            }
        };
        let only = (!rerun_all).then_some(w);
        for j in k - catch_up..=k {
            if j < k {
                self.progress(&format!("running {} again from {src}", q.labels[j]));
            }
            let t = Instant::now();
            let results = run_on(&mut q.workers, q.outs[j], &q.prims[j], q.defer, only).await;
            let named = results.into_iter().collect::<Result<Vec<_>>>()?;
            q.phases.push(Phase::from_nodes(
                &format!("{} (after recovery)", q.labels[j]),
                t.elapsed().as_secs_f64(),
                &named,
            ));
            if j < k {
                for (i, wk) in q.workers.iter_mut().enumerate() {
                    if only.is_none_or(|o| o == i) {
                        wk.inputs = vec![q.outs[j].to_string()];
                    }
                }
            }
        }
        self.progress("recovered; continuing");
        Ok(())
    }
}

/// Fetches the last primitive's output from every worker and merges it
/// on the host: Scan's rows in order, Q1's partial groups into one.
async fn collect(q: &mut InFlight) -> Result<QueryReport> {
    let query = q.query;
    let last = q.outs[q.outs.len() - 1];
    let workers = &mut q.workers;
    let t = Instant::now();
    let calls = workers
        .iter_mut()
        .map(|w| async move { w.client.get_table(last, None, None).await });
    let parts = futures::future::try_join_all(calls).await?;
    let fetched = t.elapsed().as_secs_f64();
    let schema = parts[0].0.clone();
    let rows: Vec<RecordBatch> = parts.into_iter().flat_map(|p| p.1).collect();
    let c = Instant::now();
    let (schema, result) = match query {
        Query::Scan => (schema.clone(), tpch::order_scan(schema, rows).await?),
        Query::Q1 => {
            let merged = tpch::q1_merge(schema, rows).await?;
            (merged.schema(), vec![merged])
        }
    };
    let merged_rows = result.iter().map(|b| b.num_rows() as u64).sum();
    q.phases.push(Phase {
        background: false,
        checkpoint: None,
        rows: merged_rows,
        name: if query == Query::Scan {
            "collect"
        } else {
            "merge"
        }
        .into(),
        wall_s: t.elapsed().as_secs_f64(),
        io_s: 0.0,
        compute_s: c.elapsed().as_secs_f64(),
        comm_s: fetched,
        critical: "host".into(),
    });
    Ok(QueryReport {
        query,
        schema,
        result,
        // The caller moves the phases in once every checkpoint settled.
        phases: Vec::new(),
        settled_s: 0.0,
    })
}
