//! One QP inside the firmware: its link (idle, connecting, a TCP connection, a UDP port) and
//! its transmit and receive state machines over the smoltcp sockets.
//!
//! Over 600 lines: one QP's link states and every transition between them in one place, as in the soft NIC.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, SocketAddrV6};
use std::sync::Arc;

use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{IpAddress, IpEndpoint};

use crate::meter::{Dir, Kind, Meter, Nanos, Stage};
use crate::params::DeviceParams;
use crate::pci::{PciBus, Use};
use crate::sram::Sram;

use super::cq::{CqWrites, Outstanding};
use qpip_verbs::backend::MgmtResult;
use qpip_verbs::framer::Framer;
use qpip_verbs::machines::rx::{RecvTarget, RxMachine, RxStop};
use qpip_verbs::machines::tx::OutMsg;
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::{QpShared, QpState};
use qpip_verbs::wr::WcStatus;

/// How long a peer may stay silent before its connection is declared dead.
const DEAD_PEER: smoltcp::time::Duration = smoltcp::time::Duration::from_secs(120);

/// An idle connection probes its peer this often, so a crashed peer (a killed process on
/// the fabric, which sends no RST) is found within `DEAD_PEER`.
pub(super) const KEEP_ALIVE: smoltcp::time::Duration = smoltcp::time::Duration::from_secs(30);

/// What the QP machines borrow from the firmware while they run.
pub(super) struct Ctx<'a> {
    pub sockets: &'a mut SocketSet<'static>,
    pub memory: &'a MemoryTable,
    pub meter: &'a mut Meter,
    pub bus: &'a mut PciBus,
    pub dev: &'a DeviceParams,
    /// Largest IPv6 packet on the fabric.
    pub mtu: usize,
    pub sram: &'a mut Sram,
    /// Aborted TCP sockets: removed after the next egress poll has sent their RST.
    pub dying: &'a mut Vec<SocketHandle>,
    pub cq: &'a mut CqWrites,
}

/// Writes the CQ entries of the completions `$qp` made since `$seen`. A macro so that it
/// borrows only the fields it uses while a socket is borrowed from the set.
macro_rules! written {
    ($cx:expr, $qp:expr, $seen:expr) => {
        $cx.cq.write($cx.bus, $cx.meter, $qp, $seen)
    };
}

/// SRAM of one TCP connection or listening socket: its control block and both buffers.
pub(super) fn tcp_sram(dev: &DeviceParams) -> u64 {
    dev.tcb_bytes + dev.tcp_send_buffer as u64 + dev.tcp_recv_buffer as u64
}

/// A reliable QP's connection.
pub(super) struct TcpLink {
    pub handle: SocketHandle,
    tx: VecDeque<OutMsg>,
    /// Bytes moved into the send buffer since the connection opened.
    pushed: u64,
    rx: RxMachine,
    /// Received bytes copied toward host memory whose DMA has not finished: they stay in
    /// the socket's buffer (and out of the window the peer is offered) until it has.
    held: usize,
    /// Those DMAs: when each finishes and how many bytes it moves.
    placing: VecDeque<(Nanos, usize)>,
    /// Orderly close asked for: send what is posted, then FIN.
    pub closing: bool,
    pub fin_sent: bool,
    /// Closed on our side with everything acknowledged: discard what still arrives until the
    /// connection is gone.
    draining: bool,
}

impl TcpLink {
    pub(super) fn new(handle: SocketHandle) -> Self {
        TcpLink {
            handle,
            tx: VecDeque::new(),
            pushed: 0,
            rx: RxMachine::new(),
            held: 0,
            placing: VecDeque::new(),
            closing: false,
            fin_sent: false,
            draining: false,
        }
    }

