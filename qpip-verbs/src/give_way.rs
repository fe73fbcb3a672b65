//! Giving a polling thread's core away, but not to a CPU hog.
//!
//! A thread that polls yields now and then (`sched_yield`) so that a thread woken onto its
//! core — on two cores often the very one it waits for — runs at once instead of after the
//! poller's slice. But the scheduler cannot be told whom to yield to: with a thread on the
//! core that computes and never sleeps (a compiler, a busy VM), every yield hands that thread
//! the core until the next tick, 4 ms here (HZ 250), and a round trip that yields once costs
//! that. Measured (`qpip-bench micro`, a busy thread on every CPU): a QP round trip whose
//! waiters poll took 3 999 µs once host pollers yielded (session 18), against 7.9 µs before
//! and a busy-polling socket's 6.7 (BENCHMARKS.md, session 20).
//!
//! So each thread times its yields: two in a row that each kept it off its core for
//! `LONG_YIELD` or more mean the core is shared with such a thread, and the thread then
//! polls without yielding (as a busy-polling socket loop does) for a while that doubles with
//! each such pair, from `FIRST_QUIET` up to `LAST_QUIET`, and is reset by a short yield.
//! With the hog staying, that is two lost ticks a second at most. One long yield is not
//! enough: with a dozen of our own threads runnable on two cores (the mount at QD16), a
//! yield that lets them all run takes 0.5–2 ms now and then, but two in a row of 1 ms or
//! more came twice among 474 yields of 200 µs or more (`mc.sh`, session 20).

use std::cell::Cell;
use std::time::{Duration, Instant};

/// A yield that kept the thread off its core this long may have handed the core to a thread
/// that ran a whole slice (which ends at a tick: 4 ms at HZ 250, 1–2 ms at HZ 1000); the
/// thread it waits for answers sooner (a 4 KiB request's work takes tens of µs).
const LONG_YIELD: Duration = Duration::from_millis(1);
/// Long yields in a row that start a quiet while.
const LONG_IN_A_ROW: u8 = 2;
/// How long a thread polls without yielding after its first [`LONG_IN_A_ROW`] long yields.
const FIRST_QUIET: Duration = Duration::from_millis(50);
/// The longest such while: with a hog that stays, two long yields a second.
const LAST_QUIET: Duration = Duration::from_secs(1);

#[derive(Clone, Copy)]
struct Quiet {
    /// No yields before this.
    until: Option<Instant>,
    /// Long yields in a row so far.
    long: u8,
    /// The next quiet while.
    next: Duration,
}

thread_local! {
    static QUIET: Cell<Quiet> = const {
        Cell::new(Quiet { until: None, long: 0, next: FIRST_QUIET })
    };
}

/// Yields the core (`sched_yield`) unless this thread is in a quiet while (its recent yields
/// handed the core to a thread that kept it: the module's comment); then only spins once
/// (`spin_loop`). Returns whether it
/// yielded. A yield is no sleep: the caller stays runnable, so no wake-up is owed either way.
pub fn yield_core() -> bool {
    yield_core_at(Instant::now()).is_some()
}

/// [`yield_core`] for a caller that has just read the clock (`now`), one reading fewer:
/// the time the yield ended (to chain yields with), or None where it only spun.
pub fn yield_core_at(now: Instant) -> Option<Instant> {
    QUIET.with(|cell| {
        let mut quiet = cell.get();
        if let Some(until) = quiet.until {
            if now < until {
                std::hint::spin_loop();
                return None;
            }
            quiet.until = None;
        }
        std::thread::yield_now();
        let after = Instant::now();
        quiet = next_quiet(quiet, after.saturating_duration_since(now), after);
        cell.set(quiet);
        Some(after)
    })
}

/// What a yield that took `took`, ending at `now`, leaves: the [`LONG_IN_A_ROW`]th long one
/// in a row starts a quiet while (and doubles the next), a short one resets.
fn next_quiet(quiet: Quiet, took: Duration, now: Instant) -> Quiet {
    if took < LONG_YIELD {
        return Quiet {
            until: None,
            long: 0,
            next: FIRST_QUIET,
        };
    }
    if quiet.long + 1 < LONG_IN_A_ROW {
        return Quiet {
            long: quiet.long + 1,
            ..quiet
        };
    }
    Quiet {
        until: Some(now + quiet.next),
        long: 0,
        next: (quiet.next * 2).min(LAST_QUIET),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_long_yields_in_a_row_quiet_for_a_while_that_doubles_up_to_a_second() {
        let t = Instant::now();
        let long = Duration::from_millis(4);
        let mut q = Quiet {
            until: None,
            long: 0,
            next: FIRST_QUIET,
        };
        q = next_quiet(q, long, t);
        assert_eq!(q.until, None, "one long yield is not enough");
        q = next_quiet(q, Duration::from_micros(3), t);
        q = next_quiet(q, long, t);
        assert_eq!(q.until, None, "a short one between resets the count");
        q = next_quiet(q, long, t);
        assert_eq!(q.until, Some(t + FIRST_QUIET));
        for _ in 0..20 {
            q = next_quiet(q, long, t);
        }
        assert_eq!(q.until, Some(t + LAST_QUIET));
        q = next_quiet(q, Duration::from_micros(3), t);
        assert_eq!((q.until, q.long, q.next), (None, 0, FIRST_QUIET));
    }

    #[test]
    fn a_quiet_thread_spins_instead_until_its_while_ends() {
        let quiet_for = |d: Duration| {
            QUIET.with(|c| {
                c.set(Quiet {
                    until: Some(Instant::now() + d),
                    long: 0,
                    next: FIRST_QUIET,
                })
            })
        };
        quiet_for(Duration::from_secs(60));
        assert!(!yield_core());
        quiet_for(Duration::ZERO);
        assert!(yield_core());
    }
}
