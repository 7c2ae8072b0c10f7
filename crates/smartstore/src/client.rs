//! The Flight client a host (or a node talking to a peer) uses to reach a
//! storage node: the host's side of sending plan fragments and fetching
//! results (section 2.3 of the smart-storage paper), and a node's side of
//! checkpoint and recovery transfers (sections 3 and 4.2), in
//! [`crate::wire`]'s messages. Every error names the node, and a node that
//! does not answer is reported lost, the fault section 3 recovers from.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket};
use futures::{StreamExt, TryStreamExt};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::access::{BearerToken, Credentials};
use crate::error::{Error, Result};
use crate::plan::Fragment;
use crate::wire::{
    CheckpointCmd, FLOW_WINDOW, GetCmd, MAX_MESSAGE, PUT_END, PutCmd, RAW_CHUNK, RebuildCmd,
    ScatterCmd, Stats, flight_encode, flight_encode_stream,
};

/// How long connecting to a node may take before it counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A connection to one storage node.
#[derive(Debug, Clone)]
pub struct NodeClient {
    label: String,
    addr: String,
    inner: FlightServiceClient<InterceptedService<Channel, BearerToken>>,
}

impl NodeClient {
    /// Connects to the node at `addr` (`host:port`) presenting no
    /// credentials (a node started without a token); `label` names it in
    /// errors (for example `main 2 (127.0.0.1:4000)`).
    pub async fn connect(addr: &str, label: &str) -> Result<NodeClient> {
        NodeClient::connect_with(addr, label, &Credentials::default()).await
    }

    /// Connects to the node at `addr`, presenting `credentials` on every
    /// call.
    pub async fn connect_with(
        addr: &str,
        label: &str,
        credentials: &Credentials,
    ) -> Result<NodeClient> {
        let err = |m: String| Error::node(label, m);
        let scheme = if credentials.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| err(format!("bad address {addr:?}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .initial_stream_window_size(Some(FLOW_WINDOW))
            .initial_connection_window_size(Some(FLOW_WINDOW))
            .tcp_nodelay(true);
        if let Some(tls) = &credentials.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| err(format!("TLS: {e}{}", source_chain(&e))))?;
        }
        let channel = endpoint.connect().await.map_err(|e| Error::NodeLost {
            node: label.to_string(),
            message: format!("unreachable: {e}{}", source_chain(&e)),
        })?;
        Ok(NodeClient {
            label: label.to_string(),
            addr: addr.to_string(),
            inner: FlightServiceClient::with_interceptor(channel, credentials.interceptor())
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        })
    }

