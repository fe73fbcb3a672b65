//! The host side of a simulated node: the verbs (a real [`Nic`] whose backend records what
//! the host asks for), a CPU that pays the measured per-operation overheads, and the
//! application that drives it.
//!
//! Applications never poll CQs themselves: the simulation hands them each completion at the
//! moment the NIC's DMA made it visible, so nothing is seen "from the future".

use std::any::Any;
use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::meter::Nanos;
use crate::params::HostParams;
use qpip_verbs::backend::{Command, ListenerId, MgmtResult, NicBackend};
use qpip_verbs::cq::CompletionQueue;
use qpip_verbs::error::{Error, Result};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::nic::Nic;
use qpip_verbs::qp::{QpAttr, QueuePair};
use qpip_verbs::reply::{ReplyReceiver, reply_channel};
use qpip_verbs::shared::{QpKind, QpShared, QpState};
use qpip_verbs::wr::{Completion, QpNum, RecvWr, SendWr};

/// What the host did toward the NIC: a management command or a doorbell across PCI, a WR
/// written into a ring in host memory.
pub(crate) enum Outbound {
    Command(Command),
    Doorbell(QpNum),
    PostSend(Arc<QpShared>, SendWr),
    PostRecv(Arc<QpShared>, RecvWr),
}

fn check_post(qp: &QueuePair, op: &'static str) -> Result<()> {
    let state = qp.state();
    if matches!(state, QpState::Init | QpState::Connecting | QpState::Ready) {
        Ok(())
    } else {
        Err(Error::BadState {
            qp: qp.num(),
            state,
            op,
        })
    }
}

/// The backend under the simulated host's [`Nic`]: it only records, the simulation delivers.
struct SimBackend {
    queue: Arc<Mutex<Vec<Outbound>>>,
}

impl NicBackend for SimBackend {
    fn name(&self) -> &'static str {
        "lanai-sim"
    }
    fn manage(&self, cmd: Command) {
        self.queue.lock().push(Outbound::Command(cmd));
    }
    fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        // One doorbell FIFO entry per post, as each post is its own PIO write.
        qp.doorbell
            .store(true, std::sync::atomic::Ordering::Release);
        self.queue.lock().push(Outbound::Doorbell(qp.num));
    }
    fn io_path(&self) -> &'static str {
        "firmware (virtual time)"
    }
    fn engine_threads(&self) -> Vec<i32> {
        Vec::new()
    }
    fn shutdown(&self) {}
}

/// A management reply the host is waiting for; `tag` is what the application was given.
pub(crate) struct Waiting {
    pub tag: u64,
    pub rx: ReplyReceiver<MgmtResult>,
}

/// One simulated host: its verbs, its CPU clock and busy time.
pub struct Host {
    nic: Nic,
    queue: Arc<Mutex<Vec<Outbound>>>,
    /// Stamped writes across PCI, for the simulation to deliver.
    pub(crate) out: Vec<(Nanos, Outbound)>,
    pub(crate) cqs: Vec<CompletionQueue>,
    pub(crate) waiting: Vec<Waiting>,
    /// The CPU is busy until this time.
    pub(crate) clock: Nanos,
    pub(crate) busy: Nanos,
    /// The application asked for the measurement window to start (accounts reset).
    pub(crate) mark: bool,
    params: HostParams,
    addr: Ipv6Addr,
    next_tag: u64,
    next_listener: ListenerId,
}

fn us_to_ns(us: f64) -> Nanos {
    (us * 1000.0).round().max(0.0) as Nanos
}

impl Host {
    pub(crate) fn new(memory: Arc<MemoryTable>, params: HostParams, addr: Ipv6Addr) -> Self {
        let queue = Arc::new(Mutex::new(Vec::new()));
        let backend = SimBackend {
            queue: queue.clone(),
        };
        Host {
            nic: Nic::with_backend(Box::new(backend), memory),
            queue,
            out: Vec::new(),
            cqs: Vec::new(),
            waiting: Vec::new(),
            clock: 0,
            busy: 0,
            mark: false,
            params,
            addr,
            next_tag: 1,
            next_listener: 1,
        }
    }

    /// The host CPU's clock: the current time as the application sees it.
    pub fn now(&self) -> Nanos {
        self.clock
    }

    /// CPU time spent in per-operation overheads (and [`Self::compute`]).
    pub fn busy_ns(&self) -> Nanos {
        self.busy
    }

    /// This host's NIC address.
    pub fn addr(&self) -> Ipv6Addr {
        self.addr
    }

    /// The verbs, for registering memory. Do not poll CQs through it: completions arrive
    /// through [`App::on_completion`].
    pub fn nic(&self) -> &Nic {
        &self.nic
    }

    /// Starts the measurement window: every NIC's occupancy accounts and every host's busy
    /// time are reset once this callback returns.
    pub fn mark(&mut self) {
        self.mark = true;
    }

    /// Spends `ns` of CPU time.
    pub fn compute(&mut self, ns: Nanos) {
        self.clock += ns;
        self.busy += ns;
    }

