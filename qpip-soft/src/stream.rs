//! The byte streams a reliable QP runs over: TCP, or a local Unix-domain stream socket. Both
//! are plain file descriptors to the data path (epoll or io_uring); only connecting,
//! addressing and socket options differ.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use mio::event::Source;
use mio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use mio::{Interest, Registry, Token};

/// Links whose TCP segments are at most this many bytes (Ethernet's MTUs up to 9000; loopback's
/// are 64 KiB) read file bodies instead of splicing them (`splice`) and cut their writes at
/// whole GSO packets (`tx`).
pub(crate) const ETHERNET_MAX_SEGMENT: usize = 9_000;

/// A connected (or connecting) stream socket.
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Local and peer IP addresses (none for a Unix socket).
    pub(super) fn ip_addrs(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        match self {
            Stream::Tcp(s) => (s.local_addr().ok(), s.peer_addr().ok()),
            Stream::Unix(_) => (None, None),
        }
    }

    /// Each message should leave as soon as it is posted (batching is done by writev); a Unix
    /// socket has no Nagle to turn off.
    pub(super) fn set_nodelay(&self) {
        if let Stream::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }

    /// The connection's TCP segment size (`TCP_MAXSEG`: 1448 bytes on a 1500-byte link, about
    /// 64 KiB over loopback); none for a Unix socket or when the kernel does not say.
    pub(super) fn segment_size(&self) -> Option<usize> {
        let Stream::Tcp(s) = self else {
            return None;
        };
        let mut mss: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket, and an int-sized out-parameter with its length.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_MAXSEG,
                (&raw mut mss).cast(),
                &mut len,
            )
        };
        (rc == 0 && mss > 0).then_some(mss as usize)
    }

    /// A non-blocking connect has finished: `Ok(true)` connected, `Ok(false)` not yet.
    pub(super) fn connected(&self) -> io::Result<bool> {
        let err = match self {
            Stream::Tcp(s) => s.take_error(),
            Stream::Unix(s) => s.take_error(),
        };
        if let Some(e) = err? {
            return Err(e);
        }
        let peer = match self {
            Stream::Tcp(s) => s.peer_addr().map(drop),
            Stream::Unix(s) => s.peer_addr().map(drop),
        };
        match peer {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Its peer reset it (a TCP RST): nothing can be sent or read on it any more.
    pub(super) fn was_reset(&self) -> bool {
        match self {
            Stream::Tcp(s) => s
                .take_error()
                .is_ok_and(|e| e.is_some_and(|e| e.kind() == io::ErrorKind::ConnectionReset)),
            Stream::Unix(_) => false,
        }
    }

    /// The address a connect reply carries.
    pub(super) fn reply_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Stream::Tcp(s) => s.local_addr(),
            Stream::Unix(_) => Ok(qpip_verbs::backend::UNIX_ADDR),
        }
    }

    /// Another handle on the same socket (a duplicated descriptor).
    pub(super) fn try_clone(&self) -> io::Result<Stream> {
        use std::os::fd::AsFd;
        let fd = self.as_fd().try_clone_to_owned()?;
        Ok(match self {
            Stream::Tcp(_) => Stream::Tcp(TcpStream::from_std(std::net::TcpStream::from(fd))),
            Stream::Unix(_) => Stream::Unix(UnixStream::from_std(
                std::os::unix::net::UnixStream::from(fd),
            )),
        })
    }

    pub(super) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        }
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }
}

impl std::os::fd::AsFd for Stream {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
        }
    }
}

// OpenSSL owns its stream and reads and writes through `&mut`.
impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read_vectored(bufs),
            Stream::Unix(s) => (&*s).read_vectored(bufs),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }
    /// A short message (a framing header and a small body) is gathered into one buffer and
    /// sent with `send`, which skips writev's iovec import and file layer: a round trip's
    /// every message (BENCHMARKS, "A message's own path").
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if bufs.len() > 1 && total <= GATHER {
            let mut one = [0u8; GATHER];
            let mut at = 0;
            for b in bufs {
                one[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
            return self.write(&one[..at]);
        }
        match *self {
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
            Stream::Unix(s) => (&*s).write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The longest write gathered into one buffer: a copy this short costs less than writev's
/// iovec import.
const GATHER: usize = 256;

impl Source for Stream {
    fn register(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.register(r, t, i),
            Stream::Unix(s) => s.register(r, t, i),
        }
    }
    fn reregister(&mut self, r: &Registry, t: Token, i: Interest) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.reregister(r, t, i),
            Stream::Unix(s) => s.reregister(r, t, i),
        }
    }
    fn deregister(&mut self, r: &Registry) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.deregister(r),
            Stream::Unix(s) => s.deregister(r),
        }
    }
}

/// A listening socket.
pub(super) enum Acceptor {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        /// Removes the socket file when the listener goes.
        _file: SocketFile,
    },
}

