//! The hand-over rules ([`crate::drive`]): who runs a driven queue's processor at each moment,
//! decided from what the deciding thread sees, with no atomics, no locks and no clock of
//! their own. A host thread's decision points in `driven` (arriving, leaving) each build a
//! look from the shared flags and ask the functions below; the NIC thread's loop is one
//! state machine ([`NicThreadRules`]) it asks at every turn with one kind of look. Either carries
//! out the action returned; the time is passed in (`now`), so every rule is tested here
//! without threads.

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

/// What the NIC thread sees, read from the shared flags in one place
/// (`DrivenQueue::look`) before each decision and again after it raises a flag to sleep.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NicLook {
    /// The NIC stops.
    pub stop: bool,
    /// Someone holds the processor (a host thread: the NIC thread looks only while it does
    /// not).
    pub held: bool,
    /// Host drives begun so far.
    pub drives: u64,
    /// A waiter has asked the NIC thread to let go of the processor.
    pub wanted: bool,
    /// Threads in a CQ wait on the queue.
    pub waiters: u32,
    /// Commands or doorbells are queued.
    pub work: bool,
    /// A driver left with sends under way (cleared by the NIC thread's next take).
    pub resume: bool,
    /// When the last host drive ended (None: there never was one).
    pub last_drive_end: Option<Instant>,
}

impl NicLook {
    /// Something calls for the processor now: waiters asleep behind a driver that left,
    /// sends to carry on, commands or doorbells.
    fn calls(&self) -> bool {
        self.resume || self.waiters > 0 || self.work
    }
}

/// What the NIC thread does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NicAction {
    /// Take the processor unless a host thread holds it, run it so, let go of it (fairly:
    /// straight to a waiter that asked; then yield once if it has not taken it yet), and
    /// tell [`NicThreadRules::drove`] how the run ended.
    Drive(Run),
    /// Sleep, then look again.
    Sleep(Sleep),
    /// End the thread: the NIC stops.
    Stop,
}

/// How the NIC thread runs the processor it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Run {
    /// Not at all: let go at once (a waiter asked for it and is on its way).
    LetGo,
    /// Turns without sleeping until one finds nothing to do, then let go and watch.
    UntilIdle,
    /// Host threads wait without driving (asleep behind a driver that left): drive for them,
    /// sleeping on the processor's descriptor as a host driver does (`shell::drive`), while
    /// they do.
    ForWaiters,
}

/// How the NIC thread's drive ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunEnd {
    /// Nothing left to do (or nobody left to drive for).
    Idle,
    /// Told to let go (stop, or a waiter asked).
    LetGo,
    /// A host thread held the processor: no run.
    Busy,
}

/// One sleep of the NIC thread, always on its kick (`Handover::kick`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sleep {
    /// On the processor's descriptor too (`Processor::watch_fd`), without the processor.
    pub fd: bool,
    /// At most this long (None: until woken).
    pub timeout: Option<Duration>,
    /// The flag raised around the sleep, for the wakers that do not always kick; None: a
    /// bounded sleep nobody needs to end early but the kick.
    pub raised: Option<Raised>,
}

/// The flag a sleep raises and what the look after its fence must show for the sleep to go
/// on (the sleeper's half of its fence pair in [`crate::drive`]'s wake table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Raised {
    /// `Handover::parked_untimed`: sleep while the drive of this count holds the processor
    /// (its end kicks, or the look sees it over).
    ParkedUntimed { drives: u64 },
    /// `Handover::watching`: sleep while nothing calls for the processor (a doorbell rings
    /// the waker, or the look sees it).
    Watching,
}

impl Raised {
    /// After the raise and its fence: whether `look` lets the sleep go on.
    pub(crate) fn sleeps(self, look: &NicLook) -> bool {
        match self {
            Raised::ParkedUntimed { drives } => look.held && look.drives == drives,
            Raised::Watching => !look.stop && !look.calls(),
        }
    }
}

/// Where the NIC thread is in its loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The processor left to host threads; `seen_drives`: host drives counted at the last
    /// look at a held processor since it parked (None: no look yet).
    Parked { seen_drives: Option<u64> },
    /// Let go of the processor idle: watch its descriptor without it, so that a waiter
    /// finds it free at once.
    Watching,
    /// The watch ended; `waited`: the doorbell wait is over already.
    Watched { waited: bool },
}

/// The NIC thread's decisions, one state machine: each turn of its loop builds a
/// [`NicLook`], asks [`NicThreadRules::next`] at `now`, and carries out the action.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NicThreadRules {
    /// How long the queue is left to host threads after a drive.
    grace: Duration,
    state: State,
}

