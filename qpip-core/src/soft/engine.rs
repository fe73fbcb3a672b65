//! The engine thread: the soft NIC's processor. Each turn it runs the management commands,
//! the doorbell FIFO, and the sockets that became ready; it spins briefly after work and
//! then sleeps in epoll until a doorbell, a command or a socket wakes it.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::link::EngineQp;
use super::uring::{Event, Ring};
use super::{IoMode, Shared, SoftConfig, WAKER_TOKEN};
use crate::backend::{Command, ListenerId, MgmtResult};
use crate::mr::MemoryTable;
use crate::reply::ReplySender;
use crate::wr::QpNum;

/// Listener tokens live above every QP number.
const LISTENER_BASE: usize = 1 << 40;

struct EngineListener {
    sock: TcpListener,
    backlog: usize,
    /// Connections accepted from the kernel and not yet mated to a QP.
    pending: VecDeque<(TcpStream, SocketAddr)>,
    /// QPs waiting for a connection.
    accepts: VecDeque<(QpNum, ReplySender<MgmtResult>)>,
    readable: bool,
}

pub(super) struct Engine {
    poll: Poll,
    shared: Arc<Shared>,
    memory: Arc<MemoryTable>,
    cfg: SoftConfig,
    /// Boxed: an io_uring operation may point into a QP's buffers, which must not move.
    qps: HashMap<QpNum, Box<EngineQp>>,
    /// Destroyed QPs whose io_uring operations have not completed yet.
    zombies: HashMap<QpNum, Box<EngineQp>>,
    listeners: HashMap<ListenerId, EngineListener>,
    ring: Option<Ring>,
}

impl Engine {
    pub(super) fn new(
        poll: Poll,
        shared: Arc<Shared>,
        memory: Arc<MemoryTable>,
        cfg: SoftConfig,
    ) -> Self {
        Engine {
            poll,
            shared,
            memory,
            cfg,
            qps: HashMap::new(),
            zombies: HashMap::new(),
            listeners: HashMap::new(),
            ring: None,
        }
    }

    /// io_uring if the configuration allows it and the kernel lets us (containers often
    /// forbid it); epoll otherwise.
    fn open_ring(&self) -> Option<Ring> {
        if self.cfg.io == IoMode::Epoll {
            return None;
        }
        use std::os::fd::AsRawFd;
        match Ring::new(self.poll.as_raw_fd()) {
            Ok(ring) => Some(ring),
            Err(e) => {
                tracing::info!("io_uring unavailable ({e}); the soft NIC uses epoll");
                None
            }
        }
    }

    pub(super) fn run(mut self) {
        // SAFETY: gettid has no preconditions.
        self.shared
            .engine_tid
            .store(unsafe { libc::gettid() }, Ordering::Release);
        self.ring = self.open_ring();
        self.shared
            .uring
            .store(self.ring.is_some(), Ordering::Release);
        let mut events = Events::with_capacity(1024);
        let mut completions = Vec::new();
        let mut last_work = Instant::now();
        loop {
            let mut worked = self.run_commands();
            worked |= self.run_doorbells();
            if self.shared.stop.load(Ordering::Acquire) {
                break;
            }
            if worked {
                last_work = Instant::now();
            }
            let spinning = last_work.elapsed() < self.cfg.spin;
            if !spinning {
                self.shared.sleeping.store(true, Ordering::Relaxed);
                // Pairs with the fence in ring_doorbell: either the host sees `sleeping` and
                // wakes us, or we see its doorbell here.
                fence(Ordering::SeqCst);
                if !self.shared.doorbells.is_empty() || !self.shared.commands.is_empty() {
                    self.shared.sleeping.store(false, Ordering::Relaxed);
                    continue;
                }
            }
            let any = if self.ring.is_some() {
                self.turn_uring(!spinning, &mut events, &mut completions)
            } else {
                self.turn_epoll(!spinning, &mut events)
            };
            self.shared.sleeping.store(false, Ordering::Relaxed);
            if any {
                last_work = Instant::now();
            } else if spinning && !worked {
                // Spinning: let the application threads have the core (two-core machines).
                std::thread::yield_now();
            }
        }
        let registry = self.poll.registry();
        for qp in self.qps.values_mut() {
            qp.disconnect(registry);
        }
    }

