//! One client connection: the NBD handshake, then the transmission phase, driven entirely by
//! completions on the connection's CQ. The protocol rules live in nbd-proto; this module moves
//! messages between the QP and the image.
//!
//! Copies per request (user space / kernel):
//! - READ: 0 / 1. The reply is a send WR whose data SGE points into the registered mapping of
//!   the image; the NIC engine's `writev` copies page cache → socket. A qcow2 image has no
//!   mapping of its virtual disk: its reads are read into a registered buffer first (1 / 1).
//!   An RBD export has none either: librbd places the data in the registered buffer.
//! - WRITE: 1 / 1. The NIC reads the payload from the socket straight into a registered receive
//!   slot (kernel copy); `pwrite` copies the slot into the page cache. A store that can run
//!   writes concurrently (RBD) is handed every write of a batch of completions before the
//!   connection waits for any: their receive slots are posted again, and their replies sent,
//!   once they are done, at the end of the batch or before any other command. Its reads
//!   are started likewise, each into its own registered buffer, and replied to when done.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use nbd_proto::consts as c;
use nbd_proto::flags::CmdFlags;
use nbd_proto::handshake::server::{ServerEvent, ServerHandshake, ServerNegotiated};
use nbd_proto::reply::{self, ReplyTo, SimpleReply};
use nbd_proto::transmission::{Command, ErrorValue, Request, TransmissionInfo, validate_request};
use qpip_core::{
    Access, Completion, CompletionQueue, Endpoint, MemoryRegion, Opcode, QueuePair, RecvWr, SendWr,
    WcStatus,
};

use crate::backend::Pending;
use crate::export::Export;
use crate::framer::{FramerState, WritePlacement};
use crate::recv_window::RecvWindow;
use crate::shared::ServerShared;

/// Receive slots a connection may post at most in the transmission phase (how many it does
/// post: [`RecvWindow`]): requests the client may have in flight before TCP flow control
/// holds it.
pub const RECV_SLOTS: usize = 32;
/// Largest payload piece placed in one receive WR (longer writes arrive in pieces).
pub const CHUNK: usize = 1 << 20;
/// A receive slot: the longest request header (extended) and a payload piece.
pub const SLOT_LEN: usize = c::EXTENDED_REQUEST_LEN + CHUNK;
/// Reply header slots: one per reply in flight.
const REPLY_SLOTS: usize = 64;
const REPLY_SLOT_LEN: usize = 512;
/// Most extents in one block-status reply (the client asks again for the rest).
const MAX_EXTENTS: usize = 32;
/// A client that does not finish its handshake in this time is dropped, so that idle
/// sockets cannot hold the connection slots for long (qemu-nbd's --handshake-limit default).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// After SIGTERM: how long new requests get ESHUTDOWN before the connection is closed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// How often a connection in its handshake looks whether it has been evicted.
const EVICT_POLL: Duration = Duration::from_millis(100);

const REPLY_WR: u64 = 1 << 32;
const HANDSHAKE_WR: u64 = 2 << 32;

/// CQ depth: every WR the connection can have outstanding, so it can never overflow.
pub const CQ_DEPTH: usize = RECV_SLOTS + REPLY_SLOTS + 16;

pub struct Connection {
    shared: Arc<ServerShared>,
    qp: QueuePair,
    cq: CompletionQueue,
    framer: Arc<FramerState>,
    peer: Endpoint,
    /// Completions read while waiting for something else (a free reply slot).
    stash: VecDeque<Completion>,
    /// Handshake replies in flight, kept alive until their send completes.
    handshake_sends: HashMap<u64, MemoryRegion>,
    next_wr: u64,
    /// Set by the accept loop when too many handshakes are under way and this is the oldest;
    /// dropped when the handshake ends.
    evict: Option<Arc<AtomicBool>>,
}

fn io_error_value(e: &io::Error) -> ErrorValue {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorValue::NoSpc,
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => ErrorValue::Perm,
        Some(libc::EINVAL) => ErrorValue::Inval,
        Some(libc::EOPNOTSUPP) => ErrorValue::NotSup,
        _ => ErrorValue::Io,
    }
}

