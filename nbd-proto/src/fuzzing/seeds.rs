//! The seed inputs of the fuzz targets: real conversations between this crate's machines and
//! real request/reply streams, as [`super`]'s harnesses read them.

use super::*;

/// Record a real conversation: (client→server stream, server→client stream).
pub fn transcript(client: ClientHandshake, knobs: u8) -> (Vec<u8>, Vec<u8>) {
    let mut server = ServerHandshake::new(server_config(knobs));
    let mut client = client;
    let mut s2c_log = server.greeting().to_vec();
    let mut c2s_log = Vec::new();
    let mut s2c = s2c_log.clone();
    for _ in 0..50 {
        let mut c2s = Vec::new();
        let cr = client.feed(&core::mem::take(&mut s2c), &mut c2s);
        c2s_log.extend_from_slice(&c2s);
        let sr = server.feed(&c2s, &mut s2c);
        s2c_log.extend_from_slice(&s2c);
        if !matches!(cr, Ok(ClientEvent::Continue)) || !matches!(sr, Ok(ServerEvent::Continue)) {
            // deliver the last server output too
            let _ = client.feed(&s2c, &mut Vec::new());
            break;
        }
    }
    (c2s_log, s2c_log)
}

/// `stream` cut into the messages `frame` finds, in order (any rest last); `handle` moves
/// the machine on and says whether it expects more.
fn split_messages(
    mut stream: &[u8],
    mut frame: impl FnMut(&[u8]) -> Need,
    mut handle: impl FnMut(&[u8]) -> bool,
) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some(n) = frame(stream)
        .total()
        .filter(|&n| n > 0 && n <= stream.len())
    {
        let (msg, rest) = stream.split_at(n);
        out.push(msg);
        stream = rest;
        if !handle(msg) {
            break;
        }
    }
    if !stream.is_empty() {
        out.push(stream);
    }
    out
}

/// The messages of a client-to-server stream, as the server for `knobs` frames them.
fn server_messages(knobs: u8, stream: &[u8]) -> Vec<&[u8]> {
    let s = core::cell::RefCell::new(ServerHandshake::new(server_config(knobs)));
    split_messages(
        stream,
        |m| {
            let s = s.borrow();
            server_need(s.phase(), m, &s.frame_limits())
        },
        |m| {
            let r = s.borrow_mut().handle_message(m, &mut Vec::new());
            matches!(r, Ok(ServerEvent::Continue))
        },
    )
}

/// The messages of a server-to-client stream, as the client for `knobs` frames them.
fn client_messages(knobs: u8, stream: &[u8]) -> Vec<&[u8]> {
    let cl = core::cell::RefCell::new(client_for(knobs));
    split_messages(
        stream,
        |m| {
            let c = cl.borrow();
            client_need(c.phase(), m, &c.frame_limits(), |_| None)
        },
        |m| {
            let r = cl.borrow_mut().handle_message(m, &mut Vec::new());
            matches!(r, Ok(ClientEvent::Continue))
        },
    )
}

/// Messages in the handshake harnesses' input format (the inverse of [`chunks`]): each
/// piece of at most 64 bytes is preceded by its length - 1; a message longer than 64 bytes
/// spans several pieces (whole for `feed`, split for `handle_message`).
fn as_chunks(messages: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for piece in messages.iter().flat_map(|m| m.chunks(64)) {
        out.push((piece.len() - 1) as u8);
        out.extend_from_slice(piece);
    }
    out
}

/// Named inputs for one fuzz target.
pub type Seeds = Vec<(String, Vec<u8>)>;

/// Seed inputs per fuzz target, `(target, [(name, bytes)])`: real conversations between
/// this crate's client and server machines, and real request/reply streams built with the
/// encoders the server uses (plus the hostile replies of issue 18). Committed under
/// `fuzz/seeds/TARGET/NAME`; the test `committed_seeds_are_current` fails when they drift,
/// and `QPIP_WRITE_SEEDS=1 cargo test -p nbd-proto committed_seeds` rewrites them.
pub fn seeds() -> Vec<(&'static str, Seeds)> {
    let (c2s_seeds, s2c_seeds) = handshake_seeds();
    let requests = request_seeds();
    let replies = reply_seeds();
    let framers = framer_seeds(&c2s_seeds, &s2c_seeds, &requests, &replies);
    let transmission = transmission_seeds(requests, &replies);
    vec![
        ("server_handshake", c2s_seeds),
        ("client_handshake", s2c_seeds),
        ("transmission", transmission),
        ("framers", framers),
        ("replies", replies),
    ]
}

