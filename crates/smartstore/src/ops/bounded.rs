//! A primitive in a node's bounded working memory: streamed, and spilled
//! to the node's device where it must hold more than its memory.
//!
//! The smart-storage paper's nodes run each primitive on an embedded
//! processor with a small memory (64 MB in its section 5); a node's
//! partition is far larger, so a primitive cannot hold its input whole.
//! [`super::run`] does hold it: fast while a node's share fits its
//! memory, and at scale factor 10 (15 million rows a node) it needs about
//! 2.6 GB. [`run`] takes the input as a stream of row blocks (a stored
//! object read by [`crate::columnar::RowBlocks`]) and returns the output
//! as a stream, holding at most about [`WorkMemory::budget`] bytes:
//!
//! - **Scan** filters and projects block by block
//!   ([`super::scanfilter`]); it holds one block.
//! - **Sort** is an external merge sort. The input is cut into chunks of a
//!   quarter of the budget; each chunk is sorted in memory, stably (Q1's
//!   dictionary keys by the bucketed [`crate::ranksort`], other keys by
//!   arrow's row format, with no task or plan) and spilled as a sorted
//!   run, an Arrow IPC stream
//!   file in the spill directory, its integer-backed columns narrowed to
//!   the chunk's range ([`crate::codec::narrow`], widened bit-exact when
//!   read) and its batches [`RUN_BATCH_ROWS`] long. The runs are then
//!   merged ([`Merge`]): a stable k-way merge over arrow's row format,
//!   which emits the longest stretch of the leading run that sorts before
//!   every other run's head in one slice, found by galloping. A stable
//!   chunk sort makes the whole sort stable; runs with key-constant
//!   batches (ranksort's buckets) merge a batch at a time. When more runs
//!   are cut than the budget holds a batch of each, only as many adjacent
//!   runs are merged into longer runs first as it takes.
//! - **AggGrpSort** whose aggregates combine (Q1's sums and counts, and
//!   minima and maxima) aggregates a chunk at a time in memory and
//!   combines the partial rows ([`aggregate_by_chunks`]): memory holds a
//!   chunk and one row per group.
//! - **AggGrpSort** with an average is DataFusion's grouped aggregation and sort over the
//!   streaming source, under a memory pool of the budget with the spill
//!   directory for its temporary files (at least [`MIN_POOL`]; DataFusion
//!   spills its sort and,
//!   where it can, its aggregation state there; an aggregation whose
//!   groups cannot fit and cannot spill is refused with DataFusion's
//!   "resources exhausted" error, never answered wrong).
//!
//! A Sort need not run where it is asked for: [`Spilled::deferred_sort`]
//! keeps its input and keys, and its reader sorts as it reads, or, when
//! the reader's answer does not depend on the order of its rows
//! ([`ignores_order`]), reads the input unsorted
//! ([`Spilled::blocks_in_any_order`]).
//!
//! The budget bounds what these steps hold; a node adds its runtime, one
//! read chunk per input column ([`crate::columnar::READ_CHUNK`]) and one
//! write buffer per output column. Spill files are removed when the step
//! that wrote them ends, successfully or not.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::compute::{SortOptions, concat_batches};
use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use arrow::record_batch::{RecordBatch, RecordBatchOptions};
use arrow::row::{RowConverter, Rows, SortField};
use datafusion::catalog::streaming::StreamingTable;
use datafusion::error::DataFusionError;
use datafusion::execution::TaskContext;
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::prelude::SessionContext;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::BATCH_ROWS;
use super::scanfilter::ScanFilter;
use crate::batch::data_bytes;
use crate::devmodel::ReadCost;
use crate::error::{Error, Result};
use crate::plan::{AggFunc, Aggregate, Primitive, SortKey, Value};
use parking_lot::Mutex;

/// A primitive's input: row blocks, each a `Result` (a damaged input
/// ends with an error).
pub type BatchIter = Box<dyn Iterator<Item = Result<RecordBatch>> + Send>;

/// A primitive's output, produced as it is consumed.
pub type BatchStream = BoxStream<'static, Result<RecordBatch>>;

/// The working memory a primitive may hold, and where it spills.
#[derive(Debug, Clone)]
pub struct WorkMemory {
    /// Bytes of row data the primitive holds at most (at least one row
    /// block, whatever this says).
    pub budget: usize,
    /// Directory for spill files (created when first needed).
    pub spill_dir: PathBuf,
}

/// An external sort cuts its input into chunks of `budget /` this.
const CHUNKS_PER_BUDGET: usize = 4;

/// Smallest memory pool DataFusion's operators get: a grouped aggregation
/// reserves a few batches' worth of hash table before it can spill (about
/// 80 KB for 16,384-row batches), and a pool below that refuses even a
/// handful of groups.
const MIN_POOL: usize = 4 << 20;

/// Most runs merged at once, whatever the budget.
const MAX_FAN_IN: usize = 1024;

/// Rows in a sorted run's batches. A merge holds one batch of each run,
/// so runs of smaller batches merge more at once (a quarter of
/// [`BATCH_ROWS`]: at 64 MB a merge reads 230 runs of Q1's Scan output,
/// the 60 a node cuts at scale factor 10 in one pass).
const RUN_BATCH_ROWS: usize = BATCH_ROWS / 4;

/// Runs `primitive` over `input` (row blocks of `schema`) within `mem`;
/// returns the output's schema and the output: a stream, its input read
/// as it is consumed, or a Sort's runs, spilled once its input was read
/// whole and merged as they are read.
pub async fn run(
    primitive: &Primitive,
    schema: SchemaRef,
    input: BatchIter,
    mem: &WorkMemory,
) -> Result<(SchemaRef, Output)> {
    match primitive {
        Primitive::Scan { .. } => {
            let filter = ScanFilter::new(primitive, &schema)?;
            let out = filter.schema().clone();
            let blocks = input.map(move |b| filter.apply(&b?));
            Ok((out, Output::Stream(futures::stream::iter(blocks).boxed())))
        }
        Primitive::Sort { keys } => {
            let order = Order::new(&schema, keys)?;
            let chunk = mem.budget / CHUNKS_PER_BUDGET;
            let (schema, sorted) = sort(schema, &order, input, mem, chunk)?;
            Ok((
                schema,
                match sorted {
                    Sorted::Whole(b) => {
                        Output::Stream(futures::stream::iter(b.into_iter().map(Ok)).boxed())
                    }
                    Sorted::Runs(runs) => Output::Spilled(runs),
                },
            ))
        }
        Primitive::AggGrpSort {
            group_by,
            aggregates,
        } if aggregates.iter().all(|a| a.func != AggFunc::Avg) => {
            let (schema, out) =
                aggregate_by_chunks(schema, group_by, aggregates, input, mem).await?;
            let out = futures::stream::iter(out.into_iter().map(Ok)).boxed();
            Ok((schema, Output::Stream(out)))
        }
        _ => {
            let (schema, out) = through_datafusion(primitive, schema, input, mem).await?;
            Ok((schema, Output::Stream(out)))
        }
    }
}

/// What a primitive in bounded memory produced.
#[allow(missing_debug_implementations)] // a stream has no Debug
pub enum Output {
    /// Batches, produced as they are consumed.
    Stream(BatchStream),
    /// Sorted runs on the device, merged as they are read.
    Spilled(Spilled),
}

impl Output {
    /// The output as a stream of batches (a spilled one merged).
    pub fn into_stream(self) -> Result<BatchStream> {
        Ok(match self {
            Output::Stream(s) => s,
            Output::Spilled(s) => futures::stream::iter(s.blocks()?).boxed(),
        })
    }
}

