//! Wire representations of handshake messages: greeting, client flags, option
//! requests and their payloads, option replies and their payloads.
//!
//! Everything here is pure encode/parse; the state machines in
//! [`super::server`] and [`super::client`] decide what to send.
//!
//! Over 600 lines: every handshake message's encoding and parsing, and their round-trip tests (a quarter).

use crate::consts as c;
use crate::error::{ProtoError, parse_string};
use crate::flags::{ClientFlags, HandshakeFlags, TransmissionFlags};
use crate::wire::Reader;

/// Block size constraints (`NBD_INFO_BLOCK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockSize {
    /// Minimum block size: power of two, at most 64 KiB.
    pub min: u32,
    /// Preferred block size: power of two, at least `max(min, 512)`.
    pub preferred: u32,
    /// Maximum block size: multiple of `min`, or `u32::MAX` for "no limit".
    pub max: u32,
}

impl BlockSize {
    /// The spec's defaults when nothing was advertised: "a default minimum block
    /// size of 1, a preferred block size of 2^12 (4,096), and a maximum block size
    /// that is effectively unlimited (0xffffffff, or the export size if that is smaller)".
    pub const DEFAULT: Self = Self {
        min: 1,
        preferred: 4096,
        max: u32::MAX,
    };

    /// Check the spec's constraints on advertised values (see "Block size constraints").
    pub fn check(&self) -> Result<(), ProtoError> {
        let Self {
            min,
            preferred,
            max,
        } = *self;
        if !min.is_power_of_two() || min > 65536 {
            return Err(ProtoError::Invalid(
                "minimum block size must be a power of two <= 65536",
            ));
        }
        if !preferred.is_power_of_two() || preferred < min.max(512) {
            return Err(ProtoError::Invalid(
                "preferred block size must be a power of two >= max(min, 512)",
            ));
        }
        if max != u32::MAX && (max % min != 0 || max < preferred) {
            return Err(ProtoError::Invalid(
                "maximum block size must be a multiple of min and >= preferred",
            ));
        }
        Ok(())
    }

    /// Encode as the 12 bytes following the info type.
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.min.to_be_bytes());
        out.extend_from_slice(&self.preferred.to_be_bytes());
        out.extend_from_slice(&self.max.to_be_bytes());
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        Self::DEFAULT
    }
}

fn exact(buf: &[u8], n: usize) -> Result<&[u8], ProtoError> {
    if buf.len() < n {
        Err(ProtoError::Truncated {
            need: n,
            got: buf.len(),
        })
    } else if buf.len() > n {
        Err(ProtoError::LengthMismatch {
            expected: n,
            got: buf.len(),
        })
    } else {
        Ok(buf)
    }
}

fn str_len(s: &str, what: &'static str) -> Result<u32, ProtoError> {
    if s.len() > c::MAX_STRING_LEN {
        return Err(ProtoError::TooLong {
            what,
            len: s.len() as u64,
            limit: c::MAX_STRING_LEN as u64,
        });
    }
    // MAX_STRING_LEN fits in u32
    Ok(s.len() as u32)
}

// ---- Greeting and client flags -----------------------------------------------

/// The newstyle server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags (18 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    /// Handshake flags offered by the server.
    pub flags: HandshakeFlags,
}

impl Greeting {
    /// Encode the 18 bytes.
    pub fn encode(&self) -> [u8; c::GREETING_LEN] {
        let mut b = [0u8; c::GREETING_LEN];
        b[0..8].copy_from_slice(&c::NBDMAGIC.to_be_bytes());
        b[8..16].copy_from_slice(&c::IHAVEOPT.to_be_bytes());
        b[16..18].copy_from_slice(&self.flags.bits().to_be_bytes());
        b
    }

    /// Parse exactly 18 bytes. Oldstyle greetings are rejected (bad magic).
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(exact(buf, c::GREETING_LEN)?);
        let (m1, m2, flags) = (r.u64(), r.u64(), r.u16());
        let (Some(m1), Some(m2), Some(flags)) = (m1, m2, flags) else {
            return Err(ProtoError::Invalid("greeting"));
        };
        if m1 != c::NBDMAGIC {
            return Err(ProtoError::BadMagic {
                expected: c::NBDMAGIC,
                found: m1,
            });
        }
        if m2 != c::IHAVEOPT {
            return Err(ProtoError::BadMagic {
                expected: c::IHAVEOPT,
                found: m2,
            });
        }
        Ok(Self {
            flags: HandshakeFlags(flags),
        })
    }
}

