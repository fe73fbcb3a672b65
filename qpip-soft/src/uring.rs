//! io_uring for the TCP data path of the soft NIC.
//!
//! The transmit and receive machines take their socket as a `read`/`write` closure. Here that
//! closure submits a READV/WRITEV and answers "would block"; when the completion arrives the
//! engine runs the machine again and the closure hands over the result. The machine's state
//! did not move meanwhile, so it asks for the same iovecs, and the result applies to them.
//! One `io_uring_enter` then submits every QP's I/O and waits for all of it; the control path
//! (accept, connect, UDP, the doorbell eventfd) stays on epoll, whose descriptor the ring
//! watches with a multishot poll.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::RawFd;

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use qpip_verbs::wr::QpNum;

use crate::splice::Splicer;

pub(super) const OP_READ: u64 = 1;
pub(super) const OP_WRITE: u64 = 2;
const EPOLL_TOKEN: u64 = u64::MAX;

fn user_data(qp: QpNum, op: u64) -> u64 {
    (u64::from(qp) << 8) | op
}

/// What a completion is about.
pub(super) enum Event {
    /// The epoll descriptor is readable: poll it.
    Epoll,
    /// A QP's read or write finished with `result` (bytes, or -errno).
    Io { qp: QpNum, op: u64, result: i32 },
}

pub(super) struct Ring {
    ring: IoUring,
    epoll_fd: RawFd,
    epoll_armed: bool,
}

impl Ring {
    pub(super) fn new(epoll_fd: RawFd) -> io::Result<Ring> {
        Ok(Ring {
            ring: IoUring::new(256)?,
            epoll_fd,
            epoll_armed: false,
        })
    }

    /// The ring's descriptor: readable while completions wait in it.
    pub(super) fn fd(&self) -> RawFd {
        use std::os::fd::AsRawFd;
        self.ring.as_raw_fd()
    }