/// The handshake harnesses' seeds, (client→server, server→client): a transcript for each of
/// the client's goals and configs × the server's configs.
fn handshake_seeds() -> (Seeds, Seeds) {
    let mut c2s_seeds = Vec::new();
    let mut s2c_seeds = Vec::new();
    let clients: [(&str, u8); 7] = [
        ("connect-go", 0x00),
        ("connect-default-export", 0x40),
        ("connect-export-name", 0x08),
        ("connect-no-structured", 0x01),
        ("connect-no-zeroes-off", 0x04),
        ("list", 0x10),
        ("info", 0x20),
    ];
    let servers: [(&str, u8); 5] = [
        ("default", 0x00),
        ("no-go", 0x08),
        ("no-structured", 0x10),
        ("strict-no-zeroes-off", 0x02 | 0x01),
        ("block-size", 0x40),
    ];
    for (cname, cknobs) in clients {
        for (sname, sknobs) in servers {
            let (c2s, s2c) = transcript(client_for(cknobs), sknobs);
            let mut a = vec![sknobs];
            a.extend(as_chunks(&server_messages(sknobs, &c2s)));
            c2s_seeds.push((format!("{cname}.{sname}"), a));
            let mut b = vec![cknobs];
            b.extend(as_chunks(&client_messages(cknobs, &s2c)));
            s2c_seeds.push((format!("{cname}.{sname}"), b));
        }
    }
    (c2s_seeds, s2c_seeds)
}

/// Requests as a server receives them, each followed by what the transmission harness reads
/// after the header: the export's size, flags (all but READ_ONLY) and limits, then a write's
/// payload.
fn request_seeds() -> Seeds {
    let request = |command, flags: u16, offset, length: u32| {
        Request {
            flags: CmdFlags(flags),
            command,
            cookie: REPLY_COOKIE,
            offset,
            length: length.into(),
        }
        .encode(false)
        .expect("a 32-bit length")
        .to_vec()
    };
    let mut requests = vec![
        ("read".to_string(), request(Command::Read, 0, 512, 4096)),
        (
            "write-fua".to_string(),
            request(Command::Write, c::CMD_FLAG_FUA, 4096, 512),
        ),
        (
            "block-status".to_string(),
            request(Command::BlockStatus, c::CMD_FLAG_REQ_ONE, 0, 1 << 20),
        ),
        ("trim".to_string(), request(Command::Trim, 0, 0, 1 << 16)),
        ("flush".to_string(), request(Command::Flush, 0, 0, 0)),
        ("disc".to_string(), request(Command::Disc, 0, 0, 0)),
    ];
    for (name, r) in &mut requests {
        r.extend_from_slice(&(1u64 << 30).to_be_bytes());
        r.extend_from_slice(&(0x0fffu16 & !c::FLAG_READ_ONLY).to_be_bytes());
        r.extend_from_slice(&(1u32 | 2 | 9 << 2).to_be_bytes());
        r.extend_from_slice(&(1u32 << 25).to_be_bytes());
        r.extend_from_slice(&(1u32 << 25).to_be_bytes());
        if name.starts_with("write") {
            r.extend_from_slice(&[0x5a; 512]);
        }
    }
    requests
}

/// The replies harness's seeds: each of [`reply_streams`] behind its knobs, offset and
/// length (13 bytes).
fn reply_seeds() -> Seeds {
    let mut replies = Vec::new();
    for (name, knobs, offset, length, stream) in reply_streams() {
        let mut v = vec![knobs];
        v.extend_from_slice(&offset.to_be_bytes());
        v.extend_from_slice(&length.to_be_bytes());
        v.extend_from_slice(&stream);
        replies.push((name.to_string(), v));
    }
    replies
}

