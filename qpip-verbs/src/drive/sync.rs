//! The sleepers' side of the wake table's store-buffering pairs ([`crate::drive`]): a thread
//! about to sleep raises its flag (or counts itself), fences, then looks for work one last
//! time; a thread that posts work makes it visible, fences ([`posted`]), then reads the flags
//! and wakes whom it finds. With `fence(SeqCst)` on both sides at least one sees the other,
//! so no wake-up is lost; the flags themselves need no stronger ordering than `Relaxed`.
//!
//! Built over loom's atomics under `--cfg qpip_loom`, where the models below check these
//! pairs (`RUSTFLAGS="--cfg qpip_loom" cargo test -p qpip-verbs --release --lib loom`).

#[cfg(qpip_loom)]
use loom::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
#[cfg(not(qpip_loom))]
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};

/// The poster's half of every pair: what it wrote before (a push, a flag) is visible to a
/// sleeper that raises its flag after this, or the flags it reads after this show the
/// sleeper.
#[inline]
pub(crate) fn posted() {
    fence(Ordering::SeqCst);
}

/// A flag a thread raises while it sleeps (or is about to).
#[derive(Debug)]
pub(crate) struct SleepFlag(AtomicBool);

impl SleepFlag {
    /// Lowered.
    pub(crate) fn new() -> Self {
        SleepFlag(AtomicBool::new(false))
    }

    /// Raises the flag; the caller's looks that follow see whatever was posted before a
    /// poster's [`posted`] that did not see the flag.
    #[inline]
    pub(crate) fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Lowers it (awake again: a wake-up is no longer needed).
    #[inline]
    pub(crate) fn lower(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    /// Whether the sleeper has raised it (a poster asks after [`posted`]).
    #[inline]
    pub(crate) fn raised(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The threads that sleep (or are about to) on one futex: [`SleepFlag`] for several.
#[derive(Debug)]
pub(crate) struct SleepCount(AtomicU32);

impl SleepCount {
    /// Nobody.
    pub(crate) fn new() -> Self {
        SleepCount(AtomicU32::new(0))
    }

    /// Counts the caller in; its looks that follow see whatever was posted before a poster's
    /// [`posted`] that did not count it.
    #[inline]
    pub(crate) fn enter(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Counts the caller out.
    #[inline]
    pub(crate) fn leave(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }

    /// Sleepers counted in (a poster asks after [`posted`]).
    #[inline]
    pub(crate) fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Models of the pairs: every interleaving and every outcome the memory model allows, for two
/// threads — a sleeper that announces itself and looks, a poster that posts and looks. The
/// property: if the sleeper goes to sleep (saw no work), the poster saw it and wakes it.
#[cfg(all(test, qpip_loom))]
mod loom_models {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;

    /// The doorbell and its sleeping engine (`ring_doorbell` against `shell::drive`'s sleep on
    /// the processor's descriptor; the watching NIC thread is the same pair).
    #[test]
    fn loom_doorbell_and_sleep_lose_no_wake_up() {
        loom::model(|| {
            let sleeping = Arc::new(SleepFlag::new());
            let fifo = Arc::new(AtomicBool::new(false));
            let poster = {
                let (sleeping, fifo) = (sleeping.clone(), fifo.clone());
                loom::thread::spawn(move || {
                    fifo.store(true, Ordering::Release);
                    posted();
                    sleeping.raised() // rings the waker
                })
            };
            sleeping.raise();
            let saw_work = fifo.load(Ordering::Acquire);
            let woken = poster.join().unwrap();
            assert!(saw_work || woken, "the engine slept through a doorbell");
        });
    }

    /// A CQ waiter and the NIC's completion (`CompletionQueue::wait`'s sleep against
    /// `CqShared::notify`), with a second waiter that counts itself in and out meanwhile.
    #[test]
    fn loom_cq_wait_and_completion_lose_no_wake_up() {
        loom::model(|| {
            let sleepers = Arc::new(SleepCount::new());
            let ring = Arc::new(AtomicBool::new(false));
            let nic = {
                let (sleepers, ring) = (sleepers.clone(), ring.clone());
                loom::thread::spawn(move || {
                    ring.store(true, Ordering::Release);
                    posted();
                    sleepers.get() > 0 // bumps the futex word and wakes
                })
            };
            let other = {
                let sleepers = sleepers.clone();
                loom::thread::spawn(move || {
                    sleepers.enter();
                    sleepers.leave();
                })
            };
            sleepers.enter();
            let polled = ring.load(Ordering::Acquire);
            let woken = nic.join().unwrap();
            other.join().unwrap();
            assert!(polled || woken, "the waiter slept through its completion");
        });
    }

    /// A `CqWaker` against a waiter that drives its queue (`CqShared::wake` against
    /// `QueueDriver::drive`): the driver's count in `driving` has no fence of its own; the
    /// fence of the sleep it announces before it sleeps in the processor orders it.
    #[test]
    fn loom_cq_wake_reaches_a_driver_about_to_sleep() {
        loom::model(|| {
            let driving = Arc::new(AtomicU32::new(0));
            let woken = Arc::new(AtomicBool::new(false));
            let waker = {
                let (driving, woken) = (driving.clone(), woken.clone());
                loom::thread::spawn(move || {
                    woken.store(true, Ordering::Release);
                    posted();
                    driving.load(Ordering::Relaxed) > 0 // interrupts the driver
                })
            };
            driving.fetch_add(1, Ordering::Relaxed);
            SleepFlag::new().raise(); // `Shared::sleeping`, before the last look
            let news = woken.load(Ordering::Acquire);
            let interrupted = waker.join().unwrap();
            assert!(news || interrupted, "the driver slept through a wake");
        });
    }

    /// A drive's end against the NIC thread parked until it ends (`DrivenQueue::drive`'s
    /// departure against `DrivenQueue::sleep` with `Raised::ParkedUntimed`): the driver lets
    /// go of the engine lock and stores its end, fences, and kicks if it sees
    /// `parked_untimed`; the NIC thread raises it, fences, and sleeps only if the drive still
    /// holds the lock.
    #[test]
    fn loom_drive_end_reaches_the_nic_thread_parked_untimed() {
        loom::model(|| {
            let parked_untimed = Arc::new(SleepFlag::new());
            let held = Arc::new(AtomicBool::new(true));
            let driver = {
                let (parked_untimed, held) = (parked_untimed.clone(), held.clone());
                loom::thread::spawn(move || {
                    held.store(false, Ordering::Release); // the engine lock let go
                    posted();
                    parked_untimed.raised() // kicks
                })
            };
            parked_untimed.raise();
            let still_held = held.load(Ordering::Acquire);
            let kicked = driver.join().unwrap();
            assert!(
                !still_held || kicked,
                "the NIC thread slept through the drive's end"
            );
        });
    }
}
