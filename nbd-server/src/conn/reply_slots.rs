//! A connection's reply slots: registered memory for reply headers, one slot per reply send
//! in flight, and the buffers a reply's data is sent from until its send is done.
//!
//! Read buffers (the data of a READ from a store without a mapping: qcow2, RBD, the holes of
//! a tmpfs image) are memory the client decides how long we hold: until it reads the reply.
//! They are counted: a connection holds [`READ_BASE`] bytes of them on its own and takes
//! more from the server's `--buffer-memory` budget, given back when the send completes. When
//! neither has room, [`ReplySlots::reserve`] waits for sends to complete, so the connection
//! stops reading requests and TCP holds a client that does not read its replies.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use qpip_core::{Access, Completion, MemoryRegion, Nic, Opcode, SendWr, Sge};

use super::link::Link;
use super::recv_window::CHUNK;
use super::shared::ServerShared;
use crate::error::{Error, Result};

/// Reply header slots: one per send in flight.
pub(crate) const REPLY_SLOTS: usize = 64;
const REPLY_SLOT_LEN: usize = 512;
/// A reply slot's send is work request `REPLY_WR + slot`.
const REPLY_WR: u64 = 1 << 32;
/// Read-buffer bytes a connection may hold without asking the server's budget: two pieces
/// of [`super::transmission::CHUNK`], so that one is read while the other is sent.
pub(crate) const READ_BASE: usize = 2 << 20;
/// How long a connection waits for its client to read a reply before it gives up, at most:
/// `--idle-timeout` lowers it (a client that reads none of its replies is no less idle than
/// one that sends nothing, and it holds a connection place and memory meanwhile).
const CLIENT_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Read buffers a connection keeps for its next pieces when their sends are done, at most
/// its [`READ_BASE`]'s worth of bytes: a fresh one costs an allocation, its registration and
/// the zeroing of memory that the store's read then overwrites.
type Spares = Arc<parking_lot::Mutex<Vec<MemoryRegion>>>;

/// Registered memory that a reply send reads from until it completes; what it counts
/// against the connection's base or the server's budget goes back when it is dropped.
pub(crate) struct SendBuffer {
    mr: MemoryRegion,
    shared: Arc<ServerShared>,
    /// Bytes taken from the server's budget for it.
    from_budget: usize,
    /// The connection's base bytes in use, and this buffer's share of them.
    base_used: Arc<AtomicUsize>,
    from_base: usize,
    /// Where a read buffer goes back to when its send is done.
    spares: Option<Spares>,
}

impl SendBuffer {
    pub(super) fn mr(&self) -> &MemoryRegion {
        &self.mr
    }
}

impl Drop for SendBuffer {
    fn drop(&mut self) {
        if let Some(spares) = &self.spares {
            let mut spares = spares.lock();
            let kept: usize = spares.iter().map(|mr| mr.len()).sum();
            if self.mr.len() <= CHUNK && kept + self.mr.len() <= READ_BASE {
                spares.push(self.mr.clone());
            }
        }
        self.shared.buffer_budget.give(self.from_budget);
        self.base_used.fetch_sub(self.from_base, Ordering::AcqRel);
    }
}

pub(crate) struct ReplySlots {
    mr: MemoryRegion,
    free: Vec<usize>,
    /// Buffers of the sends in flight, by reply slot: read data, or a header longer than a
    /// slot.
    buffers: HashMap<usize, SendBuffer>,
    /// Read-buffer bytes held from the connection's own [`READ_BASE`].
    base_used: Arc<AtomicUsize>,
    spares: Spares,
    /// When the client last read a reply (a reply send completed), or when a reply went out
    /// with none in flight before.
    progress: Instant,
    /// Replies in flight and none read for this long: the connection is closed.
    read_timeout: Duration,
}

impl ReplySlots {
    /// `idle_timeout`: the server's `--idle-timeout`, which bounds how long a client may
    /// leave its replies unread (never above [`CLIENT_READ_TIMEOUT`]).
    pub(super) fn new(nic: &Nic, idle_timeout: Option<Duration>) -> Self {
        ReplySlots {
            mr: nic.alloc_region(REPLY_SLOTS * REPLY_SLOT_LEN, Access::READ),
            free: (0..REPLY_SLOTS).rev().collect(),
            buffers: HashMap::new(),
            base_used: Arc::new(AtomicUsize::new(0)),
            spares: Spares::default(),
            progress: Instant::now(),
            read_timeout: idle_timeout.map_or(CLIENT_READ_TIMEOUT, |t| t.min(CLIENT_READ_TIMEOUT)),
        }
    }

    /// True when no reply is in flight.
    pub(super) fn all_free(&self) -> bool {
        self.free.len() == REPLY_SLOTS
    }

    /// Err when replies are in flight and the client has read none of them for the read
    /// timeout: the connection must be closed (the error says why).
    pub(super) fn check_reading(&self) -> Result<()> {
        if !self.all_free() && self.progress.elapsed() >= self.read_timeout {
            return Err(Error::ClientNotReading {
                secs: self.read_timeout.as_secs_f64(),
            });
        }
        Ok(())
    }

