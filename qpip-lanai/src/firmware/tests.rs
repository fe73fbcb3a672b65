//! Two firmwares on a virtual clock, frames carried through one switch.

use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use super::*;
use crate::sim::fabric::{Fabric, Faults};
use qpip_verbs::cq::CompletionQueue;
use qpip_verbs::framer::{Framer, LengthPrefixed, RawStream};
use qpip_verbs::mr::{Access, MemoryRegion};
use qpip_verbs::reply::{ReplyReceiver, reply_channel};
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::{Completion, RecvWr, SendWr};

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
    /// The simulator's fabric: link and switch timing, losses.
    fabric: Fabric,
    /// (arrival, sequence, destination side, frame)
    flight: Vec<(Nanos, u64, usize, Vec<u8>)>,
    seq: u64,
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
        let mut fabric = Fabric::new(self::fabric(), 7);
        for (side, name) in [(SERVER, "server"), (CLIENT, "client")] {
            let route = &fabric.params.node(name).expect("node in fabric.toml").route;
            let port = *route.first().expect("a route");
            fabric.attach(side, port);
        }
        Net {
            sides: [side("server", 1, &p), side("client", 2, &p)],
            now: 0,
            fabric,
            flight: Vec::new(),
            seq: 0,
        }
    }

    /// Everything `side` sends is lost (or, with `false`, arrives again).
    fn blackhole(&mut self, side: usize, lost: bool) {
        let drop = if lost { 1.0 } else { 0.0 };
        let faults = Faults {
            drop,
            ..Faults::none()
        };
        self.fabric.set_faults(side, 1 - side, faults);
    }

    /// Each frame, either way, is lost with probability `p` (seeded: runs repeat).
    fn lose(&mut self, p: f64) {
        for side in [SERVER, CLIENT] {
            let faults = Faults {
                drop: p,
                ..Faults::none()
            };
            self.fabric.set_faults(side, 1 - side, faults);
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
        let cqs = (side.cq.shared().clone(), side.cq.shared().clone());
        let shared = Arc::new(QpShared::new(num, kind, cqs, (1024, 1024)));
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
        qp.push_send(wr).expect("room in the send ring");
        self.sides[s].fw.doorbell(self.now, qp.num);
    }

    fn post_recv(&mut self, s: usize, qp: &QpShared, wr: RecvWr) {
        qp.push_recv(wr).expect("room in the receive ring");
        self.sides[s].fw.doorbell(self.now, qp.num);
    }

    fn completions(&self, s: usize) -> Vec<Completion> {
        let mut out = vec![Completion::default(); 8192];
        let n = self.sides[s].cq.poll(&mut out).expect("no CQ overflow");
        out.truncate(n);
        out
    }

    /// Puts side `i`'s frames through the fabric. Switched at once rather than when each
    /// head reaches the switch (each side has an output port of its own, so no two senders
    /// contend for one), and every frame is taken at once (no receive back-pressure here).
    fn carry(&mut self, i: usize) {
        while let Some(f) = self.sides[i].fw.transmit() {
            self.fabric.offer(i, f);
        }
        while let Some((at, frame, sent)) = self.fabric.start(i) {
            let (freed, mut heads) = self.fabric.switch(at, i, &frame, sent);
            let mut released: Vec<_> = freed.into_iter().collect();
            while let Some(h) = heads.pop() {
                let at = h.at;
                self.fabric.arrive_head(h.node, h.head);
                if let Some(a) = self.fabric.admit(h.node, at) {
                    self.fabric.tail_in(a.node);
                    self.seq += 1;
                    self.flight.push((a.tail, self.seq, a.node, a.frame));
                    released.extend(a.released);
                    heads.extend(a.next);
                }
            }
            for (n, t, _) in released {
                self.sides[n].fw.link_done(t);
            }
        }
    }

    /// Moves frames and runs timers until the next event; false when nothing is left to do.
    fn step(&mut self) -> bool {
        for i in 0..2 {
            self.carry(i);
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
fn data_survives_losing_a_seventh_of_the_frames() {
    let mut net = Net::new();
    net.lose(1.0 / 7.0);
    transfer(&mut net, &mixed_sizes(60));
}

#[test]
fn raw_stream_fills_each_receive_wr_with_what_arrived() {
    let mut net = Net::new();
    let (s, c) = net.pair_with(Box::new(RawStream), Box::new(RawStream));
    let src = net.region(CLIENT, 3000);
    let sent: Vec<u8> = (0..3000).map(|i| (i * 13 % 251) as u8).collect();
    src.write_at(0, &sent);
    for i in 0..3 {
        net.post_send(
            CLIENT,
            &c,
            SendWr::new(i, &[src.sge(i as usize * 1000, 1000)]),
        );
    }
    let dst = net.region(SERVER, 700 * 10);
    for i in 0..10 {
        net.post_recv(
            SERVER,
            &s,
            RecvWr::new(i, &[dst.sge(i as usize * 700, 700)]),
        );
    }
    let mut got = Vec::new();
    let mut next = 0;
    assert!(net.run_until(|n| {
        for d in n.completions(SERVER) {
            assert_eq!(d.status, WcStatus::Success);
            assert_eq!(d.wr_id, next);
            assert!(d.byte_len > 0 && d.byte_len <= 700);
            let mut b = vec![0u8; d.byte_len as usize];
            dst.read_at(next as usize * 700, &mut b);
            got.extend_from_slice(&b);
            next += 1;
        }
        got.len() == sent.len()
    }));
    assert_eq!(got, sent, "no framing bytes added, stream intact");
}

/// A message split over two TCP segments (a socket peer through the bridge sends this way),
/// its receive WR posted before the first, between the two, or after both have arrived: in
/// virtual time each ordering is exact, and half a message, or a whole one without a WR,
/// completes nothing in a virtual second after its last segment.
#[test]
fn a_message_split_over_segments_completes_whenever_its_wr_is_posted() {
    let mut net = Net::new();
    let (s, c) = net.pair_with(Box::new(LengthPrefixed::default()), Box::new(RawStream));
    let src = net.region(CLIENT, 32);
    let mut msg = 28u32.to_be_bytes().to_vec();
    msg.extend((0..28u8).map(|i| i + 1));
    src.write_at(0, &msg);
    let dst = net.region(SERVER, 64 * 3);
    // Sends one segment and runs until the server's firmware has acknowledged it, then a
    // virtual second more: the server's CQ must still be empty.
    let segment = |net: &mut Net, wr_id: u64, off: usize, len: usize| {
        net.post_send(CLIENT, &c, SendWr::new(wr_id, &[src.sge(off, len)]));
        let mut sent = Vec::new();
        assert!(net.run_until(|n| {
            sent.extend(n.completions(CLIENT));
            !sent.is_empty()
        }));
        assert_eq!((sent[0].wr_id, sent[0].status), (wr_id, WcStatus::Success));
        let until = net.now + 1_000_000_000;
        net.run_until(|n| n.now > until);
        assert!(net.completions(SERVER).is_empty(), "segment {wr_id}");
    };
    for (round, when) in ["before", "between", "after"].iter().enumerate() {
        let wr = RecvWr::new(round as u64, &[dst.sge(64 * round, 64)]);
        if *when == "before" {
            net.post_recv(SERVER, &s, wr.clone());
        }
        segment(&mut net, 1, 0, 26);
        if *when == "between" {
            net.post_recv(SERVER, &s, wr.clone());
        }
        if *when == "after" {
            segment(&mut net, 2, 26, 6);
            net.post_recv(SERVER, &s, wr);
        } else {
            net.post_send(CLIENT, &c, SendWr::new(2, &[src.sge(26, 6)]));
        }
        let mut got = Vec::new();
        assert!(net.run_until(|n| {
            got.extend(n.completions(SERVER));
            !got.is_empty()
        }));
        assert_eq!(
            (got[0].wr_id, got[0].status, got[0].byte_len),
            (round as u64, WcStatus::Success, 28),
            "WR posted {when} the segments"
        );
        let mut placed = [0u8; 28];
        dst.read_at(64 * round, &mut placed);
        assert_eq!(&placed[..], &msg[4..], "WR posted {when} the segments");
        if *when != "after" {
            // The second segment's send completion, not awaited above.
            let mut sent = Vec::new();
            assert!(net.run_until(|n| {
                sent.extend(n.completions(CLIENT));
                !sent.is_empty()
            }));
            assert_eq!((sent[0].wr_id, sent[0].status), (2, WcStatus::Success));
        }
    }
}

#[test]
fn without_receive_wrs_the_window_closes_and_sends_wait() {
    let mut net = Net::new();
    let (s, c) = net.pair();
    const N: usize = 8;
    const LEN: usize = 50_000;
    let src = net.region(CLIENT, N * LEN);
    for i in 0..N {
        src.write_at(i * LEN, &pattern(i, LEN));
        net.post_send(CLIENT, &c, SendWr::new(i as u64, &[src.sge(i * LEN, LEN)]));
    }
    // 400 KB against 64 KB of receive buffer and 64 KB of send buffer: stuck.
    net.run_until(|n| n.now > 5_000_000_000);
    let early = net.completions(CLIENT);
    assert!(
        early.len() < N,
        "{} of {N} sends completed without receivers",
        early.len()
    );
    assert!(net.completions(SERVER).is_empty());
    // And it stays stuck: a further virtual minute (window probes and all) completes
    // nothing, and the connection is held, not failed. This is the proof of "nothing more
    // completes" that the real-time contract test cannot give without waiting.
    let from = net.now;
    net.run_until(|n| n.now > from + 60_000_000_000);
    assert!(
        net.now > from + 30_000_000_000,
        "the firmware's timers keep running"
    );
    assert!(net.completions(CLIENT).is_empty(), "a send completed later");
    assert!(net.completions(SERVER).is_empty());
    assert_eq!((s.state(), c.state()), (QpState::Ready, QpState::Ready));
    let dst = net.region(SERVER, N * LEN);
    for i in 0..N {
        net.post_recv(SERVER, &s, RecvWr::new(i as u64, &[dst.sge(i * LEN, LEN)]));
    }
    let mut recvd = 0;
    let mut sent = early.len();
    assert!(net.run_until(|n| {
        recvd += n.completions(SERVER).len();
        sent += n.completions(CLIENT).len();
        recvd == N && sent == N
    }));
    for i in 0..N {
        let mut got = vec![0u8; LEN];
        dst.read_at(i * LEN, &mut got);
        assert!(got == pattern(i, LEN), "message {i}");
    }
}

#[test]
fn a_send_completes_only_when_the_peer_acknowledges_it() {
    let mut net = Net::new();
    let (s, c) = net.pair();
    let dst = net.region(SERVER, 100);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 100)]));
    let src = net.region(CLIENT, 100);
    src.write_at(0, b"hello");
    net.blackhole(SERVER, true); // the server's ACKs never arrive
    net.post_send(CLIENT, &c, SendWr::new(7, &[src.sge(0, 5)]));
    net.run_until(|n| n.now > 200_000_000);
    assert_eq!(net.completions(SERVER).len(), 1, "the data arrived");
    assert!(
        net.completions(CLIENT).is_empty(),
        "but is not acknowledged"
    );
    net.blackhole(SERVER, false);
    let mut done = Vec::new();
    assert!(net.run_until(|n| {
        done.extend(n.completions(CLIENT));
        !done.is_empty()
    }));
    assert_eq!(done[0].wr_id, 7);
    assert_eq!(done[0].status, WcStatus::Success);
    assert_eq!(done[0].byte_len, 5);
}

