//! The NIC processor's time: every firmware stage is charged its cost from the table, so the
//! same firmware code predicts occupancy and latency in virtual time and merely counts in
//! real time.
//!
//! Time is nanoseconds since the NIC's epoch (`Nanos`). A handler starts at
//! `max(event time, processor free)`; each `charge` advances the processor clock; frames and
//! completions produced by the handler carry the clock at the moment they were produced.

use std::collections::BTreeMap;

use super::memport::MemPort;
use super::params::{ChecksumAt, LanaiParams};

/// Nanoseconds since the NIC's epoch (virtual or real).
pub(crate) type Nanos = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    Send,
    Recv,
}

/// Whether the packet carries data or is a bare ACK (UDP datagrams count as data).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Data,
    Ack,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    Doorbell,
    Schedule,
    GetWr,
    GetData,
    BuildTcpHeader,
    BuildUdpHeader,
    BuildIpHeader,
    Send,
    MediaReceive,
    IpParse,
    TcpParse,
    UdpParse,
    /// Firmware receive checksum (only when the hardware does not sum on receive).
    Checksum,
    PutData,
    Update,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Doorbell => "doorbell",
            Stage::Schedule => "schedule",
            Stage::GetWr => "get_wr",
            Stage::GetData => "get_data",
            Stage::BuildTcpHeader => "build_tcp_header",
            Stage::BuildUdpHeader => "build_udp_header",
            Stage::BuildIpHeader => "build_ip_header",
            Stage::Send => "send",
            Stage::MediaReceive => "media_receive",
            Stage::IpParse => "ip_parse",
            Stage::TcpParse => "tcp_parse",
            Stage::UdpParse => "udp_parse",
            Stage::Checksum => "checksum",
            Stage::PutData => "put_data",
            Stage::Update => "update",
        }
    }
}

/// The cost of each stage after the what-if hardware flags and the processor clock are
/// applied.
#[derive(Clone, Debug)]
pub struct CostModel {
    params: LanaiParams,
    /// Costs in the table are for 133 MHz; a faster processor divides them.
    scale: f64,
}

impl CostModel {
    pub fn new(params: &LanaiParams) -> Self {
        CostModel {
            params: params.clone(),
            scale: 133.0 / params.device.clock_mhz,
        }
    }

    pub fn params(&self) -> &LanaiParams {
        &self.params
    }

    /// Nanoseconds the processor spends in `stage`; `payload` is the bytes summed by a
    /// firmware checksum.
    pub fn stage_ns(&self, dir: Dir, kind: Kind, stage: Stage, payload: usize) -> Nanos {
        let d = &self.params.device;
        let c = &self.params.cost;
        let us = match dir {
            Dir::Send => {
                let s = match kind {
                    Kind::Data => &c.send.data,
                    Kind::Ack => &c.send.ack,
                };
                match stage {
                    Stage::Doorbell if d.hw_doorbell => 0.0,
                    Stage::Doorbell => s.doorbell,
                    Stage::Schedule => s.schedule,
                    Stage::GetWr => s.get_wr,
                    Stage::GetData => s.get_data,
                    Stage::BuildTcpHeader => s.build_tcp_header,
                    Stage::BuildUdpHeader => c.udp.build_udp_header,
                    Stage::BuildIpHeader => s.build_ip_header,
                    Stage::Send => s.send,
                    Stage::Update => s.update,
                    _ => 0.0,
                }
            }
            Dir::Recv => {
                let s = match kind {
                    Kind::Data => &c.recv.data,
                    Kind::Ack => &c.recv.ack,
                };
                match stage {
                    Stage::Doorbell if d.hw_doorbell => 0.0,
                    Stage::Doorbell => s.doorbell,
                    Stage::MediaReceive => s.media_receive,
                    Stage::IpParse => s.ip_parse,
                    Stage::TcpParse => {
                        let mut t = s.tcp_parse;
                        if d.hw_demux {
                            t -= c.split.tcp_demux;
                        }
                        if d.hw_multiply && kind == Kind::Ack {
                            t -= c.split.ack_parse_multiply;
                        }
                        t
                    }
                    Stage::UdpParse => c.udp.udp_parse,
                    Stage::Checksum => match d.recv_checksum {
                        ChecksumAt::Hardware => 0.0,
                        // Cycles at the table's 133 MHz, in µs; scaled to the clock below.
                        ChecksumAt::Firmware => d.firmware_checksum_cycles(payload) / 133.0,
                    },
                    Stage::GetWr => s.get_wr,
                    Stage::PutData => s.put_data,
                    Stage::Update => {
                        let mut t = s.update;
                        if d.hw_multiply && kind == Kind::Ack {
                            t -= c.split.ack_update_multiply;
                        }
                        t
                    }
                    _ => 0.0,
                }
            }
        };
        (us.max(0.0) * 1000.0 * self.scale).round() as Nanos
    }
}

/// Occupancy of one (direction, kind) pair: time per stage and packets seen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Occupancy {
    pub packets: u64,
    pub stage_ns: BTreeMap<Stage, Nanos>,
}

impl Occupancy {
    /// Mean microseconds per packet, per stage.
    pub fn per_packet_us(&self) -> BTreeMap<&'static str, f64> {
        let n = self.packets.max(1) as f64;
        self.stage_ns
            .iter()
            .map(|(s, ns)| (s.name(), *ns as f64 / 1000.0 / n))
            .collect()
    }
}

