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

use crate::stream::ETHERNET_MAX_SEGMENT;

/// Most iovecs handed to one `writev`.
const MAX_IOV: usize = 64;

/// The bytes of the kernel's largest GSO packet (`gso_max_size`'s default): a TCP socket
/// builds packets of as many whole segments as fit in it (`tcp_xmit_size_goal`), 45 of 1448
/// bytes at MTU 1500, 7 of 8948 at MTU 9000.
const GSO_MAX_SIZE: usize = 65_536;

/// Whole GSO packets one `writev` carries on a cut link. A `writev` holds the socket for the
/// whole copy, and the ACKs that arrive meanwhile wait on its backlog until the call ends;
/// a write that ends inside a packet sends a short one. Measured on one connection's reads
/// over veth (BENCHMARKS.md, issue 36, session 20), against whole replies per `writev` (up to
/// 256 KiB and more): two packets per call read 1.6–1.9× faster at half the server's CPU per
/// GB, at MTU 1500 and 9000 and 64 KiB to 1 MiB requests; one or three packets per call
/// nearly as well; cuts that end inside a packet (60 or 120 segments at MTU 1500, 10 at
/// 9000) lost most of that. Over loopback (64 KiB segments) such cuts read at 0.7× the speed.
const GSO_PACKETS_PER_WRITE: usize = 2;

/// The unsent bytes of `msgs`, in order, as slices: at most `MAX_IOV` of them, and at most
/// `limit` bytes (the last slice cut short to fit).
fn pending<'a>(
    msgs: impl IntoIterator<Item = &'a OutMsg>,
    limit: usize,
    out: &mut SmallVec<[IoSlice<'a>; MAX_IOV]>,
) {
    let mut room = limit;
    for part in msgs.into_iter().flat_map(OutMsg::unsent) {
        if out.len() == MAX_IOV || room == 0 {
            return;
        }
        let part = &part[..part.len().min(room)];
        room -= part.len();
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
    /// Most bytes one `writev` carries (see [`GSO_PACKETS_PER_WRITE`]).
    write_limit: usize,
}

impl TxMachine {
    pub(super) fn new() -> Self {
        TxMachine {
            inflight: VecDeque::new(),
            write_limit: usize::MAX,
        }
    }

    /// The stream's segment size, once connected: on a link of at most [`ETHERNET_MAX_SEGMENT`]
    /// bytes per segment, each `writev` carries [`GSO_PACKETS_PER_WRITE`] whole GSO packets'
    /// bytes at most, cutting a message where needed (the next call goes on from there).
    pub(super) fn set_segment_size(&mut self, segment: Option<usize>) {
        self.write_limit = match segment {
            Some(s) if s > 0 && s <= ETHERNET_MAX_SEGMENT => {
                GSO_PACKETS_PER_WRITE * s * (GSO_MAX_SIZE / s)
            }
            _ => usize::MAX,
        };
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
            pending(&self.inflight, self.write_limit, &mut iov);
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
            pending([msg], usize::MAX, &mut iov);
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

    fn iov_bytes(iov: &[IoSlice<'_>]) -> usize {
        iov.iter().map(|s| s.len()).sum()
    }

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
    fn a_writev_carries_two_whole_gso_packets_on_an_ethernet_link() {
        // MTU 1500: 45 segments of 1448 bytes per GSO packet, 130 320 bytes per call; three
        // 256 KiB messages go in six full calls (cut inside messages) and the rest.
        let mut want = vec![130_320; 6];
        want.push(3 * 262_144 - 6 * 130_320);
        assert_eq!(writes(Some(1448), 3, 262_144), want);
        // MTU 9000: 7 segments of 8948 bytes per packet; small messages gather up to it.
        assert_eq!(
            writes(Some(8948), 40, 4096),
            vec![125_272, 40 * 4096 - 125_272]
        );
    }

    #[test]
    fn loopback_segments_do_not_cut_writes() {
        assert_eq!(writes(Some(65_483), 3, 262_144), vec![3 * 262_144]);
    }

    #[test]
    fn a_stream_without_segments_gathers_everything() {
        assert_eq!(writes(None, 8, 4096), vec![8 * 4096]);
    }
}
