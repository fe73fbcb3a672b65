//! Block status: the `BLOCK_STATUS` and `BLOCK_STATUS_EXT` chunks parsed and built, and the
//! extents a server reports for a request selected as the spec says.

use super::{Chunk, ReplyTo, StructuredReplyHeader, done, header};
use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::CmdFlags;
use crate::wire::Reader;

/// One block-status descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Length in bytes (nonzero on the wire; above 32 bits only in `BLOCK_STATUS_EXT`).
    pub length: u64,
    /// Status flags (for `base:allocation`: [`crate::flags::AllocationFlags`]).
    pub flags: u32,
}

/// The payload of a `BLOCK_STATUS` chunk (structured, not extended, headers), after its length
/// was checked against the header.
pub(super) fn parse_compact<'a>(
    header: &StructuredReplyHeader,
    mut r: Reader<'a>,
) -> Result<Chunk<'a>, ProtoError> {
    let bad = |m| Err(ProtoError::Invalid(m));
    let payload_len = r.remaining();
    if payload_len < 12 || !(payload_len - 4).is_multiple_of(8) {
        return bad("BLOCK_STATUS length must be 4 + 8n, n >= 1");
    }
    if header.offset.is_some() {
        return bad("BLOCK_STATUS chunk with extended headers");
    }
    let context_id = r.u32().unwrap_or(0);
    let mut extents = Vec::with_capacity(r.remaining() / 8);
    while let (Some(length), Some(flags)) = (r.u32(), r.u32()) {
        if length == 0 {
            return bad("zero-length extent");
        }
        extents.push(Extent {
            length: length.into(),
            flags,
        });
    }
    Ok(Chunk::BlockStatus {
        context_id,
        extents,
    })
}

/// The payload of a `BLOCK_STATUS_EXT` chunk (extended headers).
pub(super) fn parse_extended<'a>(
    header: &StructuredReplyHeader,
    mut r: Reader<'a>,
) -> Result<Chunk<'a>, ProtoError> {
    let bad = |m| Err(ProtoError::Invalid(m));
    if header.offset.is_none() {
        return bad("BLOCK_STATUS_EXT chunk without extended headers");
    }
    let (Some(context_id), Some(count)) = (r.u32(), r.u32()) else {
        return bad("BLOCK_STATUS_EXT length must be 8 + 16n, n >= 1");
    };
    if count == 0 || r.remaining() as u64 != u64::from(count) * 16 {
        return bad("BLOCK_STATUS_EXT length must be 8 + 16 x its count, count >= 1");
    }
    let mut extents = Vec::with_capacity(r.remaining() / 16);
    while let (Some(length), Some(status)) = (r.u64(), r.u64()) {
        if length == 0 {
            return bad("zero-length extent");
        }
        // Only 32-bit contexts are ever negotiated (base:allocation), whose
        // status "MUST" have the upper 32 bits clear.
        let Ok(flags) = u32::try_from(status) else {
            return bad("64-bit status for a 32-bit metadata context");
        };
        extents.push(Extent { length, flags });
    }
    Ok(Chunk::BlockStatus {
        context_id,
        extents,
    })
}

