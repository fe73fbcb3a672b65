//! The management state machine: QP creation, UDP binds, connects, listeners and accepts,
//! close and destroy, and the timers that go with them.

use super::*;
use qpip_verbs::framer::Framer;
use qpip_verbs::machines::mgmt::{Management, no_qp, not_idle};
use qpip_verbs::shared::QpShared;

impl Management for Firmware {
    fn create_qp(&mut self, qp: Arc<QpShared>, framer: Box<dyn Framer>) {
        let mut q = FwQp::new(qp, framer);
        let d = &self.params.device;
        let need = d.qp_state_bytes + d.wr_cache_entries * d.wr_entry_bytes;
        match self.sram.alloc(need) {
            Ok(()) => q.sram = need,
            Err(e) => {
                tracing::warn!(qp = q.shared.num, "QP cannot be created: {e}");
                q.shared.set_state(QpState::Error);
                q.link = Link::Down;
                q.shared.flush_queues();
                q.shared.notify_cqs();
            }
        }
        self.qps.insert(q.shared.num, q);
    }

    fn bind_udp(&mut self, qp: QpNum, addr: SocketAddr) -> MgmtResult {
        let q = self.qps.get(&qp).ok_or_else(|| no_qp(qp))?;
        if q.shared.kind != QpKind::Unreliable || !q.is_idle() {
            return Err(not_idle(qp, "unreliable"));
        }
        let port = self.local_port(addr)?;
        let d = &self.params.device;
        let need = 2 * d.udp_buffer as u64;
        self.sram.alloc(need)?;
        // A datagram needs a metadata slot; small ones should not run out of slots first.
        let slots = (d.udp_buffer / 256).max(4);
        let buf = || {
            udp::PacketBuffer::new(
                vec![udp::PacketMetadata::EMPTY; slots],
                vec![0u8; d.udp_buffer],
            )
        };
        let mut s = udp::Socket::new(buf(), buf());
        if let Err(e) = s.bind(IpListenEndpoint {
            addr: Some(IpAddress::Ipv6(self.addr)),
            port,
        }) {
            self.sram.release(need);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, e.to_string()));
        }
        let h = self.sockets.add(s);
        let local = SocketAddrV6::new(self.addr, port, 0, 0);
        // Invariant: checked above that the QP exists.
        if let Some(q) = self.qps.get_mut(&qp) {
            q.sram += need;
            q.link = Link::Udp(Box::new(UdpLink::new(h)));
            q.shared.set_addrs(Some(SocketAddr::V6(local)), None);
            q.shared.set_state(QpState::Ready);
        }
        Ok(SocketAddr::V6(local))
    }

    fn connect(&mut self, qp: QpNum, addr: SocketAddr, reply: ReplySender<MgmtResult>) {
        let r = (|| {
            let q = self.qps.get(&qp).ok_or_else(|| no_qp(qp))?;
            if q.shared.kind != QpKind::Reliable || !q.is_idle() {
                return Err(not_idle(qp, "reliable"));
            }
            let SocketAddr::V6(remote) = addr else {
                return Err(unsupported_v4());
            };
            if remote.ip().is_unspecified() || remote.port() == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("cannot connect to {addr}"),
                ));
            }
            let port = self.ephemeral_port()?;
            let h = self.new_tcp_socket()?;
            let sock = self.sockets.get_mut::<tcp::Socket>(h);
            let remote_ep = IpEndpoint::new(IpAddress::Ipv6(*remote.ip()), remote.port());
            let local_ep = IpEndpoint::new(IpAddress::Ipv6(self.addr), port);
            if let Err(e) = sock.connect(self.iface.context(), remote_ep, local_ep) {
                self.free_tcp_socket(h);
                return Err(io::Error::new(io::ErrorKind::InvalidInput, e.to_string()));
            }
            Ok(h)
        })();
        match r {
            Ok(handle) => {
                let deadline = self.meter.now() + CONNECT_TIMEOUT_NS;
                if let Some(q) = self.qps.get_mut(&qp) {
                    q.shared.set_state(QpState::Connecting);
                    q.link = Link::Connecting {
                        handle,
                        reply,
                        deadline,
                    };
                }
            }
            Err(e) => reply.send(Err(e)),
        }
    }

    fn listen(&mut self, id: ListenerId, addr: SocketAddr, backlog: u32) -> MgmtResult {
        let port = self.local_port(addr)?;
        let mut l = Listener {
            port,
            backlog: (backlog as usize).max(1),
            listening: Vec::new(),
            pending: VecDeque::new(),
            accepts: VecDeque::new(),
        };
        // At least one listening socket must fit, or the listen fails.
        let h = self.new_tcp_socket()?;
        if let Err(e) = self.sockets.get_mut::<tcp::Socket>(h).listen(port) {
            self.free_tcp_socket(h);
            return Err(io::Error::new(io::ErrorKind::InvalidInput, e.to_string()));
        }
        l.listening.push(h);
        self.listeners.insert(id, l);
        self.replenish(id);
        Ok(self.local(port))
    }

    fn close_listener(&mut self, id: ListenerId) {
        let Some(l) = self.listeners.remove(&id) else {
            return;
        };
        for (_, reply) in l.accepts {
            reply.send(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "listener closed",
            )));
        }
        for h in l.listening {
            self.free_tcp_socket(h);
        }
        for h in l.pending {
            // Connections nobody accepted are reset.
            self.sockets.get_mut::<tcp::Socket>(h).abort();
            self.dying.push(h);
        }
    }

    fn close(&mut self, qp: QpNum) {
        self.with_qp(qp, |q, cx| match &mut q.link {
            Link::Tcp(t) => {
                if !t.closing {
                    t.closing = true;
                    q.shared.set_state(QpState::Closing);
                }
            }
            Link::Down => {}
            _ => q.fail(cx, QpState::Closed, WcStatus::Flushed),
        });
    }

    fn destroy(&mut self, qp: QpNum) {
        let mut orphan = None;
        self.with_qp(qp, |q, cx| orphan = q.destroy(cx));
        if let Some(q) = self.qps.remove(&qp) {
            self.sram.release(q.sram);
        }
        if let Some(handle) = orphan {
            self.orphans.push(Orphan {
                handle,
                deadline: self.meter.now() + ORPHAN_TIMEOUT_NS,
            });
        }
    }

    fn has_listener(&self, listener: ListenerId) -> bool {
        self.listeners.contains_key(&listener)
    }

    fn accept(&mut self, listener: ListenerId, qp: QpNum, reply: ReplySender<MgmtResult>) {
        if let Some(l) = self.listeners.get_mut(&listener) {
            l.accepts.push_back((qp, reply));
        }
    }

    fn disconnect(&mut self, qp: QpNum) {
        self.with_qp(qp, |q, cx| {
            let gone = matches!(q.shared.state(), QpState::Closed | QpState::Error);
            if !(matches!(q.link, Link::Down) && gone) {
                q.fail(cx, QpState::Closed, WcStatus::Flushed);
            }
        });
    }
}

