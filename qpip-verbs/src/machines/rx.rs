//! The receive state machine: takes receive WRs off the ring ([`RecvTarget`], for datagrams
//! and streams alike) and, on a reliable QP, finds message boundaries with the QP's framer
//! and places each message into the next receive WR, the body straight from the connection
//! into the WR's memory. The connection is a [`RxIo`] (a kernel socket for the soft NIC, the
//! firmware's TCP receive buffer for the LANai), so the machine is tested without one.
//!
//! A body the framer placed in a registered file goes there without passing through user
//! memory where the connection can do that ([`RxIo::read_into_file`]: the soft NIC splices
//! socket → pipe → file), else through a bounded bounce buffer and `pwrite`. Its first bytes,
//! read ahead with the header, are written with the rest (one file write per piece, not an
//! extra small one per message).
//!
//! Its tests, which drive the machine without a socket, are in `machines/rx/tests.rs`.

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
    /// The WR's id, for its completion.
    pub wr_id: u64,
    /// Its memory, checked.
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

    /// Writes `prefix` (body bytes already read, at most [`MAX_HEADER`]) into `file` at
    /// `offset`, followed by up to `max` bytes moved from the connection without a copy
    /// through user memory, and empties whatever it used on the way (a pipe) before it
    /// returns: bytes taken from the connection (0: the peer closed), and the error writing
    /// the file hit, if one did (those bytes were taken and dropped). The prefix is written
    /// only with bytes from the connection: on `WouldBlock` it is still the caller's. `None`:
    /// the connection cannot; the machine then reads into a bounce buffer and writes that.
    fn read_into_file(
        &mut self,
        _file: &File,
        _offset: u64,
        _prefix: &[u8],
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
    /// A file body's bytes read ahead with the header, not yet written: they go into the
    /// file with the next bytes from the connection.
    prefix: SmallVec<[u8; MAX_HEADER]>,
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
            // Bytes of a file body come only with its header (a body read later goes through
            // `RxIo::read_into_file`): held for the file write of the bytes after them.
            Some(Placement::File(_)) if to_wr < data.len() => {
                debug_assert_eq!(at, self.prefix.len());
                self.prefix.extend_from_slice(&data[to_wr..]);
            }
            _ => {}
        }
    }

    /// Writes the held prefix of a file body by itself (a body that ends within it).
    fn flush_prefix(&mut self) {
        if let Some(Placement::File(span)) = &self.body
            && !self.prefix.is_empty()
        {
            let offset = span.offset() + (self.filled - self.in_wr - self.prefix.len()) as u64;
            if let Err(e) = span.file().write_all_at(&self.prefix, offset)
                && self.place_error.is_none()
            {
                self.place_error = Some(file_errno(&e));
            }
            self.prefix.clear();
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

/// The receive state machine of one QP: frames the byte stream and places each message in a receive WR (or its body where the framer says).
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

/// A file body over a connection that cannot splice: `prefix` and up to `BOUNCE` bytes read
/// after it into `bounce`, then written to the file. Same answer as [`RxIo::read_into_file`].
fn bounce_into_file(
    bounce: &mut Vec<u8>,
    io: &mut dyn RxIo,
    file: &File,
    offset: u64,
    prefix: &[u8],
    max: usize,
) -> io::Result<(usize, Option<io::Error>)> {
    if bounce.is_empty() {
        bounce.resize(BOUNCE + MAX_HEADER, 0);
    }
    let p = prefix.len();
    let want = max.min(BOUNCE);
    let n = io.read(&mut [IoSliceMut::new(&mut bounce[p..p + want])])?;
    if n == 0 {
        return Ok((0, None));
    }
    bounce[..p].copy_from_slice(prefix);
    Ok((n, file.write_all_at(&bounce[..p + n], offset).err()))
}

impl Default for RxMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl RxMachine {
    /// A machine with nothing read yet.
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
                if let Some(stop) = self.start_next(qp, memory, framer, io) {
                    return stop;
                }
                continue;
            };

            if !cur.stream && cur.filled == cur.total {
                self.complete_cur(qp, WcStatus::Success, 0);
                continue;
            }
            debug_assert_eq!(self.hdr_len, 0);
            if let Some(span) = cur.in_file_body() {
                let at = cur.filled - cur.in_wr - cur.prefix.len();
                let max = cur.total - cur.filled;
                let offset = span.offset() + at as u64;
                let file = span.file();
                let moved = match io.read_into_file(file, offset, &cur.prefix, max) {
                    Some(r) => r,
                    None => bounce_into_file(&mut self.bounce, io, file, offset, &cur.prefix, max),
                };
                match moved {
                    Ok((0, _)) => {
                        tracing::debug!(qp = qp.num, "peer closed in the middle of a message");
                        self.complete_cur(qp, WcStatus::RemoteClosed, 0);
                        return RxStop::Failed;
                    }
                    Ok((k, file_error)) => {
                        cur.filled += k.min(max);
                        cur.prefix.clear();
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

    /// With no message in progress: asks the framer where the next one ends, reading its
    /// header first (and a little beyond), and starts it. `Some` when pumping stops.
    fn start_next(
        &mut self,
        qp: &QpShared,
        memory: &MemoryTable,
        framer: &mut dyn Framer,
        io: &mut dyn RxIo,
    ) -> Option<RxStop> {
        if qp.rq.is_empty() {
            return Some(RxStop::NoWr);
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
                if let Err(stop) = self.start_framed(qp, memory, header_len, strip, body_len, None)
                {
                    return Some(stop);
                }
                return None;
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
                    return Some(stop);
                }
                return None;
            }
            Frame::Stream => {
                if let Err(stop) = self.start_message(qp, memory, usize::MAX, None, true) {
                    return Some(stop);
                }
                let in_hdr = self.hdr_len.min(self.cur.as_ref().map_or(0, |c| c.total));
                self.take_hdr(0, in_hdr);
                if self.cur.as_ref().is_some_and(|c| c.filled > 0) {
                    self.complete_cur(qp, WcStatus::Success, 0);
                }
                return None;
            }
            Frame::Invalid(reason) => {
                tracing::warn!(qp = qp.num, "framing error: {reason}");
                return Some(self.fail_next(qp, WcStatus::FramingError, 0, "invalid message"));
            }
        };
        if need > MAX_HEADER || need <= self.hdr_len {
            tracing::warn!(
                qp = qp.num,
                need,
                have = self.hdr_len,
                "framer asked for an impossible header"
            );
            return Some(self.fail_next(qp, WcStatus::FramingError, 0, "bad header request"));
        }
        // Read the header, and a little beyond: bounded read-ahead saves a system
        // call per small message.
        let mut iov = [IoSliceMut::new(&mut self.hdr[self.hdr_len..])];
        match io.read(&mut iov) {
            Ok(0) => return Some(self.fail_next(qp, WcStatus::RemoteClosed, 0, "peer closed")),
            Ok(k) => self.hdr_len += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(RxStop::WouldBlock),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Some(self.fail_next(qp, status_of(&e), os_error(&e), "read failed"));
            }
        }
        None
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
            prefix: SmallVec::new(),
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
        if let Some(mut cur) = self.cur.take() {
            if status == WcStatus::Success {
                cur.flush_prefix();
            }
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
mod tests;
