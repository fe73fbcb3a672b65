//! The NIC thread: the one loop that plays the NIC processor for every threaded backend.
//!
//! The host side hands it management commands (a queue) and doorbells (the doorbell FIFO,
//! one entry per QP however many WRs were posted). The loop runs commands, then doorbells,
//! then one non-blocking `step` of the backend's physical layer; after its poll window
//! without work it announces that it sleeps and sleeps on the descriptor the processor names
//! (`drive::sleep`, the one place a thread running a queue sleeps). A backend
//! supplies only [`Processor`]: where its commands and doorbells go, `step`, and what to
//! watch; it never blocks.
//!
//! Batching belongs here: the doorbells are drained as one batch per turn before the
//! physical layer runs. The poll window is learned from arrivals ([`PollWindow`]), up to
//! [`ShellConfig::spin`]: the thread polls while work keeps coming back within the window,
//! and sleeps at once when idle gaps outlast it, so an idle NIC costs no CPU and does not
//! take the core from the application on a two-core machine.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering, fence};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::{ArrayQueue, SegQueue};
use parking_lot::Mutex;

use crate::backend::Command;
use crate::drive::QueueDriver;
use crate::drive::handover::Handover;
use crate::drive::rules::{Ended, RunEnd};
use crate::drive::sleep::{EpollEvents, sleep, sleep_epoll};
use crate::drive::sync::{SleepFlag, posted};
use crate::error::{Error, Result};
use crate::poll_window::PollWindow;
use crate::shared::QpShared;
use crate::wr::QpNum;

/// What a backend's NIC processor does with the work the shell hands it.
pub trait Processor {
    /// Management: one privileged command (through [`super::mgmt::dispatch`]).
    fn command(&mut self, cmd: Command);
    /// Doorbell: `qp` has new WRs. Clear its doorbell flag before reading its rings, so a WR
    /// posted after that rings again.
    fn doorbell(&mut self, qp: QpNum);
    /// Moves whatever the physical layer has ready, without blocking, and takes what made
    /// [`Self::watch_fd`] readable.
    fn step(&mut self) -> Progress;
    /// [`Self::step`] by a host thread that polls (within its CQ's window: it does not sleep
    /// between its steps, and the commands and doorbells it runs come from the shell's queues,
    /// not from the waker). Where one socket is all that may bring work, the processor may
    /// read it directly (one non-blocking read, as a busy-polling socket reader makes)
    /// instead of asking [`Self::watch_fd`] first; an edge that descriptor then still holds
    /// for those bytes must not count as work when a later step takes it (the wake table of
    /// [`crate::drive`]). Taking events a sleep left is still this call's job.
    fn poll(&mut self) -> Progress {
        self.step()
    }
    /// The descriptor that is readable (`poll(2)`) while the physical layer has something for
    /// [`Self::step`] or the waker has rung (an epoll instance holding both, an io_uring's).
    /// Whoever runs the processor sleeps on it, and the NIC thread of a driven queue watches
    /// it without holding the processor, so that a host thread that comes to wait finds the
    /// processor free.
    fn watch_fd(&self) -> std::os::fd::RawFd;
    /// Where a sleep on [`Self::watch_fd`] leaves what woke it, when that descriptor is an
    /// epoll instance whose events [`Self::step`] takes from this buffer: the sleep is then
    /// the `epoll_wait` the step would make, one system call for both. None: the sleep only
    /// waits for the descriptor to be readable.
    fn wake_events(&mut self) -> Option<&mut EpollEvents> {
        None
    }
    /// How soon a timer of the physical layer is due (smoltcp's `poll_delay`): a sleep lasts
    /// at most this long. None: no timer.
    fn poll_in(&self) -> Option<Duration> {
        None
    }
    /// The NIC stops (the last commands have run): last frames out, connections down.
    fn stop(&mut self);
    /// Posted sends still wait for the wire (a socket that would block): a host thread that
    /// stops driving hands the queue to the NIC thread at once, so they go on leaving.
    fn sending(&self) -> bool {
        false
    }
}

/// A processor chosen when the NIC thread starts (say, io_uring or epoll, as the kernel
/// allows).
impl<P: Processor + ?Sized> Processor for Box<P> {
    fn command(&mut self, cmd: Command) {
        (**self).command(cmd)
    }
    fn doorbell(&mut self, qp: QpNum) {
        (**self).doorbell(qp)
    }
    fn step(&mut self) -> Progress {
        (**self).step()
    }
    fn poll(&mut self) -> Progress {
        (**self).poll()
    }
    fn watch_fd(&self) -> std::os::fd::RawFd {
        (**self).watch_fd()
    }
    fn wake_events(&mut self) -> Option<&mut EpollEvents> {
        (**self).wake_events()
    }
    fn poll_in(&self) -> Option<Duration> {
        (**self).poll_in()
    }
    fn stop(&mut self) {
        (**self).stop()
    }
    fn sending(&self) -> bool {
        (**self).sending()
    }
}

