//! Is the server still answering, and when may a lost connection be tried again? The clock
//! is the caller's: every method that needs the time takes `now`, and the jitter of the
//! back-off takes the caller's random number, so tests can drive both.

use std::time::{Duration, Instant};

/// What the caller does about a server that has not replied for a while.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stall {
    /// Nothing: no request waits longer than the request timeout.
    None,
    /// Drop the connection and reissue the requests on a new one.
    Reconnect(String),
    /// The server stayed silent past the reconnect timeout too: fail everything.
    GiveUp(String),
}

/// Connection losses since the server last answered. It outlives a successful reconnect, so
/// a server that accepts connections and then breaks each one cannot restart the clock.
#[derive(Clone, Copy, Debug)]
struct Outage {
    since: Instant,
    /// Wait before the next connection attempt (0 for the first).
    backoff: Duration,
}

/// The stall and outage clocks of one client.
#[derive(Clone, Debug)]
pub struct Liveness {
    request_timeout: Option<Duration>,
    reconnect_timeout: Duration,
    /// When a reply last arrived (or the first request after an idle spell was issued).
    last_progress: Instant,
    /// When the server first let a request time out, if it has not replied since.
    stalled_since: Option<Instant>,
    /// The connection trouble that no reply has ended yet, if any.
    outage: Option<Outage>,
}

impl Liveness {
    /// First wait between connection attempts (after an immediate first one).
    pub const FIRST_BACKOFF: Duration = Duration::from_millis(50);
    /// Longest wait between connection attempts.
    pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

    /// Requests time out after `request_timeout` without a reply (never if `None`); a lost
    /// server gets `reconnect_timeout` to come back.
    pub fn new(
        now: Instant,
        request_timeout: Option<Duration>,
        reconnect_timeout: Duration,
    ) -> Self {
        Liveness {
            request_timeout,
            reconnect_timeout,
            last_progress: now,
            stalled_since: None,
            outage: None,
        }
    }

    /// How long a lost server gets to come back.
    pub fn reconnect_timeout(&self) -> Duration {
        self.reconnect_timeout
    }

    /// Lowers the reconnect timeout (never raises it).
    pub fn limit_reconnect_timeout(&mut self, limit: Duration) {
        self.reconnect_timeout = self.reconnect_timeout.min(limit);
    }

