//! A connection's link to its client: the QP and its CQ, and the sends of bytes that are not
//! in registered memory yet (handshake replies). The handshake and the transmission phase
//! both talk through it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use qpip_core::{Access, Completion, CompletionQueue, Endpoint, MemoryRegion, QueuePair, SendWr};

use super::shared::ServerShared;
use crate::error::{Error, Result};

/// A handshake message's send is work request `HANDSHAKE_WR + n`, above the reply slots'
/// ([`super::reply_slots`]) and the receive WRs (numbered from 0).
const HANDSHAKE_WR: u64 = 2 << 32;
/// How often a connection in its handshake looks whether it has been evicted.
const EVICT_POLL: Duration = Duration::from_millis(100);

pub(crate) struct Link {
    pub shared: Arc<ServerShared>,
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub peer: Endpoint,
    /// Completions read while waiting for something else (a free reply slot).
    pub stash: VecDeque<Completion>,
    /// Handshake replies in flight, kept alive until their send completes.
    handshake_sends: HashMap<u64, MemoryRegion>,
    next_wr: u64,
    /// Set by the accept loop when too many handshakes are under way and this is the oldest;
    /// dropped when the handshake ends.
    pub evict: Option<Arc<AtomicBool>>,
}

impl Link {
    pub(super) fn new(
        shared: Arc<ServerShared>,
        qp: QueuePair,
        cq: CompletionQueue,
        peer: Endpoint,
        evict: Arc<AtomicBool>,
    ) -> Self {
        Link {
            shared,
            qp,
            cq,
            peer,
            stash: VecDeque::new(),
            handshake_sends: HashMap::new(),
            next_wr: 0,
            evict: Some(evict),
        }
    }

    /// The next completion, before `deadline` (None: whenever it comes) unless the connection
    /// is evicted first.
    pub(super) fn wait_one(
        &mut self,
        deadline: Option<Instant>,
        during: &'static str,
    ) -> Result<Completion> {
        if let Some(c) = self.stash.pop_front() {
            return Ok(c);
        }
        let mut buf = [Completion::default(); 1];
        loop {
            if self
                .evict
                .as_ref()
                .is_some_and(|f| f.load(Ordering::Acquire))
            {
                return Err(Error::Evicted { during });
            }
            let left = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()),
                None => EVICT_POLL,
            };
            if left.is_zero() {
                return Err(Error::TimedOut { during });
            }
            // In slices, so that an eviction is noticed soon.
            if self.cq.wait(&mut buf, Some(left.min(EVICT_POLL)))? == 1 {
                return Ok(buf[0]);
            }
        }
    }

    /// Sends bytes that are not in registered memory yet (handshake replies).
    pub(super) fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mr = self.shared.nic.alloc_region(bytes.len(), Access::READ);
        mr.write_at(0, bytes);
        self.next_wr += 1;
        let id = HANDSHAKE_WR + self.next_wr;
        self.qp
            .post_send(SendWr::new(id, &[mr.sge(0, bytes.len())]))?;
        self.handshake_sends.insert(id, mr);
        Ok(())
    }

    /// True while bytes given to [`Link::send_bytes`] are still being sent.
    pub(super) fn sending_bytes(&self) -> bool {
        !self.handshake_sends.is_empty()
    }

    /// True for the completion of a [`Link::send_bytes`] send.
    pub(super) fn is_bytes_send(c: &Completion) -> bool {
        c.wr_id >= HANDSHAKE_WR
    }

    /// Waits (until `deadline`) for the handshake replies still being sent, so that their
    /// memory is not deregistered under the NIC.
    pub(super) fn finish_sending_bytes(&mut self, deadline: Option<Instant>) {
        while self.sending_bytes() {
            match self.wait_one(deadline, "the last handshake reply") {
                Ok(c) if c.opcode == qpip_core::Opcode::Send => {
                    self.handshake_sends.remove(&c.wr_id);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    /// A [`Link::send_bytes`] send completed: its memory goes.
    pub(super) fn on_bytes_sent(&mut self, c: &Completion) -> Result<()> {
        self.handshake_sends.remove(&c.wr_id);
        if !c.is_ok() {
            return Err(Error::SendFailed {
                what: "to the client",
                status: c.status,
            });
        }
        Ok(())
    }
}
