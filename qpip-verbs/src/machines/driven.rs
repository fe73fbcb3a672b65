//! Run to completion, the NIC's side ([`crate::drive`]): the processor behind a lock that a
//! host thread waiting on one of the queue's CQs takes to run the queue's turns itself, and
//! the NIC thread that runs them only while no host thread does.
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
//!   waits waits at most that long, as interrupt moderation delays an interrupt).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::handover::NEVER;
use super::shell::{NicThread, Processor, Shared, ShellConfig, Turns, drive, run_commands};
use crate::drive::{Driven, QueueDriver};
use crate::error::Result;

/// How long the NIC thread leaves the queue to its host threads after the last drive.
pub const GRACE: Duration = Duration::from_millis(20);

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

    /// The NIC thread's loop: drive while no host thread does, park otherwise.
    pub(crate) fn run_nic_thread(&self, spin: Duration) {
        let (shared, handover) = (&*self.shared, &self.shared.handover);
        let mut turns = Turns::new(spin);
        while self.park() {
            let Some(mut engine) = self.engine.try_lock() else {
                continue; // a host thread took it first
            };
            let mut let_go =
                || shared.stop.load(Ordering::Acquire) || handover.wanted.load(Ordering::Acquire);
            if !let_go() {
                drive(shared, &mut engine.0, &mut turns, &mut let_go, None);
            }
            // Straight to the host thread that asked, if it waits already; `wanted` stays
            // set until it has the processor, so this thread does not drive again before.
            parking_lot::MutexGuard::unlock_fair(engine);
            if handover.wanted.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        }
        // Last commands (QPs destroyed as the NIC's handles went) still run, so peers are told.
        let (nic, _) = &mut *self.engine.lock();
        run_commands(shared, nic);
        nic.stop();
    }

    /// Waits until the NIC thread should drive: nobody does while threads wait, commands
    /// came, or no host thread drove for its grace. False once the NIC stops.
    fn park(&self) -> bool {
        let (shared, h) = (&*self.shared, &self.shared.handover);
        let mut seen_drives = h.drives.load(Ordering::Acquire);
        loop {
            if shared.stop.load(Ordering::Acquire) {
                return false;
            }
            let seq = h.park.load(Ordering::SeqCst);
            if self.engine.is_locked() {
                let drives = h.drives.load(Ordering::Acquire);
                if drives != seen_drives {
                    // Host threads keep driving: look again after a grace period.
                    seen_drives = drives;
                    crate::futex::wait(&h.park, seq, Some(self.grace));
                    continue;
                }
                // One drive for a whole grace period (a waiter blocked on an idle
                // connection): sleep until its end wakes us.
                h.parked_untimed.store(true, Ordering::SeqCst);
                if self.engine.is_locked() && h.drives.load(Ordering::SeqCst) == seen_drives {
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