#[test]
fn udp_datagrams_report_their_source() {
    let mut net = Net::new();
    let s = net.qp_with(SERVER, QpKind::Unreliable, Box::new(RawStream));
    let c = net.qp_with(CLIENT, QpKind::Unreliable, Box::new(RawStream));
    let bind = |net: &mut Net, side, qp: &QpShared, port| {
        let (tx, rx) = reply_channel();
        let addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
        net.cmd(
            side,
            Command::BindUdp {
                qp: qp.num,
                addr,
                reply: tx,
            },
        );
        take(rx).unwrap().unwrap()
    };
    let server_addr = bind(&mut net, SERVER, &s, 5000);
    let client_addr = bind(&mut net, CLIENT, &c, 0);
    assert_eq!(server_addr, net.addr(SERVER, 5000));
    assert_eq!(client_addr.ip(), net.sides[CLIENT].addr);
    assert_ne!(client_addr.port(), 0);
    let dst = net.region(SERVER, 4096);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 2048)]));
    net.post_recv(SERVER, &s, RecvWr::new(2, &[dst.sge(2048, 4)]));
    let src = net.region(CLIENT, 100);
    src.write_at(0, b"datagram!");
    net.post_send(
        CLIENT,
        &c,
        SendWr::new(10, &[src.sge(0, 9)]).to(server_addr),
    );
    net.post_send(
        CLIENT,
        &c,
        SendWr::new(11, &[src.sge(0, 9)]).to(server_addr),
    );
    let v4: SocketAddr = "10.0.0.1:5".parse().unwrap();
    net.post_send(CLIENT, &c, SendWr::new(12, &[src.sge(0, 9)]).to(v4));
    // Larger than one packet: no IPv6 fragmentation in the firmware.
    let big = net.region(CLIENT, 20_000);
    net.post_send(
        CLIENT,
        &c,
        SendWr::new(13, &[big.sge(0, 20_000)]).to(server_addr),
    );
    let mut recv = Vec::new();
    let mut sent = Vec::new();
    assert!(net.run_until(|n| {
        recv.extend(n.completions(SERVER));
        sent.extend(n.completions(CLIENT));
        recv.len() == 2 && sent.len() == 4
    }));
    assert_eq!(recv[0].status, WcStatus::Success);
    assert_eq!(recv[0].byte_len, 9);
    assert_eq!(recv[0].src, Some(client_addr));
    let mut got = [0u8; 9];
    dst.read_at(0, &mut got);
    assert_eq!(&got, b"datagram!");
    assert_eq!(
        recv[1].status,
        WcStatus::LengthError,
        "4-byte WR, 9-byte datagram"
    );
    let status: Vec<_> = sent.iter().map(|c| (c.wr_id, c.status)).collect();
    assert!(status.contains(&(10, WcStatus::Success)));
    assert!(status.contains(&(11, WcStatus::Success)));
    assert!(status.contains(&(12, WcStatus::InvalidRequest)));
    assert!(status.contains(&(13, WcStatus::InvalidRequest)));
}

