//! A connection's transmission phase, driven entirely by completions on its CQ: requests
//! checked by nbd-proto's [`ServerTransmission`], executed on the export's store, and answered
//! from registered memory. The protocol rules live in nbd-proto; this module moves messages
//! between the QP and the store.
//!
//! Copies per request (user space / kernel):
//! - READ: 0 / 1. The reply is a send WR whose data SGE points into the registered mapping of
//!   the image; the NIC engine's `writev` copies page cache → socket. A qcow2 image has no
//!   mapping of its virtual disk: its reads are read into registered buffers first (1 / 1),
//!   a piece at a time ([`super::read_reply`]). An RBD export has none either: librbd places
//!   the data in the registered buffers. A range of a tmpfs image with a hole is read like
//!   qcow2's (0 / 2): through the mapping, tmpfs would allocate a page per hole.
//! - WRITE: 1 / 1. The NIC reads the payload from the socket straight into a registered receive
//!   slot (kernel copy); `pwrite` copies the slot into the page cache. A store that can run
//!   writes concurrently (RBD) is handed each write as it arrives and wakes the connection
//!   (through its CQ's waker) when it is done; each turn of the loop then replies to the
//!   writes that are done, in any order, and posts their receive slots again (each piece's
//!   slot as soon as that piece is written), so the depth toward the store is the client's.
//!   Its reads are started likewise, into registered buffers counted against the
//!   connection's memory bound, and replied to when done. Ordering is the commands': a
//!   READ waits for the writes before it; FLUSH, TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS
//!   and DISC wait for the reads and writes before them (so FLUSH covers every write
//!   answered or started before it); a FUA write flushes once its own data is written.
//!   RESIZE (offered by stores that can resize) waits for all of them too.
//!
//! Over 600 lines: the completion loop and every command's execution share the connection's state (slots, pending writes and reads).

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use nbd_proto::consts as c;
use nbd_proto::handshake::server::ServerNegotiated;
use nbd_proto::reply::{self, ReplyTo};
use nbd_proto::transmission::server::{ServerTransmission, ValidRequest};
use nbd_proto::transmission::{ByteRange, Command, ContextSet, ErrorValue, ValidCommand};
use qpip_core::{Access, Completion, CqWaker, MemoryRegion, Opcode, RecvWr, WcStatus};

use super::framer::FramerState;
use super::link::Link;
use super::read_reply::{ReadContext, ReadReply};
use super::recv_window::{RECV_SLOTS, RecvWindow, SLOT_LEN};
use super::reply_slots::ReplySlots;
use crate::error::{Chain, Error, Result, io_error_value};
use crate::export::{Export, MetaContext};
use crate::metrics::{ConnStats, Started};
use crate::store::{Pending, ReadFrom};

// A BLOCK_STATUS payload (8 + 4 per context id) arrives whole with its header.
const _: () = assert!(8 + 4 * ContextSet::MAX <= super::recv_window::CHUNK);

/// Most extents in one block-status reply (the client asks again for the rest).
const MAX_EXTENTS: usize = 32;
/// TRIM, WRITE_ZEROES and CACHE may cover the whole export: the store is asked for pieces of
/// at most this much, so that no call holds a store's lock (qcow2's) for long.
const EFFECT_PIECE: u64 = 1 << 30;
/// After NBD_CMD_DISC: how long the replies to the requests before it may take to go out.
const DISC_DRAIN: Duration = Duration::from_secs(5);
/// After SIGTERM: how long new requests get ESHUTDOWN before the connection is closed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Runs `op` on `range` in pieces of at most [`EFFECT_PIECE`] bytes, in order; stops at the
/// first error or the first piece it declines (false).
fn in_pieces(
    range: ByteRange,
    mut op: impl FnMut(u64, u64) -> io::Result<bool>,
) -> io::Result<bool> {
    let mut at = range.offset();
    while at < range.end() {
        let n = (range.end() - at).min(EFFECT_PIECE);
        if !op(at, n)? {
            return Ok(false);
        }
        at += n;
    }
    Ok(true)
}

