//! The model's inputs: device, per-stage costs, host and fabric parameters, read from TOML
//! (`configs/lanai.toml`, `configs/fabric.toml`; both are embedded as the defaults).

use std::net::{Ipv6Addr, SocketAddr};
use std::path::Path;

use serde::Deserialize;

/// The device, cost table and host of `configs/lanai.toml`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LanaiParams {
    /// The NIC: processor, SRAM, PCI, buffers and what its hardware does itself.
    pub device: DeviceParams,
    pub(crate) cost: CostTable,
    /// The host CPU's own share of each message.
    pub host: HostParams,
}

/// Where the receive checksum is computed.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ChecksumAt {
    /// The receive DMA engine's checksum assist: free for the processor.
    Hardware,
    /// The LANai sums every byte itself (the cost model's checksum loop).
    Firmware,
}

/// The `[device]` table: the LANai 9 NIC the firmware runs on.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeviceParams {
    /// The LANai processor's clock; every firmware stage's cycles are counted at it.
    pub clock_mhz: f64,
    pub(crate) sram_bytes: u64,
    pub(crate) firmware_bytes: u64,
    pub(crate) pci_width_bits: u32,
    pub(crate) pci_clock_mhz: f64,
    /// Bytes per PCI burst the DMA engines are programmed for.
    pub dma_burst_bytes: usize,
    /// Bus clocks each burst spends outside its data phases (address, DEVSEL, turnaround).
    pub pci_burst_overhead_clocks: u64,
    /// Bus clocks the host bridge takes to deliver the first data of a read burst.
    pub pci_read_latency_clocks: u64,
    /// Bus clocks one PIO write holds the bus.
    pub pio_bus_clocks: u64,
    /// From the host's store to the write landing in the NIC.
    pub pio_write_ns: u64,
    /// Doorbells the NIC queues before the host has to wait for room.
    pub doorbell_fifo_entries: usize,
    /// SRAM buffers a segment is staged in between its PCI DMA and the wire.
    pub send_staging_buffers: usize,
    /// Bytes the SRAM moves per processor clock (its one port, shared with the DMA engines).
    pub sram_bytes_per_cycle: usize,
    /// SRAM buffers a received frame is held in until its DMA to host memory is done.
    pub recv_staging_buffers: usize,
    /// Who checksums received segments.
    pub recv_checksum: ChecksumAt,
    /// Instructions the firmware's checksum loop issues per 32-bit word (one per cycle
    /// when memory does not hold it up), loop overhead included.
    pub firmware_checksum_instructions_per_word: f64,
    /// Loads that loop makes per 32-bit word.
    pub firmware_checksum_loads_per_word: f64,
    /// Cycles a load's time step takes beyond one: its data access and the next
    /// instruction's fetch both need the one SRAM port.
    pub sram_load_extra_cycles: f64,
    /// The cycles per word other forms of the loop and of the memory would take: the
    /// prediction is also shown at both ends.
    pub firmware_checksum_cycles_per_word_range: [f64; 2],
    pub(crate) qp_state_bytes: u64,
    pub(crate) tcb_bytes: u64,
    pub(crate) wr_cache_entries: u64,
    pub(crate) wr_entry_bytes: u64,
    pub(crate) tcp_send_buffer: usize,
    pub(crate) tcp_recv_buffer: usize,
    /// Nagle's algorithm off on the firmware's TCP connections (a program's TCP_NODELAY);
    /// off by default: with data in flight only full segments go (RFC 1122 4.2.3.4).
    #[serde(default)]
    pub tcp_nodelay: bool,
    pub(crate) udp_buffer: usize,
    /// What-if hardware support (all off on the LANai 9): doorbells decoded in hardware
    /// (no firmware doorbell stage), connection demultiplexing in hardware, a hardware
    /// multiplier for the RTT estimators.
    #[serde(default)]
    pub hw_doorbell: bool,
    /// Connection demultiplexing in hardware (see `hw_doorbell`).
    #[serde(default)]
    pub hw_demux: bool,
    /// A hardware multiplier for the RTT estimators (see `hw_doorbell`).
    #[serde(default)]
    pub hw_multiply: bool,
}

impl DeviceParams {
    /// Processor cycles the firmware's checksum loop takes per 32-bit word: its
    /// instructions, plus the extra cycle of each load on the one-port SRAM. (Cycles DMA
    /// engines take from the SRAM meanwhile stretch the stage on top: `memport`.)
    pub fn firmware_checksum_cycles_per_word(&self) -> f64 {
        self.firmware_checksum_instructions_per_word
            + self.firmware_checksum_loads_per_word * self.sram_load_extra_cycles
    }

