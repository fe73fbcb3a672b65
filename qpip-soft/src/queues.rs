//! The soft NIC's queues, as a multi-queue NIC has a ring pair and an interrupt per core: each
//! queue is an engine thread of its own (its own epoll or io_uring, doorbell FIFO and QPs), so
//! nothing on the data path is shared between queues. A QP lives on one queue for its life,
//! the one with the fewest QPs when it was created, so a server's connections spread over the
//! queues as RSS spreads flows. A listener lives on one queue, which mates the accepts that
//! wait on it; an accept that finds a connection waiting is answered on the calling thread
//! ([`crate::accept`]). Either way the connection reaches its QP's queue through that queue's
//! inbox and the QP's doorbell, behind the commands already sent there (the QP's creation
//! among them). A QP whose CQs already serve QPs of a queue joins that queue, so that a thread
//! waiting on its CQ can drive one queue for all of them.
//!
//! Ownership: the backend owns the `Queues`, which own each queue's [`NicThread`] and through
//! it the queue's engine; an engine reaches the other queues through a `Weak`, so nothing
//! owns its owner. The backend goes when the verbs' last handle on the NIC does (the last
//! `Nic`, QP or listener): [`Queues::shutdown`] stops and joins every engine thread, then
//! dropping the queues drops the engines, closing their sockets, epolls and eventfds.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;
use qpip_verbs::backend::{Command, ListenerId, MgmtResult};
use qpip_verbs::machines::mgmt::{no_qp, not_idle};
use qpip_verbs::machines::shell::NicThread;
use qpip_verbs::reply::{ReplySender, reply_channel};
use qpip_verbs::shared::{QpKind, QpShared, QpState};
use qpip_verbs::wr::QpNum;

use crate::accept::{Inbox, Listening, QpTable};
use crate::stream::Stream;

/// Where a live QP is.
struct Placed {
    queue: usize,
    /// Its rings and state, for pairing it with a connection (weak: the QP's handle owns it).
    qp: Weak<QpShared>,
}

pub(crate) struct Queues {
    /// Set once every queue's thread runs (the engines hold this table before that).
    threads: OnceLock<Vec<NicThread>>,
    /// Live QPs per queue.
    loads: Vec<AtomicUsize>,
    /// Each live QP, for the commands that name a QP by number.
    placed: Mutex<HashMap<QpNum, Placed>>,
    /// Each queue's inbox of connections for its QPs.
    inboxes: Vec<Arc<Inbox>>,
    /// The open listeners, for accepts answered on the calling thread.
    listening: Mutex<HashMap<ListenerId, Arc<Listening>>>,
}

impl Queues {
    pub(crate) fn new(n: usize) -> Arc<Queues> {
        let n = n.max(1);
        Arc::new(Queues {
            threads: OnceLock::new(),
            loads: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            placed: Mutex::new(HashMap::new()),
            inboxes: (0..n).map(|_| Arc::default()).collect(),
            listening: Mutex::new(HashMap::new()),
        })
    }

    /// Queue `q`'s inbox.
    pub(crate) fn inbox(&self, q: usize) -> &Arc<Inbox> {
        &self.inboxes[q.min(self.inboxes.len() - 1)]
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
    fn queue_of(&self, qp: QpNum) -> Option<usize> {
        self.placed.lock().get(&qp).map(|p| p.queue)
    }

    /// A listener opened on one of the queues.
    pub(crate) fn add_listener(&self, id: ListenerId, l: Arc<Listening>) {
        self.listening.lock().insert(id, l);
    }

    /// A listener closed.
    pub(crate) fn remove_listener(&self, id: ListenerId) {
        self.listening.lock().remove(&id);
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
    fn place(&self, qp: &Arc<QpShared>) -> usize {
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
        let placed = Placed {
            queue: q,
            qp: Arc::downgrade(qp),
        };
        self.placed.lock().insert(qp.num, placed);
        q
    }

    fn forget(&self, qp: QpNum) -> Option<usize> {
        let q = self.placed.lock().remove(&qp)?.queue;
        self.loads[q].fetch_sub(1, Ordering::Relaxed);
        Some(q)
    }

    fn listener_queue(&self, id: ListenerId) -> usize {
        id as usize % self.len()
    }

    /// Sends a management command to the queue it concerns; an accept that finds a
    /// connection waiting is answered here, on the calling thread.
    pub(crate) fn route(&self, cmd: Command) {
        let cmd = match cmd {
            Command::Accept {
                listener,
                qp,
                reply,
            } => {
                let l = self.listening.lock().get(&listener).cloned();
                let reply = match l {
                    Some(l) => match l.accept_now(self, qp, reply) {
                        Some(reply) => reply,
                        None => return,
                    },
                    None => reply,
                };
                Command::Accept {
                    listener,
                    qp,
                    reply,
                }
            }
            cmd => cmd,
        };
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

impl QpTable for Queues {
    fn claim(&self, qp: QpNum) -> io::Result<Arc<QpShared>> {
        let shared = self.placed.lock().get(&qp).and_then(|p| p.qp.upgrade());
        let shared = shared.ok_or_else(|| no_qp(qp))?;
        if shared.kind == QpKind::Reliable && shared.transition(QpState::Init, QpState::Connecting)
        {
            Ok(shared)
        } else {
            Err(not_idle(qp, "reliable"))
        }
    }

    fn pair(
        &self,
        qp: &Arc<QpShared>,
        stream: Stream,
        peer: SocketAddr,
        reply: ReplySender<MgmtResult>,
    ) {
        let (local, remote) = stream.ip_addrs();
        qp.set_addrs(local, remote.map(|_| peer));
        qp.transition(QpState::Connecting, QpState::Ready);
        let q = qp.queue.load(Ordering::Acquire) as usize;
        self.inbox(q).put(qp.num, stream);
        self.ring_doorbell(qp);
        reply.send(Ok(peer));
    }
}
