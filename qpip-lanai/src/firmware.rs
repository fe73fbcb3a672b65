//! The QPIP firmware: the doorbell, management, transmit and receive state machines of the
//! LANai NIC, with its own IPv6, UDP and TCP (smoltcp as the base), over the device model.
//!
//! Sans-IO: no sockets, no threads, no clock. Time is an argument (`Nanos`), frames go out
//! through [`Firmware::transmit`] and come in through [`Firmware::receive`]. Every stage is
//! charged to the [`Meter`], so the same code runs under the virtual-time simulation
//! (`sim`) and as the real-time backend (`realtime`).
//!
//! Choices worth knowing:
//! - TCP is smoltcp's: RFC 1323 timestamps (from the NIC clock), window scaling (64 KiB
//!   buffers give a shift of 1), Reno, Nagle on (sender-side silly window avoidance). ACKs
//!   are not delayed: like the paper's
//!   firmware, every data segment received is acknowledged at once (the ACK rides on data
//!   when the QP has some to send in the same poll).
//! - smoltcp may carry several small QP messages in one segment, or split a message over
//!   several; the paper's firmware sent one message per segment. The wire bytes are the same
//!   stream either way; only the per-packet costs shift.
//! - Host data is fetched by DMA per transmitted segment (retransmissions fetch again, as the
//!   WR's memory stays the NIC's until the peer ACKs it) into one of a few SRAM staging
//!   buffers, which frees when the frame's tail has left; the headers wait for the DMA's
//!   checksum. The PCI bus is one, shared by both DMA engines and the host's PIO (`pci`).
//! - Receive: per-packet stages (media receive, parse, update) when the packet arrives; get
//!   WR per receive WR taken and put data per DMA to host memory. Bytes stay in the socket's
//!   buffer (closing the window) until their DMA to host memory has finished.
//! - smoltcp keeps a few out-of-order segments (the paper's TCP subset dropped them).
//! - A listener keeps two sockets in LISTEN (each costs a TCB and both buffers of SRAM) and
//!   makes more as they are used, up to the backlog and the SRAM.
//! - Timers: a connect fails with `TimedOut` after 20 s; a peer silent for 120 s fails the
//!   QP (idle connections send keep-alives every 30 s, so a crashed peer is found); a
//!   connection the host dropped gets 60 s to finish closing.
//! - Handlers start at `max(now, processor free)` and smoltcp sees the processor's clock, so
//!   in real time a saturated NIC's clock runs ahead of the wall clock (the model's speed
//!   limit shows up as delay).

mod cq;
mod link;
mod mgmt;
mod port;
mod staging;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::Arc;

use smoltcp::iface::{Config, Interface, PollResult, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpEndpoint, IpListenEndpoint};

use self::cq::CqWrites;
use self::link::{Ctx, FwQp, Link, TcpLink, UdpLink, tcp_sram, v6};
use self::port::{Carried, Port, Wire, classify, instant, nanos, set_tsval_clock};
use self::staging::{RecvStaging, SendStaging};
use super::frame;
use super::meter::{CostModel, Dir, Kind, Meter, Nanos, Stage};
use super::params::{FabricParams, LanaiParams};
use super::pci::{PciBus, Use};
use super::sram::Sram;
use qpip_verbs::backend::{Command, ListenerId, MgmtResult};
use qpip_verbs::machines::mgmt::dispatch;
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::{QpKind, QpState};
use qpip_verbs::wr::{QpNum, WcStatus};

