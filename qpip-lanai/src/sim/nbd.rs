//! The storage experiment's programs on the simulated hosts: the Linux 2.4 NBD client
//! (`drivers/block/nbd.c`) and nbd-server 2.0, moved from sockets onto QPs, and the other
//! plausible ports beside the simplest one ([`NbdPort`]). Plain NBD on the wire (the old
//! protocol the 2.4 programs spoke: a 28-byte request, a 16-byte reply), one request stream
//! in one direction: what the block layer hands the client when a file is read or written
//! sequentially.
//!
//! The application state (which request is where) is kept apart from the verbs it drives:
//! [`Requests`] knows nothing of QPs.

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::meter::Nanos;
use qpip_verbs::backend::MgmtResult;
use qpip_verbs::framer::{Frame, Framer};
use qpip_verbs::mr::{Access, MemoryRegion};
use qpip_verbs::qp::{QpAttr, QueuePair};
use qpip_verbs::wr::{Completion, Opcode, RecvWr, SendWr, WcStatus};

use super::host::{App, Host};

/// The old NBD protocol's request header: magic, type, handle, offset, length.
pub const REQUEST_HEADER: usize = 28;
/// Its reply header: magic, error, handle.
pub const REPLY_HEADER: usize = 16;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const REPLY_MAGIC: u32 = 0x6744_6698;

/// Which way the data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NbdDir {
    /// The client reads: the server's replies carry the data.
    Read,
    /// The client writes: its requests carry the data.
    Write,
}

impl NbdDir {
    fn code(self) -> u32 {
        match self {
            NbdDir::Read => 0,
            NbdDir::Write => 1,
        }
    }
}

/// Where the client's reply receives are posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyRecv {
    /// One receive WR on one reply buffer, posted again once the reply has been handled: a
    /// READ's data is copied from it into the request's buffers (`nbd_read_stat` reads the
    /// header, then the data into the buffer heads; on QPs a message needs its receive
    /// posted before it arrives, and only the buffer of the reply that comes next would do).
    Bounce,
    /// A receive WR per request, posted with it: the reply's header lands in it and a READ's
    /// data straight in the request's own buffers (the framer names them), no copy.
    Direct,
}

/// How the two programs were ported to QPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NbdPort {
    /// Requests the client has sent and not had answered, at most: what the block layer
    /// hands it (the kernel client sends each request as it comes, `do_nbd_request`).
    pub depth: usize,
    /// The client waits for each request's send to complete before sending the next: the
    /// request header is a local of `nbd_send_req`, which holds the transmit lock while it
    /// sends, and a send WR's memory is the NIC's until the peer has acknowledged it.
    pub send_waits: bool,
    /// Where the client's reply receives are posted.
    pub reply_recv: ReplyRecv,
    /// Requests the server takes at once: 1 is nbd-server's loop on its one buffer (read a
    /// request, do it, send the reply, wait for the send, post the receive again).
    pub server_slots: usize,
    /// The server moves the data through its page cache (`read()`/`write()` on the image):
    /// one host copy per byte. Off: the image is registered memory the NIC reads and writes.
    pub server_copies: bool,
}

impl NbdPort {
    /// The simplest port of the 2.4 programs, for a sequential stream in `dir`: reads have
    /// one request outstanding (2.4's read-ahead window, `MAX_READAHEAD` 31 pages, is one
    /// request of `MAX_SECTORS`), writes 64 (2.4's request slots per queue, 128 with more
    /// than 32 MB of memory, half of them for writes, all filled by write-back).
    pub fn as_ported(dir: NbdDir) -> Self {
        NbdPort {
            depth: match dir {
                NbdDir::Read => 1,
                NbdDir::Write => 64,
            },
            send_waits: true,
            reply_recv: ReplyRecv::Bounce,
            server_slots: 1,
            server_copies: true,
        }
    }
}

/// One run of the storage experiment.
#[derive(Clone, Copy, Debug)]
pub struct NbdConfig {
    pub(crate) dir: NbdDir,
    pub(crate) total: u64,
    /// Bytes per request: 2.4's largest request of whole 4 KiB blocks (`MAX_SECTORS` 254).
    pub request_bytes: usize,
    pub(crate) port: NbdPort,
    pub(crate) tcp_port: u16,
}

impl NbdConfig {
    /// 2.4's largest request of whole ext2 blocks: 31 blocks of 4 KiB (254 sectors at most).
    pub const REQUEST_BYTES: usize = 31 * 4096;