/// Serves the transmission phase that `negotiated` opens, once `last_reply` (the handshake's
/// final reply) has gone out; returns when the client leaves or the connection must close.
pub(crate) fn serve(
    link: &mut Link,
    framer: &FramerState,
    export: Arc<Export>,
    stats: Arc<ConnStats>,
    negotiated: &ServerNegotiated,
    last_reply: &[u8],
) -> Result<()> {
    let t = Transmission::new(link, framer, export, stats, negotiated)?;
    // The receive slots are posted before the reply that lets the client send requests.
    t.link.send_bytes(last_reply)?;
    t.run()
}

/// Wakes the connection's CQ wait when the store finishes a read or write it started.
struct WakeCq(CqWaker);

impl Wake for WakeCq {
    fn wake(self: Arc<Self>) {
        self.0.wake();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.wake();
    }
}

/// A WRITE whose payload is still arriving in pieces (or a refused request's payload, read
/// on and dropped before its error reply).
struct PendingWrite {
    to: ReplyTo,
    started: Started,
    /// Where the payload goes.
    offset: u64,
    /// Payload bytes in all.
    len: u64,
    fua: bool,
    received: u64,
    error: Option<ErrorValue>,
    /// Pieces the store is still writing, each with the receive slot it reads from (held,
    /// not posted again, until it is done).
    pieces: Vec<(Box<dyn Pending>, usize)>,
}

impl PendingWrite {
    /// Takes the pieces that are done (all of them with `block`, waiting for them): their
    /// errors are kept, their slots pushed onto `freed`.
    fn settle(&mut self, block: bool, freed: &mut Vec<usize>) {
        let mut i = 0;
        while i < self.pieces.len() {
            if !block && !self.pieces[i].0.is_done() {
                i += 1;
                continue;
            }
            let (piece, slot) = self.pieces.swap_remove(i);
            if let Err(e) = piece.wait() {
                self.error.get_or_insert(io_error_value(&e));
            }
            freed.push(slot);
        }
    }
}

struct Transmission<'a> {
    link: &'a mut Link,
    /// The requests the framer parsed, one per message that starts with a header.
    framer: &'a FramerState,
    export: Arc<Export>,
    /// What the connection counts ([`crate::metrics`]).
    stats: Arc<ConnStats>,
    /// The protocol side: request checks, reply bytes.
    session: ServerTransmission,
    recv_mr: MemoryRegion,
    stride: usize,
    window: RecvWindow,
    replies: ReplySlots,
    pending_write: Option<PendingWrite>,
    shutdown_since: Option<Instant>,
    /// Writes fully received whose pieces the store is still writing: replied to by
    /// `reap_writes` once done.
    started_writes: Vec<PendingWrite>,
    /// The receive slot of the message being handled.
    msg_slot: usize,
    /// Set by `on_message` when the message's slot must be held (a write piece reads it).
    hold_slot: bool,
    /// Reads the store is still doing: replied to by `reap_reads` once done.
    started_reads: Vec<(ReadReply, Started)>,
    /// Given to the store with every read and write it starts: wakes our CQ wait.
    waker: Waker,
}

impl Drop for Transmission<'_> {
    fn drop(&mut self) {
        // Started writes read from recv_mr: waited for (by dropping them) before it goes.
        self.pending_write = None;
        self.started_writes.clear();
        self.started_reads.clear();
        self.window.release(&self.link.shared.buffer_budget);
    }
}

