//! Errors returned by the verbs (completions carry their own status, see [`crate::WcStatus`]).

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::shared::QpState;

/// Why a verb failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket-level operation of the NIC failed (the cause is the error's `source`).
    #[error("{op} {addr}")]
    Net {
        /// What was done (bind, connect, listen, ...).
        op: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// A Unix-domain socket operation of the NIC failed.
    #[error("{op} {}", path.display())]
    NetPath {
        /// What was done.
        op: &'static str,
        /// The socket's path.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: io::Error,
    },
    /// The queue already holds as many outstanding WRs as it was created for.
    #[error("{queue} queue of QP {qp} is full ({depth} outstanding work requests)")]
    QueueFull {
        /// The QP.
        qp: u32,
        /// Which queue: send or receive.
        queue: &'static str,
        /// Its depth.
        depth: usize,
    },
    /// The QP is in a state that does not allow the operation.
    #[error("QP {qp} is {state:?}: cannot {op}")]
    BadState {
        /// The QP.
        qp: u32,
        /// Its state.
        state: QpState,
        /// What was asked.
        op: &'static str,
    },
    /// The work request cannot be carried out as given.
    #[error("invalid work request: {0}")]
    InvalidWr(&'static str),
    /// The operation did not finish in time.
    #[error("{op} timed out after {after:?}")]
    Timeout {
        /// What timed out.
        op: &'static str,
        /// How long it was given.
        after: std::time::Duration,
    },
    /// The TLS handshake failed, or TLS could not start (the reason says which).
    #[error("TLS: {0}")]
    Tls(String),
    /// The backend cannot do this.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What it cannot do.
        what: &'static str,
    },
    /// The NIC engine stopped (it failed to start or the NIC was shut down).
    #[error("NIC engine unavailable: {0}")]
    Engine(String),
}

/// A verb's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
