//! The soft NIC's processor: the physical layer (kernel sockets through io_uring or epoll) and
//! the QPs' links over it. The NIC thread shell ([`qpip_verbs::machines::shell`]) hands it
//! commands and doorbells; its `step` looks at the sockets without blocking, and the shell
//! sleeps on its epoll (or io_uring) descriptor until a doorbell, a command or a socket
//! makes it readable.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use mio::net::TcpListener;
use mio::unix::SourceFd;
use mio::{Interest, Poll, Registry, Token};

use super::accept::{Inbox, Listening};
use super::link::{EngineQp, Ready};
use super::queues::Queues;
use super::stream::Acceptor;
use super::uring::{Event, NoRing, Ring, RingIo, UringIo};
use super::{IoMode, WAKER_TOKEN};
use qpip_verbs::backend::{Command, ListenerId, MgmtResult};
use qpip_verbs::drive::EpollEvents;
use qpip_verbs::framer::Framer;
use qpip_verbs::keymap::KeyMap;
use qpip_verbs::machines::mgmt::{self, Management, no_qp};
use qpip_verbs::machines::shell::{Processor, Progress};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::QpNum;

/// Listener tokens live above every QP number.
const LISTENER_BASE: usize = 1 << 40;

struct EngineListener {
    listening: Arc<Listening>,
    /// In the epoll set: only while accepts wait, so that connections taken by accepts on
    /// their own threads wake no engine.
    armed: bool,
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
    /// The epoll instance's events, filled by the shell's sleep or a turn's look; taken
    /// while a turn hands them out.
    events: Option<EpollEvents>,
    completions: Vec<Event>,
    /// Boxed: an io_uring operation may point into a QP's buffers, which must not move.
    qps: KeyMap<QpNum, Box<EngineQp<Q>>>,
    /// Destroyed QPs whose io_uring operations have not completed yet.
    zombies: KeyMap<QpNum, Box<EngineQp<Q>>>,
    /// Fences waiting for the zombies' I/O to finish.
    fences: Vec<ReplySender<()>>,
    listeners: KeyMap<ListenerId, EngineListener>,
    /// Some exactly when `Q` is [`UringIo`].
    ring: Option<Ring>,
    /// The NIC's queues (where connections for QPs of other queues are handed). Weak: the
    /// queues own the engines ([`super::queues`]).
    queues: Weak<Queues>,
    /// Connections handed to this queue's QPs.
    inbox: Arc<Inbox>,
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
        let inbox = queues
            .upgrade()
            .map_or_else(Default::default, |q| q.inbox(queue).clone());
        Engine {
            poll,
            memory,
            events: Some(EpollEvents::with_capacity(1024)),
            completions: Vec::new(),
            qps: KeyMap::default(),
            zombies: KeyMap::default(),
            fences: Vec::new(),
            listeners: KeyMap::default(),
            ring,
            queues,
            inbox,
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
    fn turn_epoll(&mut self, turn: Turn, events: &mut EpollEvents) -> Progress {
        use std::os::fd::AsRawFd;
        // Events a sleep left are taken without a look of our own.
        if let Err(e) = events.look(self.poll.as_raw_fd(), matches!(turn, Turn::Wait)) {
            tracing::error!("soft NIC engine: epoll failed: {e}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut any = Progress::Idle;
        for (token, bits) in events.drain() {
            if self.dispatch(Token(token as usize), Ready::from_epoll(bits)) == Progress::Worked {
                any = Progress::Worked;
            }
        }
        any
    }

    /// One turn of the io_uring engine: submit every QP's queued I/O and wait (or just look)
    /// for completions; epoll readiness arrives as a completion too.
    fn turn_uring(&mut self, turn: Turn, events: &mut EpollEvents) -> Progress {
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

    /// Hands an event to whom it is for; whether it was work (see [`EngineQp::on_event`]).
    fn dispatch(&mut self, token: Token, ready: Ready) -> Progress {
        if token == WAKER_TOKEN {
            return Progress::Worked;
        }
        let Token(t) = token;
        if t >= LISTENER_BASE {
            self.mate((t - LISTENER_BASE) as ListenerId);
            Progress::Worked
        } else if let Some(qp) = self.qps.get_mut(&(t as QpNum)) {
            qp.on_event(self.poll.registry(), ready, &self.memory)
        } else {
            Progress::Idle
        }
    }

    /// The one socket that may bring work, when there is only one: a single QP with a plain
    /// link that waits for bytes and not for room to write, no listener watched, no sleep's
    /// events to take. A thread that polls may read it instead of asking epoll.
    fn sole_reader(&self) -> Option<QpNum> {
        let sleep_left_events = self.events.as_ref().is_none_or(EpollEvents::pending);
        if self.ring.is_some()
            || sleep_left_events
            || self.qps.len() != 1
            || self.listeners.values().any(|l| l.armed)
        {
            return None;
        }
        let (&num, qp) = self.qps.iter().next()?;
        qp.may_read_unasked().then_some(num)
    }

    fn add_listener(&mut self, id: ListenerId, sock: Acceptor) -> io::Result<()> {
        let listening = Arc::new(Listening::new(sock));
        let mut l = EngineListener {
            listening,
            armed: false,
        };
        self.arm(id, &mut l)?;
        if let Some(all) = self.queues.upgrade() {
            all.add_listener(id, l.listening.clone());
        }
        self.listeners.insert(id, l);
        Ok(())
    }

    /// Puts a listener in the epoll set (reported at once if connections wait).
    fn arm(&self, id: ListenerId, l: &mut EngineListener) -> io::Result<()> {
        if !l.armed {
            use std::os::fd::AsRawFd;
            let fd = l.listening.sock.as_raw_fd();
            self.poll.registry().register(
                &mut SourceFd(&fd),
                Token(LISTENER_BASE + id as usize),
                Interest::READABLE,
            )?;
            l.armed = true;
        }
        Ok(())
    }

    fn disarm(&self, l: &mut EngineListener) {
        if l.armed {
            use std::os::fd::AsRawFd;
            let fd = l.listening.sock.as_raw_fd();
            let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            l.armed = false;
        }
    }

    /// Mates the accepts waiting on listener `id` with the connections there are; stops
    /// watching it when none waits.
    fn mate(&mut self, id: ListenerId) {
        let Some(all) = self.queues.upgrade() else {
            return; // the NIC is going away
        };
        let Some(mut l) = self.listeners.remove(&id) else {
            return;
        };
        if !l.listening.mate(&*all) {
            self.disarm(&mut l);
        }
        self.listeners.insert(id, l);
    }

    /// Takes in the connection handed to `qp`, if one waits (none if the QP is gone: it
    /// closes).
    fn take_handed(&mut self, qp: QpNum) {
        match self.qps.get_mut(&qp) {
            Some(q) => attach_handed(&self.inbox, q, self.poll.registry(), &self.memory),
            None => drop(self.inbox.take(qp)),
        }
    }
}

/// Attaches the connection handed to `qp` through `inbox`, if one waits.
fn attach_handed<Q: RingIo>(
    inbox: &Inbox,
    qp: &mut EngineQp<Q>,
    registry: &Registry,
    memory: &MemoryTable,
) {
    if let Some(stream) = inbox.take(qp.shared.num) {
        qp.attach(registry, stream, memory);
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
        // A command the host sent about a QP after its accept returned finds the connection
        // attached, even if the QP's doorbell has not been seen yet.
        if let Command::StartTls { qp, .. }
        | Command::Close { qp }
        | Command::Disconnect { qp }
        | Command::Destroy { qp } = &cmd
        {
            self.take_handed(*qp);
        }
        mgmt::dispatch(self, cmd);
    }

    fn doorbell(&mut self, num: QpNum) {
        let Some(qp) = self.qps.get_mut(&num) else {
            // Destroyed: a connection handed to it meanwhile closes. (Not yet created cannot
            // be: the shell runs the commands queued before a doorbell first.)
            drop(self.inbox.take(num));
            return;
        };
        // Clear before draining: a WR (or a connection) handed after this point rings again;
        // a swap, so that what was handed before the ring is seen.
        qp.shared.doorbell.swap(false, Ordering::SeqCst);
        let registry = self.poll.registry();
        attach_handed(&self.inbox, qp, registry, &self.memory);
        qp.service(registry, &self.memory);
    }

    fn step(&mut self) -> Progress {
        self.turn(Turn::Look)
    }

    fn poll(&mut self) -> Progress {
        // The busy-polling socket reader's one call instead of `epoll_wait` and then the
        // read. The edge epoll keeps for what it read is taken by a later look (a sleep's,
        // or the NIC thread's, which steps before it watches) as no news: not work.
        let Some(num) = self.sole_reader() else {
            return self.turn(Turn::Look);
        };
        match self.qps.get_mut(&num) {
            Some(qp) => qp.read_unasked(self.poll.registry(), &self.memory),
            None => Progress::Idle,
        }
    }

    fn sending(&self) -> bool {
        self.qps.values().any(|q| q.sending())
    }

    fn wake_events(&mut self) -> Option<&mut EpollEvents> {
        // The io_uring engine sleeps on its ring, whose completions are not epoll's.
        match self.ring {
            Some(_) => None,
            None => self.events.as_mut(),
        }
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
        self.add_listener(id, Acceptor::Tcp(sock))?;
        Ok(local)
    }

    fn listen_unix(&mut self, id: ListenerId, path: PathBuf, backlog: u32) -> MgmtResult {
        let (sock, file) = super::stream::listen_unix(&path, backlog)?;
        let sock = Acceptor::Unix {
            listener: sock,
            _file: file,
        };
        self.add_listener(id, sock)?;
        Ok(qpip_verbs::backend::UNIX_ADDR)
    }

    fn connect_unix(&mut self, qp: QpNum, path: PathBuf, reply: ReplySender<MgmtResult>) {
        match self.qps.get_mut(&qp) {
            Some(q) => q.connect_unix(self.poll.registry(), &path, reply),
            None => reply.send(Err(no_qp(qp))),
        }
    }

    fn listen_fd(&mut self, id: ListenerId, fd: std::os::fd::OwnedFd, _backlog: u32) -> MgmtResult {
        // Its owner set its kernel queue when it listened.
        let std_sock = std::net::TcpListener::from(fd);
        std_sock.set_nonblocking(true)?;
        let local = std_sock.local_addr()?; // fails for anything but a TCP socket
        let sock = TcpListener::from_std(std_sock);
        self.add_listener(id, Acceptor::Tcp(sock))?;
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
        let Some(mut l) = self.listeners.remove(&listener) else {
            return;
        };
        l.listening.wait(qp, reply);
        if let Err(e) = self.arm(listener, &mut l) {
            tracing::error!("soft NIC: cannot watch a listener: {e}");
        }
        self.listeners.insert(listener, l);
        self.mate(listener);
    }

    fn close_listener(&mut self, listener: ListenerId) {
        if let Some(mut l) = self.listeners.remove(&listener) {
            self.disarm(&mut l);
            if let Some(all) = self.queues.upgrade() {
                all.remove_listener(listener);
            }
            l.listening.close();
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
