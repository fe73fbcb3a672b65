//! Run to completion: a host thread that waits on a CQ runs its NIC queue's work itself
//! instead of sleeping until the NIC thread wakes it, as NAPI busy polling and io_uring's task
//! work let the consumer drive the device. A request–reply then costs the waiter one wake-up
//! (the kernel's, when the reply's bytes arrive), as a blocking socket does, where a NIC
//! thread in between costs two hand-offs.
//!
//! A backend whose processor may run on any thread (is `Send`: the soft NIC's epoll engine,
//! not its io_uring one) binds each CQ to the queue its QPs live on
//! ([`crate::shared::CqShared::bind_driver`]); [`crate::CompletionQueue::wait`] then drives
//! that queue while it waits. One thread drives a queue at a time; a waiter that finds it
//! driven sleeps on its CQ as before, and the driver's completions wake it.
//!
//! # The contract
//!
//! **Ownership.** A driven queue (`driven::DrivenQueue`: the processor — sockets, QPs,
//! listeners, epoll — and what drives it) is owned by its [`crate::machines::shell::NicThread`]
//! alone, which the backend owns; a CQ bound to it holds it weakly, a thread in a CQ wait
//! holds it only for that wait, and the processor holds nothing that owns its `NicThread`, so
//! dropping the NIC ends the thread and closes every descriptor (`driven`'s doc has the
//! details). The processor sits behind one lock, the queue's *engine lock*; whoever holds it
//! runs the engine, and at every moment that is exactly one of: nobody (the NIC thread parked
//! or watching, every waiter asleep), one host thread in a CQ wait, or the NIC thread. The
//! hand-over decisions — who takes it, when the NIC thread takes it back, when it lets go —
//! are `rules`, a pure state machine; `driven` only translates between the shared flags
//! (`handover`) and the rules' looks and actions. What polling learns lives beside that
//! lock: the queue's pace (`shell::Pace`, when work last came) with the processor under it;
//! each CQ's poll window in its CQ (`poll_window::KeptWindow`, an atomic only the thread
//! holding the engine lock writes); the NIC thread's own window in its `shell::Turns`.
//!
//! **Lock order**, outermost first; a thread takes a lock only while holding locks of earlier
//! levels:
//! 1. host locks a waiter may hold across a CQ wait or a command's reply (the NBD client
//!    pool's per-connection `Mutex<Client>`, an application's own);
//! 2. the queue's engine lock;
//! 3. what the processor takes under it: the framers' locks (nbd-proto's `InFlight` table,
//!    the server framer's parsed requests), the soft NIC's `Queues::placed` and a listener's
//!    backlog (its `accept::Listening`, taken before `placed`; an accept that finds a
//!    connection waiting takes both on the calling thread, without the engine lock), a
//!    queue's accept inbox (`accept::Inbox`, a leaf: taken by whoever pairs a connection,
//!    under the listener's queue's engine lock or none, and by the QP's own engine), reply
//!    slots ([`crate::reply`]), the memory table ([`crate::mr::MemoryTable`]), a QP's
//!    addresses.
//!
//! Framers (and everything else at level 3) run under the engine lock **on whichever thread
//! drives** — the NIC thread or any application thread waiting on any CQ of the queue — so
//! [`crate::Framer::frame`] must never block on a lock of level 1, nor wait for the NIC.
//! Never held across a CQ wait (nor a command's reply, nor anything else that waits for the
//! NIC): a lock of level 3, since the thread that would complete the wait needs it under the
//! engine lock. The engine lock itself is held across the sleep on the processor's
//! descriptor by the thread that drives, and by nobody else while waiting: other waiters
//! sleep on their CQ.
//!
//! **Wake table**: every place a thread sleeps on a driven queue, who wakes it, and how a
//! wake-up cannot be lost. "Dekker" means the store-buffering pair: each side stores its own
//! flag, issues `fence(SeqCst)`, then loads the other's (the flags themselves `Relaxed`), so
//! at least one side sees the other: the sleeper's side is `sync::SleepFlag::raise` (or
//! `SleepCount::enter`), the poster's `sync::posted`, and loom models check the pairs
//! (`RUSTFLAGS="--cfg qpip_loom" cargo test -p qpip-verbs --release --lib loom`, in
//! scripts/test).
//!
//! | sleeper, where | woken by | flag | fence pair |
//! |---|---|---|---|
//! | CQ waiter, futex `CqShared::seq` (`CompletionQueue::wait`) | `CqShared::notify` after a batch of completions (whoever runs the processor); `CqShared::wake` (a `CqWaker`) | `CqShared::sleepers` | Dekker: waiter counts itself, fence, reads `seq`, polls ring and `woken` / notifier pushes (or sets `woken`), fence, reads `sleepers` |
//! | whoever drives (a host thread, or the NIC thread in its `rules::Run::ForWaiters` drive), asleep on the processor's descriptor (`sleep::sleep` on `Processor::watch_fd`, or `sleep::sleep_epoll` on it where the processor lends `wake_events`, from `shell::drive`) | the waker (it makes that descriptor readable): `NicThread::ring_doorbell`, `NicThread::manage`, a waiter asking for the processor (`wanted`), `CqShared::wake` through [`QueueDriver::interrupt`]; the kernel | `Shared::sleeping` (doorbells), `CqShared::driving` (CQ wakes) | Dekker: sleeper sets `sleeping`, fence, looks at the FIFO, commands and its stop condition (the CQ's news, `wanted`) / poster pushes, fence, reads `sleeping`; waker sets `woken`, fence, reads `driving` (counted before the drive's first sleep fence). Commands and `wanted` ring the waker always |
//! | NIC thread parked, `DrivenQueue::sleep` on its kick alone (`Handover::kick`, an eventfd), timed (grace) or until a drive ends (`rules::Raised::ParkedUntimed`) | `Handover::kick`: `manage`, `shutdown`, a leaving driver (`rules::leave`); a timed sleep's own timeout | `Handover::parked_untimed` (untimed only) | Dekker: the sleep raises it, fence, looks (`Raised::sleeps`: the same drive still holds the engine) / driver unlocks, stores `last_exit`, fence, reads it. The kick's count stays until a sleep that saw it takes it (before the next look), so a kick before the sleep ends it at once |
//! | NIC thread watching, `DrivenQueue::sleep` on `Processor::watch_fd` and its kick, without the processor (`rules::Raised::Watching`) | the waker (in that descriptor): `ring_doorbell`, `manage`; the kick: `manage`, `shutdown`, a leaving driver that leaves work (`Call::NicThread`); the kernel | `Handover::watching` (doorbells) | Dekker: the sleep raises it, fence, looks (`Raised::sleeps`: the FIFO, commands, `resume`, `waiters`, `stop`) / poster pushes, fence, reads it. A leaving driver reads no flag: it kicks whenever it leaves sends, waiters or work, and the kick's count outlives a sleep not yet begun |
//! | NIC thread in the doorbell wait, `DrivenQueue::sleep` on its kick, at most `rules::DOORBELL_WAIT` | `Handover::kick`, or its timeout | none: bounded | none needed |
//! | waiter asking for the processor, blocked on the engine lock | the holder's unlock (the NIC thread's is fair: straight to the asker) | `Handover::wanted` | `wanted` (Release) then the waker, always; the NIC thread reads it (Acquire) after each turn and before each sleep |
//! | async CQ waiter (`wait_async`, `CqShared::event`) | `notify`, `wake` | the listener | event-listener's: listen, then poll again / `Event::notify` fences before it looks for listeners. Async waiters never drive: on a driven queue their completions come from the NIC thread, at most a grace after the last drive |
//! | command reply (`ReplyReceiver::wait_until`) | `ReplySender::send`, or its drop | the slot's state, under its mutex | the slot's mutex, then event-listener's as above; the command itself reaches the engine through `manage` (waker and kick, always) |
//!
//! A full bounded doorbell FIFO is not a sleep: the poster rings the waker and yields until
//! the engine makes room. Nor is a poller's yield (the NIC thread's at every look, a host's at
//! every fourth, `shell::HOST_YIELD_EVERY`, each skipped while yields have been handing the
//! core to a CPU hog, [`crate::give_way`]): the thread stays runnable, so no wake-up is owed.
//!
//! **Edges a poll leaves behind.** A host thread that polls within its window, while its CQ's
//! last waits were all caught by polling (`PollWindow::polling_catches_work`; none slept, and
//! this one has not yet), looks through `Processor::poll`, which may read the queue's one
//! socket directly instead of asking the descriptor (the soft NIC's epoll engine, when a
//! single QP is all that may bring work): one
//! non-blocking read per look, the busy-polling socket reader's call. epoll still holds that
//! socket's edge-triggered event for what the read took, and whoever asks it next (the
//! driver's own sleep, or the NIC thread's first step after its grace: it steps before it
//! watches) gets it back as the socket is then, writable-only or readable with bytes there
//! now. The QP's flags are what the read left (spent at `EAGAIN` or a short read, as after an
//! event), so the event tells it nothing new and is not work (`Progress::Idle`): a sleep it
//! ends early takes it and sleeps again (one `epoll_wait` more) without learning a wake-up
//! from it, and no read is made for it. No wake-up is lost either: a direct read never takes
//! an edge, so bytes or a close that come after a short read are still reported to the next
//! look. The NIC thread, a host that never polls and a host whose waits sleep only step
//! (`shell::drive`): a sleeper is woken through the descriptor, and the edge a direct read
//! leaves there made each of its wake-ups dearer for the peer that sends (BENCHMARKS, "Why
//! the direct read made `nbd qd1` dearer").
//!
//! **One sleep site.** The processor never blocks: it steps (`Processor::step` returns a
//! `Progress`), names the descriptor to watch (`Processor::watch_fd`) and says when its
//! timers are due (`Processor::poll_in`), as smoltcp's interface does. Every sleep of the
//! NIC thread and of a host thread driving is in `sleep`: one `ppoll(2)` on that
//! descriptor, the NIC thread's kick, or both, with the timeout the rules give; or, where the
//! descriptor is an epoll instance that lends its event buffer (`Processor::wake_events`,
//! the epoll engine) and no kick is watched, `sleep::sleep_epoll`: the `epoll_wait(2)` its
//! next step would make, whose events that step takes (the waker is in the same epoll set,
//! so every wake-up above still ends it).
//!
//! **The NIC thread's loop** (`DrivenQueue::run_nic_thread`) is one loop over one state
//! machine, `rules::NicThreadRules`: each turn reads the shared flags into one
//! `rules::NicLook` (`DrivenQueue::look`), asks `NicThreadRules::next`, and carries out
//! its `rules::NicAction` — drive (take the processor unless a host thread holds it, run it
//! until idle, for waiters, or not at all; then let go fairly), sleep, or stop. Its own
//! loop sleeps in one call, `DrivenQueue::sleep`, where the flag the rules name
//! (`rules::Raised`) is raised, the look after its fence taken and the flag lowered, once
//! for both pairs of the table above (parked untimed, watching). Its only other sleep is
//! inside a `Run::ForWaiters` drive: `shell::drive`'s, on the processor's descriptor, the
//! sleep host drivers share.
//!
//! **The files.** This one: the contract, and the [`QueueDriver`] a CQ wait drives through;
//! `rules`: the hand-over decisions, pure (a host thread's arrival and departure, the NIC
//! thread's state machine); `driven`: the driven queue (the processor behind its engine
//! lock, the NIC thread's loop, a host thread's drive) translating the shared flags to the
//! rules and back; `handover`: the flags host drivers and the NIC thread share; `sleep`:
//! the one place they sleep; `sync`: the sleepers' side of the fence pairs, and their loom
//! models. The NIC thread's shell (command queue, doorbell FIFO, turns) is
//! [`crate::machines::shell`].

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::poll_window::KeptWindow;

