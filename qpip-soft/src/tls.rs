//! TLS in the soft NIC: the engine runs the handshake and the record layer with OpenSSL over
//! the QP's socket, so the host's QPs keep exchanging plaintext messages (as a NIC with
//! inline TLS offload would). OpenSSL, not rustls: it does both X.509 and external PSK (the
//! legacy PSK callbacks work in TLS 1.3 with SHA-256 suites), which is what qemu-nbd, nbdkit
//! and libnbd (GnuTLS) offer; rustls has no external PSK.

use std::io::{self, IoSlice, IoSliceMut};

use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslMode, SslStream,
    SslVerifyMode, SslVersion,
};

use super::stream::Stream;
use qpip_verbs::tls::{TlsConfig, TlsCredentials};

/// Builds the OpenSSL context for `config`; errors name the file at fault.
pub(crate) fn context(config: &TlsConfig) -> io::Result<SslContext> {
    let method = if config.server {
        SslMethod::tls_server()
    } else {
        SslMethod::tls_client()
    };
    let mut b = SslContextBuilder::new(method).map_err(ossl)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(ossl)?;
    // The TX machine retries a write that would block with what is left of its iovec.
    b.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
    match &config.credentials {
        TlsCredentials::X509 {
            ca,
            cert,
            key,
            verify_peer,
        } => {
            let file = |what: &str, p: &std::path::Path, e: openssl::error::ErrorStack| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{what} {}: {}", p.display(), first_reason(&e)),
                )
            };
            // A file that cannot be opened: the system's reason, not OpenSSL's error stack
            // (whose fopen entry has no reason string).
            let readable = |what: &str, p: &std::path::Path| {
                std::fs::File::open(p)
                    .map(drop)
                    .map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", p.display())))
            };
            if let Some(cert) = cert {
                readable("certificate", cert)?;
                b.set_certificate_chain_file(cert)
                    .map_err(|e| file("certificate", cert, e))?;
            }
            if let Some(key) = key {
                readable("private key", key)?;
                b.set_private_key_file(key, SslFiletype::PEM)
                    .map_err(|e| file("private key", key, e))?;
                b.check_private_key()
                    .map_err(|e| file("private key (does not match the certificate)", key, e))?;
            }
            if config.server && (cert.is_none() || key.is_none()) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a TLS server needs a certificate and its key",
                ));
            }
            match ca {
                Some(ca) => {
                    readable("CA certificate", ca)?;
                    b.set_ca_file(ca)
                        .map_err(|e| file("CA certificate", ca, e))?
                }
                None if *verify_peer && !config.server => {
                    b.set_default_verify_paths().map_err(ossl)?
                }
                None if *verify_peer => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "verifying client certificates needs a CA certificate",
                    ));
                }
                None => {}
            }
            let mode = match (verify_peer, config.server) {
                (false, _) => SslVerifyMode::NONE,
                (true, false) => SslVerifyMode::PEER,
                (true, true) => SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT,
            };
            b.set_verify(mode);
        }
        TlsCredentials::Psk { keys } => {
            if keys.is_empty() {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "no PSK keys"));
            }
            // TLS 1.2 fallback: the PSK suites, with forward secrecy first.
            b.set_cipher_list("ECDHE-PSK:DHE-PSK:PSK:!aNULL:!eNULL")
                .map_err(ossl)?;
            if config.server {
                let keys = keys.clone();
                b.set_psk_server_callback(move |_, identity, psk| {
                    let found = identity
                        .and_then(|id| keys.iter().find(|(i, _)| i.as_bytes() == id))
                        .filter(|(_, k)| k.len() <= psk.len());
                    Ok(found.map_or(0, |(_, k)| {
                        psk[..k.len()].copy_from_slice(k);
                        k.len()
                    }))
                });
            } else {
                let (id, key) = keys[0].clone();
                b.set_psk_client_callback(move |_, _hint, identity, psk| {
                    // The identity is a NUL-terminated string.
                    if id.len() >= identity.len() || key.len() > psk.len() {
                        return Ok(0);
                    }
                    identity[..id.len()].copy_from_slice(id.as_bytes());
                    identity[id.len()] = 0;
                    psk[..key.len()].copy_from_slice(&key);
                    Ok(key.len())
                });
            }
        }
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "unknown TLS credentials",
            ));
        }
    }
    Ok(b.build())
}

fn ossl(e: openssl::error::ErrorStack) -> io::Error {
    io::Error::other(first_reason(&e))
}

