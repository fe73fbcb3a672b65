//! The NIC's send staging buffers: a segment is stored in SRAM by the host->NIC DMA and
//! forwarded by the network send DMA; its buffer is free again once the frame's tail has
//! left. With every buffer taken, the firmware builds nothing more (store and forward).

use std::collections::VecDeque;

use crate::meter::Nanos;

#[derive(Clone, Debug)]
pub(crate) struct SendStaging {
    buffers: usize,
    /// When each buffer in use is freed, in the order the link sends them.
    releases: VecDeque<Nanos>,
    /// When the network send DMA has put the last frame's tail on the link.
    link_free: Nanos,
    /// Buffer-nanoseconds held since the last reset (the utilisation account).
    held_ns: Nanos,
}

impl SendStaging {
    pub(crate) fn new(buffers: usize) -> Self {
        SendStaging {
            buffers: buffers.max(1),
            releases: VecDeque::new(),
            link_free: 0,
            held_ns: 0,
        }
    }

    fn retire(&mut self, now: Nanos) {
        while self.releases.front().is_some_and(|&t| t <= now) {
            self.releases.pop_front();
        }
    }

    /// A buffer is free at `now`.
    pub(crate) fn has_room(&mut self, now: Nanos) -> bool {
        self.retire(now);
        self.releases.len() < self.buffers
    }

    /// When the next buffer frees, if all are taken at `now`.
    pub(crate) fn next_free(&mut self, now: Nanos) -> Option<Nanos> {
        if self.has_room(now) {
            None
        } else {
            self.releases.front().copied()
        }
    }

    /// A frame staged from `taken` (its DMA starts) and ready for the wire at `ready_at`
    /// takes `wire_ns` on the link: returns when its head leaves.
    pub(crate) fn stage(&mut self, taken: Nanos, ready_at: Nanos, wire_ns: Nanos) -> Nanos {
        let depart = ready_at.max(self.link_free);
        self.link_free = depart + wire_ns;
        self.releases.push_back(self.link_free);
        self.held_ns += self.link_free.saturating_sub(taken);
        depart
    }

    /// Myrinet stop/go held the last frame on the link: its tail left at `tail`.
    pub(crate) fn stopped_until(&mut self, tail: Nanos) {
        if let Some(last) = self.releases.back_mut()
            && *last < tail
        {
            self.held_ns += tail - *last;
            *last = tail;
        }
        self.link_free = self.link_free.max(tail);
    }

    pub(crate) fn buffers(&self) -> usize {
        self.buffers
    }

    pub(crate) fn held_ns(&self) -> Nanos {
        self.held_ns
    }

    pub(crate) fn reset_accounts(&mut self) {
        self.held_ns = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_frees_when_its_frame_has_left_and_the_link_is_serial() {
        let mut s = SendStaging::new(2);
        assert_eq!(s.stage(0, 100, 50), 100);
        // Ready earlier than the link is free: waits for the first frame's tail.
        assert_eq!(s.stage(10, 120, 50), 150);
        assert!(!s.has_room(149));
        assert_eq!(s.next_free(149), Some(150));
        assert!(s.has_room(150));
        s.stopped_until(400);
        assert_eq!(s.next_free(150), None);
        assert_eq!(s.stage(150, 150, 10), 400);
        assert_eq!(s.held_ns(), 150 + 190 + 200 + 260);
    }
}
