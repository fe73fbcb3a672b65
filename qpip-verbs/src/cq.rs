//! Completion queues: where the NIC reports every finished work request.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::drive::{Driven, QueueDriver, Waiting};
use crate::shared::CqShared;
use crate::wr::Completion;

/// A completion queue failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CqError {
    /// More completions arrived than the queue could hold; `lost` of them were dropped. The CQ
    /// stays in this state: size CQs for the WRs that can be outstanding on them.
    #[error("completion queue overflowed: {lost} completions lost (depth {depth})")]
    Overflow {
        /// Completions dropped.
        lost: u64,
        /// The CQ's depth.
        depth: usize,
    },
}

/// A completion queue. Clones share the queue; one CQ may serve any number of QPs.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) shared: Arc<CqShared>,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("depth", &self.depth())
            .field("len", &self.len())
            .finish()
    }
}

/// Wakes a CQ's waiters from any thread without a completion: their [`CompletionQueue::wait`]
/// returns (`Ok(0)` when nothing completed meanwhile). For hosts that also wait for work done
/// elsewhere (a storage library's callbacks) on the thread that waits for the CQ: the
/// callback wakes it instead of the waiter polling. A wake with no waiter is kept for the
/// next wait; several wakes before it count as one.
#[derive(Clone)]
pub struct CqWaker(Arc<CqShared>);

impl CqWaker {
    /// Wakes the CQ's waiter (or the next wait).
    pub fn wake(&self) {
        self.0.wake();
    }
}

impl std::fmt::Debug for CqWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CqWaker")
    }
}

impl CompletionQueue {
    /// A CQ that holds up to `depth` completions.
    pub fn new(depth: usize) -> Self {
        CompletionQueue {
            shared: Arc::new(CqShared::new(depth)),
        }
    }

    /// A handle that makes this CQ's waits return from another thread (see [`CqWaker`]).
    pub fn waker(&self) -> CqWaker {
        CqWaker(self.shared.clone())
    }

    /// The ring the NIC completes into (for backends and simulators that build QPs).
    pub fn shared(&self) -> &Arc<CqShared> {
        &self.shared
    }

    /// Completions it holds at most.
    pub fn depth(&self) -> usize {
        self.shared.ring.capacity()
    }

    /// Completions waiting to be polled.
    pub fn len(&self) -> usize {
        self.shared.ring.len()
    }

    /// No completion is waiting.
    pub fn is_empty(&self) -> bool {
        self.shared.ring.is_empty()
    }

    /// Blocking waiters ([`Self::wait`]) asleep on this CQ or about to be: each has counted
    /// itself and will wake only through the NIC's notify. For diagnostics, and for tests that
    /// need a waiter asleep before its completion comes instead of sleeping "long enough".
    pub fn sleepers(&self) -> usize {
        self.shared.sleepers.get() as usize
    }

    /// Waiters running this CQ's NIC queue themselves now (run to completion,
    /// [`crate::drive`]): for diagnostics and for tests that need a waiter driving before its
    /// completion comes.
    pub fn drivers(&self) -> usize {
        self.shared.driving.load(Ordering::Relaxed) as usize
    }

    /// How long [`Self::wait`] and [`Self::wait_async`] poll before sleeping. Zero sleeps at
    /// once (lowest CPU); a few tens of µs trade CPU for latency.
    pub fn set_spin(&self, spin: Duration) {
        self.shared
            .spin_nanos
            .store(spin.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Moves up to `out.len()` completions into `out` without blocking. Returns how many.
    /// Once the queue has overflowed, the completions that did fit are still returned, then
    /// every call reports the overflow.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, CqError> {
        let mut n = 0;
        while n < out.len() {
            match self.shared.ring.pop() {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => break,
            }
        }
        if n == 0 && self.shared.overflowed.load(Ordering::Acquire) {
            return Err(CqError::Overflow {
                lost: self.shared.lost.load(Ordering::Relaxed),
                depth: self.depth(),
            });
        }
        Ok(n)
    }

    /// Blocks until at least one completion is available (or `timeout` passes: then `Ok(0)`).
    /// When the CQ's NIC queue may be driven by its waiters ([`crate::drive`]) and nobody
    /// else drives it, runs the queue's work on this thread until a completion comes (one
    /// wake-up: the kernel's, when bytes arrive). Otherwise polls for the spin window, then
    /// sleeps on the CQ's futex; the NIC wakes it only because it counted itself as a
    /// sleeper.
    pub fn wait(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
    ) -> Result<usize, CqError> {
        let spin = Duration::from_nanos(self.shared.spin_nanos.load(Ordering::Relaxed));
        self.wait_spinning(out, timeout, spin)
    }

    /// [`Self::wait`] with this call's own spin window instead of the CQ's: a caller that
    /// knows its completion is far off (a large transfer) sleeps at once.
    pub fn wait_spinning(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
        spin: Duration,
    ) -> Result<usize, CqError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        if let Some(driver) = self.shared.driver() {
            // Run to completion: drive the queue instead of spinning on it.
            let n = self.poll(out)?;
            if n > 0 || self.shared.take_wake() {
                return Ok(n);
            }
            let wait = driver.begin_wait();
            return match self.drive(driver.as_ref(), &wait, out, spin, deadline) {
                Ok(Some(n)) => Ok(n),
                // Another thread drives: wait for it as for a NIC thread.
                Ok(None) => match self.spin_poll(out, spin) {
                    Ok(0) if !self.shared.take_wake() => self.sleep(out, deadline),
                    r => r,
                },
                Err(e) => Err(e),
            };
        } else {
            let n = self.spin_poll(out, spin)?;
            if n > 0 || self.shared.take_wake() {
                return Ok(n);
            }
        }
        self.sleep(out, deadline)
    }

