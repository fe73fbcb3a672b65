//! qpip-nbd-server as a library: exports disk images over QP send-receive, plain NBD on the
//! wire. Three parts, each in a folder of its own:
//!
//! - [`store`]: the disks behind exports, behind one trait ([`store::Store`]): a raw file,
//!   a qcow2 image, a Ceph RBD image; [`store::open`] is the one place a store is chosen
//!   and opened (scheme, format probe, creation, locks).
//! - `conn`: one client connection (handshake, transmission, the NIC framer, reply slots and
//!   the receive window); it sees an export's store through the trait only.
//! - [`server::Server`]: listeners, an accept loop each, a thread per connection, shutdown.
//!
//! [`metrics`] counts what connections do, for the binary's `--metrics` listener.
//!
//! The binary (`src/bin/qpip-nbd-server/`) is a command line around them: its configuration
//! file, daemon duties and clap arguments are its own modules, which report with `anyhow`;
//! the library's errors are typed ([`Error`], [`store::open::OpenError`]).

mod conn;
pub mod error;
pub mod export;
pub mod metrics;
pub mod server;
pub mod store;

pub use conn::recv_window::{CHUNK, RECV_SLOTS};
pub use error::Error;
