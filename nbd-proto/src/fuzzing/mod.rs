//! Fuzzing entry points, shared by the `cargo fuzz` targets in `fuzz/` and by
//! the deterministic property test below (so CI exercises them on stable).
//!
//! Every function takes arbitrary bytes, must never panic, and asserts that
//! outputs stay bounded. Not part of the stable API.
//!
//! One harness per fuzz target beside its invariants; the seed inputs in [`seeds`], the
//! property test in `tests.rs`.

use crate::consts as c;
use crate::flags::{CmdFlags, TransmissionFlags};
use crate::framing::{ClientPhase, FrameLimits, Need, ServerPhase, client_need, server_need};
use crate::handshake::{
    BlockSize, ClientConfig, ClientEvent, ClientHandshake, Export, InfoReply, InfoRequest,
    MetaContextEntry, MetaContextRequest, OptionHeader, OptionReplyHeader, ServerConfig,
    ServerEntry, ServerEvent, ServerHandshake,
};
use crate::reply::{Chunk, SimpleReply, StructuredReplyHeader, select_extents};
use crate::transmission::client::reply_check::{ReplyCheck, Step, simple_data_len};
use crate::transmission::server::{RequestError, ServerTransmission};
use crate::transmission::{Command, ErrorValue, Request, TransmissionInfo, validate_request};
use core::ops::Range;

/// Upper bound on bytes a machine may produce for one input in these harnesses.
pub const MAX_OUTPUT: usize = 1 << 20;

fn server_config(knobs: u8) -> ServerConfig {
    let mut disk = Export::new("disk", 1 << 30);
    disk.description = "fuzz disk".into();
    disk.flags = TransmissionFlags(0x0fff);
    disk.block_size = Some(BlockSize {
        min: 512,
        preferred: 4096,
        max: 1 << 25,
    });
    disk.require_block_size = knobs & 0x40 != 0;
    // A second context, so that queries meet more than base:allocation.
    disk.contexts = vec![crate::consts::QEMU_ALLOCATION_DEPTH.to_owned()];
    ServerConfig {
        exports: vec![disk, Export::new("", 512)],
        default_export: None,
        offer_no_zeroes: knobs & 1 == 0,
        allow_non_fixed_newstyle: knobs & 2 == 0,
        allow_list: knobs & 4 == 0,
        support_go: knobs & 8 == 0,
        support_structured_replies: knobs & 0x10 == 0,
        support_extended_headers: knobs & 0x80 == 0,
        support_meta_contexts: knobs & 0x20 == 0,
        // Every knob bit is taken; STARTTLS is covered by the handshake unit tests.
        tls: crate::handshake::TlsMode::Off,
        max_option_len: 4096 + 64,
        max_options: 64,
    }
}

/// Split `data` into chunks whose sizes are driven by the data itself.
fn chunks(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = data;
    core::iter::from_fn(move || {
        let (&n, tail) = rest.split_first()?;
        let n = (usize::from(n) % 64 + 1).min(tail.len());
        let (head, tail) = tail.split_at(n);
        rest = tail;
        Some(head)
    })
}

/// Server handshake: first byte = config knobs, then the client byte stream,
/// delivered both as a stream (`feed`) and as unframed "messages".
pub fn server_handshake(data: &[u8]) {
    let Some((&knobs, data)) = data.split_first() else {
        return;
    };
    let cfg = server_config(knobs);

    let mut s = ServerHandshake::new(cfg.clone());
    let mut out = Vec::new();
    for chunk in chunks(data) {
        let before = out.len();
        match s.feed(chunk, &mut out) {
            Ok(ServerEvent::Continue) => {}
            Ok(ServerEvent::Done(n)) => {
                assert!(n.export_index < cfg.exports.len());
                assert!(n.flags.contains(TransmissionFlags::HAS_FLAGS));
                break;
            }
            _ => break,
        }
        assert!(out.len() - before <= MAX_OUTPUT);
    }
    assert!(out.len() <= MAX_OUTPUT * 64);

    // message level, without framing: arbitrary slices as messages
    let mut s = ServerHandshake::new(cfg);
    let mut out = Vec::new();
    for msg in chunks(data) {
        out.clear();
        if !matches!(s.handle_message(msg, &mut out), Ok(ServerEvent::Continue)) {
            break;
        }
        assert!(out.len() <= MAX_OUTPUT);
    }
}