    /// The node's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The node's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    fn err(&self, e: impl std::fmt::Display) -> Error {
        Error::node(&self.label, e)
    }

    fn status(&self, s: tonic::Status) -> Error {
        match s.code() {
            // The connection broke or the node's storage is gone.
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown => {
                Error::NodeLost {
                    node: self.label.clone(),
                    message: s.message().to_string(),
                }
            }
            c => self.err(format!("{}: {}", code_name(c), s.message())),
        }
    }

    /// Sends an action with a raw body; returns the first answer's body.
    pub async fn action(&mut self, kind: &str, body: Vec<u8>) -> Result<Vec<u8>> {
        let req = Action {
            r#type: kind.into(),
            body: body.into(),
        };
        let mut stream = self
            .inner
            .do_action(req)
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let first = stream
            .message()
            .await
            .map_err(|s| self.status(s))?
            .ok_or_else(|| self.err(format!("{kind}: empty answer")))?;
        Ok(first.body.to_vec())
    }

    async fn stats(&mut self, kind: &str, body: Vec<u8>) -> Result<Stats> {
        let bytes = self.action(kind, body).await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| self.err(format!("{kind}: malformed stats: {e}")))
    }

    /// Checks the node answers.
    pub async fn ping(&mut self) -> Result<serde_json::Value> {
        let bytes = self.action("ping", Vec::new()).await?;
        serde_json::from_slice(&bytes).map_err(|e| self.err(format!("ping: {e}")))
    }

    /// Runs a plan fragment.
    pub async fn run(&mut self, fragment: &Fragment) -> Result<Stats> {
        self.stats("run", fragment.to_json()).await
    }

    /// Sends an object to a mirror or parity node.
    pub async fn checkpoint(&mut self, cmd: &CheckpointCmd) -> Result<Stats> {
        self.stats("checkpoint", serde_json::to_vec(cmd).expect("json"))
            .await
    }

    /// Spreads an object's rows across nodes (load redistribution).
    pub async fn scatter(&mut self, cmd: &ScatterCmd) -> Result<Stats> {
        self.stats("scatter", serde_json::to_vec(cmd).expect("json"))
            .await
    }

    /// Rebuilds a lost node's object on this node.
    pub async fn rebuild(&mut self, cmd: &RebuildCmd) -> Result<Stats> {
        self.stats("rebuild", serde_json::to_vec(cmd).expect("json"))
            .await
    }

    fn descriptor(cmd: &PutCmd) -> FlightDescriptor {
        FlightDescriptor::new_cmd(serde_json::to_vec(cmd).expect("json"))
    }

    async fn put(&mut self, messages: Vec<FlightData>) -> Result<Stats> {
        self.put_stream(futures::stream::iter(messages)).await
    }

    async fn put_stream(
        &mut self,
        messages: impl futures::Stream<Item = FlightData> + Send + 'static,
    ) -> Result<Stats> {
        let mut results = self
            .inner
            .do_put(messages)
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let r = results
            .message()
            .await
            .map_err(|s| self.status(s))?
            .ok_or_else(|| self.err("do_put: no result"))?;
        serde_json::from_slice(&r.app_metadata)
            .map_err(|e| self.err(format!("do_put: malformed stats: {e}")))
    }

    /// The message that ends a table put (see [`PUT_END`]).
    fn put_end() -> FlightData {
        FlightData {
            app_metadata: PUT_END.into(),
            ..Default::default()
        }
    }

    /// Stores a table.
    pub async fn put_table(
        &mut self,
        name: &str,
        schema: SchemaRef,
        batches: Vec<RecordBatch>,
    ) -> Result<Stats> {
        self.put_table_as(
            PutCmd::Table {
                name: name.into(),
                sync: true,
            },
            schema,
            batches,
        )
        .await
    }

    /// Stores a table with the given put command (a [`PutCmd::Table`]).
    pub async fn put_table_as(
        &mut self,
        cmd: PutCmd,
        schema: SchemaRef,
        batches: Vec<RecordBatch>,
    ) -> Result<Stats> {
        let mut messages: Vec<FlightData> =
            flight_encode(schema, batches, Some(Self::descriptor(&cmd)))
                .try_collect()
                .await
                .map_err(|e| self.err(e))?;
        messages.push(Self::put_end());
        self.put(messages).await
    }

    /// Stores a table whose batches arrive as a stream, sending each as it
    /// comes (the node writes it as it arrives: neither side holds the
    /// table). An error in the stream ends the put without its end marker,
    /// so the node stores nothing, and is the error returned.
    pub async fn put_table_stream(
        &mut self,
        cmd: PutCmd,
        schema: SchemaRef,
        batches: impl futures::Stream<Item = Result<RecordBatch>> + Send + 'static,
    ) -> Result<Stats> {
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
        let batches = until_error(batches, failed.clone());
        let messages = until_error(
            flight_encode_stream(schema, batches, Some(Self::descriptor(&cmd))),
            failed.clone(),
        );
        let end_if_whole = {
            let failed = failed.clone();
            futures::stream::once(async move { failed.lock().is_none().then(Self::put_end) })
                .filter_map(futures::future::ready)
        };
        let result = self.put_stream(messages.chain(end_if_whole)).await;
        if let Some(e) = failed.lock().take() {
            return Err(self.err(format!("put of a table cut short: {e}")));
        }
        result
    }

    /// Sends raw bytes (an object file or a parity member).
    pub async fn put_raw(&mut self, cmd: &PutCmd, bytes: impl Into<bytes::Bytes>) -> Result<Stats> {
        let bytes: bytes::Bytes = bytes.into();
        let mut messages = vec![FlightData {
            flight_descriptor: Some(Self::descriptor(cmd)),
            // The total length, so the receiver sizes its buffer once.
            app_metadata: (bytes.len() as u64).to_le_bytes().to_vec().into(),
            ..Default::default()
        }];
        // Chunks share the caller's buffer: no copy before the socket.
        messages.extend((0..bytes.len()).step_by(RAW_CHUNK).map(|at| FlightData {
            data_body: bytes.slice(at..(at + RAW_CHUNK).min(bytes.len())),
            ..Default::default()
        }));
        self.put(messages).await
    }

    /// Fetches an object file's raw bytes.
    pub async fn get_object(&mut self, name: &str) -> Result<Vec<u8>> {
        let ticket =
            Ticket::new(serde_json::to_vec(&GetCmd::Object { name: name.into() }).expect("json"));
        let mut stream = self
            .inner
            .do_get(ticket)
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = stream.message().await.map_err(|s| self.status(s))? {
            out.extend_from_slice(&m.data_body);
        }
        Ok(out)
    }

    /// Fetches a table (optionally some row blocks and columns).
    pub async fn get_table(
        &mut self,
        name: &str,
        stride: Option<[usize; 2]>,
        columns: Option<Vec<usize>>,
    ) -> Result<(SchemaRef, Vec<RecordBatch>)> {
        let cmd = GetCmd::Table {
            name: name.into(),
            stride,
            columns,
        };
        let ticket = Ticket::new(serde_json::to_vec(&cmd).expect("json"));
        let stream = self
            .inner
            .do_get(ticket)
            .await
            .map_err(|s| self.status(s))?
            .into_inner();
        let mut decoded = arrow_flight::decode::FlightRecordBatchStream::new_from_flight_data(
            stream.map_err(|s| arrow_flight::error::FlightError::Tonic(Box::new(s))),
        );
        let mut batches = Vec::new();
        while let Some(b) = decoded.next().await {
            batches.push(b.map_err(|e| self.err(e))?);
        }
        let schema = decoded
            .schema()
            .cloned()
            .ok_or_else(|| self.err("do_get: no schema"))?;
        Ok((schema, batches))
    }
}

fn code_name(c: tonic::Code) -> &'static str {
    match c {
        tonic::Code::InvalidArgument => "refused",
        tonic::Code::DataLoss => "damaged data",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::Unimplemented => "unsupported",
        tonic::Code::Unauthenticated => "unauthenticated",
        tonic::Code::PermissionDenied | tonic::Code::ResourceExhausted => "refused",
        _ => "error",
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The items of `s` up to its first error, which is kept in `failed` (the
/// stream then ends there).
fn until_error<T, E: std::fmt::Display>(
    s: impl futures::Stream<Item = std::result::Result<T, E>>,
    failed: Arc<Mutex<Option<String>>>,
) -> impl futures::Stream<Item = T> {
    s.take_while(move |r| {
        if let Err(e) = r {
            *failed.lock() = Some(e.to_string());
        }
        futures::future::ready(r.is_ok())
    })
    .filter_map(|r| futures::future::ready(r.ok()))
}
