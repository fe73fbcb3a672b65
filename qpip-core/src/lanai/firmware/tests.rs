//! Two firmwares on a virtual clock, frames carried through one switch.

use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::cq::CompletionQueue;
use crate::framer::{Framer, LengthPrefixed};
use crate::mr::{Access, MemoryRegion};
use crate::qp::{QpAttr, QpShared};
use crate::reply::{ReplyReceiver, reply_channel};
use crate::wr::{Completion, RecvWr, SendWr};

const SERVER: usize = 0;
const CLIENT: usize = 1;

struct Side {
    fw: Firmware,
    mem: Arc<MemoryTable>,
    cq: CompletionQueue,
    addr: Ipv6Addr,
    next_qp: QpNum,
}

struct Net {
    sides: [Side; 2],
    now: Nanos,
    /// (arrival, sequence, destination side, frame)
    flight: Vec<(Nanos, u64, usize, Vec<u8>)>,
    seq: u64,
    link_free: [Nanos; 2],
    /// Drop every n-th frame (0: none).
    drop_every: u64,
    /// Drop everything a side sends.
    blackhole: [bool; 2],
    frames: u64,
}

fn fabric() -> FabricParams {
    FabricParams::default()
}

fn side(name: &str, seed: u64, params: &LanaiParams) -> Side {
    let fab = fabric();
    let addr = fab.node(name).expect("node in fabric.toml").addr;
    let mem = MemoryTable::new();
    let fw = Firmware::new(
        FirmwareConfig {
            addr,
            params: params.clone(),
            fabric: fab,
            seed,
        },
        mem.clone(),
    );
    Side {
        fw,
        mem,
        cq: CompletionQueue::new(8192),
        addr,
        next_qp: 1,
    }
}

impl Net {
    fn new() -> Self {
        Self::with_params(LanaiParams::default())
    }

    fn with_params(p: LanaiParams) -> Self {
        Net {
            sides: [side("server", 1, &p), side("client", 2, &p)],
            now: 0,
            flight: Vec::new(),
            seq: 0,
            link_free: [0; 2],
            drop_every: 0,
            blackhole: [false; 2],
            frames: 0,
        }
    }

    fn addr(&self, s: usize, port: u16) -> SocketAddr {
        SocketAddr::new(self.sides[s].addr.into(), port)
    }

    fn region(&self, s: usize, len: usize) -> MemoryRegion {
        self.sides[s].mem.register_owned(len, Access::READ_WRITE)
    }

    fn qp_with(&mut self, s: usize, kind: QpKind, framer: Box<dyn Framer>) -> Arc<QpShared> {
        let side = &mut self.sides[s];
        let num = side.next_qp;
        side.next_qp += 1;
        let attr = QpAttr::new(&side.cq).depths(1024, 1024);
        let shared = Arc::new(QpShared::new(num, kind, &attr));
        side.fw.command(
            self.now,
            Command::CreateQp {
                qp: shared.clone(),
                framer,
            },
        );
        shared
    }

    fn qp(&mut self, s: usize) -> Arc<QpShared> {
        self.qp_with(s, QpKind::Reliable, Box::new(LengthPrefixed::default()))
    }

    fn cmd(&mut self, s: usize, cmd: Command) {
        self.sides[s].fw.command(self.now, cmd);
    }

    fn listen(&mut self, s: usize, port: u16) -> MgmtResult {
        let (tx, rx) = reply_channel();
        let addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
        self.cmd(
            s,
            Command::Listen {
                id: 1,
                addr,
                backlog: 16,
                reply: tx,
            },
        );
        take(rx).expect("listen replies at once")
    }

    fn accept(&mut self, s: usize, qp: &QpShared) -> ReplyReceiver<MgmtResult> {
        let (tx, rx) = reply_channel();
        self.cmd(
            s,
            Command::Accept {
                listener: 1,
                qp: qp.num,
                reply: tx,
            },
        );
        rx
    }

    fn connect(&mut self, s: usize, qp: &QpShared, to: SocketAddr) -> ReplyReceiver<MgmtResult> {
        let (tx, rx) = reply_channel();
        self.cmd(
            s,
            Command::Connect {
                qp: qp.num,
                addr: to,
                reply: tx,
            },
        );
        rx
    }

