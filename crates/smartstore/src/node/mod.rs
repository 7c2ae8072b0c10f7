//! A storage node: the paper's smart disk (section 2.2), a process that
//! holds table partitions and checkpoints in its own directory and runs plan
//! fragments on them, served over Arrow Flight.
//!
//! This file is the node's store: the objects it holds on its device and in
//! its bounded memory (section 5's 64 MB), what their I/O is charged, and
//! running a fragment over them. Its transfers to and from other nodes for
//! checkpoints and recovery are in `transfer`, its Flight service in
//! `service`; the messages themselves are [`crate::wire`]'s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use parking_lot::Mutex;

use crate::access::{NodeAccess, TokenCheck};
use crate::columnar;
use crate::devmodel::DeviceModel;
use crate::error::{Error, Result};
use crate::object::{self, Kind};
use crate::ops::bounded::Spilled;
use crate::plan::{Fragment, check_object_name};

mod bounded;
mod service;
mod transfer;

pub use bounded::SPILL_DIR;

pub use service::{InProcessNode, NodeService, serve};
use transfer::PendingParity;

// The wire types and batch helpers once lived here; their old paths stay.
pub use crate::batch::{compact, data_bytes};
pub use crate::wire::{
    CheckpointCmd, FLOW_WINDOW, GetCmd, MAX_BATCH_MESSAGE, MAX_MESSAGE, PutCmd, RAW_CHUNK,
    RebuildCmd, ScatterCmd, Stats, flight_encode,
};

/// A storage node's state.
#[derive(Debug)]
pub struct Node {
    dir: PathBuf,
    model: DeviceModel,
    /// Who may call it, whom it sends to, how large a put may be.
    access: NodeAccess,
    /// Its Flight service's token check (shared: it counts refusals).
    token_check: TokenCheck,
    inner: Mutex<Inner>,
}

/// An object in the node's memory: its decoded table, its file bytes, or
/// both. Primitive outputs live here; the next primitive, a checkpoint or
/// the host's fetch reads them without device I/O.
#[derive(Default)]
struct Held {
    table: Option<(SchemaRef, Vec<RecordBatch>)>,
    file: Option<Arc<Vec<u8>>>,
    /// An output the query does not materialise kept as spilled runs or
    /// as a deferred Scan or Sort (see `bounded`); of it, memory holds
    /// only a deferred Sort's held input (counted in `bytes`).
    spilled: Option<Arc<Spilled>>,
    bytes: usize,
    /// Whether the object is also on the device, so memory may drop it.
    on_device: bool,
}

#[derive(Default)]
struct Inner {
    /// Held objects, oldest first; those also on the device within
    /// `budget` bytes in all.
    held: Vec<(String, Held)>,
    budget: usize,
    parity: HashMap<String, PendingParity>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("held", &self.held.iter().map(|h| &h.0).collect::<Vec<_>>())
            .field("parity", &self.parity.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Default memory a node caches objects of its device in: the paper's
/// 64 MB of on-device memory (section 5). An object larger than this is
/// read back from the device (and charged to the device model) by the next
/// primitive that needs it. Objects kept in memory only (a primitive's
/// output until its checkpoint has written it) are the only copy and are
/// always held.
pub const DEFAULT_MEMORY: usize = crate::spec::DEFAULT_NODE_MEMORY;

/// Where a stored object goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Written to the device, not synced: materialised primitive outputs
    /// and checkpoints. They protect against the loss of a *node* (the
    /// copy is on another node); a power loss of the whole cluster
    /// restarts the query.
    Device,
    /// Kept in memory only (a primitive's output when the query does not
    /// checkpoint).
    Memory,
}

impl Inner {
    fn get(&self, name: &str) -> Option<&Held> {
        self.held.iter().find(|h| h.0 == name).map(|h| &h.1)
    }

    fn put(&mut self, name: &str, held: Held) {
        self.held.retain(|h| h.0 != name);
        if held.on_device && held.bytes > self.budget {
            return;
        }
        self.held.push((name.to_string(), held));
        self.evict();
    }

    /// Records that a memory-only object is now on the device too (its
    /// checkpoint wrote it), so memory may drop it.
    fn mark_on_device(&mut self, name: &str) {
        if let Some(h) = self.held.iter_mut().find(|h| h.0 == name) {
            h.1.on_device = true;
        }
        self.evict();
    }

