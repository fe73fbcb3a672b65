//! The hand-over rules ([`crate::drive`]): who runs a driven queue's processor at each moment,
//! decided from what the deciding thread sees, with no atomics, no locks and no clock of
//! their own. Each decision point of `driven` builds one of the looks below from the shared
//! flags, asks the rules, and carries out the action they return; the time is passed in
//! (`now`), so every rule is tested here without threads.

use std::time::{Duration, Instant};

use super::Driven;

/// How long the NIC thread leaves the queue to its host threads after the last drive.
pub const GRACE: Duration = Duration::from_millis(20);

/// How long a watching NIC thread woken by a doorbell leaves it to the posting thread, which
/// usually comes to wait on its CQ within microseconds (a poster that never waits has its WRs
/// go out this much later).
pub(crate) const DOORBELL_WAIT: Duration = Duration::from_micros(100);

// ---- A host thread that waits on a CQ ----

/// What a waiter sees when it comes to drive its CQ's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Arrival {
    /// The NIC stops, or its thread has died.
    pub gone: bool,
    /// A waiter has asked the NIC thread to let go of the processor.
    pub wanted: bool,
    /// Threads in a CQ wait on the queue, this one included.
    pub waiters: u32,
}

/// What a waiter does when it comes to drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Approach {
    /// Nobody will run the queue: sleep on the CQ (its end flushes the WRs).
    Gone,
    /// Take the processor if it is free; if it is held, do as said.
    Take(IfHeld),
    /// Leave the processor alone (another waiter asked for it, and it may be what this one
    /// waits for), and do as said.
    Held(IfHeld),
}

/// What a waiter does when it cannot take the processor at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IfHeld {
    /// The only waiter: the holder is the NIC thread (or a driver on its way out, which lets
    /// go at once). Ask the NIC thread to let go (`wanted`, the waker) and wait for the lock.
    Ask,
    /// Another host thread drives: sleep on the CQ; the driver's completions wake us.
    SleepBehind,
}

/// Who drives: a waiter takes a free processor; the only waiter asks the NIC thread for a
/// held one; any other waiter sleeps behind the driver.
pub(crate) fn arrive(a: Arrival) -> Approach {
    if a.gone {
        return Approach::Gone;
    }
    let if_held = if a.waiters == 1 {
        IfHeld::Ask
    } else {
        IfHeld::SleepBehind
    };
    if a.wanted {
        Approach::Held(if_held)
    } else {
        Approach::Take(if_held)
    }
}

/// How a run of the processor's turns ended (`machines::shell::drive`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// Its stop condition held.
    Done,
    /// The deadline passed first (or the queue stopped before the run began).
    Deadline,
}

/// What a drive tells its waiter: `ready`, the waiter's condition, looked at after the drive.
pub(crate) fn outcome(ended: Ended, ready: bool) -> Driven {
    match (ended, ready) {
        (Ended::Done, true) => Driven::Ready,
        // Stopped, or another waiter asked for the queue: sleep behind it.
        (Ended::Done, false) => Driven::Busy,
        (Ended::Deadline, _) => Driven::TimedOut,
    }
}

/// What a driver sees once it has let go of the processor (after the fence that pairs with
/// the NIC thread's announcements).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Departure {
    /// Posted sends still wait for the wire.
    pub sending: bool,
    /// Threads in a CQ wait on the queue, the leaving one included.
    pub waiters: u32,
    /// Commands or doorbells are queued.
    pub work: bool,
    /// The NIC thread sleeps without a timer until a drive ends.
    pub parked_untimed: bool,
}

/// Whom a leaving driver wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    /// Nobody: the queue is left to the next waiter, or to the NIC thread after its grace.
    Nobody,
    /// The NIC thread (its kick, wherever it sleeps), to look again and drive.
    NicThread,
}

/// Handing back: a driver that leaves while others wait, with sends under way or work
/// queued, or behind a NIC thread that sleeps until a drive ends, wakes the NIC thread.
pub(crate) fn leave(d: Departure) -> Call {
    if d.sending || d.waiters > 1 || d.work || d.parked_untimed {
        Call::NicThread
    } else {
        Call::Nobody
    }
}

// ---- The NIC thread ----

/// What the parked NIC thread sees of the processor when it looks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ParkLook {
    /// The NIC stops.
    Stopped,
    /// A host thread holds the processor; `drives` host drives have begun so far.
    Held { drives: u64 },
    /// Nobody holds it.
    Free {
        /// A driver left with sends under way.
        resume: bool,
        /// Threads in a CQ wait on the queue.
        waiters: u32,
        /// Commands or doorbells are queued.
        work: bool,
        /// When the last host drive ended (None: there never was one).
        last_drive_end: Option<Instant>,
    },
}

