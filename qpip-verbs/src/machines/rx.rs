//! The receive state machine: takes receive WRs off the ring ([`RecvTarget`], for datagrams
//! and streams alike) and, on a reliable QP, finds message boundaries with the QP's framer
//! and places each message into the next receive WR, the body straight from the connection
//! into the WR's memory. The connection is a `read` closure (a kernel socket for the soft NIC,
//! the firmware's TCP receive buffer for the LANai), so the machine is tested without one.

use std::io::{self, IoSliceMut};

use smallvec::SmallVec;

use super::status_of;
use crate::framer::{Frame, Framer, MAX_HEADER};
use crate::mr::{MemoryTable, Segment, Sge};
use crate::shared::QpShared;
use crate::wr::WcStatus;

/// A receive WR taken off the ring, its memory checked: where the next message goes.
pub struct RecvTarget {
    pub wr_id: u64,
    pub segs: SmallVec<[Segment; 4]>,
}

/// A receive WR failed the key check; it was completed with a protection error.
#[derive(Debug, PartialEq, Eq)]
pub struct WrRefused;

impl RecvTarget {
    /// Takes the next receive WR; `None` if none is posted. A WR naming memory it may not
    /// write is completed with a protection error at once.
    pub fn take(qp: &QpShared, memory: &MemoryTable) -> Option<Result<RecvTarget, WrRefused>> {
        let wr = qp.rq.pop()?;
        let segs: Result<SmallVec<[Segment; 4]>, _> =
            wr.sg_list.iter().map(|s| memory.resolve(s, true)).collect();
        Some(match segs {
            Ok(segs) => Ok(RecvTarget {
                wr_id: wr.wr_id,
                segs,
            }),
            Err(fault) => {
                tracing::warn!(qp = qp.num, wr_id = wr.wr_id, "receive WR refused: {fault}");
                qp.complete_recv(wr.wr_id, WcStatus::ProtectionError, 0, None, 0);
                Err(WrRefused)
            }
        })
    }

    /// Bytes the WR can take.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.segs.iter().map(Segment::len).sum()
    }

    /// Copies `data` into the WR's memory from byte `offset`; returns how much fit.
    pub fn scatter(&self, offset: usize, data: &[u8]) -> usize {
        scatter(&self.segs, offset, data)
    }
}

/// Why the machine stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum RxStop {
    /// The socket has no more bytes for now.
    WouldBlock,
    /// No receive WR is posted: stop reading, so TCP flow control holds the sender.
    NoWr,
    /// A fatal error; the WR it hit was completed with its status. The QP must go to error.
    Failed,
}

/// A message being placed: its first `in_wr` bytes into a receive WR, the rest into `body`
/// when the framer named memory for it ([`Frame::MessageAt`]).
struct InMsg {
    wr: RecvTarget,
    body: Option<Segment>,
    /// Bytes of the message that go into the WR (all of them without `body`).
    in_wr: usize,
    /// Bytes placed so far.
    filled: usize,
    /// Bytes the message has (a raw-stream WR: its capacity).
    total: usize,
    /// Raw stream: complete after every read, whatever it brought.
    stream: bool,
}

impl InMsg {
    /// Copies `data` to byte `pos` of the message (the WR's part, then the body's).
    fn place(&self, pos: usize, data: &[u8]) {
        let to_wr = self.in_wr.saturating_sub(pos).min(data.len());
        self.wr.scatter(pos, &data[..to_wr]);
        if let Some(body) = &self.body {
            scatter(
                std::slice::from_ref(body),
                pos + to_wr - self.in_wr,
                &data[to_wr..],
            );
        }
    }

    /// The message's memory from byte `from` to `to`, as iovecs (the WR's, then the body's).
    fn iov(&self, from: usize, to: usize) -> SmallVec<[IoSliceMut<'_>; 6]> {
        let mut out = segs_mut(&self.wr.segs, from.min(self.in_wr), to.min(self.in_wr));
        if let Some(body) = &self.body
            && to > self.in_wr
        {
            let (a, b) = (from.max(self.in_wr) - self.in_wr, to - self.in_wr);
            out.extend(segs_mut(std::slice::from_ref(body), a, b));
        }
        out
    }
}

pub struct RxMachine {
    /// Bytes of the next message(s) read before their WR was chosen. Never more than
    /// `MAX_HEADER`, so buffering outside WR memory stays bounded.
    hdr: [u8; MAX_HEADER],
    hdr_len: usize,
    cur: Option<InMsg>,
}

