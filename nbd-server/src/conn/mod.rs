//! One client connection: the NBD handshake ([`handshake`]), a place among the
//! connections served, then the transmission phase ([`transmission`]).
//!
//! The connection serves an export through its [`crate::store::Store`] trait object and
//! knows no store by name.

pub(crate) mod framer;
mod handshake;
mod link;
mod read_reply;
pub mod recv_window;
mod reply_slots;
pub mod shared;
mod transmission;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use qpip_core::{CompletionQueue, Endpoint, QueuePair};

use self::framer::{FramerState, WritePlacement};
use self::link::Link;
use self::recv_window::RECV_SLOTS;
use self::reply_slots::REPLY_SLOTS;
use self::shared::ServerShared;
use crate::error::Result;

/// CQ depth: every WR the connection can have outstanding, so it can never overflow.
pub const CQ_DEPTH: usize = RECV_SLOTS + REPLY_SLOTS + 16;

pub struct Connection {
    link: Link,
    /// What the framer hears from the connection: the phase, which the handshake moves
    /// on, and where WRITE payloads may be placed.
    framer: Arc<FramerState>,
}

impl Connection {
    pub fn new(
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

    pub fn run(mut self) -> Result<()> {
        let handshake = handshake::run(&mut self.link, &self.framer);
        self.link.evict = None;
        let Some((neg, last_reply)) = handshake? else {
            return Ok(());
        };
        // Only clients past the handshake count toward --max-connections; the final reply
        // has not gone out, so a refused client sees the connection close in the handshake.
        let Some(_place) = self.link.shared.admit(&self.link.peer) else {
            self.link.qp.close();
            return Ok(());
        };
        let export = self.link.shared.exports[neg.export_index].clone();
        tracing::info!(peer = %self.link.peer, export = %export.name, structured = neg.structured_replies, extended = neg.extended_headers, tls = neg.tls, "client connected");
        if let Some(region) = &export.file_region {
            // Before the reply that lets the client send requests (one that came before it
            // would only cost its copy: the framer would leave it in the receive slot).
            let info = neg.transmission_info();
            let region = region.clone();
            let from = export.place_from;
            let _ = self
                .framer
                .placement
                .set(WritePlacement { region, info, from });
        }
        let _counted = Counted::new(&export.connections);
        transmission::serve(&mut self.link, export.clone(), &neg, &last_reply)
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
