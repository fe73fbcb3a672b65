//! One connection shared by many threads, each with its own requests in flight at the same
//! time: a server without multi-conn gets one connection, and the mount's threads still
//! pipeline on it, as nbdfuse and the kernel's client do.
//!
//! Ownership: the [`Client`] and the routing of its replies sit behind one mutex, held to
//! submit, to hand a wait's completions to the client and to pick up results, never across
//! a wait. One thread at a time *pumps*: it waits on the connection's CQ (driving the NIC
//! queue, run to completion) outside the mutex, so that others can submit meanwhile, and
//! then hands what it got to the client. The others park.
//!
//! Wake-ups (each an `unpark`): a thread whose call waits for another's pumping first yields
//! its core a few times ([`OWNER_YIELDS`]; none while yields hand the core to a CPU hog,
//! `give_way`) watching its call's flag, then looks at the pump again and parks. The pumper
//! wakes the owner of every call whose replies it routed when that call is finished or waits
//! for room in the window, and every call that waits for room when there is room. A thread that stops pumping hands the pump to the
//! first parked thread that still needs it (FIFO, so an exclusive user is not starved).
//! A locked section that replaced the connection (a reconnect while submitting) wakes the
//! pumper's wait, which would otherwise sit on a dead CQ until its 1 s limit.
//!
//! Lock order: the mutex comes before the NIC's own locks (posting, polling, connecting
//! happen under it), and no NIC code calls back into the client, so there is no cycle. It is
//! held through a reconnect's back-off (the other threads could do nothing meanwhile).
//!
//! [`SharedClient::exclusive`] lends the whole client to one thread (the blocking calls,
//! a read-modify-write): it takes the pump and the mutex together, so its own waits see
//! every completion, and routes the replies of other calls it received when it is done.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{self, Thread, ThreadId};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};
use qpip_core::{Completion, CqWaker, give_way};

use super::pipeline::Checks;
use super::{Client, Op, Output};
use crate::error::Result;
use crate::region::MrSlice;

/// A request's tag: its call's id above these bits, its index in the call below them.
const INDEX_BITS: u32 = 20;

/// Who has the pump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pump {
    Free,
    /// Handed to this parked thread, which takes it when it runs.
    HandedTo(ThreadId),
    Held(ThreadId),
}

/// A call in progress: its requests' outcomes as they come.
struct Call {
    owner: Thread,
    results: Vec<Option<Result<Output>>>,
    /// Submitted and not answered yet.
    unfinished: usize,
    /// Some of its requests wait for room in the window.
    wants_room: bool,
    /// Every request answered (for an owner that yields before it parks).
    finished: Arc<AtomicBool>,
}

/// A thread parked until it may pump: for a call (`Some`) or to use the client alone.
struct Parked {
    thread: Thread,
    call: Option<u64>,
}

struct State {
    client: Client,
    calls: HashMap<u64, Call>,
    next_call: u64,
    pump: Pump,
    /// While a pumper waits outside the mutex: what wakes it, and the connection it waits on.
    pumping_on: Option<(CqWaker, u64)>,
    parked: VecDeque<Parked>,
}

/// A [`Client`] that many threads use at once, their requests pipelined on its connection.
pub struct SharedClient {
    state: Mutex<State>,
    /// Calls in progress (for a pool's choice of connection).
    calls: AtomicUsize,
    /// The client's export size after the last locked section.
    size: AtomicU64,
}

impl std::fmt::Debug for SharedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedClient")
            .field("calls", &self.calls.load(Ordering::Relaxed))
            .finish()
    }
}

/// Completions one wait takes at most.
const BATCH: usize = 32;

/// How many times a thread whose replies another thread will receive yields its core, watching
/// for them, before it parks (once per call). A park costs a futex wait and the receiver's
/// wake-up; at QD16 through one connection four context switches per request were the cost
/// (BENCHMARKS.md, session 19: 16 yields gave QD16 against qemu-nbd +7-25 %, our server's QD16
/// writes +8 %, `nbd ext2` MB per CPU-second level; a lone request never yields, as its owner
/// receives its reply itself).
const OWNER_YIELDS: usize = 16;

impl State {
    /// Hands the client's finished requests to their calls; wakes the owners that can go on
    /// (finished, or waiting for room) unless it is `me`.
    fn route(&mut self, me: ThreadId) {
        while let Some(reply) = self.client.done.pop_front() {
            let id = reply.tag >> INDEX_BITS;
            let index = (reply.tag & ((1 << INDEX_BITS) - 1)) as usize;
            let Some(call) = self.calls.get_mut(&id) else {
                tracing::debug!(tag = reply.tag, "a reply for no call in progress");
                continue;
            };
            call.results[index] = Some(reply.result);
            call.unfinished -= 1;
            if call.unfinished == 0 {
                call.finished.store(true, Ordering::Release);
            }
            if (call.unfinished == 0 || call.wants_room) && call.owner.id() != me {
                call.owner.unpark();
            }
        }
        if self.client.session.has_room() {
            for call in self.calls.values_mut().filter(|c| c.wants_room) {
                if call.owner.id() != me {
                    call.owner.unpark();
                }
            }
        }
    }

