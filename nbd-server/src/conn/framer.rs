//! The QP framer for the server side of NBD: it tells the NIC where each client message ends,
//! so that every request (header plus write payload) lands in one receive WR.
//!
//! Write payloads longer than a receive slot arrive as continuation messages of at most one
//! slot each (`header_len` 0), so 32 MiB writes need no 32 MiB buffers.
//!
//! A valid WRITE of at least `PLACE_MIN` bytes to an export in a raw file goes further: the
//! framer names the file range as the place of its payload, and the NIC writes it into the
//! image itself (the soft NIC splices socket → pipe → file), the way a storage-offload NIC
//! puts a write's data on the disk; the receive WR takes only the header. The framer checks
//! the request exactly as the connection does (`validate_request`), so nothing the server
//! would refuse reaches the file; nor does a write to the first sector of a raw image whose
//! format was probed, which the image checks (`Image::write_at`).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use nbd_proto::consts as c;
use nbd_proto::framing::{FrameLimits, Need, ServerPhase, server_need};
use nbd_proto::transmission::{Command, Request, TransmissionInfo, validate_request};
use qpip_core::{FileRegion, Frame, Framer};

/// Smallest WRITE payload the NIC places in the image: below it a splice's extra system
/// calls cost more than the copy they save, and the payload rides in the receive slot.
pub const PLACE_MIN: usize = 32 << 10;

/// What the framer needs to place WRITE payloads in the export's file.
pub struct WritePlacement {
    pub region: FileRegion,
    pub info: TransmissionInfo,
    /// Writes that start below this offset are not placed: the store checks them
    /// ([`crate::store::Store::placement_from`]).
    pub from: u64,
}

/// What the connection tells its framer (which runs on the NIC's thread).
pub struct FramerState {
    /// The protocol phase; the connection moves it to `Transmission` before it sends the
    /// reply that ends the handshake (the client sends nothing until it has that reply).
    pub phase: AtomicU8,
    /// Set by the connection when the transmission phase starts, for raw writable exports.
    pub placement: OnceLock<WritePlacement>,
}

impl FramerState {
    pub fn new() -> Arc<FramerState> {
        Self::at(ServerPhase::ClientFlags)
    }

    pub fn at(phase: ServerPhase) -> Arc<FramerState> {
        Arc::new(FramerState {
            phase: AtomicU8::new(phase.to_u8()),
            placement: OnceLock::new(),
        })
    }

    pub fn phase(&self) -> ServerPhase {
        ServerPhase::from_u8(self.phase.load(Ordering::Acquire))
            .unwrap_or(ServerPhase::Transmission)
    }

    pub fn set_phase(&self, phase: ServerPhase) {
        self.phase.store(phase.to_u8(), Ordering::Release);
    }
}

pub struct ServerFramer {
    state: Arc<FramerState>,
    limits: FrameLimits,
    /// Largest body placed in one receive WR.
    chunk: usize,
    /// Payload bytes of the current WRITE still to come as continuation messages.
    pending: u64,
}

impl ServerFramer {
    pub fn new(state: Arc<FramerState>, limits: FrameLimits, chunk: usize) -> Self {
        ServerFramer {
            state,
            limits,
            chunk: chunk.max(1),
            pending: 0,
        }
    }
}

impl ServerFramer {
    /// Where the payload of the request in `header` goes in the image, if it is a valid WRITE
    /// worth placing there.
    fn place_write(
        &self,
        header: &[u8],
        header_len: usize,
        body_len: usize,
    ) -> Option<qpip_core::Sge> {
        let place = self.state.placement.get()?;
        if body_len < PLACE_MIN {
            return None;
        }
        let extended = header_len == c::EXTENDED_REQUEST_LEN;
        let req = Request::parse(&header[..header_len], extended).ok()?;
        if req.command != Command::Write
            || req.payload_len(extended) != body_len as u64
            || req.offset < place.from
        {
            return None;
        }
        validate_request(&req, &place.info).ok()?;
        Some(place.region.sge(req.offset, u32::try_from(body_len).ok()?))
    }
}

impl Framer for ServerFramer {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let phase = self.state.phase();
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
                    self.state.set_phase(ServerPhase::Options);
                }
                if transmission && let Some(body) = self.place_write(header, header_len, body_len) {
                    return Frame::MessageAt {
                        header_len,
                        strip: 0,
                        body,
                    };
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
        let mut f = ServerFramer::new(FramerState::at(phase), FrameLimits::default(), 1000);
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
}