impl Connection {
    pub fn new(
        shared: Arc<ServerShared>,
        qp: QueuePair,
        cq: CompletionQueue,
        framer: Arc<FramerState>,
        peer: Endpoint,
        evict: Arc<AtomicBool>,
    ) -> Self {
        Connection {
            shared,
            qp,
            cq,
            framer,
            peer,
            stash: VecDeque::new(),
            handshake_sends: HashMap::new(),
            next_wr: 0,
            evict: Some(evict),
        }
    }

    pub fn run(mut self) -> Result<()> {
        let handshake = self.handshake();
        self.evict = None;
        let Some((neg, last_reply)) = handshake? else {
            return Ok(());
        };
        // Only clients past the handshake count toward --max-connections; the final reply
        // has not gone out, so a refused client sees the connection close in the handshake.
        let Some(_place) = self.shared.admit(&self.peer) else {
            self.qp.close();
            return Ok(());
        };
        let export = self.shared.exports[neg.export_index].clone();
        tracing::info!(peer = %self.peer, export = %export.name, structured = neg.structured_replies, extended = neg.extended_headers, tls = neg.tls, "client connected");
        if let Some(region) = &export.file_region {
            // Before the reply that lets the client send requests (none could be placed
            // without it, which would only cost their copy).
            let info = neg.transmission_info();
            let region = region.clone();
            let _ = self.framer.placement.set(WritePlacement { region, info });
        }
        let t = Transmission::new(&mut self, export, &neg)?;
        // The receive slots are posted before the reply that lets the client send requests.
        t.conn.send_bytes(&last_reply)?;
        t.run()
    }

    fn wait_one(&mut self, deadline: Instant, what: &str) -> Result<Completion> {
        if let Some(c) = self.stash.pop_front() {
            return Ok(c);
        }
        let mut buf = [Completion::default(); 1];
        loop {
            if self
                .evict
                .as_ref()
                .is_some_and(|f| f.load(Ordering::Acquire))
            {
                bail!(
                    "{what}: dropped to make room for newer clients (too many unfinished handshakes)"
                );
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("{what}: timed out");
            }
            // In slices, so that an eviction is noticed soon.
            if self.cq.wait(&mut buf, Some(left.min(EVICT_POLL)))? == 1 {
                return Ok(buf[0]);
            }
        }
    }

