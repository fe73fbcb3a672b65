//! The lanai backend in real time: the firmware as a working [`NicBackend`].
//!
//! One thread, `qpip-lanai-nic` (the shared NIC thread shell, [`qpip_verbs::machines::shell`]),
//! plays the LANai processor: it owns the `Firmware` and feeds it management commands,
//! doorbells and frames at wall-clock time (nanoseconds since the NIC started). The Myrinet port is a UDP socket on this machine (the node's `port` in
//! the fabric config); the crossbar is emulated at the sender: a frame's first route byte
//! names the switch output, so the frame, with that byte consumed, goes to the datagram
//! socket of the node (or bridge) whose route starts with it.

use std::collections::HashMap;
use std::io;
use std::net::{Ipv6Addr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::firmware::{Firmware, FirmwareConfig};
use super::frame;
use super::meter::Nanos;
use super::params::{FabricParams, LanaiParams, NodeParams, ParamsError};
use qpip_verbs::backend::{Command, NicBackend};
use qpip_verbs::error::{Error, Result};
use qpip_verbs::machines::shell::{NicThread, Processor, Progress, ShellConfig};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::QpNum;

/// The node a server takes when none is named.
pub const DEFAULT_SERVER_NODE: &str = "server";

/// Which emulated LANai NIC to open: the model, the fabric and this machine's node on it.
#[derive(Clone, Debug)]
pub struct LanaiConfig {
    /// The NIC's model: clock, costs of each firmware stage, SRAM, PCI (`configs/lanai.toml`).
    pub params: LanaiParams,
    /// The fabric: its nodes, their addresses and ports, the routes between them
    /// (`configs/fabric.toml`).
    pub fabric: FabricParams,
    /// The node this NIC is. `None`: the first node other than [`DEFAULT_SERVER_NODE`] whose
    /// fabric port is free (what a client wants; servers name their node).
    pub node: Option<String>,
}

impl Default for LanaiConfig {
    /// The embedded configs, first free client node.
    fn default() -> Self {
        LanaiConfig {
            params: LanaiParams::default(),
            fabric: FabricParams::default(),
            node: None,
        }
    }
}

impl LanaiConfig {
    /// Reads the parameter files (the embedded defaults where a path is `None`).
    pub fn from_options(
        node: Option<&str>,
        fabric: Option<&Path>,
        params: Option<&Path>,
    ) -> Result<LanaiConfig, ParamsError> {
        Ok(LanaiConfig {
            params: params
                .map(LanaiParams::load)
                .transpose()?
                .unwrap_or_default(),
            fabric: fabric
                .map(FabricParams::load)
                .transpose()?
                .unwrap_or_default(),
            node: node.map(str::to_string),
        })
    }

    /// The named node's entry in the fabric, if a node is named.
    pub fn node_params(&self) -> Result<Option<&NodeParams>> {
        match &self.node {
            None => Ok(None),
            Some(name) => self.fabric.node(name).map(Some).ok_or_else(|| {
                let names: Vec<&str> = self.fabric.node.iter().map(|n| n.name.as_str()).collect();
                Error::Engine(format!(
                    "the fabric has no node named {name:?} (nodes: {})",
                    names.join(", ")
                ))
            }),
        }
    }

    /// The IPv6 address of the named node.
    pub fn node_addr(&self) -> Result<Option<Ipv6Addr>> {
        Ok(self.node_params()?.map(|n| n.addr))
    }
}

/// How long the NIC thread keeps polling after its last piece of work before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
const WAKER: mio::Token = mio::Token(0);
const FABRIC: mio::Token = mio::Token(1);
/// Frames taken from the fabric port per turn of the NIC thread.
const RX_BATCH: usize = 64;
/// Socket buffers of the emulated port: a burst of 16 KB frames must not overflow them.
const PORT_BUFFER: usize = 4 << 20;

/// The emulated LANai NIC as a backend: its firmware on the NIC thread, frames to and from
/// the fabric through this node's datagram port.
pub struct LanaiBackend {
    thread: NicThread,
}

/// Binds the node's fabric port; `AddrInUse` becomes an error that says what to do.
fn bind_port(node: &NodeParams) -> Result<UdpSocket> {
    let port = node.port.ok_or_else(|| {
        Error::Engine(format!(
            "node {} has no fabric port in the fabric config",
            node.name
        ))
    })?;
    UdpSocket::bind(port).map_err(|e| {
        if e.kind() == io::ErrorKind::AddrInUse {
            Error::Engine(format!(
                "fabric port {port} of node {} is in use; pick another node with --lanai-node",
                node.name
            ))
        } else {
            Error::Net {
                op: "binding the fabric port",
                addr: port,
                source: e,
            }
        }
    })
}

/// The node this NIC plays and its bound port.
fn claim_node(cfg: &LanaiConfig) -> Result<(NodeParams, UdpSocket)> {
    if let Some(node) = cfg.node_params()? {
        return Ok((node.clone(), bind_port(node)?));
    }
    let mut tried = Vec::new();
    for node in cfg
        .fabric
        .node
        .iter()
        .filter(|n| n.name != DEFAULT_SERVER_NODE && n.port.is_some())
    {
        match bind_port(node) {
            Ok(sock) => return Ok((node.clone(), sock)),
            Err(e) => {
                tracing::debug!("{e}");
                tried.push(node.name.as_str());
            }
        }
    }
    Err(Error::Engine(format!(
        "no free client node on the fabric (tried {}); name one with --lanai-node",
        if tried.is_empty() {
            "none".to_string()
        } else {
            tried.join(", ")
        }
    )))
}

/// A seed that differs between runs, so a restarted NIC does not reuse the sequence numbers
/// a peer may still remember.
fn fresh_seed(addr: &Ipv6Addr) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ u64::from(std::process::id()).rotate_left(32) ^ (u128::from(*addr) as u64)
}

