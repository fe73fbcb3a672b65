//! A client's view of one request's reply: is each simple reply or structured chunk allowed
//! for this request, and where do its bytes go?
//!
//! Sans-IO: the caller frames the server's messages ([`crate::framing::client_need`]), finds
//! the request by cookie, and hands each message to that request's [`ReplyCheck`], which
//! returns a [`Step`] saying what to do with the caller's buffer (copy these payload bytes
//! there, zero that range, take these extents) or the violation that ends the connection.
//! Everything the server supplies is checked before it is used: offsets and lengths with
//! checked arithmetic against the request ([`ReadCoverage`]), no byte covered twice, the
//! chunk type against the command, nothing after the final chunk.
//!
//! Over 600 lines: two fifths are tests.

use std::ops::Range;

use crate::consts as c;
use crate::coverage::{ChunkError, ReadCoverage};
use crate::error::ProtoError;
use crate::reply::{Chunk, SimpleReply, StructuredReplyHeader};
use crate::transmission::{Command, ErrorValue, Request};

/// Why a reply breaks the protocol (the connection must end; retrying cannot help).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplyError {
    /// A chunk outside the request, overlapping an earlier one, or too fragmented.
    #[error(transparent)]
    Chunk(#[from] ChunkError),
    /// A malformed chunk payload (bad length, unknown type, ...).
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// A chunk type that does not answer this request's command.
    #[error("a {chunk} chunk that does not answer a {command:?} request")]
    WrongCommand {
        /// The chunk type.
        chunk: &'static str,
        /// The request's command.
        command: Command,
    },
    /// A successful simple reply to a read whose data has another length.
    #[error("a read of {expected} bytes answered with {got}")]
    ReadLength {
        /// The request's length.
        expected: u64,
        /// Bytes of data in the reply.
        got: u64,
    },
    /// Another message for a request whose reply was already complete.
    #[error("a reply for a request that was already answered")]
    AfterDone,
    /// A simple reply in the middle of a structured reply.
    #[error("a simple reply after structured chunks for the same request")]
    Mixed,
    /// A block status chunk whose extents would run past 2^64.
    #[error("a block status request whose range wraps")]
    Wraps,
    /// An extended chunk header whose offset is not the request's (it "MUST match").
    #[error("an extended reply for offset {got}, the request's is {expected}")]
    WrongOffset {
        /// The request's offset.
        expected: u64,
        /// The offset in the chunk header.
        got: u64,
    },
}

/// What the caller does with one accepted message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step<'a> {
    /// Copy `payload[src]` into the request's buffer at `dst` (same length, nonempty unless
    /// the read itself is empty). `payload` is what follows the 16-byte simple reply or the
    /// 20- or 32-byte chunk header.
    Data {
        /// Bytes of the payload to copy.
        src: Range<usize>,
        /// Where they go in the request's buffer.
        dst: Range<usize>,
    },
    /// Fill `dst` of the request's buffer with zeroes (an `OFFSET_HOLE` chunk).
    Zero {
        /// Where the hole lies in the request's buffer.
        dst: Range<usize>,
    },
    /// One context's extents, absolute, contiguous (after that context's earlier ones),
    /// clipped to the request.
    Extents(Vec<CheckedExtent>),
    /// The server reports an error for this request (the first one is kept by
    /// [`ReplyCheck::finish`]); the message is raw peer bytes (see [`crate::peer_text`]).
    Error {
        /// The error (unknown values read as `EINVAL`, as the spec says).
        error: ErrorValue,
        /// The server's message.
        message: &'a [u8],
    },
    /// Nothing to do (a `NONE` chunk, a successful non-read simple reply, a block status
    /// chunk for a context not selected).
    Nothing,
}

/// One extent of a block status answer, clipped to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckedExtent {
    /// Absolute offset.
    pub offset: u64,
    /// Length (nonzero).
    pub length: u64,
    /// The context's status flags (`base:allocation`'s: [`crate::flags::AllocationFlags`]).
    pub flags: u32,
    /// The context the extent describes (its id).
    pub context_id: u32,
}

/// An accepted message: what to do, and whether it was the request's last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted<'a> {
    /// What to do with the caller's buffer.
    pub step: Step<'a>,
    /// The reply is complete: call [`ReplyCheck::finish`].
    pub done: bool,
}

