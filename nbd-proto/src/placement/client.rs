//! The client's placement: where each server message ends and where a READ reply's data go,
//! decided from the session's own table of requests in flight ([`InFlight`]), which the
//! transport's framer holds a handle to. No second table: the session opens a request to
//! the framer when it sends it ([`crate::transmission::client::ClientSession::outgoing`]),
//! and the framer closes it when it frames the request's last reply message (a simple reply,
//! or a chunk with the DONE flag), so no later message can be placed into its memory,
//! whatever the server sends, once the session has handled that one.

use crate::consts as c;
use crate::framing::{
    ClientPhase, DataAt, FrameError, FrameLimits, Need, ReadChunk, client_data_at, client_need,
    client_read_chunk, reply_cookie,
};
use crate::transmission::Command;
use crate::transmission::client::assembly::{Entry, Framing};
use crate::transmission::client::{InFlight, ReadTarget};

/// What the framer decided for the next server message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientFrame<P> {
    /// Read until this many bytes of the message are present, then ask again.
    NeedHeader(usize),
    /// The message is `header_len + body_len` bytes, delivered whole.
    Message {
        /// Header bytes.
        header_len: usize,
        /// Bytes after the header.
        body_len: usize,
    },
    /// The message's first `header_len` bytes are its header; the READ data after it go to
    /// `body`, the caller's memory as its `place` made it (inside the read's buffer).
    MessageAt {
        /// Header bytes (with an OFFSET_DATA chunk's offset).
        header_len: usize,
        /// Where the data go.
        body: P,
    },
    /// The bytes cannot start a valid message: the connection must close.
    Invalid(FrameError),
}

/// A READ whose replies the framer frames: sent on this connection, its last reply not yet
/// framed.
struct OpenRead {
    offset: u64,
    length: u32,
    /// It has memory for its data to be placed in.
    placed: bool,
}

fn open_read<R>(entry: &Entry<R>) -> Option<OpenRead> {
    (entry.req.command == Command::Read && entry.framing == Framing::Open).then(|| OpenRead {
        offset: entry.req.offset,
        // reads are at most the session's max_io, a u32
        length: entry.req.length as u32,
        placed: entry.region.is_some() && entry.req.length > 0,
    })
}

impl<R: ReadTarget> InFlight<R> {
    /// Decides the server message that starts with `header` (the bytes received so far of
    /// it) in `phase`. A READ's data are placed where `place(region, at, len)` says: `len`
    /// bytes at `at` of the read's buffer (`region`, its memory). A simple reply's data
    /// length is its read's; a data chunk announcing data past its read is refused from its
    /// header (its data may never come). Once the answer is a message, the message is
    /// committed: a request's last one closes it.
    pub fn frame<P>(
        &self,
        phase: ClientPhase,
        header: &[u8],
        limits: &FrameLimits,
        place: impl FnOnce(&R, usize, usize) -> P,
    ) -> ClientFrame<P> {
        let mut table = self.lock();
        let structured = table.structured;
        let read = |cookie: u64| table.entries.get(&cookie).and_then(open_read);
        let need = client_need(phase, header, limits, |cookie| {
            read(cookie).filter(|_| !structured).map(|r| r.length)
        });
        let (header_len, body_len) = match need {
            Need::Header(n) => return ClientFrame::NeedHeader(n),
            Need::Invalid(e) => return ClientFrame::Invalid(e),
            Need::Message {
                header_len,
                body_len,
            } => (header_len, body_len),
        };
        let whole = ClientFrame::Message {
            header_len,
            body_len,
        };
        if !matches!(
            phase,
            ClientPhase::Transmission | ClientPhase::TransmissionExtended
        ) {
            return whole;
        }
        // A data chunk announcing more than its read is refused now: its data may never come.
        match client_read_chunk(header, |cookie| read(cookie).map(|r| (r.offset, r.length))) {
            ReadChunk::Header(n) => return ClientFrame::NeedHeader(n),
            ReadChunk::Invalid(e) => return ClientFrame::Invalid(e),
            ReadChunk::Fits => {}
        }
        // A simple reply carries data only where simple replies were negotiated.
        let simple = header.first_chunk::<4>() == Some(&c::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let at = client_data_at(header, |cookie| {
            read(cookie)
                .filter(|r| r.placed && simple != structured)
                .map(|r| (r.offset, r.length))
        });
        if let DataAt::Header(n) = at {
            return ClientFrame::NeedHeader(n);
        }
        // The message is committed: the read's last one closes it to the framer.
        let Some((cookie, last)) = reply_cookie(header) else {
            return whole;
        };
        let Some(entry) = table.entries.get_mut(&cookie) else {
            return whole;
        };
        let open = open_read(entry);
        if last && entry.framing == Framing::Open {
            entry.framing = Framing::Closed;
        }
        match (at, open, &entry.region) {
            (
                DataAt::Data {
                    header_len,
                    at,
                    len,
                },
                Some(OpenRead { placed: true, .. }),
                Some(region),
            ) => ClientFrame::MessageAt {
                header_len,
                body: place(region, at, len),
            },
            _ => whole,
        }
    }
}

#[cfg(test)]
mod tests;