impl LanaiBackend {
    /// Claims `cfg`'s node (binds its fabric port) and starts the NIC thread running the
    /// firmware over `memory`.
    pub fn start(cfg: LanaiConfig, memory: Arc<MemoryTable>) -> Result<Self> {
        let (node, sock) = claim_node(&cfg)?;
        let local = sock.local_addr().ok();
        let sref = socket2::SockRef::from(&sock);
        // Best effort: the kernel caps these at its rmem/wmem maximum.
        let _ = sref.set_recv_buffer_size(PORT_BUFFER);
        let _ = sref.set_send_buffer_size(PORT_BUFFER);
        sock.set_nonblocking(true)
            .map_err(|e| Error::Engine(format!("fabric port of node {}: {e}", node.name)))?;
        let mut sock = mio::net::UdpSocket::from_std(sock);
        let poll = mio::Poll::new().map_err(|e| Error::Engine(format!("epoll: {e}")))?;
        let waker = mio::Waker::new(poll.registry(), WAKER)
            .map_err(|e| Error::Engine(format!("eventfd: {e}")))?;
        poll.registry()
            .register(&mut sock, FABRIC, mio::Interest::READABLE)
            .map_err(|e| Error::Engine(format!("epoll: {e}")))?;
        tracing::info!(
            node = %node.name,
            addr = %node.addr,
            port = ?local,
            "lanai NIC on the emulated Myrinet fabric"
        );
        let fw_cfg = FirmwareConfig {
            addr: node.addr,
            seed: fresh_seed(&node.addr),
            params: cfg.params,
            fabric: cfg.fabric,
        };
        let routes = fw_cfg.fabric.crossbar();
        let shell = ShellConfig {
            name: "qpip-lanai-nic",
            spin: SPIN,
            doorbell_fifo: Some(fw_cfg.params.device.doorbell_fifo_entries),
            grace: Duration::ZERO, // the card's processor alone runs its firmware
        };
        let thread = NicThread::spawn(shell, waker, move || RealtimeNic {
            // Built on its own thread: the firmware need not be Send.
            fw: Firmware::new(fw_cfg, memory),
            poll,
            events: mio::Events::with_capacity(16),
            sock,
            // The largest datagram; frames are at most MTU plus a few bytes.
            buf: vec![0u8; 65536],
            routes,
            epoch: Instant::now(),
            node: node.name,
        })?;
        Ok(LanaiBackend { thread })
    }
}

fn ipv6_only(addr: &SocketAddr) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!(
            "the lanai NIC speaks IPv6 only ({addr} is IPv4); use a fabric address such as [fd00:4c41:4e41::1]:10809"
        ),
    )
}

