//! Transmission phase replies: the 16-byte simple reply, the 20-byte
//! structured reply chunk header, chunk payloads, and block-status builders.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::{CmdFlags, ReplyFlags};
use crate::transmission::ErrorValue;
use crate::wire::Reader;

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

/// A structured reply chunk header (the payload follows on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StructuredReplyHeader {
    /// Chunk flags.
    pub flags: ReplyFlags,
    /// Chunk type (`NBD_REPLY_TYPE_*`).
    pub reply_type: u16,
    /// Cookie of the request.
    pub cookie: u64,
    /// Payload length.
    pub length: u32,
}

impl StructuredReplyHeader {
    /// Encode the 20 bytes.
    pub fn encode(&self) -> [u8; c::STRUCTURED_REPLY_HEADER_LEN] {
        let mut b = [0u8; c::STRUCTURED_REPLY_HEADER_LEN];
        b[0..4].copy_from_slice(&c::STRUCTURED_REPLY_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.bits().to_be_bytes());
        b[6..8].copy_from_slice(&self.reply_type.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Parse from the first 20 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(flags), Some(ty), Some(cookie), Some(length)) =
            (r.u32(), r.u16(), r.u16(), r.u64(), r.u32())
        else {
            return Err(ProtoError::Truncated {
                need: c::STRUCTURED_REPLY_HEADER_LEN,
                got: buf.len(),
            });
        };
        if magic != c::STRUCTURED_REPLY_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: c::STRUCTURED_REPLY_MAGIC.into(),
                found: magic.into(),
            });
        }
        Ok(Self {
            flags: ReplyFlags(flags),
            reply_type: ty,
            cookie,
            length,
        })
    }

    /// True if this is the final chunk of its reply.
    pub const fn is_done(&self) -> bool {
        self.flags.contains(ReplyFlags::DONE)
    }
}

/// One block-status descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Length in bytes (nonzero on the wire).
    pub length: u32,
    /// Status flags (for `base:allocation`: [`crate::flags::AllocationFlags`]).
    pub flags: u32,
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
    /// `NBD_REPLY_TYPE_BLOCK_STATUS`.
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
            c::REPLY_TYPE_BLOCK_STATUS => {
                if payload.len() < 12 || !(payload.len() - 4).is_multiple_of(8) {
                    return bad("BLOCK_STATUS length must be 4 + 8n, n >= 1");
                }
                let context_id = r.u32().unwrap_or(0);
                let mut extents = Vec::with_capacity(r.remaining() / 8);
                while let (Some(length), Some(flags)) = (r.u32(), r.u32()) {
                    if length == 0 {
                        return bad("zero-length extent");
                    }
                    extents.push(Extent { length, flags });
                }
                Ok(Self::BlockStatus {
                    context_id,
                    extents,
                })
            }
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

