//! The client half of the transmission phase, sans-IO and clock-free (like quinn-proto's
//! `Connection`): which requests are in flight under which cookie and send slot, what their
//! headers look like on the current connection, and how the server's replies are assembled
//! into the callers' buffers.
//!
//! The caller owns the I/O: it sends [`ClientSession::outgoing`] for each request it
//! [`ClientSession::start`]s, hands every framed server message to
//! [`ClientSession::on_message`] (or [`ClientSession::on_placed_message`] when the transport
//! put a READ's data straight into the caller's memory), and after a reconnect reissues what
//! [`ClientSession::reissue`] returns. Time matters only to [`Liveness`], which takes it as an
//! argument.
//!
//! | module | job |
//! |---|---|
//! | [`checks`] | may this request be sent to this export ([`Limits::check`]) |
//! | [`assembly`] | one request's reply into its buffer ([`Output`], typed [`Violation`]s) |
//! | [`liveness`] | request timeout and reconnect back-off, clock passed in |

pub mod assembly;
pub mod checks;
pub mod liveness;
pub mod reply_check;
mod table;

use crate::consts as c;
use crate::flags::CmdFlags;
use crate::handshake::ClientNegotiated;
use crate::reply::{SimpleReply, StructuredReplyHeader};
use crate::transmission::client::reply_check::Step;
use crate::transmission::{Command, Request, RequestHeader};

use assembly::{Entry, Framing};
pub use assembly::{Extent, Failed, Mode, Output, ReadTarget, Violation};
pub use checks::{Limits, Refused, Submission};
pub use liveness::{Liveness, Stall};
pub use table::InFlight;
use table::Table;

/// A request the session took: its cookie and the send slot its header (and a copied WRITE
/// payload) occupy until it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Started {
    /// The request's cookie.
    pub cookie: u64,
    /// Its send slot (`0..window`).
    pub slot: usize,
}

/// What to send for one request on the current connection.
#[derive(Debug)]
pub struct Outgoing<R> {
    /// The request's command.
    pub command: Command,
    /// The request header (compact or extended).
    pub header: RequestHeader,
    /// WRITE payload bytes that follow the header.
    pub payload_len: usize,
    /// The request's send slot.
    pub slot: usize,
    /// The caller's memory a WRITE's payload is sent from, if it has one.
    pub region: Option<R>,
}

/// A finished request.
#[derive(Debug)]
pub struct Finished {
    /// The caller's tag.
    pub tag: u64,
    /// Its outcome.
    pub result: Result<Output, Failed>,
}

/// What one server message did.
#[derive(Debug)]
pub enum Delivered {
    /// Part of a reply; the request is still in flight.
    Partial,
    /// The request's reply is complete.
    Finished(Finished),
    /// The server refused the request with ESHUTDOWN: it was not carried out and stays in
    /// flight, to go again on the next connection (a restarted server).
    ShuttingDown,
}

/// The client's requests in flight on one export, across reconnects.
#[derive(Debug)]
pub struct ClientSession<R> {
    limits: Limits,
    mode: Mode,
    window: usize,
    free_slots: Vec<usize>,
    /// The requests in flight, shared with the transport's framer ([`InFlight::frame`]).
    inflight: InFlight<R>,
    next_cookie: u64,
    bytes_placed: u64,
}

impl Mode {
    /// The mode a handshake negotiated.
    pub fn of(neg: &ClientNegotiated) -> Mode {
        Mode {
            structured: neg.structured_replies,
            extended: neg.extended_headers,
            allocation_ctx: neg.base_allocation,
            contexts: neg.meta_contexts.clone(),
        }
    }
}

impl<R: ReadTarget + Clone> ClientSession<R> {
    /// A session on the export `neg` negotiated, with READs and WRITEs of at most `max_io`
    /// bytes and at most `window` requests in flight.
    pub fn new(neg: &ClientNegotiated, max_io: u32, window: usize) -> Self {
        Self::with_table(neg, max_io, window, InFlight::new())
    }

    /// As [`Self::new`], keeping its requests in `inflight`: the table the transport's
    /// framer was given before the handshake ended ([`InFlight::frame`]).
    pub fn with_table(
        neg: &ClientNegotiated,
        max_io: u32,
        window: usize,
        inflight: InFlight<R>,
    ) -> Self {
        let export = &neg.export;
        let mode = Mode::of(neg);
        inflight.lock().restart(mode.structured);
        ClientSession {
            limits: Limits {
                size: export.size,
                flags: export.flags,
                block_size: export.block_size,
                max_io,
                block_status: !neg.meta_contexts.is_empty(),
            },
            mode,
            window,
            free_slots: (0..window).rev().collect(),
            inflight,
            next_cookie: 1,
            bytes_placed: 0,
        }
    }