#[test]
fn a_bad_lkey_is_a_protection_error_and_the_reliable_qp_fails() {
    let mut net = Net::new();
    let (_s, c) = net.pair();
    let src = net.region(CLIENT, 100);
    let mut bad = src.sge(0, 10);
    bad.lkey += 1000;
    for wr in [
        SendWr::new(1, &[src.sge(0, 10)]),
        SendWr::new(2, &[bad]),
        SendWr::new(3, &[src.sge(0, 10)]),
    ] {
        c.push_send(wr).unwrap();
    }
    c.push_recv(RecvWr::new(4, &[src.sge(0, 10)])).unwrap();
    net.sides[CLIENT].fw.doorbell(net.now, c.num);
    let mut done = Vec::new();
    net.run_until(|n| {
        done.extend(n.completions(CLIENT));
        done.len() == 4
    });
    let status = |id| done.iter().find(|d| d.wr_id == id).map(|d| d.status);
    assert_eq!(status(2), Some(WcStatus::ProtectionError));
    assert_eq!(status(3), Some(WcStatus::Flushed));
    assert_eq!(status(4), Some(WcStatus::Flushed));
    assert!(status(1).is_some());
    assert_eq!(c.state(), QpState::Error);
}

#[test]
fn a_peer_abort_completes_everything_without_hanging() {
    let mut net = Net::new();
    let (s, c) = net.pair();
    let dst = net.region(SERVER, 100);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 50)]));
    net.post_recv(SERVER, &s, RecvWr::new(2, &[dst.sge(50, 50)]));
    net.run_until(|n| n.now > 1_000_000);
    net.cmd(CLIENT, Command::Disconnect { qp: c.num });
    let mut done = Vec::new();
    assert!(net.run_until(|n| {
        done.extend(n.completions(SERVER));
        done.len() == 2
    }));
    assert_eq!(done[0].status, WcStatus::RemoteClosed);
    assert_eq!(done[1].status, WcStatus::Flushed);
    assert_eq!(s.state(), QpState::Error);
    assert_eq!(c.state(), QpState::Closed);
}