/// The client [`client_handshake`] plays for its first byte.
fn client_for(knobs: u8) -> ClientHandshake {
    let cfg = ClientConfig {
        structured_replies: knobs & 1 == 0,
        base_allocation: knobs & 2 == 0,
        no_zeroes: knobs & 4 == 0,
        use_go: knobs & 8 == 0,
        ..ClientConfig::new(if knobs & 0x40 != 0 { "" } else { "disk" })
    };
    match knobs >> 4 & 3 {
        0 | 3 => ClientHandshake::connect(cfg),
        1 => ClientHandshake::list(),
        _ => ClientHandshake::info(cfg),
    }
}

/// Client handshake: first byte selects the goal and config, then the server byte stream.
pub fn client_handshake(data: &[u8]) {
    let Some((&knobs, data)) = data.split_first() else {
        return;
    };
    let make = || client_for(knobs);
    let mut cl = make();
    let mut out = Vec::new();
    for chunk in chunks(data) {
        match cl.feed(chunk, &mut out) {
            Ok(ClientEvent::Continue) => {}
            Ok(ClientEvent::Listed(l)) => {
                assert!(l.len() <= crate::handshake::client::MAX_LIST_ENTRIES);
                break;
            }
            _ => break,
        }
        assert!(out.len() <= MAX_OUTPUT);
    }
    let mut cl = make();
    let mut out = Vec::new();
    for msg in chunks(data) {
        if !matches!(cl.handle_message(msg, &mut out), Ok(ClientEvent::Continue)) {
            break;
        }
        assert!(out.len() <= MAX_OUTPUT);
    }
}

/// Transmission codecs: the server's request parser (and the replies it builds), reply and
/// chunk parse, and the handshake payload parsers.
pub fn transmission(data: &[u8]) {
    for extended in [false, true] {
        transmission_request(data, extended);
    }
    transmission_reply(data);
}

/// The server session the bytes after a request header describe (export size, flags, block
/// sizes, and a shutdown knob), and whether it is shutting down.
fn transmission_session(data: &[u8], extended: bool) -> (ServerTransmission, bool) {
    let tail = data
        .get(Request::header_len(extended)..)
        .unwrap_or_default();
    let mut r = crate::wire::Reader::new(tail);
    let mut info = TransmissionInfo::new(
        r.u64().unwrap_or(1 << 20),
        TransmissionFlags(r.u16().unwrap_or(0xffff)),
    );
    let extra = r.u32().unwrap_or(0);
    info.structured_replies = extra & 1 != 0;
    info.has_meta_context = extra & 2 != 0;
    info.block_size = BlockSize {
        min: 1 << (extra >> 2 & 15),
        preferred: 4096,
        max: r.u32().unwrap_or(u32::MAX),
    };
    info.df_max_len = r.u32().unwrap_or(u32::MAX);
    info.extended_headers = extended;
    let mut server = ServerTransmission::from_info(info);
    let shutting_down = extra & 0x40 != 0;
    if shutting_down {
        server.begin_shutdown();
    }
    (server, shutting_down)
}

