//! The export behind the FUSE file: a pool of [`Client`] connections and byte-granular I/O on
//! top of the export's block-granular requests.
//!
//! With a multi-conn server every connection is its own [`Client`] (its own QP, one shared soft
//! NIC); without multi-conn there is exactly one, shared behind a mutex. A FUSE thread takes the
//! first idle connection, starting from the one it used last, and waits on that one when all
//! are busy. Each `Client` pipelines the pieces of one FUSE request itself (up to its window).
//!
//! Requests the server's minimum block size does not divide are widened: reads read the covering
//! blocks, writes read-modify-write the partial head and tail blocks under an exclusive lock
//! (aligned writes share that lock, so a read-modify-write never overwrites a concurrent write's
//! bytes with stale ones). The kernel's page-cache I/O is page-aligned, so only O_DIRECT I/O at
//! odd offsets pays for this, and only against servers with a minimum block size above 1.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use nbd_client::{Client, Error};
use parking_lot::{Mutex, RwLock};
use qpip_core::MemoryRegion;

/// An errno for the application.
pub type Errno = i32;

/// Zero-filled writes (servers without WRITE_ZEROES) go out in pieces of this size.
const ZERO_CHUNK: u64 = 1 << 20;
/// After unmounting: how long a lost server gets to come back for the last flush.
const CLOSE_RECONNECT: std::time::Duration = std::time::Duration::from_secs(2);

/// The errno an NBD client error reaches the application as. Anything that leaves the outcome
/// unknown (lost connection, protocol violation) is EIO: never success, never wrong data.
pub fn errno_of(e: &Error) -> Errno {
    match e {
        Error::Server { error, .. } => nbd_client::error::errno(*error),
        Error::Unsupported(_) => libc::EOPNOTSUPP,
        Error::Unaligned { .. } | Error::Invalid(_) => libc::EINVAL,
        Error::OutOfRange { .. } => libc::ENOSPC,
        _ => libc::EIO,
    }
}

fn log_err(what: &str, offset: u64, len: u64, e: &Error) -> Errno {
    let errno = errno_of(e);
    tracing::warn!(offset, len, "{what} failed: {e} (errno {errno})");
    errno
}

thread_local! {
    /// The connection this thread used last.
    static PREFERRED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// What the export supports, fixed at connect time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub size: u64,
    pub min_block: u64,
    pub read_only: bool,
    pub flush: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    pub block_status: bool,
    pub multi_conn: bool,
}

impl Caps {
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

pub struct Backend {
    conns: Vec<Mutex<Client>>,
    caps: Caps,
    next: AtomicUsize,
    /// Shared by aligned writes, exclusive for read-modify-write.
    rmw: RwLock<()>,
}

/// `[offset, offset+len)` split at block boundaries: (head, middle, tail), each (offset, len).
fn split(offset: u64, len: u64, min: u64) -> [(u64, u64); 3] {
    let end = offset + len;
    let a = offset.next_multiple_of(min).min(end);
    let b = (end - end % min).max(a);
    [(offset, a - offset), (a, b - a), (b, end - b)]
}

impl Backend {
    /// `conns` are connections to the same export (more than one only with multi-conn).
    pub fn new(conns: Vec<Client>, force_read_only: bool) -> Backend {
        assert!(!conns.is_empty(), "a backend needs a connection");
        let caps = Caps::of(&conns[0], force_read_only);
        Backend {
            conns: conns.into_iter().map(Mutex::new).collect(),
            caps,
            next: AtomicUsize::new(0),
            rmw: RwLock::new(()),
        }
    }

    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Runs `f` on an idle connection (or waits for this thread's usual one).
    fn with<R>(&self, f: impl FnOnce(&mut Client) -> R) -> R {
        let n = self.conns.len();
        let start = PREFERRED.with(|p| {
            p.get().unwrap_or_else(|| {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
                p.set(Some(i));
                i
            })
        });
        for k in 0..n {
            let i = (start + k) % n;
            if let Some(mut c) = self.conns[i].try_lock() {
                PREFERRED.with(|p| p.set(Some(i)));
                return f(&mut c);
            }
        }
        f(&mut self.conns[start].lock())
    }

    /// Reads `len` bytes at `offset` (the caller keeps the range inside the export).
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, Errno> {
        let min = self.caps.min_block;
        let start = offset - offset % min;
        let end = (offset + len).next_multiple_of(min).min(self.caps.size);
        let mut buf = vec![0u8; (end - start) as usize];
        self.with(|c| c.read_at(start, &mut buf))
            .map_err(|e| log_err("read", start, end - start, &e))?;
        if start != offset || end != offset + len {
            let at = (offset - start) as usize;
            buf.copy_within(at..at + len as usize, 0);
            buf.truncate(len as usize);
        }
        Ok(buf)
    }

    /// Reads `len` bytes at `offset` into registered memory: `mr` from `at` (the caller keeps
    /// the range inside the export and inside `mr`, and nothing else uses those bytes
    /// meanwhile).
    pub fn read_into(
        &self,
        offset: u64,
        len: u64,
        mr: &MemoryRegion,
        at: usize,
    ) -> Result<(), Errno> {
        let min = self.caps.min_block;
        if at
            .checked_add(len as usize)
            .is_none_or(|end| end > mr.len())
        {
            return Err(libc::EINVAL);
        }
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            return self
                .with(|c| c.read_at_mr(offset, mr, at, len as usize))
                .map_err(|e| log_err("read", offset, len, &e));
        }
        let buf = self.read(offset, len)?;
        mr.write_at(at, &buf);
        Ok(())
    }

