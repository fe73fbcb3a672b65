//! One request's reply, assembled into the caller's buffer: the message (a simple reply or
//! one structured chunk) is parsed, checked by [`ReplyCheck`], and its bytes copied where the
//! check says — or, for READ data the transport already placed into the caller's registered
//! memory, only checked to be where they belong.

use crate::consts as c;
use crate::error::ProtoError;
use crate::peer_text::printable;
use crate::transmission::client::reply_check::{ReplyCheck, ReplyError, Step, Unanswered};
use crate::transmission::{Command, ErrorValue, Request};

/// Memory of the caller's that a READ's data go to (registered memory the transport may
/// also place them into directly).
pub trait ReadTarget {
    /// Copies `bytes` to offset `at` of the read's buffer (inside the read's length).
    fn write_at(&self, at: usize, bytes: &[u8]);
}

/// One extent of block status, of one metadata context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Absolute offset.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// Not allocated (NBD_STATE_HOLE): `flags` read as `base:allocation`'s.
    pub hole: bool,
    /// Reads as zeroes (NBD_STATE_ZERO): `flags` read as `base:allocation`'s.
    pub zero: bool,
    /// The context's status flags as sent (`qemu:allocation-depth`: the depth).
    pub flags: u32,
    /// The context the extent describes (its id on the connection that answered).
    pub context_id: u32,
}

/// The result of a successful request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// Done (a READ into the caller's memory too).
    Done,
    /// A READ's data.
    Data(Vec<u8>),
    /// A block status answer.
    Extents(Vec<Extent>),
}

/// Why a request that the server answered did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Failed {
    /// The server reported an error (its first one, with its message).
    #[error("server error {error}{}", if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Server {
        /// The error value.
        error: ErrorValue,
        /// The server's message, made printable.
        message: String,
    },
    /// The server said it was done without answering the request whole.
    #[error(transparent)]
    Incomplete(Unanswered),
}

/// A server message that breaks the protocol (the connection must end).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A header or chunk that does not parse.
    #[error(transparent)]
    Malformed(#[from] ProtoError),
    /// A reply whose cookie no request in flight has.
    #[error("a reply for unknown cookie {0}")]
    UnknownCookie(u64),
    /// A reply the request's [`ReplyCheck`] refuses.
    #[error(transparent)]
    Reply(#[from] ReplyError),
    /// A chunk whose header and payload disagree on its length.
    #[error("a chunk that says it has {said} bytes of payload has {has}")]
    PayloadLength {
        /// The header's length.
        said: u32,
        /// Bytes that followed the header.
        has: usize,
    },
    /// No reply magic the session negotiated.
    #[error("a reply with unknown magic {0:#010x}")]
    UnknownMagic(u32),
    /// Fewer bytes than a magic.
    #[error("a reply of {0} bytes, too short for a header")]
    TooShort(usize),
    /// A placed chunk whose header lacks the data's offset.
    #[error("a placed chunk without its offset")]
    PlacedWithoutOffset,
    /// Placed READ data that are not where the reply check puts them.
    #[error("READ data placed where the reply check does not put them")]
    PlacedElsewhere,
}

/// How far the framer is with a request's replies on the current connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Not sent on this connection: nothing of the server's is framed or placed for it.
    Unsent,
    /// Sent: its replies are framed by its numbers, a READ's data placed in its memory.
    Open,
    /// The framer has seen its last reply message: nothing more goes into its memory,
    /// whatever the server sends.
    Closed,
}

/// A request in flight and its reply so far.
#[derive(Debug)]
pub(crate) struct Entry<R> {
    pub tag: u64,
    pub req: Request,
    pub slot: usize,
    /// READ data, unless they go to `region`.
    data: Vec<u8>,
    /// READ data go here instead of `data`; a WRITE's data are sent from here.
    pub region: Option<R>,
    pub check: ReplyCheck,
    extents: Vec<Extent>,
    /// The server's first error, with its message.
    error: Option<Failed>,
    /// Where the framer is with its replies.
    pub framing: Framing,
}

impl<R: ReadTarget> Entry<R> {
    pub(crate) fn new(tag: u64, req: Request, slot: usize, region: Option<R>) -> Self {
        let data = if req.command == Command::Read && region.is_none() {
            vec![0; req.length as usize]
        } else {
            Vec::new()
        };
        Entry {
            tag,
            req,
            slot,
            data,
            region,
            check: ReplyCheck::new(&req),
            extents: Vec::new(),
            error: None,
            framing: Framing::Unsent,
        }
    }

    /// A READ whose data the transport places into the caller's memory.
    pub(crate) fn places_data(&self) -> bool {
        self.req.command == Command::Read && self.region.is_some()
    }

    /// Carries out what the reply check accepted; `payload` is the message after its header.
    pub(crate) fn apply(&mut self, step: Step, payload: &[u8]) {
        match step {
            Step::Data { src, dst } => match &self.region {
                Some(r) => r.write_at(dst.start, &payload[src]),
                None => self.data[dst].copy_from_slice(&payload[src]),
            },
            Step::Zero { dst } => match &self.region {
                Some(r) => r.write_at(dst.start, &vec![0; dst.len()]),
                None => self.data[dst].fill(0),
            },
            Step::Extents(extents) => self.extents.extend(extents.iter().map(|e| Extent {
                offset: e.offset,
                length: e.length,
                hole: e.flags & c::STATE_HOLE != 0,
                zero: e.flags & c::STATE_ZERO != 0,
                flags: e.flags,
                context_id: e.context_id,
            })),
            Step::Error { error, message } => {
                self.error.get_or_insert(Failed::Server {
                    error,
                    message: printable(message),
                });
            }
            _ => {}
        }
    }

    /// Forgets the reply so far: the request goes again on a new connection.
    pub(crate) fn reset(&mut self) {
        if self.req.command == Command::Read {
            self.data.iter_mut().for_each(|b| *b = 0);
        }
        self.check.restart();
        self.extents.clear();
        self.error = None;
        self.framing = Framing::Unsent;
    }

    /// The server refused the request with ESHUTDOWN: it was not carried out.
    pub(crate) fn refused_for_shutdown(&self) -> bool {
        self.check.finish() == Err(Unanswered::Server(ErrorValue::Shutdown))
    }

    /// The request's outcome, once its reply is complete.
    pub(crate) fn outcome(self) -> Result<Output, Failed> {
        match self.check.finish() {
            Err(Unanswered::Server(error)) => Err(self.error.unwrap_or(Failed::Server {
                error,
                message: String::new(),
            })),
            Err(why) => Err(Failed::Incomplete(why)),
            Ok(()) => Ok(match self.req.command {
                Command::Read if self.region.is_some() => Output::Done,
                Command::Read => Output::Data(self.data),
                Command::BlockStatus => Output::Extents(self.extents),
                _ => Output::Done,
            }),
        }
    }
}

/// How the session reads the server's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mode {
    /// Structured replies negotiated.
    pub structured: bool,
    /// Extended headers negotiated.
    pub extended: bool,
    /// The context id of `base:allocation`, if negotiated.
    pub allocation_ctx: Option<u32>,
    /// Every metadata context selected, `(id, name)`: block status answers them all.
    pub contexts: Vec<(u32, String)>,
}

impl Mode {
    /// The id of the context `name` on this connection, if it was selected.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts
            .iter()
            .find(|(_, n)| n == name)
            .map(|(id, _)| *id)
    }

    /// Whether `id` is a selected context's.
    pub fn selected(&self, id: u32) -> bool {
        self.contexts.iter().any(|(i, _)| *i == id)
    }
}
