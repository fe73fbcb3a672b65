//! The client side of NBD framing for a QP: it tells the NIC where each server message ends,
//! so that every reply (header plus read data) lands in one receive WR — or, for a READ into
//! registered memory ([`crate::Op::ReadInto`]), where its data go: the NIC then places them
//! straight into the caller's buffer and only the reply header into the WR.
//!
//! The phase lives in an `AtomicU8` shared with the connection, which updates it after each
//! handshake message and before it posts the next receive WR (the NIC consults the framer only
//! when a receive WR is posted). Simple replies do not say how long their data is, and only
//! the client knows where a READ's data belong: the connection records every outstanding
//! READ by cookie in `reads` *before* it posts the request. The framer also refuses, from its
//! header, an `OFFSET_DATA` chunk announcing data past its read: framed by its announced
//! length, the client would otherwise wait for data a broken server may never send, and end
//! in a request timeout instead of a protocol error.
//!
//! A read's entry leaves the table when the framer sees the read's last message (a simple
//! reply, or a chunk with the DONE flag), so once the client has handled that message no
//! later message can be placed into the buffer, whatever the server sends.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use nbd_proto::consts as c;
use nbd_proto::framing::{
    ClientPhase, DataAt, FrameLimits, Need, ReadChunk, client_data_at, client_need,
    client_read_chunk, reply_cookie,
};
use parking_lot::Mutex;
use qpip_core::{Frame, Framer, Sge};

/// An outstanding READ, as the framer needs it.
#[derive(Clone, Copy, Debug)]
pub struct PendingRead {
    pub offset: u64,
    pub length: u32,
    /// Answered by a simple reply (no structured replies negotiated): the reply's data
    /// length is the read's.
    pub simple: bool,
    /// Registered memory for the read's data (`length` bytes), where the NIC places them.
    pub into: Option<Sge>,
}

/// Cookie → outstanding READs (the framer frames simple replies, places data, and refuses
/// a data chunk that runs past its read from its header).
pub type Reads = Arc<Mutex<HashMap<u64, PendingRead>>>;

/// Why the framer refused the server's last message: the NIC only reports a framing error,
/// the connection reads the reason from here.
pub type FrameFault = Arc<Mutex<Option<String>>>;

pub struct ClientFramer {
    phase: Arc<AtomicU8>,
    reads: Reads,
    limits: FrameLimits,
    fault: FrameFault,
}

impl ClientFramer {
    pub fn new(phase: Arc<AtomicU8>, reads: Reads, limits: FrameLimits, fault: FrameFault) -> Self {
        ClientFramer {
            phase,
            reads,
            limits,
            fault,
        }
    }

    fn invalid(&self, why: String) -> Frame {
        *self.fault.lock() = Some(why.clone());
        Frame::Invalid(why)
    }
}

impl Framer for ClientFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let phase =
            ClientPhase::from_u8(self.phase.load(Ordering::Acquire)).unwrap_or(ClientPhase::Closed);
        let mut reads = self.reads.lock();
        let need = client_need(phase, header, &self.limits, |cookie| {
            reads.get(&cookie).filter(|r| r.simple).map(|r| r.length)
        });
        let (header_len, body_len) = match need {
            Need::Header(n) => return Frame::NeedHeader(n),
            Need::Invalid(e) => return self.invalid(e.to_string()),
            Need::Message {
                header_len,
                body_len,
            } => (header_len, body_len),
        };
        let whole = Frame::Message {
            header_len,
            strip: 0,
            body_len,
        };
        let transmission = matches!(
            phase,
            ClientPhase::Transmission | ClientPhase::TransmissionExtended
        );
        if !transmission || reads.is_empty() {
            return whole;
        }
        // A data chunk announcing more than its read is refused now: its data may never come.
        match client_read_chunk(header, |cookie| {
            reads.get(&cookie).map(|r| (r.offset, r.length))
        }) {
            ReadChunk::Header(n) => return Frame::NeedHeader(n),
            ReadChunk::Invalid(e) => {
                drop(reads);
                return self.invalid(e.to_string());
            }
            ReadChunk::Fits => {}
        }
        // A simple reply carries data only where simple replies were negotiated.
        let simple = header.first_chunk::<4>() == Some(&c::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let place = client_data_at(header, |cookie| {
            reads
                .get(&cookie)
                .filter(|r| r.into.is_some() && r.simple == simple)
                .map(|r| (r.offset, r.length))
        });
        if let DataAt::Header(n) = place {
            return Frame::NeedHeader(n);
        }
        // The message is committed: the read's last one takes its entry out of the table.
        let last = match reply_cookie(header) {
            Some((cookie, last)) if last => reads.remove(&cookie),
            Some((cookie, _)) => reads.get(&cookie).copied(),
            None => None,
        };
        match (place, last.and_then(|r| r.into)) {
            (
                DataAt::Data {
                    header_len,
                    at,
                    len,
                },
                Some(into),
            ) => Frame::MessageAt {
                header_len,
                strip: 0,
                body: Sge {
                    addr: into.addr + at as u64,
                    len: len as u32,
                    lkey: into.lkey,
                },
            },
            _ => whole,
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
        let reads: Reads = Default::default();
        let mut f = ClientFramer::new(
            phase.clone(),
            reads.clone(),
            FrameLimits::default(),
            FrameFault::default(),
        );
        assert!(matches!(
            f.frame(&[]),
            Frame::Message { header_len: 18, .. }
        ));
        phase.store(ClientPhase::Transmission.to_u8(), Ordering::Release);
        reads.lock().insert(
            7,
            PendingRead {
                offset: 0,
                length: 4096,
                simple: true,
                into: None,
            },
        );
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
