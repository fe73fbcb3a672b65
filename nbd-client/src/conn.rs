//! One QP connection to an NBD server: connect, drive nbd-proto's handshake state machine
//! over the QP (one receive WR at a time, the framer's phase updated before each), then post
//! the receive slots of the transmission phase.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use nbd_proto::consts as c;
use nbd_proto::framing::{ClientPhase, FrameLimits};
use nbd_proto::handshake::{ClientEvent, ClientHandshake};
use qpip_core::{
    Access, Completion, CompletionQueue, MemoryRegion, Nic, Opcode, QpAttr, QueuePair, RecvWr,
    SendWr, TlsConfig, TlsCredentials,
};

use crate::error::{Error, Result};
use crate::framer::{ClientFramer, FrameFault, Reads};
use crate::uri::NbdUri;

/// Largest READ or WRITE sent as one request (longer ones are split; the server's maximum
/// block size may lower it). 1 MiB keeps per-request costs down on both sides while a
/// connection's registered buffers (window × request, receive slots × request) stay at tens of
/// MiB of address space, touched only as used.
pub const MAX_IO: usize = 1 << 20;
/// Receive WRs posted in the transmission phase (replies, or reply chunks, in flight).
pub(crate) const RECV_SLOTS: usize = 32;
/// One receive slot: a reply header (20 bytes + 8-byte offset of OFFSET_DATA) and up to
/// `MAX_IO` bytes of data, or an error chunk with its message, or option replies (64 KiB).
pub(crate) const RECV_SLOT: usize = MAX_IO + 8192;
/// Requests in flight on one connection, at most.
pub const MAX_WINDOW: usize = 64;
/// The receive WR ids carry this bit; send WR ids are cookies (below it).
pub(crate) const RECV_BIT: u64 = 1 << 62;

pub(crate) struct Conn {
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub phase: Arc<AtomicU8>,
    /// Why the framer refused a message, if it did.
    pub frame_fault: FrameFault,
    pub recv_mr: MemoryRegion,
    /// Handshake messages sent, kept registered until the connection goes.
    _sent: Vec<MemoryRegion>,
}

impl Conn {
    pub(crate) fn repost(&self, slot: usize) -> Result<()> {
        self.qp.post_recv(RecvWr::new(
            RECV_BIT | slot as u64,
            &[self.recv_mr.sge(slot * RECV_SLOT, RECV_SLOT)],
        ))?;
        Ok(())
    }

    /// Waits (up to a second) until every posted send has completed, so that the memory they
    /// name can be released: a WR naming deregistered memory fails with a protection error.
    fn finish_sends(&self, buf: &mut [Completion]) {
        let until = Instant::now() + Duration::from_secs(1);
        while self.qp.outstanding_sends() > 0 && Instant::now() < until {
            if self.cq.wait(buf, Some(Duration::from_millis(100))).is_err() {
                break;
            }
        }
    }

    fn send_bytes(&mut self, nic: &Nic, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mr = nic.alloc_region(bytes.len(), Access::READ);
        mr.write_at(0, bytes);
        self.qp
            .post_send(SendWr::new(RECV_BIT - 1, &[mr.sge(0, bytes.len())]))?;
        self._sent.push(mr);
        Ok(())
    }

