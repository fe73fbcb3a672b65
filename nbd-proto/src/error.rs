//! Typed errors shared by the codec.

/// A wire-level decoding error: the peer sent bytes that cannot be a valid message.
///
/// Every variant means "the peer violated the protocol"; what to do about it
/// (reply with an error, or hard-disconnect) is decided by the caller or the
/// state machines, which document their choice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The buffer is shorter than the fixed part of the message.
    #[error("truncated message: need {need} bytes, got {got}")]
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes available.
        got: usize,
    },
    /// The message does not start with the expected magic number.
    #[error("bad magic {found:#x}, expected {expected:#x}")]
    BadMagic {
        /// Expected magic.
        expected: u64,
        /// Magic found on the wire.
        found: u64,
    },
    /// A length field is above a limit this crate enforces.
    #[error("{what} length {len} exceeds limit {limit}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Length found.
        len: u64,
        /// Limit.
        limit: u64,
    },
    /// The buffer length does not match the length announced in its header.
    #[error("length mismatch: header says {expected} bytes, got {got}")]
    LengthMismatch {
        /// Length announced.
        expected: usize,
        /// Length present.
        got: usize,
    },
    /// A structurally invalid message (the reason is static text).
    #[error("invalid message: {0}")]
    Invalid(&'static str),
    /// A string field is not valid UTF-8 or contains NUL.
    #[error("invalid string in {0}")]
    BadString(&'static str),
    /// An unknown, non-error structured reply type (the client must hard-disconnect).
    #[error("unknown structured reply type {0:#x}")]
    UnknownReplyType(u16),
}

/// Decode a protocol string: UTF-8, no NUL, at most [`crate::consts::MAX_STRING_LEN`] bytes.
pub(crate) fn parse_string<'a>(bytes: &'a [u8], what: &'static str) -> Result<&'a str, ProtoError> {
    if bytes.len() > crate::consts::MAX_STRING_LEN {
        return Err(ProtoError::TooLong {
            what,
            len: bytes.len() as u64,
            limit: crate::consts::MAX_STRING_LEN as u64,
        });
    }
    let s = core::str::from_utf8(bytes).map_err(|_| ProtoError::BadString(what))?;
    if s.contains('\0') {
        return Err(ProtoError::BadString(what));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings() {
        assert_eq!(parse_string(b"abc", "x"), Ok("abc"));
        assert_eq!(parse_string(b"a\0c", "x"), Err(ProtoError::BadString("x")));
        assert_eq!(parse_string(&[0xff], "x"), Err(ProtoError::BadString("x")));
        assert!(parse_string(&[b'a'; 4096], "x").is_ok());
        assert!(matches!(
            parse_string(&[b'a'; 4097], "x"),
            Err(ProtoError::TooLong { .. })
        ));
    }
}