fn transmission_request(data: &[u8], extended: bool) {
    let (server, shutting_down) = transmission_session(data, extended);
    let info = server.info().clone();
    let parsed = server.parse_request(data);
    let Ok(req) = Request::parse(data, extended) else {
        // exactly the headers that do not parse must close the connection
        assert!(parsed.is_err_and(|e| e.must_close()));
        return;
    };
    let header = req.encode(extended).expect("a parsed request encodes");
    assert_eq!(Request::parse(&header, extended), Ok(req));
    let mut reply = Vec::new();
    match parsed {
        Ok(valid) => {
            assert_eq!(valid.cookie(), req.cookie);
            let command = *valid.command();
            assert_eq!(command.command(), req.command);
            // the typed command agrees with the public checks (during a shutdown fewer pass)
            assert!(req.command == Command::Disc || validate_request(&req, &info).is_ok());
            assert!(
                !shutting_down
                    || matches!(req.command, Command::Disc | Command::Write | Command::Flush)
            );
            use crate::transmission::ValidCommand as V;
            match command {
                V::Read { range, .. }
                | V::Write { range, .. }
                | V::Trim { range, .. }
                | V::Cache { range }
                | V::WriteZeroes { range, .. }
                | V::BlockStatus { range, .. } => {
                    // accepted ranges really are in range, and are what was asked
                    assert_eq!((range.offset(), range.len()), (req.offset, req.length));
                    assert!(
                        req.offset
                            .checked_add(req.length)
                            .is_some_and(|e| e <= info.size)
                    );
                    assert_eq!(range.end(), req.offset + req.length);
                    let min = u64::from(info.block_size.min.max(1));
                    assert!(range.offset() % min == 0 && range.len() % min == 0);
                    // the maximum block size caps payloads: READ and WRITE only
                    if matches!(command, V::Read { .. } | V::Write { .. }) {
                        assert!(range.len() <= u64::from(info.block_size.max));
                    }
                }
                V::BlockStatusPayload { payload_len, .. } => assert_eq!(payload_len, req.length),
                V::Flush => assert_eq!((req.offset, req.length), (0, 0)),
                V::Disc | V::Resize { .. } => {}
            }
            // only a WRITE carries a payload (a DISC is valid whatever its flags say: the
            // server closes the connection on it without reading on)
            assert_eq!(valid.payload_len(), command.payload_len());
            assert!(
                req.payload_len(extended) == valid.payload_len() || req.command == Command::Disc
            );
            if let V::Read { range, .. } = command
                && !range.is_empty()
            {
                let h = server
                    .read_reply_header(&valid)
                    .expect("a valid read has a reply");
                check_reply_echoes(&h, &server, &req);
            }
            server.reply(valid.reply_to(), Ok(()), &mut reply);
        }
        Err(RequestError::Refused(refusal)) => {
            assert_eq!(refusal.cookie(), req.cookie);
            assert_eq!(refusal.command(), req.command);
            // the payload is read on before the error reply, or the stream loses its place
            assert_eq!(refusal.payload_len(), req.payload_len(extended));
            // (a BLOCK_STATUS payload's length is checked against the contexts selected,
            // which validate_request does not know)
            let payload_form = req.command == Command::BlockStatus
                && req.flags.contains(crate::flags::CmdFlags::PAYLOAD_LEN);
            if refusal.error() != ErrorValue::Shutdown && !payload_form {
                assert_eq!(validate_request(&req, &info), Err(refusal.error()));
            }
            server.reply(refusal.reply_to(), Err(refusal.error()), &mut reply);
        }
        Err(e) => panic!("a parsed header is not malformed: {e}"),
    }
    check_reply_echoes(&reply, &server, &req);
}

/// A reply (or reply header) of `server`'s style answers `req`: its cookie, and with extended
/// headers its offset.
fn check_reply_echoes(reply: &[u8], server: &ServerTransmission, req: &Request) {
    let extended = server.info().extended_headers;
    if server.info().structured_replies {
        let h = StructuredReplyHeader::parse_as(reply, extended).expect("a reply parses");
        assert_eq!(h.cookie, req.cookie);
        assert_eq!(h.offset, extended.then_some(req.offset));
        assert!(h.is_done());
    } else {
        assert_eq!(
            SimpleReply::parse(reply).expect("a reply parses").cookie,
            req.cookie
        );
    }
}

