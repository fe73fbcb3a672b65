//! The receive state machine: takes receive WRs off the ring ([`RecvTarget`], for datagrams
//! and streams alike) and, on a reliable QP, finds message boundaries with the QP's framer
//! and places each message into the next receive WR, the body straight from the connection
//! into the WR's memory. The connection is a [`RxIo`] (a kernel socket for the soft NIC, the
//! firmware's TCP receive buffer for the LANai), so the machine is tested without one.
//!
//! A body the framer placed in a registered file goes there without passing through user
//! memory where the connection can do that ([`RxIo::read_into_file`]: the soft NIC splices
//! socket → pipe → file), else through a bounded bounce buffer and `pwrite`.
//!
//! Over 600 lines: two fifths are its tests, which drive the machine without a socket.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::os::unix::fs::FileExt;

use smallvec::SmallVec;

use super::status_of;
use crate::framer::{Frame, Framer, MAX_HEADER};
use crate::mr::{FileSpan, MemoryTable, Placement, Segment, Sge};
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

/// The connection the receive machine reads.
pub trait RxIo {
    /// Reads into `iov`: bytes read, 0 when the peer closed, or `WouldBlock`.
    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize>;

    /// Moves up to `max` bytes from the connection into `file` at `offset` without a copy
    /// through user memory, and empties whatever it used on the way (a pipe) before it
    /// returns: bytes taken from the connection (0: the peer closed), and the error writing
    /// the file hit, if one did (those bytes were taken and dropped). `None`: the connection
    /// cannot; the machine then reads into a bounce buffer and writes that.
    fn read_into_file(
        &mut self,
        _file: &File,
        _offset: u64,
        _max: usize,
    ) -> Option<io::Result<(usize, Option<io::Error>)>> {
        None
    }
}

/// A plain `read` closure as the connection.
struct ReadFn<'a>(&'a mut dyn FnMut(&mut [IoSliceMut<'_>]) -> io::Result<usize>);

impl RxIo for ReadFn<'_> {
    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        (self.0)(iov)
    }
}

/// Bytes read at a time for a file body on a connection that cannot splice.
const BOUNCE: usize = 64 << 10;

/// A message being placed: its first `in_wr` bytes into a receive WR, the rest into `body`
/// when the framer named memory or a registered file for it ([`Frame::MessageAt`]).
struct InMsg {
    wr: RecvTarget,
    body: Option<Placement>,
    /// The first error writing a file body (errno); the rest of the body is still read (and
    /// dropped) so that the stream stays in step, and the completion reports it.
    place_error: Option<i32>,
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
    fn place(&mut self, pos: usize, data: &[u8]) {
        let to_wr = self.in_wr.saturating_sub(pos).min(data.len());
        self.wr.scatter(pos, &data[..to_wr]);
        let at = (pos + to_wr).saturating_sub(self.in_wr);
        match &self.body {
            Some(Placement::Memory(body)) => {
                scatter(std::slice::from_ref(body), at, &data[to_wr..]);
            }
            // Nothing more is written once writing the file failed.
            Some(Placement::File(span)) if to_wr < data.len() && self.place_error.is_none() => {
                let offset = span.offset() + at as u64;
                if let Err(e) = span.file().write_all_at(&data[to_wr..], offset) {
                    self.place_error = Some(file_errno(&e));
                }
            }
            _ => {}
        }
    }

    /// The body is a file and the bytes from `filled` on belong to it.
    fn in_file_body(&self) -> Option<FileSpan> {
        match &self.body {
            Some(Placement::File(span)) if self.filled >= self.in_wr => Some(span.clone()),
            _ => None,
        }
    }