impl<'a> Transmission<'a> {
    fn new(
        link: &'a mut Link,
        framer: &'a FramerState,
        export: Arc<Export>,
        stats: Arc<ConnStats>,
        neg: &ServerNegotiated,
    ) -> Result<Self> {
        let stride = SLOT_LEN;
        let recv_mr = link
            .shared
            .nic
            .alloc_region(RECV_SLOTS * stride, Access::READ_WRITE);
        let replies = ReplySlots::new(&link.shared.nic, link.shared.idle_timeout);
        let waker = Waker::from(Arc::new(WakeCq(link.cq.waker())));
        let (window, first) = RecvWindow::new(RECV_SLOTS, stride);
        for slot in first {
            link.qp.post_recv(RecvWr::new(
                slot as u64,
                &[recv_mr.sge(slot * stride, stride)],
            ))?;
        }
        Ok(Transmission {
            link,
            framer,
            export,
            stats,
            session: ServerTransmission::new(neg),
            recv_mr,
            stride,
            window,
            replies,
            pending_write: None,
            shutdown_since: None,
            started_writes: Vec::new(),
            msg_slot: 0,
            hold_slot: false,
            started_reads: Vec::new(),
            waker,
        })
    }

    fn run(mut self) -> Result<()> {
        let mut buf = [Completion::default(); 32];
        let mut batch = Vec::with_capacity(buf.len());
        let mut last_request = Instant::now();
        loop {
            if let Some(limit) = self.link.shared.idle_timeout
                && last_request.elapsed() >= limit
                && self.pending_write.is_none()
                && self.started_writes.is_empty()
                && self.started_reads.is_empty()
                && self.replies.all_free()
            {
                tracing::info!(peer = %self.link.peer, "closing: idle for {} s (--idle-timeout)", limit.as_secs_f64());
                self.link.qp.close();
                return Ok(());
            }
            // Replies in flight that the client does not read: idle too, and holding memory.
            self.replies.check_reading()?;
            if self.shutdown_since.is_none() && self.link.shared.shutting_down() {
                self.shutdown_since = Some(Instant::now());
                self.session.begin_shutdown();
            }
            if let Some(t) = self.shutdown_since
                && t.elapsed() > SHUTDOWN_GRACE
                && self.pending_write.is_none()
            {
                tracing::info!(peer = %self.link.peer, "closing for shutdown");
                // The requests started are answered (their replies may still go out).
                self.finish_writes()?;
                self.finish_reads()?;
                self.link.qp.ring_doorbell();
                self.export.store.flush().ok();
                self.link.qp.close();
                return Ok(());
            }
            batch.clear();
            if self.link.stash.is_empty() {
                // Also returns when the store finishes a request it started (the waker).
                let n = self
                    .link
                    .cq
                    .wait(&mut buf, Some(Duration::from_millis(200)))?;
                batch.extend_from_slice(&buf[..n]);
            } else {
                batch.extend(self.link.stash.drain(..));
            }
            // The whole batch is handled before the NIC hears of it: its replies and the
            // receive slots posted again go out with one doorbell.
            let more = self.handle_batch(&batch, &mut last_request);
            self.link.qp.ring_doorbell();
            if !more? {
                return Ok(());
            }
        }
    }

    /// Handles completions, posting replies and receive slots quietly. False: disconnect.
    fn handle_batch(&mut self, batch: &[Completion], last_request: &mut Instant) -> Result<bool> {
        let arrived = batch.iter().filter(|c| c.opcode != Opcode::Send).count();
        self.window
            .arrived(arrived, &self.link.shared.buffer_budget);
        for &c in batch {
            if c.opcode == Opcode::Send {
                self.replies.on_send(self.link, &c)?;
                continue;
            }
            match c.status {
                // A WRITE whose payload the NIC could not write into the image: answered
                // with its errno (begin_write); the connection goes on.
                WcStatus::Success | WcStatus::PlacementError => {}
                WcStatus::RemoteClosed | WcStatus::Flushed => {
                    if self.pending_write.is_some() {
                        tracing::warn!(peer = %self.link.peer, "client vanished in the middle of a write");
                    }
                    return Ok(false);
                }
                s => return Err(Error::RequestRefused(s)),
            }
            // Read per message already (the idle timeout); a request's arrival time too.
            *last_request = Instant::now();
            let slot = c.wr_id as usize;
            self.msg_slot = slot;
            self.hold_slot = false;
            if !self.on_message(slot, &c, *last_request)? {
                return Ok(false);
            }
            // A held slot is posted again when its write piece is done (reap_writes).
            if !self.hold_slot {
                let slot = self.window.reuse(slot);
                self.post_slot(slot)?;
            }
        }
        // What the store finished meanwhile is answered; the rest wakes us when done.
        self.reap_writes(false)?;
        self.reap_reads(false)?;
        for slot in self.window.top_up() {
            self.post_slot(slot)?;
        }
        Ok(true)
    }

