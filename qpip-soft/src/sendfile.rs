//! Send WRs that name a registered file: file → pipe → socket with `splice(2)`. The pipe
//! takes the file's page-cache pages by reference, and the socket takes them from the pipe
//! by reference too, so the bytes are not copied on the way out (the sender's copy that
//! `writev` from a mapping makes). Memory parts of the same messages (the framer's header, a
//! reply header) are copied into the pipe, so a header and its data leave in the same
//! segments. Unlike the receive side's pipe ([`crate::splice`]), this one may hold
//! bytes between turns: the socket was full, and what is in the pipe goes first next time.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Largest pipe asked for: 1 MiB, the default `/proc/sys/fs/pipe-max-size`.
const PIPE_SIZE: libc::c_int = 1 << 20;

pub(super) struct SendPipe {
    read_end: OwnedFd,
    write_end: OwnedFd,
    capacity: usize,
}

impl SendPipe {
    pub(super) fn new() -> io::Result<SendPipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: fds is a valid two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 returned two new descriptors that nothing else owns.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: plain fcntl on our descriptor; a refusal leaves the default size.
        let got = unsafe { libc::fcntl(write_end.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
        let size = if got > 0 {
            got
        } else {
            // SAFETY: plain fcntl on our descriptor, as above.
            unsafe { libc::fcntl(write_end.as_raw_fd(), libc::F_GETPIPE_SZ) }
        };
        Ok(SendPipe {
            read_end,
            write_end,
            capacity: usize::try_from(size).unwrap_or(1 << 16).max(4096),
        })
    }

    /// Bytes the pipe holds at most (each piece put takes at least a page of it).
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies `bytes` into the pipe's own pages; `WouldBlock` when it is full. A `write`,
    /// not `vmsplice`: vmsplice would put the caller's pages in the pipe by reference, and
    /// the socket would keep them after the WR completes, to send whatever the host writes
    /// there next.
    pub(super) fn put_bytes(&mut self, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: `bytes` is a live buffer of its length.
        let n = unsafe {
            libc::write(
                self.write_end.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
            )
        };
        result(n)
    }

    /// Moves up to `len` bytes of `file` from `offset` into the pipe by reference;
    /// `WouldBlock` when it is full, `Ok(0)` past the file's end.
    pub(super) fn put_file(&mut self, file: &File, offset: u64, len: usize) -> io::Result<usize> {
        let mut at = offset as libc::loff_t;
        // SAFETY: both descriptors are open; `at` is the file offset splice reads from.
        let n = unsafe {
            libc::splice(
                file.as_raw_fd(),
                &mut at,
                self.write_end.as_raw_fd(),
                std::ptr::null_mut(),
                len,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
            )
        };
        result(n)
    }

    /// Moves up to `len` bytes from the pipe into the socket; `WouldBlock` when it is full.
    pub(super) fn send_to(&mut self, sock: RawFd, len: usize) -> io::Result<usize> {
        // SAFETY: both descriptors are open; pipes and sockets have no offset.
        let n = unsafe {
            libc::splice(
                self.read_end.as_raw_fd(),
                std::ptr::null_mut(),
                sock,
                std::ptr::null_mut(),
                len,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
            )
        };
        result(n)
    }
}

fn result(n: isize) -> io::Result<usize> {
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}