    /// `me` may pump now (the pump is free, was handed to it, or it pumps already).
    fn may_pump(&self, me: ThreadId) -> bool {
        match self.pump {
            Pump::Free => true,
            Pump::HandedTo(t) | Pump::Held(t) => t == me,
        }
    }

    /// `me` stops pumping: the pump goes to the first parked thread that still needs it.
    fn release_pump(&mut self) {
        self.pump = Pump::Free;
        let calls = &self.calls;
        let next = self.parked.iter().find(|p| match p.call {
            None => true,
            Some(id) => calls
                .get(&id)
                .is_some_and(|c| c.unfinished > 0 || c.wants_room),
        });
        if let Some(p) = next {
            self.pump = Pump::HandedTo(p.thread.id());
            p.thread.unpark();
        }
    }

    /// Parks `me` until woken (with `call` or for the whole client), the mutex released.
    fn park(guard: &mut MutexGuard<'_, State>, call: Option<u64>) {
        let me = thread::current();
        guard.parked.push_back(Parked {
            thread: me.clone(),
            call,
        });
        MutexGuard::unlocked(guard, thread::park);
        guard.parked.retain(|p| p.thread.id() != me.id());
    }

    /// After a locked section that may have replaced the connection: a pumper still waiting
    /// on the old one's CQ is woken.
    fn wake_stale_pumper(&self) {
        if let Some((waker, generation)) = &self.pumping_on
            && *generation != self.client.link.generation()
        {
            waker.wake();
        }
    }
}

impl SharedClient {
    /// `client`, to be shared.
    pub fn new(client: Client) -> SharedClient {
        SharedClient {
            size: AtomicU64::new(client.size()),
            calls: AtomicUsize::new(0),
            state: Mutex::new(State {
                client,
                calls: HashMap::new(),
                next_call: 0,
                pump: Pump::Free,
                pumping_on: None,
                parked: VecDeque::new(),
            }),
        }
    }

    /// The client alone.
    pub fn into_inner(self) -> Client {
        self.state.into_inner().client
    }

    /// Calls in progress now.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// The export's size as the client knew it after its last call.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// Something of the client that needs no wait (its counters, its options).
    pub fn peek<R>(&self, f: impl FnOnce(&mut Client) -> R) -> R {
        f(&mut self.state.lock().client)
    }

    /// Runs `f` with the client to itself: no other thread submits or waits meanwhile. The
    /// other calls' requests stay in flight, and their replies, if `f` waits, reach them
    /// afterwards.
    pub fn exclusive<R>(&self, f: impl FnOnce(&mut Client) -> R) -> R {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let me = thread::current().id();
        let mut st = self.state.lock();
        while !st.may_pump(me) {
            State::park(&mut st, None);
        }
        st.pump = Pump::Held(me);
        let r = f(&mut st.client);
        st.route(me);
        st.release_pump();
        self.size.store(st.client.size(), Ordering::Relaxed);
        drop(st);
        self.calls.fetch_sub(1, Ordering::Relaxed);
        r
    }

