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
//! [`nbd_proto::placement::client`]), so the NIC places them straight into the caller's
//! region and only the reply header into the receive slot. The caller's region belongs to
//! the NIC until the request is answered; when a connection is dropped with such reads in
//! flight, the client waits for the NIC's fence (`Nic::fence`) before it hands anything back.
//!
//! The protocol itself — cookies, the in-flight table, checking and assembling replies, the
//! stall and back-off clocks — is nbd-proto's sans-IO [`nbd_proto::transmission::client`]; this crate does
//! the I/O around it. A [`Client`] is made of parts that each own their state, one a module:
//! `link` (the connection, the NIC and the send slots: posting requests and waiting for
//! completions), the session, and `recovery` (liveness, reconnects, failures). The rest
//! drive the parts: getting a client, the handshake and its variants (`connect`), the
//! pipelined API and completion handling (`pipeline`), a lost connection (`reconnect`:
//! reconnect, reissue, or fail), and the blocking calls on top (`blocking`). Memory ranges enter
//! checked ([`MrSlice`]) and are carried down as they are.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nbd_proto::flags::TransmissionFlags;
use nbd_proto::handshake::{BlockSize, ExportDetails};
use nbd_proto::transmission::client::ClientSession;
use qpip_core::Nic;

use crate::error::{Error, Result};
use crate::region::{MrSlice, Region};
use crate::uri::NbdUri;

mod blocking;
mod connect;
mod link;
mod pipeline;
mod reconnect;
mod recovery;
mod shared;

use link::Link;
use recovery::{Failure, Recovery};

pub use nbd_proto::transmission::client::{Extent, Output};
pub use shared::SharedClient;

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
    /// The largest READ or WRITE to send, in bytes (nbdcopy's `--request-size`); `None`: the
    /// server's maximum block size, at most [`crate::MAX_IO`]. Rounded down to the server's
    /// minimum block size.
    pub max_request: Option<u32>,
    /// Ask for structured replies.
    pub structured_replies: bool,
    /// Ask for extended headers (with structured replies; used if the server has them).
    pub extended_headers: bool,
    /// Ask for the `base:allocation` metadata context (block status).
    pub base_allocation: bool,
    /// Further metadata contexts to select by name (e.g. `qemu:allocation-depth`), for
    /// [`Client::block_status_of`]; those the server does not offer are left out.
    pub meta_contexts: Vec<String>,
    /// List the export's metadata contexts when connecting ([`Client::listed_contexts`]).
    pub list_contexts: bool,
    /// The NIC to use (a new soft NIC if `None`); clients may share one.
    pub nic: Option<Nic>,
    /// Set by another thread (a signal handler, an unmount) when the process is stopping:
    /// from then on the client no longer waits for a server that does not answer. Requests
    /// in flight that get no reply for [`STOP_GRACE`] fail with EIO, and a lost connection
    /// is not restored. The client stays failed, as after its reconnect timeout.
    pub stop: Option<Arc<AtomicBool>>,
}

/// Once [`ClientOptions::stop`] is set, how long requests in flight may go without a reply.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            reconnect_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            request_timeout: Some(Duration::from_secs(60)),
            window: 32,
            max_request: None,
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            meta_contexts: Vec::new(),
            list_contexts: false,
            nic: None,
            stop: None,
        }
    }
}

/// What the client knows about the export: what the handshake reported.
pub type ExportInfo = ExportDetails;

