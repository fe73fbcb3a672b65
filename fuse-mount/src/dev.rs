//! The /dev/fuse transport: worker threads each read one request at a time from the device
//! into their own registered buffer and answer it with one writev. Also the path for what the
//! kernel never sends over the ring (FORGET, INTERRUPT) and for the connection's end (ENODEV).

use std::io;
use std::os::fd::RawFd;

use qpip_core::{Access, MemoryRegion, Nic};

use crate::abi::{self, bytes_of, fuse_in_header, fuse_out_header};
use crate::fs::{Buffers, NbdFs, Outcome};
use crate::proto;

/// A worker's input area: the largest request (header, fuse_write_in, MAX_IO bytes of data)
/// with room to spare, as the kernel demands of /dev/fuse readers.
pub(crate) const IN_CAP: usize = crate::fs::MAX_IO as usize + abi::MIN_READ_BUFFER;

/// One worker's buffer: the request at the start, the reply at [`IN_CAP`].
pub(crate) fn buffer(nic: &Nic) -> MemoryRegion {
    nic.alloc_region(2 * IN_CAP, Access::READ_WRITE)
}

/// Reads one message into `mr` (from 0). Ok(None): the connection is gone (unmounted).
pub(crate) fn read_message(fd: RawFd, mr: &MemoryRegion) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: the first IN_CAP bytes of the region are this worker's and no WR names them
        // while the kernel writes there.
        let n = unsafe { libc::read(fd, mr.as_ptr().cast(), IN_CAP.min(mr.len())) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            // Interrupted, or the request was aborted before it was read: read again.
            Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
            Some(libc::ENODEV) => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Answers request `unique`: `body` bytes of `mr` from `at` (or an error).
pub(crate) fn reply(fd: RawFd, unique: u64, result: Result<(&MemoryRegion, usize, usize), i32>) {
    let (error, body) = match result {
        Ok(b) => (0, Some(b)),
        Err(e) => (-e, None),
    };
    let len = size_of::<fuse_out_header>() + body.map_or(0, |b| b.2);
    let h = fuse_out_header {
        len: len as u32,
        error,
        unique,
    };
    let hb = bytes_of(&h);
    let mut iov = [
        libc::iovec {
            iov_base: hb.as_ptr() as *mut _,
            iov_len: hb.len(),
        },
        libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        },
    ];
    let mut n = 1;
    if let Some((mr, at, blen)) = body
        && blen > 0
    {
        // SAFETY: at..at+blen is inside the region (the handler wrote the reply there).
        iov[1].iov_base = unsafe { mr.as_ptr().add(at) }.cast();
        iov[1].iov_len = blen;
        n = 2;
    }
    // SAFETY: the iovecs point at live memory for the duration of the call.
    let r = unsafe { libc::writev(fd, iov.as_ptr(), n) };
    if r < 0 {
        let e = io::Error::last_os_error();
        // ENOENT: the request was interrupted meanwhile; nothing waits for the answer.
        if e.raw_os_error() != Some(libc::ENOENT) && e.raw_os_error() != Some(libc::ENODEV) {
            tracing::warn!(unique, "answering the kernel failed: {e}");
        }
    }
}

/// Tells the kernel to drop node `ino`'s cached attributes and its page cache from `off`
/// (`len` 0: to the end); its next stat asks us again. Not from a request's handler: the
/// kernel may wait there for pages that request holds.
pub(crate) fn notify_inval_inode(fd: RawFd, ino: u64, off: i64, len: i64) -> io::Result<()> {
    let body = abi::fuse_notify_inval_inode_out { ino, off, len };
    notify(fd, abi::NOTIFY_INVAL_INODE, &[bytes_of(&body)])
}

/// Tells the kernel to drop its cached entry for `name` in directory `parent`: the next
/// lookup of the name asks us again.
pub(crate) fn notify_inval_entry(fd: RawFd, parent: u64, name: &[u8]) -> io::Result<()> {
    let body = abi::fuse_notify_inval_entry_out {
        parent,
        namelen: name.len() as u32,
        flags: 0,
    };
    // The kernel reads the name with its terminating NUL.
    notify(fd, abi::NOTIFY_INVAL_ENTRY, &[bytes_of(&body), name, &[0]])
}

/// Writes one unsolicited message (`code` in the error field, unique 0) made of `parts`.
fn notify(fd: RawFd, code: i32, parts: &[&[u8]]) -> io::Result<()> {
    let len = size_of::<fuse_out_header>() + parts.iter().map(|p| p.len()).sum::<usize>();
    let h = fuse_out_header {
        len: len as u32,
        error: code,
        unique: 0,
    };
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(bytes_of(&h));
    for p in parts {
        msg.extend_from_slice(p);
    }
    // SAFETY: msg is live for the duration of the call.
    let r = unsafe { libc::write(fd, msg.as_ptr().cast(), msg.len()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Handles one message the worker read into `mr`.
pub(crate) fn serve_one(fd: RawFd, fs: &NbdFs, mr: &MemoryRegion, n: usize) {
    // SAFETY: the first `n` bytes were just written by read(2); nothing writes them while
    // this view lives (the reply goes to the other half).
    let msg = unsafe { std::slice::from_raw_parts(mr.as_ptr(), n) };
    let (h, args): (fuse_in_header, &[u8]) = match proto::split_message(msg) {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!("unreadable request from the kernel: {e}");
            return;
        }
    };
    let parsed = proto::split_args(h.opcode, args)
        .and_then(|(op_in, rest)| Ok((proto::parse(h.opcode, op_in, rest)?, rest.len())));
    let (op, rest_len) = match parsed {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(unique = h.unique, "bad request: {e}");
            return reply(fd, h.unique, Err(libc::EINVAL));
        }
    };
    let bufs = Buffers {
        mr,
        input: size_of::<fuse_in_header>() + abi::op_in_size(h.opcode),
        input_len: rest_len,
        out: IN_CAP,
        out_cap: mr.len() - IN_CAP,
    };
    match fs.handle(&h, &op, &bufs) {
        Outcome::Silent => {}
        Outcome::Reply(len) => reply(fd, h.unique, Ok((mr, IN_CAP, len))),
        Outcome::Error(e) => reply(fd, h.unique, Err(e)),
    }
}

/// A worker: serves requests until the connection ends.
pub(crate) fn worker(fd: RawFd, fs: &NbdFs, mr: MemoryRegion) -> io::Result<()> {
    while let Some(n) = read_message(fd, &mr)? {
        serve_one(fd, fs, &mr, n);
    }
    Ok(())
}
