//! Transmission phase replies: the 16-byte simple reply, the 20-byte
//! structured reply chunk header and its 32-byte extended form, chunk payloads and
//! their builders. Block status (its chunks and the extents a reply reports) is in
//! `reply/block_status.rs`.
//!
//! Over 600 lines: every other reply and chunk type's encoding and parsing in one place, and
//! their round-trip tests (a third).

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::ReplyFlags;
use crate::request::{ErrorValue, Request};
use crate::wire::Reader;

mod block_status;

pub use block_status::{Extent, block_status_chunk, block_status_reply, select_extents};

/// A simple reply header (read data, if any, follows on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimpleReply {
    /// Raw error value (0 = success); see [`ErrorValue::from_wire`].
    pub error: u32,
    /// Cookie of the request.
    pub cookie: u64,
}

impl SimpleReply {
    /// A successful reply.
    pub const fn ok(cookie: u64) -> Self {
        Self { error: 0, cookie }
    }

    /// An error reply.
    pub const fn err(cookie: u64, error: ErrorValue) -> Self {
        Self {
            error: error.to_u32(),
            cookie,
        }
    }

    /// Encode the 16 bytes.
    pub fn encode(&self) -> [u8; c::SIMPLE_REPLY_LEN] {
        let mut b = [0u8; c::SIMPLE_REPLY_LEN];
        b[0..4].copy_from_slice(&c::SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&self.error.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b
    }

    /// Parse from the first 16 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(error), Some(cookie)) = (r.u32(), r.u32(), r.u64()) else {
            return Err(ProtoError::Truncated {
                need: c::SIMPLE_REPLY_LEN,
                got: buf.len(),
            });
        };
        if magic != c::SIMPLE_REPLY_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: c::SIMPLE_REPLY_MAGIC.into(),
                found: magic.into(),
            });
        }
        Ok(Self { error, cookie })
    }

    /// The typed error (unknown nonzero values read as `EINVAL`), `None` on success.
    pub const fn error_value(&self) -> Option<ErrorValue> {
        ErrorValue::from_wire(self.error)
    }
}

/// A structured reply chunk header, or an extended one (the payload follows on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StructuredReplyHeader {
    /// Chunk flags.
    pub flags: ReplyFlags,
    /// Chunk type (`NBD_REPLY_TYPE_*`).
    pub reply_type: u16,
    /// Cookie of the request.
    pub cookie: u64,
    /// Payload length (64 bits on the wire in an extended header, but never above 32
    /// bits: payloads are bounded by the 32-bit block sizes).
    pub length: u32,
    /// `Some(request offset)` for an extended header, which echoes the request's offset;
    /// `None` for a structured one.
    pub offset: Option<u64>,
}

/// An encoded chunk header (with the fixed fields of its payload, for the builders below), or
/// a simple reply: at most 32 + 12 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkBytes {
    buf: [u8; c::EXTENDED_REPLY_HEADER_LEN + 12],
    len: usize,
}

impl ChunkBytes {
    /// A reply header given whole (a simple reply's 16 bytes); at most 44 bytes.
    pub(crate) fn from_slice(bytes: &[u8]) -> Self {
        let mut b = Self {
            buf: [0; c::EXTENDED_REPLY_HEADER_LEN + 12],
            len: 0,
        };
        b.push(bytes);
        b
    }

    fn push(&mut self, bytes: &[u8]) {
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }
}

impl core::ops::Deref for ChunkBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl StructuredReplyHeader {
    /// Header length on the wire.
    pub const fn header_len(&self) -> usize {
        if self.offset.is_some() {
            c::EXTENDED_REPLY_HEADER_LEN
        } else {
            c::STRUCTURED_REPLY_HEADER_LEN
        }
    }

    /// Encode the 20 bytes (structured) or 32 bytes (extended).
    pub fn encode(&self) -> ChunkBytes {
        let mut b = ChunkBytes {
            buf: [0; c::EXTENDED_REPLY_HEADER_LEN + 12],
            len: 0,
        };
        let magic = match self.offset {
            Some(_) => c::EXTENDED_REPLY_MAGIC,
            None => c::STRUCTURED_REPLY_MAGIC,
        };
        b.push(&magic.to_be_bytes());
        b.push(&self.flags.bits().to_be_bytes());
        b.push(&self.reply_type.to_be_bytes());
        b.push(&self.cookie.to_be_bytes());
        match self.offset {
            Some(offset) => {
                b.push(&offset.to_be_bytes());
                b.push(&u64::from(self.length).to_be_bytes());
            }
            None => b.push(&self.length.to_be_bytes()),
        }
        b
    }

