//! The Prometheus endpoint: `GET /metrics` on the `--metrics` address
//! returns [`Controller::render_metrics`] as OpenMetrics text (the content
//! type prometheus-client's encoder writes, which Prometheus negotiates and
//! a plain `curl` prints as it is); anything else is 404.

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use crate::controller::Controller;

/// A running metrics endpoint; stops when dropped.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    addr: std::net::SocketAddr,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Serve the controller's metrics on `addr`.
    pub fn start(addr: std::net::SocketAddr, ctl: &Arc<Controller>) -> std::io::Result<Self> {
        let server = Arc::new(tiny_http::Server::http(addr).map_err(std::io::Error::other)?);
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| std::io::Error::other("metrics endpoint has no IP address"))?;
        let (s, weak): (Arc<tiny_http::Server>, Weak<Controller>) =
            (Arc::clone(&server), Arc::downgrade(ctl));
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                for request in s.incoming_requests() {
                    let response = match (request.method(), request.url(), weak.upgrade()) {
                        (tiny_http::Method::Get, "/metrics", Some(ctl)) => {
                            let header = tiny_http::Header::from_bytes(
                                &b"Content-Type"[..],
                                crate::metrics::CONTENT_TYPE.as_bytes(),
                            )
                            .expect("static header");
                            tiny_http::Response::from_string(ctl.render_metrics())
                                .with_header(header)
                        }
                        _ => tiny_http::Response::from_string("not found; try /metrics\n")
                            .with_status_code(404),
                    };
                    let _ = request.respond(response);
                }
            })?;
        tracing::info!(%addr, "serving metrics at /metrics");
        Ok(Self {
            server,
            thread: Some(thread),
            addr,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
