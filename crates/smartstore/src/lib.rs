//! # smartstore: processor-embedded storage nodes with query offload
//!
//! Chiu, Choudhary and Kandemir, *Fault Recovery Designs for
//! Processor-Embedded Distributed Storage Architectures with I/O-Intensive
//! DB Workloads* (`papers/smart-storage-fault-recovery.txt`). Storage nodes
//! with embedded processors, organised into storage groups, run the
//! data-intensive primitives of a query on their own partitions; the host
//! sends plan fragments and merges the results. This crate builds that
//! system for real: nodes are processes serving Arrow Flight, operators are
//! DataFusion's, data is TPC-H `lineitem` from the `tpchgen` crates.
//!
//! | paper | here |
//! |---|---|
//! | smart node (SD, SM), section 2.2 | [`node::Node`], `rebound node` |
//! | storage group, mirror group (3.1), parity node (3.4) | [`host::Cluster`], [`spec::ClusterSpec`], [`spec::Layout`] |
//! | row-wise and column-wise partitions, parity | [`redundancy`] |
//! | a node's stored partition (row-wise across nodes, column by column inside one) | [`columnar`], [`object`] |
//! | query plan distributed to the nodes (2.3) | [`plan::Fragment`], [`wire`] |
//! | primitives Scan, Sort, AggGrpSort bundle (2.3, 4.2) | [`plan::Primitive`], [`ops`] |
//! | a node's bounded memory (2.2; 64 MB in 5) as a bound on a primitive's working memory: streamed input, external sort, narrowed spills, a Scan deferred into its reader | [`ops::bounded`], [`ops::scanfilter`], [`columnar::RowBlocks`], `node::bounded` |
//! | Sort on few-valued (dictionary) keys, by normalized key | [`ranksort`] |
//! | the bundle's Group-by over sorted input, by runs; its sums as exact integer arithmetic | [`rungroup`], [`ops`] |
//! | checkpoint per primitive (4.2), pipelined behind the next primitive and encoded once | [`host::Cluster::run_query_with`], [`codec`] |
//! | HP C2490A disk, MEMS G1 to G3 (5.2, Table 1) | [`devmodel`] |
//! | Scan and TPC-H Q1 workloads (4) | [`spec::Query`], [`tpch`] |
//! | recovery schemes: spare, migration, redistribution, parity (3.1 to 3.4) | [`recovery`], [`host::Cluster::run_query_with`] |
//!
//! Stored objects are checksummed ([`object`]); a damaged one is an error
//! naming the file, never a wrong answer.
//!
//! ## Layers
//!
//! A module names (`crate::x`, in a `use`, a `use crate::{..}` group or an
//! inline path) only modules of a lower layer, so imports run one way and
//! no two modules need each other. The files of a folder module
//! (`src/node/`, `src/host/`) belong to it and reach each other through
//! `super`. `tests/layers.rs` reads this table and every file under `src/`,
//! and fails on a name that breaks it or a module missing from it.
//!
//! | layer | modules | what |
//! |---|---|---|
//! | 0 | `error`, `redundancy` | the error type; the redundancy crate (layouts, parity), re-exported |
//! | 1 | `access`, `batch`, `codec`, `devmodel`, `object`, `plan`, `ranksort`, `rungroup` | leaves: who may call a node and where it may send data, a batch's own bytes, checkpoint encodings, device models, the object envelope, plan fragments, the Sort and Group-by kernels |
//! | 2 | `columnar`, `ops`, `spec`, `wire` | a table object's payload, the primitives, the cluster and workload asked for, the Flight messages |
//! | 3 | `client`, `recovery`, `tpch` | the Flight client, the recovery schemes and faults, the TPC-H data and plans |
//! | 4 | `node` | a storage node: its store, its transfers to peers, its Flight service |
//! | 5 | `host` | the host: the cluster, the query loop, the recovery steps, the report |

pub mod access;
pub mod batch;
pub mod client;
pub mod codec;
pub mod columnar;
pub mod devmodel;
pub mod error;
pub mod host;
pub mod node;
pub mod object;
pub mod ops;
pub mod plan;
pub mod ranksort;
pub mod recovery;
pub mod rungroup;
pub mod spec;
pub use redundancy;
pub mod tpch;
pub mod wire;

pub use error::{Error, Result};