/// What a turn of the physical layer ([`Processor::step`]) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Something moved: data, a connection, a timer.
    Worked,
    /// Nothing did.
    Idle,
}

impl Progress {
    fn worked(self) -> bool {
        self == Progress::Worked
    }
}

/// How the shell runs.
pub struct ShellConfig {
    /// The thread's name.
    pub name: &'static str,
    /// The longest the thread polls after its last piece of work before it sleeps (the
    /// window it learns stays within it; zero: never poll).
    pub spin: Duration,
    /// Entries of the doorbell FIFO: `Some` for a device's bounded FIFO (a full one holds
    /// the host back), `None` for unbounded.
    pub doorbell_fifo: Option<usize>,
    /// With [`NicThread::spawn_driven`]: how long the NIC thread leaves the queue to host
    /// threads after their last drive before it drives again itself (what arrives while
    /// nobody waits waits at most that long); unused otherwise.
    pub grace: Duration,
}

/// The doorbell FIFO.
enum Doorbells {
    Bounded(ArrayQueue<QpNum>),
    Unbounded(SegQueue<QpNum>),
}

impl Doorbells {
    fn push(&self, qp: QpNum) -> bool {
        match self {
            Doorbells::Bounded(q) => q.push(qp).is_ok(),
            Doorbells::Unbounded(q) => {
                q.push(qp);
                true
            }
        }
    }
    fn pop(&self) -> Option<QpNum> {
        match self {
            Doorbells::Bounded(q) => q.pop(),
            Doorbells::Unbounded(q) => q.pop(),
        }
    }
    fn is_empty(&self) -> bool {
        match self {
            Doorbells::Bounded(q) => q.is_empty(),
            Doorbells::Unbounded(q) => q.is_empty(),
        }
    }
}

/// What the host threads and the NIC thread share.
pub(crate) struct Shared {
    commands: SegQueue<Command>,
    doorbells: Doorbells,
    /// Whoever runs the processor (the NIC thread or a driving host thread) sleeps on its
    /// descriptor: a doorbell must ring the waker.
    sleeping: SleepFlag,
    pub(crate) stop: AtomicBool,
    waker: mio::Waker,
    tid: AtomicI32,
    /// The NIC thread has ended (stopped or panicked): commands get no reply.
    pub(crate) dead: AtomicBool,
    /// Run to completion's hand-over between host drivers and the NIC thread.
    pub(crate) handover: Handover,
}

impl Shared {
    pub(crate) fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the NIC thread: {e}");
        }
    }

    /// Drops queued commands, so their reply senders go and the waiting hosts get an error
    /// instead of waiting forever.
    fn drop_commands(&self) {
        while self.commands.pop().is_some() {}
    }

    pub(crate) fn has_work(&self) -> bool {
        !self.doorbells.is_empty() || !self.commands.is_empty()
    }
}

/// The host's handle on a running NIC thread.
pub struct NicThread {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    name: &'static str,
    /// Set when host threads may run the processor ([`Self::spawn_driven`]).
    driver: Option<Arc<dyn QueueDriver>>,
}

impl NicThread {
    /// Starts the thread and returns once `build` has made the processor on it (it need not
    /// be `Send`, and what it sets up — an io_uring, say — belongs to the NIC thread, not to
    /// the caller's). `waker` must make the processor's [`Processor::watch_fd`] readable.
    /// Only the NIC thread runs the processor, as a device's own processor runs its firmware.
    pub fn spawn<P: Processor>(
        cfg: ShellConfig,
        waker: mio::Waker,
        build: impl FnOnce() -> P + Send + 'static,
    ) -> Result<NicThread> {
        let shared = Shared::new(&cfg, waker)?;
        let spin = cfg.spin;
        Self::start(cfg, shared, move |shared, started| {
            let nic = build();
            let _ = started.send(None);
            run(shared, spin, nic);
        })
    }