impl NicThreadRules {
    /// Parked, leaving the queue to host threads for `grace` after a drive.
    pub(crate) fn new(grace: Duration) -> Self {
        NicThreadRules {
            grace,
            state: State::Parked { seen_drives: None },
        }
    }

    /// The next action, from `look` at `now`.
    pub(crate) fn next(&mut self, look: NicLook, now: Instant) -> NicAction {
        if look.stop {
            return NicAction::Stop;
        }
        // Transitions that need no new look take the same one.
        loop {
            match self.state {
                State::Parked { seen_drives } => return self.parked(seen_drives, &look, now),
                State::Watching if look.calls() => self.state = State::Watched { waited: false },
                State::Watching => {
                    self.state = State::Watched { waited: false };
                    return NicAction::Sleep(Sleep {
                        fd: true,
                        timeout: None,
                        raised: Some(Raised::Watching),
                    });
                }
                // A host thread took the processor: park.
                State::Watched { .. } if look.held => {
                    self.state = State::Parked { seen_drives: None }
                }
                // The doorbell wait: the poster usually waits on its CQ right after and
                // drives the queue itself; give it that moment rather than take the
                // processor from it, then look again.
                State::Watched { waited: false } if look.work => {
                    self.state = State::Watched { waited: true };
                    return NicAction::Sleep(Sleep {
                        fd: false,
                        timeout: Some(DOORBELL_WAIT),
                        raised: None,
                    });
                }
                // The descriptor is readable, a driver left something, or the poster did not
                // come: drive.
                State::Watched { .. } => return drive(&look),
            }
        }
    }

    /// The drive of the last [`NicAction::Drive`] ended so: an idle NIC thread lets go and
    /// watches, one told to let go (or that found a host thread driving) parks.
    pub(crate) fn drove(&mut self, end: RunEnd) {
        self.state = match end {
            RunEnd::Idle => State::Watching,
            RunEnd::LetGo | RunEnd::Busy => State::Parked { seen_drives: None },
        };
    }

    fn parked(&mut self, seen_drives: Option<u64>, look: &NicLook, now: Instant) -> NicAction {
        if look.held {
            // The first look at a held processor waits a grace period, timed: the host
            // thread it was just handed to may not have counted its drive yet, and parking
            // untimed behind it would have its end wake this thread (every request). Host
            // threads that keep driving are looked at again after each grace period; one
            // drive for a whole grace period (a waiter blocked on an idle connection) is
            // slept behind until its end wakes us.
            if seen_drives == Some(look.drives) {
                return NicAction::Sleep(Sleep {
                    fd: false,
                    timeout: None,
                    raised: Some(Raised::ParkedUntimed {
                        drives: look.drives,
                    }),
                });
            }
            self.state = State::Parked {
                seen_drives: Some(look.drives),
            };
            return parked_for(self.grace);
        }
        // Waiters asleep behind a driver that left, sends to carry on, or commands: drive
        // now. Otherwise stay parked for the grace after the last drive, so that a thread
        // that comes back to wait within it (a request–reply loop) finds the processor free
        // and nobody to wake; what arrives meanwhile waits at most that long, as interrupt
        // moderation delays an interrupt.
        let idle = look
            .last_drive_end
            .map(|end| now.saturating_duration_since(end));
        if !look.calls()
            && let Some(idle) = idle
            && idle < self.grace
        {
            return parked_for(self.grace - idle);
        }
        drive(look)
    }
}

/// Parked on the kick alone, at most `timeout`.
fn parked_for(timeout: Duration) -> NicAction {
    NicAction::Sleep(Sleep {
        fd: false,
        timeout: Some(timeout),
        raised: None,
    })
}