    /// One turn of the epoll engine: wait (or just look) for socket readiness.
    fn turn_epoll(&mut self, sleep: bool, events: &mut Events) -> bool {
        let timeout = if sleep { None } else { Some(Duration::ZERO) };
        if let Err(e) = self.poll.poll(events, timeout)
            && e.kind() != io::ErrorKind::Interrupted
        {
            tracing::error!("soft NIC engine: epoll failed: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut any = false;
        for event in events.iter() {
            any = true;
            self.dispatch(event);
        }
        any
    }

    /// One turn of the io_uring engine: submit every QP's queued I/O and wait (or just look)
    /// for completions; epoll readiness arrives as a completion too.
    fn turn_uring(
        &mut self,
        sleep: bool,
        events: &mut Events,
        completions: &mut Vec<Event>,
    ) -> bool {
        let Some(ring) = self.ring.as_mut() else {
            return false;
        };
        for q in self.qps.values_mut() {
            if let Some(io) = q.uring.as_mut() {
                for e in io.outbox.drain(..) {
                    if let Err(err) = ring.push(&e) {
                        tracing::error!("io_uring submit failed: {err}");
                    }
                }
            }
        }
        if let Err(e) = ring.submit(sleep) {
            tracing::error!("soft NIC engine: io_uring_enter failed: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        ring.completions(completions);
        let any = !completions.is_empty();
        for ev in completions.drain(..) {
            let registry = self.poll.registry();
            match ev {
                Event::Epoll => {
                    self.turn_epoll(false, events);
                }
                Event::Io { qp, op, result } => {
                    if let Some(q) = self.qps.get_mut(&qp) {
                        q.on_uring(registry, &self.memory, op, result);
                    } else if let Some(z) = self.zombies.get_mut(&qp) {
                        z.on_uring(registry, &self.memory, op, result);
                        if !z.io_in_flight() {
                            self.zombies.remove(&qp);
                        }
                    }
                }
            }
        }
        any
    }

    fn dispatch(&mut self, event: &mio::event::Event) {
        let Token(t) = event.token();
        if event.token() == WAKER_TOKEN {
            return;
        }
        if t >= LISTENER_BASE {
            let id = (t - LISTENER_BASE) as ListenerId;
            if let Some(l) = self.listeners.get_mut(&id) {
                l.readable = true;
            }
            self.mate(id);
        } else if let Some(qp) = self.qps.get_mut(&(t as QpNum)) {
            qp.on_event(self.poll.registry(), event, &self.memory);
        }
    }

    fn run_doorbells(&mut self) -> bool {
        let mut worked = false;
        while let Some(num) = self.shared.doorbells.pop() {
            worked = true;
            if !self.qps.contains_key(&num) {
                // The QP's creation may still be in the command queue.
                self.run_commands();
            }
            if let Some(qp) = self.qps.get_mut(&num) {
                // Clear before draining: a WR posted after this point rings again.
                qp.shared.doorbell.store(false, Ordering::SeqCst);
                qp.service(self.poll.registry(), &self.memory);
            }
        }
        worked
    }

    fn run_commands(&mut self) -> bool {
        let mut worked = false;
        while let Some(cmd) = self.shared.commands.pop() {
            worked = true;
            self.command(cmd);
        }
        worked
    }

    fn command(&mut self, cmd: Command) {
        let registry = self.poll.registry();
        match cmd {
            Command::CreateQp { qp, framer } => {
                let num = qp.num;
                let mut eq = Box::new(EngineQp::new(qp, framer, self.ring.is_some()));
                eq.service(registry, &self.memory);
                self.qps.insert(num, eq);
            }
            Command::BindUdp { qp, addr, reply } => match self.qps.get_mut(&qp) {
                Some(q) => {
                    let r = q.bind_udp(registry, addr);
                    reply.send(r);
                    q.service(registry, &self.memory);
                }
                None => reply.send(Err(no_qp(qp))),
            },
            Command::Connect { qp, addr, reply } => match self.qps.get_mut(&qp) {
                Some(q) => q.connect(registry, addr, reply),
                None => reply.send(Err(no_qp(qp))),
            },
            Command::Listen {
                id,
                addr,
                backlog,
                reply,
            } => {
                let result = TcpListener::bind(addr).and_then(|mut sock| {
                    registry.register(
                        &mut sock,
                        Token(LISTENER_BASE + id as usize),
                        Interest::READABLE,
                    )?;
                    let local = sock.local_addr()?;
                    let l = EngineListener {
                        sock,
                        backlog: backlog as usize,
                        pending: VecDeque::new(),
                        accepts: VecDeque::new(),
                        readable: true,
                    };
                    self.listeners.insert(id, l);
                    Ok(local)
                });
                reply.send(result);
            }
            Command::Accept {
                listener,
                qp,
                reply,
            } => match self.listeners.get_mut(&listener) {
                Some(l) => {
                    l.accepts.push_back((qp, reply));
                    self.mate(listener);
                }
                None => reply.send(Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "no such listener",
                ))),
            },
            Command::CloseListener { listener } => {
                if let Some(mut l) = self.listeners.remove(&listener) {
                    let _ = registry.deregister(&mut l.sock);
                    for (_, reply) in l.accepts.drain(..) {
                        reply.send(Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            "listener closed",
                        )));
                    }
                }
            }
            Command::Close { qp } => {
                if let Some(q) = self.qps.get_mut(&qp) {
                    q.start_close(registry, &self.memory);
                }
            }
            Command::Disconnect { qp } => {
                if let Some(q) = self.qps.get_mut(&qp) {
                    q.disconnect(registry);
                }
            }
            Command::Destroy { qp } => {
                if let Some(mut q) = self.qps.remove(&qp) {
                    q.disconnect(registry);
                    if q.io_in_flight() {
                        self.zombies.insert(qp, q);
                    }
                }
            }
        }
    }

