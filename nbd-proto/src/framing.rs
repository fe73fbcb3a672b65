//! Message framing for message-oriented transports.
//!
//! A transport that delivers whole messages (such as the queue-pair transport)
//! asks a *framer* where the next message ends: it shows the framer the bytes
//! received so far and gets back a [`Need`]. A message is **header + body**:
//! the header is small and parsed by this crate; the body is bulk data (the
//! payload of an `NBD_CMD_WRITE`, the data of a read reply, option data) which
//! the transport may place directly into registered memory.
//!
//! The framers are pure functions of `(phase, prefix)`. The phase is a small
//! `Copy` enum with a `u8` representation so a caller can keep it in an
//! `AtomicU8` shared with its receive path. A server flips its phase to
//! [`ServerPhase::Transmission`] right before sending the final reply of the
//! handshake (`NBD_OPT_GO` ack or `NBD_OPT_EXPORT_NAME` reply), since the
//! client may pipeline its first request right after.
//!
//! Over 600 lines: the server's and the client's framing share the header rules; nearly half is tests.

use crate::consts as c;
use crate::wire::{be_u16, be_u32, be_u64};

/// Limits enforced by the framers (bounded memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest option data (server side) or option reply data (client side).
    pub max_option_len: u32,
    /// Largest `NBD_CMD_WRITE` payload accepted by the server framer.
    pub max_write_len: u32,
    /// Largest reply body (simple-reply read data or structured chunk payload)
    /// accepted by the client framer.
    pub max_reply_len: u32,
}

/// Default option data cap: 64 KiB (an export name is at most 4 KiB).
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 * 1024;
/// Default write payload cap: 32 MiB (2^25), the size the spec says SHOULD NOT
/// be considered a denial of service.
pub const DEFAULT_MAX_WRITE_LEN: u32 = 1 << 25;
/// Default reply body cap: 32 MiB of data plus the 8-byte offset of an
/// `OFFSET_DATA` chunk.
pub const DEFAULT_MAX_REPLY_LEN: u32 = (1 << 25) + 8;

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_option_len: DEFAULT_MAX_OPTION_LEN,
            max_write_len: DEFAULT_MAX_WRITE_LEN,
            max_reply_len: DEFAULT_MAX_REPLY_LEN,
        }
    }
}

/// Why a prefix can never become a valid message (the connection must be dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Wrong magic number.
    #[error("bad magic {found:#x}, expected {expected:#x}")]
    BadMagic {
        /// Expected magic.
        expected: u64,
        /// Magic found.
        found: u64,
    },
    /// A length above the configured limit.
    #[error("length {len} exceeds limit {limit}")]
    TooLong {
        /// Length announced.
        len: u64,
        /// Limit.
        limit: u32,
    },
    /// The phase does not expect any message from the peer.
    #[error("no message expected in this phase")]
    Unexpected,
    /// An `OFFSET_DATA` chunk with more data than its read asked for.
    #[error("a data chunk of {len} bytes is longer than its read of {read_len} bytes")]
    ChunkLongerThanRead {
        /// Bytes of data the chunk header announces.
        len: u64,
        /// The read's length.
        read_len: u32,
    },
    /// An `OFFSET_DATA` chunk whose data lie (partly) outside its read.
    #[error(
        "a data chunk of {len} bytes at offset {offset} lies outside the read of {read_len} \
         bytes at {read_offset}"
    )]
    ChunkOutsideRead {
        /// The chunk's offset.
        offset: u64,
        /// Bytes of data the chunk header announces.
        len: u64,
        /// The read's offset.
        read_offset: u64,
        /// The read's length.
        read_len: u32,
    },
}

/// The framer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Not enough bytes to know the message length: wait until at least this
    /// many bytes (counted from the start of the message) are available.
    Header(usize),
    /// The message is `header_len + body_len` bytes long.
    Message {
        /// Bytes of header (parsed by this crate).
        header_len: usize,
        /// Bytes of body (bulk data).
        body_len: usize,
    },
    /// The bytes can never form a valid message.
    Invalid(FrameError),
}

