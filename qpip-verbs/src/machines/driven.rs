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
//! The hand-over rules:
//! - a waiter takes the processor when it is free; when the NIC thread holds it and nobody
//!   else waits, the waiter asks for it (`wanted`, the waker) and the NIC thread lets go at
//!   its next look; when another host thread drives, the waiter sleeps on its CQ and the
//!   driver's completions wake it;
//! - a driver that leaves while others still wait wakes the NIC thread, which drives for them;
//! - the NIC thread stays parked for its grace ([`super::shell::ShellConfig::grace`],
//!   [`GRACE`] by default) after the last drive ended, so a thread that
//!   comes back to wait within it (a request–reply loop) finds the processor free and nobody
//!   to wake; past it, or on a command, the NIC thread drives again (what arrives while nobody
//!   waits waits at most that long, as interrupt moderation delays an interrupt);
//! - the NIC thread holds the processor only while there is work: idle, it lets go and
//!   watches the physical layer ([`Processor::watch_fd`]), so that a host thread that comes
//!   to wait on a queue idle for longer than the grace takes the processor at once (holding
//!   it while asleep cost every such wait two hand-overs: 4 KiB QD1 reads through the mount,
//!   whose rarely used connections' queues sat with their NIC threads, spent 110–150 ms of
//!   NIC thread per 10 000 requests).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::handover::NEVER;
use super::shell::{
    NicThread, Processor, Shared, ShellConfig, Turns, drive, run_commands, run_until_idle,
};
use crate::drive::{Driven, QueueDriver};
use crate::error::Result;

/// How long the NIC thread leaves the queue to its host threads after the last drive.
pub const GRACE: Duration = Duration::from_millis(20);

/// How long a watching NIC thread woken by a doorbell leaves it to the posting thread, which
/// usually comes to wait on its CQ within microseconds (a poster that never waits has its WRs
/// go out this much later).
const DOORBELL_WAIT: Duration = Duration::from_micros(100);

impl NicThread {
    /// [`Self::spawn`] for a processor that host threads may run too: a thread waiting on a
    /// CQ bound to this queue drives it ([`crate::drive`], [`Self::driver`]); the NIC thread
    /// runs it only while no host thread does.
    pub fn spawn_driven<P: Processor + Send + 'static>(
        cfg: ShellConfig,
        waker: mio::Waker,
        build: impl FnOnce() -> P + Send + 'static,
    ) -> Result<NicThread> {
        let shared = Shared::new(&cfg, waker);
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
    /// The processor, and what host threads driving it learned of arrivals.
    engine: Mutex<(P, Turns)>,
    grace: Duration,
}

impl<P: Processor + Send> DrivenQueue<P> {
    pub(crate) fn new(shared: Arc<Shared>, nic: P, grace: Duration) -> Self {
        DrivenQueue {
            shared,
            engine: Mutex::new((nic, Turns::host())),
            grace,
        }
    }

    /// The NIC thread's loop: drive while no host thread does, park otherwise. With a
    /// [`Processor::watch_fd`], it holds the processor only while there is work and watches
    /// the physical layer without it when idle, so that a host thread that comes to wait
    /// takes it at once instead of asking this thread to let go.
    pub(crate) fn run_nic_thread(&self, spin: Duration) {
        let (shared, handover) = (&*self.shared, &self.shared.handover);
        let mut turns = Turns::new(spin);
        let watch_fd = self.engine.lock().0.watch_fd();
        let mut act = self.park();
        while act {
            let Some(mut engine) = self.engine.try_lock() else {
                act = self.park(); // a host thread took it first
                continue;
            };
            let mut let_go =
                || shared.stop.load(Ordering::Acquire) || handover.wanted.load(Ordering::Acquire);
            let mut idle = false;
            if !let_go() {
                let nic = &mut engine.0;
                if watch_fd.is_none() {
                    drive(shared, nic, &mut turns, &mut let_go, None);
                } else if handover.waiters.load(Ordering::SeqCst) == 0 {
                    idle = run_until_idle(shared, nic, &mut let_go);
                } else {
                    // Host threads wait without driving (asleep behind a driver that left):
                    // drive for them, sleeping in the processor, while they do.
                    let mut until = || let_go() || handover.waiters.load(Ordering::SeqCst) == 0;
                    idle = drive(shared, nic, &mut turns, &mut until, None) && !let_go();
                }
            }
            // Straight to the host thread that asked, if it waits already; `wanted` stays
            // set until it has the processor, so this thread does not drive again before.
            parking_lot::MutexGuard::unlock_fair(engine);
            if handover.wanted.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            act = match watch_fd {
                Some(fd) if idle => self.watch(fd) || self.park(),
                _ => self.park(),
            };
        }
        // Last commands (QPs destroyed as the NIC's handles went) still run, so peers are told.
        let (nic, _) = &mut *self.engine.lock();
        run_commands(shared, nic);
        nic.stop();
    }

