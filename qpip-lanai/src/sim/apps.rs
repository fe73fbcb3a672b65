//! Applications for the simulated hosts: 1-byte ping-pong over UDP or TCP, and bulk
//! transfer over TCP (ttcp, or a verified stream of varied messages for the loss tests).

use std::any::Any;
use std::net::SocketAddr;

use crate::meter::Nanos;
use qpip_verbs::backend::{ListenerId, MgmtResult};
use qpip_verbs::cq::CompletionQueue;
use qpip_verbs::mr::{Access, MemoryRegion};
use qpip_verbs::qp::{QpAttr, QueuePair};
use qpip_verbs::wr::{Completion, Opcode, RecvWr, SendWr, WcStatus};

use super::fabric::XorShift;
use super::host::{App, Host};

/// Transport of a ping-pong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    /// Unreliable QPs: one datagram each way per round.
    Udp,
    /// A reliable QP: the firmware's TCP connection.
    Tcp,
}

/// Which end of a two-party application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Listens (TCP) or binds and echoes (UDP); receives the bulk transfer.
    Server,
    /// Connects to the server's address; sends first.
    Client {
        /// The server's address on the fabric.
        server: SocketAddr,
    },
}

const RECV_SLOTS: usize = 4;
const SLOT: usize = 64;

/// How a ping-pong program was ported to QPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PingPort {
    /// The sockets program as it was, on one buffer: `write()` returns when the send has
    /// completed (TCP: the peer acknowledged the byte; UDP: the datagram left) and only then
    /// does `read()` post the receive WR and wait for it.
    Blocking,
    /// Receives posted ahead (`RECV_SLOTS` of them, reposted as each completes) and the
    /// next message sent on the reply, whether or not the previous send has completed.
    Preposted,
}

/// 1-byte messages back and forth, `rounds` times after one warm-up round trip (the NICs
/// are busy with the initial receive doorbells at first); the client measures from handling
/// the warm-up reply to handling the last reply.
pub struct PingPong {
    proto: Proto,
    role: Role,
    port: u16,
    rounds: u64,
    ping_port: PingPort,
    seen: u64,
    sent: u64,
    qp: Option<QueuePair>,
    mr: Option<MemoryRegion>,
    cq: Option<CompletionQueue>,
    listener: Option<ListenerId>,
    started_at: Option<Nanos>,
    finished_at: Option<Nanos>,
    error: Option<String>,
}

impl PingPong {
    pub(crate) fn ported(
        proto: Proto,
        role: Role,
        port: u16,
        rounds: u64,
        ping_port: PingPort,
    ) -> Self {
        PingPong {
            proto,
            role,
            port,
            rounds,
            ping_port,
            seen: 0,
            sent: 0,
            qp: None,
            mr: None,
            cq: None,
            listener: None,
            started_at: None,
            finished_at: None,
            error: None,
        }
    }

    /// Mean round-trip time in nanoseconds (client, once done).
    pub fn mean_rtt_ns(&self) -> Option<f64> {
        let (a, b) = (self.started_at?, self.finished_at?);
        Some((b - a) as f64 / self.rounds.max(1) as f64)
    }

    fn fail(&mut self, msg: String) {
        self.error.get_or_insert(msg);
    }

    fn send_one(&mut self, host: &mut Host, dest: Option<SocketAddr>) {
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let off = RECV_SLOTS * SLOT;
        mr.write_at(off, &[self.sent as u8]);
        let mut wr = SendWr::new(1000 + self.sent, &[mr.sge(off, 1)]);
        if let Some(d) = dest {
            wr = wr.to(d);
        }
        self.sent += 1;
        if let Err(e) = host.post_send(qp, wr) {
            self.fail(format!("post_send: {e}"));
        }
    }

    fn post_recv(&mut self, host: &mut Host, slot: usize) {
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let wr = RecvWr::new(slot as u64, &[mr.sge(slot * SLOT, SLOT)]);
        if let Err(e) = host.post_recv(qp, wr) {
            self.fail(format!("post_recv: {e}"));
        }
    }
}

impl App for PingPong {
    fn start(&mut self, host: &mut Host) {
        let cq = host.create_cq(256);
        let attr = QpAttr::new(&cq);
        self.mr = Some(
            host.nic()
                .alloc_region((RECV_SLOTS + 1) * SLOT, Access::READ_WRITE),
        );
        self.cq = Some(cq);
        match (self.proto, self.role) {
            (Proto::Udp, role) => {
                let port = match role {
                    Role::Server => self.port,
                    Role::Client { .. } => self.port + 1,
                };
                let (qp, _bind) = host.create_udp_qp(port, attr);
                self.qp = Some(qp);
            }
            (Proto::Tcp, Role::Server) => {
                let qp = host.create_qp(attr);
                let (listener, _) = host.listen(self.port);
                host.accept(listener, &qp);
                self.listener = Some(listener);
                self.qp = Some(qp);
            }
            (Proto::Tcp, Role::Client { server }) => {
                let qp = host.create_qp(attr);
                host.connect(&qp, server);
                self.qp = Some(qp);
            }
        }
        match (self.ping_port, self.role) {
            (PingPort::Preposted, _) => {
                for slot in 0..RECV_SLOTS {
                    self.post_recv(host, slot);
                }
            }
            // The server's loop starts with a read; the client's with a write.
            (PingPort::Blocking, Role::Server) => self.post_recv(host, 0),
            (PingPort::Blocking, Role::Client { .. }) => {}
        }
    }

