//! The link: the client's part that owns the QP side — the current connection (if any), the
//! NIC, and the send slots each request occupies until it is answered. It posts requests and
//! waits for completions; what the completions mean is the session's business.

use std::time::{Duration, Instant};

use nbd_proto::consts as c;
use nbd_proto::flags::CmdFlags;
use nbd_proto::transmission::client::ClientSession;
use nbd_proto::transmission::{Command, Request};
use qpip_core::{Access, Completion, CompletionQueue, CqWaker, MemoryRegion, Nic, Opcode, SendWr};

use crate::conn::{Conn, RECV_SLOT};
use crate::error::{Error, Result};
use crate::region::Region;

/// Above this much READ/WRITE data in flight a blocking wait sleeps on the CQ at once instead
/// of spinning first: at loopback speeds (a few GB/s) 64 KiB plus a round trip fit in the
/// CQ's default 50 µs window, a 1 MiB request does not, and spinning through its transfer
/// only takes the core from the threads doing it (measured in BENCHMARKS.md, *The whole
/// path*).
const SPIN_MAX_DATA: u64 = 64 << 10;

/// The QP side of a client.
pub(super) struct Link {
    nic: Nic,
    conn: Option<Conn>,
    /// Which connection `conn` is: it changes whenever one replaces another, so that
    /// completions a wait took from an old one's CQ are known to be stale.
    generation: u64,
    /// The send slots: `window` of `slot_len` bytes.
    send_mr: MemoryRegion,
    slot_len: usize,
}

impl Link {
    /// A link over `conn`, with `window` send slots for requests of up to `max_io` bytes.
    pub(super) fn new(nic: Nic, conn: Conn, window: usize, max_io: u32) -> Link {
        let slot_len = c::EXTENDED_REQUEST_LEN + max_io as usize;
        let send_mr = nic.alloc_region(window * slot_len, Access::READ);
        Link {
            nic,
            conn: Some(conn),
            generation: 0,
            send_mr,
            slot_len,
        }
    }

    pub(super) fn nic(&self) -> &Nic {
        &self.nic
    }

    /// Copies a WRITE's payload into its send slot, after the room for its header.
    pub(super) fn copy_payload(&self, slot: usize, data: &[u8]) {
        self.send_mr
            .write_at(slot * self.slot_len + c::EXTENDED_REQUEST_LEN, data);
    }

    /// Sends request `cookie` of `session` on the current connection.
    pub(super) fn post(&self, session: &ClientSession<Region>, cookie: u64) -> Result<()> {
        let Some(conn) = &self.conn else {
            return Err(Error::Invalid("no connection"));
        };
        let out = session.outgoing(cookie)?;
        let header = &out.header;
        // The header ends where the payload starts (its length depends on the connection's
        // header style, which a reconnect may change).
        let start = out.slot * self.slot_len + c::EXTENDED_REQUEST_LEN - header.len();
        self.send_mr.write_at(start, header);
        // A WRITE from the caller's memory: header from the send slot, payload from there.
        let wr = match out.region {
            Some(r) => SendWr::new(
                cookie,
                &[
                    self.send_mr.sge(start, header.len()),
                    r.mr.sge(r.at, out.payload_len),
                ],
            ),
            _ => SendWr::new(
                cookie,
                &[self.send_mr.sge(start, header.len() + out.payload_len)],
            ),
        };
        conn.qp.post_send(wr)?;
        Ok(())
    }

    /// The current connection's CQ, to wait on without holding the client (a connection
    /// shared by threads, `shared.rs`); None: no connection.
    pub(super) fn waiter(&self, data_in_flight: u64) -> Option<CqWait> {
        let conn = self.conn.as_ref()?;
        Some(CqWait {
            generation: self.generation,
            cq: conn.cq.clone(),
            // Moving this much takes longer than the CQ's spin window: sleep at once.
            sleep_at_once: data_in_flight > SPIN_MAX_DATA,
        })
    }

