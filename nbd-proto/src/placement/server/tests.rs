use super::*;
use crate::flags::{CmdFlags, TransmissionFlags as TF};
use crate::transmission::{Command, ErrorValue, Request, TransmissionInfo};

fn session(extended: bool) -> ServerTransmission {
    let mut info = TransmissionInfo::new(1 << 20, TF::SEND_FLUSH | TF::SEND_FUA);
    info.structured_replies = extended;
    info.extended_headers = extended;
    ServerTransmission::from_info(info)
}

fn phase(extended: bool) -> ServerPhase {
    if extended {
        ServerPhase::TransmissionExtended
    } else {
        ServerPhase::Transmission
    }
}

fn write(offset: u64, length: u64, extended: bool) -> Request {
    Request {
        flags: if extended {
            CmdFlags::PAYLOAD_LEN
        } else {
            CmdFlags::empty()
        },
        command: Command::Write,
        cookie: 1,
        offset,
        length,
    }
}

/// A machine in the transmission phase, and its phase.
fn started(
    extended: bool,
    chunk: usize,
    place: Option<PlaceWrites>,
) -> (ServerPlacement, ServerPhase) {
    let mut m = ServerPlacement::new(FrameLimits::default(), chunk);
    m.start_transmission(session(extended), place);
    (m, phase(extended))
}

#[test]
fn large_writes_come_in_pieces_then_requests_resume() {
    for extended in [false, true] {
        let (mut m, mut p) = started(extended, 1000, None);
        let hdr = write(0, 2500, extended).encode(extended).unwrap();
        let header_len = Request::header_len(extended);
        assert_eq!(
            m.frame(&mut p, &hdr[..10]),
            ServerFrame::NeedHeader(header_len)
        );
        let ServerFrame::Request {
            header_len: h,
            body_len: 1000,
            request: Ok(req),
        } = m.frame(&mut p, &hdr)
        else {
            panic!("not a request");
        };
        assert_eq!((h, req.payload_len()), (header_len, 2500));
        assert_eq!(m.frame(&mut p, &[]), ServerFrame::Payload { len: 1000 });
        assert_eq!(m.frame(&mut p, &[]), ServerFrame::Payload { len: 500 });
        let read = Request {
            flags: CmdFlags::empty(),
            command: Command::Read,
            cookie: 2,
            ..write(0, 2500, extended)
        };
        assert!(matches!(
            m.frame(&mut p, &read.encode(extended).unwrap()),
            ServerFrame::Request {
                body_len: 0,
                request: Ok(_),
                ..
            }
        ));
    }
}

#[test]
fn client_flags_then_options() {
    let mut m = ServerPlacement::new(FrameLimits::default(), 1000);
    let mut p = ServerPhase::ClientFlags;
    assert_eq!(m.frame(&mut p, &[]), ServerFrame::NeedHeader(4));
    assert_eq!(
        m.frame(&mut p, &[0, 0, 0, 3]),
        ServerFrame::Message {
            header_len: 4,
            body_len: 0
        }
    );
    assert_eq!(p, ServerPhase::Options);
    assert_eq!(m.frame(&mut p, &[]), ServerFrame::NeedHeader(16));
    assert!(matches!(
        m.frame(&mut p, &[0u8; 16]),
        ServerFrame::Invalid(FrameError::BadMagic { .. })
    ));
}

#[test]
fn requests_before_the_transmission_starts_are_refused() {
    let mut m = ServerPlacement::new(FrameLimits::default(), 1000);
    let mut p = ServerPhase::Transmission;
    let hdr = write(0, 10, false).encode(false).unwrap();
    assert_eq!(
        m.frame(&mut p, &hdr),
        ServerFrame::Invalid(FrameError::Unexpected)
    );
}

#[test]
fn only_valid_large_writes_from_the_placement_offset_on_are_placed() {
    let place = PlaceWrites {
        min_len: 4096,
        from: 512,
    };
    for extended in [false, true] {
        let (mut m, mut p) = started(extended, 1000, Some(place));
        let hdr = write(4096, 8192, extended).encode(extended).unwrap();
        let ServerFrame::PlacedWrite {
            offset: 4096,
            len: 8192,
            request,
            ..
        } = m.frame(&mut p, &hdr)
        else {
            panic!("a large valid write is placed");
        };
        assert_eq!(request.payload_len(), 8192);
        // Too small, below `from`, or past the export's end: in the receive slots.
        for (offset, len) in [(4096, 4095), (0, 8192), ((1 << 20) - 4096, 8192)] {
            let hdr = write(offset, len, extended).encode(extended).unwrap();
            let f = m.frame(&mut p, &hdr);
            assert!(
                matches!(f, ServerFrame::Request { body_len: 1000, .. }),
                "{offset} {len}: {f:?}"
            );
            // The rest of the payload, in pieces.
            while let ServerFrame::Payload { .. } = m.frame(&mut p, &[]) {}
        }
        let hdr = write((1 << 20) - 4096, 8192, extended)
            .encode(extended)
            .unwrap();
        let ServerFrame::Request {
            request: Err(refusal),
            ..
        } = m.frame(&mut p, &hdr)
        else {
            panic!("a write past the end is refused");
        };
        assert_eq!(refusal.error(), ErrorValue::NoSpc);
        assert_eq!(refusal.payload_len(), 8192);
    }
}

#[test]
fn oversized_payloads_and_bad_magic_end_the_connection() {
    let limits = FrameLimits {
        max_write_len: 1000,
        ..FrameLimits::default()
    };
    let mut m = ServerPlacement::new(limits, 100);
    m.start_transmission(session(false), None);
    let mut p = ServerPhase::Transmission;
    assert!(matches!(
        m.frame(&mut p, &write(0, 1001, false).encode(false).unwrap()),
        ServerFrame::Invalid(FrameError::TooLong { .. })
    ));
    assert!(matches!(
        m.frame(&mut p, &[0; 28]),
        ServerFrame::Invalid(FrameError::BadMagic { .. })
    ));
}