/// What a NIC needs to know about itself.
#[derive(Clone, Debug)]
pub(crate) struct FirmwareConfig {
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
pub(crate) struct OutFrame {
    /// The whole Myrinet frame (route included).
    pub bytes: Vec<u8>,
    /// When the frame is in SRAM and the processor has handed it to the send DMA engine.
    pub ready_at: Nanos,
}

/// Listening sockets kept ready per listener: each holds a TCB and both buffers in SRAM, so
/// only a couple wait for SYNs; more are made as they are used, up to the backlog.
const LISTEN_SPARES: usize = 2;
/// How long a connect may take before it fails with `TimedOut`.
const CONNECT_TIMEOUT_NS: Nanos = 20_000_000_000;
/// How long a connection the host let go of may take to finish closing.
const ORPHAN_TIMEOUT_NS: Nanos = 60_000_000_000;
/// Rounds of service + poll per event before the firmware yields.
const MAX_ROUNDS: usize = 32;
/// First ephemeral port.
const EPHEMERAL: u16 = 49152;

struct Listener {
    port: u16,
    backlog: usize,
    /// Sockets in LISTEN.
    listening: Vec<SocketHandle>,
    /// Sockets past LISTEN and not yet mated to a QP.
    pending: VecDeque<SocketHandle>,
    /// QPs waiting for a connection.
    accepts: VecDeque<(QpNum, ReplySender<MgmtResult>)>,
}

struct Orphan {
    handle: SocketHandle,
    deadline: Nanos,
}

/// Time each hardware resource was busy (the bench's bound and utilisation report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub pci_read_ns: Nanos,
    pub pci_write_ns: Nanos,
    pub pci_pio_ns: Nanos,
    pub processor_ns: Nanos,
    /// Buffer-nanoseconds of send staging held.
    pub staging_ns: Nanos,
    pub staging_buffers: usize,
    /// Buffer-nanoseconds of receive staging held.
    pub rx_staging_ns: Nanos,
    pub rx_staging_buffers: usize,
}

/// Counters of things the firmware dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FirmwareStats {
    /// Packets to addresses without a route.
    pub no_route: u64,
    /// Frames that failed to decode (CRC, type, leftover route) or were not for this NIC.
    pub bad_frames: u64,
}

/// The firmware of one NIC.
pub(crate) struct Firmware {
    addr: Ipv6Addr,
    params: LanaiParams,
    fabric: FabricParams,
    meter: Meter,
    memory: Arc<MemoryTable>,
    sram: Sram,
    iface: Interface,
    sockets: SocketSet<'static>,
    out: VecDeque<OutFrame>,
    bus: PciBus,
    staging: SendStaging,
    rx_staging: RecvStaging,
    cq: CqWrites,
    qps: BTreeMap<QpNum, FwQp>,
    listeners: BTreeMap<ListenerId, Listener>,
    orphans: Vec<Orphan>,
    dying: Vec<SocketHandle>,
    next_port: u16,
    stats: FirmwareStats,
    next_poll: Option<Nanos>,
}

fn unsupported_v4() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "the lanai firmware speaks IPv6 only",
    )
}

impl Firmware {
    pub(crate) fn new(cfg: FirmwareConfig, memory: Arc<MemoryTable>) -> Firmware {
        let meter = Meter::new(CostModel::new(&cfg.params));
        let mut out = VecDeque::new();
        let mut bus = PciBus::new(&cfg.params.device);
        let mut staging = SendStaging::new(cfg.params.device.send_staging_buffers);
        let rx_staging = RecvStaging::new(cfg.params.device.recv_staging_buffers);
        let mut meter_tmp = meter.clone();
        let mut no_route = 0;
        let mut port = Port {
            rx: None,
            wire: Wire {
                meter: &mut meter_tmp,
                out: &mut out,
                fabric: &cfg.fabric,
                bus: &mut bus,
                staging: &mut staging,
                no_route: &mut no_route,
            },
        };
        let mut config = Config::new(HardwareAddress::Ip);
        config.random_seed = cfg.seed;
        let mut iface = Interface::new(config, &mut port, instant(0));
        iface.update_ip_addrs(|addrs| {
            // Invariant: a fresh interface has room for its one address.
            let _ = addrs.push(IpCidr::new(IpAddress::Ipv6(cfg.addr), 64));
        });
        // Every destination is reached through the fabric; the port routes by address.
        let _ = iface.routes_mut().add_default_ipv6_route(cfg.addr);
        let sram = Sram::new(
            cfg.params.device.sram_bytes,
            cfg.params.device.firmware_bytes,
        );
        Firmware {
            addr: cfg.addr,
            params: cfg.params,
            fabric: cfg.fabric,
            meter,
            memory,
            sram,
            iface,
            sockets: SocketSet::new(Vec::new()),
            out,
            bus,
            staging,
            rx_staging,
            cq: CqWrites::default(),
            qps: BTreeMap::new(),
            listeners: BTreeMap::new(),
            orphans: Vec::new(),
            dying: Vec::new(),
            next_port: EPHEMERAL + (cfg.seed % 8192) as u16,
            stats: FirmwareStats::default(),
            next_poll: None,
        }
    }

