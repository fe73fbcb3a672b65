//! The NBD client: requests pipelined over one QP connection, transparent reconnection.
//!
//! Every request occupies a *send slot* of registered memory holding its 28-byte header and,
//! for a WRITE, its payload, until the server has answered it. That is what makes reissue
//! possible: when the connection is lost, the client reconnects (exponential backoff, bounded
//! by [`ClientOptions::reconnect_timeout`]) and posts every unanswered slot again on the new
//! connection. A request is reported done only when the server answered it; when the
//! connection cannot be restored in time, every unanswered request fails with EIO.
//!
//! Copies per request (user space): WRITE 1 (caller buffer → send slot); READ 2 (receive slot
//! → the request's buffer → caller buffer). The NIC reads replies from the socket straight
//! into the receive slot (header and data in one receive WR) and sends requests straight from
//! the send slot. With the caller's buffer in registered memory ([`Op::WriteFrom`],
//! [`Client::write_at_mr`]) a WRITE costs no copy: its send WR has two SGEs, the header in the
//! send slot and the data where the caller has it, which must stay untouched until the
//! request is answered (a reissue after reconnection sends it again). A READ into registered
//! memory ([`Op::ReadInto`], [`Client::read_at_mr`]) costs no copy either: the framer tells
//! the NIC where each reply's data belong (by cookie, checked to lie inside the read,
//! [`nbd_proto::framing::client_data_at`]), so the NIC places them straight into the caller's
//! region and only the reply header into the receive slot. The caller's region belongs to
//! the NIC until the request is answered; when a connection is dropped with such reads in
//! flight, the client waits for the NIC's [`Nic::fence`] before it hands anything back.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use nbd_proto::consts as c;
use nbd_proto::flags::{CmdFlags, TransmissionFlags};
use nbd_proto::handshake::{
    BlockSize, ClientConfig, ClientError, ClientEvent, ClientHandshake, ExportDetails,
    ExportListing,
};
use nbd_proto::peer_text::printable;
use nbd_proto::reply::{SimpleReply, StructuredReplyHeader};
use nbd_proto::reply_check::{ReplyCheck, Step, Unanswered};
use nbd_proto::transmission::{Command, ErrorValue, Request};
use qpip_core::{Access, Completion, MemoryRegion, Nic, Opcode, SendWr, WcStatus};

use crate::conn::{Conn, MAX_IO, MAX_WINDOW, RECV_BIT, RECV_SLOT};
use crate::error::{Error, Result};
use crate::framer::PendingRead;
use crate::uri::NbdUri;

/// How a [`Client`] connects and recovers.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Give up reconnecting after this long (then unanswered requests fail with EIO).
    pub reconnect_timeout: Duration,
    /// Time allowed for one connect plus handshake.
    pub connect_timeout: Duration,
    /// With requests in flight and no reply for this long, the server is taken for hung: the
    /// connection is dropped and the requests reissued on a new one (as on connection loss).
    /// If replies stay away for `reconnect_timeout` more, they fail with EIO. `None` waits
    /// forever.
    pub request_timeout: Option<Duration>,
    /// Requests in flight at most (1..=64).
    pub window: usize,
    /// Ask for structured replies.
    pub structured_replies: bool,
    /// Ask for extended headers (with structured replies; used if the server has them).
    pub extended_headers: bool,
    /// Ask for the `base:allocation` metadata context (block status).
    pub base_allocation: bool,
    /// The NIC to use (a new soft NIC if `None`); clients may share one.
    pub nic: Option<Nic>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            reconnect_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            request_timeout: Some(Duration::from_secs(60)),
            window: 32,
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            nic: None,
        }
    }
}

/// What the client knows about the export: what the handshake reported.
pub type ExportInfo = ExportDetails;

/// One extent of `base:allocation` block status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub length: u64,
    /// Not allocated (NBD_STATE_HOLE).
    pub hole: bool,
    /// Reads as zeroes (NBD_STATE_ZERO).
    pub zero: bool,
}

/// A request of the pipelined API. READ and WRITE are at most [`Client::max_io`] bytes.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        data: &'a [u8],
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        fua: bool,
    },
    BlockStatus {
        offset: u64,
        len: u32,
    },
    /// A READ whose data goes to registered memory: `mr` from `at` (its reply is
    /// [`Output::Done`]).
    ReadInto {
        offset: u64,
        len: u32,
        mr: &'a MemoryRegion,
        at: usize,
    },
    /// A WRITE sent from registered memory without a copy: `len` bytes of `mr` from `at`,
    /// which must stay unchanged until the request is answered.
    WriteFrom {
        offset: u64,
        len: u32,
        mr: &'a MemoryRegion,
        at: usize,
        fua: bool,
    },
}

/// The result of a successful request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Done,
    Data(Vec<u8>),
    Extents(Vec<Extent>),
}

/// A finished request of the pipelined API.
#[derive(Debug)]
pub struct Reply {
    pub tag: u64,
    pub result: Result<Output>,
}

/// Why a client gave up on its server.
#[derive(Clone, Debug)]
enum Failure {
    /// The connection was lost and could not be restored in time.
    Lost(String),
    /// The server broke the protocol.
    Violation(String),
}

/// The largest export the client accepts: offsets are `off_t` (signed 64-bit) in every file
/// and block device API.
const MAX_EXPORT_SIZE: u64 = i64::MAX as u64;

/// Tags of requests the blocking calls issue for themselves.
const INTERNAL: u64 = 1 << 63;

struct Inflight {
    tag: u64,
    req: Request,
    slot: usize,
    data: Vec<u8>,
    /// READ data goes here instead of `data`; WRITE data is sent from here instead of the
    /// send slot.
    region: Option<(MemoryRegion, usize)>,
    /// The reply so far, checked against the request (nbd-proto's sans-IO rules).
    check: ReplyCheck,
    extents: Vec<Extent>,
    /// The server's first error, with its message.
    error: Option<Error>,
}

