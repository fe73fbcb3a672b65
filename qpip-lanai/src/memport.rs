//! The LANai 9's local memory as one port shared by the NIC processor and the DMA engines
//! (host PCI DMA, network send and receive DMA). It runs at the processor's clock and moves
//! `sram_bytes_per_cycle` bytes per cycle; every cycle a DMA engine takes is one the
//! processor, which runs its firmware from that memory, waits (DMA engines stream at fixed
//! rates and win arbitration). So a firmware stage that overlaps DMA traffic takes longer by
//! the memory cycles the DMAs took meanwhile. Times are virtual nanoseconds.

#[derive(Clone, Debug)]
pub(crate) struct MemPort {
    cycle_ns: f64,
    bytes_per_cycle: usize,
    /// DMA transfers through the memory: (start, end, fraction of the cycles they take).
    dma: Vec<(u64, u64, f64)>,
}

impl MemPort {
    pub(crate) fn new(clock_mhz: f64, bytes_per_cycle: usize) -> Self {
        MemPort {
            cycle_ns: 1000.0 / clock_mhz,
            bytes_per_cycle: bytes_per_cycle.max(1),
            dma: Vec::new(),
        }
    }

    /// A DMA engine moves `bytes` through the memory, evenly over `[start, end)`.
    pub(crate) fn dma(&mut self, start: u64, end: u64, bytes: usize) {
        if end > start && bytes > 0 {
            let cycles = bytes.div_ceil(self.bytes_per_cycle) as f64 * self.cycle_ns;
            let share = (cycles / (end - start) as f64).min(1.0);
            self.dma.push((start, end, share));
        }
    }

    /// When the processor, with `work` ns of its own cycles to run from `start`, is done:
    /// `work` stretched by the cycles DMA engines take meanwhile.
    pub(crate) fn stretch(&self, start: u64, work: u64) -> u64 {
        let mut t = start as f64;
        let mut left = work as f64;
        while left > 0.0 {
            let mut load = 0.0;
            let mut next = f64::INFINITY;
            for &(s, e, share) in &self.dma {
                let (s, e) = (s as f64, e as f64);
                if s <= t && t < e {
                    load += share;
                    next = next.min(e);
                } else if s > t {
                    next = next.min(s);
                }
            }
            let free = (1.0 - load).max(0.0);
            if free > 0.0 && (next - t) * free >= left {
                t += left / free;
                break;
            }
            left -= (next - t) * free;
            t = next;
        }
        t.ceil() as u64
    }

    /// Forgets transfers over by `now` (no stage starts earlier again).
    pub(crate) fn retire(&mut self, now: u64) {
        self.dma.retain(|&(_, e, _)| e > now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_overlapping_dma_is_slower_by_the_cycles_the_dma_takes() {
        let mut m = MemPort::new(133.0, 8);
        // Idle memory: the stage takes its cost.
        assert_eq!(m.stretch(0, 5_500), 5_500);
        // A 16 KiB PCI DMA over 100 µs takes 2048 of the memory's cycles in that time.
        m.dma(0, 100_000, 16384);
        let share: f64 = 2048.0 * (1000.0 / 133.0) / 100_000.0;
        let expect = (5_500.0 / (1.0 - share)).ceil() as u64;
        assert_eq!(m.stretch(0, 5_500), expect);
        assert!(expect > 6_400, "{expect}");
        // A stage that runs past the DMA's end is stretched only while they overlap.
        let lost = (99_000.0 * share).ceil() as u64;
        let end = m.stretch(1_000, 100_000);
        assert!(
            end.abs_diff(101_000 + lost) <= 1,
            "{end} vs {}",
            101_000 + lost
        );
        m.retire(100_000);
        assert_eq!(m.stretch(100_000, 5_500), 105_500);
    }
}
