//! The server's half of the transmission phase, sans-IO. The header bytes of a request (as
//! the server's framer delimited them) become a [`ValidRequest`], checked once, or a
//! [`RequestError`] that says how to answer; replies (simple, structured or extended, as
//! negotiated) become bytes. Write payloads and read data stay the caller's: they never pass
//! through here, so the transport can place them where it likes.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::CmdFlags;
use crate::handshake::server::ServerNegotiated;
use crate::reply::{self, ChunkBytes, Extent, ReplyTo, SimpleReply};
use crate::transmission::validate::check_request;
use crate::transmission::{
    Command, ContextSet, ErrorValue, Request, TransmissionInfo, ValidCommand,
};

/// A request that passed every check of [`crate::transmission::validate_request`]: only
/// [`ServerTransmission::parse_request`] makes one, so holding one means the checks ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ValidRequest {
    to: ReplyTo,
    command: ValidCommand,
}

impl ValidRequest {
    /// The request's cookie, echoed in its reply.
    pub const fn cookie(&self) -> u64 {
        self.to.cookie
    }

    /// Whom the reply answers (with extended headers, the request's offset too).
    pub const fn reply_to(&self) -> ReplyTo {
        self.to
    }

    /// The command, with its checked range and flags.
    pub const fn command(&self) -> &ValidCommand {
        &self.command
    }

    /// Payload bytes that follow the header (a `WRITE`'s length, else 0).
    pub const fn payload_len(&self) -> u64 {
        self.command.payload_len()
    }
}

/// A well-formed request the server does not execute: it reads the `payload_len` bytes of
/// payload that follow (and discards them), then replies with `error`. The connection stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{command:?} refused: {error}")]
pub struct Refusal {
    to: ReplyTo,
    command: Command,
    error: ErrorValue,
    payload_len: u64,
}

impl Refusal {
    /// The request's cookie, echoed in the error reply.
    pub const fn cookie(&self) -> u64 {
        self.to.cookie
    }

    /// Whom the error reply answers.
    pub const fn reply_to(&self) -> ReplyTo {
        self.to
    }

    /// The command as sent (possibly [`Command::Unknown`]).
    pub const fn command(&self) -> Command {
        self.command
    }

    /// The error value to reply with.
    pub const fn error(&self) -> ErrorValue {
        self.error
    }

    /// Payload bytes that follow the header on the wire and must be read before the reply.
    pub const fn payload_len(&self) -> u64 {
        self.payload_len
    }
}

/// Why a request header did not yield a [`ValidRequest`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The header cannot be parsed (short, or the wrong magic): nothing after it can be
    /// trusted, so the connection must close, without a reply.
    #[error("request header: {0}")]
    Malformed(ProtoError),
    /// Well-formed but refused: answered with an error reply.
    #[error("{0}")]
    Refused(Refusal),
}

impl RequestError {
    /// True when the server must close the connection instead of replying.
    pub const fn must_close(&self) -> bool {
        matches!(self, Self::Malformed(_))
    }
}

/// The server side of one connection's transmission phase: what was negotiated, and whether
/// the server is shutting down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTransmission {
    info: TransmissionInfo,
    /// The metadata contexts selected, `(id, name)`, in the order their chunks are sent.
    contexts: Vec<(u32, String)>,
    shutting_down: bool,
}

impl ServerTransmission {
    /// The transmission phase that `negotiated` opens.
    pub fn new(negotiated: &ServerNegotiated) -> Self {
        Self {
            info: negotiated.transmission_info(),
            contexts: negotiated.meta_contexts.clone(),
            shutting_down: false,
        }
    }

    /// A transmission phase described by `info` alone (no metadata context selected).
    pub fn from_info(info: TransmissionInfo) -> Self {
        Self {
            info,
            contexts: Vec::new(),
            shutting_down: false,
        }
    }

    /// What was negotiated.
    pub const fn info(&self) -> &TransmissionInfo {
        &self.info
    }

