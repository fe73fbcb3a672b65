//! A READ answered from registered buffers (a store without a mapping: qcow2, RBD, the holes
//! of a tmpfs image), in pieces of at most [`CHUNK`] bytes: each piece is read into a buffer
//! counted by [`ReplySlots`] and sent as soon as it is read, so a 32 MiB read holds a few MiB,
//! not 32, and a client that does not read its replies holds the connection's bound at most.
//!
//! The reply's header goes out with the first piece, so an error reading the first piece is
//! answered with the error; one in a later piece, after the header promised the data, can
//! only end the connection (the client sees it close, as when a server dies mid-reply).

use std::collections::VecDeque;
use std::io;

use nbd_proto::transmission::server::{ServerTransmission, ValidRequest};
use nbd_proto::transmission::{ByteRange, ErrorValue};

use super::link::Link;
use super::recv_window::CHUNK;
use super::reply_slots::{ReplySlots, SendBuffer};
use crate::error::{Error, Result, io_error_value};
use crate::export::Export;
use crate::store::Pending;

/// What a READ reply needs from its connection.
pub(crate) struct ReadContext<'a> {
    pub link: &'a mut Link,
    pub replies: &'a mut ReplySlots,
    pub export: &'a Export,
    pub session: &'a ServerTransmission,
    /// Woken by the store when a started read is done.
    pub waker: &'a std::task::Waker,
}

/// One piece of a reply: a read into `buffer`, maybe still under way.
struct Piece {
    len: usize,
    /// Declared before `buffer`, so that dropping a piece waits for its read first.
    pending: Option<Box<dyn Pending>>,
    buffer: SendBuffer,
}

pub(crate) struct ReadReply {
    req: ValidRequest,
    range: ByteRange,
    /// Pieces started and not yet sent, in order.
    started: VecDeque<Piece>,
    /// The first byte of the range no piece covers yet.
    next: u64,
    /// The header went out: a failure now ends the connection.
    header_sent: bool,
}

impl ReadReply {
    pub(super) fn new(req: ValidRequest, range: ByteRange) -> Self {
        ReadReply {
            req,
            range,
            started: VecDeque::new(),
            next: range.offset(),
            header_sent: false,
        }
    }

    pub(super) fn reply_to(&self) -> nbd_proto::reply::ReplyTo {
        self.req.reply_to()
    }

    /// Every piece has been started.
    pub(super) fn fully_started(&self) -> bool {
        self.next == self.range.end()
    }

    /// Some started read is still under way (the store is asynchronous).
    pub(super) fn in_progress(&self) -> bool {
        self.started.iter().any(|p| p.pending.is_some())
    }

    /// Every piece is started and read: [`ReadReply::finish`] sends the reply without
    /// waiting for the store.
    pub(super) fn all_done(&self) -> bool {
        self.fully_started()
            && self
                .started
                .iter()
                .all(|p| p.pending.as_ref().is_none_or(|p| p.is_done()))
    }

    /// Starts reads of pieces while the connection's read memory has room without waiting.
    pub(super) fn start(&mut self, cx: &mut ReadContext) -> io::Result<()> {
        while !self.fully_started() {
            let len = self.next_len();
            let Some(buffer) = cx.replies.try_reserve(cx.link, len) else {
                break;
            };
            self.start_piece(cx, buffer)?;
        }
        Ok(())
    }

    /// Sends the reply to its end: waits for the started pieces, then reads and sends the
    /// rest a piece at a time, waiting for the client to read earlier replies where memory is
    /// short. `Ok(Err(e))`: the read failed before anything was sent; reply with `e`.
    pub(super) fn finish(mut self, cx: &mut ReadContext) -> Result<Result<(), ErrorValue>> {
        loop {
            while let Some(piece) = self.started.pop_front() {
                let read = piece.pending.map_or(Ok(()), |p| p.wait());
                if let Err(e) = read {
                    return self.failed(cx, &e);
                }
                self.send(cx, piece.len, piece.buffer)?;
            }
            if self.fully_started() {
                return Ok(Ok(()));
            }
            let buffer = cx.replies.reserve(cx.link, self.next_len())?;
            if let Err(e) = self.start_piece(cx, buffer) {
                return self.failed(cx, &e);
            }
        }
    }

    fn next_len(&self) -> usize {
        (self.range.end() - self.next).min(CHUNK as u64) as usize
    }

    fn start_piece(&mut self, cx: &mut ReadContext, buffer: SendBuffer) -> io::Result<()> {
        let len = self.next_len();
        // SAFETY: the buffer is new and not posted: nothing else uses its bytes, and the
        // read started into it is kept with it (Piece) until it is done.
        let pending = unsafe {
            let buf = buffer.mr().as_mut_slice()[..len].as_mut_ptr();
            cx.export.store.start_read(buf, len, self.next, cx.waker)?
        };
        self.started.push_back(Piece {
            len,
            pending,
            buffer,
        });
        self.next += len as u64;
        Ok(())
    }

    /// Posts one piece, after the reply's header if it is the first.
    fn send(&mut self, cx: &mut ReadContext, len: usize, buffer: SendBuffer) -> Result<()> {
        let header = match self.header_sent {
            true => None,
            false => Some(
                cx.session
                    .read_reply_header(&self.req)
                    .map_err(Error::Reply)?,
            ),
        };
        let data = buffer.mr().sge(0, len);
        let hdr: &[u8] = header.as_deref().unwrap_or(&[]);
        cx.replies.post(cx.link, hdr, Some(data), Some(buffer))?;
        self.header_sent = true;
        Ok(())
    }

    fn failed(&self, cx: &ReadContext, e: &io::Error) -> Result<Result<(), ErrorValue>> {
        let (offset, len) = (self.range.offset(), self.range.len());
        let at = cx.export.store.location();
        tracing::warn!(export = %cx.export.name, "read at {offset} of {len} bytes from {at}: {e}");
        if self.header_sent {
            return Err(Error::ReadFailedMidReply);
        }
        Ok(Err(io_error_value(e)))
    }
}
