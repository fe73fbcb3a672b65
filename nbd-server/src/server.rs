//! The server: exports, listeners on every address, an accept loop per listener, a thread per
//! connection, and an orderly shutdown.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nbd_proto::framing::FrameLimits;
use nbd_proto::handshake::TlsMode;
use nbd_proto::handshake::messages::BlockSize;
use nbd_proto::handshake::server::{Export as ProtoExport, ServerConfig};
use parking_lot::Mutex;
use qpip_core::{CompletionQueue, Endpoint, Listener, Nic, QpAttr, QueuePair, TlsConfig};

use crate::conn::framer::{FramerState, ServerFramer};
use crate::conn::recv_window::{BufferBudget, CHUNK, RECV_SLOTS};
use crate::conn::shared::{RateLimitedLog, ServerShared};
use crate::conn::{self, Connection};
use crate::error::{Chain, Result};
use crate::export::{Export, MetaContext};
use crate::metrics::{Registry, Snapshot};

/// What a server serves and how.
pub struct ServerOptions {
    /// Where to accept clients: bound before the images are opened, so that an address in
    /// use is reported before any image is touched.
    pub listen: Vec<Listener>,
    /// Clients served at once (past the handshake); more are refused after their handshake.
    pub max_connections: usize,
    /// Connections in their handshake at once; a new one beyond this drops the oldest.
    pub max_handshakes: usize,
    /// A client that has not finished its handshake in this time is dropped (qemu-nbd's
    /// --handshake-limit, 10 s by default there and here); None: never.
    pub handshake_limit: Option<Duration>,
    /// Close a connection with nothing in flight after this long without a request.
    pub idle_timeout: Option<Duration>,
    /// Bytes of receive buffers that connections may share beyond their base slots (see
    /// `conn::recv_window`).
    pub buffer_memory: u64,
    /// The export a client gets when it asks for the empty name.
    pub default_export: Option<String>,
    /// Answer NBD_OPT_LIST with the export names.
    pub list_exports: bool,
    /// TLS: how it is offered, and the credentials the NIC uses (with `On`/`Require`).
    pub tls: TlsMode,
    /// The NIC's TLS credentials, with `tls` `On` or `Require`.
    pub tls_config: Option<TlsConfig>,
}

/// A running server.
pub struct Server {
    shared: Arc<ServerShared>,
    accept_threads: Vec<JoinHandle<()>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    local: Vec<Endpoint>,
}

/// Largest request the server accepts (and advertises): 32 MiB, qemu-nbd's default.
pub const MAX_BLOCK: u32 = 32 << 20;

impl Server {
    /// Starts serving `exports` on `nic` as `opts` say: one accept thread per listener.
    pub fn start(nic: Nic, exports: Vec<Arc<Export>>, opts: ServerOptions) -> Result<Server> {
        let proto_exports = exports
            .iter()
            .map(|e| ProtoExport {
                name: e.name.clone(),
                description: e.description.clone(),
                size: e.store.size(),
                flags: e.flags(),
                block_size: Some(BlockSize {
                    min: 1,
                    preferred: 4096,
                    max: MAX_BLOCK,
                }),
                require_block_size: false,
                contexts: e.contexts.iter().map(MetaContext::name).collect(),
            })
            .collect();
        let mut proto = ServerConfig::new(proto_exports);
        proto.default_export = opts.default_export.clone();
        proto.allow_list = opts.list_exports;
        proto.tls = opts.tls;
        let limits = FrameLimits {
            max_option_len: proto.max_option_len,
            max_write_len: MAX_BLOCK,
            ..FrameLimits::default()
        };
        let shared = Arc::new(ServerShared {
            nic: nic.clone(),
            exports,
            proto,
            tls: opts.tls_config,
            limits,
            shutdown: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            max_connections: opts.max_connections,
            handshakes: Mutex::new(VecDeque::new()),
            max_handshakes: opts.max_handshakes.max(1),
            handshake_limit: opts.handshake_limit,
            idle_timeout: opts.idle_timeout,
            refusals: Mutex::new(RateLimitedLog::default()),
            handshake_failures: Mutex::new(RateLimitedLog::default()),
            buffer_budget: BufferBudget::new(
                usize::try_from(opts.buffer_memory).unwrap_or(usize::MAX),
            ),
            metrics: Registry::default(),
        });
        let connections = Arc::new(Mutex::new(Vec::new()));
        let mut accept_threads = Vec::new();
        let mut local = Vec::new();
        for listener in opts.listen {
            let addr = listener.endpoint();
            tracing::debug!("listening on {addr}"); // main prints it
            local.push(addr.clone());
            let shared = shared.clone();
            let connections = connections.clone();
            accept_threads.push(
                std::thread::Builder::new()
                    .name(format!("nbd-accept-{addr}"))
                    .spawn(move || accept_loop(shared, listener, connections))?,
            );
        }
        Ok(Server {
            shared,
            accept_threads,
            connections,
            local,
        })
    }