    /// Posts a receive slot quietly (the batch loop rings).
    fn post_slot(&self, slot: usize) -> Result<()> {
        self.link.qp.post_recv_quiet(RecvWr::new(
            slot as u64,
            &[self.recv_mr.sge(slot * self.stride, self.stride)],
        ))?;
        Ok(())
    }

    /// Starts writing `len` bytes of the receive slot memory at `at` to `offset`: done when it
    /// returns, or pushed onto `pw.pieces` with this message's slot held.
    fn write_piece(&mut self, pw: &mut PendingWrite, at: usize, len: usize, offset: u64) {
        let data = self.slot(at, len);
        // SAFETY: the slot is held (not posted again) until the piece is waited for, in
        // reap_writes, or dropped, which waits too (Drop clears them before recv_mr goes).
        match unsafe { (self.export.store).start_write(data.as_ptr(), len, offset, &self.waker) } {
            Ok(None) => {}
            Ok(Some(piece)) => {
                pw.pieces.push((piece, self.msg_slot));
                self.hold_slot = true;
            }
            Err(e) => pw.error = Some(io_error_value(&e)),
        }
    }

    /// Waits for every started write, posts their receive slots again and replies to them:
    /// before a command that must come after them.
    fn finish_writes(&mut self) -> Result<()> {
        self.reap_writes(true)
    }

    /// Replies to the started writes the store is done with (with `block`, all of them,
    /// in order, waiting), and posts the receive slots of the pieces done again, the ones of
    /// a write still arriving included.
    fn reap_writes(&mut self, block: bool) -> Result<()> {
        let mut freed = Vec::new();
        if let Some(pw) = &mut self.pending_write {
            pw.settle(block, &mut freed);
        }
        let mut i = 0;
        while i < self.started_writes.len() {
            self.started_writes[i].settle(block, &mut freed);
            if !self.started_writes[i].pieces.is_empty() {
                i += 1;
                continue;
            }
            let pw = self.started_writes.remove(i);
            let result = match pw.error {
                Some(e) => Err(e),
                None => self.after_write(&pw),
            };
            self.reply_not_read(pw.to, pw.started, result)?;
        }
        for slot in freed {
            let slot = self.window.reuse(slot);
            self.post_slot(slot)?;
        }
        Ok(())
    }

    /// Waits for the started reads and sends their replies, in order.
    fn finish_reads(&mut self) -> Result<()> {
        self.reap_reads(true)
    }

