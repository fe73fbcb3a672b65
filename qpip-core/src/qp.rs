//! Queue pairs: a send queue and a receive queue of work requests, on one connection (reliable,
//! TCP) or one bound port (unreliable, UDP).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use crate::backend::{Command, MgmtResult};
use crate::cq::{CompletionQueue, CqShared};
use crate::error::{Error, Result};
use crate::framer::{Framer, LengthPrefixed};
use crate::nic::NicInner;
use crate::reply::reply_channel;
use crate::wr::{Completion, Opcode, QpNum, RecvWr, SendWr, WcStatus};

/// Reliable (TCP) or unreliable (UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpKind {
    Reliable,
    Unreliable,
}

/// Where a QP is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum QpState {
    /// Created; WRs may be posted, nothing moves until it is connected (or accepted).
    Init = 0,
    Connecting = 1,
    /// Connected (reliable) or bound (unreliable): WRs are carried out.
    Ready = 2,
    /// An orderly close is under way: posted sends finish, new ones are refused.
    Closing = 3,
    Closed = 4,
    /// A fatal error; every outstanding WR was flushed.
    Error = 5,
}

impl QpState {
    fn from_u8(v: u8) -> QpState {
        match v {
            0 => QpState::Init,
            1 => QpState::Connecting,
            2 => QpState::Ready,
            3 => QpState::Closing,
            4 => QpState::Closed,
            _ => QpState::Error,
        }
    }
}

/// The part of a QP that the host and the NIC share: the work queues (rings in memory both
/// see), the CQs, the state and the doorbell flag.
pub struct QpShared {
    pub num: QpNum,
    pub kind: QpKind,
    pub sq: ArrayQueue<SendWr>,
    pub rq: ArrayQueue<RecvWr>,
    sq_outstanding: AtomicUsize,
    rq_outstanding: AtomicUsize,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    state: AtomicU8,
    /// Set by the host when it rings the doorbell, cleared by the NIC when it looks: one
    /// doorbell entry per QP however many WRs were posted meanwhile.
    pub doorbell: AtomicBool,
    /// (local, peer), as the NIC last set them.
    addrs: parking_lot::Mutex<(Option<SocketAddr>, Option<SocketAddr>)>,
}

impl QpShared {
    pub(crate) fn new(num: QpNum, kind: QpKind, attr: &QpAttr) -> Self {
        QpShared {
            num,
            kind,
            sq: ArrayQueue::new(attr.max_send_wr),
            rq: ArrayQueue::new(attr.max_recv_wr),
            sq_outstanding: AtomicUsize::new(0),
            rq_outstanding: AtomicUsize::new(0),
            send_cq: attr.send_cq.shared.clone(),
            recv_cq: attr.recv_cq.shared.clone(),
            state: AtomicU8::new(QpState::Init as u8),
            doorbell: AtomicBool::new(false),
            addrs: parking_lot::Mutex::new((None, None)),
        }
    }

    /// Puts a receive WR on the ring as `post_recv` does (tests of the NIC machines, and the
    /// virtual-time simulation, which writes rings at the host's time). False if full.
    pub(crate) fn push_recv(&self, wr: RecvWr) -> bool {
        self.rq_outstanding.fetch_add(1, Ordering::AcqRel);
        let ok = self.rq.push(wr).is_ok();
        if !ok {
            self.rq_outstanding.fetch_sub(1, Ordering::AcqRel);
        }
        ok
    }

    /// Puts a send WR on the ring as `post_send` does (the virtual-time simulation). False if
    /// full.
    pub(crate) fn push_send(&self, wr: SendWr) -> bool {
        self.sq_outstanding.fetch_add(1, Ordering::AcqRel);
        let ok = self.sq.push(wr).is_ok();
        if !ok {
            self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
        }
        ok
    }

