//! Work requests and their completions.

use std::net::SocketAddr;

use smallvec::SmallVec;

use crate::mr::Sge;

/// Scatter/gather list; four entries fit inline, so posting does not allocate.
pub type SgList = SmallVec<[Sge; 4]>;

/// The number a NIC gives a QP; completions name it.
pub type QpNum = u32;

/// A send work request: the bytes named by `sg_list`, sent as one message.
#[derive(Clone, Debug)]
pub struct SendWr {
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// The memory it names.
    pub sg_list: SgList,
    /// Destination of the datagram; required on unreliable (UDP) QPs, ignored on reliable ones.
    pub dest: Option<SocketAddr>,
}

impl SendWr {
    /// A WR with id `wr_id` naming `sges`.
    pub fn new(wr_id: u64, sges: &[Sge]) -> Self {
        SendWr {
            wr_id,
            sg_list: SgList::from_slice(sges),
            dest: None,
        }
    }
    /// Sets the datagram destination (unreliable QPs).
    pub fn to(mut self, dest: SocketAddr) -> Self {
        self.dest = Some(dest);
        self
    }
    /// Bytes it names.
    pub fn len(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.len)).sum()
    }
    /// It names no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A receive work request: memory for the next arriving message.
#[derive(Clone, Debug)]
pub struct RecvWr {
    /// The caller's id, returned in the completion.
    pub wr_id: u64,
    /// The memory it names.
    pub sg_list: SgList,
}

impl RecvWr {
    /// A WR with id `wr_id` naming `sges`.
    pub fn new(wr_id: u64, sges: &[Sge]) -> Self {
        RecvWr {
            wr_id,
            sg_list: SgList::from_slice(sges),
        }
    }
    /// Bytes it names.
    pub fn len(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.len)).sum()
    }
    /// It names no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which queue a completion comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Opcode {
    /// A send WR's.
    #[default]
    Send,
    /// A receive WR's.
    Recv,
}

/// How a work request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WcStatus {
    /// Done.
    #[default]
    Success,
    /// The arriving message was larger than the receive WR's memory.
    LengthError,
    /// An SGE named an unknown key, memory outside its region, or a read-only region for a
    /// receive.
    ProtectionError,
    /// The peer closed or reset the connection before this WR could finish.
    RemoteClosed,
    /// The QP went to the error state (or was closed) while this WR was outstanding.
    Flushed,
    /// The peer sent bytes the QP's framer rejects.
    FramingError,
    /// The transport failed for another reason; `Completion::os_error` has the errno.
    TransportError,
    /// A send WR that cannot be carried out (a UDP send without a destination, say).
    InvalidRequest,
    /// A receive: the message arrived whole, but writing its body into the registered file
    /// its framer named failed (`Completion::os_error` has the errno: ENOSPC, EIO, ...).
    /// The QP goes on with the next message.
    PlacementError,
}

/// A completion token: one for every finished WR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The WR's id.
    pub wr_id: u64,
    /// Its QP.
    pub qp_num: QpNum,
    /// Send or receive.
    pub opcode: Opcode,
    /// How it ended.
    pub status: WcStatus,
    /// Bytes sent, or bytes placed into the receive WR's memory.
    pub byte_len: u32,
    /// Bytes of a received message that the NIC placed where its framer said
    /// ([`crate::Frame::MessageAt`]), outside the receive WR; 0 otherwise.
    pub placed: u32,
    /// Source of a datagram (unreliable QPs).
    pub src: Option<SocketAddr>,
    /// The OS error behind a `TransportError` or `RemoteClosed`, when there was one.
    pub os_error: i32,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            qp_num: 0,
            opcode: Opcode::Send,
            status: WcStatus::Success,
            byte_len: 0,
            placed: 0,
            src: None,
            os_error: 0,
        }
    }
}

impl Completion {
    /// It ended in success.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}