    /// Drops the oldest objects that are also on the device until the held
    /// ones fit the budget.
    fn evict(&mut self) {
        let mut total: usize = self.held.iter().map(|h| h.1.bytes).sum();
        let mut i = 0;
        while total > self.budget && i + 1 < self.held.len() {
            if self.held[i].1.on_device {
                total -= self.held.remove(i).1.bytes;
            } else {
                i += 1;
            }
        }
    }
}

impl Node {
    /// A node over `dir` (created if missing), charging I/O to `model`.
    /// `memory` bytes of objects on the device are cached in memory.
    /// It accepts every call and makes no transfers: see [`Node::open_with`].
    pub fn open(dir: &Path, model: DeviceModel, memory: usize) -> Result<Arc<Node>> {
        Node::open_with(dir, model, memory, NodeAccess::default())
    }

    /// A node over `dir` under `access`.
    pub fn open_with(
        dir: &Path,
        model: DeviceModel,
        memory: usize,
        access: NodeAccess,
    ) -> Result<Arc<Node>> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        bounded::clear_spills(dir);
        Ok(Arc::new(Node {
            dir: dir.to_path_buf(),
            model,
            token_check: TokenCheck::new(access.token.clone()),
            access,
            inner: Mutex::new(Inner {
                budget: memory,
                ..Inner::default()
            }),
        }))
    }

    /// What the node accepts and whom it sends to.
    pub fn access(&self) -> &NodeAccess {
        &self.access
    }

    /// Calls refused for a missing or wrong cluster token so far.
    pub fn refused_calls(&self) -> u64 {
        self.token_check
            .refused()
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The node's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        check_object_name(name)?;
        Ok(self.dir.join(format!("{name}.obj")))
    }

    fn charge(&self, bytes: u64, measured: Duration, stats: &mut Stats) {
        stats.io_real_s += measured.as_secs_f64();
        stats.io_s += self.model.charge(bytes).unwrap_or(measured).as_secs_f64();
    }

    /// A whole object file (checked): from memory when held, encoded from
    /// the held table for a memory-only object, else read off the device.
    pub fn load(&self, name: &str, stats: &mut Stats) -> Result<Arc<Vec<u8>>> {
        let (table, spilled) = {
            let inner = self.inner.lock();
            match inner.get(name) {
                Some(Held { file: Some(f), .. }) => return Ok(f.clone()),
                Some(Held {
                    spilled: Some(s), ..
                }) => (None, Some(s.clone())),
                // Once on the device, its bytes are those of the file there
                // (a checkpoint's codec), which parity members must match.
                Some(Held {
                    table: Some(t),
                    on_device: false,
                    ..
                }) => (Some(t.clone()), None),
                _ => (None, None),
            }
        };
        // Read (a deferred primitive run) outside the node's lock.
        let table = match spilled {
            Some(s) => Some(self.read_spilled(&s, stats)?),
            None => table,
        };
        if let Some((schema, batches)) = table {
            let t = Instant::now();
            let file = Arc::new(columnar::table_file(&schema, &batches)?);
            stats.compute_s += t.elapsed().as_secs_f64();
            return Ok(file);
        }
        let path = self.path(name)?;
        let t = Instant::now();
        let file = object::read_file(&path)?;
        self.charge(file.len() as u64, t.elapsed(), stats);
        stats.bytes_read += file.len() as u64;
        Ok(Arc::new(file))
    }

    /// Stores a whole object file (its checksum already verified).
    pub fn store(
        &self,
        name: &str,
        file: Vec<u8>,
        placement: Placement,
        stats: &mut Stats,
    ) -> Result<()> {
        let path = self.path(name)?;
        if placement != Placement::Memory {
            let t = Instant::now();
            object::write_file(&path, &file)?;
            self.charge(file.len() as u64, t.elapsed(), stats);
            stats.bytes_written += file.len() as u64;
        }
        let bytes = file.len();
        self.inner.lock().put(
            name,
            Held {
                table: None,
                file: Some(Arc::new(file)),
                spilled: None,
                bytes,
                on_device: placement != Placement::Memory,
            },
        );
        Ok(())
    }

