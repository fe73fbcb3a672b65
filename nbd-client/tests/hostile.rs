//! The client against a hostile server: a fake NBD server (nbd-proto's own handshake, then
//! crafted replies) answers every READ with a reply that breaks the protocol. The client must
//! fail the request with a clear error, never panic, never write outside the caller's buffer,
//! never reconnect in a loop, and never print the server's text raw.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nbd_client::{Client, ClientOptions, Error};
use nbd_proto::consts as c;
use nbd_proto::flags::ReplyFlags;
use nbd_proto::handshake::{Export, ServerConfig};
use nbd_proto::reply::{ReplyTo, StructuredReplyHeader, none_chunk, offset_data_header};
use nbd_proto::transmission::{Command, Request};

const SIZE: u64 = 16 << 20;

/// What the fake server sends for one READ: the bytes, and whether to close afterwards.
type Answer = Box<dyn Fn(&Request) -> (Vec<u8>, bool) + Send + Sync>;

struct Hostile {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl Hostile {
    /// Compact headers: the answers are structured chunks or simple replies.
    fn start(answer: Answer) -> Hostile {
        Self::start_with(vec![SIZE], false, answer)
    }

    /// Connection `i` reports export size `sizes[i]` (the last one for every later one).
    fn start_sized(sizes: Vec<u64>, answer: Answer) -> Hostile {
        Self::start_with(sizes, false, answer)
    }

    /// Extended headers offered: the answers are extended chunks.
    fn start_extended(answer: Answer) -> Hostile {
        Self::start_with(vec![SIZE], true, answer)
    }

