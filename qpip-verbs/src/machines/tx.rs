//! The transmit machine's outgoing message: a send WR taken off the ring, its memory checked
//! against the region table and its framing header built ([`SendMessage`]), and how much of
//! it the link has taken ([`OutMsg`]). How the bytes leave (a kernel socket's `writev`, the
//! firmware's TCP send buffer) is the backend's.

use std::fs::File;
use std::net::SocketAddr;

use smallvec::SmallVec;

use crate::framer::{Framer, MAX_HEADER};
use crate::mr::{MemoryTable, Placement, ProtectionFault};
use crate::wr::SendWr;

/// A piece of an outgoing message.
pub enum Part<'a> {
    /// Bytes in memory: the framer's header, or a memory SGE's.
    Bytes(&'a [u8]),
    /// `len` bytes of a registered file from `offset` (a file SGE, or what is left of it).
    File {
        /// The file.
        file: &'a File,
        /// Where the bytes start.
        offset: u64,
        /// How many.
        len: usize,
    },
}

impl Part<'_> {
    /// Bytes in the part.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Part::Bytes(b) => b.len(),
            Part::File { len, .. } => *len,
        }
    }

    /// The part has no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The part without its first `n` bytes (`n` at most its length).
    fn skip(self, n: usize) -> Self {
        match self {
            Part::Bytes(b) => Part::Bytes(&b[n..]),
            Part::File { file, offset, len } => Part::File {
                file,
                offset: offset + n as u64,
                len: len - n,
            },
        }
    }
}

/// A send WR resolved for the wire: its memory checked against the region table and the
/// framer's header built. Both backends' transmit machines queue these: the one outgoing-message type.
pub struct SendMessage {
    /// The WR's id, for its completion.
    pub wr_id: u64,
    hdr: [u8; MAX_HEADER],
    /// Bytes of the framer's header.
    pub hdr_len: usize,
    segs: SmallVec<[Placement; 4]>,
    /// Bytes of the WR's memory after the header.
    pub body_len: usize,
    /// Where a datagram goes (unreliable QPs).
    pub dest: Option<SocketAddr>,
}

impl SendMessage {
    /// Checks every SGE (Err: the WR's id and the fault) and asks the framer for a header.
    /// Every SGE must name memory: an SGE naming a file is a protection fault.
    pub fn prepare(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
    ) -> Result<SendMessage, (u64, ProtectionFault)> {
        Self::resolve(wr, memory, framer, false)
    }

    /// As [`Self::prepare`], for a link that sends from files: an SGE may also name a range
    /// of a registered file ([`Part::File`]).
    pub fn prepare_with_files(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
    ) -> Result<SendMessage, (u64, ProtectionFault)> {
        Self::resolve(wr, memory, framer, true)
    }

    fn resolve(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
        files: bool,
    ) -> Result<SendMessage, (u64, ProtectionFault)> {
        let mut segs = SmallVec::new();
        for sge in &wr.sg_list {
            let seg = match files {
                true => memory.resolve_source(sge),
                false => memory.resolve(sge, false).map(Placement::Memory),
            };
            segs.push(seg.map_err(|f| (wr.wr_id, f))?);
        }
        let body_len = segs.iter().map(Placement::len).sum();
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

    /// The message's parts: framing header, then each SGE's.
    #[inline]
    pub fn all_parts(&self) -> impl Iterator<Item = Part<'_>> {
        let body = self.segs.iter().map(|s| match s {
            // SAFETY: the NIC owns the WR's memory until it completes it.
            Placement::Memory(m) => Part::Bytes(unsafe { m.bytes() }),
            Placement::File(f) => Part::File {
                file: f.file(),
                offset: f.offset(),
                len: f.len(),
            },
        });
        std::iter::once(Part::Bytes(&self.hdr[..self.hdr_len])).chain(body)
    }

    /// The bytes of a message [`Self::prepare`]d (which names memory only), part by part.
    #[inline]
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        self.all_parts().filter_map(|p| match p {
            Part::Bytes(b) => Some(b),
            Part::File { .. } => None,
        })
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
        SendMessage::prepare(wr, memory, framer).map(OutMsg::new)
    }

    /// Resolves a send WR as [`SendMessage::prepare_with_files`] does.
    pub fn prepare_with_files(
        wr: SendWr,
        memory: &MemoryTable,
        framer: Option<&mut dyn Framer>,
    ) -> Result<OutMsg, (u64, ProtectionFault)> {
        SendMessage::prepare_with_files(wr, memory, framer).map(OutMsg::new)
    }

    fn new(msg: SendMessage) -> OutMsg {
        OutMsg {
            msg,
            sent: 0,
            end: None,
        }
    }

    /// The parts the link has not taken yet, from `ahead` bytes past what it has taken.
    #[inline]
    pub fn unsent_parts(&self, ahead: usize) -> impl Iterator<Item = Part<'_>> {
        let mut skip = self.sent + ahead;
        self.msg.all_parts().filter_map(move |part| {
            if skip >= part.len() {
                skip -= part.len();
                return None;
            }
            let rest = part.skip(skip);
            skip = 0;
            Some(rest)
        })
    }

    /// The bytes the link has not taken yet, part by part (a message that names memory only).
    #[inline]
    pub fn unsent(&self) -> impl Iterator<Item = &[u8]> {
        self.unsent_parts(0).filter_map(|p| match p {
            Part::Bytes(b) => Some(b),
            Part::File { .. } => None,
        })
    }
}