    /// Where the server listens: the addresses actually bound (port 0 resolved) and the
    /// Unix-domain sockets.
    pub fn local_addrs(&self) -> &[Endpoint] {
        &self.local
    }

    /// Clients past their handshake, served now.
    pub fn active_connections(&self) -> usize {
        self.shared.active.load(Ordering::Acquire)
    }

    /// What reads the server's figures while it runs, from any thread.
    pub fn stats(&self) -> Stats {
        Stats(self.shared.clone())
    }

    /// Orderly shutdown: stop accepting, let connections finish what is in flight (new
    /// requests get ESHUTDOWN), flush every export.
    pub fn shutdown(self, timeout: Duration) {
        self.shared.shutdown.store(true, Ordering::Release);
        for t in self.accept_threads {
            let _ = t.join();
        }
        let deadline = Instant::now() + timeout;
        loop {
            let pending: Vec<JoinHandle<()>> = self.connections.lock().drain(..).collect();
            if pending.is_empty() {
                break;
            }
            for t in pending {
                while !t.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if t.is_finished() {
                    let _ = t.join();
                }
            }
            if Instant::now() >= deadline {
                tracing::warn!("connections still open at the shutdown deadline");
                break;
            }
        }
        for e in &self.shared.exports {
            if let Err(err) = e.store.close() {
                tracing::error!(export = %e.name, "closing {} failed: {err}", e.store.location());
            }
        }
    }
}

/// Reads a running server's figures ([`Server::stats`]).
#[derive(Clone)]
pub struct Stats(Arc<ServerShared>);

impl Stats {
    /// The figures now, of the server, its exports and their open connections.
    pub fn snapshot(&self) -> Snapshot {
        let exports = self.0.exports.iter().map(|e| (e.name.as_str(), &e.stats));
        self.0.metrics.snapshot(exports)
    }
}

fn accept_loop(
    shared: Arc<ServerShared>,
    listener: Listener,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    // The QP that waits for the next client, made once it is needed: a timed-out accept
    // leaves it idle, so the loop's timeouts make no CQ or QP.
    let mut next = None;
    while !shared.shutting_down() {
        let (qp, cq, state) = next.take().unwrap_or_else(|| idle_qp(&shared));
        let peer = match listener.accept_timeout(&qp, Duration::from_millis(200)) {
            Ok(peer) => listener.peer_endpoint(peer),
            Err(qpip_core::Error::Timeout { .. }) => {
                next = Some((qp, cq, state));
                continue;
            }
            Err(e) => {
                tracing::warn!("accept on {}: {e}", listener.endpoint());
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let evict = shared.start_handshake(&peer);
        let s = shared.clone();
        let who = peer.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-{peer}"))
            .spawn(move || {
                if let Err(e) = Connection::new(s, qp, cq, state, who.clone(), evict).run() {
                    tracing::warn!(peer = %who, "connection ended: {}", Chain(&e));
                }
            });
        match spawned {
            Ok(t) => {
                let mut list = connections.lock();
                list.retain(|t| !t.is_finished());
                list.push(t);
            }
            Err(e) => tracing::error!(%peer, "cannot start a connection thread: {e}"),
        }
    }
}

/// A connection's idle QP, its CQ and its framer's state.
fn idle_qp(shared: &ServerShared) -> (QueuePair, CompletionQueue, Arc<FramerState>) {
    let cq = shared.nic.create_cq(conn::CQ_DEPTH);
    cq.set_spin(Duration::ZERO);
    let state = FramerState::new();
    let framer = ServerFramer::new(state.clone(), shared.limits, CHUNK);
    let qp = shared.nic.create_qp(
        QpAttr::new(&cq)
            .framer(framer)
            .depths(conn::CQ_DEPTH, RECV_SLOTS),
    );
    (qp, cq, state)
}
