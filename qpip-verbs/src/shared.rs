//! What the host and the NIC share: the work rings of a QP, its CQs' rings, its state and its
//! doorbell flag. The verbs write here and read completions; every backend reads WRs and
//! writes completions. A leaf: it knows neither the verbs nor any backend.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use event_listener::Event;

use crate::drive::QueueDriver;
use crate::drive::sync::{SleepCount, posted};
use crate::poll_window::KeptWindow;
use crate::wr::{Completion, Opcode, QpNum, RecvWr, SendWr, WcStatus};

/// Reliable (TCP) or unreliable (UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpKind {
    /// A TCP connection (or a Unix-domain stream).
    Reliable,
    /// A UDP port.
    Unreliable,
}

/// Where a QP is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum QpState {
    /// Created; WRs may be posted, nothing moves until it is connected (or accepted).
    Init = 0,
    /// Connecting, or waiting to be accepted.
    Connecting = 1,
    /// Connected (reliable) or bound (unreliable): WRs are carried out.
    Ready = 2,
    /// An orderly close is under way: posted sends finish, new ones are refused.
    Closing = 3,
    /// Closed.
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

    /// WRs may still be posted (they are carried out, or wait for the connection).
    pub fn accepts_posts(self) -> bool {
        matches!(self, QpState::Init | QpState::Connecting | QpState::Ready)
    }
}

/// Default spin before sleeping in a CQ wait: long enough to cover a loopback round trip,
/// short enough that an idle waiter costs nothing.
const DEFAULT_CQ_SPIN: Duration = Duration::from_micros(50);

/// The completion ring of a CQ: the NIC pushes, the host polls.
///
/// Blocking waiters sleep on a futex, `seq`, after counting themselves in `sleepers`; the NIC
/// makes a system call (bumps `seq`, wakes the futex) only when that count is non-zero, so a
/// consumer that is polling costs the NIC a fence and a load. Async waiters use `event`, whose
/// notify is as cheap when nobody listens.
pub struct CqShared {
    pub(crate) ring: ArrayQueue<Completion>,
    pub(crate) lost: AtomicU64,
    pub(crate) overflowed: AtomicBool,
    /// The futex word of blocking waiters: changes whenever a notify finds sleepers.
    pub(crate) seq: AtomicU32,
    /// Blocking waiters that are asleep or about to be.
    pub(crate) sleepers: SleepCount,
    /// Completions were pushed since the last notify: a notify without news wakes nobody.
    unnotified: AtomicBool,
    /// Async waiters.
    pub(crate) event: Event,
    /// How long a host waiter polls before it sleeps.
    pub(crate) spin_nanos: AtomicU64,
    /// Set by [`crate::cq::CqWaker::wake`]: the next wait returns, with or without
    /// completions.
    pub(crate) woken: AtomicBool,
    /// The NIC queue a waiter drives ([`crate::drive`]); unset when the backend has none.
    /// Weak: the NIC owns its queues, and a CQ, which may outlive the NIC, must not keep a
    /// queue's engine (its sockets and epoll) or the QPs in it alive.
    driver: OnceLock<Weak<dyn QueueDriver>>,
    /// QPs of more than one queue complete here: waiters sleep instead of driving.
    mixed: AtomicBool,
    /// Waiters of this CQ driving its queue now, counted by the driver while it holds the
    /// queue (a wake must interrupt them).
    pub(crate) driving: AtomicU32,
    /// How long this CQ's driving waiters poll before they sleep, learned from its arrivals.
    pub(crate) window: KeptWindow,
}

impl CqShared {
    pub(crate) fn new(depth: usize) -> Self {
        CqShared {
            ring: ArrayQueue::new(depth.max(1)),
            lost: AtomicU64::new(0),
            overflowed: AtomicBool::new(false),
            seq: AtomicU32::new(0),
            sleepers: SleepCount::new(),
            unnotified: AtomicBool::new(false),
            event: Event::new(),
            spin_nanos: AtomicU64::new(DEFAULT_CQ_SPIN.as_nanos() as u64),
            woken: AtomicBool::new(false),
            driver: OnceLock::new(),
            mixed: AtomicBool::new(false),
            driving: AtomicU32::new(0),
            window: KeptWindow::default(),
        }
    }

