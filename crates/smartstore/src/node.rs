//! A storage node: the paper's smart disk (section 2.2), a process that
//! holds table partitions and checkpoints in its own directory and runs plan
//! fragments on them, served over Arrow Flight.
//!
//! ## Flight interface
//!
//! | call | body | does |
//! |---|---|---|
//! | `do_put` | descriptor cmd [`PutCmd`] (JSON), then Arrow data or raw bytes | stores a table, a copy of an object, or folds a member into a parity object |
//! | `do_get` | ticket [`GetCmd`] (JSON) | streams a table (optionally some row blocks, some columns) or an object file's raw bytes |
//! | `do_action "run"` | a [`Fragment`](crate::plan::Fragment) | runs the primitive, materialises its output |
//! | `do_action "checkpoint"` | [`CheckpointCmd`] | sends an object to a mirror node, or into a parity node's parity |
//! | `do_action "rebuild"` | [`RebuildCmd`] | rebuilds a lost node's object from a mirror group or from parity |
//! | `do_action "scatter"` | [`ScatterCmd`] | spreads a table's row blocks over other nodes |
//! | `do_action "ping"` | none | answers the node's directory and device model |
//!
//! Raw bytes travel in `FlightData.data_body`, 1 MiB per message, with an
//! empty `data_header`. Every action answers one JSON [`Stats`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{ArrayData, MutableArrayData, make_array};
use arrow::datatypes::{DataType, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoder, FlightDataEncoderBuilder};
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status, Streaming};

use crate::client::NodeClient;
use crate::columnar;
use crate::devmodel::DeviceModel;
use crate::error::{Error, Result};
use crate::object::{self, Kind};
use crate::plan::{Fragment, check_object_name};
use crate::redundancy::ParityBlock;

/// Raw bytes per Flight message.
pub const RAW_CHUNK: usize = 1 << 20;
/// Largest gRPC message a node or client accepts.
pub const MAX_MESSAGE: usize = 64 << 20;
/// Target size of one record-batch message. Batches are never split below
/// this (a row block is far smaller), so a row block keeps its boundaries
/// from node to node: the redundancy layouts rely on that to rebuild a
/// partition bit-exact.
pub const MAX_BATCH_MESSAGE: usize = MAX_MESSAGE / 2;
/// HTTP/2 flow-control window of a node's streams and connections, both
/// directions. gRPC's default of 64 KiB makes a bulk transfer (a checkpoint
/// or a rebuild moves tens of MB) wait for a window update every 64 KiB.
pub const FLOW_WINDOW: u32 = 16 << 20;

/// Where a node's time went while it served one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// I/O time as charged: the device model's, or the measured time
    /// without a model.
    pub io_s: f64,
    /// I/O time as measured on the node's files.
    pub io_real_s: f64,
    /// Operator time (DataFusion), measured.
    pub compute_s: f64,
    /// Time spent sending to or fetching from other nodes, measured, less
    /// the other side's I/O.
    pub comm_s: f64,
    /// Bytes read from the node's device.
    pub bytes_read: u64,
    /// Bytes written to the node's device.
    pub bytes_written: u64,
    /// Bytes sent to or fetched from other nodes.
    pub bytes_moved: u64,
    /// Rows produced.
    pub rows_out: u64,
}

impl Stats {
    /// Sum of two requests' stats (sequential work).
    pub fn plus(&self, o: &Stats) -> Stats {
        Stats {
            io_s: self.io_s + o.io_s,
            io_real_s: self.io_real_s + o.io_real_s,
            compute_s: self.compute_s + o.compute_s,
            comm_s: self.comm_s + o.comm_s,
            bytes_read: self.bytes_read + o.bytes_read,
            bytes_written: self.bytes_written + o.bytes_written,
            bytes_moved: self.bytes_moved + o.bytes_moved,
            rows_out: self.rows_out + o.rows_out,
        }
    }
    /// The time the node was busy, as charged.
    pub fn busy_s(&self) -> f64 {
        self.io_s + self.compute_s + self.comm_s
    }
}

