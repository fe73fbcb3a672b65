//! One-shot replies from the NIC's management state machine to a waiting host thread or task.
//!
//! A waiter may give up (a timed-out accept). The NIC must not then do what the answer reports
//! — mate a connection to a QP its host is about to drop, losing the connection — so before it
//! acts it [claims](ReplySender::claim) the answer: a waiter that gives up before the claim
//! abandons it and the NIC leaves the work undone; once claimed, the waiter takes the answer,
//! however late it comes.

use std::sync::Arc;
use std::time::Instant;

use event_listener::{Event, Listener};
use parking_lot::Mutex;

enum State<T> {
    /// Nobody has acted on the command yet.
    Waiting,
    /// The NIC has begun to act on it: the waiter must take the answer.
    Claimed,
    /// The answer, not yet taken.
    Answered(T),
    /// The waiter gave up before the NIC claimed it, or took the answer, or the NIC dropped
    /// the command unanswered.
    Closed,
}

struct Slot<T> {
    state: Mutex<State<T>>,
    event: Event,
}

/// The NIC's end: fills the slot once.
pub struct ReplySender<T>(Arc<Slot<T>>);

/// The host's end: waits, blocking or async.
pub struct ReplyReceiver<T>(Arc<Slot<T>>);

/// A one-shot channel for a NIC command's answer.
pub fn reply_channel<T>() -> (ReplySender<T>, ReplyReceiver<T>) {
    let slot = Arc::new(Slot {
        state: Mutex::new(State::Waiting),
        event: Event::new(),
    });
    (ReplySender(slot.clone()), ReplyReceiver(slot))
}

impl<T> ReplySender<T> {
    /// Answers (nothing happens if the receiver is gone).
    pub fn send(self, value: T) {
        {
            let mut state = self.0.state.lock();
            if matches!(*state, State::Waiting | State::Claimed) {
                *state = State::Answered(value);
            }
        }
        self.0.event.notify(usize::MAX);
    }

    /// Nobody will take the answer: the waiter gave up before a claim (or is gone). A NIC
    /// that keeps commands queued drops these.
    pub fn abandoned(&self) -> bool {
        matches!(*self.0.state.lock(), State::Closed)
    }

    /// Commits the NIC to answering: false if the waiter has already given up (then the
    /// command's work must not be done); after true, the waiter takes the answer.
    pub fn claim(&self) -> bool {
        let mut state = self.0.state.lock();
        match *state {
            State::Waiting => {
                *state = State::Claimed;
                true
            }
            State::Claimed => true,
            State::Answered(_) | State::Closed => false,
        }
    }
}

impl<T> ReplyReceiver<T> {
    fn take(&self) -> Option<T> {
        let mut state = self.0.state.lock();
        if matches!(*state, State::Answered(_)) {
            match std::mem::replace(&mut *state, State::Closed) {
                State::Answered(v) => return Some(v),
                _ => unreachable!("checked above"),
            }
        }
        None
    }

    /// Gives up unless the NIC has claimed the command: true if it has (the answer will come).
    fn give_up(&self) -> bool {
        let mut state = self.0.state.lock();
        match *state {
            State::Waiting => {
                *state = State::Closed;
                false
            }
            State::Claimed | State::Answered(_) => true,
            State::Closed => false,
        }
    }

    /// No answer will come (looked at after listening: the sender closes the slot before it
    /// notifies, where its handle's count fell only after).
    fn closed(&self) -> bool {
        matches!(*self.0.state.lock(), State::Closed)
    }

    /// The reply if it has arrived, without waiting (the virtual-time simulation).
    pub fn try_recv(&self) -> Option<T> {
        self.take()
    }

    /// Waits until the reply arrives or `deadline` passes — or, if the NIC claimed the command
    /// by then, until its answer comes.
    pub fn wait_until(self, mut deadline: Option<Instant>) -> Option<T> {
        loop {
            if let Some(v) = self.take() {
                return Some(v);
            }
            let listener = self.0.event.listen();
            if let Some(v) = self.take() {
                return Some(v);
            }
            if self.closed() {
                return None; // the sender went without replying
            }
            match deadline {
                Some(d) => {
                    if listener.wait_deadline(d).is_none() {
                        if !self.give_up() {
                            return None;
                        }
                        deadline = None; // claimed: the answer is on its way
                    }
                }
                None => listener.wait(),
            }
        }
    }

    /// Waits for the answer from async code; None if the sender was dropped.
    pub async fn wait_async(self) -> Option<T> {
        loop {
            if let Some(v) = self.take() {
                return Some(v);
            }
            let listener = self.0.event.listen();
            if let Some(v) = self.take() {
                return Some(v);
            }
            if self.closed() {
                return None;
            }
            listener.await;
        }
    }
}

impl<T> Drop for ReplyReceiver<T> {
    fn drop(&mut self) {
        // A waiter that goes without its answer (a cancelled future) abandons the command if
        // the NIC has not claimed it yet.
        self.give_up();
    }
}

impl<T> Drop for ReplySender<T> {
    fn drop(&mut self) {
        // A sender that goes without replying closes the slot, then wakes the waiter to see it.
        {
            let mut state = self.0.state.lock();
            if matches!(*state, State::Waiting | State::Claimed) {
                *state = State::Closed;
            }
        }
        self.0.event.notify(usize::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_waiter_that_gives_up_first_abandons_the_command() {
        let (tx, rx) = reply_channel::<u32>();
        assert_eq!(rx.wait_until(Some(Instant::now())), None);
        assert!(!tx.claim(), "the NIC must not act on an abandoned command");
    }

    #[test]
    fn a_claimed_command_is_answered_even_after_the_deadline() {
        let (tx, rx) = reply_channel::<u32>();
        assert!(tx.claim());
        let nic = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            tx.send(7);
        });
        assert_eq!(rx.wait_until(Some(Instant::now())), Some(7));
        nic.join().unwrap();
    }

    /// The sender's drop races the waiter's last look many times: a wake-up it sends before
    /// the waiter listens again must not be lost (the waiter would hang).
    #[test]
    fn a_sender_dropped_while_the_waiter_looks_again_is_noticed() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..5_000 {
                let (tx, rx) = reply_channel::<u32>();
                assert!(tx.claim());
                let nic = std::thread::spawn(move || drop(tx));
                assert_eq!(rx.wait_until(Some(Instant::now())), None);
                nic.join().unwrap();
            }
            let _ = done.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(60)).is_ok(),
            "a waiter missed its sender's drop"
        );
    }

    #[test]
    fn a_claim_that_is_dropped_unanswered_ends_the_wait() {
        let (tx, rx) = reply_channel::<u32>();
        assert!(tx.claim());
        let nic = std::thread::spawn(move || drop(tx));
        assert_eq!(rx.wait_until(Some(Instant::now())), None);
        nic.join().unwrap();
    }
}
