//! The NIC handle over a running backend: it registers memory and creates CQs, QPs and
//! listeners. Which backend runs is chosen above the backends (`qpip_core::Nic::open`).

use std::any::Any;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::backend::{Command, ListenerId, NicBackend, NicHandle};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::{Access, FileRegion, MemoryRegion, MemoryTable};
use crate::qp::{QpAttr, QueuePair};
use crate::reply::{ReplyReceiver, reply_channel};
use crate::shared::QpKind;

/// A handle on a NIC. Clones share it, and so does every QP and listener: the NIC goes away
/// when the last handle, QP and listener are gone. That drop stops and joins the NIC's threads
/// and closes every descriptor the NIC opened (the sockets of its QPs and listeners among
/// them) before it returns, unless another thread is inside a CQ wait on one of its queues,
/// which lets go when its wait returns. CQs and memory regions do not keep the NIC: a CQ that
/// outlives it holds the completions of the WRs flushed as its QPs were destroyed.
#[derive(Clone)]
pub struct Nic {
    inner: Arc<NicHandle>,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nic")
            .field("backend", &self.inner.backend.name())
            .finish()
    }
}

impl Nic {
    /// Wraps a backend built elsewhere (it must resolve SGEs through `memory`).
    pub fn with_backend(backend: Box<dyn NicBackend>, memory: Arc<MemoryTable>) -> Nic {
        Nic {
            inner: Arc::new(NicHandle {
                backend,
                memory,
                next_qp: AtomicU32::new(1),
                next_listener: AtomicU32::new(1),
            }),
        }
    }

    /// The backend's name (`soft`, `lanai`).
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// How the NIC moves data ("io_uring" or "epoll" for the soft NIC).
    pub fn io_path(&self) -> &'static str {
        self.inner.backend.io_path()
    }

    /// Kernel thread ids of the NIC engine's threads, for CPU accounting.
    pub fn engine_threads(&self) -> Vec<i32> {
        self.inner.backend.engine_threads()
    }

    /// CPU time application threads spent running the NIC's queues while they waited on
    /// CQs (run to completion): the NIC's work, inside those threads' own CPU time. Counted
    /// from the first call on (zero then): the count costs two system calls per wait.
    pub fn driven_cpu(&self) -> Duration {
        self.inner.backend.driven_cpu()
    }

    /// Waits (up to `timeout`) until the NIC has run every command issued before this call
    /// and writes no more into memory named by QPs dropped before it ([`Command::Fence`]).
    /// False if the NIC did not answer in time (or is gone).
    pub fn fence(&self, timeout: Duration) -> bool {
        let (tx, rx) = reply_channel();
        self.inner.manage(Command::Fence { reply: tx });
        rx.wait_until(Some(Instant::now() + timeout)).is_some()
    }

    /// Registers `len` zeroed bytes, allocated and owned by the region.
    pub fn alloc_region(&self, len: usize, access: Access) -> MemoryRegion {
        self.inner.memory.register_owned(len, access)
    }

    /// Registers memory the caller owns (an mmap of a disk image, say).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until the last clone of the region and every WR naming
    /// it are gone. `keep_alive` is dropped only then, so it may own the memory.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> MemoryRegion {
        // SAFETY: the caller keeps `len` bytes at `ptr` valid for the region's life.
        unsafe {
            self.inner
                .memory
                .register_borrowed(ptr, len, access, keep_alive)
        }
    }

    /// Registers the first `len` bytes of `file` (a disk image, say) so that a framer may have
    /// message bodies written there by the NIC ([`crate::Frame::MessageAt`]).
    pub fn register_file(&self, file: Arc<std::fs::File>, len: u64, access: Access) -> FileRegion {
        self.inner.memory.register_file(file, len, access)
    }

    /// Creates a completion queue holding up to `depth` completions.
    pub fn create_cq(&self, depth: usize) -> CompletionQueue {
        CompletionQueue::new(depth)
    }

    /// Creates a reliable (TCP) QP, idle until it is connected or accepted.
    pub fn create_qp(&self, attr: QpAttr) -> QueuePair {
        self.new_qp(QpKind::Reliable, attr)
    }

    /// A new QP of `kind` as `attr` says.
    pub fn new_qp(&self, kind: QpKind, attr: QpAttr) -> QueuePair {
        let num = self.inner.next_qp.fetch_add(1, Ordering::Relaxed);
        let (qp, framer) = QueuePair::create(&self.inner, num, kind, attr);
        self.inner.manage(Command::CreateQp {
            qp: qp.shared.clone(),
            framer,
        });
        qp
    }

    /// Creates an unreliable (UDP) QP bound to `addr` (port 0 picks one). Every send WR names
    /// its destination; every receive completion reports its source. The framer is unused:
    /// a datagram is a message.
    pub fn create_udp_qp(&self, addr: SocketAddr, attr: QpAttr) -> Result<QueuePair> {
        let qp = self.new_qp(QpKind::Unreliable, attr);
        let (tx, rx) = reply_channel();
        self.inner.manage(Command::BindUdp {
            qp: qp.num(),
            addr,
            reply: tx,
        });
        wait_mgmt(rx, None, "bind UDP", addr)?;
        Ok(qp)
    }

    /// Listens for TCP connections on `addr`; incoming connections wait until a QP accepts
    /// them.
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener> {
        let id = self.inner.next_listener.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = reply_channel();
        self.inner.manage(Command::Listen {
            id,
            addr,
            backlog: 1024,
            reply: tx,
        });
        let local = wait_mgmt(rx, None, "listen on", addr)?;
        Ok(Listener {
            id,
            local,
            unix: None,
            nic: self.inner.clone(),
        })
    }

    /// Listens on a Unix-domain stream socket created at `path`, readable and writable by
    /// its owner only, and removed when the listener closes. A stale socket file (nothing
    /// listening on it) is replaced; anything else at `path` is an error. Accepts report
    /// [`crate::backend::UNIX_ADDR`] as the peer. The LANai backend refuses it.
    pub fn listen_unix(&self, path: &Path) -> Result<Listener> {
        let id = self.inner.next_listener.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = reply_channel();
        self.inner.manage(Command::ListenUnix {
            id,
            path: path.to_path_buf(),
            backlog: 1024,
            reply: tx,
        });
        let local = match rx.wait_until(None) {
            Some(r) => r.map_err(|source| Error::NetPath {
                op: "listen on",
                path: path.to_path_buf(),
                source,
            })?,
            None => {
                return Err(Error::Engine(format!(
                    "listen on {}: no reply from the NIC engine",
                    path.display()
                )));
            }
        };
        Ok(Listener {
            id,
            local,
            unix: Some(path.to_path_buf()),
            nic: self.inner.clone(),
        })
    }

    /// Listens on a TCP socket that is already bound and listening, such as one passed by
    /// systemd socket activation: the NIC takes it over, as if [`Nic::listen`] had made it.
    pub fn listen_fd(&self, fd: std::os::fd::OwnedFd) -> Result<Listener> {
        use std::os::fd::AsRawFd;
        let raw = fd.as_raw_fd();
        let id = self.inner.next_listener.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = reply_channel();
        self.inner.manage(Command::ListenFd {
            id,
            fd,
            backlog: 1024,
            reply: tx,
        });
        let local = match rx.wait_until(None) {
            Some(r) => r.map_err(|source| {
                Error::Engine(format!(
                    "listening on inherited socket (fd {raw}): {source}"
                ))
            })?,
            None => {
                return Err(Error::Engine(format!(
                    "listening on inherited socket (fd {raw}): no reply from the NIC engine"
                )));
            }
        };
        Ok(Listener {
            id,
            local,
            unix: None,
            nic: self.inner.clone(),
        })
    }
}

