//! The client session against hand-built server messages: reads assembled from any split of
//! chunks, placed data checked, violations typed, reissue and abandonment.

use std::cell::RefCell;
use std::rc::Rc;

use super::*;
use crate::flags::TransmissionFlags;
use crate::handshake::{BlockSize, ExportDetails};
use crate::reply::{ReplyTo, error_chunk, none_chunk, offset_data_header, offset_hole};
use crate::transmission::ErrorValue;

/// Caller memory: a shared byte vector.
#[derive(Clone, Debug, Default)]
struct Mem(Rc<RefCell<Vec<u8>>>);

impl ReadTarget for Mem {
    fn write_at(&self, at: usize, bytes: &[u8]) {
        self.0.borrow_mut()[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

fn negotiated(structured: bool, extended: bool) -> ClientNegotiated {
    ClientNegotiated {
        export: ExportDetails {
            size: 1 << 20,
            flags: TransmissionFlags::HAS_FLAGS | TransmissionFlags::SEND_FLUSH,
            block_size: BlockSize::DEFAULT,
            block_size_advertised: false,
            name: None,
            description: None,
        },
        structured_replies: structured,
        extended_headers: extended,
        base_allocation: structured.then_some(1),
        meta_contexts: (structured.then_some(1))
            .map(|id| (id, crate::consts::BASE_ALLOCATION.to_owned()))
            .into_iter()
            .collect(),
        listed_contexts: Vec::new(),
        no_zeroes: true,
        via_go: true,
        tls: false,
    }
}

fn session(structured: bool, extended: bool) -> ClientSession<Mem> {
    ClientSession::new(&negotiated(structured, extended), 1 << 16, 4)
}

fn read(s: &mut ClientSession<Mem>, tag: u64, offset: u64, len: u32, into: Option<Mem>) -> Started {
    let req = s
        .limits()
        .check(&Submission {
            command: Command::Read,
            offset,
            length: len,
            fua: false,
        })
        .expect("a valid read");
    s.start(tag, req, into).expect("room")
}

fn data_chunk(to: ReplyTo, last: bool, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut m = offset_data_header(to, last, offset, data.len() as u32)
        .unwrap()
        .to_vec();
    m.extend_from_slice(data);
    m
}

fn finished(d: Delivered) -> Finished {
    match d {
        Delivered::Finished(f) => f,
        other => panic!("not finished: {other:?}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn simple_replies_answer_a_read_and_a_flush() {
    let mut s = session(false, false);
    let r = read(&mut s, 7, 4096, 512, None);
    let out = s.outgoing(r.cookie).unwrap();
    assert_eq!(out.header.len(), c::REQUEST_LEN);
    assert!(out.region.is_none());
    let data = pattern(512, 1);
    let mut msg = SimpleReply::ok(r.cookie).encode().to_vec();
    msg.extend_from_slice(&data);
    let f = finished(s.on_message(&msg).unwrap());
    assert_eq!((f.tag, f.result), (7, Ok(Output::Data(data))));
    assert_eq!(s.in_flight(), 0);
    // Another message for it: the cookie is no longer known.
    assert_eq!(
        s.on_message(&msg).unwrap_err(),
        Violation::UnknownCookie(r.cookie)
    );
    let req = s
        .limits()
        .check(&Submission {
            command: Command::Flush,
            offset: 9,
            length: 9,
            fua: false,
        })
        .unwrap();
    assert_eq!((req.offset, req.length), (0, 0));
    let f = s.start(8, req, None).unwrap();
    assert_eq!(s.outgoing(f.cookie).unwrap().command, Command::Flush);
    let err = SimpleReply::err(f.cookie, ErrorValue::Io).encode();
    let f = finished(s.on_message(&err).unwrap());
    assert_eq!(
        f.result,
        Err(Failed::Server {
            error: ErrorValue::Io,
            message: String::new()
        })
    );
}

/// Property: however a READ's reply is cut into data and hole chunks, in whatever order,
/// the buffer ends up holding exactly the data (holes zero), and an extra chunk after the
/// last one is refused.
#[test]
fn any_split_of_a_structured_read_assembles_the_data() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n.max(1)
    };
    for round in 0..500 {
        let extended = round % 2 == 1;
        let placed = round % 3 == 0;
        let mut s = session(true, extended);
        let len = 1 + next(8192) as u32;
        let offset = next(1 << 19);
        let mem = Mem(Rc::new(RefCell::new(vec![0xee; len as usize])));
        let r = read(&mut s, round, offset, len, placed.then(|| mem.clone()));
        let to = ReplyTo {
            cookie: r.cookie,
            offset: extended.then_some(offset),
        };
        let mut expect = pattern(len as usize, round as u8);
        // Cut [0, len) into pieces, some holes, and send them in a shuffled order.
        let mut pieces = Vec::new();
        let mut at = 0u32;
        while at < len {
            let n = (1 + next(2048) as u32).min(len - at);
            pieces.push((at, n, next(4) == 0));
            at += n;
        }
        for i in (1..pieces.len()).rev() {
            pieces.swap(i, next(i as u64 + 1) as usize);
        }
        let last = pieces.len() - 1;
        for (i, &(at, n, hole)) in pieces.iter().enumerate() {
            let range = at as usize..(at + n) as usize;
            let done = i == last;
            let d = if hole {
                expect[range].fill(0);
                s.on_message(&offset_hole(to, done, offset + u64::from(at), n).unwrap())
            } else if placed {
                // The transport put the data in place; only the header is left.
                mem.write_at(at as usize, &expect[range]);
                let hdr = offset_data_header(to, done, offset + u64::from(at), n).unwrap();
                s.on_placed_message(&hdr, n as usize)
            } else {
                s.on_message(&data_chunk(
                    to,
                    done,
                    offset + u64::from(at),
                    &expect[range],
                ))
            }
            .unwrap();
            match (done, d) {
                (false, Delivered::Partial) => {}
                (true, Delivered::Finished(f)) => {
                    let got = match f.result.unwrap() {
                        Output::Data(d) => d,
                        Output::Done => mem.0.borrow().clone(),
                        other => panic!("{other:?}"),
                    };
                    assert_eq!(got, expect, "round {round}");
                }
                (_, d) => panic!("round {round}: {d:?} at piece {i} of {}", pieces.len()),
            }
        }
        assert_eq!(s.bytes_placed() > 0, placed && pieces.iter().any(|p| !p.2));
        assert!(s.has_room() && s.in_flight() == 0);
    }
}

#[test]
fn violations_are_typed() {
    let mut s = session(true, false);
    let r = read(&mut s, 1, 0, 1024, None);
    assert_eq!(s.on_message(&[1, 2]).unwrap_err(), Violation::TooShort(2));
    assert_eq!(
        s.on_message(&[0xde, 0xad, 0xbe, 0xef]).unwrap_err(),
        Violation::UnknownMagic(0xdead_beef)
    );
    // A simple reply where structured replies were negotiated, for a read: it must carry
    // the read's length of data.
    let simple = SimpleReply::ok(r.cookie).encode();
    assert!(matches!(
        s.on_message(&simple).unwrap_err(),
        Violation::Reply(_)
    ));
    // Data outside the request.
    let outside = data_chunk(r.cookie.into(), true, 1024, &[1; 16]);
    assert!(matches!(
        s.on_message(&outside).unwrap_err(),
        Violation::Reply(_)
    ));
    // A header that lies about its payload.
    let mut short = data_chunk(r.cookie.into(), true, 0, &[1; 16]);
    short.pop();
    assert_eq!(
        s.on_message(&short).unwrap_err(),
        Violation::PayloadLength { said: 24, has: 23 }
    );
    // Placed data where the check would not put them (not a placed read at all).
    let hdr = offset_data_header(r.cookie, true, 0, 1024).unwrap();
    assert_eq!(
        s.on_placed_message(&hdr, 1024).unwrap_err(),
        Violation::PlacedElsewhere
    );
    let hdr = offset_data_header(r.cookie, true, 0, 16).unwrap();
    assert_eq!(
        s.on_placed_message(&hdr[..c::STRUCTURED_REPLY_HEADER_LEN], 16)
            .unwrap_err(),
        Violation::PlacedWithoutOffset
    );
}

#[test]
fn shutdown_keeps_the_request_and_reissue_starts_it_over() {
    let mut s = session(true, false);
    let a = read(&mut s, 1, 0, 1024, None);
    let b = read(&mut s, 2, 1024, 1024, None);
    // Half of `a`'s data, then the connection goes.
    let part = data_chunk(a.cookie.into(), false, 0, &[9; 512]);
    assert!(matches!(s.on_message(&part).unwrap(), Delivered::Partial));
    let mut refusal = Vec::new();
    error_chunk(b.cookie, true, ErrorValue::Shutdown, "bye", &mut refusal);
    assert!(matches!(
        s.on_message(&refusal).unwrap(),
        Delivered::ShuttingDown
    ));
    assert_eq!(s.in_flight(), 2);
    // The new connection has extended headers.
    let mode = Mode::of(&negotiated(true, true));
    assert_eq!(s.reissue(mode), vec![a.cookie, b.cookie]);
    assert_eq!(
        s.outgoing(a.cookie).unwrap().header.len(),
        c::EXTENDED_REQUEST_LEN
    );
    // `a` is answered whole again: the old half is forgotten, no overlap.
    let to = ReplyTo {
        cookie: a.cookie,
        offset: Some(0),
    };
    let whole = data_chunk(to, true, 0, &[5; 1024]);
    let f = finished(s.on_message(&whole).unwrap());
    assert_eq!(f.result, Ok(Output::Data(vec![5; 1024])));
    let f = finished(
        s.on_message(&none_chunk(ReplyTo {
            cookie: b.cookie,
            offset: Some(1024),
        }))
        .unwrap(),
    );
    assert_eq!(f.tag, 2);
}

#[test]
fn the_window_bounds_requests_and_abandon_frees_it() {
    let mut s = session(true, true);
    let started: Vec<Started> = (0..4).map(|t| read(&mut s, t, 0, 512, None)).collect();
    assert!(!s.has_room());
    let req = s
        .limits()
        .check(&Submission {
            command: Command::Read,
            offset: 0,
            length: 512,
            fua: false,
        })
        .unwrap();
    assert_eq!(s.start(9, req, None), Err(Refused::Invalid("no free slot")));
    let mut slots: Vec<usize> = started.iter().map(|s| s.slot).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2, 3]);
    let mut tags = s.abandon_all();
    tags.sort_unstable();
    assert_eq!(tags, [0, 1, 2, 3]);
    assert!(s.has_room() && s.in_flight() == 0);
}

#[test]
fn placed_reads_are_framed_and_reported() {
    let mut s = session(true, false);
    let mem = Mem(Rc::new(RefCell::new(vec![0; 4096])));
    let r = read(&mut s, 3, 8192, 4096, Some(mem));
    assert!(s.places_data());
    // A READ's region is where its data go, not something to send.
    assert!(s.outgoing(r.cookie).unwrap().region.is_none());
    let chunk = offset_data_header(ReplyTo::from(r.cookie), true, 8192 + 1024, 2048).unwrap();
    let framed = s.table().frame(
        crate::framing::ClientPhase::Transmission,
        &chunk,
        &crate::framing::FrameLimits::default(),
        |_, at, len| (at, len),
    );
    assert_eq!(
        framed,
        crate::placement::client::ClientFrame::MessageAt {
            header_len: c::STRUCTURED_REPLY_HEADER_LEN + 8,
            body: (1024, 2048)
        }
    );
}

#[test]
fn data_in_flight_counts_reads_and_writes_until_their_replies() {
    let mut s = session(false, false);
    assert_eq!(s.data_in_flight(), 0);
    let r = read(&mut s, 1, 0, 4096, None);
    let flush = s
        .limits()
        .check(&Submission {
            command: Command::Flush,
            offset: 0,
            length: 0,
            fua: false,
        })
        .unwrap();
    let f = s.start(2, flush, None).unwrap();
    assert_eq!(s.data_in_flight(), 4096, "a flush moves no data");
    let write = s
        .limits()
        .check(&Submission {
            command: Command::Write,
            offset: 8192,
            length: 1024,
            fua: false,
        })
        .unwrap();
    let w = s.start(3, write, None).unwrap();
    assert_eq!(s.data_in_flight(), 5120);
    finished(s.on_message(&SimpleReply::ok(w.cookie).encode()).unwrap());
    let mut msg = SimpleReply::ok(r.cookie).encode().to_vec();
    msg.extend_from_slice(&[0; 4096]);
    finished(s.on_message(&msg).unwrap());
    assert_eq!(s.data_in_flight(), 0);
    finished(s.on_message(&SimpleReply::ok(f.cookie).encode()).unwrap());
}