    /// Moves message bytes into the socket's send buffer; true if any moved.
    ///
    /// Only when a full segment's worth fits (or all that is left does): with Nagle off,
    /// refilling the buffer by whatever each ACK freed would send as many small segments
    /// (sender-side silly window avoidance, RFC 1122 4.2.3.4).
    fn push(&mut self, sock: &mut tcp::Socket<'_>, mss: usize) -> bool {
        let room = sock.send_capacity() - sock.send_queue();
        // Summed only when less than a segment fits (the queue is walked on every service).
        if room < mss {
            let unpushed: usize = self
                .tx
                .iter()
                .filter(|m| m.end.is_none())
                .map(|m| m.total() - m.sent)
                .sum();
            if room < unpushed {
                return false;
            }
        }
        let mut progress = false;
        for msg in self.tx.iter_mut().filter(|m| m.end.is_none()) {
            let mut blocked = false;
            let mut moved = 0;
            for part in msg.unsent() {
                let n = sock.send_slice(part).unwrap_or(0);
                moved += n;
                if n < part.len() {
                    blocked = true;
                    break;
                }
            }
            msg.sent += moved;
            self.pushed += moved as u64;
            progress |= moved > 0;
            if blocked {
                break;
            }
            msg.end = Some(self.pushed);
            progress = true;
        }
        progress
    }

    fn all_pushed(&self) -> bool {
        self.tx.iter().all(|m| m.end.is_some())
    }

    /// Bytes whose DMA to host memory has finished by `now` leave the socket's buffer, so
    /// the window reopens only for data the host really has; true if any left.
    fn release_placed(&mut self, sock: &mut tcp::Socket<'_>, now: Nanos) -> bool {
        let mut any = false;
        while let Some(&(done, n)) = self.placing.front()
            && done <= now
        {
            self.placing.pop_front();
            let mut left = n;
            while left > 0 {
                match sock.recv(|b| {
                    let k = b.len().min(left);
                    (k, k)
                }) {
                    Ok(k) if k > 0 => left -= k,
                    _ => break,
                }
            }
            self.held = self.held.saturating_sub(n);
            any = true;
        }
        any
    }

    /// Closed on our side with everything acknowledged: what still arrives is discarded and
    /// anything posted flushed, until the connection is gone and the link can be released.
    /// Returns (progress, what to do after).
    fn drain(&mut self, sock: &mut tcp::Socket<'_>, shared: &QpShared) -> (bool, After) {
        self.placing.clear();
        self.held = 0;
        while let Ok(n) = sock.recv(|b| (b.len(), b.len())) {
            if n == 0 {
                break;
            }
        }
        let progress = !shared.rq.is_empty() || !shared.sq.is_empty();
        shared.flush_queues();
        let after = if matches!(sock.state(), tcp::State::Closed | tcp::State::TimeWait) {
            After::Release
        } else {
            After::Nothing
        };
        (progress, after)
    }

    /// One pass of an open connection: transmit, complete what is acknowledged, receive, and
    /// close in order when asked to. Sets `progress` if anything moved.
    fn step(
        &mut self,
        cx: &mut Ctx<'_>,
        shared: &QpShared,
        framer: &mut dyn Framer,
        seen: &mut Outstanding,
        progress: &mut bool,
    ) -> After {
        let sock = cx.sockets.get_mut::<tcp::Socket>(self.handle);
        if let Some(after) = self.take_sends(shared, framer, cx.memory, cx.meter, progress) {
            return after;
        }
        // IPv6 (40) + TCP (20) + timestamps (12): the payload of a full segment.
        *progress |= self.push(sock, cx.mtu.saturating_sub(72));
        *progress |= self.complete_acked(sock, shared);
        written!(cx, shared, seen);
        // A peer silent this long is dead: the QP fails instead of hanging, and its SRAM
        // comes back. A live peer is never that quiet: it answers zero-window probes
        // (backed off to 60 s at most) and the keep-alives an idle connection sends.
        sock.set_timeout(Some(DEAD_PEER));
        *progress |= self.release_placed(sock, cx.meter.now());
        let (received, stop) = self.receive(sock, shared, framer, cx.memory, cx.meter, cx.bus);
        // Each receive completion's entry follows the data DMAs of its message.
        written!(cx, shared, seen);
        *progress |= received;
        if stop == RxStop::Failed {
            return After::Fail {
                state: QpState::Error,
                send: WcStatus::RemoteClosed,
            };
        }
        if sock.state() == tcp::State::Closed {
            // Reset by the peer (or timed out) under us.
            tracing::debug!(qp = shared.num, "connection reset");
            return After::Fail {
                state: QpState::Error,
                send: WcStatus::RemoteClosed,
            };
        }
        *progress |= self.close_in_order(sock, shared);
        After::Nothing
    }

