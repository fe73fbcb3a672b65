//! The paper's measurements on two simulated hosts ("client" and "server" of the fabric):
//! 1-byte round-trip time over UDP and TCP, and ttcp throughput with NIC occupancy and host
//! CPU utilisation. Everything is predicted from the model's inputs.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::meter::{Dir, Kind, Nanos, Occupancy};
use crate::params::{FabricParams, LanaiParams};

use super::apps::{Bulk, BulkConfig, PingPong, PingPort, Proto, Role};
use super::nbd::{NbdClient, NbdConfig, NbdDir, NbdServer};
use super::{FabricStats, Faults, Sim, SimError};

/// The inputs of one run.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Both NICs' and hosts' model.
    pub params: LanaiParams,
    /// The fabric between them.
    pub fabric: FabricParams,
    /// Seeds the firmware (TCP initial sequence numbers) and fault injection.
    pub seed: u64,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            params: LanaiParams::default(),
            fabric: FabricParams::default(),
            seed: 1,
        }
    }
}

/// More virtual time than any run needs (a hang shows as an error, not a stuck test).
pub const LIMIT: Nanos = 600_000_000_000;

/// Two nodes: (sim, server, client).
pub fn pair(setup: &Setup) -> Result<(Sim, usize, usize), SimError> {
    let mut sim = Sim::new(setup.fabric.clone(), setup.seed);
    let server = sim.add_lanai_node("server", &setup.params, setup.seed)?;
    let client = sim.add_lanai_node("client", &setup.params, setup.seed.wrapping_add(1))?;
    Ok((sim, server, client))
}

fn server_addr(setup: &Setup, port: u16) -> Result<SocketAddr, SimError> {
    let n = setup
        .fabric
        .node("server")
        .ok_or_else(|| SimError::UnknownNode("server".into()))?;
    Ok(SocketAddr::new(n.addr.into(), port))
}

/// How busy each hardware resource was, as a fraction of the elapsed time, in the order
/// wire, PCI read, PCI write, NIC processor, staging, rx staging: the sender's link, the
/// sender's bus reading, the receiver's bus writing, the busier processor, the sender's send
/// staging buffers, the receiver's receive staging buffers.
pub type Utilisation = Vec<(&'static str, f64)>;

/// The resources of `sim` over `elapsed` ns, data flowing from `sender` to `receiver`.
fn utilisation(sim: &Sim, sender: usize, receiver: usize, elapsed: Nanos) -> Utilisation {
    let t = elapsed.max(1) as f64;
    let (us, ur) = (sim.nic(sender).usage(), sim.nic(receiver).usage());
    let staging = us.staging_ns as f64 / us.staging_buffers.max(1) as f64;
    let rx_staging = ur.rx_staging_ns as f64 / ur.rx_staging_buffers.max(1) as f64;
    vec![
        ("wire", sim.link_busy_ns(sender) as f64 / t),
        ("PCI read", us.pci_read_ns as f64 / t),
        ("PCI write", ur.pci_write_ns as f64 / t),
        (
            "NIC processor",
            us.processor_ns.max(ur.processor_ns) as f64 / t,
        ),
        ("staging", staging / t),
        ("rx staging", rx_staging / t),
    ]
}

/// The resource closest to saturation.
pub fn bound(u: &Utilisation) -> (&'static str, f64) {
    u.iter()
        .copied()
        .fold(("none", 0.0), |a, b| if b.1 > a.1 { b } else { a })
}

/// Mean 1-byte round-trip time in microseconds over `rounds` round trips.
pub fn rtt_us(setup: &Setup, proto: Proto, rounds: u64) -> Result<f64, SimError> {
    rtt(setup, proto, rounds).map(|r| r.0)
}

/// Mean 1-byte round-trip time in microseconds, with the resources' utilisation over the
/// run (client to server), of the blocking sockets program as ported.
pub fn rtt(setup: &Setup, proto: Proto, rounds: u64) -> Result<(f64, Utilisation), SimError> {
    rtt_ported(setup, proto, rounds, PingPort::Blocking)
}

/// [`rtt`] of the program ported as `ping_port` says.
pub fn rtt_ported(
    setup: &Setup,
    proto: Proto,
    rounds: u64,
    ping_port: PingPort,
) -> Result<(f64, Utilisation), SimError> {
    let (mut sim, s, c) = pair(setup)?;
    let port = 7000;
    let server = server_addr(setup, port)?;
    sim.set_app(
        s,
        Box::new(PingPong::ported(
            proto,
            Role::Server,
            port,
            rounds,
            ping_port,
        )),
    );
    sim.set_app(
        c,
        Box::new(PingPong::ported(
            proto,
            Role::Client { server },
            port,
            rounds,
            ping_port,
        )),
    );
    let end = sim.run(LIMIT)?;
    let u = utilisation(&sim, c, s, end);
    sim.app::<PingPong>(c)
        .and_then(|p| p.mean_rtt_ns())
        .map(|ns| (ns / 1000.0, u))
        .ok_or_else(|| SimError::App {
            node: "client".into(),
            message: "no round-trip time measured".into(),
        })
}

/// Mean µs per packet for each stage, and their total.
pub type StageUs = BTreeMap<&'static str, f64>;

/// NIC occupancy during a transfer, per packet, summed over both NICs (the sender's NIC
/// transmits data and receives ACKs; the receiver's receives data and transmits ACKs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OccupancyReport {
    /// Transmitting a data segment.
    pub send_data: StageUs,
    /// Transmitting an ACK.
    pub send_ack: StageUs,
    /// Receiving a data segment.
    pub recv_data: StageUs,
    /// Receiving an ACK.
    pub recv_ack: StageUs,
    /// Packets behind each figure: send data, send ACK, receive data, receive ACK.
    pub packets: [u64; 4],
}

