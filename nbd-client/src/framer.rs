//! The client side of NBD framing for a QP: it tells the NIC where each server message ends,
//! so that every reply (header plus read data) lands in one receive WR.
//!
//! The phase lives in an `AtomicU8` shared with the connection, which updates it after each
//! handshake message and before it posts the next receive WR (the NIC consults the framer only
//! when a receive WR is posted). Simple replies do not say how long their data is: the
//! connection records the length of every outstanding simple-reply READ by cookie in `reads`
//! *before* it posts the request.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use nbd_proto::framing::{ClientPhase, FrameLimits, Need, client_need};
use parking_lot::Mutex;
use qpip_core::{Frame, Framer};

/// Cookie → length of each outstanding READ (simple replies only).
pub type ReadLengths = Arc<Mutex<HashMap<u64, u32>>>;

pub struct ClientFramer {
    phase: Arc<AtomicU8>,
    reads: ReadLengths,
    limits: FrameLimits,
}

impl ClientFramer {
    pub fn new(phase: Arc<AtomicU8>, reads: ReadLengths, limits: FrameLimits) -> Self {
        ClientFramer {
            phase,
            reads,
            limits,
        }
    }
}

impl Framer for ClientFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let phase =
            ClientPhase::from_u8(self.phase.load(Ordering::Acquire)).unwrap_or(ClientPhase::Closed);
        let reads = &self.reads;
        match client_need(phase, header, &self.limits, |cookie| {
            reads.lock().get(&cookie).copied()
        }) {
            Need::Header(n) => Frame::NeedHeader(n),
            Need::Message {
                header_len,
                body_len,
            } => Frame::Message {
                header_len,
                strip: 0,
                body_len,
            },
            Need::Invalid(e) => Frame::Invalid(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd_proto::reply::SimpleReply;

    #[test]
    fn simple_read_replies_use_the_recorded_length() {
        let phase = Arc::new(AtomicU8::new(ClientPhase::Greeting.to_u8()));
        let reads: ReadLengths = Default::default();
        let mut f = ClientFramer::new(phase.clone(), reads.clone(), FrameLimits::default());
        assert!(matches!(
            f.frame(&[]),
            Frame::Message { header_len: 18, .. }
        ));
        phase.store(ClientPhase::Transmission.to_u8(), Ordering::Release);
        reads.lock().insert(7, 4096);
        let ok = SimpleReply::ok(7).encode();
        assert_eq!(f.frame(&ok[..4]), Frame::NeedHeader(16));
        assert_eq!(
            f.frame(&ok),
            Frame::Message {
                header_len: 16,
                strip: 0,
                body_len: 4096
            }
        );
        let other = SimpleReply::ok(8).encode();
        assert_eq!(
            f.frame(&other),
            Frame::Message {
                header_len: 16,
                strip: 0,
                body_len: 0
            }
        );
        assert!(matches!(f.frame(&[0, 0, 0, 0]), Frame::Invalid(_)));
        phase.store(ClientPhase::Closed.to_u8(), Ordering::Release);
        assert!(matches!(f.frame(&[]), Frame::Invalid(_)));
    }
}
