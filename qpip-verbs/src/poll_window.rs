//! How long a thread running a NIC queue polls before it sleeps, learned from arrivals: the
//! NIC thread's own window ([`crate::machines::shell`]), and each CQ's for the waiters that
//! drive its queue ([`KeptWindow`], [`crate::drive`]). Polling pays when work comes back
//! within the window (no wake-up, no context switch); it is pure waste when it does not, and
//! on a two-core machine the polling thread takes the core the work needs. One thread runs a
//! queue at a time, so a queue costs at most one polling core whatever its CQs learned.
//! (A CQ waiter that polls the ring rather than driving its queue keeps its fixed spin: a
//! window learned there was measured and not kept, docs/bench/qd1-cq-window.txt.)

use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl PollWindow {
    /// The first window after a sleep that polling would have saved (KVM's
    /// `halt_poll_ns_grow_start`, 10 µs).
    pub const START: Duration = Duration::from_micros(10);

    /// A window that starts closed and grows to at most `max`.
    pub fn new(max: Duration) -> Self {
        PollWindow {
            window: Duration::ZERO,
            max,
        }
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
pub struct KeptWindow(AtomicU64);

impl KeptWindow {
    /// The kept window, within the longest `max` this wait allows (its CQ's spin).
    pub fn resume(&self, max: Duration) -> PollWindow {
        let kept = Duration::from_nanos(self.0.load(Ordering::Relaxed));
        PollWindow {
            window: kept.min(max),
            max,
        }
    }

    /// Keeps what a drive learned.
    pub fn keep(&self, w: &PollWindow) {
        let nanos = u64::try_from(w.window.as_nanos()).unwrap_or(u64::MAX);
        self.0.store(nanos, Ordering::Relaxed);
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
    fn a_zero_maximum_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        w.idle_ended(Duration::ZERO, true);
        assert_eq!(w.get(), Duration::ZERO);
    }
}
