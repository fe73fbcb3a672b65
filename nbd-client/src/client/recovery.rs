//! Recovery: the client's part that owns liveness (nbd-proto's
//! [`nbd_proto::transmission::client::Liveness`] keeps the clocks), the reconnect count and
//! the failure that ends the client. The reconnect-and-reissue that drives the other parts
//! is `reconnect.rs`.

use std::time::{Duration, Instant};

use nbd_proto::transmission::client::{Liveness, Stall};

/// Why a client gave up on its server.
#[derive(Clone, Debug)]
pub(crate) enum Failure {
    /// The connection was lost and could not be restored in time.
    Lost(String),
    /// The server broke the protocol.
    Violation(String),
}

/// Whether the server is alive, how often it came back, and why the client gave up.
pub(super) struct Recovery {
    liveness: Liveness,
    reconnects: u64,
    /// Why the client gave up for good, if it has.
    failed: Option<Failure>,
    /// A request was refused with ESHUTDOWN: reconnect once the batch is handled.
    server_stopping: bool,
}

impl Recovery {
    /// Replies are awaited `request_timeout` (None: forever) and a lost server
    /// `reconnect_timeout`.
    pub(super) fn new(request_timeout: Option<Duration>, reconnect_timeout: Duration) -> Self {
        Recovery {
            liveness: Liveness::new(Instant::now(), request_timeout, reconnect_timeout),
            reconnects: 0,
            failed: None,
            server_stopping: false,
        }
    }

    /// Why the client gave up, if it has.
    pub(super) fn failed(&self) -> Option<&Failure> {
        self.failed.as_ref()
    }

    /// The client gives up for good.
    pub(super) fn fail(&mut self, failure: Failure) {
        self.failed = Some(failure);
    }

    /// The connection is lost now: the deadline for restoring it.
    pub(super) fn lost(&mut self, now: Instant) -> Instant {
        self.liveness.lost(now)
    }

    /// How long to wait before the next attempt (`random` for the jitter).
    pub(super) fn next_wait(&mut self, random: u64) -> Duration {
        self.liveness.next_wait(random)
    }

    /// The connection was restored.
    pub(super) fn reconnected(&mut self) {
        self.reconnects += 1;
    }

    pub(super) fn reconnects(&self) -> u64 {
        self.reconnects
    }

    pub(super) fn limit_reconnect_timeout(&mut self, limit: Duration) {
        self.liveness.limit_reconnect_timeout(limit);
    }

    /// The wait for a reply starts (again) now: a request goes out with nothing else in
    /// flight, or the connection was restored.
    pub(super) fn restart_wait(&mut self) {
        self.liveness.restart_wait(Instant::now());
    }

    /// Something arrived from the server.
    pub(super) fn heard(&mut self) {
        self.liveness.replied(Instant::now());
    }

    /// A request's whole answer arrived (it ends an outage).
    pub(super) fn answered(&mut self) {
        self.liveness.answered();
    }

    /// The server refused a request with ESHUTDOWN.
    pub(super) fn server_stopping(&mut self) {
        self.server_stopping = true;
    }

    /// The server said it is shutting down since this was last asked.
    pub(super) fn take_server_stopping(&mut self) -> bool {
        std::mem::take(&mut self.server_stopping)
    }

    /// How long the server has been silent.
    pub(super) fn silent_for(&self) -> Duration {
        self.liveness.silent_for(Instant::now())
    }

    /// What a wait without completions means, with `busy` requests in flight or not.
    pub(super) fn stall(&mut self, busy: bool) -> Stall {
        self.liveness.stall(Instant::now(), busy)
    }
}