/// The NIC processor's clock and its occupancy accounts.
#[derive(Clone, Debug)]
pub struct Meter {
    costs: CostModel,
    /// The SRAM the processor shares with the DMA engines.
    memory: MemPort,
    clock: Nanos,
    busy: Nanos,
    accounts: BTreeMap<(Dir, Kind), Occupancy>,
}

impl Meter {
    pub fn new(costs: CostModel) -> Self {
        let d = &costs.params.device;
        Meter {
            memory: MemPort::new(d.clock_mhz, d.sram_bytes_per_cycle),
            costs,
            clock: 0,
            busy: 0,
            accounts: BTreeMap::new(),
        }
    }

    pub fn costs(&self) -> &CostModel {
        &self.costs
    }

    /// Starts a handler for an event that happened at `now`: the processor picks it up when
    /// it is free.
    pub fn begin(&mut self, now: Nanos) {
        self.clock = self.clock.max(now);
        self.memory.retire(now);
    }

    /// A DMA engine moves `bytes` through the NIC's SRAM over `[start, end)`: stages that
    /// overlap it wait for the memory cycles it takes.
    pub fn sram_dma(&mut self, start: Nanos, end: Nanos, bytes: usize) {
        self.memory.dma(start, end, bytes);
    }

    /// The processor's clock: when the stage being run ends.
    pub fn now(&self) -> Nanos {
        self.clock
    }

    /// Charges `stage` (with `payload` bytes for a firmware checksum) and advances the clock,
    /// by its cost plus the SRAM cycles DMA engines take meanwhile.
    pub fn charge(&mut self, dir: Dir, kind: Kind, stage: Stage, payload: usize) {
        let work = self.costs.stage_ns(dir, kind, stage, payload);
        let start = self.clock;
        self.clock = self.memory.stretch(start, work);
        let ns = self.clock - start;
        self.busy += ns;
        *self
            .accounts
            .entry((dir, kind))
            .or_default()
            .stage_ns
            .entry(stage)
            .or_default() += ns;
    }

    /// Counts one packet sent or received (the divisor of the per-packet occupancy).
    pub fn count_packet(&mut self, dir: Dir, kind: Kind) {
        self.accounts.entry((dir, kind)).or_default().packets += 1;
    }

    /// Total processor time charged so far.
    pub fn busy_ns(&self) -> Nanos {
        self.busy
    }

    pub fn occupancy(&self, dir: Dir, kind: Kind) -> Occupancy {
        self.accounts.get(&(dir, kind)).cloned().unwrap_or_default()
    }

    /// Forgets the accounts (not the clock): measure a phase on its own.
    pub fn reset_accounts(&mut self) {
        self.accounts.clear();
        self.busy = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_charged_and_hardware_support_removes_its_parts() {
        let mut p = LanaiParams::default();
        let m = CostModel::new(&p);
        assert_eq!(m.stage_ns(Dir::Recv, Kind::Ack, Stage::TcpParse, 0), 14_000);
        p.device.hw_multiply = true;
        p.device.hw_doorbell = true;
        let m = CostModel::new(&p);
        assert_eq!(m.stage_ns(Dir::Recv, Kind::Ack, Stage::TcpParse, 0), 8_000);
        assert_eq!(m.stage_ns(Dir::Send, Kind::Data, Stage::Doorbell, 0), 0);
        p.device.clock_mhz = 266.0;
        let m = CostModel::new(&p);
        assert_eq!(m.stage_ns(Dir::Send, Kind::Data, Stage::GetWr, 0), 2_750);
    }

    #[test]
    fn the_firmware_checksum_costs_its_cycles_per_word() {
        let mut p = LanaiParams::default();
        p.device.recv_checksum = ChecksumAt::Firmware;
        let m = CostModel::new(&p);
        let ns = |bytes| m.stage_ns(Dir::Recv, Kind::Data, Stage::Checksum, bytes);
        // Twice the words, twice the time; a partial word costs a whole one.
        assert_eq!(ns(8000), 2 * ns(4000));
        assert_eq!(ns(4001), ns(4004));
        let cpw = p.device.firmware_checksum_cycles_per_word();
        let want = 1000.0 * cpw / 133.0 * 1000.0; // 1000 words at 133 MHz, in ns
        assert!(
            (ns(4000) as f64 - want).abs() <= 1.0,
            "{} vs {want}",
            ns(4000)
        );
        // Each extra cycle a load takes adds one cycle per word loaded.
        p.device.sram_load_extra_cycles += 1.0;
        let slower = CostModel::new(&p).stage_ns(Dir::Recv, Kind::Data, Stage::Checksum, 4000);
        let per_word = p.device.firmware_checksum_loads_per_word * 1000.0 / 133.0;
        assert!((slower as f64 - ns(4000) as f64 - 1000.0 * per_word).abs() <= 2.0);
        // The hardware sum costs the processor nothing.
        p.device.recv_checksum = ChecksumAt::Hardware;
        assert_eq!(
            CostModel::new(&p).stage_ns(Dir::Recv, Kind::Data, Stage::Checksum, 4000),
            0
        );
    }

    #[test]
    fn a_handler_starts_when_the_processor_is_free() {
        let mut meter = Meter::new(CostModel::new(&LanaiParams::default()));
        meter.begin(1_000);
        meter.charge(Dir::Send, Kind::Data, Stage::GetWr, 0);
        assert_eq!(meter.now(), 6_500);
        meter.begin(2_000); // arrived while busy: waits
        assert_eq!(meter.now(), 6_500);
        meter.count_packet(Dir::Send, Kind::Data);
        let occ = meter.occupancy(Dir::Send, Kind::Data);
        assert_eq!(occ.per_packet_us()["get_wr"], 5.5);
    }
}
