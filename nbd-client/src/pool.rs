//! Several connections to one export, shared by threads, and byte-granular I/O on top of the
//! export's block-granular requests: what the FUSE mount and `qpip-nbd copy` both stand on.
//!
//! With a multi-conn server every connection is its own [`Client`] (its own QP, one shared
//! NIC); without multi-conn there is exactly one. Either way threads share connections
//! ([`SharedClient`]): a thread's requests go out on the connection it used last unless that
//! one is busy and another is idle (writes join the connection that is writing, if one is),
//! and pipeline there with the other threads' requests (up to the connection's window), so
//! a server without multi-conn still sees the mount's queue depth, as nbdfuse and the
//! kernel's client give it.
//!
//! Requests the server's minimum block size does not divide are widened: reads read the
//! covering blocks, writes read-modify-write the partial head and tail blocks under an
//! exclusive lock (aligned writes share that lock, so a read-modify-write never overwrites a
//! concurrent write's bytes with stale ones). Page-cache I/O is page-aligned, so only
//! O_DIRECT I/O at odd offsets pays for this, and only against servers with a minimum block
//! size above 1.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::RwLock;

use nbd_proto::transmission::ErrorValue;

use crate::client::{Client, ClientOptions, SharedClient};
use crate::error::{Error, Result};
use crate::region::MrSlice;
use crate::uri::NbdUri;

/// Zero-filled writes (servers without WRITE_ZEROES) go out in pieces of this size.
const ZERO_CHUNK: u64 = 1 << 20;

thread_local! {
    /// The connection this thread used last.
    static PREFERRED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// What the export supports, fixed at connect time (its size as it was then: the current
/// one is [`Pool::size`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The export's size in bytes.
    pub size: u64,
    /// The server's minimum block size (at least 1).
    pub min_block: u64,
    /// Writes are refused (by the server, or forced).
    pub read_only: bool,
    /// The server takes FLUSH.
    pub flush: bool,
    /// The server takes TRIM.
    pub trim: bool,
    /// The server takes WRITE_ZEROES.
    pub write_zeroes: bool,
    /// Block status (`base:allocation`) was negotiated.
    pub block_status: bool,
    /// The server keeps several connections' caches coherent.
    pub multi_conn: bool,
}

impl Caps {
    /// What `c`'s export supports; read-only anyway with `force_read_only`.
    pub fn of(c: &Client, force_read_only: bool) -> Caps {
        Caps {
            size: c.size(),
            min_block: u64::from(c.block_size().min).max(1),
            read_only: force_read_only || c.is_read_only(),
            flush: c.can_flush(),
            trim: c.can_trim(),
            write_zeroes: c.can_write_zeroes(),
            block_status: c.can_block_status(),
            multi_conn: c.can_multi_conn(),
        }
    }
}

/// Connections to one export.
pub struct Pool {
    uri: NbdUri,
    opts: ClientOptions,
    conns: Vec<SharedClient>,
    caps: Caps,
    /// The export's size as the connection that last heard it says (a reconnect may find
    /// the export resized).
    size: AtomicU64,
    /// Each connection's size when last noted: a change in one is news, a connection that
    /// has not reconnected yet (still at the old size) is not.
    sizes: Vec<AtomicU64>,
    /// The server offers RESIZE: the export's size may change (an RBD image).
    resizable: bool,
    next: AtomicUsize,
    /// Shared by aligned writes, exclusive for read-modify-write.
    rmw: RwLock<()>,
    /// Each connection's writes in progress.
    writes: Vec<AtomicUsize>,
}

/// A write in progress on a connection, counted while it lives.
struct Writing<'a>(&'a AtomicUsize);

impl<'a> Writing<'a> {
    fn on(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Writing(count)
    }
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("uri", &self.uri.to_string())
            .field("connections", &self.conns.len())
            .field("caps", &self.caps)
            .finish()
    }
}

/// `[offset, offset+len)` split at block boundaries: (head, middle, tail), each (offset, len).
fn split(offset: u64, len: u64, min: u64) -> [(u64, u64); 3] {
    let end = offset + len;
    let a = offset.next_multiple_of(min).min(end);
    let b = (end - end % min).max(a);
    [(offset, a - offset), (a, b - a), (b, end - b)]
}

