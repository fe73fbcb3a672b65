//! Run to completion, the NIC's side ([`crate::drive`]): the processor behind a lock that a
//! host thread waiting on one of the queue's CQs takes to run the queue's turns itself, and
//! the NIC thread that runs them only while no host thread does.
//!
//! Who owns the queue's engine (the [`DrivenQueue`] and its processor, with the processor's
//! sockets and epoll): its [`NicThread`], whose owner is the backend (one owner, no cycle).
//! Besides it, only for a while: the NIC thread until it ends, and a host thread inside a CQ
//! wait. Everything else refers to it weakly: a CQ bound to it
//! ([`crate::shared::CqShared::bind_driver`]), since a CQ may outlive the NIC; and the
//! processor itself must hold nothing that owns its `NicThread` (the soft NIC's engines reach
//! their sibling queues through a `Weak`). So when the NIC goes, [`NicThread::shutdown`]
//! ends the thread (its last commands run, then [`Processor::stop`]) and dropping the
//! `NicThread` drops the processor, closing every descriptor it holds (a thread still in a CQ
//! wait drops it when its wait returns; the stopped queue no longer drives it).
//!
//! The hand-over decisions are [`crate::drive::rules`]'s; this file only reads the shared
//! flags ([`super::handover`]) into the rules' looks and carries out their actions, with the
//! fences the wake table of [`crate::drive`] names.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::drive::rules::{
    self, Approach, Arrival, Call, Departure, Ended, IfHeld, NicAction, NicLook, Raised, Run,
    RunEnd,
};
use crate::drive::sleep::sleep;
use crate::drive::sync::posted;
use crate::drive::{Driven, QueueDriver, Waiting};
use crate::error::Result;
use crate::machines::shell::{
    NicThread, Pace, Processor, Shared, ShellConfig, Turns, drive, drive_host, run_commands,
    run_until_idle,
};
use crate::poll_window::KeptWindow;

impl NicThread {
    /// [`Self::spawn`] for a processor that host threads may run too: a thread waiting on a
    /// CQ bound to this queue drives it ([`crate::drive`], [`Self::driver`]); the NIC thread
    /// runs it only while no host thread does. `Send` is what says a processor may run on
    /// any thread: one tied to the thread that made it (an io_uring's, whose submitter owns
    /// it) is not, so it cannot be bound to host drivers.
    pub fn spawn_driven<P: Processor + Send + 'static>(
        cfg: ShellConfig,
        waker: mio::Waker,
        build: impl FnOnce() -> P + Send + 'static,
    ) -> Result<NicThread> {
        let shared = Shared::new(&cfg, waker)?;
        let (spin, grace) = (cfg.spin, cfg.grace);
        Self::start(cfg, shared, move |shared, started| {
            let engine = Arc::new(DrivenQueue::new(shared.clone(), build(), grace));
            let _ = started.send(Some(engine.clone() as Arc<dyn QueueDriver>));
            engine.run_nic_thread(spin);
        })
    }
}

/// A queue whose processor the NIC thread and host threads take turns to run.
pub(crate) struct DrivenQueue<P> {
    shared: Arc<Shared>,
    /// The processor, and the pace of its work as host threads driving it saw it (each
    /// brings its CQ's poll window).
    engine: Mutex<(P, Pace)>,
    grace: Duration,
}

impl<P: Processor + Send> DrivenQueue<P> {
    pub(crate) fn new(shared: Arc<Shared>, nic: P, grace: Duration) -> Self {
        DrivenQueue {
            shared,
            engine: Mutex::new((nic, Pace::new())),
            grace,
        }
    }

    /// The NIC thread's loop, one turn per decision of [`rules::NicThreadRules`]: look at the
    /// shared flags, ask, carry out the action — drive while no host thread does, park
    /// otherwise, and when idle watch the processor's descriptor
    /// ([`Processor::watch_fd`]) without the processor, so that a host thread that comes to
    /// wait takes it at once instead of asking this thread to let go. Its one sleep is
    /// [`Self::sleep`]'s.
    pub(crate) fn run_nic_thread(&self, spin: Duration) {
        let mut nic_rules = rules::NicThreadRules::new(self.grace);
        let mut turns = Turns::new(spin);
        let watch_fd = self.engine.lock().0.watch_fd();
        loop {
            match nic_rules.next(self.look(), Instant::now()) {
                NicAction::Drive(run) => nic_rules.drove(self.drive_nic(run, &mut turns)),
                NicAction::Sleep(s) => self.sleep(s, watch_fd),
                NicAction::Stop => break,
            }
        }
        // Last commands (QPs destroyed as the NIC's handles went) still run, so peers are told.
        let (nic, _) = &mut *self.engine.lock();
        run_commands(&self.shared, nic);
        nic.stop();
    }

