//! The server's placement machine: where each client message ends and, in the transmission
//! phase, which request it carries (parsed and checked here, once) and whether a WRITE's
//! payload goes straight to the export.
//!
//! The transport's framer runs it on the NIC's thread and hands each parsed request to the
//! connection with the message's completion, so the connection never parses a header.
//! Nothing here allocates: a frame is decided from the header bytes and the machine's own
//! few fields.

use crate::framing::{FrameError, FrameLimits, Need, ServerPhase, server_need};
use crate::transmission::server::{Refusal, ServerTransmission, ValidRequest};
use crate::transmission::{Request, ValidCommand};

/// Which WRITE payloads the transport may place in the export itself (a raw image the NIC
/// writes into): valid WRITEs of at least `min_len` bytes that start at `from` or later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceWrites {
    /// Smallest payload placed; smaller ones ride in the receive slot (where placing costs
    /// more than the copy it saves).
    pub min_len: u32,
    /// Writes that start below this offset are not placed: the store checks them first.
    pub from: u64,
}

/// What the machine decided for the next client message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerFrame {
    /// Read until this many bytes of the message are present, then ask again.
    NeedHeader(usize),
    /// A handshake message (client flags, or an option with its data), delivered whole.
    Message {
        /// Header bytes.
        header_len: usize,
        /// Bytes after the header.
        body_len: usize,
    },
    /// A request: its header, parsed and checked, and the first `body_len` bytes of its
    /// payload in the same message; the rest of the payload follows as
    /// [`ServerFrame::Payload`] messages.
    Request {
        /// Header bytes.
        header_len: usize,
        /// Payload bytes in this message.
        body_len: usize,
        /// The request, or how to refuse it (after reading its payload).
        request: Result<ValidRequest, Refusal>,
    },
    /// A valid WRITE whose whole payload (`len` bytes) goes into the export at `offset`;
    /// the message holds only the header.
    PlacedWrite {
        /// Header bytes.
        header_len: usize,
        /// Where the payload goes in the export.
        offset: u64,
        /// Payload bytes.
        len: u32,
        /// The request.
        request: ValidRequest,
    },
    /// The next piece (`len` bytes, no header) of the current request's payload.
    Payload {
        /// Payload bytes in this message.
        len: usize,
    },
    /// The bytes cannot start a valid message: the connection must close.
    Invalid(FrameError),
}

/// One connection's placement state, driven by the framer (see the module docs).
#[derive(Debug, Clone)]
pub struct ServerPlacement {
    limits: FrameLimits,
    /// Largest payload piece in one message (a receive slot's size).
    chunk: usize,
    /// Payload bytes of the current request still to come as [`ServerFrame::Payload`].
    pending: u64,
    /// The transmission phase's checks, once it has started.
    session: Option<ServerTransmission>,
    place: Option<PlaceWrites>,
}

impl ServerPlacement {
    /// A machine for a new connection: messages up to `limits`, payload pieces of at most
    /// `chunk` bytes.
    pub fn new(limits: FrameLimits, chunk: usize) -> Self {
        Self {
            limits,
            chunk: chunk.max(1),
            pending: 0,
            session: None,
            place: None,
        }
    }

    /// The transmission phase starts: requests are checked by `session` (its shutdown rule
    /// aside, which the connection applies when it executes them, [`ServerTransmission::admit`])
    /// and WRITEs placed as `place` allows.
    pub fn start_transmission(&mut self, session: ServerTransmission, place: Option<PlaceWrites>) {
        self.session = Some(session);
        self.place = place;
    }

    /// The export's size changed under the connection (a RESIZE it carried out): requests
    /// are checked against `size` from now on.
    pub fn set_size(&mut self, size: u64) {
        if let Some(session) = &mut self.session {
            session.set_size(size);
        }
    }

    /// The transmission phase has started.
    pub const fn in_transmission(&self) -> bool {
        self.session.is_some()
    }

    /// Decides the message that starts with `header` (the bytes received so far of it) in
    /// `phase`; the client flags move `phase` on to the options. The same prefix gets the
    /// same answer until the answer is a message; the machine then commits to it.
    pub fn frame(&mut self, phase: &mut ServerPhase, header: &[u8]) -> ServerFrame {
        let extended = match *phase {
            ServerPhase::Transmission => false,
            ServerPhase::TransmissionExtended => true,
            handshake => return self.handshake(phase, handshake, header),
        };
        if self.pending > 0 {
            let n = self.pending.min(self.chunk as u64);
            self.pending -= n;
            // at most `chunk`, a usize
            return ServerFrame::Payload { len: n as usize };
        }
        let Some(session) = &self.session else {
            return ServerFrame::Invalid(FrameError::Unexpected);
        };
        let (header_len, payload) = match server_need(*phase, header, &self.limits) {
            Need::Header(n) => return ServerFrame::NeedHeader(n),
            Need::Invalid(e) => return ServerFrame::Invalid(e),
            Need::Message {
                header_len,
                body_len,
            } => (header_len, body_len),
        };
        // The framer saw the whole header and its magic: it parses.
        let Some(Ok(req)) = header
            .get(..header_len)
            .map(|h| Request::parse(h, extended))
        else {
            return ServerFrame::Invalid(FrameError::Unexpected);
        };
        let request = session.check(&req);
        if let Ok(valid) = request
            && let Some((offset, len)) = self.placed(&valid, payload)
        {
            return ServerFrame::PlacedWrite {
                header_len,
                offset,
                len,
                request: valid,
            };
        }
        let now = payload.min(self.chunk);
        self.pending = (payload - now) as u64;
        ServerFrame::Request {
            header_len,
            body_len: now,
            request,
        }
    }

    /// Where a valid request's `payload` goes in the export, if it is a WRITE to place.
    fn placed(&self, req: &ValidRequest, payload: usize) -> Option<(u64, u32)> {
        let place = self.place?;
        let ValidCommand::Write { range, .. } = *req.command() else {
            return None;
        };
        let len = u32::try_from(payload).ok()?;
        (len >= place.min_len && range.offset() >= place.from).then_some((range.offset(), len))
    }

    fn handshake(
        &mut self,
        phase: &mut ServerPhase,
        now: ServerPhase,
        header: &[u8],
    ) -> ServerFrame {
        match server_need(now, header, &self.limits) {
            Need::Header(n) => ServerFrame::NeedHeader(n),
            Need::Message { header_len, .. } if header.len() < header_len => {
                ServerFrame::NeedHeader(header_len)
            }
            Need::Message {
                header_len,
                body_len,
            } => {
                if now == ServerPhase::ClientFlags {
                    // Options follow the client flags without waiting for the server.
                    *phase = ServerPhase::Options;
                }
                ServerFrame::Message {
                    header_len,
                    body_len,
                }
            }
            Need::Invalid(e) => ServerFrame::Invalid(e),
        }
    }
}

#[cfg(test)]
mod tests;
