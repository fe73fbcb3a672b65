//! Raw protocol constants, named as in the NBD specification (`doc/proto.md`).
//!
//! Typed wrappers (flag sets, enums) live next to the code that uses them;
//! this module is the single source of the numeric values.

// ---- Magics -------------------------------------------------------------

/// `NBDMAGIC`, first 8 bytes of the server greeting (also `INIT_PASSWD`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, second 8 bytes of the newstyle greeting and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// `NBD_REQUEST_MAGIC`.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// `NBD_SIMPLE_REPLY_MAGIC`.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// `NBD_STRUCTURED_REPLY_MAGIC`.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// `NBD_EXTENDED_REQUEST_MAGIC` (extended headers).
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// `NBD_EXTENDED_REPLY_MAGIC` (extended headers).
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

// ---- Handshake flags (server, 16 bits) ----------------------------------

/// `NBD_FLAG_FIXED_NEWSTYLE`.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// `NBD_FLAG_NO_ZEROES`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

// ---- Client flags (32 bits) ----------------------------------------------

/// `NBD_FLAG_C_FIXED_NEWSTYLE`.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// `NBD_FLAG_C_NO_ZEROES`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---- Transmission flags (16 bits) ----------------------------------------

/// `NBD_FLAG_HAS_FLAGS` (always set).
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY`.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_ROTATIONAL`.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_FLAG_SEND_TRIM`.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_SEND_DF`.
pub const FLAG_SEND_DF: u16 = 1 << 7;
/// `NBD_FLAG_CAN_MULTI_CONN`.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_RESIZE`.
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
/// `NBD_FLAG_SEND_CACHE`.
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_FLAG_SEND_FAST_ZERO`.
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- Options --------------------------------------------------------------

/// `NBD_OPT_EXPORT_NAME`.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_PEEK_EXPORT` (withdrawn, never supported).
pub const OPT_PEEK_EXPORT: u32 = 4;
/// `NBD_OPT_STARTTLS`.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// `NBD_OPT_EXTENDED_HEADERS`.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// ---- Option reply types ----------------------------------------------------

/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`.
pub const REP_META_CONTEXT: u32 = 4;
/// Bit marking an option reply type as an error.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// `NBD_REP_ERR_UNSUP`.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// `NBD_REP_ERR_POLICY`.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// `NBD_REP_ERR_INVALID`.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// `NBD_REP_ERR_PLATFORM`.
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
/// `NBD_REP_ERR_TLS_REQD`.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// `NBD_REP_ERR_UNKNOWN`.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// `NBD_REP_ERR_SHUTDOWN`.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// `NBD_REP_ERR_BLOCK_SIZE_REQD`.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
/// `NBD_REP_ERR_TOO_BIG`.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
/// `NBD_REP_ERR_EXT_HEADER_REQD`.
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_FLAG_ERROR | 10;

// ---- Info types (NBD_REP_INFO payload) ------------------------------------

/// `NBD_INFO_EXPORT`.
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`.
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---- Commands --------------------------------------------------------------

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const CMD_BLOCK_STATUS: u16 = 7;
/// `NBD_CMD_RESIZE` (experimental).
pub const CMD_RESIZE: u16 = 8;

// ---- Command flags ---------------------------------------------------------

/// `NBD_CMD_FLAG_FUA`.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE`.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_DF`.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// `NBD_CMD_FLAG_REQ_ONE`.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// `NBD_CMD_FLAG_FAST_ZERO`.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers: `length` is a payload length).
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---- Structured replies ------------------------------------------------------

/// `NBD_REPLY_FLAG_DONE`.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Bit marking a structured reply type as an error chunk.
pub const REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
/// `NBD_REPLY_TYPE_NONE`.
pub const REPLY_TYPE_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_OFFSET_HOLE`.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// `NBD_REPLY_TYPE_BLOCK_STATUS`.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` (extended headers: 64-bit extents).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// `NBD_REPLY_TYPE_ERROR`.
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_FLAG_ERROR | 1;
/// `NBD_REPLY_TYPE_ERROR_OFFSET`.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_FLAG_ERROR | 2;

// ---- Error values --------------------------------------------------------------

/// `NBD_EPERM`.
pub const EPERM: u32 = 1;
/// `NBD_EIO`.
pub const EIO: u32 = 5;
/// `NBD_ENOMEM`.
pub const ENOMEM: u32 = 12;
/// `NBD_EINVAL`.
pub const EINVAL: u32 = 22;
/// `NBD_ENOSPC`.
pub const ENOSPC: u32 = 28;
/// `NBD_EOVERFLOW`.
pub const EOVERFLOW: u32 = 75;
/// `NBD_ENOTSUP`.
pub const ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`.
pub const ESHUTDOWN: u32 = 108;

// ---- base:allocation -------------------------------------------------------------

/// Name of the only metadata context defined by the spec.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// qemu's allocation depth context (docs/interop/nbd.rst): 0 unallocated in the whole
/// backing chain, 1 allocated in the image itself, N in its (N-1)th backing file.
pub const QEMU_ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// The prefix of qemu's dirty bitmap contexts, `qemu:dirty-bitmap:NAME` (docs/interop/nbd.rst).
pub const QEMU_DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
/// `NBD_STATE_DIRTY` of a dirty bitmap context: the extent was written since the bitmap was
/// made.
pub const STATE_DIRTY: u32 = 1 << 0;
/// `NBD_STATE_HOLE`.
pub const STATE_HOLE: u32 = 1 << 0;
/// `NBD_STATE_ZERO`.
pub const STATE_ZERO: u32 = 1 << 1;

// ---- Sizes ------------------------------------------------------------------------

/// Server greeting: `NBDMAGIC` + `IHAVEOPT` + 16-bit handshake flags.
pub const GREETING_LEN: usize = 18;
/// Client flags message.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Option request header: `IHAVEOPT` + option + length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Option reply header: magic + option + type + length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// `NBD_OPT_EXPORT_NAME` reply without the trailing zeroes.
pub const EXPORT_NAME_REPLY_SHORT_LEN: usize = 10;
/// Trailing reserved zeroes of the `NBD_OPT_EXPORT_NAME` reply.
pub const EXPORT_NAME_ZEROES: usize = 124;
/// Request header.
pub const REQUEST_LEN: usize = 28;
/// Simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Structured reply chunk header.
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;
/// Extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;
/// Extended reply chunk header.
pub const EXTENDED_REPLY_HEADER_LEN: usize = 32;
/// Maximum length of any protocol string (export names, messages...), per spec.
pub const MAX_STRING_LEN: usize = 4096;