    fn on_reply(&mut self, host: &mut Host, _tag: u64, result: MgmtResult) {
        if let Err(e) = result {
            self.fail(format!("management command failed: {e}"));
            return;
        }
        // The client's bind or connect is its one reply: send the warm-up message.
        if let Role::Client { server } = self.role
            && self.sent == 0
        {
            self.send_one(host, (self.proto == Proto::Udp).then_some(server));
        }
    }

    fn on_completion(&mut self, host: &mut Host, c: Completion) {
        if c.status != WcStatus::Success {
            self.fail(format!("{:?} completion {:?}", c.opcode, c.status));
            return;
        }
        if c.opcode == Opcode::Send {
            // The write returned: a blocking program now reads (the last reply excepted).
            if self.ping_port == PingPort::Blocking && !self.done() {
                self.post_recv(host, 0);
            }
            return;
        }
        if c.byte_len != 1 {
            self.fail(format!("received {} bytes, expected 1", c.byte_len));
            return;
        }
        self.seen += 1;
        if self.ping_port == PingPort::Preposted {
            self.post_recv(host, c.wr_id as usize % RECV_SLOTS);
        }
        match self.role {
            Role::Server => {
                let dest = match self.proto {
                    Proto::Udp => match c.src {
                        Some(s) => Some(s),
                        None => return self.fail("datagram without a source".into()),
                    },
                    Proto::Tcp => None,
                };
                self.send_one(host, dest);
            }
            Role::Client { server } => {
                if self.seen == 1 {
                    self.started_at = Some(host.now());
                }
                if self.seen <= self.rounds {
                    self.send_one(host, (self.proto == Proto::Udp).then_some(server));
                } else {
                    self.finished_at = Some(host.now());
                }
            }
        }
    }

    fn done(&self) -> bool {
        self.seen > self.rounds
    }

