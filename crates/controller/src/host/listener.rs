//! The NBD listener: binds the configured endpoint (TCP or a Unix socket),
//! or serves on a listening socket handed over (systemd socket
//! activation); accepts clients and runs each on its own thread; shuts
//! down gracefully: stop accepting, end every connection once its
//! in-flight requests are answered, destage everything, sync the devices.
//!
//! Admission, so that sockets that never negotiate cannot lock anyone out:
//! - a connection first *negotiates* (the handshake), within
//!   `handshake_timeout` for the whole negotiation however its bytes
//!   trickle; it holds one thread and no served-client slot;
//! - at most `max_handshakes` negotiate at once: a new client past that
//!   ends the *oldest* negotiation, the one likeliest to be stalled (a
//!   well-behaved client negotiates in milliseconds), so a flood of idle
//!   sockets delays a real client by at most its own handshake;
//! - only a negotiated connection takes one of the `max_connections`
//!   served slots (and its `connection_threads` readers); past the limit it
//!   is closed with a warning;
//! - `max_connections_per_peer` (0: no cap) bounds the connections,
//!   negotiating or served, of one client address.
//!
//! With `tls` on, the credentials are loaded before the first accept
//! ([`crate::host::tls`]); a client that negotiates TLS is served on the
//! plaintext end of its TLS pump, which its thread joins when it ends.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use crate::config::Endpoint;
use crate::controller::Controller;
use crate::host::socket::{Listener, Socket};
use crate::host::tls::TlsServer;

/// Where a live connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Negotiating since this instant.
    Negotiating(Instant),
    /// Served (past its handshake).
    Served,
    /// A negotiation ended to make room; its thread is leaving.
    Evicted,
}

struct Entry {
    socket: Socket,
    peer: Option<IpAddr>,
    phase: Phase,
}

#[derive(Default)]
struct Live {
    conns: HashMap<u64, Entry>,
    threads: Vec<JoinHandle<()>>,
}

impl Live {
    fn negotiating(&self) -> usize {
        self.conns
            .values()
            .filter(|e| matches!(e.phase, Phase::Negotiating(_)))
            .count()
    }

    fn served(&self) -> usize {
        self.conns
            .values()
            .filter(|e| e.phase == Phase::Served)
            .count()
    }

    fn of_peer(&self, peer: Option<IpAddr>) -> usize {
        self.conns.values().filter(|e| e.peer == peer).count()
    }

    /// End the negotiation that started first.
    fn evict_oldest_negotiation(&mut self) {
        let oldest = self
            .conns
            .iter()
            .filter_map(|(id, e)| match e.phase {
                Phase::Negotiating(since) => Some((since, *id)),
                Phase::Served | Phase::Evicted => None,
            })
            .min();
        if let Some((since, id)) = oldest
            && let Some(e) = self.conns.get_mut(&id)
        {
            e.phase = Phase::Evicted;
            tracing::warn!(
                conn = id,
                peer = %e.socket.peer_name(),
                negotiating_for = ?since.elapsed(),
                "too many connections negotiating; ending the oldest negotiation"
            );
            let _ = e.socket.shutdown(Shutdown::Both);
        }
    }
}

/// A running NBD server.
pub struct Server {
    ctl: Arc<Controller>,
    endpoint: Endpoint,
    stop: Arc<AtomicBool>,
    live: Arc<Mutex<Live>>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Server {
    /// Load the TLS credentials (if any), bind the configured endpoint
    /// and start accepting.
    pub fn start(ctl: Arc<Controller>) -> std::io::Result<Self> {
        let tls = load_tls(&ctl)?;
        let listener = Listener::bind(&ctl.config.listen, ctl.config.socket_mode)?;
        Self::serve(ctl, listener, tls)
    }

    /// Start accepting on `listener`, a listening socket bound elsewhere
    /// (one inherited from systemd); `listen` in the configuration is not
    /// bound.
    pub fn start_on(ctl: Arc<Controller>, listener: Listener) -> std::io::Result<Self> {
        let tls = load_tls(&ctl)?;
        Self::serve(ctl, listener, tls)
    }

    fn serve(
        ctl: Arc<Controller>,
        listener: Listener,
        tls: Option<Arc<TlsServer>>,
    ) -> std::io::Result<Self> {
        listener.set_blocking()?;
        let endpoint = listener.endpoint()?;
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(Mutex::new(Live::default()));
        let accept = {
            let (ctl, stop, live) = (Arc::clone(&ctl), Arc::clone(&stop), Arc::clone(&live));
            std::thread::Builder::new()
                .name("nbd-accept".into())
                .spawn(move || accept_loop(&listener, &ctl, tls.as_ref(), &stop, &live))?
        };
        tracing::info!(%endpoint, tls = ?ctl.config.tls, "serving NBD (export \"\" and \"{}\")", ctl.config.export_name);
        Ok(Self {
            ctl,
            endpoint,
            stop,
            live,
            accept: Some(accept),
        })
    }

    /// Where it listens (the port actually bound, with port 0).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The TCP address actually bound; `None` for a Unix socket.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.tcp()
    }