    fn start_with(sizes: Vec<u64>, extended: bool, answer: Answer) -> Hostile {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let answer = Arc::new(answer);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let i = count.fetch_add(1, Ordering::SeqCst);
                let size = sizes[i.min(sizes.len() - 1)];
                let answer = answer.clone();
                std::thread::spawn(move || serve(s, size, extended, &answer));
            }
        });
        Hostile { addr, accepted }
    }

    fn uri(&self) -> String {
        format!("nbd://{}/disk", self.addr)
    }

    fn connections(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

/// One connection: an honest handshake, then `answer` for each READ, honest replies else.
fn serve(mut s: TcpStream, size: u64, extended: bool, answer: &Answer) {
    let config = ServerConfig {
        support_extended_headers: extended,
        ..ServerConfig::new(vec![Export::new("disk", size)])
    };
    let Some(mut pending) = qpip_test_support::fake::handshake(&mut s, config) else {
        return;
    };
    let mut buf = vec![0u8; 64 << 10];
    let header_len = Request::header_len(extended);
    loop {
        while pending.len() < header_len {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
        }
        let Ok(req) = Request::parse(&pending, extended) else {
            return;
        };
        let need = header_len + req.payload_len(extended) as usize;
        while pending.len() < need {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
        }
        pending.drain(..need);
        let (bytes, close) = match req.command {
            Command::Read => answer(&req),
            Command::Disc => return,
            _ => (none_chunk(ReplyTo::new(&req, extended)).to_vec(), false),
        };
        if s.write_all(&bytes).is_err() || close {
            return;
        }
    }
}

fn chunk(flags: ReplyFlags, reply_type: u16, cookie: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = StructuredReplyHeader {
        flags,
        reply_type,
        cookie,
        length: payload.len() as u32,
        offset: None,
    }
    .encode()
    .to_vec();
    v.extend_from_slice(payload);
    v
}

fn data_chunk(cookie: u64, last: bool, offset: u64, len: usize) -> Vec<u8> {
    let mut v = offset_data_header(cookie, last, offset, len as u32)
        .unwrap()
        .to_vec();
    v.resize(v.len() + len, 0xEE);
    v
}

fn options() -> ClientOptions {
    ClientOptions {
        reconnect_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        request_timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    }
}

/// Reads 4 KiB at 64 KiB into the middle of a guarded buffer, once into memory of the
/// caller's (the client copies) and once into registered memory (the NIC places READ data
/// there itself); returns the error, which must be the same both ways. The guard bytes
/// around the buffer must be untouched, and the client must not have reconnected.
fn read_fails(h: &Hostile) -> Error {
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mut buf = vec![0x55u8; 3 * 4096];
    let t = Instant::now();
    let e = client
        .read_at(64 << 10, &mut buf[4096..8192])
        .expect_err("a hostile reply must fail the read");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert_guarded(&buf);
    // Later requests fail at once, without reconnecting to the server.
    let again = client.read_at(0, &mut buf[..4096]).unwrap_err();
    assert!(matches!(again, Error::Protocol { .. }), "{again}");
    assert_eq!(
        h.connections(),
        1,
        "the client reconnected to a broken server"
    );

    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mr = client
        .nic()
        .alloc_region(3 * 4096, qpip_core::Access::READ_WRITE);
    mr.write_at(0, &[0x55u8; 3 * 4096]);
    let placed = client
        .read_at_mr(64 << 10, &mr, 4096, 4096)
        .expect_err("a hostile reply must fail the read into registered memory");
    assert_eq!(
        placed.to_string(),
        e.to_string(),
        "placed and copied reads differ"
    );
    let mut back = vec![0u8; 3 * 4096];
    mr.read_at(0, &mut back);
    assert_guarded(&back);
    assert_eq!(
        h.connections(),
        2,
        "the client reconnected to a broken server"
    );
    e
}

fn assert_guarded(buf: &[u8]) {
    assert!(
        buf[..4096].iter().all(|&b| b == 0x55),
        "wrote before the buffer"
    );
    assert!(
        buf[8192..].iter().all(|&b| b == 0x55),
        "wrote after the buffer"
    );
}

fn assert_violation(e: &Error, words: &str) {
    assert!(
        matches!(e, Error::Protocol { .. }) && e.to_string().contains(words),
        "expected a protocol violation mentioning {words:?}, got: {e}"
    );
}

#[test]
fn wrapping_chunk_offset_is_refused_not_a_panic() {
    // The crash of issue 18: offset 2^64 - 8 wraps `start + len` back inside the request.
    let h = Hostile::start(Box::new(|r| {
        (
            data_chunk(r.cookie, true, r.offset.wrapping_sub(8), 16),
            false,
        )
    }));
    assert_violation(&read_fails(&h), "outside the read");
}

#[test]
fn chunk_outside_the_request_is_refused() {
    let h = Hostile::start(Box::new(|r| {
        let past = r.offset + r.length;
        (data_chunk(r.cookie, true, past, r.length as usize), false)
    }));
    assert_violation(&read_fails(&h), "outside the read");
}

#[test]
fn overlapping_chunks_are_refused() {
    // 2 + 2 KiB add up to the 4 KiB read, but overlap and leave its tail unwritten.
    let h = Hostile::start(Box::new(|r| {
        let mut v = data_chunk(r.cookie, false, r.offset, 2048);
        v.extend(data_chunk(r.cookie, true, r.offset + 1024, 2048));
        (v, false)
    }));
    assert_violation(&read_fails(&h), "overlaps");
}

#[test]
fn reply_for_an_unknown_cookie_is_refused() {
    let h = Hostile::start(Box::new(|r| {
        (
            data_chunk(r.cookie ^ 0xdead, true, r.offset, r.length as usize),
            false,
        )
    }));
    assert_violation(&read_fails(&h), "unknown cookie");
}

#[test]
fn bad_reply_magic_is_refused() {
    let h = Hostile::start(Box::new(|r| {
        let mut v = data_chunk(r.cookie, true, r.offset, r.length as usize);
        v[..4].copy_from_slice(b"EVIL");
        (v, false)
    }));
    assert_violation(&read_fails(&h), "cannot frame");
}

#[test]
fn hole_longer_than_the_read_is_refused() {
    let h = Hostile::start(Box::new(|r| {
        let mut p = r.offset.to_be_bytes().to_vec();
        p.extend_from_slice(&u32::MAX.to_be_bytes());
        (
            chunk(ReplyFlags::DONE, c::REPLY_TYPE_OFFSET_HOLE, r.cookie, &p),
            false,
        )
    }));
    assert_violation(&read_fails(&h), "outside the read");
}

#[test]
fn server_text_is_escaped_and_capped() {
    // A 60 000-byte error message that clears the screen and sets the window title.
    let h = Hostile::start(Box::new(|r| {
        let mut msg = b"\x1b[2J\x1b]0;pwned\x07".to_vec();
        msg.resize(60_000, b'A');
        let mut p = 5u32.to_be_bytes().to_vec(); // EIO
        p.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        p.extend_from_slice(&msg);
        (
            chunk(ReplyFlags::DONE, c::REPLY_TYPE_ERROR, r.cookie, &p),
            false,
        )
    }));
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mut buf = vec![0u8; 4096];
    let e = client.read_at(0, &mut buf).unwrap_err();
    let Error::Server { message, .. } = &e else {
        panic!("expected the server's error, got {e}");
    };
    assert!(
        !message.contains('\x1b') && !message.contains('\x07'),
        "{message:?}"
    );
    assert!(
        message.len() < 2048,
        "{} bytes of server text",
        message.len()
    );
    assert!(message.starts_with("\\u{1b}[2J"), "{message:?}");
    // An error reply is no violation: the connection goes on.
    assert!(matches!(
        client.read_at(0, &mut buf),
        Err(Error::Server { .. })
    ));
    assert_eq!(h.connections(), 1);
}

#[test]
fn truncated_replies_reconnect_a_bounded_number_of_times() {
    // Half a reply, then close: a network fault each time. Each reconnect succeeds, so only a
    // deadline that survives successful reconnects ends it.
    let h = Hostile::start(Box::new(|r| {
        let mut v = data_chunk(r.cookie, true, r.offset, r.length as usize);
        v.truncate(v.len() / 2);
        (v, true)
    }));
    // Exponential back-off from 50 ms within the 2 s deadline: a handful of attempts.
    read_loses_the_connection_within(&h, Duration::from_secs(8), 8);
}

#[test]
fn a_stalled_server_times_out() {
    let h = Hostile::start(Box::new(|_| (Vec::new(), false)));
    read_loses_the_connection_within(&h, Duration::from_secs(10), 4);
}

#[test]
fn honest_replies_in_pieces_still_work() {
    // The control: a read answered by a hole and two data chunks out of order.
    let h = Hostile::start(Box::new(|r| {
        let (o, n) = (r.offset, r.length as usize);
        let mut v = data_chunk(r.cookie, false, o + 2048, n - 2048);
        v.extend_from_slice(
            &nbd_proto::reply::offset_hole(r.cookie, false, o + 1024, 1024).unwrap(),
        );
        v.extend(data_chunk(r.cookie, false, o, 1024));
        v.extend_from_slice(&none_chunk(r.cookie));
        (v, false)
    }));
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mut buf = vec![0x55u8; 4096];
    client.read_at(0, &mut buf).unwrap();
    assert!(buf[..1024].iter().all(|&b| b == 0xEE));
    assert!(buf[1024..2048].iter().all(|&b| b == 0));
    assert!(buf[2048..].iter().all(|&b| b == 0xEE));
}

#[test]
fn an_export_too_big_to_address_is_refused_at_connect() {
    let h = Hostile::start_sized(vec![u64::MAX], Box::new(|_| (Vec::new(), false)));
    let e = Client::connect_with(&h.uri(), options()).unwrap_err();
    assert!(
        matches!(e, Error::Protocol { .. }) && e.to_string().contains("18446744073709551615 bytes"),
        "{e}"
    );
}

#[test]
fn an_export_too_big_to_address_is_refused_on_reconnect_and_by_a_size_probe() {
    // The first connection is honest and closes at the first READ; every later one
    // reports 2^63 bytes, which the first handshake would have refused.
    let h = Hostile::start_sized(vec![SIZE, 1 << 63], Box::new(|_| (Vec::new(), true)));
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mut buf = vec![0u8; 4096];
    let e = client.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, Error::ConnectionLost { .. }), "{e}");
    assert!(e.to_string().contains("9223372036854775808 bytes"), "{e}");
    assert_eq!(client.size(), SIZE, "a reconnect took the size 2^63");
    let e = Client::info_with(&h.uri(), &options()).unwrap_err();
    assert!(e.to_string().contains("9223372036854775808 bytes"), "{e}");
}

