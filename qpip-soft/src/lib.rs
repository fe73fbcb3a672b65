//! The soft NIC: an engine thread plays the NIC processor and runs the doorbell, management,
//! transmit and receive state machines over the kernel's TCP and UDP sockets.
//!
//! The host side only writes WRs into rings and polls CQs. Ringing the doorbell costs an atomic
//! swap, plus one `eventfd` write when the engine sleeps. The engine runs in the shared NIC
//! thread shell ([`qpip_verbs::machines::shell`]): it polls after its last work for a window
//! learned from arrivals (so a busy stream never pays a wake-up), then the shell sleeps on the
//! engine's epoll (or io_uring) descriptor.

mod accept;
mod engine;
mod link;
mod queues;
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
use qpip_verbs::machines::shell::{NicThread, Processor, ShellConfig};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::shared::QpShared;

use queues::Queues;

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
    /// How the engine does its socket I/O (io_uring where allowed, or epoll).
    pub io: IoMode,
    /// Queues (engine threads), each owning the QPs placed on it. At least 1.
    pub queues: usize,
    /// Host threads waiting on a CQ run its queue's engine themselves
    /// ([`qpip_verbs::drive`]); the engine threads run only while none does. Needs the
    /// epoll data path (an io_uring belongs to the thread that submits to it): on, the
    /// engine uses epoll whatever `io` says.
    pub run_to_completion: bool,
    /// With run to completion: how long an engine thread leaves its queue to the
    /// application threads after their last wait before it drives again itself (work that
    /// arrives while nobody waits waits at most that long, as an interrupt moderation timer
    /// delays an interrupt).
    pub grace: Duration,
}

impl Default for SoftConfig {
    /// A poll window of at most 50 µs, run to completion (so epoll) with
    /// [`default_queues`] queues;
    /// `QPIP_SOFT_SPIN_US`, `QPIP_SOFT_QUEUES`, `QPIP_SOFT_GRACE_US` and `QPIP_SOFT_RTC=0` (engine threads only,
    /// io_uring where available unless `QPIP_SOFT_IO=epoll`) in the environment override
    /// them.
    fn default() -> Self {
        let us = std::env::var("QPIP_SOFT_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        let io = match std::env::var("QPIP_SOFT_IO").as_deref() {
            Ok("epoll") => IoMode::Epoll,
            _ => IoMode::Auto,
        };
        let run_to_completion = std::env::var("QPIP_SOFT_RTC").as_deref() != Ok("0");
        let queues = std::env::var("QPIP_SOFT_QUEUES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| default_queues(run_to_completion));
        let grace = std::env::var("QPIP_SOFT_GRACE_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(qpip_verbs::machines::DRIVE_GRACE, Duration::from_micros);
        SoftConfig {
            spin: Duration::from_micros(us),
            io,
            queues,
            run_to_completion,
            grace,
        }
    }
}

/// One queue per core, as a multi-queue NIC has one per CPU; with run to completion at
/// least [`RTC_MIN_QUEUES`].
pub fn default_queues(run_to_completion: bool) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if run_to_completion {
        cores.max(RTC_MIN_QUEUES)
    } else {
        cores
    }
}

/// Queues a run-to-completion NIC has at least. One thread drives a queue at a time, so
/// connections that share a queue hand their work to its engine thread whenever more than
/// one waits (two hand-offs per request: 4 KiB QD1 through the mount fell to 0.77× the
/// IOPS of a queue per connection, `nbd qd1`); a queue nobody uses costs a parked thread.
pub const RTC_MIN_QUEUES: usize = 8;

/// The soft NIC: its queues' engine threads over kernel sockets.
pub struct SoftBackend {
    queues: Arc<Queues>,
    /// "io_uring" or "epoll": decided before the engine starts.
    io_path: &'static str,
}

const WAKER_TOKEN: mio::Token = mio::Token(usize::MAX);

impl SoftBackend {
    /// Starts the queues' engines as `cfg` says, over the NIC's registered `memory`.
    pub fn start(cfg: SoftConfig, memory: Arc<MemoryTable>) -> Result<Self> {
        let queues = Queues::new(cfg.queues);
        let uring = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::with_capacity(queues.len());
        for q in 0..queues.len() {
            let poll = mio::Poll::new().map_err(|e| Error::Engine(format!("epoll: {e}")))?;
            let waker = mio::Waker::new(poll.registry(), WAKER_TOKEN)
                .map_err(|e| Error::Engine(format!("eventfd: {e}")))?;
            let shell = ShellConfig {
                name: "qpip-soft-nic",
                spin: cfg.spin,
                doorbell_fifo: None,
                grace: cfg.grace,
            };
            let (memory, engine_queues) = (memory.clone(), Arc::downgrade(&queues));
            let thread = if cfg.run_to_completion {
                // Host threads run it too: the epoll engine, the one that may run anywhere.
                NicThread::spawn_driven(shell, waker, move || {
                    engine::Engine::epoll(poll, memory, q, engine_queues)
                })
            } else {
                let (engine_uring, io) = (uring.clone(), cfg.io);
                // The ring is opened on the engine thread: the kernel ties a ring to the task
                // that creates it, and tearing it down interrupts that task's blocking calls.
                NicThread::spawn(shell, waker, move || -> Box<dyn Processor> {
                    let ring = engine::open_ring(&poll, io);
                    if q == 0 {
                        engine_uring.store(ring.is_some(), Ordering::Release);
                    }
                    match ring {
                        Some(ring) => {
                            Box::new(engine::Engine::uring(poll, memory, ring, q, engine_queues))
                        }
                        None => Box::new(engine::Engine::epoll(poll, memory, q, engine_queues)),
                    }
                })
            };
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    threads.iter().for_each(NicThread::shutdown);
                    return Err(e);
                }
            }
        }
        queues.set_threads(threads);
        let io_path = if uring.load(Ordering::Acquire) {
            "io_uring"
        } else {
            "epoll"
        };
        Ok(SoftBackend { queues, io_path })
    }

    /// How many queues (engine threads) the NIC runs.
    pub fn queues(&self) -> usize {
        self.queues.len()
    }
}

impl NicBackend for SoftBackend {
    fn name(&self) -> &'static str {
        "soft"
    }

    fn manage(&self, cmd: Command) {
        self.queues.route(cmd);
    }

    fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        self.queues.ring_doorbell(qp);
    }

    fn io_path(&self) -> &'static str {
        self.io_path
    }

    fn engine_threads(&self) -> Vec<i32> {
        self.queues.engine_threads()
    }

    fn driven_cpu(&self) -> Duration {
        self.queues.driven_cpu()
    }

    fn shutdown(&self) {
        self.queues.shutdown();
    }
}