impl Need {
    /// Total message length, once known.
    pub const fn total(&self) -> Option<usize> {
        match *self {
            Self::Message {
                header_len,
                body_len,
            } => Some(header_len + body_len),
            _ => None,
        }
    }
}

fn check_len(len: u64, limit: u32) -> Result<usize, FrameError> {
    if len > u64::from(limit) {
        Err(FrameError::TooLong { len, limit })
    } else {
        // at most a u32, which fits usize on the platforms this crate supports (>= 32 bit)
        Ok(len as usize)
    }
}

/// Which client message a server expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ServerPhase {
    /// The 4-byte client flags.
    ClientFlags = 0,
    /// Option requests: 16-byte header + data.
    Options = 1,
    /// Requests: 28-byte header (+ payload for `WRITE`).
    Transmission = 2,
    /// Extended requests: 32-byte header (+ payload with `NBD_CMD_FLAG_PAYLOAD_LEN`).
    TransmissionExtended = 3,
}

impl ServerPhase {
    /// For storage in an `AtomicU8`.
    pub const fn to_u8(self) -> u8 {
        self as u8
    }
    /// Inverse of [`Self::to_u8`].
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::ClientFlags),
            1 => Some(Self::Options),
            2 => Some(Self::Transmission),
            3 => Some(Self::TransmissionExtended),
            _ => None,
        }
    }
}

/// Server-side framer: where does the client message starting at `prefix[0]` end?
pub fn server_need(phase: ServerPhase, prefix: &[u8], limits: &FrameLimits) -> Need {
    match phase {
        ServerPhase::ClientFlags => Need::Message {
            header_len: c::CLIENT_FLAGS_LEN,
            body_len: 0,
        },
        ServerPhase::Options => {
            let (Some(magic), Some(len)) = (be_u64(prefix, 0), be_u32(prefix, 12)) else {
                return Need::Header(c::OPTION_HEADER_LEN);
            };
            if magic != c::IHAVEOPT {
                return Need::Invalid(FrameError::BadMagic {
                    expected: c::IHAVEOPT,
                    found: magic,
                });
            }
            match check_len(len.into(), limits.max_option_len) {
                Ok(body_len) => Need::Message {
                    header_len: c::OPTION_HEADER_LEN,
                    body_len,
                },
                Err(e) => Need::Invalid(e),
            }
        }
        ServerPhase::Transmission | ServerPhase::TransmissionExtended => {
            let extended = phase == ServerPhase::TransmissionExtended;
            let (header_len, expected) = if extended {
                (c::EXTENDED_REQUEST_LEN, c::EXTENDED_REQUEST_MAGIC)
            } else {
                (c::REQUEST_LEN, c::REQUEST_MAGIC)
            };
            if prefix.len() < header_len {
                return Need::Header(header_len);
            }
            let magic = be_u32(prefix, 0).unwrap_or(0);
            if magic != expected {
                return Need::Invalid(FrameError::BadMagic {
                    expected: expected.into(),
                    found: magic.into(),
                });
            }
            let flags = be_u16(prefix, 4).unwrap_or(0);
            let cmd = be_u16(prefix, 6).unwrap_or(0);
            // Compact: only a WRITE has a payload. Extended: the flag says so, whatever the
            // command (the server then refuses a command that takes none, after reading it);
            // a WRITE has one even without the flag, which qemu (10) does not set.
            let payload = if extended {
                (flags & c::CMD_FLAG_PAYLOAD_LEN != 0 || cmd == c::CMD_WRITE)
                    .then(|| be_u64(prefix, 24).unwrap_or(0))
            } else {
                (cmd == c::CMD_WRITE).then(|| be_u32(prefix, 24).unwrap_or(0).into())
            };
            let body_len = match payload.map(|len| check_len(len, limits.max_write_len)) {
                None => 0,
                Some(Ok(n)) => n,
                Some(Err(e)) => return Need::Invalid(e),
            };
            Need::Message {
                header_len,
                body_len,
            }
        }
    }
}