fn os_error(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// Copies `data` into the segments starting at byte `offset` of the WR; returns how much fit.
fn scatter(segs: &[Segment], mut offset: usize, mut data: &[u8]) -> usize {
    let len = data.len();
    for seg in segs {
        if data.is_empty() {
            break;
        }
        if offset >= seg.len() {
            offset -= seg.len();
            continue;
        }
        // SAFETY: the NIC owns the WR's memory until it completes it.
        let dst = unsafe { &mut seg.bytes_mut()[offset..] };
        let n = dst.len().min(data.len());
        dst[..n].copy_from_slice(&data[..n]);
        data = &data[n..];
        offset = 0;
    }
    len - data.len()
}

/// The WR's memory from `from` to `to`, as iovecs.
fn segs_mut(segs: &[Segment], mut from: usize, mut to: usize) -> SmallVec<[IoSliceMut<'_>; 6]> {
    let mut out = SmallVec::new();
    for seg in segs {
        if to == 0 {
            break;
        }
        let len = seg.len();
        if from >= len {
            from -= len;
            to -= len;
            continue;
        }
        let end = to.min(len);
        // SAFETY: the NIC owns the WR's memory until it completes it.
        out.push(IoSliceMut::new(unsafe { &mut seg.bytes_mut()[from..end] }));
        to -= end;
        from = 0;
    }
    out
}

impl Default for RxMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl RxMachine {
    pub fn new() -> Self {
        RxMachine {
            hdr: [0; MAX_HEADER],
            hdr_len: 0,
            cur: None,
        }
    }

    /// Bytes read past the last complete message (read ahead, waiting for a receive WR).
    pub fn buffered(&self) -> usize {
        self.hdr_len + self.cur.as_ref().map_or(0, |c| c.filled)
    }

    /// Moves bytes from the socket into receive WRs until the socket would block, no WR is
    /// posted, or the QP fails.
    pub fn pump(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        framer: &mut dyn Framer,
        read: &mut dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<usize>,
    ) -> RxStop {
        loop {
            let Some(cur) = self.cur.as_mut() else {
                if qp.rq.is_empty() {
                    return RxStop::NoWr;
                }
                let frame = framer.frame(&self.hdr[..self.hdr_len]);
                let need = match frame {
                    Frame::NeedHeader(n) => n,
                    Frame::Message { header_len, .. } | Frame::MessageAt { header_len, .. }
                        if header_len > self.hdr_len =>
                    {
                        header_len
                    }
                    Frame::Message {
                        header_len,
                        strip,
                        body_len,
                    } => {
                        if let Err(stop) =
                            self.start_framed(qp, memory, header_len, strip, body_len, None)
                        {
                            return stop;
                        }
                        continue;
                    }
                    Frame::MessageAt {
                        header_len,
                        strip,
                        body,
                    } => {
                        let body_len = body.len as usize;
                        if let Err(stop) =
                            self.start_framed(qp, memory, header_len, strip, body_len, Some(body))
                        {
                            return stop;
                        }
                        continue;
                    }
                    Frame::Stream => {
                        if let Err(stop) = self.start_message(qp, memory, usize::MAX, None, true) {
                            return stop;
                        }
                        let in_hdr = self.hdr_len.min(self.cur.as_ref().map_or(0, |c| c.total));
                        self.take_hdr(0, in_hdr);
                        if self.cur.as_ref().is_some_and(|c| c.filled > 0) {
                            self.complete_cur(qp, WcStatus::Success, 0);
                        }
                        continue;
                    }
                    Frame::Invalid(reason) => {
                        tracing::warn!(qp = qp.num, "framing error: {reason}");
                        return self.fail_next(qp, WcStatus::FramingError, 0, "invalid message");
                    }
                };
                if need > MAX_HEADER || need <= self.hdr_len {
                    tracing::warn!(
                        qp = qp.num,
                        need,
                        have = self.hdr_len,
                        "framer asked for an impossible header"
                    );
                    return self.fail_next(qp, WcStatus::FramingError, 0, "bad header request");
                }
                // Read the header, and a little beyond: bounded read-ahead saves a system
                // call per small message.
                let mut iov = [IoSliceMut::new(&mut self.hdr[self.hdr_len..])];
                match read(&mut iov) {
                    Ok(0) => return self.fail_next(qp, WcStatus::RemoteClosed, 0, "peer closed"),
                    Ok(k) => self.hdr_len += k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return RxStop::WouldBlock,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        return self.fail_next(qp, status_of(&e), os_error(&e), "read failed");
                    }
                }
                continue;
            };

            if !cur.stream && cur.filled == cur.total {
                self.complete_cur(qp, WcStatus::Success, 0);
                continue;
            }
            // The body goes straight into the WR's memory; for framed messages the bytes after
            // it (the next header) land in `hdr`, which is empty here.
            debug_assert_eq!(self.hdr_len, 0);
            let (filled, total, stream) = (cur.filled, cur.total, cur.stream);
            let mut iov = cur.iov(filled, total);
            if !stream {
                iov.push(IoSliceMut::new(&mut self.hdr[..]));
            }
            match read(&mut iov) {
                Ok(0) => {
                    drop(iov);
                    tracing::debug!(qp = qp.num, "peer closed in the middle of a message");
                    self.complete_cur(qp, WcStatus::RemoteClosed, 0);
                    return RxStop::Failed;
                }
                Ok(k) => {
                    let body = k.min(total - filled);
                    drop(iov);
                    self.hdr_len = k - body;
                    if let Some(cur) = self.cur.as_mut() {
                        cur.filled += body;
                    }
                    if stream {
                        self.complete_cur(qp, WcStatus::Success, 0);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return RxStop::WouldBlock,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    drop(iov);
                    self.complete_cur(qp, status_of(&e), os_error(&e));
                    return RxStop::Failed;
                }
            }
        }
    }

    /// Starts a framed message whose header (`header_len` bytes, `hdr` holds them) is
    /// followed by `body_len` bytes, placed into `body` if the framer named it.
    fn start_framed(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        header_len: usize,
        strip: usize,
        body_len: usize,
        body: Option<Sge>,
    ) -> Result<(), RxStop> {
        if strip > header_len {
            let why = "framer strips more than the header";
            return Err(self.fail_next(qp, WcStatus::FramingError, 0, why));
        }
        let body = match body.map(|sge| memory.resolve(&sge, true)) {
            None => None,
            Some(Ok(seg)) => Some(seg),
            Some(Err(fault)) => {
                tracing::warn!(
                    qp = qp.num,
                    "framer named memory the NIC may not write: {fault}"
                );
                let why = "body placement refused";
                return Err(self.fail_next(qp, WcStatus::ProtectionError, 0, why));
            }
        };
        let total = header_len - strip + body_len;
        self.start_message(qp, memory, total, body, false)?;
        // Header bytes (and any body bytes read ahead) go in first.
        let in_hdr = self.hdr_len.min(header_len.saturating_add(body_len));
        self.take_hdr(strip, in_hdr);
        Ok(())
    }

    /// Takes the next receive WR for a message of `total` bytes (`usize::MAX`: raw stream),
    /// of which the last `body.len()` go to `body` if there is one.
    fn start_message(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        total: usize,
        body: Option<Segment>,
        stream: bool,
    ) -> Result<(), RxStop> {
        let wr = match RecvTarget::take(qp, memory) {
            None => return Err(RxStop::NoWr),
            Some(Err(WrRefused)) => return Err(RxStop::Failed),
            Some(Ok(wr)) => wr,
        };
        let capacity = wr.capacity();
        let total = if stream { capacity } else { total };
        let in_wr = total - body.as_ref().map_or(0, Segment::len);
        if in_wr > capacity {
            tracing::warn!(
                qp = qp.num,
                wr_id = wr.wr_id,
                total = in_wr,
                capacity,
                "message longer than its receive WR"
            );
            qp.complete_recv(wr.wr_id, WcStatus::LengthError, 0, None, 0);
            return Err(RxStop::Failed);
        }
        self.cur = Some(InMsg {
            wr,
            body,
            in_wr,
            filled: 0,
            total,
            stream,
        });
        Ok(())
    }

    /// Moves `hdr[strip..end]` into the current WR and drops `hdr[..end]`.
    fn take_hdr(&mut self, strip: usize, end: usize) {
        if let Some(cur) = self.cur.as_mut() {
            let data = &self.hdr[strip.min(end)..end];
            cur.place(cur.filled, data);
            cur.filled += data.len();
        }
        self.hdr.copy_within(end..self.hdr_len, 0);
        self.hdr_len -= end;
    }

    fn complete_cur(&mut self, qp: &QpShared, status: WcStatus, os_error: i32) {
        if let Some(cur) = self.cur.take() {
            let in_wr = cur.filled.min(cur.in_wr);
            let placed = (cur.filled - in_wr) as u32;
            qp.complete_recv_placed(cur.wr.wr_id, status, in_wr as u32, placed, None, os_error);
        }
    }

    /// Fails the next receive WR (there is one: reads only happen with one posted).
    fn fail_next(&mut self, qp: &QpShared, status: WcStatus, os_error: i32, why: &str) -> RxStop {
        tracing::debug!(qp = qp.num, ?status, "receive failed: {why}");
        if let Some(wr) = qp.rq.pop() {
            qp.complete_recv(wr.wr_id, status, 0, None, os_error);
        }
        RxStop::Failed
    }

    /// Flushes the WR in progress (the QP is going down).
    pub fn flush(&mut self, qp: &QpShared) {
        self.complete_cur(qp, WcStatus::Flushed, 0);
        self.hdr_len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framer::{LengthPrefixed, RawStream};
    use crate::shared::QpKind;
    use crate::wr::{Completion, RecvWr};
    use crate::{CompletionQueue, MemoryRegion};

    /// A socket stand-in: hands out `wire` at most `step` bytes per read.
    struct Trickle {
        wire: Vec<u8>,
        pos: usize,
        step: usize,
        reads: usize,
    }

    impl Trickle {
        fn new(wire: Vec<u8>, step: usize) -> Trickle {
            Trickle {
                wire,
                pos: 0,
                step,
                reads: 0,
            }
        }

        fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            if self.pos == self.wire.len() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.reads += 1;
            let mut budget = self.step.min(self.wire.len() - self.pos);
            let mut n = 0;
            for buf in iov.iter_mut() {
                let k = buf.len().min(budget);
                buf[..k].copy_from_slice(&self.wire[self.pos..self.pos + k]);
                self.pos += k;
                n += k;
                budget -= k;
            }
            Ok(n)
        }
    }

    fn setup(
        slots: usize,
        slot: usize,
    ) -> (
        QpShared,
        CompletionQueue,
        std::sync::Arc<MemoryTable>,
        MemoryRegion,
    ) {
        let cq = CompletionQueue::new(1024);
        let cqs = (cq.shared.clone(), cq.shared.clone());
        let qp = QpShared::new(1, QpKind::Reliable, cqs, (slots, slots));
        let table = MemoryTable::new();
        let mr = table.register_owned(slots * slot, crate::Access::READ_WRITE);
        for i in 0..slots {
            let half = slot / 2;
            let sges = [mr.sge(i * slot, half), mr.sge(i * slot + half, slot - half)];
            qp.push_recv(RecvWr::new(i as u64, &sges)).unwrap();
        }
        (qp, cq, table, mr)
    }

    fn drain(cq: &CompletionQueue) -> Vec<Completion> {
        let mut out = [Completion::default(); 1024];
        let n = cq.poll(&mut out).unwrap();
        out[..n].to_vec()
    }

    fn framed(msgs: &[&[u8]]) -> Vec<u8> {
        let mut wire = Vec::new();
        for m in msgs {
            wire.extend_from_slice(&(m.len() as u32).to_be_bytes());
            wire.extend_from_slice(m);
        }
        wire
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_messages() {
        let msgs: Vec<Vec<u8>> = (0..40).map(|i| vec![i as u8; (i * 37) % 200]).collect();
        let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
        let wire = framed(&refs);
        for step in [1, 2, 3, 5, 7, 64, 100, 1 << 20] {
            let (qp, cq, table, mr) = setup(40, 256);
            let mut rx = RxMachine::new();
            let mut framer = LengthPrefixed::default();
            let mut sock = Trickle::new(wire.clone(), step);
            let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
            assert_eq!(stop, RxStop::NoWr, "step {step}");
            let done = drain(&cq);
            assert_eq!(done.len(), 40, "step {step}");
            for (i, c) in done.iter().enumerate() {
                let want = (i as u64, WcStatus::Success, msgs[i].len());
                assert_eq!((c.wr_id, c.status, c.byte_len as usize), want);
                let mut got = vec![0u8; msgs[i].len()];
                mr.read_at(i * 256, &mut got);
                assert_eq!(got, msgs[i], "message {i}, step {step}");
            }
            if step == 1 << 20 {
                // Small messages come out of the bounded read-ahead: fewer reads than messages.
                assert!(sock.reads < 40, "{} reads", sock.reads);
            }
        }
    }

    /// Length-prefixed messages whose bodies go to consecutive places of `dst` (the prefix
    /// stays in the receive WR), as an NBD client places READ data.
    struct PlaceInto {
        dst: MemoryRegion,
        next: usize,
    }

    impl Framer for PlaceInto {
        fn frame(&mut self, header: &[u8]) -> Frame {
            let Some(prefix) = header.first_chunk::<4>() else {
                return Frame::NeedHeader(4);
            };
            let len = u32::from_be_bytes(*prefix) as usize;
            let body = self.dst.sge(self.next, len);
            self.next += len;
            Frame::MessageAt {
                header_len: 4,
                strip: 0,
                body,
            }
        }
    }

    #[test]
    fn bodies_go_where_the_framer_says_and_headers_into_the_wr() {
        let msgs: Vec<Vec<u8>> = (1..20).map(|i| vec![i as u8; (i * 53) % 300]).collect();
        let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
        let wire = framed(&refs);
        for step in [1, 3, 4, 5, 64, 1 << 20] {
            let (qp, cq, table, mr) = setup(19, 8);
            let dst = table.register_owned(8192, crate::Access::READ_WRITE);
            let mut framer = PlaceInto {
                dst: dst.clone(),
                next: 0,
            };
            let mut rx = RxMachine::new();
            let mut sock = Trickle::new(wire.clone(), step);
            let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
            assert_eq!(stop, RxStop::NoWr, "step {step}");
            let done = drain(&cq);
            assert_eq!(done.len(), msgs.len(), "step {step}");
            let mut at = 0;
            for (i, c) in done.iter().enumerate() {
                let want = (WcStatus::Success, 4, msgs[i].len() as u32);
                assert_eq!((c.status, c.byte_len, c.placed), want, "step {step}");
                let mut prefix = [0u8; 4];
                mr.read_at(i * 8, &mut prefix);
                assert_eq!(u32::from_be_bytes(prefix) as usize, msgs[i].len());
                let mut got = vec![0u8; msgs[i].len()];
                dst.read_at(at, &mut got);
                assert_eq!(got, msgs[i], "message {i}, step {step}");
                at += msgs[i].len();
            }
        }
    }

    #[test]
    fn a_body_placed_in_read_only_memory_is_a_protection_error() {
        let (qp, cq, table, _mr) = setup(2, 64);
        let dst = table.register_owned(64, crate::Access::READ);
        let mut framer = PlaceInto { dst, next: 0 };
        let mut rx = RxMachine::new();
        let mut sock = Trickle::new(framed(&[b"secret"]), 100);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::Failed);
        let c = drain(&cq);
        assert_eq!((c[0].status, c[0].placed), (WcStatus::ProtectionError, 0));
    }

    #[test]
    fn no_receive_wr_means_no_read() {
        let (qp, cq, table, _mr) = setup(1, 64);
        let mut rx = RxMachine::new();
        let mut framer = LengthPrefixed::default();
        let mut sock = Trickle::new(framed(&[b"one", b"two"]), 3);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::NoWr);
        assert_eq!(drain(&cq).len(), 1);
        // The second message stays in the "kernel" (beyond at most MAX_HEADER of read-ahead).
        assert!(sock.pos < sock.wire.len());
    }

    #[test]
    fn raw_stream_completes_each_read() {
        let (qp, cq, table, mr) = setup(4, 16);
        let mut rx = RxMachine::new();
        let wire = b"abcdefghijklmnopqrstuvwxyz".to_vec();
        let mut sock = Trickle::new(wire, 10);
        rx.pump(&qp, &table, &mut RawStream, &mut |iov| sock.read(iov));
        let lens: Vec<u32> = drain(&cq).iter().map(|c| c.byte_len).collect();
        assert_eq!(
            lens,
            vec![10, 10, 6],
            "one completion per read, never waiting to fill"
        );
        let mut got = [0u8; 16];
        mr.read_at(0, &mut got);
        assert_eq!(&got[..10], b"abcdefghij");
    }

    #[test]
    fn truncated_message_at_eof_is_remote_closed() {
        let (qp, cq, table, _mr) = setup(2, 64);
        let mut rx = RxMachine::new();
        let mut framer = LengthPrefixed::default();
        let mut wire = framed(&[b"0123456789"]);
        wire.truncate(8);
        let mut sock = Trickle::new(wire, 100);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| match sock.read(iov) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0), // then the peer closes
            r => r,
        });
        assert_eq!(stop, RxStop::Failed);
        let c = drain(&cq);
        assert_eq!((c[0].status, c[0].byte_len), (WcStatus::RemoteClosed, 4));
    }
}
