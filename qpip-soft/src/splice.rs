//! File bodies without a user-space copy: socket → pipe → file with `splice(2)`. The socket's
//! pages move into the pipe by reference, and the one copy left is the file's own (into its
//! page cache), where `recv` + `pwrite` make two. The pipe is emptied before each call returns,
//! so it never holds bytes between turns of the receive machine.
//!
//! Over a link of Ethernet-sized segments the bodies are read instead (`read` into a buffer,
//! then `pwrite`), one copy more: a spliced page is released by the thread that writes the file,
//! so the sending stack on the other side of a veth pair finds its page fragments still held
//! and copies into fresh, cold pages — there the sender's CPU per GB, not ours, bounded the
//! writes (BENCHMARKS.md, issue 36 item 3, session 14).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;

use qpip_verbs::framer::MAX_HEADER;

use crate::stream::ETHERNET_MAX_SEGMENT;

/// Largest pipe asked for; the kernel grants up to `/proc/sys/fs/pipe-max-size` (1 MiB by
/// default), so one splice can take a whole 1 MiB write.
const PIPE_SIZE: libc::c_int = 1 << 20;

/// Most bytes a body waits for before its thread is woken ([`Lowat::set`]); also the most a
/// read-mode call takes at once.
const LOWAT_MAX: usize = 256 << 10;

pub(super) struct Splicer {
    /// None on a link that reads its bodies ([`Splicer::new`]).
    pipe: Option<Pipe>,
    /// The read mode's buffer; with a pipe, where bytes go that must be dropped (a file write
    /// failed with the pipe still full).
    scratch: Vec<u8>,
    lowat: Lowat,
}

struct Pipe {
    read_end: OwnedFd,
    write_end: OwnedFd,
    capacity: usize,
}

/// The socket's `SO_RCVLOWAT` as last set here (1: the kernel's default).
struct Lowat(usize);

impl Splicer {
    /// For a connection whose TCP segments are `segment` bytes (None: not TCP, or unknown):
    /// a pipe to splice through, or none where bodies are read ([`ETHERNET_MAX_SEGMENT`]).
    pub(super) fn new(segment: Option<usize>) -> io::Result<Splicer> {
        let pipe = match segment {
            Some(s) if s <= ETHERNET_MAX_SEGMENT => None,
            _ => Some(Pipe::new()?),
        };
        Ok(Splicer {
            pipe,
            scratch: Vec::new(),
            lowat: Lowat(1),
        })
    }