    /// Binds the CQ to the NIC queue of a QP that completes here (backend side, when the QP
    /// is placed), so that waiters drive it. A CQ that QPs of two queues complete into is
    /// driven by nobody: its waiters sleep until a NIC thread wakes them.
    pub fn bind_driver(&self, driver: &Arc<dyn QueueDriver>) {
        let bound = self.driver.get_or_init(|| Arc::downgrade(driver));
        if !std::ptr::addr_eq(bound.as_ptr(), Arc::as_ptr(driver)) {
            self.mixed.store(true, Ordering::Release);
        }
    }

    /// The queue this CQ's waiters drive, if exactly one and its NIC is still there.
    pub fn driver(&self) -> Option<Arc<dyn QueueDriver>> {
        if self.mixed.load(Ordering::Acquire) {
            return None;
        }
        self.driver.get()?.upgrade()
    }

    /// What a driving waiter waits for: a completion, a wake or an overflow.
    pub(crate) fn has_news(&self) -> bool {
        !self.ring.is_empty()
            || self.woken.load(Ordering::Acquire)
            || self.overflowed.load(Ordering::Acquire)
    }

    /// Adds a completion (NIC side). A full queue records the loss and wakes waiters so
    /// that the overflow is reported.
    pub(crate) fn push(&self, c: Completion) {
        if self.ring.push(c).is_err() {
            self.lost.fetch_add(1, Ordering::Relaxed);
            self.overflowed.store(true, Ordering::Release);
            tracing::error!(qp = c.qp_num, wr_id = c.wr_id, "completion queue overflow");
        }
        self.unnotified.store(true, Ordering::Release);
    }

    /// Makes the waiters return (see [`crate::cq::CqWaker`]).
    pub(crate) fn wake(&self) {
        self.woken.store(true, Ordering::Release);
        // Pairs with the waiter's count-then-look, as in notify.
        posted();
        if self.sleepers.get() > 0 {
            self.seq.fetch_add(1, Ordering::Release);
            crate::futex::wake_all(&self.seq);
        }
        if self.driving.load(Ordering::Relaxed) > 0
            && let Some(d) = self.driver.get().and_then(Weak::upgrade)
        {
            d.interrupt();
        }
        self.event.notify(usize::MAX);
    }

    /// Takes a wake-up ([`Self::wake`]), if there is one.
    pub(crate) fn take_wake(&self) -> bool {
        self.woken.load(Ordering::Relaxed) && self.woken.swap(false, Ordering::AcqRel)
    }

    /// Wakes sleeping waiters; call once after a batch of pushes. No system call unless a
    /// blocking waiter sleeps.
    pub(crate) fn notify(&self) {
        // A NIC turn that completed nothing (a doorbell for receive WRs, say) wakes nobody.
        if !self.unnotified.load(Ordering::Relaxed)
            || !self.unnotified.swap(false, Ordering::AcqRel)
        {
            return;
        }
        // Pairs with the waiter's count-then-poll: either we see it counted, or it sees
        // what we pushed.
        posted();
        if self.sleepers.get() > 0 {
            self.seq.fetch_add(1, Ordering::Release);
            crate::futex::wake_all(&self.seq);
        }
        // Async waiters; a load when nobody listens.
        self.event.notify(usize::MAX);
    }
}

/// The part of a QP that the host and the NIC share: the work queues (rings in memory both
/// see), the CQs, the state and the doorbell flag.
pub struct QpShared {
    /// The QP's number.
    pub num: QpNum,
    /// Reliable or unreliable.
    pub kind: QpKind,
    /// The send queue.
    pub sq: ArrayQueue<SendWr>,
    /// The receive queue.
    pub rq: ArrayQueue<RecvWr>,
    sq_outstanding: AtomicUsize,
    rq_outstanding: AtomicUsize,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    state: AtomicU8,
    /// Set by the host when it rings the doorbell, cleared by the NIC when it looks: one
    /// doorbell entry per QP however many WRs were posted meanwhile.
    pub doorbell: AtomicBool,
    /// Which queue of a multi-queue NIC owns the QP (its doorbells go there); set by the
    /// backend when the QP is created, for its life.
    pub queue: AtomicU32,
    /// (local, peer), as the NIC last set them.
    addrs: parking_lot::Mutex<(Option<SocketAddr>, Option<SocketAddr>)>,
}

/// A queue of a QP is full (its depth is returned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueFull(pub usize);

