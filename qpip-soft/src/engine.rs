//! The soft NIC's processor: the physical layer (kernel sockets through io_uring or epoll) and
//! the QPs' links over it. The NIC thread shell ([`qpip_verbs::machines::shell`]) hands it
//! commands and doorbells; its `step` looks at the sockets without blocking, and the shell
//! sleeps on its epoll (or io_uring) descriptor until a doorbell, a command or a socket
//! makes it readable.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token};

use super::link::EngineQp;
use super::queues::{Accepted, Queues};
use super::stream::{Acceptor, Stream};
use super::uring::{Event, NoRing, Ring, RingIo, UringIo};
use super::{IoMode, WAKER_TOKEN};
use qpip_verbs::backend::{Command, ListenerId, MgmtResult};
use qpip_verbs::framer::Framer;
use qpip_verbs::machines::mgmt::{self, Management, no_qp, not_idle};
use qpip_verbs::machines::shell::{Processor, Progress};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::QpNum;

/// Listener tokens live above every QP number.
const LISTENER_BASE: usize = 1 << 40;

struct EngineListener {
    sock: Acceptor,
    backlog: usize,
    /// Connections accepted from the kernel and not yet mated to a QP.
    pending: VecDeque<(Stream, SocketAddr)>,
    /// QPs waiting for a connection.
    accepts: VecDeque<(QpNum, ReplySender<MgmtResult>)>,
    readable: bool,
}

/// What a turn of the physical layer does before it runs what is ready.
#[derive(Clone, Copy, Debug)]
enum Turn {
    /// Only look.
    Look,
    /// Wait until something is ready (the last reaping when the NIC stops: every other
    /// sleep is the shell's, on [`Processor::watch_fd`]).
    Wait,
}

/// The engine of one queue. `Q`: what its QPs hold for I/O through its io_uring —
/// [`NoRing`] on the epoll engine, which may run on any thread (a driven queue's), or
/// [`UringIo`] on the engine with a ring, which only its NIC thread runs (it is not `Send`).
pub(super) struct Engine<Q> {
    poll: Poll,
    memory: Arc<MemoryTable>,
    /// Taken while a turn hands its events out.
    events: Option<Events>,
    completions: Vec<Event>,
    /// Boxed: an io_uring operation may point into a QP's buffers, which must not move.
    qps: HashMap<QpNum, Box<EngineQp<Q>>>,
    /// Destroyed QPs whose io_uring operations have not completed yet.
    zombies: HashMap<QpNum, Box<EngineQp<Q>>>,
    /// Fences waiting for the zombies' I/O to finish.
    fences: Vec<ReplySender<()>>,
    listeners: HashMap<ListenerId, EngineListener>,
    /// Some exactly when `Q` is [`UringIo`].
    ring: Option<Ring>,
    /// This engine's queue, and the NIC's queues (where connections for QPs of other queues
    /// are handed). Weak: the queues own the engines ([`super::queues`]).
    queue: usize,
    queues: Weak<Queues>,
}

impl Engine<NoRing> {
    /// The epoll engine of queue `queue` over `poll`.
    pub(super) fn epoll(
        poll: Poll,
        memory: Arc<MemoryTable>,
        queue: usize,
        queues: Weak<Queues>,
    ) -> Self {
        Engine::new(poll, memory, None, queue, queues)
    }
}

impl Engine<UringIo> {
    /// The engine of queue `queue` over `poll` whose TCP data goes through `ring`.
    pub(super) fn uring(
        poll: Poll,
        memory: Arc<MemoryTable>,
        ring: Ring,
        queue: usize,
        queues: Weak<Queues>,
    ) -> Self {
        Engine::new(poll, memory, Some(ring), queue, queues)
    }
}

impl<Q: RingIo> Engine<Q> {
    fn new(
        poll: Poll,
        memory: Arc<MemoryTable>,
        ring: Option<Ring>,
        queue: usize,
        queues: Weak<Queues>,
    ) -> Self {
        Engine {
            poll,
            memory,
            events: Some(Events::with_capacity(1024)),
            completions: Vec::new(),
            qps: HashMap::new(),
            zombies: HashMap::new(),
            fences: Vec::new(),
            listeners: HashMap::new(),
            ring,
            queue,
            queues,
        }
    }