/// Which server message a client expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ClientPhase {
    /// The 18-byte greeting.
    Greeting = 0,
    /// Option replies: 20-byte header + data.
    Options = 1,
    /// The `NBD_OPT_EXPORT_NAME` reply with 124 trailing zeroes (134 bytes).
    ExportNameReply = 2,
    /// The `NBD_OPT_EXPORT_NAME` reply when `NO_ZEROES` was negotiated (10 bytes).
    ExportNameReplyNoZeroes = 3,
    /// Simple replies (16 bytes + read data) and structured chunks (20 + length).
    Transmission = 4,
    /// Nothing is expected (handshake over without transmission).
    Closed = 5,
    /// Extended reply chunks (32 bytes + length).
    TransmissionExtended = 6,
}

impl ClientPhase {
    /// For storage in an `AtomicU8`.
    pub const fn to_u8(self) -> u8 {
        self as u8
    }
    /// Inverse of [`Self::to_u8`].
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::Greeting),
            1 => Some(Self::Options),
            2 => Some(Self::ExportNameReply),
            3 => Some(Self::ExportNameReplyNoZeroes),
            4 => Some(Self::Transmission),
            5 => Some(Self::Closed),
            6 => Some(Self::TransmissionExtended),
            _ => None,
        }
    }
}

/// Client-side framer: where does the server message starting at `prefix[0]` end?
///
/// In the transmission phase, a simple reply carries read data only for a
/// successful `NBD_CMD_READ`, and only the client knows which cookies are
/// reads: `read_len(cookie)` must return `Some(length)` for a pending read and
/// `None` otherwise (the body is then empty). Structured chunks are self-describing.
pub fn client_need(
    phase: ClientPhase,
    prefix: &[u8],
    limits: &FrameLimits,
    mut read_len: impl FnMut(u64) -> Option<u32>,
) -> Need {
    let fixed = |n: usize| Need::Message {
        header_len: n,
        body_len: 0,
    };
    match phase {
        ClientPhase::Greeting => fixed(c::GREETING_LEN),
        ClientPhase::ExportNameReply => {
            fixed(c::EXPORT_NAME_REPLY_SHORT_LEN + c::EXPORT_NAME_ZEROES)
        }
        ClientPhase::ExportNameReplyNoZeroes => fixed(c::EXPORT_NAME_REPLY_SHORT_LEN),
        ClientPhase::Closed => Need::Invalid(FrameError::Unexpected),
        ClientPhase::Options => {
            let (Some(magic), Some(len)) = (be_u64(prefix, 0), be_u32(prefix, 16)) else {
                return Need::Header(c::OPTION_REPLY_HEADER_LEN);
            };
            if magic != c::OPTION_REPLY_MAGIC {
                return Need::Invalid(FrameError::BadMagic {
                    expected: c::OPTION_REPLY_MAGIC,
                    found: magic,
                });
            }
            match check_len(len.into(), limits.max_option_len) {
                Ok(body_len) => Need::Message {
                    header_len: c::OPTION_REPLY_HEADER_LEN,
                    body_len,
                },
                Err(e) => Need::Invalid(e),
            }
        }
        ClientPhase::Transmission => {
            let Some(magic) = be_u32(prefix, 0) else {
                return Need::Header(4);
            };
            match magic {
                c::SIMPLE_REPLY_MAGIC => {
                    let (Some(error), Some(cookie)) = (be_u32(prefix, 4), be_u64(prefix, 8)) else {
                        return Need::Header(c::SIMPLE_REPLY_LEN);
                    };
                    let body = if error == 0 {
                        read_len(cookie).unwrap_or(0)
                    } else {
                        0
                    };
                    match check_len(body.into(), limits.max_reply_len) {
                        Ok(body_len) => Need::Message {
                            header_len: c::SIMPLE_REPLY_LEN,
                            body_len,
                        },
                        Err(e) => Need::Invalid(e),
                    }
                }
                c::STRUCTURED_REPLY_MAGIC => {
                    let Some(len) = be_u32(prefix, 16) else {
                        return Need::Header(c::STRUCTURED_REPLY_HEADER_LEN);
                    };
                    match check_len(len.into(), limits.max_reply_len) {
                        Ok(body_len) => Need::Message {
                            header_len: c::STRUCTURED_REPLY_HEADER_LEN,
                            body_len,
                        },
                        Err(e) => Need::Invalid(e),
                    }
                }
                other => Need::Invalid(FrameError::BadMagic {
                    expected: c::SIMPLE_REPLY_MAGIC.into(),
                    found: other.into(),
                }),
            }
        }
        // With extended headers every reply is an extended chunk, even without payload.
        ClientPhase::TransmissionExtended => {
            let (Some(magic), Some(len)) = (be_u32(prefix, 0), be_u64(prefix, 24)) else {
                return Need::Header(c::EXTENDED_REPLY_HEADER_LEN);
            };
            if magic != c::EXTENDED_REPLY_MAGIC {
                return Need::Invalid(FrameError::BadMagic {
                    expected: c::EXTENDED_REPLY_MAGIC.into(),
                    found: magic.into(),
                });
            }
            match check_len(len, limits.max_reply_len) {
                Ok(body_len) => Need::Message {
                    header_len: c::EXTENDED_REPLY_HEADER_LEN,
                    body_len,
                },
                Err(e) => Need::Invalid(e),
            }
        }
    }
}

