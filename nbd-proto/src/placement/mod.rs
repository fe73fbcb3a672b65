//! Placement, decided once and sans-IO: where each message of a connection ends and where
//! its bulk bytes go, from the tables the protocol machines keep.
//!
//! A queue-pair transport asks its framer, on the NIC's thread, where the next message ends
//! and whether its body belongs somewhere other than the receive buffer. These machines
//! answer that for NBD, so the transport's framers only translate their answers:
//!
//! | module | side | decides |
//! |---|---|---|
//! | [`server`] | server | each client message; a request's header parsed and checked once ([`server::ServerFrame::Request`]); a large valid WRITE's payload placed in the export |
//! | [`client`] | client | each server reply, from the session's own table of requests in flight; a READ's data placed in the caller's memory |

pub mod client;
pub mod server;