    /// A connected pair of QPs (server, client) with the given framers.
    fn pair_with(
        &mut self,
        sf: Box<dyn Framer>,
        cf: Box<dyn Framer>,
    ) -> (Arc<QpShared>, Arc<QpShared>) {
        self.listen(SERVER, 7000).expect("listen");
        let s = self.qp_with(SERVER, QpKind::Reliable, sf);
        let c = self.qp_with(CLIENT, QpKind::Reliable, cf);
        let acc = self.accept(SERVER, &s);
        let to = self.addr(SERVER, 7000);
        let con = self.connect(CLIENT, &c, to);
        self.run_until(|_| s.state() == QpState::Ready && c.state() == QpState::Ready);
        take(acc).expect("accept replied").expect("accepted");
        take(con).expect("connect replied").expect("connected");
        (s, c)
    }

    fn pair(&mut self) -> (Arc<QpShared>, Arc<QpShared>) {
        self.pair_with(
            Box::new(LengthPrefixed::default()),
            Box::new(LengthPrefixed::default()),
        )
    }

    fn post_send(&mut self, s: usize, qp: &QpShared, wr: SendWr) {
        qp.push_send(wr);
        self.sides[s].fw.doorbell(self.now, qp.num);
    }

    fn post_recv(&mut self, s: usize, qp: &QpShared, wr: RecvWr) {
        qp.push_recv(wr);
        self.sides[s].fw.doorbell(self.now, qp.num);
    }

    fn completions(&self, s: usize) -> Vec<Completion> {
        let mut out = vec![Completion::default(); 8192];
        let n = self.sides[s].cq.poll(&mut out).expect("no CQ overflow");
        out.truncate(n);
        out
    }

    /// Moves frames and runs timers until the next event; false when nothing is left to do.
    fn step(&mut self) -> bool {
        for i in 0..2 {
            while let Some(f) = self.sides[i].fw.transmit() {
                self.frames += 1;
                if self.blackhole[i]
                    || (self.drop_every > 0 && self.frames.is_multiple_of(self.drop_every))
                {
                    continue;
                }
                let (port, f2) = frame::switch(&f.bytes).expect("firmware frames are valid");
                let dst = match port {
                    1 => SERVER,
                    2 => CLIENT,
                    _ => continue,
                };
                let fab = fabric();
                let start = f.ready_at.max(self.link_free[i]);
                self.link_free[i] = start + fab.wire_ns(f.bytes.len());
                let arrival = self.link_free[i] + fab.switch_latency_ns + 2 * fab.cable_ns;
                self.seq += 1;
                self.flight.push((arrival, self.seq, dst, f2));
            }
        }
        let next = self
            .flight
            .iter()
            .map(|f| f.0)
            .chain(self.sides.iter().filter_map(|s| s.fw.poll_at()))
            .min();
        let Some(next) = next else { return false };
        self.now = self.now.max(next);
        self.flight.sort_by_key(|f| (f.0, f.1));
        while self.flight.first().is_some_and(|f| f.0 <= self.now) {
            let (_, _, dst, bytes) = self.flight.remove(0);
            self.sides[dst].fw.receive(self.now, &bytes);
        }
        for s in &mut self.sides {
            if s.fw.poll_at().is_some_and(|t| t <= self.now) {
                s.fw.poll(self.now);
            }
        }
        true
    }

    /// Runs until `done` holds (checked between events), the network idles or a virtual
    /// minute passes. Returns whether `done` held.
    fn run_until(&mut self, mut done: impl FnMut(&mut Net) -> bool) -> bool {
        let limit = self.now + 60_000_000_000;
        for _ in 0..2_000_000 {
            if done(self) {
                return true;
            }
            if !self.step() || self.now > limit {
                return done(self);
            }
        }
        done(self)
    }
}

fn take(rx: ReplyReceiver<MgmtResult>) -> Option<MgmtResult> {
    rx.wait_until(Some(Instant::now()))
}

fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

#[test]
fn connect_and_accept_report_addresses() {
    let mut net = Net::new();
    let local = net.listen(SERVER, 7000).unwrap();
    assert_eq!(local, net.addr(SERVER, 7000));
    let s = net.qp(SERVER);
    let c = net.qp(CLIENT);
    let acc = net.accept(SERVER, &s);
    let con = net.connect(CLIENT, &c, net.addr(SERVER, 7000));
    assert!(net.run_until(|_| s.state() == QpState::Ready && c.state() == QpState::Ready));
    let peer = take(acc).unwrap().unwrap();
    let client_local = take(con).unwrap().unwrap();
    assert_eq!(peer, client_local);
    assert_eq!(peer.ip(), net.sides[CLIENT].addr);
    assert!(net.sides[SERVER].fw.meter().busy_ns() > 0);
}

