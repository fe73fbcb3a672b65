//! Errors of the NBD client, and their mapping to `std::io::Error`.

use std::io;
use std::time::Duration;

use nbd_proto::handshake::ClientError;
use nbd_proto::transmission::ErrorValue;

use crate::uri::UriError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Uri(#[from] UriError),
    #[error("cannot resolve {host}")]
    Resolve {
        host: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot connect to {uri}")]
    Connect {
        uri: String,
        #[source]
        source: qpip_core::Error,
    },
    #[error("NBD handshake with {uri} failed")]
    Handshake {
        uri: String,
        #[source]
        source: ClientError,
    },
    #[error("{uri}: {what}")]
    HandshakeIo { uri: String, what: String },
    /// TLS could not be set up (credentials) or its handshake failed; never a fallback.
    #[error("{uri}: {why}")]
    Tls { uri: String, why: String },
    /// The server answered a request with an NBD error.
    #[error("server error {error}{}", if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Server { error: ErrorValue, message: String },
    #[error("the export does not support {0}")]
    Unsupported(&'static str),
    #[error(
        "request at offset {offset} of {len} bytes is not aligned to the server's minimum block size {min}"
    )]
    Unaligned { offset: u64, len: u64, min: u32 },
    #[error(
        "request at offset {offset} of {len} bytes is beyond the end of the export ({size} bytes)"
    )]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("{0}")]
    Invalid(&'static str),
    #[error("connection to {uri} lost and not restored within {after:?}: {why}")]
    ConnectionLost {
        uri: String,
        after: Duration,
        why: String,
    },
    #[error("the server at {uri} broke the protocol: {why}")]
    Protocol { uri: String, why: String },
    #[error("the export at {uri} changed across a reconnect: {why}")]
    ExportChanged { uri: String, why: String },
    #[error(transparent)]
    Nic(#[from] qpip_core::Error),
    #[error("completion queue: {0}")]
    Cq(#[from] qpip_core::CqError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

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

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        let kind = match &e {
            // NBD errors carry an errno: the same kind the local call would give.
            Error::Server { error, .. } => io::Error::from_raw_os_error(errno(*error)).kind(),
            Error::Unaligned { .. } | Error::OutOfRange { .. } | Error::Invalid(_) => {
                io::ErrorKind::InvalidInput
            }
            Error::Unsupported(_) => io::ErrorKind::Unsupported,
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
}