/// A request of the pipelined API. READ and WRITE are at most [`Client::max_io`] bytes.
#[derive(Clone, Copy, Debug)]
pub enum Op<'a> {
    /// A READ of `len` bytes at `offset` (its reply is [`Output::Data`]).
    Read {
        /// Offset in the export.
        offset: u64,
        /// Bytes to read.
        len: u32,
    },
    /// A WRITE of `data` at `offset` (copied into the request's send slot).
    Write {
        /// Offset in the export.
        offset: u64,
        /// The bytes to write.
        data: &'a [u8],
        /// Durable before the reply (where the server offers FUA).
        fua: bool,
    },
    /// A FLUSH: every write answered before it is durable.
    Flush,
    /// A TRIM of `len` bytes at `offset`.
    Trim {
        /// Offset in the export.
        offset: u64,
        /// Bytes to discard.
        len: u32,
    },
    /// A WRITE_ZEROES of `len` bytes at `offset`.
    WriteZeroes {
        /// Offset in the export.
        offset: u64,
        /// Bytes to zero.
        len: u32,
        /// Durable before the reply (where the server offers FUA).
        fua: bool,
    },
    /// A BLOCK_STATUS of `len` bytes at `offset` (its reply is [`Output::Extents`]: those
    /// of every selected context, each extent naming its context's id).
    BlockStatus {
        /// Offset in the export.
        offset: u64,
        /// Bytes to describe.
        len: u32,
    },
    /// A READ of `into.len()` bytes whose data go to registered memory, `into` (its reply
    /// is [`Output::Done`]).
    ReadInto {
        /// Offset in the export.
        offset: u64,
        /// Where the data go.
        into: MrSlice<'a>,
    },
    /// NBD_CMD_RESIZE (experimental): the export becomes `size` bytes long. No other request
    /// may be in flight meanwhile (see [`Client::resize`]).
    Resize {
        /// The export's new size in bytes.
        size: u64,
    },
    /// A WRITE of `from.len()` bytes sent from registered memory without a copy: `from`,
    /// which must stay unchanged until the request is answered.
    WriteFrom {
        /// Offset in the export.
        offset: u64,
        /// The bytes to write.
        from: MrSlice<'a>,
        /// Durable before the reply (where the server offers FUA).
        fua: bool,
    },
}

/// A finished request of the pipelined API.
#[derive(Debug)]
pub struct Reply {
    /// The tag the request was submitted with.
    pub tag: u64,
    /// Its outcome.
    pub result: Result<Output>,
}

/// An NBD client on one QP connection, made of parts that each own their state: the link
/// (connection, NIC and send slots: post and wait), the session (nbd-proto's requests in
/// flight and their replies) with the finished requests not yet reaped, and recovery
/// (liveness, reconnects, failures). The methods here and in the submodules
/// drive the parts; no part reaches into another's fields.
pub struct Client {
    uri: NbdUri,
    opts: ClientOptions,
    info: ExportInfo,
    link: Link,
    /// Requests in flight and their replies (nbd-proto's sans-IO half).
    session: ClientSession<Region>,
    /// Finished requests, for [`Client::reap`] and the blocking calls.
    done: VecDeque<Reply>,
    recovery: Recovery,
    /// The export's metadata contexts, as the server listed them when connecting (with
    /// [`ClientOptions::list_contexts`]).
    listed_contexts: Vec<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("uri", &self.uri.to_string())
            .field("info", &self.info)
            .field("in_flight", &self.session.in_flight())
            .finish()
    }
}