    /// The export's size changed under this connection: after a `RESIZE` it carried out,
    /// requests are checked against `size` from now on.
    pub fn set_size(&mut self, size: u64) {
        self.info.size = size;
    }

    /// Length of a request header: 32 bytes with extended headers, else 28.
    pub const fn header_len(&self) -> usize {
        Request::header_len(self.info.extended_headers)
    }

    /// The context id of `base:allocation`, if the client selected it.
    pub fn base_allocation(&self) -> Option<u32> {
        self.context_id(c::BASE_ALLOCATION)
    }

    /// The id of the context `name`, if the client selected it.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(_, n)| n == name)
            .map(|(id, _)| *id)
    }

    /// The metadata contexts the client selected, `(id, name)`: a `BLOCK_STATUS` reply has
    /// one chunk for each, in this order.
    pub fn contexts(&self) -> &[(u32, String)] {
        &self.contexts
    }

    /// From now on, requests other than `WRITE`, `FLUSH` and `DISC` that carry no payload
    /// are refused with `ESHUTDOWN` (what is in flight may still complete).
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
    }

    /// Parse and check the request header at the start of `header` (bytes after it, such as
    /// a write payload, are ignored). `DISC` is valid whatever else it says: the server
    /// closes on it without reading on.
    pub fn parse_request(&self, header: &[u8]) -> Result<ValidRequest, RequestError> {
        let req =
            Request::parse(header, self.info.extended_headers).map_err(RequestError::Malformed)?;
        self.admit(self.check(&req)).map_err(RequestError::Refused)
    }

    /// Every check of a parsed request but the shutdown rule ([`Self::admit`]): what a
    /// framer can decide when the request arrives, before the connection gets to it.
    pub fn check(&self, req: &Request) -> Result<ValidRequest, Refusal> {
        let extended = self.info.extended_headers;
        let to = ReplyTo::new(req, extended);
        if req.command == Command::Disc {
            return Ok(ValidRequest {
                to,
                command: ValidCommand::Disc,
            });
        }
        let refusal = |error| Refusal {
            to,
            command: req.command,
            error,
            payload_len: req.payload_len(extended),
        };
        match check_request(req, &self.info) {
            // A BLOCK_STATUS payload is the effect length and at least one id, and names
            // each selected context at most once: anything else is read on and refused
            // (as qemu-nbd does), unseen.
            Ok(ValidCommand::BlockStatusPayload { payload_len, .. })
                if payload_len < 12
                    || !(payload_len - 8).is_multiple_of(4)
                    || (payload_len - 8) / 4 > self.contexts.len() as u64 =>
            {
                Err(refusal(ErrorValue::Inval))
            }
            Ok(command) => Ok(ValidRequest { to, command }),
            Err(error) => Err(refusal(error)),
        }
    }

    /// The `BLOCK_STATUS` `req` ([`ValidCommand::BlockStatusPayload`]) with its `payload`
    /// read: the effect length and the ids of the contexts to answer for, checked into a
    /// [`ValidCommand::BlockStatus`]. An id not selected, or named twice, is `EINVAL` (the
    /// spec's MUST); the effect length is checked as a `BLOCK_STATUS` length is (nonzero,
    /// aligned, within the export).
    pub fn block_status_payload(
        &self,
        req: &ValidRequest,
        payload: &[u8],
    ) -> Result<ValidRequest, ErrorValue> {
        let ValidCommand::BlockStatusPayload {
            offset,
            payload_len,
            req_one,
        } = req.command
        else {
            return Err(ErrorValue::Inval);
        };
        if payload.len() as u64 != payload_len {
            return Err(ErrorValue::Inval);
        }
        let (effect, ids) = payload.split_at_checked(8).ok_or(ErrorValue::Inval)?;
        let effect = u64::from_be_bytes(effect.try_into().map_err(|_| ErrorValue::Inval)?);
        let mut contexts = ContextSet::EMPTY;
        for id in ids.chunks_exact(4) {
            let id = u32::from_be_bytes(id.try_into().map_err(|_| ErrorValue::Inval)?);
            let at = self.contexts.iter().position(|(i, _)| *i == id);
            contexts = at
                .and_then(|at| contexts.with(at))
                .ok_or(ErrorValue::Inval)?;
        }
        let plain = Request {
            flags: if req_one {
                CmdFlags::REQ_ONE
            } else {
                CmdFlags::empty()
            },
            command: Command::BlockStatus,
            cookie: req.to.cookie,
            offset,
            length: effect,
        };
        match check_request(&plain, &self.info)? {
            ValidCommand::BlockStatus { range, req_one, .. } => Ok(ValidRequest {
                to: req.to,
                command: ValidCommand::BlockStatus {
                    range,
                    req_one,
                    contexts,
                },
            }),
            _ => Err(ErrorValue::Inval),
        }
    }

    /// The shutdown rule, applied when the connection executes a request [`Self::check`]ed
    /// earlier: once [`Self::begin_shutdown`] ran, requests other than `WRITE`, `FLUSH` and
    /// `DISC` that carry no payload are refused with `ESHUTDOWN`, whatever the check said.
    pub fn admit(&self, checked: Result<ValidRequest, Refusal>) -> Result<ValidRequest, Refusal> {
        let (to, command, payload_len) = match &checked {
            Ok(req) => (req.to, req.command.command(), req.payload_len()),
            Err(refusal) => (refusal.to, refusal.command, refusal.payload_len),
        };
        if self.shutting_down
            && payload_len == 0
            && !matches!(command, Command::Flush | Command::Write | Command::Disc)
        {
            return Err(Refusal {
                to,
                command,
                error: ErrorValue::Shutdown,
                payload_len,
            });
        }
        checked
    }

    /// Append the whole reply to a request other than `READ`: as [`Self::reply`], except
    /// that a success is a simple reply unless extended headers rule those out. The spec
    /// allows either for commands other than `READ`, qemu-nbd and nbdkit answer so, and a
    /// client reads a simple reply in one go where a chunk header makes it read again for
    /// the rest (libnbd: two `recv`s per reply).
    pub fn reply_not_read(&self, to: ReplyTo, result: Result<(), ErrorValue>, out: &mut Vec<u8>) {
        if result.is_ok() && !self.info.extended_headers {
            out.extend_from_slice(&SimpleReply::ok(to.cookie).encode());
        } else {
            self.reply(to, result, out);
        }
    }

    /// Append the whole reply to a request without data: success, or `result`'s error.
    pub fn reply(&self, to: ReplyTo, result: Result<(), ErrorValue>, out: &mut Vec<u8>) {
        match result {
            Ok(()) if self.info.structured_replies => out.extend_from_slice(&reply::none_chunk(to)),
            Ok(()) => out.extend_from_slice(&SimpleReply::ok(to.cookie).encode()),
            Err(e) => self.reply_error(to, e, None, out),
        }
    }

    /// Append an error reply to a request without data: with structured replies, an error
    /// chunk whose message says `why` (none without one, as qemu-nbd sends it: the error
    /// value says the rest); a simple reply carries the error value alone.
    pub fn reply_error(&self, to: ReplyTo, e: ErrorValue, why: Option<&str>, out: &mut Vec<u8>) {
        if !self.info.structured_replies {
            out.extend_from_slice(&SimpleReply::err(to.cookie, e).encode());
            return;
        }
        reply::error_chunk(to, true, e, why.unwrap_or(""), out);
    }

    /// The header of a successful reply to a nonzero `READ`, which the whole range's data
    /// follows: a simple reply, or one final `OFFSET_DATA` chunk.
    pub fn read_reply_header(&self, req: &ValidRequest) -> Result<ChunkBytes, ProtoError> {
        let ValidCommand::Read { range, .. } = req.command else {
            return Err(ProtoError::Invalid("a read reply answers a READ"));
        };
        if !self.info.structured_replies {
            return Ok(ChunkBytes::from_slice(
                &SimpleReply::ok(req.cookie()).encode(),
            ));
        }
        // checked: at most the maximum block size, a u32
        let len = u32::try_from(range.len()).map_err(|_| ProtoError::TooLong {
            what: "read reply",
            len: range.len(),
            limit: u32::MAX.into(),
        })?;
        reply::offset_data_header(req.to, true, range.offset(), len)
    }

    /// Append the reply to a `BLOCK_STATUS`: one chunk per context, each trimmed to the
    /// request (see [`reply::block_status_reply`]).
    pub fn block_status_reply(
        &self,
        req: &ValidRequest,
        contexts: &[(u32, &[Extent])],
        out: &mut Vec<u8>,
    ) -> Result<(), ProtoError> {
        let ValidCommand::BlockStatus { range, req_one, .. } = req.command else {
            return Err(ProtoError::Invalid(
                "a block status reply answers a BLOCK_STATUS",
            ));
        };
        let flags = if req_one {
            CmdFlags::REQ_ONE
        } else {
            CmdFlags::empty()
        };
        reply::block_status_reply(req.to, flags, range.len(), contexts, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::TransmissionFlags as TF;
    use crate::reply::{Chunk, StructuredReplyHeader};

    fn session(structured: bool, extended: bool) -> ServerTransmission {
        let mut info = TransmissionInfo::new(
            1 << 20,
            TF::SEND_FLUSH | TF::SEND_FUA | TF::SEND_TRIM | TF::SEND_WRITE_ZEROES | TF::SEND_DF,
        );
        info.structured_replies = structured || extended;
        info.has_meta_context = structured || extended;
        info.extended_headers = extended;
        ServerTransmission::from_info(info)
    }

    fn header(
        command: Command,
        flags: CmdFlags,
        offset: u64,
        length: u64,
        extended: bool,
    ) -> Vec<u8> {
        let req = Request {
            flags,
            command,
            cookie: 0xc0c0,
            offset,
            length,
        };
        req.encode(extended).unwrap().to_vec()
    }

    #[test]
    fn block_status_payload_selects_contexts() {
        let mut s = session(true, true);
        s.contexts = vec![
            (1, "base:allocation".into()),
            (2, "qemu:allocation-depth".into()),
        ];
        let pl = CmdFlags::PAYLOAD_LEN;
        // not offered: refused, the payload read on
        let r = s.parse_request(&header(Command::BlockStatus, pl, 0, 12, true));
        let Err(RequestError::Refused(r)) = r else {
            panic!("{r:?}")
        };
        assert_eq!((r.error(), r.payload_len()), (ErrorValue::Inval, 12));
        s.info.flags |= TF::BLOCK_STATUS_PAYLOAD;
        // lengths: 8 + 4 per id, one id at least, no more ids than contexts
        for len in [0, 8, 10, 13, 20] {
            let r = s.parse_request(&header(Command::BlockStatus, pl, 0, len, true));
            let Err(RequestError::Refused(r)) = r else {
                panic!("{len}: {r:?}")
            };
            assert_eq!(
                (r.error(), r.payload_len()),
                (ErrorValue::Inval, len),
                "{len}"
            );
        }
        let req = s
            .parse_request(&header(Command::BlockStatus, pl, 4096, 16, true))
            .unwrap();
        assert_eq!(req.payload_len(), 16);
        let payload = |effect: u64, ids: &[u32]| {
            let mut p = effect.to_be_bytes().to_vec();
            ids.iter()
                .for_each(|i| p.extend_from_slice(&i.to_be_bytes()));
            p
        };
        let checked = s
            .block_status_payload(&req, &payload(8192, &[2, 1]))
            .unwrap();
        let ValidCommand::BlockStatus {
            range, contexts, ..
        } = *checked.command()
        else {
            panic!("{checked:?}")
        };
        assert_eq!((range.offset(), range.len()), (4096, 8192));
        assert!(contexts.contains(0) && contexts.contains(1) && !contexts.contains(2));
        let req = s
            .parse_request(&header(Command::BlockStatus, pl, 4096, 12, true))
            .unwrap();
        let checked = s.block_status_payload(&req, &payload(512, &[2])).unwrap();
        let ValidCommand::BlockStatus { contexts, .. } = *checked.command() else {
            panic!("{checked:?}")
        };
        assert!(!contexts.contains(0) && contexts.contains(1));
        // unknown or twice-named ids, zero or out-of-bounds effect lengths, a short payload
        for (effect, ids) in [
            (512, &[3][..]),
            (0, &[1]),
            (1 << 20, &[1]),
            (u64::MAX, &[1]),
        ] {
            let p = payload(effect, ids);
            assert_eq!(s.block_status_payload(&req, &p), Err(ErrorValue::Inval));
        }
        let req = s
            .parse_request(&header(Command::BlockStatus, pl, 0, 16, true))
            .unwrap();
        let twice = payload(512, &[1, 1]);
        assert_eq!(s.block_status_payload(&req, &twice), Err(ErrorValue::Inval));
        assert_eq!(
            s.block_status_payload(&req, &twice[..12]),
            Err(ErrorValue::Inval)
        );
    }

    #[test]
    fn valid_requests_come_typed() {
        let s = session(true, false);
        let r = s
            .parse_request(&header(Command::Write, CmdFlags::FUA, 4096, 512, false))
            .unwrap();
        assert_eq!(r.cookie(), 0xc0c0);
        assert_eq!(r.payload_len(), 512);
        let ValidCommand::Write { range, fua: true } = *r.command() else {
            panic!("{r:?}");
        };
        assert_eq!(
            (range.offset(), range.len(), range.end()),
            (4096, 512, 4608)
        );
        let r = s
            .parse_request(&header(Command::Read, CmdFlags::DF, 0, 512, false))
            .unwrap();
        assert!(matches!(r.command(), ValidCommand::Read { df: true, .. }));
        assert_eq!(r.payload_len(), 0);
        let r = s
            .parse_request(&header(
                Command::BlockStatus,
                CmdFlags::REQ_ONE,
                0,
                8,
                false,
            ))
            .unwrap();
        assert!(matches!(
            r.command(),
            ValidCommand::BlockStatus { req_one: true, .. }
        ));
        let r = s
            .parse_request(&header(Command::Flush, CmdFlags::empty(), 0, 0, false))
            .unwrap();
        assert_eq!(*r.command(), ValidCommand::Flush);
        // A DISC is valid whatever it says.
        let r = s
            .parse_request(&header(Command::Disc, CmdFlags(0xffff), 1, 3, false))
            .unwrap();
        assert_eq!(r.command().command(), Command::Disc);
    }

    #[test]
    fn refusals_say_how_to_answer() {
        let s = session(true, true);
        // A write past the end: ENOSPC, after its payload has been read.
        let e = s
            .parse_request(&header(
                Command::Write,
                CmdFlags::PAYLOAD_LEN,
                1 << 20,
                512,
                true,
            ))
            .unwrap_err();
        assert!(!e.must_close());
        let RequestError::Refused(r) = e else {
            panic!("{e:?}")
        };
        assert_eq!(
            (r.cookie(), r.command(), r.error(), r.payload_len()),
            (0xc0c0, Command::Write, ErrorValue::NoSpc, 512)
        );
        assert_eq!(
            r.reply_to().offset,
            Some(1 << 20),
            "extended replies echo the offset"
        );
        // A payload on a READ is refused, but still read.
        let Err(RequestError::Refused(r)) =
            s.parse_request(&header(Command::Read, CmdFlags::PAYLOAD_LEN, 0, 64, true))
        else {
            panic!()
        };
        assert_eq!((r.error(), r.payload_len()), (ErrorValue::Inval, 64));
        let Err(RequestError::Refused(r)) =
            s.parse_request(&header(Command::Unknown(77), CmdFlags::empty(), 0, 0, true))
        else {
            panic!()
        };
        assert_eq!(r.command(), Command::Unknown(77));
        // Bytes that are no request header: close.
        for bad in [
            &[0u8; 32][..],
            &header(Command::Read, CmdFlags::empty(), 0, 1, false),
        ] {
            let e = s.parse_request(bad).unwrap_err();
            assert!(
                e.must_close() && matches!(e, RequestError::Malformed(_)),
                "{e:?}"
            );
        }
        assert!(matches!(
            s.parse_request(&header(Command::Read, CmdFlags::empty(), 0, 1, true)[..31]),
            Err(RequestError::Malformed(ProtoError::Truncated {
                need: 32,
                got: 31
            }))
        ));
    }

    #[test]
    fn shutdown_refuses_new_work_but_writes_and_flushes() {
        let mut s = session(false, false);
        s.begin_shutdown();
        let refused = |h: Vec<u8>| match s.parse_request(&h) {
            Err(RequestError::Refused(r)) => Some(r.error()),
            _ => None,
        };
        assert_eq!(
            refused(header(Command::Read, CmdFlags::empty(), 0, 512, false)),
            Some(ErrorValue::Shutdown)
        );
        // even an invalid one
        assert_eq!(
            refused(header(
                Command::Unknown(99),
                CmdFlags::empty(),
                0,
                512,
                false
            )),
            Some(ErrorValue::Shutdown)
        );
        assert!(
            s.parse_request(&header(Command::Write, CmdFlags::empty(), 0, 512, false))
                .is_ok()
        );
        assert!(
            s.parse_request(&header(Command::Flush, CmdFlags::empty(), 0, 0, false))
                .is_ok()
        );
        assert!(
            s.parse_request(&header(Command::Disc, CmdFlags::empty(), 0, 0, false))
                .is_ok()
        );
        // a write that is refused is refused for what is wrong with it
        assert_eq!(
            refused(header(
                Command::Write,
                CmdFlags::empty(),
                1 << 20,
                512,
                false
            )),
            Some(ErrorValue::NoSpc)
        );
    }

    /// A success other than READ's is a simple reply, as with qemu-nbd and nbdkit, unless
    /// extended headers are in use; errors keep the structured chunk and its message.
    #[test]
    fn other_successes_are_simple_replies_unless_extended() {
        for (structured, extended) in [(false, false), (true, false), (true, true)] {
            let s = session(structured, extended);
            let flush = s
                .parse_request(&header(Command::Flush, CmdFlags::empty(), 0, 0, extended))
                .unwrap();
            let mut ok = Vec::new();
            s.reply_not_read(flush.reply_to(), Ok(()), &mut ok);
            if extended {
                let h = StructuredReplyHeader::parse_as(&ok, true).unwrap();
                assert_eq!(h.reply_type, c::REPLY_TYPE_NONE);
            } else {
                assert_eq!(SimpleReply::parse(&ok), Ok(SimpleReply::ok(0xc0c0)));
            }
            let mut err = Vec::new();
            s.reply_not_read(flush.reply_to(), Err(ErrorValue::Io), &mut err);
            let mut want = Vec::new();
            s.reply(flush.reply_to(), Err(ErrorValue::Io), &mut want);
            assert_eq!(err, want, "errors as reply() says them");
        }
    }

    #[test]
    fn an_error_says_its_reason_in_the_chunk_and_nothing_else_without_one() {
        for (structured, extended) in [(false, false), (true, false), (true, true)] {
            let s = session(structured, extended);
            let to = s
                .parse_request(&header(Command::Flush, CmdFlags::empty(), 0, 0, extended))
                .unwrap()
                .reply_to();
            let (mut why, mut plain) = (Vec::new(), Vec::new());
            s.reply_error(
                to,
                ErrorValue::Perm,
                Some("a shrink while another uses it"),
                &mut why,
            );
            s.reply(to, Err(ErrorValue::Perm), &mut plain);
            if !structured {
                assert_eq!(why, plain, "a simple reply has no room for a reason");
                continue;
            }
            for (bytes, want) in [(&why, "a shrink while another uses it"), (&plain, "")] {
                let h = StructuredReplyHeader::parse_as(bytes, extended).unwrap();
                match Chunk::parse(&h, &bytes[h.header_len()..]).unwrap() {
                    Chunk::Error { error, message, .. } => {
                        assert_eq!((error, message), (c::EPERM, want.as_bytes()));
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
    }

    #[test]
    fn replies_follow_the_negotiated_style() {
        for (structured, extended) in [(false, false), (true, false), (true, true)] {
            let s = session(structured, extended);
            let read = s
                .parse_request(&header(
                    Command::Read,
                    CmdFlags::empty(),
                    4096,
                    512,
                    extended,
                ))
                .unwrap();
            let mut ok = Vec::new();
            s.reply(read.reply_to(), Ok(()), &mut ok);
            let mut err = Vec::new();
            s.reply(read.reply_to(), Err(ErrorValue::Io), &mut err);
            let data = s.read_reply_header(&read).unwrap();
            if !structured {
                assert_eq!(SimpleReply::parse(&ok), Ok(SimpleReply::ok(0xc0c0)));
                assert_eq!(
                    SimpleReply::parse(&err).unwrap().error_value(),
                    Some(ErrorValue::Io)
                );
                assert_eq!(*data, SimpleReply::ok(0xc0c0).encode());
                continue;
            }
            let offset = extended.then_some(4096);
            let h = StructuredReplyHeader::parse_as(&ok, extended).unwrap();
            assert!(h.is_done() && h.reply_type == c::REPLY_TYPE_NONE);
            assert_eq!((h.cookie, h.offset), (0xc0c0, offset));
            let h = StructuredReplyHeader::parse_as(&err, extended).unwrap();
            let chunk = Chunk::parse(&h, &err[h.header_len()..]).unwrap();
            assert!(
                matches!(chunk, Chunk::Error { error: c::EIO, .. }),
                "{chunk:?}"
            );
            let h = StructuredReplyHeader::parse_as(&data, extended).unwrap();
            assert_eq!(
                (h.reply_type, h.length, h.offset),
                (c::REPLY_TYPE_OFFSET_DATA, 512 + 8, offset)
            );
            assert_eq!(data[h.header_len()..], 4096u64.to_be_bytes());
            // only a READ has a read reply
            let flush = s
                .parse_request(&header(Command::Flush, CmdFlags::empty(), 0, 0, extended))
                .unwrap();
            assert!(s.read_reply_header(&flush).is_err());
            assert!(s.block_status_reply(&flush, &[], &mut Vec::new()).is_err());
        }
    }

    #[test]
    fn block_status_reply_is_trimmed_to_the_request() {
        let s = session(true, false);
        let req = s
            .parse_request(&header(
                Command::BlockStatus,
                CmdFlags::REQ_ONE,
                0,
                4096,
                false,
            ))
            .unwrap();
        let extents = [Extent {
            length: 1 << 20,
            flags: 3,
        }];
        let mut out = Vec::new();
        s.block_status_reply(&req, &[(1, &extents)], &mut out)
            .unwrap();
        let h = StructuredReplyHeader::parse(&out).unwrap();
        let Ok(Chunk::BlockStatus { extents, .. }) = Chunk::parse(&h, &out[20..]) else {
            panic!()
        };
        assert_eq!(extents[0].length, 4096, "REQ_ONE clips to the request");
    }
}