    /// Cycles to checksum `bytes` (whole 32-bit words; a short tail costs a word).
    pub fn firmware_checksum_cycles(&self, bytes: usize) -> f64 {
        bytes.div_ceil(4) as f64 * self.firmware_checksum_cycles_per_word()
    }

    /// Nanoseconds the firmware needs to checksum one byte at the NIC's clock.
    pub fn firmware_checksum_ns_per_byte(&self) -> f64 {
        self.firmware_checksum_cycles_per_word() / 4.0 * 1000.0 / self.clock_mhz
    }
}

/// Microseconds per firmware stage (DESIGN.md section 4).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CostTable {
    pub(crate) send: SendCosts,
    pub(crate) recv: RecvCosts,
    pub(crate) udp: UdpCosts,
    pub(crate) split: SplitCosts,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct SendCosts {
    pub(crate) data: SendStages,
    pub(crate) ack: SendStages,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecvCosts {
    pub(crate) data: RecvStages,
    pub(crate) ack: RecvStages,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct SendStages {
    pub(crate) doorbell: f64,
    pub(crate) schedule: f64,
    pub(crate) get_wr: f64,
    pub(crate) get_data: f64,
    pub(crate) build_tcp_header: f64,
    pub(crate) build_ip_header: f64,
    pub(crate) send: f64,
    pub(crate) update: f64,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecvStages {
    pub(crate) doorbell: f64,
    pub(crate) media_receive: f64,
    pub(crate) ip_parse: f64,
    pub(crate) tcp_parse: f64,
    pub(crate) get_wr: f64,
    pub(crate) put_data: f64,
    pub(crate) update: f64,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct UdpCosts {
    pub(crate) build_udp_header: f64,
    pub(crate) udp_parse: f64,
}

/// Parts of the stages that hardware support would remove (the what-if table).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SplitCosts {
    pub(crate) ack_parse_multiply: f64,
    pub(crate) ack_update_multiply: f64,
    pub(crate) tcp_demux: f64,
}

/// The `[host]` table: the host CPU's own cost of a message through QPIP.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostParams {
    pub(crate) cpu_mhz: f64,
    /// Host CPU time each posted send costs.
    pub send_overhead_us: f64,
    /// Host CPU time each receive costs (posting its WR and handling its completion).
    pub recv_overhead_us: f64,
    /// Host time per byte a program copies in memory (a `read()`/`write()` through the page
    /// cache, a bounce buffer copied out); configs/lanai.toml gives the derivation.
    #[serde(default = "default_copy_ns_per_byte")]
    pub copy_ns_per_byte: f64,
}

/// The embedded configs/lanai.toml's value, for parameter files written before it existed.
fn default_copy_ns_per_byte() -> f64 {
    3.75
}

/// The fabric of `configs/fabric.toml`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FabricParams {
    /// Each link's speed, each way.
    pub link_gbps: f64,
    pub(crate) switch_latency_ns: u64,
    pub(crate) cable_ns: u64,
    /// Largest IPv6 packet a frame carries.
    pub mtu: usize,
    /// The hosts on the fabric.
    #[serde(default)]
    pub node: Vec<NodeParams>,
    /// Where frames for addresses no node owns go: a TUN device into the host's own stack.
    pub bridge: Option<BridgeParams>,
}

/// One `[[node]]`: a host on the fabric.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeParams {
    /// What `--lanai-node` calls it.
    pub name: String,
    /// Its NIC's IPv6 address.
    pub addr: Ipv6Addr,
    pub(crate) route: Vec<u8>,
    /// Real-time mode: where this node's emulated NIC port binds on the local machine.
    pub port: Option<SocketAddr>,
}

/// The `[bridge]` table: the fabric port that carries frames to and from a TUN device, so
/// that the host kernel's TCP/IP reaches firmware QPs (`qpip-lanai-bridge`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BridgeParams {
    pub(crate) name: String,
    pub(crate) route: Vec<u8>,
    /// Where the bridge's fabric port binds on this machine.
    pub port: Option<SocketAddr>,
    pub(crate) tun: String,
    /// The kernel's own address on the TUN device.
    pub host_addr: Ipv6Addr,
    pub(crate) prefix_len: u8,
}

