//! The pipelined API: a request goes out as one send WR from its send slot (and, for a
//! WRITE from registered memory, the caller's region); every completion is handed to the
//! session, whose finished requests queue up for [`Client::reap`].

use nbd_proto::transmission::client::{Delivered, Failed, Stall, Submission};
use nbd_proto::transmission::{Command, Request};
use qpip_core::{Completion, Opcode, WcStatus};

use super::recovery::Failure;
use super::{Client, Op, Reply, STOP_GRACE};
use crate::conn::RECV_BIT;
use crate::error::{Error, Result};

/// Tags of requests the blocking calls issue for themselves.
pub(super) const INTERNAL: u64 = 1 << 63;

/// A READ or WRITE length, which a request header holds in 32 bits.
fn length(len: usize) -> Result<u32> {
    u32::try_from(len).map_err(|_| Error::Invalid("request too long"))
}

/// How much of a request [`Client::check_op`] checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Checks {
    /// Everything: a request of the pipelined API enters here.
    All,
    /// All but its export range: a piece of a range a blocking call checked where it
    /// entered.
    InCheckedRange,
}

impl Client {
    /// The request header `op` makes, or why it must not be sent.
    fn check_op(&self, op: &Op, checks: Checks) -> Result<Request> {
        let (command, offset, length, fua) = match *op {
            Op::Read { offset, len } => (Command::Read, offset, len, false),
            Op::Write { offset, data, fua } => (Command::Write, offset, length(data.len())?, fua),
            Op::Flush => (Command::Flush, 0, 0, false),
            Op::Trim { offset, len } => (Command::Trim, offset, len, false),
            Op::WriteZeroes { offset, len, fua } => (Command::WriteZeroes, offset, len, fua),
            Op::BlockStatus { offset, len } => (Command::BlockStatus, offset, len, false),
            Op::Resize { size } => (Command::Resize, size, 0, false),
            // The slices were checked to lie inside their regions when they were made.
            Op::ReadInto { offset, into } => (Command::Read, offset, length(into.len())?, false),
            Op::WriteFrom { offset, from, fua } => {
                (Command::Write, offset, length(from.len())?, fua)
            }
        };
        let sub = Submission {
            command,
            offset,
            length,
            fua,
        };
        let limits = self.session.limits();
        Ok(match checks {
            Checks::All => limits.check(&sub)?,
            Checks::InCheckedRange => limits.check_piece(&sub)?,
        })
    }

    /// Submits a request; blocks (processing replies) while the window is full. Its reply
    /// comes out of [`Self::reap`] with `tag` (tags must be below 2^63).
    pub fn submit(&mut self, tag: u64, op: Op) -> Result<()> {
        self.submit_checking(tag, op, Checks::All)
    }

    /// [`Self::submit`], checking what `checks` says.
    pub(super) fn submit_checking(&mut self, tag: u64, op: Op, checks: Checks) -> Result<()> {
        if let Some(f) = self.recovery.failed() {
            return Err(self.failure_error(f));
        }
        let req = self.check_op(&op, checks)?;
        while !self.session.has_room() {
            self.pump(true)?;
        }
        if self.session.in_flight() == 0 {
            self.recovery.restart_wait();
        }
        let region = match op {
            Op::ReadInto { into: slice, .. } | Op::WriteFrom { from: slice, .. } => {
                Some(slice.region())
            }
            _ => None,
        };
        let started = self.session.start(tag, req, region)?;
        // The header is written by `post`, right before the payload (its length depends on
        // the connection's header style, which a reconnect may change).
        if let Op::Write { data, .. } = op {
            self.link.copy_payload(started.slot, data);
        }
        if let Err(e) = self.link.post(&self.session, started.cookie) {
            self.recover(format!("posting a request failed: {e}"));
        }
        Ok(())
    }

    /// Waits for the next finished request of the pipelined API.
    pub fn reap(&mut self) -> Result<Reply> {
        loop {
            if let Some(i) = self.done.iter().position(|r| r.tag & INTERNAL == 0) {
                return Ok(self.done.remove(i).expect("position is in range"));
            }
            if !self.session.any_tag(|t| t & INTERNAL == 0) {
                return Err(Error::Invalid("reap with nothing in flight"));
            }
            self.pump(true)?;
        }
    }

    /// Finished requests of the pipelined API, without waiting.
    pub fn try_reap(&mut self) -> Result<Option<Reply>> {
        self.pump(false)?;
        Ok(self
            .done
            .iter()
            .position(|r| r.tag & INTERNAL == 0)
            .and_then(|i| self.done.remove(i)))
    }

    /// Processes completions: one wait (up to 1 s) if `block`, else what is there.
    pub(super) fn pump(&mut self, block: bool) -> Result<()> {
        if let Some(f) = self.recovery.failed()
            && self.session.in_flight() == 0
        {
            return Err(self.failure_error(f));
        }
        let mut buf = [Completion::default(); 32];
        let data = if block {
            self.session.data_in_flight()
        } else {
            0
        };
        let Some(n) = self.link.completions(&mut buf, block, data)? else {
            self.recover("no connection".into());
            return Ok(());
        };
        self.handle(&buf[..n]);
        Ok(())
    }