    /// Starts the thread that runs `body` and waits until it says it runs.
    pub(crate) fn start(
        cfg: ShellConfig,
        shared: Arc<Shared>,
        body: impl FnOnce(&Arc<Shared>, Started) + Send + 'static,
    ) -> Result<NicThread> {
        let thread_shared = shared.clone();
        let (started, is_started) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(cfg.name.into())
            .spawn(move || {
                // Also on unwinding: a panicking NIC must not leave hosts waiting.
                let _guard = DeadGuard(thread_shared.clone());
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() };
                thread_shared.tid.store(tid, Ordering::Release);
                body(&thread_shared, started);
            })
            .map_err(|e| Error::Engine(format!("cannot start {}: {e}", cfg.name)))?;
        let Ok(driver) = is_started.recv() else {
            let _ = thread.join();
            return Err(Error::Engine(format!("{} failed to start", cfg.name)));
        };
        Ok(NicThread {
            shared,
            thread: Mutex::new(Some(thread)),
            name: cfg.name,
            driver,
        })
    }

    /// The queue host threads drive, for binding CQs to it; None when only the NIC thread
    /// runs the processor.
    pub fn driver(&self) -> Option<&Arc<dyn QueueDriver>> {
        self.driver.as_ref()
    }

    /// Queues a management command and wakes the thread (or the host thread driving it).
    pub fn manage(&self, cmd: Command) {
        self.shared.commands.push(cmd);
        // Pairs with DeadGuard's: either the ending thread drops this command, or we do.
        fence(Ordering::SeqCst);
        if self.shared.dead.load(Ordering::Relaxed) {
            self.shared.drop_commands();
            return;
        }
        self.shared.wake();
        self.shared.handover.kick();
    }

    /// Puts `qp` in the doorbell FIFO unless it is there already. An atomic swap and a fence;
    /// a system call only when the thread sleeps (or a bounded FIFO is full).
    #[inline]
    pub fn ring_doorbell(&self, qp: &QpShared) {
        if qp.doorbell.swap(true, Ordering::AcqRel) {
            return; // already in the FIFO; the NIC clears the flag before it reads the rings
        }
        // A full FIFO holds the host's write back until the NIC makes room.
        while !self.shared.doorbells.push(qp.num) {
            if self.shared.stop.load(Ordering::Acquire) || self.shared.dead.load(Ordering::Acquire)
            {
                return;
            }
            self.shared.wake();
            std::thread::yield_now();
        }
        // Pairs with the sleeper's raised flag: either we see it, or it sees the doorbell.
        posted();
        if self.shared.sleeping.raised() || self.shared.handover.watching.raised() {
            self.shared.wake();
        }
    }

    /// CPU time host threads spent running this queue (run to completion), which a
    /// thread's own CPU accounting counts as the application's.
    pub fn driven_cpu(&self) -> Duration {
        self.shared.handover.driven_cpu()
    }

    /// Kernel thread id of the NIC thread, once it runs.
    pub fn engine_threads(&self) -> Vec<i32> {
        match self.shared.tid.load(Ordering::Acquire) {
            0 => vec![],
            tid => vec![tid],
        }
    }

    /// Stops the thread and waits for it.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake();
        self.shared.handover.kick();
        if let Some(t) = self.thread.lock().take()
            && t.join().is_err()
        {
            tracing::error!("{} panicked", self.name);
        }
    }
}

/// Tells the spawner the thread runs, with the queue hosts may drive (if any).
type Started = std::sync::mpsc::Sender<Option<Arc<dyn QueueDriver>>>;

impl Shared {
    pub(crate) fn new(cfg: &ShellConfig, waker: mio::Waker) -> Result<Arc<Shared>> {
        let doorbells = match cfg.doorbell_fifo {
            Some(n) => Doorbells::Bounded(ArrayQueue::new(n.max(1))),
            None => Doorbells::Unbounded(SegQueue::new()),
        };
        let handover =
            Handover::new().map_err(|e| Error::Engine(format!("{}: eventfd: {e}", cfg.name)))?;
        Ok(Arc::new(Shared {
            commands: SegQueue::new(),
            doorbells,
            sleeping: SleepFlag::new(),
            stop: AtomicBool::new(false),
            waker,
            tid: AtomicI32::new(0),
            dead: AtomicBool::new(false),
            handover,
        }))
    }
}

struct DeadGuard(Arc<Shared>);

impl Drop for DeadGuard {
    fn drop(&mut self) {
        self.0.dead.store(true, Ordering::Release);
        // Pairs with manage's: either it sees `dead` and drops its command, or we drop it.
        fence(Ordering::SeqCst);
        self.0.drop_commands();
        if std::thread::panicking() {
            tracing::error!("the NIC thread panicked; the NIC is gone");
        }
    }
}

