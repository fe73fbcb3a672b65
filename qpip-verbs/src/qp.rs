//! Queue pairs: a send queue and a receive queue of work requests, on one connection (reliable,
//! TCP) or one bound port (unreliable, UDP).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Command, MgmtResult, NicHandle};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::framer::{Framer, LengthPrefixed};
use crate::reply::reply_channel;
use crate::shared::{QpKind, QpShared, QpState, QueueFull};
use crate::wr::{QpNum, RecvWr, SendWr};

/// How to build a QP.
pub struct QpAttr {
    /// The CQ of its send completions.
    pub send_cq: CompletionQueue,
    /// The CQ of its receive completions.
    pub recv_cq: CompletionQueue,
    /// Send WRs outstanding at most.
    pub max_send_wr: usize,
    /// Receive WRs outstanding at most.
    pub max_recv_wr: usize,
    /// How incoming messages are delimited.
    pub framer: Box<dyn Framer>,
}

impl QpAttr {
    /// Both queues complete into `cq`; 256 WRs each; length-prefixed messages.
    pub fn new(cq: &CompletionQueue) -> Self {
        QpAttr {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            max_send_wr: 256,
            max_recv_wr: 256,
            framer: Box::new(LengthPrefixed::default()),
        }
    }
    /// With `framer` delimiting incoming messages.
    pub fn framer(mut self, framer: impl Framer) -> Self {
        self.framer = Box::new(framer);
        self
    }
    /// With these queue depths.
    pub fn depths(mut self, max_send_wr: usize, max_recv_wr: usize) -> Self {
        self.max_send_wr = max_send_wr.max(1);
        self.max_recv_wr = max_recv_wr.max(1);
        self
    }
    /// With receive completions on `cq` (sends stay on the first CQ).
    pub fn recv_cq(mut self, cq: &CompletionQueue) -> Self {
        self.recv_cq = cq.clone();
        self
    }
}

/// A queue pair. Dropping it disconnects and destroys it; outstanding WRs are flushed.
pub struct QueuePair {
    pub(crate) shared: Arc<QpShared>,
    pub(crate) nic: Arc<NicHandle>,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("num", &self.shared.num)
            .field("kind", &self.shared.kind)
            .field("state", &self.state())
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn create(
        nic: &Arc<NicHandle>,
        num: QpNum,
        kind: QpKind,
        attr: QpAttr,
    ) -> (QueuePair, Box<dyn Framer>) {
        let shared = Arc::new(QpShared::new(
            num,
            kind,
            (attr.send_cq.shared.clone(), attr.recv_cq.shared.clone()),
            (attr.max_send_wr, attr.max_recv_wr),
        ));
        (
            QueuePair {
                shared,
                nic: nic.clone(),
            },
            attr.framer,
        )
    }

    /// The rings this QP shares with the NIC (for simulators that post at virtual time).
    pub fn shared(&self) -> &Arc<QpShared> {
        &self.shared
    }

    /// The QP's number.
    pub fn num(&self) -> QpNum {
        self.shared.num
    }
    /// The queue of a multi-queue NIC that owns the QP (0 on a NIC with one queue).
    pub fn queue(&self) -> u32 {
        self.shared.queue.load(std::sync::atomic::Ordering::Acquire)
    }
    /// Reliable or unreliable.
    pub fn kind(&self) -> QpKind {
        self.shared.kind
    }
    /// Where it is in its life.
    pub fn state(&self) -> QpState {
        self.shared.state()
    }