    /// Management state machine: a privileged command from the host.
    pub(crate) fn command(&mut self, now: Nanos, cmd: Command) {
        self.begin(now);
        dispatch(self, cmd);
        self.run();
    }

    /// Doorbell state machine: the doorbell FIFO held `qp` (new WRs in its rings).
    pub(crate) fn doorbell(&mut self, now: Nanos, qp: QpNum) {
        self.begin(now);
        if let Some(q) = self.qps.get_mut(&qp) {
            q.shared
                .doorbell
                .store(false, std::sync::atomic::Ordering::SeqCst);
            if !q.shared.sq.is_empty() {
                self.meter.charge(Dir::Send, Kind::Data, Stage::Doorbell, 0);
            }
            if q.shared.rq.len() > q.rq_seen {
                self.meter.charge(Dir::Recv, Kind::Data, Stage::Doorbell, 0);
            }
        }
        self.run();
    }

    /// Receive state machine: a frame finished arriving from the network at `now`, into a
    /// receive staging buffer (the caller took it off the wire only when
    /// [`Firmware::rx_free_at`] allowed). The buffer frees once the frame is handled and the
    /// DMA writes issued for it have finished.
    pub(crate) fn receive(&mut self, now: Nanos, frame: &[u8]) {
        self.begin(now);
        let writes = self.bus.writes_done_at();
        self.handle_frame(frame);
        let mut release = self.meter.now();
        if self.bus.writes_done_at() > writes {
            release = release.max(self.bus.writes_done_at());
        }
        let taken = now.saturating_sub(self.fabric.wire_ns(frame.len()));
        self.rx_staging.hold(taken, release);
    }

    /// When the network receive DMA can next take a frame off the wire, from `now` on.
    pub(crate) fn rx_free_at(&mut self, now: Nanos) -> Nanos {
        self.rx_staging.free_at(now)
    }

    fn handle_frame(&mut self, frame: &[u8]) {
        let pkt = match frame::decode(frame) {
            Ok(p) => p,
            Err(e) => {
                self.stats.bad_frames += 1;
                tracing::debug!("lanai: frame dropped: {e}");
                return;
            }
        };
        let Some((dst, carried)) = classify(pkt) else {
            self.stats.bad_frames += 1;
            return;
        };
        let kind = carried.kind();
        let m = &mut self.meter;
        m.count_packet(Dir::Recv, kind);
        m.charge(Dir::Recv, kind, Stage::MediaReceive, 0);
        m.charge(Dir::Recv, kind, Stage::IpParse, 0);
        if dst != self.addr {
            self.stats.bad_frames += 1;
            return;
        }
        match carried {
            Carried::Tcp { .. } => m.charge(Dir::Recv, kind, Stage::TcpParse, 0),
            Carried::Udp { .. } => m.charge(Dir::Recv, kind, Stage::UdpParse, 0),
            Carried::Other => {}
        }
        m.charge(Dir::Recv, kind, Stage::Checksum, carried.payload());
        // Get WR and put data are charged where a WR is taken and a DMA set up (link.rs).
        m.charge(Dir::Recv, kind, Stage::Update, 0);
        self.poll_iface(Some(pkt));
        self.run();
    }