    /// Takes posted send WRs into the transmit queue while the connection may still carry
    /// them; a WR that cannot be prepared fails the QP.
    fn take_sends(
        &mut self,
        shared: &QpShared,
        framer: &mut dyn Framer,
        memory: &MemoryTable,
        meter: &mut Meter,
        progress: &mut bool,
    ) -> Option<After> {
        if self.fin_sent {
            return None;
        }
        while let Some(wr) = shared.sq.pop() {
            *progress = true;
            meter.charge(Dir::Send, Kind::Data, Stage::GetWr, 0);
            match OutMsg::prepare(wr, memory, Some(&mut *framer)) {
                Ok(msg) => self.tx.push_back(msg),
                Err((wr_id, fault)) => {
                    tracing::warn!(qp = shared.num, wr_id, "send WR refused: {fault}");
                    // Failed before the host can see why (in real time it polls the
                    // CQ while the firmware runs).
                    shared.set_state(QpState::Error);
                    shared.complete_send(wr_id, WcStatus::ProtectionError, 0, 0);
                    return Some(After::Fail {
                        state: QpState::Error,
                        send: WcStatus::Flushed,
                    });
                }
            }
        }
        None
    }

    /// Completes each send WR once the peer has acknowledged all of its bytes (a reset
    /// socket acknowledges nothing, whatever its buffer says); true if any completed.
    fn complete_acked(&mut self, sock: &tcp::Socket<'_>, shared: &QpShared) -> bool {
        let reset = sock.state() == tcp::State::Closed;
        let acked = self.pushed.saturating_sub(sock.send_queue() as u64);
        let mut progress = false;
        while !reset
            && let Some(m) = self.tx.front()
            && m.end.is_some_and(|end| end <= acked)
        {
            shared.complete_send(m.wr_id, WcStatus::Success, m.body_len as u32, 0);
            self.tx.pop_front();
            progress = true;
        }
        progress
    }

    /// Receive: the framer finds messages in the byte stream, bodies go to WRs. With no WR
    /// posted the bytes stay in the socket and the window closes. Returns whether anything
    /// moved (bytes placed count even when no WR was taken: the tail of a message split
    /// over segments completes a WR taken earlier, and its CQ must be notified) and where
    /// the receive machine stopped.
    fn receive(
        &mut self,
        sock: &mut tcp::Socket<'_>,
        shared: &QpShared,
        framer: &mut dyn Framer,
        memory: &MemoryTable,
        meter: &mut Meter,
        bus: &mut PciBus,
    ) -> (bool, RxStop) {
        let TcpLink {
            rx, held, placing, ..
        } = self;
        let mut placed = 0usize;
        let before = shared.rq.len();
        let rq_seen = std::cell::Cell::new(before);
        // Per receive WR the firmware fetches its descriptor (get WR); per DMA it sets up
        // the move to host memory (put data): charged where that work happens, not per
        // packet.
        let take_wrs = |meter: &mut Meter| {
            let now_len = shared.rq.len();
            for _ in now_len..rq_seen.get() {
                meter.charge(Dir::Recv, Kind::Data, Stage::GetWr, 0);
            }
            rq_seen.set(now_len);
        };
        let mut read = |iov: &mut [IoSliceMut<'_>]| -> io::Result<usize> {
            take_wrs(meter);
            let total = peek_past(sock, *held, iov);
            if total > 0 {
                placed += total;
                meter.charge(Dir::Recv, Kind::Data, Stage::PutData, 0);
                let done = bus.dma_now(Use::Write, meter, total);
                placing.push_back((done, total));
                *held += total;
                return Ok(total);
            }
            if *held > 0 {
                // End of stream is seen once the held bytes are in host memory.
                return Err(io::ErrorKind::WouldBlock.into());
            }
            match sock.recv_slice(&mut []) {
                Ok(_) => Err(io::ErrorKind::WouldBlock.into()),
                Err(tcp::RecvError::Finished) => Ok(0),
                Err(_) => Err(io::ErrorKind::ConnectionReset.into()),
            }
        };
        let stop = rx.pump(shared, memory, framer, &mut read);
        take_wrs(meter);
        (shared.rq.len() != before || placed > 0, stop)
    }