    /// Sends the replies of the started reads the store is done with (with `block`, all of
    /// them, in order, waiting).
    fn reap_reads(&mut self, block: bool) -> Result<()> {
        let mut i = 0;
        while i < self.started_reads.len() {
            if block || self.started_reads[i].0.all_done() {
                let (r, started) = self.started_reads.remove(i);
                self.finish_read(r, started)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    fn finish_read(&mut self, r: ReadReply, started: Started) -> Result<()> {
        let to = r.reply_to();
        let mut cx = ReadContext {
            link: self.link,
            replies: &mut self.replies,
            export: &self.export,
            session: &self.session,
            waker: &self.waker,
        };
        match r.finish(&mut cx)? {
            Ok(()) => self.stats.replied(started, None),
            Err(e) => self.reply(to, started, Err(e))?,
        }
        Ok(())
    }

    /// Handles one message (a request, or a piece of a write payload), which arrived in
    /// receive slot `slot` (and, for a WRITE the framer placed, in the image). False:
    /// disconnect.
    fn on_message(&mut self, slot: usize, wc: &Completion, at: Instant) -> Result<bool> {
        let len = wc.byte_len as usize;
        let base = slot * self.stride;
        if let Some(mut pw) = self.pending_write.take() {
            if pw.error.is_none() {
                let off = pw.offset + pw.received;
                self.write_piece(&mut pw, base, len, off);
            }
            pw.received += len as u64;
            self.pending_write = Some(pw);
            return self.on_message_done_write();
        }
        let hdr_len = self.session.header_len();
        if len < hdr_len {
            return Err(Error::ShortRequest(len));
        }
        // The framer parsed and checked the header; only the shutdown rule is the
        // connection's (it may have begun since).
        let Some(framed) = self.framer.take_request() else {
            return Err(Error::UnframedRequest);
        };
        let request = self.session.admit(framed);
        let body_len = len - hdr_len;
        tracing::trace!(peer = %self.link.peer, ?request, "request");
        let command = match &request {
            Ok(req) => req.command().command(),
            Err(refusal) => refusal.command(),
        };
        let started = self.stats.request(command, at);
        // Reads come after the writes before them are done and answered; every other
        // command (but a write) after the reads too.
        if command != Command::Write {
            self.finish_writes()?;
        }
        if !matches!(command, Command::Write | Command::Read) {
            self.finish_reads()?;
        }
        let req = match request {
            Ok(req) => req,
            // A refused request's payload is read on (and dropped) before its error reply.
            Err(refusal) if refusal.payload_len() > 0 => {
                let pw = PendingWrite {
                    to: refusal.reply_to(),
                    started,
                    offset: 0,
                    len: refusal.payload_len(),
                    fua: false,
                    received: 0,
                    error: Some(refusal.error()),
                    pieces: Vec::new(),
                };
                return self.begin_write(pw, base + hdr_len, body_len, wc);
            }
            Err(refusal) => {
                self.reply(refusal.reply_to(), started, Err(refusal.error()))?;
                return Ok(true);
            }
        };
        match *req.command() {
            ValidCommand::Disc => {
                tracing::info!(peer = %self.link.peer, "client disconnected");
                // The requests before it are done and replied to (finish_writes and
                // finish_reads above); the replies, posted quietly, go out before the close.
                // Requests after it are not executed.
                match self.replies.drain(self.link, DISC_DRAIN) {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(peer = %self.link.peer, "closing after NBD_CMD_DISC with replies unsent after {} s: the client does not read them", DISC_DRAIN.as_secs())
                    }
                    Err(e) => {
                        tracing::debug!(peer = %self.link.peer, "sending the replies before NBD_CMD_DISC: {}", Chain(&e))
                    }
                }
                self.link.qp.close();
                return Ok(false);
            }
            ValidCommand::Read { range, .. } => {
                self.read(&req, started.moving(range.len()), range)?;
                return Ok(true);
            }
            ValidCommand::Resize { size } => {
                self.resize(&req, started, size)?;
                return Ok(true);
            }
            ValidCommand::Write { range, fua } => {
                let pw = PendingWrite {
                    to: req.reply_to(),
                    started: started.moving(range.len()),
                    offset: range.offset(),
                    len: range.len(),
                    fua,
                    received: 0,
                    error: None,
                    pieces: Vec::new(),
                };
                return self.begin_write(pw, base + hdr_len, body_len, wc);
            }
            // Its payload came with the header: it is at most 8 + 4 * ContextSet::MAX bytes
            // (nbd-proto refuses more), well within a receive slot.
            ValidCommand::BlockStatusPayload { .. } => {
                let payload = self.slot(base + hdr_len, body_len);
                match self.session.block_status_payload(&req, payload) {
                    Ok(checked) => return self.execute_and_reply(&checked, started),
                    Err(e) => {
                        self.reply(req.reply_to(), started, Err(e))?;
                        return Ok(true);
                    }
                }
            }
            _ => {}
        }
        self.execute_and_reply(&req, started)
    }

    /// Runs a command other than READ, WRITE and DISC ([`Self::execute`]) and replies.
    fn execute_and_reply(&mut self, req: &ValidRequest, started: Started) -> Result<bool> {
        match self.execute(req) {
            // The command sent its own reply.
            Ok(Some(())) => {
                self.stats.replied(started, None);
                Ok(true)
            }
            // Not a READ: those are answered above.
            Ok(None) => {
                self.reply_not_read(req.reply_to(), started, Ok(()))?;
                Ok(true)
            }
            Err(e) => {
                self.reply(req.reply_to(), started, Err(e))?;
                Ok(true)
            }
        }
    }

    /// A request with a payload: writes the `body_len` bytes of it that came with the header
    /// (at `at` in the receive slots), and waits for the rest. What the NIC placed in the
    /// image (`wc.placed`, the whole payload of a WRITE the framer placed) is written already.
    fn begin_write(
        &mut self,
        mut pw: PendingWrite,
        at: usize,
        body_len: usize,
        wc: &Completion,
    ) -> Result<bool> {
        if pw.error.is_none() && body_len > 0 {
            let offset = pw.offset;
            self.write_piece(&mut pw, at, body_len, offset);
        }
        if wc.status == WcStatus::PlacementError {
            let e = io::Error::from_raw_os_error(wc.os_error);
            tracing::debug!(peer = %self.link.peer, "writing a payload into the image: {e}");
            pw.error.get_or_insert(io_error_value(&e));
        }
        pw.received = body_len as u64 + u64::from(wc.placed);
        self.pending_write = Some(pw);
        // A payload that fit in one slot completes now.
        self.on_message_done_write()
    }

    fn on_message_done_write(&mut self) -> Result<bool> {
        let Some(pw) = self.pending_write.take() else {
            return Ok(true);
        };
        if pw.received < pw.len {
            self.pending_write = Some(pw);
            return Ok(true);
        }
        if !pw.pieces.is_empty() {
            self.started_writes.push(pw);
            return Ok(true);
        }
        let result = match pw.error {
            Some(e) => Err(e),
            None => self.after_write(&pw),
        };
        self.reply_not_read(pw.to, pw.started, result)?;
        Ok(true)
    }

    /// FUA: the written range is durable before the reply.
    fn after_write(&self, pw: &PendingWrite) -> Result<(), ErrorValue> {
        if pw.fua {
            self.export.store.flush().map_err(|e| io_error_value(&e))?;
        }
        Ok(())
    }

    /// Received bytes in a receive slot, where the NIC placed them: `pwrite` takes them from
    /// here, with no copy in between.
    fn slot(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: the slot's receive WR has completed and is reposted only after this borrow
        // ends (the caller is the completion handler), so the NIC does not write these bytes.
        let all = unsafe { self.recv_mr.as_slice() };
        &all[offset..offset + len]
    }

    /// Runs a command other than READ, WRITE and DISC. `Ok(Some(()))` when it sent its own
    /// reply.
    fn execute(&mut self, req: &ValidRequest) -> Result<Option<()>, ErrorValue> {
        let store = &self.export.store;
        fn io<T>(r: io::Result<T>) -> Result<T, ErrorValue> {
            r.map_err(|e| io_error_value(&e))
        }
        match *req.command() {
            ValidCommand::Flush => io(store.flush()).map(|()| None),
            ValidCommand::Trim { range, fua } => {
                io(in_pieces(range, |at, n| store.trim(at, n).map(|()| true)))?;
                if fua {
                    io(store.flush())?;
                }
                Ok(None)
            }
            ValidCommand::WriteZeroes {
                range,
                fua,
                no_hole,
                fast_zero,
            } => {
                // False: FAST_ZERO and the store would have to write the zeroes.
                let done = io(in_pieces(range, |at, n| {
                    store.write_zeroes(at, n, !fast_zero, !no_hole)
                }))?;
                if !done {
                    return Err(ErrorValue::NotSup);
                }
                if fua {
                    io(store.flush())?;
                }
                Ok(None)
            }
            ValidCommand::Cache { range } => io(in_pieces(range, |at, n| {
                store.prefetch(at, n).map(|()| true)
            }))
            .map(|_| None),
            ValidCommand::BlockStatus {
                range, contexts, ..
            } => {
                self.send_block_status(req, range, contexts)?;
                Ok(Some(()))
            }
            // READ, WRITE, RESIZE and DISC are handled by the caller.
            _ => Err(ErrorValue::Inval),
        }
    }

    /// NBD_CMD_RESIZE (offered where the store can resize: RBD). Every request before it is
    /// done (it waits like the other commands), as the extension asks; on success this
    /// connection's requests are checked against the new size, new connections are told it,
    /// and other open connections keep the size they were told (past the new end of a
    /// shrink their requests get EINVAL or ENOSPC from the store).
    fn resize(&mut self, req: &ValidRequest, started: Started, size: u64) -> Result<()> {
        let alone = self.export.connections.load(Ordering::SeqCst) <= 1;
        match self.export.store.resize(size, alone) {
            Ok(()) => {
                // Before the reply: the framer checks the next request against the new size.
                self.session.set_size(size);
                self.framer.set_size(size);
                self.reply(req.reply_to(), started, Ok(()))
            }
            // The store's reason goes to the client in the error chunk's message.
            Err(e) => {
                let mut out = Vec::with_capacity(128);
                let value = io_error_value(&e);
                let why = crate::error::Refusal::of(&e).map(|r| r.why.as_str());
                (self.session).reply_error(req.reply_to(), value, why, &mut out);
                self.stats.replied(started, Some(value));
                self.replies.post(self.link, &out, None, None)
            }
        }
    }

    /// The reply to a request without data: success, or the error.
    fn reply(
        &mut self,
        to: ReplyTo,
        started: Started,
        result: Result<(), ErrorValue>,
    ) -> Result<()> {
        let mut out = Vec::with_capacity(64);
        self.session.reply(to, result, &mut out);
        self.stats.replied(started, result.err());
        self.replies.post(self.link, &out, None, None)
    }

    /// The reply to a request other than READ (a success may be a simple reply).
    fn reply_not_read(
        &mut self,
        to: ReplyTo,
        started: Started,
        result: Result<(), ErrorValue>,
    ) -> Result<()> {
        let mut out = Vec::with_capacity(64);
        self.session.reply_not_read(to, result, &mut out);
        self.stats.replied(started, result.err());
        self.replies.post(self.link, &out, None, None)
    }

    /// READ: the reply header from a slot, the data straight from the image's mapping, or
    /// read by the store into registered buffers a piece at a time. Errors are replied to;
    /// `Err` ends the connection.
    fn read(&mut self, req: &ValidRequest, started: Started, range: ByteRange) -> Result<()> {
        if range.is_empty() {
            return self.reply(req.reply_to(), started, Ok(()));
        }
        let from = self.export.store.read_from(range.offset(), range.len());
        // No mapping (qcow2, RBD), or a range whose holes the mapping would fill with new
        // pages (tmpfs): the store reads into registered buffers.
        let mapped = match (from.unwrap_or(ReadFrom::Gone), &self.export.region) {
            (ReadFrom::Gone, _) => {
                tracing::warn!(export = %self.export.name, "read at {} of {} bytes: {} is shorter than that now (truncated by another process?)", range.offset(), range.len(), self.export.store.location());
                return self.reply(req.reply_to(), started, Err(ErrorValue::Io));
            }
            (ReadFrom::Mapping, Some(region)) => {
                region.sge(range.offset() as usize, range.len() as usize)
            }
            _ => return self.read_into_buffers(req, started, range),
        };
        let hdr = self.session.read_reply_header(req).map_err(Error::Reply)?;
        self.stats.replied(started, None);
        self.replies.post(self.link, &hdr, Some(mapped), None)
    }

    fn read_into_buffers(
        &mut self,
        req: &ValidRequest,
        started: Started,
        range: ByteRange,
    ) -> Result<()> {
        let mut r = ReadReply::new(*req, range);
        let mut cx = ReadContext {
            link: self.link,
            replies: &mut self.replies,
            export: &self.export,
            session: &self.session,
            waker: &self.waker,
        };
        if let Err(e) = r.start(&mut cx) {
            let at = self.export.store.location();
            tracing::warn!(export = %self.export.name, "read at {} of {} bytes from {at}: {e}", range.offset(), range.len());
            drop(r); // waits for the pieces started
            return self.reply(req.reply_to(), started, Err(io_error_value(&e)));
        }
        // An asynchronous store (RBD) reads on, and wakes us when done.
        if r.fully_started() && r.in_progress() {
            self.started_reads.push((r, started));
            return Ok(());
        }
        // Memory is short: the reads started before hold some of it; they go first.
        if !r.fully_started() {
            self.finish_reads()?;
        }
        self.finish_read(r, started)
    }

    /// BLOCK_STATUS: one chunk per context the client selected, in the order it was told
    /// them (each context's extents end where its own answer does).
    fn send_block_status(
        &mut self,
        req: &ValidRequest,
        range: ByteRange,
        wanted: ContextSet,
    ) -> Result<(), ErrorValue> {
        let store = &self.export.store;
        let (at, len) = (range.offset(), range.len());
        // Extents of at most 2 GiB (block aligned) in 32-bit replies; under extended headers
        // one extent says it all, however long (a hole across a whole 1 PiB qcow2 disk).
        let most = if req.reply_to().offset.is_some() {
            u64::MAX
        } else {
            1 << 31
        };
        let mut chunks: Vec<(u32, Vec<reply::Extent>)> = Vec::new();
        let selected = self.session.contexts().iter().enumerate();
        for (_, (id, name)) in selected.filter(|(i, _)| wanted.contains(*i)) {
            let runs: Vec<(u64, u32)> = if name == c::BASE_ALLOCATION {
                let extents = store.extents(at, len).map_err(|e| io_error_value(&e))?;
                extents
                    .into_iter()
                    .map(|e| {
                        let flags = if e.hole {
                            c::STATE_HOLE | c::STATE_ZERO
                        } else {
                            0
                        };
                        (e.len, flags)
                    })
                    .collect()
            } else {
                // The handshake selects only contexts the export offers.
                match self.export.context(name) {
                    Some(MetaContext::AllocationDepth) => store
                        .allocation_depth(at, len)
                        .map_err(|e| io_error_value(&e))?
                        .into_iter()
                        .map(|d| (d.len, d.depth))
                        .collect(),
                    Some(MetaContext::DirtyBitmap(b)) => store
                        .dirty_bitmap(b, at, len)
                        .map_err(|e| io_error_value(&e))?
                        .into_iter()
                        .map(|d| (d.len, if d.dirty { c::STATE_DIRTY } else { 0 }))
                        .collect(),
                    _ => return Err(ErrorValue::Inval),
                }
            };
            let mut wire = Vec::new();
            for (n, flags) in runs {
                let mut left = n;
                while left > 0 && wire.len() < MAX_EXTENTS {
                    let piece = left.min(most);
                    wire.push(reply::Extent {
                        length: piece,
                        flags,
                    });
                    left -= piece;
                }
            }
            chunks.push((*id, wire));
        }
        let contexts: Vec<(u32, &[reply::Extent])> =
            chunks.iter().map(|(id, w)| (*id, w.as_slice())).collect();
        let mut out = Vec::new();
        self.session
            .block_status_reply(req, &contexts, &mut out)
            .map_err(|_| ErrorValue::Io)?;
        self.replies.post(self.link, &out, None, None).map_err(|e| {
            tracing::warn!("block status reply: {}", Chain(&e));
            ErrorValue::Io
        })
    }
}
