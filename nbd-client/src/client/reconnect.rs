//! A lost connection: reconnect with exponential back-off and jitter, reissue every request
//! not yet answered, or — once the server has had its reconnect timeout — fail them all. It
//! drives the client's parts: recovery's clocks, the link's connection, the session's
//! requests.

use std::time::{Duration, Instant};

use nbd_proto::handshake::{ClientEvent, ClientHandshake};
use nbd_proto::transmission::client::Mode;

use super::recovery::Failure;
use super::{Client, Reply};
use crate::conn::Conn;

/// A random number for the back-off's jitter.
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// `e` and its sources, `: `-separated: "cannot connect" alone does not say why.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    s
}

/// How one reconnect attempt went.
enum Attempt {
    Reconnected,
    /// Why not; try again.
    Failed(String),
}

impl Client {
    /// The connection is gone: reconnect with exponential back-off and jitter, and reissue
    /// every request not yet answered; once `reconnect_timeout` has passed since the server
    /// last answered anything, fail them all with EIO.
    pub(super) fn recover(&mut self, why: String) {
        if self.recovery.failed().is_some() {
            return;
        }
        tracing::warn!(uri = %self.uri, in_flight = self.session.in_flight(), "connection lost: {why}; reconnecting");
        self.drop_conn();
        let start = Instant::now();
        let deadline = self.recovery.lost(start);
        let mut last = why.clone();
        loop {
            if self.stopping() {
                last = "stopping: not reconnecting".into();
                break;
            }
            let wait = self.recovery.next_wait(random());
            std::thread::sleep(wait.min(deadline.saturating_duration_since(Instant::now())));
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match self.reconnect(self.opts.connect_timeout.min(left)) {
                Attempt::Reconnected => {
                    self.recovery.reconnected();
                    // At the level of the loss's line: a log at the default level that says
                    // "reconnecting" also says when it did.
                    tracing::warn!(uri = %self.uri, reissued = self.session.in_flight(), after = ?start.elapsed(), "reconnected");
                    return;
                }
                Attempt::Failed(why) => {
                    tracing::debug!(uri = %self.uri, after = ?start.elapsed(), "reconnect attempt failed: {why}");
                    last = why;
                }
            }
        }
        let why = format!("{why}; last attempt: {last}");
        tracing::error!(uri = %self.uri, "giving up: {why}");
        self.fail_all(Failure::Lost(why));
    }

    /// One attempt: a new connection to the same export, and every request in flight sent
    /// again on it.
    fn reconnect(&mut self, timeout: Duration) -> Attempt {
        let hs = ClientHandshake::connect(Self::config(&self.uri, &self.opts));
        let (conn, neg) = match Conn::open(
            self.link.nic(),
            &self.uri,
            self.session.table(),
            hs,
            timeout,
        ) {
            Ok((conn, ClientEvent::Connected(neg))) => (conn, neg),
            Ok(_) => return Attempt::Failed("handshake ended without transmission".into()),
            Err(e) => return Attempt::Failed(chain(&e)),
        };
        if let Err(e) = super::connect::usable_size(&self.uri, neg.export.size) {
            return Attempt::Failed(e.to_string());
        }
        // The export was resized meanwhile (`rbd resize`, a server restarted on a grown
        // image): from now on the new size is the export's. Requests in flight past a shrunk
        // end are reissued and get the server's error.
        if neg.export.size != self.info.size {
            tracing::warn!(uri = %self.uri, "the export's size changed from {} to {} bytes while reconnecting", self.info.size, neg.export.size);
            self.set_size(neg.export.size);
        }
        self.link.attach(conn);
        for cookie in self.session.reissue(Mode::of(&neg)) {
            if let Err(e) = self.link.post(&self.session, cookie) {
                self.drop_conn();
                return Attempt::Failed(format!("reissuing failed: {e}"));
            }
        }
        Attempt::Reconnected
    }

    /// The pool learned that the export is now `size` bytes (another connection found it
    /// resized when it reconnected, or a probe asked) while this connection, idle, still
    /// holds another size and would refuse requests past its old end before sending them:
    /// it looks at its connection first (if the server closed it, it reconnects now and
    /// learns the size too), and makes the connection again if it still holds the old size.
    pub(crate) fn catch_up_size(&mut self, size: u64) {
        if self.size() == size || self.session.in_flight() > 0 {
            return;
        }
        let _ = self.pump(false);
        if self.size() != size {
            // Still open (the pool learned the size from a probe): made again.
            self.recover("the export was resized: reconnecting to learn its size".into());
        }
    }

    /// The server refused a request inside the export as this connection knows it as past
    /// its end (EINVAL, ENOSPC): the export may have shrunk under the connection (NBD
    /// cannot tell an open one), so it is made again to learn the size now.
    pub(crate) fn relearn_size(&mut self) {
        self.recover(
            "the server refused a request inside the export as past its end: it may have shrunk; reconnecting to learn its size"
                .into(),
        );
    }

    /// The server broke the protocol: no reconnect, every request fails.
    pub(super) fn give_up(&mut self, why: String) {
        tracing::error!(uri = %self.uri, "giving up on the server: it broke the protocol: {why}");
        self.drop_conn();
        self.fail_all(Failure::Violation(why));
    }

    /// Closes the connection. The NIC may still be writing READ data into callers' regions
    /// for a moment: with such reads in flight, wait for its fence before they are reissued
    /// or failed (the caller then owns the memory again).
    pub(super) fn drop_conn(&mut self) {
        if !self.link.detach(self.session.places_data()) {
            tracing::error!(uri = %self.uri, "the NIC did not confirm in 10 s that it stopped writing into READ buffers");
        }
    }

    /// Every request in flight fails with `failure`, and so does every later one.
    pub(super) fn fail_all(&mut self, failure: Failure) {
        for tag in self.session.abandon_all() {
            self.done.push_back(Reply {
                tag,
                result: Err(self.failure_error(&failure)),
            });
        }
        self.recovery.fail(failure);
    }
}
