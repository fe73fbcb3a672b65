//! What a client may ask of the export it negotiated: a request is checked here before it
//! takes a slot, so that the server never sees one it must refuse (the client's mirror of
//! [`crate::validate_request`], with errors that say what is wrong instead of an errno).

use crate::flags::{CmdFlags, TransmissionFlags};
use crate::handshake::BlockSize;
use crate::transmission::{Command, Request};

/// Why the client refuses to send a request (nothing went on the wire).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// Offset or length is not a multiple of the minimum block size.
    #[error(
        "request at offset {offset} of {len} bytes is not aligned to the server's minimum block size {min}"
    )]
    Unaligned {
        /// Offset of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// The server's minimum block size.
        min: u32,
    },
    /// The range runs past the end of the export.
    #[error(
        "request at offset {offset} of {len} bytes is beyond the end of the export ({size} bytes)"
    )]
    OutOfRange {
        /// Offset of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// The export's size.
        size: u64,
    },
    /// A writing command on a read-only export.
    #[error("the export is read-only")]
    ReadOnly,
    /// The export does not offer the command.
    #[error("the export does not support {0}")]
    Unsupported(&'static str),
    /// Anything else the caller got wrong.
    #[error("{0}")]
    Invalid(&'static str),
}

/// A request as the caller describes it; the session picks the cookie and header style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submission {
    /// READ, WRITE, FLUSH, TRIM, WRITE_ZEROES or BLOCK_STATUS.
    pub command: Command,
    /// Offset in the export.
    pub offset: u64,
    /// Bytes (a WRITE's payload length).
    pub length: u32,
    /// Ask for FUA (sent only when the export offers it).
    pub fua: bool,
}

/// The negotiated export, as far as request checks need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Export size.
    pub size: u64,
    /// Transmission flags.
    pub flags: TransmissionFlags,
    /// Block size constraints.
    pub block_size: BlockSize,
    /// Largest READ/WRITE in one request.
    pub max_io: u32,
    /// `base:allocation` was negotiated.
    pub block_status: bool,
}

