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

/// Most TCP segments' worth of bytes one `writev` carries. A `writev` holds the socket for
/// the whole copy, and the ACKs that arrive meanwhile wait on its backlog until the call ends.
/// Measured on one connection's 256 KiB reads (BENCHMARKS.md, issue 36, session 13): over a
/// 1500-byte link (1448-byte segments) batches of 1.5–3.8 MB read a third slower than batches
/// cut at 181 segments (256 KiB); over loopback (64 KiB segments) a 256 KiB cut cost 10–27 %,
/// where 181 segments (11 MiB) cuts nothing.
const SEGMENTS_PER_WRITE: usize = 181;

/// The unsent bytes of `msg`, as slices (at most `MAX_IOV` in all).
fn pending<'a>(msg: &'a OutMsg, out: &mut SmallVec<[IoSlice<'a>; MAX_IOV]>) {
    for part in msg.unsent() {
        if out.len() == MAX_IOV {
            return;
        }
        out.push(IoSlice::new(part));
    }
}

fn iov_bytes(iov: &[IoSlice<'_>]) -> usize {
    iov.iter().map(|s| s.len()).sum()
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
    /// Most bytes one `writev` carries (see [`SEGMENTS_PER_WRITE`]).
    write_limit: usize,
}

impl TxMachine {
    pub(super) fn new() -> Self {
        TxMachine {
            inflight: VecDeque::new(),
            write_limit: usize::MAX,
        }
    }

    /// The stream's segment size, once connected: cuts each `writev` at
    /// [`SEGMENTS_PER_WRITE`] segments.
    pub(super) fn set_segment_size(&mut self, segment: Option<usize>) {
        self.write_limit = segment.map_or(usize::MAX, |s| s.saturating_mul(SEGMENTS_PER_WRITE));
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
            let mut gathered = 0;
            for msg in &self.inflight {
                if iov.len() == MAX_IOV || gathered >= self.write_limit {
                    break;
                }
                let from = iov.len();
                pending(msg, &mut iov);
                gathered += iov_bytes(&iov[from..]);
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

#[cfg(test)]
mod tests {
    use super::*;
    use qpip_verbs::shared::QpKind;
    use qpip_verbs::wr::SendWr;
    use qpip_verbs::{Access, CompletionQueue};

    /// Queues `count` messages of `len` bytes and pumps them into a socket that takes
    /// everything: the bytes of each `writev`.
    fn writes(segment: Option<usize>, count: usize, len: usize) -> Vec<usize> {
        let cq = CompletionQueue::new(64);
        let cqs = (cq.shared().clone(), cq.shared().clone());
        let qp = QpShared::new(1, QpKind::Reliable, cqs, (8, 8));
        let memory = MemoryTable::new();
        let mr = memory.register_owned(count * len, Access::READ_WRITE);
        let mut tx = TxMachine::new();
        tx.set_segment_size(segment);
        for i in 0..count {
            let wr = SendWr::new(i as u64, &[mr.sge(i * len, len)]);
            tx.inflight
                .push_back(OutMsg::prepare(wr, &memory, None).unwrap());
        }
        let mut calls = Vec::new();
        let stop = tx.pump_stream(&qp, &mut |iov| {
            let n = iov_bytes(iov);
            calls.push(n);
            Ok(n)
        });
        assert_eq!(stop, TxStop::Idle);
        calls
    }

    #[test]
    fn a_writev_stops_gathering_at_its_segments_worth() {
        // 100-byte segments: at most 18 100 bytes gathered, so five 4 KiB messages, then three.
        assert_eq!(writes(Some(100), 8, 4096), vec![5 * 4096, 3 * 4096]);
        // A message larger than the limit still goes whole.
        assert_eq!(writes(Some(10), 2, 4096), vec![4096, 4096]);
    }

    #[test]
    fn a_stream_without_segments_gathers_everything() {
        assert_eq!(writes(None, 8, 4096), vec![8 * 4096]);
    }
}