    /// Orderly close: FIN once every posted send is in the buffer; closed once all of it is
    /// acknowledged, receives flushed. True if it moved.
    fn close_in_order(&mut self, sock: &mut tcp::Socket<'_>, shared: &QpShared) -> bool {
        let mut progress = false;
        if self.closing && !self.fin_sent && self.all_pushed() && shared.sq.is_empty() {
            sock.close();
            self.fin_sent = true;
            progress = true;
        }
        if self.fin_sent && self.tx.is_empty() {
            self.draining = true;
            shared.set_state(QpState::Closed);
            self.rx.flush(shared);
            shared.flush_queues();
            progress = true;
        }
        progress
    }

    /// When the next placed DMA finishes (the window reopens then).
    pub(super) fn next_release(&self) -> Option<Nanos> {
        self.placing.front().map(|&(t, _)| t)
    }
}

/// Copies up to `want` received bytes that follow the `held` ones into `iov`, without
/// taking them from the socket; returns how many.
fn peek_past(sock: &mut tcp::Socket<'_>, held: usize, iov: &mut [IoSliceMut<'_>]) -> usize {
    let want: usize = iov.iter().map(|b| b.len()).sum();
    let n = want.min(sock.recv_queue().saturating_sub(held));
    if n == 0 {
        return 0;
    }
    let mut tmp = vec![0u8; held + n];
    let got = sock.peek_slice(&mut tmp).unwrap_or(0).saturating_sub(held);
    let mut src = &tmp[held..held + got];
    for buf in iov.iter_mut() {
        let k = buf.len().min(src.len());
        buf[..k].copy_from_slice(&src[..k]);
        src = &src[k..];
        if src.is_empty() {
            break;
        }
    }
    got
}

/// An unreliable QP's port.
pub(super) struct UdpLink {
    pub handle: SocketHandle,
    tx: VecDeque<OutMsg>,
    /// Payload bytes handed to the socket so far.
    pushed: u64,
}

impl UdpLink {
    pub(super) fn new(handle: SocketHandle) -> Self {
        UdpLink {
            handle,
            tx: VecDeque::new(),
            pushed: 0,
        }
    }
}

pub(super) enum Link {
    /// Created, not yet connected, accepted or bound.
    Idle,
    Connecting {
        handle: SocketHandle,
        reply: ReplySender<MgmtResult>,
        deadline: Nanos,
    },
    Tcp(Box<TcpLink>),
    Udp(Box<UdpLink>),
    /// Closed or failed: anything posted is flushed.
    Down,
}

pub(super) struct FwQp {
    pub shared: Arc<QpShared>,
    pub framer: Box<dyn Framer>,
    /// SRAM charged to the QP itself (state, WR cache, UDP buffers).
    pub sram: u64,
    pub link: Link,
    /// Receive WRs in the ring when the QP was last serviced (doorbell classification).
    pub rq_seen: usize,
}

pub(super) fn v6(ep: IpEndpoint) -> SocketAddr {
    match ep.addr {
        IpAddress::Ipv6(a) => SocketAddr::V6(SocketAddrV6::new(a, ep.port, 0, 0)),
    }
}

/// What the TCP machine decided once its socket borrow ended.
enum After {
    Nothing,
    Fail { state: QpState, send: WcStatus },
    Release,
}

impl FwQp {
    pub(super) fn new(shared: Arc<QpShared>, framer: Box<dyn Framer>) -> Self {
        FwQp {
            shared,
            framer,
            sram: 0,
            link: Link::Idle,
            rq_seen: 0,
        }
    }

    pub(super) fn is_idle(&self) -> bool {
        matches!(self.link, Link::Idle) && self.shared.state() == QpState::Init
    }