impl Inflight {
    /// Carries out what the reply check accepted; `payload` is the message after its header.
    fn apply(&mut self, step: Step, payload: &[u8]) {
        match step {
            Step::Data { src, dst } => match &self.region {
                Some((mr, at)) => mr.write_at(at + dst.start, &payload[src]),
                None => self.data[dst].copy_from_slice(&payload[src]),
            },
            Step::Zero { dst } => match &self.region {
                Some((mr, at)) => mr.write_at(at + dst.start, &vec![0; dst.len()]),
                None => self.data[dst].fill(0),
            },
            Step::Extents(extents) => self.extents.extend(extents.iter().map(|e| Extent {
                offset: e.offset,
                length: e.length,
                hole: e.flags & c::STATE_HOLE != 0,
                zero: e.flags & c::STATE_ZERO != 0,
            })),
            Step::Error { error, message } => {
                self.error.get_or_insert(Error::Server {
                    error,
                    message: printable(message),
                });
            }
            _ => {}
        }
    }

    fn reset(&mut self) {
        if self.req.command == Command::Read {
            self.data.iter_mut().for_each(|b| *b = 0);
        }
        self.check.restart();
        self.extents.clear();
        self.error = None;
    }
}

/// An NBD client on one QP connection.
pub struct Client {
    uri: NbdUri,
    opts: ClientOptions,
    nic: Nic,
    conn: Option<Conn>,
    info: ExportInfo,
    structured: bool,
    /// Extended headers negotiated on the current connection.
    extended: bool,
    allocation_ctx: Option<u32>,
    send_mr: MemoryRegion,
    slot_len: usize,
    free_slots: Vec<usize>,
    inflight: HashMap<u64, Inflight>,
    next_cookie: u64,
    done: VecDeque<Reply>,
    /// Why the client gave up for good, if it has.
    failed: Option<Failure>,
    max_io: u32,
    reconnects: u64,
    /// When a reply last arrived (or the first request after an idle spell was issued).
    last_progress: Instant,
    /// When the server first let a request time out, if it has not replied since.
    stalled_since: Option<Instant>,
    /// The connection trouble that no reply has ended yet, if any.
    outage: Option<Outage>,
    /// READ data the NIC placed straight into callers' regions.
    bytes_placed: u64,
    /// A request was refused with ESHUTDOWN: reconnect once the batch is handled.
    shutting_down: bool,
}

/// Connection losses since the server last answered. It outlives a successful reconnect, so
/// a server that accepts connections and then breaks each one cannot restart the clock.
#[derive(Clone, Copy, Debug)]
struct Outage {
    since: Instant,
    /// Wait before the next connection attempt (0 for the first).
    backoff: Duration,
}

impl Outage {
    const FIRST: Duration = Duration::from_millis(50);
    const MAX: Duration = Duration::from_secs(2);

    /// The wait before the next attempt, with jitter (half to all of the back-off, so many
    /// clients of one server do not reconnect in step), and doubles the back-off.
    fn next_wait(&mut self) -> Duration {
        use std::hash::{BuildHasher, Hasher};
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).clamp(Self::FIRST, Self::MAX);
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        wait.mul_f64(0.5 + (random % 1024) as f64 / 2048.0)
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("uri", &self.uri.to_string())
            .field("info", &self.info)
            .field("in_flight", &self.inflight.len())
            .finish()
    }
}

/// Copies `n` bytes between registered regions.
///
/// # Panics
/// If either range is outside its region (the callers check the ranges first).
/// `len` bytes at `offset` of a receive region, read in place.
///
/// # Safety
/// The bytes must belong to a receive WR that has completed and is not posted again while
/// the slice lives, so that the NIC does not write them meanwhile.
unsafe fn completed_bytes(region: &MemoryRegion, offset: usize, len: usize) -> &[u8] {
    assert!(
        offset.checked_add(len).is_some_and(|e| e <= region.len()),
        "receive bytes out of bounds"
    );
    // SAFETY: in bounds (checked above); the caller guarantees nothing writes them.
    unsafe { std::slice::from_raw_parts(region.as_ptr().add(offset), len) }
}

fn round_down(v: u64, to: u64) -> u64 {
    v - v % to.max(1)
}

impl Client {
    /// Connects to an NBD URI with the default options.
    pub fn connect(uri: &str) -> Result<Client> {
        Self::connect_with(uri, ClientOptions::default())
    }

    /// Connects with `opts`: OPT_GO with block sizes, structured replies and
    /// `base:allocation` when the server has them, falling back to simple replies and
    /// NBD_OPT_EXPORT_NAME when it does not.
    pub fn connect_with(uri: &str, mut opts: ClientOptions) -> Result<Client> {
        let uri = NbdUri::parse(uri)?;
        opts.window = opts.window.clamp(1, MAX_WINDOW);
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let (conn, ev) = Conn::open(
            &nic,
            &uri,
            ClientHandshake::connect(Self::config(&uri, &opts)),
            opts.connect_timeout,
        )?;
        let ClientEvent::Connected(neg) = ev else {
            return Err(Error::Protocol {
                uri: uri.to_string(),
                why: "handshake ended without entering transmission".into(),
            });
        };
        let info = neg.export.clone();
        if info.size > MAX_EXPORT_SIZE {
            // Files, block devices and every offset we hand to the kernel are signed 64-bit:
            // such an export cannot be used, whatever it holds (qemu refuses it too).
            return Err(Error::Protocol {
                uri: uri.to_string(),
                why: format!(
                    "it reports an export of {} bytes, more than the 2^63 - 1 any file or block device can address",
                    info.size
                ),
            });
        }
        let bs = info.block_size;
        let max = u64::from(bs.max).min(MAX_IO as u64);
        let max_io = round_down(max, u64::from(bs.min)).max(u64::from(bs.min)) as u32;
        let slot_len = c::EXTENDED_REQUEST_LEN + max_io as usize;
        let send_mr = nic.alloc_region(opts.window * slot_len, Access::READ);
        tracing::debug!(%uri, ?info, structured = neg.structured_replies, extended = neg.extended_headers, "connected");
        Ok(Client {
            free_slots: (0..opts.window).rev().collect(),
            uri,
            nic,
            conn: Some(conn),
            info,
            structured: neg.structured_replies,
            extended: neg.extended_headers,
            allocation_ctx: neg.base_allocation,
            send_mr,
            slot_len,
            inflight: HashMap::new(),
            next_cookie: 1,
            done: VecDeque::new(),
            failed: None,
            max_io,
            reconnects: 0,
            last_progress: Instant::now(),
            stalled_since: None,
            outage: None,
            bytes_placed: 0,
            shutting_down: false,
            opts,
        })
    }