/// What the parked NIC thread does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Park {
    /// End the thread.
    Stop,
    /// Take the processor and drive.
    Drive,
    /// Sleep on the kick at most this long, then look again.
    Sleep(Duration),
    /// Sleep on the kick until the drive of this count ends (its end wakes us: announce
    /// it, then look again that it still runs).
    UntilDriveEnds { drives: u64 },
}

/// The NIC thread's rules, with what it learned since it parked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Parking {
    grace: Duration,
    /// Host drives counted at the last look at a held processor (None: no look yet).
    seen_drives: Option<u64>,
}

impl Parking {
    /// The NIC thread parks, leaving the queue to host threads for `grace` after a drive.
    pub(crate) fn new(grace: Duration) -> Self {
        Parking {
            grace,
            seen_drives: None,
        }
    }

    /// One look at the processor, at `now`.
    pub(crate) fn look(&mut self, look: ParkLook, now: Instant) -> Park {
        match look {
            ParkLook::Stopped => Park::Stop,
            // The first look at a held processor waits a grace period, timed: the host
            // thread it was just handed to may not have counted its drive yet, and parking
            // untimed behind it would have its end wake this thread (every request). Host
            // threads that keep driving are looked at again after each grace period; one
            // drive for a whole grace period (a waiter blocked on an idle connection) is
            // slept behind until its end wakes us.
            ParkLook::Held { drives } => {
                if self.seen_drives == Some(drives) {
                    Park::UntilDriveEnds { drives }
                } else {
                    self.seen_drives = Some(drives);
                    Park::Sleep(self.grace)
                }
            }
            // Waiters asleep behind a driver that left, sends to carry on, or commands:
            // drive now. Otherwise stay parked for the grace after the last drive, so that
            // a thread that comes back to wait within it (a request–reply loop) finds the
            // processor free and nobody to wake; what arrives meanwhile waits at most that
            // long, as interrupt moderation delays an interrupt.
            ParkLook::Free {
                resume,
                waiters,
                work,
                last_drive_end,
            } => {
                if resume || waiters > 0 || work {
                    return Park::Drive;
                }
                match last_drive_end.map(|end| now.saturating_duration_since(end)) {
                    Some(idle) if idle < self.grace => Park::Sleep(self.grace - idle),
                    _ => Park::Drive,
                }
            }
        }
    }
}

/// What the NIC thread sees once it holds the processor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Holding {
    /// It must let go (the NIC stops, or a waiter asked for the processor).
    pub let_go: bool,
    /// Threads in a CQ wait on the queue.
    pub waiters: u32,
}

/// How the NIC thread runs the processor it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Run {
    /// Not at all: let go at once.
    LetGo,
    /// Turns without sleeping until one finds nothing to do, then let go and watch.
    UntilIdle,
    /// Host threads wait without driving (asleep behind a driver that left): drive for them,
    /// sleeping on the processor's descriptor, while they do.
    ForWaiters,
}

/// What the NIC thread does with the processor it took.
pub(crate) fn hold(h: Holding) -> Run {
    if h.let_go {
        Run::LetGo
    } else if h.waiters == 0 {
        Run::UntilIdle
    } else {
        Run::ForWaiters
    }
}

/// How the NIC thread's run of the processor ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunEnd {
    /// Nothing left to do (or nobody left to drive for).
    Idle,
    /// Told to let go (stop, or a waiter asked).
    LetGo,
}

/// Where the NIC thread sleeps after letting go of the processor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rest {
    /// Watch the processor's descriptor without the processor, so that a waiter finds it
    /// free at once.
    Watch,
    /// Park: sleep on the kick alone, the processor left to host threads.
    Park,
}

/// Letting go when idle: an idle NIC thread watches; one told to let go parks.
pub(crate) fn rest(end: RunEnd) -> Rest {
    match end {
        RunEnd::Idle => Rest::Watch,
        RunEnd::LetGo => Rest::Park,
    }
}

/// What the NIC thread sees as it starts to watch (after announcing it and the fence).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WatchLook {
    /// The NIC stops.
    pub stop: bool,
    /// Commands or doorbells are queued.
    pub work: bool,
    /// A driver left with sends under way.
    pub resume: bool,
    /// Threads in a CQ wait on the queue.
    pub waiters: u32,
}

/// Whether the watch sleeps: not when something already calls for the processor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Watch {
    /// Sleep until the descriptor is readable (the kernel, the waker) or the kick rings.
    Poll,
    /// Something is pending: go on at once.
    Skip,
}