    pub fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }
    pub fn set_state(&self, s: QpState) {
        self.state.store(s as u8, Ordering::Release);
    }

    pub fn set_addrs(&self, local: Option<SocketAddr>, peer: Option<SocketAddr>) {
        *self.addrs.lock() = (local, peer);
    }

    /// Posts a completion for a send WR (NIC side).
    pub fn complete_send(&self, wr_id: u64, status: WcStatus, byte_len: u32, os_error: i32) {
        self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
        self.send_cq.push(Completion {
            wr_id,
            qp_num: self.num,
            opcode: Opcode::Send,
            status,
            byte_len,
            src: None,
            os_error,
        });
    }

    /// Posts a completion for a receive WR (NIC side).
    pub fn complete_recv(
        &self,
        wr_id: u64,
        status: WcStatus,
        byte_len: u32,
        src: Option<SocketAddr>,
        os_error: i32,
    ) {
        self.rq_outstanding.fetch_sub(1, Ordering::AcqRel);
        self.recv_cq.push(Completion {
            wr_id,
            qp_num: self.num,
            opcode: Opcode::Recv,
            status,
            byte_len,
            src,
            os_error,
        });
    }

    /// Flushes every WR still in the rings (NIC side; WRs it already took are its own business).
    pub fn flush_queues(&self) {
        while let Some(wr) = self.sq.pop() {
            self.complete_send(wr.wr_id, WcStatus::Flushed, 0, 0);
        }
        while let Some(wr) = self.rq.pop() {
            self.complete_recv(wr.wr_id, WcStatus::Flushed, 0, None, 0);
        }
    }

    /// Wakes whoever waits on this QP's CQs (after a batch of completions).
    pub fn notify_cqs(&self) {
        self.send_cq.notify();
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.recv_cq.notify();
        }
    }
}

/// How to build a QP.
pub struct QpAttr {
    pub send_cq: CompletionQueue,
    pub recv_cq: CompletionQueue,
    pub max_send_wr: usize,
    pub max_recv_wr: usize,
    pub framer: Box<dyn Framer>,
}

impl QpAttr {
    /// Both queues complete into `cq`; 256 WRs each; length-prefixed messages.
    pub fn new(cq: &CompletionQueue) -> Self {
        QpAttr {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            max_send_wr: 256,
            max_recv_wr: 256,
            framer: Box::new(LengthPrefixed::default()),
        }
    }
    pub fn framer(mut self, framer: impl Framer) -> Self {
        self.framer = Box::new(framer);
        self
    }
    pub fn depths(mut self, max_send_wr: usize, max_recv_wr: usize) -> Self {
        self.max_send_wr = max_send_wr.max(1);
        self.max_recv_wr = max_recv_wr.max(1);
        self
    }
    pub fn recv_cq(mut self, cq: &CompletionQueue) -> Self {
        self.recv_cq = cq.clone();
        self
    }
}

/// A queue pair. Dropping it disconnects and destroys it; outstanding WRs are flushed.
pub struct QueuePair {
    pub(crate) shared: Arc<QpShared>,
    pub(crate) nic: Arc<NicInner>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("num", &self.shared.num)
            .field("kind", &self.shared.kind)
            .field("state", &self.state())
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn create(
        nic: &Arc<NicInner>,
        num: QpNum,
        kind: QpKind,
        attr: QpAttr,
    ) -> (QueuePair, Box<dyn Framer>) {
        let shared = Arc::new(QpShared::new(num, kind, &attr));
        (
            QueuePair {
                shared,
                nic: nic.clone(),
            },
            attr.framer,
        )
    }

    pub fn num(&self) -> QpNum {
        self.shared.num
    }
    pub fn kind(&self) -> QpKind {
        self.shared.kind
    }
    pub fn state(&self) -> QpState {
        self.shared.state()
    }

