//! The soft NIC: an engine thread plays the NIC processor and runs the doorbell, management,
//! transmit and receive state machines over the kernel's TCP and UDP sockets.
//!
//! The host side only writes WRs into rings and polls CQs. Ringing the doorbell costs an atomic
//! swap, plus one `eventfd` write when the engine sleeps. The engine spins for a short while
//! after its last work (so a busy stream never pays a wake-up), then sleeps in `epoll_wait`.

mod engine;
mod link;
pub(crate) mod rx;
pub(crate) mod tx;
mod uring;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering, fence};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use crate::backend::{Command, NicBackend};
use crate::error::{Error, Result};
use crate::mr::MemoryTable;
use crate::qp::QpShared;
use crate::wr::QpNum;

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
    /// How long the engine keeps polling after its last piece of work before it sleeps.
    pub spin: Duration,
    pub io: IoMode,
}

impl Default for SoftConfig {
    /// 50 µs of spinning and io_uring where available; `QPIP_SOFT_SPIN_US` and
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

/// What the host threads and the engine thread share.
struct Shared {
    commands: SegQueue<Command>,
    /// The doorbell FIFO: QPs with newly posted WRs.
    doorbells: SegQueue<QpNum>,
    sleeping: AtomicBool,
    stop: AtomicBool,
    waker: mio::Waker,
    engine_tid: AtomicI32,
    /// Whether the engine got an io_uring (set once it has started).
    uring: AtomicBool,
}

impl Shared {
    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the soft NIC engine: {e}");
        }
    }
}

pub(crate) struct SoftBackend {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The completion status for a failed socket operation.
fn status_of(e: &std::io::Error) -> crate::wr::WcStatus {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => {
            crate::wr::WcStatus::RemoteClosed
        }
        _ => crate::wr::WcStatus::TransportError,
    }
}

const WAKER_TOKEN: mio::Token = mio::Token(usize::MAX);

impl SoftBackend {
    pub(crate) fn start(cfg: SoftConfig, memory: Arc<MemoryTable>) -> Result<Self> {
        let poll = mio::Poll::new().map_err(|e| Error::Engine(format!("epoll: {e}")))?;
        let waker = mio::Waker::new(poll.registry(), WAKER_TOKEN)
            .map_err(|e| Error::Engine(format!("eventfd: {e}")))?;
        let shared = Arc::new(Shared {
            commands: SegQueue::new(),
            doorbells: SegQueue::new(),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            waker,
            engine_tid: AtomicI32::new(0),
            uring: AtomicBool::new(false),
        });
        let engine = engine::Engine::new(poll, shared.clone(), memory, cfg);
        let thread = std::thread::Builder::new()
            .name("qpip-soft-nic".into())
            .spawn(move || engine.run())
            .map_err(|e| Error::Engine(format!("cannot start the engine thread: {e}")))?;
        Ok(SoftBackend {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }
}

impl NicBackend for SoftBackend {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn manage(&self, cmd: Command) {
        self.shared.commands.push(cmd);
        self.shared.wake();
    }

    fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        if qp.doorbell.swap(true, Ordering::AcqRel) {
            return; // already in the FIFO; the engine drains the rings after clearing the flag
        }
        self.shared.doorbells.push(qp.num);
        // Pairs with the engine's fence between announcing sleep and re-checking the FIFO.
        fence(Ordering::SeqCst);
        if self.shared.sleeping.load(Ordering::Relaxed) {
            self.shared.wake();
        }
    }

    fn io_path(&self) -> &'static str {
        if self.shared.uring.load(Ordering::Acquire) {
            "io_uring"
        } else {
            "epoll"
        }
    }

    fn engine_threads(&self) -> Vec<i32> {
        match self.shared.engine_tid.load(Ordering::Acquire) {
            0 => vec![],
            tid => vec![tid],
        }
    }

    fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(t) = self.thread.lock().take()
            && t.join().is_err()
        {
            tracing::error!("the soft NIC engine thread panicked");
        }
    }
}
