//! qpip-nbd-server as a library: exports disk images over QP send-receive, plain NBD on the
//! wire. The binary is a thin command line around [`server::Server`] (its configuration file
//! and daemon duties are its own modules, which report with `anyhow`; the library's errors
//! are [`Error`]).

pub mod backend;
mod conn;
pub mod error;
pub mod export;
mod framer;
mod handshake;
pub mod image;
mod link;
pub mod qcow2;
#[cfg(feature = "rbd")]
pub mod rbd;
mod read_reply;
pub mod recv_window;
mod reply_slots;
pub mod server;
pub mod shared;
mod transmission;

pub use error::Error;
pub use transmission::{CHUNK, RECV_SLOTS};
