//! Transmission phase requests as bytes: the request header (28 bytes compact, 32
//! extended), the command and error enums. Below the handshake and the replies, which use
//! them; [`crate::transmission`] re-exports them with the rest of the phase.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::CmdFlags;

/// A request type (`NBD_CMD_*`). Unknown values are kept, so that a server can
/// answer them with `EINVAL` instead of failing to parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE` (the only request followed by a payload).
    Write,
    /// `NBD_CMD_DISC` (no reply).
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_CACHE`.
    Cache,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus,
    /// `NBD_CMD_RESIZE` (experimental).
    Resize,
    /// Any other value.
    Unknown(u16),
}

impl Command {
    /// Decode a wire value (total: unknown values become [`Command::Unknown`]).
    pub const fn from_u16(v: u16) -> Self {
        match v {
            c::CMD_READ => Self::Read,
            c::CMD_WRITE => Self::Write,
            c::CMD_DISC => Self::Disc,
            c::CMD_FLUSH => Self::Flush,
            c::CMD_TRIM => Self::Trim,
            c::CMD_CACHE => Self::Cache,
            c::CMD_WRITE_ZEROES => Self::WriteZeroes,
            c::CMD_BLOCK_STATUS => Self::BlockStatus,
            c::CMD_RESIZE => Self::Resize,
            other => Self::Unknown(other),
        }
    }

    /// The wire value.
    pub const fn to_u16(self) -> u16 {
        match self {
            Self::Read => c::CMD_READ,
            Self::Write => c::CMD_WRITE,
            Self::Disc => c::CMD_DISC,
            Self::Flush => c::CMD_FLUSH,
            Self::Trim => c::CMD_TRIM,
            Self::Cache => c::CMD_CACHE,
            Self::WriteZeroes => c::CMD_WRITE_ZEROES,
            Self::BlockStatus => c::CMD_BLOCK_STATUS,
            Self::Resize => c::CMD_RESIZE,
            Self::Unknown(v) => v,
        }
    }

    /// True for the commands that modify the export.
    pub const fn is_write(self) -> bool {
        matches!(
            self,
            Self::Write | Self::Trim | Self::WriteZeroes | Self::Resize
        )
    }
}

/// An error value carried by simple replies and error chunks (`NBD_E*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorValue {
    /// `NBD_EPERM` (1).
    #[error("EPERM: operation not permitted")]
    Perm,
    /// `NBD_EIO` (5).
    #[error("EIO: input/output error")]
    Io,
    /// `NBD_ENOMEM` (12).
    #[error("ENOMEM: cannot allocate memory")]
    NoMem,
    /// `NBD_EINVAL` (22).
    #[error("EINVAL: invalid argument")]
    Inval,
    /// `NBD_ENOSPC` (28).
    #[error("ENOSPC: no space left on device")]
    NoSpc,
    /// `NBD_EOVERFLOW` (75).
    #[error("EOVERFLOW: value too large")]
    Overflow,
    /// `NBD_ENOTSUP` (95).
    #[error("ENOTSUP: operation not supported")]
    NotSup,
    /// `NBD_ESHUTDOWN` (108).
    #[error("ESHUTDOWN: server is shutting down")]
    Shutdown,
}

impl ErrorValue {
    /// The wire value.
    pub const fn to_u32(self) -> u32 {
        match self {
            Self::Perm => c::EPERM,
            Self::Io => c::EIO,
            Self::NoMem => c::ENOMEM,
            Self::Inval => c::EINVAL,
            Self::NoSpc => c::ENOSPC,
            Self::Overflow => c::EOVERFLOW,
            Self::NotSup => c::ENOTSUP,
            Self::Shutdown => c::ESHUTDOWN,
        }
    }

    /// Exact decoding: `None` for 0 (success) and for values the spec does not define.
    pub const fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            c::EPERM => Self::Perm,
            c::EIO => Self::Io,
            c::ENOMEM => Self::NoMem,
            c::EINVAL => Self::Inval,
            c::ENOSPC => Self::NoSpc,
            c::EOVERFLOW => Self::Overflow,
            c::ENOTSUP => Self::NotSup,
            c::ESHUTDOWN => Self::Shutdown,
            _ => return None,
        })
    }

    /// Client-side decoding of a nonzero error: unknown values map to `EINVAL`,
    /// as the spec says ("The client SHOULD treat an unexpected error value as
    /// if it had been `NBD_EINVAL`"). Returns `None` for 0 (success).
    pub const fn from_wire(v: u32) -> Option<Self> {
        if v == 0 {
            return None;
        }
        match Self::from_u32(v) {
            Some(e) => Some(e),
            None => Some(Self::Inval),
        }
    }
}

