//! The FUSE-over-io_uring transport (Linux 6.14+): after INIT with FUSE_OVER_IO_URING, every
//! queue (one per possible CPU; the kernel queues a request on the queue of the CPU its
//! task runs on) gets ring entries, each a header area and a payload buffer registered with
//! FUSE_IO_URING_CMD_REGISTER (an IORING_OP_URING_CMD on the /dev/fuse fd, in a 128-byte SQE).
//! Its completion brings a request; one COMMIT_AND_FETCH submission then both answers it and
//! takes the next.
//!
//! Here every entry has its own thread and its own small io_uring (set up by that thread,
//! checked before INIT is answered), so a request that waits
//! for the server blocks nothing else; the kernel copies a request into an entry in the task
//! that submitted the entry's command, which is that thread. Each entry lives in one
//! registered memory region: the header area, then the payload, where the kernel puts WRITE
//! data (sent to the server from there) and where READ data from the server is placed for the
//! kernel.
//!
//! The threads are not pinned to their queue's CPU, as libfuse pins its per-CPU queue threads:
//! a request waits on the queue of the CPU its task ran on, and a pinned thread must wait for
//! that CPU while the other one idles. Pinned on this two-core machine, 4 KiB QD1 through the
//! mount made a fifth fewer requests per second (BENCHMARKS, session 18).

use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, squeue, types};
use qpip_core::{Access, MemoryRegion, Nic};

use crate::abi::{self, bytes_of, fuse_in_header, fuse_out_header, fuse_uring_ent_in_out};
use crate::fs::{Buffers, NbdFs, Outcome};
use crate::proto;

/// Where the payload starts in an entry's region (the header area is 288 bytes).
const PAYLOAD: usize = 4096;
const HEADER: usize = size_of::<abi::fuse_uring_req_header>();
const OFF_OP_IN: usize = abi::URING_IN_OUT_HEADER_SZ;
const OFF_ENT: usize = OFF_OP_IN + abi::URING_OP_IN_OUT_SZ;

/// Completion results that mean the connection is gone, not that something failed.
const GONE: [i32; 4] = [
    libc::ENOTCONN,
    libc::ECANCELED,
    libc::ECONNABORTED,
    libc::ENODEV,
];

/// Byte offset of `len` in `struct io_uring_sqe` (u8 opcode, u8 flags, u16 ioprio, s32 fd,
/// u64 off, u64 addr, u32 len): the io-uring crate's URING_CMD builder does not set it.
const SQE_LEN_OFFSET: usize = 24;

/// The queues the kernel has: one per possible CPU (num_possible_cpus()).
pub(crate) fn queue_count() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| possible_cpus(&s))
        .unwrap_or_else(|| {
            // SAFETY: plain sysconf query.
            let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
            n.max(1) as usize
        })
}