/// The NIC thread's loop when only it runs the processor.
fn run<P: Processor>(shared: &Shared, spin: Duration, mut nic: P) {
    let mut turns = Turns::new(spin);
    drive(
        shared,
        &mut nic,
        &mut turns,
        &mut || shared.stop.load(Ordering::Acquire),
        None,
    );
    // Last commands (QPs destroyed as the NIC's handles went) still run, so peers are told.
    run_commands(shared, &mut nic);
    nic.stop();
}

/// The NIC thread's turns: its own poll window, and the pace of the queue's work.
pub(crate) struct Turns {
    window: PollWindow,
    pace: Pace,
}

impl Turns {
    /// `spin`: the longest poll window (zero: sleep as soon as a turn finds nothing).
    pub(crate) fn new(spin: Duration) -> Self {
        Turns {
            window: PollWindow::new(spin),
            pace: Pace::new(),
        }
    }
}

/// When a queue last had work, and whether whoever ran it slept since: what the window of
/// the next thread to run it learns from. The poll window itself is not here: the NIC
/// thread has its own ([`Turns`]), and each CQ's waiters theirs
/// ([`crate::poll_window::KeptWindow`]).
pub(crate) struct Pace {
    last_work: Instant,
    slept: bool,
    /// The clock as these turns last read it, while nothing but looks for work (no work,
    /// no sleep) has run since: a drive that ends then records it as its end instead of
    /// reading the clock again, one reading fewer between a message's arrival and the
    /// application (a reading costs 25–70 ns here; BENCHMARKS, "A message's own path").
    read: Option<Instant>,
}

impl Pace {
    pub(crate) fn new() -> Self {
        Pace {
            last_work: Instant::now(),
            slept: false,
            read: None,
        }
    }

    /// Work came: `window` learns how long after the last work, if the runner slept between.
    fn worked(&mut self, window: &mut PollWindow) {
        let now = Instant::now();
        window.idle_ended(now - self.last_work, self.slept);
        self.last_work = now;
        self.slept = false;
        self.read = Some(now);
    }

    /// Now, as the last reading of the clock that nothing but looks followed, or as the
    /// clock says.
    pub(crate) fn now(&mut self) -> Instant {
        self.read.take().unwrap_or_else(Instant::now)
    }
}

/// Who runs the processor's turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runner {
    /// The NIC thread: it yields its core while it polls, and always steps.
    NicThread,
    /// An application thread waiting on a CQ: it keeps its core while it polls, but for a
    /// yield every [`HOST_YIELD_EVERY`] looks that find nothing.
    Host,
}

/// A host thread that polls yields its core at every this many looks that find nothing. A
/// thread woken onto its core — on two cores often the very one it waits for: a local
/// server's connection thread, the next hop of a FUSE request — would otherwise wait for the
/// poller's whole window (the scheduler lets the running thread finish its slice); a yield
/// lets it run at once. With nothing else runnable a yield is one system call, which every
/// look would pay: at every fourth, 4 KiB QD1 through the mount made 8–25 % more requests per
/// second at 15–20 % less CPU per request and the round trip stayed level, where every look
/// cost it 3–7 % and every sixteenth gained nothing (BENCHMARKS, session 18). Not while a
/// CPU hog shares the core ([`crate::give_way`]): a yield then costs a tick.
const HOST_YIELD_EVERY: u32 = 4;

/// Runs the processor's turns — commands, then doorbells, then a step of the physical layer
/// — until `done()` (looked at after the work of each turn and before sleeping) or
/// `deadline`; polls for the learned window after the last work, then sleeps on the
/// processor's descriptor (`drive::sleep`).
pub(crate) fn drive<P: Processor>(
    shared: &Shared,
    nic: &mut P,
    turns: &mut Turns,
    done: &mut dyn FnMut() -> bool,
    deadline: Option<Instant>,
) -> Ended {
    let Turns { window, pace } = turns;
    run_turns(shared, nic, Runner::NicThread, pace, window, done, deadline)
}

/// [`drive`] by an application thread waiting on a CQ, polling within `window`: its CQ's.
pub(crate) fn drive_host<P: Processor>(
    shared: &Shared,
    nic: &mut P,
    pace: &mut Pace,
    window: &mut PollWindow,
    done: &mut dyn FnMut() -> bool,
    deadline: Option<Instant>,
) -> Ended {
    run_turns(shared, nic, Runner::Host, pace, window, done, deadline)
}