    /// Writes `prefix` and then up to `max` bytes from `sock` into `file` at `offset` (the
    /// answer of `RxIo::read_into_file`): `WouldBlock` when the socket has nothing. The prefix
    /// (the body's first bytes, read with its header) goes into the pipe (or the buffer) first,
    /// so one file write takes it with the socket's bytes: a small write of its own would cost
    /// a system call and a pass of the file system's write path per message.
    pub(super) fn socket_to_file(
        &mut self,
        sock: RawFd,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> io::Result<(usize, Option<io::Error>)> {
        let Some(pipe) = &self.pipe else {
            return self.read_to_file(sock, file, offset, prefix, max);
        };
        let p = pipe.put(prefix, &mut self.scratch)?;
        let want = max.min(pipe.capacity);
        // SAFETY: both descriptors are open; null offsets mean "current position" (sockets
        // and pipes have none).
        let n = unsafe {
            libc::splice(
                sock,
                std::ptr::null_mut(),
                pipe.write_end.as_raw_fd(),
                std::ptr::null_mut(),
                want,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
            )
        };
        if n <= 0 {
            // Nothing came: the prefix is still the caller's.
            let e = (n < 0).then(io::Error::last_os_error);
            pipe.drop_bytes(p, &mut self.scratch)?;
            return self.lowat.nothing_came(sock, e, max);
        }
        let n = n as usize;
        self.lowat.took(sock, n, max);
        let total = p + n;
        let mut done = 0;
        let mut at = offset as libc::loff_t;
        while done < total {
            // SAFETY: as above; `at` is the file offset splice reads and advances.
            let k = unsafe {
                libc::splice(
                    pipe.read_end.as_raw_fd(),
                    std::ptr::null_mut(),
                    file.as_raw_fd(),
                    &mut at,
                    total - done,
                    libc::SPLICE_F_MOVE,
                )
            };
            match k {
                k if k > 0 => done += k as usize,
                _ => {
                    let e = if k == 0 {
                        io::Error::from(io::ErrorKind::WriteZero)
                    } else {
                        io::Error::last_os_error()
                    };
                    if e.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    pipe.drop_bytes(total - done, &mut self.scratch)?;
                    return Ok((n, Some(e)));
                }
            }
        }
        Ok((n, None))
    }

    /// [`Self::socket_to_file`] without a pipe: the prefix and up to `max` bytes (at most
    /// [`LOWAT_MAX`]) read into the buffer, then one `pwrite`.
    fn read_to_file(
        &mut self,
        sock: RawFd,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> io::Result<(usize, Option<io::Error>)> {
        let p = prefix.len();
        let want = max.min(LOWAT_MAX);
        if self.scratch.len() < p + want {
            self.scratch.resize(MAX_HEADER.max(p) + LOWAT_MAX, 0);
        }
        let buf = &mut self.scratch[p..p + want];
        // SAFETY: `buf` is valid for `want` bytes; the caller keeps `sock` open.
        let n = unsafe { libc::read(sock, buf.as_mut_ptr().cast(), want) };
        if n <= 0 {
            let e = (n < 0).then(io::Error::last_os_error);
            return self.lowat.nothing_came(sock, e, max);
        }
        let n = n as usize;
        self.lowat.took(sock, n, max);
        self.scratch[..p].copy_from_slice(prefix);
        Ok((n, file.write_all_at(&self.scratch[..p + n], offset).err()))
    }
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
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
        Ok(Pipe {
            read_end,
            write_end,
            capacity: usize::try_from(size).unwrap_or(1 << 16).max(4096),
        })
    }

    /// Puts `bytes` into the empty pipe (`vmsplice`); returns how many it holds now.
    fn put(&self, bytes: &[u8], scratch: &mut Vec<u8>) -> io::Result<usize> {
        if bytes.is_empty() {
            return Ok(0);
        }
        let iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        // SAFETY: one iovec over `bytes`, which outlive the call. The pipe holds their pages by
        // reference, not a copy: the caller splices it into the file (the copy) before `bytes`
        // can change, so nothing else may be left in the pipe when it returns.
        let k = unsafe { libc::vmsplice(self.write_end.as_raw_fd(), &iov, 1, 0) };
        match usize::try_from(k) {
            Ok(k) if k == bytes.len() => Ok(k),
            // An empty pipe of at least a page takes a header's bytes whole; anything else is
            // an error, with the pipe emptied again.
            Ok(k) => {
                self.drop_bytes(k, scratch)?;
                Err(io::Error::from(io::ErrorKind::WriteZero))
            }
            Err(_) => Err(io::Error::last_os_error()),
        }
    }

    /// Reads `len` bytes out of the pipe (through `scratch`) and forgets them.
    fn drop_bytes(&self, mut len: usize, scratch: &mut Vec<u8>) -> io::Result<()> {
        if scratch.is_empty() {
            scratch.resize(64 << 10, 0);
        }
        while len > 0 {
            let want = len.min(scratch.len());
            // SAFETY: scratch is valid for `want` bytes.
            let k =
                unsafe { libc::read(self.read_end.as_raw_fd(), scratch.as_mut_ptr().cast(), want) };
            if k <= 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            len -= k as usize;
        }
        Ok(())
    }
}

impl Lowat {
    /// Nothing came from the socket (`e`: why; None: the peer closed): the answer to give,
    /// and while a body owes `max` bytes the socket wakes its reader only once they are in.
    fn nothing_came(
        &mut self,
        sock: RawFd,
        e: Option<io::Error>,
        max: usize,
    ) -> io::Result<(usize, Option<io::Error>)> {
        match e {
            None => Ok((0, None)),
            Some(e) => {
                if e.kind() == io::ErrorKind::WouldBlock {
                    self.set(sock, max.min(LOWAT_MAX));
                }
                Err(e)
            }
        }
    }

    /// `n` of the `max` bytes a body owed came: once it is all in, any byte wakes again.
    fn took(&mut self, sock: RawFd, n: usize, max: usize) {
        if n == max {
            self.set(sock, 1);
        }
    }

