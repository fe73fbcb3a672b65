//! One QP as the engine sees it: its socket (the link), its framer, and its transmit and
//! receive machines. The engine drives it from doorbells, management commands and socket
//! readiness.
//!
//! Over 600 lines: one QP's link states and every transition between them (connect, TLS, close, teardown deferred while io_uring still holds buffers) in one place.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use mio::net::{TcpStream, UdpSocket, UnixStream};
use mio::{Interest, Registry, Token};
use smallvec::SmallVec;

use super::splice::Splicer;
use super::stream::Stream;
use super::tls::{Step, TlsLink};
use super::tx::{TxMachine, TxStop};
use super::uring::{RingIo, UringIo};
use qpip_verbs::backend::MgmtResult;
use qpip_verbs::framer::Framer;
use qpip_verbs::machines::mgmt::not_idle;
use qpip_verbs::machines::rx::{RecvTarget, RxIo, RxMachine, RxStop};
use qpip_verbs::machines::shell::Progress;
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::reply::ReplySender;
use qpip_verbs::shared::{QpKind, QpShared, QpState};
use qpip_verbs::wr::WcStatus;

pub(super) enum Link {
    /// No socket yet: WRs wait in the rings.
    Idle,
    Connecting {
        stream: Stream,
        reply: ReplySender<MgmtResult>,
    },
    /// A reliable QP's byte stream (TCP, or a local Unix-domain socket).
    Stream(Stream),
    /// The same under TLS (the engine does the record layer; the handshake replies to
    /// `handshake` when it ends).
    Tls {
        tls: Box<TlsLink>,
        handshake: Option<ReplySender<io::Result<()>>>,
    },
    Udp(UdpSocket),
    /// Closed in order: our side is shut; the peer's bytes are read and dropped until its EOF,
    /// so that closing never turns into a reset that could destroy data still on its way.
    Draining(Stream),
    Down,
}

/// A teardown waiting for io_uring operations to finish: the kernel may still be writing into
/// WR memory, so those WRs cannot be handed back (flushed) yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Deferred {
    Fail,
    Disconnect,
    FinishClose,
}

/// What `service` must do once the machines have run.
enum After {
    Nothing,
    Fail,
    DropLink,
}

/// What an epoll event says of a socket, as the QP's machines need it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Ready {
    /// A read may make progress (data, end of stream or an error to report).
    pub readable: bool,
    /// The peer will send no more, or the socket failed.
    pub read_closed: bool,
    /// A write may make progress (room, or an error to report).
    pub writable: bool,
}

impl Ready {
    /// From epoll's event bits, read as mio reads them.
    pub(super) fn from_epoll(bits: u32) -> Ready {
        let has = |flag: libc::c_int| bits & flag as u32 != 0;
        let error = has(libc::EPOLLERR);
        let hup = has(libc::EPOLLHUP);
        let read_closed = hup || (has(libc::EPOLLIN) && has(libc::EPOLLRDHUP));
        // mio's write-closed beyond a hang-up needs an error, which counts here anyway.
        Ready {
            readable: has(libc::EPOLLIN) || has(libc::EPOLLPRI) || read_closed || error,
            read_closed: read_closed || error,
            writable: has(libc::EPOLLOUT) || hup || error,
        }
    }
}

pub(super) struct EngineQp<Q> {
    pub(super) shared: Arc<QpShared>,
    framer: Box<dyn Framer>,
    pub(super) link: Link,
    tx: TxMachine,
    rx: RxMachine,
    /// The receive WR taken for the next datagram.
    next_datagram: Option<RecvTarget>,
    readable: bool,
    /// epoll said the peer has closed (or the socket failed): reads go on to EOF however
    /// short the last one was.
    read_closed: bool,
    writable: bool,
    closing: bool,
    /// Some when the TCP data path goes through io_uring (never on the epoll engine).
    pub(super) uring: Option<Q>,
    /// The stream's TCP segment size, read once when it is established (None: not TCP): it
    /// cuts the transmit machine's writes and chooses how file bodies are placed.
    segment: Option<usize>,
    /// The pipe file bodies pass through, made when the first one arrives.
    splicer: Option<Splicer>,
    deferred: Option<Deferred>,
}

/// What places file bodies, made for the connection's first (its mode from the connection's
/// `segment` size); None (the receive machine then bounces) if no pipe can be made.
fn splicer(slot: &mut Option<Splicer>, segment: Option<usize>) -> Option<&mut Splicer> {
    if slot.is_none() {
        match Splicer::new(segment) {
            Ok(s) => *slot = Some(s),
            Err(e) => tracing::debug!("no pipe for splicing file bodies: {e}"),
        }
    }
    slot.as_mut()
}

/// A stream socket read through io_uring, as the receive machine's connection.
struct UringRx<'a> {
    io: &'a mut UringIo,
    fd: RawFd,
    segment: Option<usize>,
    splicer: &'a mut Option<Splicer>,
}

impl RxIo for UringRx<'_> {
    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.io.read(self.fd, iov)
    }
    fn read_into_file(
        &mut self,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> Option<io::Result<(usize, Option<io::Error>)>> {
        let splicer = splicer(self.splicer, self.segment)?;
        Some(
            self.io
                .splice_in(self.fd, splicer, file, offset, prefix, max),
        )
    }
}