#[test]
fn replies_never_marked_done_give_up_at_the_deadline() {
    // Each connection gets the read's data but never the DONE flag: the client times the
    // request out and reconnects, but a chunk that never completes a request is no answer,
    // so the reconnect deadline still ends it.
    let h = Hostile::start(Box::new(|r| {
        (
            data_chunk(r.cookie, false, r.offset, r.length as usize),
            false,
        )
    }));
    read_loses_the_connection_within(&h, Duration::from_secs(10), 4);
}

/// A read against `h` ends in `ConnectionLost` within `limit`, after at most `connections`.
fn read_loses_the_connection_within(h: &Hostile, limit: Duration, connections: usize) {
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    let mut buf = vec![0u8; 4096];
    let t = Instant::now();
    let e = client.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, Error::ConnectionLost { .. }), "{e}");
    assert!(t.elapsed() < limit, "took {:?}", t.elapsed());
    assert!(
        h.connections() <= connections,
        "{} connections in {:?}",
        h.connections(),
        t.elapsed()
    );
}

#[test]
fn extended_replies_must_echo_the_request_offset() {
    // Honest: the read works, copied and placed.
    let h = Hostile::start_extended(Box::new(|r| {
        let to = ReplyTo::new(r, true);
        let mut v = offset_data_header(to, true, r.offset, r.length as u32)
            .unwrap()
            .to_vec();
        v.resize(v.len() + r.length as usize, 0xEE);
        (v, false)
    }));
    let mut client = Client::connect_with(&h.uri(), options()).unwrap();
    assert!(client.extended_headers());
    let mut buf = vec![0u8; 4096];
    client.read_at(8192, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0xEE));

    // The chunk's data lie inside the read, but its header names another request offset.
    let h = Hostile::start_extended(Box::new(|r| {
        let to = ReplyTo {
            cookie: r.cookie,
            offset: Some(r.offset + 512),
        };
        let mut v = offset_data_header(to, true, r.offset, r.length as u32)
            .unwrap()
            .to_vec();
        v.resize(v.len() + r.length as usize, 0xEE);
        (v, false)
    }));
    let e = read_fails(&h);
    assert!(
        matches!(e, Error::Protocol { .. }) && e.to_string().contains("offset"),
        "{e}"
    );
}

