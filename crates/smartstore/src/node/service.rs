//! A node's Flight service (the smart disk's interface to the host and its
//! peers, section 2.3 of the smart-storage paper): each call of
//! [`crate::wire`]'s interface decoded and handed to the [`Node`], and the
//! node served on a socket, as a process or on a thread of this one.

use std::path::Path;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use tonic::{Request, Response, Status, Streaming};

use super::{DEFAULT_MEMORY, Node, Placement};
use crate::access::NodeAccess;
use crate::devmodel::DeviceModel;
use crate::error::{Error, Result};
use crate::plan::Fragment;
use crate::wire::{
    FLOW_WINDOW, GetCmd, MAX_MESSAGE, PUT_END, PutCmd, RAW_CHUNK, Stats, flight_encode,
};

fn parse<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(bytes)
        .map_err(|e| Status::invalid_argument(format!("malformed {what}: {e}")))
}

/// Counts a put's bytes as its messages arrive and refuses the first
/// message that takes it past the node's limit, so no more than the limit
/// is ever buffered for one put.
struct PutBudget {
    name: String,
    limit_bytes: u64,
    seen_bytes: u64,
}

impl PutBudget {
    fn take(&mut self, m: &FlightData) -> Result<(), Status> {
        self.seen_bytes += (m.data_body.len() + m.data_header.len() + m.app_metadata.len()) as u64;
        if self.seen_bytes > self.limit_bytes {
            tracing::warn!(
                "refused a put of {} past {} bytes (--max-put-bytes)",
                self.name,
                self.limit_bytes
            );
            return Err(Status::resource_exhausted(format!(
                "put of {}: larger than this node's limit of {} bytes (--max-put-bytes); \
                 refused after {} bytes",
                self.name, self.limit_bytes, self.seen_bytes
            )));
        }
        Ok(())
    }
}

fn put_name(cmd: &PutCmd) -> &str {
    match cmd {
        PutCmd::Table { name, .. } | PutCmd::Object { name } | PutCmd::ParityAdd { name, .. } => {
            name
        }
    }
}