    /// What one wait found: the completions `comps` of the current connection, or none
    /// (the wait timed out: a stalled server is looked for).
    pub(super) fn handle(&mut self, comps: &[Completion]) {
        if comps.is_empty() {
            self.check_stall();
            return;
        }
        if comps.iter().any(|c| c.opcode == Opcode::Recv && c.is_ok()) {
            self.recovery.heard();
        }
        let mut fault = None;
        for comp in comps {
            if fault.is_some() {
                break;
            }
            if comp.opcode == Opcode::Send {
                if !comp.is_ok() {
                    fault = Some(Failure::Lost(format!(
                        "a request could not be sent ({:?})",
                        comp.status
                    )));
                }
                continue;
            }
            if comp.status != WcStatus::Success {
                fault = Some(match comp.status {
                    WcStatus::RemoteClosed => {
                        Failure::Lost("the server closed the connection".into())
                    }
                    WcStatus::FramingError => Failure::Violation(match self.link.frame_fault() {
                        Some(why) => format!("it sent a reply the client cannot frame: {why}"),
                        None => "it sent a reply the client cannot frame (bad magic or an \
                                     oversize chunk)"
                            .into(),
                    }),
                    WcStatus::LengthError => {
                        Failure::Violation("it sent a reply longer than any request allows".into())
                    }
                    s => Failure::Lost(format!(
                        "receive failed ({s:?}, os error {})",
                        comp.os_error
                    )),
                });
                continue;
            }
            let slot = (comp.wr_id & !RECV_BIT) as usize;
            if let Err(why) = self.on_reply(slot, comp.byte_len as usize, comp.placed as usize) {
                fault = Some(Failure::Violation(why));
                continue;
            }
            if let Err(e) = self.link.repost(slot) {
                fault = Some(Failure::Lost(format!("reposting a receive failed: {e}")));
            }
        }
        match fault {
            Some(Failure::Lost(why)) => self.recover(why),
            Some(Failure::Violation(why)) => self.give_up(why),
            None if self.recovery.take_server_stopping() => {
                self.recover("the server is shutting down (ESHUTDOWN)".into())
            }
            None => {}
        }
    }

    /// Handles one reply message in receive slot `slot`. Err: the server broke the
    /// protocol (the session checks every number it sent before using it). `placed` bytes
    /// of READ data went straight to the request's region (the framer said where); `len`
    /// bytes, the rest of the message, are in the slot.
    fn on_reply(&mut self, slot: usize, len: usize, placed: usize) -> Result<(), String> {
        // SAFETY: the slot's receive WR has completed; it is posted again only after this
        // function returns (`pump`), so the NIC does not write these bytes meanwhile.
        let msg = unsafe { self.link.received(slot, len) }.ok_or("a reply outside its slot")?;
        let delivered = if placed > 0 {
            self.session.on_placed_message(msg, placed)
        } else {
            self.session.on_message(msg)
        };
        match delivered.map_err(|v| v.to_string())? {
            Delivered::Partial => {}
            // It goes again on the next connection (a restarted server), like requests a
            // lost connection leaves unanswered. It does not end an outage.
            Delivered::ShuttingDown => self.recovery.server_stopping(),
            Delivered::Finished(f) => {
                // A whole answer ends an outage; a chunk that never leads to one does not.
                self.recovery.answered();
                let result = f.result.map_err(|e| match e {
                    Failed::Server { error, message } => Error::Server { error, message },
                    other => Error::Protocol {
                        uri: self.uri.to_string(),
                        why: other.to_string(),
                    },
                });
                self.done.push_back(Reply { tag: f.tag, result });
            }
        }
        Ok(())
    }

    /// Requests in flight and no reply for `request_timeout`: reconnect and reissue, unless
    /// the server has already been silent for `reconnect_timeout` past its first timeout.
    fn check_stall(&mut self) {
        let in_flight = self.session.in_flight();
        if in_flight > 0 && self.stopping() && self.recovery.silent_for() >= STOP_GRACE {
            let why = format!(
                "stopping: no reply from the server for {} s",
                STOP_GRACE.as_secs()
            );
            tracing::error!(uri = %self.uri, in_flight, "{why}; failing the requests in flight");
            self.drop_conn();
            self.fail_all(Failure::Lost(why));
            return;
        }
        match self.recovery.stall(self.session.in_flight() > 0) {
            Stall::None => {}
            Stall::Reconnect(why) => {
                self.recover(why);
                self.recovery.restart_wait();
            }
            Stall::GiveUp(why) => {
                tracing::error!(uri = %self.uri, "giving up: {why}");
                self.drop_conn();
                self.fail_all(Failure::Lost(why));
            }
        }
    }
}