impl FabricParams {
    /// The emulated crossbar: switch output port (first route byte) to the datagram socket
    /// of the node or bridge behind it.
    pub(crate) fn crossbar(&self) -> std::collections::HashMap<u8, SocketAddr> {
        let mut ports = std::collections::HashMap::new();
        let nodes = self.node.iter().map(|n| (&n.route, n.port));
        let bridge = self.bridge.iter().map(|b| (&b.route, b.port));
        for (route, port) in nodes.chain(bridge) {
            if let (Some(&out), Some(port)) = (route.first(), port) {
                ports.entry(out).or_insert(port);
            }
        }
        ports
    }

    /// Nanoseconds a link needs to serialise `bytes`.
    pub fn wire_ns(&self, bytes: usize) -> u64 {
        (bytes as f64 * 8.0 / self.link_gbps).ceil() as u64
    }
    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&NodeParams> {
        self.node.iter().find(|n| n.name == name)
    }
    pub(crate) fn node_by_addr(&self, addr: &Ipv6Addr) -> Option<&NodeParams> {
        self.node.iter().find(|n| n.addr == *addr)
    }
    /// The source route to `addr`: its node's, or the bridge's for addresses no node owns.
    pub fn route_to(&self, addr: &Ipv6Addr) -> Option<&[u8]> {
        match self.node_by_addr(addr) {
            Some(n) => Some(&n.route),
            None => self.bridge.as_ref().map(|b| b.route.as_slice()),
        }
    }
}

/// Why a parameter file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ParamsError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What reading it said.
        source: std::io::Error,
    },
    /// The file is not valid TOML for these parameters.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the TOML parser said.
        message: String,
    },
}

const DEFAULT_LANAI: &str = include_str!("../../configs/lanai.toml");
const DEFAULT_FABRIC: &str = include_str!("../../configs/fabric.toml");

fn parse<T: for<'de> Deserialize<'de>>(text: &str, path: &str) -> Result<T, ParamsError> {
    toml::from_str(text).map_err(|e| ParamsError::Parse {
        path: path.to_string(),
        message: e.to_string(),
    })
}

fn load<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ParamsError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ParamsError::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown)
}

impl Default for LanaiParams {
    /// The embedded `configs/lanai.toml`.
    fn default() -> Self {
        // Invariant: the embedded file is checked by the `embedded_defaults_parse` test.
        parse(DEFAULT_LANAI, "configs/lanai.toml").expect("embedded configs/lanai.toml")
    }
}

impl LanaiParams {
    /// Reads a `configs/lanai.toml`-style file.
    pub fn load(path: &Path) -> Result<Self, ParamsError> {
        load(path)
    }
}

impl Default for FabricParams {
    /// The embedded `configs/fabric.toml`.
    fn default() -> Self {
        parse(DEFAULT_FABRIC, "configs/fabric.toml").expect("embedded configs/fabric.toml")
    }
}

impl FabricParams {
    /// Reads a `configs/fabric.toml`-style file.
    pub fn load(path: &Path) -> Result<Self, ParamsError> {
        load(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_parse() {
        let p = LanaiParams::default();
        assert_eq!(p.device.sram_bytes, 2 << 20);
        assert_eq!(p.cost.recv.ack.tcp_parse, 14.0);
        let f = FabricParams::default();
        assert_eq!(f.mtu, 16384);
        assert!(f.node("server").is_some());
    }

    #[test]
    fn wire_time_follows_the_link_rate_and_checksum_the_clock() {
        let f = FabricParams::default();
        assert_eq!(f.wire_ns(250), 1000);
        // Instructions plus the loads' extra cycles, per 4 bytes, at 133 MHz.
        let mut p = LanaiParams::default();
        let d = &p.device;
        let cpw = d.firmware_checksum_instructions_per_word
            + d.firmware_checksum_loads_per_word * d.sram_load_extra_cycles;
        let ns = d.firmware_checksum_ns_per_byte();
        assert!((ns - cpw / 4.0 * 1000.0 / 133.0).abs() < 1e-9, "{ns}");
        let [lo, hi] = d.firmware_checksum_cycles_per_word_range;
        assert!(lo <= cpw && cpw <= hi, "{lo} <= {cpw} <= {hi}");
        // A load that takes no extra cycle leaves the instruction count.
        p.device.sram_load_extra_cycles = 0.0;
        assert_eq!(
            p.device.firmware_checksum_cycles_per_word(),
            p.device.firmware_checksum_instructions_per_word
        );
    }

    #[test]
    fn unknown_addresses_route_to_the_bridge() {
        let f = FabricParams::default();
        let kernel: Ipv6Addr = "fd00:4c41:4e41::fe".parse().unwrap();
        assert_eq!(f.route_to(&kernel), Some(&[0u8][..]));
    }
}