    fn config(uri: &NbdUri, opts: &ClientOptions) -> ClientConfig {
        let mut cfg = ClientConfig::new(uri.export.clone());
        cfg.structured_replies = opts.structured_replies;
        cfg.tls = uri.tls.is_some();
        cfg.extended_headers = opts.extended_headers && opts.structured_replies;
        cfg.base_allocation = opts.base_allocation && opts.structured_replies;
        cfg
    }

    /// The export's details without entering transmission (NBD_OPT_INFO); falls back to a
    /// full connect for servers without it.
    pub fn info(uri: &str) -> Result<ExportInfo> {
        Self::info_with(uri, &ClientOptions::default())
    }

    /// [`Self::info`] with `opts` (its NIC and connect timeout).
    pub fn info_with(uri: &str, opts: &ClientOptions) -> Result<ExportInfo> {
        let parsed = NbdUri::parse(uri)?;
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let hs = ClientHandshake::info(Self::config(&parsed, opts));
        match Conn::open(&nic, &parsed, hs, opts.connect_timeout) {
            Ok((_, ClientEvent::Info(d))) => Ok(*d),
            Ok(_) => Err(Error::Protocol {
                uri: parsed.to_string(),
                why: "unexpected answer to NBD_OPT_INFO".into(),
            }),
            Err(Error::Handshake {
                source: ClientError::NoFixedNewstyle,
                ..
            }) => Self::info_by_connect(uri, nic),
            Err(Error::Handshake {
                source: ClientError::Rejected { reply, .. },
                ..
            }) if reply == c::REP_ERR_UNSUP => Self::info_by_connect(uri, nic),
            Err(e) => Err(e),
        }
    }

    fn info_by_connect(uri: &str, nic: Nic) -> Result<ExportInfo> {
        let client = Self::connect_with(
            uri,
            ClientOptions {
                nic: Some(nic),
                window: 1,
                ..Default::default()
            },
        )?;
        let info = client.export_info().clone();
        client.disconnect()?;
        Ok(info)
    }

    /// When `err` is the server refusing the export `uri` names, and its export list (if
    /// it gives one) lacks that name: one line naming the export and the exports it has.
    pub fn explain_unknown_export(uri: &str, err: &Error, opts: &ClientOptions) -> Option<String> {
        let Error::Handshake {
            source: ClientError::Rejected { .. },
            ..
        } = err
        else {
            return None;
        };
        let parsed = NbdUri::parse(uri).ok()?;
        let mut base = parsed.clone();
        base.export.clear();
        let list = Self::list_with(&base.to_string(), opts).ok()?;
        if list.iter().any(|x| x.name == parsed.export) {
            return None;
        }
        let names: Vec<String> = list.iter().map(|x| format!("{:?}", x.name)).collect();
        Some(format!(
            "{parsed}: the server has no export named {:?}; its exports: {}",
            parsed.export,
            if names.is_empty() {
                "(none listed)".to_string()
            } else {
                names.join(", ")
            }
        ))
    }

    /// The server's exports (NBD_OPT_LIST).
    pub fn list(uri: &str) -> Result<Vec<ExportListing>> {
        Self::list_with(uri, &ClientOptions::default())
    }

