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

/// A transmission request header (the `length` bytes of a `WRITE` payload
/// follow it on the wire and are not part of this repr).
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
    /// Length in bytes.
    pub length: u32,
}

impl Request {
    /// Encode the 28-byte header.
    pub fn encode(&self) -> [u8; c::REQUEST_LEN] {
        let mut b = [0u8; c::REQUEST_LEN];
        b[0..4].copy_from_slice(&c::REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.bits().to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_u16().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Parse a request header from the first 28 bytes of `buf` (extra bytes,
    /// such as a write payload, are ignored). Fails on short input or bad magic;
    /// unknown commands and flags are kept for [`validate_request`] to reject.
    pub fn parse(buf: &[u8]) -> Result<Self, ProtoError> {
        let b: &[u8; c::REQUEST_LEN] = buf
            .get(..c::REQUEST_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(ProtoError::Truncated {
                need: c::REQUEST_LEN,
                got: buf.len(),
            })?;
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != c::REQUEST_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: c::REQUEST_MAGIC.into(),
                found: magic.into(),
            });
        }
        Ok(Self {
            flags: CmdFlags(u16::from_be_bytes([b[4], b[5]])),
            command: Command::from_u16(u16::from_be_bytes([b[6], b[7]])),
            cookie: u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
            offset: u64::from_be_bytes([b[16], b[17], b[18], b[19], b[20], b[21], b[22], b[23]]),
            length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        })
    }

    /// Bytes of payload that follow this header on the wire (`length` for `WRITE`, else 0).
    pub const fn payload_len(&self) -> u32 {
        match self.command {
            Command::Write => self.length,
            _ => 0,
        }
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
///    `SEND_FAST_ZERO`; `REQ_ONE` only on `BLOCK_STATUS`) → `EINVAL`.
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
    if !req.offset.is_multiple_of(min) || !u64::from(req.length).is_multiple_of(min) {
        return Err(ErrorValue::Inval);
    }

    // 7. maximum block size
    let len_capped = match req.command {
        C::Read | C::Write | C::Cache => true,
        C::WriteZeroes => !f.contains(CmdFlags::FAST_ZERO),
        _ => false,
    };
    if len_capped && req.length > info.block_size.max {
        return Err(ErrorValue::Inval);
    }

    // 8. DF overflow
    if f.contains(CmdFlags::DF) && req.length > info.df_max_len.min(u32::MAX - 8) {
        return Err(ErrorValue::Overflow);
    }

    // zero-length block status
    if req.command == C::BlockStatus && req.length == 0 {
        return Err(ErrorValue::Inval);
    }

    // 9. bounds
    let in_bounds = req
        .offset
        .checked_add(u64::from(req.length))
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
            length,
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
        let b = r.encode();
        assert_eq!(
            b,
            [
                0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0x10,
                0, 0, 0, 2, 0
            ]
        );
        assert_eq!(Request::parse(&b), Ok(r));
        assert_eq!(r.payload_len(), 512);
        for v in 0..=20u16 {
            let r = req(Command::from_u16(v), 0xffff, u64::MAX, u32::MAX);
            assert_eq!(Request::parse(&r.encode()), Ok(r));
            assert_eq!(Command::from_u16(v).to_u16(), v);
        }
        assert_eq!(req(Command::Read, 0, 0, 9).payload_len(), 0);
    }

    #[test]
    fn request_parse_errors() {
        assert!(matches!(
            Request::parse(&[0; 27]),
            Err(ProtoError::Truncated { need: 28, got: 27 })
        ));
        assert!(matches!(
            Request::parse(&[0; 28]),
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