/// The firmware speaks IPv6 only: an IPv4 address is refused before it reaches the NIC.
fn refuse_ipv4(cmd: Command) -> Option<Command> {
    match cmd {
        Command::Connect { addr, reply, .. } if addr.is_ipv4() => {
            reply.send(Err(ipv6_only(&addr)));
            None
        }
        Command::Listen { addr, reply, .. } if addr.is_ipv4() => {
            reply.send(Err(ipv6_only(&addr)));
            None
        }
        Command::BindUdp { addr, reply, .. } if addr.is_ipv4() => {
            reply.send(Err(ipv6_only(&addr)));
            None
        }
        cmd => Some(cmd),
    }
}

impl NicBackend for LanaiBackend {
    fn name(&self) -> &'static str {
        "lanai"
    }

    fn manage(&self, cmd: Command) {
        if let Some(cmd) = refuse_ipv4(cmd) {
            self.thread.manage(cmd);
        }
    }

    fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        self.thread.ring_doorbell(qp);
    }

    fn io_path(&self) -> &'static str {
        "firmware"
    }

    fn engine_threads(&self) -> Vec<i32> {
        self.thread.engine_threads()
    }

    fn shutdown(&self) {
        self.thread.shutdown();
    }
}

/// The NIC processor: the firmware and its physical layer, a datagram socket standing for
/// the Myrinet port, on the wall clock.
struct RealtimeNic {
    fw: Firmware,
    poll: mio::Poll,
    events: mio::Events,
    sock: mio::net::UdpSocket,
    buf: Vec<u8>,
    routes: HashMap<u8, SocketAddr>,
    epoch: Instant,
    node: String,
}

impl Processor for RealtimeNic {
    fn command(&mut self, cmd: Command) {
        let now = self.now();
        self.fw.command(now, cmd);
    }

    fn doorbell(&mut self, qp: QpNum) {
        let now = self.now();
        tracing::trace!(node = %self.node, now, qp, "doorbell");
        self.fw.doorbell(now, qp);
    }

    fn step(&mut self) -> Progress {
        // Take the readiness the shell slept on (edge-triggered: reported once); the frames
        // themselves are read below whether or not it said so.
        if let Err(e) = self.poll.poll(&mut self.events, Some(Duration::ZERO))
            && e.kind() != io::ErrorKind::Interrupted
        {
            tracing::error!("lanai NIC thread: epoll failed: {e}");
        }
        let mut worked = self.receive_frames();
        let now = self.timer_now();
        if self.fw.poll_at().is_some_and(|t| t <= now) {
            tracing::trace!(node = %self.node, now, "poll");
            self.fw.poll(now);
            worked = true;
        }
        if worked | self.send_frames() {
            Progress::Worked
        } else {
            Progress::Idle
        }
    }

    fn watch_fd(&self) -> std::os::fd::RawFd {
        // A frame on the fabric port or the waker.
        use std::os::fd::AsRawFd;
        self.poll.as_raw_fd()
    }

    fn poll_in(&self) -> Option<Duration> {
        // The firmware's next timer.
        self.fw
            .poll_at()
            .map(|t| Duration::from_nanos(t.saturating_sub(self.timer_now())))
    }

    fn stop(&mut self) {
        // The last commands' RSTs and FINs go on the wire, so peers are not left waiting
        // for a node that is gone.
        let now = self.timer_now();
        self.fw.poll(now);
        self.send_frames();
        tracing::debug!(node = %self.node, "lanai NIC stopped");
    }
}

impl RealtimeNic {
    fn now(&self) -> Nanos {
        self.epoch.elapsed().as_nanos() as Nanos
    }

    /// The firmware's own clock runs ahead of the wall while it is charged more work than
    /// the wall clock saw (the emulated 133 MHz processor's backlog). In real time that
    /// backlog is not waited out: a timer is due once either clock has reached it.
    fn timer_now(&self) -> Nanos {
        self.now().max(self.fw.meter().now())
    }