    /// Parse a structured chunk header from the first 20 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        Self::parse_as(buf, false)
    }

    /// Parse a structured (20 bytes) or, with `extended`, an extended (32 bytes) chunk header.
    /// An extended length above `u32::MAX` is refused: no payload can be that long.
    pub fn parse_as(buf: &[u8], extended: bool) -> Result<Self, ProtoError> {
        let (need, expected) = if extended {
            (c::EXTENDED_REPLY_HEADER_LEN, c::EXTENDED_REPLY_MAGIC)
        } else {
            (c::STRUCTURED_REPLY_HEADER_LEN, c::STRUCTURED_REPLY_MAGIC)
        };
        let truncated = ProtoError::Truncated {
            need,
            got: buf.len(),
        };
        let mut r = Reader::new(buf);
        let (Some(magic), Some(flags), Some(ty), Some(cookie)) =
            (r.u32(), r.u16(), r.u16(), r.u64())
        else {
            return Err(truncated);
        };
        let (offset, length) = if extended {
            let (Some(offset), Some(length)) = (r.u64(), r.u64()) else {
                return Err(truncated);
            };
            (Some(offset), length)
        } else {
            (None, r.u32().ok_or(truncated)?.into())
        };
        if magic != expected {
            return Err(ProtoError::BadMagic {
                expected: expected.into(),
                found: magic.into(),
            });
        }
        let length = u32::try_from(length).map_err(|_| ProtoError::TooLong {
            what: "extended reply payload",
            len: length,
            limit: u32::MAX.into(),
        })?;
        Ok(Self {
            flags: ReplyFlags(flags),
            reply_type: ty,
            cookie,
            length,
            offset,
        })
    }

    /// True if this is the final chunk of its reply.
    pub const fn is_done(&self) -> bool {
        self.flags.contains(ReplyFlags::DONE)
    }
}

/// Whom a server's chunk answers: the request's cookie, and with extended headers its
/// offset (echoed in every chunk header). A bare cookie means structured chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReplyTo {
    /// Cookie of the request.
    pub cookie: u64,
    /// `Some(request offset)` with extended headers.
    pub offset: Option<u64>,
}

impl ReplyTo {
    /// The chunks answering `req`, extended or structured.
    pub const fn new(req: &Request, extended: bool) -> Self {
        Self {
            cookie: req.cookie,
            offset: if extended { Some(req.offset) } else { None },
        }
    }
}

impl From<u64> for ReplyTo {
    fn from(cookie: u64) -> Self {
        Self {
            cookie,
            offset: None,
        }
    }
}