    /// Sleeps until `fd` (the physical layer) is readable or the waker rings (a doorbell, a
    /// command, a host thread that leaves work behind), without holding the processor. True
    /// when this thread should run the processor now; false when a host thread has taken it.
    fn watch(&self, fd: std::os::fd::RawFd) -> bool {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        h.watching.store(true, Ordering::SeqCst);
        // Pairs with the fences of ring_doorbell and of a drive's end: either they see
        // `watching` and ring the waker, or this sees their work.
        fence(Ordering::SeqCst);
        let pending = shared.stop.load(Ordering::Acquire)
            || shared.has_work()
            || h.resume.load(Ordering::Acquire)
            || h.waiters.load(Ordering::SeqCst) > 0;
        if !pending {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; the descriptor is the processor's and outlives it.
            unsafe { libc::poll(&mut pfd, 1, -1) };
        }
        h.watching.store(false, Ordering::SeqCst);
        if shared.has_work() && !shared.stop.load(Ordering::Acquire) {
            // A doorbell: its poster usually waits on its CQ right after and drives the
            // queue itself; give it that moment rather than take the processor from it.
            let seq = h.park.load(Ordering::SeqCst);
            if !self.engine.is_locked() {
                crate::futex::wait(&h.park, seq, Some(DOORBELL_WAIT));
            }
        }
        !self.engine.is_locked() || shared.stop.load(Ordering::Acquire)
    }

    /// Waits until the NIC thread should drive: nobody does while threads wait, commands
    /// came, or no host thread drove for its grace. False once the NIC stops.
    fn park(&self) -> bool {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        // None: no look yet. The first look at a held processor waits a grace period, timed:
        // the host thread it was just handed to may not have counted its drive yet, and
        // parking untimed behind it would have its end wake this thread (every request).
        let mut seen_drives = None;
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return false;
            }
            let seq = h.park.load(Ordering::SeqCst);
            if self.engine.is_locked() {
                let drives = h.drives.load(Ordering::Acquire);
                if seen_drives != Some(drives) {
                    // Host threads keep driving: look again after a grace period.
                    seen_drives = Some(drives);
                    crate::futex::wait(&h.park, seq, Some(self.grace));
                    continue;
                }
                // One drive for a whole grace period (a waiter blocked on an idle
                // connection): sleep until its end wakes us.
                h.parked_untimed.store(true, Ordering::SeqCst);
                if self.engine.is_locked() && h.drives.load(Ordering::SeqCst) == drives {
                    crate::futex::wait(&h.park, seq, None);
                }
                h.parked_untimed.store(false, Ordering::Relaxed);
                continue;
            }
            if h.resume.swap(false, Ordering::AcqRel)
                || h.waiters.load(Ordering::SeqCst) > 0
                || shared.has_work()
            {
                return true;
            }
            match h.since_last_drive() {
                Some(idle) if idle < self.grace => {
                    crate::futex::wait(&h.park, seq, Some(self.grace - idle))
                }
                _ => return true,
            }
        }
    }
}

