//! The QPIP NIC's state machines, written once for every backend. A backend supplies only
//! its physical layer: the soft NIC kernel sockets, the LANai its firmware's smoltcp device,
//! costs and clock.
//!
//! - [`shell`]: the NIC thread: command queue, doorbell FIFO (the doorbell machine), the
//!   sleep/wake pairing, stop and join (run to completion's side of it is [`crate::drive`]);
//! - [`mgmt`]: the management machine's one dispatcher of [`crate::backend::Command`];
//! - [`tx`]: the transmit machine's outgoing message (a send WR resolved for the wire);
//! - [`rx`]: the receive machine: message boundaries by framer, placement into receive WRs.

pub mod mgmt;
pub mod rx;
pub mod shell;
pub mod tx;

pub use crate::drive::rules::GRACE as DRIVE_GRACE;

/// The completion status for a failed socket (or socket-like) operation.
pub fn status_of(e: &std::io::Error) -> crate::wr::WcStatus {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => {
            crate::wr::WcStatus::RemoteClosed
        }
        _ => crate::wr::WcStatus::TransportError,
    }
}
