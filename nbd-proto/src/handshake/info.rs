//! What the handshake settles for the transmission phase, as the server's request checks
//! need it.

use crate::flags::TransmissionFlags;
use crate::handshake::messages::BlockSize;

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
