//! Completion entries on their way to the host: each one the firmware makes is written to
//! the host's CQ by its own DMA, and the host sees that completion when that write has
//! reached host memory (not when the handler's last DMA ends).

use std::collections::VecDeque;

use crate::meter::{Meter, Nanos};
use crate::pci::{PciBus, Use};
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::QpNum;

/// Bytes of one completion entry written to the host's CQ.
const CQ_ENTRY_BYTES: usize = 32;

/// A QP's send and receive WRs not yet completed: a drop between two looks is the number
/// of completions made in between (the host posts only between handlers in virtual time;
/// in real time a racing post can hide one from the bus account, which nothing reads).
#[derive(Clone, Copy, Debug)]
pub(super) struct Outstanding(usize, usize);

impl Outstanding {
    pub(super) fn of(qp: &QpShared) -> Self {
        Outstanding(qp.outstanding_sends(), qp.outstanding_recvs())
    }
}

/// The CQ entries written during the current handler, in the order they were written.
#[derive(Debug, Default)]
pub(crate) struct CqWrites {
    /// (QP, a receive completion, when its entry is in host memory).
    done: VecDeque<(QpNum, bool, Nanos)>,
}

impl CqWrites {
    /// A new handler: the simulation has taken what the last one wrote.
    pub(super) fn begin(&mut self) {
        self.done.clear();
    }

    /// Writes one CQ entry per completion `qp` made since `seen` (sends first: each kind's
    /// order is what the host sees), at the processor's clock.
    pub(super) fn write(
        &mut self,
        bus: &mut PciBus,
        meter: &mut Meter,
        qp: &QpShared,
        seen: &mut Outstanding,
    ) {
        let now = Outstanding::of(qp);
        let made = [
            (false, seen.0.saturating_sub(now.0)),
            (true, seen.1.saturating_sub(now.1)),
        ];
        for (recv, n) in made {
            for _ in 0..n {
                let end = bus.dma_now(Use::Write, meter, CQ_ENTRY_BYTES);
                self.done.push_back((qp.num, recv, end));
            }
        }
        *seen = now;
    }

    /// When the next completion of `qp` (of the receive side if `recv`) is visible to the
    /// host, if this handler wrote one.
    pub(crate) fn visible_at(&mut self, qp: QpNum, recv: bool) -> Option<Nanos> {
        let i = self
            .done
            .iter()
            .position(|&(q, r, _)| q == qp && r == recv)?;
        self.done.remove(i).map(|(_, _, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::meter::CostModel;
    use crate::params::LanaiParams;
    use qpip_verbs::cq::CompletionQueue;
    use qpip_verbs::shared::QpKind;
    use qpip_verbs::wr::{SendWr, WcStatus};

    #[test]
    fn each_completion_is_visible_when_its_own_entry_is_written() {
        let p = LanaiParams::default();
        let mut bus = PciBus::new(&p.device);
        let mut meter = Meter::new(CostModel::new(&p));
        let cq = CompletionQueue::new(8);
        let qp = Arc::new(QpShared::new(
            3,
            QpKind::Reliable,
            (cq.shared().clone(), cq.shared().clone()),
            (4, 4),
        ));
        for id in 0..2 {
            qp.push_send(SendWr::new(id, &[])).unwrap();
        }
        let mut cqw = CqWrites::default();
        let mut seen = Outstanding::of(&qp);
        meter.begin(1_000);
        qp.complete_send(0, WcStatus::Success, 0, 0);
        cqw.write(&mut bus, &mut meter, &qp, &mut seen);
        // A long DMA write (received data) between the two completions.
        let data_end = bus.dma(Use::Write, 1_000, 16384, |_, _, _| {});
        meter.begin(50_000);
        qp.complete_send(1, WcStatus::Success, 0, 0);
        cqw.write(&mut bus, &mut meter, &qp, &mut seen);
        let entry = bus.dma_ns(Use::Write, CQ_ENTRY_BYTES);
        let first = cqw.visible_at(3, false).unwrap();
        let second = cqw.visible_at(3, false).unwrap();
        assert_eq!(first, 1_000 + entry);
        // The second waits for the bus (the data DMA), not the first for the second.
        assert_eq!(second, data_end.max(50_000) + entry);
        assert!(first < second);
        assert_eq!(cqw.visible_at(3, false), None);
        assert_eq!(cqw.visible_at(3, true), None);
    }
}