    /// Copies `bytes` in host memory: spends the CPU time the copy takes.
    pub fn copy(&mut self, bytes: usize) {
        self.compute((bytes as f64 * self.params.copy_ns_per_byte).round() as Nanos);
    }

    /// Moves what the backend recorded into the stamped outbound list.
    fn stamp(&mut self) {
        let now = self.clock;
        self.out
            .extend(self.queue.lock().drain(..).map(|o| (now, o)));
    }

    fn tag(&mut self) -> u64 {
        let t = self.next_tag;
        self.next_tag += 1;
        t
    }

    pub(crate) fn create_cq(&mut self, depth: usize) -> CompletionQueue {
        let cq = self.nic.create_cq(depth);
        self.cqs.push(cq.clone());
        cq
    }

    /// A reliable (TCP) QP, idle until connected or accepted.
    pub fn create_qp(&mut self, attr: QpAttr) -> QueuePair {
        let qp = self.nic.new_qp(QpKind::Reliable, attr);
        self.stamp();
        qp
    }

    /// An unreliable (UDP) QP bound to `port`; the bind's reply comes to
    /// [`App::on_reply`] with the returned tag.
    pub fn create_udp_qp(&mut self, port: u16, attr: QpAttr) -> (QueuePair, u64) {
        let qp = self.nic.new_qp(QpKind::Unreliable, attr);
        let addr = SocketAddr::new(self.addr.into(), port);
        let tag = self.manage(|reply| Command::BindUdp {
            qp: qp.num(),
            addr,
            reply,
        });
        (qp, tag)
    }

    /// Listens on `port`; returns the listener and the tag of the reply.
    pub fn listen(&mut self, port: u16) -> (ListenerId, u64) {
        let id = self.next_listener;
        self.next_listener += 1;
        let addr = SocketAddr::new(self.addr.into(), port);
        let tag = self.manage(|reply| Command::Listen {
            id,
            addr,
            backlog: 16,
            reply,
        });
        (id, tag)
    }

    /// Mates the next connection on `listener` to `qp`; the reply (the peer) comes with the
    /// returned tag.
    pub fn accept(&mut self, listener: ListenerId, qp: &QueuePair) -> u64 {
        let qp = qp.num();
        self.manage(|reply| Command::Accept {
            listener,
            qp,
            reply,
        })
    }

    /// Connects `qp` to `addr`; the reply comes with the returned tag.
    pub fn connect(&mut self, qp: &QueuePair, addr: SocketAddr) -> u64 {
        let qp = qp.num();
        self.manage(|reply| Command::Connect { qp, addr, reply })
    }

    fn manage(
        &mut self,
        cmd: impl FnOnce(qpip_verbs::reply::ReplySender<MgmtResult>) -> Command,
    ) -> u64 {
        let (tx, rx) = reply_channel();
        let tag = self.tag();
        self.waiting.push(Waiting { tag, rx });
        self.stamp();
        self.out.push((self.clock, Outbound::Command(cmd(tx))));
        tag
    }

    /// Orderly close of `qp`.
    pub fn close(&mut self, qp: &QueuePair) {
        qp.close();
        self.stamp();
    }

    /// Posts a send WR, paying the host's per-send overhead first. The WR reaches the ring
    /// at the host's clock (not earlier, though the callback runs now) and its doorbell
    /// `pio_write_ns` later.
    pub fn post_send(&mut self, qp: &QueuePair, wr: SendWr) -> Result<()> {
        check_post(qp, "post a send")?;
        if qp.kind() == QpKind::Unreliable && wr.dest.is_none() {
            return Err(Error::InvalidWr(
                "a send on an unreliable QP needs a destination",
            ));
        }
        self.compute(us_to_ns(self.params.send_overhead_us));
        self.stamp();
        self.out
            .push((self.clock, Outbound::PostSend(qp.shared().clone(), wr)));
        Ok(())
    }

    /// Posts a receive WR (its cost is part of the per-receive overhead, paid when the
    /// completion is handled).
    pub fn post_recv(&mut self, qp: &QueuePair, wr: RecvWr) -> Result<()> {
        check_post(qp, "post a receive")?;
        self.stamp();
        self.out
            .push((self.clock, Outbound::PostRecv(qp.shared().clone(), wr)));
        Ok(())
    }

    /// Pays for handling one receive completion.
    pub(crate) fn charge_recv(&mut self) {
        self.compute(us_to_ns(self.params.recv_overhead_us));
    }
}

/// An application on a simulated host. Callbacks run on the host's CPU clock
/// ([`Host::now`]); everything they post is stamped with it.
pub trait App: Any {
    /// Called once when the simulation starts.
    fn start(&mut self, host: &mut Host);
    /// A completion became visible to the host (a receive's overhead is already paid).
    fn on_completion(&mut self, host: &mut Host, c: Completion);
    /// A management command finished.
    fn on_reply(&mut self, host: &mut Host, tag: u64, result: MgmtResult);
    /// The application has finished its work (the simulation stops when all have).
    fn done(&self) -> bool;
    /// Something went wrong that the simulation should report.
    fn error(&self) -> Option<String> {
        None
    }
    /// The application as `Any`, for `Sim::app` to hand back its concrete type.
    fn as_any(&self) -> &dyn Any;
}