/// The cookie of the transmission-phase server message that starts with `prefix` (its
/// header complete), and whether it is that request's last message: a simple reply, or a
/// structured or extended chunk with the DONE flag. `None` for anything else.
pub fn reply_cookie(prefix: &[u8]) -> Option<(u64, bool)> {
    match be_u32(prefix, 0)? {
        c::SIMPLE_REPLY_MAGIC => Some((be_u64(prefix, 8)?, true)),
        c::STRUCTURED_REPLY_MAGIC | c::EXTENDED_REPLY_MAGIC => {
            let flags = be_u16(prefix, 4)?;
            Some((be_u64(prefix, 8)?, flags & c::REPLY_FLAG_DONE != 0))
        }
        _ => None,
    }
}

/// Where a reply message's READ data go, for a NIC that places them straight into the
/// read's buffer ([`client_data_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataAt {
    /// The message is READ data for a placed read, but its offset is still to come: wait
    /// until this many bytes of the message are available.
    Header(usize),
    /// The message's first `header_len` bytes are its header; the `len` bytes after them are
    /// data for bytes `at..at + len` of the read's buffer (checked to lie inside it).
    Data {
        /// Bytes of header (with an OFFSET_DATA chunk's 8-byte offset).
        header_len: usize,
        /// Where the data start in the read's buffer.
        at: usize,
        /// Bytes of data.
        len: usize,
    },
    /// Nothing to place: the message is delivered whole (and checked by
    /// [`crate::transmission::client::reply_check::ReplyCheck`] as usual, which refuses what is wrong with it).
    Whole,
}