    fn error(&self) -> Option<String> {
        self.error.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Message sizes of a bulk transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizes {
    /// Every message this many bytes.
    Fixed(usize),
    /// Uniform in 1..=max, from a seeded PRNG (both ends draw the same list).
    Varied {
        /// The largest message.
        max: usize,
        /// The PRNG's seed.
        seed: u64,
    },
}

/// A bulk transfer over one TCP connection, client to server.
///
/// `window` and `recv_depth` are how the program was ported to QPs: ttcp's blocking
/// `write(fd, buf, buflen)` on its one buffer becomes a send WR the program waits for (its
/// buffer is the NIC's until the peer has acknowledged every byte), so one send is
/// outstanding; its `read(fd, buf, buflen)` loop becomes one receive WR posted on that buffer
/// and posted again when the read has returned (after `read_think_ns` of the host's own work).
#[derive(Clone, Copy, Debug)]
pub struct BulkConfig {
    pub(crate) total: u64,
    pub(crate) sizes: Sizes,
    /// Send WRs the sender keeps posted (1: a blocking write).
    pub window: usize,
    /// Receive WRs the receiver keeps posted (1: a blocking read on one buffer).
    pub recv_depth: usize,
    /// Host time between a receive completing and its WR being posted again (the program's
    /// own work per read; the per-receive overhead of the verbs is charged apart).
    pub read_think_ns: Nanos,
    /// The program set TCP_NODELAY: the connection's TCP sends a short tail at once instead
    /// of waiting for the data in flight to be acknowledged (Nagle).
    pub nodelay: bool,
    /// Fill messages with a pattern and check every byte on arrival.
    pub verify: bool,
    pub(crate) port: u16,
}

impl BulkConfig {
    /// ttcp v1.4 as the simplest QP port runs it: `total` bytes in `msg`-byte messages, one
    /// buffer on each side, so one send outstanding (a write returns when the peer has
    /// acknowledged its bytes) and one receive posted, reposted as each read returns; with
    /// TCP_NODELAY, as the paper ran it.
    pub fn ttcp(total: u64, msg: usize) -> Self {
        BulkConfig {
            total,
            sizes: Sizes::Fixed(msg),
            window: 1,
            recv_depth: 1,
            read_think_ns: 0,
            nodelay: true,
            verify: false,
            port: 5001,
        }
    }

    /// The same transfer from a program that keeps the NIC fed: 8 sends outstanding and 16
    /// receives posted (the hardware's limits, not the program's, set the rate).
    pub fn pipelined(total: u64, msg: usize) -> Self {
        BulkConfig {
            window: 8,
            recv_depth: 16,
            ..Self::ttcp(total, msg)
        }
    }

    /// With `sends` outstanding and `recvs` posted.
    pub fn with_port(self, sends: usize, recvs: usize) -> Self {
        BulkConfig {
            window: sends,
            recv_depth: recvs,
            ..self
        }
    }

    fn message_sizes(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut left = self.total;
        let mut rng = match self.sizes {
            Sizes::Varied { seed, .. } => Some(XorShift::new(seed)),
            Sizes::Fixed(_) => None,
        };
        while left > 0 {
            let s = match (self.sizes, rng.as_mut()) {
                (Sizes::Varied { max, .. }, Some(r)) => r.range(1, max.max(1) as u64) as usize,
                (Sizes::Fixed(n), _) | (Sizes::Varied { max: n, .. }, None) => n.max(1),
            };
            let s = s.min(usize::try_from(left).unwrap_or(usize::MAX));
            out.push(s);
            left -= s as u64;
        }
        out
    }

    fn max_message(&self) -> usize {
        match self.sizes {
            Sizes::Fixed(n) | Sizes::Varied { max: n, .. } => n.max(1),
        }
    }
}

/// The pattern of byte `j` of message `i`: differs between neighbouring messages and shifts
/// within a message, so lost, repeated or reordered bytes show.
fn pattern(i: usize, j: usize) -> u8 {
    (i.wrapping_mul(251) ^ j ^ (j >> 8).wrapping_mul(31)) as u8
}

/// One end of a bulk transfer.
pub struct Bulk {
    cfg: BulkConfig,
    role: Role,
    sizes: Vec<usize>,
    qp: Option<QueuePair>,
    mr: Option<MemoryRegion>,
    free_slots: Vec<usize>,
    next: usize,
    completed: usize,
    bytes: u64,
    /// Sends posted and not yet completed, now and at most.
    outstanding: usize,
    max_outstanding: usize,
    /// Bytes completed (acknowledged, or received) so far, at each completion.
    timeline: Vec<(Nanos, u64)>,
    started_at: Option<Nanos>,
    finished_at: Option<Nanos>,
    /// The tag of the client's connect: its reply starts the transfer.
    connect_tag: Option<u64>,
    error: Option<String>,
}

impl Bulk {
    pub(crate) fn new(cfg: BulkConfig, role: Role) -> Self {
        Bulk {
            sizes: cfg.message_sizes(),
            cfg,
            role,
            qp: None,
            mr: None,
            free_slots: Vec::new(),
            next: 0,
            completed: 0,
            bytes: 0,
            outstanding: 0,
            max_outstanding: 0,
            timeline: Vec::new(),
            started_at: None,
            finished_at: None,
            connect_tag: None,
            error: None,
        }
    }

    /// Messages completed (sent and acknowledged, or received).
    pub fn messages(&self) -> usize {
        self.completed
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The most sends the sender ever had posted and not completed.
    pub fn max_outstanding(&self) -> usize {
        self.max_outstanding
    }

    /// Bytes completed by each completion's time: acknowledged by the peer (sender) or
    /// placed in a receive WR (receiver).
    pub fn timeline(&self) -> &[(Nanos, u64)] {
        &self.timeline
    }

    /// When the sender posted its first message (sender) and when the last message was
    /// handled (receiver).
    pub fn started_at(&self) -> Option<Nanos> {
        self.started_at
    }
    pub(crate) fn finished_at(&self) -> Option<Nanos> {
        self.finished_at
    }

    fn fail(&mut self, msg: String) {
        self.error.get_or_insert(msg);
    }

    fn slots(&self) -> usize {
        match self.role {
            Role::Server => self.cfg.recv_depth.max(1),
            Role::Client { .. } => self.cfg.window.max(1),
        }
    }

    fn pump(&mut self, host: &mut Host) {
        while self.next < self.sizes.len() {
            let Some(slot) = self.free_slots.pop() else {
                return;
            };
            let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
                return;
            };
            let len = self.sizes[self.next];
            let off = slot * self.cfg.max_message();
            if self.cfg.verify {
                let msg: Vec<u8> = (0..len).map(|j| pattern(self.next, j)).collect();
                mr.write_at(off, &msg);
            }
            self.next += 1;
            if let Err(e) = host.post_send(qp, SendWr::new(slot as u64, &[mr.sge(off, len)])) {
                self.fail(format!("post_send: {e}"));
                return;
            }
            self.outstanding += 1;
            self.max_outstanding = self.max_outstanding.max(self.outstanding);
        }
    }

    fn post_recv(&mut self, host: &mut Host, slot: usize) {
        let (Some(qp), Some(mr)) = (&self.qp, &self.mr) else {
            return;
        };
        let max = self.cfg.max_message();
        if let Err(e) = host.post_recv(qp, RecvWr::new(slot as u64, &[mr.sge(slot * max, max)])) {
            self.fail(format!("post_recv: {e}"));
        }
    }

    fn check(&mut self, slot: usize, len: usize) {
        let i = self.completed;
        let Some(&want) = self.sizes.get(i) else {
            return self.fail(format!("message {i} beyond the {} sent", self.sizes.len()));
        };
        if len != want {
            return self.fail(format!("message {i}: {len} bytes, sent {want}"));
        }
        if !self.cfg.verify {
            return;
        }
        let Some(mr) = &self.mr else { return };
        let mut got = vec![0u8; len];
        mr.read_at(slot * self.cfg.max_message(), &mut got);
        if let Some(j) = (0..len).find(|&j| got[j] != pattern(i, j)) {
            self.fail(format!("message {i}: byte {j} differs"));
        }
    }
}

impl App for Bulk {
    fn start(&mut self, host: &mut Host) {
        let cq = host.create_cq(1024);
        let attr = QpAttr::new(&cq).depths(self.cfg.window.max(1) + 1, self.cfg.recv_depth + 1);
        let slots = self.slots();
        self.mr = Some(
            host.nic()
                .alloc_region(slots * self.cfg.max_message(), Access::READ_WRITE),
        );
        let qp = host.create_qp(attr);
        match self.role {
            Role::Server => {
                let (listener, _) = host.listen(self.cfg.port);
                host.accept(listener, &qp);
                self.qp = Some(qp);
                for slot in 0..slots {
                    self.post_recv(host, slot);
                }
            }
            Role::Client { server } => {
                self.connect_tag = Some(host.connect(&qp, server));
                self.qp = Some(qp);
                self.free_slots = (0..slots).rev().collect();
            }
        }
    }

    fn on_reply(&mut self, host: &mut Host, tag: u64, result: MgmtResult) {
        if let Err(e) = result {
            return self.fail(format!("management command failed: {e}"));
        }
        if self.connect_tag == Some(tag) && self.started_at.is_none() {
            // Connected: the measurement starts here.
            host.mark();
            self.started_at = Some(host.now());
            self.pump(host);
        }
    }

    fn on_completion(&mut self, host: &mut Host, c: Completion) {
        if c.status != WcStatus::Success {
            return self.fail(format!("{:?} completion {:?}", c.opcode, c.status));
        }
        let slot = c.wr_id as usize;
        match (self.role, c.opcode) {
            (Role::Client { .. }, Opcode::Send) => {
                self.bytes += u64::from(c.byte_len);
                self.completed += 1;
                self.outstanding = self.outstanding.saturating_sub(1);
                self.timeline.push((host.now(), self.bytes));
                self.free_slots.push(slot);
                self.pump(host);
                if self.completed == self.sizes.len() {
                    self.finished_at = Some(host.now());
                }
            }
            (Role::Server, Opcode::Recv) => {
                self.check(slot, c.byte_len as usize);
                self.bytes += u64::from(c.byte_len);
                self.completed += 1;
                self.timeline.push((host.now(), self.bytes));
                if self.completed == self.sizes.len() {
                    self.finished_at = Some(host.now());
                } else {
                    // The read returned; the program's loop comes round and reads again.
                    host.compute(self.cfg.read_think_ns);
                    self.post_recv(host, slot);
                }
            }
            (role, op) => self.fail(format!("unexpected {op:?} completion at {role:?}")),
        }
    }

    fn done(&self) -> bool {
        self.completed >= self.sizes.len()
    }

    fn error(&self) -> Option<String> {
        self.error.clone()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_sizes_add_up_and_are_reproducible() {
        let cfg = BulkConfig {
            sizes: Sizes::Varied {
                max: 20_000,
                seed: 3,
            },
            ..BulkConfig::ttcp(1_000_000, 0)
        };
        let a = cfg.message_sizes();
        assert_eq!(a.iter().sum::<usize>(), 1_000_000);
        assert!(a.iter().all(|&s| (1..=20_000).contains(&s)));
        assert_eq!(a, cfg.message_sizes());
        let fixed = BulkConfig::ttcp(40_000, 16_384).message_sizes();
        assert_eq!(fixed, vec![16_384, 16_384, 7_232]);
        assert_ne!(pattern(0, 5), pattern(1, 5));
        assert_ne!(pattern(0, 5), pattern(0, 261));
    }
}
