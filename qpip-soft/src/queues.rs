//! The soft NIC's queues, as a multi-queue NIC has a ring pair and an interrupt per core: each
//! queue is an engine thread of its own (its own epoll or io_uring, doorbell FIFO and QPs), so
//! nothing on the data path is shared between queues. A QP lives on one queue for its life,
//! the one with the fewest QPs when it was created, so a server's connections spread over the
//! queues as RSS spreads flows. A listener lives on one queue; a connection it accepts for a
//! QP of another queue is handed to that queue ([`Accepted`]), behind the commands already
//! sent there (the QP's creation among them). A QP whose CQs already serve QPs of a queue
//! joins that queue, so that a thread waiting on its CQ can drive one queue for all of them.
//!
//! Ownership: the backend owns the `Queues`, which own each queue's [`NicThread`] and through
//! it the queue's engine; an engine reaches the other queues through a `Weak`, so nothing
//! owns its owner. The backend goes when the verbs' last handle on the NIC does (the last
//! `Nic`, QP or listener): [`Queues::shutdown`] stops and joins every engine thread, then
//! dropping the queues drops the engines, closing their sockets, epolls and eventfds.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use qpip_verbs::backend::{Command, ListenerId, MgmtResult};
use qpip_verbs::machines::shell::NicThread;
use qpip_verbs::reply::{ReplySender, reply_channel};
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::QpNum;

use crate::stream::Stream;

/// A connection the listener's queue accepted for a QP that lives on another queue.
pub(crate) struct Accepted {
    pub qp: QpNum,
    pub stream: Stream,
    pub peer: SocketAddr,
    pub reply: ReplySender<MgmtResult>,
}

pub(crate) struct Queues {
    /// Set once every queue's thread runs (the engines hold this table before that).
    threads: OnceLock<Vec<NicThread>>,
    /// Live QPs per queue.
    loads: Vec<AtomicUsize>,
    /// The queue of each live QP, for the commands that name a QP by number.
    placed: Mutex<HashMap<QpNum, usize>>,
}

impl Queues {
    pub(crate) fn new(n: usize) -> Arc<Queues> {
        Arc::new(Queues {
            threads: OnceLock::new(),
            loads: (0..n.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            placed: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.loads.len()
    }

    pub(crate) fn set_threads(&self, threads: Vec<NicThread>) {
        debug_assert_eq!(threads.len(), self.len());
        if self.threads.set(threads).is_err() {
            tracing::error!("soft NIC queues started twice");
        }
    }

    fn threads(&self) -> &[NicThread] {
        self.threads.get().map_or(&[], Vec::as_slice)
    }

    /// The queue of `qp`, if it lives.
    pub(crate) fn queue_of(&self, qp: QpNum) -> Option<usize> {
        self.placed.lock().get(&qp).copied()
    }

    /// Hands `cmd` to queue `q`.
    pub(crate) fn send(&self, q: usize, cmd: Command) {
        match self.threads().get(q) {
            Some(t) => t.manage(cmd),
            None => tracing::error!("soft NIC: no queue {q}"),
        }
    }

    /// Places a new QP on the queue its CQs are driven on, if they are, else on the queue
    /// with the fewest QPs; binds its CQs to that queue (run to completion).
    fn place(&self, qp: &QpShared) -> usize {
        let threads = self.threads();
        let driven_on = |t: &NicThread| {
            qp.cqs().iter().any(|cq| {
                cq.driver()
                    .zip(t.driver())
                    .is_some_and(|(a, b)| Arc::ptr_eq(&a, b))
            })
        };
        let q = threads.iter().position(driven_on).unwrap_or_else(|| {
            (0..self.len())
                .min_by_key(|&q| self.loads[q].load(Ordering::Relaxed))
                .unwrap_or(0)
        });
        if let Some(driver) = threads.get(q).and_then(NicThread::driver) {
            qp.cqs().iter().for_each(|cq| cq.bind_driver(driver));
        }
        self.loads[q].fetch_add(1, Ordering::Relaxed);
        qp.queue.store(q as u32, Ordering::Release);
        self.placed.lock().insert(qp.num, q);
        q
    }

    fn forget(&self, qp: QpNum) -> Option<usize> {
        let q = self.placed.lock().remove(&qp)?;
        self.loads[q].fetch_sub(1, Ordering::Relaxed);
        Some(q)
    }

    fn listener_queue(&self, id: ListenerId) -> usize {
        id as usize % self.len()
    }

    /// Sends a management command to the queue it concerns.
    pub(crate) fn route(&self, cmd: Command) {
        let q = match &cmd {
            Command::CreateQp { qp, .. } => self.place(qp),
            Command::BindUdp { qp, .. }
            | Command::Connect { qp, .. }
            | Command::ConnectUnix { qp, .. }
            | Command::StartTls { qp, .. }
            | Command::Close { qp }
            | Command::Disconnect { qp } => self.queue_of(*qp).unwrap_or(0),
            Command::Destroy { qp } => self.forget(*qp).unwrap_or(0),
            Command::Listen { id, .. }
            | Command::ListenUnix { id, .. }
            | Command::ListenFd { id, .. } => self.listener_queue(*id),
            Command::Accept { listener, .. } | Command::CloseListener { listener } => {
                self.listener_queue(*listener)
            }
            Command::Fence { .. } if self.len() > 1 => return self.fence_all(cmd),
            _ => 0,
        };
        self.send(q, cmd);
    }

    /// A fence on every queue, answered once all have answered.
    fn fence_all(&self, cmd: Command) {
        let Command::Fence { reply } = cmd else {
            return;
        };
        let answers: Vec<_> = (0..self.len())
            .map(|q| {
                let (tx, rx) = reply_channel();
                self.send(q, Command::Fence { reply: tx });
                rx
            })
            .collect();
        // Fences are rare (a client recovering a connection): a short-lived thread joins them.
        let joined = std::thread::Builder::new()
            .name("qpip-soft-fence".into())
            .spawn(move || {
                if answers.into_iter().all(|rx| rx.wait_until(None).is_some()) {
                    reply.send(());
                }
            });
        if let Err(e) = joined {
            tracing::error!("soft NIC: cannot start a fence: {e}");
        }
    }

    /// The doorbell of `qp`'s queue.
    #[inline]
    pub(crate) fn ring_doorbell(&self, qp: &QpShared) {
        let q = qp.queue.load(Ordering::Acquire) as usize;
        if let Some(t) = self.threads().get(q) {
            t.ring_doorbell(qp);
        }
    }

    pub(crate) fn engine_threads(&self) -> Vec<i32> {
        self.threads()
            .iter()
            .flat_map(NicThread::engine_threads)
            .collect()
    }

    pub(crate) fn driven_cpu(&self) -> std::time::Duration {
        self.threads().iter().map(NicThread::driven_cpu).sum()
    }

    pub(crate) fn shutdown(&self) {
        for t in self.threads() {
            t.shutdown();
        }
    }
}
