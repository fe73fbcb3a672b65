//! Transmission phase requests: the request header (28 bytes compact, 32 extended), the
//! command and error enums, and what both sides share about the negotiated session.
//!
//! | module | job |
//! |---|---|
//! | this one | re-exports [`Request`] (encode/parse), [`Command`], [`ErrorValue`] (from [`crate::request`]) and [`TransmissionInfo`] (from the handshake, which settles it) |
//! | [`validate`] | the checks ([`validate_request`]) and the [`ValidCommand`] they yield |
//!
//! The server's half of the phase is [`server`] ([`server::ServerTransmission`]); the client's
//! is [`client`] ([`client::ClientSession`]).

pub mod client;
pub mod server;
pub mod validate;

pub use crate::handshake::TransmissionInfo;
pub use crate::request::{Command, ErrorValue, Request, RequestHeader};
pub use validate::{ByteRange, ContextSet, ValidCommand, validate_request};

#[cfg(test)]
mod tests;
