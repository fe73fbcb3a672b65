//! Run to completion: a host thread that waits on a CQ runs its NIC queue's work itself
//! instead of sleeping until the NIC thread wakes it, as NAPI busy polling and io_uring's task
//! work let the consumer drive the device. A request–reply then costs the waiter one wake-up
//! (the kernel's, when the reply's bytes arrive), as a blocking socket does, where a NIC
//! thread in between costs two hand-offs.
//!
//! A backend whose processor may run on any thread binds each CQ to the queue its QPs live on
//! ([`crate::shared::CqShared::bind_driver`]); [`crate::CompletionQueue::wait`] then drives
//! that queue while it waits. One thread drives a queue at a time; a waiter that finds it
//! driven sleeps on its CQ as before, and the driver's completions wake it.

use std::sync::atomic::AtomicU32;
use std::time::{Duration, Instant};

/// How a drive ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driven {
    /// The waiter's condition holds (its CQ has news).
    Ready,
    /// The deadline passed first.
    TimedOut,
    /// Another thread drives the queue (or the queue is gone): sleep on the CQ instead.
    Busy,
}

/// A NIC queue that host threads may drive.
pub trait QueueDriver: Send + Sync {
    /// A thread starts waiting on a CQ of this queue (driving it or asleep behind its
    /// driver): a driver that leaves while others wait has the NIC thread drive for them.
    fn begin_wait(&self);
    /// The thread of a [`Self::begin_wait`] stops waiting.
    fn end_wait(&self);
    /// Runs the queue's work on the calling thread (between `begin_wait` and `end_wait`)
    /// until `ready()` holds or `deadline` passes, counted in `driving` while it does;
    /// polls after its last work for a window learned from arrivals, at most `spin`, then
    /// sleeps until the queue's sockets wake it. Returns [`Driven::Busy`] when another
    /// thread drives it, or asks for it.
    fn drive(
        &self,
        driving: &AtomicU32,
        ready: &dyn Fn() -> bool,
        spin: Duration,
        deadline: Option<Instant>,
    ) -> Driven;
    /// Makes a drive that is blocked waiting for the queue's sockets look at `ready` again
    /// (a CQ woken from outside the NIC).
    fn interrupt(&self);
}
