//! The QP framer for the server side of NBD: a thin adapter that runs nbd-proto's placement
//! machine ([`ServerPlacement`]) on the NIC's thread and translates its answers for the NIC.
//!
//! Every request header is parsed and checked there, once: the parsed request (or how to
//! refuse it) waits in [`FramerState`]'s queue for the connection, which takes it with the
//! message's completion (receive completions come in the order messages were framed).
//! Write payloads longer than a receive slot arrive as continuation messages of at most one
//! slot each (`header_len` 0), so 32 MiB writes need no 32 MiB buffers.
//!
//! A valid WRITE of at least [`PLACE_MIN`] bytes to an export in a raw file goes further: the
//! machine says so, the framer names the file range as the place of its payload, and the NIC
//! writes it into the image itself (the soft NIC splices socket → pipe → file), the way a
//! storage-offload NIC puts a write's data on the disk; the receive WR takes only the header.
//! Nothing the server would refuse reaches the file, nor does a write below the store's
//! placement offset (the first sector of a raw image whose format was probed, which the
//! store checks).
//!
//! The hot path allocates nothing: the queue is sized for every receive WR the connection
//! posts, and the machine decides from the header bytes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use nbd_proto::framing::{FrameLimits, ServerPhase};
use nbd_proto::placement::server::{PlaceWrites, ServerFrame, ServerPlacement};
use nbd_proto::transmission::server::{Refusal, ServerTransmission, ValidRequest};
use parking_lot::Mutex;
use qpip_core::{FileRegion, Frame, Framer};

use super::recv_window::RECV_SLOTS;

/// Smallest WRITE payload the NIC places in the image: below it a splice's extra system
/// calls cost more than the copy they save, and the payload rides in the receive slot.
pub(crate) const PLACE_MIN: u32 = 32 << 10;

/// A request the framer parsed: checked, or how to refuse it.
pub(crate) type Framed = Result<ValidRequest, Refusal>;

/// What the transmission phase tells the framer: the checks, and where WRITE payloads may go.
struct Setup {
    session: ServerTransmission,
    /// The export's file and the placement rule, for raw writable exports.
    place: Option<(FileRegion, PlaceWrites)>,
}

/// What the connection and its framer (on the NIC's thread) share.
pub(crate) struct FramerState {
    /// The protocol phase; the connection moves it to the transmission phase before it
    /// sends the reply that ends the handshake (the client sends nothing until it has that
    /// reply).
    phase: AtomicU8,
    /// Set once, before the phase becomes the transmission phase.
    setup: OnceLock<Setup>,
    /// The export's size as this connection knows it: the negotiated one, then what a
    /// RESIZE the connection carried out made it (set before its reply, and the client
    /// sends nothing while a RESIZE is in flight, so the framer has it for the next request).
    size: AtomicU64,
    /// Requests framed and not yet taken by the connection, in arrival order.
    requests: Mutex<VecDeque<Framed>>,
}

impl FramerState {
    pub(crate) fn new() -> Arc<FramerState> {
        Arc::new(FramerState {
            phase: AtomicU8::new(ServerPhase::ClientFlags.to_u8()),
            setup: OnceLock::new(),
            size: AtomicU64::new(0),
            // A request per receive WR at most: pushing never allocates.
            requests: Mutex::new(VecDeque::with_capacity(RECV_SLOTS)),
        })
    }

    fn phase(&self) -> ServerPhase {
        ServerPhase::from_u8(self.phase.load(Ordering::Acquire))
            .unwrap_or(ServerPhase::Transmission)
    }

    fn set_phase(&self, phase: ServerPhase) {
        self.phase.store(phase.to_u8(), Ordering::Release);
    }

    /// The transmission phase `phase` starts: requests are checked as `session` checks them
    /// and WRITE payloads placed into `place`'s file region as its rule allows. Before the
    /// reply that lets the client send requests.
    pub(crate) fn start_transmission(
        &self,
        phase: ServerPhase,
        session: ServerTransmission,
        place: Option<(FileRegion, u64)>,
    ) {
        let place = place.map(|(region, from)| {
            let rule = PlaceWrites {
                min_len: PLACE_MIN,
                from,
            };
            (region, rule)
        });
        self.size.store(session.info().size, Ordering::Release);
        let _ = self.setup.set(Setup { session, place });
        self.set_phase(phase);
    }

    /// The export's size changed under the connection (a RESIZE it carried out): the
    /// framer checks the requests that follow against `size`.
    pub(crate) fn set_size(&self, size: u64) {
        self.size.store(size, Ordering::Release);
    }

    /// The request of the next message that carries a header, as the framer parsed it.
    pub(crate) fn take_request(&self) -> Option<Framed> {
        self.requests.lock().pop_front()
    }
}

/// The framer: nbd-proto's placement machine over the shared state.
pub(crate) struct ServerFramer {
    state: Arc<FramerState>,
    machine: ServerPlacement,
    /// The export's file, once the transmission phase places writes there.
    region: Option<FileRegion>,
    /// The export's size the machine checks requests against.
    size: u64,
}

impl ServerFramer {
    pub(crate) fn new(state: Arc<FramerState>, limits: FrameLimits, chunk: usize) -> Self {
        ServerFramer {
            state,
            machine: ServerPlacement::new(limits, chunk),
            region: None,
            size: 0,
        }
    }