/// How a request ended, per [`ReplyCheck::finish`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unanswered {
    /// The server reported an error.
    #[error("{0}")]
    Server(ErrorValue),
    /// A read whose chunks left part of the buffer unwritten.
    #[error("a read of {len} bytes answered with {covered} bytes")]
    ReadIncomplete {
        /// The request's length.
        len: u64,
        /// Bytes the chunks covered.
        covered: u64,
    },
    /// A block status reply without extents of a selected context.
    #[error("a block status reply without extents")]
    NoExtents,
}

/// The reply to one request, as far as it has arrived.
#[derive(Debug, Clone)]
pub struct ReplyCheck {
    command: Command,
    offset: u64,
    length: u64,
    coverage: ReadCoverage,
    /// Where each selected context's next extent starts, for the contexts answered so far.
    next_extents: Vec<(u32, u64)>,
    extents: bool,
    structured: bool,
    done: bool,
    error: Option<ErrorValue>,
}

impl ReplyCheck {
    /// Nothing received yet for `req`.
    pub fn new(req: &Request) -> Self {
        ReplyCheck {
            command: req.command,
            offset: req.offset,
            length: req.length,
            coverage: ReadCoverage::new(req.offset, req.length),
            next_extents: Vec::new(),
            extents: false,
            structured: false,
            done: false,
            error: None,
        }
    }

    /// A simple reply; `data_len` bytes followed its 16-byte header (the framer gives
    /// a read's length after a successful reply, 0 otherwise). The data are `payload[src]`.
    pub fn simple(
        &mut self,
        reply: &SimpleReply,
        data_len: usize,
    ) -> Result<Accepted<'static>, ReplyError> {
        if self.done {
            return Err(ReplyError::AfterDone);
        }
        if self.structured {
            return Err(ReplyError::Mixed);
        }
        let step = if let Some(error) = reply.error_value() {
            self.error.get_or_insert(error);
            Step::Error {
                error,
                message: &[],
            }
        } else if self.command == Command::Read {
            if data_len as u64 != self.length {
                return Err(ReplyError::ReadLength {
                    expected: self.length,
                    got: data_len as u64,
                });
            }
            let dst = self.coverage.place(self.offset, data_len as u64)?;
            Step::Data {
                src: 0..data_len,
                dst,
            }
        } else {
            Step::Nothing
        };
        self.done = true;
        Ok(Accepted { step, done: true })
    }

    /// An extended header must echo the request's offset.
    fn check_offset(&self, header: &StructuredReplyHeader) -> Result<(), ReplyError> {
        match header.offset {
            Some(got) if got != self.offset => Err(ReplyError::WrongOffset {
                expected: self.offset,
                got,
            }),
            _ => Ok(()),
        }
    }

    /// A structured or extended chunk with its whole payload. `selected` says which context
    /// ids the handshake selected (block status for other contexts is ignored).
    pub fn chunk<'a>(
        &mut self,
        header: &StructuredReplyHeader,
        payload: &'a [u8],
        selected: impl Fn(u32) -> bool,
    ) -> Result<Accepted<'a>, ReplyError> {
        if self.done {
            return Err(ReplyError::AfterDone);
        }
        self.check_offset(header)?;
        let wrong = |chunk| ReplyError::WrongCommand {
            chunk,
            command: self.command,
        };
        let step = match Chunk::parse(header, payload)? {
            Chunk::None => Step::Nothing,
            Chunk::OffsetData { offset, data } => {
                if self.command != Command::Read {
                    return Err(wrong("OFFSET_DATA"));
                }
                let dst = self.coverage.place(offset, data.len() as u64)?;
                // Chunk::parse: the data are the payload after the 8-byte offset.
                Step::Data {
                    src: 8..payload.len(),
                    dst,
                }
            }
            Chunk::OffsetHole { offset, length } => {
                if self.command != Command::Read {
                    return Err(wrong("OFFSET_HOLE"));
                }
                Step::Zero {
                    dst: self.coverage.place(offset, length.into())?,
                }
            }
            Chunk::BlockStatus {
                context_id,
                extents,
            } if selected(context_id) => {
                if self.command != Command::BlockStatus {
                    return Err(wrong("BLOCK_STATUS"));
                }
                let end = self
                    .offset
                    .checked_add(self.length)
                    .ok_or(ReplyError::Wraps)?;
                // Each context's extents follow on from its own earlier ones (the server
                // may send several chunks for one context).
                let at = match self
                    .next_extents
                    .iter()
                    .position(|(id, _)| *id == context_id)
                {
                    Some(i) => i,
                    None => {
                        self.next_extents.push((context_id, self.offset));
                        self.next_extents.len() - 1
                    }
                };
                let next = &mut self.next_extents[at].1;
                let mut out = Vec::new();
                for e in extents {
                    if *next >= end {
                        break;
                    }
                    let length = e.length.min(end - *next);
                    out.push(CheckedExtent {
                        offset: *next,
                        length,
                        flags: e.flags,
                        context_id,
                    });
                    *next += length;
                }
                self.extents |= !out.is_empty();
                Step::Extents(out)
            }
            Chunk::Error { error, message, .. } | Chunk::ErrorOffset { error, message, .. } => {
                let error = ErrorValue::from_wire(error).unwrap_or(ErrorValue::Inval);
                self.error.get_or_insert(error);
                Step::Error { error, message }
            }
            _ => Step::Nothing,
        };
        self.structured = true;
        self.done = header.is_done();
        Ok(Accepted {
            step,
            done: self.done,
        })
    }

    /// An OFFSET_DATA chunk whose `data_len` bytes of data the NIC already placed in the
    /// request's buffer where [`crate::framing::client_data_at`] said; `offset` is the chunk's
    /// (its first 8 payload bytes). The same rules as [`Self::chunk`]: the data must lie
    /// inside the request and overlap no earlier chunk. Step::Data's `dst` is where they are.
    pub fn placed_chunk(
        &mut self,
        header: &StructuredReplyHeader,
        offset: u64,
        data_len: usize,
    ) -> Result<Accepted<'static>, ReplyError> {
        if self.done {
            return Err(ReplyError::AfterDone);
        }
        self.check_offset(header)?;
        if header.reply_type != c::REPLY_TYPE_OFFSET_DATA
            || data_len == 0
            || u64::from(header.length) != 8 + data_len as u64
        {
            return Err(ProtoError::Invalid(
                "a placed chunk that is not OFFSET_DATA of its length",
            )
            .into());
        }
        if self.command != Command::Read {
            return Err(ReplyError::WrongCommand {
                chunk: "OFFSET_DATA",
                command: self.command,
            });
        }
        let dst = self.coverage.place(offset, data_len as u64)?;
        self.structured = true;
        self.done = header.is_done();
        Ok(Accepted {
            step: Step::Data {
                src: 8..8 + data_len,
                dst,
            },
            done: self.done,
        })
    }

    /// The reply is complete: did the request succeed? A read succeeds only if its chunks
    /// covered every byte; a block status only with at least one extent of a selected context.
    pub fn finish(&self) -> Result<(), Unanswered> {
        if let Some(e) = self.error {
            return Err(Unanswered::Server(e));
        }
        match self.command {
            Command::Read if !self.coverage.is_complete() => Err(Unanswered::ReadIncomplete {
                len: self.length,
                covered: self.coverage.covered(),
            }),
            Command::BlockStatus if !self.extents => Err(Unanswered::NoExtents),
            _ => Ok(()),
        }
    }

    /// The server's last chunk has arrived (or its simple reply).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Forgets what arrived (the request is sent again after a reconnect).
    pub fn restart(&mut self) {
        self.coverage.clear();
        self.next_extents.clear();
        self.extents = false;
        self.structured = false;
        self.done = false;
        self.error = None;
    }
}

