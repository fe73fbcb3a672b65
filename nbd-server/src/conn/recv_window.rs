//! How many receive slots a connection keeps posted, and which.
//!
//! Every posted receive WR is a slot of registered memory (a request header plus up to
//! [`CHUNK`] of write payload) that the NIC may fill. Receive WRs are consumed in the
//! order they were posted, so posting all of a connection's slots would cycle through them
//! and, after a few dozen writes, leave every slot's pages touched for the connection's life:
//! 32 MiB for a client that never had more than one write in flight. Instead a connection
//! starts with a few slots and reposts the one it just emptied, so the same slots are reused;
//! it takes more only when the client's pipeline outruns the window (the NIC consumed every
//! posted WR before the server caught up), and those extra slots come from one budget shared
//! by the whole server. Memory for receive buffers is therefore bounded by
//! `connections × BASE_SLOTS × slot + budget`, and a connection only touches what its
//! pipeline needed.

use std::sync::atomic::{AtomicUsize, Ordering};

use nbd_proto::consts::EXTENDED_REQUEST_LEN;

/// Receive slots a connection may post at most in the transmission phase (how many it does
/// post: `RecvWindow`): requests the client may have in flight before TCP flow control
/// holds it.
pub const RECV_SLOTS: usize = 32;
/// Largest payload piece placed in one receive WR (longer writes arrive in pieces).
pub const CHUNK: usize = 1 << 20;
/// A receive slot: the longest request header (extended) and a payload piece.
pub(crate) const SLOT_LEN: usize = EXTENDED_REQUEST_LEN + CHUNK;

/// Slots every connection may use without asking the budget.
pub(crate) const BASE_SLOTS: usize = 4;

/// The server-wide memory (`--buffer-memory`) that connections may take beyond their own
/// base: extra receive slots, and read buffers of stores without a mapping
/// (`super::reply_slots`). Counted in bytes.
#[derive(Debug)]
pub(crate) struct BufferBudget(AtomicUsize);

impl BufferBudget {
    pub(crate) fn new(bytes: usize) -> Self {
        BufferBudget(AtomicUsize::new(bytes))
    }

    /// Takes up to `want` units of `unit` bytes; returns how many it got.
    pub(crate) fn take_units(&self, unit: usize, want: usize) -> usize {
        let mut got = 0;
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                got = want.min(left / unit);
                Some(left - got * unit)
            });
        got
    }

    /// Takes `bytes`, all or nothing.
    pub(crate) fn take(&self, bytes: usize) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                left.checked_sub(bytes)
            })
            .is_ok()
    }

    pub(crate) fn give(&self, bytes: usize) {
        self.0.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Bytes left.
    #[cfg(test)]
    pub(crate) fn available(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One connection's posted receive slots.
#[derive(Debug)]
pub(crate) struct RecvWindow {
    /// Slots to keep posted.
    target: usize,
    /// Slots posted and not yet completed.
    posted: usize,
    /// Slots never posted or given up, lowest index last (taken first).
    unused: Vec<usize>,
    /// Slots taken from the budget.
    extra: usize,
    /// Bytes of one slot.
    slot_len: usize,
}

impl RecvWindow {
    /// A window over `slots` slots of `slot_len` bytes; returns it and the slots to post at
    /// once.
    pub(crate) fn new(slots: usize, slot_len: usize) -> (Self, Vec<usize>) {
        let base = BASE_SLOTS.min(slots);
        let w = RecvWindow {
            target: base,
            posted: base,
            unused: (base..slots).rev().collect(),
            extra: 0,
            slot_len,
        };
        (w, (0..base).collect())
    }

    /// `n` receive WRs completed in one batch. If that is every WR that was posted, the NIC
    /// may have had to stop reading while the server worked: the window doubles, as far as
    /// the budget allows.
    pub(crate) fn arrived(&mut self, n: usize, budget: &BufferBudget) {
        let ran_dry = n >= self.posted;
        self.posted = self.posted.saturating_sub(n);
        if ran_dry {
            let room = self.unused.len();
            let got = budget.take_units(self.slot_len, self.target.min(room));
            self.target += got;
            self.extra += got;
        }
    }

    /// `slot` was emptied and is posted again (it is warm: reusing it touches no new page).
    pub(crate) fn reuse(&mut self, slot: usize) -> usize {
        self.posted += 1;
        slot
    }

    /// After a batch's slots are reposted: fresh slots to post so that `target` are posted.
    pub(crate) fn top_up(&mut self) -> Vec<usize> {
        let mut post = Vec::new();
        while self.posted < self.target {
            let Some(s) = self.unused.pop() else { break };
            post.push(s);
            self.posted += 1;
        }
        post
    }

    /// Slots kept posted now.
    #[cfg(test)]
    pub(crate) fn target(&self) -> usize {
        self.target
    }

    /// Gives the slots taken from `budget` back (the connection ends).
    pub(crate) fn release(&mut self, budget: &BufferBudget) {
        budget.give(self.extra * self.slot_len);
        self.extra = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_at_a_time_reuses_the_same_slot() {
        let budget = BufferBudget::new(100);
        let (mut w, first) = RecvWindow::new(32, 1);
        assert_eq!(first, vec![0, 1, 2, 3]);
        for _ in 0..1000 {
            w.arrived(1, &budget);
            assert_eq!(w.reuse(0), 0);
            assert!(w.top_up().is_empty());
        }
        assert_eq!(w.target(), BASE_SLOTS);
        assert_eq!(budget.available(), 100);
    }

    #[test]
    fn a_deep_pipeline_grows_the_window_from_the_budget_and_gives_it_back() {
        let budget = BufferBudget::new(6);
        let (mut w, _) = RecvWindow::new(32, 1);
        // All four posted WRs completed in one batch: the NIC ran dry.
        w.arrived(4, &budget);
        assert_eq!(w.target(), 8);
        let mut posted: Vec<usize> = (0..4).map(|s| w.reuse(s)).collect();
        posted.extend(w.top_up());
        assert_eq!(posted, vec![0, 1, 2, 3, 4, 5, 6, 7]);
        // Dry again: only 2 slots are left in the budget.
        w.arrived(8, &budget);
        assert_eq!(w.target(), 10);
        assert_eq!(budget.available(), 0);
        w.release(&budget);
        assert_eq!(budget.available(), 6);
    }

    #[test]
    fn the_window_never_passes_the_connection_s_slots() {
        let budget = BufferBudget::new(1000);
        let (mut w, _) = RecvWindow::new(6, 1);
        for _ in 0..5 {
            let n = w.posted;
            w.arrived(n, &budget);
            for s in 0..n {
                w.reuse(s);
            }
            w.top_up();
        }
        assert_eq!(w.target(), 6);
        assert_eq!(budget.available(), 998);
    }
}