/// Encode the 4-byte client flags message.
pub fn encode_client_flags(flags: ClientFlags) -> [u8; c::CLIENT_FLAGS_LEN] {
    flags.bits().to_be_bytes()
}

/// Parse exactly 4 bytes of client flags (unknown bits are kept; the server checks them).
pub fn parse_client_flags(buf: &[u8]) -> Result<ClientFlags, ProtoError> {
    let b = exact(buf, c::CLIENT_FLAGS_LEN)?;
    Ok(ClientFlags(u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
}

// ---- Option requests ---------------------------------------------------------------

/// The 16-byte header of an option request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number (`NBD_OPT_*`).
    pub option: u32,
    /// Length of the option data that follows.
    pub length: u32,
}

impl OptionHeader {
    /// Encode the 16 bytes.
    pub fn encode(&self) -> [u8; c::OPTION_HEADER_LEN] {
        let mut b = [0u8; c::OPTION_HEADER_LEN];
        b[0..8].copy_from_slice(&c::IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Parse the header from the first 16 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(option), Some(length)) = (r.u64(), r.u32(), r.u32()) else {
            return Err(ProtoError::Truncated {
                need: c::OPTION_HEADER_LEN,
                got: buf.len(),
            });
        };
        if magic != c::IHAVEOPT {
            return Err(ProtoError::BadMagic {
                expected: c::IHAVEOPT,
                found: magic,
            });
        }
        Ok(Self { option, length })
    }
}

/// Append a complete option request (header + data) to `out`.
///
/// # Panics
/// Never; data longer than `u32::MAX` is a caller bug and is truncated in the
/// length field (the crate never produces such data).
pub fn encode_option(option: u32, data: &[u8], out: &mut Vec<u8>) {
    let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&OptionHeader { option, length }.encode());
    out.extend_from_slice(data);
}

/// Payload of `NBD_OPT_INFO` / `NBD_OPT_GO`: export name and requested info types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name ("" = default export).
    pub name: &'a str,
    /// Requested `NBD_INFO_*` types, in request order.
    pub items: Vec<u16>,
}

impl<'a> InfoRequest<'a> {
    /// Parse the option data. The name must satisfy the string rules and the
    /// item list must exactly fill the remaining data.
    pub fn parse(data: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(data);
        let name_len = r.u32().ok_or(ProtoError::Truncated {
            need: 6,
            got: data.len(),
        })?;
        let name_len = usize::try_from(name_len).map_err(|_| ProtoError::Invalid("name length"))?;
        let name = r
            .bytes(name_len)
            .ok_or(ProtoError::Invalid("name length exceeds option data"))?;
        let name = parse_string(name, "export name")?;
        let n = r.u16().ok_or(ProtoError::Invalid("missing info count"))?;
        if r.remaining() != usize::from(n) * 2 {
            return Err(ProtoError::Invalid("info request count mismatch"));
        }
        let mut items = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            items.push(r.u16().ok_or(ProtoError::Invalid("info request"))?);
        }
        Ok(Self { name, items })
    }

    /// Encode as option data.
    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        let len = str_len(self.name, "export name")?;
        let n = u16::try_from(self.items.len())
            .map_err(|_| ProtoError::Invalid("too many info requests"))?;
        let mut out = Vec::with_capacity(6 + self.name.len() + self.items.len() * 2);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&n.to_be_bytes());
        for i in &self.items {
            out.extend_from_slice(&i.to_be_bytes());
        }
        Ok(out)
    }
}

/// Payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest<'a> {
    /// Export name.
    pub export: &'a str,
    /// Queries (e.g. `base:allocation`).
    pub queries: Vec<&'a str>,
}