    /// Writes `len` bytes of registered memory (`mr` from `at`) at `offset`; the NIC sends
    /// them from there.
    pub fn write_from(
        &self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
    ) -> Result<(), Errno> {
        if self.caps.read_only {
            return Err(libc::EROFS);
        }
        if at.checked_add(len).is_none_or(|end| end > mr.len()) {
            return Err(libc::EINVAL);
        }
        let min = self.caps.min_block;
        if offset.is_multiple_of(min) && (len as u64).is_multiple_of(min) {
            let _shared = self.rmw.read();
            return self
                .with(|c| c.write_at_mr(offset, mr, at, len, false))
                .map_err(|e| log_err("write", offset, len as u64, &e));
        }
        // SAFETY: the range is inside the region (checked above) and the caller leaves those
        // bytes alone until this returns; no receive WR names them.
        let data = unsafe { std::slice::from_raw_parts(mr.as_ptr().add(at), len) };
        self.write(offset, data)
    }

    /// Writes `data` at `offset` (inside the export).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Errno> {
        if self.caps.read_only {
            return Err(libc::EROFS);
        }
        let min = self.caps.min_block;
        let len = data.len() as u64;
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            let _shared = self.rmw.read();
            return self
                .with(|c| c.write_at(offset, data, false))
                .map_err(|e| log_err("write", offset, len, &e));
        }
        let _exclusive = self.rmw.write();
        let start = offset - offset % min;
        let end = (offset + len).next_multiple_of(min);
        let mut buf = vec![0u8; (end - start) as usize];
        // The head and tail blocks as they are now, then the new bytes over them.
        let head_end = (start + min).min(end);
        let tail_start = (end - min).max(head_end);
        self.with(|c| -> nbd_client::Result<()> {
            c.read_at(start, &mut buf[..(head_end - start) as usize])?;
            if tail_start < end {
                c.read_at(tail_start, &mut buf[(tail_start - start) as usize..])?;
            }
            let at = (offset - start) as usize;
            buf[at..at + data.len()].copy_from_slice(data);
            c.write_at(start, &buf, false)
        })
        .map_err(|e| log_err("read-modify-write", start, end - start, &e))
    }

    /// Makes acknowledged writes durable (NBD FLUSH). With multi-conn one connection's FLUSH
    /// covers the writes acknowledged on all of them.
    pub fn flush(&self) -> Result<(), Errno> {
        if self.caps.read_only || !self.caps.flush {
            return Ok(());
        }
        self.with(|c| c.flush())
            .map_err(|e| log_err("flush", 0, 0, &e))
    }

    /// Zeroes exactly `[offset, offset+len)`: WRITE_ZEROES for whole blocks when the server
    /// has it, written zeroes otherwise.
    pub fn zero(&self, offset: u64, len: u64) -> Result<(), Errno> {
        if self.caps.read_only {
            return Err(libc::EROFS);
        }
        let [head, mid, tail] = split(offset, len, self.caps.min_block);
        self.write_zero_bytes(head.0, head.1)?;
        self.write_zero_bytes(tail.0, tail.1)?;
        if mid.1 == 0 {
            return Ok(());
        }
        if self.caps.write_zeroes {
            let _shared = self.rmw.read();
            self.with(|c| c.write_zeroes(mid.0, mid.1, false))
                .map_err(|e| log_err("write zeroes", mid.0, mid.1, &e))
        } else {
            self.write_zero_bytes(mid.0, mid.1)
        }
    }

    fn write_zero_bytes(&self, offset: u64, len: u64) -> Result<(), Errno> {
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
    /// does not then report as zero is zeroed. Without TRIM or block status it is [`Self::zero`]
    /// (WRITE_ZEROES may deallocate too).
    pub fn punch(&self, offset: u64, len: u64) -> Result<(), Errno> {
        if self.caps.read_only {
            return Err(libc::EROFS);
        }
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
            self.with(|c| c.trim(mid.0, mid.1))
                .map_err(|e| log_err("trim", mid.0, mid.1, &e))?;
        }
        let end = mid.0 + mid.1;
        let mut at = mid.0;
        while at < end {
            let extents = self
                .with(|c| c.block_status(at, end - at))
                .map_err(|e| log_err("block status", at, end - at, &e))?;
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

    /// Flushes and disconnects every connection. The file system is unmounted by now: a
    /// server that is gone gets [`CLOSE_RECONNECT`] to come back, not the whole reconnect
    /// timeout, so the process exits promptly.
    pub fn close(self) {
        for c in &self.conns {
            c.lock().limit_reconnect_timeout(CLOSE_RECONNECT);
        }
        if let Err(e) = self.flush() {
            tracing::warn!(
                "final flush failed (errno {e}): writes the server acknowledged may not be durable on it"
            );
        }
        for c in self.conns {
            if let Err(e) = c.into_inner().disconnect() {
                tracing::warn!("disconnect: {e}");
            }
        }
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

    #[test]
    fn errnos() {
        use nbd_proto::transmission::ErrorValue;
        let server = |error| Error::Server {
            error,
            message: String::new(),
        };
        assert_eq!(errno_of(&server(ErrorValue::Io)), libc::EIO);
        assert_eq!(errno_of(&server(ErrorValue::NoSpc)), libc::ENOSPC);
        assert_eq!(errno_of(&server(ErrorValue::Perm)), libc::EPERM);
        let lost = Error::ConnectionLost {
            uri: "nbd://x".into(),
            after: std::time::Duration::from_secs(1),
            why: "gone".into(),
        };
        assert_eq!(errno_of(&lost), libc::EIO);
    }
}