    /// Runs the QP's machines as far as they go; true if anything moved.
    pub(super) fn service(&mut self, cx: &mut Ctx<'_>) -> bool {
        let mut seen = Outstanding::of(&self.shared);
        let progress = match &self.link {
            Link::Tcp(_) => self.service_tcp(cx, &mut seen),
            Link::Udp(_) => self.service_udp(cx, &mut seen),
            Link::Down => {
                let any = !self.shared.sq.is_empty() || !self.shared.rq.is_empty();
                self.shared.flush_queues();
                any
            }
            Link::Idle | Link::Connecting { .. } => false,
        };
        written!(cx, &self.shared, &mut seen);
        self.rq_seen = self.shared.rq.len();
        if progress {
            self.shared.notify_cqs();
        }
        progress
    }

    fn service_tcp(&mut self, cx: &mut Ctx<'_>, seen: &mut Outstanding) -> bool {
        let FwQp {
            shared,
            framer,
            link,
            ..
        } = self;
        let Link::Tcp(t) = link else { return false };
        let (progress, after) = if t.draining {
            t.drain(cx.sockets.get_mut::<tcp::Socket>(t.handle), shared)
        } else {
            let mut progress = false;
            let after = t.step(cx, shared, framer.as_mut(), seen, &mut progress);
            (progress, after)
        };
        self.settle(cx, seen, after) || progress
    }

    /// Carries out what the TCP machine decided once its socket borrow ended; true if
    /// anything moved.
    fn settle(&mut self, cx: &mut Ctx<'_>, seen: &mut Outstanding, after: After) -> bool {
        match after {
            After::Nothing => false,
            After::Fail { state, send } => {
                written!(cx, &self.shared, seen);
                self.fail(cx, state, send);
                *seen = Outstanding::of(&self.shared);
                true
            }
            After::Release => {
                if let Link::Tcp(t) = std::mem::replace(&mut self.link, Link::Down) {
                    cx.sockets.remove(t.handle);
                    cx.sram.release(tcp_sram(cx.dev));
                }
                true
            }
        }
    }

    fn service_udp(&mut self, cx: &mut Ctx<'_>, seen: &mut Outstanding) -> bool {
        let FwQp { shared, link, .. } = self;
        let Link::Udp(u) = link else { return false };
        let mut progress = false;
        let sock = cx.sockets.get_mut::<udp::Socket>(u.handle);
        while let Some(wr) = shared.sq.pop() {
            progress = true;
            cx.meter.charge(Dir::Send, Kind::Data, Stage::GetWr, 0);
            match OutMsg::prepare(wr, cx.memory, None) {
                Ok(msg) => {
                    // No IPv6 fragmentation: a datagram fits one packet (IPv6 + UDP headers).
                    let room = sock.payload_send_capacity().min(cx.mtu.saturating_sub(48));
                    if !matches!(msg.dest, Some(SocketAddr::V6(_))) || msg.body_len > room {
                        tracing::warn!(
                            qp = shared.num,
                            wr_id = msg.wr_id,
                            dest = ?msg.dest,
                            len = msg.body_len,
                            "datagram cannot be sent (IPv6 destination, at most {room} bytes)"
                        );
                        shared.complete_send(msg.wr_id, WcStatus::InvalidRequest, 0, 0);
                        written!(cx, shared, seen);
                    } else {
                        u.tx.push_back(msg);
                    }
                }
                Err((wr_id, fault)) => {
                    // Not fatal on an unreliable QP.
                    tracing::warn!(qp = shared.num, wr_id, "send WR refused: {fault}");
                    shared.complete_send(wr_id, WcStatus::ProtectionError, 0, 0);
                    written!(cx, shared, seen);
                }
            }
        }
        // Hand datagrams to the socket while its buffer has room.
        for msg in u.tx.iter_mut().filter(|m| m.end.is_none()) {
            let Some(SocketAddr::V6(dest)) = msg.dest else {
                break;
            };
            let ep = IpEndpoint::new(IpAddress::Ipv6(*dest.ip()), dest.port());
            let Ok(buf) = sock.send(msg.body_len, ep) else {
                break;
            };
            let mut off = 0;
            for part in msg.parts().skip(1) {
                buf[off..off + part.len()].copy_from_slice(part);
                off += part.len();
            }
            u.pushed += msg.body_len as u64;
            msg.end = Some(u.pushed);
            progress = true;
        }
        // A datagram's send completes once it has left the socket for the wire.
        let sent = u.pushed - sock.send_queue() as u64;
        while let Some(m) = u.tx.front()
            && m.end.is_some_and(|end| end <= sent)
        {
            shared.complete_send(m.wr_id, WcStatus::Success, m.body_len as u32, 0);
            written!(cx, shared, seen);
            u.tx.pop_front();
            progress = true;
        }
        // Each datagram fills one receive WR.
        while sock.can_recv() {
            let wr = match RecvTarget::take(shared, cx.memory) {
                None => break,
                Some(Ok(wr)) => wr,
                Some(Err(_refused)) => {
                    progress = true;
                    written!(cx, shared, seen);
                    continue;
                }
            };
            progress = true;
            cx.meter.charge(Dir::Recv, Kind::Data, Stage::GetWr, 0);
            let Ok((data, meta)) = sock.recv() else {
                break;
            };
            let off = wr.scatter(0, data);
            let status = if off < data.len() {
                WcStatus::LengthError
            } else {
                WcStatus::Success
            };
            cx.meter.charge(Dir::Recv, Kind::Data, Stage::PutData, 0);
            cx.bus.dma_now(Use::Write, cx.meter, off);
            shared.complete_recv(wr.wr_id, status, off as u32, Some(v6(meta.endpoint)), 0);
            written!(cx, shared, seen);
        }
        progress
    }