impl<'a> MetaContextRequest<'a> {
    /// Parse the option data; every length must fit in the data and the data
    /// must be consumed exactly. Memory is bounded by the data length. A query longer than
    /// 4096 bytes or not UTF-8 becomes the empty query: like it, it names no context (still
    /// a query: a LIST of only such queries lists nothing), and qemu-nbd skips it rather
    /// than failing the option; one with a NUL (within 4096 bytes) is invalid, as qemu-nbd
    /// finds it.
    pub fn parse(data: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(data);
        let invalid = ProtoError::Invalid("meta context request");
        let name_len = r.u32().ok_or(invalid.clone())?;
        let name = r
            .bytes(usize::try_from(name_len).map_err(|_| invalid.clone())?)
            .ok_or(invalid.clone())?;
        let export = parse_string(name, "export name")?;
        let n = r.u32().ok_or(invalid.clone())?;
        // each query takes at least 4 bytes: bound the count before allocating
        if u64::from(n) * 4 > r.remaining() as u64 {
            return Err(invalid);
        }
        let mut queries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let ql = r.u32().ok_or(invalid.clone())?;
            let q = r
                .bytes(usize::try_from(ql).map_err(|_| invalid.clone())?)
                .ok_or(invalid.clone())?;
            if q.len() <= crate::consts::MAX_STRING_LEN && q.contains(&0) {
                return Err(ProtoError::BadString("meta context query"));
            }
            queries.push(parse_string(q, "meta context query").unwrap_or(""));
        }
        if r.remaining() != 0 {
            return Err(ProtoError::Invalid(
                "trailing bytes in meta context request",
            ));
        }
        Ok(Self { export, queries })
    }

    /// Encode as option data.
    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        let mut out = Vec::new();
        out.extend_from_slice(&str_len(self.export, "export name")?.to_be_bytes());
        out.extend_from_slice(self.export.as_bytes());
        let n = u32::try_from(self.queries.len())
            .map_err(|_| ProtoError::Invalid("too many queries"))?;
        out.extend_from_slice(&n.to_be_bytes());
        for q in &self.queries {
            out.extend_from_slice(&str_len(q, "meta context query")?.to_be_bytes());
            out.extend_from_slice(q.as_bytes());
        }
        Ok(out)
    }
}

// ---- Option replies ------------------------------------------------------------------

/// The 20-byte header of an option reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// The option this replies to.
    pub option: u32,
    /// Reply type (`NBD_REP_*`).
    pub reply_type: u32,
    /// Length of the reply data that follows.
    pub length: u32,
}

impl OptionReplyHeader {
    /// Encode the 20 bytes.
    pub fn encode(&self) -> [u8; c::OPTION_REPLY_HEADER_LEN] {
        let mut b = [0u8; c::OPTION_REPLY_HEADER_LEN];
        b[0..8].copy_from_slice(&c::OPTION_REPLY_MAGIC.to_be_bytes());
        b[8..12].copy_from_slice(&self.option.to_be_bytes());
        b[12..16].copy_from_slice(&self.reply_type.to_be_bytes());
        b[16..20].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Parse the header from the first 20 bytes of `buf`.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(option), Some(reply_type), Some(length)) =
            (r.u64(), r.u32(), r.u32(), r.u32())
        else {
            return Err(ProtoError::Truncated {
                need: c::OPTION_REPLY_HEADER_LEN,
                got: buf.len(),
            });
        };
        if magic != c::OPTION_REPLY_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: c::OPTION_REPLY_MAGIC,
                found: magic,
            });
        }
        Ok(Self {
            option,
            reply_type,
            length,
        })
    }

    /// True if the reply type has the error bit set.
    pub const fn is_error(&self) -> bool {
        self.reply_type & c::REP_FLAG_ERROR != 0
    }
}

/// Append a complete option reply (header + data) to `out`.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8], out: &mut Vec<u8>) {
    let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(
        &OptionReplyHeader {
            option,
            reply_type,
            length,
        }
        .encode(),
    );
    out.extend_from_slice(data);
}

