//! The server's framer: where each client message (handshake option or transmission request)
//! ends.

use super::{FrameError, FrameLimits, Need, check_len};
use crate::consts as c;
use crate::wire::{be_u16, be_u32, be_u64};

/// Which client message a server expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ServerPhase {
    /// The 4-byte client flags.
    ClientFlags = 0,
    /// Option requests: 16-byte header + data.
    Options = 1,
    /// Requests: 28-byte header (+ payload for `WRITE`).
    Transmission = 2,
    /// Extended requests: 32-byte header (+ payload with `NBD_CMD_FLAG_PAYLOAD_LEN`).
    TransmissionExtended = 3,
}

impl ServerPhase {
    /// For storage in an `AtomicU8`.
    pub const fn to_u8(self) -> u8 {
        self as u8
    }
    /// Inverse of [`Self::to_u8`].
    pub const fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::ClientFlags),
            1 => Some(Self::Options),
            2 => Some(Self::Transmission),
            3 => Some(Self::TransmissionExtended),
            _ => None,
        }
    }
}

/// Server-side framer: where does the client message starting at `prefix[0]` end?
pub fn server_need(phase: ServerPhase, prefix: &[u8], limits: &FrameLimits) -> Need {
    match phase {
        ServerPhase::ClientFlags => Need::Message {
            header_len: c::CLIENT_FLAGS_LEN,
            body_len: 0,
        },
        ServerPhase::Options => {
            let (Some(magic), Some(len)) = (be_u64(prefix, 0), be_u32(prefix, 12)) else {
                return Need::Header(c::OPTION_HEADER_LEN);
            };
            if magic != c::IHAVEOPT {
                return Need::Invalid(FrameError::BadMagic {
                    expected: c::IHAVEOPT,
                    found: magic,
                });
            }
            match check_len(len.into(), limits.max_option_len) {
                Ok(body_len) => Need::Message {
                    header_len: c::OPTION_HEADER_LEN,
                    body_len,
                },
                Err(e) => Need::Invalid(e),
            }
        }
        ServerPhase::Transmission | ServerPhase::TransmissionExtended => {
            let extended = phase == ServerPhase::TransmissionExtended;
            let (header_len, expected) = if extended {
                (c::EXTENDED_REQUEST_LEN, c::EXTENDED_REQUEST_MAGIC)
            } else {
                (c::REQUEST_LEN, c::REQUEST_MAGIC)
            };
            if prefix.len() < header_len {
                return Need::Header(header_len);
            }
            let magic = be_u32(prefix, 0).unwrap_or(0);
            if magic != expected {
                return Need::Invalid(FrameError::BadMagic {
                    expected: expected.into(),
                    found: magic.into(),
                });
            }
            let flags = be_u16(prefix, 4).unwrap_or(0);
            let cmd = be_u16(prefix, 6).unwrap_or(0);
            // Compact: only a WRITE has a payload. Extended: the flag says so, whatever the
            // command (the server then refuses a command that takes none, after reading it);
            // a WRITE has one even without the flag, which qemu (10) does not set.
            let payload = if extended {
                (flags & c::CMD_FLAG_PAYLOAD_LEN != 0 || cmd == c::CMD_WRITE)
                    .then(|| be_u64(prefix, 24).unwrap_or(0))
            } else {
                (cmd == c::CMD_WRITE).then(|| be_u32(prefix, 24).unwrap_or(0).into())
            };
            let body_len = match payload.map(|len| check_len(len, limits.max_write_len)) {
                None => 0,
                Some(Ok(n)) => n,
                Some(Err(e)) => return Need::Invalid(e),
            };
            Need::Message {
                header_len,
                body_len,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::CmdFlags;
    use crate::framing::tests::L;
    use crate::transmission::{Command, Request};

    #[test]
    fn server_flags_and_options() {
        assert_eq!(
            server_need(ServerPhase::ClientFlags, &[], &L).total(),
            Some(4)
        );
        assert_eq!(
            server_need(ServerPhase::Options, b"IHAVE", &L),
            Need::Header(16)
        );
        let mut h = b"IHAVEOPT".to_vec();
        h.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 100]);
        assert_eq!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Message {
                header_len: 16,
                body_len: 100
            }
        );
        h[15] = 101;
        assert_eq!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Invalid(FrameError::TooLong {
                len: 101,
                limit: 100
            })
        );
        h[0] = b'X';
        assert!(matches!(
            server_need(ServerPhase::Options, &h, &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn server_requests() {
        let mut r = Request {
            flags: CmdFlags::empty(),
            command: Command::Read,
            cookie: 1,
            offset: 0,
            length: 5000,
        };
        assert_eq!(
            server_need(
                ServerPhase::Transmission,
                &r.encode(false).unwrap()[..27],
                &L
            ),
            Need::Header(28)
        );
        assert_eq!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L).total(),
            Some(28)
        );
        r.command = Command::Write;
        r.length = 1000;
        assert_eq!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L),
            Need::Message {
                header_len: 28,
                body_len: 1000
            }
        );
        r.length = 1001;
        assert!(matches!(
            server_need(ServerPhase::Transmission, &r.encode(false).unwrap(), &L),
            Need::Invalid(FrameError::TooLong { .. })
        ));
        assert!(matches!(
            server_need(ServerPhase::Transmission, &[0; 28], &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn extended_requests_are_framed_by_their_flag() {
        let ext = ServerPhase::TransmissionExtended;
        let mut r = Request {
            flags: CmdFlags::PAYLOAD_LEN,
            command: Command::Write,
            cookie: 1,
            offset: 0,
            length: 1000,
        };
        let h = r.encode(true).unwrap();
        assert_eq!(server_need(ext, &h[..31], &L), Need::Header(32));
        assert_eq!(
            server_need(ext, &h, &L),
            Need::Message {
                header_len: 32,
                body_len: 1000
            }
        );
        // A huge effect length without the flag has no payload; a payload on any command
        // is read (and refused later); one above the limit is a disconnect.
        r.flags = CmdFlags::empty();
        r.command = Command::Trim;
        r.length = 1 << 40;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L).total(),
            Some(32)
        );
        r.flags = CmdFlags::PAYLOAD_LEN;
        r.length = 10;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L).total(),
            Some(42)
        );
        r.length = 1 << 40;
        assert_eq!(
            server_need(ext, &r.encode(true).unwrap(), &L),
            Need::Invalid(FrameError::TooLong {
                len: 1 << 40,
                limit: 1000
            })
        );
        // The compact magic is refused in the extended phase and vice versa.
        let compact = r.encode(false);
        assert!(compact.is_err());
        r.length = 10;
        assert!(matches!(
            server_need(ext, &[&r.encode(false).unwrap()[..], &[0; 4]].concat(), &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
        assert!(matches!(
            server_need(ServerPhase::Transmission, &r.encode(true).unwrap(), &L),
            Need::Invalid(FrameError::BadMagic { .. })
        ));
    }
}
