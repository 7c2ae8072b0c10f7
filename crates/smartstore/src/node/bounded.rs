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
//! ([`Node::defer`], [`Spilled::deferred`]): its compiled filter and
//! its inputs, held open, and the next primitive runs it as it reads. A
//! query over a node's share of `lineitem` at scale factor 10 then moves
//! no Scan output at all, where it wrote and read back about 250 MB.
//!
//! A Sort the query does not materialise is deferred the same way, over
//! any inputs, held in memory or not ([`Spilled::deferred_sort`]). Its
//! reader sorts as it reads, unless the reader's answer does not depend on
//! the order of its rows ([`bounded::ignores_order`]: Q1's AggGrpSort,
//! sums and counts of decimals grouped and sorted by their keys): then it
//! reads the Sort's input as it comes and no row is sorted. With the Scan
//! deferred as well, Q1 without checkpoints is one pass over `lineitem`
//! per node, filtered and aggregated as it is read, in a node's 64 MB as
//! in more. A node defers only where the fragment allows it
//! ([`Fragment::defer`]): the host allows it for queries without
//! checkpoints. With checkpoints every primitive runs where the paper's
//! plan puts it and its output is there for its checkpoint (section 4.2);
//! a checkpoint that ran a deferred primitive would read its input a
//! second time beside the next primitive (measured once, with the disk
//! model on the parity layout: checkpointed Q1 in 15.1 s instead of
//! 12.0). The host's fetch or a checkpoint of a deferred output still
//! works: it runs the primitive, outside the node's lock, charged to the
//! node's stats.
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
        // A spilled input (runs, or a deferred Scan or Sort) is read as
        // a stream of blocks, never loaded whole.
        total > self.inner.lock().budget as u64
            || parts.iter().any(|(_, p)| matches!(p, Part::Spilled(_)))
    }

    /// Defers `fragment` if it allows it and is a Sort, or a streaming
    /// Scan, whose output it does not materialise ([`Node::defer`]); else
    /// runs it within the node's memory when its inputs are larger than
    /// that (or one is spilled), streaming its inputs through it
    /// ([`Node::run_bounded`]). `None` when neither: the inputs fit and
    /// the caller loads them whole.
    pub(super) async fn run_streamed(
        &self,
        fragment: &Fragment,
        columns: Option<&[String]>,
        started: Instant,
        mut stats: Stats,
    ) -> Result<Option<Stats>> {
        let cost = Arc::new(Mutex::new(ReadCost::default()));
        let (parts, total) = self.input_parts(fragment, columns, &cost)?;
        let streams = self.streams(&parts, total);
        // A Sort is deferred whatever its inputs' size: its reader may not
        // need it run at all. A Scan only when it streams over inputs not
        // held in memory: over those it runs at once, as fast as its
        // reader would run it.
        let defers = fragment.defer
            && !fragment.materialize
            && match fragment.primitive {
                Primitive::Sort { .. } => true,
                Primitive::Scan { .. } => {
                    streams && !parts.iter().any(|(_, p)| matches!(p, Part::Held))
                }
                _ => false,
            };
        if defers {
            return self
                .defer(fragment, parts, total, columns, cost, started, stats)
                .map(Some);
        }
        if !streams {
            return Ok(None);
        }
        let inputs = self.streamed_inputs(fragment, parts, columns, cost, &mut stats)?;
        self.run_bounded(fragment, inputs, started, stats)
            .await
            .map(Some)
    }

    /// Defers a primitive that the fragment allows to be deferred and
    /// whose output it does not materialise: a Sort over any inputs, a
    /// Scan that streams over inputs none of which is held in memory. The
    /// node keeps the primitive itself ([`Spilled::deferred`],
    /// [`Spilled::deferred_sort`]) over its inputs as they are now (files
    /// held open; a held input's batches, counted in the node's memory
    /// while the deferred output lives), and its reader runs it as it
    /// reads: the next primitive, or the host's fetch. An aggregation that
    /// takes its rows in any order reads a deferred Sort's input unsorted.
    /// Returns the fragment's stats.
    #[allow(clippy::too_many_arguments)]
    fn defer(
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
        // Bytes of held inputs the deferred output keeps alive.
        let mut pinned = 0usize;
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
                    let s = projected(&sp, &name, columns)?.0;
                    let (cols, name) = (cols.clone(), name.clone());
                    let reopen: Reopen = Box::new(move |cost| {
                        Ok(project(&sp, &name, cols.as_deref(), cost, true)?.1)
                    });
                    (s, reopen)
                }
                // Held in memory: read from there (a Sort's input).
                Part::Held => {
                    let (s, b) = self.load_table(&name, columns, &mut stats)?;
                    pinned += b.iter().map(data_bytes).sum::<usize>();
                    let b = Arc::new(b);
                    let reopen: Reopen = Box::new(move |_| {
                        let b = b.clone();
                        Ok(Box::new((0..b.len()).map(move |i| Ok(b[i].clone()))) as BatchIter)
                    });
                    (s, reopen)
                }
            };
            same_columns(&mut schema, &s, &name, fragment)?;
            sources.push(source);
        }
        let schema = schema.expect("one input at least");
        let deferred = match &fragment.primitive {
            Primitive::Sort { keys } => {
                let mem = self.work_memory();
                Spilled::deferred_sort(schema, keys, sources, total, mem)?
            }
            _ => Spilled::deferred(
                ScanFilter::new(&fragment.primitive, &schema)?,
                sources,
                total,
            ),
        };
        self.hold_spilled(&fragment.output, deferred, pinned)?;
        let cost = std::mem::take(&mut *cost.lock());
        self.charge_reads(&cost, &mut stats);
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
        // A spilled input is read in any order (sorted runs one after
        // another, a deferred Sort unsorted) when the order cannot change
        // the answer.
        let mut ordered = true;
        for (name, part) in &parts {
            if let Part::Spilled(sp) = part {
                let s = projected(sp, name, columns)?.0;
                ordered = !bounded::ignores_order(&fragment.primitive, &s)?;
                break;
            }
        }
        for (name, part) in parts {
            let (s, b): (SchemaRef, BatchIter) = match part {
                Part::Device(r) => (r.schema().clone(), Box::new(r)),
                Part::Spilled(sp) => project(&sp, &name, columns, &cost, ordered)?,
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
        let mem = self.work_memory();
        let (schema, out) =
            bounded::run(&fragment.primitive, inputs.schema, inputs.blocks, &mem).await?;
        let mut writing = Duration::ZERO;
        match out {
            // Sorted runs the query does not materialise stay as they are:
            // the next primitive merges them as it reads.
            Output::Spilled(runs) if !fragment.materialize => {
                stats.rows_out = runs.rows();
                self.hold_spilled(&fragment.output, runs, 0)?;
            }
            out => {
                let out = out.into_stream()?;
                writing = self
                    .store_stream(fragment, &schema, out, &mem, &mut stats)
                    .await?;
            }
        }
        let cost = std::mem::take(&mut *inputs.cost.lock());
        self.charge_reads(&cost, &mut stats);
        stats.compute_s += started
            .elapsed()
            .saturating_sub(cost.time + writing)
            .as_secs_f64();
        Ok(stats)
    }
}

