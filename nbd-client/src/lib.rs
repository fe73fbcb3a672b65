//! NBD client over Queue Pair IP.
//!
//! ```no_run
//! use nbd_client::Client;
//! let mut c = Client::connect("nbd://127.0.0.1:10809/disk")?;
//! let mut buf = vec![0u8; 4096];
//! c.read_at(0, &mut buf)?;
//! c.write_at(0, &buf, false)?;
//! c.flush()?;
//! c.disconnect()?;
//! # Ok::<(), nbd_client::Error>(())
//! ```
//!
//! Every request travels as a send WR from registered memory; every reply lands, header and
//! data, in one registered receive WR, delimited by the QP's framer, which asks nbd-proto's
//! placement (`InFlight::frame`, over the session's own table of requests in flight) —
//! except the data of a READ into registered memory, which the NIC places straight into the
//! caller's buffer where that placement says. Requests are pipelined
//! (a window of up to 64), split at the server's maximum block size, and reissued on a new
//! connection when the old one is lost.
//!
//! The protocol state (cookies, requests in flight, reply assembly, timeouts) is nbd-proto's
//! sans-IO [`nbd_proto::transmission::client`]; here is the I/O around it: [`client`] (the
//! [`Client`] and its parts: the link, the session and recovery; connect, info and list;
//! the pipelined and the blocking calls), `conn` (one QP connection and its handshake),
//! `framer` (the QP's framer, an adapter over nbd-proto's placement), [`region`] (memory
//! ranges checked once, [`MrSlice`]), and [`pool`], several connections to one export shared
//! by threads.

pub mod client;
mod conn;
pub mod error;
mod framer;
pub mod pool;
pub mod region;
pub mod uri;

pub use client::{Client, ClientOptions, ExportInfo, Extent, Op, Output, Reply, SharedClient};
pub use conn::{MAX_IO, MAX_WINDOW};
pub use error::{Error, Result};
pub use nbd_proto::handshake::ExportListing;
pub use pool::{Caps, Pool};
pub use qpip_core::Nic;
pub use region::MrSlice;
pub use uri::{DEFAULT_PORT, NbdUri, TlsParams, UriError};
