//! The QPIP firmware: the doorbell, management, transmit and receive state machines of the
//! LANai NIC, with its own IPv6, UDP and TCP (smoltcp as the base), over the device model.
//!
//! Sans-IO: no sockets, no threads, no clock. Time is an argument (`Nanos`), frames go out
//! through [`Firmware::transmit`] and come in through [`Firmware::receive`]. Every stage is
//! charged to the [`Meter`], so the same code runs under the virtual-time simulation
//! (`sim`) and as the real-time backend (`realtime`).

use std::net::Ipv6Addr;
use std::sync::Arc;

use crate::backend::Command;
use crate::mr::MemoryTable;
use crate::wr::QpNum;

use super::meter::{Meter, Nanos};
use super::params::{FabricParams, LanaiParams};

/// What a NIC needs to know about itself.
#[derive(Clone, Debug)]
pub struct FirmwareConfig {
    /// The NIC's IPv6 address.
    pub addr: Ipv6Addr,
    pub params: LanaiParams,
    /// MTU and the route table.
    pub fabric: FabricParams,
    /// Seeds the TCP initial sequence numbers (deterministic runs).
    pub seed: u64,
}

/// A frame ready for the network send DMA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutFrame {
    /// The whole Myrinet frame (route included).
    pub bytes: Vec<u8>,
    /// When the frame is in SRAM and the processor has handed it to the send DMA engine.
    pub ready_at: Nanos,
}

/// The firmware of one NIC.
pub struct Firmware {
    meter: Meter,
    #[allow(dead_code)]
    memory: Arc<MemoryTable>,
}

impl Firmware {
    pub fn new(cfg: FirmwareConfig, memory: Arc<MemoryTable>) -> Firmware {
        let _ = cfg;
        let _ = memory;
        todo!("firmware")
    }

    /// Management state machine: a privileged command from the host.
    pub fn command(&mut self, now: Nanos, cmd: Command) {
        let _ = (now, cmd);
        todo!()
    }

    /// Doorbell state machine: the doorbell FIFO held `qp` (new WRs in its rings).
    pub fn doorbell(&mut self, now: Nanos, qp: QpNum) {
        let _ = (now, qp);
        todo!()
    }

    /// Receive state machine: a frame finished arriving from the network at `now`.
    pub fn receive(&mut self, now: Nanos, frame: &[u8]) {
        let _ = (now, frame);
        todo!()
    }

    /// Transmit scheduler and timers: run whatever is due at `now`.
    pub fn poll(&mut self, now: Nanos) {
        let _ = now;
        todo!()
    }

    /// When `poll` next has something to do (a retransmission or delayed-ACK timer, a
    /// QP with sendable work), if ever.
    pub fn poll_at(&self) -> Option<Nanos> {
        todo!()
    }

    /// The next frame to put on the wire, in the order they were built.
    pub fn transmit(&mut self) -> Option<OutFrame> {
        todo!()
    }

    pub fn meter(&self) -> &Meter {
        &self.meter
    }

    pub fn meter_mut(&mut self) -> &mut Meter {
        &mut self.meter
    }
}
