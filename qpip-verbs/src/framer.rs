//! Framers: how a QP finds where one message ends and the next begins in a byte stream.
//!
//! QPIP adds no wire format. A reliable QP reads a TCP byte stream, so something must say where
//! each message ends: the QP's framer. It is consulted with the header bytes received so far
//! of the next message and answers how many more it needs or how long the message is. The
//! NIC then places the message (header, then body) into one receive WR; the body goes straight
//! from the socket into the WR's memory. A framer that knows where a body belongs (an NBD
//! client knows which buffer waits for a READ's data) may name that memory instead
//! ([`Frame::MessageAt`]): the NIC places the body there and only the header in the WR, the
//! way an RDMA NIC places a tagged message.

use crate::mr::Sge;

/// Most header bytes a framer may ask for before it must decide.
pub const MAX_HEADER: usize = 64;

/// A framer's answer for the next message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Frame {
    /// Read until `n` header bytes (in total, for this message) are present, then ask again.
    NeedHeader(usize),
    /// The message is the first `header_len` bytes plus `body_len` more; the first `strip`
    /// bytes are framing only and are not delivered (e.g. a length prefix).
    Message {
        /// Header bytes.
        header_len: usize,
        /// Leading header bytes not delivered.
        strip: usize,
        /// Bytes after the header.
        body_len: usize,
    },
    /// As `Message`, but the body (`body.len` bytes) goes to `body`, registered memory the
    /// application named or a range of a registered file ([`crate::FileRegion`], which the
    /// NIC then writes), checked like a receive WR's SGE (its key, bounds and local-write
    /// access); the receive WR takes only the header. The completion's `placed` counts the
    /// body bytes that arrived, its `byte_len` the header bytes in the WR.
    MessageAt {
        /// Header bytes.
        header_len: usize,
        /// Leading header bytes not delivered.
        strip: usize,
        /// Where the body goes.
        body: Sge,
    },
    /// No message boundaries: each receive WR takes whatever bytes have arrived (raw stream).
    Stream,
    /// The bytes cannot start a valid message; the QP goes to the error state.
    Invalid(String),
}

/// Finds message boundaries for one QP. An application protocol implements it (NBD's
/// requests and replies delimit themselves).
///
/// Contract: `frame` is called with a growing prefix of the next message's bytes (starting
/// empty) and must answer the same way for the same prefix until it returns `Message`.
pub trait Framer: Send + 'static {
    /// Where the message that starts with `header` ends.
    fn frame(&mut self, header: &[u8]) -> Frame;

    /// Bytes to put on the wire before an outgoing message of `body_len` bytes; returns how
    /// many of `out` it filled. Most framers add nothing.
    fn encode_header(&mut self, body_len: usize, out: &mut [u8; MAX_HEADER]) -> usize {
        let _ = (body_len, out);
        0
    }
}

/// Messages carried as a 4-byte big-endian length followed by the body: for QP-to-QP
/// applications that have no framing of their own.
#[derive(Clone, Debug)]
pub struct LengthPrefixed {
    /// Longest body accepted from the peer; longer is a framing error (bounded memory).
    pub max_message: u32,
}

impl Default for LengthPrefixed {
    fn default() -> Self {
        LengthPrefixed {
            max_message: 64 << 20,
        }
    }
}

impl Framer for LengthPrefixed {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let Some(prefix) = header.first_chunk::<4>() else {
            return Frame::NeedHeader(4);
        };
        let len = u32::from_be_bytes(*prefix);
        if len > self.max_message {
            return Frame::Invalid(format!(
                "message of {len} bytes exceeds the limit of {}",
                self.max_message
            ));
        }
        Frame::Message {
            header_len: 4,
            strip: 4,
            body_len: len as usize,
        }
    }

    fn encode_header(&mut self, body_len: usize, out: &mut [u8; MAX_HEADER]) -> usize {
        // Send WRs longer than u32::MAX are refused before they reach the framer.
        out[..4].copy_from_slice(&(body_len as u32).to_be_bytes());
        4
    }
}

/// No framing: each receive WR is filled with whatever bytes have arrived, up to its size.
/// For talking to any plain socket peer.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawStream;

impl Framer for RawStream {
    fn frame(&mut self, _header: &[u8]) -> Frame {
        Frame::Stream
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_prefixed_asks_for_four_bytes_then_sizes_the_body() {
        let mut f = LengthPrefixed::default();
        assert_eq!(f.frame(&[]), Frame::NeedHeader(4));
        assert_eq!(f.frame(&[0, 0]), Frame::NeedHeader(4));
        assert_eq!(
            f.frame(&[0, 0, 1, 0]),
            Frame::Message {
                header_len: 4,
                strip: 4,
                body_len: 256
            }
        );
        let mut out = [0u8; MAX_HEADER];
        assert_eq!(f.encode_header(256, &mut out), 4);
        assert_eq!(&out[..4], &[0, 0, 1, 0]);
    }

    #[test]
    fn length_prefixed_rejects_oversized() {
        let mut f = LengthPrefixed { max_message: 10 };
        assert!(matches!(f.frame(&[0, 0, 0, 11]), Frame::Invalid(_)));
    }
}