    /// `total` bytes in `dir`, ported simply.
    pub fn as_ported(dir: NbdDir, total: u64) -> Self {
        NbdConfig {
            dir,
            total,
            request_bytes: Self::REQUEST_BYTES,
            port: NbdPort::as_ported(dir),
            tcp_port: 10809,
        }
    }

    /// The same run with the programs ported as `port` says.
    pub fn with_port(self, port: NbdPort) -> Self {
        NbdConfig { port, ..self }
    }

    fn requests(&self) -> usize {
        self.total.div_ceil(self.request_bytes.max(1) as u64) as usize
    }

    fn len_of(&self, k: usize) -> usize {
        let done = (k * self.request_bytes) as u64;
        (self.total - done).min(self.request_bytes as u64) as usize
    }
}

/// The client's requests: handed over, sent, answered. No verbs here.
#[derive(Debug, Default)]
pub struct Requests {
    /// Handed over and not yet answered, by handle: (length, buffer slot).
    in_flight: BTreeMap<u64, (usize, usize)>,
    /// Handed over and waiting for the transmit side, in order.
    to_send: VecDeque<u64>,
    free_slots: Vec<usize>,
    next: u64,
    answered: u64,
    sending: usize,
    max_in_flight: usize,
    max_sending: usize,
}

impl Requests {
    fn new(slots: usize) -> Self {
        Requests {
            free_slots: (0..slots).rev().collect(),
            ..Requests::default()
        }
    }

    /// The block layer hands over the next request if a slot is free; its handle.
    fn hand_over(&mut self, len: usize) -> Option<u64> {
        let slot = self.free_slots.pop()?;
        let h = self.next;
        self.next += 1;
        self.in_flight.insert(h, (len, slot));
        self.to_send.push_back(h);
        self.max_in_flight = self.max_in_flight.max(self.in_flight.len());
        Some(h)
    }

    fn sent(&mut self) {
        self.sending += 1;
        self.max_sending = self.max_sending.max(self.sending);
    }

    fn send_done(&mut self) {
        self.sending = self.sending.saturating_sub(1);
    }

    /// The reply to `h` has been handled; its length and slot.
    fn answer(&mut self, h: u64) -> Option<(usize, usize)> {
        let (len, slot) = self.in_flight.remove(&h)?;
        self.free_slots.push(slot);
        self.answered += 1;
        Some((len, slot))
    }
}

/// The client's reply framer: a 16-byte header, then a READ's data, whose length (and, for
/// [`ReplyRecv::Direct`], buffer) the client recorded under the request's handle.
struct ReplyFramer {
    reads: Arc<Mutex<BTreeMap<u64, ReadInto>>>,
}

#[derive(Clone, Copy)]
struct ReadInto {
    len: usize,
    into: Option<qpip_verbs::mr::Sge>,
}

impl Framer for ReplyFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let Some(h) = header.first_chunk::<REPLY_HEADER>() else {
            return Frame::NeedHeader(REPLY_HEADER);
        };
        if u32::from_be_bytes([h[0], h[1], h[2], h[3]]) != REPLY_MAGIC {
            return Frame::Invalid("not an NBD reply".into());
        }
        let handle = u64::from_be_bytes(h[8..16].try_into().unwrap_or_default());
        match self.reads.lock().remove(&handle) {
            Some(ReadInto {
                into: Some(sge), ..
            }) => Frame::MessageAt {
                header_len: REPLY_HEADER,
                strip: 0,
                body: sge,
            },
            Some(ReadInto { len, .. }) => Frame::Message {
                header_len: REPLY_HEADER,
                strip: 0,
                body_len: len,
            },
            None => Frame::Message {
                header_len: REPLY_HEADER,
                strip: 0,
                body_len: 0,
            },
        }
    }
}

/// The server's request framer: a 28-byte header, then a WRITE's data.
struct RequestFramer;

impl Framer for RequestFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let Some(h) = header.first_chunk::<REQUEST_HEADER>() else {
            return Frame::NeedHeader(REQUEST_HEADER);
        };
        let word = |i: usize| u32::from_be_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        if word(0) != REQUEST_MAGIC {
            return Frame::Invalid("not an NBD request".into());
        }
        let body_len = if word(4) == NbdDir::Write.code() {
            word(24) as usize
        } else {
            0
        };
        Frame::Message {
            header_len: REQUEST_HEADER,
            strip: 0,
            body_len,
        }
    }
}

fn request_header(dir: NbdDir, handle: u64, from: u64, len: usize) -> [u8; REQUEST_HEADER] {
    let mut b = [0u8; REQUEST_HEADER];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&dir.code().to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..24].copy_from_slice(&from.to_be_bytes());
    b[24..28].copy_from_slice(&(len as u32).to_be_bytes());
    b
}