    /// What the NIC thread sees: every look of its loop is this one.
    fn look(&self) -> NicLook {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        NicLook {
            stop: shared.stop.load(Ordering::Acquire),
            held: self.engine.is_locked(),
            drives: h.drives.load(Ordering::Acquire),
            wanted: h.wanted.load(Ordering::Acquire),
            waiters: h.waiters.load(Ordering::SeqCst),
            work: shared.has_work(),
            resume: h.resume.load(Ordering::Acquire),
            last_drive_end: h.last_drive_end(),
        }
    }

    /// [`NicAction::Drive`]: takes the processor unless a host thread holds it, runs it as
    /// `run` says, and lets go.
    fn drive_nic(&self, run: Run, turns: &mut Turns) -> RunEnd {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        // The take serves a leaving driver's request to carry on its sends: this thread
        // runs the processor, or the host thread that holds it does (and asks again as it
        // leaves). Cleared here, not where it is seen: looks only read.
        h.resume.swap(false, Ordering::AcqRel);
        let Some(mut engine) = self.engine.try_lock() else {
            return RunEnd::Busy;
        };
        let mut let_go = || shared.stop.load(Ordering::Acquire) || h.wanted.load(Ordering::Acquire);
        let nic = &mut engine.0;
        let end = match run {
            Run::LetGo => RunEnd::LetGo,
            Run::UntilIdle => run_until_idle(shared, nic, &mut let_go),
            Run::ForWaiters => {
                let mut until = || let_go() || h.waiters.load(Ordering::SeqCst) == 0;
                drive(shared, nic, turns, &mut until, None);
                if let_go() {
                    RunEnd::LetGo
                } else {
                    RunEnd::Idle
                }
            }
        };
        // Straight to the host thread that asked, if it waits already; `wanted` stays set
        // until it has the processor, so this thread does not drive again before.
        parking_lot::MutexGuard::unlock_fair(engine);
        if h.wanted.load(Ordering::Acquire) {
            crate::give_way::yield_core();
        }
        end
    }

    /// [`NicAction::Sleep`], the NIC thread's one sleep: on its kick, and on `watch_fd`
    /// (the processor's) when the rules say, announced by the flag they name. The flag's
    /// raise and the look after its fence pair with the wakers that post without kicking
    /// (the wake table of [`crate::drive`]): either they see the flag and wake this thread,
    /// or the look sees what they posted and the sleep does not begin.
    fn sleep(&self, s: rules::Sleep, watch_fd: RawFd) {
        let h = &self.shared.handover;
        let flag = s.raised.map(|r| match r {
            Raised::ParkedUntimed { .. } => &h.parked_untimed,
            Raised::Watching => &h.watching,
        });
        if let Some(flag) = flag {
            flag.raise();
        }
        if s.raised.is_none_or(|r| r.sleeps(&self.look())) {
            sleep(s.fd.then_some(watch_fd), Some(&h.kick), s.timeout);
        }
        if let Some(flag) = flag {
            flag.lower();
        }
    }
}