    /// One turn of the physical layer: look or wait for socket events (see [`Turn`]), and
    /// run them.
    fn turn(&mut self, turn: Turn) -> Progress {
        let Some(mut events) = self.events.take() else {
            return Progress::Idle;
        };
        let any = if self.ring.is_some() {
            // Only the NIC thread runs an io_uring engine (it is not `Send`).
            self.turn_uring(turn, &mut events)
        } else {
            self.turn_epoll(turn, &mut events)
        };
        self.events = Some(events);
        any
    }

    /// One turn of the epoll engine: wait (see [`Self::turn`]) or just look for socket
    /// readiness.
    fn turn_epoll(&mut self, turn: Turn, events: &mut Events) -> Progress {
        let timeout = match turn {
            Turn::Look => Some(Duration::ZERO),
            Turn::Wait => None,
        };
        if let Err(e) = self.poll.poll(events, timeout)
            && e.kind() != io::ErrorKind::Interrupted
        {
            tracing::error!("soft NIC engine: epoll failed: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut any = Progress::Idle;
        for event in events.iter() {
            any = Progress::Worked;
            self.dispatch(event);
        }
        any
    }

    /// One turn of the io_uring engine: submit every QP's queued I/O and wait (or just look)
    /// for completions; epoll readiness arrives as a completion too.
    fn turn_uring(&mut self, turn: Turn, events: &mut Events) -> Progress {
        let Some(ring) = self.ring.as_mut() else {
            return Progress::Idle;
        };
        let mut completions = std::mem::take(&mut self.completions);
        // A destroyed QP's operations queued before its teardown go too: their completions
        // end the teardown.
        for q in self.qps.values_mut().chain(self.zombies.values_mut()) {
            if let Some(io) = q.uring.as_mut() {
                for e in io.get_mut().outbox.drain(..) {
                    if let Err(err) = ring.push(&e) {
                        tracing::error!("io_uring submit failed: {err}");
                    }
                }
            }
        }
        if let Err(e) = ring.submit(matches!(turn, Turn::Wait)) {
            tracing::error!("soft NIC engine: io_uring_enter failed: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        ring.completions(&mut completions);
        let any = if completions.is_empty() {
            Progress::Idle
        } else {
            Progress::Worked
        };
        for ev in completions.drain(..) {
            let registry = self.poll.registry();
            match ev {
                Event::Epoll => {
                    self.turn_epoll(Turn::Look, events);
                }
                Event::Io { qp, op, result } => {
                    if let Some(q) = self.qps.get_mut(&qp) {
                        q.on_uring(registry, &self.memory, op, result);
                    } else if let Some(z) = self.zombies.get_mut(&qp) {
                        z.on_uring(registry, &self.memory, op, result);
                        if !z.io_in_flight() {
                            self.zombies.remove(&qp);
                            if self.zombies.is_empty() {
                                self.fences.drain(..).for_each(|f| f.send(()));
                            }
                        }
                    }
                }
            }
        }
        self.completions = completions;
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

    fn add_listener(&mut self, id: ListenerId, mut sock: Acceptor, backlog: u32) -> io::Result<()> {
        self.poll.registry().register(
            &mut sock,
            Token(LISTENER_BASE + id as usize),
            Interest::READABLE,
        )?;
        let l = EngineListener {
            sock,
            backlog: backlog as usize,
            pending: VecDeque::new(),
            accepts: VecDeque::new(),
            readable: true,
        };
        self.listeners.insert(id, l);
        Ok(())
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
            if l.pending.is_empty() {
                return;
            }
            let Some((qp_num, reply)) = l.accepts.pop_front() else {
                return;
            };
            // Its waiter gave up (a timed-out accept): its QP may be going away.
            if !reply.claim() {
                continue;
            }
            let Some((stream, peer)) = l.pending.pop_front() else {
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
                Some(_) => {
                    l.pending.push_front((stream, peer));
                    reply.send(Err(not_idle(qp_num, "reliable")));
                }
                // The QP lives on another queue: the connection goes there, behind the QP's
                // creation. (No queues: the NIC is going away.)
                None => match self
                    .queues
                    .upgrade()
                    .and_then(|all| Some((all.queue_of(qp_num)?, all)))
                {
                    Some((q, all)) if q != self.queue => {
                        let work = Accepted {
                            qp: qp_num,
                            stream,
                            peer,
                            reply,
                        };
                        all.send(q, Command::Private(Box::new(work)));
                    }
                    _ => {
                        l.pending.push_front((stream, peer));
                        reply.send(Err(no_qp(qp_num)));
                    }
                },
            }
        }
    }
}

/// io_uring if `mode` allows it and the kernel lets us (containers often forbid it); epoll
/// otherwise.
pub(super) fn open_ring(poll: &Poll, mode: IoMode) -> Option<Ring> {
    if mode == IoMode::Epoll {
        return None;
    }
    use std::os::fd::AsRawFd;
    match Ring::new(poll.as_raw_fd()) {
        Ok(ring) => Some(ring),
        Err(e) => {
            tracing::info!("io_uring unavailable ({e}); the soft NIC uses epoll");
            None
        }
    }
}

impl<Q: RingIo> Processor for Engine<Q> {
    fn command(&mut self, cmd: Command) {
        mgmt::dispatch(self, cmd);
    }

    fn doorbell(&mut self, num: QpNum) {
        if let Some(qp) = self.qps.get_mut(&num) {
            // Clear before draining: a WR posted after this point rings again.
            qp.shared.doorbell.store(false, Ordering::SeqCst);
            qp.service(self.poll.registry(), &self.memory);
        }
    }

    fn step(&mut self) -> Progress {
        self.turn(Turn::Look)
    }

    fn sending(&self) -> bool {
        self.qps.values().any(|q| q.sending())
    }

    fn watch_fd(&self) -> std::os::fd::RawFd {
        // An io_uring engine reaps its sockets (and its epoll instance) through the ring.
        use std::os::fd::AsRawFd;
        match &self.ring {
            Some(ring) => ring.fd(),
            None => self.poll.as_raw_fd(),
        }
    }

    fn stop(&mut self) {
        let registry = self.poll.registry();
        for qp in self.qps.values_mut() {
            qp.disconnect(registry);
        }
        // Through io_uring a QP's teardown waits for its operations, which shutting its
        // socket down ends at once: reap them, so that the WRs they held are flushed into
        // their CQs (which may outlive the NIC) before the engine and its ring go.
        while self
            .zombies
            .values()
            .chain(self.qps.values())
            .any(|q| q.io_in_flight())
        {
            self.turn(Turn::Wait);
        }
    }
}

impl<Q: RingIo> Management for Engine<Q> {
    fn create_qp(&mut self, qp: Arc<QpShared>, framer: Box<dyn Framer>) {
        let num = qp.num;
        let mut eq = Box::new(EngineQp::new(qp, framer));
        eq.service(self.poll.registry(), &self.memory);
        self.qps.insert(num, eq);
    }

    fn bind_udp(&mut self, qp: QpNum, addr: SocketAddr) -> MgmtResult {
        let registry = self.poll.registry();
        let q = self.qps.get_mut(&qp).ok_or_else(|| no_qp(qp))?;
        let local = q.bind_udp(registry, addr)?;
        q.service(registry, &self.memory);
        Ok(local)
    }

    fn connect(&mut self, qp: QpNum, addr: SocketAddr, reply: ReplySender<MgmtResult>) {
        match self.qps.get_mut(&qp) {
            Some(q) => q.connect(self.poll.registry(), addr, reply),
            None => reply.send(Err(no_qp(qp))),
        }
    }

    fn listen(&mut self, id: ListenerId, addr: SocketAddr, backlog: u32) -> MgmtResult {
        let sock = super::stream::listen_tcp(addr, backlog)?;
        let local = sock.local_addr()?;
        self.add_listener(id, Acceptor::Tcp(sock), backlog)?;
        Ok(local)
    }

    fn listen_unix(&mut self, id: ListenerId, path: PathBuf, backlog: u32) -> MgmtResult {
        let (sock, file) = super::stream::listen_unix(&path, backlog)?;
        let sock = Acceptor::Unix {
            listener: sock,
            _file: file,
        };
        self.add_listener(id, sock, backlog)?;
        Ok(qpip_verbs::backend::UNIX_ADDR)
    }

    fn connect_unix(&mut self, qp: QpNum, path: PathBuf, reply: ReplySender<MgmtResult>) {
        match self.qps.get_mut(&qp) {
            Some(q) => q.connect_unix(self.poll.registry(), &path, reply),
            None => reply.send(Err(no_qp(qp))),
        }
    }

    fn listen_fd(&mut self, id: ListenerId, fd: std::os::fd::OwnedFd, backlog: u32) -> MgmtResult {
        let std_sock = std::net::TcpListener::from(fd);
        std_sock.set_nonblocking(true)?;
        let local = std_sock.local_addr()?; // fails for anything but a TCP socket
        let sock = TcpListener::from_std(std_sock);
        self.add_listener(id, Acceptor::Tcp(sock), backlog)?;
        Ok(local)
    }

    fn start_tls(
        &mut self,
        qp: QpNum,
        config: Box<qpip_verbs::tls::TlsConfig>,
        reply: ReplySender<io::Result<()>>,
    ) {
        match self.qps.get_mut(&qp) {
            Some(q) => q.start_tls(self.poll.registry(), &self.memory, &config, reply),
            None => reply.send(Err(no_qp(qp))),
        }
    }

    fn has_listener(&self, listener: ListenerId) -> bool {
        self.listeners.contains_key(&listener)
    }

    fn accept(&mut self, listener: ListenerId, qp: QpNum, reply: ReplySender<MgmtResult>) {
        if let Some(l) = self.listeners.get_mut(&listener) {
            l.accepts.push_back((qp, reply));
            self.mate(listener);
        }
    }

    fn close_listener(&mut self, listener: ListenerId) {
        if let Some(mut l) = self.listeners.remove(&listener) {
            let _ = self.poll.registry().deregister(&mut l.sock);
            for (_, reply) in l.accepts.drain(..) {
                reply.send(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "listener closed",
                )));
            }
        }
    }

    fn close(&mut self, qp: QpNum) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.start_close(self.poll.registry(), &self.memory);
        }
    }