/// The first reason OpenSSL gives; without one, the first entry's function and library
/// rather than the whole stack with its source locations.
fn first_reason(e: &openssl::error::ErrorStack) -> String {
    let errors = e.errors();
    errors
        .iter()
        .find_map(|x| x.reason().map(str::to_owned))
        .or_else(|| {
            let x = errors.first()?;
            Some(format!(
                "{} failed{}",
                x.function().unwrap_or("OpenSSL"),
                x.library().map(|l| format!(" ({l})")).unwrap_or_default()
            ))
        })
        .unwrap_or_else(|| "OpenSSL reported an error without a reason".into())
}

/// A connection under TLS: the socket as the engine registers it, and OpenSSL's stream over
/// a duplicate of its descriptor (so that the socket outlives OpenSSL when it is drained).
pub(super) struct TlsLink {
    pub(super) raw: Stream,
    ssl: SslStream<Stream>,
    /// The handshake is still under way.
    pub(super) handshaking: bool,
}

/// How a handshake step ended.
pub(super) enum Step {
    Done,
    WouldBlock,
    Failed(io::Error),
}

fn would_block(code: ErrorCode) -> bool {
    code == ErrorCode::WANT_READ || code == ErrorCode::WANT_WRITE
}

impl TlsLink {
    /// Sets up the handshake on `raw` (nothing is read or written yet).
    pub(super) fn new(raw: Stream, config: &TlsConfig) -> io::Result<TlsLink> {
        let ctx = context(config)?;
        let mut ssl = Ssl::new(&ctx).map_err(ossl)?;
        if let (false, Some(name)) = (config.server, &config.server_name) {
            if name.parse::<std::net::IpAddr>().is_err() {
                ssl.set_hostname(name).map_err(ossl)?; // SNI takes names only
            }
            if let TlsCredentials::X509 {
                verify_peer: true, ..
            } = config.credentials
            {
                let param = ssl.param_mut();
                match name.parse::<std::net::IpAddr>() {
                    Ok(ip) => param.set_ip(ip).map_err(ossl)?,
                    Err(_) => param.set_host(name).map_err(ossl)?,
                }
            }
        }
        if config.server {
            ssl.set_accept_state();
        } else {
            ssl.set_connect_state();
        }
        let dup = raw.try_clone()?;
        let ssl = SslStream::new(ssl, dup).map_err(ossl)?;
        Ok(TlsLink {
            raw,
            ssl,
            handshaking: true,
        })
    }

    /// Moves the handshake on as far as the socket lets it.
    pub(super) fn handshake(&mut self) -> Step {
        match self.ssl.do_handshake() {
            Ok(()) => {
                self.handshaking = false;
                Step::Done
            }
            Err(e) if would_block(e.code()) => Step::WouldBlock,
            Err(e) => Step::Failed(self.explain(e)),
        }
    }

    /// A one-line reason for a failed handshake.
    fn explain(&self, e: openssl::ssl::Error) -> io::Error {
        let verify = self.ssl.ssl().verify_result();
        let why = match e.ssl_error() {
            Some(stack) if verify.as_raw() != 0 => {
                format!("{} ({})", first_reason(stack), verify.error_string())
            }
            Some(stack) => first_reason(stack),
            None => match e.io_error() {
                Some(io) => io.to_string(),
                None if e.code() == ErrorCode::SYSCALL || e.code() == ErrorCode::ZERO_RETURN => {
                    "the peer closed the connection".into()
                }
                None => e.to_string(),
            },
        };
        io::Error::new(io::ErrorKind::InvalidData, why)
    }

    /// Writes plaintext from the first non-empty slice (one or more records).
    pub(super) fn write(&mut self, iov: &[IoSlice<'_>]) -> io::Result<usize> {
        let Some(buf) = iov.iter().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        self.ssl.ssl_write(buf).map_err(|e| to_io(&e))
    }

    /// Reads plaintext into the first non-empty slice; Ok(0) at the peer's close_notify.
    pub(super) fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let Some(buf) = iov.iter_mut().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        match self.ssl.ssl_read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(e) => Err(to_io(&e)),
        }
    }

    /// Sends close_notify if the socket takes it now (best effort: the socket is shut next).
    pub(super) fn close_notify(&mut self) {
        if !self.handshaking {
            let _ = self.ssl.shutdown();
        }
    }
}

fn to_io(e: &openssl::ssl::Error) -> io::Error {
    if would_block(e.code()) {
        return io::ErrorKind::WouldBlock.into();
    }
    match e.io_error() {
        Some(io) => io::Error::new(io.kind(), io.to_string()),
        None => io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}")),
    }
}
