//! The handshake phase: wire messages and the server / client state machines.

pub mod client;
mod info;
pub mod messages;
pub mod server;

#[cfg(test)]
mod tests;

pub use client::{
    ClientConfig, ClientError, ClientEvent, ClientHandshake, ClientNegotiated, ExportDetails,
    ExportListing,
};
pub use info::TransmissionInfo;
pub use messages::{
    BlockSize, ExportNameReply, Greeting, InfoReply, InfoRequest, MetaContextEntry,
    MetaContextRequest, OptionHeader, OptionReplyHeader, ServerEntry, encode_client_flags,
    encode_option, encode_option_reply, parse_client_flags,
};
pub use server::{
    BASE_ALLOCATION_ID, Export, ServerConfig, ServerError, ServerEvent, ServerHandshake,
    ServerNegotiated, TlsMode,
};
