//! The wire between a host (or a node) and a storage node: the Flight
//! calls, the commands and tickets they carry, the stats every call
//! answers, and how a table's batches become Flight messages.
//!
//! These are the messages of the paper's host-to-smart-node protocol
//! (section 2.3: plan fragments sent to the nodes, results merged by the
//! host), of checkpointing intermediate results to the mirror or parity
//! group (section 4.2) and of the recovery schemes' transfers (sections
//! 3.1 to 3.4). Both [`crate::client`] and [`crate::node`] speak it; neither
//! defines it.
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
//! empty `data_header`. A table put ends with one more message: an empty
//! `data_header` and `app_metadata` [`PUT_END`]; a node stores nothing from
//! a table put whose stream ends without it (a sender that failed midway).
//! Every action answers one JSON [`Stats`].

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::FlightDescriptor;
use arrow_flight::encode::{DictionaryHandling, FlightDataEncoder, FlightDataEncoderBuilder};
use serde::{Deserialize, Serialize};

use crate::batch::compact;
use crate::codec::Codec;

/// The `app_metadata` of the message that ends a table put.
pub const PUT_END: &[u8] = b"rebound.put.end";

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
    /// Time encoding checkpoints (part of `compute_s`).
    #[serde(default)]
    pub encode_s: f64,
    /// Time folding parity members (part of `compute_s`).
    #[serde(default)]
    pub fold_s: f64,
    /// In-memory bytes of the tables checkpointed, before encoding.
    #[serde(default)]
    pub raw_bytes: u64,
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
            encode_s: self.encode_s + o.encode_s,
            fold_s: self.fold_s + o.fold_s,
            raw_bytes: self.raw_bytes + o.raw_bytes,
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
        /// The run this fold belongs to: a member of another run starts a
        /// fresh fold, so a fold a lost node left unfinished never mixes
        /// with the next run's members.
        #[serde(default)]
        epoch: u64,
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
    /// How the checkpoint's columns are encoded (see [`crate::codec`]).
    #[serde(default)]
    pub codec: Codec,
    /// The query run it belongs to (parity folds are per run).
    #[serde(default)]
    pub epoch: u64,
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

/// A table's batches as the Flight messages nodes and clients exchange:
/// batches [`compact`]ed, split above [`MAX_BATCH_MESSAGE`], dictionaries
/// sent as dictionaries (a stored copy keeps the sender's types and bytes).
pub fn flight_encode(
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    descriptor: Option<FlightDescriptor>,
) -> FlightDataEncoder {
    flight_encode_stream(schema, futures::stream::iter(batches), descriptor)
}

/// [`flight_encode`] over batches that arrive as a stream (a table placed
/// as it is generated).
pub fn flight_encode_stream(
    schema: SchemaRef,
    batches: impl futures::Stream<Item = RecordBatch> + Send + 'static,
    descriptor: Option<FlightDescriptor>,
) -> FlightDataEncoder {
    use futures::StreamExt;
    FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .with_max_flight_data_size(MAX_BATCH_MESSAGE)
        .with_dictionary_handling(DictionaryHandling::Resend)
        .with_flight_descriptor(descriptor)
        .build(batches.map(|b| Ok(compact(b)?)))
}