/// A table put: decodes the Flight messages (the first included, each
/// already counted against the put limit) and stores the table, base data
/// (`sync`) written to the device batch by batch, anything else held
/// until complete. Nothing is stored from a stream that ends without the
/// sender's end marker.
async fn put_table(
    node: &Arc<Node>,
    name: &str,
    sync: bool,
    messages: impl futures::Stream<Item = Result<FlightData, Status>> + Send + 'static,
) -> Result<Stats, Status> {
    let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let end_seen = ended.clone();
    let rest = messages
        // The sender's end marker: not a Flight message to
        // decode, the proof that the stream was not cut short.
        .try_filter(move |m| {
            let end = m.data_header.is_empty() && m.app_metadata.as_ref() == PUT_END;
            if end {
                end_seen.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            futures::future::ready(!end)
        })
        .map_err(|s| arrow_flight::error::FlightError::Tonic(Box::new(s)));
    let mut decoded = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(rest);
    let flight_err = |e| match e {
        arrow_flight::error::FlightError::Tonic(s) => *s,
        e => Status::invalid_argument(format!("do_put: {e}")),
    };
    let mut stats = Stats::default();
    if sync {
        // Base data streams to the device batch by batch: the
        // node never holds a whole partition for a put.
        let mut writer = None;
        let mut busy = std::time::Duration::ZERO;
        while let Some(b) = decoded.next().await {
            let b = b.map_err(flight_err)?;
            let t = std::time::Instant::now();
            let w = match &mut writer {
                Some(w) => w,
                None => writer.insert(node.table_writer(name, &b.schema())?),
            };
            w.write(&b)?;
            busy += t.elapsed();
        }
        check_ended(name, &ended)?;
        let writer = match writer {
            Some(w) => w,
            None => {
                let schema = decoded
                    .schema()
                    .cloned()
                    .ok_or_else(|| Status::invalid_argument("do_put: no schema"))?;
                node.table_writer(name, &schema)?
            }
        };
        node.commit_table(name, writer, busy, &mut stats)?;
    } else {
        let mut batches = Vec::new();
        while let Some(b) = decoded.next().await {
            batches.push(b.map_err(flight_err)?);
        }
        check_ended(name, &ended)?;
        let schema = decoded
            .schema()
            .cloned()
            .ok_or_else(|| Status::invalid_argument("do_put: no schema"))?;
        node.store_table(name, &schema, batches, Placement::Device, &mut stats)?;
    }
    Ok(stats)
}

/// Refuses a table put whose stream ended without the sender's end
/// marker ([`PUT_END`]): a sender that failed mid-table closes its stream
/// early, and a partial table must not pass for the whole one.
fn check_ended(name: &str, ended: &std::sync::atomic::AtomicBool) -> Result<(), Status> {
    if ended.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "do_put of {name}: the stream ended before the sender's end marker; nothing stored"
    )))
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
        let mut budget = PutBudget {
            name: put_name(&cmd).to_string(),
            limit_bytes: node.access.max_put_bytes,
            seen_bytes: 0,
        };
        budget.take(&first)?;
        let stats = match &cmd {
            PutCmd::Table { name, sync } => {
                let rest =
                    futures::stream::once(async move { Ok(first) }).chain(stream.map(move |m| {
                        let m = m?;
                        budget.take(&m)?;
                        Ok(m)
                    }));
                put_table(&node, name, *sync, rest).await?
            }
            _ => {
                // The sender announces the total length in the first
                // message's metadata: the buffer is sized once, within the
                // put limit (a wrong hint only costs a regrowth).
                let hint = <[u8; 8]>::try_from(first.app_metadata.as_ref())
                    .map_or(RAW_CHUNK as u64, u64::from_le_bytes)
                    .min(node.access.max_put_bytes);
                let mut bytes = Vec::with_capacity(hint as usize);
                bytes.extend_from_slice(&first.data_body);
                while let Some(m) = stream.message().await? {
                    budget.take(&m)?;
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
                let info = serde_json::json!({
                    "dir": node.dir,
                    "device_model": node.model.name(),
                    "refused_calls": node.refused_calls(),
                });
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

/// Serves `node` on `listener` until `shutdown` completes.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let token_check = node.token_check.clone();
    let node_tls = node.access.tls.as_ref().map(|t| t.server.clone());
    let svc = FlightServiceServer::new(NodeService(node))
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    // The token is checked before any handler runs.
    let svc = tonic::service::interceptor::InterceptedService::new(svc, token_check);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &node_tls {
        builder = builder
            .tls_config(tls.clone())
            .map_err(|e| Error::node("self", format!("TLS: {e}")))?;
    }
    builder
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
    /// Starts a node over `dir` on an ephemeral loopback port, accepting
    /// every call and making no transfers.
    pub fn start(dir: &Path, model: DeviceModel) -> Result<InProcessNode> {
        InProcessNode::start_with(dir, model, NodeAccess::default())
    }

    /// Starts a node over `dir` under `access` on an ephemeral loopback port.
    pub fn start_with(dir: &Path, model: DeviceModel, access: NodeAccess) -> Result<InProcessNode> {
        InProcessNode::start_with_memory(dir, model, access, DEFAULT_MEMORY)
    }

    /// Starts a node over `dir` under `access` with `memory` bytes of
    /// memory (see [`Node::open_with`]).
    pub fn start_with_memory(
        dir: &Path,
        model: DeviceModel,
        access: NodeAccess,
        memory: usize,
    ) -> Result<InProcessNode> {
        let node = Node::open_with(dir, model, memory, access)?;
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
    use crate::batch::{compact, data_bytes};
    use crate::wire::MAX_BATCH_MESSAGE;
    use crate::{columnar, object};
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

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
        object::write_file(&path, &columnar::table_file(&schema, &blocks).unwrap()).unwrap();
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