    /// Which connection is current ([`CqWait::generation`]).
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Completions into `buf`: one wait (up to 1 s) if `block`, else what is there. With
    /// more than [`SPIN_MAX_DATA`] of data in flight a wait sleeps at once. None: no
    /// connection.
    pub(super) fn completions(
        &self,
        buf: &mut [Completion],
        block: bool,
        data_in_flight: u64,
    ) -> Result<Option<usize>> {
        if block {
            return self.waiter(data_in_flight).map(|w| w.wait(buf)).transpose();
        }
        let Some(conn) = &self.conn else {
            return Ok(None);
        };
        Ok(Some(conn.cq.poll(buf)?))
    }

    /// The first `len` bytes of receive slot `slot`, read in place.
    ///
    /// # Safety
    /// The slot's receive WR must have completed and not be posted again while the slice
    /// lives, so that the NIC does not write these bytes meanwhile.
    pub(super) unsafe fn received(&self, slot: usize, len: usize) -> Option<&[u8]> {
        let region = &self.conn.as_ref()?.recv_mr;
        let offset = slot * RECV_SLOT;
        if offset.checked_add(len).is_none_or(|e| e > region.len()) || len > RECV_SLOT {
            return None;
        }
        // SAFETY: in bounds (checked above); the caller guarantees nothing writes them.
        Some(unsafe { std::slice::from_raw_parts(region.as_ptr().add(offset), len) })
    }

    /// Posts receive slot `slot` again.
    pub(super) fn repost(&self, slot: usize) -> Result<()> {
        match &self.conn {
            Some(conn) => conn.repost(slot),
            None => Ok(()),
        }
    }

    /// Why the framer refused the server's last message, if it said.
    pub(super) fn frame_fault(&self) -> Option<String> {
        self.conn.as_ref().and_then(|c| c.frame_fault.lock().take())
    }

    /// A new connection takes the old one's place.
    pub(super) fn attach(&mut self, conn: Conn) {
        self.conn = Some(conn);
        self.generation += 1;
    }

    /// Drops the connection. With `fence` (READs in flight had their data placed in callers'
    /// memory) waits for the NIC to confirm it stopped writing there; false if it did not.
    pub(super) fn detach(&mut self, fence: bool) -> bool {
        let Some(conn) = self.conn.take() else {
            return true;
        };
        drop(conn);
        !fence || self.nic.fence(Duration::from_secs(10))
    }

    /// Sends NBD_CMD_DISC (in `extended` headers or not) and closes the connection.
    pub(super) fn disconnect(&mut self, extended: bool) -> Result<()> {
        let Some(conn) = self.conn.take() else {
            return Ok(());
        };
        let req = Request {
            flags: CmdFlags::empty(),
            command: Command::Disc,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        let header = req
            .encode(extended)
            .map_err(|_| Error::Invalid("NBD_CMD_DISC does not encode"))?;
        self.send_mr.write_at(0, &header);
        conn.qp
            .post_send(SendWr::new(0, &[self.send_mr.sge(0, header.len())]))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = [Completion::default(); 8];
        'wait: while Instant::now() < deadline {
            let n = conn.cq.wait(&mut buf, Some(Duration::from_millis(200)))?;
            for comp in &buf[..n] {
                if comp.opcode == Opcode::Send && comp.wr_id == 0 {
                    break 'wait;
                }
            }
        }
        conn.qp.close();
        Ok(())
    }
}

/// One wait on a connection's CQ, taken out of the client ([`Link::waiter`]).
pub(super) struct CqWait {
    /// The connection it belongs to ([`Link::generation`]).
    pub(super) generation: u64,
    cq: CompletionQueue,
    sleep_at_once: bool,
}

impl CqWait {
    /// Completions into `buf`: one wait of up to 1 s (sleeping at once with much data in
    /// flight, [`SPIN_MAX_DATA`]).
    pub(super) fn wait(&self, buf: &mut [Completion]) -> Result<usize> {
        let limit = Some(Duration::from_secs(1));
        Ok(match self.sleep_at_once {
            true => self.cq.wait_spinning(buf, limit, Duration::ZERO)?,
            false => self.cq.wait(buf, limit)?,
        })
    }

    /// Makes [`Self::wait`] return early (the connection it waits on was replaced).
    pub(super) fn waker(&self) -> CqWaker {
        self.cq.waker()
    }
}