    /// Takes connections from the kernel and mates them to waiting QPs.
    fn mate(&mut self, id: ListenerId) {
        let registry = self.poll.registry();
        let Some(l) = self.listeners.get_mut(&id) else {
            return;
        };
        loop {
            while l.readable && l.pending.len() < l.backlog {
                match l.sock.accept() {
                    Ok(conn) => l.pending.push_back(conn),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => l.readable = false,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // EMFILE and friends: leave the connection in the kernel's backlog.
                        tracing::warn!("accept failed: {e}");
                        break;
                    }
                }
            }
            while l.accepts.front().is_some_and(|(_, r)| r.is_abandoned()) {
                l.accepts.pop_front();
            }
            if l.pending.is_empty() || l.accepts.is_empty() {
                return;
            }
            let (Some((qp_num, reply)), Some((stream, peer))) =
                (l.accepts.pop_front(), l.pending.pop_front())
            else {
                return;
            };
            match self.qps.get_mut(&qp_num) {
                Some(qp) if qp.is_idle() => match qp.attach(registry, stream, peer) {
                    Ok(()) => {
                        reply.send(Ok(peer));
                        qp.service(registry, &self.memory);
                    }
                    Err(e) => reply.send(Err(e)),
                },
                _ => {
                    l.pending.push_front((stream, peer));
                    let msg = format!("QP {qp_num} is not an idle reliable QP");
                    reply.send(Err(io::Error::new(io::ErrorKind::InvalidInput, msg)));
                }
            }
        }
    }
}

fn no_qp(qp: QpNum) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("no QP {qp}"))
}
