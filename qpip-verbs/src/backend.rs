//! The NIC backend trait: what sits under the verbs.
//!
//! The host side of a QP is its rings ([`QpShared`]): posting writes a WR there and rings the
//! doorbell. Everything else is the backend's: the doorbell, management, transmit and receive
//! state machines of a NIC. `soft` runs them on an engine thread over kernel sockets; `lanai`
//! runs firmware on an emulated LANai 9.

use std::io;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use crate::framer::Framer;
use crate::mr::MemoryTable;
use crate::reply::ReplySender;
use crate::shared::QpShared;
use crate::wr::QpNum;

/// Identifies a listening port on a NIC.
pub type ListenerId = u32;

/// The result of a management command that yields an address.
pub type MgmtResult = io::Result<SocketAddr>;

/// The address a management reply carries for a Unix-domain socket, which has no IP
/// address: the unspecified `[::]:0`. The host knows the socket's path.
pub const UNIX_ADDR: SocketAddr = SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0));

/// Privileged commands for the management state machine.
#[non_exhaustive]
pub enum Command {
    /// A new QP: its rings and the framer that delimits its incoming messages.
    CreateQp {
        /// The QP's shared state.
        qp: Arc<QpShared>,
        /// Its framer.
        framer: Box<dyn Framer>,
    },
    /// Bind an unreliable QP to a UDP address; replies with the bound address.
    BindUdp {
        /// The QP.
        qp: QpNum,
        /// The address to bind.
        addr: SocketAddr,
        /// Gets the bound address.
        reply: ReplySender<MgmtResult>,
    },
    /// Connect a reliable QP; replies with the local address once the connection is up.
    Connect {
        /// The QP.
        qp: QpNum,
        /// The peer's address.
        addr: SocketAddr,
        /// Gets the local address once connected.
        reply: ReplySender<MgmtResult>,
    },
    /// Connect a reliable QP to a Unix-domain stream socket; replies [`UNIX_ADDR`] once the
    /// connection is up. NICs without host sockets refuse it.
    ConnectUnix {
        /// The QP.
        qp: QpNum,
        /// The socket's path.
        path: PathBuf,
        /// Gets [`UNIX_ADDR`] once connected.
        reply: ReplySender<MgmtResult>,
    },
    /// Listen for connections; replies with the bound address.
    Listen {
        /// The new listener.
        id: ListenerId,
        /// The address to listen on.
        addr: SocketAddr,
        /// Connections waiting to be accepted, at most.
        backlog: u32,
        /// Gets the bound address.
        reply: ReplySender<MgmtResult>,
    },
    /// Listen on a Unix-domain stream socket created at `path` (owner-only access; removed
    /// when the listener closes); replies [`UNIX_ADDR`], and so does each accept on it. NICs
    /// without host sockets refuse it.
    ListenUnix {
        /// The new listener.
        id: ListenerId,
        /// The socket's path.
        path: PathBuf,
        /// Connections waiting to be accepted, at most.
        backlog: u32,
        /// Gets [`UNIX_ADDR`].
        reply: ReplySender<MgmtResult>,
    },
    /// Listen on a socket that is already bound and listening, handed over by its owner
    /// (systemd socket activation); replies with its address. The NIC owns it from then on.
    ListenFd {
        /// The new listener.
        id: ListenerId,
        /// The listening socket.
        fd: std::os::fd::OwnedFd,
        /// Connections waiting to be accepted, at most.
        backlog: u32,
        /// Gets its address.
        reply: ReplySender<MgmtResult>,
    },
    /// Mate the next incoming connection on `listener` to the idle QP `qp`; replies with the
    /// peer's address. A backend may answer it on the calling thread when a connection is
    /// already waiting (the soft NIC does).
    Accept {
        /// The listener.
        listener: ListenerId,
        /// The idle QP that takes the connection.
        qp: QpNum,
        /// Gets the peer's address.
        reply: ReplySender<MgmtResult>,
    },
    /// Stop listening (waiting accepts fail).
    CloseListener {
        /// The listener.
        listener: ListenerId,
    },
    /// Switch a connected reliable QP to TLS: the NIC runs the handshake, then carries every
    /// message in TLS records. Only with no WR outstanding on the QP and nothing received
    /// past the last message; replies once the handshake is done (or failed, which fails
    /// the QP). NICs without TLS refuse it.
    StartTls {
        /// The QP.
        qp: QpNum,
        /// Credentials and peer checks.
        config: Box<crate::tls::TlsConfig>,
        /// Gets the handshake's outcome.
        reply: ReplySender<io::Result<()>>,
    },
    /// Orderly close: finish posted sends, shut the connection, flush receives.
    Close {
        /// The QP.
        qp: QpNum,
    },
    /// Abortive close: flush everything now.
    Disconnect {
        /// The QP.
        qp: QpNum,
    },
    /// Disconnect and forget the QP.
    Destroy {
        /// The QP.
        qp: QpNum,
    },
    /// Answered once every command before it has run and the NIC writes no more into the
    /// memory of any QP destroyed before it (I/O it had under way has finished): after that,
    /// memory those QPs' WRs or framers named is the host's again.
    Fence {
        /// Answered when the fence holds.
        reply: ReplySender<()>,
    },
}

/// A NIC implementation under the verbs.
pub trait NicBackend: Send + Sync + 'static {
    /// Short name for messages ("soft", "lanai").
    fn name(&self) -> &'static str;
    /// Hands a command to the management state machine.
    fn manage(&self, cmd: Command);
    /// Tells the doorbell state machine that `qp` has new WRs. Called on every post; it must
    /// be cheap (no system call unless the NIC sleeps).
    fn ring_doorbell(&self, qp: &Arc<QpShared>);
    /// How the NIC moves data ("io_uring", "epoll", "firmware", ...), for reports.
    fn io_path(&self) -> &'static str;
    /// Kernel thread ids of the threads that play the NIC processor (for CPU accounting).
    fn engine_threads(&self) -> Vec<i32>;
    /// CPU time application threads spent doing the NIC's work while they waited on a CQ
    /// (run to completion, [`crate::drive`]); their own accounting counts it as theirs.
    fn driven_cpu(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// Stops the NIC; called when the last handle is gone. Its threads have ended when it
    /// returns, and dropping the backend then closes every descriptor it opened: nothing the
    /// backend owns may own the backend back.
    fn shutdown(&self);
}

/// An open NIC as the verbs hold it: the backend, the memory table it resolves SGEs
/// through, and the numbering of QPs and listeners. The backend stops when the last QP,
/// listener and `Nic` handle are gone.
pub(crate) struct NicHandle {
    pub(crate) backend: Box<dyn NicBackend>,
    pub(crate) memory: Arc<MemoryTable>,
    pub(crate) next_qp: AtomicU32,
    pub(crate) next_listener: AtomicU32,
}

impl NicHandle {
    pub(crate) fn manage(&self, cmd: Command) {
        self.backend.manage(cmd);
    }
    pub(crate) fn ring_doorbell(&self, qp: &Arc<QpShared>) {
        self.backend.ring_doorbell(qp);
    }
}

impl Drop for NicHandle {
    fn drop(&mut self) {
        self.backend.shutdown();
    }
}