impl Acceptor {
    /// The next connection and the address to report for its peer.
    pub(super) fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        match self {
            Acceptor::Tcp(l) => l.accept().map(|(s, a)| (Stream::Tcp(s), a)),
            Acceptor::Unix { listener, .. } => listener
                .accept()
                .map(|(s, _)| (Stream::Unix(s), qpip_verbs::backend::UNIX_ADDR)),
        }
    }
}

impl AsRawFd for Acceptor {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Acceptor::Tcp(l) => l.as_raw_fd(),
            Acceptor::Unix { listener, .. } => listener.as_raw_fd(),
        }
    }
}

/// The socket file of a Unix listener: removed when the listener goes, if it is still ours.
pub(super) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        // Someone may have replaced it meanwhile: remove only the file this listener made.
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A TCP listener on `addr` whose kernel queue holds `backlog` connections (capped by
/// net.core.somaxconn). mio's bind asks for 128 only: a flood of clients that connect and
/// reset overflowed it, and each dropped SYN cost its client a one-second retransmission
/// (nbdkit and qemu-nbd listen with SOMAXCONN).
pub(super) fn listen_tcp(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(backlog.min(i32::MAX as u32) as i32)?;
    sock.set_nonblocking(true)?;
    Ok(TcpListener::from_std(sock.into()))
}

/// A Unix-domain listener at `path`, readable and writable by its owner only. A stale socket
/// file (nothing accepts on it) is replaced; any other file there is left alone and refused.
pub(super) fn listen_unix(path: &Path, backlog: u32) -> io::Result<(UnixListener, SocketFile)> {
    use socket2::{Domain, Socket, Type};
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            ));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another server is listening on it",
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path)?; // stale: its server is gone
            }
            Err(e) => return Err(e),
        }
    }
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    bind_private(&sock, path)?;
    let made = std::fs::symlink_metadata(path)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        dev: made.dev(),
        ino: made.ino(),
    };
    sock.listen(backlog.min(i32::MAX as u32) as i32)?;
    sock.set_nonblocking(true)?;
    let std_listener: std::os::unix::net::UnixListener = sock.into();
    Ok((UnixListener::from_std(std_listener), file))
}

/// Binds `sock` at `path` with mode 0600 from the start. Linux gives a Unix socket's file the
/// mode of the socket's inode (less the umask) when it binds, and `fchmod` on the unbound
/// socket sets that mode: so no name is ever chmod-ed (a chmod by name would follow a
/// symlink that someone swapped in after the bind, in a directory others may write).
fn bind_private(sock: &socket2::Socket, path: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fchmod on a descriptor this function borrows for the call.
    if unsafe { libc::fchmod(sock.as_raw_fd(), 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    sock.bind(&socket2::SockAddr::unix(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn a_tcp_stream_knows_its_segment_size_and_a_unix_one_has_none() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let tcp = Stream::Tcp(TcpStream::from_std(client));
        // Loopback's MTU is 64 KiB: its segments are far larger than a 1500-byte link's.
        assert!(
            tcp.segment_size().is_some_and(|mss| mss > 1448),
            "{:?}",
            tcp.segment_size()
        );
        let (unix, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(
            Stream::Unix(UnixStream::from_std(unix)).segment_size(),
            None
        );
    }

    /// What happened in directory `dir` while `f` ran, as inotify saw it: (mask, name).
    fn events_in(dir: &Path, f: impl FnOnce()) -> Vec<(u32, String)> {
        // SAFETY: plain system calls on a descriptor this function owns.
        unsafe {
            let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
            assert!(fd >= 0, "{}", io::Error::last_os_error());
            let d = CString::new(dir.as_os_str().as_bytes()).unwrap();
            assert!(libc::inotify_add_watch(fd, d.as_ptr(), libc::IN_ALL_EVENTS) >= 0);
            f();
            let mut buf = vec![0u8; 64 << 10];
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            libc::close(fd);
            let mut out = Vec::new();
            let mut at = 0;
            while n > 0 && at < n as usize {
                let ev = buf
                    .as_ptr()
                    .add(at)
                    .cast::<libc::inotify_event>()
                    .read_unaligned();
                let name = &buf[at + 16..at + 16 + ev.len as usize];
                let name = String::from_utf8_lossy(name)
                    .trim_end_matches('\0')
                    .to_string();
                out.push((ev.mask, name));
                at += 16 + ev.len as usize;
            }
            out
        }
    }

    #[test]
    fn a_unix_listener_s_file_is_0600_from_its_bind_and_no_name_is_chmod_ed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let mut made = None;
        let events = events_in(dir.path(), || made = Some(listen_unix(&path, 8).unwrap()));
        let mode = std::fs::symlink_metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // One creation, of the socket itself, and nothing else: no directory beside it, no
        // rename into place, no attribute change by name (IN_ATTRIB), which a path swapped
        // for a symlink would have redirected.
        assert_eq!(
            events,
            [(libc::IN_CREATE, "s.sock".to_string())],
            "{events:x?}"
        );
        drop(made);
        assert!(!path.exists(), "the listener's file outlived it");
    }
}