    /// Transmit scheduler and timers: run whatever is due at `now`.
    pub(crate) fn poll(&mut self, now: Nanos) {
        self.begin(now);
        self.timers();
        self.run();
    }

    /// When `poll` next has something to do (a retransmission or delayed-ACK timer, a
    /// QP with sendable work), if ever.
    pub(crate) fn poll_at(&self) -> Option<Nanos> {
        self.next_poll
    }

    /// The next frame to put on the wire, in the order they were built.
    pub(crate) fn transmit(&mut self) -> Option<OutFrame> {
        self.out.pop_front()
    }

    /// When everything written to host memory so far (received data, CQ entries) is visible
    /// to the host: the last DMA write has crossed the bus (later reads do not delay it).
    pub(crate) fn host_visible_at(&self) -> Nanos {
        self.bus.writes_done_at()
    }

    /// When the next completion of `qp` (receive side if `recv`) the last handler made is
    /// visible to the host: its own CQ entry's DMA write has reached host memory.
    pub(crate) fn completion_visible_at(&mut self, qp: QpNum, recv: bool) -> Option<Nanos> {
        self.cq.visible_at(qp, recv)
    }

    /// A host PIO write (doorbell, command) issued at `at` crosses the shared bus: returns
    /// when it lands in the NIC.
    pub(crate) fn pio(&mut self, at: Nanos) -> Nanos {
        self.bus.pio(at)
    }

    /// A network DMA engine moved `bytes` of a frame through SRAM over `[start, end)` (the
    /// link's timing, which the fabric decides): its memory cycles slow the processor.
    pub(crate) fn net_dma(&mut self, start: Nanos, end: Nanos, bytes: usize) {
        self.meter.sram_dma(start, end, bytes);
    }

    /// The oldest frame handed to the link has left: its tail at `tail` (later than its
    /// wire time when Myrinet stop/go held it). Its send staging buffer frees then.
    pub(crate) fn link_done(&mut self, tail: Nanos) {
        self.staging.left(tail);
        self.update_poll_at();
    }

    /// How busy the hardware has been since the accounts were last reset.
    pub(crate) fn usage(&self) -> Usage {
        Usage {
            pci_read_ns: self.bus.busy_ns(Use::Read),
            pci_write_ns: self.bus.busy_ns(Use::Write),
            pci_pio_ns: self.bus.busy_ns(Use::Pio),
            processor_ns: self.meter.busy_ns(),
            staging_ns: self.staging.held_ns(),
            staging_buffers: self.staging.buffers(),
            rx_staging_ns: self.rx_staging.held_ns(),
            rx_staging_buffers: self.rx_staging.buffers(),
        }
    }

    /// Starts a measurement window: processor, bus and staging accounts from zero.
    pub(crate) fn reset_accounts(&mut self) {
        self.meter.reset_accounts();
        self.bus.reset_accounts();
        self.staging.reset_accounts();
        self.rx_staging.reset_accounts();
    }

    pub(crate) fn meter(&self) -> &Meter {
        &self.meter
    }

    pub(crate) fn meter_mut(&mut self) -> &mut Meter {
        &mut self.meter
    }

    /// SRAM in use by QPs, connections and listeners (the firmware image not counted).
    #[cfg(test)]
    pub(crate) fn sram_used(&self) -> u64 {
        self.sram.used()
    }