    /// Reads a table object, decoding only the `columns` named (all when
    /// `None`): from memory when held, else only those columns' segments off
    /// the device (see [`crate::columnar`]).
    pub fn load_table(
        &self,
        name: &str,
        columns: Option<&[String]>,
        stats: &mut Stats,
    ) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        let path = self.path(name)?;
        let held = self
            .inner
            .lock()
            .get(name)
            .map(|h| (h.table.clone(), h.file.clone(), h.spilled.clone()));
        let mut t = Instant::now();
        let (schema, batches) = match held {
            Some((Some(tb), _, _)) => tb,
            Some((None, None, Some(s))) => {
                let read = self.read_spilled(&s, stats)?;
                t = Instant::now();
                read
            }
            Some((None, Some(file), _)) => {
                let (kind, payload) = object::decode(&path, &file)?;
                if kind != Kind::Table {
                    return Err(Error::object(&path, "is not a table"));
                }
                let table = columnar::decode(&path, payload, columns)?;
                stats.compute_s += t.elapsed().as_secs_f64();
                return Ok(table);
            }
            _ => {
                let (table, cost) = columnar::read(&path, columns)?;
                self.charge_reads(&cost, stats);
                stats.compute_s += t.elapsed().saturating_sub(cost.time).as_secs_f64();
                return Ok(table);
            }
        };
        let out = match columns {
            Some(cols)
                if schema.fields().len() != cols.len()
                    || schema.fields().iter().zip(cols).any(|(f, c)| f.name() != c) =>
            {
                let idx = column_indices(&schema, cols, name)?;
                let s = Arc::new(schema.project(&idx)?);
                let b = batches
                    .iter()
                    .map(|b| b.project(&idx))
                    .collect::<Result<Vec<_>, _>>()?;
                (s, b)
            }
            _ => (schema, batches),
        };
        stats.compute_s += t.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Stores a table object.
    pub fn store_table(
        &self,
        name: &str,
        schema: &SchemaRef,
        batches: Vec<RecordBatch>,
        placement: Placement,
        stats: &mut Stats,
    ) -> Result<()> {
        let path = self.path(name)?;
        let bytes: usize = batches.iter().map(data_bytes).sum();
        let mut held = Held {
            table: Some((schema.clone(), batches)),
            file: None,
            spilled: None,
            bytes,
            on_device: placement != Placement::Memory,
        };
        if placement != Placement::Memory {
            let t = Instant::now();
            let (_, b) = held.table.as_ref().expect("just set");
            let file = columnar::table_file(schema, b)?;
            stats.compute_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            object::write_file(&path, &file)?;
            self.charge(file.len() as u64, t.elapsed(), stats);
            stats.bytes_written += file.len() as u64;
            held.bytes += file.len();
            held.file = Some(Arc::new(file));
        } else {
            // A memory-only object replaces any older file of that name.
            let _ = std::fs::remove_file(&path);
        }
        self.inner.lock().put(name, held);
        Ok(())
    }

    /// Starts writing the table object `name` as its batches arrive (a
    /// put of base data); [`Node::commit_table`] puts it in place.
    pub fn table_writer(&self, name: &str, schema: &SchemaRef) -> Result<columnar::TableWriter> {
        columnar::TableWriter::create(&self.path(name)?, schema)
    }

    /// Puts a table written by `writer` in place as base data, synced. It
    /// is not held: a query reads base data off the device, as the paper's
    /// Scan does. `busy` is the time its batches took to write.
    pub fn commit_table(
        &self,
        name: &str,
        writer: columnar::TableWriter,
        busy: Duration,
        stats: &mut Stats,
    ) -> Result<()> {
        let t = Instant::now();
        let len = writer.finish(true)?;
        self.charge(len, busy + t.elapsed(), stats);
        stats.bytes_written += len;
        self.inner.lock().held.retain(|h| h.0 != name);
        Ok(())
    }

