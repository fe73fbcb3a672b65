//! How long the NIC thread polls before it sleeps, learned from arrivals
//! ([`crate::machines::shell`]). Polling pays when work comes back within the window (no
//! wake-up, no context switch); it is pure waste when it does not, and on a two-core machine
//! the polling thread takes the core the work needs. (The same rule for a host thread
//! waiting on a CQ was measured and not kept: docs/bench/qd1-cq-window.txt.)

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

    /// Changes the longest it may grow to (the window shrinks to it if longer).
    pub fn set_max(&mut self, max: Duration) {
        self.max = max;
        self.window = self.window.min(max);
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
    fn a_zero_maximum_never_polls() {
        let mut w = PollWindow::new(Duration::ZERO);
        w.idle_ended(Duration::ZERO, true);
        assert_eq!(w.get(), Duration::ZERO);
    }
}
