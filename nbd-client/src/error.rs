//! Errors of the NBD client, and their mapping to `std::io::Error`.

use std::io;
use std::time::Duration;

use nbd_proto::handshake::ClientError;
use nbd_proto::transmission::ErrorValue;
use nbd_proto::transmission::client::Refused;

use crate::uri::UriError;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The NBD URI does not parse.
    #[error(transparent)]
    Uri(#[from] UriError),
    /// The URI's host name does not resolve.
    #[error("cannot resolve {host}")]
    Resolve {
        /// The host name.
        host: String,
        /// The resolver's error.
        #[source]
        source: io::Error,
    },
    /// No address of the server took the connection.
    #[error("cannot connect to {uri}")]
    Connect {
        /// The server's URI.
        uri: String,
        /// The last address's error.
        #[source]
        source: qpip_core::Error,
    },
    /// The NBD handshake failed (the server refused or broke it).
    #[error("NBD handshake with {uri} failed")]
    Handshake {
        /// The server's URI.
        uri: String,
        /// What went wrong, as the handshake machine says.
        #[source]
        source: ClientError,
    },
    /// The connection failed during the handshake.
    #[error("{uri}: {what}")]
    HandshakeIo {
        /// The server's URI.
        uri: String,
        /// What failed.
        what: String,
    },
    /// TLS could not be set up (credentials) or its handshake failed; never a fallback.
    #[error("{uri}: {why}")]
    Tls {
        /// The server's URI.
        uri: String,
        /// What failed.
        why: String,
    },
    /// The server answered a request with an NBD error.
    #[error("server error {error}{}", if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Server {
        /// The error value.
        error: ErrorValue,
        /// The server's message, made printable (may be empty).
        message: String,
    },
    /// The export does not offer the command.
    #[error("the export does not support {0}")]
    Unsupported(&'static str),
    /// A write to an export used read-only (a [`crate::Pool`] forced read-only, or a
    /// read-only export).
    #[error("the export is used read-only")]
    ReadOnly,
    /// Offset or length is not a multiple of the server's minimum block size.
    #[error(
        "request at offset {offset} of {len} bytes is not aligned to the server's minimum block size {min}"
    )]
    Unaligned {
        /// Offset of the request.
        offset: u64,
        /// Its length.
        len: u64,
        /// The server's minimum block size.
        min: u32,
    },
    /// The range runs past the end of the export.
    #[error(
        "request at offset {offset} of {len} bytes is beyond the end of the export ({size} bytes)"
    )]
    OutOfRange {
        /// Offset of the request.
        offset: u64,
        /// Its length.
        len: u64,
        /// The export's size.
        size: u64,
    },
    /// Anything else the caller got wrong.
    #[error("{0}")]
    Invalid(&'static str),
    /// The connection was lost and not restored within the reconnect timeout.
    #[error("connection to {uri} lost and not restored within {after:?}: {why}")]
    ConnectionLost {
        /// The server's URI.
        uri: String,
        /// The reconnect timeout.
        after: Duration,
        /// Why it was lost, and the last attempt's error.
        why: String,
    },
    /// The server broke the protocol; the client gave up on it.
    #[error("the server at {uri} broke the protocol: {why}")]
    Protocol {
        /// The server's URI.
        uri: String,
        /// What it did.
        why: String,
    },
    /// The export is not the same after a reconnect (its size changed).
    #[error("the export at {uri} changed across a reconnect: {why}")]
    ExportChanged {
        /// The server's URI.
        uri: String,
        /// What changed.
        why: String,
    },
    /// The NIC refused an operation.
    #[error(transparent)]
    Nic(#[from] qpip_core::Error),
    /// Waiting on the completion queue failed.
    #[error("completion queue: {0}")]
    Cq(#[from] qpip_core::CqError),
}

/// A client call's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Refused> for Error {
    fn from(r: Refused) -> Error {
        match r {
            Refused::Unaligned { offset, len, min } => Error::Unaligned { offset, len, min },
            Refused::OutOfRange { offset, len, size } => Error::OutOfRange { offset, len, size },
            // What the server would answer (EPERM), without asking it.
            Refused::ReadOnly => Error::Server {
                error: ErrorValue::Perm,
                message: "the export is read-only".into(),
            },
            Refused::Unsupported(what) => Error::Unsupported(what),
            Refused::Invalid(why) => Error::Invalid(why),
            _ => Error::Invalid("a request the export does not allow"),
        }
    }
}

/// The errno behind an NBD error value.
pub fn errno(e: ErrorValue) -> i32 {
    match e {
        ErrorValue::Perm => libc::EPERM,
        ErrorValue::Io => libc::EIO,
        ErrorValue::NoMem => libc::ENOMEM,
        ErrorValue::Inval => libc::EINVAL,
        ErrorValue::NoSpc => libc::ENOSPC,
        ErrorValue::Overflow => libc::EOVERFLOW,
        ErrorValue::NotSup => libc::EOPNOTSUPP,
        ErrorValue::Shutdown => libc::ESHUTDOWN,
        _ => libc::EINVAL,
    }
}

impl Error {
    /// The errno this error reaches an application as. Anything that leaves the outcome
    /// unknown (lost connection, protocol violation) is EIO: never success, never wrong data.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Server { error, .. } => errno(*error),
            Error::Unsupported(_) => libc::EOPNOTSUPP,
            Error::Unaligned { .. } | Error::Invalid(_) => libc::EINVAL,
            Error::OutOfRange { .. } => libc::ENOSPC,
            Error::ReadOnly => libc::EROFS,
            _ => libc::EIO,
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match &e {
            // NBD errors carry an errno: the same kind the local call would give.
            Error::Server { error, .. } => io::Error::from_raw_os_error(errno(*error)).kind(),
            Error::Unaligned { .. } | Error::OutOfRange { .. } | Error::Invalid(_) => {
                io::ErrorKind::InvalidInput
            }
            Error::Unsupported(_) => io::ErrorKind::Unsupported,
            Error::ReadOnly => io::ErrorKind::ReadOnlyFilesystem,
            Error::Uri(_) => io::ErrorKind::InvalidInput,
            Error::Resolve { .. } => io::ErrorKind::NotFound,
            Error::Connect { .. } => io::ErrorKind::ConnectionRefused,
            // EIO: the outcome of unacknowledged requests is unknown (a server that broke the
            // protocol may have carried them out or not).
            Error::ConnectionLost { .. } | Error::Protocol { .. } => {
                return io::Error::new(
                    io::Error::from_raw_os_error(libc::EIO).kind(),
                    e.to_string(),
                );
            }
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbd_errors_map_to_io_kinds() {
        let k = |error| {
            io::Error::from(Error::Server {
                error,
                message: String::new(),
            })
            .kind()
        };
        assert_eq!(k(ErrorValue::Perm), io::ErrorKind::PermissionDenied);
        assert_eq!(k(ErrorValue::Inval), io::ErrorKind::InvalidInput);
        assert_eq!(k(ErrorValue::NoSpc), io::ErrorKind::StorageFull);
        assert_eq!(k(ErrorValue::NotSup), io::ErrorKind::Unsupported);
        assert_eq!(k(ErrorValue::NoMem), io::ErrorKind::OutOfMemory);
        let unaligned = io::Error::from(Error::Unaligned {
            offset: 1,
            len: 2,
            min: 512,
        });
        assert_eq!(unaligned.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn errnos() {
        let server = |error| Error::Server {
            error,
            message: String::new(),
        };
        assert_eq!(server(ErrorValue::Io).errno(), libc::EIO);
        assert_eq!(server(ErrorValue::NoSpc).errno(), libc::ENOSPC);
        assert_eq!(server(ErrorValue::Perm).errno(), libc::EPERM);
        assert_eq!(Error::ReadOnly.errno(), libc::EROFS);
        assert_eq!(Error::Invalid("x").errno(), libc::EINVAL);
        let lost = Error::ConnectionLost {
            uri: "nbd://x".into(),
            after: Duration::from_secs(1),
            why: "gone".into(),
        };
        assert_eq!(lost.errno(), libc::EIO);
    }
}
