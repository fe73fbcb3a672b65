//! The reply-assembly fuzz check, run by nbd-proto's `replies` target with the reply checks'
//! own ([`crate::fuzzing::replies`]): any server bytes, through two client sessions.

use crate::flags::{CmdFlags, TransmissionFlags};
use crate::framing::{ClientPhase, FrameLimits};
use crate::handshake::BlockSize;
use crate::placement::client::ClientFrame;
use crate::transmission::client::ReadTarget;
use crate::transmission::{Command, Request};

/// The caller memory of [`replies`]: every write must lie inside it.
#[derive(Debug, Clone)]
struct Shadow(std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl ReadTarget for Shadow {
    fn write_at(&self, at: usize, bytes: &[u8]) {
        let mut buf = self.0.borrow_mut();
        let end = at.checked_add(bytes.len()).expect("no wrap");
        assert!(end <= buf.len(), "a write outside the read's buffer");
        buf[at..end].copy_from_slice(bytes);
    }
}

/// The input of [`crate::fuzzing::replies`] through the client session twice, a READ's data
/// once into the session's own buffer and once into caller memory, framed by the second
/// session's own table ([`crate::transmission::client::InFlight::frame`]): where it places
/// data, the harness copies them as the NIC would (they must lie inside the buffer). Both
/// sessions must judge every message alike and end with the same bytes, and nothing may
/// land outside the buffer.
pub fn replies(data: &[u8]) {
    use crate::handshake::{ClientNegotiated, ExportDetails};
    use crate::transmission::client::{ClientSession, Delivered, Output};
    let mut r = crate::wire::Reader::new(data);
    let knobs = r.bytes(1).map_or(0, |b| b[0]);
    let offset = r.u64().unwrap_or(0);
    let length = r.u32().unwrap_or(0);
    if length > 1 << 16 {
        return; // the session allocates the buffer
    }
    let command = match knobs & 3 {
        1 => Command::BlockStatus,
        2 => Command::Write,
        _ => Command::Read,
    };
    let neg = ClientNegotiated {
        export: ExportDetails {
            size: u64::MAX,
            flags: TransmissionFlags::HAS_FLAGS,
            block_size: BlockSize::DEFAULT,
            block_size_advertised: false,
            name: None,
            description: None,
        },
        structured_replies: knobs & 4 == 0,
        extended_headers: false,
        base_allocation: (knobs & 8 == 0).then_some(u32::from(knobs >> 4)),
        meta_contexts: ((knobs & 8 == 0).then_some(u32::from(knobs >> 4)))
            .map(|id| (id, crate::consts::BASE_ALLOCATION.to_owned()))
            .into_iter()
            .collect(),
        listed_contexts: Vec::new(),
        no_zeroes: true,
        via_go: true,
        tls: false,
    };
    let req = Request {
        flags: CmdFlags::empty(),
        command,
        cookie: 0,
        offset,
        length: length.into(),
    };
    let mut owned: ClientSession<Shadow> = ClientSession::new(&neg, length, 1);
    let mut placed: ClientSession<Shadow> = ClientSession::new(&neg, length, 1);
    let cookie = owned.start(0, req, None).expect("room").cookie;
    let memory = std::rc::Rc::new(std::cell::RefCell::new(vec![0; length as usize]));
    let shadow = (command == Command::Read).then(|| Shadow(memory.clone()));
    placed.start(0, req, shadow).expect("room");
    owned.outgoing(cookie).expect("in flight");
    placed.outgoing(cookie).expect("in flight");
    let limits = FrameLimits::default();
    let mut rest = r.rest();
    loop {
        let frame = placed
            .table()
            .frame(ClientPhase::Transmission, rest, &limits, |_, at, len| {
                (at, len)
            });
        let (msg, at) = match frame {
            ClientFrame::Message {
                header_len,
                body_len,
            } => (rest.get(..header_len + body_len), None),
            ClientFrame::MessageAt {
                header_len,
                body: (at, len),
            } => (rest.get(..header_len + len), Some((header_len, at, len))),
            ClientFrame::NeedHeader(n) => {
                assert!(
                    n > rest.len(),
                    "asked for {n} bytes with {} there",
                    rest.len()
                );
                break;
            }
            _ => break,
        };
        let Some(msg) = msg else { break };
        rest = &rest[msg.len()..];
        let by_placed = match at {
            None => placed.on_message(msg),
            Some((header_len, at, len)) => {
                // The NIC's part: the data into the read's buffer, where the framer said.
                Shadow(memory.clone()).write_at(at, &msg[header_len..]);
                placed.on_placed_message(&msg[..header_len], len)
            }
        };
        match (owned.on_message(msg), by_placed) {
            (Err(a), Err(b)) => {
                if at.is_none() {
                    assert_eq!(a, b);
                }
                break;
            }
            (Ok(Delivered::Partial), Ok(Delivered::Partial)) => {}
            (Ok(Delivered::ShuttingDown), Ok(Delivered::ShuttingDown)) => break,
            (Ok(Delivered::Finished(a)), Ok(Delivered::Finished(b))) => {
                match (a.result, b.result) {
                    (Ok(Output::Data(d)), Ok(Output::Done)) => assert!(d == *memory.borrow()),
                    (a, b) => assert_eq!(a, b),
                }
                break;
            }
            (a, b) => panic!("the sessions disagree: {a:?} / {b:?}"),
        }
    }
}
