//! The scheduler, fabric and host model against a stand-in NIC whose timing is known exactly:
//! a UDP-only "NIC" that charges one doorbell stage, defers the send to its poll timer and
//! charges one get-WR stage per send and per receive.

use std::collections::{BTreeMap, VecDeque};
use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;

use super::apps::{PingPong, PingPort, Proto, Role};
use super::*;
use crate::frame;
use crate::meter::{CostModel, Dir, Kind, Stage};
use qpip_verbs::backend::MgmtResult;
use qpip_verbs::framer::Framer;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::{Completion, SendWr, WcStatus};

/// A QP, its framer (unused) and its bound port.
type EchoQp = (Arc<QpShared>, Box<dyn Framer>, u16);

struct EchoNic {
    addr: Ipv6Addr,
    fabric: FabricParams,
    memory: Arc<MemoryTable>,
    meter: Meter,
    qps: BTreeMap<QpNum, EchoQp>,
    due: VecDeque<QpNum>,
    out: VecDeque<OutFrame>,
}

impl EchoNic {
    fn new(addr: Ipv6Addr, memory: Arc<MemoryTable>, params: &LanaiParams) -> Self {
        EchoNic {
            addr,
            fabric: FabricParams::default(),
            memory,
            meter: Meter::new(CostModel::new(params)),
            qps: BTreeMap::new(),
            due: VecDeque::new(),
            out: VecDeque::new(),
        }
    }
}

impl SimNic for EchoNic {
    fn command(&mut self, now: Nanos, cmd: Command) {
        self.meter.begin(now);
        match cmd {
            Command::CreateQp { qp, framer } => {
                self.qps.insert(qp.num, (qp, framer, 0));
            }
            Command::BindUdp { qp, addr, reply } => {
                if let Some(q) = self.qps.get_mut(&qp) {
                    q.2 = addr.port();
                    q.0.set_state(qpip_verbs::shared::QpState::Ready);
                }
                reply.send(Ok(addr));
            }
            _ => {}
        }
    }
    fn doorbell(&mut self, now: Nanos, qp: QpNum) {
        self.meter.begin(now);
        self.meter.charge(Dir::Send, Kind::Data, Stage::Doorbell, 0);
        self.due.push_back(qp);
    }
    fn receive(&mut self, now: Nanos, bytes: &[u8]) {
        self.meter.begin(now);
        self.meter.charge(Dir::Recv, Kind::Data, Stage::GetWr, 0);
        let Ok(p) = frame::decode(bytes) else { return };
        let src_ip = Ipv6Addr::from(<[u8; 16]>::try_from(&p[..16]).unwrap());
        let sport = u16::from_be_bytes([p[16], p[17]]);
        let dport = u16::from_be_bytes([p[18], p[19]]);
        let data = &p[20..];
        let Some((qp, _, _)) = self.qps.values().find(|q| q.2 == dport) else {
            return;
        };
        let Some(wr) = qp.rq.pop() else { return };
        let seg = self.memory.resolve(&wr.sg_list[0], true).unwrap();
        // SAFETY: the receive WR was just taken from its queue: its memory is the NIC's to write.
        unsafe { seg.bytes_mut()[..data.len()].copy_from_slice(data) };
        let src = SocketAddr::new(src_ip.into(), sport);
        qp.complete_recv(wr.wr_id, WcStatus::Success, data.len() as u32, Some(src), 0);
    }
    fn poll(&mut self, now: Nanos) {
        self.meter.begin(now);
        while let Some(num) = self.due.pop_front() {
            let Some((qp, _, port)) = self.qps.get(&num) else {
                continue;
            };
            while let Some(wr) = qp.sq.pop() {
                self.meter.charge(Dir::Send, Kind::Data, Stage::GetWr, 0);
                let seg = self.memory.resolve(&wr.sg_list[0], false).unwrap();
                let dest = wr.dest.unwrap();
                let std::net::IpAddr::V6(dip) = dest.ip() else {
                    continue;
                };
                let mut p = self.addr.octets().to_vec();
                p.extend_from_slice(&port.to_be_bytes());
                p.extend_from_slice(&dest.port().to_be_bytes());
                // SAFETY: the send WR is posted, so its memory is the NIC's (this test's) to read.
                p.extend_from_slice(unsafe { seg.bytes() });
                let route = self.fabric.route_to(&dip).unwrap();
                self.out.push_back(OutFrame {
                    bytes: frame::encode(route, &p),
                    ready_at: self.meter.now(),
                });
                qp.complete_send(wr.wr_id, WcStatus::Success, seg.len() as u32, 0);
            }
        }
    }
    fn poll_at(&self) -> Option<Nanos> {
        (!self.due.is_empty()).then(|| self.meter.now())
    }
    fn transmit(&mut self) -> Option<OutFrame> {
        self.out.pop_front()
    }
    fn host_visible_at(&self) -> Nanos {
        self.meter.now()
    }
    fn meter(&self) -> &Meter {
        &self.meter
    }
    fn meter_mut(&mut self) -> &mut Meter {
        &mut self.meter
    }
}

