//! Message framing for message-oriented transports.
//!
//! A transport that delivers whole messages (such as the queue-pair transport)
//! asks a *framer* where the next message ends: it shows the framer the bytes
//! received so far and gets back a [`Need`]. A message is **header + body**:
//! the header is small and parsed by this crate; the body is bulk data (the
//! payload of an `NBD_CMD_WRITE`, the data of a read reply, option data) which
//! the transport may place directly into registered memory.
//!
//! The framers are pure functions of `(phase, prefix)`. The phase is a small
//! `Copy` enum with a `u8` representation so a caller can keep it in an
//! `AtomicU8` shared with its receive path. A server flips its phase to
//! [`ServerPhase::Transmission`] right before sending the final reply of the
//! handshake (`NBD_OPT_GO` ack or `NBD_OPT_EXPORT_NAME` reply), since the
//! client may pipeline its first request right after.
//!
//! The server's framer is in `framing/server.rs`, the client's in `framing/client.rs`; what
//! both share (limits, errors, the answer) is here.

mod client;
mod server;

pub use client::{
    ClientPhase, DataAt, ReadChunk, client_data_at, client_need, client_read_chunk, reply_cookie,
};
pub use server::{ServerPhase, server_need};

/// Limits enforced by the framers (bounded memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest option data (server side) or option reply data (client side).
    pub max_option_len: u32,
    /// Largest `NBD_CMD_WRITE` payload accepted by the server framer.
    pub max_write_len: u32,
    /// Largest reply body (simple-reply read data or structured chunk payload)
    /// accepted by the client framer.
    pub max_reply_len: u32,
}

/// Default option data cap: 64 KiB (an export name is at most 4 KiB).
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 * 1024;
/// Default write payload cap: 32 MiB (2^25), the size the spec says SHOULD NOT
/// be considered a denial of service.
pub const DEFAULT_MAX_WRITE_LEN: u32 = 1 << 25;
/// Default reply body cap: 32 MiB of data plus the 8-byte offset of an
/// `OFFSET_DATA` chunk.
pub const DEFAULT_MAX_REPLY_LEN: u32 = (1 << 25) + 8;

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_option_len: DEFAULT_MAX_OPTION_LEN,
            max_write_len: DEFAULT_MAX_WRITE_LEN,
            max_reply_len: DEFAULT_MAX_REPLY_LEN,
        }
    }
}

/// Why a prefix can never become a valid message (the connection must be dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Wrong magic number.
    #[error("bad magic {found:#x}, expected {expected:#x}")]
    BadMagic {
        /// Expected magic.
        expected: u64,
        /// Magic found.
        found: u64,
    },
    /// A length above the configured limit.
    #[error("length {len} exceeds limit {limit}")]
    TooLong {
        /// Length announced.
        len: u64,
        /// Limit.
        limit: u32,
    },
    /// The phase does not expect any message from the peer.
    #[error("no message expected in this phase")]
    Unexpected,
    /// An `OFFSET_DATA` chunk with more data than its read asked for.
    #[error("a data chunk of {len} bytes is longer than its read of {read_len} bytes")]
    ChunkLongerThanRead {
        /// Bytes of data the chunk header announces.
        len: u64,
        /// The read's length.
        read_len: u32,
    },
    /// An `OFFSET_DATA` chunk whose data lie (partly) outside its read.
    #[error(
        "a data chunk of {len} bytes at offset {offset} lies outside the read of {read_len} \
         bytes at {read_offset}"
    )]
    ChunkOutsideRead {
        /// The chunk's offset.
        offset: u64,
        /// Bytes of data the chunk header announces.
        len: u64,
        /// The read's offset.
        read_offset: u64,
        /// The read's length.
        read_len: u32,
    },
}

/// The framer's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Not enough bytes to know the message length: wait until at least this
    /// many bytes (counted from the start of the message) are available.
    Header(usize),
    /// The message is `header_len + body_len` bytes long.
    Message {
        /// Bytes of header (parsed by this crate).
        header_len: usize,
        /// Bytes of body (bulk data).
        body_len: usize,
    },
    /// The bytes can never form a valid message.
    Invalid(FrameError),
}

impl Need {
    /// Total message length, once known.
    pub const fn total(&self) -> Option<usize> {
        match *self {
            Self::Message {
                header_len,
                body_len,
            } => Some(header_len + body_len),
            _ => None,
        }
    }
}

fn check_len(len: u64, limit: u32) -> Result<usize, FrameError> {
    if len > u64::from(limit) {
        Err(FrameError::TooLong { len, limit })
    } else {
        // at most a u32, which fits usize on the platforms this crate supports (>= 32 bit)
        Ok(len as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const L: FrameLimits = FrameLimits {
        max_option_len: 100,
        max_write_len: 1000,
        max_reply_len: 2000,
    };

    #[test]
    fn phases_roundtrip_u8() {
        for v in 0..4 {
            assert_eq!(ServerPhase::from_u8(v).map(ServerPhase::to_u8), Some(v));
        }
        assert_eq!(ServerPhase::from_u8(4), None);
        for v in 0..7 {
            assert_eq!(ClientPhase::from_u8(v).map(ClientPhase::to_u8), Some(v));
        }
        assert_eq!(ClientPhase::from_u8(7), None);
    }
}