/// AggGrpSort whose aggregates combine (sums, counts, minima, maxima):
/// each chunk of the input is aggregated in memory by [`super::run`] (so
/// Q1's sums keep their exact integer path), and the partial rows so far
/// are aggregated again with each chunk's (sums and counts summed, minima
/// and maxima of minima and maxima), so memory holds a chunk and one row
/// per group. Groups whose rows outgrow half the budget are refused.
async fn aggregate_by_chunks(
    schema: SchemaRef,
    group_by: &[String],
    aggregates: &[Aggregate],
    input: BatchIter,
    mem: &WorkMemory,
) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let bundle = Primitive::AggGrpSort {
        group_by: group_by.to_vec(),
        aggregates: aggregates.to_vec(),
    };
    let combining: Vec<Aggregate> = aggregates
        .iter()
        .map(|a| Aggregate {
            func: match a.func {
                AggFunc::Count | AggFunc::Sum => AggFunc::Sum,
                f => f,
            },
            arg: Value::col(&a.name),
            name: a.name.clone(),
        })
        .collect();
    let combine = Primitive::AggGrpSort {
        group_by: group_by.to_vec(),
        aggregates: combining.clone(),
    };
    // Both are planned once, not once a chunk.
    let chunk_bytes = (mem.budget / CHUNKS_PER_BUDGET).max(1);
    let bundle_schema = super::agg_schema(&schema, group_by, aggregates)?;
    let mut combine_schema: Option<SchemaRef> = None;
    let mut partial: Option<(SchemaRef, Vec<RecordBatch>)> = None;
    let mut chunk = Vec::new();
    let mut bytes = 0;
    let mut input = input.peekable();
    while let Some(b) = input.next() {
        let b = b?;
        bytes += data_bytes(&b);
        chunk.push(b);
        if bytes < chunk_bytes && input.peek().is_some() {
            continue;
        }
        let chunk = std::mem::take(&mut chunk);
        let (ps, rows) =
            super::aggregate_planned(&bundle, schema.clone(), chunk, &bundle_schema).await?;
        bytes = 0;
        let rows = match partial.take() {
            None => rows,
            Some((_, mut before)) => {
                before.extend(rows);
                let want = match &combine_schema {
                    Some(w) => w.clone(),
                    None => combine_schema
                        .insert(super::agg_schema(&ps, group_by, &combining)?)
                        .clone(),
                };
                let (_, again) =
                    super::aggregate_planned(&combine, ps.clone(), before, &want).await?;
                again
                    .iter()
                    .map(|b| retype(b, &ps))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let held: usize = rows.iter().map(data_bytes).sum();
        if held > mem.budget / 2 {
            return Err(Error::Invalid(format!(
                "the groups of an AggGrpSort outgrow the node's working memory \
                 ({held} bytes of partial aggregates, budget {})",
                mem.budget
            )));
        }
        partial = Some((ps, rows));
    }
    match partial {
        Some(p) => Ok(p),
        // No rows at all: the in-memory bundle's answer to none.
        None => super::run(&bundle, schema, Vec::new()).await,
    }
}

/// `b`'s columns cast to `to`'s types (a sum of sums comes back wider than
/// the sum it combines).
fn retype(b: &RecordBatch, to: &SchemaRef) -> Result<RecordBatch> {
    let cols = b
        .columns()
        .iter()
        .zip(to.fields())
        .map(|(c, f)| Ok(arrow::compute::cast(c, f.data_type())?))
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(to.clone(), cols)?)
}

/// AggGrpSort with an average: DataFusion's plan of the primitive over a
/// streaming source, under a memory pool of the budget.
async fn through_datafusion(
    primitive: &Primitive,
    schema: SchemaRef,
    input: BatchIter,
    mem: &WorkMemory,
) -> Result<(SchemaRef, BatchStream)> {
    std::fs::create_dir_all(&mem.spill_dir).map_err(|e| Error::io(&mem.spill_dir, e))?;
    let pool = mem.budget.max(MIN_POOL);
    let runtime = RuntimeEnvBuilder::new()
        .with_memory_pool(Arc::new(FairSpillPool::new(pool)))
        .with_temp_file_path(&mem.spill_dir)
        .build_arc()?;
    // A sort keeps this much back for merging what it spilled (10 MB by
    // default, more than a small pool holds).
    let config = super::config().set_usize(
        "datafusion.execution.sort_spill_reservation_bytes",
        pool / 4,
    );
    let ctx = SessionContext::new_with_config_rt(config, runtime);
    let source = OneShot {
        schema: schema.clone(),
        input: Mutex::new(Some(input)),
    };
    let table = StreamingTable::try_new(schema.clone(), vec![Arc::new(source)])?;
    let df = super::apply(primitive, ctx.read_table(Arc::new(table))?, &schema)?;
    let out_schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
    let stream = df.execute_stream().await?;
    Ok((out_schema, stream.map(|r| r.map_err(Error::from)).boxed()))
}

/// A streaming source that hands DataFusion the input once.
struct OneShot {
    schema: SchemaRef,
    input: Mutex<Option<BatchIter>>,
}

impl std::fmt::Debug for OneShot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OneShot").finish_non_exhaustive()
    }
}

impl PartitionStream for OneShot {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let stream = match self.input.lock().take() {
            Some(input) => futures::stream::iter(
                input.map(|r| r.map_err(|e| DataFusionError::External(Box::new(e)))),
            )
            .boxed(),
            None => futures::stream::once(async {
                Err(DataFusionError::Internal(
                    "a primitive's input was read twice".into(),
                ))
            })
            .boxed(),
        };
        Box::pin(RecordBatchStreamAdapter::new(self.schema.clone(), stream))
    }
}

/// The Sort primitive as an external merge sort (see the module docs).
/// Chunks are cut at `chunk_bytes` (a quarter of the budget, or all of it
/// for an input known to fit it, which is then sorted whole).
fn sort(
    schema: SchemaRef,
    order: &Order,
    input: BatchIter,
    mem: &WorkMemory,
    chunk_bytes: usize,
) -> Result<(SchemaRef, Sorted)> {
    let chunk_bytes = chunk_bytes.max(1);
    let mut runs = Vec::new();
    let (mut rows, mut total) = (0u64, 0u64);
    let mut chunk = Vec::new();
    let mut bytes = 0;
    for b in input {
        let b = b?;
        if b.num_rows() == 0 {
            continue;
        }
        bytes += data_bytes(&b);
        rows += b.num_rows() as u64;
        chunk.push(b);
        if bytes >= chunk_bytes {
            let sorted = order.sort_chunk(&schema, &std::mem::take(&mut chunk))?;
            runs.push(Run::write_narrowed(&mem.spill_dir, &schema, &sorted)?);
            total += bytes as u64;
            bytes = 0;
        }
    }
    let last = if chunk.is_empty() {
        Vec::new()
    } else {
        order.sort_chunk(&schema, &chunk)?
    };
    if runs.is_empty() {
        // It fit one chunk: nothing was spilled.
        return Ok((schema, Sorted::Whole(last)));
    }
    total += bytes as u64;
    if !last.is_empty() {
        runs.push(Run::write_narrowed(&mem.spill_dir, &schema, &last)?);
    }
    let runs = fewer_runs(&schema, order, runs, mem)?;
    let spilled = Spilled {
        schema: schema.clone(),
        form: Form::Runs {
            runs,
            order: Some(order.clone()),
        },
        rows,
        bytes: total,
    };
    Ok((schema, Sorted::Runs(spilled)))
}

/// What the external sort produced: its input sorted in memory when it
/// fit one chunk, else sorted runs to merge.
enum Sorted {
    Whole(Vec<RecordBatch>),
    Runs(Spilled),
}

/// Merges groups of adjacent `runs` into longer runs while there are
/// more than the budget holds a batch of each, so that one merge reads
/// them all. Each merge takes only as many runs as it must (the first
/// takes `runs - fan_in + 1` when that is under the fan-in), so a sort
/// a few runs over the fan-in rewrites a few runs, not all of them.
/// Merging adjacent runs in place keeps the sort stable: a merge gives
/// ties to the earlier run.
fn fewer_runs(
    schema: &SchemaRef,
    order: &Order,
    runs: Vec<Run>,
    mem: &WorkMemory,
) -> Result<Vec<Arc<Run>>> {
    let widest = runs.iter().map(|r| r.widest).max().unwrap_or(1).max(1);
    let fan_in = (mem.budget / 2 / widest).clamp(2, MAX_FAN_IN);
    let mut runs: Vec<Arc<Run>> = runs.into_iter().map(Arc::new).collect();
    let mut at = 0;
    while runs.len() > fan_in {
        let k = fan_in.min(runs.len() - fan_in + 1);
        if at + k > runs.len() {
            // The next level: merged runs are merged again.
            at = 0;
        }
        let group: Vec<Arc<Run>> = runs.drain(at..at + k).collect();
        let merged = Merge::new(schema.clone(), order.clone(), group)?;
        runs.insert(at, Arc::new(Run::write(&mem.spill_dir, schema, merged)?));
        at += 1;
    }
    Ok(runs)
}

