//! The request checks ([`validate_request`]) and what they yield: a [`ValidCommand`] whose
//! ranges lie inside the export and whose flags were negotiated.

use crate::flags::{CmdFlags, TransmissionFlags};
use crate::handshake::TransmissionInfo;
use crate::request::{Command, ErrorValue, Request};

/// A byte range of the export that passed the checks: aligned to the minimum block size,
/// and `offset + len` does not overflow nor pass the export's end. Only the checks build one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ByteRange {
    offset: u64,
    len: u64,
}

impl ByteRange {
    /// First byte.
    pub const fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes (may be 0: a no-op, except for `BLOCK_STATUS`, which refuses it).
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length range.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last byte (at most the export size).
    pub const fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Which of the selected metadata contexts a `BLOCK_STATUS` answers: positions in the list
/// `NBD_OPT_SET_META_CONTEXT` selected (at most [`ContextSet::MAX`]; a server offers the
/// payload form of `BLOCK_STATUS` only when the selection fits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContextSet(u64);

impl ContextSet {
    /// Most contexts a set can name.
    pub const MAX: usize = 64;
    /// Every selected context (a `BLOCK_STATUS` without a payload).
    pub const ALL: Self = Self(u64::MAX);
    /// None yet.
    pub const EMPTY: Self = Self(0);

    /// Whether the context at position `i` of the selection is in the set.
    pub const fn contains(&self, i: usize) -> bool {
        i < Self::MAX && self.0 & (1 << i) != 0
    }

    /// The set with position `i` added; None where `i` is past [`Self::MAX`] or already in.
    pub const fn with(self, i: usize) -> Option<Self> {
        if i >= Self::MAX || self.contains(i) {
            None
        } else {
            Some(Self(self.0 | (1 << i)))
        }
    }
}

/// A command that passed [`validate_request`]'s checks, with the flags that matter to it.
/// `READ` and `WRITE` ranges are at most the maximum block size long, so their length fits
/// in a `u32`; the ranges of commands without a payload may reach the export's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValidCommand {
    /// `NBD_CMD_READ`; `df`: do not fragment the reply.
    Read {
        /// The range to read.
        range: ByteRange,
        /// `NBD_CMD_FLAG_DF`.
        df: bool,
    },
    /// `NBD_CMD_WRITE`: `range.len()` payload bytes follow the header.
    Write {
        /// The range to write.
        range: ByteRange,
        /// `NBD_CMD_FLAG_FUA`: durable before the reply.
        fua: bool,
    },
    /// `NBD_CMD_DISC`: close, with no reply.
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim {
        /// The range to trim.
        range: ByteRange,
        /// `NBD_CMD_FLAG_FUA`.
        fua: bool,
    },
    /// `NBD_CMD_CACHE`.
    Cache {
        /// The range to prefetch.
        range: ByteRange,
    },
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes {
        /// The range to zero.
        range: ByteRange,
        /// `NBD_CMD_FLAG_FUA`.
        fua: bool,
        /// `NBD_CMD_FLAG_NO_HOLE`: zeroes must be allocated.
        no_hole: bool,
        /// `NBD_CMD_FLAG_FAST_ZERO`: fail rather than write slowly.
        fast_zero: bool,
    },
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus {
        /// The range asked about (nonzero).
        range: ByteRange,
        /// `NBD_CMD_FLAG_REQ_ONE`: one extent per context.
        req_one: bool,
        /// The contexts to answer for (all of them, unless a payload chose some).
        contexts: ContextSet,
    },
    /// `NBD_CMD_BLOCK_STATUS` with `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers, where the
    /// server offered `NBD_FLAG_BLOCK_STATUS_PAYLOAD`): its `payload_len` bytes (the effect
    /// length, then the context ids to answer for) follow the header, and only they say
    /// which range is asked about: the server reads them, then checks them into a
    /// [`ValidCommand::BlockStatus`] ([`crate::transmission::server::ServerTransmission::block_status_payload`]).
    BlockStatusPayload {
        /// The request's offset.
        offset: u64,
        /// Payload bytes: 8, then 4 per id (checked against the selection by the server).
        payload_len: u64,
        /// `NBD_CMD_FLAG_REQ_ONE`.
        req_one: bool,
    },
    /// `NBD_CMD_RESIZE` (experimental): the new size, not range-checked.
    Resize {
        /// The new export size.
        size: u64,
    },
}

impl ValidCommand {
    /// The wire command.
    pub const fn command(&self) -> Command {
        match self {
            Self::Read { .. } => Command::Read,
            Self::Write { .. } => Command::Write,
            Self::Disc => Command::Disc,
            Self::Flush => Command::Flush,
            Self::Trim { .. } => Command::Trim,
            Self::Cache { .. } => Command::Cache,
            Self::WriteZeroes { .. } => Command::WriteZeroes,
            Self::BlockStatus { .. } | Self::BlockStatusPayload { .. } => Command::BlockStatus,
            Self::Resize { .. } => Command::Resize,
        }
    }

    /// Payload bytes that follow the header: a `WRITE`'s length, a `BLOCK_STATUS`
    /// payload's, else 0.
    pub const fn payload_len(&self) -> u64 {
        match self {
            Self::Write { range, .. } => range.len,
            Self::BlockStatusPayload { payload_len, .. } => *payload_len,
            _ => 0,
        }
    }
}