impl<P: Processor + Send> QueueDriver for DrivenQueue<P> {
    fn begin_wait(&self) -> Waiting<'_> {
        Waiting::new(&self.shared.handover.waiters)
    }

    fn drive(
        &self,
        _wait: &Waiting<'_>,
        driving: &AtomicU32,
        window: &KeptWindow,
        ready: &dyn Fn() -> bool,
        spin: Duration,
        deadline: Option<Instant>,
    ) -> Driven {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        let stopped = || shared.stop.load(Ordering::Acquire) || shared.dead.load(Ordering::Acquire);
        let approach = rules::arrive(Arrival {
            gone: stopped(),
            wanted: h.wanted.load(Ordering::Acquire),
            waiters: h.waiters.load(Ordering::SeqCst),
        });
        let taken = match approach {
            Approach::Gone => return Driven::Busy,
            Approach::Take(if_held) => self.engine.try_lock().ok_or(if_held),
            Approach::Held(if_held) => Err(if_held),
        };
        let mut engine = match taken {
            Ok(engine) => engine,
            Err(IfHeld::Ask) => {
                h.wanted.store(true, Ordering::Release);
                shared.wake();
                let engine = self.engine.lock();
                h.wanted.store(false, Ordering::Release);
                engine
            }
            Err(IfHeld::SleepBehind) => return Driven::Busy,
        };
        let (nic, pace) = &mut *engine;
        let mut learned = window.resume(spin);
        h.drives.fetch_add(1, Ordering::AcqRel);
        driving.fetch_add(1, Ordering::Relaxed);
        let accounting = h.accounting.load(Ordering::Relaxed);
        let cpu0 = if accounting {
            thread_cpu()
        } else {
            Duration::ZERO
        };
        let mut done = || ready() || stopped() || h.wanted.load(Ordering::Acquire);
        let ended = if stopped() {
            Ended::Deadline
        } else {
            drive_host(shared, nic, pace, &mut learned, &mut done, deadline)
        };
        window.keep(&learned);
        if accounting {
            let cpu = thread_cpu().saturating_sub(cpu0);
            h.driven_cpu_ns
                .fetch_add(cpu.as_nanos() as u64, Ordering::Relaxed);
        }
        driving.fetch_sub(1, Ordering::Relaxed);
        let sending = nic.sending();
        let ended_at = pace.now();
        drop(engine);
        if sending {
            h.resume.store(true, Ordering::Release);
        }
        h.drive_ended(ended_at);
        // Pairs with the parked NIC thread's `parked_untimed`: either it sees this drive
        // ended, or this sees it asleep without a timer.
        posted();
        let call = rules::leave(Departure {
            sending,
            waiters: h.waiters.load(Ordering::SeqCst),
            work: shared.has_work(),
            parked_untimed: h.parked_untimed.raised(),
        });
        if call == Call::NicThread {
            h.kick();
        }
        rules::outcome(ended, ready())
    }

    fn interrupt(&self) {
        self.shared.wake();
    }
}