    /// The controller behind the server.
    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctl
    }

    /// Connections negotiating and served now.
    pub fn connections(&self) -> (usize, usize) {
        let live = self.live.lock();
        (live.negotiating(), live.served())
    }

    /// Stop accepting, close every connection after its in-flight requests,
    /// then shut the controller down (destage and sync).
    pub fn shutdown(mut self) -> std::io::Result<()> {
        self.stop_accepting();
        let threads = {
            let mut live = self.live.lock();
            for e in live.conns.values() {
                let how = match e.phase {
                    Phase::Negotiating(_) | Phase::Evicted => Shutdown::Both,
                    Phase::Served => Shutdown::Read,
                };
                let _ = e.socket.shutdown(how);
            }
            std::mem::take(&mut live.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        self.ctl.shutdown()
    }

    fn stop_accepting(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        Listener::poke(&self.endpoint);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop_accepting();
        }
    }
}

/// The TLS credentials the configuration names (checked: an error names
/// the file).
fn load_tls(ctl: &Controller) -> std::io::Result<Option<Arc<TlsServer>>> {
    TlsServer::load(&ctl.config)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))
}

fn accept_loop(
    listener: &Listener,
    ctl: &Arc<Controller>,
    tls: Option<&Arc<TlsServer>>,
    stop: &AtomicBool,
    live: &Arc<Mutex<Live>>,
) {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let socket = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        socket.tune(ctl.config.tcp_keepalive);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        if !register(ctl, live, id, &socket) {
            let _ = socket.shutdown(Shutdown::Both);
            continue;
        }
        ctl.metrics
            .connections_total
            .fetch_add(1, Ordering::Relaxed);
        let (c, l, t) = (Arc::clone(ctl), Arc::clone(live), tls.cloned());
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || run_connection(&c, &l, t.as_deref(), socket, id));
        match spawned {
            Ok(t) => {
                let mut g = live.lock();
                g.threads.retain(|t| !t.is_finished());
                g.threads.push(t);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start a connection thread");
                live.lock().conns.remove(&id);
            }
        }
    }
}

/// Enter a new connection as negotiating: `false` when the per-peer cap
/// refuses it. Makes room among the negotiating ones if needed.
fn register(ctl: &Controller, live: &Mutex<Live>, id: u64, socket: &Socket) -> bool {
    let Ok(handle) = socket.try_clone() else {
        return false;
    };
    let peer = socket.peer_ip();
    let mut g = live.lock();
    let cap = ctl.config.max_connections_per_peer;
    if cap > 0 && g.of_peer(peer) >= cap {
        tracing::warn!(
            peer = %socket.peer_name(),
            cap,
            "per-peer connection cap reached; refusing a connection"
        );
        return false;
    }
    if g.negotiating() >= ctl.config.max_handshakes {
        g.evict_oldest_negotiation();
    }
    g.conns.insert(
        id,
        Entry {
            socket: handle,
            peer,
            phase: Phase::Negotiating(Instant::now()),
        },
    );
    true
}

/// One connection's thread: negotiate, take a served slot, serve, leave.
fn run_connection(
    ctl: &Arc<Controller>,
    live: &Mutex<Live>,
    tls: Option<&TlsServer>,
    socket: Socket,
    id: u64,
) {
    let mut admit = || promote(ctl, live, id);
    if let Some(n) = crate::host::connection::negotiate(ctl, socket, id, tls, &mut admit) {
        if let Some(e) = live.lock().conns.get_mut(&id)
            && let Ok(handle) = n.socket.try_clone()
        {
            // After TLS the connection is served on another socket:
            // register that one, so a shutdown ends it.
            e.socket = handle;
        }
        ctl.metrics.connections.fetch_add(1, Ordering::Relaxed);
        crate::host::connection::serve(Arc::clone(ctl), n.socket, n.negotiated, id);
        ctl.metrics.connections.fetch_sub(1, Ordering::Relaxed);
        if let Some(pump) = n.pump {
            // The connection closed its end: the pump sends the last
            // replies (within send_timeout) and ends the session.
            pump.join();
        }
    }
    live.lock().conns.remove(&id);
}

/// Move a connection entering transmission to the served ones: refused
/// (why) when every served slot is taken.
fn promote(ctl: &Controller, live: &Mutex<Live>, id: u64) -> Result<(), String> {
    let mut g = live.lock();
    let served = g.served();
    let max = ctl.config.max_connections;
    if served >= max {
        return Err(format!(
            "the server is serving its maximum of {max} clients (max_connections)"
        ));
    }
    match g.conns.get_mut(&id) {
        Some(e) if e.phase != Phase::Evicted => {
            e.phase = Phase::Served;
            Ok(())
        }
        _ => Err("the negotiation was ended to make room".to_owned()),
    }
}
