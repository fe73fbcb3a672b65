//! Transmission phase requests: the 28-byte request header, command and error
//! enums, and [`validate_request`], which picks the error the spec asks a server
//! to return for a bad request.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::{CmdFlags, TransmissionFlags};
use crate::handshake::BlockSize;

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
    /// [`validate_request`] to reject.
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

/// What a server needs to know about the negotiated session to validate requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransmissionInfo {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags sent to the client.
    pub flags: TransmissionFlags,
    /// Structured replies negotiated.
    pub structured_replies: bool,
    /// At least one metadata context negotiated (needed for `BLOCK_STATUS`).
    pub has_meta_context: bool,
    /// Block size constraints the server enforces (defaults: 1 / 4096 / `u32::MAX`).
    pub block_size: BlockSize,
    /// Largest `READ` length served unfragmented when `NBD_CMD_FLAG_DF` is set;
    /// longer `DF` reads get `EOVERFLOW`. The spec requires at least 65,536;
    /// values above `u32::MAX - 8` are clamped, as one chunk cannot carry more.
    pub df_max_len: u32,
    /// Extended headers negotiated (`NBD_CMD_FLAG_PAYLOAD_LEN` marks a WRITE's payload).
    pub extended_headers: bool,
}

impl TransmissionInfo {
    /// Info for an export of `size` bytes with `flags`, default block sizes,
    /// no structured replies and no metadata context.
    pub fn new(size: u64, flags: TransmissionFlags) -> Self {
        Self {
            size,
            flags: flags | TransmissionFlags::HAS_FLAGS,
            structured_replies: false,
            has_meta_context: false,
            block_size: BlockSize::DEFAULT,
            df_max_len: u32::MAX,
            extended_headers: false,
        }
    }
}