/// The length of the data a successful simple reply to `req` carries (for
/// [`crate::framing::client_need`]'s `read_len`); simple replies only exist with compact
/// requests, whose lengths are 32-bit.
pub fn simple_data_len(req: &Request) -> Option<u32> {
    (req.command == Command::Read)
        .then(|| u32::try_from(req.length).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts as c;
    use crate::flags::{CmdFlags, ReplyFlags};

    fn req(command: Command, offset: u64, length: u32) -> Request {
        Request {
            flags: CmdFlags::empty(),
            command,
            cookie: 7,
            offset,
            length: length.into(),
        }
    }

    fn hdr(flags: ReplyFlags, reply_type: u16, payload: &[u8]) -> StructuredReplyHeader {
        StructuredReplyHeader {
            flags,
            reply_type,
            cookie: 7,
            length: payload.len() as u32,
            offset: None,
        }
    }

    fn data(offset: u64, n: usize) -> Vec<u8> {
        let mut p = offset.to_be_bytes().to_vec();
        p.resize(8 + n, 0xab);
        p
    }

    #[test]
    fn placed_chunks_follow_the_chunk_rules() {
        let mut r = ReplyCheck::new(&req(Command::Read, 4096, 300));
        let h = |flags, length| StructuredReplyHeader {
            flags,
            reply_type: c::REPLY_TYPE_OFFSET_DATA,
            cookie: 7,
            length,
            offset: None,
        };
        let a = r.placed_chunk(&h(ReplyFlags::empty(), 208), 4096 + 100, 200);
        assert_eq!(
            a.unwrap().step,
            Step::Data {
                src: 8..208,
                dst: 100..300
            }
        );
        // Overlapping what arrived, a length that is not the chunk's, no data: refused.
        assert!(
            r.placed_chunk(&h(ReplyFlags::empty(), 58), 4096 + 250, 50)
                .is_err()
        );
        assert!(
            r.placed_chunk(&h(ReplyFlags::empty(), 58), 4096, 40)
                .is_err()
        );
        assert!(r.placed_chunk(&h(ReplyFlags::empty(), 8), 4096, 0).is_err());
        let last = r
            .placed_chunk(&h(ReplyFlags::DONE, 108), 4096, 100)
            .unwrap();
        assert!(last.done);
        assert_eq!(r.finish(), Ok(()));
        let mut w = ReplyCheck::new(&req(Command::Write, 0, 10));
        assert!(matches!(
            w.placed_chunk(&h(ReplyFlags::DONE, 18), 0, 10),
            Err(ReplyError::WrongCommand { .. })
        ));
    }

    #[test]
    fn chunks_in_any_order_fill_a_read() {
        let mut r = ReplyCheck::new(&req(Command::Read, 4096, 300));
        let p = data(4096 + 100, 200);
        let a = r.chunk(
            &hdr(ReplyFlags::empty(), c::REPLY_TYPE_OFFSET_DATA, &p),
            &p,
            |_| false,
        );
        assert_eq!(
            a.unwrap().step,
            Step::Data {
                src: 8..208,
                dst: 100..300
            }
        );
        let mut hole = 4096u64.to_be_bytes().to_vec();
        hole.extend_from_slice(&100u32.to_be_bytes());
        let a = r
            .chunk(
                &hdr(ReplyFlags::DONE, c::REPLY_TYPE_OFFSET_HOLE, &hole),
                &hole,
                |_| false,
            )
            .unwrap();
        assert_eq!(
            a,
            Accepted {
                step: Step::Zero { dst: 0..100 },
                done: true
            }
        );
        assert_eq!(r.finish(), Ok(()));
        assert_eq!(
            r.chunk(&hdr(ReplyFlags::DONE, c::REPLY_TYPE_NONE, &[]), &[], |_| {
                false
            }),
            Err(ReplyError::AfterDone)
        );
    }

    #[test]
    fn hostile_chunks_are_refused() {
        let mut r = ReplyCheck::new(&req(Command::Read, 0, 1 << 20));
        // the wrapping offset of issue 18
        let p = data(u64::MAX - 7, 16);
        let h = hdr(ReplyFlags::empty(), c::REPLY_TYPE_OFFSET_DATA, &p);
        assert!(matches!(
            r.chunk(&h, &p, |_| false),
            Err(ReplyError::Chunk(ChunkError::Outside { .. }))
        ));
        let p = data(10, 10);
        let h = hdr(ReplyFlags::empty(), c::REPLY_TYPE_OFFSET_DATA, &p);
        r.chunk(&h, &p, |_| false).unwrap();
        let p = data(15, 10);
        let h = hdr(ReplyFlags::empty(), c::REPLY_TYPE_OFFSET_DATA, &p);
        assert!(matches!(
            r.chunk(&h, &p, |_| false),
            Err(ReplyError::Chunk(ChunkError::Overlap { .. }))
        ));
        assert!(matches!(
            r.simple(&SimpleReply::ok(7), 1 << 20),
            Err(ReplyError::Mixed)
        ));
        let mut w = ReplyCheck::new(&req(Command::Write, 0, 10));
        let p = data(0, 10);
        let h = hdr(ReplyFlags::DONE, c::REPLY_TYPE_OFFSET_DATA, &p);
        assert!(matches!(
            w.chunk(&h, &p, |_| false),
            Err(ReplyError::WrongCommand { .. })
        ));
        let mut s = ReplyCheck::new(&req(Command::Read, 0, 10));
        assert_eq!(
            s.simple(&SimpleReply::ok(7), 9),
            Err(ReplyError::ReadLength {
                expected: 10,
                got: 9
            })
        );
    }

    #[test]
    fn errors_and_extents() {
        let mut r = ReplyCheck::new(&req(Command::Read, 0, 10));
        let mut e = Vec::new();
        crate::reply::error_chunk(7, false, ErrorValue::Io, "bad\x1b", &mut e);
        let h = StructuredReplyHeader::parse(&e).unwrap();
        let a = r.chunk(&h, &e[20..], |_| false).unwrap();
        assert!(matches!(
            a.step,
            Step::Error {
                error: ErrorValue::Io,
                ..
            }
        ));
        assert_eq!(r.finish(), Err(Unanswered::Server(ErrorValue::Io)));

        let mut b = ReplyCheck::new(&req(Command::BlockStatus, 512, 1000));
        let mut bs = Vec::new();
        crate::reply::block_status_chunk(
            7,
            true,
            3,
            &[
                crate::reply::Extent {
                    length: 600,
                    flags: 1,
                },
                crate::reply::Extent {
                    length: 4096,
                    flags: 2,
                },
            ],
            &mut bs,
        )
        .unwrap();
        let h = StructuredReplyHeader::parse(&bs).unwrap();
        // another context: ignored, and then no extents at all
        let mut other = b.clone();
        assert_eq!(
            other.chunk(&h, &bs[20..], |id| id == 4).unwrap().step,
            Step::Nothing
        );
        assert_eq!(other.finish(), Err(Unanswered::NoExtents));
        let a = b.chunk(&h, &bs[20..], |id| id == 3).unwrap();
        assert_eq!(
            a.step,
            Step::Extents(vec![
                CheckedExtent {
                    offset: 512,
                    length: 600,
                    flags: 1,
                    context_id: 3,
                },
                CheckedExtent {
                    offset: 1112,
                    length: 400,
                    flags: 2,
                    context_id: 3,
                },
            ])
        );
        assert_eq!(b.finish(), Ok(()));
    }

    #[test]
    fn each_selected_context_has_its_own_extents_in_one_reply() {
        let mut b = ReplyCheck::new(&req(Command::BlockStatus, 0, 1000));
        let chunk = |ctx: u32, last: bool, extents: &[(u64, u32)]| {
            let ex: Vec<_> = extents
                .iter()
                .map(|&(length, flags)| crate::reply::Extent { length, flags })
                .collect();
            let mut v = Vec::new();
            crate::reply::block_status_chunk(7, last, ctx, &ex, &mut v).unwrap();
            v
        };
        let selected = |id: u32| id == 1 || id == 2;
        // base:allocation (1), then qemu:allocation-depth (2): each starts at the request's
        // offset; a context not selected (9) is ignored.
        for (ctx, last, extents, want) in [
            (1, false, vec![(600, 3)], vec![(0, 600, 3)]),
            (9, false, vec![(1000, 1)], vec![]),
            (
                2,
                false,
                vec![(200, 1), (800, 0)],
                vec![(0, 200, 1), (200, 800, 0)],
            ),
            (1, true, vec![(4096, 0)], vec![(600, 400, 0)]),
        ] {
            let v = chunk(ctx, last, &extents);
            let h = StructuredReplyHeader::parse(&v).unwrap();
            let a = b.chunk(&h, &v[20..], selected).unwrap();
            let got: Vec<_> = match a.step {
                Step::Extents(e) => e
                    .iter()
                    .map(|e| {
                        assert_eq!(e.context_id, ctx);
                        (e.offset, e.length, e.flags)
                    })
                    .collect(),
                Step::Nothing => vec![],
                other => panic!("{other:?}"),
            };
            assert_eq!(got, want, "context {ctx}");
            assert_eq!(a.done, last);
        }
        assert_eq!(b.finish(), Ok(()));
    }

    #[test]
    fn extended_chunks_must_echo_the_request_offset() {
        let mut r = ReplyCheck::new(&req(Command::Read, 4096, 100));
        let mut h = hdr(
            ReplyFlags::DONE,
            c::REPLY_TYPE_OFFSET_DATA,
            &data(4096, 100),
        );
        h.offset = Some(0);
        assert_eq!(
            r.chunk(&h, &data(4096, 100), |_| false),
            Err(ReplyError::WrongOffset {
                expected: 4096,
                got: 0
            })
        );
        assert_eq!(
            r.placed_chunk(&h, 4096, 100),
            Err(ReplyError::WrongOffset {
                expected: 4096,
                got: 0
            })
        );
        h.offset = Some(4096);
        assert!(r.chunk(&h, &data(4096, 100), |_| false).unwrap().done);
        assert_eq!(r.finish(), Ok(()));
    }
}