    /// [`Self::list`] with `opts` (its NIC and connect timeout).
    pub fn list_with(uri: &str, opts: &ClientOptions) -> Result<Vec<ExportListing>> {
        let parsed = NbdUri::parse(uri)?;
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let hs = ClientHandshake::list_with(Self::config(&parsed, opts));
        match Conn::open(&nic, &parsed, hs, opts.connect_timeout)? {
            (_, ClientEvent::Listed(v)) => Ok(v),
            _ => Err(Error::Protocol {
                uri: parsed.to_string(),
                why: "unexpected answer to NBD_OPT_LIST".into(),
            }),
        }
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }
    pub fn size(&self) -> u64 {
        self.info.size
    }
    pub fn flags(&self) -> TransmissionFlags {
        self.info.flags
    }
    pub fn export_info(&self) -> &ExportInfo {
        &self.info
    }
    pub fn block_size(&self) -> BlockSize {
        self.info.block_size
    }
    /// Largest READ/WRITE of the pipelined API (the server's maximum, capped at 1 MiB).
    pub fn max_io(&self) -> u32 {
        self.max_io
    }
    /// Requests in flight at most.
    pub fn window(&self) -> usize {
        self.opts.window
    }
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }
    /// How many times the connection was restored.
    /// Lowers how long a lost connection is retried (never raises it): for a last flush on
    /// the way out, which should not hold a process for the whole reconnect timeout when
    /// the server is gone.
    pub fn limit_reconnect_timeout(&mut self, limit: Duration) {
        self.opts.reconnect_timeout = self.opts.reconnect_timeout.min(limit);
    }

    /// The NIC the client's connections run on (to register memory for
    /// [`Op::ReadInto`] and [`Op::WriteFrom`]).
    pub fn nic(&self) -> &Nic {
        &self.nic
    }

    /// Bytes of READ data the NIC placed straight into callers' registered regions
    /// ([`Op::ReadInto`], [`Self::read_at_mr`]) without a copy.
    pub fn bytes_placed(&self) -> u64 {
        self.bytes_placed
    }

    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }
    pub fn structured_replies(&self) -> bool {
        self.structured
    }
    /// Extended headers are in use (32-byte requests, extended reply chunks).
    pub fn extended_headers(&self) -> bool {
        self.extended
    }
    fn has(&self, f: TransmissionFlags) -> bool {
        self.info.flags.contains(f)
    }
    pub fn is_read_only(&self) -> bool {
        self.has(TransmissionFlags::READ_ONLY)
    }
    pub fn can_flush(&self) -> bool {
        self.has(TransmissionFlags::SEND_FLUSH)
    }
    pub fn can_fua(&self) -> bool {
        self.has(TransmissionFlags::SEND_FUA)
    }
    pub fn can_trim(&self) -> bool {
        self.has(TransmissionFlags::SEND_TRIM)
    }
    pub fn can_write_zeroes(&self) -> bool {
        self.has(TransmissionFlags::SEND_WRITE_ZEROES)
    }
    pub fn can_multi_conn(&self) -> bool {
        self.has(TransmissionFlags::CAN_MULTI_CONN)
    }
    pub fn can_block_status(&self) -> bool {
        self.allocation_ctx.is_some()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let min = self.info.block_size.min;
        if !offset.is_multiple_of(u64::from(min)) || !len.is_multiple_of(u64::from(min)) {
            return Err(Error::Unaligned { offset, len, min });
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.info.size)
        {
            return Err(Error::OutOfRange {
                offset,
                len,
                size: self.info.size,
            });
        }
        Ok(())
    }

    fn check_op(&self, op: &Op) -> Result<Request> {
        let mut flags = CmdFlags::empty();
        let (command, offset, len) = match *op {
            Op::Read { offset, len } => (Command::Read, offset, len),
            Op::Write { offset, data, fua } => {
                flags.set(CmdFlags::FUA, fua && self.can_fua());
                let len =
                    u32::try_from(data.len()).map_err(|_| Error::Invalid("write too long"))?;
                (Command::Write, offset, len)
            }
            Op::Flush => (Command::Flush, 0, 0),
            Op::Trim { offset, len } => (Command::Trim, offset, len),
            Op::WriteZeroes { offset, len, fua } => {
                flags.set(CmdFlags::FUA, fua && self.can_fua());
                (Command::WriteZeroes, offset, len)
            }
            Op::BlockStatus { offset, len } => (Command::BlockStatus, offset, len),
            Op::ReadInto {
                offset,
                len,
                mr,
                at,
            } => {
                if at.checked_add(len as usize).is_none_or(|e| e > mr.len()) {
                    return Err(Error::Invalid("read buffer outside its region"));
                }
                (Command::Read, offset, len)
            }
            Op::WriteFrom {
                offset,
                len,
                mr,
                at,
                fua,
            } => {
                if at.checked_add(len as usize).is_none_or(|e| e > mr.len()) {
                    return Err(Error::Invalid("write data outside its region"));
                }
                flags.set(CmdFlags::FUA, fua && self.can_fua());
                (Command::Write, offset, len)
            }
        };
        if command.is_write() && self.is_read_only() {
            return Err(Error::Server {
                error: ErrorValue::Perm,
                message: "the export is read-only".into(),
            });
        }
        match command {
            Command::Read | Command::Write if len > self.max_io => {
                return Err(Error::Invalid("request longer than max_io()"));
            }
            Command::Flush if !self.can_flush() => return Err(Error::Unsupported("FLUSH")),
            Command::Trim if !self.can_trim() => return Err(Error::Unsupported("TRIM")),
            Command::WriteZeroes if !self.can_write_zeroes() => {
                return Err(Error::Unsupported("WRITE_ZEROES"));
            }
            Command::BlockStatus if !self.can_block_status() => {
                return Err(Error::Unsupported("block status (base:allocation)"));
            }
            Command::BlockStatus if len == 0 => {
                return Err(Error::Invalid("zero-length block status"));
            }
            _ => {}
        }
        if command != Command::Flush {
            self.check_range(offset, u64::from(len))?;
        }
        Ok(Request {
            flags,
            command,
            cookie: 0,
            offset,
            length: len.into(),
        })
    }

    /// Submits a request; blocks (processing replies) while the window is full. Its reply
    /// comes out of [`Self::reap`] with `tag` (tags must be below 2^63).
    pub fn submit(&mut self, tag: u64, op: Op) -> Result<()> {
        if let Some(f) = &self.failed {
            return Err(self.failure_error(f));
        }
        let mut req = self.check_op(&op)?;
        while self.free_slots.is_empty() {
            self.pump(true)?;
        }
        if self.inflight.is_empty() {
            self.last_progress = Instant::now();
        }
        let Some(slot) = self.free_slots.pop() else {
            return Err(Error::Invalid("no free slot"));
        };
        req.cookie = self.next_cookie;
        self.next_cookie += 1;
        // The header is written by `post`, right before the payload (its length depends on
        // the connection's header style, which a reconnect may change).
        if let Op::Write { data, .. } = op {
            self.send_mr
                .write_at(slot * self.slot_len + c::EXTENDED_REQUEST_LEN, data);
        }
        let region = match op {
            Op::ReadInto { mr, at, .. } | Op::WriteFrom { mr, at, .. } => Some((mr.clone(), at)),
            _ => None,
        };
        let data = if req.command == Command::Read && region.is_none() {
            vec![0; req.length as usize]
        } else {
            Vec::new()
        };
        self.inflight.insert(
            req.cookie,
            Inflight {
                tag,
                req,
                slot,
                data,
                region,
                check: ReplyCheck::new(&req),
                extents: Vec::new(),
                error: None,
            },
        );
        if let Err(e) = self.post(req.cookie) {
            self.recover(format!("posting a request failed: {e}"));
        }
        Ok(())
    }

    fn post(&self, cookie: u64) -> Result<()> {
        let (Some(conn), Some(inf)) = (&self.conn, self.inflight.get(&cookie)) else {
            return Err(Error::Invalid("no connection"));
        };
        let mut req = inf.req;
        req.flags.set(
            CmdFlags::PAYLOAD_LEN,
            self.extended && req.command == Command::Write,
        );
        let header = req
            .encode(self.extended)
            .map_err(|_| Error::Invalid("request too long for compact headers"))?;
        // The header ends where the payload starts.
        let start = inf.slot * self.slot_len + c::EXTENDED_REQUEST_LEN - header.len();
        self.send_mr.write_at(start, &header);
        if inf.req.command == Command::Read && (!self.structured || inf.region.is_some()) {
            let read = PendingRead {
                offset: inf.req.offset,
                // reads are at most max_io bytes
                length: inf.req.length as u32,
                simple: !self.structured,
                into: inf
                    .region
                    .as_ref()
                    .filter(|_| inf.req.length > 0)
                    .map(|(mr, at)| mr.sge(*at, inf.req.length as usize)),
            };
            conn.reads.lock().insert(cookie, read);
        }
        let payload = req.payload_len(self.extended) as usize;
        let wr = match &inf.region {
            Some((mr, at)) if inf.req.command == Command::Write => SendWr::new(
                cookie,
                &[self.send_mr.sge(start, header.len()), mr.sge(*at, payload)],
            ),
            _ => SendWr::new(cookie, &[self.send_mr.sge(start, header.len() + payload)]),
        };
        conn.qp.post_send(wr)?;
        Ok(())
    }

    /// Waits for the next finished request of the pipelined API.
    pub fn reap(&mut self) -> Result<Reply> {
        loop {
            if let Some(i) = self.done.iter().position(|r| r.tag & INTERNAL == 0) {
                return Ok(self.done.remove(i).expect("position is in range"));
            }
            if !self.inflight.values().any(|f| f.tag & INTERNAL == 0) {
                return Err(Error::Invalid("reap with nothing in flight"));
            }
            self.pump(true)?;
        }
    }

    /// Finished requests of the pipelined API, without waiting.
    pub fn try_reap(&mut self) -> Result<Option<Reply>> {
        self.pump(false)?;
        Ok(self
            .done
            .iter()
            .position(|r| r.tag & INTERNAL == 0)
            .and_then(|i| self.done.remove(i)))
    }

    fn lost(&self, why: String) -> Error {
        Error::ConnectionLost {
            uri: self.uri.to_string(),
            after: self.opts.reconnect_timeout,
            why,
        }
    }

    fn failure_error(&self, f: &Failure) -> Error {
        match f {
            Failure::Lost(why) => self.lost(why.clone()),
            Failure::Violation(why) => Error::Protocol {
                uri: self.uri.to_string(),
                why: why.clone(),
            },
        }
    }

    /// Processes completions: one wait (up to 1 s) if `block`, else what is there.
    fn pump(&mut self, block: bool) -> Result<()> {
        if let Some(f) = &self.failed
            && self.inflight.is_empty()
        {
            return Err(self.failure_error(f));
        }
        let Some(conn) = &self.conn else {
            self.recover("no connection".into());
            return Ok(());
        };
        let mut buf = [Completion::default(); 32];
        let n = if block {
            conn.cq.wait(&mut buf, Some(Duration::from_secs(1)))?
        } else {
            conn.cq.poll(&mut buf)?
        };
        if n == 0 {
            self.check_stall();
            return Ok(());
        }
        if buf[..n]
            .iter()
            .any(|c| c.opcode == Opcode::Recv && c.is_ok())
        {
            self.last_progress = Instant::now();
            self.stalled_since = None;
        }
        let mut fault = None;
        for comp in &buf[..n] {
            if fault.is_some() {
                break;
            }
            if comp.opcode == Opcode::Send {
                if !comp.is_ok() {
                    fault = Some(Failure::Lost(format!(
                        "a request could not be sent ({:?})",
                        comp.status
                    )));
                }
                continue;
            }
            if comp.status != WcStatus::Success {
                fault = Some(match comp.status {
                    WcStatus::RemoteClosed => {
                        Failure::Lost("the server closed the connection".into())
                    }
                    WcStatus::FramingError => Failure::Violation(
                        "it sent a reply the client cannot frame (bad magic or an oversize chunk)"
                            .into(),
                    ),
                    WcStatus::LengthError => {
                        Failure::Violation("it sent a reply longer than any request allows".into())
                    }
                    s => Failure::Lost(format!(
                        "receive failed ({s:?}, os error {})",
                        comp.os_error
                    )),
                });
                continue;
            }
            let slot = (comp.wr_id & !RECV_BIT) as usize;
            if let Err(why) = self.on_reply(slot, comp.byte_len as usize, comp.placed as usize) {
                fault = Some(Failure::Violation(why));
                continue;
            }
            if let Some(conn) = &self.conn
                && let Err(e) = conn.repost(slot)
            {
                fault = Some(Failure::Lost(format!("reposting a receive failed: {e}")));
            }
        }
        match fault {
            Some(Failure::Lost(why)) => self.recover(why),
            Some(Failure::Violation(why)) => self.give_up(why),
            None if std::mem::take(&mut self.shutting_down) => {
                self.recover("the server is shutting down (ESHUTDOWN)".into())
            }
            None => {}
        }
        Ok(())
    }

    /// The server broke the protocol: that is no network fault, and a new connection to the
    /// same server would most likely break the same way. Drop the connection and fail every
    /// request in flight, and every later one, with the violation.
    fn give_up(&mut self, why: String) {
        tracing::error!(uri = %self.uri, "giving up on the server: it broke the protocol: {why}");
        self.drop_conn();
        self.fail_all(Failure::Violation(why));
    }

    /// Handles one reply message in receive slot `slot`. Err: the server broke the
    /// protocol. nbd-proto's [`ReplyCheck`] decides whether the message may answer its
    /// request and where its bytes go, checking every number the server sent first: nothing
    /// it sends can make the client panic or write outside the request's buffer.
    /// `placed` bytes of READ data went straight to the request's region (the framer said
    /// where); `len` bytes, the rest of the message, are in the slot.
    fn on_reply(&mut self, slot: usize, len: usize, placed: usize) -> Result<(), String> {
        let conn = self.conn.as_ref().ok_or("no connection")?;
        // SAFETY: the slot's receive WR has completed; it is posted again only after this
        // function returns (`pump`), so the NIC does not write these bytes meanwhile.
        let msg = unsafe { completed_bytes(&conn.recv_mr, slot * RECV_SLOT, len) };
        let magic = msg.first_chunk::<4>().map(|m| u32::from_be_bytes(*m));
        if placed > 0 {
            // Only the header is in the slot (at most a chunk header and its offset).
            let mut hdr = [0u8; c::EXTENDED_REPLY_HEADER_LEN + 8];
            let n = msg.len().min(hdr.len());
            hdr[..n].copy_from_slice(&msg[..n]);
            return self.on_placed_reply(&hdr[..n], placed);
        }
        let chunk_magic = if self.extended {
            c::EXTENDED_REPLY_MAGIC
        } else {
            c::STRUCTURED_REPLY_MAGIC
        };
        let (cookie, accepted, payload) = if !self.extended && magic == Some(c::SIMPLE_REPLY_MAGIC)
        {
            let r = SimpleReply::parse(msg).map_err(|e| e.to_string())?;
            let payload = &msg[c::SIMPLE_REPLY_LEN..];
            let inf = self
                .inflight
                .get_mut(&r.cookie)
                .ok_or_else(|| format!("a reply for unknown cookie {}", r.cookie))?;
            let accepted = inf
                .check
                .simple(&r, payload.len())
                .map_err(|e| e.to_string())?;
            (r.cookie, accepted, payload)
        } else if self.structured && magic == Some(chunk_magic) {
            let h =
                StructuredReplyHeader::parse_as(msg, self.extended).map_err(|e| e.to_string())?;
            let payload = &msg[h.header_len()..];
            if payload.len() != h.length as usize {
                return Err(format!(
                    "a chunk that says it has {} bytes of payload has {}",
                    h.length,
                    payload.len()
                ));
            }
            let inf = self
                .inflight
                .get_mut(&h.cookie)
                .ok_or_else(|| format!("a reply for unknown cookie {}", h.cookie))?;
            let accepted = inf
                .check
                .chunk(&h, payload, self.allocation_ctx)
                .map_err(|e| e.to_string())?;
            (h.cookie, accepted, payload)
        } else {
            return Err(match magic {
                Some(m) => format!("a reply with unknown magic {m:#010x}"),
                None => format!("a reply of {len} bytes, too short for a header"),
            });
        };
        let inf = self.inflight.get_mut(&cookie).expect("found above");
        inf.apply(accepted.step, payload);
        if accepted.done {
            self.finish(cookie);
        }
        Ok(())
    }

    /// A reply whose READ data (`placed` bytes) the NIC put into the request's region; `msg`
    /// is its header. The same checks as a reply delivered whole, and the data must be
    /// where the checks say they belong (the framer computed the same place).
    fn on_placed_reply(&mut self, msg: &[u8], placed: usize) -> Result<(), String> {
        let simple = msg.first_chunk::<4>() == Some(&c::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let (cookie, accepted, at) = if !simple {
            let h =
                StructuredReplyHeader::parse_as(msg, self.extended).map_err(|e| e.to_string())?;
            let offset = msg
                .get(h.header_len()..)
                .and_then(|p| p.first_chunk::<8>())
                .map(|o| u64::from_be_bytes(*o))
                .ok_or("a placed chunk without its offset")?;
            let inf = self
                .inflight
                .get_mut(&h.cookie)
                .ok_or_else(|| format!("a reply for unknown cookie {}", h.cookie))?;
            let at = offset.wrapping_sub(inf.req.offset) as usize;
            let accepted = inf
                .check
                .placed_chunk(&h, offset, placed)
                .map_err(|e| e.to_string())?;
            (h.cookie, accepted, at)
        } else {
            let r = SimpleReply::parse(msg).map_err(|e| e.to_string())?;
            let inf = self
                .inflight
                .get_mut(&r.cookie)
                .ok_or_else(|| format!("a reply for unknown cookie {}", r.cookie))?;
            let accepted = inf.check.simple(&r, placed).map_err(|e| e.to_string())?;
            (r.cookie, accepted, 0)
        };
        let inf = self.inflight.get(&cookie).expect("found above");
        match (&accepted.step, &inf.region) {
            (Step::Data { dst, .. }, Some(_)) if dst.start == at && dst.len() == placed => {}
            _ => return Err("READ data placed where the reply check does not put them".into()),
        }
        self.bytes_placed += placed as u64;
        if accepted.done {
            self.finish(cookie);
        }
        Ok(())
    }

    fn finish(&mut self, cookie: u64) {
        if matches!(
            self.inflight.get(&cookie).map(|f| f.check.finish()),
            Some(Err(Unanswered::Server(ErrorValue::Shutdown)))
        ) {
            // The server is shutting down and did not carry the request out: it goes again
            // on the next connection (a restarted server), like requests a lost connection
            // leaves unanswered. It does not end an outage.
            self.shutting_down = true;
            return;
        }
        let Some(inf) = self.inflight.remove(&cookie) else {
            return;
        };
        // A whole answer ends an outage; a chunk that never leads to one does not.
        self.outage = None;
        self.free_slots.push(inf.slot);
        let result = match inf.check.finish() {
            Err(Unanswered::Server(error)) => Err(inf.error.unwrap_or(Error::Server {
                error,
                message: String::new(),
            })),
            Err(why) => Err(Error::Protocol {
                uri: self.uri.to_string(),
                why: why.to_string(),
            }),
            Ok(()) => match inf.req.command {
                Command::Read if inf.region.is_some() => Ok(Output::Done),
                Command::Read => Ok(Output::Data(inf.data)),
                Command::BlockStatus => Ok(Output::Extents(inf.extents)),
                _ => Ok(Output::Done),
            },
        };
        self.done.push_back(Reply {
            tag: inf.tag,
            result,
        });
    }

    /// Requests in flight and no reply for `request_timeout`: reconnect and reissue, unless
    /// the server has already been silent for `reconnect_timeout` past its first timeout.
    fn check_stall(&mut self) {
        let Some(limit) = self.opts.request_timeout else {
            return;
        };
        if self.inflight.is_empty() || self.last_progress.elapsed() < limit {
            return;
        }
        let since = *self.stalled_since.get_or_insert_with(Instant::now);
        let why = format!("no reply from the server for {} s", limit.as_secs_f64());
        if since.elapsed() >= self.opts.reconnect_timeout {
            tracing::error!(uri = %self.uri, "giving up: {why}");
            self.drop_conn();
            self.fail_all(Failure::Lost(why));
            return;
        }
        self.recover(why);
        self.last_progress = Instant::now();
    }

    /// The connection is gone: reconnect with exponential back-off and jitter, and reissue
    /// every request not yet answered; once `reconnect_timeout` has passed since the server
    /// last answered anything, fail them all with EIO.
    fn recover(&mut self, why: String) {
        if self.failed.is_some() {
            return;
        }
        tracing::warn!(uri = %self.uri, in_flight = self.inflight.len(), "connection lost: {why}; reconnecting");
        self.drop_conn();
        let start = Instant::now();
        let outage = self.outage.get_or_insert(Outage {
            since: start,
            backoff: Duration::ZERO,
        });
        let deadline = outage.since + self.opts.reconnect_timeout;
        let mut last = why.clone();
        loop {
            let wait = self
                .outage
                .as_mut()
                .map_or(Duration::ZERO, Outage::next_wait);
            std::thread::sleep(wait.min(deadline.saturating_duration_since(Instant::now())));
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let hs = ClientHandshake::connect(Self::config(&self.uri, &self.opts));
            match Conn::open(
                &self.nic,
                &self.uri,
                hs,
                self.opts.connect_timeout.min(left),
            ) {
                Ok((conn, ClientEvent::Connected(neg))) => {
                    if neg.export.size != self.info.size {
                        last = format!(
                            "export size changed from {} to {}",
                            self.info.size, neg.export.size
                        );
                        break;
                    }
                    self.structured = neg.structured_replies;
                    self.extended = neg.extended_headers;
                    self.allocation_ctx = neg.base_allocation;
                    self.conn = Some(conn);
                    let mut cookies: Vec<u64> = self.inflight.keys().copied().collect();
                    cookies.sort_unstable();
                    let mut ok = true;
                    for cookie in cookies {
                        if let Some(inf) = self.inflight.get_mut(&cookie) {
                            inf.reset();
                        }
                        if let Err(e) = self.post(cookie) {
                            last = format!("reissuing failed: {e}");
                            ok = false;
                            break;
                        }
                    }
                    if ok {
                        self.reconnects += 1;
                        tracing::info!(uri = %self.uri, reissued = self.inflight.len(), after = ?start.elapsed(), "reconnected");
                        return;
                    }
                    self.drop_conn();
                }
                Ok(_) => last = "handshake ended without transmission".into(),
                Err(e) => last = e.to_string(),
            }
        }
        let why = format!("{why}; last attempt: {last}");
        tracing::error!(uri = %self.uri, "giving up: {why}");
        self.fail_all(Failure::Lost(why));
    }

    /// Drops the connection. Its NIC may be placing READ data into callers' regions right
    /// now; those regions are the callers' again only once the NIC's fence says it has
    /// stopped, so the client waits for that before it reissues or fails such reads.
    fn drop_conn(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        drop(conn);
        let placing = self
            .inflight
            .values()
            .any(|f| f.req.command == Command::Read && f.region.is_some());
        if placing && !self.nic.fence(Duration::from_secs(10)) {
            tracing::error!(uri = %self.uri, "the NIC did not confirm in 10 s that it stopped writing into READ buffers");
        }
    }

    /// Fails every request in flight with `failure` (EIO); the client stays failed.
    fn fail_all(&mut self, failure: Failure) {
        let cookies: Vec<u64> = self.inflight.keys().copied().collect();
        for cookie in cookies {
            if let Some(inf) = self.inflight.remove(&cookie) {
                self.free_slots.push(inf.slot);
                self.done.push_back(Reply {
                    tag: inf.tag,
                    result: Err(self.failure_error(&failure)),
                });
            }
        }
        self.failed = Some(failure);
    }

    /// Runs `ops` with the window full; `on_done(index, output)` for each success. The first
    /// error is returned after every request has finished.
    fn run<'a>(
        &mut self,
        ops: impl IntoIterator<Item = Op<'a>>,
        mut on_done: impl FnMut(u64, Output),
    ) -> Result<()> {
        let mut pending = 0usize;
        let mut first_err: Option<Error> = None;
        let mut drain = |this: &mut Client, pending: &mut usize| {
            while let Some(i) = this.done.iter().position(|r| r.tag & INTERNAL != 0) {
                let r = this.done.remove(i).expect("position is in range");
                *pending -= 1;
                match r.result {
                    Ok(out) => on_done(r.tag & !INTERNAL, out),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        };
        for (i, op) in ops.into_iter().enumerate() {
            if let Err(e) = self.submit(INTERNAL | i as u64, op) {
                drain(self, &mut pending);
                while pending > 0 {
                    self.pump(true)?;
                    drain(self, &mut pending);
                }
                return Err(e);
            }
            pending += 1;
            drain(self, &mut pending);
        }
        while pending > 0 {
            self.pump(true)?;
            drain(self, &mut pending);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn pieces(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u32)> {
        let max = max.max(1);
        (0..len.div_ceil(max)).map(move |i| {
            let o = i * max;
            (offset + o, (len - o).min(max) as u32)
        })
    }

    /// Reads `buf.len()` bytes at `offset`, as many requests in flight as the window allows.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        let max = u64::from(self.max_io);
        let ops: Vec<Op> = Self::pieces(offset, buf.len() as u64, max)
            .map(|(offset, len)| Op::Read { offset, len })
            .collect();
        self.run(ops, |i, out| {
            if let Output::Data(d) = out {
                let at = (i * max) as usize;
                buf[at..at + d.len()].copy_from_slice(&d);
            }
        })
    }

    /// Writes `data` at `offset`; with `fua` (when the server offers it) durable on return.
    pub fn write_at(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        let max = self.max_io as usize;
        let ops: Vec<Op> = data
            .chunks(max.max(1))
            .enumerate()
            .map(|(i, d)| Op::Write {
                offset: offset + (i * max) as u64,
                data: d,
                fua,
            })
            .collect();
        self.run(ops, |_, _| {})
    }

    /// `len` bytes at `offset` of the export, to or from `mr` at `at`, checked and cut into
    /// requests of at most `max_io`: (export offset, length, offset in `mr`).
    fn region_pieces(
        &self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
        outside: &'static str,
    ) -> Result<impl Iterator<Item = (u64, u32, usize)> + use<>> {
        self.check_range(offset, len as u64)?;
        if at.checked_add(len).is_none_or(|e| e > mr.len()) {
            return Err(Error::Invalid(outside));
        }
        Ok(Self::pieces(offset, len as u64, u64::from(self.max_io))
            .map(move |(o, n)| (o, n, at + (o - offset) as usize)))
    }

    /// Reads `len` bytes at `offset` into registered memory (`mr` from `at`): the NIC places
    /// the data there, no copy (holes are zero-filled by the client).
    pub fn read_at_mr(
        &mut self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
    ) -> Result<()> {
        let ops: Vec<Op> = self
            .region_pieces(offset, mr, at, len, "read buffer outside its region")?
            .map(|(offset, len, at)| Op::ReadInto {
                offset,
                len,
                mr,
                at,
            })
            .collect();
        self.run(ops, |_, _| {})
    }

    /// Writes `len` bytes of registered memory (`mr` from `at`) at `offset` without copying
    /// them: the NIC sends them from `mr`.
    pub fn write_at_mr(
        &mut self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
        fua: bool,
    ) -> Result<()> {
        let ops: Vec<Op> = self
            .region_pieces(offset, mr, at, len, "write data outside its region")?
            .map(|(offset, len, at)| Op::WriteFrom {
                offset,
                len,
                mr,
                at,
                fua,
            })
            .collect();
        self.run(ops, |_, _| {})
    }

    /// Makes every acknowledged write durable (a no-op if the server has no FLUSH).
    pub fn flush(&mut self) -> Result<()> {
        if !self.can_flush() {
            return Ok(());
        }
        self.run([Op::Flush], |_, _| {})
    }

    /// Largest TRIM / WRITE_ZEROES length in one request.
    fn max_zero(&self) -> u64 {
        let bs = self.info.block_size;
        round_down(u64::from(bs.max).min(1 << 30), u64::from(bs.min)).max(u64::from(bs.min))
    }

    /// Discards a range (NBD_CMD_TRIM; its contents are unspecified afterwards).
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        if !self.can_trim() {
            return Err(Error::Unsupported("TRIM"));
        }
        self.check_range(offset, len)?;
        let ops: Vec<Op> = Self::pieces(offset, len, self.max_zero())
            .map(|(offset, len)| Op::Trim { offset, len })
            .collect();
        self.run(ops, |_, _| {})
    }

    /// Zeroes a range (NBD_CMD_WRITE_ZEROES; the server may punch holes).
    pub fn write_zeroes(&mut self, offset: u64, len: u64, fua: bool) -> Result<()> {
        if !self.can_write_zeroes() {
            return Err(Error::Unsupported("WRITE_ZEROES"));
        }
        self.check_range(offset, len)?;
        let ops: Vec<Op> = Self::pieces(offset, len, self.max_zero())
            .map(|(offset, len)| Op::WriteZeroes { offset, len, fua })
            .collect();
        self.run(ops, |_, _| {})
    }

    /// Allocation status from `offset` (base:allocation). The server may describe less than
    /// `len` bytes; ask again from the end of the last extent.
    pub fn block_status(&mut self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        let min = u64::from(self.info.block_size.min);
        let len = len.min(self.info.size.saturating_sub(offset));
        let len = round_down(len.min(u64::from(u32::MAX)), min).max(min.min(len));
        let mut got = Vec::new();
        self.run(
            [Op::BlockStatus {
                offset,
                len: len as u32,
            }],
            |_, out| {
                if let Output::Extents(e) = out {
                    got = e;
                }
            },
        )?;
        Ok(got)
    }

    /// Waits for every request in flight (their replies stay queued for `reap`).
    pub fn drain(&mut self) -> Result<()> {
        while !self.inflight.is_empty() {
            self.pump(true)?;
        }
        Ok(())
    }

    /// Finishes in-flight requests, sends NBD_CMD_DISC and closes the connection.
    pub fn disconnect(mut self) -> Result<()> {
        self.drain()?;
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        let req = Request {
            flags: CmdFlags::empty(),
            command: Command::Disc,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        let header = req
            .encode(self.extended)
            .map_err(|_| Error::Invalid("NBD_CMD_DISC does not encode"))?;
        self.send_mr.write_at(0, &header);
        conn.qp
            .post_send(SendWr::new(0, &[self.send_mr.sge(0, header.len())]))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [Completion::default(); 8];
        'wait: while Instant::now() < deadline {
            let n = conn.cq.wait(&mut buf, Some(Duration::from_millis(200)))?;
            for comp in &buf[..n] {
                if comp.opcode == Opcode::Send && comp.wr_id == 0 {
                    break 'wait;
                }
            }
        }
        conn.qp.close();
        Ok(())
    }
}
