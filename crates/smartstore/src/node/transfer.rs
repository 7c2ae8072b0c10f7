//! A node's transfers to and from its peers: checkpointing an intermediate
//! result to a mirror node or into the parity node's parity (sections 3.1,
//! 3.4 and 4.2 of the smart-storage paper), folding parity members as they
//! arrive, rebuilding a lost node's object from the mirror group or from
//! parity (sections 3.1 and 3.4), and scattering a checkpoint over the
//! survivors for load redistribution (section 3.3).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;

use super::{Node, Placement};
use crate::batch::data_bytes;
use crate::client::NodeClient;
use crate::codec::Codec;
use crate::columnar;
use crate::error::{Error, Result};
use crate::object::{self, Kind};
use crate::redundancy::ParityBlock;
use crate::wire::{CheckpointCmd, PutCmd, RebuildCmd, ScatterCmd, Stats};

/// An object file shared with the node's memory, lent to a transfer
/// without a copy.
struct Shared(Arc<Vec<u8>>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// A parity object whose members are still arriving.
pub(super) struct PendingParity {
    block: ParityBlock,
    arrived: Vec<bool>,
    /// The run whose members these are.
    epoch: u64,
}

impl Node {
    /// Spreads a table's row blocks over other nodes.
    pub async fn scatter(&self, cmd: &ScatterCmd) -> Result<Stats> {
        self.check_storage()?;
        if cmd.targets.is_empty() {
            return Err(Error::Plan("scatter without targets".into()));
        }
        let mut stats = Stats::default();
        let (schema, batches) = self.load_table(&cmd.object, None, &mut stats)?;
        for addr in &cmd.targets {
            self.access.check_member(addr)?;
        }
        let credentials = self.access.credentials();
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
            let credentials = &credentials;
            async move {
                let label = format!("redistribution target {addr}");
                let mut peer = NodeClient::connect_with(addr, &label, credentials).await?;
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
        self.access.check_member(&cmd.target)?;
        let mut stats = Stats::default();
        let file = self.checkpoint_file(&cmd.object, cmd.codec, &mut stats)?;
        let put = match cmd.parity {
            Some((member, members)) => PutCmd::ParityAdd {
                name: cmd.as_name.clone(),
                member,
                members,
                epoch: cmd.epoch,
            },
            None => PutCmd::Object {
                name: cmd.as_name.clone(),
            },
        };
        let t = Instant::now();
        let label = format!("checkpoint target {}", cmd.target);
        let mut peer =
            NodeClient::connect_with(&cmd.target, &label, &self.access.credentials()).await?;
        let remote = peer
            .put_raw(&put, bytes::Bytes::from_owner(Shared(file.clone())))
            .await?;
        stats.comm_s += (t.elapsed().as_secs_f64() - remote.io_real_s - remote.fold_s).max(0.0);
        stats.io_s += remote.io_s;
        stats.io_real_s += remote.io_real_s;
        stats.fold_s += remote.fold_s;
        stats.compute_s += remote.fold_s;
        stats.bytes_moved += file.len() as u64;
        Ok(stats)
    }

    /// The file a checkpoint of `name` sends, encoded once: a primitive's
    /// output still in memory only is encoded by `codec` and written to
    /// this node's device (not synced: it guards against losing a node,
    /// and the copy on the mirror or in the parity is the one that
    /// matters), and those same bytes are what the peer gets. An object
    /// already on the device is sent as it is stored.
    fn checkpoint_file(&self, name: &str, codec: Codec, stats: &mut Stats) -> Result<Arc<Vec<u8>>> {
        let (table, spilled) = {
            let inner = self.inner.lock();
            match inner.get(name) {
                Some(h) if !h.on_device => (h.table.clone(), h.spilled.clone()),
                _ => (None, None),
            }
        };
        // A spilled output is read whole to be encoded (a checkpoint
        // file is built in memory), then kept on the device instead.
        let table = match (table, &spilled) {
            (Some(t), _) => Some(t),
            // A deferred Sort is sorted here, behind the next primitive.
            (None, Some(s)) => Some(self.read_spilled(s, stats)?),
            (None, None) => None,
        };
        let Some((schema, batches)) = table else {
            return self.load(name, stats);
        };
        let t = Instant::now();
        let file = columnar::table_file_with(&schema, &batches, codec)?;
        let encode = t.elapsed().as_secs_f64();
        stats.encode_s += encode;
        stats.compute_s += encode;
        stats.raw_bytes += batches.iter().map(|b| data_bytes(b) as u64).sum::<u64>();
        let path = self.path(name)?;
        let t = Instant::now();
        object::write_file(&path, &file)?;
        self.charge(file.len() as u64, t.elapsed(), stats);
        stats.bytes_written += file.len() as u64;
        if spilled.is_some() {
            // The object on the device replaces the runs.
            self.inner.lock().held.retain(|h| h.0 != name);
        } else {
            self.inner.lock().mark_on_device(name);
        }
        Ok(Arc::new(file))
    }

    /// Rebuilds a lost node's object here.
    pub async fn rebuild(&self, cmd: &RebuildCmd) -> Result<Stats> {
        self.check_storage()?;
        for addr in rebuild_sources(cmd) {
            self.access.check_member(addr)?;
        }
        let mut stats = Stats::default();
        let t = Instant::now();
        match cmd {
            RebuildCmd::Copy {
                source,
                object,
                name,
            } => {
                self.rebuild_copy(source, object, name, t, &mut stats)
                    .await?;
            }
            RebuildCmd::MirrorColumns {
                sources,
                cols_object,
                member,
                name,
            } => {
                self.rebuild_mirror_columns(sources, cols_object, *member, name, t, &mut stats)
                    .await?;
            }
            RebuildCmd::Parity {
                parity,
                survivors,
                member,
                name,
            } => {
                self.rebuild_parity(parity, survivors, *member, name, t, &mut stats)
                    .await?;
            }
        }
        Ok(stats)
    }

    /// [`RebuildCmd::Copy`]: one holder sends the object (a checkpoint on
    /// the lost node's mirror). `t` is when the rebuild started.
    async fn rebuild_copy(
        &self,
        source: &str,
        object: &str,
        name: &str,
        t: Instant,
        stats: &mut Stats,
    ) -> Result<()> {
        let label = format!("source {source}");
        let mut peer = NodeClient::connect_with(source, &label, &self.access.credentials()).await?;
        let file = peer.get_object(object).await?;
        stats.bytes_moved += file.len() as u64;
        stats.comm_s += t.elapsed().as_secs_f64();
        // The source read the object off its device.
        stats.io_s += self
            .model
            .charge(file.len() as u64)
            .map_or(0.0, |d| d.as_secs_f64());
        object::decode(&self.path(name)?, &file)?;
        self.store(name, file, Placement::Device, stats)
    }

    /// [`RebuildCmd::MirrorColumns`]: every mirror node sends its columns
    /// of the lost node's row blocks, in parallel (section 3.1), and they
    /// are zipped back into whole rows. `t` is when the rebuild started.
    async fn rebuild_mirror_columns(
        &self,
        sources: &[String],
        cols_object: &str,
        member: usize,
        name: &str,
        t: Instant,
        stats: &mut Stats,
    ) -> Result<()> {
        let nodes = sources.len();
        // Parallel reads: each mirror node sends its columns of the
        // lost node's row blocks.
        let credentials = self.access.credentials();
        let fetches = sources.iter().enumerate().map(|(j, addr)| {
            let cols_object = cols_object.to_string();
            let addr = addr.clone();
            let credentials = &credentials;
            async move {
                let label = format!("mirror {j} ({addr})");
                let mut peer = NodeClient::connect_with(&addr, &label, credentials).await?;
                peer.get_table(&cols_object, Some([member, nodes]), None)
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
        let file = columnar::table_file(&schema, &batches)?;
        stats.compute_s += c.elapsed().as_secs_f64();
        self.store(name, file, Placement::Device, stats)
    }

    /// [`RebuildCmd::Parity`]: the XOR of the parity and every surviving
    /// member, fetched in parallel (section 3.4). `t` is when the rebuild
    /// started.
    async fn rebuild_parity(
        &self,
        parity: &(String, String),
        survivors: &[(usize, String, String)],
        member: usize,
        name: &str,
        t: Instant,
        stats: &mut Stats,
    ) -> Result<()> {
        let mut all = vec![(parity.0.clone(), parity.1.clone(), "parity".to_string())];
        for (i, addr, obj) in survivors {
            all.push((addr.clone(), obj.clone(), format!("data {i}")));
        }
        let credentials = self.access.credentials();
        let credentials = &credentials;
        let fetches = all.iter().map(|(addr, obj, role)| async move {
            let label = format!("{role} ({addr})");
            let mut peer = NodeClient::connect_with(addr, &label, credentials).await?;
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
        let file = block.rebuild(member, &surv)?;
        stats.compute_s += c.elapsed().as_secs_f64();
        object::decode(&self.path(name)?, &file)?;
        self.store(name, file, Placement::Device, stats)
    }

    /// Receives a raw object file or parity member.
    pub(super) fn receive_raw(&self, cmd: &PutCmd, bytes: Vec<u8>) -> Result<Stats> {
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
                epoch,
            } => {
                self.path(name)?; // a valid object name
                if *members == 0 || *members > 1024 || member >= members {
                    return Err(Error::Plan(format!("parity member {member} of {members}")));
                }
                let done = {
                    let mut inner = self.inner.lock();
                    let fresh = || PendingParity {
                        block: ParityBlock::new(*members),
                        arrived: vec![false; *members],
                        epoch: *epoch,
                    };
                    let p = inner.parity.entry(name.clone()).or_insert_with(fresh);
                    if p.epoch != *epoch {
                        // An earlier run's fold, left unfinished by a lost
                        // member: it will never complete.
                        tracing::info!(
                            "parity {name}: run {} abandoned, run {epoch} starts",
                            p.epoch
                        );
                        *p = fresh();
                    }
                    if p.arrived.len() != *members || p.arrived[*member] {
                        return Err(Error::Plan(format!(
                            "parity {name}: member {member} of {members} repeated or counts disagree"
                        )));
                    }
                    let t = Instant::now();
                    p.block.add(*member, &bytes);
                    let fold = t.elapsed().as_secs_f64();
                    stats.fold_s += fold;
                    stats.compute_s += fold;
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

/// Every address a rebuild reads from.
fn rebuild_sources(cmd: &RebuildCmd) -> Vec<&str> {
    match cmd {
        RebuildCmd::Copy { source, .. } => vec![source.as_str()],
        RebuildCmd::MirrorColumns { sources, .. } => sources.iter().map(String::as_str).collect(),
        RebuildCmd::Parity {
            parity, survivors, ..
        } => std::iter::once(parity.0.as_str())
            .chain(survivors.iter().map(|s| s.1.as_str()))
            .collect(),
    }
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