/// A parsed structured reply chunk payload, borrowing from the input buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Chunk<'a> {
    /// `NBD_REPLY_TYPE_NONE`.
    None,
    /// `NBD_REPLY_TYPE_OFFSET_DATA`.
    OffsetData {
        /// Absolute offset.
        offset: u64,
        /// Data (at least one byte).
        data: &'a [u8],
    },
    /// `NBD_REPLY_TYPE_OFFSET_HOLE`.
    OffsetHole {
        /// Absolute offset.
        offset: u64,
        /// Hole size (nonzero).
        length: u32,
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS`, or `_EXT` with extended headers.
    BlockStatus {
        /// Metadata context id.
        context_id: u32,
        /// At least one descriptor.
        extents: Vec<Extent>,
    },
    /// `NBD_REPLY_TYPE_ERROR`, or an unknown type with the error bit set
    /// (`reply_type` tells which); the client must treat the reply as failed.
    Error {
        /// Chunk type.
        reply_type: u16,
        /// Raw error value (nonzero).
        error: u32,
        /// Human-readable message (lossy UTF-8 is the caller's choice; raw bytes here).
        message: &'a [u8],
    },
    /// `NBD_REPLY_TYPE_ERROR_OFFSET`.
    ErrorOffset {
        /// Raw error value (nonzero).
        error: u32,
        /// Message bytes.
        message: &'a [u8],
        /// Offset of the error.
        offset: u64,
    },
}

impl<'a> Chunk<'a> {
    /// Parse the payload of a chunk whose header is `header`; `payload` must be
    /// exactly `header.length` bytes. Enforces every length rule of the spec;
    /// unknown non-error types are an error (the client must hard-disconnect).
    pub fn parse(header: &StructuredReplyHeader, payload: &'a [u8]) -> Result<Self, ProtoError> {
        if payload.len() as u64 != u64::from(header.length) {
            return Err(ProtoError::LengthMismatch {
                expected: header.length as usize,
                got: payload.len(),
            });
        }
        let bad = |m| Err(ProtoError::Invalid(m));
        let mut r = Reader::new(payload);
        match header.reply_type {
            c::REPLY_TYPE_NONE => {
                if !payload.is_empty() {
                    return bad("NONE chunk with payload");
                }
                if !header.is_done() {
                    return bad("NONE chunk without DONE flag");
                }
                Ok(Self::None)
            }
            c::REPLY_TYPE_OFFSET_DATA => match r.u64() {
                Some(offset) if r.remaining() > 0 => Ok(Self::OffsetData {
                    offset,
                    data: r.rest(),
                }),
                _ => bad("OFFSET_DATA chunk shorter than 9 bytes"),
            },
            c::REPLY_TYPE_OFFSET_HOLE => match (payload.len(), r.u64(), r.u32()) {
                (12, Some(offset), Some(length)) if length != 0 => {
                    Ok(Self::OffsetHole { offset, length })
                }
                _ => bad("OFFSET_HOLE chunk must be 12 bytes with nonzero size"),
            },
            c::REPLY_TYPE_BLOCK_STATUS => block_status::parse_compact(header, r),
            c::REPLY_TYPE_BLOCK_STATUS_EXT => block_status::parse_extended(header, r),
            ty if ty & c::REPLY_TYPE_FLAG_ERROR != 0 => {
                let (Some(error), Some(msg_len)) = (r.u32(), r.u16()) else {
                    return bad("error chunk shorter than 6 bytes");
                };
                if error == 0 {
                    return bad("error chunk with zero error");
                }
                let Some(message) = r.bytes(usize::from(msg_len)) else {
                    return bad("error message length exceeds chunk");
                };
                if ty == c::REPLY_TYPE_ERROR_OFFSET {
                    match (r.u64(), r.remaining()) {
                        (Some(offset), 0) => Ok(Self::ErrorOffset {
                            error,
                            message,
                            offset,
                        }),
                        _ => bad("ERROR_OFFSET chunk must end with an 8-byte offset"),
                    }
                } else if ty == c::REPLY_TYPE_ERROR && r.remaining() != 0 {
                    bad("trailing bytes in ERROR chunk")
                } else {
                    Ok(Self::Error {
                        reply_type: ty,
                        error,
                        message,
                    })
                }
            }
            other => Err(ProtoError::UnknownReplyType(other)),
        }
    }
}

fn header(
    flags: ReplyFlags,
    ty: u16,
    to: ReplyTo,
    length: usize,
) -> Result<ChunkBytes, ProtoError> {
    let length = u32::try_from(length).map_err(|_| ProtoError::TooLong {
        what: "structured reply payload",
        len: length as u64,
        limit: u32::MAX.into(),
    })?;
    Ok(StructuredReplyHeader {
        flags,
        reply_type: ty,
        cookie: to.cookie,
        length,
        offset: to.offset,
    }
    .encode())
}

fn done(last: bool) -> ReplyFlags {
    if last {
        ReplyFlags::DONE
    } else {
        ReplyFlags::empty()
    }
}

/// Header of an `OFFSET_DATA` chunk carrying `data_len` bytes at `offset`:
/// the chunk header + 8-byte offset. The caller sends `data_len` bytes of
/// data right after (the message body). Fails if `data_len` is 0 or too large.
pub fn offset_data_header(
    to: impl Into<ReplyTo>,
    last: bool,
    offset: u64,
    data_len: u32,
) -> Result<ChunkBytes, ProtoError> {
    if data_len == 0 || data_len > u32::MAX - 8 {
        return Err(ProtoError::Invalid("OFFSET_DATA length must be 1..=2^32-9"));
    }
    let mut b = header(
        done(last),
        c::REPLY_TYPE_OFFSET_DATA,
        to.into(),
        data_len as usize + 8,
    )?;
    b.push(&offset.to_be_bytes());
    Ok(b)
}

/// A complete `OFFSET_HOLE` chunk. Fails on a zero-length hole.
pub fn offset_hole(
    to: impl Into<ReplyTo>,
    last: bool,
    offset: u64,
    length: u32,
) -> Result<ChunkBytes, ProtoError> {
    if length == 0 {
        return Err(ProtoError::Invalid("hole size must be nonzero"));
    }
    let mut b = header(done(last), c::REPLY_TYPE_OFFSET_HOLE, to.into(), 12)?;
    b.push(&offset.to_be_bytes());
    b.push(&length.to_be_bytes());
    Ok(b)
}

/// The final `NONE` chunk (`DONE` set).
pub fn none_chunk(to: impl Into<ReplyTo>) -> ChunkBytes {
    let to = to.into();
    StructuredReplyHeader {
        flags: ReplyFlags::DONE,
        reply_type: c::REPLY_TYPE_NONE,
        cookie: to.cookie,
        length: 0,
        offset: to.offset,
    }
    .encode()
}

/// Truncate `message` to at most [`c::MAX_STRING_LEN`] bytes on a char boundary.
fn clip_message(message: &str) -> &str {
    if message.len() <= c::MAX_STRING_LEN {
        return message;
    }
    let mut end = c::MAX_STRING_LEN;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// Append an `ERROR` chunk (message clipped to 4096 bytes).
pub fn error_chunk(
    to: impl Into<ReplyTo>,
    last: bool,
    error: ErrorValue,
    message: &str,
    out: &mut Vec<u8>,
) {
    let m = clip_message(message);
    let hdr = header(done(last), c::REPLY_TYPE_ERROR, to.into(), 6 + m.len());
    // 6 + 4096 always fits in u32
    if let Ok(h) = hdr {
        out.extend_from_slice(&h);
        out.extend_from_slice(&error.to_u32().to_be_bytes());
        out.extend_from_slice(&(m.len() as u16).to_be_bytes());
        out.extend_from_slice(m.as_bytes());
    }
}

/// Append an `ERROR_OFFSET` chunk (message clipped to 4096 bytes).
pub fn error_offset_chunk(
    to: impl Into<ReplyTo>,
    last: bool,
    error: ErrorValue,
    message: &str,
    offset: u64,
    out: &mut Vec<u8>,
) {
    let m = clip_message(message);
    if let Ok(h) = header(
        done(last),
        c::REPLY_TYPE_ERROR_OFFSET,
        to.into(),
        14 + m.len(),
    ) {
        out.extend_from_slice(&h);
        out.extend_from_slice(&error.to_u32().to_be_bytes());
        out.extend_from_slice(&(m.len() as u16).to_be_bytes());
        out.extend_from_slice(m.as_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn split(buf: &[u8]) -> (StructuredReplyHeader, &[u8]) {
        let h = StructuredReplyHeader::parse(buf).unwrap();
        (h, &buf[20..])
    }

    #[test]
    fn simple_reply_roundtrip() {
        let r = SimpleReply::err(0xdead_beef, ErrorValue::NoSpc);
        let b = r.encode();
        assert_eq!(
            b,
            [
                0x67, 0x44, 0x66, 0x98, 0, 0, 0, 28, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef
            ]
        );
        assert_eq!(SimpleReply::parse(&b), Ok(r));
        assert_eq!(r.error_value(), Some(ErrorValue::NoSpc));
        assert_eq!(SimpleReply::ok(1).error_value(), None);
        assert!(SimpleReply::parse(&b[..15]).is_err());
        assert!(SimpleReply::parse(&[0; 16]).is_err());
    }

    #[test]
    fn structured_header_roundtrip() {
        let h = StructuredReplyHeader {
            flags: ReplyFlags::DONE,
            reply_type: c::REPLY_TYPE_ERROR,
            cookie: 3,
            length: 6,
            offset: None,
        };
        let b = h.encode();
        assert_eq!(&b[..8], &[0x66, 0x8e, 0x33, 0xef, 0, 1, 0x80, 1]);
        assert_eq!(StructuredReplyHeader::parse(&b), Ok(h));
        assert!(StructuredReplyHeader::parse(&b[..19]).is_err());
        assert!(StructuredReplyHeader::parse(&[0; 20]).is_err());
    }

    #[test]
    fn data_and_hole_and_none() {
        let mut msg = offset_data_header(5, true, 4096, 3).unwrap().to_vec();
        msg.extend_from_slice(b"abc");
        let (h, p) = split(&msg);
        assert_eq!(h.length, 11);
        assert!(h.is_done());
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::OffsetData {
                offset: 4096,
                data: b"abc"
            })
        );
        assert!(offset_data_header(5, true, 0, 0).is_err());

        let hole = offset_hole(5, false, 512, 1024).unwrap();
        let (h, p) = split(&hole);
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::OffsetHole {
                offset: 512,
                length: 1024
            })
        );
        assert!(offset_hole(5, false, 0, 0).is_err());

        let n = none_chunk(5);
        let (h, p) = split(&n);
        assert_eq!(Chunk::parse(&h, p), Ok(Chunk::None));
    }

    #[test]
    fn error_chunks() {
        let mut v = Vec::new();
        error_chunk(1, true, ErrorValue::Io, "boom", &mut v);
        let (h, p) = split(&v);
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::Error {
                reply_type: c::REPLY_TYPE_ERROR,
                error: 5,
                message: b"boom"
            })
        );
        v.clear();
        error_offset_chunk(1, false, ErrorValue::Io, "", 77, &mut v);
        let (h, p) = split(&v);
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::ErrorOffset {
                error: 5,
                message: b"",
                offset: 77
            })
        );
        v.clear();
        let long = "é".repeat(3000);
        error_chunk(1, true, ErrorValue::Io, &long, &mut v);
        let (h, _) = split(&v);
        assert!(h.length as usize <= 6 + 4096);
    }

    #[test]
    fn chunk_parse_rejects_bad_lengths() {
        let hdr = |ty: u16, len: u32, flags: u16| StructuredReplyHeader {
            flags: ReplyFlags(flags),
            reply_type: ty,
            cookie: 0,
            length: len,
            offset: None,
        };
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_NONE, 1, 1), &[0]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_NONE, 0, 0), &[]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_OFFSET_DATA, 8, 0), &[0; 8]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_OFFSET_HOLE, 12, 0), &[0; 12]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_OFFSET_HOLE, 13, 0), &[1; 13]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_BLOCK_STATUS, 4, 0), &[0; 4]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_BLOCK_STATUS, 13, 0), &[1; 13]).is_err());
        // zero-length extent
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_BLOCK_STATUS, 12, 0), &[0; 12]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_ERROR, 5, 0), &[0, 0, 0, 1, 0]).is_err());
        // zero error
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_ERROR, 6, 0), &[0; 6]).is_err());
        // message length too large
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_ERROR, 6, 0), &[0, 0, 0, 1, 0, 1]).is_err());
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_ERROR_OFFSET, 6, 0), &[0, 0, 0, 1, 0, 0]).is_err());
        // unknown error type is tolerated; unknown non-error type is not
        assert!(matches!(
            Chunk::parse(&hdr(0x8009, 7, 0), &[0, 0, 0, 1, 0, 1, b'x']),
            Ok(Chunk::Error {
                reply_type: 0x8009,
                ..
            })
        ));
        assert_eq!(
            Chunk::parse(&hdr(3, 0, 0), &[]),
            Err(ProtoError::UnknownReplyType(3))
        );
        // header/payload mismatch
        assert!(Chunk::parse(&hdr(c::REPLY_TYPE_NONE, 0, 1), &[0]).is_err());
    }

    pub(super) fn split_ext(buf: &[u8]) -> (StructuredReplyHeader, &[u8]) {
        let h = StructuredReplyHeader::parse_as(buf, true).unwrap();
        (h, &buf[32..])
    }

    #[test]
    fn extended_headers_echo_the_offset() {
        let to = ReplyTo {
            cookie: 0x0102,
            offset: Some(0x4000),
        };
        let n = none_chunk(to);
        assert_eq!(
            *n,
            [
                0x6e, 0x8a, 0x27, 0x8c, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0x40,
                0, 0, 0, 0, 0, 0, 0, 0, 0
            ]
        );
        let (h, p) = split_ext(&n);
        assert_eq!(h.offset, Some(0x4000));
        assert_eq!(Chunk::parse(&h, p), Ok(Chunk::None));
        // The extended header is not a structured one, and vice versa.
        assert!(StructuredReplyHeader::parse(&n).is_err());
        assert!(StructuredReplyHeader::parse_as(&none_chunk(1), true).is_err());

        let mut msg = offset_data_header(to, true, 0x4100, 3).unwrap().to_vec();
        assert_eq!(msg.len(), 40);
        msg.extend_from_slice(b"xyz");
        let (h, p) = split_ext(&msg);
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::OffsetData {
                offset: 0x4100,
                data: b"xyz"
            })
        );
        assert_eq!(offset_hole(to, false, 0x4000, 9).unwrap().len(), 44);

        // A 64-bit payload length is refused, not truncated.
        let mut huge = n.to_vec();
        huge[24..32].copy_from_slice(&(1u64 << 32).to_be_bytes());
        assert!(matches!(
            StructuredReplyHeader::parse_as(&huge, true),
            Err(ProtoError::TooLong { .. })
        ));
    }
}
