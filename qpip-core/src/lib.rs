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
//!
//! # Where the NIC lives
//!
//! This crate opens the chosen NIC ([`Nic::open`] on a [`NicChoice`]); everything else is in
//! the crates under it, and no backend imports another. What applications need of a
//! backend's own crate is here too: [`check_tls`] and [`DEFAULT_LANAI_SERVER_NODE`]. The
//! command-line options that choose a NIC and the `qpip-lanai-bridge` binary are in
//! `qpip-cli`, above this crate, so that no library depends on clap, anyhow,
//! tracing-subscriber or signal-hook:
//!
//! | crate | what |
//! |---|---|
//! | `qpip-verbs` | the verbs; `shared`: what host and NIC share (rings, QP/CQ state); `backend`: the backend trait and the management `Command`; `machines`: the NIC machines once |
//! | `qpip-soft` | the soft NIC's physical layer: kernel sockets through io_uring or epoll |
//! | `qpip-lanai` | the LANai's physical layer: the firmware (its own IPv6/UDP/TCP on smoltcp), the device's costs and clock, the Myrinet fabric, the virtual-time simulator |
//!
//! The four machines of the paper:
//!
//! | machine | written once (`qpip-verbs`) | soft | LANai |
//! |---|---|---|---|
//! | doorbell | `machines::shell` (doorbell FIFO, sleep/wake pairing; `NicThread::ring_doorbell`) | `Engine::doorbell` services the QP | `Firmware::doorbell` charges the stage, services |
//! | management | `machines::mgmt::dispatch` over the `Management` trait | `impl Management for Engine` (kernel listeners, connects) | `impl Management for Firmware` (`firmware/mgmt.rs`: smoltcp sockets, SRAM) |
//! | transmit | `machines::tx`: `SendMessage` (a send WR resolved for the wire), `OutMsg` (its progress on the link) | `tx.rs`: `writev`/`sendmsg` until the kernel takes it | `firmware/link.rs`: into the TCP send buffer, complete on ACK |
//! | receive | `machines::rx`: `RecvTarget` (receive WR resolution), `RxMachine` (framing, placement) | `link.rs`: socket reads feed `RxMachine`; datagrams fill a `RecvTarget` | `firmware/link.rs`: the TCP receive buffer feeds `RxMachine`; datagrams fill a `RecvTarget` |
//!
//! The NIC thread (`machines::shell`) runs both real-time backends: it drains commands and
//! doorbells, then the backend's `step` (the soft engine's sockets; the LANai's fabric port,
//! timers and outgoing frames) and, once idle for its learned poll window, sleeps on the
//! descriptor the backend names (`watch_fd`) until its next timer (`poll_in`): the backend
//! itself never blocks.

mod nic;

pub use nic::{Nic, NicChoice};
pub use qpip_lanai as lanai;
pub use qpip_lanai::LanaiConfig;
/// The LANai fabric node a server is when none is named (`--lanai-node`).
pub use qpip_lanai::realtime::DEFAULT_SERVER_NODE as DEFAULT_LANAI_SERVER_NODE;
pub use qpip_soft as soft;
pub use qpip_soft::{IoMode, SoftConfig};
pub use qpip_verbs::backend;
pub use qpip_verbs::framer;
pub use qpip_verbs::give_way;
pub use qpip_verbs::tls;
pub use qpip_verbs::{
    Access, Completion, CompletionQueue, CqError, CqWaker, Endpoint, Error, FileRegion, Frame,
    Framer, LengthPrefixed, Listener, MemoryRegion, MemoryTable, Opcode, ProtectionFault, QpAttr,
    QpKind, QpNum, QpShared, QpState, QueuePair, RawStream, RecvWr, ReplyReceiver, ReplySender,
    Result, Segment, SendWr, SgList, Sge, TlsConfig, TlsCredentials, WcStatus, reply_channel,
};

/// Checks that `config`'s files load and fit together (certificate and key, CA), as a
/// connection's TLS will load them: errors name the file at fault. Call it before opening
/// connections, so that bad credentials fail at start and not at the first connection.
pub fn check_tls(config: &TlsConfig) -> std::io::Result<()> {
    qpip_soft::check_tls(config)
}