impl Pool {
    /// One connection to `uri`; [`Self::add_connection`] opens more.
    pub fn connect(uri: &str, opts: ClientOptions) -> Result<Pool> {
        let first = Client::connect_with(uri, opts.clone())?;
        Ok(Pool {
            uri: first.uri().clone(),
            caps: Caps::of(&first, false),
            size: AtomicU64::new(first.size()),
            sizes: vec![AtomicU64::new(first.size())],
            resizable: first.can_resize(),
            conns: vec![SharedClient::new(first)],
            opts,
            next: AtomicUsize::new(0),
            rmw: RwLock::new(()),
            writes: vec![AtomicUsize::new(0)],
        })
    }

    /// Another connection to the same export (only worth it with multi-conn: without it the
    /// server does not keep the connections' caches coherent).
    pub fn add_connection(&mut self) -> Result<()> {
        let c = Client::connect_with(&self.uri.to_string(), self.opts.clone())?;
        self.sizes.push(AtomicU64::new(c.size()));
        self.writes.push(AtomicUsize::new(0));
        self.conns.push(SharedClient::new(c));
        Ok(())
    }

    /// Treats the export as read-only whatever the server says.
    pub fn force_read_only(&mut self) {
        self.caps.read_only = true;
    }

    /// What the export supports.
    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    /// The export's size now: what a connection was told when it last (re)connected. After
    /// `rbd resize` and a reconnect it is the new size; a connection that has not reconnected
    /// yet still refuses requests past its own old end.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::SeqCst)
    }

    /// Another connection found the export resized when it reconnected (a restarted
    /// server), or a probe did: this one, still at the old size, would refuse requests past
    /// its old end before sending them, so it looks at its connection first (if the server
    /// closed it, it reconnects now and learns the new size too), and reconnects if it is
    /// still at the old size.
    fn catch_up(&self, c: &mut Client) {
        c.catch_up_size(self.size());
    }

    /// The server offers NBD's RESIZE on the export: its size may change under us.
    pub fn resizable(&self) -> bool {
        self.resizable
    }

    /// Asks the server for the export's size on a connection of its own that never enters
    /// transmission (NBD_OPT_INFO), and makes it [`Self::size`]: the connections still at
    /// another size reconnect before their next request (`catch_up`). For exports
    /// whose size changes while nobody reconnects (`rbd resize` under a running server).
    pub fn probe_size(&self) -> Result<u64> {
        let now = Client::info_with(&self.uri.to_string(), &self.opts)?.size;
        let before = self.size.swap(now, Ordering::SeqCst);
        if before != now {
            tracing::info!(uri = %self.uri, "the export is now {now} bytes (was {before})");
        }
        Ok(now)
    }

    /// Notes connection `i`'s size after a call on it.
    fn note_size(&self, i: usize) {
        let now = self.conns[i].size();
        if self.sizes[i].swap(now, Ordering::SeqCst) == now {
            return;
        }
        let before = self.size.swap(now, Ordering::SeqCst);
        if before != now {
            tracing::info!(uri = %self.uri, "the export is now {now} bytes (was {before})");
        }
    }

    /// The server's URI.
    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    /// Connections open.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Times the connections were restored, all together.
    pub fn reconnects(&self) -> u64 {
        self.conns.iter().map(|c| c.peek(|c| c.reconnects())).sum()
    }

    /// The connection for this thread's next call: the one it used last, unless that one
    /// is busy and another is idle. A `write` joins the connection that has writes in
    /// progress, if one has: writes at once then reach the server on one connection, whose
    /// thread writes the image without contending with other connections' threads for the
    /// file's lock (measured in BENCHMARKS.md, session 19: ext2 writes 0.99-1.24x nbdkit's
    /// MB per CPU-second spread, 1.20-1.28x joined; QD16 random writes +7-19 %). A lone
    /// write goes where the thread's other requests go.
    fn pick(&self, write: bool) -> usize {
        if write
            && let Some(i) = self
                .writes
                .iter()
                .position(|w| w.load(Ordering::Relaxed) > 0)
        {
            return i;
        }
        let n = self.conns.len();
        // The thread may use several pools, of other sizes.
        let start = PREFERRED.with(|p| {
            p.get().unwrap_or_else(|| {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
                p.set(Some(i));
                i
            })
        }) % n;
        let i = (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.conns[i].calls() == 0)
            .unwrap_or(start);
        PREFERRED.with(|p| p.set(Some(i)));
        i
    }

    /// Runs `f` with a connection to itself (other threads' requests on it wait meanwhile).
    pub fn with<R>(&self, f: impl FnOnce(&mut Client) -> R) -> R {
        let i = self.pick(false);
        let r = self.conns[i].exclusive(|c| {
            self.catch_up(c);
            f(c)
        });
        self.note_size(i);
        r
    }

    /// Runs `f` on a connection shared with other threads, for a read or write inside the
    /// export as the connection knows it: a refusal as if it were past the end (EINVAL for
    /// a read, ENOSPC for a write) says the export shrank under the connection
    /// (`rbd resize`; NBD cannot tell an open connection), so the connection is made again
    /// to learn the size now, which [`Self::size`] then says. The request itself still
    /// fails.
    fn with_io<R>(&self, write: bool, f: impl FnOnce(&SharedClient) -> Result<R>) -> Result<R> {
        let i = self.pick(write);
        let conn = &self.conns[i];
        let _writing = write.then(|| Writing::on(&self.writes[i]));
        if conn.size() != self.size() {
            conn.exclusive(|c| self.catch_up(c));
        }
        let r = f(conn);
        if let Err(Error::Server {
            error: ErrorValue::Inval | ErrorValue::NoSpc,
            ..
        }) = &r
        {
            conn.exclusive(|c| c.relearn_size());
        }
        self.note_size(i);
        r
    }

    fn writable(&self) -> Result<()> {
        match self.caps.read_only {
            true => Err(Error::ReadOnly),
            false => Ok(()),
        }
    }

    /// Reads `len` bytes at `offset` (the caller keeps the range inside the export).
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let min = self.caps.min_block;
        let start = offset - offset % min;
        let end = (offset + len).next_multiple_of(min).min(self.size());
        let mut buf = vec![0u8; (end - start) as usize];
        self.with_io(false, |c| c.read_at(start, &mut buf))?;
        if start != offset || end != offset + len {
            let at = (offset - start) as usize;
            buf.copy_within(at..at + len as usize, 0);
            buf.truncate(len as usize);
        }
        Ok(buf)
    }

    /// Reads `into.len()` bytes at `offset` into registered memory, `into` (the caller
    /// keeps the range inside the export, and nothing else uses those bytes meanwhile).
    pub fn read_into(&self, offset: u64, into: MrSlice<'_>) -> Result<()> {
        let min = self.caps.min_block;
        let len = into.len() as u64;
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            return self.with_io(false, |c| c.read_into(offset, into));
        }
        let buf = self.read(offset, len)?;
        into.mr().write_at(into.at(), &buf);
        Ok(())
    }

    /// Writes the bytes of registered memory `from` at `offset`; the NIC sends them from
    /// there.
    pub fn write_from(&self, offset: u64, from: MrSlice<'_>) -> Result<()> {
        self.writable()?;
        let min = self.caps.min_block;
        if offset.is_multiple_of(min) && (from.len() as u64).is_multiple_of(min) {
            let _shared = self.rmw.read();
            return self.with_io(true, |c| c.write_from(offset, from, false));
        }
        // SAFETY: the caller leaves those bytes alone until this returns; no receive WR
        // names them.
        let data = unsafe { from.bytes() };
        self.write(offset, data)
    }

    /// Writes `data` at `offset` (inside the export).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.writable()?;
        let min = self.caps.min_block;
        let len = data.len() as u64;
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            let _shared = self.rmw.read();
            return self.with_io(true, |c| c.write_at(offset, data, false));
        }
        let _exclusive = self.rmw.write();
        let start = offset - offset % min;
        let end = (offset + len).next_multiple_of(min);
        let mut buf = vec![0u8; (end - start) as usize];
        // The head and tail blocks as they are now, then the new bytes over them.
        let head_end = (start + min).min(end);
        let tail_start = (end - min).max(head_end);
        self.with(|c| -> Result<()> {
            c.read_at(start, &mut buf[..(head_end - start) as usize])?;
            if tail_start < end {
                c.read_at(tail_start, &mut buf[(tail_start - start) as usize..])?;
            }
            let at = (offset - start) as usize;
            buf[at..at + data.len()].copy_from_slice(data);
            c.write_at(start, &buf, false)
        })
    }

    /// Makes acknowledged writes durable (NBD FLUSH). With multi-conn one connection's FLUSH
    /// covers the writes acknowledged on all of them.
    pub fn flush(&self) -> Result<()> {
        if self.caps.read_only || !self.caps.flush {
            return Ok(());
        }
        self.with(|c| c.flush())
    }

    /// Zeroes exactly `[offset, offset+len)`: WRITE_ZEROES for whole blocks when the server
    /// has it, written zeroes otherwise.
    pub fn zero(&self, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        let [head, mid, tail] = split(offset, len, self.caps.min_block);
        self.write_zero_bytes(head.0, head.1)?;
        self.write_zero_bytes(tail.0, tail.1)?;
        if mid.1 == 0 {
            return Ok(());
        }
        if self.caps.write_zeroes {
            let _shared = self.rmw.read();
            self.with(|c| c.write_zeroes(mid.0, mid.1, false))
        } else {
            self.write_zero_bytes(mid.0, mid.1)
        }
    }

    fn write_zero_bytes(&self, offset: u64, len: u64) -> Result<()> {
        let zeroes = vec![0u8; len.min(ZERO_CHUNK) as usize];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(ZERO_CHUNK);
            self.write(at, &zeroes[..n as usize])?;
            at += n;
        }
        Ok(())
    }

    /// Punches a hole: TRIM (the server may deallocate), and because NBD leaves trimmed
    /// contents unspecified while a punched hole must read as zeroes, whatever block status
    /// does not then report as zero is zeroed. Without TRIM or block status it is
    /// [`Self::zero`] (WRITE_ZEROES may deallocate too).
    pub fn punch(&self, offset: u64, len: u64) -> Result<()> {
        self.writable()?;
        if !(self.caps.trim && self.caps.block_status) {
            return self.zero(offset, len);
        }
        let [head, mid, tail] = split(offset, len, self.caps.min_block);
        self.write_zero_bytes(head.0, head.1)?;
        self.write_zero_bytes(tail.0, tail.1)?;
        if mid.1 == 0 {
            return Ok(());
        }
        {
            let _shared = self.rmw.read();
            self.with(|c| c.trim(mid.0, mid.1))?;
        }
        let end = mid.0 + mid.1;
        let mut at = mid.0;
        while at < end {
            let extents = self.with(|c| c.block_status(at, end - at))?;
            if extents.is_empty() {
                return self.zero(at, end - at);
            }
            for e in extents {
                let stop = (e.offset + e.length).min(end);
                if !e.zero && stop > at {
                    self.zero(at, stop - at)?;
                }
                at = at.max(stop);
            }
        }
        Ok(())
    }

    /// Lowers every connection's reconnect timeout (see [`Client::limit_reconnect_timeout`]).
    pub fn limit_reconnect_timeout(&self, limit: std::time::Duration) {
        for c in &self.conns {
            c.peek(|c| c.limit_reconnect_timeout(limit));
        }
    }

    /// The connections, to disconnect.
    pub fn into_clients(self) -> Vec<Client> {
        self.conns
            .into_iter()
            .map(SharedClient::into_inner)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_at_block_boundaries() {
        assert_eq!(split(0, 4096, 512), [(0, 0), (0, 4096), (4096, 0)]);
        assert_eq!(split(100, 1000, 512), [(100, 412), (512, 512), (1024, 76)]);
        assert_eq!(split(100, 10, 512), [(100, 10), (110, 0), (110, 0)]);
        assert_eq!(split(7, 9, 1), [(7, 0), (7, 9), (16, 0)]);
    }
}