fn transmission_reply(data: &[u8]) {
    if let Ok(r) = SimpleReply::parse(data) {
        assert_eq!(SimpleReply::parse(&r.encode()), Ok(r));
        let _ = r.error_value();
    }
    for extended in [false, true] {
        let Ok(h) = StructuredReplyHeader::parse_as(data, extended) else {
            continue;
        };
        assert_eq!(
            StructuredReplyHeader::parse_as(&h.encode(), extended),
            Ok(h)
        );
        let payload = &data[h.header_len()..];
        // also try the payload with a header length that matches it
        let mut h2 = h;
        h2.length = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        for hh in [h, h2] {
            if let Ok(Chunk::BlockStatus { extents, .. }) = Chunk::parse(&hh, payload) {
                let each = if extended { 16 } else { 8 };
                assert!(extents.len() * each < payload.len());
                let sel = select_extents(CmdFlags(hh.flags.bits()), hh.length.into(), &extents);
                assert!(sel.len() <= extents.len());
            }
        }
    }
    let _ = InfoRequest::parse(data);
    let _ = MetaContextRequest::parse(data);
    if let Ok(i) = InfoReply::parse(data) {
        let _ = i.encode();
    }
    let _ = ServerEntry::parse(data);
    let _ = MetaContextEntry::parse(data);
    let _ = crate::handshake::Greeting::parse(data);
    let _ = crate::handshake::OptionReplyHeader::parse(data);
    let _ = crate::handshake::ExportNameReply::parse(data, data.len() == 10);
}

/// Framers: every phase against the input, with answers checked against the parsers.
///
/// Every answer is passed through [`core::hint::black_box`] and cross-checked against code
/// outside the framer. The first version only asserted bounds that hold by construction
/// (`header_len <= 134`, `body_len <= limit`): the optimiser proved them, the framers' results
/// were then unused, and the whole call was deleted as dead code, so libFuzzer saw no
/// coverage to grow (issue 18: one 1-byte input, coverage 16, after 2 M executions).
pub fn framers(data: &[u8]) {
    let limits = FrameLimits {
        max_option_len: 1000,
        max_write_len: 5000,
        max_reply_len: 7000,
    };
    for p in 0..=4u8 {
        let Some(phase) = ServerPhase::from_u8(p) else {
            continue;
        };
        let need = |d: &[u8]| server_need(phase, d, &limits);
        check_stable(&need, data);
        if let Need::Message {
            header_len,
            body_len,
        } = need(data)
        {
            match phase {
                ServerPhase::ClientFlags => assert_eq!((header_len, body_len), (4, 0)),
                ServerPhase::Options => {
                    let h = OptionHeader::parse(data).expect("framed option header parses");
                    assert_eq!((header_len, body_len), (16, h.length as usize));
                }
                ServerPhase::Transmission => {
                    assert_eq!(header_len, c::REQUEST_LEN);
                    let write = crate::wire::be_u16(data, 6) == Some(c::CMD_WRITE);
                    let len = crate::wire::be_u32(data, 24).expect("framed request header");
                    assert_eq!(body_len, if write { len as usize } else { 0 });
                    let req = Request::parse(data, false).expect("framed request parses");
                    assert_eq!(body_len as u64, req.payload_len(false));
                }
                ServerPhase::TransmissionExtended => {
                    assert_eq!(header_len, c::EXTENDED_REQUEST_LEN);
                    let req = Request::parse(data, true).expect("framed request parses");
                    assert_eq!(body_len as u64, req.payload_len(true));
                }
            }
        }
        server_placement(phase, data, &limits);
    }
    // Which cookies are pending reads, and their lengths, follow from the cookie.
    let read_len = |cookie: u64| (!cookie.is_multiple_of(3)).then_some((cookie % 10_000) as u32);
    for p in 0..=7u8 {
        let Some(phase) = ClientPhase::from_u8(p) else {
            continue;
        };
        let need = |d: &[u8]| client_need(phase, d, &limits, read_len);
        check_stable(&need, data);
        let Need::Message {
            header_len,
            body_len,
        } = need(data)
        else {
            continue;
        };
        match phase {
            ClientPhase::Greeting => assert_eq!(header_len + body_len, c::GREETING_LEN),
            ClientPhase::ExportNameReply => assert_eq!(header_len + body_len, 134),
            ClientPhase::ExportNameReplyNoZeroes => assert_eq!(header_len + body_len, 10),
            ClientPhase::Options => {
                let h = OptionReplyHeader::parse(data).expect("framed option reply parses");
                assert_eq!((header_len, body_len), (20, h.length as usize));
            }
            ClientPhase::Transmission => {
                if let Ok(h) = StructuredReplyHeader::parse(data) {
                    assert_eq!((header_len, body_len), (20, h.length as usize));
                } else {
                    let r = SimpleReply::parse(data).expect("framed reply parses");
                    let body = if r.error == 0 {
                        read_len(r.cookie).unwrap_or(0)
                    } else {
                        0
                    };
                    assert_eq!((header_len, body_len), (16, body as usize));
                }
            }
            ClientPhase::TransmissionExtended => {
                let h = StructuredReplyHeader::parse_as(data, true).expect("framed reply parses");
                assert_eq!((header_len, body_len), (32, h.length as usize));
            }
            ClientPhase::Closed => unreachable!("no message is framed once closed"),
        }
    }
}