impl Firmware {
    pub(super) fn port_in_use(&self, port: u16) -> bool {
        self.listeners.values().any(|l| l.port == port)
            || self.sockets.iter().any(|(_, s)| match s {
                smoltcp::socket::Socket::Tcp(t) => {
                    t.listen_endpoint().port == port
                        || t.local_endpoint().is_some_and(|e| e.port == port)
                }
                smoltcp::socket::Socket::Udp(u) => u.endpoint().port == port,
                #[allow(unreachable_patterns)]
                _ => false,
            })
    }

    pub(super) fn ephemeral_port(&mut self) -> io::Result<u16> {
        for _ in 0..16384 {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { EPHEMERAL } else { p + 1 };
            if !self.port_in_use(p) {
                return Ok(p);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "no ephemeral port left",
        ))
    }

    /// Checks a local address: IPv6, this NIC's (or unspecified); returns its port.
    pub(super) fn local_port(&mut self, addr: SocketAddr) -> io::Result<u16> {
        let SocketAddr::V6(a) = addr else {
            return Err(unsupported_v4());
        };
        if !a.ip().is_unspecified() && *a.ip() != self.addr {
            return Err(io::Error::new(
                io::ErrorKind::AddrNotAvailable,
                format!("{} is not this NIC's address ({})", a.ip(), self.addr),
            ));
        }
        match a.port() {
            0 => self.ephemeral_port(),
            p if self.port_in_use(p) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("port {p} is in use"),
            )),
            p => Ok(p),
        }
    }

    pub(super) fn new_tcp_socket(&mut self) -> io::Result<SocketHandle> {
        self.sram.alloc(self.conn_sram())?;
        let d = &self.params.device;
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0u8; d.tcp_recv_buffer]),
            tcp::SocketBuffer::new(vec![0u8; d.tcp_send_buffer]),
        );
        // Sender-side silly window avoidance (RFC 1122 4.2.3.4): with data in flight only
        // full segments go; ACKs are not delayed, so a short tail waits one round trip at most.
        // A program that set TCP_NODELAY (ttcp -D) has it off.
        s.set_nagle_enabled(!d.tcp_nodelay);
        s.set_ack_delay(None);
        s.set_congestion_control(tcp::CongestionControl::Reno);
        s.set_tsval_generator(Some(port::tsval));
        s.set_keep_alive(Some(link::KEEP_ALIVE));
        Ok(self.sockets.add(s))
    }

    pub(super) fn free_tcp_socket(&mut self, h: SocketHandle) {
        self.sockets.remove(h);
        self.sram.release(self.conn_sram());
    }

    /// Keeps `LISTEN_SPARES` sockets listening (within the backlog and the SRAM).
    pub(super) fn replenish(&mut self, id: ListenerId) {
        loop {
            let Some(l) = self.listeners.get(&id) else {
                return;
            };
            let port = l.port;
            if l.listening.len() >= LISTEN_SPARES.min(l.backlog)
                || l.listening.len() + l.pending.len() >= l.backlog
            {
                return;
            }
            let Ok(h) = self.new_tcp_socket() else {
                return; // SRAM full: fewer sockets wait for SYNs
            };
            if self.sockets.get_mut::<tcp::Socket>(h).listen(port).is_err() {
                self.free_tcp_socket(h);
                return;
            }
            if let Some(l) = self.listeners.get_mut(&id) {
                l.listening.push(h);
            }
        }
    }

    /// Connect deadlines and orphans.
    pub(super) fn timers(&mut self) {
        let now = self.meter.now();
        let expired: Vec<QpNum> = self
            .qps
            .iter()
            .filter(|(_, q)| matches!(q.link, Link::Connecting { deadline, .. } if deadline <= now))
            .map(|(n, _)| *n)
            .collect();
        for n in expired {
            if let Some(q) = self.qps.get_mut(&n)
                && let Link::Connecting { handle, reply, .. } =
                    std::mem::replace(&mut q.link, Link::Idle)
            {
                q.shared.set_state(QpState::Init);
                reply.send(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection timed out",
                )));
                self.sockets.get_mut::<tcp::Socket>(handle).abort();
                self.dying.push(handle);
            }
        }
    }

    pub(super) fn service_connects(&mut self) -> bool {
        let mut progress = false;
        let mut refused = Vec::new();
        for q in self.qps.values_mut() {
            let Link::Connecting { handle, .. } = &q.link else {
                continue;
            };
            let handle = *handle;
            let sock = self.sockets.get_mut::<tcp::Socket>(handle);
            match sock.state() {
                tcp::State::SynSent | tcp::State::SynReceived => {}
                tcp::State::Closed => {
                    progress = true;
                    if let Link::Connecting { reply, .. } =
                        std::mem::replace(&mut q.link, Link::Idle)
                    {
                        q.shared.set_state(QpState::Init);
                        reply.send(Err(io::Error::new(
                            io::ErrorKind::ConnectionRefused,
                            "connection refused",
                        )));
                    }
                    refused.push(handle);
                }
                _ => {
                    progress = true;
                    let local = sock.local_endpoint().map(v6);
                    let peer = sock.remote_endpoint().map(v6);
                    if let Link::Connecting { reply, .. } =
                        std::mem::replace(&mut q.link, Link::Tcp(Box::new(TcpLink::new(handle))))
                    {
                        q.shared.set_addrs(local, peer);
                        q.shared.set_state(QpState::Ready);
                        reply.send(local.ok_or_else(|| io::Error::other("no local address")));
                    }
                }
            }
        }
        for h in refused {
            self.free_tcp_socket(h);
        }
        progress
    }

    pub(super) fn service_listeners(&mut self) -> bool {
        let mut progress = false;
        let ids: Vec<ListenerId> = self.listeners.keys().copied().collect();
        for id in ids {
            let Some(l) = self.listeners.get_mut(&id) else {
                continue;
            };
            // Sockets that took a SYN become pending; pending ones that fell back to LISTEN
            // (reset during the handshake) listen again; dead ones are freed.
            let mut i = 0;
            while i < l.listening.len() {
                let h = l.listening[i];
                if self.sockets.get::<tcp::Socket>(h).state() != tcp::State::Listen {
                    l.pending.push_back(l.listening.swap_remove(i));
                    progress = true;
                } else {
                    i += 1;
                }
            }
            let mut dead = Vec::new();
            l.pending
                .retain(|&h| match self.sockets.get::<tcp::Socket>(h).state() {
                    tcp::State::Listen => {
                        l.listening.push(h);
                        false
                    }
                    tcp::State::Closed => {
                        dead.push(h);
                        false
                    }
                    _ => true,
                });
            for h in dead {
                self.free_tcp_socket(h);
                progress = true;
            }
            progress |= self.mate(id);
            self.replenish(id);
        }
        progress
    }

    /// Mates established connections to QPs waiting in accept.
    pub(super) fn mate(&mut self, id: ListenerId) -> bool {
        let mut progress = false;
        let Some(l) = self.listeners.get_mut(&id) else {
            return false;
        };
        loop {
            if l.accepts.is_empty() {
                return progress;
            }
            let ready = l.pending.iter().position(|&h| {
                !matches!(
                    self.sockets.get::<tcp::Socket>(h).state(),
                    tcp::State::SynReceived
                )
            });
            let Some(pos) = ready else {
                return progress;
            };
            let Some((qp, reply)) = l.accepts.pop_front() else {
                return progress;
            };
            // Its waiter gave up (a timed-out accept): its QP may be going away.
            if !reply.claim() {
                continue;
            }
            progress = true;
            match self.qps.get_mut(&qp) {
                Some(q) if q.shared.kind == QpKind::Reliable && q.is_idle() => {
                    let Some(h) = l.pending.remove(pos) else {
                        return progress;
                    };
                    let sock = self.sockets.get::<tcp::Socket>(h);
                    let local = sock.local_endpoint().map(v6);
                    let peer = sock.remote_endpoint().map(v6);
                    q.link = Link::Tcp(Box::new(TcpLink::new(h)));
                    q.shared.set_addrs(local, peer);
                    q.shared.set_state(QpState::Ready);
                    reply.send(peer.ok_or_else(|| io::Error::other("no peer address")));
                }
                Some(_) => reply.send(Err(not_idle(qp, "reliable"))),
                None => reply.send(Err(no_qp(qp))),
            }
        }
    }

    pub(super) fn service_orphans(&mut self) -> bool {
        let now = self.meter.now();
        let mut progress = false;
        let mut i = 0;
        while i < self.orphans.len() {
            let o = &self.orphans[i];
            let sock = self.sockets.get_mut::<tcp::Socket>(o.handle);
            // Nobody reads any more: discard, so the peer is not held by our window.
            while let Ok(n) = sock.recv(|b| (b.len(), b.len())) {
                if n == 0 {
                    break;
                }
            }
            let state = sock.state();
            if matches!(state, tcp::State::Closed | tcp::State::TimeWait) {
                let h = self.orphans.swap_remove(i).handle;
                self.free_tcp_socket(h);
                progress = true;
            } else if o.deadline <= now {
                sock.abort();
                let h = self.orphans.swap_remove(i).handle;
                self.dying.push(h);
                progress = true;
            } else {
                i += 1;
            }
        }
        progress
    }
}