impl QpShared {
    /// A QP's shared state, in `Init`, with queues of these depths.
    pub fn new(
        num: QpNum,
        kind: QpKind,
        (send_cq, recv_cq): (Arc<CqShared>, Arc<CqShared>),
        (max_send_wr, max_recv_wr): (usize, usize),
    ) -> Self {
        QpShared {
            num,
            kind,
            sq: ArrayQueue::new(max_send_wr.max(1)),
            rq: ArrayQueue::new(max_recv_wr.max(1)),
            sq_outstanding: AtomicUsize::new(0),
            rq_outstanding: AtomicUsize::new(0),
            send_cq,
            recv_cq,
            state: AtomicU8::new(QpState::Init as u8),
            doorbell: AtomicBool::new(false),
            queue: AtomicU32::new(0),
            addrs: parking_lot::Mutex::new((None, None)),
        }
    }

    /// Puts a send WR on the ring (host side). Fails when as many WRs as the ring holds are
    /// outstanding (posted and not yet completed), so a completion always has room.
    #[inline]
    pub fn push_send(&self, wr: SendWr) -> Result<(), QueueFull> {
        reserve(&self.sq_outstanding, self.sq.capacity())?;
        // Cannot fail: outstanding WRs never exceed the ring's capacity.
        let _ = self.sq.push(wr);
        Ok(())
    }

    /// Puts a receive WR on the ring (host side), as [`Self::push_send`].
    #[inline]
    pub fn push_recv(&self, wr: RecvWr) -> Result<(), QueueFull> {
        reserve(&self.rq_outstanding, self.rq.capacity())?;
        let _ = self.rq.push(wr);
        Ok(())
    }

    /// Send WRs posted and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.sq_outstanding.load(Ordering::Acquire)
    }
    /// Receive WRs posted and not yet completed.
    pub fn outstanding_recvs(&self) -> usize {
        self.rq_outstanding.load(Ordering::Acquire)
    }

    /// Where it is in its life.
    #[inline]
    pub fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }
    /// Moves it on.
    #[inline]
    pub fn set_state(&self, s: QpState) {
        self.state.store(s as u8, Ordering::Release);
    }

    /// Moves it from state `from` to `to`; false (and no change) if it is not in `from`.
    pub fn transition(&self, from: QpState, to: QpState) -> bool {
        self.state
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Records its addresses once known.
    pub fn set_addrs(&self, local: Option<SocketAddr>, peer: Option<SocketAddr>) {
        *self.addrs.lock() = (local, peer);
    }
    /// Its local address, once known.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addrs.lock().0
    }
    /// Its peer's address, once known.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.addrs.lock().1
    }

    /// Posts a completion for a send WR (NIC side).
    #[inline]
    pub fn complete_send(&self, wr_id: u64, status: WcStatus, byte_len: u32, os_error: i32) {
        self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
        self.send_cq.push(Completion {
            wr_id,
            qp_num: self.num,
            opcode: Opcode::Send,
            status,
            byte_len,
            placed: 0,
            src: None,
            os_error,
        });
    }

    /// Posts a completion for a receive WR (NIC side).
    #[inline]
    pub fn complete_recv(
        &self,
        wr_id: u64,
        status: WcStatus,
        byte_len: u32,
        src: Option<SocketAddr>,
        os_error: i32,
    ) {
        self.complete_recv_placed(wr_id, status, byte_len, 0, src, os_error);
    }

    /// Posts a completion for a receive WR whose message body went elsewhere (`placed`
    /// bytes, [`crate::Frame::MessageAt`]) (NIC side).
    #[inline]
    pub fn complete_recv_placed(
        &self,
        wr_id: u64,
        status: WcStatus,
        byte_len: u32,
        placed: u32,
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
            placed,
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

    /// The CQs this QP completes into (send, receive; the same one twice if shared).
    pub fn cqs(&self) -> [&Arc<CqShared>; 2] {
        [&self.send_cq, &self.recv_cq]
    }

    /// Wakes whoever waits on this QP's CQs (after a batch of completions).
    #[inline]
    pub fn notify_cqs(&self) {
        self.send_cq.notify();
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.recv_cq.notify();
        }
    }
}

/// Counts one more outstanding WR unless `depth` already are.
fn reserve(outstanding: &AtomicUsize, depth: usize) -> Result<(), QueueFull> {
    outstanding
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < depth).then_some(n + 1)
        })
        .map(|_| ())
        .map_err(|_| QueueFull(depth))
}
