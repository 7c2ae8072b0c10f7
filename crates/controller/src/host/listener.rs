//! The NBD listener: binds the configured address, or serves on a
//! listening socket handed over (systemd socket activation); accepts connections (up to `max_connections`), runs
//! each on its own thread, and shuts down gracefully: stop accepting, end
//! every connection once its in-flight requests are answered, destage
//! everything, sync the devices.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::controller::Controller;

struct Live {
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

/// A running NBD server.
pub struct Server {
    ctl: Arc<Controller>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    live: Arc<Mutex<Live>>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Bind the configured address and start accepting.
    pub fn start(ctl: Arc<Controller>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(ctl.config.listen)?;
        Self::start_on(ctl, listener)
    }

    /// Start accepting on `listener`, a listening socket bound elsewhere
    /// (one inherited from systemd); `listen` in the configuration is not
    /// bound.
    pub fn start_on(ctl: Arc<Controller>, listener: TcpListener) -> std::io::Result<Self> {
        listener.set_nonblocking(false)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(Mutex::new(Live {
            streams: HashMap::new(),
            threads: Vec::new(),
        }));
        let accept = {
            let (ctl, stop, live) = (Arc::clone(&ctl), Arc::clone(&stop), Arc::clone(&live));
            std::thread::Builder::new()
                .name("nbd-accept".into())
                .spawn(move || accept_loop(&listener, &ctl, &stop, &live))?
        };
        tracing::info!(%addr, "serving NBD (export \"\" and \"rebound\")");
        Ok(Self {
            ctl,
            addr,
            stop,
            live,
            accept: Some(accept),
        })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The controller behind the server.
    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctl
    }

    /// Stop accepting, close every connection after its in-flight requests,
    /// then shut the controller down (destage and sync).
    pub fn shutdown(mut self) -> std::io::Result<()> {
        self.stop_accepting();
        let threads = {
            let mut live = self.live.lock();
            for s in live.streams.values() {
                let _ = s.shutdown(Shutdown::Read);
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
        let _ = TcpStream::connect(self.addr);
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

fn accept_loop(
    listener: &TcpListener,
    ctl: &Arc<Controller>,
    stop: &AtomicBool,
    live: &Arc<Mutex<Live>>,
) {
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let open = ctl.metrics.connections.load(Ordering::Relaxed) as usize;
        if open >= ctl.config.max_connections {
            tracing::warn!(open, "connection limit reached; refusing a client");
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let Ok(registered) = stream.try_clone() else {
            continue;
        };
        ctl.metrics.connections.fetch_add(1, Ordering::Relaxed);
        ctl.metrics
            .connections_total
            .fetch_add(1, Ordering::Relaxed);
        let (c, l) = (Arc::clone(ctl), Arc::clone(live));
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                crate::host::connection::serve(Arc::clone(&c), stream, id);
                c.metrics.connections.fetch_sub(1, Ordering::Relaxed);
                l.lock().streams.remove(&id);
            });
        match spawned {
            Ok(t) => {
                let mut g = live.lock();
                g.streams.insert(id, registered);
                g.threads.retain(|t| !t.is_finished());
                g.threads.push(t);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start a connection thread");
                ctl.metrics.connections.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