/// Drive: let go at once for a waiter that asked, drive for waiters asleep behind a driver
/// that left, or run until idle for nobody. [`NicThreadRules::drove`] decides what follows.
fn drive(look: &NicLook) -> NicAction {
    NicAction::Drive(if look.wanted {
        Run::LetGo
    } else if look.waiters == 0 {
        Run::UntilIdle
    } else {
        Run::ForWaiters
    })
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

    fn quiet() -> NicLook {
        NicLook {
            stop: false,
            held: false,
            drives: 0,
            wanted: false,
            waiters: 0,
            work: false,
            resume: false,
            last_drive_end: None,
        }
    }

    /// A host thread drives: it counts as a waiter.
    fn held(drives: u64) -> NicLook {
        NicLook {
            held: true,
            drives,
            waiters: 1,
            ..quiet()
        }
    }

    const WATCH: NicAction = NicAction::Sleep(Sleep {
        fd: true,
        timeout: None,
        raised: Some(Raised::Watching),
    });

    const DOORBELL_WAITED: NicAction = NicAction::Sleep(Sleep {
        fd: false,
        timeout: Some(DOORBELL_WAIT),
        raised: None,
    });

    /// A NIC thread whose run just found nothing to do.
    fn watching() -> NicThreadRules {
        let mut n = NicThreadRules::new(20 * MS);
        n.drove(RunEnd::Idle);
        n
    }

    #[test]
    fn the_nic_thread_drives_at_once_when_no_host_ever_drove() {
        let mut n = NicThreadRules::new(GRACE);
        assert_eq!(
            n.next(quiet(), Instant::now()),
            NicAction::Drive(Run::UntilIdle)
        );
    }

    #[test]
    fn the_nic_thread_waits_out_the_grace_after_the_last_drive() {
        let t0 = Instant::now();
        let after = NicLook {
            last_drive_end: Some(t0),
            ..quiet()
        };
        let mut n = NicThreadRules::new(20 * MS);
        assert_eq!(n.next(after, t0), parked_for(20 * MS));
        assert_eq!(n.next(after, t0 + 5 * MS), parked_for(15 * MS));
        assert_eq!(
            n.next(after, t0 + 20 * MS),
            NicAction::Drive(Run::UntilIdle)
        );
        let mut n = NicThreadRules::new(20 * MS);
        assert_eq!(
            n.next(after, t0 + 60 * MS),
            NicAction::Drive(Run::UntilIdle)
        );
    }

    #[test]
    fn waiters_sends_and_commands_end_the_grace() {
        let t0 = Instant::now();
        let after = NicLook {
            last_drive_end: Some(t0),
            ..quiet()
        };
        for (look, run) in [
            (
                NicLook {
                    resume: true,
                    ..after
                },
                Run::UntilIdle,
            ),
            (
                NicLook {
                    waiters: 1,
                    ..after
                },
                Run::ForWaiters,
            ),
            (
                NicLook {
                    work: true,
                    ..after
                },
                Run::UntilIdle,
            ),
        ] {
            let mut n = NicThreadRules::new(20 * MS);
            assert_eq!(n.next(look, t0), NicAction::Drive(run), "{look:?}");
        }
    }

    #[test]
    fn the_nic_thread_lets_go_for_an_asker_runs_until_idle_for_nobody_and_drives_for_waiters() {
        let now = Instant::now();
        for (look, run) in [
            (
                NicLook {
                    wanted: true,
                    waiters: 1,
                    ..quiet()
                },
                Run::LetGo,
            ),
            (quiet(), Run::UntilIdle),
            (
                NicLook {
                    waiters: 2,
                    ..quiet()
                },
                Run::ForWaiters,
            ),
        ] {
            let mut n = NicThreadRules::new(GRACE);
            assert_eq!(n.next(look, now), NicAction::Drive(run), "{look:?}");
            // The same after a watch that a readable descriptor ended.
            let mut n = watching();
            assert_eq!(n.next(quiet(), now), WATCH);
            assert_eq!(n.next(look, now), NicAction::Drive(run), "{look:?}");
        }
    }

    #[test]
    fn the_nic_thread_sleeps_timed_behind_busy_hosts_and_untimed_behind_one_long_drive() {
        let t0 = Instant::now();
        let mut n = NicThreadRules::new(20 * MS);
        // First look: timed, the holder may not have counted its drive yet.
        assert_eq!(n.next(held(7), t0), parked_for(20 * MS));
        // Drives keep beginning: timed again.
        assert_eq!(n.next(held(9), t0), parked_for(20 * MS));
        // The same drive a whole grace later: until its end wakes us.
        let untimed = NicAction::Sleep(Sleep {
            fd: false,
            timeout: None,
            raised: Some(Raised::ParkedUntimed { drives: 9 }),
        });
        assert_eq!(n.next(held(9), t0), untimed);
        assert_eq!(n.next(held(9), t0), untimed);
        // What was learned lasts only while parked: a drive (or a take a host thread
        // beat) parks afresh.
        for end in [RunEnd::LetGo, RunEnd::Busy] {
            let mut n = NicThreadRules::new(20 * MS);
            assert_eq!(n.next(held(9), t0), parked_for(20 * MS));
            assert_eq!(n.next(quiet(), t0), NicAction::Drive(Run::UntilIdle));
            n.drove(end);
            assert_eq!(n.next(held(9), t0), parked_for(20 * MS), "{end:?}");
        }
    }

    #[test]
    fn the_untimed_sleep_goes_on_only_behind_the_same_drive() {
        let behind = Raised::ParkedUntimed { drives: 9 };
        assert!(behind.sleeps(&held(9)));
        // It ended (its end kicks, or this look sees it), or another began.
        assert!(!behind.sleeps(&quiet()));
        assert!(!behind.sleeps(&held(10)));
    }

    #[test]
    fn a_stopping_nic_thread_ends_wherever_it_is() {
        let stop = NicLook {
            stop: true,
            ..held(3)
        };
        let now = Instant::now();
        let mut watched = watching();
        assert_eq!(watched.next(quiet(), now), WATCH);
        let mut waited = watching();
        assert_eq!(waited.next(quiet(), now), WATCH);
        let rung = NicLook {
            work: true,
            ..quiet()
        };
        assert_eq!(waited.next(rung, now), DOORBELL_WAITED);
        for mut n in [NicThreadRules::new(GRACE), watching(), watched, waited] {
            assert_eq!(n.next(stop, now), NicAction::Stop);
        }
    }

    #[test]
    fn an_idle_nic_thread_lets_go_and_watches_one_told_to_let_go_parks() {
        let t0 = Instant::now();
        assert_eq!(watching().next(quiet(), t0), WATCH);
        for end in [RunEnd::LetGo, RunEnd::Busy] {
            let mut n = NicThreadRules::new(20 * MS);
            n.drove(end);
            let after = NicLook {
                last_drive_end: Some(t0),
                ..quiet()
            };
            assert_eq!(n.next(after, t0), parked_for(20 * MS), "{end:?}");
        }
    }

    #[test]
    fn a_watch_sleeps_only_while_nothing_calls_for_the_processor() {
        assert!(Raised::Watching.sleeps(&quiet()));
        let pending = [
            NicLook {
                stop: true,
                ..quiet()
            },
            NicLook {
                work: true,
                ..quiet()
            },
            NicLook {
                resume: true,
                ..quiet()
            },
            NicLook {
                waiters: 1,
                ..quiet()
            },
        ];
        for look in pending {
            assert!(!Raised::Watching.sleeps(&look), "{look:?}");
        }
        // Seen before the watch begins, the same skips it: on to what follows a watch.
        let now = Instant::now();
        for (look, then) in [
            (pending[1], DOORBELL_WAITED),
            (pending[2], NicAction::Drive(Run::UntilIdle)),
            (pending[3], NicAction::Drive(Run::ForWaiters)),
            (
                NicLook {
                    held: true,
                    ..pending[3]
                },
                parked_for(20 * MS),
            ),
        ] {
            assert_eq!(watching().next(look, now), then, "{look:?}");
        }
    }

    #[test]
    fn a_doorbell_is_left_to_its_poster_for_the_doorbell_wait() {
        let now = Instant::now();
        let rung = NicLook {
            work: true,
            ..quiet()
        };
        let mut n = watching();
        assert_eq!(n.next(quiet(), now), WATCH);
        assert_eq!(n.next(rung, now), DOORBELL_WAITED);
        // The poster did not come: the NIC thread sends its WRs.
        assert_eq!(n.next(rung, now), NicAction::Drive(Run::UntilIdle));
        // It came and drives: park.
        let taken = NicLook {
            work: true,
            ..held(4)
        };
        let mut n = watching();
        assert_eq!(n.next(quiet(), now), WATCH);
        assert_eq!(n.next(rung, now), DOORBELL_WAITED);
        assert_eq!(n.next(taken, now), parked_for(20 * MS));
        let mut n = watching();
        assert_eq!(n.next(quiet(), now), WATCH);
        assert_eq!(n.next(taken, now), parked_for(20 * MS));
    }

    #[test]
    fn a_readable_descriptor_has_the_nic_thread_drive_unless_a_host_took_it() {
        let now = Instant::now();
        let mut n = watching();
        assert_eq!(n.next(quiet(), now), WATCH);
        assert_eq!(n.next(quiet(), now), NicAction::Drive(Run::UntilIdle));
        // A host took it: parked afresh, so the same drive seen again is slept behind.
        let mut n = watching();
        assert_eq!(n.next(quiet(), now), WATCH);
        assert_eq!(n.next(held(4), now), parked_for(20 * MS));
        assert_eq!(
            n.next(held(4), now),
            NicAction::Sleep(Sleep {
                fd: false,
                timeout: None,
                raised: Some(Raised::ParkedUntimed { drives: 4 }),
            })
        );
    }
}
