//! The client side of NBD framing for a QP: a thin adapter that asks nbd-proto's placement
//! ([`InFlight::frame`]) where each server message ends — and, for a READ into registered
//! memory ([`crate::Op::ReadInto`]), where its data go: the NIC then places them straight
//! into the caller's buffer and only the reply header into the WR.
//!
//! The phase lives in an `AtomicU8` shared with the connection, which updates it after each
//! handshake message and before it posts the next receive WR (the NIC consults the framer only
//! when a receive WR is posted). The framer reads the session's own table of requests in
//! flight (no copy of it): the session opens a request to the framer when it hands out its
//! header, before the request is posted, and the framer closes it when it frames its last
//! reply message, so once the client has handled that message no later message can be
//! placed into the buffer, whatever the server sends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use nbd_proto::framing::{ClientPhase, FrameLimits};
use nbd_proto::placement::client::ClientFrame;
use nbd_proto::transmission::client::InFlight;
use parking_lot::Mutex;
use qpip_core::{Frame, Framer};

use crate::region::Region;

/// The session's requests in flight, as the framer reads them.
pub(crate) type Reads = InFlight<Region>;

/// Why the framer refused the server's last message: the NIC only reports a framing error,
/// the connection reads the reason from here.
pub(crate) type FrameFault = Arc<Mutex<Option<String>>>;

pub(crate) struct ClientFramer {
    phase: Arc<AtomicU8>,
    reads: Reads,
    limits: FrameLimits,
    fault: FrameFault,
}

impl ClientFramer {
    pub(crate) fn new(
        phase: Arc<AtomicU8>,
        reads: Reads,
        limits: FrameLimits,
        fault: FrameFault,
    ) -> Self {
        ClientFramer {
            phase,
            reads,
            limits,
            fault,
        }
    }
}

impl Framer for ClientFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let phase =
            ClientPhase::from_u8(self.phase.load(Ordering::Acquire)).unwrap_or(ClientPhase::Closed);
        let frame = self.reads.frame(phase, header, &self.limits, |r, at, len| {
            r.mr.sge(r.at + at, len)
        });
        match frame {
            ClientFrame::NeedHeader(n) => Frame::NeedHeader(n),
            ClientFrame::Message {
                header_len,
                body_len,
            } => Frame::Message {
                header_len,
                strip: 0,
                body_len,
            },
            ClientFrame::MessageAt { header_len, body } => Frame::MessageAt {
                header_len,
                strip: 0,
                body,
            },
            ClientFrame::Invalid(e) => {
                let why = e.to_string();
                *self.fault.lock() = Some(why.clone());
                Frame::Invalid(why)
            }
            _ => Frame::Invalid("unknown frame".into()),
        }
    }
}