fn wait_mgmt(
    rx: ReplyReceiver<std::io::Result<SocketAddr>>,
    timeout: Option<Duration>,
    op: &'static str,
    addr: SocketAddr,
) -> Result<SocketAddr> {
    match rx.wait_until(timeout.map(|t| Instant::now() + t)) {
        Some(r) => r.map_err(|source| Error::Net { op, addr, source }),
        None => match timeout {
            Some(after) => Err(Error::Timeout { op, after }),
            None => Err(Error::Engine(format!(
                "{op} {addr}: no reply from the NIC engine"
            ))),
        },
    }
}

/// Where a reliable connection ends: an IP address and port, or a Unix-domain socket's path.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// An IP address and port.
    Ip(SocketAddr),
    /// A Unix-domain socket's path.
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Ip(a) => a.fmt(f),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A listening port. Each `accept` mates one incoming connection to an idle QP.
pub struct Listener {
    id: ListenerId,
    local: SocketAddr,
    /// The socket's path, for a Unix-domain listener.
    unix: Option<PathBuf>,
    nic: Arc<NicHandle>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .field("unix", &self.unix)
            .finish()
    }
}

impl Listener {
    /// The bound address ([`crate::backend::UNIX_ADDR`] for a Unix-domain listener).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The socket's path, for a Unix-domain listener.
    pub fn unix_path(&self) -> Option<&Path> {
        self.unix.as_deref()
    }

    /// Where the listener is: its address, or its socket's path.
    pub fn endpoint(&self) -> Endpoint {
        match &self.unix {
            Some(p) => Endpoint::Unix(p.clone()),
            None => Endpoint::Ip(self.local),
        }
    }

    /// The peer an accept reported, as an endpoint: a Unix-domain peer is known by the
    /// listener's path (its own socket is usually unnamed).
    pub fn peer_endpoint(&self, peer: SocketAddr) -> Endpoint {
        match &self.unix {
            Some(p) => Endpoint::Unix(p.clone()),
            None => Endpoint::Ip(peer),
        }
    }

    /// Waits for a connection and mates it to `qp` (which must be idle); returns the peer.
    pub fn accept(&self, qp: &QueuePair) -> Result<SocketAddr> {
        self.accept_until(qp, None)
    }

    /// [`Self::accept`] that gives up after `timeout` (the QP stays idle).
    pub fn accept_timeout(&self, qp: &QueuePair, timeout: Duration) -> Result<SocketAddr> {
        self.accept_until(qp, Some(timeout))
    }

    fn accept_until(&self, qp: &QueuePair, timeout: Option<Duration>) -> Result<SocketAddr> {
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::Accept {
            listener: self.id,
            qp: qp.num(),
            reply: tx,
        });
        wait_mgmt(rx, timeout, "accept on", self.local)
    }

    /// Accepts from async code.
    pub async fn accept_async(&self, qp: &QueuePair) -> Result<SocketAddr> {
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::Accept {
            listener: self.id,
            qp: qp.num(),
            reply: tx,
        });
        match rx.wait_async().await {
            Some(r) => r.map_err(|source| Error::Net {
                op: "accept on",
                addr: self.local,
                source,
            }),
            None => Err(Error::Engine(format!(
                "accept on {}: no reply from the NIC engine",
                self.local
            ))),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.nic
            .manage(Command::CloseListener { listener: self.id });
    }
}
