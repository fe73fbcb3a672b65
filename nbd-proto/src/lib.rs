//! The NBD wire protocol as a sans-IO codec (bytes in, events out).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod consts;
mod error;
pub mod flags;
pub mod framing;
#[doc(hidden)]
pub mod fuzzing;
pub mod handshake;
pub mod reply;
pub mod transmission;
mod wire;

pub use error::ProtoError;