/// What a `do_put` stores (the first message's descriptor cmd).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PutCmd {
    /// Arrow data follows; stored as a table object.
    Table {
        /// Object name.
        name: String,
        /// Sync it to the device (base data); otherwise written unsynced.
        #[serde(default = "yes")]
        sync: bool,
    },
    /// A complete object file follows as raw bytes; stored as is, after
    /// its checksum is verified.
    Object {
        /// Object name.
        name: String,
    },
    /// Member `member` of `members` follows as raw bytes; folded into the
    /// parity object `name`, which is stored once every member arrived.
    ParityAdd {
        /// Parity object name.
        name: String,
        /// Which member this is.
        member: usize,
        /// How many members the parity covers.
        members: usize,
    },
}

/// What a `do_get` streams (the ticket).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum GetCmd {
    /// A table object's batches: with `stride = [i, n]` only batches
    /// `b` with `b % n == i`; with `columns`, only those column indices.
    Table {
        /// Object name.
        name: String,
        /// Row-block selection.
        #[serde(default)]
        stride: Option<[usize; 2]>,
        /// Column selection.
        #[serde(default)]
        columns: Option<Vec<usize>>,
    },
    /// An object file's raw bytes, header included.
    Object {
        /// Object name.
        name: String,
    },
}

fn yes() -> bool {
    true
}

/// Body of the `scatter` action: spread a table's row blocks round-robin
/// over `targets`, each receiving `as_name` (section 3.3's load
/// redistribution of checkpointed results).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScatterCmd {
    /// Local object spread.
    pub object: String,
    /// Receiving nodes' addresses.
    pub targets: Vec<String>,
    /// Name of the piece on every target.
    pub as_name: String,
}

/// Body of the `checkpoint` action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointCmd {
    /// Local object sent.
    pub object: String,
    /// Address of the receiving node.
    pub target: String,
    /// Name it gets there (for parity: the parity object's name).
    pub as_name: String,
    /// `Some((member, members))`: fold into the target's parity instead of
    /// copying.
    pub parity: Option<(usize, usize)>,
}

/// Body of the `rebuild` action: rebuild a lost main node's object here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum RebuildCmd {
    /// From the mirror group's column-wise copy: every mirror node `j`
    /// holds columns `column_groups(.., nodes)[j]` of every row block in
    /// `cols_object`; the lost node `member` held blocks `b % nodes ==
    /// member`. Read in parallel from every mirror node (section 3.1).
    MirrorColumns {
        /// Mirror nodes' addresses, by index.
        sources: Vec<String>,
        /// Their column-wise object.
        cols_object: String,
        /// Lost main node's index.
        member: usize,
        /// Object name written here.
        name: String,
    },
    /// A copy of one object held by one node (a checkpoint on the mirror).
    Copy {
        /// Holder's address.
        source: String,
        /// Object there.
        object: String,
        /// Object name written here.
        name: String,
    },
    /// XOR of the parity and every surviving member (section 3.4).
    Parity {
        /// Parity node's address and object.
        parity: (String, String),
        /// Surviving members: index, address, object.
        survivors: Vec<(usize, String, String)>,
        /// Lost member's index.
        member: usize,
        /// Object name written here.
        name: String,
    },
}

struct PendingParity {
    block: ParityBlock,
    arrived: Vec<bool>,
}

/// A storage node's state.
#[derive(Debug)]
pub struct Node {
    dir: PathBuf,
    model: DeviceModel,
    inner: Mutex<Inner>,
}