    /// The message's memory from byte `from` to `to`, as iovecs (the WR's, then the body's
    /// when that is memory).
    fn iov(&self, from: usize, to: usize) -> SmallVec<[IoSliceMut<'_>; 6]> {
        let mut out = segs_mut(&self.wr.segs, from.min(self.in_wr), to.min(self.in_wr));
        if let Some(Placement::Memory(body)) = &self.body
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
    /// File bodies on connections that cannot splice pass through here (allocated on first
    /// use, `BOUNCE` bytes).
    bounce: Vec<u8>,
}

fn os_error(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// The errno of a failed file write; EIO for an error that carries none.
fn file_errno(e: &io::Error) -> i32 {
    e.raw_os_error().filter(|&n| n != 0).unwrap_or(libc::EIO)
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

/// A file body over a connection that cannot splice: up to `BOUNCE` bytes read into
/// `bounce`, then written to the file. Same answer as [`RxIo::read_into_file`].
fn bounce_into_file(
    bounce: &mut Vec<u8>,
    io: &mut dyn RxIo,
    file: &File,
    offset: u64,
    max: usize,
) -> io::Result<(usize, Option<io::Error>)> {
    if bounce.is_empty() {
        bounce.resize(BOUNCE, 0);
    }
    let want = max.min(bounce.len());
    let n = io.read(&mut [IoSliceMut::new(&mut bounce[..want])])?;
    Ok((n, file.write_all_at(&bounce[..n], offset).err()))
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
            bounce: Vec::new(),
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
        self.pump_io(qp, memory, framer, &mut ReadFn(read))
    }

    /// [`Self::pump`] over a connection that may place file bodies itself.
    pub fn pump_io(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        framer: &mut dyn Framer,
        io: &mut dyn RxIo,
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
                match io.read(&mut iov) {
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
            debug_assert_eq!(self.hdr_len, 0);
            if let Some(span) = cur.in_file_body() {
                let at = cur.filled - cur.in_wr;
                let max = cur.total - cur.filled;
                let offset = span.offset() + at as u64;
                let moved = match io.read_into_file(span.file(), offset, max) {
                    Some(r) => r,
                    None => bounce_into_file(&mut self.bounce, io, span.file(), offset, max),
                };
                match moved {
                    Ok((0, _)) => {
                        tracing::debug!(qp = qp.num, "peer closed in the middle of a message");
                        self.complete_cur(qp, WcStatus::RemoteClosed, 0);
                        return RxStop::Failed;
                    }
                    Ok((k, file_error)) => {
                        cur.filled += k.min(max);
                        if let Some(e) = file_error {
                            cur.place_error.get_or_insert(file_errno(&e));
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return RxStop::WouldBlock,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.complete_cur(qp, status_of(&e), os_error(&e));
                        return RxStop::Failed;
                    }
                }
                continue;
            }
            // The body goes straight into the WR's memory; for framed messages the bytes after
            // it (the next header) land in `hdr`, which is empty here. Before a file body only
            // the WR's part is read: what follows it goes to the file.
            let file_body = matches!(cur.body, Some(Placement::File(_)));
            let (filled, stream) = (cur.filled, cur.stream);
            let total = if file_body { cur.in_wr } else { cur.total };
            let mut iov = cur.iov(filled, total);
            if !stream && !file_body {
                iov.push(IoSliceMut::new(&mut self.hdr[..]));
            }
            match io.read(&mut iov) {
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
        let body = match body.map(|sge| memory.resolve_placement(&sge)) {
            None => None,
            Some(Ok(place)) => Some(place),
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
        body: Option<Placement>,
        stream: bool,
    ) -> Result<(), RxStop> {
        let wr = match RecvTarget::take(qp, memory) {
            None => return Err(RxStop::NoWr),
            Some(Err(WrRefused)) => return Err(RxStop::Failed),
            Some(Ok(wr)) => wr,
        };
        let capacity = wr.capacity();
        let total = if stream { capacity } else { total };
        let in_wr = total - body.as_ref().map_or(0, Placement::len);
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
            place_error: None,
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
            let (status, os_error) = match (status, cur.place_error) {
                (WcStatus::Success, Some(errno)) => (WcStatus::PlacementError, errno),
                _ => (status, os_error),
            };
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

    /// Length-prefixed messages whose bodies go to consecutive places of a region (the
    /// prefix stays in the receive WR), as an NBD client places READ data: `sge(at, len)`
    /// names them, in memory or in a registered file.
    struct PlaceInto {
        sge: Box<dyn Fn(u64, u32) -> Sge + Send>,
        next: u64,
    }

    impl PlaceInto {
        fn memory(dst: MemoryRegion) -> PlaceInto {
            let sge = move |at, len| dst.sge(at as usize, len as usize);
            PlaceInto {
                sge: Box::new(sge),
                next: 0,
            }
        }
        fn file(dst: crate::FileRegion) -> PlaceInto {
            let sge = move |at, len| dst.sge(at, len);
            PlaceInto {
                sge: Box::new(sge),
                next: 0,
            }
        }
    }

    impl Framer for PlaceInto {
        fn frame(&mut self, header: &[u8]) -> Frame {
            let Some(prefix) = header.first_chunk::<4>() else {
                return Frame::NeedHeader(4);
            };
            let len = u32::from_be_bytes(*prefix);
            let body = (self.sge)(self.next, len);
            self.next += u64::from(len);
            Frame::MessageAt {
                header_len: 4,
                strip: 0,
                body,
            }
        }
    }

    /// Each message completed with its 4-byte prefix in an 8-byte receive WR of `mr` and its
    /// body, in order, where `body(at, buf)` reads consecutive bodies back from.
    fn check_placed(
        done: &[Completion],
        mr: &MemoryRegion,
        msgs: &[Vec<u8>],
        body: impl Fn(u64, &mut [u8]),
        step: usize,
    ) {
        assert_eq!(done.len(), msgs.len(), "step {step}");
        let mut at = 0u64;
        for (i, c) in done.iter().enumerate() {
            let want = (WcStatus::Success, 4, msgs[i].len() as u32);
            assert_eq!((c.status, c.byte_len, c.placed), want, "step {step}");
            let mut prefix = [0u8; 4];
            mr.read_at(i * 8, &mut prefix);
            assert_eq!(u32::from_be_bytes(prefix) as usize, msgs[i].len());
            let mut got = vec![0u8; msgs[i].len()];
            body(at, &mut got);
            assert_eq!(got, msgs[i], "message {i}, step {step}");
            at += msgs[i].len() as u64;
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
            let mut framer = PlaceInto::memory(dst.clone());
            let mut rx = RxMachine::new();
            let mut sock = Trickle::new(wire.clone(), step);
            let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
            assert_eq!(stop, RxStop::NoWr, "step {step}");
            let body = |at: u64, got: &mut [u8]| dst.read_at(at as usize, got);
            check_placed(&drain(&cq), &mr, &msgs, body, step);
        }
    }

    fn file_of(len: u64, writable: bool) -> (tempfile::NamedTempFile, std::sync::Arc<File>) {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        tmp.as_file().set_len(len).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .open(tmp.path())
            .unwrap();
        (tmp, std::sync::Arc::new(f))
    }

    #[test]
    fn file_bodies_are_written_to_the_file_and_headers_into_the_wr() {
        // Bodies longer than the bounce buffer too, so that one takes several rounds.
        let mut msgs: Vec<Vec<u8>> = (1..12).map(|i| vec![i as u8; (i * 53) % 300]).collect();
        msgs.push((0..BOUNCE * 2 + 7).map(|i| (i % 251) as u8).collect());
        let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
        let wire = framed(&refs);
        let total: usize = msgs.iter().map(Vec::len).sum();
        for step in [1, 3, 5, 64, 1 << 20] {
            if step == 1 && wire.len() > 100_000 {
                continue; // a byte a read through 128 KiB is slow and proves nothing more
            }
            let (qp, cq, table, mr) = setup(msgs.len(), 8);
            let (_tmp, file) = file_of(total as u64, true);
            let dst = table.register_file(file.clone(), total as u64, crate::Access::READ_WRITE);
            let mut framer = PlaceInto::file(dst);
            let mut rx = RxMachine::new();
            let mut sock = Trickle::new(wire.clone(), step);
            let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
            assert_eq!(stop, RxStop::NoWr, "step {step}");
            let body = |at: u64, got: &mut [u8]| file.read_exact_at(got, at).unwrap();
            check_placed(&drain(&cq), &mr, &msgs, body, step);
        }
    }

    #[test]
    fn a_file_that_refuses_the_write_fails_that_message_only() {
        // Registered writable, but the descriptor is read-only: the OS refuses (EBADF).
        let (qp, cq, table, mr) = setup(3, 16);
        let (_tmp, file) = file_of(64, false);
        let dst = table.register_file(file, 64, crate::Access::READ_WRITE);
        let mut framer = PlaceInto::file(dst);
        let mut rx = RxMachine::new();
        let mut sock = Trickle::new(framed(&[b"lost", &[7u8; 40], b"x"]), 7);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::NoWr);
        let c = drain(&cq);
        let got: Vec<_> = c.iter().map(|c| (c.status, c.byte_len, c.placed)).collect();
        let failed = WcStatus::PlacementError;
        assert_eq!(got, [(failed, 4, 4), (failed, 4, 40), (failed, 4, 1)]);
        assert!(c.iter().all(|c| c.os_error == 9), "EBADF: {c:?}");
        // The stream stayed in step: every header landed where it belongs.
        let mut prefix = [0u8; 4];
        mr.read_at(2 * 16, &mut prefix);
        assert_eq!(u32::from_be_bytes(prefix), 1);
    }

    #[test]
    fn file_placement_checks_bounds_and_access() {
        for (len, access) in [(8, crate::Access::READ_WRITE), (64, crate::Access::READ)] {
            let (qp, cq, table, _mr) = setup(2, 64);
            let (_tmp, file) = file_of(64, true);
            let dst = table.register_file(file.clone(), len, access);
            let mut framer = PlaceInto::file(dst);
            let mut rx = RxMachine::new();
            let mut sock = Trickle::new(framed(&[b"too long for it"]), 100);
            let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
            assert_eq!(stop, RxStop::Failed);
            let c = drain(&cq);
            assert_eq!((c[0].status, c[0].placed), (WcStatus::ProtectionError, 0));
            let mut got = [1u8; 15];
            file.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, [0u8; 15], "nothing written");
        }
    }

    #[test]
    fn a_file_region_is_not_memory_for_work_requests() {
        let table = MemoryTable::new();
        let (_tmp, file) = file_of(64, true);
        let dst = table.register_file(file, 64, crate::Access::READ_WRITE);
        let sge = dst.sge(0, 8);
        assert!(matches!(
            table.resolve(&sge, false),
            Err(crate::ProtectionFault::NotMemory(_))
        ));
        drop(dst);
        assert!(matches!(
            table.resolve_placement(&sge),
            Err(crate::ProtectionFault::UnknownKey(_))
        ));
    }

    #[test]
    fn a_body_placed_in_read_only_memory_is_a_protection_error() {
        let (qp, cq, table, _mr) = setup(2, 64);
        let dst = table.register_owned(64, crate::Access::READ);
        let mut framer = PlaceInto::memory(dst);
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