fn merged(a: Occupancy, b: Occupancy) -> (StageUs, u64) {
    let mut sum = a.clone();
    sum.packets += b.packets;
    for (s, ns) in b.stage_ns {
        *sum.stage_ns.entry(s).or_default() += ns;
    }
    let mut us = sum.per_packet_us();
    let total = us.values().sum();
    us.insert("total", total);
    (us, sum.packets)
}

/// What one ttcp run predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct TtcpResult {
    /// Bytes the receiver got.
    pub bytes: u64,
    /// From the sender's first post to the receiver handling the last message.
    pub elapsed_ns: Nanos,
    /// Megabytes (10^6 bytes) per second.
    pub mbps: f64,
    /// The sending host's CPU busy over `elapsed_ns`, in percent.
    pub sender_cpu_pct: f64,
    /// The receiving host's CPU busy over `elapsed_ns`, in percent.
    pub receiver_cpu_pct: f64,
    /// What each packet cost the NICs' processors, stage by stage.
    pub occupancy: OccupancyReport,
    /// Frames the sender's NIC put on the wire toward the receiver, and back.
    pub frames_to_server: u64,
    pub(crate) frames_to_client: u64,
    /// Everything the fabric counted (bytes per direction, faults injected).
    pub fabric: FabricStats,
    /// How busy each resource was during the transfer.
    pub utilisation: Utilisation,
}

/// Bulk transfer client to server with `cfg`, optionally with `faults` on both directions.
pub fn bulk(
    setup: &Setup,
    cfg: BulkConfig,
    faults: Option<Faults>,
) -> Result<TtcpResult, SimError> {
    // The program's TCP_NODELAY: the firmware's connections (one here) without Nagle.
    let mut setup = setup.clone();
    setup.params.device.tcp_nodelay |= cfg.nodelay;
    let setup = &setup;
    let (mut sim, s, c) = pair(setup)?;
    let server = server_addr(setup, cfg.port)?;
    if let Some(f) = faults {
        sim.set_faults(c, s, f);
        sim.set_faults(s, c, f);
    }
    sim.set_app(s, Box::new(Bulk::new(cfg, Role::Server)));
    sim.set_app(c, Box::new(Bulk::new(cfg, Role::Client { server })));
    sim.run(LIMIT)?;
    let missing = |what: &str| SimError::App {
        node: "client".into(),
        message: format!("no {what}"),
    };
    let receiver = sim.app::<Bulk>(s).ok_or_else(|| missing("receiver"))?;
    let start = sim.mark_at().ok_or_else(|| missing("start mark"))?;
    let end = receiver.finished_at().ok_or_else(|| missing("end"))?;
    let elapsed = end.saturating_sub(start).max(1);
    let pct = |busy: Nanos| 100.0 * busy as f64 / elapsed as f64;
    let (sn, cn) = (sim.nic(s).meter(), sim.nic(c).meter());
    let (send_data, p0) = merged(
        cn.occupancy(Dir::Send, Kind::Data),
        sn.occupancy(Dir::Send, Kind::Data),
    );
    let (send_ack, p1) = merged(
        sn.occupancy(Dir::Send, Kind::Ack),
        cn.occupancy(Dir::Send, Kind::Ack),
    );
    let (recv_data, p2) = merged(
        sn.occupancy(Dir::Recv, Kind::Data),
        cn.occupancy(Dir::Recv, Kind::Data),
    );
    let (recv_ack, p3) = merged(
        cn.occupancy(Dir::Recv, Kind::Ack),
        sn.occupancy(Dir::Recv, Kind::Ack),
    );
    Ok(TtcpResult {
        bytes: receiver.bytes(),
        elapsed_ns: elapsed,
        mbps: receiver.bytes() as f64 / 1e6 / (elapsed as f64 / 1e9),
        sender_cpu_pct: pct(sim.host(c).busy_ns()),
        receiver_cpu_pct: pct(sim.host(s).busy_ns()),
        occupancy: OccupancyReport {
            send_data,
            send_ack,
            recv_data,
            recv_ack,
            packets: [p0, p1, p2, p3],
        },
        frames_to_server: sim.fabric_stats().frames_between(c, s),
        frames_to_client: sim.fabric_stats().frames_between(s, c),
        fabric: sim.fabric_stats().clone(),
        utilisation: utilisation(&sim, c, s, elapsed),
    })
}