/// Check a request against the negotiated session and return the error value
/// the spec recommends, or `Ok(())` if the server should execute it.
///
/// The checks, in order (the spec does not order them; this order makes the
/// most specific diagnosis win):
///
/// 1. `DISC` is always accepted (it has no reply).
/// 2. Unknown command, or a command whose transmission flag was not advertised
///    (`FLUSH`, `TRIM`, `WRITE_ZEROES`, `CACHE`, `RESIZE`) → `EINVAL`
///    ("The server SHOULD return `NBD_EINVAL` if it receives an unknown command").
///    `BLOCK_STATUS` without a negotiated metadata context → `EINVAL`
///    ("Servers SHOULD reply with `NBD_EINVAL` to clients sending
///    `NBD_CMD_BLOCK_STATUS` without selecting at least one metadata context").
/// 3. Unknown flag, or flag not documented for the command, or not enabled by
///    negotiation (`FUA` needs `SEND_FUA`; `DF` only on `READ` and needs `SEND_DF`;
///    `NO_HOLE` only on `WRITE_ZEROES`; `FAST_ZERO` only on `WRITE_ZEROES` and needs
///    `SEND_FAST_ZERO`; `REQ_ONE` only on `BLOCK_STATUS`; `PAYLOAD_LEN` only on
///    `WRITE` with extended headers) → `EINVAL`.
/// 4. `WRITE`/`TRIM`/`WRITE_ZEROES`/`RESIZE` on a read-only export → `EPERM`, checked
///    before all the others (also where the command is not advertised, as qemu-nbd does).
/// 5. `FLUSH` with nonzero offset or length → `EINVAL` (they "MUST be set to all-zero").
/// 6. Offset or length not a multiple of the minimum block size → `EINVAL`.
/// 7. `READ`/`WRITE`/`CACHE`, and `WRITE_ZEROES` without `FAST_ZERO`, longer than the
///    maximum block size → `EINVAL`.
/// 8. `READ` with `DF` longer than `df_max_len` → `EOVERFLOW` (the only case the spec
///    permits `EOVERFLOW`).
/// 9. Range past the end of the export: `WRITE`/`WRITE_ZEROES` → `ENOSPC`
///    ("SHOULD return `NBD_ENOSPC` if it receives a write request including one or
///    more sectors beyond the size of the device"); `READ`/`TRIM`/`CACHE`/
///    `BLOCK_STATUS` → `EINVAL`.
///
/// Zero-length requests (unspecified by the spec, which only says the server
/// "SHOULD NOT disconnect") are accepted as no-ops for `READ`, `WRITE`, `TRIM`,
/// `CACHE` and `WRITE_ZEROES` (with `offset <= size`); a zero-length
/// `BLOCK_STATUS` gets `EINVAL`, since no valid reply (at least one extent of
/// nonzero length not exceeding the request) exists.
///
/// `RESIZE` (experimental) is only checked for flags and read-only; its offset
/// is the new size and is not range-checked.
pub fn validate_request(req: &Request, info: &TransmissionInfo) -> Result<(), ErrorValue> {
    use Command as C;
    let tf = info.flags;
    let f = req.flags;

    // 4 first: a writing command on a read-only export is EPERM even where the export does
    // not advertise the command (a read-only export offers no TRIM or WRITE_ZEROES), as
    // qemu-nbd answers.
    if req.command.is_write() && tf.contains(TransmissionFlags::READ_ONLY) {
        return Err(ErrorValue::Perm);
    }

    // 2. command support
    let supported = match req.command {
        C::Disc => return Ok(()),
        C::Read | C::Write => true,
        C::Flush => tf.contains(TransmissionFlags::SEND_FLUSH),
        C::Trim => tf.contains(TransmissionFlags::SEND_TRIM),
        C::WriteZeroes => tf.contains(TransmissionFlags::SEND_WRITE_ZEROES),
        C::Cache => tf.contains(TransmissionFlags::SEND_CACHE),
        C::Resize => tf.contains(TransmissionFlags::SEND_RESIZE),
        C::BlockStatus => info.structured_replies && info.has_meta_context,
        C::Unknown(_) => false,
    };
    if !supported {
        return Err(ErrorValue::Inval);
    }

    // 3. flags
    if f.unknown_bits() != 0 {
        return Err(ErrorValue::Inval);
    }
    if f.contains(CmdFlags::FUA) && !tf.contains(TransmissionFlags::SEND_FUA) {
        return Err(ErrorValue::Inval);
    }
    if f.contains(CmdFlags::DF)
        && !(req.command == C::Read
            && info.structured_replies
            && tf.contains(TransmissionFlags::SEND_DF))
    {
        return Err(ErrorValue::Inval);
    }
    if f.contains(CmdFlags::NO_HOLE) && req.command != C::WriteZeroes {
        return Err(ErrorValue::Inval);
    }
    if f.contains(CmdFlags::FAST_ZERO)
        && !(req.command == C::WriteZeroes && tf.contains(TransmissionFlags::SEND_FAST_ZERO))
    {
        return Err(ErrorValue::Inval);
    }
    if f.contains(CmdFlags::REQ_ONE) && req.command != C::BlockStatus {
        return Err(ErrorValue::Inval);
    }
    // With extended headers only a WRITE may say it carries a payload (no optional payload
    // form, such as BLOCK_STATUS's, is implemented); without them the flag does not exist.
    if f.contains(CmdFlags::PAYLOAD_LEN) && !(info.extended_headers && req.command == C::Write) {
        return Err(ErrorValue::Inval);
    }

    match req.command {
        // 5.
        C::Flush => {
            return if req.offset == 0 && req.length == 0 {
                Ok(())
            } else {
                Err(ErrorValue::Inval)
            };
        }
        C::Resize => return Ok(()),
        _ => {}
    }

    // 6. alignment
    let min = u64::from(info.block_size.min.max(1));
    if !req.offset.is_multiple_of(min) || !req.length.is_multiple_of(min) {
        return Err(ErrorValue::Inval);
    }

    // 7. maximum block size
    let len_capped = match req.command {
        C::Read | C::Write | C::Cache => true,
        C::WriteZeroes => !f.contains(CmdFlags::FAST_ZERO),
        _ => false,
    };
    if len_capped && req.length > u64::from(info.block_size.max) {
        return Err(ErrorValue::Inval);
    }

    // 8. DF overflow
    if f.contains(CmdFlags::DF) && req.length > u64::from(info.df_max_len.min(u32::MAX - 8)) {
        return Err(ErrorValue::Overflow);
    }

    // zero-length block status
    if req.command == C::BlockStatus && req.length == 0 {
        return Err(ErrorValue::Inval);
    }

    // 9. bounds
    let in_bounds = req
        .offset
        .checked_add(req.length)
        .is_some_and(|end| end <= info.size);
    if !in_bounds {
        return Err(match req.command {
            C::Write | C::WriteZeroes => ErrorValue::NoSpc,
            _ => ErrorValue::Inval,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::flags::TransmissionFlags as TF;

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags: CmdFlags(flags),
            command,
            cookie: 7,
            offset,
            length: length.into(),
        }
    }

    fn all_flags() -> TF {
        TF::SEND_FLUSH
            | TF::SEND_FUA
            | TF::SEND_TRIM
            | TF::SEND_WRITE_ZEROES
            | TF::SEND_DF
            | TF::SEND_CACHE
            | TF::SEND_FAST_ZERO
    }

    fn full_info() -> TransmissionInfo {
        let mut i = TransmissionInfo::new(1 << 20, all_flags());
        i.structured_replies = true;
        i.has_meta_context = true;
        i
    }

    #[test]
    fn request_roundtrip_and_bytes() {
        let r = Request {
            flags: CmdFlags::FUA,
            command: Command::Write,
            cookie: 0x0102_0304_0506_0708,
            offset: 0x1000,
            length: 512,
        };
        let b = r.encode(false).unwrap();
        assert_eq!(
            *b,
            [
                0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0x10,
                0, 0, 0, 2, 0
            ]
        );
        assert_eq!(Request::parse(&b, false), Ok(r));
        assert_eq!(r.payload_len(false), 512);
        for v in 0..=20u16 {
            let r = req(Command::from_u16(v), 0xffff, u64::MAX, u32::MAX);
            assert_eq!(Request::parse(&r.encode(false).unwrap(), false), Ok(r));
            assert_eq!(Request::parse(&r.encode(true).unwrap(), true), Ok(r));
            assert_eq!(Command::from_u16(v).to_u16(), v);
        }
        assert_eq!(req(Command::Read, 0, 0, 9).payload_len(false), 0);
    }

    #[test]
    fn extended_request_bytes_and_lengths() {
        let r = Request {
            flags: CmdFlags::PAYLOAD_LEN,
            command: Command::Write,
            cookie: 0x0102_0304_0506_0708,
            offset: 0x1000,
            length: 512,
        };
        let b = r.encode(true).unwrap();
        assert_eq!(
            *b,
            [
                0x21, 0xe4, 0x1c, 0x71, 0, 0x20, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0,
                0x10, 0, 0, 0, 0, 0, 0, 0, 2, 0
            ]
        );
        assert_eq!(r.payload_len(true), 512);
        // Without PAYLOAD_LEN an extended length is an effect length: no payload.
        let trim = Request {
            flags: CmdFlags::empty(),
            command: Command::Trim,
            length: 1 << 40,
            ..r
        };
        assert_eq!(trim.payload_len(true), 0);
        assert_eq!(Request::parse(&trim.encode(true).unwrap(), true), Ok(trim));
        assert!(matches!(
            trim.encode(false),
            Err(ProtoError::TooLong { len, .. }) if len == 1 << 40
        ));
        // Each style refuses the other's magic.
        assert!(matches!(
            Request::parse(&trim.encode(true).unwrap(), false),
            Err(ProtoError::BadMagic { .. })
        ));
        assert!(matches!(
            Request::parse(
                &[
                    0x25, 0x60, 0x95, 0x13, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                    0, 0, 0, 0, 0, 0, 0, 0, 0, 0
                ],
                true
            ),
            Err(ProtoError::BadMagic { .. })
        ));
        assert!(matches!(
            Request::parse(&[0; 31], true),
            Err(ProtoError::Truncated { need: 32, got: 31 })
        ));
    }

    #[test]
    fn payload_len_flag_follows_the_header_style() {
        let mut ext = full_info();
        ext.extended_headers = true;
        ext.size = 1 << 50;
        let big_trim = Request {
            length: 1 << 40,
            ..req(Command::Trim, 0, 0, 0)
        };
        assert_eq!(validate_request(&big_trim, &ext), Ok(()));
        assert_eq!(
            validate_request(&req(Command::Write, 0x20, 0, 512), &ext),
            Ok(())
        );
        // as qemu sends them
        assert_eq!(
            validate_request(&req(Command::Write, 0, 0, 512), &ext),
            Ok(())
        );
        assert_eq!(req(Command::Write, 0, 0, 512).payload_len(true), 512);
        for r in [
            req(Command::Read, 0x20, 0, 512),      // payload on READ
            req(Command::BlockStatus, 0x20, 0, 8), // optional payload form not implemented
        ] {
            assert_eq!(validate_request(&r, &ext), Err(ErrorValue::Inval), "{r:?}");
        }
        // A 64-bit READ exceeds the maximum block size.
        let big_read = Request {
            length: 1 << 33,
            ..req(Command::Read, 0, 0, 0)
        };
        assert_eq!(validate_request(&big_read, &ext), Err(ErrorValue::Inval));
        // Compact: the flag does not exist.
        assert_eq!(
            validate_request(&req(Command::Write, 0x20, 0, 512), &full_info()),
            Err(ErrorValue::Inval)
        );
    }

    #[test]
    fn request_parse_errors() {
        assert!(matches!(
            Request::parse(&[0; 27], false),
            Err(ProtoError::Truncated { need: 28, got: 27 })
        ));
        assert!(matches!(
            Request::parse(&[0; 28], false),
            Err(ProtoError::BadMagic { .. })
        ));
    }

    #[test]
    fn error_values() {
        for v in [1, 5, 12, 22, 28, 75, 95, 108] {
            assert_eq!(ErrorValue::from_u32(v).map(ErrorValue::to_u32), Some(v));
        }
        assert_eq!(ErrorValue::from_u32(0), None);
        assert_eq!(ErrorValue::from_u32(2), None);
        assert_eq!(ErrorValue::from_wire(0), None);
        assert_eq!(ErrorValue::from_wire(2), Some(ErrorValue::Inval));
        assert_eq!(ErrorValue::from_wire(28), Some(ErrorValue::NoSpc));
    }

    #[test]
    fn valid_requests_pass() {
        let i = full_info();
        for r in [
            req(Command::Read, 0, 0, 4096),
            req(Command::Read, 1, (1 << 20) - 512, 512),
            req(Command::Read, 4, 0, 65536),
            req(Command::Write, 1, 0, 1 << 20),
            req(Command::Flush, 0, 0, 0),
            req(Command::Flush, 1, 0, 0),
            req(Command::Trim, 0, 0, 1 << 20),
            req(Command::Cache, 0, 0, 10),
            req(Command::WriteZeroes, 2 | 16 | 1, 0, 10),
            req(Command::BlockStatus, 8, 0, 10),
            req(Command::Disc, 0xffff, 5, 5),
            req(Command::Read, 0, 1 << 20, 0),
            req(Command::Write, 0, 0, 0),
        ] {
            assert_eq!(validate_request(&r, &i), Ok(()), "{r:?}");
        }
    }

    #[test]
    fn unknown_and_unsupported_commands() {
        let i = full_info();
        assert_eq!(
            validate_request(&req(Command::Unknown(99), 0, 0, 0), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Resize, 0, 0, 0), &i),
            Err(ErrorValue::Inval)
        );
        let bare = TransmissionInfo::new(1 << 20, TF::empty());
        for cmd in [
            Command::Flush,
            Command::Trim,
            Command::WriteZeroes,
            Command::Cache,
            Command::BlockStatus,
        ] {
            assert_eq!(
                validate_request(&req(cmd, 0, 0, 512), &bare),
                Err(ErrorValue::Inval),
                "{cmd:?}"
            );
        }
        // block status needs a meta context even with structured replies
        let mut no_ctx = full_info();
        no_ctx.has_meta_context = false;
        assert_eq!(
            validate_request(&req(Command::BlockStatus, 0, 0, 512), &no_ctx),
            Err(ErrorValue::Inval)
        );
        let mut resize = TransmissionInfo::new(10, TF::SEND_RESIZE);
        assert_eq!(
            validate_request(&req(Command::Resize, 0, 1 << 40, 0), &resize),
            Ok(())
        );
        resize.flags |= TF::READ_ONLY;
        assert_eq!(
            validate_request(&req(Command::Resize, 0, 1 << 40, 0), &resize),
            Err(ErrorValue::Perm)
        );
    }

    #[test]
    fn bad_flags() {
        let i = full_info();
        let cases = [
            req(Command::Read, 0x20, 0, 512), // unknown bit
            req(Command::Write, 4, 0, 512),   // DF on write
            req(Command::Read, 2, 0, 512),    // NO_HOLE on read
            req(Command::Write, 16, 0, 512),  // FAST_ZERO on write
            req(Command::Read, 8, 0, 512),    // REQ_ONE on read
            req(Command::Trim, 16, 0, 512),   // FAST_ZERO on trim
        ];
        for r in cases {
            assert_eq!(validate_request(&r, &i), Err(ErrorValue::Inval), "{r:?}");
        }
        let mut no_fua = full_info();
        no_fua.flags = TF::HAS_FLAGS | TF::SEND_WRITE_ZEROES;
        assert_eq!(
            validate_request(&req(Command::Write, 1, 0, 512), &no_fua),
            Err(ErrorValue::Inval)
        );
        // FAST_ZERO without SEND_FAST_ZERO
        assert_eq!(
            validate_request(&req(Command::WriteZeroes, 16, 0, 512), &no_fua),
            Err(ErrorValue::Inval)
        );
        // DF without SEND_DF, and DF without structured replies
        assert_eq!(
            validate_request(&req(Command::Read, 4, 0, 512), &no_fua),
            Err(ErrorValue::Inval)
        );
        let mut no_sr = full_info();
        no_sr.structured_replies = false;
        assert_eq!(
            validate_request(&req(Command::Read, 4, 0, 512), &no_sr),
            Err(ErrorValue::Inval)
        );
    }

    #[test]
    fn read_only_is_eperm() {
        let mut i = full_info();
        i.flags |= TF::READ_ONLY;
        for cmd in [Command::Write, Command::Trim, Command::WriteZeroes] {
            assert_eq!(
                validate_request(&req(cmd, 0, 0, 512), &i),
                Err(ErrorValue::Perm)
            );
        }
        // A read-only export advertises no TRIM or WRITE_ZEROES: still EPERM, not EINVAL.
        let mut ro = i.clone();
        ro.flags = TF::HAS_FLAGS | TF::READ_ONLY | TF::SEND_FLUSH;
        for cmd in [Command::Trim, Command::WriteZeroes] {
            assert_eq!(
                validate_request(&req(cmd, 0, 0, 512), &ro),
                Err(ErrorValue::Perm)
            );
        }
        // EPERM wins over out-of-bounds
        assert_eq!(
            validate_request(&req(Command::Write, 0, 1 << 30, 512), &i),
            Err(ErrorValue::Perm)
        );
        assert_eq!(validate_request(&req(Command::Read, 0, 0, 512), &i), Ok(()));
        assert_eq!(validate_request(&req(Command::Flush, 0, 0, 0), &i), Ok(()));
    }

    #[test]
    fn flush_must_be_zero() {
        let i = full_info();
        assert_eq!(
            validate_request(&req(Command::Flush, 0, 1, 0), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Flush, 0, 0, 1), &i),
            Err(ErrorValue::Inval)
        );
    }

    #[test]
    fn bounds_errors() {
        let i = full_info();
        let end = 1u64 << 20;
        assert_eq!(
            validate_request(&req(Command::Write, 0, end, 1), &i),
            Err(ErrorValue::NoSpc)
        );
        assert_eq!(
            validate_request(&req(Command::WriteZeroes, 0, end - 1, 2), &i),
            Err(ErrorValue::NoSpc)
        );
        for cmd in [
            Command::Read,
            Command::Trim,
            Command::Cache,
            Command::BlockStatus,
        ] {
            assert_eq!(
                validate_request(&req(cmd, 0, end - 1, 2), &i),
                Err(ErrorValue::Inval),
                "{cmd:?}"
            );
        }
        // overflow of offset + length
        assert_eq!(
            validate_request(&req(Command::Read, 0, u64::MAX, 1), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Write, 0, u64::MAX, 1), &i),
            Err(ErrorValue::NoSpc)
        );
        // zero-length past the end
        assert_eq!(
            validate_request(&req(Command::Read, 0, end + 1, 0), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::BlockStatus, 0, 0, 0), &i),
            Err(ErrorValue::Inval)
        );
    }

    #[test]
    fn block_size_errors() {
        let mut i = full_info();
        i.block_size = BlockSize {
            min: 512,
            preferred: 4096,
            max: 65536,
        };
        assert_eq!(
            validate_request(&req(Command::Read, 0, 256, 512), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Write, 0, 0, 500), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Read, 0, 0, 65536 + 512), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::Cache, 0, 0, 65536 + 512), &i),
            Err(ErrorValue::Inval)
        );
        assert_eq!(
            validate_request(&req(Command::WriteZeroes, 0, 0, 65536 + 512), &i),
            Err(ErrorValue::Inval)
        );
        // fast zero and trim are not capped by the maximum block size
        assert_eq!(
            validate_request(&req(Command::WriteZeroes, 16, 0, 65536 + 512), &i),
            Ok(())
        );
        assert_eq!(
            validate_request(&req(Command::Trim, 0, 0, 65536 + 512), &i),
            Ok(())
        );
        assert_eq!(
            validate_request(&req(Command::BlockStatus, 0, 0, 65536 + 512), &i),
            Ok(())
        );
    }

    #[test]
    fn df_overflow() {
        let mut i = full_info();
        i.size = u64::MAX;
        i.df_max_len = 65536;
        assert_eq!(
            validate_request(&req(Command::Read, 4, 0, 65536), &i),
            Ok(())
        );
        assert_eq!(
            validate_request(&req(Command::Read, 4, 0, 65537), &i),
            Err(ErrorValue::Overflow)
        );
        assert_eq!(
            validate_request(&req(Command::Read, 0, 0, 65537), &i),
            Ok(())
        );
        i.df_max_len = u32::MAX;
        assert_eq!(
            validate_request(&req(Command::Read, 4, 0, u32::MAX), &i),
            Err(ErrorValue::Overflow)
        );
    }
}