/// Reply streams for one request, as a client receives them: (name, knobs, offset, length,
/// server bytes), well-formed ones and the hostile ones of issue 18.
fn reply_streams() -> Vec<(&'static str, u8, u64, u32, Vec<u8>)> {
    use crate::reply::{
        Extent, block_status_chunk, error_chunk, none_chunk, offset_data_header, offset_hole,
    };

    let ck = REPLY_COOKIE;
    let ok = |v: Result<Vec<u8>, crate::ProtoError>| v.expect("valid by construction");
    let data = |offset: u64, n: u32, last: bool| -> Result<Vec<u8>, crate::ProtoError> {
        let mut v = offset_data_header(ck, last, offset, n)?.to_vec();
        v.extend((0..n).map(|i| i as u8));
        Ok(v)
    };
    let cat = |parts: &[&[u8]]| parts.concat();
    let ext = |length, flags| Extent { length, flags };
    let mut simple_read = SimpleReply::ok(ck).encode().to_vec();
    simple_read.extend_from_slice(&[0x11; 256]);
    let mut err = Vec::new();
    error_chunk(ck, true, ErrorValue::Io, "read failed", &mut err);
    let mut err_escape = Vec::new();
    error_chunk(
        ck,
        true,
        ErrorValue::Perm,
        "\u{1b}[2J\u{1b}]0;owned\u{7}",
        &mut err_escape,
    );
    let mut bs = Vec::new();
    block_status_chunk(
        ck,
        true,
        1,
        &[ext(4096, 0), ext(8192, 3), ext(1 << 20, 0)],
        &mut bs,
    )
    .expect("nonzero extents");
    let mut bs_other = Vec::new();
    block_status_chunk(ck, false, 2, &[ext(512, 3)], &mut bs_other).expect("nonzero extents");
    vec![
        ("read-simple", 0x10, 4096, 256, simple_read),
        (
            "read-simple-error",
            0x10,
            4096,
            256,
            SimpleReply::err(ck, ErrorValue::Io).encode().to_vec(),
        ),
        (
            "read-data-in-order",
            0x10,
            4096,
            256,
            cat(&[
                &ok(data(4096, 128, false)),
                &ok(data(4096 + 128, 128, false)),
                &none_chunk(ck),
            ]),
        ),
        (
            "read-data-hole-out-of-order",
            0x10,
            4096,
            256,
            cat(&[
                &ok(data(4096 + 192, 64, false)),
                &ok(offset_hole(ck, false, 4096 + 64, 128).map(|h| h.to_vec())),
                &ok(data(4096, 64, true)),
            ]),
        ),
        (
            "read-error-chunk",
            0x10,
            0,
            512,
            cat(&[&ok(data(0, 100, false)), &err]),
        ),
        ("read-error-escapes", 0x10, 0, 512, err_escape),
        (
            "read-wrapping-offset",
            0x10,
            0,
            1 << 20,
            ok(data(u64::MAX - 7, 16, true)),
        ),
        (
            "read-overlap",
            0x10,
            0,
            64,
            cat(&[&ok(data(0, 40, false)), &ok(data(32, 32, true))]),
        ),
        (
            "read-outside",
            0x10,
            1024,
            64,
            ok(data(1024 + 32, 64, true)),
        ),
        ("block-status", 0x11, 0, 1 << 20, cat(&[&bs_other, &bs])),
        (
            "write-ack",
            0x12,
            0,
            4096,
            SimpleReply::ok(ck).encode().to_vec(),
        ),
    ]
}

/// The framers harness's seeds: every phase's bytes, the first handshake streams both ways,
/// the requests' headers and the reply streams.
fn framer_seeds(c2s_seeds: &Seeds, s2c_seeds: &Seeds, requests: &Seeds, replies: &Seeds) -> Seeds {
    let mut framers: Vec<(String, Vec<u8>)> = Vec::new();
    for (dir, seeds) in [("c2s", c2s_seeds), ("s2c", s2c_seeds)] {
        for (name, v) in seeds.iter().take(2) {
            let stream: Vec<u8> = chunks(&v[1..]).flatten().copied().collect();
            framers.push((format!("{dir}-{name}"), stream));
        }
    }
    for (name, v) in requests {
        framers.push((format!("request-{name}"), v[..c::REQUEST_LEN].to_vec()));
    }
    for (name, v) in replies {
        framers.push((format!("reply-{name}"), v[13..].to_vec()));
    }
    framers
}

/// The transmission harness's seeds: the requests, the reply streams, and an option (bytes
/// from the wrong phase).
fn transmission_seeds(requests: Seeds, replies: &Seeds) -> Seeds {
    let mut transmission = requests;
    for (name, v) in replies {
        transmission.push((format!("reply-{name}"), v[13..].to_vec()));
    }
    let mut opt = Vec::new();
    crate::handshake::encode_option(
        c::OPT_GO,
        &InfoRequest {
            name: "disk",
            items: vec![c::INFO_BLOCK_SIZE],
        }
        .encode()
        .expect("valid by construction"),
        &mut opt,
    );
    transmission.push(("option-go".into(), opt[c::OPTION_HEADER_LEN..].to_vec()));
    transmission
}