    /// Runs `ops` pipelined with the other threads' requests; every outcome, in order, once
    /// every request has finished.
    fn run(&self, ops: &[Op<'_>], checks: Checks) -> Vec<Result<Output>> {
        assert!(ops.len() < 1 << INDEX_BITS, "too many requests in one call");
        self.calls.fetch_add(1, Ordering::Relaxed);
        let me = thread::current();
        let mut st = self.state.lock();
        let id = st.next_call;
        st.next_call += 1;
        st.calls.insert(
            id,
            Call {
                owner: me.clone(),
                results: (0..ops.len()).map(|_| None).collect(),
                unfinished: 0,
                wants_room: false,
                finished: Default::default(),
            },
        );

        let mut next = 0;
        let mut yielded = false;
        let mut buf = [Completion::default(); BATCH];
        loop {
            // As many of its requests as the window takes.
            while next < ops.len()
                && (st.client.session.has_room() || st.client.recovery.failed().is_some())
            {
                let tag = id << INDEX_BITS | next as u64;
                let submitted = st.client.submit_checking(tag, ops[next], checks);
                let call = st.calls.get_mut(&id).expect("the call is in progress");
                match submitted {
                    Ok(()) => call.unfinished += 1,
                    Err(e) => call.results[next] = Some(Err(e)),
                }
                next += 1;
            }
            st.wake_stale_pumper();
            st.route(me.id());
            let call = st.calls.get_mut(&id).expect("the call is in progress");
            call.wants_room = next < ops.len();
            if next == ops.len() && call.unfinished == 0 {
                break;
            }
            if !st.may_pump(me.id()) {
                if next == ops.len() && !yielded {
                    // Another thread will receive the replies: give it the core a few
                    // times before sleeping (a yield is no sleep: no wake-up is owed).
                    yielded = true;
                    let finished = st.calls[&id].finished.clone();
                    MutexGuard::unlocked(&mut st, || {
                        let mut at = Instant::now();
                        for _ in 0..OWNER_YIELDS {
                            if finished.load(Ordering::Acquire) {
                                return;
                            }
                            // Not to a CPU hog: then it parks at once.
                            match give_way::yield_core_at(at) {
                                Some(after) => at = after,
                                None => return,
                            }
                        }
                    });
                    // Finished, or not: either way the pump may have changed hands
                    // meanwhile, so look again before parking.
                    continue;
                }
                State::park(&mut st, Some(id));
                continue;
            }
            st.pump = Pump::Held(me.id());
            let data = st.client.session.data_in_flight();
            let Some(wait) = st.client.link.waiter(data) else {
                // No connection: this restores it (or fails every request).
                let _ = st.client.pump(false);
                continue;
            };
            st.pumping_on = Some((wait.waker(), wait.generation));
            let got = MutexGuard::unlocked(&mut st, || wait.wait(&mut buf));
            st.pumping_on = None;
            if wait.generation != st.client.link.generation() {
                continue; // the connection was replaced meanwhile: what it got is stale
            }
            match got {
                Ok(n) => st.client.handle(&buf[..n]),
                Err(e) => st
                    .client
                    .recover(format!("waiting for completions failed: {e}")),
            }
        }
        let call = st.calls.remove(&id).expect("the call is in progress");
        // Held, or handed to it while its last replies came.
        if matches!(st.pump, Pump::Held(t) | Pump::HandedTo(t) if t == me.id()) {
            st.release_pump();
        }
        self.size.store(st.client.size(), Ordering::Relaxed);
        drop(st);
        self.calls.fetch_sub(1, Ordering::Relaxed);
        call.results
            .into_iter()
            .map(|r| r.expect("every request of the call finished"))
            .collect()
    }

    /// The first error of `results`, if any.
    fn first_error(results: Vec<Result<Output>>) -> Result<()> {
        results
            .into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), Err)
    }

    /// The export range `offset..offset + len` cut into pieces of at most the client's
    /// largest request, checked once here; None with the check's error.
    fn pieces(&self, offset: u64, len: u64) -> Result<Vec<(u64, u32)>> {
        self.peek(|c| -> Result<_> {
            c.check_range(offset, len)?;
            Ok(Client::pieces(offset, len, u64::from(c.max_io())).collect())
        })
    }

    /// The export range `offset..offset + slice.len()`, checked, as `op` of each piece of
    /// `slice`.
    fn slice_ops<'m>(
        &self,
        offset: u64,
        slice: MrSlice<'m>,
        op: impl Fn(u64, MrSlice<'m>) -> Op<'m>,
    ) -> Result<Vec<Op<'m>>> {
        Ok(self
            .pieces(offset, slice.len() as u64)?
            .into_iter()
            .map(|(o, n)| op(o, slice.piece((o - offset) as usize, n as usize)))
            .collect())
    }

    /// Reads into registered memory, `into`: the NIC places the data there.
    pub fn read_into(&self, offset: u64, into: MrSlice<'_>) -> Result<()> {
        let ops = self.slice_ops(offset, into, |offset, into| Op::ReadInto { offset, into })?;
        Self::first_error(self.run(&ops, Checks::InCheckedRange))
    }

    /// Writes registered memory `from` (sent from there, unchanged until this returns).
    pub fn write_from(&self, offset: u64, from: MrSlice<'_>, fua: bool) -> Result<()> {
        let ops = self.slice_ops(offset, from, |offset, from| Op::WriteFrom {
            offset,
            from,
            fua,
        })?;
        Self::first_error(self.run(&ops, Checks::InCheckedRange))
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let pieces = self.pieces(offset, buf.len() as u64)?;
        let ops: Vec<Op> = pieces
            .iter()
            .map(|&(offset, len)| Op::Read { offset, len })
            .collect();
        let results = self.run(&ops, Checks::InCheckedRange);
        let mut first_err = None;
        for ((o, _), r) in pieces.into_iter().zip(results) {
            match r {
                Ok(Output::Data(d)) => {
                    let at = (o - offset) as usize;
                    buf[at..at + d.len()].copy_from_slice(&d);
                }
                Ok(_) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Writes `data` at `offset` (copied into the requests' send slots).
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let ops: Vec<Op> = self
            .pieces(offset, data.len() as u64)?
            .into_iter()
            .map(|(o, n)| {
                let at = (o - offset) as usize;
                Op::Write {
                    offset: o,
                    data: &data[at..at + n as usize],
                    fua,
                }
            })
            .collect();
        Self::first_error(self.run(&ops, Checks::InCheckedRange))
    }
}
