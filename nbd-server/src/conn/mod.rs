//! One client connection: the NBD handshake ([`handshake`]), a place among the
//! connections served, then the transmission phase ([`transmission`]).
//!
//! The connection serves an export through its [`crate::store::Store`] trait object and
//! knows no store by name.

pub(crate) mod framer;
mod handshake;
mod link;
mod read_reply;
pub(crate) mod recv_window;
mod reply_slots;
pub(crate) mod shared;
mod transmission;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use qpip_core::{CompletionQueue, Endpoint, QueuePair};

use nbd_proto::transmission::server::ServerTransmission;

use self::framer::FramerState;
use self::link::Link;
use self::recv_window::RECV_SLOTS;
use self::reply_slots::REPLY_SLOTS;
use self::shared::ServerShared;
use crate::error::Result;
use crate::metrics::Handshake;

/// CQ depth: every WR the connection can have outstanding, so it can never overflow.
pub(crate) const CQ_DEPTH: usize = RECV_SLOTS + REPLY_SLOTS + 16;

pub(crate) struct Connection {
    link: Link,
    /// What the connection and its framer share: the phase, how requests are checked and
    /// where WRITE payloads may be placed; the requests the framer parsed.
    framer: Arc<FramerState>,
}

impl Connection {
    pub(crate) fn new(
        shared: Arc<ServerShared>,
        qp: QueuePair,
        cq: CompletionQueue,
        framer: Arc<FramerState>,
        peer: Endpoint,
        evict: Arc<AtomicBool>,
    ) -> Self {
        Connection {
            link: Link::new(shared, qp, cq, peer, evict),
            framer,
        }
    }

    pub(crate) fn run(mut self) -> Result<()> {
        let handshake = handshake::run(&mut self.link);
        self.link.evict = None;
        let (neg, last_reply) = match handshake {
            Ok(Some(done)) => done,
            Ok(None) => {
                self.link.shared.metrics.handshake(Handshake::Abandoned);
                return Ok(());
            }
            Err(e) => {
                self.link.shared.metrics.handshake(Handshake::Failed);
                self.link.shared.handshake_failed(&self.link.peer, &e);
                return Ok(());
            }
        };
        // Only clients past the handshake count toward --max-connections; the final reply
        // has not gone out, so a refused client sees the connection close in the handshake.
        let Some(_place) = self.link.shared.admit(&self.link.peer) else {
            self.link.shared.metrics.handshake(Handshake::Refused);
            self.link.qp.close();
            return Ok(());
        };
        self.link.shared.metrics.handshake(Handshake::Completed);
        let export = self.link.shared.exports[neg.export_index].clone();
        tracing::info!(peer = %self.link.peer, export = %export.name, structured = neg.structured_replies, extended = neg.extended_headers, tls = neg.tls, "client connected");
        // Before the reply that lets the client send requests: from then on the framer
        // parses them (and places large WRITEs in a raw image's file).
        let place = (export.file_region.as_ref()).map(|region| (region.clone(), export.place_from));
        self.framer.start_transmission(
            neg.transmission_phase(),
            ServerTransmission::new(&neg),
            place,
        );
        let _counted = Counted::new(&export.connections);
        let id = self.link.shared.metrics.next_id();
        let stats = export.stats.attach(id, self.link.peer.to_string());
        transmission::serve(
            &mut self.link,
            &self.framer,
            export.clone(),
            stats.conn.clone(),
            &neg,
            &last_reply,
        )
    }
}

/// One connection counted on its export for as long as it serves it.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Counted(n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
