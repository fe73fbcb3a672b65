//! Errors returned by the verbs (completions carry their own status, see [`crate::WcStatus`]).

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::shared::QpState;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket-level operation of the NIC failed (the cause is the error's `source`).
    #[error("{op} {addr}")]
    Net {
        op: &'static str,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    /// A Unix-domain socket operation of the NIC failed.
    #[error("{op} {}", path.display())]
    NetPath {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The queue already holds as many outstanding WRs as it was created for.
    #[error("{queue} queue of QP {qp} is full ({depth} outstanding work requests)")]
    QueueFull {
        qp: u32,
        queue: &'static str,
        depth: usize,
    },
    /// The QP is in a state that does not allow the operation.
    #[error("QP {qp} is {state:?}: cannot {op}")]
    BadState {
        qp: u32,
        state: QpState,
        op: &'static str,
    },
    /// The work request cannot be carried out as given.
    #[error("invalid work request: {0}")]
    InvalidWr(&'static str),
    /// The operation did not finish in time.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        op: &'static str,
        after: std::time::Duration,
    },
    /// The TLS handshake failed, or TLS could not start (the reason says which).
    #[error("TLS: {0}")]
    Tls(String),
    /// The backend cannot do this.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        backend: &'static str,
        what: &'static str,
    },
    /// The NIC engine stopped (it failed to start or the NIC was shut down).
    #[error("NIC engine unavailable: {0}")]
    Engine(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