    fn disconnect(&mut self, qp: QpNum) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.disconnect(self.poll.registry());
        }
    }

    fn destroy(&mut self, qp: QpNum) {
        if let Some(mut q) = self.qps.remove(&qp) {
            q.disconnect(self.poll.registry());
            if q.io_in_flight() {
                self.zombies.insert(qp, q);
            }
        }
    }

    fn fence(&mut self, reply: ReplySender<()>) {
        if self.zombies.is_empty() {
            reply.send(());
        } else {
            self.fences.push(reply);
        }
    }

    /// A connection another queue's listener accepted for one of this queue's QPs.
    fn private(&mut self, work: Box<dyn std::any::Any + Send>) {
        let Ok(work) = work.downcast::<Accepted>() else {
            tracing::error!("soft NIC queue {}: unknown hand-over", self.queue);
            return;
        };
        let Accepted {
            qp,
            stream,
            peer,
            reply,
        } = *work;
        let registry = self.poll.registry();
        match self.qps.get_mut(&qp) {
            Some(q) if q.is_idle() => match q.attach(registry, stream, peer) {
                Ok(()) => {
                    reply.send(Ok(peer));
                    q.service(registry, &self.memory);
                }
                Err(e) => reply.send(Err(e)),
            },
            // Destroyed (or connected) meanwhile: the connection is closed.
            Some(_) => reply.send(Err(not_idle(qp, "reliable"))),
            None => reply.send(Err(no_qp(qp))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host threads run a driven queue's processor, so it must be `Send`: the epoll engine
    /// is, and an engine with an io_uring is not, so it cannot be bound to host drivers
    /// ([`qpip_verbs::machines::shell::NicThread::spawn_driven`] refuses it at compile time).
    #[test]
    fn only_the_epoll_engine_may_run_on_any_thread() {
        fn may_run_anywhere<T: Send>() {}
        may_run_anywhere::<Engine<NoRing>>();
        // Were `Engine<UringIo>` Send, both impls would apply and the path below would be
        // ambiguous: this test would not compile.
        trait AmbiguousIfSend<A> {
            fn some_item() {}
        }
        impl<T: ?Sized> AmbiguousIfSend<()> for T {}
        struct IsSend;
        impl<T: ?Sized + Send> AmbiguousIfSend<IsSend> for T {}
        let _ = <Engine<UringIo> as AmbiguousIfSend<_>>::some_item;
    }
}