fn echo_pair(rounds: u64, faults: Option<Faults>) -> (Sim, usize, usize) {
    let params = LanaiParams::default();
    let fabric = FabricParams::default();
    let mut sim = Sim::new(fabric.clone(), 7);
    let mut add = |name: &str| {
        let addr = fabric.node(name).unwrap().addr;
        let mem = MemoryTable::new();
        let nic = EchoNic::new(addr, mem.clone(), &params);
        sim.add_node(name, Box::new(nic), mem, &params).unwrap()
    };
    let s = add("server");
    let c = add("client");
    let server = SocketAddr::new(fabric.node("server").unwrap().addr.into(), 9);
    // Receives posted ahead: the timing below follows a receive's repost, then the send.
    let port = PingPort::Preposted;
    sim.set_app(
        s,
        Box::new(PingPong::ported(Proto::Udp, Role::Server, 9, rounds, port)),
    );
    sim.set_app(
        c,
        Box::new(PingPong::ported(
            Proto::Udp,
            Role::Client { server },
            9,
            rounds,
            port,
        )),
    );
    if let Some(f) = faults {
        sim.set_faults(c, s, f);
    }
    (sim, s, c)
}

#[test]
fn udp_ping_pong_takes_exactly_the_modelled_time() {
    let (mut sim, _s, c) = echo_pair(10, None);
    sim.run(1_000_000_000).unwrap();
    let p = LanaiParams::default();
    let f = FabricParams::default();
    // Frame: route len + 1 route byte + type + (16+2+2 header + 1 byte) + CRC; the switch
    // takes the route byte off.
    let len_after_switch = frame::overhead(1) + 21 - 1;
    // The echo reposts its receive before sending: that receive's doorbell starts the NIC's
    // poll timer, which finds the send WR already in the ring (posted at the host's clock).
    let host = 1_300 + 1_200; // receive overhead, then send overhead
    let via_recv_doorbell = 1_300 + p.device.pio_write_ns + 1_000;
    let one_way = host.max(via_recv_doorbell)
        + 5_500 // get WR (send)
        + f.cable_ns
        + f.switch_latency_ns
        + f.cable_ns
        + f.wire_ns(len_after_switch)
        + 5_500; // get WR (receive)
    let rtt = sim.app::<PingPong>(c).unwrap().mean_rtt_ns().unwrap();
    assert_eq!(rtt, 2.0 * one_way as f64);
    // Host CPU: the client paid one send and one receive overhead per round, warm-up
    // included.
    assert_eq!(sim.host(c).busy_ns(), 11 * 2_500);
}

#[test]
fn lost_datagrams_stall_and_the_time_limit_reports_it() {
    let drop_all = Faults {
        drop: 1.0,
        ..Faults::none()
    };
    let (mut sim, _s, _c) = echo_pair(3, Some(drop_all));
    match sim.run(1_000_000_000) {
        Err(SimError::Stalled { .. }) => {}
        other => panic!("expected a stall, got {other:?}"),
    }
    assert_eq!(sim.fabric_stats().dropped, 1);
}

#[test]
fn runs_are_deterministic_under_faults() {
    let faults = Faults {
        drop: 0.0,
        duplicate: 0.3,
        delay: 0.3,
        delay_ns: 20_000,
    };
    let run = || {
        let (mut sim, _s, c) = echo_pair(50, Some(faults));
        let end = sim.run(1_000_000_000).unwrap();
        (
            end,
            sim.app::<PingPong>(c).unwrap().mean_rtt_ns(),
            sim.fabric_stats().clone(),
        )
    };
    let a = run();
    assert!(a.2.duplicated > 0 && a.2.delayed > 0);
    assert_eq!(a, run());
}