/// The sort keys by column index (as [`crate::ranksort`] takes them) and
/// as arrow's row format orders them: a converter of their values to
/// comparable rows.
#[derive(Debug, Clone)]
struct Order {
    keys: Vec<crate::ranksort::Key>,
    fields: Vec<SortField>,
}

impl Order {
    fn new(schema: &SchemaRef, keys: &[SortKey]) -> Result<Order> {
        let mut by_index = Vec::with_capacity(keys.len());
        let mut fields = Vec::with_capacity(keys.len());
        for k in keys {
            let i = schema
                .index_of(&k.column)
                .map_err(|_| Error::Plan(format!("unknown column {:?}", k.column)))?;
            by_index.push(crate::ranksort::Key {
                column: i,
                descending: k.descending,
            });
            // As the Sort primitive orders: nulls last either way.
            fields.push(SortField::new_with_options(
                schema.field(i).data_type().clone(),
                SortOptions {
                    descending: k.descending,
                    nulls_first: false,
                },
            ));
        }
        Ok(Order {
            keys: by_index,
            fields,
        })
    }

    fn converter(&self) -> Result<RowConverter> {
        Ok(RowConverter::new(self.fields.clone())?)
    }

    fn rows(&self, converter: &RowConverter, b: &RecordBatch) -> Result<Rows> {
        let cols: Vec<_> = self
            .keys
            .iter()
            .map(|k| b.column(k.column).clone())
            .collect();
        Ok(converter.convert_columns(&cols)?)
    }

    /// A chunk sorted stably, in batches of [`BATCH_ROWS`]: by the
    /// bucketed [`crate::ranksort`] where it applies (Q1's dictionary
    /// keys), else by the keys' row format, the row's place in the chunk
    /// breaking ties.
    fn sort_chunk(&self, schema: &SchemaRef, chunk: &[RecordBatch]) -> Result<Vec<RecordBatch>> {
        if let Some(sorted) = crate::ranksort::sort(schema, chunk, &self.keys, BATCH_ROWS)? {
            return Ok(sorted);
        }
        let all = concat_batches(schema, chunk)?;
        let rows = self.rows(&self.converter()?, &all)?;
        let mut order: Vec<u32> = (0..all.num_rows() as u32).collect();
        // `sort_by` is stable.
        order.sort_by(|&a, &b| rows.row(a as usize).cmp(&rows.row(b as usize)));
        let order = arrow::array::UInt32Array::from(order);
        let mut out = Vec::with_capacity(all.num_rows().div_ceil(BATCH_ROWS));
        let mut at = 0;
        while at < order.len() {
            let len = BATCH_ROWS.min(order.len() - at);
            out.push(arrow::compute::take_record_batch(
                &all,
                &order.slice(at, len),
            )?);
            at += len;
        }
        Ok(out)
    }
}

/// Numbers spill files apart within the process.
static SPILLS: AtomicU64 = AtomicU64::new(0);

/// A sorted run spilled to a file, removed when dropped.
#[derive(Debug)]
struct Run {
    path: PathBuf,
    /// Bytes of its largest batch (as it is in memory, read back).
    widest: usize,
    /// The schema its batches are read back as, when the file stores some
    /// of their columns narrowed ([`Run::write_narrowed`]); `None` when
    /// it stores them as they are.
    wide: Option<SchemaRef>,
}

impl Run {
    /// Writes `batches` (of `schema`) as a run in `dir`.
    fn write(
        dir: &Path,
        schema: &SchemaRef,
        batches: impl IntoIterator<Item = Result<RecordBatch>>,
    ) -> Result<Run> {
        let mut w = RunWriter::create(dir, schema)?;
        for b in batches {
            w.write(&b?)?;
        }
        w.finish()
    }

    /// Writes a chunk held whole in memory as a run, its integer-backed
    /// columns narrowed to the chunk's range ([`crate::codec::narrow`]):
    /// Q1's four decimals take 8 bytes a row on the device instead of 32,
    /// so a quarter of the bytes cross the page cache twice. Read back
    /// bit-exact ([`RunReader`] widens them).
    fn write_narrowed(dir: &Path, schema: &SchemaRef, batches: &[RecordBatch]) -> Result<Run> {
        let batches: Vec<RecordBatch> = batches
            .iter()
            .flat_map(|b| {
                (0..b.num_rows())
                    .step_by(RUN_BATCH_ROWS)
                    .map(|at| b.slice(at, RUN_BATCH_ROWS.min(b.num_rows() - at)))
            })
            .collect();
        let batches = &batches[..];
        let mut fields = Vec::with_capacity(schema.fields().len());
        let mut columns: Vec<Vec<arrow::array::ArrayRef>> = Vec::with_capacity(fields.capacity());
        let mut narrowed = false;
        for (i, f) in schema.fields().iter().enumerate() {
            let blocks: Vec<_> = batches.iter().map(|b| b.column(i).clone()).collect();
            match crate::codec::narrow(f, &blocks)? {
                Some((stored, blocks)) => {
                    narrowed = true;
                    fields.push(stored);
                    columns.push(blocks);
                }
                None => {
                    fields.push(f.clone());
                    columns.push(blocks);
                }
            }
        }
        if !narrowed {
            return Run::write(dir, schema, batches.iter().cloned().map(Ok));
        }
        let stored = Arc::new(arrow::datatypes::Schema::new_with_metadata(
            fields,
            schema.metadata().clone(),
        ));
        let mut w = RunWriter::create(dir, &stored)?;
        for (k, b) in batches.iter().enumerate() {
            let cols = columns.iter().map(|c| c[k].clone()).collect();
            let options = RecordBatchOptions::new().with_row_count(Some(b.num_rows()));
            let n = RecordBatch::try_new_with_options(stored.clone(), cols, &options)?;
            w.write_counted(&n, data_bytes(b))?;
        }
        let mut run = w.finish()?;
        run.wide = Some(schema.clone());
        Ok(run)
    }
}

/// A run being written, batch by batch.
struct RunWriter {
    run: Run,
    writer: StreamWriter<BufWriter<File>>,
}

impl RunWriter {
    /// Starts a run of `schema` in `dir` (created if missing).
    fn create(dir: &Path, schema: &SchemaRef) -> Result<RunWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let n = SPILLS.fetch_add(1, Ordering::Relaxed);
        let run = Run {
            path: dir.join(format!("run-{}-{n}.arrows", std::process::id())),
            widest: 0,
            wide: None,
        };
        let file = File::create(&run.path).map_err(|e| Error::io(&run.path, e))?;
        let writer = StreamWriter::try_new(BufWriter::with_capacity(1 << 20, file), schema)?;
        Ok(RunWriter { run, writer })
    }

    /// Appends a batch.
    fn write(&mut self, b: &RecordBatch) -> Result<()> {
        self.write_counted(b, data_bytes(b))
    }

    /// Appends a batch that takes `bytes` in memory once read back.
    fn write_counted(&mut self, b: &RecordBatch, bytes: usize) -> Result<()> {
        self.run.widest = self.run.widest.max(bytes);
        Ok(self.writer.write(b)?)
    }

    fn finish(mut self) -> Result<Run> {
        self.writer.finish()?;
        self.writer
            .get_mut()
            .flush()
            .map_err(|e| Error::io(&self.run.path, e))?;
        Ok(self.run)
    }
}

/// A stream spilled as it is produced (an output larger than the node's
/// memory that the query does not materialise): cut into chunks of a
/// quarter of the budget, each written as a run with its columns narrowed
/// to the chunk's range ([`Run::write_narrowed`]), and read back in order.
#[derive(Debug)]
pub struct StreamSpill {
    schema: SchemaRef,
    dir: PathBuf,
    chunk_bytes: usize,
    chunk: Vec<RecordBatch>,
    held: usize,
    runs: Vec<Arc<Run>>,
    rows: u64,
    bytes: u64,
}