#[test]
fn an_orderly_close_delivers_posted_sends_then_flushes_receives() {
    let mut net = Net::new();
    let (s, c) = net.pair();
    let src = net.region(CLIENT, 30_000);
    src.write_at(0, &pattern(1, 30_000));
    let keep = net.region(CLIENT, 10);
    net.post_recv(CLIENT, &c, RecvWr::new(99, &[keep.sge(0, 10)]));
    net.post_send(CLIENT, &c, SendWr::new(1, &[src.sge(0, 30_000)]));
    net.cmd(CLIENT, Command::Close { qp: c.num });
    assert_eq!(c.state(), QpState::Closing);
    let dst = net.region(SERVER, 30_000);
    net.post_recv(SERVER, &s, RecvWr::new(5, &[dst.sge(0, 30_000)]));
    net.post_recv(SERVER, &s, RecvWr::new(6, &[dst.sge(0, 10)]));
    let mut client = Vec::new();
    let mut server = Vec::new();
    assert!(net.run_until(|n| {
        client.extend(n.completions(CLIENT));
        server.extend(n.completions(SERVER));
        client.len() == 2 && server.len() == 2
    }));
    let st = |v: &[Completion], id| v.iter().find(|d| d.wr_id == id).map(|d| d.status);
    assert_eq!(st(&client, 1), Some(WcStatus::Success));
    assert_eq!(st(&client, 99), Some(WcStatus::Flushed));
    assert_eq!(st(&server, 5), Some(WcStatus::Success));
    assert_eq!(
        st(&server, 6),
        Some(WcStatus::RemoteClosed),
        "FIN after the data"
    );
    assert_eq!(c.state(), QpState::Closed);
    let mut got = vec![0u8; 30_000];
    dst.read_at(0, &mut got);
    assert!(got == pattern(1, 30_000));
    // Both ends let go: all SRAM but the QPs' own comes back.
    net.cmd(SERVER, Command::Destroy { qp: s.num });
    net.cmd(CLIENT, Command::Destroy { qp: c.num });
    net.run_until(|n| n.sides.iter().all(|s| s.fw.orphans.is_empty()));
    assert_eq!(net.sides[CLIENT].fw.sram_used(), 0);
}