mod driven;
pub(crate) mod handover;
pub(crate) mod rules;
pub(crate) mod sleep;

pub use sleep::EpollEvents;
pub(crate) mod sync;

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

/// A thread's wait on a CQ of a driven queue, counted while it lasts: it drives the queue or
/// sleeps behind its driver, and a driver that leaves while others wait has the NIC thread
/// drive for them. Made by [`QueueDriver::begin_wait`]; dropping it ends the wait.
pub struct Waiting<'a> {
    waiters: &'a AtomicU32,
}

impl<'a> Waiting<'a> {
    /// Counts a wait in `waiters` until the guard drops.
    pub(crate) fn new(waiters: &'a AtomicU32) -> Self {
        waiters.fetch_add(1, Ordering::SeqCst);
        Waiting { waiters }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A NIC queue that host threads may drive.
pub trait QueueDriver: Send + Sync {
    /// The calling thread starts waiting on a CQ of this queue, until the guard drops.
    fn begin_wait(&self) -> Waiting<'_>;
    /// Runs the queue's work on the calling thread (within its `wait`) until `ready()` holds
    /// or `deadline` passes, counted in `driving` while it does; polls after its last work
    /// for `window` (its CQ's, learned from arrivals and kept there), at most `spin`, then
    /// sleeps until the queue's sockets wake it. Returns [`Driven::Busy`] when another
    /// thread drives it, or asks for it.
    fn drive(
        &self,
        wait: &Waiting<'_>,
        driving: &AtomicU32,
        window: &KeptWindow,
        ready: &dyn Fn() -> bool,
        spin: Duration,
        deadline: Option<Instant>,
    ) -> Driven;
    /// Makes a drive that is blocked waiting for the queue's sockets look at `ready` again
    /// (a CQ woken from outside the NIC).
    fn interrupt(&self);
}