    /// Posts a send WR: writes it into the send ring and rings the doorbell. No system call
    /// unless the NIC engine sleeps.
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        self.post_send_quiet(wr)?;
        self.nic.ring_doorbell(&self.shared);
        Ok(())
    }

    /// Posts a receive WR: memory for the next arriving message.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.post_recv_quiet(wr)?;
        self.nic.ring_doorbell(&self.shared);
        Ok(())
    }

    /// Posts a send WR without ringing the doorbell: the NIC sees it at the next
    /// [`Self::ring_doorbell`] (or the next post that rings). For a burst of WRs: one doorbell,
    /// and the NIC takes them all in one turn (one `writev`) instead of chasing each one.
    /// Ring before waiting for any of their completions.
    pub fn post_send_quiet(&self, wr: SendWr) -> Result<()> {
        self.check_postable("post a send")?;
        if wr.len() > u64::from(u32::MAX) {
            return Err(Error::InvalidWr("a message is at most 4 GiB - 1"));
        }
        if self.kind() == QpKind::Unreliable && wr.dest.is_none() {
            return Err(Error::InvalidWr(
                "a send on an unreliable QP needs a destination",
            ));
        }
        self.shared
            .push_send(wr)
            .map_err(|full| self.queue_full("send", full))
    }

    /// Posts a receive WR without ringing the doorbell, as [`Self::post_send_quiet`].
    pub fn post_recv_quiet(&self, wr: RecvWr) -> Result<()> {
        self.check_postable("post a receive")?;
        self.shared
            .push_recv(wr)
            .map_err(|full| self.queue_full("receive", full))
    }

    /// Tells the NIC about WRs posted quietly. Costs nothing when the NIC has not yet looked
    /// at the rings since the last ring.
    pub fn ring_doorbell(&self) {
        self.nic.ring_doorbell(&self.shared);
    }

    fn check_postable(&self, op: &'static str) -> Result<()> {
        let state = self.state();
        if state.accepts_posts() {
            Ok(())
        } else {
            Err(Error::BadState {
                qp: self.num(),
                state,
                op,
            })
        }
    }

    fn queue_full(&self, queue: &'static str, QueueFull(depth): QueueFull) -> Error {
        Error::QueueFull {
            qp: self.num(),
            queue,
            depth,
        }
    }

    /// Send WRs posted and not yet completed.
    pub fn outstanding_sends(&self) -> usize {
        self.shared.outstanding_sends()
    }
    /// Receive WRs posted and not yet completed.
    pub fn outstanding_recvs(&self) -> usize {
        self.shared.outstanding_recvs()
    }

    /// Connects a reliable QP to a listening peer (a QP listener or any TCP server).
    pub fn connect(&self, addr: SocketAddr) -> Result<()> {
        self.connect_until(addr, None)
    }

    /// [`Self::connect`] that gives up after `timeout`.
    pub fn connect_timeout(&self, addr: SocketAddr, timeout: Duration) -> Result<()> {
        self.connect_until(addr, Some(timeout))
    }

    fn connect_until(&self, addr: SocketAddr, timeout: Option<Duration>) -> Result<()> {
        let rx = self.start_connect(addr)?;
        match rx.wait_until(timeout.map(|t| Instant::now() + t)) {
            Some(r) => r.map(drop).map_err(|source| Error::Net {
                op: "connect to",
                addr,
                source,
            }),
            None => {
                self.nic.manage(Command::Disconnect { qp: self.num() });
                match timeout {
                    Some(after) => Err(Error::Timeout {
                        op: "connect",
                        after,
                    }),
                    None => Err(Error::Engine("the engine dropped a connect request".into())),
                }
            }
        }
    }

    /// Connects to the Unix-domain stream socket at `path`, giving up after `timeout`. The
    /// LANai backend refuses it.
    pub fn connect_unix(&self, path: &std::path::Path, timeout: Duration) -> Result<()> {
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::ConnectUnix {
            qp: self.num(),
            path: path.to_path_buf(),
            reply: tx,
        });
        match rx.wait_until(Some(Instant::now() + timeout)) {
            Some(r) => r.map(drop).map_err(|source| Error::NetPath {
                op: "connect to",
                path: path.to_path_buf(),
                source,
            }),
            None => {
                self.nic.manage(Command::Disconnect { qp: self.num() });
                Err(Error::Timeout {
                    op: "connect",
                    after: timeout,
                })
            }
        }
    }

    /// Switches the connection to TLS, the NIC doing the handshake and the record layer
    /// (as NICs with inline TLS offload do): the QP's messages stay plaintext on this side.
    /// Call it with no WR outstanding (after the last plaintext message's send has completed
    /// and before a receive WR is posted for the first TLS one); it returns when the
    /// handshake is done. A failed handshake fails the QP. The LANai backend refuses it.
    pub fn start_tls(&self, config: crate::tls::TlsConfig, timeout: Duration) -> Result<()> {
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::StartTls {
            qp: self.num(),
            config: Box::new(config),
            reply: tx,
        });
        match rx.wait_until(Some(Instant::now() + timeout)) {
            Some(r) => r.map_err(|e| Error::Tls(e.to_string())),
            None => {
                self.nic.manage(Command::Disconnect { qp: self.num() });
                Err(Error::Timeout {
                    op: "TLS handshake",
                    after: timeout,
                })
            }
        }
    }

    /// Connects from async code.
    pub async fn connect_async(&self, addr: SocketAddr) -> Result<()> {
        let rx = self.start_connect(addr)?;
        match rx.wait_async().await {
            Some(r) => r.map(drop).map_err(|source| Error::Net {
                op: "connect to",
                addr,
                source,
            }),
            None => Err(Error::Engine("the engine dropped a connect request".into())),
        }
    }

    fn start_connect(&self, addr: SocketAddr) -> Result<crate::reply::ReplyReceiver<MgmtResult>> {
        if self.kind() != QpKind::Reliable {
            return Err(Error::BadState {
                qp: self.num(),
                state: self.state(),
                op: "connect an unreliable QP",
            });
        }
        let (tx, rx) = reply_channel();
        self.nic.manage(Command::Connect {
            qp: self.num(),
            addr,
            reply: tx,
        });
        Ok(rx)
    }

    /// Orderly close: sends already posted go out, then the connection is shut down and
    /// posted receives are flushed.
    pub fn close(&self) {
        self.nic.manage(Command::Close { qp: self.num() });
    }

    /// Abortive close: everything outstanding is flushed at once.
    pub fn disconnect(&self) {
        self.nic.manage(Command::Disconnect { qp: self.num() });
    }

    /// Address of the peer of a connected QP.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.shared.peer_addr()
    }

    /// Local address of a connected or bound QP.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.shared.local_addr()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.nic.manage(Command::Destroy { qp: self.num() });
    }
}
