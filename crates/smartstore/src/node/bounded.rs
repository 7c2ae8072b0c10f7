//! Running a fragment whose input does not fit the node's memory.
//!
//! A node's `--memory` (the paper's 64 MB of on-device memory, section 5)
//! bounds the objects it caches. A fragment whose input is larger than
//! that is not loaded whole: its input objects are read a row block at a
//! time ([`RowBlocks`]), the primitive runs within the same
//! number of bytes of working memory ([`crate::ops::bounded`], spilling to
//! the node's `.spill` directory). Its output is kept in memory while it
//! is under half the budget (an aggregate's groups); past that it is
//! written to the device as it is produced: a table object
//! ([`crate::columnar::TableWriter`]) when the query materialises it,
//! else spilled runs ([`StreamSpill`]); an output larger than the node's
//! memory cannot be kept in it. The output object is put in place only
//! after the whole input was read and checked, so a damaged input stores
//! nothing.
//!
//! A Scan that would stream and that the query does not materialise is
//! not run at all: its output would only be spilled for the next
//! primitive to read back once, so the node holds the Scan instead
//! ([`Node::defer_scan`], [`Spilled::deferred`]): its compiled filter and
//! its inputs, held open, and the next primitive runs it as it reads. A
//! query over a node's share of `lineitem` at scale factor 10 then moves
//! no Scan output at all, where it wrote and read back about 250 MB.
//!
//! A fragment whose input fits runs as before ([`Node::run`]): loaded
//! whole, with the in-memory primitives' speed; its working memory is up
//! to about twice its input (input and output).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use futures::StreamExt;
use parking_lot::Mutex;

use super::{Held, Node, Placement};
use crate::batch::data_bytes;
use crate::columnar::TableWriter;
use crate::columnar::{ReadCost, RowBlocks};
use crate::error::{Error, Result};
use crate::ops::bounded::{
    self, BatchIter, BatchStream, Output, Reopen, Spilled, StreamSpill, WorkMemory,
};
use crate::ops::scanfilter::ScanFilter;
use crate::plan::{Fragment, Primitive};
use crate::wire::Stats;

/// Name of the directory, inside a node's, that spill files go to (a name
/// no object can have: object names do not start with a dot).
pub const SPILL_DIR: &str = ".spill";

/// A fragment's inputs when they are streamed: their schema and blocks,
/// and what reading them costs as it happens.
pub(super) struct Streamed {
    schema: SchemaRef,
    blocks: BatchIter,
    cost: Arc<Mutex<ReadCost>>,
}

impl Node {
    /// Where each of the fragment's inputs is, and their bytes in all.
    fn input_parts(
        &self,
        fragment: &Fragment,
        columns: Option<&[String]>,
        cost: &Arc<Mutex<ReadCost>>,
    ) -> Result<(Vec<(String, Part)>, u64)> {
        let mut total: u64 = 0;
        let mut parts = Vec::new();
        for name in std::iter::once(&fragment.input).chain(&fragment.also) {
            let held = self
                .inner
                .lock()
                .get(name)
                .map(|h| (h.bytes as u64, h.spilled.clone()));
            let part = match held {
                Some((_, Some(s))) => {
                    total += s.bytes();
                    Part::Spilled(s)
                }
                Some((bytes, None)) => {
                    total += bytes;
                    Part::Held
                }
                None => {
                    // Opening reads the header and directory; the
                    // segments are read (and checked) by the first block.
                    let r = RowBlocks::open(&self.path(name)?, columns, cost.clone())?;
                    total += r.bytes();
                    Part::Device(r)
                }
            };
            parts.push((name.clone(), part));
        }
        Ok((parts, total))
    }

    /// Whether inputs of `total` bytes, some of them spilled or not, are
    /// streamed rather than loaded whole.
    fn streams(&self, parts: &[(String, Part)], total: u64) -> bool {
        // A spilled input is never loaded whole: it was too large.
        total > self.inner.lock().budget as u64
            || parts.iter().any(|(_, p)| matches!(p, Part::Spilled(_)))
    }