/// The server's placement machine in `phase` against `data`: it frames as [`server_need`]
/// does, its request is what [`ServerTransmission::parse_request`] makes of the header, a
/// payload comes whole in pieces of at most the chunk, and a placed WRITE is valid, inside
/// the export, from the placement offset on and at least the placement minimum.
fn server_placement(phase: ServerPhase, data: &[u8], limits: &FrameLimits) {
    use crate::placement::server::{PlaceWrites, ServerFrame, ServerPlacement};
    use crate::transmission::server::RequestError;
    use crate::transmission::{TransmissionInfo, ValidCommand};
    const CHUNK: usize = 1000;
    let place = PlaceWrites {
        min_len: 1024,
        from: 4096,
    };
    let extended = phase == ServerPhase::TransmissionExtended;
    let mut info = TransmissionInfo::new(
        1 << 20,
        crate::flags::TransmissionFlags(!crate::flags::TransmissionFlags::READ_ONLY.0),
    );
    info.structured_replies = data.first().is_some_and(|b| b & 1 == 0) || extended;
    info.has_meta_context = info.structured_replies;
    info.extended_headers = extended;
    let session = ServerTransmission::from_info(info);
    let mut machine = ServerPlacement::new(*limits, CHUNK);
    let in_transmission = matches!(
        phase,
        ServerPhase::Transmission | ServerPhase::TransmissionExtended
    );
    if in_transmission {
        machine.start_transmission(session.clone(), Some(place));
    }
    let mut now = phase;
    let frame = core::hint::black_box(machine.frame(&mut now, data));
    let (total, first) = match (frame, server_need(phase, data, limits)) {
        (ServerFrame::NeedHeader(n), Need::Header(m)) => return assert_eq!(n, m),
        (ServerFrame::NeedHeader(n), Need::Message { header_len, .. }) => {
            return assert!(n == header_len && data.len() < n);
        }
        (ServerFrame::Invalid(a), Need::Invalid(b)) => return assert_eq!(a, b),
        (
            ServerFrame::Message {
                header_len,
                body_len,
            },
            need,
        ) => {
            assert!(!in_transmission);
            let total = Some(header_len + body_len);
            return assert_eq!(total, need.total());
        }
        (
            ServerFrame::Request {
                header_len,
                body_len,
                request,
            },
            need,
        ) => {
            let parsed = session.parse_request(data).map_err(|e| match e {
                RequestError::Refused(r) => r,
                RequestError::Malformed(e) => panic!("a framed request does not parse: {e}"),
            });
            assert_eq!(request, parsed);
            let total = need.total().expect("framed") - header_len;
            assert_eq!(body_len, total.min(CHUNK));
            (total, body_len)
        }
        (
            ServerFrame::PlacedWrite {
                header_len,
                offset,
                len,
                request,
            },
            need,
        ) => {
            assert_eq!(session.parse_request(data), Ok(request));
            let ValidCommand::Write { range, .. } = *request.command() else {
                panic!("placed a {request:?}");
            };
            assert_eq!((range.offset(), range.len()), (offset, u64::from(len)));
            assert!(offset >= place.from && len >= place.min_len && range.end() <= 1 << 20);
            assert_eq!(need.total(), Some(header_len + len as usize));
            return;
        }
        (a, b) => panic!("the placement machine says {a:?}, the framer {b:?}"),
    };
    // The rest of the payload, in pieces of at most the chunk, then the next header.
    let mut got = first;
    while got < total {
        let ServerFrame::Payload { len } = machine.frame(&mut now, &[]) else {
            panic!("a payload cut short at {got} of {total}");
        };
        assert!(len > 0 && len <= CHUNK);
        got += len;
    }
    assert_eq!(got, total);
    assert!(matches!(
        machine.frame(&mut now, &[]),
        ServerFrame::NeedHeader(_)
    ));
}