/// A transmission request header (the payload of a `WRITE` follows it on the
/// wire and is not part of this repr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    /// Command flags.
    pub flags: CmdFlags,
    /// Request type.
    pub command: Command,
    /// Opaque cookie (the spec's "handle"), echoed in replies.
    pub cookie: u64,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes: the payload length of a `WRITE`, else the effect length.
    /// Above `u32::MAX` only with extended headers.
    pub length: u64,
}

/// An encoded request header: 28 bytes compact, 32 bytes extended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    buf: [u8; c::EXTENDED_REQUEST_LEN],
    len: usize,
}

impl core::ops::Deref for RequestHeader {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Request {
    /// Header length on the wire: compact or `extended`.
    pub const fn header_len(extended: bool) -> usize {
        if extended {
            c::EXTENDED_REQUEST_LEN
        } else {
            c::REQUEST_LEN
        }
    }

    /// Encode the header: compact (28 bytes), or `extended` (32 bytes; a `WRITE` should
    /// then carry `NBD_CMD_FLAG_PAYLOAD_LEN` in `flags`, as the spec says). The flags are sent as given, so
    /// that tests can send what a server must refuse. A compact header cannot carry a
    /// length above `u32::MAX`.
    pub fn encode(&self, extended: bool) -> Result<RequestHeader, ProtoError> {
        let mut buf = [0u8; c::EXTENDED_REQUEST_LEN];
        let magic = if extended {
            buf[24..32].copy_from_slice(&self.length.to_be_bytes());
            c::EXTENDED_REQUEST_MAGIC
        } else {
            let length = u32::try_from(self.length).map_err(|_| ProtoError::TooLong {
                what: "compact request",
                len: self.length,
                limit: u32::MAX.into(),
            })?;
            buf[24..28].copy_from_slice(&length.to_be_bytes());
            c::REQUEST_MAGIC
        };
        buf[0..4].copy_from_slice(&magic.to_be_bytes());
        buf[4..6].copy_from_slice(&self.flags.bits().to_be_bytes());
        buf[6..8].copy_from_slice(&self.command.to_u16().to_be_bytes());
        buf[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        buf[16..24].copy_from_slice(&self.offset.to_be_bytes());
        Ok(RequestHeader {
            buf,
            len: Self::header_len(extended),
        })
    }

    /// Parse a compact (or, with `extended`, an extended) request header from the start
    /// of `buf` (extra bytes, such as a write payload, are ignored). Fails on short input
    /// or the other style's magic; unknown commands and flags are kept for
    /// [`crate::transmission::validate::validate_request`] to reject.
    pub fn parse(buf: &[u8], extended: bool) -> Result<Self, ProtoError> {
        let need = Self::header_len(extended);
        let mut r = crate::wire::Reader::new(buf);
        let (Some(magic), Some(flags), Some(command), Some(cookie), Some(offset)) =
            (r.u32(), r.u16(), r.u16(), r.u64(), r.u64())
        else {
            return Err(ProtoError::Truncated {
                need,
                got: buf.len(),
            });
        };
        let (expected, length) = if extended {
            (c::EXTENDED_REQUEST_MAGIC, r.u64())
        } else {
            (c::REQUEST_MAGIC, r.u32().map(u64::from))
        };
        let Some(length) = length else {
            return Err(ProtoError::Truncated {
                need,
                got: buf.len(),
            });
        };
        if magic != expected {
            return Err(ProtoError::BadMagic {
                expected: expected.into(),
                found: magic.into(),
            });
        }
        Ok(Self {
            flags: CmdFlags(flags),
            command: Command::from_u16(command),
            cookie,
            offset,
            length,
        })
    }

    /// Bytes of payload that follow this header on the wire: `length` for a `WRITE`, or
    /// for an extended request with `NBD_CMD_FLAG_PAYLOAD_LEN`; else 0. An extended `WRITE`
    /// without the flag still has its payload: qemu (10) sends them so, and qemu-nbd reads
    /// them so.
    pub const fn payload_len(&self, extended: bool) -> u64 {
        let has_payload = matches!(self.command, Command::Write)
            || (extended && self.flags.contains(CmdFlags::PAYLOAD_LEN));
        if has_payload { self.length } else { 0 }
    }
}
