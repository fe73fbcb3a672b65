//! The management state machine's one dispatcher: every backend answers the same privileged
//! commands ([`Command`]); this decides which answer runs and when the host gets its reply.

use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use crate::backend::{Command, ListenerId, MgmtResult};
use crate::framer::Framer;
use crate::reply::ReplySender;
use crate::shared::QpShared;
use crate::wr::QpNum;

/// What a NIC does for each management command.
pub trait Management {
    /// A new QP: its rings and the framer of its incoming messages.
    fn create_qp(&mut self, qp: Arc<QpShared>, framer: Box<dyn Framer>);
    /// Binds an unreliable QP; the bound address.
    fn bind_udp(&mut self, qp: QpNum, addr: SocketAddr) -> MgmtResult;
    /// Starts connecting a reliable QP; `reply` is answered once the connection is up.
    fn connect(&mut self, qp: QpNum, addr: SocketAddr, reply: ReplySender<MgmtResult>);
    /// Opens a listener; the bound address.
    fn listen(&mut self, id: ListenerId, addr: SocketAddr, backlog: u32) -> MgmtResult;
    /// Takes over a listening socket bound by someone else; its address. NICs without host
    /// sockets refuse it.
    fn listen_fd(&mut self, id: ListenerId, fd: OwnedFd, backlog: u32) -> MgmtResult {
        let _ = (id, fd, backlog);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this NIC cannot take over a host socket",
        ))
    }
    /// Opens a listener on a Unix-domain socket at `path`. NICs without host sockets (the
    /// LANai reaches only its fabric) refuse it.
    fn listen_unix(&mut self, id: ListenerId, path: PathBuf, backlog: u32) -> MgmtResult {
        let _ = (id, path, backlog);
        Err(no_unix())
    }
    /// Starts connecting a reliable QP to a Unix-domain socket; NICs without host sockets
    /// refuse it.
    fn connect_unix(&mut self, qp: QpNum, path: PathBuf, reply: ReplySender<MgmtResult>) {
        let _ = (qp, path);
        reply.send(Err(no_unix()));
    }
    /// Switches `qp` to TLS; `reply` is answered when the handshake ends. NICs without TLS
    /// (the LANai) refuse it.
    fn start_tls(
        &mut self,
        qp: QpNum,
        config: Box<crate::tls::TlsConfig>,
        reply: ReplySender<io::Result<()>>,
    ) {
        let _ = (qp, config);
        reply.send(Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this NIC does not do TLS",
        )));
    }
    /// Queues `qp` for the next connection on `listener`; `reply` gets the peer. Only called
    /// for a listener that exists.
    fn accept(&mut self, listener: ListenerId, qp: QpNum, reply: ReplySender<MgmtResult>);
    /// `listener` exists.
    fn has_listener(&self, listener: ListenerId) -> bool;
    /// Closes `listener`; its waiting accepts fail.
    fn close_listener(&mut self, listener: ListenerId);
    /// Orderly close.
    fn close(&mut self, qp: QpNum);
    /// Abortive close.
    fn disconnect(&mut self, qp: QpNum);
    /// Disconnect and forget.
    fn destroy(&mut self, qp: QpNum);
    /// Answers `reply` once no destroyed QP's I/O is under way ([`Command::Fence`]). A NIC
    /// whose reads finish within the turn that starts them answers at once.
    fn fence(&mut self, reply: ReplySender<()>) {
        reply.send(());
    }
}

/// Runs one command on `nic`.
pub fn dispatch(nic: &mut impl Management, cmd: Command) {
    match cmd {
        Command::CreateQp { qp, framer } => nic.create_qp(qp, framer),
        Command::BindUdp { qp, addr, reply } => reply.send(nic.bind_udp(qp, addr)),
        Command::Connect { qp, addr, reply } => nic.connect(qp, addr, reply),
        Command::ConnectUnix { qp, path, reply } => nic.connect_unix(qp, path, reply),
        Command::ListenUnix {
            id,
            path,
            backlog,
            reply,
        } => reply.send(nic.listen_unix(id, path, backlog)),
        Command::Listen {
            id,
            addr,
            backlog,
            reply,
        } => reply.send(nic.listen(id, addr, backlog)),
        Command::ListenFd {
            id,
            fd,
            backlog,
            reply,
        } => reply.send(nic.listen_fd(id, fd, backlog)),
        Command::Accept {
            listener,
            qp,
            reply,
        } => {
            if nic.has_listener(listener) {
                nic.accept(listener, qp, reply);
            } else {
                reply.send(Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "no such listener",
                )));
            }
        }
        Command::StartTls { qp, config, reply } => nic.start_tls(qp, config, reply),
        Command::CloseListener { listener } => nic.close_listener(listener),
        Command::Close { qp } => nic.close(qp),
        Command::Disconnect { qp } => nic.disconnect(qp),
        Command::Destroy { qp } => nic.destroy(qp),
        Command::Fence { reply } => nic.fence(reply),
    }
}

fn no_unix() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "this NIC has no Unix-domain sockets (it reaches only its own network)",
    )
}

/// The error for a command naming a QP the NIC does not have.
pub fn no_qp(qp: QpNum) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no QP {qp}"))
}

/// The error for connect, bind or accept on a QP that is not idle or of the wrong kind.
pub fn not_idle(qp: QpNum, kind: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("QP {qp} is not an idle {kind} QP"),
    )
}