#[test]
fn running_out_of_sram_is_an_out_of_memory_reply() {
    let mut net = Net::new();
    net.listen(SERVER, 7000).unwrap();
    let to = net.addr(SERVER, 7000);
    let mut errors = Vec::new();
    let mut ok = 0;
    for _ in 0..40 {
        let c = net.qp(CLIENT);
        let rx = net.connect(CLIENT, &c, to);
        match take(rx) {
            Some(Err(e)) => errors.push(e),
            Some(Ok(_)) => ok += 1,
            None => {}
        }
    }
    let e = errors.first().expect("SRAM runs out before 40 connections");
    assert_eq!(e.kind(), io::ErrorKind::OutOfMemory);
    assert!(
        e.to_string().starts_with("LANai SRAM exhausted: need ")
            && e.to_string().ends_with(" of 2097152 free"),
        "{e}"
    );
    assert_eq!(ok, 0, "connects reply once established");
    // QPs themselves run out too: the QP goes to the error state, its WRs flushed.
    let mut failed = None;
    for _ in 0..2000 {
        let q = net.qp(CLIENT);
        if q.state() == QpState::Error {
            failed = Some(q);
            break;
        }
    }
    let q = failed.expect("QP creation runs out of SRAM");
    let m = net.region(CLIENT, 8);
    net.post_recv(CLIENT, &q, RecvWr::new(1, &[m.sge(0, 8)]));
    let flushed = net.completions(CLIENT);
    assert!(
        flushed
            .iter()
            .any(|d| d.wr_id == 1 && d.status == WcStatus::Flushed)
    );
    net.run_until(|n| n.now > 1_000_000_000);
}

