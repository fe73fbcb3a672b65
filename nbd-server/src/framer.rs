//! The QP framer for the server side of NBD: it tells the NIC where each client message ends,
//! so that every request (header plus write payload) lands in one receive WR.
//!
//! Write payloads longer than a receive slot arrive as continuation messages of at most one
//! slot each (`header_len` 0), so 32 MiB writes need no 32 MiB buffers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use nbd_proto::framing::{FrameLimits, Need, ServerPhase, server_need};
use qpip_core::{Frame, Framer};

pub struct ServerFramer {
    phase: Arc<AtomicU8>,
    limits: FrameLimits,
    /// Largest body placed in one receive WR.
    chunk: usize,
    /// Payload bytes of the current WRITE still to come as continuation messages.
    pending: u64,
}

impl ServerFramer {
    /// `phase` is shared with the connection, which moves it to `Transmission` before it sends
    /// the reply that ends the handshake (the client sends nothing until it has that reply).
    pub fn new(phase: Arc<AtomicU8>, limits: FrameLimits, chunk: usize) -> Self {
        ServerFramer {
            phase,
            limits,
            chunk: chunk.max(1),
            pending: 0,
        }
    }
}

impl Framer for ServerFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let phase = ServerPhase::from_u8(self.phase.load(Ordering::Acquire))
            .unwrap_or(ServerPhase::Transmission);
        let transmission = matches!(
            phase,
            ServerPhase::Transmission | ServerPhase::TransmissionExtended
        );
        if transmission && self.pending > 0 {
            let n = self.pending.min(self.chunk as u64);
            self.pending -= n;
            return Frame::Message {
                header_len: 0,
                strip: 0,
                body_len: n as usize,
            };
        }
        match server_need(phase, header, &self.limits) {
            Need::Header(n) => Frame::NeedHeader(n),
            Need::Message { header_len, .. } if header.len() < header_len => {
                Frame::NeedHeader(header_len)
            }
            Need::Message {
                header_len,
                body_len,
            } => {
                // The message is committed here: advance the framer's own state.
                if phase == ServerPhase::ClientFlags {
                    // Options follow the client flags without waiting for the server.
                    self.phase
                        .store(ServerPhase::Options.to_u8(), Ordering::Release);
                }
                let now = body_len.min(self.chunk);
                self.pending = (body_len - now) as u64;
                Frame::Message {
                    header_len,
                    strip: 0,
                    body_len: now,
                }
            }
            Need::Invalid(e) => Frame::Invalid(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd_proto::flags::CmdFlags;
    use nbd_proto::transmission::{Command, Request};

    #[test]
    fn large_writes_come_in_chunks_then_requests_resume() {
        for (phase, extended) in [
            (ServerPhase::Transmission, false),
            (ServerPhase::TransmissionExtended, true),
        ] {
            large_write(phase, extended);
        }
    }

    fn large_write(phase: ServerPhase, extended: bool) {
        let phase = Arc::new(AtomicU8::new(phase.to_u8()));
        let mut f = ServerFramer::new(phase, FrameLimits::default(), 1000);
        let write = Request {
            flags: if extended {
                CmdFlags::PAYLOAD_LEN
            } else {
                CmdFlags::empty()
            },
            command: Command::Write,
            cookie: 1,
            offset: 0,
            length: 2500,
        };
        let hdr = write.encode(extended).unwrap();
        let header_len = Request::header_len(extended);
        assert_eq!(f.frame(&hdr[..10]), Frame::NeedHeader(header_len));
        assert_eq!(
            f.frame(&hdr),
            Frame::Message {
                header_len,
                strip: 0,
                body_len: 1000
            }
        );
        assert_eq!(
            f.frame(&[]),
            Frame::Message {
                header_len: 0,
                strip: 0,
                body_len: 1000
            }
        );
        assert_eq!(
            f.frame(&[]),
            Frame::Message {
                header_len: 0,
                strip: 0,
                body_len: 500
            }
        );
        let read = Request {
            flags: CmdFlags::empty(),
            command: Command::Read,
            cookie: 2,
            ..write
        };
        assert_eq!(
            f.frame(&read.encode(extended).unwrap()),
            Frame::Message {
                header_len,
                strip: 0,
                body_len: 0
            }
        );
    }

    #[test]
    fn client_flags_then_options() {
        let phase = Arc::new(AtomicU8::new(ServerPhase::ClientFlags.to_u8()));
        let mut f = ServerFramer::new(phase.clone(), FrameLimits::default(), 1000);
        assert_eq!(f.frame(&[]), Frame::NeedHeader(4));
        assert_eq!(
            f.frame(&[0, 0, 0, 3]),
            Frame::Message {
                header_len: 4,
                strip: 0,
                body_len: 0
            }
        );
        assert_eq!(phase.load(Ordering::Acquire), ServerPhase::Options.to_u8());
        assert_eq!(f.frame(&[]), Frame::NeedHeader(16));
        assert!(
            matches!(f.frame(&[0u8; 16]), Frame::Invalid(_)),
            "bad option magic"
        );
    }
}