/// The stand-in NIC whose k-th completion of a handler is written `k` µs after the
/// handler, and whose last DMA write ends 100 µs after it.
struct LateCqNic {
    echo: EchoNic,
    written: VecDeque<Nanos>,
}

impl SimNic for LateCqNic {
    fn command(&mut self, now: Nanos, cmd: Command) {
        self.echo.command(now, cmd)
    }
    fn doorbell(&mut self, now: Nanos, qp: QpNum) {
        self.echo.doorbell(now, qp)
    }
    fn receive(&mut self, now: Nanos, frame: &[u8]) {
        self.echo.receive(now, frame)
    }
    fn poll(&mut self, now: Nanos) {
        self.echo.poll(now);
        let t = self.echo.meter.now();
        self.written = (1..=4).map(|k| t + k * 1_000).collect();
    }
    fn poll_at(&self) -> Option<Nanos> {
        self.echo.poll_at()
    }
    fn transmit(&mut self) -> Option<OutFrame> {
        self.echo.transmit()
    }
    fn host_visible_at(&self) -> Nanos {
        self.echo.meter.now() + 100_000
    }
    fn completion_visible_at(&mut self, _qp: QpNum, _recv: bool) -> Option<Nanos> {
        self.written.pop_front()
    }
    fn meter(&self) -> &Meter {
        &self.echo.meter
    }
    fn meter_mut(&mut self) -> &mut Meter {
        &mut self.echo.meter
    }
}

/// Posts two datagrams at once and notes when the host sees each send completion.
#[derive(Default)]
struct TwoSends {
    qp: Option<qpip_verbs::qp::QueuePair>,
    cq: Option<qpip_verbs::cq::CompletionQueue>,
    mr: Option<qpip_verbs::mr::MemoryRegion>,
    seen: Vec<Nanos>,
}