impl StreamSpill {
    /// Starts spilling a stream of `schema` within `mem`.
    pub fn new(schema: &SchemaRef, mem: &WorkMemory) -> StreamSpill {
        StreamSpill {
            schema: schema.clone(),
            dir: mem.spill_dir.clone(),
            chunk_bytes: (mem.budget / CHUNKS_PER_BUDGET).max(1),
            chunk: Vec::new(),
            held: 0,
            runs: Vec::new(),
            rows: 0,
            bytes: 0,
        }
    }

    /// Appends a batch.
    pub fn write(&mut self, b: &RecordBatch) -> Result<()> {
        let bytes = data_bytes(b);
        self.rows += b.num_rows() as u64;
        self.bytes += bytes as u64;
        self.held += bytes;
        self.chunk.push(b.clone());
        if self.held >= self.chunk_bytes {
            self.cut()?;
        }
        Ok(())
    }

    fn cut(&mut self) -> Result<()> {
        let chunk = std::mem::take(&mut self.chunk);
        self.held = 0;
        if !chunk.is_empty() {
            let run = Run::write_narrowed(&self.dir, &self.schema, &chunk)?;
            self.runs.push(Arc::new(run));
        }
        Ok(())
    }

    /// Ends the stream: the output it holds, read back as written.
    pub fn into_spilled(mut self) -> Result<Spilled> {
        self.cut()?;
        Ok(Spilled {
            schema: self.schema,
            form: Form::Runs {
                runs: self.runs,
                order: None,
            },
            rows: self.rows,
            bytes: self.bytes,
        })
    }
}

/// A primitive's output that the query does not materialise, kept in the
/// form its reader takes instead of as a table: a Sort's sorted runs on
/// the device, merged as they are read ([`Spilled::blocks`]), the runs of
/// a spilled stream ([`StreamSpill`]), or a primitive not run yet, over
/// its inputs as they were: a Scan ([`Spilled::deferred`]) or a Sort
/// ([`Spilled::deferred_sort`]). Written once or not at all, and removed
/// with its last reader.
pub struct Spilled {
    schema: SchemaRef,
    form: Form,
    rows: u64,
    bytes: u64,
}

enum Form {
    /// Runs on the device, merged when read if they have an order.
    Runs {
        runs: Vec<Arc<Run>>,
        order: Option<Order>,
    },
    /// A Scan or a Sort run by whoever reads it, over its sources as they
    /// were when it was deferred.
    Deferred { sources: Vec<Reopen>, step: Step },
}

/// The primitive a deferred output runs when it is read.
enum Step {
    /// Filter and project each block.
    Scan(ScanFilter),
    /// Sort the whole input (an external sort within `mem`), unless the
    /// reader takes its rows in any order.
    Sort { order: Order, mem: WorkMemory },
}

/// A deferred Scan's or Sort's source: its row blocks, from the start,
/// each time it is called; reads charged to the cost given.
pub type Reopen = Box<dyn Fn(&Arc<Mutex<ReadCost>>) -> Result<BatchIter> + Send + Sync>;

impl std::fmt::Debug for Spilled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Spilled");
        match &self.form {
            Form::Runs { runs, .. } => d.field("runs", &runs.len()),
            Form::Deferred {
                sources,
                step: Step::Scan(_),
            } => d.field("deferred scan over", &sources.len()),
            Form::Deferred {
                sources,
                step: Step::Sort { .. },
            } => d.field("deferred sort over", &sources.len()),
        };
        d.field("rows", &self.rows).finish_non_exhaustive()
    }
}

impl Spilled {
    /// A Scan whose output would only be spilled and read once, kept
    /// instead as what it reads and how: `filter` over the blocks of
    /// `sources`, in order, run by the primitive that reads the output
    /// (each read runs it afresh). Nothing is written; the bytes the
    /// Scan would have written and the next primitive read back are
    /// never moved. `bytes` is its input's size, the bound on its
    /// output's.
    pub fn deferred(filter: ScanFilter, sources: Vec<Reopen>, bytes: u64) -> Spilled {
        Spilled {
            schema: filter.schema().clone(),
            form: Form::Deferred {
                sources,
                step: Step::Scan(filter),
            },
            rows: 0,
            bytes,
        }
    }

    /// A Sort kept as its `sources` (of `schema`) and `keys`: each reader
    /// sorts as it reads ([`Spilled::blocks`]: in memory when the input's
    /// `bytes` fit `mem`'s budget, else an external sort within it), or,
    /// when it takes rows in any order ([`ignores_order`]), reads the
    /// sources as they are ([`Spilled::blocks_in_any_order`]) and no row
    /// is sorted. Fails on a key the schema lacks.
    pub fn deferred_sort(
        schema: SchemaRef,
        keys: &[SortKey],
        sources: Vec<Reopen>,
        bytes: u64,
        mem: WorkMemory,
    ) -> Result<Spilled> {
        let order = Order::new(&schema, keys)?;
        Ok(Spilled {
            schema,
            form: Form::Deferred {
                sources,
                step: Step::Sort { order, mem },
            },
            rows: 0,
            bytes,
        })
    }

    /// Whether this is a primitive not run yet.
    pub fn is_deferred(&self) -> bool {
        matches!(self.form, Form::Deferred { .. })
    }

    /// The output's schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Its rows (0 when deferred: not known until it runs).
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes of its rows' data (as they would be in memory); when
    /// deferred, of its input.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its row blocks, in order (a merge of sorted runs, or a deferred
    /// primitive run).
    pub fn blocks(&self) -> Result<BatchIter> {
        self.blocks_charged(&Arc::new(Mutex::new(ReadCost::default())))
    }

    /// [`Spilled::blocks`], a deferred primitive's reads charged to `cost`.
    pub fn blocks_charged(&self, cost: &Arc<Mutex<ReadCost>>) -> Result<BatchIter> {
        let (runs, order) = match &self.form {
            Form::Runs { runs, order } => (runs, order),
            Form::Deferred { sources, step } => {
                let input = Self::open_sources(sources, cost)?;
                return match step {
                    Step::Scan(filter) => {
                        let filter = filter.clone();
                        Ok(Box::new(input.map(move |b| filter.apply(&b?))))
                    }
                    Step::Sort { order, mem } => {
                        // An input that fits the budget is sorted whole,
                        // as the Sort would have sorted it in memory.
                        let chunk = if self.bytes <= mem.budget as u64 {
                            mem.budget
                        } else {
                            mem.budget / CHUNKS_PER_BUDGET
                        };
                        match sort(self.schema.clone(), order, input, mem, chunk)?.1 {
                            Sorted::Whole(b) => Ok(Box::new(b.into_iter().map(Ok))),
                            Sorted::Runs(runs) => runs.blocks(),
                        }
                    }
                };
            }
        };
        if let Some(order) = order
            && runs.len() > 1
        {
            return Ok(Box::new(Merge::new(
                self.schema.clone(),
                order.clone(),
                runs.clone(),
            )?));
        }
        Ok(Self::runs_in_turn(runs))
    }

    /// All its rows, in an order that may not be [`Spilled::blocks`]'s:
    /// sorted runs read one after the other instead of merged, a deferred
    /// Sort's input as it comes instead of sorted. For a reader whose
    /// answer does not depend on the order of its input
    /// ([`ignores_order`]).
    pub fn blocks_in_any_order(&self, cost: &Arc<Mutex<ReadCost>>) -> Result<BatchIter> {
        match &self.form {
            Form::Runs { runs, .. } => Ok(Self::runs_in_turn(runs)),
            Form::Deferred {
                sources,
                step: Step::Sort { .. },
            } => Self::open_sources(sources, cost),
            Form::Deferred { .. } => self.blocks_charged(cost),
        }
    }