fn run_turns<P: Processor>(
    shared: &Shared,
    nic: &mut P,
    runner: Runner,
    pace: &mut Pace,
    window: &mut PollWindow,
    done: &mut dyn FnMut() -> bool,
    deadline: Option<Instant>,
) -> Ended {
    // The processor may hold what no step has taken: after a sleep (what woke it), or
    // after a step that found work (a stream). Otherwise a host thread that never polls
    // skips the step: its sleep returns at once if something is ready (one system call
    // fewer per wait); the NIC thread always steps (an io_uring engine submits there).
    let mut fresh = false;
    let mut idle_looks: u32 = 0;
    pace.read = None;
    loop {
        let mut worked = run_commands(shared, nic);
        worked |= run_doorbells(shared, nic);
        if worked {
            pace.read = None;
        }
        if done() {
            // The work of this turn is not counted in the pace: after a request's doorbell
            // ended a drive (its send completed), the next drive's window runs from the
            // previous arrival, not from the request. Counting it made a QD1 waiter poll
            // for the whole reply time, slower on two cores (BENCHMARKS, session 13).
            // What a sleep took from the kernel is dispatched before the processor is let
            // go: whoever watches its descriptor next would not see it.
            if nic.wake_events().is_some_and(|e| e.pending()) {
                nic.step();
                pace.read = None;
            }
            return Ended::Done;
        }
        let polls = runner == Runner::Host && window.max() > Duration::ZERO;
        if fresh || runner == Runner::NicThread || polls {
            // Only a host whose waits polling catches looks without the readiness descriptor:
            // the NIC thread and a host that sleeps learn of their sockets from it.
            let direct = polls && window.polling_catches_work();
            fresh = if direct { nic.poll() } else { nic.step() }.worked();
            worked |= fresh;
        }
        if worked {
            pace.worked(window);
            continue;
        }
        // The clock reading of an idle look within the window (None: not polling).
        let polling = if pace.slept {
            None
        } else {
            let now = Instant::now();
            pace.read = Some(now);
            (now.saturating_duration_since(pace.last_work) < window.get()).then_some(now)
        };
        if let Some(now) = polling {
            idle_looks = idle_looks.wrapping_add(1);
            if runner == Runner::Host && !idle_looks.is_multiple_of(HOST_YIELD_EVERY) {
                std::hint::spin_loop();
            } else {
                // The NIC thread lets the application threads have the core (two cores);
                // a host, a thread woken onto its core ([`HOST_YIELD_EVERY`]). Neither
                // gives it to a CPU hog ([`crate::give_way`]).
                crate::give_way::yield_core_at(now);
            }
            continue;
        }
        let left = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Some(left),
                _ => return Ended::Deadline,
            },
            None => None,
        };
        let timeout = match (left, nic.poll_in()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Pairs with ring_doorbell's `posted`: either the host sees `sleeping` and wakes us,
        // or we see its doorbell here.
        shared.sleeping.raise();
        if shared.has_work() || done() {
            shared.sleeping.lower();
            continue;
        }
        let watch = nic.watch_fd();
        match nic.wake_events() {
            Some(events) => sleep_epoll(watch, events, timeout),
            None => sleep(Some(watch), None, timeout),
        }
        fresh = true;
        pace.read = None;
        shared.sleeping.lower();
        // The next turn's step takes what woke us, and learns from it.
        pace.slept = true;
        window.note_sleep();
    }
}

/// Runs the processor's turns, never sleeping, until a turn finds nothing to do or
/// `let_go()`.
pub(crate) fn run_until_idle<P: Processor>(
    shared: &Shared,
    nic: &mut P,
    let_go: &mut dyn FnMut() -> bool,
) -> RunEnd {
    loop {
        let mut worked = run_commands(shared, nic);
        worked |= run_doorbells(shared, nic);
        worked |= nic.step().worked();
        if let_go() {
            return RunEnd::LetGo;
        }
        if !worked {
            return RunEnd::Idle;
        }
    }
}

pub(crate) fn run_commands(shared: &Shared, nic: &mut impl Processor) -> bool {
    let mut worked = false;
    while let Some(cmd) = shared.commands.pop() {
        worked = true;
        nic.command(cmd);
    }
    worked
}

fn run_doorbells(shared: &Shared, nic: &mut impl Processor) -> bool {
    let mut worked = false;
    while let Some(qp) = shared.doorbells.pop() {
        worked = true;
        // The QP's creation may have been queued after our last look at the commands.
        run_commands(shared, nic);
        nic.doorbell(qp);
    }
    worked
}
