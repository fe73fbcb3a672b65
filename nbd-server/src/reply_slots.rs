//! A connection's reply slots: registered memory for reply headers, one slot per reply in
//! flight, and the read buffers a reply's data is sent from until its send is done.

use std::collections::HashMap;
use std::time::Duration;

use qpip_core::{Access, Completion, MemoryRegion, Nic, Opcode, SendWr, Sge};

use crate::error::{Error, Result};
use crate::link::Link;

/// Reply header slots: one per reply in flight.
pub(crate) const REPLY_SLOTS: usize = 64;
const REPLY_SLOT_LEN: usize = 512;
/// A reply slot's send is work request `REPLY_WR + slot`.
const REPLY_WR: u64 = 1 << 32;

pub(crate) struct ReplySlots {
    mr: MemoryRegion,
    free: Vec<usize>,
    /// Read data of images without a mapping (qcow2, RBD), by reply slot, until its send is
    /// done.
    read_bufs: HashMap<usize, MemoryRegion>,
}

impl ReplySlots {
    pub fn new(nic: &Nic) -> Self {
        ReplySlots {
            mr: nic.alloc_region(REPLY_SLOTS * REPLY_SLOT_LEN, Access::READ),
            free: (0..REPLY_SLOTS).rev().collect(),
            read_bufs: HashMap::new(),
        }
    }

    /// True when no reply is in flight.
    pub fn all_free(&self) -> bool {
        self.free.len() == REPLY_SLOTS
    }

    /// Posts a reply whose header is `hdr`, followed by `data` (an SGE into registered
    /// memory: the export's mapping, or `read_buf`, which is kept until the send is done).
    pub fn post(
        &mut self,
        link: &mut Link,
        hdr: &[u8],
        data: Option<Sge>,
        read_buf: Option<MemoryRegion>,
    ) -> Result<()> {
        if hdr.len() > REPLY_SLOT_LEN {
            return Err(Error::ReplyTooLong(hdr.len()));
        }
        let slot = self.take(link)?;
        self.mr.write_at(slot * REPLY_SLOT_LEN, hdr);
        let head = self.mr.sge(slot * REPLY_SLOT_LEN, hdr.len());
        let wr = match data {
            Some(d) => SendWr::new(REPLY_WR + slot as u64, &[head, d]),
            None => SendWr::new(REPLY_WR + slot as u64, &[head]),
        };
        // Quietly: the batch loop rings once for all replies of a batch.
        link.qp.post_send_quiet(wr)?;
        if let Some(mr) = read_buf {
            self.read_bufs.insert(slot, mr);
        }
        Ok(())
    }

    /// A send completed: a reply's slot (and read buffer) is free again, or a handshake
    /// message's memory goes.
    pub fn on_send(&mut self, link: &mut Link, c: &Completion) -> Result<()> {
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
        self.read_bufs.remove(&slot);
        self.free.push(slot);
        Ok(())
    }

    fn take(&mut self, link: &mut Link) -> Result<usize> {
        loop {
            if let Some(s) = self.free.pop() {
                return Ok(s);
            }
            // All reply slots are in flight: the client is slow to read. Wait for sends
            // (the NIC must know of the replies posted quietly).
            link.qp.ring_doorbell();
            let mut buf = [Completion::default(); 32];
            let n = link.cq.wait(&mut buf, Some(Duration::from_secs(60)))?;
            if n == 0 {
                return Err(Error::ClientNotReading);
            }
            for c in &buf[..n] {
                if c.opcode == Opcode::Send {
                    self.on_send(link, c)?;
                } else {
                    link.stash.push_back(*c);
                }
            }
        }
    }
}
