//! The soft NIC: an engine thread plays the NIC processor and runs the doorbell, management,
//! transmit and receive state machines over the kernel's TCP and UDP sockets.
//!
//! The host side only writes WRs into rings and polls CQs. Ringing the doorbell costs an atomic
//! swap, plus one `eventfd` write when the engine sleeps. The engine runs in the shared NIC
//! thread shell ([`qpip_verbs::machines::shell`]): it polls after its last work for a window
//! learned from arrivals (so a busy stream never pays a wake-up), then sleeps in `epoll_wait`
//! (or io_uring).

mod engine;
mod link;
mod splice;
mod stream;
mod tls;
mod tx;
mod uring;

/// Checks that `config`'s files load and fit together (certificate and key, CA), as a
/// connection's TLS will load them: errors name the file at fault.
pub fn check_tls(config: &qpip_verbs::tls::TlsConfig) -> std::io::Result<()> {
    tls::context(config).map(drop)
}

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use qpip_verbs::backend::{Command, NicBackend};
use qpip_verbs::error::{Error, Result};
use qpip_verbs::machines::shell::{NicThread, ShellConfig};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::shared::QpShared;

/// How the engine moves bytes through the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// io_uring where the kernel allows it, epoll otherwise.
    Auto,
    /// epoll readiness and plain `readv`/`writev`.
    Epoll,
}

/// Settings of the soft NIC engine.
#[derive(Clone, Debug)]
pub struct SoftConfig {
    /// The longest the engine polls after its last piece of work before it sleeps (the
    /// window it learns from arrivals stays within it).
    pub spin: Duration,
    pub io: IoMode,
}

impl Default for SoftConfig {
    /// A poll window of at most 50 µs and io_uring where available; `QPIP_SOFT_SPIN_US` and
    /// `QPIP_SOFT_IO=epoll` in the environment override them.
    fn default() -> Self {
        let us = std::env::var("QPIP_SOFT_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        let io = match std::env::var("QPIP_SOFT_IO").as_deref() {
            Ok("epoll") => IoMode::Epoll,
            _ => IoMode::Auto,
        };
        SoftConfig {
            spin: Duration::from_micros(us),
            io,
        }
    }
}

pub struct SoftBackend {
    thread: NicThread,
    /// "io_uring" or "epoll": decided before the engine starts.
    io_path: &'static str,
}

const WAKER_TOKEN: mio::Token = mio::Token(usize::MAX);

impl SoftBackend {
    pub fn start(cfg: SoftConfig, memory: Arc<MemoryTable>) -> Result<Self> {
        let poll = mio::Poll::new().map_err(|e| Error::Engine(format!("epoll: {e}")))?;
        let waker = mio::Waker::new(poll.registry(), WAKER_TOKEN)
            .map_err(|e| Error::Engine(format!("eventfd: {e}")))?;
        let shell = ShellConfig {
            name: "qpip-soft-nic",
            spin: cfg.spin,
            doorbell_fifo: None,
        };
        let uring = Arc::new(AtomicBool::new(false));
        let engine_uring = uring.clone();
        // The ring is opened on the engine thread: the kernel ties a ring to the task that
        // creates it, and tearing it down interrupts that task's blocking system calls.
        let thread = NicThread::spawn(shell, waker, move || {
            let ring = engine::open_ring(&poll, cfg.io);
            engine_uring.store(ring.is_some(), Ordering::Release);
            engine::Engine::new(poll, memory, ring)
        })?;
        let io_path = if uring.load(Ordering::Acquire) {
            "io_uring"
        } else {
            "epoll"
        };
        Ok(SoftBackend { thread, io_path })
    }
}

impl NicBackend for SoftBackend {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn manage(&self, cmd: Command) {
        self.thread.manage(cmd);
    }

    fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        self.thread.ring_doorbell(qp);
    }

    fn io_path(&self) -> &'static str {
        self.io_path
    }

    fn engine_threads(&self) -> Vec<i32> {
        self.thread.engine_threads()
    }

    fn shutdown(&self) {
        self.thread.shutdown();
    }
}