/// ttcp: `total` bytes in `msg`-byte messages over TCP, as the simplest QP port of the
/// program runs it ([`BulkConfig::ttcp`]: one send outstanding, one receive posted).
pub fn ttcp(setup: &Setup, total: u64, msg: usize) -> Result<TtcpResult, SimError> {
    bulk(setup, BulkConfig::ttcp(total, msg), None)
}

/// What one run of the storage experiment predicts.
#[derive(Clone, Debug, PartialEq)]
pub struct NbdResult {
    pub(crate) bytes: u64,
    /// From the client's connection being up to its last reply handled.
    pub elapsed_ns: Nanos,
    /// Megabytes (10^6 bytes) per second.
    pub mbps: f64,
    /// The client host's CPU busy over `elapsed_ns`, in percent.
    pub client_cpu_pct: f64,
    /// The server host's CPU busy over `elapsed_ns`, in percent.
    pub server_cpu_pct: f64,
    /// Requests the client had handed over and not had answered, at most.
    pub max_in_flight: usize,
    /// How busy each resource was, data flowing server to client (read) or back (write),
    /// with the busier host's CPU as "host CPU".
    pub utilisation: Utilisation,
}

/// The storage experiment: the client reads or writes `cfg.total` bytes through the server.
pub fn nbd(setup: &Setup, cfg: NbdConfig) -> Result<NbdResult, SimError> {
    let (mut sim, s, c) = pair(setup)?;
    let server = server_addr(setup, cfg.tcp_port)?;
    sim.set_app(s, Box::new(NbdServer::new(cfg)));
    sim.set_app(c, Box::new(NbdClient::new(cfg, server)));
    sim.run(LIMIT)?;
    let missing = |what: &str| SimError::App {
        node: "client".into(),
        message: format!("no {what}"),
    };
    let client = sim.app::<NbdClient>(c).ok_or_else(|| missing("client"))?;
    let start = sim.mark_at().ok_or_else(|| missing("start mark"))?;
    let end = client.finished_at().ok_or_else(|| missing("end"))?;
    let elapsed = end.saturating_sub(start).max(1);
    let pct = |busy: Nanos| 100.0 * busy as f64 / elapsed as f64;
    let (client_cpu, server_cpu) = (sim.host(c).busy_ns(), sim.host(s).busy_ns());
    let (from, to) = match cfg.dir {
        NbdDir::Read => (s, c),
        NbdDir::Write => (c, s),
    };
    let mut utilisation = utilisation(&sim, from, to, elapsed);
    utilisation.push((
        "host CPU",
        client_cpu.max(server_cpu) as f64 / elapsed as f64,
    ));
    Ok(NbdResult {
        bytes: cfg.total,
        elapsed_ns: elapsed,
        mbps: cfg.total as f64 / 1e6 / (elapsed as f64 / 1e9),
        client_cpu_pct: pct(client_cpu),
        server_cpu_pct: pct(server_cpu),
        max_in_flight: client.max_in_flight(),
        utilisation,
    })
}