#[test]
fn identical_runs_are_identical() {
    let run = || {
        let mut net = Net::new();
        transfer(&mut net, &mixed_sizes(120));
        (
            net.now,
            net.sides[SERVER].fw.meter().busy_ns(),
            net.sides[CLIENT].fw.meter().busy_ns(),
            net.sides[SERVER].fw.host_visible_at(),
            net.fabric.stats.clone(),
        )
    };
    let a = run();
    assert_eq!(a, run());
    assert!(a.1 > 0 && a.3 > 0);
}

#[test]
fn stages_are_charged_per_packet_or_per_wr_where_the_work_is_done() {
    let mut net = Net::new();
    // 20 messages of 100 bytes: fewer segments than messages (Nagle coalesces them), so
    // per-packet and per-WR charges differ.
    transfer(&mut net, &[100; 20]);
    let m = net.sides[SERVER].fw.meter();
    let data = m.occupancy(Dir::Recv, Kind::Data);
    assert!(data.packets > 0);
    let per = data.per_packet_us();
    assert_eq!(per["tcp_parse"], 7.0);
    assert_eq!(per["media_receive"], 1.0);
    // Receive: one get WR per receive WR, one put data per DMA to host memory (at least one
    // per WR), whatever the number of packets that carried them. A stage that overlaps DMA
    // traffic waits for SRAM cycles: up to a few percent more than its cost.
    let charged = |ns: Nanos, cost: Nanos| (cost..cost * 21 / 20).contains(&ns);
    let get_wr = data.stage_ns[&Stage::GetWr];
    assert!(charged(get_wr, 20 * 5_500), "{get_wr}");
    assert!(data.stage_ns[&Stage::PutData] >= 20 * 4_500);
    let acks = net.sides[CLIENT].fw.meter().occupancy(Dir::Recv, Kind::Ack);
    assert!(acks.packets > 0);
    assert_eq!(acks.per_packet_us()["tcp_parse"], 14.0);
    // Send: get WR per send WR, get data and headers per segment.
    let sent = net.sides[CLIENT]
        .fw
        .meter()
        .occupancy(Dir::Send, Kind::Data);
    assert!(sent.packets >= 1);
    let get_wr = sent.stage_ns[&Stage::GetWr];
    assert!(charged(get_wr, 20 * 5_500), "{get_wr}");
    // The headers are built while the segment's DMA moves data through SRAM.
    let per = sent.per_packet_us();
    assert!((5.0..5.75).contains(&per["build_tcp_header"]), "{per:?}");
    assert!((4.5..5.2).contains(&per["get_data"]), "{per:?}");
}

#[test]
fn a_dead_peer_fails_the_qp_instead_of_hanging() {
    let mut net = Net::new();
    let (_s, c) = net.pair();
    let src = net.region(CLIENT, 10);
    net.blackhole(SERVER, true);
    net.blackhole(CLIENT, true);
    net.post_send(CLIENT, &c, SendWr::new(1, &[src.sge(0, 10)]));
    let mut done = Vec::new();
    // The harness gives up after a virtual minute per call; the peer is declared dead at 120 s.
    for _ in 0..4 {
        if net.run_until(|n| {
            done.extend(n.completions(CLIENT));
            !done.is_empty()
        }) {
            break;
        }
    }
    assert_eq!(done.first().map(|d| d.status), Some(WcStatus::RemoteClosed));
    assert_eq!(c.state(), QpState::Error);
}