    /// Fatal error or abortive close: the link goes down, every outstanding WR completes
    /// (in-flight sends with `send`, the rest flushed), a TCP connection is reset.
    pub(super) fn fail(&mut self, cx: &mut Ctx<'_>, state: QpState, send: WcStatus) {
        let mut seen = Outstanding::of(&self.shared);
        self.shared.set_state(state);
        match std::mem::replace(&mut self.link, Link::Down) {
            Link::Tcp(mut t) => {
                for m in t.tx.drain(..) {
                    self.shared.complete_send(m.wr_id, send, 0, 0);
                }
                t.rx.flush(&self.shared);
                cx.sockets.get_mut::<tcp::Socket>(t.handle).abort();
                cx.dying.push(t.handle);
            }
            Link::Connecting { handle, reply, .. } => {
                reply.send(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "connect aborted",
                )));
                cx.sockets.get_mut::<tcp::Socket>(handle).abort();
                cx.dying.push(handle);
            }
            Link::Udp(u) => {
                for m in &u.tx {
                    self.shared.complete_send(m.wr_id, WcStatus::Flushed, 0, 0);
                }
                cx.sockets.remove(u.handle);
            }
            Link::Idle | Link::Down => {}
        }
        self.shared.flush_queues();
        written!(cx, &self.shared, &mut seen);
        self.shared.notify_cqs();
    }

    /// Destroy: the host forgets the QP. A connection it did not reset is closed the way a
    /// kernel closes a dropped socket: FIN after the data already buffered (RST if unread
    /// data is left); returns that socket so it can finish as an orphan.
    pub(super) fn destroy(&mut self, cx: &mut Ctx<'_>) -> Option<SocketHandle> {
        let orphan = match &mut self.link {
            Link::Tcp(t) => {
                let sock = cx.sockets.get_mut::<tcp::Socket>(t.handle);
                let graceful = t.fin_sent || (sock.may_send() && sock.recv_queue() == 0);
                if graceful {
                    if !t.fin_sent {
                        sock.close();
                    }
                    Some(t.handle)
                } else {
                    None
                }
            }
            _ => None,
        };
        match orphan {
            Some(handle) => {
                let mut seen = Outstanding::of(&self.shared);
                self.shared.set_state(QpState::Closed);
                if let Link::Tcp(mut t) = std::mem::replace(&mut self.link, Link::Down) {
                    for m in t.tx.drain(..) {
                        self.shared.complete_send(m.wr_id, WcStatus::Flushed, 0, 0);
                    }
                    t.rx.flush(&self.shared);
                }
                self.shared.flush_queues();
                written!(cx, &self.shared, &mut seen);
                self.shared.notify_cqs();
                Some(handle)
            }
            None => {
                self.fail(cx, QpState::Closed, WcStatus::Flushed);
                None
            }
        }
    }
}