    /// Runs `fragment` within the node's memory when its inputs are
    /// larger than that (or one is spilled): defers it if it is a Scan
    /// that may be deferred ([`Node::defer_scan`]), else streams its
    /// inputs through it ([`Node::run_bounded`]). `None` when the inputs
    /// fit: the caller loads them whole.
    pub(super) async fn run_streamed(
        &self,
        fragment: &Fragment,
        columns: Option<&[String]>,
        started: Instant,
        mut stats: Stats,
    ) -> Result<Option<Stats>> {
        let cost = Arc::new(Mutex::new(ReadCost::default()));
        let (parts, total) = self.input_parts(fragment, columns, &cost)?;
        if !self.streams(&parts, total) {
            return Ok(None);
        }
        if !fragment.materialize
            && matches!(fragment.primitive, Primitive::Scan { .. })
            && !parts.iter().any(|(_, p)| matches!(p, Part::Held))
        {
            return self
                .defer_scan(fragment, parts, total, columns, cost, started, stats)
                .map(Some);
        }
        let inputs = self.streamed_inputs(fragment, parts, columns, cost, &mut stats)?;
        self.run_bounded(fragment, inputs, started, stats)
            .await
            .map(Some)
    }

    /// Defers a Scan that streams and whose output the query does not
    /// materialise, over inputs none of which is held in memory: its
    /// output would only be spilled for the next primitive to read back
    /// once, so the node keeps the Scan itself instead
    /// ([`Spilled::deferred`]), over its inputs held open as they are now,
    /// and the next primitive runs it as it reads. Returns the fragment's
    /// stats.
    #[allow(clippy::too_many_arguments)]
    fn defer_scan(
        &self,
        fragment: &Fragment,
        parts: Vec<(String, Part)>,
        total: u64,
        columns: Option<&[String]>,
        cost: Arc<Mutex<ReadCost>>,
        started: Instant,
        mut stats: Stats,
    ) -> Result<Stats> {
        let mut schema: Option<SchemaRef> = None;
        let mut sources: Vec<Reopen> = Vec::with_capacity(parts.len());
        let cols: Option<Vec<String>> = columns.map(<[String]>::to_vec);
        for (name, part) in parts {
            let (s, source): (SchemaRef, Reopen) = match part {
                Part::Device(r) => {
                    let path = r.path().to_path_buf();
                    let file = r.file().try_clone().map_err(|e| Error::io(&path, e))?;
                    let cols = cols.clone();
                    let reopen: Reopen = Box::new(move |cost| {
                        let file = file.try_clone().map_err(|e| Error::io(&path, e))?;
                        let r = RowBlocks::open_file(&path, file, cols.as_deref(), cost.clone())?;
                        Ok(Box::new(r) as BatchIter)
                    });
                    (r.schema().clone(), reopen)
                }
                Part::Spilled(sp) => {
                    let s = match columns {
                        Some(c) => Arc::new(sp.schema().project(&super::column_indices(
                            sp.schema(),
                            c,
                            &name,
                        )?)?),
                        None => sp.schema().clone(),
                    };
                    let (cols, name) = (cols.clone(), name.clone());
                    let reopen: Reopen =
                        Box::new(move |cost| Ok(project(&sp, &name, cols.as_deref(), cost)?.1));
                    (s, reopen)
                }
                Part::Held => unreachable!("a held input runs the Scan now"),
            };
            same_columns(&mut schema, &s, &name, fragment)?;
            sources.push(source);
        }
        let schema = schema.expect("one input at least");
        let filter = ScanFilter::new(&fragment.primitive, &schema)?;
        self.hold_spilled(&fragment.output, Spilled::deferred(filter, sources, total))?;
        let cost = std::mem::take(&mut *cost.lock());
        stats.io_real_s += cost.time.as_secs_f64();
        stats.io_s += cost.time.as_secs_f64();
        stats.bytes_read += cost.bytes();
        stats.compute_s += started.elapsed().saturating_sub(cost.time).as_secs_f64();
        Ok(stats)
    }

