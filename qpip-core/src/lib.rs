//! Queue Pair IP: the queue-pair interface of InfiniBand-class networks (QPs, completion
//! queues, registered memory) over plain TCP, UDP, IPv4 and IPv6.
//!
//! ```no_run
//! use qpip_core::{Access, Nic, QpAttr, RecvWr, SendWr, Completion};
//!
//! let nic = Nic::soft()?;
//! let cq = nic.create_cq(64);
//! let listener = nic.listen("[::1]:0".parse().unwrap())?;
//! let server = nic.create_qp(QpAttr::new(&cq));
//! let client = nic.create_qp(QpAttr::new(&cq));
//! let mr = nic.alloc_region(4096, Access::READ_WRITE);
//! server.post_recv(RecvWr::new(1, &[mr.sge(0, 2048)]))?;
//! client.connect(listener.local_addr())?;
//! listener.accept(&server)?;
//! mr.write_at(2048, b"hello");
//! client.post_send(SendWr::new(2, &[mr.sge(2048, 5)]))?;
//! let mut done = [Completion::default(); 2];
//! let mut seen = 0;
//! while seen < 2 {
//!     seen += cq.wait(&mut done[seen..], None)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod backend;
pub mod cli;
mod cq;
mod error;
pub mod framer;
pub mod lanai;
mod machines;
mod mr;
mod nic;
mod qp;
mod reply;
mod shared;
pub mod soft;
mod wr;

pub use cq::{CompletionQueue, CqError};
pub use error::{Error, Result};
pub use framer::{Frame, Framer, LengthPrefixed, RawStream};
pub use mr::{Access, MemoryRegion, MemoryTable, ProtectionFault, Segment, Sge};
pub use nic::{Backend, Listener, Nic};
pub use qp::{QpAttr, QueuePair};
pub use reply::{ReplyReceiver, ReplySender, reply_channel};
pub use shared::{QpKind, QpShared, QpState};
pub use soft::{IoMode, SoftConfig};
pub use wr::{Completion, Opcode, QpNum, RecvWr, SendWr, SgList, WcStatus};