/// An object in the node's memory: its decoded table, its file bytes, or
/// both. Primitive outputs live here; the next primitive, a checkpoint or
/// the host's fetch reads them without device I/O.
#[derive(Default)]
struct Held {
    table: Option<(SchemaRef, Vec<RecordBatch>)>,
    file: Option<Arc<Vec<u8>>>,
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
/// primitive that needs it. Objects kept in memory only (outputs of a query
/// that does not checkpoint) are the only copy and are always held.
pub const DEFAULT_MEMORY: usize = 64 << 20;

/// Where a stored object goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Written to the device and synced: base partitions, which nothing
    /// else can restore on this node.
    Durable,
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
    pub fn open(dir: &Path, model: DeviceModel, memory: usize) -> Result<Arc<Node>> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        Ok(Arc::new(Node {
            dir: dir.to_path_buf(),
            model,
            inner: Mutex::new(Inner {
                budget: memory,
                ..Inner::default()
            }),
        }))
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
        let table = {
            let inner = self.inner.lock();
            match inner.get(name) {
                Some(Held { file: Some(f), .. }) => return Ok(f.clone()),
                Some(Held { table: Some(t), .. }) => Some(t.clone()),
                _ => None,
            }
        };
        if let Some((schema, batches)) = table {
            let t = Instant::now();
            let file = Arc::new(object::table_file(&schema, &batches)?);
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
            object::write_file(&path, &file, placement == Placement::Durable)?;
            self.charge(file.len() as u64, t.elapsed(), stats);
            stats.bytes_written += file.len() as u64;
        }
        let bytes = file.len();
        self.inner.lock().put(
            name,
            Held {
                table: None,
                file: Some(Arc::new(file)),
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
            .map(|h| (h.table.clone(), h.file.clone()));
        let t = Instant::now();
        let (schema, batches) = match held {
            Some((Some(tb), _)) => tb,
            Some((None, Some(file))) => {
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
                let modelled: Option<Duration> =
                    cost.requests.iter().map(|&b| self.model.charge(b)).sum();
                stats.io_real_s += cost.time.as_secs_f64();
                stats.io_s += modelled.unwrap_or(cost.time).as_secs_f64();
                stats.bytes_read += cost.bytes();
                stats.compute_s += t.elapsed().saturating_sub(cost.time).as_secs_f64();
                return Ok(table);
            }
        };
        let out = match columns {
            Some(cols)
                if schema.fields().len() != cols.len()
                    || schema.fields().iter().zip(cols).any(|(f, c)| f.name() != c) =>
            {
                let idx = cols
                    .iter()
                    .map(|c| {
                        schema
                            .index_of(c)
                            .map_err(|_| Error::Plan(format!("unknown column {c:?} in {name}")))
                    })
                    .collect::<Result<Vec<_>>>()?;
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
            bytes,
            on_device: placement != Placement::Memory,
        };
        if placement != Placement::Memory {
            let t = Instant::now();
            let (_, b) = held.table.as_ref().expect("just set");
            let file = object::table_file(schema, b)?;
            stats.compute_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            object::write_file(&path, &file, placement == Placement::Durable)?;
            self.charge(file.len() as u64, t.elapsed(), stats);
            stats.bytes_written += file.len() as u64;
            held.bytes += file.len();
            held.file = Some(Arc::new(file));
        } else {
            // A memory-only object replaces any older file of that name.
            let _ = std::fs::remove_file(&path);
        }
        if placement == Placement::Durable {
            // Base data lives on the device: a query reads it from there,
            // as the paper's Scan does.
            self.inner.lock().held.retain(|h| h.0 != name);
        } else {
            self.inner.lock().put(name, held);
        }
        Ok(())
    }

    /// Runs a fragment: reads its input (only the columns a Scan needs),
    /// runs the primitive, materialises the output.
    pub async fn run(&self, fragment: &Fragment) -> Result<Stats> {
        self.check_storage()?;
        let mut stats = Stats::default();
        let needed = fragment.primitive.input_columns();
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

    /// Spreads a table's row blocks over other nodes.
    pub async fn scatter(&self, cmd: &ScatterCmd) -> Result<Stats> {
        self.check_storage()?;
        if cmd.targets.is_empty() {
            return Err(Error::Plan("scatter without targets".into()));
        }
        let mut stats = Stats::default();
        let (schema, batches) = self.load_table(&cmd.object, None, &mut stats)?;
        let n = cmd.targets.len();
        let mut pieces: Vec<Vec<RecordBatch>> = vec![Vec::new(); n];
        for (b, batch) in batches.into_iter().enumerate() {
            pieces[b % n].push(batch);
        }
        let t = Instant::now();
        let sends = cmd.targets.iter().zip(pieces).map(|(addr, piece)| {
            let schema = schema.clone();
            let put = PutCmd::Table {
                name: cmd.as_name.clone(),
                sync: false,
            };
            async move {
                let mut peer =
                    NodeClient::connect(addr, &format!("redistribution target {addr}")).await?;
                peer.put_table_as(put, schema, piece).await
            }
        });
        let remote = futures::future::try_join_all(sends).await?;
        let slowest_io = remote.iter().map(|s| s.io_real_s).fold(0.0, f64::max);
        stats.comm_s += (t.elapsed().as_secs_f64() - slowest_io).max(0.0);
        stats.io_s += remote.iter().map(|s| s.io_s).fold(0.0, f64::max);
        stats.io_real_s += slowest_io;
        stats.bytes_moved += remote.iter().map(|s| s.bytes_written).sum::<u64>();
        Ok(stats)
    }

    /// Sends an object to another node (mirror copy or parity member).
    pub async fn checkpoint(&self, cmd: &CheckpointCmd) -> Result<Stats> {
        self.check_storage()?;
        let mut stats = Stats::default();
        let file = self.load(&cmd.object, &mut stats)?;
        let put = match cmd.parity {
            Some((member, members)) => PutCmd::ParityAdd {
                name: cmd.as_name.clone(),
                member,
                members,
            },
            None => PutCmd::Object {
                name: cmd.as_name.clone(),
            },
        };
        let t = Instant::now();
        let mut peer =
            NodeClient::connect(&cmd.target, &format!("checkpoint target {}", cmd.target)).await?;
        let remote = peer.put_raw(&put, (*file).clone()).await?;
        stats.comm_s += (t.elapsed().as_secs_f64() - remote.io_real_s).max(0.0);
        stats.io_s += remote.io_s;
        stats.io_real_s += remote.io_real_s;
        stats.bytes_moved += file.len() as u64;
        Ok(stats)
    }

    /// Rebuilds a lost node's object here.
    pub async fn rebuild(&self, cmd: &RebuildCmd) -> Result<Stats> {
        self.check_storage()?;
        let mut stats = Stats::default();
        let t = Instant::now();
        match cmd {
            RebuildCmd::Copy {
                source,
                object,
                name,
            } => {
                let mut peer = NodeClient::connect(source, &format!("source {source}")).await?;
                let file = peer.get_object(object).await?;
                stats.bytes_moved += file.len() as u64;
                stats.comm_s += t.elapsed().as_secs_f64();
                // The source read the object off its device.
                stats.io_s += self
                    .model
                    .charge(file.len() as u64)
                    .map_or(0.0, |d| d.as_secs_f64());
                object::decode(&self.path(name)?, &file)?;
                self.store(name, file, Placement::Device, &mut stats)?;
            }
            RebuildCmd::MirrorColumns {
                sources,
                cols_object,
                member,
                name,
            } => {
                let nodes = sources.len();
                // Parallel reads: each mirror node sends its columns of the
                // lost node's row blocks.
                let fetches = sources.iter().enumerate().map(|(j, addr)| {
                    let cols_object = cols_object.clone();
                    let addr = addr.clone();
                    async move {
                        let mut peer =
                            NodeClient::connect(&addr, &format!("mirror {j} ({addr})")).await?;
                        peer.get_table(&cols_object, Some([*member, nodes]), None)
                            .await
                    }
                });
                let parts = futures::future::try_join_all(fetches).await?;
                let fetched = t.elapsed();
                let mut moved = 0u64;
                let mut max_src = 0u64;
                for (_, batches) in &parts {
                    let b: u64 = batches.iter().map(|b| data_bytes(b) as u64).sum();
                    moved += b;
                    max_src = max_src.max(b);
                }
                stats.bytes_moved += moved;
                stats.comm_s += fetched.as_secs_f64();
                // Each source read its share off its device, in parallel.
                stats.io_s += self.model.charge(max_src).map_or(0.0, |d| d.as_secs_f64());
                let c = Instant::now();
                let (schema, batches) = zip_columns(&parts)?;
                let file = object::table_file(&schema, &batches)?;
                stats.compute_s += c.elapsed().as_secs_f64();
                self.store(name, file, Placement::Device, &mut stats)?;
            }
            RebuildCmd::Parity {
                parity,
                survivors,
                member,
                name,
            } => {
                let mut all = vec![(parity.0.clone(), parity.1.clone(), "parity".to_string())];
                for (i, addr, obj) in survivors {
                    all.push((addr.clone(), obj.clone(), format!("data {i}")));
                }
                let fetches = all.iter().map(|(addr, obj, role)| async move {
                    let mut peer = NodeClient::connect(addr, &format!("{role} ({addr})")).await?;
                    peer.get_object(obj).await
                });
                let files = futures::future::try_join_all(fetches).await?;
                stats.comm_s += t.elapsed().as_secs_f64();
                let largest = files.iter().map(|f| f.len() as u64).max().unwrap_or(0);
                stats.bytes_moved += files.iter().map(|f| f.len() as u64).sum::<u64>();
                stats.io_s += self.model.charge(largest).map_or(0.0, |d| d.as_secs_f64());
                let c = Instant::now();
                let ppath = PathBuf::from(format!("{}:{}", parity.0, parity.1));
                let (kind, payload) = object::decode(&ppath, &files[0])?;
                if kind != Kind::Raw {
                    return Err(Error::object(ppath, "is not a parity object"));
                }
                let block = ParityBlock::from_bytes(payload)?;
                let surv: Vec<(usize, &[u8])> = survivors
                    .iter()
                    .zip(&files[1..])
                    .map(|((i, _, _), f)| (*i, f.as_slice()))
                    .collect();
                let file = block.rebuild(*member, &surv)?;
                stats.compute_s += c.elapsed().as_secs_f64();
                object::decode(&self.path(name)?, &file)?;
                self.store(name, file, Placement::Device, &mut stats)?;
            }
        }
        Ok(stats)
    }

    /// Receives a raw object file or parity member.
    fn receive_raw(&self, cmd: &PutCmd, bytes: Vec<u8>) -> Result<Stats> {
        let mut stats = Stats::default();
        match cmd {
            PutCmd::Object { name } => {
                object::decode(&self.path(name)?, &bytes)?;
                self.store(name, bytes, Placement::Device, &mut stats)?;
            }
            PutCmd::ParityAdd {
                name,
                member,
                members,
            } => {
                self.path(name)?; // a valid object name
                if *members == 0 || *members > 1024 || member >= members {
                    return Err(Error::Plan(format!("parity member {member} of {members}")));
                }
                let done = {
                    let mut inner = self.inner.lock();
                    let p = inner
                        .parity
                        .entry(name.clone())
                        .or_insert_with(|| PendingParity {
                            block: ParityBlock::new(*members),
                            arrived: vec![false; *members],
                        });
                    if p.arrived.len() != *members || p.arrived[*member] {
                        return Err(Error::Plan(format!(
                            "parity {name}: member {member} of {members} repeated or counts disagree"
                        )));
                    }
                    p.block.add(*member, &bytes);
                    p.arrived[*member] = true;
                    if p.arrived.iter().all(|a| *a) {
                        inner.parity.remove(name).map(|p| p.block)
                    } else {
                        None
                    }
                };
                if let Some(block) = done {
                    self.store(
                        name,
                        object::encode(Kind::Raw, &block.to_bytes()),
                        Placement::Device,
                        &mut stats,
                    )?;
                }
            }
            PutCmd::Table { .. } => unreachable!("tables are decoded by do_put"),
        }
        Ok(stats)
    }
}

/// Bytes of data a batch holds (its arrays' slices; arrays decoded from
/// one message share its buffer, which `get_array_memory_size` would count
/// once per array).
pub fn data_bytes(b: &RecordBatch) -> usize {
    b.columns()
        .iter()
        .map(|c| c.to_data().get_slice_memory_size().unwrap_or(0))
        .sum()
}

/// `b` with arrays that hold only their own rows' bytes. An array decoded
/// zero-copy from a stored column segment slices that whole segment, and
/// Flight's encoder sizes a batch by its buffers' capacity: it would split
/// a 16,384-row block into many messages, and the receiver would no longer
/// see the sender's row blocks.
pub fn compact(b: RecordBatch) -> std::result::Result<RecordBatch, arrow::error::ArrowError> {
    if b.get_array_memory_size() <= 2 * data_bytes(&b) + 4096 {
        return Ok(b);
    }
    let cols = b
        .columns()
        .iter()
        .map(|c| Ok(make_array(compact_data(&c.to_data())?)))
        .collect::<std::result::Result<Vec<_>, arrow::error::ArrowError>>()?;
    RecordBatch::try_new(b.schema(), cols)
}

/// A copy of `d` holding only its own rows. A dictionary's values are
/// copied too (they may slice a shared buffer as well), in the same order,
/// so the copy encodes to the same bytes.
fn compact_data(d: &ArrayData) -> std::result::Result<ArrayData, arrow::error::ArrowError> {
    if let DataType::Dictionary(key, _) = d.data_type() {
        let keys = ArrayData::builder(key.as_ref().clone())
            .len(d.len())
            .offset(d.offset())
            .nulls(d.nulls().cloned())
            .buffers(d.buffers().to_vec())
            .build()?;
        let values = compact_data(&d.child_data()[0])?;
        return compact_data(&keys)?
            .into_builder()
            .data_type(d.data_type().clone())
            .child_data(vec![values])
            .build();
    }
    let mut m = MutableArrayData::new(vec![d], false, d.len());
    m.try_extend(0, 0, d.len())?;
    Ok(m.freeze())
}

/// A table's batches as the Flight messages nodes and clients exchange:
/// batches [`compact`]ed, split above [`MAX_BATCH_MESSAGE`], dictionaries
/// sent as dictionaries (a stored copy keeps the sender's types and bytes).
pub fn flight_encode(
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    descriptor: Option<FlightDescriptor>,
) -> FlightDataEncoder {
    FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_max_flight_data_size(MAX_BATCH_MESSAGE)
        .with_dictionary_handling(DictionaryHandling::Resend)
        .with_flight_descriptor(descriptor)
        .build(futures::stream::iter(
            batches.into_iter().map(|b| Ok(compact(b)?)),
        ))
}

/// Joins the mirror nodes' column groups back into full row blocks.
fn zip_columns(parts: &[(SchemaRef, Vec<RecordBatch>)]) -> Result<(SchemaRef, Vec<RecordBatch>)> {
    let blocks = parts.first().map_or(0, |p| p.1.len());
    if parts.iter().any(|p| p.1.len() != blocks) {
        let counts: Vec<String> = parts
            .iter()
            .map(|p| {
                let rows: usize = p.1.iter().map(|b| b.num_rows()).sum();
                format!("{} blocks / {rows} rows", p.1.len())
            })
            .collect();
        return Err(Error::Redundancy(format!(
            "mirror nodes disagree on the number of row blocks ({})",
            counts.join(", ")
        )));
    }
    let fields: Vec<_> = parts
        .iter()
        .flat_map(|p| p.0.fields().iter().cloned())
        .collect();
    let schema = Arc::new(arrow::datatypes::Schema::new(fields));
    let mut out = Vec::with_capacity(blocks);
    for b in 0..blocks {
        let cols: Vec<_> = parts
            .iter()
            .flat_map(|p| p.1[b].columns().iter().cloned())
            .collect();
        out.push(RecordBatch::try_new(schema.clone(), cols)?);
    }
    Ok((schema, out))
}

fn parse<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(bytes)
        .map_err(|e| Status::invalid_argument(format!("malformed {what}: {e}")))
}

fn stats_json(s: &Stats) -> bytes::Bytes {
    serde_json::to_vec(s).expect("stats serialise").into()
}

/// The Flight service over a [`Node`].
#[derive(Debug, Clone)]
pub struct NodeService(pub Arc<Node>);

type Stream<T> = BoxStream<'static, Result<T, Status>>;

#[tonic::async_trait]
impl FlightService for NodeService {
    type HandshakeStream = Stream<HandshakeResponse>;
    type ListFlightsStream = Stream<FlightInfo>;
    type DoGetStream = Stream<FlightData>;
    type DoPutStream = Stream<PutResult>;
    type DoActionStream = Stream<arrow_flight::Result>;
    type ListActionsStream = Stream<ActionType>;
    type DoExchangeStream = Stream<FlightData>;

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(Status::unimplemented(
            "handshake: no authentication on storage nodes",
        ))
    }
    async fn list_flights(
        &self,
        _: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(Status::unimplemented("list_flights"))
    }
    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented("get_flight_info"))
    }
    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("poll_flight_info"))
    }
    async fn get_schema(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(Status::unimplemented("get_schema"))
    }
    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(Status::unimplemented("do_exchange"))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let cmd: GetCmd = parse("ticket", &request.into_inner().ticket)?;
        let node = self.0.clone();
        node.check_storage()?;
        let mut stats = Stats::default();
        match cmd {
            GetCmd::Object { name } => {
                let file = node.load(&name, &mut stats)?;
                let chunks: Vec<FlightData> = file
                    .chunks(RAW_CHUNK)
                    .map(|c| FlightData {
                        data_body: bytes::Bytes::copy_from_slice(c),
                        ..Default::default()
                    })
                    .collect();
                Ok(Response::new(
                    futures::stream::iter(chunks.into_iter().map(Ok)).boxed(),
                ))
            }
            GetCmd::Table {
                name,
                stride,
                columns,
            } => {
                let (schema, batches) = node.load_table(&name, None, &mut stats)?;
                if let Some([i, n]) = stride
                    && (n == 0 || i >= n)
                {
                    return Err(Status::invalid_argument(format!("stride [{i}, {n}]")));
                }
                let (schema, batches) = match &columns {
                    Some(cols) => {
                        if let Some(c) = cols.iter().find(|&&c| c >= schema.fields().len()) {
                            return Err(Status::invalid_argument(format!(
                                "column index {c} out of range"
                            )));
                        }
                        let s = Arc::new(schema.project(cols).map_err(Error::from)?);
                        let b = batches
                            .iter()
                            .map(|b| b.project(cols))
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(Error::from)?;
                        (s, b)
                    }
                    None => (schema, batches),
                };
                let batches: Vec<RecordBatch> = batches
                    .into_iter()
                    .enumerate()
                    .filter(|(b, _)| stride.is_none_or(|[i, n]| b % n == i))
                    .map(|(_, b)| b)
                    .collect();
                let stream = flight_encode(schema, batches, None)
                    .map_err(|e| Status::internal(e.to_string()));
                Ok(Response::new(stream.boxed()))
            }
        }
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let mut stream = request.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("do_put: empty stream"))?;
        let desc = first
            .flight_descriptor
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("do_put: first message lacks a descriptor"))?;
        let cmd: PutCmd = parse("put descriptor", &desc.cmd)?;
        let node = self.0.clone();
        node.check_storage()?;
        let stats = match &cmd {
            PutCmd::Table { name, sync } => {
                let rest = futures::stream::once(async move { Ok(first) })
                    .chain(stream)
                    .map_err(|s| arrow_flight::error::FlightError::Tonic(Box::new(s)));
                let mut decoded =
                    arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(rest);
                let mut batches = Vec::new();
                while let Some(b) = decoded.next().await {
                    batches.push(b.map_err(|e| Status::invalid_argument(format!("do_put: {e}")))?);
                }
                let schema = decoded
                    .schema()
                    .cloned()
                    .ok_or_else(|| Status::invalid_argument("do_put: no schema"))?;
                let mut stats = Stats::default();
                let placement = if *sync {
                    Placement::Durable
                } else {
                    Placement::Device
                };
                node.store_table(name, &schema, batches, placement, &mut stats)?;
                stats
            }
            _ => {
                let mut bytes = first.data_body.to_vec();
                while let Some(m) = stream.message().await? {
                    bytes.extend_from_slice(&m.data_body);
                }
                node.receive_raw(&cmd, bytes)?
            }
        };
        let out = PutResult {
            app_metadata: stats_json(&stats),
        };
        Ok(Response::new(futures::stream::iter([Ok(out)]).boxed()))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let action = request.into_inner();
        let node = self.0.clone();
        let stats = match action.r#type.as_str() {
            "run" => {
                let f = Fragment::from_json(&action.body)?;
                node.run(&f).await?
            }
            "checkpoint" => node.checkpoint(&parse("checkpoint", &action.body)?).await?,
            "rebuild" => node.rebuild(&parse("rebuild", &action.body)?).await?,
            "scatter" => node.scatter(&parse("scatter", &action.body)?).await?,
            "ping" => {
                let info = serde_json::json!({"dir": node.dir, "device_model": node.model.name()});
                let r = arrow_flight::Result {
                    body: serde_json::to_vec(&info).expect("json").into(),
                };
                return Ok(Response::new(futures::stream::iter([Ok(r)]).boxed()));
            }
            other => {
                return Err(Status::invalid_argument(format!(
                    "unknown action {other:?}"
                )));
            }
        };
        let r = arrow_flight::Result {
            body: stats_json(&stats),
        };
        Ok(Response::new(futures::stream::iter([Ok(r)]).boxed()))
    }

    async fn list_actions(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let actions = [
            ("run", "run a plan fragment"),
            ("checkpoint", "send an object to a mirror or parity node"),
            ("rebuild", "rebuild a lost node's object here"),
            ("scatter", "spread a table's row blocks over other nodes"),
            ("ping", "node information"),
        ]
        .map(|(t, d)| {
            Ok(ActionType {
                r#type: t.into(),
                description: d.into(),
            })
        });
        Ok(Response::new(futures::stream::iter(actions).boxed()))
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

/// Serves `node` on `listener` until `shutdown` completes.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let svc = FlightServiceServer::new(NodeService(node))
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    tonic::transport::Server::builder()
        .initial_stream_window_size(Some(FLOW_WINDOW))
        .initial_connection_window_size(Some(FLOW_WINDOW))
        .add_service(svc)
        .serve_with_incoming_shutdown(
            // No Nagle: a reply of several small HTTP/2 frames (a stream's
            // schema, its batch, its trailers) otherwise waits for the
            // client's delayed ACK, 40 ms on Linux.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown,
        )
        .await
        .map_err(|e| Error::node("self", e))
}