    /// A deferred primitive's sources' blocks, one source after another.
    fn open_sources(sources: &[Reopen], cost: &Arc<Mutex<ReadCost>>) -> Result<BatchIter> {
        let inputs = sources
            .iter()
            .map(|open| open(cost))
            .collect::<Result<Vec<_>>>()?;
        Ok(Box::new(inputs.into_iter().flatten()))
    }

    /// The batches of `runs`, one run after another.
    fn runs_in_turn(runs: &[Arc<Run>]) -> BatchIter {
        let runs = runs.to_vec();
        Box::new(
            runs.into_iter()
                .map(|r| read_run(&r).map(|it| (r, it)))
                .flat_map(|opened| -> BatchIter {
                    match opened {
                        // The run stays while its reader lives.
                        Ok((run, reader)) => Box::new(reader.inspect(move |_| {
                            let _keep = &run;
                        })),
                        Err(e) => Box::new(std::iter::once(Err(e))),
                    }
                }),
        )
    }
}

/// Whether `primitive`'s answer over input of `schema` is the same
/// whatever the order of its input rows: an AggGrpSort whose aggregates
/// are counts, and sums, minima and maxima of values that are not floating
/// point (whose sums depend on the order they are added in). Its output
/// is sorted by its group keys either way. Such a reader of a deferred
/// Sort skips the sort ([`Spilled::blocks_in_any_order`]).
pub fn ignores_order(primitive: &Primitive, schema: &SchemaRef) -> Result<bool> {
    let Primitive::AggGrpSort {
        group_by,
        aggregates,
    } = primitive
    else {
        return Ok(false);
    };
    if aggregates.iter().any(|a| a.func == AggFunc::Avg) {
        return Ok(false);
    }
    let out = super::agg_schema(schema, group_by, aggregates)?;
    Ok(aggregates
        .iter()
        .zip(&out.fields()[group_by.len()..])
        .all(|(a, f)| a.func == AggFunc::Count || !f.data_type().is_floating()))
}

/// A reader of a run's batches.
fn read_run(run: &Run) -> Result<RunReader> {
    let file = File::open(&run.path).map_err(|e| Error::io(&run.path, e))?;
    let reader = StreamReader::try_new(BufReader::with_capacity(1 << 20, file), None)
        .map_err(|e| Error::object(&run.path, format!("spilled run: {e}")))?;
    Ok(RunReader {
        reader,
        wide: run.wide.clone(),
        path: run.path.clone(),
    })
}

/// A run's batches as they were before it was written: narrowed columns
/// widened back.
struct RunReader {
    reader: StreamReader<BufReader<File>>,
    wide: Option<SchemaRef>,
    path: PathBuf,
}