    /// Makes epoll report `sock` readable only once `want` bytes are queued (or it closes):
    /// the rest of a body wakes the thread once, not at every segment. Never more than the
    /// body still owes, so the bytes after it (the next header) always wake it.
    fn set(&mut self, sock: RawFd, want: usize) {
        if want == self.0 {
            return;
        }
        let v = libc::c_int::try_from(want).unwrap_or(libc::c_int::MAX);
        // SAFETY: plain setsockopt on a descriptor the caller keeps open, with an int value.
        let r = unsafe {
            libc::setsockopt(
                sock,
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            self.0 = want;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixStream;

    /// Both ways of placing a body: spliced (a connection with no segment size, such as a Unix
    /// socket, or loopback's) and read (a 1500-byte link's segments).
    const MODES: [Option<usize>; 2] = [None, Some(1448)];

    #[test]
    fn a_link_of_ethernet_segments_reads_its_bodies_where_loopback_splices_them() {
        for (segment, pipe) in [
            (Some(1448), false),
            (Some(8948), false),
            (Some(65483), true),
            (None, true),
        ] {
            let s = Splicer::new(segment).unwrap();
            assert_eq!(s.pipe.is_some(), pipe, "segment {segment:?}");
        }
    }

    #[test]
    fn socket_bytes_land_in_the_file_at_the_offset() {
        for segment in MODES {
            let (mut a, b) = UnixStream::pair().unwrap();
            b.set_nonblocking(true).unwrap();
            let tmp = tempfile::tempfile().unwrap();
            let mut s = Splicer::new(segment).unwrap();
            let err = s
                .socket_to_file(b.as_raw_fd(), &tmp, 0, &[], 10)
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
            a.write_all(b"hello, file").unwrap();
            let (n, e) = s.socket_to_file(b.as_raw_fd(), &tmp, 100, &[], 5).unwrap();
            assert_eq!((n, e.is_none()), (5, true));
            let (n, _) = s
                .socket_to_file(b.as_raw_fd(), &tmp, 105, &[], 100)
                .unwrap();
            assert_eq!(n, 6);
            let mut got = [0u8; 11];
            tmp.read_exact_at(&mut got, 100).unwrap();
            assert_eq!(&got, b"hello, file");
            drop(a);
            assert_eq!(
                s.socket_to_file(b.as_raw_fd(), &tmp, 0, &[], 10).unwrap().0,
                0
            );
        }
    }

    /// `fd` polls readable now.
    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        assert!(unsafe { libc::poll(&mut p, 1, 0) } >= 0);
        p.revents & libc::POLLIN != 0
    }

    /// Sends `data` and gives loopback a moment to queue it at the reader.
    fn send(to: &mut std::net::TcpStream, data: &[u8]) {
        to.write_all(data).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    #[test]
    fn the_rest_of_a_body_wakes_the_reader_once_it_has_all_come_and_no_later() {
        for segment in MODES {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (b, _) = l.accept().unwrap();
            b.set_nonblocking(true).unwrap();
            let fd = b.as_raw_fd();
            let tmp = tempfile::tempfile().unwrap();
            let mut s = Splicer::new(segment).unwrap();
            let err = s.socket_to_file(fd, &tmp, 0, &[], 1000).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
            // Part of the body: no wake-up for it (before, every segment woke the reader).
            send(&mut a, &[1; 600]);
            assert!(!readable(fd), "woken by 600 of the 1000 bytes owed");
            // Taken anyway, the rest is awaited, and no more than the rest.
            assert_eq!(s.socket_to_file(fd, &tmp, 0, &[], 1000).unwrap().0, 600);
            let err = s.socket_to_file(fd, &tmp, 600, &[], 400).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
            send(&mut a, &[2; 399]);
            assert!(!readable(fd));
            send(&mut a, &[3]);
            assert!(readable(fd), "the body's last byte must wake the reader");
            assert_eq!(s.socket_to_file(fd, &tmp, 600, &[], 400).unwrap().0, 400);
            // The body is in: the next message's first byte wakes it at once.
            send(&mut a, &[4]);
            assert!(readable(fd), "a header after the body must wake the reader");
            let mut got = vec![0u8; 1000];
            tmp.read_exact_at(&mut got, 0).unwrap();
            assert!(got[..600].iter().all(|&x| x == 1) && got[999] == 3);
        }
    }

    #[test]
    fn a_prefix_goes_into_the_file_with_the_socket_bytes_and_stays_the_callers_until_then() {
        for segment in MODES {
            let (mut a, b) = UnixStream::pair().unwrap();
            b.set_nonblocking(true).unwrap();
            let tmp = tempfile::tempfile().unwrap();
            let mut s = Splicer::new(segment).unwrap();
            // Nothing on the socket: nothing written, and the pipe holds nothing of the prefix.
            let err = s
                .socket_to_file(b.as_raw_fd(), &tmp, 10, b"head", 6)
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
            assert_eq!(tmp.metadata().unwrap().len(), 0);
            a.write_all(b"body!!").unwrap();
            let (n, e) = s
                .socket_to_file(b.as_raw_fd(), &tmp, 10, b"head", 6)
                .unwrap();
            assert_eq!((n, e.is_none()), (6, true));
            let mut got = [0u8; 10];
            tmp.read_exact_at(&mut got, 10).unwrap();
            assert_eq!(&got, b"headbody!!");
            assert_eq!(tmp.metadata().unwrap().len(), 20);
            // The peer closed: the prefix is dropped with nothing written.
            drop(a);
            assert_eq!(
                s.socket_to_file(b.as_raw_fd(), &tmp, 40, b"xy", 6)
                    .unwrap()
                    .0,
                0
            );
            assert_eq!(tmp.metadata().unwrap().len(), 20);
        }
    }

    #[test]
    fn a_refused_file_write_drops_the_bytes_and_says_why() {
        for segment in MODES {
            let (mut a, b) = UnixStream::pair().unwrap();
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("ro");
            std::fs::write(&path, b"").unwrap();
            let ro = File::open(&path).unwrap();
            let mut s = Splicer::new(segment).unwrap();
            a.write_all(b"first second").unwrap();
            let (n, e) = s.socket_to_file(b.as_raw_fd(), &ro, 0, &[], 6).unwrap();
            assert_eq!(n, 6);
            assert_eq!(e.unwrap().raw_os_error(), Some(libc::EBADF));
            // The pipe is empty again: what follows comes out of the socket in order.
            let mut rest = [0u8; 6];
            std::io::Read::read_exact(&mut &b, &mut rest).unwrap();
            assert_eq!(&rest, b"second");
        }
    }
}
