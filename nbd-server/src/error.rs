//! The library's error: why the server could not start, or why a connection ended.

use std::io;

use nbd_proto::handshake::server::ServerError;
use nbd_proto::transmission::ErrorValue;
use qpip_core::WcStatus;

/// Why the server could not start, or why a connection ended (each is logged with its
/// [`Chain`]; the client sees the connection close).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The NIC refused an operation (posting a work request, waiting on the queue).
    #[error(transparent)]
    Nic(#[from] qpip_core::Error),
    /// The completion queue overflowed (it is sized so that it cannot).
    #[error(transparent)]
    Cq(#[from] qpip_core::CqError),
    /// A thread could not be started.
    #[error(transparent)]
    Spawn(#[from] std::io::Error),
    /// The TLS handshake after `NBD_OPT_STARTTLS` failed.
    #[error("TLS handshake")]
    Tls(#[source] qpip_core::Error),
    /// `NBD_OPT_STARTTLS` was acknowledged but the server has no credentials.
    #[error("STARTTLS acknowledged without TLS credentials")]
    NoTlsCredentials,
    /// The client broke the handshake's rules.
    #[error("handshake: {0}")]
    Handshake(ServerError),
    /// The handshake machine answered with an event this server does not know.
    #[error("handshake: unexpected event")]
    UnexpectedEvent,
    /// The accept loop dropped this handshake for a newer client.
    #[error("{during}: dropped to make room for newer clients (too many unfinished handshakes)")]
    Evicted {
        /// What the connection was waiting for.
        during: &'static str,
    },
    /// The handshake took too long.
    #[error("{during}: timed out")]
    TimedOut {
        /// What the connection was waiting for.
        during: &'static str,
    },
    /// The NIC's framer refused a handshake message.
    #[error("handshake message refused by the NIC: {0:?}")]
    HandshakeMessageRefused(WcStatus),
    /// The NIC's framer refused a request.
    #[error("request refused by the NIC ({0:?}): malformed or oversized")]
    RequestRefused(WcStatus),
    /// A message shorter than a request header.
    #[error("short request ({0} bytes)")]
    ShortRequest(usize),
    /// A message that starts a request the framer did not parse (its queue and the
    /// completions disagree: never, unless the NIC delivered a message it did not frame).
    #[error("a request the framer did not parse")]
    UnframedRequest,
    /// A send to the client failed (`what`: a reply, or a handshake message).
    #[error("sending {what} failed: {status:?}")]
    SendFailed {
        /// Which send.
        what: &'static str,
        /// How it ended.
        status: WcStatus,
    },
    /// Replies are in flight and the client has read none of them for this long (the
    /// server's `--idle-timeout`, at most 60 s).
    #[error("closing: the client has not read a reply for {secs} s")]
    ClientNotReading {
        /// Seconds without a reply read.
        secs: f64,
    },
    /// A READ failed after its reply's header had gone out: the stream cannot say so.
    #[error("a read failed in the middle of its reply")]
    ReadFailedMidReply,
    /// A reply could not be encoded.
    #[error(transparent)]
    Reply(nbd_proto::ProtoError),
}

/// Shorthand for results of this library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Displays an error with its sources, `outer: inner: ...`, as log lines want it.
pub struct Chain<'a>(pub &'a dyn std::error::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

/// A store's refusal of a request, with the reason the client is told (the error chunk's
/// message, where structured replies carry one) beside the errno it answers with.
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Refusal {
    /// The errno the client is answered with.
    pub errno: i32,
    /// Why, in words the client sees.
    pub why: String,
}

impl Refusal {
    /// An `io::Error` that answers the client with `errno` and says `why`.
    pub fn error(errno: i32, why: impl Into<String>) -> io::Error {
        io::Error::new(
            io::Error::from_raw_os_error(errno).kind(),
            Refusal {
                errno,
                why: why.into(),
            },
        )
    }

    /// The refusal inside `e`, if a store made it so.
    pub fn of(e: &io::Error) -> Option<&Refusal> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<Refusal>())
    }
}

/// The NBD error a client is answered with for a store's I/O error.
pub(crate) fn io_error_value(e: &io::Error) -> ErrorValue {
    let errno = Refusal::of(e).map(|r| r.errno).or(e.raw_os_error());
    match errno {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorValue::NoSpc,
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => ErrorValue::Perm,
        Some(libc::EINVAL) => ErrorValue::Inval,
        Some(libc::EOPNOTSUPP) => ErrorValue::NotSup,
        _ => ErrorValue::Io,
    }
}