impl RunReader {
    fn widen(&self, b: RecordBatch) -> Result<RecordBatch> {
        let Some(wide) = &self.wide else {
            return Ok(b);
        };
        let stored = b.schema();
        let cols = wide
            .fields()
            .iter()
            .zip(stored.fields())
            .zip(b.columns())
            .map(|((want, have), c)| {
                crate::codec::widen(want, have, c.clone())
                    .map_err(|e| Error::object(&self.path, format!("spilled run: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(b.num_rows()));
        Ok(RecordBatch::try_new_with_options(
            wide.clone(),
            cols,
            &options,
        )?)
    }
}

impl Iterator for RunReader {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Result<RecordBatch>> {
        let b = self.reader.next()?;
        Some(
            b.map_err(|e| Error::object(&self.path, format!("spilled run: {e}")))
                .and_then(|b| self.widen(b)),
        )
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One run being merged: its current batch and where in it.
struct Cursor {
    reader: RunReader,
    batch: RecordBatch,
    rows: Rows,
    pos: usize,
    /// Keeps the run (and its file) while it is read.
    _run: Arc<Run>,
}

impl Cursor {
    /// A cursor at the run's first row; `None` for an empty run.
    fn open(run: Arc<Run>, order: &Order, converter: &RowConverter) -> Result<Option<Cursor>> {
        let reader = read_run(&run)?;
        let mut c = Cursor {
            reader,
            batch: RecordBatch::new_empty(Arc::new(arrow::datatypes::Schema::empty())),
            rows: converter.empty_rows(0, 0),
            pos: 0,
            _run: run,
        };
        Ok(c.next_batch(order, converter)?.then_some(c))
    }

    /// Moves to the run's next non-empty batch; false at its end.
    fn next_batch(&mut self, order: &Order, converter: &RowConverter) -> Result<bool> {
        for b in self.reader.by_ref() {
            let b = b?;
            if b.num_rows() == 0 {
                continue;
            }
            self.rows = order.rows(converter, &b)?;
            self.batch = b;
            self.pos = 0;
            return Ok(true);
        }
        Ok(false)
    }
}

/// A stable k-way merge of sorted runs (see the module docs); yields
/// batches of at most [`BATCH_ROWS`] rows.
struct Merge {
    schema: SchemaRef,
    order: Order,
    converter: RowConverter,
    /// One per run, in input order (ties go to the earlier run); `None`
    /// once a run is exhausted.
    cursors: Vec<Option<Cursor>>,
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    failed: bool,
}

impl Merge {
    fn new(schema: SchemaRef, order: Order, runs: Vec<Arc<Run>>) -> Result<Merge> {
        let converter = order.converter()?;
        let cursors = runs
            .into_iter()
            .map(|r| Cursor::open(r, &order, &converter))
            .collect::<Result<Vec<_>>>()?;
        Ok(Merge {
            schema,
            order,
            converter,
            cursors,
            pending: Vec::new(),
            pending_rows: 0,
            failed: false,
        })
    }

    /// The run whose head sorts first and the one whose head sorts next
    /// (ties: the earlier run first).
    fn leaders(&self) -> (Option<usize>, Option<usize>) {
        let head = |i: usize| {
            let c = self.cursors[i].as_ref().expect("live cursor");
            c.rows.row(c.pos)
        };
        let (mut first, mut second): (Option<usize>, Option<usize>) = (None, None);
        for i in (0..self.cursors.len()).filter(|&i| self.cursors[i].is_some()) {
            match first {
                None => first = Some(i),
                Some(f) if head(i) < head(f) => {
                    second = first;
                    first = Some(i);
                }
                Some(_) => {
                    if second.is_none_or(|s| head(i) < head(s)) {
                        second = Some(i);
                    }
                }
            }
        }
        (first, second)
    }

    /// Where the stretch of run `f` that sorts before run `s`'s head ends
    /// (galloping from the current row, which is in it).
    fn stretch_end(&self, f: usize, s: Option<usize>) -> usize {
        let c = self.cursors[f].as_ref().expect("live cursor");
        let n = c.batch.num_rows();
        let Some(s) = s else { return n };
        let o = self.cursors[s].as_ref().expect("live cursor");
        let bound = o.rows.row(o.pos);
        // An equal row of an earlier run goes first.
        let before = |k: usize| {
            let r = c.rows.row(k);
            if f < s { r <= bound } else { r < bound }
        };
        let (mut lo, mut step) = (c.pos + 1, 1);
        let mut hi = n;
        while lo < n {
            let probe = (lo + step - 1).min(n - 1);
            if before(probe) {
                lo = probe + 1;
                step *= 2;
            } else {
                hi = probe;
                break;
            }
        }
        // Rows before `lo` go; the first that does not is in `lo ..= hi`.
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if before(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn flush(&mut self) -> Result<Option<RecordBatch>> {
        let parts = std::mem::take(&mut self.pending);
        self.pending_rows = 0;
        Ok(match parts.len() {
            0 => None,
            1 => parts.into_iter().next(),
            _ => Some(concat_batches(&self.schema, &parts)?),
        })
    }

    fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        loop {
            let (first, second) = self.leaders();
            let Some(f) = first else {
                return self.flush();
            };
            let end = self.stretch_end(f, second);
            let c = self.cursors[f].as_mut().expect("live cursor");
            let take = (end - c.pos).min(BATCH_ROWS - self.pending_rows);
            self.pending.push(c.batch.slice(c.pos, take));
            self.pending_rows += take;
            c.pos += take;
            if c.pos == c.batch.num_rows() && !c.next_batch(&self.order, &self.converter)? {
                self.cursors[f] = None;
            }
            if self.pending_rows >= BATCH_ROWS {
                return self.flush();
            }
        }
    }
}

impl Iterator for Merge {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Result<RecordBatch>> {
        if self.failed {
            return None;
        }
        let r = self.next_batch();
        self.failed = r.is_err();
        r.transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Cmp, Predicate};
    use arrow::array::{Array, AsArray, Decimal64Array, DictionaryArray, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Int8Type, Schema};
    use proptest::prelude::*;

    /// Q1's shape: two one-letter dictionary keys, each batch with its own
    /// dictionary order, a decimal and the row's position.
    fn q1_like(batches: usize, rows: usize) -> (SchemaRef, Vec<RecordBatch>) {
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        let schema = Arc::new(Schema::new(vec![
            Field::new("flag", dict.clone(), false),
            Field::new("status", dict, false),
            Field::new("price", DataType::Decimal64(15, 2), false),
            Field::new("pos", DataType::Int64, false),
        ]));
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        let out = (0..batches)
            .map(|b| {
                let flags = if b % 2 == 0 {
                    ["A", "N", "R"]
                } else {
                    ["R", "A", "N"]
                };
                let fk: Vec<i8> = (0..rows).map(|_| (next() % 3) as i8).collect();
                let sk: Vec<i8> = (0..rows).map(|_| (next() % 2) as i8).collect();
                let price =
                    Decimal64Array::from_iter_values((0..rows).map(|_| (next() % 100_000) as i64))
                        .with_precision_and_scale(15, 2)
                        .unwrap();
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(
                            DictionaryArray::<Int8Type>::try_new(
                                fk.into(),
                                Arc::new(StringArray::from(flags.to_vec())),
                            )
                            .unwrap(),
                        ),
                        Arc::new(
                            DictionaryArray::<Int8Type>::try_new(
                                sk.into(),
                                Arc::new(StringArray::from(vec!["F", "O"])),
                            )
                            .unwrap(),
                        ),
                        Arc::new(price),
                        Arc::new(Int64Array::from_iter_values(
                            (0..rows).map(|i| (b * rows + i) as i64),
                        )),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, out)
    }

    fn input(batches: Vec<RecordBatch>) -> BatchIter {
        Box::new(batches.into_iter().map(Ok))
    }

    fn mem(dir: &Path, budget: usize) -> WorkMemory {
        WorkMemory {
            budget,
            spill_dir: dir.join(".spill"),
        }
    }

    async fn drain(s: BatchStream) -> Result<Vec<RecordBatch>> {
        s.collect::<Vec<_>>().await.into_iter().collect()
    }

    fn left_in(dir: &Path) -> usize {
        std::fs::read_dir(dir.join(".spill")).map_or(0, |d| d.count())
    }

    /// The rows as (flag, status, pos) strings, in order.
    fn keyed_rows(batches: &[RecordBatch]) -> Vec<(String, String, i64)> {
        let mut out = Vec::new();
        for b in batches {
            let s = |i: usize| arrow::compute::cast(b.column(i), &DataType::Utf8).unwrap();
            let (f, st) = (s(0), s(1));
            let pos = b.column(3).as_primitive::<arrow::datatypes::Int64Type>();
            for r in 0..b.num_rows() {
                out.push((
                    f.as_string::<i32>().value(r).to_string(),
                    st.as_string::<i32>().value(r).to_string(),
                    pos.value(r),
                ));
            }
        }
        out
    }

    fn sort_keys() -> Vec<SortKey> {
        vec![SortKey::asc("flag"), SortKey::asc("status")]
    }

    #[tokio::test]
    async fn an_external_sort_spills_runs_and_returns_exactly_the_in_memory_sort() {
        let (schema, batches) = q1_like(24, 3000);
        let sort = Primitive::Sort { keys: sort_keys() };
        let (_, want) = crate::ops::run(&sort, schema.clone(), batches.clone())
            .await
            .unwrap();
        let d = tempfile::tempdir().unwrap();
        // Budgets from a few batches (many runs, merged in levels) to all.
        for budget in [40_000, 200_000, 1 << 20, 64 << 20] {
            let m = mem(d.path(), budget);
            let (s, out) = run(&sort, schema.clone(), input(batches.clone()), &m)
                .await
                .unwrap();
            assert_eq!(s, schema);
            let got = drain(out.into_stream().unwrap()).await.unwrap();
            // Both sorts are stable: the same rows in the same order.
            assert_eq!(keyed_rows(&got), keyed_rows(&want), "budget {budget}");
            assert!(got.iter().all(|b| b.num_rows() <= BATCH_ROWS));
            assert_eq!(left_in(d.path()), 0, "spill files left at budget {budget}");
        }
    }

    #[tokio::test]
    async fn a_sorts_runs_store_decimals_narrowed_and_read_back_bit_exact() {
        let (schema, batches) = q1_like(24, 3000);
        let sort = Primitive::Sort { keys: sort_keys() };
        let (_, want) = crate::ops::run(&sort, schema.clone(), batches.clone())
            .await
            .unwrap();
        let in_memory: usize = batches.iter().map(data_bytes).sum();
        let d = tempfile::tempdir().unwrap();
        // Five runs, merged in one pass (a merge writes its runs plain).
        let m = mem(d.path(), 1 << 20);
        let (_, out) = run(&sort, schema.clone(), input(batches), &m)
            .await
            .unwrap();
        let Output::Spilled(spilled) = out else {
            panic!("a budget of a few batches spills");
        };
        let on_device: u64 = std::fs::read_dir(d.path().join(".spill"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        // Keys take 2 bytes a row, the decimal 8 and the position 8 in
        // memory; narrowed, the decimal (range 1000.00) and the position
        // take 4 bytes each, so the files are well under the rows' size.
        assert!(
            on_device < in_memory as u64 * 3 / 4,
            "runs take {on_device} bytes for {in_memory} bytes of rows"
        );
        let got = spilled
            .blocks()
            .unwrap()
            .collect::<Result<Vec<_>>>()
            .unwrap();
        assert_eq!(got[0].schema(), schema, "read back as the input's types");
        assert_eq!(keyed_rows(&got), keyed_rows(&want));
        let price = |bs: &[RecordBatch]| -> Vec<i64> {
            bs.iter()
                .flat_map(|b| {
                    b.column(2)
                        .as_primitive::<arrow::datatypes::Decimal64Type>()
                        .values()
                        .to_vec()
                })
                .collect()
        };
        assert_eq!(price(&got), price(&want), "decimals bit-exact");
    }

    #[tokio::test]
    async fn scan_and_the_bundle_streamed_equal_their_in_memory_answers() {
        let (schema, batches) = q1_like(12, 2000);
        let scan = Primitive::Scan {
            filter: vec![Predicate {
                left: Value::col("price"),
                cmp: Cmp::Le,
                right: Value::Decimal("700.00".into()),
            }],
            columns: Some(vec!["status".into(), "flag".into(), "price".into()]),
        };
        let bundle = Primitive::AggGrpSort {
            group_by: vec!["flag".into(), "status".into()],
            aggregates: vec![
                Aggregate {
                    func: AggFunc::Sum,
                    arg: Value::col("price"),
                    name: "sum_price".into(),
                },
                Aggregate {
                    func: AggFunc::Avg,
                    arg: Value::col("price"),
                    name: "avg_price".into(),
                },
                Aggregate {
                    func: AggFunc::Count,
                    arg: Value::col("price"),
                    name: "n".into(),
                },
            ],
        };
        // Sums, counts, minima and maxima combine chunk by chunk.
        let combined = Primitive::AggGrpSort {
            group_by: vec!["status".into(), "flag".into()],
            aggregates: [AggFunc::Sum, AggFunc::Count, AggFunc::Min, AggFunc::Max]
                .into_iter()
                .enumerate()
                .map(|(i, func)| Aggregate {
                    func,
                    arg: Value::col("price"),
                    name: format!("a{i}"),
                })
                .collect(),
        };
        let d = tempfile::tempdir().unwrap();
        for p in [scan, bundle, combined] {
            let (ws, want) = crate::ops::run(&p, schema.clone(), batches.clone())
                .await
                .unwrap();
            let (gs, out) = run(
                &p,
                schema.clone(),
                input(batches.clone()),
                &mem(d.path(), 50_000),
            )
            .await
            .unwrap();
            let got = drain(out.into_stream().unwrap()).await.unwrap();
            assert_eq!(gs.fields(), ws.fields(), "{p:?}");
            let want = concat_batches(&ws, &want).unwrap();
            let got = concat_batches(&gs, &got).unwrap();
            assert!(want.num_rows() > 0);
            assert_eq!(got, want, "{p:?}");
        }
    }

    #[tokio::test]
    async fn an_input_that_fails_midway_fails_the_sort_and_leaves_no_spill_files() {
        let (schema, batches) = q1_like(10, 3000);
        let mut blocks: Vec<Result<RecordBatch>> = batches.into_iter().map(Ok).collect();
        blocks.insert(8, Err(Error::Invalid("the device went away".into())));
        let d = tempfile::tempdir().unwrap();
        let sort = Primitive::Sort { keys: sort_keys() };
        let e = match run(
            &sort,
            schema,
            Box::new(blocks.into_iter()),
            &mem(d.path(), 40_000),
        )
        .await
        {
            Err(e) => e,
            Ok(_) => panic!("the failed input was not reported"),
        };
        assert!(e.to_string().contains("the device went away"), "{e}");
        assert_eq!(left_in(d.path()), 0);
    }

    #[tokio::test]
    async fn a_scan_whose_input_fails_midway_ends_its_output_with_the_error() {
        let (schema, batches) = q1_like(4, 100);
        let mut blocks: Vec<Result<RecordBatch>> = batches.into_iter().map(Ok).collect();
        blocks.push(Err(Error::Invalid("segment 3 fails its checksum".into())));
        let d = tempfile::tempdir().unwrap();
        let scan = Primitive::Scan {
            filter: vec![],
            columns: None,
        };
        let (_, out) = run(
            &scan,
            schema,
            Box::new(blocks.into_iter()),
            &mem(d.path(), 1000),
        )
        .await
        .unwrap();
        let e = drain(out.into_stream().unwrap()).await.unwrap_err();
        assert!(e.to_string().contains("fails its checksum"), "{e}");
    }

    #[tokio::test]
    async fn groups_that_outgrow_the_memory_are_refused_not_answered() {
        // Every row its own group: the partial rows grow with the input.
        let (schema, batches) = q1_like(8, 3000);
        let bundle = Primitive::AggGrpSort {
            group_by: vec!["pos".into()],
            aggregates: vec![Aggregate {
                func: AggFunc::Sum,
                arg: Value::col("price"),
                name: "s".into(),
            }],
        };
        let d = tempfile::tempdir().unwrap();
        let e = match run(&bundle, schema, input(batches), &mem(d.path(), 100_000)).await {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the groups did not fit and were not refused"),
        };
        assert!(e.contains("outgrow the node's working memory"), "{e}");
    }

    #[test]
    fn only_exact_combining_aggregations_ignore_the_order_of_their_input() {
        let (schema, _) = q1_like(1, 10);
        let agg = |func: AggFunc, column: &str| Primitive::AggGrpSort {
            group_by: vec!["flag".into()],
            aggregates: vec![Aggregate {
                func,
                arg: Value::col(column),
                name: "a".into(),
            }],
        };
        for func in [AggFunc::Sum, AggFunc::Count, AggFunc::Min, AggFunc::Max] {
            assert!(
                ignores_order(&agg(func, "price"), &schema).unwrap(),
                "{func:?}"
            );
        }
        assert!(!ignores_order(&agg(AggFunc::Avg, "price"), &schema).unwrap());
        assert!(!ignores_order(&Primitive::Sort { keys: sort_keys() }, &schema).unwrap());
        // Floating point sums depend on the order they are added in.
        let floats = Arc::new(Schema::new(vec![
            Field::new("flag", DataType::Utf8, false),
            Field::new("x", DataType::Float64, false),
        ]));
        assert!(!ignores_order(&agg(AggFunc::Sum, "x"), &floats).unwrap());
        assert!(!ignores_order(&agg(AggFunc::Min, "x"), &floats).unwrap());
        assert!(ignores_order(&agg(AggFunc::Count, "x"), &floats).unwrap());
    }

    #[tokio::test]
    async fn a_deferred_sort_is_sorted_when_read_in_order_and_its_input_as_it_came_otherwise() {
        let (schema, batches) = q1_like(12, 3000);
        let sort = Primitive::Sort { keys: sort_keys() };
        let (_, want) = crate::ops::run(&sort, schema.clone(), batches.clone())
            .await
            .unwrap();
        let d = tempfile::tempdir().unwrap();
        let halves = [batches[..6].to_vec(), batches[6..].to_vec()];
        let sources: Vec<Reopen> = halves
            .into_iter()
            .map(|h| -> Reopen { Box::new(move |_| Ok(input(h.clone()))) })
            .collect();
        let bytes = batches.iter().map(|b| data_bytes(b) as u64).sum();
        // A budget of a few batches: reading it in order is an external sort.
        let deferred = Spilled::deferred_sort(
            schema.clone(),
            &sort_keys(),
            sources,
            bytes,
            mem(d.path(), 100_000),
        )
        .unwrap();
        assert!(deferred.is_deferred());
        assert_eq!(left_in(d.path()), 0, "deferring writes nothing");
        let cost = Arc::new(Mutex::new(ReadCost::default()));
        let any: Vec<RecordBatch> = deferred
            .blocks_in_any_order(&cost)
            .unwrap()
            .collect::<Result<_>>()
            .unwrap();
        assert_eq!(
            keyed_rows(&any),
            keyed_rows(&batches),
            "the input as it came"
        );
        assert_eq!(left_in(d.path()), 0, "nothing sorted, nothing spilled");
        let sorted: Vec<RecordBatch> = deferred.blocks().unwrap().collect::<Result<_>>().unwrap();
        assert_eq!(keyed_rows(&sorted), keyed_rows(&want));
        assert_eq!(
            left_in(d.path()),
            0,
            "the runs are removed with their reader"
        );
        // Read twice, sorted twice, the same.
        let again: Vec<RecordBatch> = deferred.blocks().unwrap().collect::<Result<_>>().unwrap();
        assert_eq!(keyed_rows(&again), keyed_rows(&want));
        // Within a budget that holds it, sorted whole: no run spilled.
        let halves = [batches[..6].to_vec(), batches[6..].to_vec()];
        let sources: Vec<Reopen> = halves
            .into_iter()
            .map(|h| -> Reopen { Box::new(move |_| Ok(input(h.clone()))) })
            .collect();
        std::fs::remove_dir_all(d.path().join(".spill")).unwrap();
        std::fs::write(d.path().join(".spill"), b"no room to spill").unwrap();
        let whole = Spilled::deferred_sort(
            schema.clone(),
            &sort_keys(),
            sources,
            bytes,
            mem(d.path(), 64 << 20),
        )
        .unwrap();
        let sorted: Vec<RecordBatch> = whole.blocks().unwrap().collect::<Result<_>>().unwrap();
        assert_eq!(keyed_rows(&sorted), keyed_rows(&want));
        std::fs::remove_file(d.path().join(".spill")).unwrap();
        let e = Spilled::deferred_sort(
            schema,
            &[SortKey::asc("nope")],
            Vec::new(),
            0,
            mem(d.path(), 100_000),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("nope"), "{e}");
    }

    fn int_keyed(keys: &[(i64, bool)], per_batch: usize) -> (SchemaRef, Vec<RecordBatch>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("pos", DataType::Int64, false),
        ]));
        let batches = keys
            .chunks(per_batch.max(1))
            .enumerate()
            .map(|(c, ks)| {
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        Arc::new(Int64Array::from(
                            ks.iter()
                                .map(|&(k, null)| (!null).then_some(k))
                                .collect::<Vec<_>>(),
                        )),
                        Arc::new(Int64Array::from_iter_values(
                            (0..ks.len()).map(|i| (c * per_batch + i) as i64),
                        )),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, batches)
    }

    /// Rows of two group keys (both dictionaries, `k`'s values in another
    /// order in each batch, or both plain integers; `k` with nulls) and
    /// values (`d` a decimal with nulls, `v` an integer).
    fn grouped_rows(
        rows: &[(u8, bool, i64, i64, bool)],
        per_batch: usize,
        dict_keys: bool,
    ) -> (SchemaRef, Vec<RecordBatch>) {
        let k_type = if dict_keys {
            DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8))
        } else {
            DataType::Int64
        };
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", k_type.clone(), true),
            Field::new("j", k_type, false),
            Field::new("d", DataType::Decimal64(15, 2), true),
            Field::new("v", DataType::Int64, false),
        ]));
        let names = ["w", "x", "y", "z"];
        let batches = rows
            .chunks(per_batch.max(1))
            .enumerate()
            .map(|(c, rs)| {
                let k: arrow::array::ArrayRef = if dict_keys {
                    // This batch's dictionary: the names rotated by `c`.
                    let dict: Vec<&str> = (0..4).map(|i| names[(i + c) % 4]).collect();
                    let keys: arrow::array::Int8Array = rs
                        .iter()
                        .map(|r| (!r.1).then(|| ((usize::from(r.0) + 4 - c % 4) % 4) as i8))
                        .collect();
                    Arc::new(
                        DictionaryArray::<Int8Type>::try_new(
                            keys,
                            Arc::new(StringArray::from(dict)),
                        )
                        .unwrap(),
                    )
                } else {
                    Arc::new(Int64Array::from(
                        rs.iter()
                            .map(|r| (!r.1).then_some(i64::from(r.0)))
                            .collect::<Vec<_>>(),
                    ))
                };
                RecordBatch::try_new(
                    schema.clone(),
                    vec![
                        k,
                        if dict_keys {
                            let keys: arrow::array::Int8Array =
                                rs.iter().map(|r| Some(r.2.rem_euclid(3) as i8)).collect();
                            Arc::new(
                                DictionaryArray::<Int8Type>::try_new(
                                    keys,
                                    Arc::new(StringArray::from(vec!["p", "q", "r"])),
                                )
                                .unwrap(),
                            )
                        } else {
                            Arc::new(Int64Array::from_iter_values(
                                rs.iter().map(|r| r.2.rem_euclid(3)),
                            ))
                        },
                        Arc::new(
                            Decimal64Array::from(
                                rs.iter().map(|r| (!r.4).then_some(r.3)).collect::<Vec<_>>(),
                            )
                            .with_precision_and_scale(15, 2)
                            .unwrap(),
                        ),
                        Arc::new(Int64Array::from_iter_values(rs.iter().map(|r| r.2))),
                    ],
                )
                .unwrap()
            })
            .collect();
        (schema, batches)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Where [`ignores_order`] says an aggregation's answer does not
        /// depend on the order of its rows, the bounded aggregation over the
        /// rows as they came equals it over them sorted by the group keys
        /// (what a deferred Sort's reader would otherwise get), and the
        /// in-memory aggregation: dictionary keys under changing
        /// dictionaries or plain ones, nulls in keys and values, budgets
        /// from a few rows to all of them (at least twice the 15 groups'
        /// partial rows, which a smaller one refuses).
        #[test]
        fn an_aggregation_that_ignores_order_answers_the_same_over_its_rows_unsorted(
            rows in proptest::collection::vec(
                (0u8..4, proptest::bool::weighted(0.1), -50i64..50, 0i64..1_000_000, proptest::bool::weighted(0.1)),
                1..600,
            ),
            per_batch in 1usize..100,
            budget in 2048usize..40_000,
            dict_keys in any::<bool>(),
            null_keys in any::<bool>(),
            null_values in any::<bool>(),
        ) {
            // Without nulls, dictionary keys take the dictionary codes and
            // the sums the exact integer path.
            let rows: Vec<_> = rows
                .into_iter()
                .map(|(k, kn, v, d, dn)| (k, kn && null_keys, v, d, dn && null_values))
                .collect();
            let (schema, batches) = grouped_rows(&rows, per_batch, dict_keys);
            let agg = |func: AggFunc, column: &str, name: &str| Aggregate {
                func,
                arg: Value::col(column),
                name: name.into(),
            };
            let bundle = Primitive::AggGrpSort {
                group_by: vec!["k".into(), "j".into()],
                aggregates: vec![
                    agg(AggFunc::Sum, "d", "sum_d"),
                    agg(AggFunc::Count, "d", "count_d"),
                    agg(AggFunc::Sum, "v", "sum_v"),
                    agg(AggFunc::Min, "v", "min_v"),
                    agg(AggFunc::Max, "d", "max_d"),
                ],
            };
            prop_assert!(ignores_order(&bundle, &schema).unwrap());
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let d = tempfile::tempdir().unwrap();
            let m = mem(d.path(), budget);
            let (unsorted, sorted, whole) = rt.block_on(async {
                let sort = Primitive::Sort { keys: vec![SortKey::asc("k"), SortKey::asc("j")] };
                let (_, by_keys) = crate::ops::run(&sort, schema.clone(), batches.clone()).await?;
                let (s1, a) = run(&bundle, schema.clone(), input(batches.clone()), &m).await?;
                let (s2, b) = run(&bundle, schema.clone(), input(by_keys), &m).await?;
                let (s3, c) = crate::ops::run(&bundle, schema.clone(), batches.clone()).await?;
                let a = concat_batches(&s1, &drain(a.into_stream()?).await?)?;
                let b = concat_batches(&s2, &drain(b.into_stream()?).await?)?;
                let c = concat_batches(&s3, &c)?;
                Ok::<_, Error>((a, b, c))
            }).unwrap();
            prop_assert_eq!(&unsorted, &sorted);
            prop_assert_eq!(&unsorted, &whole);
            prop_assert_eq!(left_in(d.path()), 0);
        }

        /// Any keys (duplicates, nulls), either direction, any budget: the
        /// external sort's output is the input's rows, ordered as the Sort
        /// primitive orders (nulls last).
        #[test]
        fn an_external_sort_of_any_keys_is_an_ordered_permutation(
            keys in proptest::collection::vec((-20i64..20, proptest::bool::weighted(0.1)), 0..700),
            per_batch in 1usize..90,
            budget in 64usize..8000,
            descending in any::<bool>(),
        ) {
            let (schema, batches) = int_keyed(&keys, per_batch);
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let d = tempfile::tempdir().unwrap();
            let sort = Primitive::Sort { keys: vec![SortKey { column: "k".into(), descending }] };
            let got = rt.block_on(async {
                let (_, out) = run(&sort, schema.clone(), input(batches), &mem(d.path(), budget)).await?;
                drain(out.into_stream().unwrap()).await
            }).unwrap();
            let mut rows = Vec::new();
            for b in &got {
                let k = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
                let p = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
                for r in 0..b.num_rows() {
                    rows.push(((!k.is_null(r)).then(|| k.value(r)), p.value(r)));
                }
            }
            let mut positions: Vec<i64> = rows.iter().map(|r| r.1).collect();
            positions.sort_unstable();
            prop_assert_eq!(positions, (0..keys.len() as i64).collect::<Vec<_>>());
            for (r, &(p_key, p_pos)) in rows.iter().zip(rows.iter().skip(1)) {
                let _ = p_pos;
                let in_order = match (r.0, p_key) {
                    (None, Some(_)) => false,
                    (_, None) => true,
                    (Some(a), Some(b)) => if descending { a >= b } else { a <= b },
                };
                prop_assert!(in_order, "{:?} before {:?}", r.0, p_key);
            }
            // Stable: equal keys keep their input order.
            for (a, b) in rows.iter().zip(rows.iter().skip(1)) {
                if a.0 == b.0 {
                    prop_assert!(a.1 < b.1, "ties out of input order: {:?} before {:?}", a, b);
                }
            }
            for (&(k, null), row_at) in keys.iter().zip(0..) {
                let _ = row_at;
                let found = rows.iter().find(|r| r.1 == row_at as i64).unwrap();
                prop_assert_eq!(found.0, (!null).then_some(k));
            }
            prop_assert_eq!(left_in(d.path()), 0);
        }
    }
}