/// For a transmission-phase server message on which [`client_need`] answered `Message`:
/// whether it carries data for a READ that the client wants placed straight into its buffer.
/// `placed_read(cookie)` gives `(offset, length)` of such a read, `None` for any other
/// cookie. A successful simple reply to it (its data is the whole read) and an OFFSET_DATA
/// chunk whose data lie inside the read qualify; everything else, and every chunk whose
/// numbers do not fit the read, is delivered whole so that nothing the server sends can put
/// data outside the read's buffer.
pub fn client_data_at(
    prefix: &[u8],
    mut placed_read: impl FnMut(u64) -> Option<(u64, u32)>,
) -> DataAt {
    match be_u32(prefix, 0) {
        Some(c::SIMPLE_REPLY_MAGIC) => {
            let (Some(0), Some(cookie)) = (be_u32(prefix, 4), be_u64(prefix, 8)) else {
                return DataAt::Whole;
            };
            match placed_read(cookie) {
                Some((_, len)) if len > 0 => DataAt::Data {
                    header_len: c::SIMPLE_REPLY_LEN,
                    at: 0,
                    len: len as usize,
                },
                _ => DataAt::Whole,
            }
        }
        Some(magic @ (c::STRUCTURED_REPLY_MAGIC | c::EXTENDED_REPLY_MAGIC)) => {
            let (chunk_header, length) = if magic == c::EXTENDED_REPLY_MAGIC {
                (c::EXTENDED_REPLY_HEADER_LEN, be_u64(prefix, 24))
            } else {
                (
                    c::STRUCTURED_REPLY_HEADER_LEN,
                    be_u32(prefix, 16).map(u64::from),
                )
            };
            let (Some(ty), Some(cookie), Some(length)) =
                (be_u16(prefix, 6), be_u64(prefix, 8), length)
            else {
                return DataAt::Whole;
            };
            if ty != c::REPLY_TYPE_OFFSET_DATA || length <= 8 {
                return DataAt::Whole;
            }
            let Some((offset, read_len)) = placed_read(cookie) else {
                return DataAt::Whole;
            };
            let header_len = chunk_header + 8;
            let Some(chunk_offset) = be_u64(prefix, chunk_header) else {
                return DataAt::Header(header_len);
            };
            let len = length - 8;
            match chunk_offset.checked_sub(offset) {
                Some(at)
                    if at
                        .checked_add(len)
                        .is_some_and(|e| e <= u64::from(read_len)) =>
                {
                    DataAt::Data {
                        header_len,
                        at: at as usize,
                        len: len as usize,
                    }
                }
                _ => DataAt::Whole,
            }
        }
        _ => DataAt::Whole,
    }
}

/// Whether a reply message fits its read, judged from the header alone ([`client_read_chunk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadChunk {
    /// An `OFFSET_DATA` chunk of a known read whose offset is still to come: wait until this
    /// many bytes of the message are available.
    Header(usize),
    /// Nothing to refuse here: not an `OFFSET_DATA` chunk of a known read, or one that lies
    /// inside its read (the whole message is still checked by
    /// [`crate::transmission::client::reply_check::ReplyCheck`]).
    Fits,
    /// The chunk announces data beyond its read: the server broke the protocol, and waiting
    /// for those bytes could only end in a timeout.
    Invalid(FrameError),
}

