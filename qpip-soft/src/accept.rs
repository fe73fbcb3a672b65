//! Accepting: a listener's connections and the QPs waiting for them, and the one way a
//! connection becomes a QP's, on whatever thread pairs them.
//!
//! A listener ([`Listening`]) is shared by the queue that listens (its engine mates waiting
//! accepts as connections arrive) and the NIC's queues (`queues::Queues`, the [`QpTable`]
//! that claims and pairs QPs), so that an accept that finds a
//! connection already waiting in the kernel's backlog is answered on the calling thread, with
//! no command and no hand-off to an engine. The kernel's listen queue is the backlog; a
//! connection its peer reset before anyone took it is closed here and never reaches a QP (a
//! port scanner's flood costs the application nothing).
//!
//! Pairing ([`QpTable::pair`]) claims the idle QP (Init → Connecting), records the addresses,
//! makes the QP Ready and answers the accept; the connection itself goes to the QP's queue
//! through that queue's inbox ([`Inbox`], soft-internal) and the QP's doorbell, as the host
//! hands the NIC its WRs: the queue's engine attaches it ([`super::link::EngineQp::attach`])
//! before it reads the QP's rings or runs a command about the QP, so nothing the host does
//! after the accept runs without it.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use qpip_verbs::backend::MgmtResult;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::{QpShared, QpState};
use qpip_verbs::wr::QpNum;

use crate::stream::{Acceptor, Stream};

/// What accepting needs of the NIC's QPs: the NIC's queues implement it.
pub(crate) trait QpTable {
    /// Takes the idle reliable QP `qp` for a connection (Init → Connecting), so that nothing
    /// else pairs or connects it meanwhile.
    fn claim(&self, qp: QpNum) -> io::Result<Arc<QpShared>>;
    /// Gives `stream` to `qp` (claimed by [`QpTable::claim`]) and answers its accept: the QP
    /// is Ready with its addresses from here on; its queue attaches the socket at the QP's
    /// doorbell, before it reads the QP's rings.
    fn pair(
        &self,
        qp: &Arc<QpShared>,
        stream: Stream,
        peer: SocketAddr,
        reply: ReplySender<MgmtResult>,
    );
}

/// Connections handed to one queue's QPs, each taken in by the engine when it next looks at
/// its QP (the QP's doorbell, a command about it). By QP: a queue's commands may run before
/// the creation of a QP that a connection is already waiting for.
#[derive(Default)]
pub(crate) struct Inbox {
    streams: Mutex<HashMap<QpNum, Stream>>,
    /// How many: the engine's look on every doorbell costs one load.
    len: AtomicUsize,
}

impl Inbox {
    pub(crate) fn put(&self, qp: QpNum, stream: Stream) {
        let mut streams = self.streams.lock();
        // A QP is claimed once: nothing is there before.
        streams.insert(qp, stream);
        self.len.store(streams.len(), Ordering::Release);
    }

    /// The connection handed to `qp`, if any.
    pub(crate) fn take(&self, qp: QpNum) -> Option<Stream> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut streams = self.streams.lock();
        let stream = streams.remove(&qp);
        self.len.store(streams.len(), Ordering::Release);
        stream
    }
}

/// A listening socket, with the accepts waiting on it.
pub(crate) struct Listening {
    pub sock: Acceptor,
    backlog: Mutex<Backlog>,
}

#[derive(Default)]
struct Backlog {
    /// Connections taken from the kernel whose accept could not take them (its QP was not
    /// idle, or its waiter gave up): the next accept gets them first.
    pending: VecDeque<(Stream, SocketAddr)>,
    /// QPs waiting for a connection, oldest first.
    accepts: VecDeque<(QpNum, ReplySender<MgmtResult>)>,
}

impl Backlog {
    /// The next live connection: reset ones are closed and skipped. None when none waits
    /// (or the kernel refuses one: EMFILE and friends leave it in the kernel's queue).
    fn take(&mut self, sock: &Acceptor) -> Option<(Stream, SocketAddr)> {
        loop {
            let conn = match self.pending.pop_front() {
                Some(conn) => conn,
                None => match sock.accept() {
                    Ok(conn) => conn,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                        ) =>
                    {
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!("accept failed: {e}");
                        return None;
                    }
                },
            };
            if !conn.0.was_reset() {
                return Some(conn);
            }
        }
    }
}

impl Listening {
    pub(crate) fn new(sock: Acceptor) -> Self {
        Listening {
            sock,
            backlog: Mutex::new(Backlog::default()),
        }
    }

    /// An accept on the calling thread: pairs `qp` with a connection that is already
    /// waiting, unless other accepts wait before it. Gives `reply` back when none is there
    /// (the listener's queue then queues the accept).
    pub(crate) fn accept_now(
        &self,
        all: &dyn QpTable,
        qp: QpNum,
        reply: ReplySender<MgmtResult>,
    ) -> Option<ReplySender<MgmtResult>> {
        let mut b = self.backlog.lock();
        b.accepts.retain(|(_, r)| !r.abandoned());
        if !b.accepts.is_empty() {
            return Some(reply);
        }
        let shared = match all.claim(qp) {
            Ok(shared) => shared,
            Err(e) => {
                reply.send(Err(e));
                return None;
            }
        };
        match b.take(&self.sock) {
            Some((stream, peer)) => {
                all.pair(&shared, stream, peer, reply);
                None
            }
            None => {
                shared.transition(QpState::Connecting, QpState::Init);
                Some(reply)
            }
        }
    }

    /// Queues an accept behind the others (those that timed out go: an idle server's accept
    /// loop leaves one behind at each of its timeouts).
    pub(crate) fn wait(&self, qp: QpNum, reply: ReplySender<MgmtResult>) {
        let mut b = self.backlog.lock();
        b.accepts.retain(|(_, r)| !r.abandoned());
        b.accepts.push_back((qp, reply));
    }

    /// Mates waiting accepts with the connections there are; true while accepts still wait.
    pub(crate) fn mate(&self, all: &dyn QpTable) -> bool {
        let mut b = self.backlog.lock();
        while !b.accepts.is_empty() {
            let Some(conn) = b.take(&self.sock) else {
                break;
            };
            let Some((qp, reply)) = b.accepts.pop_front() else {
                break;
            };
            // Its waiter gave up (a timed-out accept): its QP may be going away.
            if !reply.claim() {
                b.pending.push_front(conn);
                continue;
            }
            match all.claim(qp) {
                Ok(shared) => all.pair(&shared, conn.0, conn.1, reply),
                Err(e) => {
                    b.pending.push_front(conn);
                    reply.send(Err(e));
                }
            }
        }
        !b.accepts.is_empty()
    }

    /// The listener closes: its waiting accepts fail.
    pub(crate) fn close(&self) {
        let accepts = std::mem::take(&mut self.backlog.lock().accepts);
        for (_, reply) in accepts {
            reply.send(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "listener closed",
            )));
        }
    }
}
