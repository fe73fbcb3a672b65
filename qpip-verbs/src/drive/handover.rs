//! Run to completion's hand-over ([`crate::drive`]): what host threads driving a queue and
//! its NIC thread share to pass the processor between them. The NIC thread's [`crate::machines::shell`]
//! keeps it with the rest of what host and NIC share; the rules that use it are
//! [`super::driven`]'s.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::drive::sleep::Kick;
use crate::drive::sync::SleepFlag;

const NEVER: u64 = u64::MAX;

/// What host drivers and the NIC thread share to hand the processor over.
pub(crate) struct Handover {
    /// Host threads in a CQ wait on this queue (driving it or asleep behind its driver).
    pub(crate) waiters: AtomicU32,
    /// A waiting host thread asks the NIC thread to let go of the processor.
    pub(crate) wanted: AtomicBool,
    /// A driver left with sends still under way: the NIC thread carries on at once (its
    /// next take of the processor clears it).
    pub(crate) resume: AtomicBool,
    /// Wakes the NIC thread wherever it sleeps ([`crate::drive::sleep`]).
    pub(crate) kick: Kick,
    /// The NIC thread sleeps without a timer behind a long drive: its end must wake it.
    pub(crate) parked_untimed: SleepFlag,
    /// The NIC thread watches the physical layer without holding the processor
    /// ([`crate::machines::shell::Processor::watch_fd`]): a doorbell must ring the waker.
    pub(crate) watching: SleepFlag,
    /// Host drives begun (tells a busy queue from one long drive).
    pub(crate) drives: AtomicU64,
    /// When the last host drive ended (ns since `epoch`; [`NEVER`] before the first).
    pub(crate) last_exit: AtomicU64,
    /// CPU time host threads spent driving (ns): the NIC's work done on them. Counted from
    /// the first time someone asks ([`Handover::driven_cpu`]): a thread's CPU clock costs a
    /// system call, two per drive.
    pub(crate) driven_cpu_ns: AtomicU64,
    /// Someone asked for [`Handover::driven_cpu`]: drives count their CPU time.
    pub(crate) accounting: AtomicBool,
    /// What `last_exit` counts from.
    pub(crate) epoch: Instant,
}

impl Handover {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Handover {
            waiters: AtomicU32::new(0),
            wanted: AtomicBool::new(false),
            resume: AtomicBool::new(false),
            kick: Kick::new()?,
            parked_untimed: SleepFlag::new(),
            watching: SleepFlag::new(),
            drives: AtomicU64::new(0),
            last_exit: AtomicU64::new(NEVER),
            driven_cpu_ns: AtomicU64::new(0),
            accounting: AtomicBool::new(false),
            epoch: Instant::now(),
        })
    }

    /// Wakes the NIC thread to look again, wherever it sleeps.
    pub(crate) fn kick(&self) {
        self.kick.ring();
    }

    /// CPU time host threads have spent running the queue since the first call.
    pub(crate) fn driven_cpu(&self) -> Duration {
        self.accounting.store(true, Ordering::Relaxed);
        Duration::from_nanos(self.driven_cpu_ns.load(Ordering::Relaxed))
    }

    /// A host drive ended at `now` (the drive's last clock reading if only looks for work
    /// followed it: at most one turn's looks early, against the NIC thread's grace of 20 ms).
    pub(crate) fn drive_ended(&self, now: Instant) {
        let ns = now.saturating_duration_since(self.epoch).as_nanos();
        self.last_exit
            .store(ns.min(u128::from(NEVER - 1)) as u64, Ordering::Release);
    }

    /// When the last host drive ended (None: there never was one).
    pub(crate) fn last_drive_end(&self) -> Option<Instant> {
        match self.last_exit.load(Ordering::Acquire) {
            NEVER => None,
            ns => Some(self.epoch + Duration::from_nanos(ns)),
        }
    }
}