/// Checks the header of an `OFFSET_DATA` chunk (structured or extended) against its read
/// *before* its data arrive: `read(cookie)` gives `(offset, length)` of every READ in flight.
/// A chunk longer than its read, or outside it, is refused at once; otherwise a client that
/// frames by the announced length would wait for data a broken server may never send.
pub fn client_read_chunk(
    prefix: &[u8],
    mut read: impl FnMut(u64) -> Option<(u64, u32)>,
) -> ReadChunk {
    let Some(magic @ (c::STRUCTURED_REPLY_MAGIC | c::EXTENDED_REPLY_MAGIC)) = be_u32(prefix, 0)
    else {
        return ReadChunk::Fits;
    };
    let (chunk_header, length) = if magic == c::EXTENDED_REPLY_MAGIC {
        (c::EXTENDED_REPLY_HEADER_LEN, be_u64(prefix, 24))
    } else {
        (
            c::STRUCTURED_REPLY_HEADER_LEN,
            be_u32(prefix, 16).map(u64::from),
        )
    };
    let (Some(ty), Some(cookie), Some(length)) = (be_u16(prefix, 6), be_u64(prefix, 8), length)
    else {
        return ReadChunk::Fits;
    };
    // A shorter payload is malformed, which the reply check reports.
    if ty != c::REPLY_TYPE_OFFSET_DATA || length <= 8 {
        return ReadChunk::Fits;
    }
    let Some((read_offset, read_len)) = read(cookie) else {
        return ReadChunk::Fits;
    };
    let len = length - 8;
    if len > u64::from(read_len) {
        return ReadChunk::Invalid(FrameError::ChunkLongerThanRead { len, read_len });
    }
    let Some(offset) = be_u64(prefix, chunk_header) else {
        return ReadChunk::Header(chunk_header + 8);
    };
    let inside = offset
        .checked_sub(read_offset)
        .and_then(|at| at.checked_add(len))
        .is_some_and(|end| end <= u64::from(read_len));
    if inside {
        ReadChunk::Fits
    } else {
        ReadChunk::Invalid(FrameError::ChunkOutsideRead {
            offset,
            len,
            read_offset,
            read_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::CmdFlags;
    use crate::transmission::{Command, Request};

    const L: FrameLimits = FrameLimits {
        max_option_len: 100,
        max_write_len: 1000,
        max_reply_len: 2000,
    };

    #[test]
    fn phases_roundtrip_u8() {
        for v in 0..4 {
            assert_eq!(ServerPhase::from_u8(v).map(ServerPhase::to_u8), Some(v));
        }
        assert_eq!(ServerPhase::from_u8(4), None);
        for v in 0..7 {
            assert_eq!(ClientPhase::from_u8(v).map(ClientPhase::to_u8), Some(v));
        }
        assert_eq!(ClientPhase::from_u8(7), None);
    }

    #[test]
    fn server_flags_and_options() {
        assert_eq!(
            server_need(ServerPhase::ClientFlags, &[], &L).total(),
            Some(4)
        );
        assert_eq!(
            server_need(ServerPhase::Options, b"IHAVE", &L),
            Need::Header(16)
        );
        let mut h = b"IHAVEOPT".to_vec();
        h.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 100]);
        assert_eq!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Message {
                header_len: 16,
                body_len: 100
            }
        );
        h[15] = 101;
        assert_eq!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Invalid(FrameError::TooLong {
                len: 101,
                limit: 100
            })
        );
        h[0] = b'X';
        assert!(matches!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn server_requests() {
        let mut r = Request {
            flags: CmdFlags::empty(),
            command: Command::Read,
            cookie: 1,
            offset: 0,
            length: 5000,
        };
        assert_eq!(
            server_need(
                ServerPhase::Transmission,
                &r.encode(false).unwrap()[..27],
                &L
            ),
            Need::Header(28)
        );
        assert_eq!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L).total(),
            Some(28)
        );
        r.command = Command::Write;
        r.length = 1000;
        assert_eq!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L),
            Need::Message {
                header_len: 28,
                body_len: 1000
            }
        );
        r.length = 1001;
        assert!(matches!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L),
            Need::Invalid(FrameError::TooLong { .. })
        ));
        assert!(matches!(
            server_need(ServerPhase::Transmission, &[0; 28], &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn extended_requests_are_framed_by_their_flag() {
        let ext = ServerPhase::TransmissionExtended;
        let mut r = Request {
            flags: CmdFlags::PAYLOAD_LEN,
            command: Command::Write,
            cookie: 1,
            offset: 0,
            length: 1000,
        };
        let h = r.encode(true).unwrap();
        assert_eq!(server_need(ext, &h[..31], &L), Need::Header(32));
        assert_eq!(
            server_need(ext, &h, &L),
            Need::Message {
                header_len: 32,
                body_len: 1000
            }
        );
        // A huge effect length without the flag has no payload; a payload on any command
        // is read (and refused later); one above the limit is a disconnect.
        r.flags = CmdFlags::empty();
        r.command = Command::Trim;
        r.length = 1 << 40;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L).total(),
            Some(32)
        );
        r.flags = CmdFlags::PAYLOAD_LEN;
        r.length = 10;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L).total(),
            Some(42)
        );
        r.length = 1 << 40;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L),
            Need::Invalid(FrameError::TooLong {
                len: 1 << 40,
                limit: 1000
            })
        );
        // The compact magic is refused in the extended phase and vice versa.
        let compact = r.encode(false);
        assert!(compact.is_err());
        r.length = 10;
        assert!(matches!(
            server_need(ext, &[&r.encode(false).unwrap()[..], &[0; 4]].concat(), &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
        assert!(matches!(
            server_need(ServerPhase::Transmission, &r.encode(true).unwrap(), &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn extended_replies_are_framed_and_placed() {
        use crate::reply::{ReplyTo, none_chunk, offset_data_header};
        let ext = ClientPhase::TransmissionExtended;
        let to = ReplyTo {
            cookie: 7,
            offset: Some(1 << 20),
        };
        let n = none_chunk(to);
        assert_eq!(client_need(ext, &n[..20], &L, |_| None), Need::Header(32));
        assert_eq!(client_need(ext, &n, &L, |_| None).total(), Some(32));
        assert_eq!(reply_cookie(&n), Some((7, true)));
        // Simple and structured replies do not exist with extended headers.
        let structured = [&none_chunk(7)[..], &[0; 12]].concat();
        assert!(matches!(
            client_need(ext, &structured, &L, |_| None),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
        let d = offset_data_header(to, true, (1 << 20) + 100, 50).unwrap();
        assert_eq!(
            client_need(ext, &d, &L, |_| None),
            Need::Message {
                header_len: 32,
                body_len: 58
            }
        );
        let reads = |cookie| (cookie == 7).then_some((1u64 << 20, 4096u32));
        assert_eq!(client_data_at(&d[..32], reads), DataAt::Header(40));
        assert_eq!(
            client_data_at(&d, reads),
            DataAt::Data {
                header_len: 40,
                at: 100,
                len: 50
            }
        );
        let outside = offset_data_header(to, true, (1 << 20) + 4090, 50).unwrap();
        assert_eq!(client_data_at(&outside, reads), DataAt::Whole);
        // Checked against the read before the data arrive.
        assert_eq!(client_read_chunk(&d[..32], reads), ReadChunk::Header(40));
        assert_eq!(client_read_chunk(&d, reads), ReadChunk::Fits);
        assert_eq!(
            client_read_chunk(&outside, reads),
            ReadChunk::Invalid(FrameError::ChunkOutsideRead {
                offset: (1 << 20) + 4090,
                len: 50,
                read_offset: 1 << 20,
                read_len: 4096
            })
        );
        let long = offset_data_header(to, true, 1 << 20, 4097).unwrap();
        assert_eq!(
            client_read_chunk(&long[..32], reads),
            ReadChunk::Invalid(FrameError::ChunkLongerThanRead {
                len: 4097,
                read_len: 4096
            })
        );
        let other = offset_data_header(8u64, true, 0, 1 << 20).unwrap();
        assert_eq!(client_read_chunk(&other, reads), ReadChunk::Fits);
    }

    #[test]
    fn client_handshake_frames() {
        let none = |_| None;
        assert_eq!(
            client_need(ClientPhase::Greeting, &[], &L, none).total(),
            Some(18)
        );
        assert_eq!(
            client_need(ClientPhase::ExportNameReply, &[], &L, none).total(),
            Some(134)
        );
        assert_eq!(
            client_need(ClientPhase::ExportNameReplyNoZeroes, &[], &L, none).total(),
            Some(10)
        );
        assert!(matches!(
            client_need(ClientPhase::Closed, &[], &L, none),
            Need::Invalid(_)
        ));
        let mut v = Vec::new();
        crate::handshake::encode_option_reply(c::OPT_LIST, c::REP_SERVER, &[1; 50], &mut v);
        assert_eq!(
            client_need(ClientPhase::Options, &v[..19], &L, none),
            Need::Header(20)
        );
        assert_eq!(
            client_need(ClientPhase::Options, &v, &L, none),
            Need::Message {
                header_len: 20,
                body_len: 50
            }
        );
        v.clear();
        crate::handshake::encode_option_reply(c::OPT_LIST, c::REP_SERVER, &[1; 101], &mut v);
        assert!(matches!(
            client_need(ClientPhase::Options, &v, &L, none),
            Need::Invalid(FrameError::TooLong { .. })
        ));
        assert!(matches!(
            client_need(ClientPhase::Options, &[0; 20], &L, none),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn client_transmission_frames() {
        use crate::reply::{SimpleReply, StructuredReplyHeader};
        let ok = SimpleReply {
            error: 0,
            cookie: 42,
        }
        .encode();
        let lookup = |cookie: u64| (cookie == 42).then_some(512);
        assert_eq!(
            client_need(ClientPhase::Transmission, &ok[..3], &L, lookup),
            Need::Header(4)
        );
        assert_eq!(
            client_need(ClientPhase::Transmission, &ok[..10], &L, lookup),
            Need::Header(16)
        );
        assert_eq!(
            client_need(ClientPhase::Transmission, &ok, &L, lookup),
            Need::Message {
                header_len: 16,
                body_len: 512
            }
        );
        let err = SimpleReply {
            error: 5,
            cookie: 42,
        }
        .encode();
        assert_eq!(
            client_need(ClientPhase::Transmission, &err, &L, lookup).total(),
            Some(16)
        );
        let other = SimpleReply {
            error: 0,
            cookie: 1,
        }
        .encode();
        assert_eq!(
            client_need(ClientPhase::Transmission, &other, &L, lookup).total(),
            Some(16)
        );
        assert!(matches!(
            client_need(ClientPhase::Transmission, &ok, &L, |_| Some(2001)),
            Need::Invalid(FrameError::TooLong { .. })
        ));
        let sh = StructuredReplyHeader {
            flags: crate::flags::ReplyFlags::DONE,
            reply_type: c::REPLY_TYPE_OFFSET_DATA,
            cookie: 9,
            length: 108,
            offset: None,
        }
        .encode();
        assert_eq!(
            client_need(ClientPhase::Transmission, &sh[..19], &L, lookup),
            Need::Header(20)
        );
        assert_eq!(
            client_need(ClientPhase::Transmission, &sh, &L, lookup),
            Need::Message {
                header_len: 20,
                body_len: 108
            }
        );
        assert!(matches!(
            client_need(ClientPhase::Transmission, &[1, 2, 3, 4], &L, lookup),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn read_data_is_placed_only_inside_its_read() {
        use crate::flags::ReplyFlags;
        use crate::reply::{SimpleReply, StructuredReplyHeader};
        // Cookie 7: a placed read of 4096 bytes at offset 1 MiB.
        let reads = |cookie| (cookie == 7).then_some((1u64 << 20, 4096u32));
        let simple = |error, cookie| SimpleReply { error, cookie }.encode();
        assert_eq!(
            client_data_at(&simple(0, 7), reads),
            DataAt::Data {
                header_len: 16,
                at: 0,
                len: 4096
            }
        );
        assert_eq!(client_data_at(&simple(5, 7), reads), DataAt::Whole);
        assert_eq!(client_data_at(&simple(0, 8), reads), DataAt::Whole);

        let chunk = |ty, cookie, length, offset: u64| {
            let mut m = StructuredReplyHeader {
                flags: ReplyFlags::DONE,
                reply_type: ty,
                cookie,
                length,
                offset: None,
            }
            .encode()
            .to_vec();
            m.extend_from_slice(&offset.to_be_bytes());
            m
        };
        let data = c::REPLY_TYPE_OFFSET_DATA;
        let inside = chunk(data, 7, 8 + 1000, (1 << 20) + 3096);
        assert_eq!(client_data_at(&inside[..20], reads), DataAt::Header(28));
        assert_eq!(
            client_data_at(&inside, reads),
            DataAt::Data {
                header_len: 28,
                at: 3096,
                len: 1000
            }
        );
        // One byte past the read's end, before its start, wrapping, no data, another type,
        // another cookie: delivered whole (the reply check refuses or handles them).
        for m in [
            chunk(data, 7, 8 + 1001, (1 << 20) + 3096),
            chunk(data, 7, 8 + 10, (1 << 20) - 1),
            chunk(data, 7, 8 + 10, u64::MAX - 3),
            chunk(data, 7, 8, 1 << 20),
            chunk(c::REPLY_TYPE_OFFSET_HOLE, 7, 12, 1 << 20),
            chunk(data, 8, 8 + 10, 1 << 20),
        ] {
            assert_eq!(client_data_at(&m, reads), DataAt::Whole, "{m:?}");
        }
    }
}
