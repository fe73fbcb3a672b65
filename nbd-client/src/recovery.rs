//! A lost connection: reconnect with exponential back-off and jitter (nbd-proto's
//! [`nbd_proto::transmission::client::Liveness`] keeps the clocks), reissue every request not yet
//! answered, or — once the server has had its reconnect timeout — fail them all.

use std::time::{Duration, Instant};

use nbd_proto::handshake::{ClientEvent, ClientHandshake};
use nbd_proto::transmission::client::Mode;

use crate::client::{Client, Failure, Reply};
use crate::conn::Conn;

/// A random number for the back-off's jitter.
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

impl Client {
    /// The connection is gone: reconnect with exponential back-off and jitter, and reissue
    /// every request not yet answered; once `reconnect_timeout` has passed since the server
    /// last answered anything, fail them all with EIO.
    pub(crate) fn recover(&mut self, why: String) {
        if self.failed.is_some() {
            return;
        }
        tracing::warn!(uri = %self.uri, in_flight = self.session.in_flight(), "connection lost: {why}; reconnecting");
        self.drop_conn();
        let start = Instant::now();
        let deadline = self.liveness.lost(start);
        let mut last = why.clone();
        loop {
            if self.stopping() {
                last = "stopping: not reconnecting".into();
                break;
            }
            let wait = self.liveness.next_wait(random());
            std::thread::sleep(wait.min(deadline.saturating_duration_since(Instant::now())));
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let hs = ClientHandshake::connect(Self::config(&self.uri, &self.opts));
            match Conn::open(
                &self.nic,
                &self.uri,
                self.session.table(),
                hs,
                self.opts.connect_timeout.min(left),
            ) {
                Ok((conn, ClientEvent::Connected(neg))) => {
                    if neg.export.size != self.info.size {
                        last = format!(
                            "export size changed from {} to {}",
                            self.info.size, neg.export.size
                        );
                        break;
                    }
                    self.conn = Some(conn);
                    let mut ok = true;
                    for cookie in self.session.reissue(Mode::of(&neg)) {
                        if let Err(e) = self.post(cookie) {
                            last = format!("reissuing failed: {e}");
                            ok = false;
                            break;
                        }
                    }
                    if ok {
                        self.reconnects += 1;
                        tracing::info!(uri = %self.uri, reissued = self.session.in_flight(), after = ?start.elapsed(), "reconnected");
                        return;
                    }
                    self.drop_conn();
                }
                Ok(_) => last = "handshake ended without transmission".into(),
                Err(e) => last = e.to_string(),
            }
        }
        let why = format!("{why}; last attempt: {last}");
        tracing::error!(uri = %self.uri, "giving up: {why}");
        self.fail_all(Failure::Lost(why));
    }

    /// The server broke the protocol: that is no network fault, and a new connection to the
    /// same server would most likely break the same way. Drop the connection and fail every
    /// request in flight, and every later one, with the violation.
    pub(crate) fn give_up(&mut self, why: String) {
        tracing::error!(uri = %self.uri, "giving up on the server: it broke the protocol: {why}");
        self.drop_conn();
        self.fail_all(Failure::Violation(why));
    }

    /// Drops the connection. Its NIC may be placing READ data into callers' regions right
    /// now; those regions are the callers' again only once the NIC's fence says it has
    /// stopped, so the client waits for that before it reissues or fails such reads.
    pub(crate) fn drop_conn(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        drop(conn);
        if self.session.places_data() && !self.nic.fence(Duration::from_secs(10)) {
            tracing::error!(uri = %self.uri, "the NIC did not confirm in 10 s that it stopped writing into READ buffers");
        }
    }

    /// Fails every request in flight with `failure` (EIO); the client stays failed.
    pub(crate) fn fail_all(&mut self, failure: Failure) {
        for tag in self.session.abandon_all() {
            self.done.push_back(Reply {
                tag,
                result: Err(self.failure_error(&failure)),
            });
        }
        self.failed = Some(failure);
    }
}
