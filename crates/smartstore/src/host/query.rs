//! Running a query on the cluster, primitive by primitive (section 2.3 of
//! the smart-storage paper: the host distributes the plan to the nodes and
//! merges their results), checkpointing each intermediate result to the
//! redundancy group when asked (section 4.2), injecting the fault a run
//! asks for and resuming after the recovery by one primitive.

use std::time::Instant;

use arrow::record_batch::RecordBatch;

use super::recover::Replacement;
use super::{Cluster, Phase, QueryReport, Worker, names, run_on};
use crate::error::{Error, Result};
use crate::plan::Primitive;
use crate::recovery::Fault;
use crate::spec::Query;
use crate::tpch;
use crate::wire::Stats;

/// A query in flight: its plan, who works on it, what it has done.
struct InFlight {
    query: Query,
    checkpoint: bool,
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
}

impl InFlight {
    /// Whether primitive `k`'s output is checkpointed (and so materialised
    /// on the device).
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
        let (prims, outs, labels) = plan(query);
        let mut q = InFlight {
            query,
            checkpoint,
            fault,
            prims,
            outs,
            labels,
            workers: self.main_workers(names::LINEITEM),
            degraded: false,
            phases: Vec::new(),
        };
        for k in 0..q.prims.len() {
            self.run_primitive(&mut q, k).await?;
            for w in q.workers.iter_mut() {
                w.inputs = vec![q.outs[k].to_string()];
            }
            if q.keeps(k) {
                let t = Instant::now();
                let s = self.checkpoint_workers(&mut q.workers, q.outs[k]).await?;
                q.phases.push(Phase::from_nodes(
                    &format!("checkpoint {}", q.labels[k]),
                    t.elapsed().as_secs_f64(),
                    &s,
                ));
            }
        }
        collect(q).await
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
        if let Some(f) = q.fault.filter(|f| f.at == k) {
            self.progress(&format!(
                "fault: losing main {} ({:?}) just before {}",
                f.node, f.mode, q.labels[k]
            ));
            self.fail_node(f.node, f.mode)?;
        }
        let keep = q.keeps(k);
        let t = Instant::now();
        let results = run_on(&mut q.workers, q.outs[k], &q.prims[k], keep, None).await;
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
        let src = if k == 0 {
            names::LINEITEM
        } else {
            q.outs[k - 1]
        };
        let recovery = self.recover(f, src, k == 0).await?;
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
        let keep = q.keeps(k);
        let t = Instant::now();
        let only = (!rerun_all).then_some(w);
        let results = run_on(&mut q.workers, q.outs[k], &q.prims[k], keep, only).await;
        let named = results.into_iter().collect::<Result<Vec<_>>>()?;
        q.phases.push(Phase::from_nodes(
            &format!("{} (after recovery)", q.labels[k]),
            t.elapsed().as_secs_f64(),
            &named,
        ));
        self.progress("recovered; continuing");
        Ok(())
    }
}

/// Fetches the last primitive's output from every worker and merges it
/// on the host: Scan's rows in order, Q1's partial groups into one.
async fn collect(q: InFlight) -> Result<QueryReport> {
    let InFlight {
        query,
        outs,
        mut workers,
        mut phases,
        ..
    } = q;
    let last = outs[outs.len() - 1];
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
    phases.push(Phase {
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
        phases,
    })
}