    /// The NIC's TLS credentials for an `nbds://` URI (None for plain `nbd://`), read now so
    /// that a missing file fails before anything is sent.
    fn tls_config(uri: &NbdUri) -> Result<Option<TlsConfig>> {
        let Some(t) = &uri.tls else {
            return Ok(None);
        };
        let err = |why: String| Error::Tls {
            uri: uri.to_string(),
            why,
        };
        let credentials = match (&t.certificates, &t.psk_file) {
            (_, Some(file)) => {
                // libnbd's default identity: the local user name.
                let user = t
                    .username
                    .clone()
                    .or_else(|| std::env::var("USER").ok())
                    .or_else(|| std::env::var("LOGNAME").ok())
                    .ok_or_else(|| err("a PSK needs tls-username=NAME".into()))?;
                let keys = qpip_core::tls::read_psk_file(file, Some(&user))
                    .map_err(|e| err(format!("tls-psk-file: {e}")))?;
                TlsCredentials::Psk { keys }
            }
            (Some(dir), None) => {
                let ca = dir.join("ca-cert.pem");
                if t.verify_peer && !ca.exists() {
                    return Err(err(format!(
                        "tls-certificates: {} is missing",
                        ca.display()
                    )));
                }
                let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
                let mine = cert.exists() && key.exists();
                TlsCredentials::X509 {
                    ca: ca.exists().then_some(ca),
                    cert: mine.then_some(cert),
                    key: mine.then_some(key),
                    verify_peer: t.verify_peer,
                }
            }
            // The system's trust store.
            (None, None) => TlsCredentials::X509 {
                ca: None,
                cert: None,
                key: None,
                verify_peer: t.verify_peer,
            },
        };
        let config = TlsConfig {
            server: false,
            credentials,
            server_name: (!uri.host.is_empty()).then(|| uri.host.clone()),
        };
        qpip_core::check_tls(&config).map_err(|e| err(format!("TLS credentials: {e}")))?;
        Ok(Some(config))
    }