    /// A read buffer of `len` bytes (a spare one if the connection has one), counted against
    /// the connection's base or the server's budget, or None when neither has room now.
    pub(super) fn try_reserve(&mut self, link: &Link, len: usize) -> Option<SendBuffer> {
        let (from_base, from_budget) = if self.base_used.load(Ordering::Acquire) + len <= READ_BASE
        {
            self.base_used.fetch_add(len, Ordering::AcqRel);
            (len, 0)
        } else if link.shared.buffer_budget.take(len) {
            (0, len)
        } else {
            return None;
        };
        let spare = {
            let mut spares = self.spares.lock();
            let fits = spares.iter().position(|mr| mr.len() >= len);
            fits.map(|i| spares.swap_remove(i))
        };
        let mr = spare.unwrap_or_else(|| link.shared.nic.alloc_region(len, Access::READ));
        Some(SendBuffer {
            mr,
            shared: link.shared.clone(),
            from_budget,
            base_used: self.base_used.clone(),
            from_base,
            spares: Some(self.spares.clone()),
        })
    }

    /// A read buffer of `len` bytes (at most [`READ_BASE`]): waits for reply sends to
    /// complete until there is room. The NIC is told of the replies posted quietly first.
    pub(super) fn reserve(&mut self, link: &mut Link, len: usize) -> Result<SendBuffer> {
        debug_assert!(len <= READ_BASE);
        loop {
            if let Some(b) = self.try_reserve(link, len) {
                return Ok(b);
            }
            self.wait_for_sends(link)?;
        }
    }

    /// Posts a reply send: `hdr` (may be empty), then `data` (an SGE into registered memory:
    /// the export's mapping, or `buffer`'s, which is kept until the send is done).
    pub(super) fn post(
        &mut self,
        link: &mut Link,
        hdr: &[u8],
        data: Option<Sge>,
        buffer: Option<SendBuffer>,
    ) -> Result<()> {
        let was_idle = self.all_free();
        let slot = self.take(link)?;
        let mut sges = Vec::with_capacity(2);
        let mut long_header = None;
        if hdr.len() > REPLY_SLOT_LEN {
            // A block-status reply with many extents: its own registered memory.
            let mr = link.shared.nic.alloc_region(hdr.len(), Access::READ);
            mr.write_at(0, hdr);
            sges.push(mr.sge(0, hdr.len()));
            long_header = Some(mr);
        } else if !hdr.is_empty() {
            self.mr.write_at(slot * REPLY_SLOT_LEN, hdr);
            sges.push(self.mr.sge(slot * REPLY_SLOT_LEN, hdr.len()));
        }
        sges.extend(data);
        if sges.is_empty() {
            self.free.push(slot);
            return Ok(());
        }
        // Quietly: the batch loop rings once for all replies of a batch.
        link.qp
            .post_send_quiet(SendWr::new(REPLY_WR + slot as u64, &sges))?;
        if was_idle {
            // The client's time to read starts with the first reply in flight.
            self.progress = Instant::now();
        }
        let buffer = match (buffer, long_header) {
            (Some(b), _) => Some(b),
            (None, Some(mr)) => Some(SendBuffer {
                mr,
                shared: link.shared.clone(),
                from_budget: 0,
                base_used: self.base_used.clone(),
                from_base: 0,
                spares: None,
            }),
            (None, None) => None,
        };
        if let Some(b) = buffer {
            self.buffers.insert(slot, b);
        }
        Ok(())
    }

    /// A send completed: a reply's slot (and buffer) is free again, or a handshake message's
    /// memory goes.
    pub(super) fn on_send(&mut self, link: &mut Link, c: &Completion) -> Result<()> {
        if Link::is_bytes_send(c) {
            return link.on_bytes_sent(c);
        }
        if !c.is_ok() {
            return Err(Error::SendFailed {
                what: "a reply",
                status: c.status,
            });
        }
        let slot = (c.wr_id - REPLY_WR) as usize;
        self.buffers.remove(&slot);
        self.free.push(slot);
        self.progress = Instant::now();
        Ok(())
    }

    /// Before a close: tells the NIC of the replies posted quietly and waits, for at most
    /// `within`, until every reply send has completed (the NIC has written it to the
    /// socket). Other completions (requests after the client's DISC) are dropped. False:
    /// some reply was still in flight at the deadline.
    pub(super) fn drain(&mut self, link: &mut Link, within: Duration) -> Result<bool> {
        link.qp.ring_doorbell();
        let deadline = Instant::now() + within;
        let mut buf = [Completion::default(); 32];
        while !self.all_free() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let n = link.cq.wait(&mut buf, Some(left))?;
            for c in &buf[..n] {
                if c.opcode == Opcode::Send {
                    self.on_send(link, c)?;
                }
            }
        }
        Ok(true)
    }

    fn take(&mut self, link: &mut Link) -> Result<usize> {
        loop {
            if let Some(s) = self.free.pop() {
                return Ok(s);
            }
            // All reply slots are in flight: the client is slow to read.
            self.wait_for_sends(link)?;
        }
    }

    /// Waits for at least one completion and handles the sends among them; the others are
    /// stashed for the completion loop. Tells the NIC of the replies posted quietly first.
    fn wait_for_sends(&mut self, link: &mut Link) -> Result<()> {
        link.qp.ring_doorbell();
        let mut buf = [Completion::default(); 32];
        let n = loop {
            self.check_reading()?;
            let left = self.read_timeout.saturating_sub(self.progress.elapsed());
            let n = link
                .cq
                .wait(&mut buf, Some(left.max(Duration::from_millis(1))))?;
            if n > 0 {
                break n;
            }
        };
        for c in &buf[..n] {
            if c.opcode == Opcode::Send {
                self.on_send(link, c)?;
            } else {
                link.stash.push_back(*c);
            }
        }
        Ok(())
    }
}