/// Payload of an `NBD_REP_INFO` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InfoReply<'a> {
    /// `NBD_INFO_EXPORT`: size and transmission flags.
    Export {
        /// Export size in bytes.
        size: u64,
        /// Transmission flags.
        flags: TransmissionFlags,
    },
    /// `NBD_INFO_NAME`: canonical export name.
    Name(&'a str),
    /// `NBD_INFO_DESCRIPTION`: human-readable description.
    Description(&'a str),
    /// `NBD_INFO_BLOCK_SIZE`: block size constraints (not validated here; see [`BlockSize::check`]).
    BlockSize(BlockSize),
    /// An info type this crate does not know (clients must ignore it).
    Unknown(u16),
}

impl<'a> InfoReply<'a> {
    /// Parse `NBD_REP_INFO` data (type + payload) with the lengths the spec mandates.
    pub fn parse(data: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(data);
        let ty = r.u16().ok_or(ProtoError::Truncated {
            need: 2,
            got: data.len(),
        })?;
        let rest = r.rest();
        Ok(match ty {
            c::INFO_EXPORT => {
                let mut r = Reader::new(exact(rest, 10)?);
                match (r.u64(), r.u16()) {
                    (Some(size), Some(flags)) => Self::Export {
                        size,
                        flags: TransmissionFlags(flags),
                    },
                    _ => return Err(ProtoError::Invalid("info export")),
                }
            }
            c::INFO_NAME => Self::Name(parse_string(rest, "info name")?),
            c::INFO_DESCRIPTION => Self::Description(parse_string(rest, "info description")?),
            c::INFO_BLOCK_SIZE => {
                let mut r = Reader::new(exact(rest, 12)?);
                match (r.u32(), r.u32(), r.u32()) {
                    (Some(min), Some(preferred), Some(max)) => Self::BlockSize(BlockSize {
                        min,
                        preferred,
                        max,
                    }),
                    _ => return Err(ProtoError::Invalid("info block size")),
                }
            }
            other => Self::Unknown(other),
        })
    }

    /// Encode as reply data (type + payload). `Unknown` encodes only its type.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(14);
        match *self {
            Self::Export { size, flags } => {
                out.extend_from_slice(&c::INFO_EXPORT.to_be_bytes());
                out.extend_from_slice(&size.to_be_bytes());
                out.extend_from_slice(&flags.bits().to_be_bytes());
            }
            Self::Name(s) => {
                out.extend_from_slice(&c::INFO_NAME.to_be_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Self::Description(s) => {
                out.extend_from_slice(&c::INFO_DESCRIPTION.to_be_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Self::BlockSize(bs) => {
                out.extend_from_slice(&c::INFO_BLOCK_SIZE.to_be_bytes());
                bs.encode_into(&mut out);
            }
            Self::Unknown(t) => out.extend_from_slice(&t.to_be_bytes()),
        }
        out
    }
}

/// Payload of an `NBD_REP_SERVER` reply: export name and optional description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerEntry<'a> {
    /// Export name.
    pub name: &'a str,
    /// Implementation-specific details, a human-readable description here.
    pub description: &'a str,
}

impl<'a> ServerEntry<'a> {
    /// Parse `NBD_REP_SERVER` data.
    pub fn parse(data: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(data);
        let len = r.u32().ok_or(ProtoError::Truncated {
            need: 4,
            got: data.len(),
        })?;
        let name = r
            .bytes(usize::try_from(len).map_err(|_| ProtoError::Invalid("name length"))?)
            .ok_or(ProtoError::Invalid("name length exceeds reply"))?;
        Ok(Self {
            name: parse_string(name, "export name")?,
            description: parse_string(r.rest(), "export description")?,
        })
    }

    /// Encode as reply data.
    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        let len = str_len(self.name, "export name")?;
        str_len(self.description, "export description")?;
        let mut out = Vec::with_capacity(4 + self.name.len() + self.description.len());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(self.description.as_bytes());
        Ok(out)
    }
}

/// Payload of an `NBD_REP_META_CONTEXT` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaContextEntry<'a> {
    /// Context id (0 in replies to `LIST_META_CONTEXT`).
    pub id: u32,
    /// Context name.
    pub name: &'a str,
}

impl<'a> MetaContextEntry<'a> {
    /// Parse `NBD_REP_META_CONTEXT` data.
    pub fn parse(data: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(data);
        let id = r.u32().ok_or(ProtoError::Truncated {
            need: 4,
            got: data.len(),
        })?;
        Ok(Self {
            id,
            name: parse_string(r.rest(), "meta context name")?,
        })
    }

    /// Encode as reply data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.name.len());
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out
    }
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, flags and (unless `NO_ZEROES` was
/// negotiated) 124 zero bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportNameReply {
    /// Export size.
    pub size: u64,
    /// Transmission flags.
    pub flags: TransmissionFlags,
}

impl ExportNameReply {
    /// Append the reply to `out` (10 bytes with `no_zeroes`, else 134).
    pub fn encode(&self, no_zeroes: bool, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.flags.bits().to_be_bytes());
        if !no_zeroes {
            out.extend_from_slice(&[0u8; c::EXPORT_NAME_ZEROES]);
        }
    }

    /// Length of the reply on the wire.
    pub const fn wire_len(no_zeroes: bool) -> usize {
        if no_zeroes {
            c::EXPORT_NAME_REPLY_SHORT_LEN
        } else {
            c::EXPORT_NAME_REPLY_SHORT_LEN + c::EXPORT_NAME_ZEROES
        }
    }

    /// Parse a reply of exactly [`Self::wire_len`] bytes (the zeroes are not checked,
    /// being "reserved").
    pub fn parse(buf: &[u8], no_zeroes: bool) -> Result<Self, ProtoError> {
        let mut r = Reader::new(exact(buf, Self::wire_len(no_zeroes))?);
        match (r.u64(), r.u16()) {
            (Some(size), Some(flags)) => Ok(Self {
                size,
                flags: TransmissionFlags(flags),
            }),
            _ => Err(ProtoError::Invalid("export name reply")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_bytes() {
        let g = Greeting {
            flags: HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES,
        };
        let b = g.encode();
        assert_eq!(&b[..8], b"NBDMAGIC");
        assert_eq!(&b[8..16], b"IHAVEOPT");
        assert_eq!(&b[16..], &[0, 3]);
        assert_eq!(Greeting::parse(&b), Ok(g));
        assert!(Greeting::parse(&b[..17]).is_err());
        let mut bad = b;
        bad[0] = 0;
        assert!(matches!(
            Greeting::parse(&bad),
            Err(ProtoError::BadMagic { .. })
        ));
        let mut old = b;
        old[8..16].copy_from_slice(&0x0000_4202_8186_1253_u64.to_be_bytes());
        assert!(matches!(
            Greeting::parse(&old),
            Err(ProtoError::BadMagic { .. })
        ));
    }

    #[test]
    fn client_flags_roundtrip() {
        let f = ClientFlags::FIXED_NEWSTYLE | ClientFlags::NO_ZEROES;
        assert_eq!(encode_client_flags(f), [0, 0, 0, 3]);
        assert_eq!(parse_client_flags(&[0, 0, 0, 3]), Ok(f));
        assert!(parse_client_flags(&[0, 0, 3]).is_err());
        assert!(parse_client_flags(&[0, 0, 0, 0, 3]).is_err());
    }

    #[test]
    fn option_header_roundtrip() {
        let h = OptionHeader {
            option: c::OPT_GO,
            length: 77,
        };
        let b = h.encode();
        assert_eq!(&b[..8], b"IHAVEOPT");
        assert_eq!(OptionHeader::parse(&b), Ok(h));
        let mut v = Vec::new();
        encode_option(c::OPT_LIST, b"", &mut v);
        assert_eq!(v.len(), 16);
        assert_eq!(&v[8..], &[0, 0, 0, 3, 0, 0, 0, 0]);
        assert!(OptionHeader::parse(&[0; 16]).is_err());
        assert!(OptionHeader::parse(&b[..15]).is_err());
    }

    #[test]
    fn info_request_roundtrip() {
        let r = InfoRequest {
            name: "disk",
            items: vec![c::INFO_BLOCK_SIZE, c::INFO_NAME],
        };
        let d = r.encode().unwrap();
        assert_eq!(d, [0, 0, 0, 4, b'd', b'i', b's', b'k', 0, 2, 0, 3, 0, 1]);
        assert_eq!(InfoRequest::parse(&d), Ok(r));
        // count mismatch, short, name overflow
        assert!(InfoRequest::parse(&d[..d.len() - 1]).is_err());
        assert!(InfoRequest::parse(&[0, 0, 0]).is_err());
        assert!(InfoRequest::parse(&[0xff, 0xff, 0xff, 0xff, 0, 0]).is_err());
        assert!(InfoRequest::parse(&[0, 0, 0, 0, 0, 0]).is_ok());
        assert!(InfoRequest::parse(&[0, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn meta_request_roundtrip() {
        let r = MetaContextRequest {
            export: "e",
            queries: vec!["base:allocation", "x-foo:"],
        };
        let d = r.encode().unwrap();
        assert_eq!(MetaContextRequest::parse(&d), Ok(r));
        let mut trailing = d.clone();
        trailing.push(0);
        assert!(MetaContextRequest::parse(&trailing).is_err());
        assert!(MetaContextRequest::parse(&d[..d.len() - 1]).is_err());
        // huge query count is rejected before allocation
        assert!(MetaContextRequest::parse(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_err());
    }

    #[test]
    fn option_reply_roundtrip() {
        let h = OptionReplyHeader {
            option: c::OPT_GO,
            reply_type: c::REP_ERR_UNKNOWN,
            length: 3,
        };
        assert!(h.is_error());
        assert_eq!(OptionReplyHeader::parse(&h.encode()), Ok(h));
        let mut v = Vec::new();
        encode_option_reply(c::OPT_LIST, c::REP_ACK, &[], &mut v);
        assert_eq!(
            v,
            [
                0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0, 0
            ]
        );
        assert!(OptionReplyHeader::parse(&[0; 20]).is_err());
    }

    #[test]
    fn info_reply_roundtrip() {
        let cases = [
            InfoReply::Export {
                size: 1 << 30,
                flags: TransmissionFlags(0x0103),
            },
            InfoReply::Name("n"),
            InfoReply::Description(""),
            InfoReply::BlockSize(BlockSize {
                min: 512,
                preferred: 4096,
                max: 1 << 25,
            }),
            InfoReply::Unknown(99),
        ];
        for i in cases {
            assert_eq!(InfoReply::parse(&i.encode()), Ok(i));
        }
        assert_eq!(
            InfoReply::Export {
                size: 1,
                flags: TransmissionFlags(1)
            }
            .encode()
            .len(),
            12
        );
        assert!(InfoReply::parse(&[0, 0, 1]).is_err());
        assert!(InfoReply::parse(&[0, 3, 0, 0, 0, 1]).is_err());
        assert!(InfoReply::parse(&[0]).is_err());
    }

    #[test]
    fn server_and_meta_entries() {
        let e = ServerEntry {
            name: "a",
            description: "the disk",
        };
        assert_eq!(ServerEntry::parse(&e.encode().unwrap()), Ok(e));
        assert!(ServerEntry::parse(&[0, 0, 0, 9, b'a']).is_err());
        let m = MetaContextEntry {
            id: 5,
            name: c::BASE_ALLOCATION,
        };
        assert_eq!(MetaContextEntry::parse(&m.encode()), Ok(m));
        assert!(MetaContextEntry::parse(&[0, 0]).is_err());
    }

    #[test]
    fn export_name_reply_spec_bytes() {
        let r = ExportNameReply {
            size: 0x0000_0001_0000_0000,
            flags: TransmissionFlags(0x0003),
        };
        let mut short = Vec::new();
        r.encode(true, &mut short);
        assert_eq!(short, [0, 0, 0, 1, 0, 0, 0, 0, 0, 3]);
        let mut long = Vec::new();
        r.encode(false, &mut long);
        assert_eq!(long.len(), 134);
        assert_eq!(&long[..10], &short[..]);
        assert!(long[10..].iter().all(|&b| b == 0));
        assert_eq!(ExportNameReply::parse(&short, true), Ok(r));
        assert_eq!(ExportNameReply::parse(&long, false), Ok(r));
        assert!(ExportNameReply::parse(&short, false).is_err());
        assert!(ExportNameReply::parse(&long, true).is_err());
    }

    #[test]
    fn block_size_check() {
        assert!(BlockSize::DEFAULT.check().is_ok());
        let ok = BlockSize {
            min: 512,
            preferred: 4096,
            max: 1 << 25,
        };
        assert!(ok.check().is_ok());
        for bad in [
            BlockSize { min: 3, ..ok },
            BlockSize {
                min: 1 << 17,
                preferred: 1 << 17,
                max: u32::MAX,
            },
            BlockSize {
                preferred: 256,
                ..ok
            },
            BlockSize {
                preferred: 3000,
                ..ok
            },
            BlockSize {
                max: 4097 * 512 + 1,
                ..ok
            },
            BlockSize { max: 2048, ..ok },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
