//! The host's 64-bit/33 MHz PCI bus as the NIC sees it: one shared medium on which the
//! host->NIC DMA engine (reads of host memory), the NIC->host engine (writes) and the host's
//! PIO writes take turns. PCI has one master at a time, so every transaction waits for the
//! bus, whichever engine issued it.
//!
//! A DMA is cut into bursts of `dma_burst_bytes`; each burst pays the bus overhead (address
//! phase, DEVSEL, turnaround) and, for reads, the host bridge's initial read latency before
//! its data phases of `pci_width_bits` each clock.
//!
//! Arbitration is per transaction (a burst, or one PIO write) in virtual-time order of the
//! request: the firmware books DMAs at its processor clock, which may run ahead of the
//! events still to come, so a later-issued request that starts earlier takes the idle bus
//! between the bookings (a DMA's bursts fill the gaps they fit) instead of queueing behind
//! them. A booking is never moved once its end has been reported, so a request that does not
//! fit before a booking waits for that booking's end.

use std::collections::BTreeMap;

use crate::meter::{Meter, Nanos};
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
    /// Booked transactions: start -> end, adjacent ones merged.
    booked: BTreeMap<Nanos, Nanos>,
    /// When every DMA write issued so far (data or CQ entry toward the host) has ended.
    writes_done: Nanos,
    busy: [Nanos; 3],
}

impl PciBus {
    /// An idle bus of `dev`'s width, clock and burst costs.
    pub fn new(dev: &DeviceParams) -> Self {
        PciBus {
            clock_ns: 1000.0 / dev.pci_clock_mhz,
            bytes_per_clock: (dev.pci_width_bits / 8).max(1) as usize,
            burst: dev.dma_burst_bytes.max(1),
            overhead_clocks: dev.pci_burst_overhead_clocks,
            read_latency_clocks: dev.pci_read_latency_clocks,
            pio_clocks: dev.pio_bus_clocks,
            pio_write_ns: dev.pio_write_ns,
            booked: BTreeMap::new(),
            writes_done: 0,
            busy: [0; 3],
        }
    }

    /// Bus clocks of a burst of `bytes`.
    fn burst_clocks(&self, kind: Use, bytes: usize) -> u64 {
        let latency = match kind {
            Use::Read => self.read_latency_clocks,
            _ => 0,
        };
        self.overhead_clocks + latency + bytes.div_ceil(self.bytes_per_clock) as u64
    }

    /// Bus clocks of the first `n` of the `total` bursts of a `len`-byte DMA (the last
    /// burst carries the remainder).
    fn bursts_clocks(&self, kind: Use, len: usize, total: usize, n: usize) -> u64 {
        let full = self.burst_clocks(kind, self.burst);
        if n < total {
            return n as u64 * full;
        }
        let last = len - (total - 1) * self.burst;
        (total as u64 - 1) * full + self.burst_clocks(kind, last)
    }

    fn ns(&self, clocks: u64) -> Nanos {
        (clocks as f64 * self.clock_ns).ceil() as Nanos
    }

    /// Nanoseconds a DMA of `len` bytes holds an idle bus.
    pub fn dma_ns(&self, kind: Use, len: usize) -> Nanos {
        let len = len.max(1);
        let total = len.div_ceil(self.burst);
        self.ns(self.bursts_clocks(kind, len, total, total))
    }

    /// Sustained rate of long DMAs of `kind`, in MB/s (10^6 bytes per second).
    pub fn rate_mbps(&self, kind: Use) -> f64 {
        let n = 1 << 20;
        n as f64 * 1000.0 / self.dma_ns(kind, n) as f64
    }

    /// The first idle stretch at or after `at`: its start and (if another booking follows)
    /// its end.
    fn gap(&self, at: Nanos) -> (Nanos, Option<Nanos>) {
        let mut t = at;
        if let Some((_, &end)) = self.booked.range(..=t).next_back() {
            t = t.max(end);
        }
        let next = self.booked.range(t..).next().map(|(&s, _)| s);
        (t, next)
    }

    fn book(&mut self, kind: Use, start: Nanos, end: Nanos) {
        self.busy[kind as usize] += end - start;
        let mut s = start;
        let mut e = end;
        if let Some((&ps, &pe)) = self.booked.range(..=s).next_back()
            && pe == s
        {
            self.booked.remove(&ps);
            s = ps;
        }
        if let Some(ne) = self.booked.remove(&e) {
            e = ne;
        }
        self.booked.insert(s, e);
    }

    /// A DMA of `len` bytes the firmware starts now: its bursts also take the NIC's SRAM
    /// cycles from the processor while they run.
    pub fn dma_now(&mut self, kind: Use, meter: &mut Meter, len: usize) -> Nanos {
        self.dma(kind, meter.now(), len, |s, e, b| meter.sram_dma(s, e, b))
    }