/// Counts the CPUs of a kernel CPU list ("0-3,8,10-11").
fn possible_cpus(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().ok()?.checked_sub(a.parse().ok()?)? + 1,
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// One ring entry with its io_uring, ready to register.
pub(crate) struct Entry {
    ring: IoUring<squeue::Entry128>,
    mr: MemoryRegion,
    qid: u16,
    payload_len: usize,
    /// iov[0]: header area, iov[1]: payload (read by the kernel at REGISTER time).
    iov: Box<[libc::iovec; 2]>,
}

impl Entry {
    /// Sets up an entry for queue `qid` whose payload holds `payload_len` bytes (at least the
    /// kernel's max(max_write, max_pages × page size)), to be served by the calling thread.
    /// Fails where io_uring is not allowed.
    pub(crate) fn new(nic: &Nic, qid: u16, payload_len: usize) -> io::Result<Entry> {
        // One thread (the caller's: a single-issuer ring belongs to the task that creates
        // it) submits and waits on this ring: the kernel's work for it (copying the next
        // request into the entry) can wait until that thread asks for completions, instead
        // of interrupting it (DEFER_TASKRUN, Linux 6.1+; plain setup otherwise).
        let ring = IoUring::<squeue::Entry128>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(4)
            .or_else(|_| IoUring::<squeue::Entry128>::builder().build(4))?;
        let mr = nic.alloc_region(PAYLOAD + payload_len, Access::READ_WRITE);
        // Resident now, as registered memory is: the kernel's copy of a request into the
        // payload would otherwise fault its pages in one by one during the first requests
        // (page clearing in the FUSE threads' profile of an ext2 write).
        for at in (0..mr.len()).step_by(4096) {
            mr.write_at(at, &[0]);
        }
        let iov = Box::new([
            libc::iovec {
                iov_base: mr.as_ptr().cast(),
                iov_len: HEADER,
            },
            libc::iovec {
                // SAFETY: PAYLOAD is inside the region.
                iov_base: unsafe { mr.as_ptr().add(PAYLOAD) }.cast(),
                iov_len: payload_len,
            },
        ]);
        let mut e = Entry {
            ring,
            mr,
            qid,
            payload_len,
            iov,
        };
        // A no-op round trip: the ring works for this thread (seccomp filters and
        // io_uring_disabled let io_uring_setup succeed and fail later, or fail at once).
        let nop = squeue::Entry128::from(opcode::Nop::new().build().user_data(0));
        e.submit_wait(&nop)?;
        Ok(e)
    }

    fn command(&self, fd: RawFd, cmd_op: u32, commit_id: u64) -> squeue::Entry128 {
        let req = abi::fuse_uring_cmd_req {
            flags: 0,
            commit_id,
            qid: self.qid,
            padding: [0; 6],
        };
        let mut cmd = [0u8; 80];
        cmd[..size_of::<abi::fuse_uring_cmd_req>()].copy_from_slice(bytes_of(&req));
        let mut b = opcode::UringCmd80::new(types::Fd(fd), cmd_op).cmd(cmd);
        if cmd_op == abi::IO_URING_CMD_REGISTER {
            b = b.addr(Some(self.iov.as_ptr() as u64));
        }
        let mut sqe = b.build().user_data(u64::from(cmd_op));
        if cmd_op == abi::IO_URING_CMD_REGISTER {
            set_sqe_len(&mut sqe, 2);
        }
        sqe
    }

    /// Submits `sqe` and waits for its completion: Ok(true) when it brought a request,
    /// Ok(false) when the connection is gone (unmounted or aborted).
    fn submit_wait(&mut self, sqe: &squeue::Entry128) -> io::Result<bool> {
        // SAFETY: the command names the entry's iovecs and region, which outlive it (the
        // entry is dropped only after its last command completed).
        unsafe { self.ring.submission().push(sqe) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            if let Some(cqe) = self.ring.completion().next() {
                return match cqe.result() {
                    0.. => Ok(true),
                    r if GONE.contains(&-r) => Ok(false),
                    r => Err(io::Error::from_raw_os_error(-r)),
                };
            }
        }
    }

    /// Registers the entry and serves requests until the connection ends. Err: the entry
    /// could not be registered (the kernel then goes back to /dev/fuse for every request) or
    /// a commit failed.
    pub(crate) fn serve(mut self, fd: RawFd, fs: &NbdFs) -> io::Result<()> {
        let reg = self.command(fd, abi::IO_URING_CMD_REGISTER, 0);
        let mut got = self
            .submit_wait(&reg)
            .map_err(|e| io::Error::new(e.kind(), format!("FUSE_IO_URING_CMD_REGISTER: {e}")))?;
        while got {
            let commit_id = self.handle(fs);
            let sqe = self.command(fd, abi::IO_URING_CMD_COMMIT_AND_FETCH, commit_id);
            got = self.submit_wait(&sqe).map_err(|e| {
                io::Error::new(e.kind(), format!("FUSE_IO_URING_CMD_COMMIT_AND_FETCH: {e}"))
            })?;
        }
        Ok(())
    }

    /// Handles the request in the entry and writes the answer there; returns its commit id.
    fn handle(&mut self, fs: &NbdFs) -> u64 {
        let mut hdr = [0u8; HEADER];
        self.mr.read_at(0, &mut hdr);
        let ent: fuse_uring_ent_in_out = abi::read(&hdr[OFF_ENT..]).unwrap_or_default();
        let h: fuse_in_header = abi::read(&hdr).unwrap_or_default();
        let op_in =
            &hdr[OFF_OP_IN..OFF_OP_IN + abi::op_in_size(h.opcode).min(abi::URING_OP_IN_OUT_SZ)];
        let rest_len = (ent.payload_sz as usize).min(self.payload_len);
        let outcome = {
            // SAFETY: the kernel filled the payload before completing the command; until the
            // commit is submitted the entry is this thread's. The view ends before the reply
            // is written into the same bytes.
            let rest =
                unsafe { std::slice::from_raw_parts(self.mr.as_ptr().add(PAYLOAD), rest_len) };
            match proto::parse(h.opcode, op_in, rest) {
                Ok(op) => {
                    let bufs = Buffers {
                        mr: &self.mr,
                        input: PAYLOAD,
                        input_len: rest_len,
                        out: PAYLOAD,
                        out_cap: self.payload_len,
                    };
                    fs.handle(&h, &op, &bufs)
                }
                Err(e) => {
                    tracing::warn!(unique = h.unique, "bad request: {e}");
                    Outcome::Error(libc::EINVAL)
                }
            }
        };
        let (error, len) = match outcome {
            Outcome::Reply(n) => (0, n),
            Outcome::Error(e) => (-e, 0),
            Outcome::Silent => (0, 0),
        };
        let out = fuse_out_header {
            len: (size_of::<fuse_out_header>() + len) as u32,
            error,
            unique: h.unique,
        };
        self.mr.write_at(0, bytes_of(&out));
        let ent_out = fuse_uring_ent_in_out {
            payload_sz: len as u32,
            ..Default::default()
        };
        self.mr.write_at(OFF_ENT, bytes_of(&ent_out));
        ent.commit_id
    }
}

/// Sets `len` of a 128-byte SQE.
fn set_sqe_len(sqe: &mut squeue::Entry128, len: u32) {
    const { assert!(size_of::<squeue::Entry128>() == 128) };
    // SAFETY: Entry128 is repr(C) and starts with the kernel's struct io_uring_sqe, whose
    // `len` is a u32 at byte 24 (checked by the test below).
    unsafe {
        (sqe as *mut squeue::Entry128)
            .cast::<u8>()
            .add(SQE_LEN_OFFSET)
            .cast::<u32>()
            .write_unaligned(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqe_bytes(e: &squeue::Entry128) -> [u8; 128] {
        // SAFETY: Entry128 is 128 bytes of plain data.
        unsafe { std::ptr::read_unaligned((e as *const squeue::Entry128).cast::<[u8; 128]>()) }
    }

    /// The SQE the ring sends: opcode IORING_OP_URING_CMD (46), the fd at 4, cmd_op at 8,
    /// addr at 16, len at 24, the 80-byte command from 48 — struct io_uring_sqe's layout.
    #[test]
    fn uring_cmd_sqe_layout() {
        let req = abi::fuse_uring_cmd_req {
            flags: 0,
            commit_id: 0x1122_3344_5566_7788,
            qid: 3,
            padding: [0; 6],
        };
        let mut cmd = [0u8; 80];
        cmd[..24].copy_from_slice(bytes_of(&req));
        let mut sqe = opcode::UringCmd80::new(types::Fd(7), abi::IO_URING_CMD_REGISTER)
            .cmd(cmd)
            .addr(Some(0xdead_beef))
            .build();
        set_sqe_len(&mut sqe, 2);
        let b = sqe_bytes(&sqe);
        assert_eq!(b[0], 46, "IORING_OP_URING_CMD");
        assert_eq!(i32::from_ne_bytes(b[4..8].try_into().unwrap()), 7);
        assert_eq!(u32::from_ne_bytes(b[8..12].try_into().unwrap()), 1);
        assert_eq!(
            u64::from_ne_bytes(b[16..24].try_into().unwrap()),
            0xdead_beef
        );
        assert_eq!(u32::from_ne_bytes(b[24..28].try_into().unwrap()), 2);
        assert_eq!(&b[48..72], bytes_of(&req));
        assert_eq!(u16::from_ne_bytes(b[64..66].try_into().unwrap()), 3, "qid");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(possible_cpus("0-1\n"), Some(2));
        assert_eq!(possible_cpus("0"), Some(1));
        assert_eq!(possible_cpus("0-3,8,10-11"), Some(7));
        assert_eq!(possible_cpus("x"), None);
        assert_eq!(possible_cpus("3-1"), None);
    }
}
