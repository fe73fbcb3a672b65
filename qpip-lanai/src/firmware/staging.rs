//! The NIC's SRAM staging buffers, store and forward both ways.
//!
//! Send: a segment is stored in SRAM by the host->NIC DMA and forwarded by the network send
//! DMA; its buffer is free again once the frame's tail has left, which the link reports
//! (with Myrinet stop/go a frame can be held on the link). With every buffer taken, the
//! firmware builds nothing more.
//!
//! Receive: the network receive DMA takes a frame off the wire only into a free buffer; the
//! buffer frees once the firmware is done with the frame and the DMA writes it issued for it
//! (its payload to host memory, then its completions) have finished. With every buffer
//! taken the NIC stops its link (stop/go) and the frame waits on the wire.

use std::collections::VecDeque;

use crate::meter::Nanos;

#[derive(Clone, Debug)]
pub(crate) struct SendStaging {
    buffers: usize,
    /// Each buffer in use, in the order the link sends them: when it was taken and, once the
    /// link has reported the frame's tail gone, when it frees.
    held: VecDeque<(Nanos, Option<Nanos>)>,
    /// Buffer-nanoseconds held since the last reset (the utilisation account).
    held_ns: Nanos,
}

impl SendStaging {
    pub(crate) fn new(buffers: usize) -> Self {
        SendStaging {
            buffers: buffers.max(1),
            held: VecDeque::new(),
            held_ns: 0,
        }
    }

    /// When a buffer is free, from `now` on; `None` while every buffer holds a frame the
    /// link has not finished with (it reports that through [`SendStaging::left`]).
    pub(crate) fn free_at(&mut self, now: Nanos) -> Option<Nanos> {
        while self
            .held
            .front()
            .is_some_and(|&(_, r)| r.is_some_and(|t| t <= now))
        {
            self.held.pop_front();
        }
        if self.held.len() < self.buffers {
            return Some(now);
        }
        self.held.front().and_then(|&(_, r)| r)
    }

    /// A buffer is free at `now`.
    pub(crate) fn has_room(&mut self, now: Nanos) -> bool {
        self.free_at(now) == Some(now)
    }

    /// A frame is staged from `taken` (its DMA starts).
    pub(crate) fn stage(&mut self, taken: Nanos) {
        self.held.push_back((taken, None));
    }

    /// The oldest frame still on the link has left: its tail at `tail`.
    pub(crate) fn left(&mut self, tail: Nanos) {
        if let Some(entry) = self.held.iter_mut().find(|(_, r)| r.is_none()) {
            entry.1 = Some(tail);
            self.held_ns += tail.saturating_sub(entry.0);
        }
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

#[derive(Clone, Debug)]
pub(crate) struct RecvStaging {
    buffers: usize,
    /// When each buffer in use frees.
    releases: Vec<Nanos>,
    held_ns: Nanos,
}

impl RecvStaging {
    pub(crate) fn new(buffers: usize) -> Self {
        RecvStaging {
            buffers: buffers.max(1),
            releases: Vec::new(),
            held_ns: 0,
        }
    }

    /// When the network receive DMA can next take a frame, from `now` on.
    pub(crate) fn free_at(&mut self, now: Nanos) -> Nanos {
        self.releases.retain(|&t| t > now);
        if self.releases.len() < self.buffers {
            return now;
        }
        self.releases.iter().copied().min().unwrap_or(now)
    }

    /// A frame held a buffer from `taken` (its head came in) until `release`.
    pub(crate) fn hold(&mut self, taken: Nanos, release: Nanos) {
        // Buffers freed before this frame came in are free.
        self.releases.retain(|&t| t > taken);
        self.releases.push(release);
        self.held_ns += release.saturating_sub(taken);
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
    fn a_send_buffer_frees_when_the_link_reports_its_frame_gone() {
        let mut s = SendStaging::new(2);
        s.stage(0);
        s.stage(10);
        // Both on the link, neither reported: no known time to come back.
        assert_eq!(s.free_at(500), None);
        s.left(150);
        assert_eq!(s.free_at(149), Some(150));
        assert!(s.has_room(150));
        s.stage(150);
        // Stopped on the link: the second frame's tail left late.
        s.left(400);
        assert_eq!(s.free_at(200), Some(400));
        assert_eq!(s.held_ns(), 150 + 390);
    }

    #[test]
    fn a_receive_buffer_is_held_until_its_release() {
        let mut r = RecvStaging::new(1);
        assert_eq!(r.free_at(0), 0);
        r.hold(0, 900);
        assert_eq!(r.free_at(100), 900);
        assert_eq!(r.free_at(900), 900);
        assert_eq!(r.held_ns(), 900);
    }
}