    /// A DMA of `len` bytes requested at `at`: its bursts take the first idle stretches
    /// they fit, each reported to `moved` as (start, end, bytes); returns the end of its
    /// last burst (for a send, also when the DMA engine's IP checksum is known).
    pub fn dma(
        &mut self,
        kind: Use,
        at: Nanos,
        len: usize,
        mut moved: impl FnMut(Nanos, Nanos, usize),
    ) -> Nanos {
        let len = len.max(1);
        let total = len.div_ceil(self.burst);
        let mut left = total;
        let mut t = at;
        loop {
            let done = total - left;
            let (start, limit) = self.gap(t);
            // The clocks of this DMA's bursts done..done+n.
            let clocks = |n: usize| {
                self.bursts_clocks(kind, len, total, done + n)
                    - self.bursts_clocks(kind, len, total, done)
            };
            let fits = |n: usize| limit.is_none_or(|l| start + self.ns(clocks(n)) <= l);
            let n = if fits(left) {
                left
            } else {
                (0..left).take_while(|&n| fits(n + 1)).count()
            };
            if n == 0 {
                t = limit.map_or(start, |l| self.booked.get(&l).copied().unwrap_or(l));
                continue;
            }
            let end = start + self.ns(clocks(n));
            self.book(kind, start, end);
            moved(start, end, (len - done * self.burst).min(n * self.burst));
            left -= n;
            if left == 0 {
                if kind == Use::Write {
                    self.writes_done = self.writes_done.max(end);
                }
                return end;
            }
            t = end;
        }
    }

    /// A host PIO write issued at `at`; returns when it lands in the NIC.
    pub fn pio(&mut self, at: Nanos) -> Nanos {
        let ns = self.ns(self.pio_clocks);
        let mut t = at;
        loop {
            let (start, limit) = self.gap(t);
            if limit.is_none_or(|l| start + ns <= l) {
                self.book(Use::Pio, start, start + ns);
                // pio_write_ns covers the bus clocks and the bridge's forwarding.
                return start + self.pio_write_ns;
            }
            t = limit.map_or(start, |l| self.booked.get(&l).copied().unwrap_or(l));
        }
    }

    /// Forgets bookings that ended by `now` (no request is made before the current event).
    pub fn retire(&mut self, now: Nanos) {
        while let Some((&s, &e)) = self.booked.first_key_value()
            && e <= now
        {
            self.booked.remove(&s);
        }
    }

    /// When the last DMA write issued so far has reached host memory.
    pub fn writes_done_at(&self) -> Nanos {
        self.writes_done
    }

    /// Time the bus has been held by `kind` since the last reset.
    pub fn busy_ns(&self, kind: Use) -> Nanos {
        self.busy[kind as usize]
    }

    pub(crate) fn reset_accounts(&mut self) {
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
        let end_r = bus.dma(Use::Read, 0, 4096, |_, _, _| {});
        assert_eq!(end_r, r);
        // Issued at the same moment from the other engine: waits for the read.
        assert_eq!(bus.dma(Use::Write, 0, 4096, |_, _, _| {}), r + w);
        // A doorbell behind both.
        let landed = bus.pio(0);
        assert!(landed >= r + w, "{landed}");
        assert_eq!(bus.busy_ns(Use::Read), r);
        assert_eq!(bus.busy_ns(Use::Write), w);
    }

    #[test]
    fn the_bus_serves_requests_in_the_time_order_of_their_start() {
        let mut bus = PciBus::new(&LanaiParams::default().device);
        let burst = bus.dma_ns(Use::Read, 256);
        let r4k = bus.dma_ns(Use::Read, 4096);
        // The firmware, its clock ahead, books a DMA for 100 µs.
        assert_eq!(
            bus.dma(Use::Read, 100_000, 4096, |_, _, _| {}),
            100_000 + r4k
        );
        // A doorbell the host writes at 1 µs does not wait behind it.
        assert_eq!(bus.pio(1_000), 1_000 + bus.pio_write_ns);
        // A DMA requested at 2 µs takes the idle bus before the booking: four bursts fit
        // between 100 µs - 4.5 bursts and the booking, the rest follow the booking.
        let at = 100_000 - burst * 9 / 2;
        let end = bus.dma(Use::Read, at, 8 * 256, |_, _, _| {});
        let four = bus.dma_ns(Use::Read, 4 * 256);
        assert_eq!(end, 100_000 + r4k + four);
        // A PIO that does not fit before the booking waits for its end, no longer.
        let landed = bus.pio(100_000 - 10);
        assert_eq!(landed, 100_000 + r4k + four + bus.pio_write_ns);
        // Busy accounts count each transaction once.
        assert_eq!(bus.busy_ns(Use::Read), r4k + 2 * four);
        bus.retire(u64::MAX);
        assert_eq!(
            bus.dma(Use::Write, 0, 8, |_, _, _| {}),
            bus.dma_ns(Use::Write, 8)
        );
    }
}