#[test]
fn ipv4_and_foreign_addresses_are_refused() {
    let mut net = Net::new();
    let (tx, rx) = reply_channel();
    net.cmd(
        SERVER,
        Command::Listen {
            id: 9,
            addr: "127.0.0.1:80".parse().unwrap(),
            backlog: 1,
            reply: tx,
        },
    );
    assert_eq!(
        take(rx).unwrap().unwrap_err().kind(),
        io::ErrorKind::Unsupported
    );
    let (tx, rx) = reply_channel();
    net.cmd(
        SERVER,
        Command::Listen {
            id: 9,
            addr: "[fd00::99]:80".parse().unwrap(),
            backlog: 1,
            reply: tx,
        },
    );
    assert_eq!(
        take(rx).unwrap().unwrap_err().kind(),
        io::ErrorKind::AddrNotAvailable
    );
}

#[test]
fn connect_to_a_closed_port_is_refused() {
    let mut net = Net::new();
    let c = net.qp(CLIENT);
    let con = net.connect(CLIENT, &c, net.addr(SERVER, 9));
    net.run_until(|_| c.state() == QpState::Init);
    let err = take(con).unwrap().unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    // The QP is idle again and may connect elsewhere.
    assert_eq!(c.state(), QpState::Init);
}

/// Sends `sizes` as length-prefixed messages client -> server and checks each arrives
/// intact and in order.
fn transfer(net: &mut Net, sizes: &[usize]) {
    let (s, c) = net.pair();
    let max = sizes.iter().copied().max().unwrap_or(1);
    let total: usize = sizes.iter().sum();
    let src = net.region(CLIENT, total.max(1));
    let mut off = 0;
    let mut offsets = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        src.write_at(off, &pattern(i, len));
        offsets.push(off);
        off += len;
    }
    const WINDOW: usize = 64;
    let dst = net.region(SERVER, max * WINDOW);
    let mut posted_recv = 0;
    let mut posted_send = 0;
    let mut received = 0;
    let mut sent_ok = 0;
    while received < sizes.len() {
        while posted_recv < sizes.len() && posted_recv < received + WINDOW {
            let slot = posted_recv % WINDOW;
            let wr = RecvWr::new(posted_recv as u64, &[dst.sge(slot * max, max)]);
            net.post_recv(SERVER, &s, wr);
            posted_recv += 1;
        }
        while posted_send < sizes.len() && posted_send < sent_ok + 200 {
            let wr = SendWr::new(
                posted_send as u64,
                &[src.sge(offsets[posted_send], sizes[posted_send])],
            );
            net.post_send(CLIENT, &c, wr);
            posted_send += 1;
        }
        let before = received;
        assert!(
            net.run_until(|n| !n.sides[SERVER].cq.is_empty() || !n.sides[CLIENT].cq.is_empty()),
            "stalled after {received} messages"
        );
        for done in net.completions(CLIENT) {
            assert_eq!(done.status, WcStatus::Success, "{done:?}");
            assert_eq!(done.wr_id, sent_ok as u64);
            assert_eq!(done.byte_len as usize, sizes[sent_ok]);
            sent_ok += 1;
        }
        for done in net.completions(SERVER) {
            assert_eq!(done.status, WcStatus::Success, "{done:?}");
            let i = done.wr_id as usize;
            assert_eq!(i, received, "in order");
            assert_eq!(done.byte_len as usize, sizes[i]);
            let mut got = vec![0u8; sizes[i]];
            dst.read_at((i % WINDOW) * max, &mut got);
            assert!(got == pattern(i, sizes[i]), "message {i} intact");
            received += 1;
        }
        let _ = before;
    }
    assert!(net.run_until(|n| {
        sent_ok += n.completions(CLIENT).len();
        sent_ok == sizes.len()
    }));
}

/// 1 B .. 200 KB, mostly small (the CRC and smoltcp run unoptimised in tests).
fn mixed_sizes(n: usize) -> Vec<usize> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match i % 100 {
                0 => 200_000,
                1 => 1,
                50 => 70_000,
                _ => 1 + (x % 3000) as usize,
            }
        })
        .collect()
}

#[test]
fn a_thousand_messages_of_mixed_sizes_arrive_in_order_and_intact() {
    let mut net = Net::new();
    transfer(&mut net, &mixed_sizes(1000));
}

#[test]
fn data_survives_losing_every_seventh_frame() {
    let mut net = Net::new();
    net.drop_every = 7;
    transfer(&mut net, &mixed_sizes(60));
}