impl Client {
    /// The server's URI.
    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }
    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.info.size
    }
    /// The export's transmission flags.
    pub fn flags(&self) -> TransmissionFlags {
        self.info.flags
    }
    /// What the handshake reported of the export.
    pub fn export_info(&self) -> &ExportInfo {
        &self.info
    }
    /// The export's block size constraints.
    pub fn block_size(&self) -> BlockSize {
        self.info.block_size
    }
    /// Largest READ/WRITE of the pipelined API (the server's maximum, capped at 1 MiB).
    pub fn max_io(&self) -> u32 {
        self.session.limits().max_io
    }
    /// Requests in flight at most.
    pub fn window(&self) -> usize {
        self.session.window()
    }
    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.session.in_flight()
    }
    /// The process is stopping ([`ClientOptions::stop`]).
    fn stopping(&self) -> bool {
        self.opts
            .stop
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Relaxed))
    }

    /// Lowers how long a lost connection is retried (never raises it): for a last flush on
    /// the way out, which should not hold a process for the whole reconnect timeout when
    /// the server is gone.
    pub fn limit_reconnect_timeout(&mut self, limit: Duration) {
        self.opts.reconnect_timeout = self.opts.reconnect_timeout.min(limit);
        self.recovery.limit_reconnect_timeout(limit);
    }

    /// The NIC the client's connections run on (to register memory for
    /// [`Op::ReadInto`] and [`Op::WriteFrom`]).
    pub fn nic(&self) -> &Nic {
        self.link.nic()
    }

    /// Bytes of READ data the NIC placed straight into callers' registered regions
    /// ([`Op::ReadInto`], [`Self::read_at_mr`]) without a copy.
    pub fn bytes_placed(&self) -> u64 {
        self.session.bytes_placed()
    }

    /// How many times the connection was restored.
    pub fn reconnects(&self) -> u64 {
        self.recovery.reconnects()
    }
    /// Structured replies are in use.
    pub fn structured_replies(&self) -> bool {
        self.session.mode().structured
    }
    /// Extended headers are in use (32-byte requests, extended reply chunks).
    pub fn extended_headers(&self) -> bool {
        self.session.mode().extended
    }
    fn has(&self, f: TransmissionFlags) -> bool {
        self.info.flags.contains(f)
    }
    /// The server exports it read-only.
    pub fn is_read_only(&self) -> bool {
        self.has(TransmissionFlags::READ_ONLY)
    }
    /// The server takes FLUSH.
    pub fn can_flush(&self) -> bool {
        self.has(TransmissionFlags::SEND_FLUSH)
    }
    /// The server takes FUA.
    pub fn can_fua(&self) -> bool {
        self.has(TransmissionFlags::SEND_FUA)
    }
    /// The server takes TRIM.
    pub fn can_trim(&self) -> bool {
        self.has(TransmissionFlags::SEND_TRIM)
    }
    /// The server takes WRITE_ZEROES.
    pub fn can_write_zeroes(&self) -> bool {
        self.has(TransmissionFlags::SEND_WRITE_ZEROES)
    }
    /// The server keeps several connections' caches coherent (multi-conn).
    pub fn can_multi_conn(&self) -> bool {
        self.has(TransmissionFlags::CAN_MULTI_CONN)
    }
    /// Block status (`base:allocation`) was negotiated.
    pub fn can_block_status(&self) -> bool {
        self.session.mode().allocation_ctx.is_some()
    }
    /// The metadata contexts selected on this connection ([`Self::block_status_of`] answers
    /// them): `base:allocation` and those of [`ClientOptions::meta_contexts`] the server
    /// offers.
    /// `(id, name)`: the id is the [`Extent::context_id`] of the context's extents in an
    /// [`Output::Extents`] (ids may change when the client reconnects).
    pub fn contexts(&self) -> &[(u32, String)] {
        &self.session.mode().contexts
    }
    /// The export's metadata contexts as the server listed them when connecting (empty
    /// without [`ClientOptions::list_contexts`]).
    pub fn listed_contexts(&self) -> &[String] {
        &self.listed_contexts
    }
    /// The server offers NBD's experimental RESIZE ([`Client::resize`]).
    pub fn can_resize(&self) -> bool {
        self.has(TransmissionFlags::SEND_RESIZE)
    }

    /// The export's size changed (a RESIZE, or a reconnect that found another size): what
    /// [`Self::size`] says and what requests are checked against from now on.
    pub(crate) fn set_size(&mut self, size: u64) {
        self.info.size = size;
        self.session.set_size(size);
    }

    /// `[offset, offset + len)` is aligned and inside the export: a blocking call's one
    /// check of its range, where it enters.
    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        Ok(self.session.limits().check_range(offset, len)?)
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
}