impl Node {
    /// The working memory a primitive gets: the node's budget, spilling
    /// to its `.spill` directory.
    fn work_memory(&self) -> WorkMemory {
        WorkMemory {
            budget: self.inner.lock().budget,
            spill_dir: self.dir.join(SPILL_DIR),
        }
    }

    /// Keeps output `name` as its spilled runs or deferred primitive,
    /// which keeps `pinned` bytes of memory alive (a deferred Sort's held
    /// input; counted against the node's memory like any held object).
    /// Like a memory-only object, it replaces any older file of that name
    /// on the device.
    fn hold_spilled(&self, name: &str, runs: Spilled, pinned: usize) -> Result<()> {
        let _ = std::fs::remove_file(self.path(name)?);
        self.inner.lock().put(
            name,
            Held {
                spilled: Some(Arc::new(runs)),
                bytes: pinned,
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
                self.hold_spilled(&fragment.output, runs, 0)?;
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

/// The schema of spilled output `name` projected to `columns` (all when
/// `None`), and the projected columns' indices.
fn projected(
    sp: &Spilled,
    name: &str,
    columns: Option<&[String]>,
) -> Result<(SchemaRef, Option<Vec<usize>>)> {
    let schema = sp.schema().clone();
    let Some(cols) = columns else {
        return Ok((schema, None));
    };
    let idx = super::column_indices(&schema, cols, name)?;
    Ok((Arc::new(schema.project(&idx)?), Some(idx)))
}

/// The blocks of spilled output `name`, projected to `columns` (all when
/// `None`), in order or, unless `ordered`, in any order
/// ([`Spilled::blocks_in_any_order`]); a deferred primitive's reads
/// charged to `cost`.
fn project(
    sp: &Spilled,
    name: &str,
    columns: Option<&[String]>,
    cost: &Arc<Mutex<ReadCost>>,
    ordered: bool,
) -> Result<(SchemaRef, BatchIter)> {
    let (schema, idx) = projected(sp, name, columns)?;
    let blocks = if ordered {
        sp.blocks_charged(cost)?
    } else {
        sp.blocks_in_any_order(cost)?
    };
    Ok(match idx {
        None => (schema, blocks),
        Some(idx) => (schema, Box::new(blocks.map(move |b| Ok(b?.project(&idx)?)))),
    })
}

/// Removes spill files a process killed mid-primitive left in `dir`.
pub(super) fn clear_spills(dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(dir.join(SPILL_DIR));
}