#[test]
fn data_chunk_longer_than_the_read_fails_at_once() {
    // Issue 24 item 10: an OFFSET_DATA chunk at the read's offset whose header says it is
    // longer than the read, by a little, by a lot, and by more than a receive slot holds.
    // The server sends the read's bytes only, then waits: the client must see the violation
    // in the header, not wait for the rest and then for the request timeout.
    for extra in [1usize, 4096, 64 << 10, 2 << 20] {
        let h = Hostile::start(Box::new(move |r| {
            let mut v =
                offset_data_header(r.cookie, true, r.offset, r.length as u32 + extra as u32)
                    .unwrap()
                    .to_vec();
            v.resize(v.len() + r.length as usize, 0xEE);
            (v, false)
        }));
        let opts = ClientOptions {
            request_timeout: Some(Duration::from_secs(10)),
            reconnect_timeout: Duration::from_secs(10),
            ..options()
        };
        for placed in [false, true] {
            let mut client = Client::connect_with(&h.uri(), opts.clone()).unwrap();
            let t = Instant::now();
            let e = if placed {
                let mr = client
                    .nic()
                    .alloc_region(3 * 4096, qpip_core::Access::READ_WRITE);
                client.read_at_mr(64 << 10, &mr, 4096, 4096).unwrap_err()
            } else {
                let mut buf = vec![0u8; 4096];
                client.read_at(64 << 10, &mut buf).unwrap_err()
            };
            assert!(
                t.elapsed() < Duration::from_secs(3),
                "{extra} extra bytes (placed: {placed}): failed after {:?}: {e}",
                t.elapsed()
            );
            // Past a receive slot the framer's length limit says so first.
            let why = if extra < 1 << 20 {
                "longer than its read"
            } else {
                "exceeds limit"
            };
            assert_violation(&e, why);
        }
    }
}