    pub(super) fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every entry's buffers (iovec arrays and the memory they name) stay alive
            // and untouched until its completion: see UringIo and the deferred teardown.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?; // the queue is full: hand it to the kernel and retry
        }
    }

    /// Submits what is queued; with `wait`, sleeps until at least one completion.
    pub(super) fn submit(&mut self, wait: bool) -> io::Result<()> {
        if !self.epoll_armed {
            let poll = opcode::PollAdd::new(types::Fd(self.epoll_fd), libc::POLLIN as u32)
                .multi(true)
                .build()
                .user_data(EPOLL_TOKEN);
            self.push(&poll)?;
            self.epoll_armed = true;
        }
        let r = if wait {
            self.ring.submit_and_wait(1)
        } else if self.ring.submission().is_empty() {
            // Nothing to hand over: completions are read from the ring's memory, and the
            // kernel kicks this thread itself to run the work behind them.
            return Ok(());
        } else {
            self.ring.submit()
        };
        match r {
            Ok(_) => Ok(()),
            Err(e)
                if e.raw_os_error() == Some(libc::EINTR)
                    || e.raw_os_error() == Some(libc::EBUSY) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub(super) fn completions(&mut self, out: &mut Vec<Event>) {
        for cqe in self.ring.completion() {
            if cqe.user_data() == EPOLL_TOKEN {
                if !cqueue::more(cqe.flags()) {
                    self.epoll_armed = false;
                }
                out.push(Event::Epoll);
            } else {
                let ud = cqe.user_data();
                out.push(Event::Io {
                    qp: (ud >> 8) as QpNum,
                    op: ud & 0xff,
                    result: cqe.result(),
                });
            }
        }
    }
}

/// One direction's operation on a QP's socket.
enum Op {
    Idle,
    InFlight,
    Done(io::Result<usize>),
}

/// A QP's reads and writes through the ring.
pub(super) struct UringIo {
    qp: QpNum,
    read: Op,
    write: Op,
    /// The iovec arrays the kernel reads while an operation is in flight.
    read_iov: Vec<libc::iovec>,
    write_iov: Vec<libc::iovec>,
    /// The message header of the write in flight (sendmsg, for MSG_NOSIGNAL: a peer that
    /// went away must give EPIPE, not a SIGPIPE).
    write_msg: libc::msghdr,
    /// Entries to hand to the ring after this turn of the machines.
    pub(super) outbox: Vec<squeue::Entry>,
    /// The last read through the ring came back short of what it asked: the socket is
    /// most likely empty, so the next read goes to the ring without a `readv` first.
    drained: bool,
    /// Bytes the read in flight asked for.
    read_asked: usize,
}

/// What a QP of an engine holds for its I/O through the engine's io_uring: [`UringIo`] on
/// the engine that has a ring, [`NoRing`] on the epoll engine. A `UringIo` is not `Send` (it
/// holds raw pointers the kernel reads while an operation is in flight, and the ring belongs
/// to the thread that made it), so neither is an engine whose QPs may hold one: only the
/// epoll engine can be handed to a driven queue, which host threads run
/// ([`qpip_verbs::machines::shell::NicThread::spawn_driven`]).
pub(super) trait RingIo: Sized {
    /// A reliable QP's I/O through the ring (None: the engine has none).
    fn new(qp: QpNum) -> Option<Self>;
    /// The ring I/O.
    fn get(&self) -> &UringIo;
    /// The ring I/O.
    fn get_mut(&mut self) -> &mut UringIo;
}

impl RingIo for UringIo {
    fn new(qp: QpNum) -> Option<Self> {
        Some(UringIo::new(qp))
    }
    fn get(&self) -> &UringIo {
        self
    }
    fn get_mut(&mut self) -> &mut UringIo {
        self
    }
}

/// The epoll engine's QPs: no ring I/O, ever (no value of this type exists).
pub(super) enum NoRing {}

impl RingIo for NoRing {
    fn new(_: QpNum) -> Option<Self> {
        None
    }
    fn get(&self) -> &UringIo {
        match *self {}
    }
    fn get_mut(&mut self) -> &mut UringIo {
        match *self {}
    }
}

fn take_result(op: &mut Op) -> Option<io::Result<usize>> {
    match std::mem::replace(op, Op::Idle) {
        Op::Done(r) => Some(r),
        Op::InFlight => {
            *op = Op::InFlight;
            Some(Err(io::ErrorKind::WouldBlock.into()))
        }
        Op::Idle => None,
    }
}

impl UringIo {
    pub(super) fn new(qp: QpNum) -> Self {
        UringIo {
            qp,
            read: Op::Idle,
            write: Op::Idle,
            read_iov: Vec::new(),
            write_iov: Vec::new(),
            // SAFETY: an all-zero msghdr is a valid empty one.
            write_msg: unsafe { std::mem::zeroed() },
            outbox: Vec::new(),
            drained: false,
            read_asked: 0,
        }
    }

    pub(super) fn in_flight(&self) -> bool {
        matches!(self.read, Op::InFlight) || matches!(self.write, Op::InFlight)
    }

    /// The `read` closure of the receive machine. While bytes keep arriving a plain `readv`
    /// takes them (as many messages per turn as are there); only an empty socket goes to the
    /// ring, which then does the waiting.
    pub(super) fn read(&mut self, fd: RawFd, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if let Some(r) = take_result(&mut self.read) {
            return r;
        }
        if !std::mem::take(&mut self.drained) {
            // SAFETY: IoSliceMut is ABI-compatible with iovec on Unix; the buffers are live.
            let n = unsafe { libc::readv(fd, iov.as_ptr().cast(), iov.len() as libc::c_int) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::WouldBlock {
                return Err(err);
            }
        }
        self.read_iov.clear();
        self.read_iov.extend(iov.iter_mut().map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        }));
        let e = opcode::Readv::new(
            types::Fd(fd),
            self.read_iov.as_ptr(),
            self.read_iov.len() as u32,
        )
        .build()
        .user_data(user_data(self.qp, OP_READ));
        self.outbox.push(e);
        self.read_asked = iov.iter().map(|b| b.len()).sum();
        self.read = Op::InFlight;
        Err(io::ErrorKind::WouldBlock.into())
    }

    /// A file body (`RxIo::read_into_file`): spliced while the socket has bytes; once it is
    /// empty a poll on the ring waits for more, and the next turn splices again.
    pub(super) fn splice_in(
        &mut self,
        fd: RawFd,
        splicer: &mut Splicer,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> io::Result<(usize, Option<io::Error>)> {
        match self.read {
            Op::InFlight => return Err(io::ErrorKind::WouldBlock.into()),
            // The poll fired (or failed): whatever it said, the splice tells the truth.
            Op::Done(_) => self.read = Op::Idle,
            Op::Idle => {}
        }
        match splicer.socket_to_file(fd, file, offset, prefix, max) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                    .build()
                    .user_data(user_data(self.qp, OP_READ));
                self.outbox.push(e);
                self.read_asked = 0;
                self.read = Op::InFlight;
                Err(io::ErrorKind::WouldBlock.into())
            }
            r => r,
        }
    }

    /// The `write` closure of the transmit machine: a plain `sendmsg` while the socket takes
    /// bytes, the ring once it is full.
    pub(super) fn write(&mut self, fd: RawFd, iov: &[IoSlice<'_>]) -> io::Result<usize> {
        if let Some(r) = take_result(&mut self.write) {
            return r;
        }
        // SAFETY: an all-zero msghdr is valid; IoSlice is ABI-compatible with iovec on Unix.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        // SAFETY: msg points at live iovecs for the duration of the call.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::WouldBlock {
            return Err(err);
        }
        self.write_iov.clear();
        self.write_iov.extend(iov.iter().map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        }));
        self.write_msg.msg_iov = self.write_iov.as_mut_ptr();
        self.write_msg.msg_iovlen = self.write_iov.len();
        let e = opcode::SendMsg::new(types::Fd(fd), &self.write_msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data(self.qp, OP_WRITE));
        self.outbox.push(e);
        self.write = Op::InFlight;
        Err(io::ErrorKind::WouldBlock.into())
    }

    /// Records a completion for the next turn of the machine. EAGAIN (a spurious wake-up)
    /// leaves the operation idle, so the next turn simply tries again.
    pub(super) fn complete(&mut self, op: u64, result: i32) {
        if result == -libc::EAGAIN {
            match op {
                OP_READ => self.read = Op::Idle,
                OP_WRITE => self.write = Op::Idle,
                _ => {}
            }
            return;
        }
        let r = if result < 0 {
            Err(io::Error::from_raw_os_error(-result))
        } else {
            Ok(result as usize)
        };
        match op {
            OP_READ => {
                // A short read most likely emptied the socket (the kernel gives what it has).
                self.drained = matches!(r, Ok(n) if n < self.read_asked);
                self.read = Op::Done(r);
            }
            OP_WRITE => self.write = Op::Done(r),
            _ => {}
        }
    }
}