/// When each request was handed over, sent and answered (client), or taken and answered
/// (server), in host time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    pub(crate) handle: u64,
    pub(crate) start: Nanos,
    pub(crate) end: Nanos,
}

/// The kernel NBD client: hands requests to the server as the block layer gives them.
pub struct NbdClient {
    cfg: NbdConfig,
    server: SocketAddr,
    qp: Option<QueuePair>,
    mr: Option<MemoryRegion>,
    reads: Arc<Mutex<BTreeMap<u64, ReadInto>>>,
    reqs: Requests,
    /// Per request: from its send being posted to its reply handled.
    stamps: BTreeMap<u64, Stamp>,
    connect_tag: Option<u64>,
    started_at: Option<Nanos>,
    finished_at: Option<Nanos>,
    error: Option<String>,
}

/// Client memory: `depth` data buffers, then `depth` request headers, then `depth` reply
/// headers (direct) or one reply buffer (bounce).
struct ClientLayout {
    data: usize,
    depth: usize,
}

impl ClientLayout {
    fn data(&self, slot: usize) -> usize {
        slot * self.data
    }
    fn header(&self, slot: usize) -> usize {
        self.depth * self.data + slot * REQUEST_HEADER
    }
    fn reply(&self, slot: usize) -> usize {
        self.depth * (self.data + REQUEST_HEADER) + slot * REPLY_HEADER
    }
    fn bounce(&self) -> usize {
        self.reply(0)
    }
    fn size(&self) -> usize {
        self.bounce() + (REPLY_HEADER + self.data).max(self.depth * REPLY_HEADER)
    }
}

/// wr_id of the bounce buffer's receive.
const BOUNCE: u64 = u64::MAX;

impl NbdClient {
    pub(crate) fn new(cfg: NbdConfig, server: SocketAddr) -> Self {
        NbdClient {
            reqs: Requests::new(cfg.port.depth.max(1)),
            cfg,
            server,
            qp: None,
            mr: None,
            reads: Arc::default(),
            stamps: BTreeMap::new(),
            connect_tag: None,
            started_at: None,
            finished_at: None,
            error: None,
        }
    }

    fn layout(&self) -> ClientLayout {
        ClientLayout {
            data: self.cfg.request_bytes,
            depth: self.cfg.port.depth.max(1),
        }
    }

    /// The most requests ever handed over and not answered.
    pub fn max_in_flight(&self) -> usize {
        self.reqs.max_in_flight
    }

    /// The most sends ever posted and not completed.
    pub fn max_sends_outstanding(&self) -> usize {
        self.reqs.max_sending
    }

    /// Per request, from its send posted to its reply handled, in handle order.
    pub fn stamps(&self) -> Vec<Stamp> {
        self.stamps.values().copied().collect()
    }

    /// Replies handled so far.
    #[cfg(test)]
    pub(crate) fn answered(&self) -> u64 {
        self.reqs.answered
    }

    /// When the first request was posted.
    #[cfg(test)]
    pub(crate) fn started_at(&self) -> Option<Nanos> {
        self.started_at
    }

    pub(crate) fn finished_at(&self) -> Option<Nanos> {
        self.finished_at
    }

    fn fail(&mut self, msg: String) {
        self.error.get_or_insert(msg);
    }

    /// The block layer hands over what the free slots allow, and the transmit side sends.
    fn issue(&mut self, host: &mut Host) {
        while (self.reqs.next as usize) < self.cfg.requests() {
            let len = self.cfg.len_of(self.reqs.next as usize);
            if self.reqs.hand_over(len).is_none() {
                break;
            }
        }
        self.pump(host);
    }

    fn pump(&mut self, host: &mut Host) {
        while !(self.cfg.port.send_waits && self.reqs.sending > 0) {
            let Some(h) = self.reqs.to_send.pop_front() else {
                return;
            };
            if let Err(e) = self.send(host, h) {
                return self.fail(e);
            }
        }
    }