    /// The table of requests in flight, for the transport's framer.
    pub fn table(&self) -> &InFlight<R> {
        &self.inflight
    }

    /// What requests may ask of the export.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The export's size changed: after a `RESIZE` the server carried out, or a reconnect
    /// that found another size. Requests are checked against `size` from now on.
    pub fn set_size(&mut self, size: u64) {
        self.limits.size = size;
    }

    /// The current connection's reply style.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Requests in flight at most.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.window - self.free_slots.len()
    }

    /// A request can start now (the window is not full).
    pub fn has_room(&self) -> bool {
        !self.free_slots.is_empty()
    }

    /// Data bytes the requests in flight move (READ and WRITE lengths): what the replies
    /// still wait on.
    pub fn data_in_flight(&self) -> u64 {
        self.inflight
            .lock()
            .entries
            .values()
            .filter(|e| matches!(e.req.command, Command::Read | Command::Write))
            .map(|e| e.req.length)
            .sum()
    }

    /// Some request in flight has a tag for which `f` holds.
    pub fn any_tag(&self, mut f: impl FnMut(u64) -> bool) -> bool {
        self.inflight.lock().entries.values().any(|e| f(e.tag))
    }

    /// Bytes of READ data the transport placed straight into callers' memory.
    pub fn bytes_placed(&self) -> u64 {
        self.bytes_placed
    }

    /// Some READ in flight has its data placed into the caller's memory: after a dropped
    /// connection the transport must confirm that it stopped writing there before such a
    /// read is reissued or failed.
    pub fn places_data(&self) -> bool {
        self.inflight
            .lock()
            .entries
            .values()
            .any(Entry::places_data)
    }

    /// Takes `req` (checked by [`Limits::check`]) in flight under `tag`. `region` is the
    /// caller's memory a READ's data go to or a WRITE's are sent from.
    pub fn start(
        &mut self,
        tag: u64,
        mut req: Request,
        region: Option<R>,
    ) -> Result<Started, Refused> {
        let slot = self
            .free_slots
            .pop()
            .ok_or(Refused::Invalid("no free slot"))?;
        req.cookie = self.next_cookie;
        self.next_cookie += 1;
        self.inflight
            .lock()
            .entries
            .insert(req.cookie, Entry::new(tag, req, slot, region));
        Ok(Started {
            cookie: req.cookie,
            slot,
        })
    }

    /// What to send for request `cookie` on the current connection (its header style may
    /// have changed with a reconnect). From now on the framer frames the request's replies
    /// by its numbers (and places a READ's data in its memory): call it right before the
    /// request goes out.
    pub fn outgoing(&self, cookie: u64) -> Result<Outgoing<R>, Refused> {
        let mut table = self.inflight.lock();
        let entry = table
            .entries
            .get_mut(&cookie)
            .ok_or(Refused::Invalid("no such request in flight"))?;
        let extended = self.mode.extended;
        let mut req = entry.req;
        req.flags.set(
            CmdFlags::PAYLOAD_LEN,
            extended && req.command == Command::Write,
        );
        let header = req
            .encode(extended)
            .map_err(|_| Refused::Invalid("request too long for compact headers"))?;
        entry.framing = Framing::Open;
        Ok(Outgoing {
            command: req.command,
            header,
            payload_len: req.payload_len(extended) as usize,
            slot: entry.slot,
            region: entry
                .region
                .as_ref()
                .filter(|_| req.command == Command::Write)
                .cloned(),
        })
    }

    /// Handles one server message delivered whole (header and payload). Err: the server
    /// broke the protocol. nbd-proto's [`crate::transmission::client::reply_check::ReplyCheck`] decides whether the
    /// message may answer its request and where its bytes go, checking every number the
    /// server sent first.
    pub fn on_message(&mut self, msg: &[u8]) -> Result<Delivered, Violation> {
        let magic = msg.first_chunk::<4>().map(|m| u32::from_be_bytes(*m));
        let (structured, extended) = (self.mode.structured, self.mode.extended);
        let chunk_magic = if extended {
            c::EXTENDED_REPLY_MAGIC
        } else {
            c::STRUCTURED_REPLY_MAGIC
        };
        let inflight = self.inflight.clone();
        let mut table = inflight.lock();
        if !extended && magic == Some(c::SIMPLE_REPLY_MAGIC) {
            let r = SimpleReply::parse(msg)?;
            let payload = &msg[c::SIMPLE_REPLY_LEN..];
            let entry = table.entry(r.cookie)?;
            let accepted = entry.check.simple(&r, payload.len())?;
            entry.apply(accepted.step, payload);
            Ok(self.delivered(&mut table, r.cookie, accepted.done))
        } else if structured && magic == Some(chunk_magic) {
            let h = StructuredReplyHeader::parse_as(msg, extended)?;
            let payload = &msg[h.header_len()..];
            if payload.len() != h.length as usize {
                return Err(Violation::PayloadLength {
                    said: h.length,
                    has: payload.len(),
                });
            }
            let entry = table.entry(h.cookie)?;
            let mode = &self.mode;
            let accepted = entry.check.chunk(&h, payload, |id| mode.selected(id))?;
            entry.apply(accepted.step, payload);
            Ok(self.delivered(&mut table, h.cookie, accepted.done))
        } else {
            Err(match magic {
                Some(m) => Violation::UnknownMagic(m),
                None => Violation::TooShort(msg.len()),
            })
        }
    }

    /// Handles a reply whose READ data (`placed` bytes) the transport put into the
    /// request's memory where [`InFlight::frame`] said; `header` is the rest of the message
    /// (its header, and a chunk's offset). The same checks as a message delivered whole, and
    /// the data must be where the checks say they belong.
    pub fn on_placed_message(
        &mut self,
        header: &[u8],
        placed: usize,
    ) -> Result<Delivered, Violation> {
        let header = &header[..header.len().min(c::EXTENDED_REPLY_HEADER_LEN + 8)];
        let simple = header.first_chunk::<4>() == Some(&c::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let inflight = self.inflight.clone();
        let mut table = inflight.lock();
        let (cookie, accepted, at) = if !simple {
            let h = StructuredReplyHeader::parse_as(header, self.mode.extended)?;
            let offset = header
                .get(h.header_len()..)
                .and_then(|p| p.first_chunk::<8>())
                .map(|o| u64::from_be_bytes(*o))
                .ok_or(Violation::PlacedWithoutOffset)?;
            let entry = table.entry(h.cookie)?;
            let at = offset.wrapping_sub(entry.req.offset) as usize;
            let accepted = entry.check.placed_chunk(&h, offset, placed)?;
            (h.cookie, accepted, at)
        } else {
            let r = SimpleReply::parse(header)?;
            let accepted = table.entry(r.cookie)?.check.simple(&r, placed)?;
            (r.cookie, accepted, 0)
        };
        let entry = table.entry(cookie)?;
        match (&accepted.step, &entry.region) {
            (Step::Data { dst, .. }, Some(_)) if dst.start == at && dst.len() == placed => {}
            _ => return Err(Violation::PlacedElsewhere),
        }
        self.bytes_placed += placed as u64;
        Ok(self.delivered(&mut table, cookie, accepted.done))
    }

    fn delivered(&mut self, table: &mut Table<R>, cookie: u64, done: bool) -> Delivered {
        if !done {
            return Delivered::Partial;
        }
        if table
            .entries
            .get(&cookie)
            .is_some_and(Entry::refused_for_shutdown)
        {
            return Delivered::ShuttingDown;
        }
        let Some(entry) = table.entries.remove(&cookie) else {
            return Delivered::Partial;
        };
        self.free_slots.push(entry.slot);
        Delivered::Finished(Finished {
            tag: entry.tag,
            result: entry.outcome(),
        })
    }

    /// A new connection with `mode`: every request in flight starts over. Returns their
    /// cookies in the order they were first issued, to send again.
    pub fn reissue(&mut self, mode: Mode) -> Vec<u64> {
        self.limits.block_status = !mode.contexts.is_empty();
        self.mode = mode;
        let mut table = self.inflight.lock();
        table.restart(self.mode.structured);
        let mut cookies: Vec<u64> = table.entries.keys().copied().collect();
        cookies.sort_unstable();
        cookies
    }

    /// Ends every request in flight unanswered (the server is lost for good); returns their
    /// tags.
    pub fn abandon_all(&mut self) -> Vec<u64> {
        let mut table = self.inflight.lock();
        let mut tags = Vec::with_capacity(table.entries.len());
        for (_, entry) in table.entries.drain() {
            self.free_slots.push(entry.slot);
            tags.push(entry.tag);
        }
        tags
    }
}

#[cfg(test)]
mod tests;
