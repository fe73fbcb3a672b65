//! How long a thread running a NIC queue polls before it sleeps, learned from arrivals: the
//! NIC thread's own window ([`crate::machines::shell`]), and each CQ's for the waiters that
//! drive its queue ([`KeptWindow`], [`crate::drive`]). Polling pays when work comes back
//! within the window (no wake-up, no context switch); it is pure waste when it does not, and
//! on a two-core machine the polling thread takes the core the work needs. One thread runs a
//! queue at a time, so a queue costs at most one polling core whatever its CQs learned.
//! (A CQ waiter that polls the ring rather than driving its queue keeps its fixed spin: a
//! window learned there was measured and not kept, docs/bench/qd1-cq-window.txt.)

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// How long to poll for work before sleeping, learned from how soon work came back, as KVM's halt polling learns its window (virt/kvm/kvm_main.c, `grow_halt_poll_ns` /
/// `shrink_halt_poll_ns`): a sleep that ended within the longest window would have been
/// saved by polling longer, so the window doubles (from [`PollWindow::START`]); a sleep that
/// outlasted it means polling was wasted, so the window halves (to zero below the start).
/// Work that came while polling leaves it as it is.
#[derive(Clone, Copy, Debug)]
pub struct PollWindow {
    window: Duration,
    max: Duration,
    /// The CQ's waits in a row that polling caught (none slept), this one not counted; 0
    /// once this one slept.
    caught_waits: u32,
    /// This wait slept (it then counts as no catch when kept).
    slept: bool,
}

impl PollWindow {
    /// The first window after a sleep that polling would have saved (KVM's
    /// `halt_poll_ns_grow_start`, 10 µs).
    pub const START: Duration = Duration::from_micros(10);

    /// Waits in a row that polling caught before a host thread reads its socket directly
    /// ([`Self::polling_catches_work`]).
    pub const CAUGHT_WAITS: u32 = 8;

    /// A window that starts closed and grows to at most `max`.
    pub fn new(max: Duration) -> Self {
        PollWindow {
            window: Duration::ZERO,
            max,
            caught_waits: 0,
            slept: false,
        }
    }

    /// The thread slept: the streak of waits that polling caught ends.
    pub fn note_sleep(&mut self) {
        self.slept = true;
        self.caught_waits = 0;
    }

    /// The CQ's last [`Self::CAUGHT_WAITS`] waits were all caught by polling, and this one has
    /// not slept: its work comes while its waiter polls, as a busy-polling socket reader's
    /// does. Only then does a host read its socket without the readiness descriptor: a
    /// waiter that sleeps is woken through that descriptor, and the edge a direct read leaves
    /// there makes each such sleep dearer for the peer that wakes it (BENCHMARKS, "Why the
    /// direct read made `nbd qd1` dearer").
    pub fn polling_catches_work(&self) -> bool {
        // A sleep zeroed the streak (`note_sleep`).
        self.caught_waits >= Self::CAUGHT_WAITS
    }

    /// How long to poll now.
    pub fn get(&self) -> Duration {
        self.window
    }

    /// The longest it may grow to.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// Work came `idle` after the last work; `slept`: the thread slept in between.
    pub fn idle_ended(&mut self, idle: Duration, slept: bool) {
        if !slept {
            return;
        }
        if idle <= self.max {
            self.window = (self.window * 2).max(Self::START).min(self.max);
        } else {
            self.window /= 2;
            if self.window < Self::START {
                self.window = Duration::ZERO;
            }
        }
    }
}

/// The poll window one CQ's waiters learned, kept between their drives of its queue
/// ([`crate::drive`]): each CQ learns from its own arrivals (its connection's round trip),
/// not from those of whichever CQ of the queue was driven last. Written only by the queue's
/// one driver at a time.
#[derive(Debug, Default)]
pub struct KeptWindow {
    window_ns: AtomicU64,
    caught_waits: AtomicU32,
}

impl KeptWindow {
    /// The kept window, within the longest `max` this wait allows (its CQ's spin).
    pub fn resume(&self, max: Duration) -> PollWindow {
        let kept = Duration::from_nanos(self.window_ns.load(Ordering::Relaxed));
        PollWindow {
            window: kept.min(max),
            max,
            caught_waits: self.caught_waits.load(Ordering::Relaxed),
            slept: false,
        }
    }

    /// Keeps what a drive learned, and whether polling caught its wait.
    pub fn keep(&self, w: &PollWindow) {
        let nanos = u64::try_from(w.window.as_nanos()).unwrap_or(u64::MAX);
        self.window_ns.store(nanos, Ordering::Relaxed);
        let caught = if w.slept {
            0
        } else {
            w.caught_waits.saturating_add(1)
        };
        self.caught_waits.store(caught, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_window_grows_while_work_comes_back_soon_and_closes_when_it_does_not() {
        let mut w = PollWindow::new(50 * US);
        assert_eq!(w.get(), Duration::ZERO, "an idle NIC does not poll");
        // Replies that came 20 µs after the request, each after a sleep: polling would have
        // saved the wake-up.
        for want in [10, 20, 40, 50, 50] {
            w.idle_ended(20 * US, true);
            assert_eq!(w.get(), want * US);
        }
        // Work found while polling: nothing to learn.
        w.idle_ended(5 * US, false);
        assert_eq!(w.get(), 50 * US);
        // Gaps longer than any window: polling is wasted, the window closes.
        for want in [25_000, 12_500, 0, 0] {
            w.idle_ended(Duration::from_millis(200), true);
            assert_eq!(w.get(), Duration::from_nanos(want));
        }
    }

    #[test]
    fn a_kept_window_resumes_within_the_next_maximum() {
        let kept = KeptWindow::default();
        assert_eq!(
            kept.resume(50 * US).get(),
            Duration::ZERO,
            "nothing learned yet"
        );
        let mut w = kept.resume(50 * US);
        w.idle_ended(20 * US, true);
        w.idle_ended(20 * US, true);
        kept.keep(&w);
        assert_eq!(kept.resume(50 * US).get(), 20 * US);
        // A wait with a shorter spin polls at most that long; what is kept stays until a
        // drive keeps another.
        assert_eq!(kept.resume(15 * US).get(), 15 * US);
        assert_eq!(kept.resume(50 * US).get(), 20 * US);
        assert_eq!(kept.resume(Duration::ZERO).get(), Duration::ZERO);
    }

    #[test]
    fn a_host_reads_directly_only_after_waits_that_polling_caught() {
        let kept = KeptWindow::default();
        let wait = |slept: bool| {
            let mut w = kept.resume(50 * US);
            let direct = w.polling_catches_work();
            if slept {
                w.note_sleep();
                assert!(
                    !w.polling_catches_work(),
                    "a wait that slept still reads directly"
                );
            }
            kept.keep(&w);
            direct
        };
        for _ in 0..PollWindow::CAUGHT_WAITS {
            assert!(
                !wait(false),
                "read directly before enough waits were caught"
            );
        }
        assert!(wait(false));
        assert!(wait(true), "the wait that sleeps began with a direct read");
        assert!(!wait(false), "one sleep did not end the streak");
        for _ in 1..PollWindow::CAUGHT_WAITS {
            assert!(!wait(false));
        }
        assert!(wait(false), "the streak did not come back");
    }

    #[test]
    fn a_zero_maximum_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        w.idle_ended(Duration::ZERO, true);
        assert_eq!(w.get(), Duration::ZERO);
    }
}
