//! What the accept loops and the connections share: the NIC, the exports, the protocol
//! configuration, and the limits on connections (places past the handshake, handshakes
//! under way, the receive-buffer pool).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nbd_proto::framing::FrameLimits;
use nbd_proto::handshake::server::ServerConfig;
use parking_lot::Mutex;
use qpip_core::{Endpoint, Nic, TlsConfig};

use super::recv_window::BufferBudget;
use crate::error::Chain;
use crate::export::Export;
use crate::metrics::Registry;

/// What the accept loops and connections share.
pub(crate) struct ServerShared {
    pub nic: Nic,
    pub exports: Vec<Arc<Export>>,
    pub proto: ServerConfig,
    /// The credentials a connection switches to TLS with, on NBD_OPT_STARTTLS.
    pub tls: Option<TlsConfig>,
    pub limits: FrameLimits,
    pub(crate) shutdown: AtomicBool,
    /// Connections past the handshake (in the transmission phase).
    pub(crate) active: AtomicUsize,
    pub(crate) max_connections: usize,
    /// Eviction flags of the connections still in their handshake, oldest first.
    pub(crate) handshakes: Mutex<VecDeque<Arc<AtomicBool>>>,
    pub(crate) max_handshakes: usize,
    /// How long a handshake may take (None: no limit).
    pub(crate) handshake_limit: Option<std::time::Duration>,
    pub idle_timeout: Option<Duration>,
    pub(crate) refusals: Mutex<RateLimitedLog>,
    /// Connections that ended in their handshake (a client that connects and resets).
    pub(crate) handshake_failures: Mutex<RateLimitedLog>,
    /// Memory connections may take beyond their base (`--buffer-memory`): receive slots
    /// and read buffers.
    pub buffer_budget: BufferBudget,
    /// Handshakes counted and connection ids ([`crate::metrics`]).
    pub metrics: Registry,
}

impl ServerShared {
    pub(crate) fn shutting_down(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Takes one of the `max_connections` transmission-phase places, or None when all are
    /// taken (the place is given back when the returned guard drops).
    pub(crate) fn admit(self: &Arc<Self>, peer: &Endpoint) -> Option<Admitted> {
        if self.active.fetch_add(1, Ordering::AcqRel) >= self.max_connections {
            self.active.fetch_sub(1, Ordering::AcqRel);
            let max = self.max_connections;
            self.refusals.lock().log(|suppressed| {
                tracing::warn!(%peer, "refusing a client: already serving {max} (--max-connections){suppressed}");
            });
            return None;
        }
        Some(Admitted(self.clone()))
    }

    /// A connection ended in its handshake with `e`: each at debug level, and as a warning
    /// at most once a second, since a flood of clients that connect and reset ends
    /// thousands a second (qemu-nbd logs none of them).
    pub(crate) fn handshake_failed(&self, peer: &Endpoint, e: &crate::error::Error) {
        tracing::debug!(%peer, "connection ended in its handshake: {}", Chain(e));
        self.handshake_failures.lock().log(|suppressed| {
            tracing::warn!(%peer, "connection ended in its handshake: {}{suppressed}", Chain(e));
        });
    }

    /// Registers a connection that starts its handshake. When `max_handshakes` are already
    /// under way, the oldest is told to give up: idle or slow sockets cannot lock out a
    /// client that completes its handshake in milliseconds.
    pub(crate) fn start_handshake(&self, peer: &Endpoint) -> Arc<AtomicBool> {
        let evict = Arc::new(AtomicBool::new(false));
        let mut pending = self.handshakes.lock();
        // A flag nobody else holds belongs to a handshake that has ended.
        pending.retain(|f| Arc::strong_count(f) > 1);
        if pending.len() >= self.max_handshakes
            && let Some(oldest) = pending.pop_front()
        {
            oldest.store(true, Ordering::Release);
            let max = self.max_handshakes;
            self.refusals.lock().log(|suppressed| {
                tracing::warn!(%peer, "{max} handshakes unfinished: dropping the oldest to admit a new client{suppressed}");
            });
        }
        pending.push_back(evict.clone());
        evict
    }
}

/// A place among the `max_connections`; given back on drop.
pub(crate) struct Admitted(Arc<ServerShared>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// At most one log line a second for a condition a flood can trigger thousands of times;
/// the next line says how many were left out.
#[derive(Default)]
pub(crate) struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimitedLog {
    fn log(&mut self, emit: impl FnOnce(&str)) {
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            self.suppressed += 1;
            return;
        }
        let note = match self.suppressed {
            0 => String::new(),
            n => format!(" ({n} more like this not logged)"),
        };
        emit(&note);
        self.last = Some(Instant::now());
        self.suppressed = 0;
    }
}