impl<P: Processor + Send> QueueDriver for DrivenQueue<P> {
    fn drive(
        &self,
        driving: &AtomicU32,
        ready: &dyn Fn() -> bool,
        spin: Duration,
        deadline: Option<Instant>,
    ) -> Driven {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        let stopped = || shared.stop.load(Ordering::Acquire) || shared.dead.load(Ordering::Acquire);
        if stopped() {
            return Driven::Busy;
        }
        let alone = h.waiters.load(Ordering::SeqCst) == 1;
        // Not while another waiter has asked for it: it may be what we wait for.
        let free = if h.wanted.load(Ordering::Acquire) {
            None
        } else {
            self.engine.try_lock()
        };
        let nic = match free {
            Some(nic) => Some(nic),
            // Only waiter: the holder is the NIC thread (or a driver on its way out, which
            // lets go at once); ask for it and wait.
            None if alone => {
                h.wanted.store(true, Ordering::SeqCst);
                shared.wake();
                let nic = self.engine.lock();
                h.wanted.store(false, Ordering::Release);
                Some(nic)
            }
            None => None,
        };
        let Some(mut engine) = nic else {
            return Driven::Busy;
        };
        let (nic, turns) = &mut *engine;
        turns.set_max(spin);
        h.drives.fetch_add(1, Ordering::AcqRel);
        driving.fetch_add(1, Ordering::SeqCst);
        let accounting = h.accounting.load(Ordering::Relaxed);
        let cpu0 = if accounting {
            thread_cpu()
        } else {
            Duration::ZERO
        };
        let mut done = || ready() || stopped() || h.wanted.load(Ordering::Acquire);
        let finished = !stopped() && drive(shared, nic, turns, &mut done, deadline);
        if accounting {
            let cpu = thread_cpu().saturating_sub(cpu0);
            h.driven_cpu_ns
                .fetch_add(cpu.as_nanos() as u64, Ordering::Relaxed);
        }
        driving.fetch_sub(1, Ordering::SeqCst);
        let sending = nic.sending();
        drop(engine);
        if sending {
            h.resume.store(true, Ordering::Release);
        }
        let now = h.epoch.elapsed().as_nanos().min(u128::from(NEVER - 1)) as u64;
        h.last_exit.store(now, Ordering::Release);
        // Pairs with the parked NIC thread's store-then-look.
        fence(Ordering::SeqCst);
        let others = h.waiters.load(Ordering::SeqCst) > 1;
        if sending || others || shared.has_work() || h.parked_untimed.load(Ordering::SeqCst) {
            h.kick();
            if h.watching.load(Ordering::SeqCst) {
                shared.wake();
            }
        }
        match (finished, ready()) {
            (true, true) => Driven::Ready,
            // Stopped, or another waiter asked for the queue: sleep behind it.
            (true, false) => Driven::Busy,
            (false, _) => Driven::TimedOut,
        }
    }

    fn begin_wait(&self) {
        self.shared.handover.waiters.fetch_add(1, Ordering::SeqCst);
    }

    fn end_wait(&self) {
        self.shared.handover.waiters.fetch_sub(1, Ordering::SeqCst);
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
    }

    impl PipeNic {
        fn turn(&mut self, timeout: Option<Duration>) -> bool {
            self.poll.poll(&mut self.events, timeout).unwrap();
            let mut any = false;
            for e in self.events.iter() {
                if e.token() == PIPE {
                    let mut buf = [0u8; 64];
                    while matches!(self.pipe.read(&mut buf), Ok(n) if n > 0) {}
                    self.turns_with_bytes.fetch_add(1, Ordering::SeqCst);
                    any = true;
                }
            }
            any
        }
    }

    impl Processor for PipeNic {
        fn command(&mut self, _: Command) {}
        fn doorbell(&mut self, _: QpNum) {}
        fn step(&mut self) -> bool {
            self.turn(Some(Duration::ZERO))
        }
        fn sleep(&mut self, timeout: Option<Duration>) -> bool {
            self.turn(timeout)
        }
        fn stop(&mut self) {}
        fn watch_fd(&self) -> Option<RawFd> {
            Some(self.poll.as_raw_fd())
        }
    }

    fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::yield_now();
        }
    }

    /// The NIC thread runs what arrives while no host thread waits, then lets go of the
    /// processor and watches the physical layer without it: a host thread that comes to wait
    /// takes the processor at once instead of asking the NIC thread for it.
    #[test]
    fn an_idle_nic_thread_watches_without_holding_the_processor() {
        let poll = Poll::new().unwrap();
        let waker = mio::Waker::new(poll.registry(), WAKER).unwrap();
        let mut fds = [0; 2];
        // SAFETY: a valid two-element array for pipe2.
        let made = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) };
        assert_eq!(made, 0);
        // SAFETY: pipe2 made both descriptors; each File owns one.
        let (read, mut write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        poll.registry()
            .register(&mut SourceFd(&read.as_raw_fd()), PIPE, Interest::READABLE)
            .unwrap();
        let cfg = ShellConfig {
            name: "test-nic",
            spin: Duration::ZERO,
            doorbell_fifo: None,
            grace: Duration::from_millis(1),
        };
        let shared = Shared::new(&cfg, waker);
        let counted = Arc::new(AtomicUsize::new(0));
        let nic = PipeNic {
            poll,
            events: Events::with_capacity(8),
            pipe: read,
            turns_with_bytes: counted.clone(),
        };
        let queue = Arc::new(DrivenQueue::new(shared.clone(), nic, cfg.grace));
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
}