/// The contract a transport relies on: the answer depends only on the header, so more bytes
/// never change a decided answer, and `Header(n)` asks for more than it was shown.
fn check_stable(need: &impl Fn(&[u8]) -> Need, data: &[u8]) {
    let answer = core::hint::black_box(need(data));
    match answer {
        Need::Header(n) => assert!(n > data.len() && n <= 32),
        Need::Message { header_len, .. } => {
            // the header alone gives the same answer (when the phase needs to look at it)
            if header_len <= data.len() {
                assert_eq!(need(&data[..header_len]), answer);
            }
        }
        Need::Invalid(_) => {}
    }
    if !matches!(answer, Need::Header(_)) {
        let mut longer = data.to_vec();
        longer.extend_from_slice(&[0xa5; 32]);
        assert_eq!(need(&longer), answer);
    }
    // a shorter prefix never decides differently: it is undecided or gives the same answer
    if let Some(short) = data.len().checked_sub(1) {
        match need(&data[..short]) {
            Need::Header(n) => assert!(n > short),
            other => assert_eq!(other, answer),
        }
    }
}

/// The cookie of the request whose reply [`replies`] plays.
pub const REPLY_COOKIE: u64 = 0x5eed;

/// One request and a hostile server's reply stream for it, through the client's checks
/// ([`ReplyCheck`]): byte 0 = knobs (bits 0-1 command: READ, BLOCK_STATUS, WRITE, READ;
/// bit 2 no structured replies; bit 3 no `base:allocation` context, else its id is bits 4-7),
/// bytes 1..9 the offset and 9..13 the length of the request, then the server's bytes,
/// framed as the client frames them.
///
/// Asserts what a client relies on: every accepted data or hole chunk lies in the request's
/// buffer and its source in the message, no byte of the buffer is covered twice, extents are
/// contiguous inside the request, a read reported complete had every byte covered, and peer
/// text is bounded once made printable.
pub fn replies(data: &[u8]) {
    crate::fuzzing::client_session::replies(data);
    let mut r = crate::wire::Reader::new(data);
    let knobs = r.bytes(1).map_or(0, |b| b[0]);
    let offset = r.u64().unwrap_or(0);
    let length = r.u32().unwrap_or(0);
    let stream = r.rest();
    let command = match knobs & 3 {
        1 => Command::BlockStatus,
        2 => Command::Write,
        _ => Command::Read,
    };
    let structured = knobs & 4 == 0;
    let ctx = (knobs & 8 == 0).then_some(u32::from(knobs >> 4));
    let req = Request {
        flags: CmdFlags::empty(),
        command,
        cookie: REPLY_COOKIE,
        offset,
        length: length.into(),
    };
    let limits = FrameLimits::default();
    let mut check = ReplyCheck::new(&req);
    // Buffer ranges written so far (a chunk is a few dozen bytes, so at most ~150 of them).
    let mut written: Vec<Range<usize>> = Vec::new();
    let mut next_extent = offset;
    let mut rest = stream;
    loop {
        let need = client_need(ClientPhase::Transmission, rest, &limits, |cookie| {
            if cookie == REPLY_COOKIE {
                simple_data_len(&req)
            } else {
                None
            }
        });
        let Need::Message {
            header_len,
            body_len,
        } = need
        else {
            break;
        };
        let Some((msg, tail)) = rest.split_at_checked(header_len + body_len) else {
            break; // truncated: the client waits for more
        };
        rest = tail;
        let payload = &msg[header_len..];
        let accepted = if header_len == c::SIMPLE_REPLY_LEN {
            let reply = SimpleReply::parse(msg).expect("the framer found a simple reply");
            if reply.cookie != REPLY_COOKIE {
                break; // unknown cookie: the client ends the connection
            }
            check.simple(&reply, body_len)
        } else {
            let h = StructuredReplyHeader::parse(msg).expect("the framer found a chunk");
            if !structured || h.cookie != REPLY_COOKIE {
                break;
            }
            check.chunk(&h, payload, |id| Some(id) == ctx)
        };
        let Ok(accepted) = accepted else {
            break; // a protocol violation ends the connection
        };
        match accepted.step {
            Step::Data { src, dst } => {
                assert!(src.start <= src.end && src.end <= payload.len());
                assert_eq!(src.len(), dst.len());
                place(&mut written, dst, length);
            }
            Step::Zero { dst } => {
                assert!(!dst.is_empty());
                place(&mut written, dst, length);
            }
            Step::Extents(extents) => {
                assert_eq!(command, Command::BlockStatus);
                for e in extents {
                    assert_eq!(e.offset, next_extent);
                    assert!(e.length > 0);
                    next_extent = e.offset.checked_add(e.length).expect("inside the request");
                    assert!(next_extent - offset <= u64::from(length));
                }
            }
            Step::Error { message, .. } => {
                let shown = crate::peer_text::printable(message);
                assert!(shown.chars().count() <= crate::peer_text::MAX_SHOWN + 3);
                assert!(!shown.chars().any(char::is_control));
            }
            _ => {}
        }
        assert_eq!(accepted.done, check.is_done());
        if accepted.done {
            let filled: usize = written.iter().map(|w| w.len()).sum();
            match check.finish() {
                Ok(()) if command == Command::Read => assert_eq!(filled as u64, u64::from(length)),
                Ok(()) if command == Command::BlockStatus => assert!(next_extent > offset),
                Err(crate::transmission::client::reply_check::Unanswered::ReadIncomplete {
                    covered,
                    ..
                }) => {
                    assert_eq!(covered, filled as u64);
                    assert!(covered < u64::from(length));
                }
                _ => {}
            }
            break;
        }
    }
}

/// Records `dst` as written, asserting it lies in a buffer of `len` bytes and touches no
/// byte written before.
fn place(written: &mut Vec<Range<usize>>, dst: Range<usize>, len: u32) {
    assert!(dst.start <= dst.end && dst.end as u64 <= u64::from(len));
    for w in written.iter() {
        assert!(
            dst.end <= w.start || w.end <= dst.start || dst.is_empty(),
            "byte covered twice"
        );
    }
    written.push(dst);
}

mod seeds;
pub use seeds::*;

pub mod client_session;

#[cfg(test)]
mod tests;