    /// Drives the CQ's queue until it has news: `Some` with what the wait returns, `None`
    /// when another thread drives the queue (the caller then sleeps).
    fn drive(
        &self,
        driver: &dyn QueueDriver,
        wait: &Waiting<'_>,
        out: &mut [Completion],
        spin: Duration,
        deadline: Option<Instant>,
    ) -> Result<Option<usize>, CqError> {
        let shared = &*self.shared;
        loop {
            let driven = driver.drive(
                wait,
                &shared.driving,
                &shared.window,
                &|| shared.has_news(),
                spin,
                deadline,
            );
            match driven {
                Driven::Busy => return Ok(None),
                Driven::Ready | Driven::TimedOut => {
                    let n = self.poll(out)?;
                    if n > 0 || shared.take_wake() || driven == Driven::TimedOut {
                        return Ok(Some(n));
                    }
                }
            }
        }
    }

    /// Sleeps on the CQ's futex until the NIC's notify (or a wake) comes, or `deadline`.
    fn sleep(&self, out: &mut [Completion], deadline: Option<Instant>) -> Result<usize, CqError> {
        let shared = &*self.shared;
        loop {
            let left = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return self.poll(out);
                    }
                    Some(left)
                }
                None => None,
            };
            // Count ourselves before the last look: pairs with notify's and wake's `posted`.
            shared.sleepers.enter();
            let seq = shared.seq.load(Ordering::Relaxed);
            let n = self.poll(out);
            if !matches!(n, Ok(0)) || shared.take_wake() {
                shared.sleepers.leave();
                return n;
            }
            crate::futex::wait(&shared.seq, seq, left);
            shared.sleepers.leave();
            let n = self.poll(out)?;
            if n > 0 || shared.take_wake() {
                return Ok(n);
            }
        }
    }

    /// Waits for completions from async code (tokio or any executor).
    pub async fn wait_async(&self, out: &mut [Completion]) -> Result<usize, CqError> {
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let listener = self.shared.event.listen();
            let n = self.poll(out)?;
            if n > 0 || self.shared.take_wake() {
                return Ok(n);
            }
            listener.await;
        }
    }

    fn spin_poll(&self, out: &mut [Completion], spin: Duration) -> Result<usize, CqError> {
        if spin.is_zero() {
            return self.poll(out);
        }
        let start = Instant::now();
        let mut rounds = 0u32;
        loop {
            let n = self.poll(out)?;
            if n == 0 && self.shared.woken.load(Ordering::Relaxed) {
                return Ok(0);
            }
            // Reading the clock costs more than a poll: look at it every 16 rounds.
            if n > 0 || (rounds.is_multiple_of(16) && start.elapsed() >= spin) {
                return Ok(n);
            }
            rounds += 1;
            if rounds.is_multiple_of(64) {
                // On two cores the thread we wait for may need ours (but no CPU hog).
                crate::give_way::yield_core();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_is_reported_after_what_fit() {
        let cq = CompletionQueue::new(2);
        for i in 0..5 {
            cq.shared.push(Completion {
                wr_id: i,
                ..Default::default()
            });
        }
        let mut out = [Completion::default(); 8];
        assert_eq!(cq.poll(&mut out), Ok(2));
        assert_eq!(
            cq.poll(&mut out),
            Err(CqError::Overflow { lost: 3, depth: 2 })
        );
    }

    #[test]
    fn a_waker_makes_a_sleeping_wait_return_and_is_kept_for_the_next() {
        let cq = CompletionQueue::new(4);
        cq.set_spin(Duration::ZERO);
        let waker = cq.waker();
        let mut out = [Completion::default(); 1];
        // Before the wait: the wait returns at once, and the wake is spent.
        waker.wake();
        waker.wake();
        assert_eq!(cq.wait(&mut out, Some(Duration::from_secs(5))), Ok(0));
        let t = Instant::now();
        assert_eq!(cq.wait(&mut out, Some(Duration::from_millis(20))), Ok(0));
        assert!(t.elapsed() >= Duration::from_millis(20));
        // During the wait, once it sleeps.
        let cq2 = cq.clone();
        let h = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(5);
            while cq2.sleepers() == 0 && Instant::now() < deadline {
                std::thread::yield_now();
            }
            waker.wake();
        });
        let t = Instant::now();
        assert_eq!(cq.wait(&mut out, Some(Duration::from_secs(30))), Ok(0));
        assert!(t.elapsed() < Duration::from_secs(10));
        h.join().unwrap();
    }

    #[test]
    fn wait_times_out_with_zero() {
        let cq = CompletionQueue::new(4);
        let mut out = [Completion::default(); 1];
        let t = Instant::now();
        assert_eq!(cq.wait(&mut out, Some(Duration::from_millis(20))), Ok(0));
        assert!(t.elapsed() >= Duration::from_millis(20));
    }

    /// `wait` must go to sleep on `cq` (a push comes only once it counts as a sleeper) and be
    /// woken by the NIC's notify.
    fn sleeps_and_is_woken(
        cq: &CompletionQueue,
        wait: impl FnOnce(&CompletionQueue, &mut [Completion]) -> Result<usize, CqError>,
    ) {
        let cq2 = cq.clone();
        let h = std::thread::spawn(move || {
            // Push only once the waiter sleeps, so that only the notify can wake it.
            let deadline = Instant::now() + Duration::from_secs(5);
            while cq2.sleepers() == 0 {
                assert!(Instant::now() < deadline, "the waiter never went to sleep");
                std::thread::yield_now();
            }
            cq2.shared.push(Completion {
                wr_id: 9,
                ..Default::default()
            });
            cq2.shared.notify();
        });
        let mut out = [Completion::default(); 1];
        let t = Instant::now();
        // The timeout only keeps a lost wake-up from hanging the run; the wait then returns
        // the completion too, so the time it took tells the two apart.
        assert_eq!(wait(cq, &mut out), Ok(1));
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "woken by the timeout"
        );
        assert_eq!(out[0].wr_id, 9);
        h.join().unwrap();
    }

    #[test]
    fn wait_wakes_on_push_from_another_thread() {
        let cq = CompletionQueue::new(4);
        cq.set_spin(Duration::ZERO);
        sleeps_and_is_woken(&cq, |cq, out| cq.wait(out, Some(Duration::from_secs(20))));
    }

    /// A wait's own spin window overrides the CQ's: with none it sleeps at once, though the
    /// CQ would spin for a minute.
    #[test]
    fn wait_spinning_uses_its_own_window() {
        let cq = CompletionQueue::new(4);
        cq.set_spin(Duration::from_secs(60));
        sleeps_and_is_woken(&cq, |cq, out| {
            cq.wait_spinning(out, Some(Duration::from_secs(20)), Duration::ZERO)
        });
    }

    /// Two threads hand a token back and forth through two CQs, both sleeping at once each
    /// time: a lost wake-up would leave both asleep (the long timeout only keeps a failure
    /// from hanging the run).
    #[test]
    fn ping_pong_loses_no_wake_up() {
        const ROUNDS: u64 = 20_000;
        let (ping, pong) = (CompletionQueue::new(4), CompletionQueue::new(4));
        ping.set_spin(Duration::ZERO);
        pong.set_spin(Duration::ZERO);
        let (ping2, pong2) = (ping.clone(), pong.clone());
        let echo = std::thread::spawn(move || {
            let mut out = [Completion::default(); 4];
            for i in 0..ROUNDS {
                assert_eq!(ping2.wait(&mut out, Some(Duration::from_secs(60))), Ok(1));
                assert_eq!(out[0].wr_id, i);
                pong2.shared.push(out[0]);
                pong2.shared.notify();
            }
        });
        let mut out = [Completion::default(); 4];
        for i in 0..ROUNDS {
            ping.shared.push(Completion {
                wr_id: i,
                ..Default::default()
            });
            ping.shared.notify();
            assert_eq!(pong.wait(&mut out, Some(Duration::from_secs(60))), Ok(1));
            assert_eq!(out[0].wr_id, i);
        }
        echo.join().unwrap();
    }

    #[test]
    fn wait_async_wakes_from_tokio() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cq = CompletionQueue::new(4);
        let cq2 = cq.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            cq2.shared.push(Completion {
                wr_id: 3,
                ..Default::default()
            });
            cq2.shared.notify();
        });
        let got = rt.block_on(async {
            let mut out = [Completion::default(); 2];
            let n = cq.wait_async(&mut out).await.unwrap();
            (n, out[0].wr_id)
        });
        assert_eq!(got, (1, 3));
    }
}