/// Append one `BLOCK_STATUS` chunk with `extents` as given (no trimming), or with
/// extended headers a `BLOCK_STATUS_EXT` chunk. Fails if `extents` is empty, contains a
/// zero-length extent, or (without extended headers) one longer than 32 bits.
pub fn block_status_chunk(
    to: impl Into<ReplyTo>,
    last: bool,
    context_id: u32,
    extents: &[Extent],
    out: &mut Vec<u8>,
) -> Result<(), ProtoError> {
    let to = to.into();
    let extended = to.offset.is_some();
    if extents.is_empty() || extents.iter().any(|e| e.length == 0) {
        return Err(ProtoError::Invalid("block status needs nonzero extents"));
    }
    if !extended && extents.iter().any(|e| e.length > u64::from(u32::MAX)) {
        return Err(ProtoError::Invalid("extent longer than 32 bits"));
    }
    let (ty, fixed, each) = if extended {
        (c::REPLY_TYPE_BLOCK_STATUS_EXT, 8, 16)
    } else {
        (c::REPLY_TYPE_BLOCK_STATUS, 4, 8)
    };
    let count =
        u32::try_from(extents.len()).map_err(|_| ProtoError::Invalid("too many extents"))?;
    let len = extents
        .len()
        .checked_mul(each)
        .and_then(|n| n.checked_add(fixed))
        .ok_or(ProtoError::Invalid("too many extents"))?;
    out.extend_from_slice(&header(done(last), ty, to, len)?);
    out.extend_from_slice(&context_id.to_be_bytes());
    if extended {
        out.extend_from_slice(&count.to_be_bytes());
    }
    for e in extents {
        if extended {
            out.extend_from_slice(&e.length.to_be_bytes());
            out.extend_from_slice(&u64::from(e.flags).to_be_bytes());
        } else {
            // checked above: fits 32 bits
            out.extend_from_slice(&(e.length as u32).to_be_bytes());
            out.extend_from_slice(&e.flags.to_be_bytes());
        }
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
    request_len: u64,
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
        covered = covered.saturating_add(e.length);
        if covered >= request_len {
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
    to: impl Into<ReplyTo>,
    request_flags: CmdFlags,
    request_len: u64,
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
    let to = to.into();
    let n = selected.len();
    let start = out.len();
    for (i, (id, ex)) in selected.iter().enumerate() {
        if let Err(e) = block_status_chunk(to, i + 1 == n, *id, ex, out) {
            out.truncate(start);
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::tests::{split, split_ext};

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
        // Without extended headers an extent cannot be longer than 32 bits.
        let long = [Extent {
            length: 1 << 32,
            flags: 0,
        }];
        let mut v = Vec::new();
        assert!(block_status_reply(9, CmdFlags::empty(), 1 << 33, &[(1, &long)], &mut v).is_err());
        assert!(v.is_empty());
        assert!(block_status_reply(9, CmdFlags::empty(), 1, &[], &mut v).is_err());
        assert!(block_status_reply(9, CmdFlags::empty(), 1, &[(1, &ex[..1])], &mut v).is_err());
        assert!(v.is_empty());
        assert!(block_status_chunk(1, true, 1, &[], &mut v).is_err());
    }

    #[test]
    fn extended_block_status() {
        let to = ReplyTo {
            cookie: 5,
            offset: Some(0),
        };
        let ex = [
            Extent {
                length: 1 << 33,
                flags: 3,
            },
            Extent {
                length: 512,
                flags: 0,
            },
        ];
        let mut v = Vec::new();
        block_status_reply(to, CmdFlags::empty(), 1 << 34, &[(1, &ex)], &mut v).unwrap();
        let (h, p) = split_ext(&v);
        assert_eq!(h.reply_type, c::REPLY_TYPE_BLOCK_STATUS_EXT);
        assert_eq!(h.length, 8 + 2 * 16);
        assert_eq!(
            Chunk::parse(&h, p),
            Ok(Chunk::BlockStatus {
                context_id: 1,
                extents: ex.to_vec()
            })
        );
        // Each chunk type belongs to one header style only.
        let mut compact = Vec::new();
        block_status_chunk(5, true, 1, &ex[1..], &mut compact).unwrap();
        let (mut hc, pc) = split(&compact);
        hc.offset = Some(0);
        assert!(Chunk::parse(&hc, pc).is_err());
        let mut he = h;
        he.offset = None;
        assert!(Chunk::parse(&he, p).is_err());
        // The count must match the length, and be nonzero.
        let mut bad = p.to_vec();
        bad[7] = 1;
        assert!(Chunk::parse(&h, &bad).is_err());
        let mut hz = h;
        hz.length = 8;
        assert!(Chunk::parse(&hz, &[0, 0, 0, 1, 0, 0, 0, 0]).is_err());
        // A 64-bit status cannot be base:allocation's.
        let mut wide = p.to_vec();
        wide[16] = 1;
        assert!(Chunk::parse(&h, &wide).is_err());
        // Several contexts (base:allocation and qemu:allocation-depth): one extended chunk
        // each, with its own id, the last one DONE.
        let depth = [Extent {
            length: 1 << 33,
            flags: 2,
        }];
        let mut v = Vec::new();
        block_status_reply(
            to,
            CmdFlags::empty(),
            1 << 34,
            &[(1, &ex), (2, &depth)],
            &mut v,
        )
        .unwrap();
        let (h1, p1) = split_ext(&v);
        let first = c::EXTENDED_REPLY_HEADER_LEN + h1.length as usize;
        let (h2, p2) = split_ext(&v[first..]);
        assert_eq!(
            (h1.reply_type, h1.is_done(), h2.reply_type, h2.is_done()),
            (
                c::REPLY_TYPE_BLOCK_STATUS_EXT,
                false,
                c::REPLY_TYPE_BLOCK_STATUS_EXT,
                true
            )
        );
        assert_eq!(
            Chunk::parse(&h1, &p1[..h1.length as usize]),
            Ok(Chunk::BlockStatus {
                context_id: 1,
                extents: ex.to_vec()
            })
        );
        assert_eq!(
            Chunk::parse(&h2, p2),
            Ok(Chunk::BlockStatus {
                context_id: 2,
                extents: depth.to_vec()
            })
        );
        assert_eq!(
            v.len(),
            first + c::EXTENDED_REPLY_HEADER_LEN + h2.length as usize
        );
    }
}