    fn send(&mut self, host: &mut Host, h: u64) -> Result<(), String> {
        let lay = self.layout();
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return Err("not connected".into());
        };
        let (len, slot) = self.reqs.in_flight[&h];
        let dir = self.cfg.dir;
        let from = h * self.cfg.request_bytes as u64;
        mr.write_at(lay.header(slot), &request_header(dir, h, from, len));
        if dir == NbdDir::Read {
            let into = (self.cfg.port.reply_recv == ReplyRecv::Direct)
                .then(|| mr.sge(lay.data(slot), len));
            self.reads.lock().insert(h, ReadInto { len, into });
        }
        if self.cfg.port.reply_recv == ReplyRecv::Direct {
            let wr = RecvWr::new(h, &[mr.sge(lay.reply(slot), REPLY_HEADER)]);
            host.post_recv(qp, wr)
                .map_err(|e| format!("post_recv: {e}"))?;
        }
        let header = mr.sge(lay.header(slot), REQUEST_HEADER);
        let wr = match dir {
            NbdDir::Write => SendWr::new(h, &[header, mr.sge(lay.data(slot), len)]),
            NbdDir::Read => SendWr::new(h, &[header]),
        };
        host.post_send(qp, wr)
            .map_err(|e| format!("post_send: {e}"))?;
        self.reqs.sent();
        let now = host.now();
        self.stamps.insert(
            h,
            Stamp {
                handle: h,
                start: now,
                end: now,
            },
        );
        Ok(())
    }

    fn post_bounce(&mut self, host: &mut Host) {
        let lay = self.layout();
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let wr = RecvWr::new(BOUNCE, &[mr.sge(lay.bounce(), REPLY_HEADER + lay.data)]);
        if let Err(e) = host.post_recv(qp, wr) {
            self.fail(format!("post_recv: {e}"));
        }
    }

    fn on_reply_msg(&mut self, host: &mut Host, c: Completion) {
        let lay = self.layout();
        let Some(mr) = &self.mr else { return };
        let at = if c.wr_id == BOUNCE {
            lay.bounce()
        } else {
            let Some(&(_, slot)) = self.reqs.in_flight.get(&c.wr_id) else {
                return self.fail(format!("reply receive {} for no request", c.wr_id));
            };
            lay.reply(slot)
        };
        let mut hdr = [0u8; REPLY_HEADER];
        mr.read_at(at, &mut hdr);
        let h = u64::from_be_bytes(hdr[8..16].try_into().unwrap_or_default());
        if hdr[4..8] != [0; 4] {
            return self.fail(format!("request {h}: the server answered an error"));
        }
        let Some((len, _)) = self.reqs.answer(h) else {
            return self.fail(format!("reply to unknown request {h}"));
        };
        if c.wr_id == BOUNCE {
            // nbd_read_stat: the data into the request's buffers, then the next reply.
            if self.cfg.dir == NbdDir::Read {
                host.copy(len);
            }
            self.post_bounce(host);
        }
        if let Some(s) = self.stamps.get_mut(&h) {
            s.end = host.now();
        }
        if self.reqs.answered as usize == self.cfg.requests() {
            self.finished_at = Some(host.now());
        } else {
            self.issue(host);
        }
    }
}

impl App for NbdClient {
    fn start(&mut self, host: &mut Host) {
        let depth = self.cfg.port.depth.max(1);
        let cq = host.create_cq(4 * depth + 16);
        let framer = ReplyFramer {
            reads: self.reads.clone(),
        };
        let attr = QpAttr::new(&cq).depths(depth + 1, depth + 1).framer(framer);
        let size = self.layout().size();
        self.mr = Some(host.nic().alloc_region(size, Access::READ_WRITE));
        let qp = host.create_qp(attr);
        self.connect_tag = Some(host.connect(&qp, self.server));
        self.qp = Some(qp);
    }

    fn on_reply(&mut self, host: &mut Host, tag: u64, result: MgmtResult) {
        if let Err(e) = result {
            return self.fail(format!("management command failed: {e}"));
        }
        if self.connect_tag == Some(tag) && self.started_at.is_none() {
            host.mark();
            self.started_at = Some(host.now());
            if self.cfg.port.reply_recv == ReplyRecv::Bounce {
                self.post_bounce(host);
            }
            self.issue(host);
        }
    }

    fn on_completion(&mut self, host: &mut Host, c: Completion) {
        if c.status != WcStatus::Success {
            return self.fail(format!("{:?} completion {:?}", c.opcode, c.status));
        }
        match c.opcode {
            Opcode::Send => {
                self.reqs.send_done();
                self.pump(host);
            }
            Opcode::Recv => self.on_reply_msg(host, c),
        }
    }

    fn done(&self) -> bool {
        self.finished_at.is_some()
    }