/// An idle connection whose peer vanishes without a word (a killed process on the fabric):
/// the keep-alives go unanswered, the QP fails and its SRAM comes back, so dead clients do
/// not pile up in a server's SRAM.
#[test]
fn an_idle_connection_to_a_vanished_peer_is_reclaimed() {
    let mut net = Net::new();
    let (s, _c) = net.pair();
    let dst = net.region(SERVER, 16);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 16)]));
    let used = net.sides[SERVER].fw.sram_used();
    net.blackhole(SERVER, true);
    net.blackhole(CLIENT, true);
    let mut done = Vec::new();
    for _ in 0..4 {
        if net.run_until(|n| {
            done.extend(n.completions(SERVER));
            !done.is_empty()
        }) {
            break;
        }
    }
    assert_eq!(done.first().map(|d| d.status), Some(WcStatus::RemoteClosed));
    assert_eq!(s.state(), QpState::Error);
    assert!(
        net.now < 200_000_000_000,
        "found within the keep-alive timeout"
    );
    assert!(
        net.sides[SERVER].fw.sram_used() < used,
        "the connection's SRAM was released"
    );
}

#[test]
fn the_firmware_can_move_to_a_backend_thread() {
    fn send<T: Send>() {}
    send::<Firmware>();
}

#[test]
fn a_connection_waits_for_a_later_accept() {
    let mut net = Net::new();
    net.listen(SERVER, 7000).unwrap();
    let c = net.qp(CLIENT);
    let con = net.connect(CLIENT, &c, net.addr(SERVER, 7000));
    assert!(net.run_until(|_| c.state() == QpState::Ready));
    let local = take(con).unwrap().unwrap();
    // Not yet mated: the client may already send; the bytes wait in the server's SRAM.
    let src = net.region(CLIENT, 4);
    src.write_at(0, b"ping");
    net.post_send(CLIENT, &c, SendWr::new(1, &[src.sge(0, 4)]));
    net.run_until(|n| n.now > 10_000_000);
    let s = net.qp(SERVER);
    let dst = net.region(SERVER, 16);
    net.post_recv(SERVER, &s, RecvWr::new(2, &[dst.sge(0, 16)]));
    let acc = net.accept(SERVER, &s);
    assert_eq!(take(acc).unwrap().unwrap(), local);
    let mut done = Vec::new();
    assert!(net.run_until(|n| {
        done.extend(n.completions(SERVER));
        !done.is_empty()
    }));
    assert_eq!((done[0].wr_id, done[0].byte_len), (2, 4));
    let mut got = [0u8; 4];
    dst.read_at(0, &mut got);
    assert_eq!(&got, b"ping");
    // A second accept waits for a connection that has not come.
    let s2 = net.qp(SERVER);
    let acc2 = net.accept(SERVER, &s2);
    net.run_until(|n| n.now > 20_000_000);
    assert_eq!(s2.state(), QpState::Init);
    net.cmd(SERVER, Command::CloseListener { listener: 1 });
    assert_eq!(
        take(acc2).unwrap().unwrap_err().kind(),
        io::ErrorKind::ConnectionAborted
    );
}

#[test]
fn packets_without_a_route_are_dropped_and_the_connect_times_out() {
    let mut net = Net::new();
    net.sides[CLIENT].fw.fabric.bridge = None;
    let c = net.qp(CLIENT);
    let nowhere: SocketAddr = "[fd00:4c41:4e41::77]:7000".parse().unwrap();
    let con = net.connect(CLIENT, &c, nowhere);
    assert!(net.run_until(|_| c.state() == QpState::Init));
    assert_eq!(
        take(con).unwrap().unwrap_err().kind(),
        io::ErrorKind::TimedOut
    );
    assert!(net.sides[CLIENT].fw.stats().no_route > 0);
    // The connection's SRAM came back; only the QP's own is in use.
    let d = &LanaiParams::default().device;
    assert_eq!(
        net.sides[CLIENT].fw.sram_used(),
        d.qp_state_bytes + d.wr_cache_entries * d.wr_entry_bytes
    );
}