impl App for TwoSends {
    fn start(&mut self, host: &mut Host) {
        let cq = host.create_cq(16);
        let (qp, _) = host.create_udp_qp(9, qpip_verbs::qp::QpAttr::new(&cq));
        self.mr = Some(
            host.nic()
                .alloc_region(64, qpip_verbs::mr::Access::READ_WRITE),
        );
        self.qp = Some(qp);
        self.cq = Some(cq);
    }
    fn on_reply(&mut self, host: &mut Host, _tag: u64, _r: MgmtResult) {
        let dest = SocketAddr::new(
            FabricParams::default().node("client").unwrap().addr.into(),
            9,
        );
        let (qp, mr) = (self.qp.as_ref().unwrap(), self.mr.as_ref().unwrap());
        for id in 0..2 {
            host.post_send(qp, SendWr::new(id, &[mr.sge(0, 8)]).to(dest))
                .unwrap();
        }
    }
    fn on_completion(&mut self, host: &mut Host, _c: Completion) {
        self.seen.push(host.now());
    }
    fn done(&self) -> bool {
        self.seen.len() == 2
    }
    fn error(&self) -> Option<String> {
        None
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[test]
fn each_completion_is_seen_when_its_own_cq_write_ends() {
    let params = LanaiParams::default();
    let fabric = FabricParams::default();
    let mut sim = Sim::new(fabric.clone(), 7);
    let addr = fabric.node("server").unwrap().addr;
    let mem = MemoryTable::new();
    let nic = LateCqNic {
        echo: EchoNic::new(addr, mem.clone(), &params),
        written: VecDeque::new(),
    };
    let s = sim.add_node("server", Box::new(nic), mem, &params).unwrap();
    sim.set_app(s, Box::new(TwoSends::default()));
    sim.run(1_000_000_000).unwrap();
    let seen = &sim.app::<TwoSends>(s).unwrap().seen;
    // Both sends complete in one handler: the host sees each when its own entry is
    // written, 1 µs after the handler and 1 µs later, not both when the handler's last
    // write ends (100 µs after it).
    let handler_end = seen[0] - 1_000;
    assert_eq!(seen[1], handler_end + 2_000, "{seen:?}");
}

/// The firmware itself through the simulated fabric.
mod firmware {
    use super::super::apps::{BulkConfig, Sizes};
    use super::super::experiments::{self, Setup};
    use super::*;

    fn lossy() -> Faults {
        Faults {
            drop: 0.05,
            duplicate: 0.02,
            delay: 0.05,
            delay_ns: 200_000,
        }
    }

    fn stream() -> BulkConfig {
        BulkConfig {
            total: 2 << 20,
            sizes: Sizes::Varied {
                max: 20_000,
                seed: 11,
            },
            window: 8,
            recv_depth: 16,
            read_think_ns: 0,
            nodelay: false,
            verify: true,
            port: 6000,
        }
    }

    #[test]
    fn tcp_delivers_a_verified_stream_through_loss_duplication_and_reordering() {
        let setup = Setup::default();
        let clean = experiments::bulk(&setup, stream(), None).unwrap();
        // `bulk` fails on any corrupt, missing, reordered or extra message, and on a hang.
        let faulty = experiments::bulk(&setup, stream(), Some(lossy())).unwrap();
        assert_eq!(faulty.bytes, 2 << 20);
        assert_eq!(clean.bytes, 2 << 20);
        // Faults happened, and lost data was sent again: more bytes crossed toward the
        // receiver than in the clean run (the firmware may cut segments differently, so
        // frame counts alone prove nothing).
        let f = &faulty.fabric;
        assert!(f.dropped > 0 && f.duplicated > 0 && f.delayed > 0, "{f:?}");
        let (c, s) = (1, 0); // client, server node indices
        let sent = f.bytes[&(c, s)];
        let needed = clean.fabric.bytes[&(c, s)];
        assert!(sent > needed, "{sent} bytes with loss, {needed} without");
        assert!(faulty.elapsed_ns > clean.elapsed_ns);
    }

    /// The stages every 1-byte message certainly passes through, one way, plus the host's
    /// overheads and the fabric's fixed latency.
    fn path_floor_ns(p: &LanaiParams, f: &FabricParams) -> f64 {
        let c = &p.cost;
        let nic_us =
            c.send.data.get_wr + c.send.data.get_data + c.recv.data.get_wr + c.recv.data.put_data;
        let host_us = p.host.send_overhead_us + p.host.recv_overhead_us;
        let fabric_ns = 2 * f.cable_ns + f.switch_latency_ns + p.device.pio_write_ns;
        (nic_us + host_us) * 1000.0 * 133.0 / p.device.clock_mhz + fabric_ns as f64
    }

    #[test]
    fn round_trips_cost_more_than_the_stages_on_their_path() {
        let setup = Setup::default();
        let floor_us = 2.0 * path_floor_ns(&setup.params, &setup.fabric) / 1000.0;
        let udp = experiments::rtt_us(&setup, Proto::Udp, 20).unwrap();
        let tcp = experiments::rtt_us(&setup, Proto::Tcp, 20).unwrap();
        for (name, rtt) in [("UDP", udp), ("TCP", tcp)] {
            assert!(
                rtt.is_finite() && rtt > floor_us,
                "{name} RTT {rtt} µs, floor {floor_us} µs"
            );
        }
        // TCP's header build and parse cost more than UDP's.
        assert!(tcp > udp, "TCP {tcp} µs, UDP {udp} µs");
    }

    #[test]
    fn small_mtu_ttcp_is_slower_and_runs_are_deterministic() {
        let mut setup = Setup::default();
        let big = experiments::ttcp(&setup, 64 * 16384, 16384).unwrap();
        assert_eq!(big, experiments::ttcp(&setup, 64 * 16384, 16384).unwrap());
        setup.fabric.mtu = 1500;
        let small = experiments::ttcp(&setup, 64 * 16384, 16384).unwrap();
        assert!(
            small.mbps < big.mbps,
            "MTU 1500 {} MB/s, MTU 16384 {} MB/s",
            small.mbps,
            big.mbps
        );
        assert!(big.occupancy.packets[0] > 0 && big.occupancy.packets[1] > 0);
        assert!(big.receiver_cpu_pct > 0.0 && big.receiver_cpu_pct < 100.0);
    }

    use super::super::apps::Bulk;
    use crate::pci::{PciBus, Use};
    use qpip_verbs::backend::MgmtResult;
    use qpip_verbs::wr::{Completion, Opcode};

    #[test]
    fn one_staging_buffer_serialises_dma_checksum_headers_and_wire() {
        let mut setup = Setup::default();
        setup.params.device.send_staging_buffers = 1;
        // Messages of exactly one segment's payload (MTU less IPv6, TCP and timestamps).
        let mss = setup.fabric.mtu - 72;
        let stream = |setup: &Setup| {
            experiments::bulk(setup, BulkConfig::pipelined(200 * mss as u64, mss), None).unwrap()
        };
        let r = stream(&setup);
        let (p, f) = (&setup.params, &setup.fabric);
        let bus = PciBus::new(&p.device);
        let dma = bus.dma_ns(Use::Read, mss);
        let wire = f.wire_ns(mss + 72 + crate::frame::overhead(1));
        let s = &p.cost.send.data;
        // Before the DMA: schedule and get data; after it (the checksum): the headers and
        // the hand-off; then the wire. Only then is the buffer free for the next segment.
        let stages =
            (s.schedule + s.get_data + s.build_tcp_header + s.build_ip_header + s.send) * 1000.0;
        let serial_ns = dma as f64 + stages + wire as f64;
        let predicted = mss as f64 / serial_ns * 1000.0;
        assert!(
            r.mbps <= predicted * 1.001 && r.mbps > predicted * 0.9,
            "{} MB/s with one buffer, {predicted} MB/s predicted",
            r.mbps
        );
        // Store and forward: slower than a NIC overlapping the DMA with the wire.
        let overlapped = mss as f64 * 1000.0 / dma.max(wire) as f64;
        assert!(r.mbps < 0.7 * overlapped, "{} vs {overlapped}", r.mbps);
        // More buffers overlap them again.
        setup.params.device.send_staging_buffers = 2;
        let two = stream(&setup);
        assert!(two.mbps > 1.2 * r.mbps, "{} vs {}", two.mbps, r.mbps);
    }

    #[test]
    fn bulk_tcp_at_1500_mtu_fills_its_segments() {
        let mut setup = Setup::default();
        setup.fabric.mtu = 1500;
        let r = experiments::ttcp(&setup, 256 * 16384, 16384).unwrap();
        let segments = r.occupancy.packets[0];
        let per = r.bytes as f64 / segments as f64;
        // MSS: 1500 less the IPv6 (40) and TCP (20) headers.
        assert!(
            per >= 0.9 * 1440.0,
            "{per} bytes per segment over {segments}"
        );
    }

    #[test]
    fn firmware_checksum_never_beats_the_hardware_one() {
        let hw = Setup::default();
        let mut fw = Setup::default();
        fw.params.device.recv_checksum = crate::params::ChecksumAt::Firmware;
        for mtu in [1500, 16384] {
            let (mut h, mut f) = (hw.clone(), fw.clone());
            h.fabric.mtu = mtu;
            f.fabric.mtu = mtu;
            let th = experiments::ttcp(&h, 64 * 16384, 16384).unwrap();
            let tf = experiments::ttcp(&f, 64 * 16384, 16384).unwrap();
            assert!(
                tf.mbps <= th.mbps,
                "MTU {mtu}: fw {} hw {}",
                tf.mbps,
                th.mbps
            );
        }
        for proto in [Proto::Udp, Proto::Tcp] {
            let rh = experiments::rtt_us(&hw, proto, 10).unwrap();
            let rf = experiments::rtt_us(&fw, proto, 10).unwrap();
            assert!(rf >= rh, "{proto:?}: fw {rf} hw {rh}");
        }
    }

    /// Both ends of two opposite transfers on one node: its receiver and its sender.
    struct BothWays {
        rx: Bulk,
        tx: Bulk,
    }

    impl App for BothWays {
        fn start(&mut self, host: &mut Host) {
            self.rx.start(host);
            self.tx.start(host);
        }
        fn on_completion(&mut self, host: &mut Host, c: Completion) {
            match c.opcode {
                Opcode::Send => self.tx.on_completion(host, c),
                _ => self.rx.on_completion(host, c),
            }
        }
        fn on_reply(&mut self, host: &mut Host, tag: u64, r: MgmtResult) {
            let copy = match &r {
                Ok(a) => Ok(*a),
                Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            };
            self.rx.on_reply(host, tag, copy);
            self.tx.on_reply(host, tag, r);
        }
        fn done(&self) -> bool {
            self.rx.done() && self.tx.done()
        }
        fn error(&self) -> Option<String> {
            self.rx.error().or_else(|| self.tx.error())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    #[test]
    fn a_bidirectional_transfer_gets_no_more_than_one_bus() {
        let setup = Setup::default();
        let (mut sim, s, c) = experiments::pair(&setup).unwrap();
        let addr =
            |name: &str, port| SocketAddr::new(setup.fabric.node(name).unwrap().addr.into(), port);
        let cfg = |port| BulkConfig {
            port,
            ..BulkConfig::pipelined(128 * 16384, 16384)
        };
        for (node, me, peer) in [(s, 5001, ("client", 5002)), (c, 5002, ("server", 5001))] {
            let both = BothWays {
                rx: Bulk::new(cfg(me), Role::Server),
                tx: Bulk::new(
                    cfg(peer.1),
                    Role::Client {
                        server: addr(peer.0, peer.1),
                    },
                ),
            };
            sim.set_app(node, Box::new(both));
        }
        sim.run(experiments::LIMIT).unwrap();
        let rate = |sender: usize, receiver: usize| {
            let tx = &sim.app::<BothWays>(sender).unwrap().tx;
            let rx = &sim.app::<BothWays>(receiver).unwrap().rx;
            let ns = rx.finished_at().unwrap() - tx.started_at().unwrap();
            rx.bytes() as f64 * 1000.0 / ns as f64
        };
        let (to_server, to_client) = (rate(c, s), rate(s, c));
        let bus = PciBus::new(&setup.params.device);
        let (r, w) = (bus.rate_mbps(Use::Read), bus.rate_mbps(Use::Write));
        // Each node's one bus reads what it sends and writes what it receives.
        for (out, inn) in [(to_server, to_client), (to_client, to_server)] {
            let share = out / r + inn / w;
            assert!(
                share <= 1.0,
                "{out} MB/s out, {inn} MB/s in: {share} of the bus"
            );
        }
        // One way alone goes faster than each way of the pair.
        let one = experiments::bulk(&setup, cfg(5001), None).unwrap();
        assert!(to_server < one.mbps && to_client < one.mbps);
    }

    #[test]
    fn a_slow_receiver_stops_the_senders_link_and_sets_the_rate() {
        let setup = Setup::default();
        // The receiver: one receive buffer and a bus at a quarter of the clock, so its DMA
        // to host memory is the slowest thing on the path.
        let mut slow = setup.params.clone();
        slow.device.pci_clock_mhz /= 4.0;
        slow.device.recv_staging_buffers = 1;
        let mut sim = Sim::new(setup.fabric.clone(), setup.seed);
        let s = sim.add_lanai_node("server", &slow, 1).unwrap();
        let c = sim.add_lanai_node("client", &setup.params, 2).unwrap();
        let cfg = BulkConfig::pipelined(64 * 16384, 16384);
        let server = SocketAddr::new(setup.fabric.node("server").unwrap().addr.into(), cfg.port);
        sim.set_app(s, Box::new(Bulk::new(cfg, Role::Server)));
        sim.set_app(c, Box::new(Bulk::new(cfg, Role::Client { server })));
        sim.run(experiments::LIMIT).unwrap();
        let rx = sim.app::<Bulk>(s).unwrap();
        let tx = sim.app::<Bulk>(c).unwrap();
        let ns = rx.finished_at().unwrap() - tx.started_at().unwrap();
        let rate = rx.bytes() as f64 * 1000.0 / ns as f64;
        // Throttled to the receiver's DMA rate, and not far below it.
        let write = PciBus::new(&slow.device).rate_mbps(Use::Write);
        assert!(
            rate <= write && rate > 0.7 * write,
            "{rate} MB/s, bus writes {write}"
        );
        // Frames waited on the wire for the receive buffer, one at a time (no queue).
        let f = sim.fabric_stats();
        assert!(f.stopped > 10 && f.stopped_ns > 0, "{f:?}");
        assert_eq!(f.max_waiting, 1);
        // Meanwhile the sender's link was held: busier than its frames' wire time.
        let wire = setup.fabric.wire_ns(f.bytes[&(c, s)] as usize);
        assert!(
            sim.link_busy_ns(c) > wire + f.stopped_ns / 2,
            "{}",
            sim.link_busy_ns(c)
        );
        // The same transfer into a fast receiver is faster.
        let fast = experiments::bulk(&setup, cfg, None).unwrap();
        assert!(fast.mbps > 1.5 * rate, "{} vs {rate}", fast.mbps);
    }
}

/// How the programs were ported: sends outstanding, receives posted, when they are posted.
mod ports {
    use super::super::apps::{Bulk, BulkConfig};
    use super::super::experiments::{self, Setup};
    use super::*;

    /// Runs `cfg` between the two nodes; returns (sender, receiver).
    fn run(setup: &Setup, cfg: BulkConfig) -> (Sim, usize, usize) {
        let (mut sim, s, c) = experiments::pair(setup).unwrap();
        let server = SocketAddr::new(setup.fabric.node("server").unwrap().addr.into(), cfg.port);
        sim.set_app(s, Box::new(Bulk::new(cfg, Role::Server)));
        sim.set_app(c, Box::new(Bulk::new(cfg, Role::Client { server })));
        sim.run(experiments::LIMIT).unwrap();
        (sim, c, s)
    }

    fn elapsed(sim: &Sim, c: usize, s: usize) -> Nanos {
        let rx = sim.app::<Bulk>(s).unwrap();
        rx.finished_at().unwrap() - sim.app::<Bulk>(c).unwrap().started_at().unwrap()
    }

    #[test]
    fn a_blocking_sender_has_one_send_outstanding() {
        let setup = Setup::default();
        let total = 64 * 16384;
        let (sim, c, s) = run(&setup, BulkConfig::ttcp(total, 16384));
        assert_eq!(sim.app::<Bulk>(c).unwrap().max_outstanding(), 1);
        assert_eq!(sim.app::<Bulk>(s).unwrap().bytes(), total);
        let blocking = elapsed(&sim, c, s);
        // The same program keeping 8 sends posted uses them, and the NIC overlaps them.
        let (sim, c, s) = run(&setup, BulkConfig::pipelined(total, 16384));
        assert_eq!(sim.app::<Bulk>(c).unwrap().max_outstanding(), 8);
        assert!(elapsed(&sim, c, s) < blocking);
    }

    #[test]
    fn a_receive_posted_late_shrinks_the_window() {
        let setup = Setup::default();
        let msg = 16384;
        // 8 sends may be outstanding (128 KiB), but the receiver's one receive is posted
        // again only 2 ms after each read returns.
        let think = 2_000_000;
        let cfg = BulkConfig {
            read_think_ns: think,
            ..BulkConfig::pipelined(32 * msg as u64, msg).with_port(8, 1)
        };
        let (sim, c, s) = run(&setup, cfg);
        let tx = sim.app::<Bulk>(c).unwrap().timeline();
        let rx = sim.app::<Bulk>(s).unwrap().timeline();
        // Bytes the receiver's NIC acknowledged that no receive had taken yet: they sit in
        // its SRAM buffer, out of the window it offers, so they never exceed that buffer
        // (plus the one message placed in the receive WR and not yet handled by the host).
        let taken_by = |t: Nanos| {
            rx.iter()
                .take_while(|(at, _)| *at <= t)
                .last()
                .map_or(0, |x| x.1)
        };
        let backlog = tx
            .iter()
            .map(|&(t, acked)| acked - taken_by(t))
            .max()
            .unwrap();
        let buffer = setup.params.device.tcp_recv_buffer as u64;
        assert!(backlog <= buffer + msg as u64 + 4, "{backlog} bytes held");
        // And the window was what held the sender: its 8 sends would have carried more.
        assert!(backlog > buffer / 2, "{backlog} bytes held");
        let outstanding = sim.app::<Bulk>(c).unwrap().max_outstanding();
        assert_eq!(outstanding, 8);
        // The reader's pace sets the rate.
        assert!(elapsed(&sim, c, s) >= 31 * think);
    }

    #[test]
    fn receives_posted_ahead_keep_the_window_open() {
        let setup = Setup::default();
        let msg = 16384;
        let base = BulkConfig::pipelined(64 * msg as u64, msg);
        // Two sends outstanding: with one receive, the second message waits in the NIC's
        // buffer until the first read returns and posts again; with 16 it goes straight on.
        let (sim, c, s) = run(&setup, base.with_port(2, 1));
        let late = elapsed(&sim, c, s);
        let (sim, c, s) = run(&setup, base.with_port(2, 16));
        assert!(elapsed(&sim, c, s) <= late);
    }
}