    /// A request was issued with nothing in flight: its wait starts now, not at the last
    /// reply before the idle spell.
    pub fn restart_wait(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// How long the server has been silent: since its last reply, or since the first request
    /// after an idle spell.
    pub fn silent_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_progress)
    }

    /// A reply message arrived: the server is alive.
    pub fn replied(&mut self, now: Instant) {
        self.last_progress = now;
        self.stalled_since = None;
    }

    /// A request was answered whole: that ends an outage (a chunk alone does not).
    pub fn answered(&mut self) {
        self.outage = None;
    }

    /// Whether requests in flight have waited too long. On [`Stall::Reconnect`] the caller
    /// reconnects and then calls [`Self::restart_wait`].
    pub fn stall(&mut self, now: Instant, in_flight: bool) -> Stall {
        let Some(limit) = self.request_timeout else {
            return Stall::None;
        };
        if !in_flight {
            return Stall::None;
        }
        let why = || format!("no reply from the server for {} s", limit.as_secs_f64());
        // Once the server has let a request time out, it gets the reconnect timeout from then
        // on, not a new request timeout for the requests reissued after a reconnect: the
        // bound is request timeout + reconnect timeout, as documented.
        if let Some(since) = self.stalled_since
            && now.saturating_duration_since(since) >= self.reconnect_timeout
        {
            return Stall::GiveUp(format!(
                "{}, nor in the {} s after",
                why(),
                self.reconnect_timeout.as_secs_f64()
            ));
        }
        if now.saturating_duration_since(self.last_progress) < limit {
            return Stall::None;
        }
        let since = *self.stalled_since.get_or_insert(now);
        let why = why();
        if now.saturating_duration_since(since) >= self.reconnect_timeout {
            Stall::GiveUp(why)
        } else {
            Stall::Reconnect(why)
        }
    }

    /// The connection is lost: the outage starts now unless one is already running. Returns
    /// when to give up reconnecting.
    pub fn lost(&mut self, now: Instant) -> Instant {
        let outage = self.outage.get_or_insert(Outage {
            since: now,
            backoff: Duration::ZERO,
        });
        outage.since + self.reconnect_timeout
    }

    /// The wait before the next connection attempt, and doubles the back-off. The jitter
    /// (half to all of the back-off, from `random`) keeps many clients of one server from
    /// reconnecting in step.
    pub fn next_wait(&mut self, random: u64) -> Duration {
        let Some(outage) = &mut self.outage else {
            return Duration::ZERO;
        };
        let wait = outage.backoff;
        outage.backoff = (outage.backoff * 2).clamp(Self::FIRST_BACKOFF, Self::MAX_BACKOFF);
        wait.mul_f64(0.5 + (random % 1024) as f64 / 2048.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn stalls_reconnect_then_give_up() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, Some(10 * S), 30 * S);
        assert_eq!(
            l.stall(t0 + 100 * S, false),
            Stall::None,
            "nothing in flight"
        );
        assert_eq!(l.stall(t0 + 9 * S, true), Stall::None);
        assert!(matches!(l.stall(t0 + 10 * S, true), Stall::Reconnect(_)));
        l.restart_wait(t0 + 10 * S);
        assert!(matches!(l.stall(t0 + 25 * S, true), Stall::Reconnect(_)));
        l.restart_wait(t0 + 25 * S);
        // 30 s after the first timeout, with no reply meanwhile.
        assert!(matches!(l.stall(t0 + 40 * S, true), Stall::GiveUp(_)));
        l.replied(t0 + 41 * S);
        assert!(matches!(l.stall(t0 + 51 * S, true), Stall::Reconnect(_)));
        let mut never = Liveness::new(t0, None, 30 * S);
        assert_eq!(never.stall(t0 + 1000 * S, true), Stall::None);
    }

    #[test]
    fn give_up_comes_a_reconnect_timeout_after_the_first_timeout() {
        // Issue 24 item 9: 60 s request timeout, 30 s reconnect timeout, a server that
        // accepts connections and never answers. The reconnect at 60 s succeeds and the
        // requests go again; they fail at 60 + 30 s, not after a second full request timeout.
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, Some(60 * S), 30 * S);
        assert!(matches!(l.stall(t0 + 60 * S, true), Stall::Reconnect(_)));
        l.restart_wait(t0 + 60 * S);
        assert_eq!(l.stall(t0 + 89 * S, true), Stall::None);
        assert!(matches!(l.stall(t0 + 90 * S, true), Stall::GiveUp(_)));
    }

    #[test]
    fn backoff_doubles_with_jitter_until_answered() {
        let t0 = Instant::now();
        let mut l = Liveness::new(t0, None, 30 * S);
        assert_eq!(l.next_wait(7), Duration::ZERO, "no outage");
        assert_eq!(l.lost(t0), t0 + 30 * S);
        assert_eq!(
            l.next_wait(0),
            Duration::ZERO,
            "the first attempt is immediate"
        );
        assert_eq!(l.next_wait(0), Liveness::FIRST_BACKOFF / 2);
        assert_eq!(
            l.next_wait(1023),
            Duration::from_millis(100).mul_f64(0.5 + 1023.0 / 2048.0)
        );
        for _ in 0..10 {
            assert!(l.next_wait(512) <= Liveness::MAX_BACKOFF);
        }
        // A reconnect that is lost again keeps the outage's deadline.
        assert_eq!(l.lost(t0 + 5 * S), t0 + 30 * S);
        l.answered();
        assert_eq!(l.lost(t0 + 40 * S), t0 + 70 * S);
        l.limit_reconnect_timeout(2 * S);
        l.limit_reconnect_timeout(60 * S);
        assert_eq!(l.reconnect_timeout(), 2 * S);
    }
}