    fn error(&self) -> Option<String> {
        self.error.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// nbd-server: takes requests into its slots, does each (through its page cache), answers.
pub struct NbdServer {
    cfg: NbdConfig,
    qp: Option<QueuePair>,
    mr: Option<MemoryRegion>,
    /// Per request: from its receive completion handled to its reply's send completed.
    stamps: Vec<Stamp>,
    /// Handle of the request each slot's reply answers.
    replying: BTreeMap<usize, u64>,
    /// When each slot's receive was last posted.
    posted_at: BTreeMap<usize, Nanos>,
    taken: u64,
    error: Option<String>,
}

impl NbdServer {
    pub(crate) fn new(cfg: NbdConfig) -> Self {
        NbdServer {
            cfg,
            qp: None,
            mr: None,
            stamps: Vec::new(),
            replying: BTreeMap::new(),
            posted_at: BTreeMap::new(),
            taken: 0,
            error: None,
        }
    }

    /// Per request, from its receive handled to its reply's send completed, in order taken.
    pub fn stamps(&self) -> &[Stamp] {
        &self.stamps
    }

    /// When each slot's receive was posted last.
    pub fn posted_at(&self, slot: usize) -> Option<Nanos> {
        self.posted_at.get(&slot).copied()
    }

    fn slot_bytes(&self) -> usize {
        REQUEST_HEADER.max(REPLY_HEADER) + self.cfg.request_bytes
    }

    fn fail(&mut self, msg: String) {
        self.error.get_or_insert(msg);
    }

    fn post_recv(&mut self, host: &mut Host, slot: usize) {
        let size = self.slot_bytes();
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let wr = RecvWr::new(slot as u64, &[mr.sge(slot * size, size)]);
        if let Err(e) = host.post_recv(qp, wr) {
            return self.fail(format!("post_recv: {e}"));
        }
        self.posted_at.insert(slot, host.now());
    }

    /// A request arrived in `slot`: do it and send the reply from the same buffer.
    fn serve(&mut self, host: &mut Host, slot: usize) {
        let base = slot * self.slot_bytes();
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let mut req = [0u8; REQUEST_HEADER];
        mr.read_at(base, &mut req);
        let word = |i: usize| u32::from_be_bytes([req[i], req[i + 1], req[i + 2], req[i + 3]]);
        let handle = u64::from_be_bytes(req[8..16].try_into().unwrap_or_default());
        let len = word(24) as usize;
        let read = word(4) == NbdDir::Read.code();
        let start = host.now();
        // write(): the data into the page cache; read(): from it, behind the reply header.
        if self.cfg.port.server_copies {
            host.copy(len);
        }
        let mut reply = [0u8; REPLY_HEADER];
        reply[0..4].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
        reply[8..16].copy_from_slice(&handle.to_be_bytes());
        mr.write_at(base, &reply);
        let n = REPLY_HEADER + if read { len } else { 0 };
        if let Err(e) = host.post_send(qp, SendWr::new(slot as u64, &[mr.sge(base, n)])) {
            return self.fail(format!("post_send: {e}"));
        }
        self.replying.insert(slot, handle);
        self.stamps.push(Stamp {
            handle,
            start,
            end: start,
        });
        self.taken += 1;
    }
}

impl App for NbdServer {
    fn start(&mut self, host: &mut Host) {
        let slots = self.cfg.port.server_slots.max(1);
        let cq = host.create_cq(4 * slots + 16);
        let attr = QpAttr::new(&cq)
            .depths(slots + 1, slots + 1)
            .framer(RequestFramer);
        let size = slots * self.slot_bytes();
        self.mr = Some(host.nic().alloc_region(size, Access::READ_WRITE));
        let qp = host.create_qp(attr);
        let (listener, _) = host.listen(self.cfg.tcp_port);
        host.accept(listener, &qp);
        self.qp = Some(qp);
        for slot in 0..slots {
            self.post_recv(host, slot);
        }
    }

    fn on_reply(&mut self, _host: &mut Host, _tag: u64, result: MgmtResult) {
        if let Err(e) = result {
            self.fail(format!("management command failed: {e}"));
        }
    }

    fn on_completion(&mut self, host: &mut Host, c: Completion) {
        if c.status != WcStatus::Success {
            return self.fail(format!("{:?} completion {:?}", c.opcode, c.status));
        }
        let slot = c.wr_id as usize;
        match c.opcode {
            Opcode::Recv => self.serve(host, slot),
            Opcode::Send => {
                // The reply has been acknowledged: its buffer takes the next request.
                let Some(h) = self.replying.remove(&slot) else {
                    return self.fail(format!("send completion for idle slot {slot}"));
                };
                if let Some(s) = self.stamps.iter_mut().rev().find(|s| s.handle == h) {
                    s.end = host.now();
                }
                if (self.taken as usize) < self.cfg.requests() {
                    self.post_recv(host, slot);
                }
            }
        }
    }

    fn done(&self) -> bool {
        self.taken as usize >= self.cfg.requests() && self.replying.is_empty()
    }

    fn error(&self) -> Option<String> {
        self.error.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
