//! qpip-nbd-server as a library: exports disk images over QP send-receive, plain NBD on the
//! wire. The binary is a thin command line around [`server::Server`].

pub mod backend;
pub mod config;
mod conn;
pub mod daemon;
pub mod export;
mod framer;
pub mod image;
pub mod qcow2;
#[cfg(feature = "rbd")]
pub mod rbd;
pub mod recv_window;
pub mod server;
pub mod shared;

pub use conn::{CHUNK, RECV_SLOTS};