    /// A QP connected to the server `uri` names (the first of its addresses that takes the
    /// connection), with the client's framer in the greeting phase.
    fn connect(
        nic: &Nic,
        uri: &NbdUri,
        reads: &Reads,
        limits: FrameLimits,
        deadline: Instant,
    ) -> Result<Conn> {
        // A Unix socket (None) is one place to try; a host name may resolve to several.
        let targets: Vec<Option<SocketAddr>> = match &uri.socket {
            Some(_) => vec![None],
            None => uri
                .socket_addrs()
                .map_err(|source| Error::Resolve {
                    host: uri.host.clone(),
                    source,
                })?
                .into_iter()
                .map(Some)
                .collect(),
        };
        let mut last_err = None;
        let mut conn = None;
        for addr in targets {
            let cq = nic.create_cq(2 * (MAX_WINDOW + RECV_SLOTS) + 16);
            let phase = Arc::new(AtomicU8::new(ClientPhase::Greeting.to_u8()));
            let frame_fault = FrameFault::default();
            let qp = nic.create_qp(
                QpAttr::new(&cq)
                    .framer(ClientFramer::new(
                        phase.clone(),
                        reads.clone(),
                        limits,
                        frame_fault.clone(),
                    ))
                    .depths(MAX_WINDOW + 8, RECV_SLOTS),
            );
            let left = deadline.saturating_duration_since(Instant::now());
            let left = left.max(Duration::from_millis(1));
            let connected = match (addr, &uri.socket) {
                (Some(addr), _) => qp.connect_timeout(addr, left),
                (None, Some(path)) => qp.connect_unix(path, left),
                (None, None) => Err(qpip_core::Error::InvalidWr("no address")),
            };
            match connected {
                Ok(()) => {
                    let recv_mr = nic.alloc_region(RECV_SLOTS * RECV_SLOT, Access::READ_WRITE);
                    conn = Some(Conn {
                        qp,
                        cq,
                        phase,
                        frame_fault,
                        recv_mr,
                        _sent: Vec::new(),
                    });
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        conn.ok_or_else(|| Error::Connect {
            uri: uri.to_string(),
            source: last_err.unwrap_or(qpip_core::Error::InvalidWr("no address")),
        })
    }

    /// Connects to `uri` and runs `hs` to its terminal event. On `Connected` the connection
    /// is ready for requests, its framer reading the session's table `reads`; after
    /// `Listed`/`Info` it has been closed.
    pub(crate) fn open(
        nic: &Nic,
        uri: &NbdUri,
        reads: &Reads,
        mut hs: ClientHandshake,
        timeout: Duration,
    ) -> Result<(Conn, ClientEvent)> {
        let deadline = Instant::now() + timeout;
        let tls = Self::tls_config(uri)?;
        let limits = FrameLimits {
            max_reply_len: (RECV_SLOT - c::STRUCTURED_REPLY_HEADER_LEN) as u32,
            ..hs.frame_limits()
        };
        let mut conn = Self::connect(nic, uri, reads, limits, deadline)?;
        // A server that requires a client certificate closes the connection once TLS is up
        // (TLS 1.3) or fails the TLS handshake (1.2): say so when we presented none.
        let no_client_cert = matches!(
            &tls,
            Some(TlsConfig {
                credentials: TlsCredentials::X509 { cert: None, .. },
                ..
            })
        );
        let mut tls_started = false;
        let hint = |tls_started: bool| {
            if tls_started && no_client_cert {
                "; the server may require a client certificate, and none was presented \
                 (tls-certificates=DIR holds no client-cert.pem and client-key.pem)"
            } else {
                ""
            }
        };
        let hs_err = |what: String| Error::HandshakeIo {
            uri: uri.to_string(),
            what,
        };
        // The connection failed under us (the server closed it): the error with the hint.
        let with_hint = |e: Error, hint: &str| {
            if hint.is_empty() {
                e
            } else {
                hs_err(format!("{e}{hint}"))
            }
        };
        conn.repost(0)?;
        let mut msg = Vec::new();
        let mut buf = [Completion::default(); 8];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(hs_err(format!("handshake timed out after {timeout:?}")));
            }
            let n = conn.cq.wait(&mut buf, Some(left))?;
            for comp in &buf[..n] {
                if comp.opcode == Opcode::Send {
                    if !comp.is_ok() {
                        return Err(hs_err(format!(
                            "sending failed: {:?}{}",
                            comp.status,
                            hint(tls_started)
                        )));
                    }
                    continue;
                }
                if !comp.is_ok() {
                    return Err(hs_err(format!(
                        "connection closed during the handshake ({:?}, phase {:?}){}",
                        comp.status,
                        hs.phase(),
                        hint(tls_started)
                    )));
                }
                msg.resize(comp.byte_len as usize, 0);
                conn.recv_mr.read_at(0, &mut msg);
                let mut out = Vec::new();
                let ev = hs.handle_message(&msg, &mut out);
                // Whatever the machine queued (an NBD_OPT_ABORT after an error) goes out.
                conn.send_bytes(nic, &out)?;
                let ev = match ev {
                    Ok(ev) => ev,
                    Err(source) => {
                        // The ABORT's buffer must stay registered until the NIC has sent it.
                        conn.finish_sends(&mut buf);
                        conn.qp.close();
                        return Err(Error::Handshake {
                            uri: uri.to_string(),
                            source,
                        });
                    }
                };
                match ev {
                    ClientEvent::Continue => {
                        conn.phase.store(hs.phase().to_u8(), Ordering::Release);
                        conn.repost(0)
                            .map_err(|e| with_hint(e, hint(tls_started)))?;
                    }
                    ClientEvent::StartTls => {
                        // No receive WR is posted: the NIC switches the idle connection.
                        let config = tls.clone().ok_or(Error::Invalid("STARTTLS without TLS"))?;
                        let left = deadline.saturating_duration_since(Instant::now());
                        tls_started = true;
                        if let Err(e) = conn
                            .qp
                            .start_tls(config, left.max(Duration::from_millis(1)))
                        {
                            conn.qp.close();
                            return Err(Error::Tls {
                                uri: uri.to_string(),
                                why: format!("TLS handshake failed: {e}{}", hint(true)),
                            });
                        }
                        let mut out = Vec::new();
                        hs.resume(&mut out).map_err(|source| Error::Handshake {
                            uri: uri.to_string(),
                            source,
                        })?;
                        let h = |e| with_hint(e, hint(true));
                        conn.send_bytes(nic, &out).map_err(h)?;
                        conn.phase.store(hs.phase().to_u8(), Ordering::Release);
                        conn.repost(0).map_err(h)?;
                    }
                    ClientEvent::Connected(ref neg) => {
                        conn.phase
                            .store(neg.transmission_phase().to_u8(), Ordering::Release);
                        for slot in 0..RECV_SLOTS {
                            conn.repost(slot)?;
                        }
                        return Ok((conn, ev));
                    }
                    other => {
                        conn.phase
                            .store(ClientPhase::Closed.to_u8(), Ordering::Release);
                        // Let the NBD_OPT_ABORT go out before the connection closes.
                        conn.finish_sends(&mut buf);
                        conn.qp.close();
                        return Ok((conn, other));
                    }
                }
            }
        }
    }
}