    /// The fragment's inputs, found by [`Node::input_parts`], as one
    /// stream of blocks.
    fn streamed_inputs(
        &self,
        fragment: &Fragment,
        parts: Vec<(String, Part)>,
        columns: Option<&[String]>,
        cost: Arc<Mutex<ReadCost>>,
        stats: &mut Stats,
    ) -> Result<Streamed> {
        let mut schema: Option<SchemaRef> = None;
        let mut blocks: Vec<BatchIter> = Vec::with_capacity(parts.len());
        for (name, part) in parts {
            let (s, b): (SchemaRef, BatchIter) = match part {
                Part::Device(r) => (r.schema().clone(), Box::new(r)),
                Part::Spilled(sp) => project(&sp, &name, columns, &cost)?,
                // Held in memory already: its blocks cost nothing more.
                Part::Held => {
                    let (s, b) = self.load_table(&name, columns, stats)?;
                    (s, Box::new(b.into_iter().map(Ok)))
                }
            };
            same_columns(&mut schema, &s, &name, fragment)?;
            blocks.push(b);
        }
        Ok(Streamed {
            schema: schema.expect("one input at least"),
            blocks: Box::new(blocks.into_iter().flatten()),
            cost,
        })
    }

    /// Runs `fragment` over `inputs` within the node's memory and writes
    /// its output to the device as it comes (see the module docs).
    /// `started` is when opening the inputs began (their checksum pass is
    /// I/O time, the rest since then compute).
    async fn run_bounded(
        &self,
        fragment: &Fragment,
        inputs: Streamed,
        started: Instant,
        mut stats: Stats,
    ) -> Result<Stats> {
        let mem = WorkMemory {
            budget: self.inner.lock().budget,
            spill_dir: self.dir.join(SPILL_DIR),
        };
        let (schema, out) =
            bounded::run(&fragment.primitive, inputs.schema, inputs.blocks, &mem).await?;
        let mut writing = Duration::ZERO;
        match out {
            // Sorted runs the query does not materialise stay as they are:
            // the next primitive merges them as it reads.
            Output::Spilled(runs) if !fragment.materialize => {
                stats.rows_out = runs.rows();
                self.hold_spilled(&fragment.output, runs)?;
            }
            out => {
                let out = out.into_stream()?;
                writing = self
                    .store_stream(fragment, &schema, out, &mem, &mut stats)
                    .await?;
            }
        }
        let cost = std::mem::take(&mut *inputs.cost.lock());
        let modelled: Option<Duration> = cost.requests.iter().map(|&b| self.model.charge(b)).sum();
        stats.io_real_s += cost.time.as_secs_f64();
        stats.io_s += modelled.unwrap_or(cost.time).as_secs_f64();
        stats.bytes_read += cost.bytes();
        stats.compute_s += started
            .elapsed()
            .saturating_sub(cost.time + writing)
            .as_secs_f64();
        Ok(stats)
    }
}

impl Node {
    /// Keeps output `name` as its spilled runs. Like a memory-only
    /// object, it replaces any older file of that name on the device.
    fn hold_spilled(&self, name: &str, runs: Spilled) -> Result<()> {
        let _ = std::fs::remove_file(self.path(name)?);
        self.inner.lock().put(
            name,
            Held {
                spilled: Some(Arc::new(runs)),
                ..Held::default()
            },
        );
        Ok(())
    }