    /// Takes the transmission phase's setup into the machine, once.
    fn start(&mut self) {
        if let Some(setup) = self.state.setup.get() {
            let rule = setup.place.as_ref().map(|(_, rule)| *rule);
            self.region = setup.place.as_ref().map(|(region, _)| region.clone());
            self.machine.start_transmission(setup.session.clone(), rule);
            self.size = setup.session.info().size;
        }
    }

    /// Takes a size the connection changed (a RESIZE) into the machine.
    fn follow_size(&mut self) {
        let size = self.state.size.load(Ordering::Acquire);
        if size != self.size {
            self.machine.set_size(size);
            self.size = size;
        }
    }
}

impl Framer for ServerFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let before = self.state.phase();
        let mut phase = before;
        if matches!(
            phase,
            ServerPhase::Transmission | ServerPhase::TransmissionExtended
        ) && !self.machine.in_transmission()
        {
            self.start();
        }
        if self.machine.in_transmission() {
            self.follow_size();
        }
        let frame = self.machine.frame(&mut phase, header);
        if phase != before {
            self.state.set_phase(phase);
        }
        let message = |header_len, body_len| Frame::Message {
            header_len,
            strip: 0,
            body_len,
        };
        match frame {
            ServerFrame::NeedHeader(n) => Frame::NeedHeader(n),
            ServerFrame::Message {
                header_len,
                body_len,
            } => message(header_len, body_len),
            ServerFrame::Request {
                header_len,
                body_len,
                request,
            } => {
                self.state.requests.lock().push_back(request);
                message(header_len, body_len)
            }
            ServerFrame::PlacedWrite {
                header_len,
                offset,
                len,
                request,
            } => {
                self.state.requests.lock().push_back(Ok(request));
                match &self.region {
                    Some(region) => Frame::MessageAt {
                        header_len,
                        strip: 0,
                        body: region.sge(offset, len),
                    },
                    // The machine places nothing without a region.
                    None => message(header_len, len as usize),
                }
            }
            ServerFrame::Payload { len } => message(0, len),
            ServerFrame::Invalid(e) => Frame::Invalid(e.to_string()),
            _ => Frame::Invalid("unknown frame".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd_proto::flags::{CmdFlags, TransmissionFlags};
    use nbd_proto::transmission::{Command, Request, TransmissionInfo};

    #[test]
    fn client_flags_then_options() {
        let state = FramerState::new();
        let mut f = ServerFramer::new(state.clone(), FrameLimits::default(), 1000);
        assert_eq!(f.frame(&[]), Frame::NeedHeader(4));
        assert_eq!(
            f.frame(&[0, 0, 0, 3]),
            Frame::Message {
                header_len: 4,
                strip: 0,
                body_len: 0
            }
        );
        assert_eq!(state.phase(), ServerPhase::Options);
        assert_eq!(f.frame(&[]), Frame::NeedHeader(16));
        assert!(
            matches!(f.frame(&[0u8; 16]), Frame::Invalid(_)),
            "bad option magic"
        );
    }

    /// A framer whose connection is in transmission on a 1 MiB export, with its state.
    fn in_transmission() -> (Arc<FramerState>, ServerFramer) {
        let state = FramerState::new();
        let f = ServerFramer::new(state.clone(), FrameLimits::default(), 1000);
        let info = TransmissionInfo::new(1 << 20, TransmissionFlags::HAS_FLAGS);
        state.start_transmission(
            ServerPhase::Transmission,
            ServerTransmission::from_info(info),
            None,
        );
        (state, f)
    }

    #[test]
    fn requests_reach_the_connection_parsed_in_order() {
        let (state, mut f) = in_transmission();
        let mut req = Request {
            flags: CmdFlags::empty(),
            command: Command::Write,
            cookie: 1,
            offset: 0,
            length: 1500,
        };
        let msg = |header_len, body_len| Frame::Message {
            header_len,
            strip: 0,
            body_len,
        };
        assert_eq!(f.frame(&req.encode(false).unwrap()), msg(28, 1000));
        assert_eq!(f.frame(&[]), msg(0, 500));
        req.command = Command::Read;
        req.cookie = 2;
        req.offset = 1 << 20;
        assert_eq!(f.frame(&req.encode(false).unwrap()), msg(28, 0));
        let write = state.take_request().unwrap().unwrap();
        assert_eq!((write.cookie(), write.payload_len()), (1, 1500));
        let refused = state.take_request().unwrap().unwrap_err();
        assert_eq!(refused.cookie(), 2);
        assert!(state.take_request().is_none());
    }

    #[test]
    fn requests_after_a_resize_are_checked_against_the_new_size() {
        let (state, mut f) = in_transmission();
        let read = Request {
            flags: CmdFlags::empty(),
            command: Command::Read,
            cookie: 1,
            offset: 1 << 20,
            length: 512,
        };
        let header = read.encode(false).unwrap();
        f.frame(&header);
        assert!(state.take_request().unwrap().is_err(), "past the end");
        // A RESIZE that grew the export, carried out before its reply.
        state.set_size(2 << 20);
        f.frame(&header);
        assert_eq!(state.take_request().unwrap().unwrap().cookie(), 1);
        state.set_size(1 << 20);
        f.frame(&header);
        assert!(state.take_request().unwrap().is_err(), "shrunk again");
    }
}