fn header(flags: ReplyFlags, ty: u16, cookie: u64, length: usize) -> Result<[u8; 20], ProtoError> {
    let length = u32::try_from(length).map_err(|_| ProtoError::TooLong {
        what: "structured reply payload",
        len: length as u64,
        limit: u32::MAX.into(),
    })?;
    Ok(StructuredReplyHeader {
        flags,
        reply_type: ty,
        cookie,
        length,
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
/// 20-byte chunk header + 8-byte offset. The caller sends `data_len` bytes of
/// data right after (the message body). Fails if `data_len` is 0 or too large.
pub fn offset_data_header(
    cookie: u64,
    last: bool,
    offset: u64,
    data_len: u32,
) -> Result<[u8; 28], ProtoError> {
    if data_len == 0 || data_len > u32::MAX - 8 {
        return Err(ProtoError::Invalid("OFFSET_DATA length must be 1..=2^32-9"));
    }
    let mut b = [0u8; 28];
    b[..20].copy_from_slice(&header(
        done(last),
        c::REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len as usize + 8,
    )?);
    b[20..].copy_from_slice(&offset.to_be_bytes());
    Ok(b)
}

/// A complete `OFFSET_HOLE` chunk (32 bytes). Fails on a zero-length hole.
pub fn offset_hole(
    cookie: u64,
    last: bool,
    offset: u64,
    length: u32,
) -> Result<[u8; 32], ProtoError> {
    if length == 0 {
        return Err(ProtoError::Invalid("hole size must be nonzero"));
    }
    let mut b = [0u8; 32];
    b[..20].copy_from_slice(&header(done(last), c::REPLY_TYPE_OFFSET_HOLE, cookie, 12)?);
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b[28..].copy_from_slice(&length.to_be_bytes());
    Ok(b)
}

/// The final `NONE` chunk (20 bytes, `DONE` set).
pub fn none_chunk(cookie: u64) -> [u8; 20] {
    StructuredReplyHeader {
        flags: ReplyFlags::DONE,
        reply_type: c::REPLY_TYPE_NONE,
        cookie,
        length: 0,
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
pub fn error_chunk(cookie: u64, last: bool, error: ErrorValue, message: &str, out: &mut Vec<u8>) {
    let m = clip_message(message);
    let hdr = header(done(last), c::REPLY_TYPE_ERROR, cookie, 6 + m.len());
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
    cookie: u64,
    last: bool,
    error: ErrorValue,
    message: &str,
    offset: u64,
    out: &mut Vec<u8>,
) {
    let m = clip_message(message);
    if let Ok(h) = header(done(last), c::REPLY_TYPE_ERROR_OFFSET, cookie, 14 + m.len()) {
        out.extend_from_slice(&h);
        out.extend_from_slice(&error.to_u32().to_be_bytes());
        out.extend_from_slice(&(m.len() as u16).to_be_bytes());
        out.extend_from_slice(m.as_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
    }
}

/// Append one `BLOCK_STATUS` chunk with `extents` as given (no trimming).
/// Fails if `extents` is empty or contains a zero-length extent.
pub fn block_status_chunk(
    cookie: u64,
    last: bool,
    context_id: u32,
    extents: &[Extent],
    out: &mut Vec<u8>,
) -> Result<(), ProtoError> {
    if extents.is_empty() || extents.iter().any(|e| e.length == 0) {
        return Err(ProtoError::Invalid("block status needs nonzero extents"));
    }
    let len = extents
        .len()
        .checked_mul(8)
        .and_then(|n| n.checked_add(4))
        .ok_or(ProtoError::Invalid("too many extents"))?;
    out.extend_from_slice(&header(
        done(last),
        c::REPLY_TYPE_BLOCK_STATUS,
        cookie,
        len,
    )?);
    out.extend_from_slice(&context_id.to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
    Ok(())
}

/// Select the extents to report for a request of `request_len` bytes, obeying the spec:
///
/// * zero-length extents are skipped;
/// * with `REQ_ONE`, exactly one extent, clipped to `request_len`;
/// * otherwise extents are taken until they cover `request_len` (the sum of the
///   first N-1 extents stays below the requested length; the last may extend past it).
///
/// Returns an empty vector if no nonzero extent was given.
pub fn select_extents(
    request_flags: CmdFlags,
    request_len: u32,
    extents: &[Extent],
) -> Vec<Extent> {
    let mut out = Vec::new();
    let mut covered: u64 = 0;
    for e in extents.iter().filter(|e| e.length != 0) {
        if request_flags.contains(CmdFlags::REQ_ONE) {
            let length = e.length.min(request_len.max(1));
            out.push(Extent {
                length,
                flags: e.flags,
            });
            break;
        }
        out.push(*e);
        covered += u64::from(e.length);
        if covered >= u64::from(request_len) {
            break;
        }
    }
    out
}

/// Append a complete block-status reply: one `BLOCK_STATUS` chunk per context
/// (the last with `DONE`), each trimmed with [`select_extents`].
///
/// Fails (appending nothing) if `contexts` is empty or a context has no
/// nonzero extent.
pub fn block_status_reply(
    cookie: u64,
    request_flags: CmdFlags,
    request_len: u32,
    contexts: &[(u32, &[Extent])],
    out: &mut Vec<u8>,
) -> Result<(), ProtoError> {
    if contexts.is_empty() {
        return Err(ProtoError::Invalid("block status reply needs a context"));
    }
    let selected: Vec<(u32, Vec<Extent>)> = contexts
        .iter()
        .map(|(id, ex)| (*id, select_extents(request_flags, request_len, ex)))
        .collect();
    if selected.iter().any(|(_, ex)| ex.is_empty()) {
        return Err(ProtoError::Invalid("block status needs nonzero extents"));
    }
    let n = selected.len();
    for (i, (id, ex)) in selected.iter().enumerate() {
        block_status_chunk(cookie, i + 1 == n, *id, ex, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(buf: &[u8]) -> (StructuredReplyHeader, &[u8]) {
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

    #[test]
    fn block_status_building() {
        let ex = [
            Extent {
                length: 0,
                flags: 9,
            },
            Extent {
                length: 4096,
                flags: 3,
            },
            Extent {
                length: 4096,
                flags: 0,
            },
            Extent {
                length: 4096,
                flags: 1,
            },
        ];
        assert_eq!(select_extents(CmdFlags::empty(), 8192, &ex).len(), 2);
        assert_eq!(select_extents(CmdFlags::empty(), 8193, &ex).len(), 3);
        assert_eq!(select_extents(CmdFlags::empty(), 1 << 30, &ex).len(), 3);
        assert_eq!(
            select_extents(CmdFlags::REQ_ONE, 1000, &ex),
            vec![Extent {
                length: 1000,
                flags: 3
            }]
        );
        assert!(select_extents(CmdFlags::empty(), 10, &ex[..1]).is_empty());

        let mut v = Vec::new();
        block_status_reply(
            9,
            CmdFlags::REQ_ONE,
            8192,
            &[(1, &ex), (2, &ex[2..])],
            &mut v,
        )
        .unwrap();
        let (h1, _) = split(&v);
        assert!(!h1.is_done());
        assert_eq!(h1.length, 12);
        let (h2, p2) = split(&v[32..]);
        assert!(h2.is_done());
        assert_eq!(
            Chunk::parse(&h2, p2),
            Ok(Chunk::BlockStatus {
                context_id: 2,
                extents: vec![Extent {
                    length: 4096,
                    flags: 0
                }]
            })
        );
        let mut v = Vec::new();
        assert!(block_status_reply(9, CmdFlags::empty(), 1, &[], &mut v).is_err());
        assert!(block_status_reply(9, CmdFlags::empty(), 1, &[(1, &ex[..1])], &mut v).is_err());
        assert!(v.is_empty());
        assert!(block_status_chunk(1, true, 1, &[], &mut v).is_err());
    }
}