/// Garbage from the fabric: random bytes, frames with a good CRC around random packets, and
/// IPv6/TCP-shaped packets aimed at the live connection's ports. None may panic the firmware
/// or disturb the connection; undecodable frames are counted.
#[test]
fn garbage_frames_are_dropped_and_the_connection_carries_on() {
    let mut net = Net::new();
    let (s, c) = net.pair();
    let (server, client) = (net.sides[SERVER].addr, net.sides[CLIENT].addr);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let bad_before = net.sides[SERVER].fw.stats().bad_frames;
    for i in 0..3000 {
        let len = (rand() % 200) as usize;
        let mut body: Vec<u8> = (0..len).map(|_| rand() as u8).collect();
        let frame = match i % 3 {
            0 => body,
            1 => frame::encode(&[], &body),
            _ => {
                // IPv6 header to the server from the client, TCP, random segment bytes with
                // the connection's ports (7000 on the server side).
                let mut p = vec![0x60, 0, 0, 0];
                p.extend_from_slice(&((20 + body.len()) as u16).to_be_bytes());
                p.extend_from_slice(&[6, 64]);
                p.extend_from_slice(&client.octets());
                p.extend_from_slice(&server.octets());
                body.resize(body.len().max(20), 0);
                body[2..4].copy_from_slice(&7000u16.to_be_bytes());
                body[12] = 0x50;
                p.extend_from_slice(&body);
                frame::encode(&[], &p)
            }
        };
        let now = net.now;
        net.sides[SERVER].fw.receive(now, &frame);
        net.sides[SERVER].fw.poll(now);
    }
    assert!(net.sides[SERVER].fw.stats().bad_frames >= bad_before + 1000);
    // The connection still works both ways (smoltcp drops segments with bad checksums, and a
    // random segment that passes cannot fall inside the window by more than chance).
    let src = net.region(CLIENT, 64);
    src.write_at(0, b"still here");
    let dst = net.region(SERVER, 64);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 64)]));
    net.post_send(CLIENT, &c, SendWr::new(2, &[src.sge(0, 10)]));
    assert!(net.run_until(|n| !n.sides[SERVER].cq.is_empty()));
    let done = net.completions(SERVER);
    assert_eq!(done[0].status, WcStatus::Success, "{done:?}");
    let mut got = [0u8; 10];
    dst.read_at(0, &mut got);
    assert_eq!(&got, b"still here");
}

#[test]
fn a_reset_waits_for_a_free_staging_buffer_instead_of_being_lost() {
    // A message and the peer's FIN come in back to back (as a real-time receive batch takes
    // them, before the link has reported any frame gone): their ACKs take every send
    // staging buffer, and the FIN fails the QP, which waits for another message. The RST
    // must wait for a buffer, not vanish with the socket: the peer, its FIN acknowledged,
    // would wait for ours forever.
    let mut net = Net::new();
    let (s, c) = net.pair();
    let dst = net.region(SERVER, 100);
    net.post_recv(SERVER, &s, RecvWr::new(1, &[dst.sge(0, 50)]));
    net.post_recv(SERVER, &s, RecvWr::new(2, &[dst.sge(50, 50)]));
    net.run_until(|n| n.now > 1_000_000);
    let src = net.region(CLIENT, 10);
    net.post_send(CLIENT, &c, SendWr::new(7, &[src.sge(0, 10)]));
    net.cmd(CLIENT, Command::Close { qp: c.num });
    let mut frames = Vec::new();
    loop {
        let side = &mut net.sides[CLIENT].fw;
        let out = side.transmit().expect("the client sends its FIN");
        side.link_done(out.ready_at);
        let (_, bytes) = crate::frame::switch(&out.bytes).expect("a routed frame");
        let pkt = crate::frame::decode(&bytes).expect("a good frame");
        let fin = crate::frame::summary(pkt).contains('F');
        frames.push(bytes);
        if fin {
            break;
        }
        if let Some(t) = side.poll_at() {
            side.poll(t);
        }
    }
    for f in &frames {
        net.now += 1_000;
        net.sides[SERVER].fw.receive(net.now, f);
    }
    assert_eq!(s.state(), QpState::Error);
    let released = |n: &mut Net| {
        matches!(n.sides[CLIENT].fw.qps[&c.num].link, Link::Down)
            && n.sides[SERVER].fw.dying.is_empty()
    };
    // At once, not when something the client retransmits meets the server's stack without
    // a socket.
    let fin_at = net.now;
    net.run_until(|n| released(n) || n.now > fin_at + 1_000_000);
    assert!(
        released(&mut net),
        "the server's RST reached the client, which let its connection go"
    );
    assert_eq!(c.state(), QpState::Closed);
}
