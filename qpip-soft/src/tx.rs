//! The transmit state machine of a QP: takes send WRs off the ring, checks their memory, and
//! writes them to the socket in order, gathering several messages into one `writev`. A send
//! WR completes when the kernel has taken all of its bytes. The socket is a closure, so the
//! machine is tested without one.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::SocketAddr;

use smallvec::SmallVec;

use qpip_verbs::framer::Framer;
use qpip_verbs::machines::status_of;
use qpip_verbs::machines::tx::OutMsg;
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::WcStatus;

/// Most iovecs handed to one `writev`.
const MAX_IOV: usize = 64;

/// The unsent bytes of `msg`, as slices (at most `MAX_IOV` in all).
fn pending<'a>(msg: &'a OutMsg, out: &mut SmallVec<[IoSlice<'a>; MAX_IOV]>) {
    for part in msg.unsent() {
        if out.len() == MAX_IOV {
            return;
        }
        out.push(IoSlice::new(part));
    }
}

/// Why the transmit machine stopped.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum TxStop {
    /// Everything taken was sent.
    Idle,
    WouldBlock,
    /// A fatal error; the WR it hit was completed with its status. The QP must go to error.
    Failed,
}

pub(super) struct TxMachine {
    inflight: VecDeque<OutMsg>,
}

impl TxMachine {
    pub(super) fn new() -> Self {
        TxMachine {
            inflight: VecDeque::new(),
        }
    }

    pub(super) fn is_idle(&self) -> bool {
        self.inflight.is_empty()
    }

    /// Takes posted send WRs off the ring. A WR whose memory fails the key check completes
    /// with a protection error; on a reliable QP that is fatal (returns false), as in verbs.
    pub(super) fn take_posted(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
        fatal_faults: bool,
    ) -> bool {
        let mut framer = framer;
        while let Some(wr) = qp.sq.pop() {
            match OutMsg::prepare(wr, memory, framer.as_deref_mut()) {
                Ok(msg) => self.inflight.push_back(msg),
                Err((wr_id, fault)) => {
                    tracing::warn!(qp = qp.num, wr_id, "send WR refused: {fault}");
                    qp.complete_send(wr_id, WcStatus::ProtectionError, 0, 0);
                    if fatal_faults {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Writes queued messages to a stream socket until it would block or all are sent.
    pub(super) fn pump_stream(
        &mut self,
        qp: &QpShared,
        write: &mut dyn FnMut(&[IoSlice<'_>]) -> io::Result<usize>,
    ) -> TxStop {
        loop {
            if self.inflight.is_empty() {
                return TxStop::Idle;
            }
            let mut iov = SmallVec::<[IoSlice<'_>; MAX_IOV]>::new();
            for msg in &self.inflight {
                if iov.len() == MAX_IOV {
                    break;
                }
                pending(msg, &mut iov);
            }
            if iov.is_empty() {
                drop(iov);
                self.advance(qp, 0); // only zero-length messages are left at the front
                continue;
            }
            let result = write(&iov);
            drop(iov);
            match result {
                Ok(0) => return self.fail_front(qp, WcStatus::RemoteClosed, 0),
                Ok(n) => self.advance(qp, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return TxStop::WouldBlock,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return self.fail_front(qp, status_of(&e), e.raw_os_error().unwrap_or(0));
                }
            }
        }
    }

    /// Sends queued datagrams until the socket would block or all are sent. A datagram that
    /// cannot be sent fails alone: the QP goes on.
    pub(super) fn pump_datagrams(
        &mut self,
        qp: &QpShared,
        send_to: &mut dyn FnMut(&[IoSlice<'_>], SocketAddr) -> io::Result<usize>,
    ) -> TxStop {
        while let Some(msg) = self.inflight.front() {
            let Some(dest) = msg.dest else {
                qp.complete_send(msg.wr_id, WcStatus::InvalidRequest, 0, 0);
                self.inflight.pop_front();
                continue;
            };
            let mut iov = SmallVec::<[IoSlice<'_>; MAX_IOV]>::new();
            pending(msg, &mut iov);
            let result = send_to(&iov, dest);
            drop(iov);
            match result {
                Ok(n) => {
                    if let Some(msg) = self.inflight.pop_front() {
                        qp.complete_send(msg.wr_id, WcStatus::Success, n as u32, 0);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return TxStop::WouldBlock,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!(qp = qp.num, %dest, "datagram send failed: {e}");
                    if let Some(msg) = self.inflight.pop_front() {
                        qp.complete_send(
                            msg.wr_id,
                            WcStatus::TransportError,
                            0,
                            e.raw_os_error().unwrap_or(0),
                        );
                    }
                }
            }
        }
        TxStop::Idle
    }

    /// Accounts `n` bytes taken by the kernel; completes the messages they finish.
    fn advance(&mut self, qp: &QpShared, mut n: usize) {
        while n > 0 {
            let Some(front) = self.inflight.front_mut() else {
                return;
            };
            let rest = front.total() - front.sent;
            if n < rest {
                front.sent += n;
                return;
            }
            n -= rest;
            if let Some(msg) = self.inflight.pop_front() {
                qp.complete_send(msg.wr_id, WcStatus::Success, msg.body_len as u32, 0);
            }
        }
        // Zero-length messages complete as soon as everything before them went out.
        while self.inflight.front().is_some_and(|m| m.total() == 0) {
            if let Some(msg) = self.inflight.pop_front() {
                qp.complete_send(msg.wr_id, WcStatus::Success, 0, 0);
            }
        }
    }

    fn fail_front(&mut self, qp: &QpShared, status: WcStatus, os_error: i32) -> TxStop {
        if let Some(msg) = self.inflight.pop_front() {
            qp.complete_send(
                msg.wr_id,
                status,
                msg.sent.saturating_sub(msg.hdr_len) as u32,
                os_error,
            );
        }
        TxStop::Failed
    }

    /// Flushes every message not yet sent (the QP is going down).
    pub(super) fn flush(&mut self, qp: &QpShared) {
        for msg in self.inflight.drain(..) {
            qp.complete_send(msg.wr_id, WcStatus::Flushed, 0, 0);
        }
    }
}