    /// Every datagram waiting on the fabric port goes to the receive state machine.
    fn receive_frames(&mut self) -> bool {
        let mut worked = false;
        // A bounded batch, so a stream of arrivals does not starve the transmit side; the
        // caller comes straight back after a turn with work, so the port is still drained
        // to WouldBlock (it is edge-triggered) before the thread sleeps.
        for _ in 0..RX_BATCH {
            match self.sock.recv_from(&mut self.buf) {
                Ok((n, _)) => {
                    worked = true;
                    let now = self.now();
                    if tracing::enabled!(tracing::Level::TRACE) {
                        let packet = frame::decode(&self.buf[..n]).unwrap_or_default();
                        tracing::trace!(node = %self.node, now, "in: {}", frame::summary(packet));
                    }
                    self.fw.receive(now, &self.buf[..n]);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return worked,
                // ICMP errors from an earlier send (a peer port not bound yet) land here; they
                // are consumed by reading them, and the port must be drained (edge-triggered).
                Err(e) => {
                    worked = true; // not drained yet: look again before sleeping
                    tracing::trace!(node = %self.node, "fabric port: {e}");
                }
            }
        }
        worked
    }

    /// Puts the firmware's frames on the wire: through the crossbar to the next port.
    fn send_frames(&mut self) -> bool {
        let mut worked = false;
        while let Some(out) = self.fw.transmit() {
            worked = true;
            // The datagram socket copies the frame at once: its staging buffer is free.
            self.fw.link_done(out.ready_at);
            let (port, bytes) = match frame::switch(&out.bytes) {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(node = %self.node, "firmware built a bad frame: {e}");
                    continue;
                }
            };
            let Some(dst) = self.routes.get(&port) else {
                tracing::debug!(node = %self.node, port, "no node on switch port: frame dropped");
                continue;
            };
            if tracing::enabled!(tracing::Level::TRACE) {
                let packet = bytes
                    .get(3..bytes.len().saturating_sub(4))
                    .unwrap_or_default();
                tracing::trace!(node = %self.node, ready_at = out.ready_at, "out: {}", frame::summary(packet));
            }
            // A lost frame is the wire's loss: TCP in the firmware retransmits.
            if let Err(e) = self.sock.send_to(&bytes, *dst) {
                tracing::debug!(node = %self.node, %dst, "frame dropped: {e}");
            }
        }
        worked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fabric_with_ports(ports: [u16; 3]) -> FabricParams {
        let mut f = FabricParams::default();
        for (n, p) in f.node.iter_mut().zip(ports) {
            n.port = Some(SocketAddr::from(([127, 0, 0, 1], p)));
        }
        f
    }

    fn free_port() -> u16 {
        UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .map(|a| a.port())
            .expect("a free UDP port")
    }

    #[test]
    fn crossbar_maps_first_route_bytes_to_ports() {
        let f = FabricParams::default();
        let x = f.crossbar();
        assert_eq!(x.get(&1), Some(&"127.0.0.1:47801".parse().unwrap()));
        assert_eq!(x.get(&0), Some(&"127.0.0.1:47800".parse().unwrap()));
        assert_eq!(x.get(&9), None);
    }

    #[test]
    fn a_client_takes_the_first_free_node_and_a_busy_named_node_is_an_error() {
        let ports = [free_port(), free_port(), free_port()];
        let cfg = LanaiConfig {
            fabric: fabric_with_ports(ports),
            ..Default::default()
        };
        // The first client node is taken: the next one is chosen, the server never.
        let _busy = UdpSocket::bind(("127.0.0.1", ports[1])).expect("bind");
        let (node, _sock) = claim_node(&cfg).expect("a free client node");
        assert_eq!(node.name, "client2");

        let named = LanaiConfig {
            node: Some("client".into()),
            ..cfg.clone()
        };
        let err = claim_node(&named).expect_err("port in use").to_string();
        assert!(
            err.contains(&format!(
                "fabric port 127.0.0.1:{} of node client is in use",
                ports[1]
            )),
            "{err}"
        );
        let unknown = LanaiConfig {
            node: Some("nope".into()),
            ..cfg
        };
        let err = claim_node(&unknown).expect_err("unknown node").to_string();
        assert!(err.contains("no node named \"nope\""), "{err}");
    }

    #[test]
    fn ipv4_addresses_are_refused_with_a_reason() {
        let (tx, rx) = qpip_verbs::reply::reply_channel();
        let cmd = Command::Connect {
            qp: 1,
            addr: "127.0.0.1:10809".parse().unwrap(),
            reply: tx,
        };
        assert!(refuse_ipv4(cmd).is_none());
        let err = rx.wait_until(None).expect("a reply").expect_err("refused");
        assert!(err.to_string().contains("IPv6 only"), "{err}");

        let (tx, _rx) = qpip_verbs::reply::reply_channel();
        let cmd = Command::Listen {
            id: 1,
            addr: "[fd00:4c41:4e41::1]:10809".parse().unwrap(),
            backlog: 1,
            reply: tx,
        };
        assert!(refuse_ipv4(cmd).is_some());
    }
}
