//! The host's 64-bit/33 MHz PCI bus as the NIC sees it: one shared medium on which the
//! host->NIC DMA engine (reads of host memory), the NIC->host engine (writes) and the host's
//! PIO writes take turns. PCI has one master at a time, so every transaction waits for the
//! bus, whichever engine issued it.
//!
//! A DMA is cut into bursts of `dma_burst_bytes`; each burst pays the bus overhead (address
//! phase, DEVSEL, turnaround) and, for reads, the host bridge's initial read latency before
//! its data phases of `pci_width_bits` each clock. Transactions are granted in the order they
//! are issued (the firmware issues them at its processor clock).

use crate::meter::Nanos;
use crate::params::DeviceParams;

/// What a bus transaction is, for the utilisation accounts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// DMA read of host memory (send data, WR fetches).
    Read,
    /// DMA write to host memory (received data, CQ entries).
    Write,
    /// A host PIO write to the NIC (doorbells, commands).
    Pio,
}

/// The bus: when it is next free and how long each use has held it.
#[derive(Clone, Debug)]
pub struct PciBus {
    clock_ns: f64,
    bytes_per_clock: usize,
    burst: usize,
    overhead_clocks: u64,
    read_latency_clocks: u64,
    pio_clocks: u64,
    pio_write_ns: Nanos,
    free: Nanos,
    /// When the last DMA write (data or CQ entry toward the host) ends.
    writes_done: Nanos,
    busy: [Nanos; 3],
}

impl PciBus {
    pub fn new(dev: &DeviceParams) -> Self {
        PciBus {
            clock_ns: 1000.0 / dev.pci_clock_mhz,
            bytes_per_clock: (dev.pci_width_bits / 8).max(1) as usize,
            burst: dev.dma_burst_bytes.max(1),
            overhead_clocks: dev.pci_burst_overhead_clocks,
            read_latency_clocks: dev.pci_read_latency_clocks,
            pio_clocks: dev.pio_bus_clocks,
            pio_write_ns: dev.pio_write_ns,
            free: 0,
            writes_done: 0,
            busy: [0; 3],
        }
    }

    /// Bus clocks a DMA of `len` bytes holds the bus.
    fn dma_clocks(&self, kind: Use, len: usize) -> u64 {
        let len = len.max(1);
        let bursts = len.div_ceil(self.burst) as u64;
        let data = len.div_ceil(self.bytes_per_clock) as u64;
        let latency = match kind {
            Use::Read => self.read_latency_clocks,
            _ => 0,
        };
        bursts * (self.overhead_clocks + latency) + data
    }

    /// Nanoseconds a DMA of `len` bytes holds an idle bus.
    pub fn dma_ns(&self, kind: Use, len: usize) -> Nanos {
        (self.dma_clocks(kind, len) as f64 * self.clock_ns).ceil() as Nanos
    }

    /// Sustained rate of long DMAs of `kind`, in MB/s (10^6 bytes per second).
    pub fn rate_mbps(&self, kind: Use) -> f64 {
        let n = 1 << 20;
        n as f64 * 1000.0 / self.dma_ns(kind, n) as f64
    }

    fn hold(&mut self, kind: Use, at: Nanos, ns: Nanos) -> Nanos {
        let start = at.max(self.free);
        self.free = start + ns;
        self.busy[kind as usize] += ns;
        start
    }

    /// A DMA of `len` bytes issued at `at`; returns when its last byte has crossed the bus
    /// (for a send, also when the DMA engine's IP checksum is known).
    pub fn dma(&mut self, kind: Use, at: Nanos, len: usize) -> Nanos {
        let ns = self.dma_ns(kind, len);
        let end = self.hold(kind, at, ns) + ns;
        if kind == Use::Write {
            self.writes_done = end;
        }
        end
    }

    /// A host PIO write issued at `at`; returns when it lands in the NIC.
    pub fn pio(&mut self, at: Nanos) -> Nanos {
        let ns = (self.pio_clocks as f64 * self.clock_ns).ceil() as Nanos;
        self.hold(Use::Pio, at, ns) + self.pio_write_ns
    }

    /// When the last DMA write issued so far has reached host memory.
    pub fn writes_done_at(&self) -> Nanos {
        self.writes_done
    }

    /// Time the bus has been held by `kind` since the last reset.
    pub fn busy_ns(&self, kind: Use) -> Nanos {
        self.busy[kind as usize]
    }

    pub fn reset_accounts(&mut self) {
        self.busy = [0; 3];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::LanaiParams;

    #[test]
    fn reads_are_slower_than_writes_and_both_below_the_bus_peak() {
        let bus = PciBus::new(&LanaiParams::default().device);
        let (r, w) = (bus.rate_mbps(Use::Read), bus.rate_mbps(Use::Write));
        assert!(r < w && w < 264.0, "read {r} MB/s, write {w} MB/s");
        // 256-byte bursts: 32 data clocks, plus 3 of overhead, plus 15 of read latency.
        assert!((r - 256.0 / (50.0 / 33.0)).abs() < 1.0, "{r}");
        assert!((w - 256.0 / (35.0 / 33.0)).abs() < 1.0, "{w}");
    }

    #[test]
    fn one_bus_serves_reads_writes_and_pio_in_turn() {
        let mut bus = PciBus::new(&LanaiParams::default().device);
        let r = bus.dma_ns(Use::Read, 4096);
        let w = bus.dma_ns(Use::Write, 4096);
        let end_r = bus.dma(Use::Read, 0, 4096);
        assert_eq!(end_r, r);
        // Issued at the same moment from the other engine: waits for the read.
        assert_eq!(bus.dma(Use::Write, 0, 4096), r + w);
        // A doorbell behind both.
        let landed = bus.pio(0);
        assert!(landed >= r + w, "{landed}");
        assert_eq!(bus.busy_ns(Use::Read), r);
        assert_eq!(bus.busy_ns(Use::Write), w);
    }
}