/// A node served on its own thread and runtime inside this process (tests
/// and single-process runs); dropped, it stops.
#[derive(Debug)]
pub struct InProcessNode {
    /// Address it listens on.
    pub addr: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcessNode {
    /// Starts a node over `dir` on an ephemeral loopback port.
    pub fn start(dir: &Path, model: DeviceModel) -> Result<InProcessNode> {
        let node = Node::open(dir, model, DEFAULT_MEMORY)?;
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| Error::io(dir, e))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| Error::io(dir, e))?;
        let addr = std_listener
            .local_addr()
            .map_err(|e| Error::io(dir, e))?
            .to_string();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("node-{addr}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("node runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(std_listener).expect("listener");
                    let _ = serve(node, listener, async {
                        let _ = rx.await;
                    })
                    .await;
                });
            })
            .map_err(|e| Error::io(dir, e))?;
        Ok(InProcessNode {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// Stops the node and waits for it.
    pub fn stop(mut self) {
        self.halt();
    }

    /// Stops the node (idempotent).
    pub fn halt(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for InProcessNode {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};

    #[tokio::test]
    async fn row_blocks_read_back_from_a_column_segment_cross_flight_unsplit() {
        // 40 MB per column in 16,384-row blocks: read back zero-copy, every
        // block's arrays (a dictionary's values too) slice the whole segment.
        let dict = DataType::Dictionary(Box::new(DataType::Int64), Box::new(DataType::Utf8));
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("d", dict.clone(), false),
        ]));
        let blocks: Vec<RecordBatch> = (0..305i64)
            .map(|b| {
                let vals = Int64Array::from_iter_values((0..16_384).map(|i| b * 16_384 + i));
                let names = StringArray::from_iter_values(
                    (0..16_384).map(|i| ["ship", "rail", "air"][((b + i) % 3) as usize]),
                );
                let d = arrow::compute::cast(&names, &dict).unwrap();
                RecordBatch::try_new(schema.clone(), vec![Arc::new(vals), d]).unwrap()
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.obj");
        object::write_file(&path, &object::table_file(&schema, &blocks).unwrap(), false).unwrap();
        let ((s, read), _) = columnar::read(&path, None).unwrap();
        assert!(read[0].get_array_memory_size() > MAX_BATCH_MESSAGE);
        let small = compact(read[7].clone()).unwrap();
        assert_eq!(small, blocks[7]);
        assert!(small.get_array_memory_size() < 2 * data_bytes(&small) + 4096);

        let messages: Vec<FlightData> = flight_encode(s, read, None).try_collect().await.unwrap();
        let decoded: Vec<RecordBatch> =
            arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
                futures::stream::iter(messages.into_iter().map(Ok)),
            )
            .try_collect()
            .await
            .unwrap();
        assert_eq!(decoded, blocks, "same row blocks, none split");
    }
}
