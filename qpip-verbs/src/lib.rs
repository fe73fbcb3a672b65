//! The QPIP verbs and everything under them that is not one backend's: what host and NIC
//! share ([`shared`]), the NIC backend contract ([`backend`]) and the NIC state machines every
//! backend runs ([`machines`]). The backends (`qpip-soft`, `qpip-lanai`) build on this crate
//! and on nothing of each other; `qpip-core` opens them and is what applications use.
//!
//! The small functions a backend calls on every WR (ring pushes, completions, the doorbell)
//! are `#[inline]`: the backends are other crates, and without it they could not be
//! inlined there as they were when everything was one crate.

pub mod backend;
pub mod cq;
pub mod drive;
pub mod error;
pub mod framer;
mod futex;
pub mod give_way;
pub mod keymap;
pub mod machines;
pub mod mr;
pub mod nic;
pub mod poll_window;
pub mod qp;
pub mod reply;
pub mod shared;
pub mod tls;
pub mod wr;

pub use cq::{CompletionQueue, CqError, CqWaker};
pub use error::{Error, Result};
pub use framer::{Frame, Framer, LengthPrefixed, RawStream};
pub use mr::{
    Access, FileRegion, FileSpan, MemoryRegion, MemoryTable, Placement, ProtectionFault, Segment,
    Sge,
};
pub use nic::{Endpoint, Listener, Nic};
pub use qp::{QpAttr, QueuePair};
pub use reply::{ReplyReceiver, ReplySender, reply_channel};
pub use shared::{QpKind, QpShared, QpState};
pub use tls::{TlsConfig, TlsCredentials};
pub use wr::{Completion, Opcode, QpNum, RecvWr, SendWr, SgList, WcStatus};