    /// Sends bytes that are not in registered memory yet (handshake replies).
    fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mr = self.shared.nic.alloc_region(bytes.len(), Access::READ);
        mr.write_at(0, bytes);
        self.next_wr += 1;
        let id = HANDSHAKE_WR + self.next_wr;
        self.qp
            .post_send(SendWr::new(id, &[mr.sge(0, bytes.len())]))?;
        self.handshake_sends.insert(id, mr);
        Ok(())
    }

    /// Waits (until `deadline`) for the handshake replies still being sent, so that their
    /// memory is not deregistered under the NIC.
    fn finish_handshake_sends(&mut self, deadline: Instant) {
        while !self.handshake_sends.is_empty() {
            match self.wait_one(deadline, "the last handshake reply") {
                Ok(c) if c.opcode == Opcode::Send => {
                    self.handshake_sends.remove(&c.wr_id);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    fn on_handshake_send(&mut self, c: &Completion) -> Result<()> {
        self.handshake_sends.remove(&c.wr_id);
        if !c.is_ok() {
            bail!("sending to the client failed: {:?}", c.status);
        }
        Ok(())
    }

    /// NBD_OPT_STARTTLS: the ACK goes out in plaintext, then the NIC switches the connection
    /// to TLS (no receive WR is posted meanwhile, so nothing is read in plaintext).
    fn start_tls(&mut self, ack: &[u8], deadline: Instant) -> Result<()> {
        let Some(config) = self.shared.tls.clone() else {
            bail!("STARTTLS acknowledged without TLS credentials");
        };
        self.send_bytes(ack)?;
        while !self.handshake_sends.is_empty() {
            let c = self.wait_one(deadline, "the STARTTLS reply")?;
            if c.opcode == Opcode::Send {
                self.on_handshake_send(&c)?;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        self.qp
            .start_tls(config, left.max(Duration::from_millis(1)))
            .context("TLS handshake")?;
        tracing::debug!(peer = %self.peer, "TLS established");
        Ok(())
    }

    /// Runs the handshake. Returns the negotiated export and the final reply (not yet sent),
    /// or None when the client ended it (ABORT, or a LIST/INFO-only session).
    fn handshake(&mut self) -> Result<Option<(ServerNegotiated, Vec<u8>)>> {
        let mut hs = ServerHandshake::new(self.shared.proto.clone());
        if self.shared.shutting_down() {
            hs.begin_shutdown();
        }
        let max = c::OPTION_HEADER_LEN + self.shared.limits.max_option_len as usize;
        let rbuf = self.shared.nic.alloc_region(max, Access::READ_WRITE);
        self.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
        self.send_bytes(&hs.greeting())?;
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let mut msg = Vec::new();
        loop {
            let c = self.wait_one(deadline, "handshake")?;
            if c.opcode == Opcode::Send {
                self.on_handshake_send(&c)?;
                continue;
            }
            match c.status {
                WcStatus::Success => {}
                WcStatus::RemoteClosed | WcStatus::Flushed => return Ok(None),
                s => bail!("handshake message refused by the NIC: {s:?}"),
            }
            msg.resize(c.byte_len as usize, 0);
            rbuf.read_at(0, &mut msg);
            let mut out = Vec::new();
            match hs
                .handle_message(&msg, &mut out)
                .map_err(|e| anyhow!("handshake: {e}"))?
            {
                ServerEvent::Continue => {
                    self.send_bytes(&out)?;
                    self.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
                }
                ServerEvent::Done(neg) => {
                    self.framer.set_phase(neg.transmission_phase());
                    return Ok(Some((*neg, out)));
                }
                ServerEvent::StartTls => {
                    self.start_tls(&out, deadline)?;
                    self.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
                }
                ServerEvent::Abort => {
                    self.send_bytes(&out)?;
                    // The ACK's memory must outlive its send: the NIC reads it later.
                    self.finish_handshake_sends(deadline);
                    self.qp.close();
                    return Ok(None);
                }
                _ => bail!("handshake: unexpected event"),
            }
        }
    }
}

/// A READ the store is still reading into registered memory.
struct StartedRead {
    req: Request,
    /// Dropped (which waits for the read) before the memory it fills.
    pending: Box<dyn Pending>,
    buffer: MemoryRegion,
}

/// A WRITE whose payload is still arriving in pieces.
struct PendingWrite {
    req: Request,
    received: u64,
    error: Option<ErrorValue>,
    /// Pieces the store is still writing (from receive slots held until they are done).
    pieces: Vec<Box<dyn Pending>>,
}

struct Transmission<'a> {
    conn: &'a mut Connection,
    export: Arc<Export>,
    info: TransmissionInfo,
    structured: bool,
    /// Extended headers: 32-byte requests, extended reply chunks only.
    extended: bool,
    allocation_ctx: Option<u32>,
    recv_mr: MemoryRegion,
    stride: usize,
    window: RecvWindow,
    reply_mr: MemoryRegion,
    free_replies: Vec<usize>,
    pending_write: Option<PendingWrite>,
    shutdown_since: Option<Instant>,
    /// Read data of images without a mapping (qcow2), by reply slot, until its send is done.
    read_bufs: HashMap<usize, MemoryRegion>,
    /// Writes fully received whose pieces the store is still writing: replied to by
    /// `finish_writes`.
    started_writes: Vec<PendingWrite>,
    /// Receive slots whose bytes a started write still reads: posted again by
    /// `finish_writes`.
    held_slots: Vec<usize>,
    /// Set by `on_message` when the message's slot must be held.
    hold_slot: bool,
    /// Reads the store is still doing: replied to by `finish_reads`.
    started_reads: Vec<StartedRead>,
}

impl Drop for Transmission<'_> {
    fn drop(&mut self) {
        // Started writes read from recv_mr: waited for (by dropping them) before it goes.
        self.pending_write = None;
        self.started_writes.clear();
        self.started_reads.clear();
        self.window.release(&self.conn.shared.slot_budget);
    }
}

impl<'a> Transmission<'a> {
    fn new(conn: &'a mut Connection, export: Arc<Export>, neg: &ServerNegotiated) -> Result<Self> {
        let stride = SLOT_LEN;
        let recv_mr = conn
            .shared
            .nic
            .alloc_region(RECV_SLOTS * stride, Access::READ_WRITE);
        let reply_mr = conn
            .shared
            .nic
            .alloc_region(REPLY_SLOTS * REPLY_SLOT_LEN, Access::READ);
        let (window, first) = RecvWindow::new(RECV_SLOTS);
        for slot in first {
            conn.qp.post_recv(RecvWr::new(
                slot as u64,
                &[recv_mr.sge(slot * stride, stride)],
            ))?;
        }
        let allocation_ctx = neg
            .meta_contexts
            .iter()
            .find(|(_, n)| n == "base:allocation")
            .map(|(id, _)| *id);
        Ok(Transmission {
            conn,
            export,
            info: neg.transmission_info(),
            structured: neg.structured_replies,
            extended: neg.extended_headers,
            allocation_ctx,
            recv_mr,
            stride,
            window,
            reply_mr,
            free_replies: (0..REPLY_SLOTS).rev().collect(),
            pending_write: None,
            shutdown_since: None,
            read_bufs: HashMap::new(),
            started_writes: Vec::new(),
            held_slots: Vec::new(),
            hold_slot: false,
            started_reads: Vec::new(),
        })
    }

    fn run(mut self) -> Result<()> {
        let mut buf = [Completion::default(); 32];
        let mut batch = Vec::with_capacity(buf.len());
        let mut last_request = Instant::now();
        loop {
            if let Some(limit) = self.conn.shared.idle_timeout
                && last_request.elapsed() >= limit
                && self.pending_write.is_none()
                && self.free_replies.len() == REPLY_SLOTS
            {
                tracing::info!(peer = %self.conn.peer, "closing: idle for {} s (--idle-timeout)", limit.as_secs_f64());
                self.conn.qp.close();
                return Ok(());
            }
            if self.shutdown_since.is_none() && self.conn.shared.shutting_down() {
                self.shutdown_since = Some(Instant::now());
            }
            if let Some(t) = self.shutdown_since
                && t.elapsed() > SHUTDOWN_GRACE
                && self.pending_write.is_none()
            {
                tracing::info!(peer = %self.conn.peer, "closing for shutdown");
                self.export.image.flush().ok();
                self.conn.qp.close();
                return Ok(());
            }
            batch.clear();
            if self.conn.stash.is_empty() {
                let n = self
                    .conn
                    .cq
                    .wait(&mut buf, Some(Duration::from_millis(200)))?;
                batch.extend_from_slice(&buf[..n]);
            } else {
                batch.extend(self.conn.stash.drain(..));
            }
            // The whole batch is handled before the NIC hears of it: its replies and the
            // receive slots posted again go out with one doorbell.
            let more = self.handle_batch(&batch, &mut last_request);
            self.conn.qp.ring_doorbell();
            if !more? {
                return Ok(());
            }
        }
    }

    /// Handles completions, posting replies and receive slots quietly. False: disconnect.
    fn handle_batch(&mut self, batch: &[Completion], last_request: &mut Instant) -> Result<bool> {
        let arrived = batch.iter().filter(|c| c.opcode != Opcode::Send).count();
        self.window.arrived(arrived, &self.conn.shared.slot_budget);
        for &c in batch {
            if c.opcode == Opcode::Send {
                self.on_send(&c)?;
                continue;
            }
            match c.status {
                // A WRITE whose payload the NIC could not write into the image: answered
                // with its errno (on_message); the connection goes on.
                WcStatus::Success | WcStatus::PlacementError => {}
                WcStatus::RemoteClosed | WcStatus::Flushed => {
                    if self.pending_write.is_some() {
                        tracing::warn!(peer = %self.conn.peer, "client vanished in the middle of a write");
                    }
                    return Ok(false);
                }
                s => bail!("request refused by the NIC ({s:?}): malformed or oversized"),
            }
            *last_request = Instant::now();
            let slot = c.wr_id as usize;
            self.hold_slot = false;
            if !self.on_message(slot, &c)? {
                return Ok(false);
            }
            if self.hold_slot {
                self.held_slots.push(slot);
            } else {
                let slot = self.window.reuse(slot);
                self.post_slot(slot)?;
            }
        }
        self.finish_writes()?;
        self.finish_reads()?;
        for slot in self.window.top_up() {
            self.post_slot(slot)?;
        }
        Ok(true)
    }

    /// Posts a receive slot quietly (the batch loop rings).
    fn post_slot(&self, slot: usize) -> Result<()> {
        self.conn.qp.post_recv_quiet(RecvWr::new(
            slot as u64,
            &[self.recv_mr.sge(slot * self.stride, self.stride)],
        ))?;
        Ok(())
    }

    fn on_send(&mut self, c: &Completion) -> Result<()> {
        if c.wr_id >= HANDSHAKE_WR {
            return self.conn.on_handshake_send(c);
        }
        if !c.is_ok() {
            bail!("sending a reply failed: {:?}", c.status);
        }
        let slot = (c.wr_id - REPLY_WR) as usize;
        self.read_bufs.remove(&slot);
        self.free_replies.push(slot);
        Ok(())
    }

    /// Starts writing `len` bytes of the receive slot memory at `at` to `offset`: done when it
    /// returns, or pushed onto `pw.pieces` with this message's slot held.
    fn write_piece(&mut self, pw: &mut PendingWrite, at: usize, len: usize, offset: u64) {
        let data = self.slot(at, len);
        // SAFETY: the slot is held (not posted again) until the piece is waited for, in
        // finish_writes, or dropped, which waits too (Drop clears them before recv_mr goes).
        match unsafe { self.export.image.start_write(data.as_ptr(), len, offset) } {
            Ok(None) => {}
            Ok(Some(piece)) => {
                pw.pieces.push(piece);
                self.hold_slot = true;
            }
            Err(e) => pw.error = Some(io_error_value(&e)),
        }
    }

    /// Waits for the started writes, posts their receive slots again and replies to them.
    fn finish_writes(&mut self) -> Result<()> {
        let wait = |pw: &mut PendingWrite| {
            for piece in pw.pieces.drain(..) {
                if let Err(e) = piece.wait() {
                    pw.error.get_or_insert(io_error_value(&e));
                }
            }
        };
        if let Some(pw) = &mut self.pending_write {
            wait(pw);
        }
        for mut pw in std::mem::take(&mut self.started_writes) {
            wait(&mut pw);
            let result = match pw.error {
                Some(e) => Err(e),
                None => self.after_write(&pw.req),
            };
            self.reply(&pw.req, result)?;
        }
        for slot in std::mem::take(&mut self.held_slots) {
            let slot = self.window.reuse(slot);
            self.post_slot(slot)?;
        }
        Ok(())
    }

    /// Waits for the started reads and sends their replies.
    fn finish_reads(&mut self) -> Result<()> {
        for r in std::mem::take(&mut self.started_reads) {
            let StartedRead {
                req,
                pending,
                buffer,
            } = r;
            let result = match pending.wait() {
                Ok(()) => self.post_read_reply(&req, Some(buffer)).map_err(|e| {
                    tracing::warn!("read reply: {e:#}");
                    ErrorValue::Io
                }),
                Err(e) => Err(io_error_value(&e)),
            };
            if let Err(e) = result {
                self.reply(&req, Err(e))?;
            }
        }
        Ok(())
    }

    /// Handles one message (a request, or a piece of a write payload), which arrived in
    /// receive slot `slot` (and, for a placed WRITE, in the image). False: disconnect.
    fn on_message(&mut self, slot: usize, c: &Completion) -> Result<bool> {
        let len = c.byte_len as usize;
        let base = slot * self.stride;
        if let Some(mut pw) = self.pending_write.take() {
            if pw.error.is_none() {
                let off = pw.req.offset + pw.received;
                self.write_piece(&mut pw, base, len, off);
            }
            pw.received += len as u64;
            self.pending_write = Some(pw);
            return self.on_message_done_write();
        }
        let mut hdr = [0u8; c::EXTENDED_REQUEST_LEN];
        let hdr = &mut hdr[..Request::header_len(self.extended)];
        if len < hdr.len() {
            bail!("short request ({len} bytes)");
        }
        self.recv_mr.read_at(base, hdr);
        let req = Request::parse(hdr, self.extended).context("request header")?;
        let hdr_len = hdr.len();
        let body_len = len - hdr_len;
        // Extended headers let any command carry a payload (refused once it has been read).
        let has_payload = req.command == Command::Write || req.payload_len(self.extended) > 0;
        let valid = validate_request(&req, &self.info);
        tracing::trace!(peer = %self.conn.peer, ?req, ?valid, "request");
        // Reads come after the writes before them are done and answered; every other
        // command (but a write) after the reads too.
        if req.command != Command::Write {
            self.finish_writes()?;
        }
        if !matches!(req.command, Command::Write | Command::Read) {
            self.finish_reads()?;
        }

        if req.command == Command::Disc {
            tracing::info!(peer = %self.conn.peer, "client disconnected");
            self.conn.qp.close();
            return Ok(false);
        }
        if self.shutdown_since.is_some()
            && !has_payload
            && !matches!(req.command, Command::Flush | Command::Write)
        {
            self.reply(&req, Err(ErrorValue::Shutdown))?;
            return Ok(true);
        }
        if has_payload {
            let mut pw = PendingWrite {
                req,
                received: 0,
                error: valid.err(),
                pieces: Vec::new(),
            };
            if pw.error.is_none() && body_len > 0 {
                self.write_piece(&mut pw, base + hdr_len, body_len, req.offset);
            }
            // The framer placed the whole payload in the image (the NIC wrote it there).
            if c.status == WcStatus::PlacementError {
                let e = io::Error::from_raw_os_error(c.os_error);
                tracing::debug!(peer = %self.conn.peer, ?req, "writing the payload into the image: {e}");
                pw.error.get_or_insert(io_error_value(&e));
            }
            pw.received = body_len as u64 + u64::from(c.placed);
            self.pending_write = Some(pw);
            // A payload that fit in one slot completes now.
            return self.on_message_done_write();
        }
        let result = valid.and_then(|()| self.execute(&req));
        match result {
            Ok(Some(())) => Ok(true), // the command sent its own reply
            Ok(None) => {
                self.reply(&req, Ok(()))?;
                Ok(true)
            }
            Err(e) => {
                self.reply(&req, Err(e))?;
                Ok(true)
            }
        }
    }

    fn on_message_done_write(&mut self) -> Result<bool> {
        let Some(pw) = self.pending_write.take() else {
            return Ok(true);
        };
        if pw.received < pw.req.payload_len(self.extended) {
            self.pending_write = Some(pw);
            return Ok(true);
        }
        if !pw.pieces.is_empty() {
            self.started_writes.push(pw);
            return Ok(true);
        }
        let result = match pw.error {
            Some(e) => Err(e),
            None => self.after_write(&pw.req),
        };
        self.reply(&pw.req, result)?;
        Ok(true)
    }

    /// FUA: the written range is durable before the reply.
    fn after_write(&self, req: &Request) -> Result<(), ErrorValue> {
        if req.flags.contains(CmdFlags::FUA) {
            self.export.image.flush().map_err(|e| io_error_value(&e))?;
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

    /// Runs a non-write command. `Ok(Some(()))` when it sent its own reply.
    fn execute(&mut self, req: &Request) -> Result<Option<()>, ErrorValue> {
        let image = &self.export.image;
        let io = |r: io::Result<()>| r.map_err(|e| io_error_value(&e));
        let fua = req.flags.contains(CmdFlags::FUA);
        match req.command {
            Command::Read => {
                if req.length == 0 {
                    return Ok(None);
                }
                self.send_read(req)?;
                Ok(Some(()))
            }
            Command::Flush => io(image.flush()).map(|()| None),
            Command::Trim => {
                io(image.trim(req.offset, req.length))?;
                if fua {
                    io(image.flush())?;
                }
                Ok(None)
            }
            Command::WriteZeroes => {
                let may_write = !req.flags.contains(CmdFlags::FAST_ZERO);
                let done = image
                    .write_zeroes(req.offset, req.length, may_write)
                    .map_err(|e| io_error_value(&e))?;
                if !done {
                    return Err(ErrorValue::NotSup);
                }
                if fua {
                    io(image.flush())?;
                }
                Ok(None)
            }
            Command::Cache => io(image.prefetch(req.offset, req.length)).map(|()| None),
            Command::BlockStatus => {
                self.send_block_status(req)?;
                Ok(Some(()))
            }
            _ => Err(ErrorValue::Inval),
        }
    }

    fn reply_slot(&mut self) -> Result<usize> {
        loop {
            if let Some(s) = self.free_replies.pop() {
                return Ok(s);
            }
            // All reply slots are in flight: the client is slow to read. Wait for sends
            // (the NIC must know of the replies posted quietly).
            self.conn.qp.ring_doorbell();
            let mut buf = [Completion::default(); 32];
            let n = self.conn.cq.wait(&mut buf, Some(Duration::from_secs(60)))?;
            if n == 0 {
                bail!("the client has not read a reply for 60 s");
            }
            for c in &buf[..n] {
                if c.opcode == Opcode::Send {
                    self.on_send(c)?;
                } else {
                    self.conn.stash.push_back(*c);
                }
            }
        }
    }

    /// Posts a reply whose header is `hdr`, followed by `data` (an SGE into registered memory).
    fn post_reply(&mut self, hdr: &[u8], data: Option<qpip_core::Sge>) -> Result<usize> {
        if hdr.len() > REPLY_SLOT_LEN {
            bail!("reply header of {} bytes does not fit a slot", hdr.len());
        }
        let slot = self.reply_slot()?;
        self.reply_mr.write_at(slot * REPLY_SLOT_LEN, hdr);
        let head = self.reply_mr.sge(slot * REPLY_SLOT_LEN, hdr.len());
        let wr = match data {
            Some(d) => SendWr::new(REPLY_WR + slot as u64, &[head, d]),
            None => SendWr::new(REPLY_WR + slot as u64, &[head]),
        };
        // Quietly: the batch loop rings once for all replies of a batch.
        self.conn.qp.post_send_quiet(wr)?;
        Ok(slot)
    }

    /// Whom the chunks of `req`'s reply answer (extended chunks echo its offset).
    fn to(&self, req: &Request) -> ReplyTo {
        ReplyTo::new(req, self.extended)
    }

    /// The reply to a request without data: success, or the error.
    fn reply(&mut self, req: &Request, result: Result<(), ErrorValue>) -> Result<()> {
        let mut out = Vec::with_capacity(64);
        match (result, self.structured) {
            (Ok(()), false) => out.extend_from_slice(
                &SimpleReply {
                    error: 0,
                    cookie: req.cookie,
                }
                .encode(),
            ),
            (Err(e), false) => out.extend_from_slice(
                &SimpleReply {
                    error: e.to_u32(),
                    cookie: req.cookie,
                }
                .encode(),
            ),
            (Ok(()), true) => out.extend_from_slice(&reply::none_chunk(self.to(req))),
            (Err(e), true) => {
                reply::error_chunk(self.to(req), true, e, &format!("{e:?}"), &mut out)
            }
        }
        self.post_reply(&out, None).map(drop)
    }

    /// READ: the reply header from a slot, the data straight from the image's mapping.
    fn send_read(&mut self, req: &Request) -> Result<(), ErrorValue> {
        let end = req.offset + req.length; // validated against the size
        if !self.export.image.still_holds(end).unwrap_or(false) {
            tracing::warn!(export = %self.export.name, "read at {} of {} bytes: {} is shorter than that now (truncated by another process?)", req.offset, req.length, self.export.image.location());
            return Err(ErrorValue::Io);
        }
        // No mapping (qcow2, RBD): the store reads into registered memory, which the reply's
        // send WR points at and which is kept until the send is done.
        let buffer = match self.export.region {
            Some(_) => None,
            None => {
                let len = req.length as usize;
                let mr = self.conn.shared.nic.alloc_region(len, Access::READ);
                // SAFETY: the region is new and not posted yet: nothing else uses its bytes,
                // and a read started into it is kept with it (StartedRead) until it is done.
                let started = unsafe {
                    let buf = mr.as_mut_slice()[..len].as_mut_ptr();
                    self.export.image.start_read(buf, len, req.offset)
                };
                match started {
                    Ok(None) => Some(mr),
                    Ok(Some(pending)) => {
                        self.started_reads.push(StartedRead {
                            req: *req,
                            pending,
                            buffer: mr,
                        });
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!(export = %self.export.name, "read at {} of {} bytes from {}: {e}", req.offset, req.length, self.export.image.location());
                        return Err(io_error_value(&e));
                    }
                }
            }
        };
        self.post_read_reply(req, buffer).map_err(|e| {
            tracing::warn!("read reply: {e:#}");
            ErrorValue::Io
        })
    }

    fn post_read_reply(&mut self, req: &Request, buffer: Option<MemoryRegion>) -> Result<()> {
        let data = match (&buffer, &self.export.region) {
            (Some(mr), _) => mr.sge(0, req.length as usize),
            (None, Some(region)) => region.sge(req.offset as usize, req.length as usize),
            (None, None) => bail!("empty image"),
        };
        let slot = if self.structured {
            // validated: at most the maximum block size, a u32
            let hdr = reply::offset_data_header(self.to(req), true, req.offset, req.length as u32)?;
            self.post_reply(&hdr, Some(data))?
        } else {
            let hdr = SimpleReply {
                error: 0,
                cookie: req.cookie,
            }
            .encode();
            self.post_reply(&hdr, Some(data))?
        };
        if let Some(mr) = buffer {
            self.read_bufs.insert(slot, mr);
        }
        Ok(())
    }

    fn send_block_status(&mut self, req: &Request) -> Result<(), ErrorValue> {
        let ctx = self.allocation_ctx.ok_or(ErrorValue::Inval)?;
        let extents = self
            .export
            .image
            .extents(req.offset, req.length)
            .map_err(|e| io_error_value(&e))?;
        let mut wire = Vec::new();
        for e in extents {
            let flags = if e.hole {
                c::STATE_HOLE | c::STATE_ZERO
            } else {
                0
            };
            let mut left = e.len;
            while left > 0 && wire.len() < MAX_EXTENTS {
                // Extents of at most 2 GiB, block aligned.
                let piece = left.min(1 << 31) as u32;
                wire.push(reply::Extent {
                    length: piece.into(),
                    flags,
                });
                left -= u64::from(piece);
            }
        }
        let mut out = Vec::new();
        reply::block_status_reply(
            self.to(req),
            req.flags,
            req.length,
            &[(ctx, &wire)],
            &mut out,
        )
        .map_err(|_| ErrorValue::Io)?;
        self.post_reply(&out, None).map(drop).map_err(|e| {
            tracing::warn!("block status reply: {e:#}");
            ErrorValue::Io
        })
    }
}
