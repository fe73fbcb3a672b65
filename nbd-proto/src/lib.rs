//! The NBD wire protocol as a sans-IO codec (bytes in, events out).
//!
//! This crate knows the Network Block Device protocol (fixed-newstyle
//! handshake, simple and structured replies, block status of `base:allocation` and of
//! the other metadata contexts an export offers, such as `qemu:allocation-depth`)
//! and nothing about I/O: no sockets, threads or clocks. It serves both roles:
//!
//! | module | job |
//! |---|---|
//! | [`consts`] | every magic, flag, option, reply type, command and error value |
//! | [`flags`] | typed flag sets ([`flags::TransmissionFlags`], [`flags::CmdFlags`], ...) |
//! | [`handshake::messages`] | encode/parse of greeting, options, option replies, infos |
//! | [`handshake::server`] | [`ServerHandshake`] state machine |
//! | [`handshake::client`] | [`ClientHandshake`] state machine |
//! | [`request`] | the [`Request`] header (compact or extended), [`Command`], [`ErrorValue`] |
//! | [`transmission`] | the transmission phase: [`validate_request`] (which error to send), the request types re-exported |
//! | [`transmission::server`] | [`ServerTransmission`]: request header bytes to a [`ValidRequest`], replies to bytes |
//! | [`transmission::client`] | the client's transmission phase: requests in flight, replies into buffers ([`transmission::client::ClientSession`]) |
//! | [`transmission::client::reply_check`] | a client's checks of one request's reply chunks ([`transmission::client::reply_check::ReplyCheck`]) |
//! | [`reply`] | simple replies, structured and extended chunks, block-status builders |
//! | [`framing`] | "where does this message end?" for message-based transports |
//! | [`placement`] | the framers' machines: each message framed, a request parsed once, READ and WRITE data placed |
//!
//! # Driving the handshake
//!
//! Both state machines take **whole framed messages** (`handle_message`) — the
//! natural fit for a transport that delivers complete messages — or a byte
//! stream (`feed`) which frames internally. The framer for the next message is
//! chosen by the machine's `phase()`. Output bytes are appended to a caller
//! `Vec<u8>`; a terminal event says when to switch to transmission or close.
//!
//! ```
//! use nbd_proto::framing::{client_need, server_need, FrameLimits};
//! use nbd_proto::handshake::{
//!     ClientConfig, ClientEvent, ClientHandshake, Export, ServerConfig, ServerEvent,
//!     ServerHandshake,
//! };
//! use nbd_proto::flags::TransmissionFlags;
//!
//! let mut export = Export::new("disk", 1 << 20);
//! export.flags = TransmissionFlags::SEND_FLUSH | TransmissionFlags::SEND_FUA;
//! let mut server = ServerHandshake::new(ServerConfig::new(vec![export]));
//! let mut client = ClientHandshake::connect(ClientConfig::new("disk"));
//!
//! // Pop one complete message off the front of `buf`, if there is one.
//! fn pop(total: Option<usize>, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
//!     let n = total.filter(|&n| n <= buf.len())?;
//!     let rest = buf.split_off(n);
//!     Some(std::mem::replace(buf, rest))
//! }
//!
//! let limits = FrameLimits::default();
//! let mut to_client = server.greeting().to_vec();
//! let mut to_server = Vec::new();
//! let (mut server_done, mut client_done) = (None, None);
//! while server_done.is_none() || client_done.is_none() {
//!     while let Some(msg) = pop(client_need(client.phase(), &to_client, &limits, |_| None).total(), &mut to_client) {
//!         match client.handle_message(&msg, &mut to_server).expect("client") {
//!             ClientEvent::Connected(n) => client_done = Some(n),
//!             _ => {}
//!         }
//!     }
//!     while let Some(msg) = pop(server_need(server.phase(), &to_server, &limits).total(), &mut to_server) {
//!         match server.handle_message(&msg, &mut to_client).expect("server") {
//!             ServerEvent::Done(n) => server_done = Some(n),
//!             _ => {}
//!         }
//!     }
//! }
//! let (s, c) = (server_done.unwrap(), client_done.unwrap());
//! assert_eq!(c.export.size, 1 << 20);
//! assert!(s.structured_replies && c.structured_replies);
//! assert_eq!(c.base_allocation, Some(nbd_proto::handshake::BASE_ALLOCATION_ID));
//!
//! // Transmission: the server parses and checks each request before executing it.
//! use nbd_proto::transmission::server::{RequestError, ServerTransmission};
//! use nbd_proto::transmission::{Command, ErrorValue, Request};
//! // Extended headers were negotiated: a WRITE says that its length is a payload length.
//! assert!(s.extended_headers && c.extended_headers);
//! let flags = nbd_proto::flags::CmdFlags::PAYLOAD_LEN;
//! let req = Request { flags, command: Command::Write, cookie: 1, offset: 1 << 20, length: 512 };
//! let server = ServerTransmission::new(&s);
//! let Err(RequestError::Refused(refusal)) = server.parse_request(&req.encode(c.extended_headers).unwrap()) else {
//!     panic!("a write past the end is refused");
//! };
//! // The server reads the 512 payload bytes on, then replies ENOSPC.
//! assert_eq!((refusal.error(), refusal.payload_len()), (ErrorValue::NoSpc, 512));
//! let mut reply = Vec::new();
//! server.reply(refusal.reply_to(), Err(refusal.error()), &mut reply);
//! ```
//!
//! # Framing
//!
//! A message is a header plus a body; the body of an `NBD_CMD_WRITE` and the
//! data of a read reply are bulk data the transport may place directly into
//! registered memory. See [`framing`]. A server switches its framer to
//! [`framing::ServerPhase::Transmission`] right before it sends the final
//! handshake reply, because a client may pipeline requests right behind it.
//!
//! # Limits (bounded memory)
//!
//! * Protocol strings (export names, descriptions, queries, error messages):
//!   at most 4096 bytes, UTF-8, no NUL ([`consts::MAX_STRING_LEN`], per spec).
//! * Option data (server) and option reply data (client): 64 KiB by default
//!   ([`framing::DEFAULT_MAX_OPTION_LEN`]); above that the server hard-disconnects
//!   (the length cannot be trusted enough to skip the data).
//! * At most 1024 options per handshake on the server
//!   ([`handshake::server::DEFAULT_MAX_OPTIONS`]), a denial of service otherwise.
//! * Client: at most 16384 `NBD_REP_SERVER` entries and 1024 info / meta
//!   context replies per option.
//! * Write payloads: 32 MiB by default ([`framing::DEFAULT_MAX_WRITE_LEN`]);
//!   reply bodies 32 MiB + 8 ([`framing::DEFAULT_MAX_REPLY_LEN`]).
//! * Allocation while parsing is bounded by the input length.
//!
//! # Spec interpretation choices
//!
//! * Clients without `NBD_FLAG_C_FIXED_NEWSTYLE` are honoured by default
//!   ("Servers MAY choose to honour fixed newstyle from clients that didn't set
//!   this bit"), but may only send `NBD_OPT_EXPORT_NAME`, "the only valid option
//!   in nonfixed newstyle negotiation"; anything else is a hard disconnect.
//!   [`handshake::ServerConfig::allow_non_fixed_newstyle`] `= false` refuses them.
//! * TLS ([`handshake::TlsMode`]): off, `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`
//!   ("if it does not support the `NBD_OPT_STARTTLS` option at all"); on or required,
//!   it is acknowledged and [`ServerEvent::StartTls`] tells the caller to run the TLS
//!   handshake, after which everything negotiated before is forgotten. Required: every
//!   option before it but `NBD_OPT_ABORT` gets `NBD_REP_ERR_TLS_REQD`, and
//!   `NBD_OPT_EXPORT_NAME` a hard disconnect. A second `NBD_OPT_STARTTLS`, or one with
//!   data, gets `NBD_REP_ERR_INVALID`. A client configured for TLS sends
//!   `NBD_OPT_STARTTLS` first and fails on any refusal (no plaintext fallback).
//! * `NBD_OPT_EXPORT_NAME` for an unknown export, an invalid name, or while
//!   shutting down is a hard disconnect ("If the server is unwilling to allow
//!   the export, it MUST terminate the session").
//! * `NBD_OPT_SET_META_CONTEXT` before structured replies: `NBD_REP_ERR_INVALID`
//!   ("a server SHOULD send `NBD_REP_ERR_INVALID`"); `NBD_OPT_LIST_META_CONTEXT`
//!   is allowed without them (the spec only says MAY). Queries without a colon, of
//!   unknown namespaces or with unknown leaves are ignored (the spec allows
//!   `NBD_REP_ERR_INVALID` for the first; qemu-nbd ignores them all), and so are queries
//!   too long or not UTF-8; a NUL in a query, a length beyond the data or trailing bytes
//!   are `NBD_REP_ERR_INVALID` (qemu-nbd ignores trailing bytes).
//!   A LIST with no query lists every context of the export; in a LIST a query ending
//!   in `:` (`base:`, `qemu:`, `qemu:dirty-bitmap:`) lists the contexts under it, in a
//!   SET it selects nothing (SET takes exact names), as qemu-nbd answers. Each context
//!   is answered once, in the export's order (`base:allocation` first, then
//!   [`handshake::Export::contexts`]), with qemu-nbd's ids (`base:allocation` 0,
//!   `qemu:allocation-depth` 1, the others 2 on). Contexts only apply if the final export is the
//!   one named in the last SET; a `BLOCK_STATUS` reply has one chunk per context.
//! * `NBD_OPT_INFO`/`NBD_OPT_GO`: `NBD_INFO_EXPORT` is always sent; requested
//!   NAME / DESCRIPTION (if non-empty) / BLOCK_SIZE are answered once each;
//!   non-default block sizes are sent even unrequested; unknown exports get
//!   `NBD_REP_ERR_UNKNOWN`.
//! * Repeated `NBD_OPT_STRUCTURED_REPLY` is acknowledged again (idempotent).
//! * Request validation order and zero-length rules: see [`validate_request`].
//!
//! * Extended headers (`NBD_OPT_EXTENDED_HEADERS`): offered only with `NBD_OPT_GO`
//!   (the spec requires it), they imply structured replies; a later
//!   `NBD_OPT_STRUCTURED_REPLY` gets `NBD_REP_ERR_EXT_HEADER_REQD` and a later
//!   `NBD_OPT_EXPORT_NAME` a hard disconnect. A `WRITE` carries
//!   `NBD_CMD_FLAG_PAYLOAD_LEN` (one without it still has its payload: qemu sends them so),
//!   and so may a `BLOCK_STATUS` where `NBD_FLAG_BLOCK_STATUS_PAYLOAD` was advertised (with
//!   contexts selected, at most [`transmission::ContextSet::MAX`], as qemu-nbd offers it):
//!   its payload, the effect length and the ids of the contexts to answer for, is read and
//!   checked by [`transmission::server::ServerTransmission::block_status_payload`] (an id
//!   not selected or named twice, a payload that is not 8 + 4n bytes with 1 ≤ n ≤ the
//!   contexts selected, a zero or out-of-bounds effect length: `EINVAL`, the payload read
//!   on); any other command with the flag is `EINVAL`. Block status is answered with
//!   `BLOCK_STATUS_EXT`, and the client checks that each extended reply echoes its
//!   request's offset.
//!
//! The TLS record layer itself is the caller's (in qpip, the NIC's).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod consts;
pub mod coverage;
mod error;
pub mod flags;
pub mod framing;
/// The fuzzing harness: nbd-proto/fuzz's targets and the stable property test (not part of
/// the library proper: only with the `fuzzing` feature, or in nbd-proto's own tests).
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
pub mod peer_text;
pub mod placement;
pub mod reply;
pub mod request;
pub mod transmission;
mod wire;

pub use error::ProtoError;
pub use framing::{ClientPhase, FrameLimits, Need, ServerPhase};
pub use handshake::{
    ClientConfig, ClientEvent, ClientHandshake, ServerConfig, ServerEvent, ServerHandshake,
};
pub use transmission::server::{ServerTransmission, ValidRequest};
pub use transmission::{Command, ErrorValue, Request, TransmissionInfo, validate_request};