/// A stream socket read with plain system calls (the epoll data path).
struct SocketRx<'a> {
    stream: &'a Stream,
    segment: Option<usize>,
    splicer: &'a mut Option<Splicer>,
    /// A read came back short: the socket is empty, and the read that would say so (EAGAIN)
    /// is skipped, in this pump and after it (the QP's readiness is spent, as mio's users
    /// treat a short read). Safe with edge-triggered epoll: bytes or a FIN that come after
    /// the short read raise a new event; a FIN that came before it was in the event we are
    /// serving (its state is read when the event is taken), so then (`read_closed`) reads go
    /// on to EOF.
    emptied: bool,
    read_closed: bool,
    /// A read or splice returned something other than `WouldBlock`.
    took: bool,
}

impl RxIo for SocketRx<'_> {
    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if self.emptied {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let asked: usize = iov.iter().map(|b| b.len()).sum();
        // One buffer (a header look, the polling host's read): `recv`, which skips readv's
        // file-position lock and iovec import (BENCHMARKS, "The rest of the gap").
        let mut stream = self.stream;
        let n = match iov {
            [one] => stream.read(one),
            _ => stream.read_vectored(iov),
        };
        self.took |= !matches!(&n, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        let n = n?;
        self.emptied = !self.read_closed && n > 0 && n < asked;
        Ok(n)
    }
    fn read_into_file(
        &mut self,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> Option<io::Result<(usize, Option<io::Error>)>> {
        if self.emptied {
            return Some(Err(io::ErrorKind::WouldBlock.into()));
        }
        let splicer = splicer(self.splicer, self.segment)?;
        let fd = self.stream.as_raw_fd();
        let moved = splicer.socket_to_file(fd, file, offset, prefix, max);
        self.took |= !matches!(&moved, Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        Some(moved)
    }
}

fn token(qp: &QpShared) -> Token {
    Token(qp.num as usize)
}

impl<Q: RingIo> EngineQp<Q> {
    pub(super) fn new(shared: Arc<QpShared>, framer: Box<dyn Framer>) -> Self {
        let uring = (shared.kind == QpKind::Reliable)
            .then(|| Q::new(shared.num))
            .flatten();
        EngineQp {
            shared,
            framer,
            link: Link::Idle,
            tx: TxMachine::new(),
            rx: RxMachine::new(),
            next_datagram: None,
            readable: false,
            read_closed: false,
            writable: false,
            closing: false,
            uring,
            segment: None,
            splicer: None,
            deferred: None,
        }
    }

    /// io_uring operations of this QP are still in the kernel.
    pub(super) fn io_in_flight(&self) -> bool {
        self.uring.as_ref().is_some_and(|io| io.get().in_flight())
    }

    /// An io_uring completion for this QP.
    pub(super) fn on_uring(
        &mut self,
        registry: &Registry,
        memory: &MemoryTable,
        op: u64,
        result: i32,
    ) {
        let Some(io) = self.uring.as_mut() else {
            return;
        };
        io.get_mut().complete(op, result);
        if let Some(d) = self.deferred {
            if !self.io_in_flight() {
                // The result is of no use any more; the teardown can now hand WRs back.
                self.uring = Q::new(self.shared.num);
                self.deferred = None;
                match d {
                    Deferred::Fail => self.fail(registry),
                    Deferred::Disconnect => self.disconnect(registry),
                    Deferred::FinishClose => self.finish_close(registry),
                }
            }
            return;
        }
        match op {
            super::uring::OP_READ => self.readable = true,
            _ => self.writable = true,
        }
        self.service(registry, memory);
    }

    /// Postpones a teardown until in-flight io_uring operations end; shutting the socket down
    /// makes them end at once. True if postponed.
    fn defer(&mut self, what: Deferred) -> bool {
        if !self.io_in_flight() {
            return false;
        }
        let stream = match &self.link {
            Link::Stream(s) | Link::Draining(s) => Some(s),
            Link::Tls { tls, .. } => Some(&tls.raw),
            _ => None,
        };
        if let Some(stream) = stream {
            let how = match what {
                Deferred::FinishClose => Shutdown::Read,
                _ => Shutdown::Both,
            };
            let _ = stream.shutdown(how);
        }
        if self.deferred != Some(Deferred::Fail) {
            self.deferred = Some(what);
        }
        true
    }

    /// Posted sends wait for the socket.
    pub(super) fn sending(&self) -> bool {
        !self.tx.is_idle()
    }

    pub(super) fn is_idle(&self) -> bool {
        matches!(self.link, Link::Idle) && self.shared.state() == QpState::Init
    }

    /// Starts a connection (management: connect).
    pub(super) fn connect(
        &mut self,
        registry: &Registry,
        addr: SocketAddr,
        reply: ReplySender<MgmtResult>,
    ) {
        if self.shared.kind != QpKind::Reliable || !self.is_idle() {
            reply.send(Err(not_idle(self.shared.num, "reliable")));
            return;
        }
        match TcpStream::connect(addr) {
            Ok(s) => self.start_connect(registry, Stream::Tcp(s), reply),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Starts a connection to a Unix-domain socket (management: connect unix).
    pub(super) fn connect_unix(
        &mut self,
        registry: &Registry,
        path: &std::path::Path,
        reply: ReplySender<MgmtResult>,
    ) {
        if self.shared.kind != QpKind::Reliable || !self.is_idle() {
            reply.send(Err(not_idle(self.shared.num, "reliable")));
            return;
        }
        match UnixStream::connect(path) {
            Ok(s) => self.start_connect(registry, Stream::Unix(s), reply),
            Err(e) => reply.send(Err(e)),
        }
    }

    fn start_connect(
        &mut self,
        registry: &Registry,
        mut stream: Stream,
        reply: ReplySender<MgmtResult>,
    ) {
        if let Err(e) = registry.register(
            &mut stream,
            token(&self.shared),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            return reply.send(Err(e));
        }
        self.shared.set_state(QpState::Connecting);
        self.link = Link::Connecting { stream, reply };
    }

    /// Takes in a connection paired with this QP ([`crate::accept`]): whoever paired it made
    /// the QP Ready with its addresses and answered the accept. A QP closed or failed
    /// meanwhile lets it go (it closes).
    pub(super) fn attach(&mut self, registry: &Registry, mut stream: Stream, memory: &MemoryTable) {
        if !matches!(self.link, Link::Idle) || self.shared.state() != QpState::Ready {
            return;
        }
        if self.uring.is_none()
            && let Err(e) = registry.register(
                &mut stream,
                token(&self.shared),
                Interest::READABLE | Interest::WRITABLE,
            )
        {
            tracing::warn!(
                qp = self.shared.num,
                "cannot watch an accepted connection: {e}"
            );
            self.fail(registry);
            return;
        }
        self.established(stream);
        self.service(registry, memory);
    }

    fn established(&mut self, stream: Stream) {
        stream.set_nodelay();
        self.segment = stream.segment_size();
        self.tx.set_segment_size(self.segment);
        self.shared.set_state(QpState::Ready);
        self.link = Link::Stream(stream);
        self.readable = true;
        self.writable = true;
    }

    /// Switches the connection to TLS (management: start TLS): the handshake starts at once;
    /// `reply` hears when it ends.
    pub(super) fn start_tls(
        &mut self,
        registry: &Registry,
        memory: &MemoryTable,
        config: &qpip_verbs::tls::TlsConfig,
        reply: ReplySender<io::Result<()>>,
    ) {
        let refuse = |why: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, why.to_owned()));
        let check = if !matches!(self.link, Link::Stream(_)) {
            refuse("the QP is not a connected stream")
        } else if !self.shared.rq.is_empty() || !self.shared.sq.is_empty() || !self.tx.is_idle() {
            refuse("work requests are outstanding: TLS starts on an idle QP")
        } else if self.rx.buffered() > 0 {
            // The peer sent plaintext past STARTTLS: it cannot be part of the handshake.
            refuse("the peer sent data before the TLS handshake")
        } else if self.io_in_flight() {
            refuse("I/O is under way")
        } else {
            Ok(())
        };
        if let Err(e) = check {
            return reply.send(Err(e));
        }
        let Link::Stream(mut stream) = std::mem::replace(&mut self.link, Link::Down) else {
            return;
        };
        if self.uring.take().is_some() {
            // OpenSSL reads and writes itself: from now on the socket is on epoll.
            if let Err(e) = registry.register(
                &mut stream,
                token(&self.shared),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                self.link = Link::Stream(stream);
                return reply.send(Err(e));
            }
        }
        match TlsLink::new(stream, config) {
            Ok(tls) => {
                self.link = Link::Tls {
                    tls: Box::new(tls),
                    handshake: Some(reply),
                };
                self.readable = true;
                self.writable = true;
                self.service(registry, memory);
            }
            Err(e) => {
                self.fail(registry);
                reply.send(Err(e));
            }
        }
    }

    /// Binds an unreliable QP (management: bind).
    pub(super) fn bind_udp(
        &mut self,
        registry: &Registry,
        addr: SocketAddr,
    ) -> io::Result<SocketAddr> {
        if self.shared.kind != QpKind::Unreliable || !self.is_idle() {
            return Err(not_idle(self.shared.num, "unreliable"));
        }
        let mut sock = UdpSocket::bind(addr)?;
        registry.register(
            &mut sock,
            token(&self.shared),
            Interest::READABLE | Interest::WRITABLE,
        )?;
        let local = sock.local_addr()?;
        self.shared.set_addrs(Some(local), None);
        self.shared.set_state(QpState::Ready);
        self.link = Link::Udp(sock);
        self.readable = true;
        self.writable = true;
        Ok(local)
    }

    /// Socket readiness; whether it was work. On a plain link an event that tells the QP
    /// nothing its flags did not say already moves nothing and is not work: so comes the
    /// edge epoll kept for bytes a poll read without it ([`Self::read_unasked`]), as
    /// writable-only or as what the socket holds now.
    pub(super) fn on_event(
        &mut self,
        registry: &Registry,
        ready: Ready,
        memory: &MemoryTable,
    ) -> Progress {
        let plain = matches!(self.link, Link::Stream(_) | Link::Udp(_));
        let news = !plain
            || (ready.readable && !self.readable)
            || (ready.read_closed && !self.read_closed)
            || (ready.writable && !self.writable);
        self.readable |= ready.readable;
        self.read_closed |= ready.read_closed;
        self.writable |= ready.writable;
        if let Link::Connecting { stream, .. } = &self.link {
            let outcome = match stream.connected() {
                Ok(true) => Ok(()),
                Ok(false) => return Progress::Idle, // not yet
                Err(e) => Err(e),
            };
            let Link::Connecting { mut stream, reply } =
                std::mem::replace(&mut self.link, Link::Idle)
            else {
                return Progress::Idle;
            };
            match outcome {
                Ok(()) => {
                    if self.uring.is_some() {
                        // From here on the ring carries this socket's data.
                        let _ = registry.deregister(&mut stream);
                    }
                    let local = stream.reply_addr();
                    let (local_ip, peer_ip) = stream.ip_addrs();
                    self.shared.set_addrs(local_ip, peer_ip);
                    self.established(stream);
                    reply.send(local);
                }
                Err(e) => {
                    let _ = registry.deregister(&mut stream);
                    self.shared.set_state(QpState::Init);
                    self.readable = false;
                    self.writable = false;
                    reply.send(Err(e));
                    return Progress::Worked;
                }
            }
        }
        self.service(registry, memory);
        if news {
            Progress::Worked
        } else {
            Progress::Idle
        }
    }

    /// The QP may be read without epoll's word ([`Self::read_unasked`]): a plain link, a
    /// receive WR (or a message under way) waiting for bytes, and no word from epoll awaited
    /// on room to write (a send posted meanwhile would wait for it).
    pub(super) fn may_read_unasked(&self) -> bool {
        let plain = match self.link {
            Link::Stream(_) => self.uring.is_none(),
            Link::Udp(_) => true,
            _ => false,
        };
        let wants =
            !self.shared.rq.is_empty() || self.rx.buffered() > 0 || self.next_datagram.is_some();
        plain && wants && self.writable && self.deferred.is_none()
    }

    /// Reads the socket as if epoll had said it is readable (a host thread polling its one
    /// socket): one non-blocking read, which leaves the readiness as epoll's word would have
    /// (spent at `EAGAIN` or a short read). Whether the socket gave anything.
    pub(super) fn read_unasked(&mut self, registry: &Registry, memory: &MemoryTable) -> Progress {
        self.readable = true;
        self.service(registry, memory)
    }

    /// Runs the transmit and receive machines as far as they can go; whether the receive
    /// machine took anything from the socket (bytes, its end or an error; on a link whose
    /// reads it cannot tell, whether it read at all).
    pub(super) fn service(&mut self, registry: &Registry, memory: &MemoryTable) -> Progress {
        if self.deferred.is_some() {
            return Progress::Idle; // going down: nothing new starts
        }
        let EngineQp {
            shared,
            framer,
            link,
            tx,
            rx,
            readable,
            read_closed,
            writable,
            next_datagram,
            uring,
            segment,
            splicer,
            ..
        } = self;
        let mut took = Progress::Idle;
        let after = match link {
            Link::Stream(stream) => {
                let fd = stream.as_raw_fd();
                let mut failed = !tx.take_posted(shared, memory, Some(framer.as_mut()), true);
                if !failed && *writable {
                    let stop = match uring {
                        Some(io) => {
                            let io = io.get_mut();
                            tx.pump_stream(shared, &mut |iov| io.write(fd, iov))
                        }
                        None => tx.pump_stream(shared, &mut |iov| (&*stream).write_vectored(iov)),
                    };
                    match stop {
                        TxStop::WouldBlock => *writable = false,
                        TxStop::Failed => failed = true,
                        TxStop::Idle => {}
                    }
                }
                // Bytes read ahead of a WR (after a short read spent the readiness) are
                // placed without the socket: its reads then stop at once.
                let read_ahead = uring.is_none() && rx.buffered() > 0;
                if !failed && (*readable || read_ahead) {
                    let stop = match uring {
                        Some(io) => {
                            let io = io.get_mut();
                            let mut conn = UringRx {
                                io,
                                fd,
                                segment: *segment,
                                splicer,
                            };
                            took = Progress::Worked;
                            rx.pump_io(shared, memory, framer.as_mut(), &mut conn)
                        }
                        None => {
                            let mut conn = SocketRx {
                                stream,
                                segment: *segment,
                                splicer,
                                emptied: !*readable,
                                read_closed: *read_closed,
                                took: false,
                            };
                            let stop = rx.pump_io(shared, memory, framer.as_mut(), &mut conn);
                            // Also when the pump stopped for want of a WR: the next WR's
                            // turn waits for the next event instead of reading to EAGAIN.
                            if conn.emptied {
                                *readable = false;
                            }
                            if conn.took {
                                took = Progress::Worked;
                            }
                            stop
                        }
                    };
                    match stop {
                        RxStop::WouldBlock => *readable = false,
                        RxStop::Failed => failed = true,
                        RxStop::NoWr => {}
                    }
                }
                if failed { After::Fail } else { After::Nothing }
            }
            Link::Tls { tls, handshake } => 'tls: {
                if tls.handshaking {
                    match tls.handshake() {
                        Step::Done => {
                            if let Some(r) = handshake.take() {
                                r.send(Ok(()));
                            }
                        }
                        Step::WouldBlock => break 'tls After::Nothing,
                        Step::Failed(e) => {
                            tracing::debug!(qp = shared.num, "TLS handshake failed: {e}");
                            // The host sees the QP failed by the time it hears why.
                            shared.set_state(QpState::Error);
                            if let Some(r) = handshake.take() {
                                r.send(Err(e));
                            }
                            break 'tls After::Fail;
                        }
                    }
                }
                // No io_uring here: OpenSSL owns the socket's reads and writes.
                let mut failed = !tx.take_posted(shared, memory, Some(framer.as_mut()), true);
                if !failed && *writable {
                    match tx.pump_stream(shared, &mut |iov| tls.write(iov)) {
                        TxStop::WouldBlock => *writable = false,
                        TxStop::Failed => failed = true,
                        TxStop::Idle => {}
                    }
                }
                if !failed && *readable {
                    took = Progress::Worked;
                    match rx.pump(shared, memory, framer.as_mut(), &mut |iov| tls.read(iov)) {
                        RxStop::WouldBlock => *readable = false,
                        RxStop::Failed => failed = true,
                        RxStop::NoWr => {}
                    }
                }
                if failed { After::Fail } else { After::Nothing }
            }
            Link::Udp(sock) => {
                tx.take_posted(shared, memory, None, false);
                if *writable {
                    let sock2 = socket2::SockRef::from(&*sock);
                    // One part (a WR of one SGE): `sendto`, which skips sendmsg's header and
                    // iovec import, as the sockets it is measured against send.
                    let mut send = |iov: &[IoSlice<'_>], dest: SocketAddr| match iov {
                        [one] => sock2.send_to(one, &dest.into()),
                        _ => sock2.send_to_vectored(iov, &dest.into()),
                    };
                    if tx.pump_datagrams(shared, &mut send) == TxStop::WouldBlock {
                        *writable = false;
                    }
                }
                if *readable {
                    let sock = &*sock;
                    took = Self::receive_datagrams(shared, memory, next_datagram, readable, sock);
                }
                After::Nothing
            }
            Link::Draining(stream) => {
                let mut sink = [0u8; 4096];
                let done = loop {
                    match (&*stream).read(&mut sink) {
                        Ok(0) => break true,
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break true,
                    }
                };
                shared.flush_queues();
                if done {
                    After::DropLink
                } else {
                    After::Nothing
                }
            }
            Link::Down => {
                shared.flush_queues();
                After::Nothing
            }
            Link::Idle | Link::Connecting { .. } => After::Nothing,
        };
        match after {
            After::Fail => self.fail(registry),
            After::DropLink => self.drop_link(registry),
            After::Nothing => {}
        }
        if self.closing && self.tx.is_idle() && self.shared.sq.is_empty() {
            self.finish_close(registry);
        }
        self.shared.notify_cqs();
        took
    }

    fn receive_datagrams(
        shared: &QpShared,
        memory: &MemoryTable,
        next: &mut Option<RecvTarget>,
        readable: &mut bool,
        sock: &UdpSocket,
    ) -> Progress {
        let sock = socket2::SockRef::from(sock);
        let mut took = Progress::Idle;
        loop {
            if next.is_none() {
                match RecvTarget::take(shared, memory) {
                    None => return took,
                    Some(Ok(wr)) => *next = Some(wr),
                    Some(Err(_refused)) => continue,
                }
            }
            let Some(pending) = next.as_ref() else {
                return took;
            };
            let mut bufs: SmallVec<[socket2::MaybeUninitSlice<'_>; 4]> = pending
                .segs
                .iter()
                .map(|s| {
                    // SAFETY: the NIC owns the WR's memory; u8 and MaybeUninit<u8> share a layout.
                    let bytes = unsafe { s.bytes_mut() };
                    // SAFETY: as above: the same bytes, viewed as MaybeUninit<u8>.
                    let uninit = unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) };
                    socket2::MaybeUninitSlice::new(uninit)
                })
                .collect();
            // One buffer (every look of a polling waiter): `recvfrom`, which skips recvmsg's
            // header and iovec import; MSG_TRUNC makes it return a longer datagram's length.
            let result = match &mut bufs[..] {
                [one] => {
                    let room = one.len();
                    sock.recv_from_with_flags(one, libc::MSG_TRUNC)
                        .map(|(n, from)| (n.min(room), n > room, from))
                }
                _ => sock
                    .recv_from_vectored(&mut bufs)
                    .map(|(n, flags, from)| (n, flags.is_truncated(), from)),
            };
            drop(bufs);
            if !matches!(&result, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
                took = Progress::Worked;
            }
            match result {
                Ok((n, truncated, from)) => {
                    let Some(pending) = next.take() else {
                        return took;
                    };
                    let status = if truncated {
                        WcStatus::LengthError
                    } else {
                        WcStatus::Success
                    };
                    shared.complete_recv(pending.wr_id, status, n as u32, from.as_socket(), 0);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    *readable = false;
                    return took;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // An ICMP error from an earlier send, say: the socket goes on.
                    tracing::debug!(qp = shared.num, "datagram receive: {e}");
                }
            }
        }
    }

    /// Fatal error: every outstanding WR is flushed and the socket dropped.
    pub(super) fn fail(&mut self, registry: &Registry) {
        self.shared.set_state(QpState::Error);
        if self.defer(Deferred::Fail) {
            return;
        }
        self.flush_all();
        self.drop_link(registry);
    }

    fn flush_all(&mut self) {
        self.tx.flush(&self.shared);
        self.rx.flush(&self.shared);
        if let Some(d) = self.next_datagram.take() {
            self.shared
                .complete_recv(d.wr_id, WcStatus::Flushed, 0, None, 0);
        }
        self.shared.flush_queues();
        self.shared.notify_cqs();
    }

    fn drop_link(&mut self, registry: &Registry) {
        match std::mem::replace(&mut self.link, Link::Down) {
            Link::Stream(mut s) | Link::Draining(mut s) => {
                let _ = registry.deregister(&mut s);
            }
            Link::Tls { mut tls, handshake } => {
                let _ = registry.deregister(&mut tls.raw);
                if let Some(r) = handshake {
                    r.send(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "the connection went down during the TLS handshake",
                    )));
                }
            }
            Link::Connecting { mut stream, reply } => {
                let _ = registry.deregister(&mut stream);
                reply.send(Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "connect aborted",
                )));
            }
            Link::Udp(mut s) => {
                let _ = registry.deregister(&mut s);
            }
            Link::Idle | Link::Down => {}
        }
    }

    /// Orderly close (management: close).
    pub(super) fn start_close(&mut self, registry: &Registry, memory: &MemoryTable) {
        match self.link {
            Link::Stream(_) | Link::Tls { .. } => {
                self.closing = true;
                self.shared.set_state(QpState::Closing);
                self.service(registry, memory);
            }
            Link::Draining(_) | Link::Down => {}
            _ => self.disconnect(registry),
        }
    }

    fn finish_close(&mut self, registry: &Registry) {
        if self.defer(Deferred::FinishClose) {
            return;
        }
        self.closing = false;
        let stream = match std::mem::replace(&mut self.link, Link::Down) {
            Link::Stream(s) => Some(s),
            Link::Tls { mut tls, .. } => {
                tls.close_notify();
                Some(tls.raw)
            }
            other => {
                self.link = other;
                None
            }
        };
        if let Some(mut stream) = stream {
            let _ = stream.shutdown(Shutdown::Write);
            if self.uring.is_some() {
                // Draining reads synchronously on epoll readiness.
                let _ = registry.register(&mut stream, token(&self.shared), Interest::READABLE);
            }
            self.link = Link::Draining(stream);
        }
        self.shared.set_state(QpState::Closed);
        self.flush_all();
    }

    /// Abortive close (management: disconnect, destroy, NIC shutdown).
    pub(super) fn disconnect(&mut self, registry: &Registry) {
        if matches!(self.link, Link::Down)
            && matches!(self.shared.state(), QpState::Closed | QpState::Error)
        {
            return;
        }
        self.shared.set_state(QpState::Closed);
        if self.defer(Deferred::Disconnect) {
            return;
        }
        self.closing = false;
        self.flush_all();
        self.drop_link(registry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uring::NoRing;
    use mio::{Events, Poll};
    use qpip_verbs::framer::LengthPrefixed;
    use qpip_verbs::shared::QpKind;
    use qpip_verbs::wr::{Completion, RecvWr};
    use qpip_verbs::{Access, CompletionQueue, MemoryRegion, Sge};
    use std::time::Duration;

    /// One reliable QP on the epoll data path over a Unix stream pair, length-prefixed: the
    /// QP, its peer's end, the epoll it is registered in, its CQ and its memory.
    struct Rig {
        qp: EngineQp<NoRing>,
        peer: std::os::unix::net::UnixStream,
        poll: Poll,
        cq: CompletionQueue,
        memory: Arc<MemoryTable>,
        mr: MemoryRegion,
        posted: u64,
    }

    const SLOT: usize = 64;

    impl Rig {
        fn new() -> Rig {
            let cq = CompletionQueue::new(64);
            let cqs = (cq.shared().clone(), cq.shared().clone());
            let shared = Arc::new(QpShared::new(1, QpKind::Reliable, cqs, (8, 8)));
            shared.set_state(QpState::Ready);
            let memory = MemoryTable::new();
            let mr = memory.register_owned(8 * SLOT, Access::READ_WRITE);
            let mut qp = EngineQp::new(shared, Box::new(LengthPrefixed::default()));
            let (ours, peer) = std::os::unix::net::UnixStream::pair().unwrap();
            ours.set_nonblocking(true).unwrap();
            let poll = Poll::new().unwrap();
            let stream = Stream::Unix(UnixStream::from_std(ours));
            qp.attach(poll.registry(), stream, &memory);
            let mut rig = Rig {
                qp,
                peer,
                poll,
                cq,
                memory,
                mr,
                posted: 0,
            };
            rig.events(); // the first (writable) edge
            rig
        }

        /// Posts a receive WR of `SLOT` bytes, as a doorbell would (no socket event).
        fn post_recv(&mut self) {
            let slot = (self.posted as usize % 8) * SLOT;
            let wr = RecvWr::new(self.posted, &[self.mr.sge(slot, SLOT)]);
            self.qp.shared.push_recv(wr).unwrap();
            self.posted += 1;
            self.qp.service(self.poll.registry(), &self.memory);
        }

        /// The peer sends `msgs`, each with its 4-byte length.
        fn send(&mut self, msgs: &[&[u8]]) {
            for m in msgs {
                self.peer
                    .write_all(&(m.len() as u32).to_be_bytes())
                    .unwrap();
                self.peer.write_all(m).unwrap();
            }
        }

        /// Hands the QP what epoll says now (waiting a little for it); whether it was work.
        fn events(&mut self) -> Progress {
            events(&mut self.poll, &mut self.qp, &self.memory)
        }

        /// A read without epoll's word, as a host thread polling its one socket makes.
        fn read_unasked(&mut self) -> Progress {
            assert!(self.qp.may_read_unasked());
            self.qp.read_unasked(self.poll.registry(), &self.memory)
        }

        /// Completions so far, with the bytes each placed.
        fn completions(&self) -> Vec<(Completion, Vec<u8>)> {
            let mut out = [Completion::default(); 16];
            let n = self.cq.poll(&mut out).unwrap();
            out[..n]
                .iter()
                .map(|c| {
                    let mut bytes = vec![0; c.byte_len as usize];
                    self.mr.read_at((c.wr_id as usize % 8) * SLOT, &mut bytes);
                    (*c, bytes)
                })
                .collect()
        }
    }

    /// Hands `qp` what `poll` says now (waiting a little for it); whether it was work.
    fn events(poll: &mut Poll, qp: &mut EngineQp<NoRing>, memory: &MemoryTable) -> Progress {
        let mut events = Events::with_capacity(8);
        poll.poll(&mut events, Some(Duration::from_millis(200)))
            .unwrap();
        let mut any = Progress::Idle;
        for e in events.iter() {
            let ready = Ready {
                readable: e.is_readable(),
                read_closed: e.is_read_closed() || e.is_error(),
                writable: e.is_writable(),
            };
            if qp.on_event(poll.registry(), ready, memory) == Progress::Worked {
                any = Progress::Worked;
            }
        }
        any
    }

    /// A short read leaves the QP's readiness spent even though the pump stopped for want of
    /// a WR (not at EAGAIN): the next WR waits for epoll's next edge instead of reading the
    /// empty socket. And that edge comes: bytes sent after the short read are received.
    #[test]
    fn a_short_read_spends_the_readiness_and_later_bytes_still_arrive() {
        let mut rig = Rig::new();
        rig.post_recv();
        rig.send(&[b"ping"]);
        rig.events();
        let got = rig.completions();
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].0.status, &got[0].1[..]),
            (WcStatus::Success, &b"ping"[..])
        );
        assert!(
            !rig.qp.readable,
            "a short read left the socket to be read again"
        );

        // No new bytes: posting a WR reads nothing and completes nothing.
        rig.post_recv();
        assert!(rig.completions().is_empty());
        // New bytes raise an edge that serves the waiting WR.
        rig.send(&[b"pong"]);
        rig.events();
        let got = rig.completions();
        assert_eq!(got.len(), 1);
        assert_eq!(
            (got[0].0.status, &got[0].1[..]),
            (WcStatus::Success, &b"pong"[..])
        );
    }

    /// A poll reads the socket without epoll: a message is taken by its one read, an empty
    /// socket is no work, and the edge epoll kept for the message read that way, taken by
    /// a later look (a sleep's), is no work either: a sleep that it ends early sleeps again
    /// instead of learning from a wake-up that brought nothing. Bytes after it are news.
    #[test]
    fn a_read_without_epoll_leaves_an_edge_that_is_no_work() {
        let mut rig = Rig::new();
        rig.post_recv();
        rig.send(&[b"ping"]);
        assert_eq!(rig.read_unasked(), Progress::Worked);
        let got = rig.completions();
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].1[..], b"ping");
        assert!(!rig.qp.readable, "the short read left the socket readable");
        rig.post_recv();
        assert_eq!(
            rig.read_unasked(),
            Progress::Idle,
            "an empty socket was work"
        );
        assert_eq!(rig.events(), Progress::Idle, "the kept edge was work");
        assert!(rig.completions().is_empty());
        rig.send(&[b"pong"]);
        assert_eq!(rig.events(), Progress::Worked);
        let got = rig.completions();
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].1[..], b"pong");
    }

    /// The same over UDP: a poll takes a datagram with its one `recvmsg`, and the edge epoll
    /// kept for it is no work; one sent after it is.
    #[test]
    fn a_datagram_read_without_epoll_leaves_an_edge_that_is_no_work() {
        let cq = CompletionQueue::new(8);
        let cqs = (cq.shared().clone(), cq.shared().clone());
        let shared = Arc::new(QpShared::new(1, QpKind::Unreliable, cqs, (4, 4)));
        let memory = MemoryTable::new();
        let mr = memory.register_owned(2 * SLOT, Access::READ_WRITE);
        let mut qp = EngineQp::<NoRing>::new(shared, Box::new(LengthPrefixed::default()));
        let mut poll = Poll::new().unwrap();
        let local = "127.0.0.1:0".parse().unwrap();
        let addr = qp.bind_udp(poll.registry(), local).unwrap();
        events(&mut poll, &mut qp, &memory); // the first (writable) edge
        let peer = std::net::UdpSocket::bind(local).unwrap();
        let post = |qp: &mut EngineQp<NoRing>, poll: &Poll, id: u64| {
            let wr = RecvWr::new(id, &[mr.sge(id as usize * SLOT, SLOT)]);
            qp.shared.push_recv(wr).unwrap();
            qp.service(poll.registry(), &memory);
        };
        post(&mut qp, &poll, 0);
        peer.send_to(b"ping", addr).unwrap();
        assert!(qp.may_read_unasked());
        // Loopback delivers at once; a few tries in case the datagram is not queued yet.
        let mut took = Progress::Idle;
        for _ in 0..1000 {
            took = qp.read_unasked(poll.registry(), &memory);
            if took == Progress::Worked {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(took, Progress::Worked);
        let mut out = [Completion::default(); 4];
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!((out[0].wr_id, out[0].byte_len), (0, 4));
        post(&mut qp, &poll, 1);
        let polled = qp.read_unasked(poll.registry(), &memory);
        assert_eq!(polled, Progress::Idle, "an empty socket was work");
        assert_eq!(events(&mut poll, &mut qp, &memory), Progress::Idle);
        peer.send_to(b"pong", addr).unwrap();
        assert_eq!(events(&mut poll, &mut qp, &memory), Progress::Worked);
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!((out[0].wr_id, out[0].byte_len), (1, 4));
    }

    /// Messages that came together are placed by one event as WRs are posted; bytes read
    /// ahead of a WR (a whole message in the header buffer) still complete without an edge.
    #[test]
    fn messages_read_ahead_complete_as_their_wrs_come() {
        let mut rig = Rig::new();
        rig.post_recv();
        rig.send(&[b"a", b"bc"]);
        rig.events();
        rig.post_recv();
        let got: Vec<_> = rig
            .completions()
            .into_iter()
            .map(|(c, b)| (c.wr_id, b))
            .collect();
        assert_eq!(got, [(0, b"a".to_vec()), (1, b"bc".to_vec())]);
    }

    /// A message split across the peer's writes (the first part read short) completes when
    /// the rest arrives.
    #[test]
    fn a_message_split_after_a_short_read_completes_with_the_rest() {
        let mut rig = Rig::new();
        rig.post_recv();
        rig.peer.write_all(&5u32.to_be_bytes()).unwrap();
        rig.peer.write_all(b"hel").unwrap();
        rig.events();
        assert!(rig.completions().is_empty());
        rig.peer.write_all(b"lo").unwrap();
        rig.events();
        let got = rig.completions();
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].1[..], b"hello");
    }

    /// Frames length-prefixed messages whose bodies go to byte 0 of a registered file.
    struct ToFile(Sge);

    impl qpip_verbs::framer::Framer for ToFile {
        fn frame(&mut self, header: &[u8]) -> qpip_verbs::framer::Frame {
            let Some(prefix) = header.first_chunk::<4>() else {
                return qpip_verbs::framer::Frame::NeedHeader(4);
            };
            let mut body = self.0;
            body.len = u32::from_be_bytes(*prefix);
            qpip_verbs::framer::Frame::MessageAt {
                header_len: 4,
                strip: 4,
                body,
            }
        }
    }

    /// A spent readiness holds for a body spliced into a file too: while the message waits
    /// for the rest of its body, a doorbell's pass does not read the socket (the rest, sent
    /// meanwhile, is taken at its event).
    #[test]
    fn a_file_body_waits_for_its_event_once_the_socket_is_drained() {
        let mut rig = Rig::new();
        let file = Arc::new(tempfile::tempfile().unwrap());
        let region = rig
            .memory
            .register_file(file.clone(), 64, Access::READ_WRITE);
        rig.qp.framer = Box::new(ToFile(region.sge(0, 0)));
        rig.post_recv();
        rig.peer.write_all(&8u32.to_be_bytes()).unwrap();
        rig.peer.write_all(b"abcd").unwrap();
        rig.events();
        assert!(rig.completions().is_empty());
        assert!(!rig.qp.readable);
        rig.peer.write_all(b"efgh").unwrap();
        rig.post_recv(); // a doorbell: no event yet
        assert!(
            rig.completions().is_empty(),
            "the socket was read without an event"
        );
        rig.events();
        let got = rig.completions();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].0.status, got[0].0.placed), (WcStatus::Success, 8));
        let mut body = [0u8; 8];
        std::os::unix::fs::FileExt::read_exact_at(&*file, &mut body, 0).unwrap();
        assert_eq!(&body, b"abcdefgh");
    }

    /// The peer closing after a short read is seen: the waiting WR completes as closed.
    #[test]
    fn a_close_after_a_short_read_completes_the_waiting_wr() {
        let mut rig = Rig::new();
        rig.post_recv();
        rig.send(&[b"last"]);
        rig.events();
        assert_eq!(rig.completions().len(), 1);
        rig.post_recv();
        rig.peer.shutdown(Shutdown::Write).unwrap();
        rig.events();
        let got = rig.completions();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.status, WcStatus::RemoteClosed);
    }

    /// The engine reads epoll's bits itself now (a sleep takes them): they mean what mio's
    /// `Event` made of them.
    #[test]
    fn epoll_bits_read_as_mio_reads_them() {
        let r = |bits: libc::c_int| Ready::from_epoll(bits as u32);
        let ready = |readable, read_closed, writable| Ready {
            readable,
            read_closed,
            writable,
        };
        assert_eq!(r(libc::EPOLLIN), ready(true, false, false));
        assert_eq!(r(libc::EPOLLOUT), ready(false, false, true));
        assert_eq!(
            r(libc::EPOLLIN | libc::EPOLLRDHUP),
            ready(true, true, false)
        );
        // RDHUP alone (no data left to read) is not a close, as in mio.
        assert_eq!(r(libc::EPOLLRDHUP), ready(false, false, false));
        assert_eq!(r(libc::EPOLLHUP), ready(true, true, true));
        assert_eq!(r(libc::EPOLLERR), ready(true, true, true));
        assert_eq!(r(libc::EPOLLPRI), ready(true, false, false));
    }
}