/// Whether to sleep watching.
pub(crate) fn watch(w: WatchLook) -> Watch {
    if w.stop || w.work || w.resume || w.waiters > 0 {
        Watch::Skip
    } else {
        Watch::Poll
    }
}

/// What the NIC thread sees when the watch ends.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Woken {
    /// The NIC stops.
    pub stop: bool,
    /// Commands or doorbells are queued.
    pub work: bool,
    /// A host thread holds the processor.
    pub held: bool,
}

/// What the NIC thread does after a watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Watched {
    /// The doorbell wait: the poster usually waits on its CQ right after and drives the
    /// queue itself; sleep on the kick at most this long to give it that moment rather
    /// than take the processor from it, then look again ([`after_watch`] with `waited`).
    LeaveToPoster(Duration),
    /// Take the processor and drive (or stop).
    Drive,
    /// A host thread took the processor: park.
    Park,
}

/// After a watch: `waited`, the doorbell wait is over already.
pub(crate) fn after_watch(w: Woken, waited: bool) -> Watched {
    if w.stop {
        Watched::Drive
    } else if w.held {
        Watched::Park
    } else if w.work && !waited {
        Watched::LeaveToPoster(DOORBELL_WAIT)
    } else {
        Watched::Drive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn arrival(wanted: bool, waiters: u32) -> Arrival {
        Arrival {
            gone: false,
            wanted,
            waiters,
        }
    }

    #[test]
    fn a_waiter_takes_a_free_processor_and_the_only_one_asks_for_a_held_one() {
        assert_eq!(arrive(arrival(false, 1)), Approach::Take(IfHeld::Ask));
        assert_eq!(
            arrive(arrival(false, 3)),
            Approach::Take(IfHeld::SleepBehind)
        );
    }

    #[test]
    fn a_waiter_leaves_a_processor_another_asked_for_alone() {
        assert_eq!(
            arrive(arrival(true, 2)),
            Approach::Held(IfHeld::SleepBehind)
        );
        // Alone with `wanted` still set by a waiter that has just left: ask in turn.
        assert_eq!(arrive(arrival(true, 1)), Approach::Held(IfHeld::Ask));
    }

    #[test]
    fn a_waiter_of_a_stopped_queue_sleeps_on_its_cq() {
        let a = Arrival {
            gone: true,
            wanted: false,
            waiters: 1,
        };
        assert_eq!(arrive(a), Approach::Gone);
    }

    #[test]
    fn a_drive_tells_its_waiter_ready_busy_or_timed_out() {
        assert_eq!(outcome(Ended::Done, true), Driven::Ready);
        assert_eq!(outcome(Ended::Done, false), Driven::Busy);
        assert_eq!(outcome(Ended::Deadline, true), Driven::TimedOut);
        assert_eq!(outcome(Ended::Deadline, false), Driven::TimedOut);
    }

    fn departure() -> Departure {
        Departure {
            sending: false,
            waiters: 1,
            work: false,
            parked_untimed: false,
        }
    }

    #[test]
    fn a_lone_driver_with_nothing_left_wakes_nobody() {
        // Even behind a watching NIC thread: the watcher sees what arrives itself.
        assert_eq!(leave(departure()), Call::Nobody);
    }

    #[test]
    fn a_driver_hands_back_to_the_nic_thread_when_others_wait() {
        let d = Departure {
            waiters: 2,
            ..departure()
        };
        assert_eq!(leave(d), Call::NicThread);
    }

    #[test]
    fn a_driver_hands_back_sends_under_way_queued_work_and_an_untimed_sleeper() {
        for d in [
            Departure {
                sending: true,
                ..departure()
            },
            Departure {
                work: true,
                ..departure()
            },
            Departure {
                parked_untimed: true,
                ..departure()
            },
        ] {
            assert_eq!(leave(d), Call::NicThread, "{d:?}");
        }
    }

    fn free(last_drive_end: Option<Instant>) -> ParkLook {
        ParkLook::Free {
            resume: false,
            waiters: 0,
            work: false,
            last_drive_end,
        }
    }

    #[test]
    fn the_nic_thread_drives_at_once_when_no_host_ever_drove() {
        let mut p = Parking::new(GRACE);
        assert_eq!(p.look(free(None), Instant::now()), Park::Drive);
    }

    #[test]
    fn the_nic_thread_waits_out_the_grace_after_the_last_drive() {
        let t0 = Instant::now();
        let mut p = Parking::new(20 * MS);
        assert_eq!(p.look(free(Some(t0)), t0), Park::Sleep(20 * MS));
        assert_eq!(p.look(free(Some(t0)), t0 + 5 * MS), Park::Sleep(15 * MS));
        assert_eq!(p.look(free(Some(t0)), t0 + 20 * MS), Park::Drive);
        assert_eq!(p.look(free(Some(t0)), t0 + 60 * MS), Park::Drive);
    }

    #[test]
    fn waiters_sends_and_commands_end_the_grace() {
        let t0 = Instant::now();
        let mut p = Parking::new(20 * MS);
        let asks = [
            ParkLook::Free {
                resume: true,
                waiters: 0,
                work: false,
                last_drive_end: Some(t0),
            },
            ParkLook::Free {
                resume: false,
                waiters: 1,
                work: false,
                last_drive_end: Some(t0),
            },
            ParkLook::Free {
                resume: false,
                waiters: 0,
                work: true,
                last_drive_end: Some(t0),
            },
        ];
        for look in asks {
            assert_eq!(p.look(look, t0), Park::Drive, "{look:?}");
        }
    }

    #[test]
    fn the_nic_thread_sleeps_timed_behind_busy_hosts_and_untimed_behind_one_long_drive() {
        let t0 = Instant::now();
        let mut p = Parking::new(20 * MS);
        // First look: timed, the holder may not have counted its drive yet.
        assert_eq!(
            p.look(ParkLook::Held { drives: 7 }, t0),
            Park::Sleep(20 * MS)
        );
        // Drives keep beginning: timed again.
        assert_eq!(
            p.look(ParkLook::Held { drives: 9 }, t0),
            Park::Sleep(20 * MS)
        );
        // The same drive a whole grace later: until its end wakes us.
        assert_eq!(
            p.look(ParkLook::Held { drives: 9 }, t0),
            Park::UntilDriveEnds { drives: 9 }
        );
        // What was learned lasts only while parked.
        let mut p = Parking::new(20 * MS);
        assert_eq!(
            p.look(ParkLook::Held { drives: 9 }, t0),
            Park::Sleep(20 * MS)
        );
    }

    #[test]
    fn a_stopping_nic_thread_ends() {
        let mut p = Parking::new(GRACE);
        assert_eq!(p.look(ParkLook::Stopped, Instant::now()), Park::Stop);
    }

    fn holding(let_go: bool, waiters: u32) -> Holding {
        Holding { let_go, waiters }
    }

    #[test]
    fn the_nic_thread_runs_until_idle_for_nobody_and_drives_for_waiters() {
        assert_eq!(hold(holding(true, 0)), Run::LetGo);
        assert_eq!(hold(holding(true, 2)), Run::LetGo);
        assert_eq!(hold(holding(false, 0)), Run::UntilIdle);
        assert_eq!(hold(holding(false, 2)), Run::ForWaiters);
    }

    #[test]
    fn an_idle_nic_thread_lets_go_and_watches() {
        assert_eq!(rest(RunEnd::Idle), Rest::Watch);
        assert_eq!(rest(RunEnd::LetGo), Rest::Park);
    }

    #[test]
    fn a_watch_sleeps_only_when_nothing_is_pending() {
        let quiet = WatchLook {
            stop: false,
            work: false,
            resume: false,
            waiters: 0,
        };
        assert_eq!(watch(quiet), Watch::Poll);
        for w in [
            WatchLook {
                stop: true,
                ..quiet
            },
            WatchLook {
                work: true,
                ..quiet
            },
            WatchLook {
                resume: true,
                ..quiet
            },
            WatchLook {
                waiters: 1,
                ..quiet
            },
        ] {
            assert_eq!(watch(w), Watch::Skip, "{w:?}");
        }
    }

    #[test]
    fn a_doorbell_is_left_to_its_poster_for_the_doorbell_wait() {
        let rung = Woken {
            stop: false,
            work: true,
            held: false,
        };
        assert_eq!(
            after_watch(rung, false),
            Watched::LeaveToPoster(DOORBELL_WAIT)
        );
        // The poster did not come: the NIC thread sends its WRs.
        assert_eq!(after_watch(rung, true), Watched::Drive);
        // It came and drives.
        let taken = Woken { held: true, ..rung };
        assert_eq!(after_watch(taken, true), Watched::Park);
        assert_eq!(after_watch(taken, false), Watched::Park);
    }

    #[test]
    fn a_readable_descriptor_has_the_nic_thread_drive_unless_a_host_took_it() {
        let readable = Woken {
            stop: false,
            work: false,
            held: false,
        };
        assert_eq!(after_watch(readable, false), Watched::Drive);
        let taken = Woken {
            held: true,
            ..readable
        };
        assert_eq!(after_watch(taken, false), Watched::Park);
        let stopping = Woken {
            stop: true,
            ..taken
        };
        assert_eq!(after_watch(stopping, false), Watched::Drive);
    }
}
