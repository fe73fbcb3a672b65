//! A connection's NBD handshake: nbd-proto's [`ServerHandshake`] fed with the messages the
//! framer delimits, one receive WR at a time, and STARTTLS handed to the NIC.

use std::time::{Duration, Instant};

use nbd_proto::consts as c;
use nbd_proto::handshake::server::{ServerEvent, ServerHandshake, ServerNegotiated};
use qpip_core::{Access, Opcode, RecvWr, WcStatus};

use super::link::Link;
use crate::error::{Error, Result};

/// Runs the handshake. Returns the negotiated export and the final reply (not yet sent),
/// or None when the client ended it (ABORT, or a LIST/INFO-only session).
pub(crate) fn run(link: &mut Link) -> Result<Option<(ServerNegotiated, Vec<u8>)>> {
    let mut config = link.shared.proto.clone();
    // A store's size may change while the server runs (an RBD image resized): each handshake
    // tells the size of the moment.
    for p in &mut config.exports {
        if let Some(e) = link.shared.exports.iter().find(|e| e.name == p.name) {
            p.size = e.store.size();
        }
    }
    let mut hs = ServerHandshake::new(config);
    if link.shared.shutting_down() {
        hs.begin_shutdown();
    }
    let max = c::OPTION_HEADER_LEN + link.shared.limits.max_option_len as usize;
    let rbuf = link.shared.nic.alloc_region(max, Access::READ_WRITE);
    link.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
    link.send_bytes(&hs.greeting())?;
    // A client that does not finish in time is dropped, so that idle sockets cannot hold
    // the handshake slots for long; without a limit, only a newer handshake evicts it.
    let deadline = link
        .shared
        .handshake_limit
        .and_then(|limit| Instant::now().checked_add(limit));
    let mut msg = Vec::new();
    loop {
        let c = link.wait_one(deadline, "handshake")?;
        if c.opcode == Opcode::Send {
            link.on_bytes_sent(&c)?;
            continue;
        }
        match c.status {
            WcStatus::Success => {}
            WcStatus::RemoteClosed | WcStatus::Flushed => return Ok(None),
            s => return Err(Error::HandshakeMessageRefused(s)),
        }
        msg.resize(c.byte_len as usize, 0);
        rbuf.read_at(0, &mut msg);
        let mut out = Vec::new();
        match hs
            .handle_message(&msg, &mut out)
            .map_err(Error::Handshake)?
        {
            ServerEvent::Continue => {
                link.send_bytes(&out)?;
                link.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
            }
            ServerEvent::Done(neg) => {
                return Ok(Some((*neg, out)));
            }
            ServerEvent::StartTls => {
                start_tls(link, &out, deadline)?;
                link.qp.post_recv(RecvWr::new(0, &[rbuf.sge(0, max)]))?;
            }
            ServerEvent::Abort => {
                link.send_bytes(&out)?;
                // The ACK's memory must outlive its send: the NIC reads it later.
                link.finish_sending_bytes(deadline);
                link.qp.close();
                return Ok(None);
            }
            _ => return Err(Error::UnexpectedEvent),
        }
    }
}

/// NBD_OPT_STARTTLS: the ACK goes out in plaintext, then the NIC switches the connection
/// to TLS (no receive WR is posted meanwhile, so nothing is read in plaintext).
fn start_tls(link: &mut Link, ack: &[u8], deadline: Option<Instant>) -> Result<()> {
    let Some(config) = link.shared.tls.clone() else {
        return Err(Error::NoTlsCredentials);
    };
    link.send_bytes(ack)?;
    while link.sending_bytes() {
        let c = link.wait_one(deadline, "the STARTTLS reply")?;
        if c.opcode == Opcode::Send {
            link.on_bytes_sent(&c)?;
        }
    }
    // The NIC's TLS handshake needs a bound: without a handshake limit, a day.
    let left = deadline.map_or(Duration::from_secs(86_400), |d| {
        d.saturating_duration_since(Instant::now())
    });
    link.qp
        .start_tls(config, left.max(Duration::from_millis(1)))
        .map_err(Error::Tls)?;
    tracing::debug!(peer = %link.peer, "TLS established");
    Ok(())
}
