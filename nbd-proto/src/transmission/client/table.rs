//! The session's table of requests in flight, shared with the transport's framer: the one
//! place the client keeps them. The framer ([`InFlight::frame`], in
//! [`crate::placement::client`]) reads it on the NIC's thread to frame replies and place READ
//! data; the session changes it on the caller's thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::assembly::{Entry, Framing, ReadTarget, Violation};

/// The requests in flight of one [`super::ClientSession`], a handle to share with the
/// transport's framer: clones name the same table.
#[derive(Debug)]
pub struct InFlight<R>(Arc<Mutex<Table<R>>>);

impl<R> Clone for InFlight<R> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<R> Default for InFlight<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R> InFlight<R> {
    /// An empty table, to give the framer of a connection before its session exists.
    pub fn new() -> Self {
        Self(Arc::new(Mutex::new(Table {
            entries: HashMap::new(),
            structured: false,
        })))
    }

    /// The table, locked. Nothing that holds the lock panics, but a poisoned lock is taken
    /// over anyway: the entries stay consistent one operation at a time.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Table<R>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the lock guards.
#[derive(Debug)]
pub(crate) struct Table<R> {
    /// Cookie → request in flight.
    pub entries: HashMap<u64, Entry<R>>,
    /// Structured replies on the current connection (else simple replies carry READ data).
    pub structured: bool,
}

impl<R: ReadTarget> Table<R> {
    pub(crate) fn entry(&mut self, cookie: u64) -> Result<&mut Entry<R>, Violation> {
        self.entries
            .get_mut(&cookie)
            .ok_or(Violation::UnknownCookie(cookie))
    }

    /// A new connection: every request starts over, unsent.
    pub(crate) fn restart(&mut self, structured: bool) {
        self.structured = structured;
        self.entries.values_mut().for_each(Entry::reset);
        debug_assert!(self.entries.values().all(|e| e.framing == Framing::Unsent));
    }
}