/// Whether a server should execute `req`, or the error value the spec recommends. A
/// server gets the typed command instead, from
/// [`ServerTransmission::parse_request`](crate::transmission::server::ServerTransmission::parse_request); a client
/// can check what it is about to send.
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
///    `WRITE` with extended headers, and on `BLOCK_STATUS` where
///    `BLOCK_STATUS_PAYLOAD` was advertised) → `EINVAL`. A `BLOCK_STATUS` with a payload
///    passes here as [`ValidCommand::BlockStatusPayload`]: its range is in the payload,
///    checked (from 6 on) once the server has read it.
/// 4. `WRITE`/`TRIM`/`WRITE_ZEROES`/`RESIZE` on a read-only export → `EPERM`, checked
///    before all the others (also where the command is not advertised, as qemu-nbd does).
/// 5. `FLUSH` with nonzero offset or length → `EINVAL` (they "MUST be set to all-zero").
/// 6. Offset or length not a multiple of the minimum block size → `EINVAL`.
/// 7. `READ`/`WRITE` longer than the maximum block size → `EINVAL` (commands without a
///    payload — `TRIM`, `WRITE_ZEROES`, `CACHE`, `BLOCK_STATUS` — may be as long as the
///    export: the spec lets their effect length pass the maximum payload size); so is a `READ` answered with structured replies that
///    one `OFFSET_DATA` chunk cannot carry (more than 2^32 − 9 bytes: this server answers
///    a read with one chunk), which only a maximum block size above that admits (checked
///    after 8, so a `DF` read that long gets `EOVERFLOW`).
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
    check_request(req, info).map(drop)
}

/// [`validate_request`]'s checks, yielding the typed command.
pub(crate) fn check_request(
    req: &Request,
    info: &TransmissionInfo,
) -> Result<ValidCommand, ErrorValue> {
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
        C::Disc => return Ok(ValidCommand::Disc),
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
    // With extended headers a WRITE says it carries a payload, and so may a BLOCK_STATUS
    // where the server offered the payload form; without them the flag does not exist.
    let payload_form = req.command == C::Write
        || (req.command == C::BlockStatus && tf.contains(TransmissionFlags::BLOCK_STATUS_PAYLOAD));
    if f.contains(CmdFlags::PAYLOAD_LEN) && !(info.extended_headers && payload_form) {
        return Err(ErrorValue::Inval);
    }
    if req.command == C::BlockStatus && f.contains(CmdFlags::PAYLOAD_LEN) {
        return Ok(ValidCommand::BlockStatusPayload {
            offset: req.offset,
            payload_len: req.length,
            req_one: f.contains(CmdFlags::REQ_ONE),
        });
    }

    match req.command {
        // 5.
        C::Flush => {
            return if req.offset == 0 && req.length == 0 {
                Ok(ValidCommand::Flush)
            } else {
                Err(ErrorValue::Inval)
            };
        }
        C::Resize => return Ok(ValidCommand::Resize { size: req.offset }),
        _ => {}
    }

    // 6. alignment
    let min = u64::from(info.block_size.min.max(1));
    if !req.offset.is_multiple_of(min) || !req.length.is_multiple_of(min) {
        return Err(ErrorValue::Inval);
    }

    // 7. maximum block size: a limit on payloads, so on READ and WRITE only. TRIM,
    // WRITE_ZEROES, CACHE and BLOCK_STATUS carry none and may reach the export's end, as
    // qemu-nbd and nbdkit serve them (qemu-img convert and nbdcopy send a hole as one).
    if matches!(req.command, C::Read | C::Write) && req.length > u64::from(info.block_size.max) {
        return Err(ErrorValue::Inval);
    }

    // 8. DF overflow
    if f.contains(CmdFlags::DF) && req.length > u64::from(info.df_max_len.min(u32::MAX - 8)) {
        return Err(ErrorValue::Overflow);
    }
    // 7, continued: one OFFSET_DATA chunk carries at most 2^32 - 9 bytes (after 8, so that a
    // DF read that long gets the spec's EOVERFLOW)
    if req.command == C::Read && info.structured_replies && req.length > u64::from(u32::MAX - 8) {
        return Err(ErrorValue::Inval);
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
    let range = ByteRange {
        offset: req.offset,
        len: req.length,
    };
    let fua = f.contains(CmdFlags::FUA);
    Ok(match req.command {
        C::Read => ValidCommand::Read {
            range,
            df: f.contains(CmdFlags::DF),
        },
        C::Write => ValidCommand::Write { range, fua },
        C::Trim => ValidCommand::Trim { range, fua },
        C::Cache => ValidCommand::Cache { range },
        C::WriteZeroes => ValidCommand::WriteZeroes {
            range,
            fua,
            no_hole: f.contains(CmdFlags::NO_HOLE),
            fast_zero: f.contains(CmdFlags::FAST_ZERO),
        },
        C::BlockStatus => ValidCommand::BlockStatus {
            range,
            req_one: f.contains(CmdFlags::REQ_ONE),
            contexts: ContextSet::ALL,
        },
        // answered above
        C::Disc | C::Flush | C::Resize | C::Unknown(_) => return Err(ErrorValue::Inval),
    })
}
