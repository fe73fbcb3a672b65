//! One-shot replies from the NIC's management state machine to a waiting host thread or task.

use std::sync::Arc;
use std::time::Instant;

use event_listener::{Event, Listener};
use parking_lot::Mutex;

struct Slot<T> {
    value: Mutex<Option<T>>,
    event: Event,
}

/// The NIC's end: fills the slot once.
pub struct ReplySender<T>(Arc<Slot<T>>);

/// The host's end: waits, blocking or async.
pub struct ReplyReceiver<T>(Arc<Slot<T>>);

/// A one-shot channel for a NIC command's answer.
pub fn reply_channel<T>() -> (ReplySender<T>, ReplyReceiver<T>) {
    let slot = Arc::new(Slot {
        value: Mutex::new(None),
        event: Event::new(),
    });
    (ReplySender(slot.clone()), ReplyReceiver(slot))
}

impl<T> ReplySender<T> {
    /// Answers (nothing happens if the receiver is gone).
    pub fn send(self, value: T) {
        *self.0.value.lock() = Some(value);
        self.0.event.notify(usize::MAX);
    }
    /// True when the waiter gave up (timed out or was dropped).
    pub fn is_abandoned(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }
}

impl<T> ReplyReceiver<T> {
    fn take(&self) -> Option<T> {
        self.0.value.lock().take()
    }

    /// The reply if it has arrived, without waiting (the virtual-time simulation).
    pub fn try_recv(&self) -> Option<T> {
        self.take()
    }

    /// Waits until the reply arrives or `deadline` passes.
    pub fn wait_until(self, deadline: Option<Instant>) -> Option<T> {
        loop {
            if let Some(v) = self.take() {
                return Some(v);
            }
            let listener = self.0.event.listen();
            if let Some(v) = self.take() {
                return Some(v);
            }
            if Arc::strong_count(&self.0) == 1 {
                return self.take(); // the sender is gone: it replied or never will
            }
            match deadline {
                Some(d) => {
                    if listener.wait_deadline(d).is_none() {
                        return self.take();
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
            if Arc::strong_count(&self.0) == 1 {
                return self.take();
            }
            listener.await;
        }
    }
}

impl<T> Drop for ReplySender<T> {
    fn drop(&mut self) {
        // Wake a waiter so it notices a sender that went away without replying.
        self.0.event.notify(usize::MAX);
    }
}