    /// Stores a primitive's output stream as `fragment.output`: in memory
    /// while it is under half the budget (an aggregate's groups), past that
    /// written as it comes, as a table object when the query materialises
    /// it, else as spilled runs ([`StreamSpill`]). Returns the time spent writing.
    async fn store_stream(
        &self,
        fragment: &Fragment,
        schema: &SchemaRef,
        mut out: BatchStream,
        mem: &WorkMemory,
        stats: &mut Stats,
    ) -> Result<Duration> {
        let mut kept = Vec::new();
        let mut kept_bytes = 0;
        let mut sink: Option<Sink> = None;
        let mut writing = Duration::ZERO;
        while let Some(b) = out.next().await {
            let b = b?;
            stats.rows_out += b.num_rows() as u64;
            let t = Instant::now();
            match &mut sink {
                Some(s) => s.write(&b)?,
                None => {
                    kept_bytes += data_bytes(&b);
                    kept.push(b);
                    if kept_bytes > mem.budget / 2 {
                        let mut s = if fragment.materialize {
                            Sink::Object(self.table_writer(&fragment.output, schema)?)
                        } else {
                            Sink::Run(Box::new(StreamSpill::new(schema, mem)))
                        };
                        for k in kept.drain(..) {
                            s.write(&k)?;
                        }
                        sink = Some(s);
                    }
                }
            }
            writing += t.elapsed();
        }
        drop(out);
        let t = Instant::now();
        match sink {
            None => {
                let placement = if fragment.materialize {
                    Placement::Device
                } else {
                    Placement::Memory
                };
                self.store_table(&fragment.output, schema, kept, placement, stats)?;
                return Ok(Duration::ZERO);
            }
            Some(Sink::Object(w)) => {
                let len = w.finish(false)?;
                writing += t.elapsed();
                self.charge(len, writing, stats);
                stats.bytes_written += len;
                // A held copy of an older output of this name is stale now.
                self.inner.lock().held.retain(|h| h.0 != fragment.output);
            }
            Some(Sink::Run(w)) => {
                let runs = w.into_spilled()?;
                writing += t.elapsed();
                self.hold_spilled(&fragment.output, runs)?;
            }
        }
        Ok(writing)
    }
}

/// Where an output too large for memory goes.
enum Sink {
    Object(TableWriter),
    Run(Box<StreamSpill>),
}

impl Sink {
    fn write(&mut self, b: &arrow::record_batch::RecordBatch) -> Result<()> {
        match self {
            Sink::Object(w) => w.write(b),
            Sink::Run(w) => w.write(b),
        }
    }
}

/// Where one input of a streamed fragment is.
enum Part {
    /// In the node's memory.
    Held,
    /// On the device as a table object.
    Device(RowBlocks),
    /// Spilled runs.
    Spilled(Arc<Spilled>),
}

/// Checks that an input's columns are the first input's (the first sets
/// them).
fn same_columns(
    first: &mut Option<SchemaRef>,
    s: &SchemaRef,
    name: &str,
    fragment: &Fragment,
) -> Result<()> {
    match first {
        Some(f) if f.fields() != s.fields() => Err(Error::Plan(format!(
            "{name} does not have {}'s columns",
            fragment.input
        ))),
        Some(_) => Ok(()),
        None => {
            *first = Some(s.clone());
            Ok(())
        }
    }
}

/// The blocks of spilled output `name`, projected to `columns` (all when
/// `None`); a deferred Scan's reads charged to `cost`.
fn project(
    sp: &Spilled,
    name: &str,
    columns: Option<&[String]>,
    cost: &Arc<Mutex<ReadCost>>,
) -> Result<(SchemaRef, BatchIter)> {
    let schema = sp.schema().clone();
    let Some(cols) = columns else {
        return Ok((schema, sp.blocks_charged(cost)?));
    };
    let idx = super::column_indices(&schema, cols, name)?;
    let out = Arc::new(schema.project(&idx)?);
    let blocks = sp.blocks_charged(cost)?.map(move |b| Ok(b?.project(&idx)?));
    Ok((out, Box::new(blocks)))
}

/// Removes spill files a process killed mid-primitive left in `dir`.
pub(super) fn clear_spills(dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(dir.join(SPILL_DIR));
}
