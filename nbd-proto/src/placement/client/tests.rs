use super::*;
use crate::flags::TransmissionFlags;
use crate::handshake::{BlockSize, ClientNegotiated, ExportDetails};
use crate::reply::SimpleReply;
use crate::transmission::Request;
use crate::transmission::client::ClientSession;

/// A read's memory, in a test: where the framer places data is all that matters.
#[derive(Clone, Debug)]
struct Buf(usize);

impl ReadTarget for Buf {
    fn write_at(&self, _at: usize, _bytes: &[u8]) {}
}

fn session(structured: bool) -> ClientSession<Buf> {
    let neg = ClientNegotiated {
        export: ExportDetails {
            size: 1 << 20,
            flags: TransmissionFlags::HAS_FLAGS,
            block_size: BlockSize::DEFAULT,
            block_size_advertised: false,
            name: None,
            description: None,
        },
        structured_replies: structured,
        extended_headers: false,
        base_allocation: None,
        meta_contexts: (None)
            .map(|id| (id, crate::consts::BASE_ALLOCATION.to_owned()))
            .into_iter()
            .collect(),
        listed_contexts: Vec::new(),
        no_zeroes: true,
        via_go: true,
        tls: false,
    };
    ClientSession::new(&neg, 1 << 16, 4)
}

fn read(offset: u64, length: u64) -> Request {
    Request {
        flags: Default::default(),
        command: Command::Read,
        cookie: 0,
        offset,
        length,
    }
}

fn frame(s: &ClientSession<Buf>, header: &[u8]) -> ClientFrame<(usize, usize, usize)> {
    s.table().frame(
        ClientPhase::Transmission,
        header,
        &FrameLimits::default(),
        |b, at, len| (b.0, at, len),
    )
}

#[test]
fn simple_read_replies_use_the_read_length_once_sent() {
    let mut s = session(false);
    let cookie = s.start(1, read(0, 4096), None).unwrap().cookie;
    let ok = SimpleReply::ok(cookie).encode();
    // Not sent yet: nothing is framed by its numbers.
    assert_eq!(
        frame(&s, &ok),
        ClientFrame::Message {
            header_len: 16,
            body_len: 0
        }
    );
    s.outgoing(cookie).unwrap();
    assert_eq!(frame(&s, &ok[..4]), ClientFrame::NeedHeader(16));
    assert_eq!(
        frame(&s, &ok),
        ClientFrame::Message {
            header_len: 16,
            body_len: 4096
        }
    );
    // That was its last message: a second reply is framed without its data.
    assert_eq!(
        frame(&s, &ok),
        ClientFrame::Message {
            header_len: 16,
            body_len: 0
        }
    );
    assert!(matches!(frame(&s, &[0, 0, 0, 0]), ClientFrame::Invalid(_)));
}

#[test]
fn placed_reads_name_their_memory_until_their_last_message() {
    let mut s = session(false);
    let cookie = s.start(1, read(0, 4096), Some(Buf(7))).unwrap().cookie;
    s.outgoing(cookie).unwrap();
    let ok = SimpleReply::ok(cookie).encode();
    assert_eq!(
        frame(&s, &ok),
        ClientFrame::MessageAt {
            header_len: 16,
            body: (7, 0, 4096)
        }
    );
    assert!(matches!(frame(&s, &ok), ClientFrame::Message { .. }));
    // Reissued on a new connection: open again once sent again.
    s.reissue(s.mode().clone());
    assert!(matches!(frame(&s, &ok), ClientFrame::Message { .. }));
    s.outgoing(cookie).unwrap();
    assert!(matches!(frame(&s, &ok), ClientFrame::MessageAt { .. }));
}

#[test]
fn handshake_messages_are_framed_whole() {
    let s = session(false);
    assert_eq!(
        s.table().frame(
            ClientPhase::Greeting,
            &[],
            &FrameLimits::default(),
            |_, _, _| ()
        ),
        ClientFrame::Message {
            header_len: 18,
            body_len: 0
        }
    );
    assert!(matches!(
        s.table().frame(
            ClientPhase::Closed,
            &[],
            &FrameLimits::default(),
            |_, _, _| ()
        ),
        ClientFrame::Invalid(_)
    ));
}