    /// Runs a fragment: reads its input (only the columns a Scan needs),
    /// runs the primitive, materialises the output. An input larger than
    /// the node's memory is streamed instead, and the output written to
    /// the device as it comes (see `bounded`).
    pub async fn run(&self, fragment: &Fragment) -> Result<Stats> {
        self.check_storage()?;
        let mut stats = Stats::default();
        // The output's previous version (the last query's) goes first, so
        // its memory serves this run instead of the heap growing by it.
        if fragment.output != fragment.input && !fragment.also.contains(&fragment.output) {
            self.inner.lock().held.retain(|h| h.0 != fragment.output);
        }
        let needed = fragment.primitive.input_columns();
        let started = Instant::now();
        if let Some(stats) = self
            .run_streamed(fragment, needed.as_deref(), started, stats)
            .await?
        {
            return Ok(stats);
        }
        let (schema, mut batches) =
            self.load_table(&fragment.input, needed.as_deref(), &mut stats)?;
        for more in &fragment.also {
            let (s, b) = self.load_table(more, needed.as_deref(), &mut stats)?;
            if s.fields() != schema.fields() {
                return Err(Error::Plan(format!(
                    "{more} does not have {}'s columns",
                    fragment.input
                )));
            }
            batches.extend(b);
        }
        let t = Instant::now();
        let (out_schema, out) = crate::ops::run(&fragment.primitive, schema, batches).await?;
        stats.rows_out = out.iter().map(|b| b.num_rows() as u64).sum();
        stats.compute_s += t.elapsed().as_secs_f64();
        let placement = if fragment.materialize {
            Placement::Device
        } else {
            Placement::Memory
        };
        self.store_table(&fragment.output, &out_schema, out, placement, &mut stats)?;
        Ok(stats)
    }

    /// Fails when the node's directory cannot be read: the storage is
    /// lost even if the process still answers, and the host must treat
    /// the node as lost (checked before every action).
    pub fn check_storage(&self) -> Result<()> {
        std::fs::read_dir(&self.dir)
            .map(drop)
            .map_err(|e| Error::StorageLost {
                path: self.dir.clone(),
                message: e.to_string(),
            })
    }
}

/// The indices in `schema` of the columns `cols` of object `name`.
fn column_indices(schema: &SchemaRef, cols: &[String], name: &str) -> Result<Vec<usize>> {
    cols.iter()
        .map(|c| {
            schema
                .index_of(c)
                .map_err(|_| Error::Plan(format!("unknown column {c:?} in {name}")))
        })
        .collect()
}

impl Node {
    /// Charges reads that took `cost` to `stats`: their time (as the
    /// device model has it, and as measured) and bytes.
    fn charge_reads(&self, cost: &columnar::ReadCost, stats: &mut Stats) {
        let modelled: Option<Duration> = cost.requests.iter().map(|&b| self.model.charge(b)).sum();
        stats.io_real_s += cost.time.as_secs_f64();
        stats.io_s += modelled.unwrap_or(cost.time).as_secs_f64();
        stats.bytes_read += cost.bytes();
    }

    /// All of a spilled output's rows, in memory (a host fetching it, or a
    /// checkpoint shipping it, takes it whole): runs merged, or a deferred
    /// primitive run now, its reads and compute charged to `stats`.
    fn read_spilled(
        &self,
        s: &Spilled,
        stats: &mut Stats,
    ) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        let t = Instant::now();
        let cost = Arc::new(parking_lot::Mutex::new(columnar::ReadCost::default()));
        let batches = s.blocks_charged(&cost)?.collect::<Result<Vec<_>>>()?;
        let cost = std::mem::take(&mut *cost.lock());
        self.charge_reads(&cost, stats);
        stats.compute_s += t.elapsed().saturating_sub(cost.time).as_secs_f64();
        Ok((s.schema().clone(), batches))
    }
}

/// Keeps the memory a node frees in its heap, for its next primitive.
///
/// A primitive builds its output in fresh column buffers (12 MB for one
/// 64-bit column of the 1.5 million rows a node holds of `lineitem` at
/// scale factor 1). glibc's allocator serves blocks that large with `mmap`
/// and unmaps them when freed, or trims them off the heap's top, so every
/// primitive faulted its pages in afresh, and the kernel's page zeroing was
/// the largest single cost of Q1's Scan. With these thresholds such blocks
/// come from the heap and stay there when freed: measured at scale factor
/// 1 on 4 nodes, the Scan phase went from about 0.15 s to 0.09 s and Q1
/// from about 0.50 s to 0.43 s. The price is a node's resident memory
/// staying at its high-water mark (the bounded memory of section 2.2's
/// smart node is enforced on held tables, not on the allocator). Call it
/// before the process starts threads; false when the allocator refused
/// (or is not glibc's) and runs with its defaults.
pub fn keep_heap_warm() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        /// Blocks below this come from the heap (glibc's maximum on 64-bit).
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        /// Freed memory at the heap's top returned to the kernel past this.
        const TRIM_THRESHOLD: libc::c_int = 256 << 20;
        // SAFETY: mallopt only changes the allocator's thresholds; it is
        // called before the node starts any thread, and a value it refuses
        // leaves the default in place (the return value says which).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}