impl Limits {
    /// `[offset, offset + len)` is aligned to the minimum block size and inside the export.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), Refused> {
        let min = self.block_size.min;
        if !offset.is_multiple_of(u64::from(min)) || !len.is_multiple_of(u64::from(min)) {
            return Err(Refused::Unaligned { offset, len, min });
        }
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(Refused::OutOfRange {
                offset,
                len,
                size: self.size,
            });
        }
        Ok(())
    }

    fn has(&self, f: TransmissionFlags) -> bool {
        self.flags.contains(f)
    }

    /// The request header for `sub` (cookie 0), or why it must not be sent.
    pub fn check(&self, sub: &Submission) -> Result<Request, Refused> {
        let req = self.check_piece(sub)?;
        if !matches!(req.command, Command::Flush | Command::Resize) {
            self.check_range(req.offset, req.length)?;
        }
        Ok(req)
    }

    /// [`Self::check`] but for the range: for a piece of a larger range the caller has
    /// checked with [`Self::check_range`] (pieces cut at multiples of the minimum block size
    /// stay aligned and inside it).
    pub fn check_piece(&self, sub: &Submission) -> Result<Request, Refused> {
        let command = sub.command;
        let mut flags = CmdFlags::empty();
        if matches!(command, Command::Write | Command::WriteZeroes) {
            flags.set(
                CmdFlags::FUA,
                sub.fua && self.has(TransmissionFlags::SEND_FUA),
            );
        }
        if command.is_write() && self.has(TransmissionFlags::READ_ONLY) {
            return Err(Refused::ReadOnly);
        }
        let len = sub.length;
        match command {
            Command::Read | Command::Write if len > self.max_io => {
                return Err(Refused::Invalid("request longer than max_io()"));
            }
            Command::Flush if !self.has(TransmissionFlags::SEND_FLUSH) => {
                return Err(Refused::Unsupported("FLUSH"));
            }
            Command::Trim if !self.has(TransmissionFlags::SEND_TRIM) => {
                return Err(Refused::Unsupported("TRIM"));
            }
            Command::WriteZeroes if !self.has(TransmissionFlags::SEND_WRITE_ZEROES) => {
                return Err(Refused::Unsupported("WRITE_ZEROES"));
            }
            Command::BlockStatus if !self.block_status => {
                return Err(Refused::Unsupported("block status (base:allocation)"));
            }
            Command::BlockStatus if len == 0 => {
                return Err(Refused::Invalid("zero-length block status"));
            }
            // The new size travels in the offset field: a multiple of the minimum block
            // size, so that every block of the export stays addressable.
            Command::Resize if !self.has(TransmissionFlags::SEND_RESIZE) => {
                return Err(Refused::Unsupported("RESIZE"));
            }
            Command::Resize => {
                let min = u64::from(self.block_size.min.max(1));
                if !sub.offset.is_multiple_of(min) {
                    return Err(Refused::Unaligned {
                        offset: sub.offset,
                        len: 0,
                        min: self.block_size.min,
                    });
                }
                return Ok(Request {
                    flags: CmdFlags::empty(),
                    command,
                    cookie: 0,
                    offset: sub.offset,
                    length: 0,
                });
            }
            Command::Read
            | Command::Write
            | Command::Flush
            | Command::Trim
            | Command::WriteZeroes
            | Command::BlockStatus => {}
            _ => return Err(Refused::Invalid("a command the client does not send")),
        }
        let offset = if command == Command::Flush {
            0
        } else {
            sub.offset
        };
        Ok(Request {
            flags,
            command,
            cookie: 0,
            offset,
            length: if command == Command::Flush {
                0
            } else {
                len.into()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transmission::{TransmissionInfo, validate_request};

    fn limits(flags: TransmissionFlags) -> Limits {
        Limits {
            size: 1 << 20,
            flags: flags | TransmissionFlags::HAS_FLAGS,
            block_size: BlockSize {
                min: 512,
                preferred: 4096,
                max: 1 << 16,
            },
            max_io: 1 << 16,
            block_status: true,
        }
    }

    fn sub(command: Command, offset: u64, length: u32) -> Submission {
        Submission {
            command,
            offset,
            length,
            fua: true,
        }
    }

    #[test]
    fn resize_carries_the_new_size_where_offered() {
        let l = limits(TransmissionFlags::SEND_RESIZE);
        // Past the export's end: the new size is no range.
        let req = l.check(&sub(Command::Resize, 4 << 20, 0)).unwrap();
        assert_eq!(
            (req.command, req.offset, req.length),
            (Command::Resize, 4 << 20, 0)
        );
        assert_eq!(req.flags, CmdFlags::empty());
        let mut info = TransmissionInfo::new(l.size, l.flags);
        info.block_size = l.block_size;
        assert_eq!(validate_request(&req, &info), Ok(()));
        assert!(matches!(
            l.check(&sub(Command::Resize, 1000, 0)),
            Err(Refused::Unaligned { offset: 1000, .. })
        ));
        assert_eq!(
            limits(TransmissionFlags::empty()).check(&sub(Command::Resize, 4 << 20, 0)),
            Err(Refused::Unsupported("RESIZE"))
        );
        assert_eq!(
            limits(TransmissionFlags::SEND_RESIZE | TransmissionFlags::READ_ONLY).check(&sub(
                Command::Resize,
                4 << 20,
                0
            )),
            Err(Refused::ReadOnly)
        );
    }

    #[test]
    fn refusals_say_why() {
        let l = limits(TransmissionFlags::SEND_FUA);
        assert_eq!(
            l.check(&sub(Command::Read, 1, 512)),
            Err(Refused::Unaligned {
                offset: 1,
                len: 512,
                min: 512
            })
        );
        assert!(matches!(
            l.check(&sub(Command::Write, 1 << 20, 512)),
            Err(Refused::OutOfRange { .. })
        ));
        assert_eq!(
            l.check(&sub(Command::Flush, 0, 0)),
            Err(Refused::Unsupported("FLUSH"))
        );
        assert_eq!(
            l.check(&sub(Command::Read, 0, 1 << 17)),
            Err(Refused::Invalid("request longer than max_io()"))
        );
        let ro = limits(TransmissionFlags::READ_ONLY);
        assert_eq!(
            ro.check(&sub(Command::Trim, 0, 512)),
            Err(Refused::ReadOnly)
        );
        let w = l.check(&sub(Command::Write, 512, 512)).unwrap();
        assert!(w.flags.contains(CmdFlags::FUA));
        let r = l.check(&sub(Command::Read, 512, 512)).unwrap();
        assert!(!r.flags.contains(CmdFlags::FUA), "FUA only on writes");
    }

    /// `check_piece` is `check` but for the range: the same header where both accept, the
    /// same refusal for anything else.
    #[test]
    fn a_piece_is_checked_for_all_but_its_range() {
        let l = limits(TransmissionFlags::SEND_FUA);
        let past_the_end = sub(Command::Write, 1 << 20, 512);
        assert!(matches!(
            l.check(&past_the_end),
            Err(Refused::OutOfRange { .. })
        ));
        assert!(l.check_piece(&past_the_end).is_ok());
        let inside = sub(Command::Write, 512, 512);
        assert_eq!(l.check_piece(&inside), l.check(&inside));
        let ro = limits(TransmissionFlags::READ_ONLY);
        assert_eq!(ro.check_piece(&inside), Err(Refused::ReadOnly));
        assert_eq!(
            l.check_piece(&sub(Command::Read, 0, 1 << 17)),
            Err(Refused::Invalid("request longer than max_io()"))
        );
    }

    /// Whatever the client accepts, a server checking by the spec accepts too.
    #[test]
    fn accepted_requests_pass_the_servers_checks() {
        let all = TransmissionFlags::SEND_FUA
            | TransmissionFlags::SEND_FLUSH
            | TransmissionFlags::SEND_TRIM
            | TransmissionFlags::SEND_WRITE_ZEROES;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for flags in [
            all,
            TransmissionFlags::READ_ONLY,
            TransmissionFlags::empty(),
        ] {
            let l = limits(flags);
            let mut info = TransmissionInfo::new(l.size, l.flags);
            info.block_size = l.block_size;
            info.structured_replies = true;
            info.has_meta_context = true;
            for _ in 0..20_000 {
                let r = next();
                let command = [
                    Command::Read,
                    Command::Write,
                    Command::Flush,
                    Command::Trim,
                    Command::WriteZeroes,
                    Command::BlockStatus,
                ][(r % 6) as usize];
                let s = Submission {
                    command,
                    offset: (next() % (1 << 21)) & !0x1ff | (r >> 60) & 1,
                    length: (next() % ((1 << 16) + 512)) as u32 & !0x1ff,
                    fua: r & 0x100 != 0,
                };
                if let Ok(req) = l.check(&s) {
                    assert_eq!(validate_request(&req, &info), Ok(()), "{s:?} -> {req:?}");
                }
            }
        }
    }
}