/// The calling thread's CPU time (a system call: thread clocks have no vDSO path; one pair per
/// drive, against the drive's own system calls).
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Command;
    use crate::machines::shell::Progress;
    use crate::poll_window::PollWindow;
    use crate::wr::QpNum;
    use mio::unix::SourceFd;
    use mio::{Events, Interest, Poll, Token};
    use std::fs::File;
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, RawFd};
    use std::sync::atomic::AtomicUsize;

    const WAKER: Token = Token(0);
    const PIPE: Token = Token(1);

    /// A processor whose physical layer is a pipe: each turn that finds bytes in it counts.
    struct PipeNic {
        poll: Poll,
        events: Events,
        pipe: File,
        turns_with_bytes: Arc<AtomicUsize>,
        /// Non-blocking looks at the pipe (a thread polling rather than sleeping).
        steps: Arc<AtomicUsize>,
        /// The same looks through `Processor::poll` (a host thread polling its window).
        polls: Arc<AtomicUsize>,
    }

    impl PipeNic {
        fn look(&mut self) -> Progress {
            self.poll
                .poll(&mut self.events, Some(Duration::ZERO))
                .unwrap();
            let mut any = Progress::Idle;
            for e in self.events.iter() {
                if e.token() == PIPE {
                    let mut buf = [0u8; 64];
                    while matches!(self.pipe.read(&mut buf), Ok(n) if n > 0) {}
                    self.turns_with_bytes.fetch_add(1, Ordering::SeqCst);
                    any = Progress::Worked;
                }
            }
            any
        }
    }

    impl Processor for PipeNic {
        fn command(&mut self, _: Command) {}
        fn doorbell(&mut self, _: QpNum) {}
        fn step(&mut self) -> Progress {
            self.steps.fetch_add(1, Ordering::SeqCst);
            self.look()
        }
        fn poll(&mut self) -> Progress {
            self.polls.fetch_add(1, Ordering::SeqCst);
            self.look()
        }
        fn stop(&mut self) {}
        fn watch_fd(&self) -> RawFd {
            self.poll.as_raw_fd()
        }
    }

    fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::yield_now();
        }
    }

    /// A driven queue over a [`PipeNic`], with the pipe's write end, the count of turns
    /// that found bytes and the counts of steps and polls.
    struct PipeQueue {
        queue: Arc<DrivenQueue<PipeNic>>,
        shared: Arc<Shared>,
        write: File,
        counted: Arc<AtomicUsize>,
        steps: Arc<AtomicUsize>,
        polls: Arc<AtomicUsize>,
    }

    fn pipe_queue() -> PipeQueue {
        let poll = Poll::new().unwrap();
        let waker = mio::Waker::new(poll.registry(), WAKER).unwrap();
        let mut fds = [0; 2];
        // SAFETY: a valid two-element array for pipe2.
        let made = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) };
        assert_eq!(made, 0);
        // SAFETY: pipe2 made both descriptors; each File owns one.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        poll.registry()
            .register(&mut SourceFd(&read.as_raw_fd()), PIPE, Interest::READABLE)
            .unwrap();
        let cfg = ShellConfig {
            name: "test-nic",
            spin: Duration::ZERO,
            doorbell_fifo: None,
            grace: Duration::from_millis(1),
        };
        let shared = Shared::new(&cfg, waker).unwrap();
        let counter = || Arc::new(AtomicUsize::new(0));
        let (counted, steps, polls) = (counter(), counter(), counter());
        let nic = PipeNic {
            poll,
            events: Events::with_capacity(8),
            pipe: read,
            turns_with_bytes: counted.clone(),
            steps: steps.clone(),
            polls: polls.clone(),
        };
        let queue = Arc::new(DrivenQueue::new(shared.clone(), nic, cfg.grace));
        PipeQueue {
            queue,
            shared,
            write,
            counted,
            steps,
            polls,
        }
    }

    /// The NIC thread runs what arrives while no host thread waits, then lets go of the
    /// processor and watches the physical layer without it: a host thread that comes to wait
    /// takes the processor at once instead of asking the NIC thread for it.
    #[test]
    fn an_idle_nic_thread_watches_without_holding_the_processor() {
        let PipeQueue {
            queue,
            shared,
            mut write,
            counted,
            ..
        } = pipe_queue();
        let nic_thread = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.run_nic_thread(Duration::ZERO))
        };
        for round in 1..=3 {
            write.write_all(b"x").unwrap();
            wait_until("the NIC thread took the bytes", || {
                counted.load(Ordering::SeqCst) >= round
            });
            wait_until("the idle NIC thread let go of the processor", || {
                !queue.engine.is_locked()
            });
        }
        shared.stop.store(true, Ordering::SeqCst);
        shared.wake();
        shared.handover.kick();
        nic_thread.join().unwrap();
    }

    /// Every sleep of the NIC thread takes its kick: watching the processor's descriptor, it
    /// wakes for a driver that left sends under way without the waker being rung. And that
    /// request to carry on its sends (`resume`) is served once: the kicked NIC thread drives,
    /// then goes back to sleep instead of skipping every watch.
    #[test]
    fn a_resumed_nic_thread_drives_once_then_sleeps_again() {
        let PipeQueue {
            queue,
            shared,
            mut write,
            counted,
            steps,
            ..
        } = pipe_queue();
        let nic_thread = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.run_nic_thread(Duration::ZERO))
        };
        write.write_all(b"x").unwrap();
        wait_until("the NIC thread took the bytes", || {
            counted.load(Ordering::SeqCst) >= 1
        });
        wait_until("the NIC thread watches", || {
            shared.handover.watching.raised() && !queue.engine.is_locked()
        });
        let steps0 = steps.load(Ordering::SeqCst);
        shared.handover.resume.store(true, Ordering::Release);
        shared.handover.kick();
        wait_until("the kicked NIC thread stepped", || {
            steps.load(Ordering::SeqCst) > steps0
        });
        // Asleep again: no step for a while (a NIC thread that keeps skipping its watch
        // steps thousands of times meanwhile).
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let before = steps.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            if steps.load(Ordering::SeqCst) == before {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the NIC thread never slept again"
            );
        }
        shared.stop.store(true, Ordering::SeqCst);
        shared.wake();
        shared.handover.kick();
        nic_thread.join().unwrap();
    }

    /// A host thread that never polls (a CQ spin of zero) does not step before it sleeps:
    /// its sleep returns at once if something is ready, and the one step after it takes
    /// what woke it (one system call per wait, as a blocking socket's).
    #[test]
    fn a_host_that_never_polls_steps_only_after_its_sleep() {
        let PipeQueue {
            queue,
            mut write,
            counted,
            steps,
            ..
        } = pipe_queue();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            write.write_all(b"x").unwrap();
        });
        let driving = AtomicU32::new(0);
        let wait = queue.begin_wait();
        let ready = || counted.load(Ordering::SeqCst) >= 1;
        let deadline = Some(Instant::now() + Duration::from_secs(10));
        let window = KeptWindow::default();
        let driven = queue.drive(&wait, &driving, &window, &ready, Duration::ZERO, deadline);
        assert_eq!(driven, Driven::Ready);
        writer.join().unwrap();
        assert_eq!(steps.load(Ordering::SeqCst), 1);
    }

    /// A host thread looks through `Processor::poll` (where a processor may read its one
    /// socket without the descriptor) only while its CQ's waits are caught by polling, and
    /// steps again once it has slept; the NIC thread, which sleeps on the descriptor, only
    /// steps.
    #[test]
    fn only_a_host_whose_waits_polling_catches_looks_without_the_descriptor() {
        let PipeQueue {
            queue,
            shared,
            write,
            counted,
            steps,
            polls,
        } = pipe_queue();
        let later = |mut w: File| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(1));
                w.write_all(b"x").unwrap();
                w
            })
        };
        let driving = AtomicU32::new(0);
        let window = KeptWindow::default();
        let spin = Duration::from_millis(100);
        let deadline = || Some(Instant::now() + Duration::from_secs(10));
        let drive_until = |turns: usize| {
            let wait = queue.begin_wait();
            let ready = || counted.load(Ordering::SeqCst) >= turns;
            queue.drive(&wait, &driving, &window, &ready, spin, deadline())
        };

        // A CQ whose waits have not been caught by polling: its host steps.
        let writer = later(write);
        assert_eq!(drive_until(1), Driven::Ready);
        let w = writer.join().unwrap();
        assert_eq!(polls.load(Ordering::SeqCst), 0, "a sleeping host polled");
        let slept_steps = steps.load(Ordering::SeqCst);
        assert!(slept_steps >= 1);

        // Waits that polling caught (their completion was there): then the host reads
        // directly until it sleeps, and steps after the sleep.
        for _ in 0..PollWindow::CAUGHT_WAITS {
            assert_eq!(drive_until(1), Driven::Ready);
        }
        let writer = later(w);
        assert_eq!(drive_until(2), Driven::Ready);
        let mut w = writer.join().unwrap();
        let host_polls = polls.load(Ordering::SeqCst);
        assert!(host_polls >= 1, "the polling host never polled");
        assert!(
            steps.load(Ordering::SeqCst) > slept_steps,
            "the host did not step after its sleep"
        );

        let nic_thread = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.run_nic_thread(Duration::from_millis(1)))
        };
        w.write_all(b"x").unwrap();
        wait_until("the NIC thread took the bytes", || {
            counted.load(Ordering::SeqCst) >= 3
        });
        assert!(steps.load(Ordering::SeqCst) >= 1);
        assert_eq!(
            polls.load(Ordering::SeqCst),
            host_polls,
            "the NIC thread polled"
        );
        shared.stop.store(true, Ordering::SeqCst);
        shared.wake();
        shared.handover.kick();
        nic_thread.join().unwrap();
    }

    /// Each CQ's waiters learn their own poll window: a CQ whose completions come back soon
    /// after each sleep comes to poll before sleeping, and a CQ of the same queue whose
    /// completions come rarely still sleeps at once, whatever the other learned.
    #[test]
    fn each_cq_learns_its_own_poll_window() {
        let PipeQueue {
            queue,
            write,
            counted,
            steps,
            ..
        } = pipe_queue();
        let (driving, spin) = (AtomicU32::new(0), Duration::from_millis(100));
        let deadline = || Some(Instant::now() + Duration::from_secs(10));
        // The busy CQ: each arrival at least 1 ms after its waiter began to wait, so its
        // window doubles from 10 µs on each sleep until it outlasts the gap (an arrival its
        // polling then catches leaves it as it is): at least 1 ms after 12 rounds.
        let busy = KeptWindow::default();
        let mut write = Some(write);
        for round in 1..=12 {
            let mut w = write.take().unwrap();
            let writer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(1));
                w.write_all(b"x").unwrap();
                w
            });
            let wait = queue.begin_wait();
            let ready = || counted.load(Ordering::SeqCst) >= round;
            let driven = queue.drive(&wait, &driving, &busy, &ready, spin, deadline());
            assert_eq!(driven, Driven::Ready);
            write = Some(writer.join().unwrap());
        }
        let learned = busy.resume(spin).get();
        assert!(
            learned >= Duration::from_millis(1),
            "the busy CQ learned {learned:?}"
        );
        // The quiet CQ, 20 ms later: its waiter has learned nothing and sleeps at once.
        let quiet = KeptWindow::default();
        let mut w = write.take().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.write_all(b"x").unwrap();
        });
        let steps0 = steps.load(Ordering::SeqCst);
        let wait = queue.begin_wait();
        let ready = || counted.load(Ordering::SeqCst) >= 13;
        let driven = queue.drive(&wait, &driving, &quiet, &ready, spin, deadline());
        assert_eq!(driven, Driven::Ready);
        writer.join().unwrap();
        let polled = steps.load(Ordering::SeqCst) - steps0;
        assert!(polled < 10, "the quiet CQ's waiter polled {polled} times");
    }
}