    /// What the firmware has dropped so far.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> FirmwareStats {
        self.stats
    }

    // ---- internals ----

    /// A handler for an event at `now`: the processor takes it when free; nothing will ask
    /// the bus for a time before `now` again.
    fn begin(&mut self, now: Nanos) {
        self.meter.begin(now);
        self.bus.retire(now);
        self.cq.begin();
    }

    fn local(&self, port: u16) -> SocketAddr {
        SocketAddr::V6(SocketAddrV6::new(self.addr, port, 0, 0))
    }

    fn conn_sram(&self) -> u64 {
        tcp_sram(&self.params.device)
    }

    /// Runs `f` on a QP with the machines' context.
    fn with_qp(&mut self, qp: QpNum, f: impl FnOnce(&mut FwQp, &mut Ctx<'_>)) {
        let (qps, mut cx) = self.split();
        if let Some(q) = qps.get_mut(&qp) {
            f(q, &mut cx);
        }
    }

    /// The QP table beside the machines' context (they borrow different parts of `self`).
    fn split(&mut self) -> (&mut BTreeMap<QpNum, FwQp>, Ctx<'_>) {
        let Firmware {
            sockets,
            memory,
            meter,
            bus,
            params,
            sram,
            dying,
            qps,
            fabric,
            cq,
            ..
        } = self;
        let cx = Ctx {
            sockets,
            memory,
            meter,
            bus,
            dev: &params.device,
            mtu: fabric.mtu,
            sram,
            dying,
            cq,
        };
        (qps, cx)
    }

    /// Moves an arriving packet through smoltcp (ingress), or just lets sockets transmit.
    fn poll_iface(&mut self, rx: Option<&[u8]>) -> PollResult {
        let t = self.meter.now();
        set_tsval_clock(t);
        let mut port = Port {
            rx,
            wire: Wire {
                meter: &mut self.meter,
                out: &mut self.out,
                fabric: &self.fabric,
                bus: &mut self.bus,
                staging: &mut self.staging,
                no_route: &mut self.stats.no_route,
            },
        };
        let r = self.iface.poll(instant(t), &mut port, &mut self.sockets);
        // An aborted socket goes once its RST is out (smoltcp forgets the peer then). With
        // every send staging buffer taken the RST waits, and the socket with it: its pending
        // RST keeps the firmware's poll due, so it leaves when a buffer frees.
        for h in std::mem::take(&mut self.dying) {
            if self
                .sockets
                .get::<tcp::Socket>(h)
                .remote_endpoint()
                .is_some()
            {
                self.dying.push(h);
            } else {
                self.free_tcp_socket(h);
            }
        }
        r
    }

    /// Service and transmit until nothing moves.
    fn run(&mut self) {
        let mut busy = true;
        for _ in 0..MAX_ROUNDS {
            let progress = self.service_all();
            let r = self.poll_iface(None);
            if !progress && r == PollResult::None {
                busy = false;
                break;
            }
        }
        self.update_poll_at();
        if busy {
            // Work left over: come back at once (or when a staging buffer frees) rather than
            // wait for an event.
            let now = self.meter.now();
            self.next_poll = Some(self.staging.free_at(now).unwrap_or(now));
        }
    }

    fn update_poll_at(&mut self) {
        let now = self.meter.now();
        let mut at = self
            .iface
            .poll_at(instant(now), &self.sockets)
            .map(|i| nanos(i).max(now));
        let mut earliest = |t: Nanos| at = Some(at.map_or(t, |a| a.min(t)));
        for q in self.qps.values() {
            match &q.link {
                Link::Connecting { deadline, .. } => earliest(*deadline),
                Link::Tcp(t) => {
                    if let Some(t) = t.next_release() {
                        earliest(t);
                    }
                }
                _ => {}
            }
        }
        for o in &self.orphans {
            earliest(o.deadline);
        }
        // Nothing leaves before a staging buffer frees: come back then, not in a busy loop
        // (with every buffer on the link, `link_done` brings the firmware back).
        self.next_poll = match self.staging.free_at(now) {
            Some(free) => at.map(|t| t.max(free)),
            None => None,
        };
    }

    /// One pass of every machine: listeners, connects, QPs, orphans.
    fn service_all(&mut self) -> bool {
        let mut progress = self.service_listeners();
        progress |= self.service_connects();
        let (qps, mut cx) = self.split();
        for q in qps.values_mut() {
            progress |= q.service(&mut cx);
        }
        progress |= self.service_orphans();
        progress
    }
}