    /// Posts a send WR: writes it into the send ring and rings the doorbell. No system call
    /// unless the NIC engine sleeps.
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        let state = self.state();
        if !matches!(state, QpState::Init | QpState::Connecting | QpState::Ready) {
            return Err(Error::BadState {
                qp: self.num(),
                state,
                op: "post a send",
            });
        }
        if wr.len() > u64::from(u32::MAX) {
            return Err(Error::InvalidWr("a message is at most 4 GiB - 1"));
        }
        if self.kind() == QpKind::Unreliable && wr.dest.is_none() {
            return Err(Error::InvalidWr(
                "a send on an unreliable QP needs a destination",
            ));
        }
        Self::reserve(
            &self.shared.sq_outstanding,
            self.shared.sq.capacity(),
            self.num(),
            "send",
        )?;
        // Cannot fail: outstanding WRs never exceed the ring's capacity.
        let _ = self.shared.sq.push(wr);
        self.nic.ring_doorbell(&self.shared);
        Ok(())
    }

    /// Posts a receive WR: memory for the next arriving message.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let state = self.state();
        if !matches!(state, QpState::Init | QpState::Connecting | QpState::Ready) {
            return Err(Error::BadState {
                qp: self.num(),
                state,
                op: "post a receive",
            });
        }
        Self::reserve(
            &self.shared.rq_outstanding,
            self.shared.rq.capacity(),
            self.num(),
            "receive",
        )?;
        let _ = self.shared.rq.push(wr);
        self.nic.ring_doorbell(&self.shared);
        Ok(())
    }

    fn reserve(
        outstanding: &AtomicUsize,
        depth: usize,
        qp: u32,
        queue: &'static str,
    ) -> Result<()> {
        outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < depth).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| Error::QueueFull { qp, queue, depth })
    }

    /// Send WRs posted and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.shared.sq_outstanding.load(Ordering::Acquire)
    }
    /// Receive WRs posted and not yet completed.
    pub fn outstanding_recvs(&self) -> usize {
        self.shared.rq_outstanding.load(Ordering::Acquire)
    }

    /// Connects a reliable QP to a listening peer (a QP listener or any TCP server).
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        self.connect_until(addr, None)
    }

    /// [`Self::connect`] that gives up after `timeout`.
    pub fn connect_timeout(&self, addr: SocketAddr, timeout: Duration) -> Result<()> {
        self.connect_until(addr, Some(timeout))
    }

    fn connect_until(&self, addr: SocketAddr, timeout: Option<Duration>) -> Result<()> {
        let rx = self.start_connect(addr)?;
        match rx.wait_until(timeout.map(|t| Instant::now() + t)) {
            Some(r) => r.map(drop).map_err(|source| Error::Net {
                op: "connect to",
                addr,
                source,
            }),
            None => {
                self.nic.manage(Command::Disconnect { qp: self.num() });
                match timeout {
                    Some(after) => Err(Error::Timeout {
                        op: "connect",
                        after,
                    }),
                    None => Err(Error::Engine("the engine dropped a connect request".into())),
                }
            }
        }
    }

    /// Connects from async code.
    pub async fn connect_async(&self, addr: SocketAddr) -> Result<()> {
        let rx = self.start_connect(addr)?;
        match rx.wait_async().await {
            Some(r) => r.map(drop).map_err(|source| Error::Net {
                op: "connect to",
                addr,
                source,
            }),
            None => Err(Error::Engine("the engine dropped a connect request".into())),
        }
    }

    fn start_connect(&self, addr: SocketAddr) -> Result<crate::reply::ReplyReceiver<MgmtResult>> {
        if self.kind() != QpKind::Reliable {
            return Err(Error::BadState {
                qp: self.num(),
                state: self.state(),
                op: "connect an unreliable QP",
            });
        }
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::Connect {
            qp: self.num(),
            addr,
            reply: tx,
        });
        Ok(rx)
    }

    /// Orderly close: sends already posted go out, then the connection is shut down and
    /// posted receives are flushed.
    pub fn close(&self) {
        self.nic.manage(Command::Close { qp: self.num() });
    }

    /// Abortive close: everything outstanding is flushed at once.
    pub fn disconnect(&self) {
        self.nic.manage(Command::Disconnect { qp: self.num() });
    }

    /// Address of the peer of a connected QP.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.shared.addrs.lock().1
    }

    /// Local address of a connected or bound QP.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.addrs.lock().0
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.nic.manage(Command::Destroy { qp: self.num() });
    }
}
