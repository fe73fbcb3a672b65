//! The client's framer: where each server message (handshake reply or transmission reply)
//! ends, and where a READ reply's data may be placed.

use super::{FrameError, FrameLimits, Need, check_len};
use crate::consts as c;
use crate::wire::{be_u16, be_u32, be_u64};

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
    use crate::framing::tests::L;

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
