//! The transmit machine's outgoing message: a send WR taken off the ring, its memory checked
//! against the region table and its framing header built ([`SendMessage`]), and how much of
//! it the link has taken ([`OutMsg`]). How the bytes leave (a kernel socket's `writev`, the
//! firmware's TCP send buffer) is the backend's.

use std::net::SocketAddr;

use smallvec::SmallVec;

use crate::framer::{Framer, MAX_HEADER};
use crate::mr::{MemoryTable, ProtectionFault, Segment};
use crate::wr::SendWr;

/// A send WR resolved for the wire: its memory checked against the region table and the
/// framer's header built. Both backends' transmit machines queue these: the one outgoing-message type.
pub struct SendMessage {
    /// The WR's id, for its completion.
    pub wr_id: u64,
    hdr: [u8; MAX_HEADER],
    /// Bytes of the framer's header.
    pub hdr_len: usize,
    segs: SmallVec<[Segment; 4]>,
    /// Bytes of the WR's memory after the header.
    pub body_len: usize,
    /// Where a datagram goes (unreliable QPs).
    pub dest: Option<SocketAddr>,
}

impl SendMessage {
    /// Checks every SGE (Err: the WR's id and the fault) and asks the framer for a header.
    pub fn prepare(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
    ) -> Result<SendMessage, (u64, ProtectionFault)> {
        let mut segs = SmallVec::new();
        for sge in &wr.sg_list {
            segs.push(memory.resolve(sge, false).map_err(|f| (wr.wr_id, f))?);
        }
        let body_len = segs.iter().map(Segment::len).sum();
        let mut hdr = [0u8; MAX_HEADER];
        let hdr_len = framer.map_or(0, |f| f.encode_header(body_len, &mut hdr).min(MAX_HEADER));
        Ok(SendMessage {
            wr_id: wr.wr_id,
            hdr,
            hdr_len,
            segs,
            body_len,
            dest: wr.dest,
        })
    }

    /// Header plus body.
    #[inline]
    pub fn total(&self) -> usize {
        self.hdr_len + self.body_len
    }

    /// The message's parts: framing header, then each segment.
    #[inline]
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(&self.hdr[..self.hdr_len]).chain(self.segs.iter().map(|s| {
            // SAFETY: the NIC owns the WR's memory until it completes it.
            unsafe { s.bytes() }
        }))
    }
}

/// A message on its way out: the resolved WR and how much of it the link has taken.
pub struct OutMsg {
    /// The resolved WR.
    pub msg: SendMessage,
    /// Bytes (header included) the link has taken.
    pub sent: usize,
    /// On a link that completes sends when the peer acknowledges them: the stream offset
    /// just past the message, once the link has taken all of it.
    pub end: Option<u64>,
}

impl std::ops::Deref for OutMsg {
    type Target = SendMessage;
    fn deref(&self) -> &SendMessage {
        &self.msg
    }
}

impl OutMsg {
    /// Resolves a send WR as [`SendMessage::prepare`] does; nothing is taken yet.
    pub fn prepare(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
    ) -> Result<OutMsg, (u64, ProtectionFault)> {
        SendMessage::prepare(wr, memory, framer).map(|msg| OutMsg {
            msg,
            sent: 0,
            end: None,
        })
    }

    /// The bytes the link has not taken yet, part by part.
    #[inline]
    pub fn unsent(&self) -> impl Iterator<Item = &[u8]> {
        let mut skip = self.sent;
        self.msg.parts().filter_map(move |part| {
            if skip >= part.len() {
                skip -= part.len();
                return None;
            }
            let rest = &part[skip..];
            skip = 0;
            Some(rest)
        })
    }
}
