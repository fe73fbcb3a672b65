//! What the client machine reports: its events, what it learned about an export, and its
//! errors.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::TransmissionFlags;
use crate::framing::{ClientPhase, FrameError};
use crate::handshake::TransmissionInfo;
use crate::handshake::messages::BlockSize;

/// What the client learned about an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDetails {
    /// Export size.
    pub size: u64,
    /// Transmission flags.
    pub flags: TransmissionFlags,
    /// Block size constraints (spec defaults if the server sent none).
    pub block_size: BlockSize,
    /// The server advertised `block_size`.
    pub block_size_advertised: bool,
    /// Canonical name, if the server sent `NBD_INFO_NAME`.
    pub name: Option<String>,
    /// Description, if the server sent `NBD_INFO_DESCRIPTION`.
    pub description: Option<String>,
}

/// The outcome of a successful connect, client side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientNegotiated {
    /// The export.
    pub export: ExportDetails,
    /// Structured replies negotiated (also true with extended headers).
    pub structured_replies: bool,
    /// Extended headers negotiated: 32-byte requests, every reply an extended chunk.
    pub extended_headers: bool,
    /// Context id of `base:allocation`, if selected.
    pub base_allocation: Option<u32>,
    /// Every metadata context selected, `(id, name)` (`base:allocation` too).
    pub meta_contexts: Vec<(u32, String)>,
    /// The export's metadata contexts, as `NBD_OPT_LIST_META_CONTEXT` listed them (with
    /// [`super::ClientConfig::list_contexts`]; empty otherwise, or if the server refused).
    pub listed_contexts: Vec<String>,
    /// `NBD_FLAG_C_NO_ZEROES` negotiated.
    pub no_zeroes: bool,
    /// Transmission entered via `NBD_OPT_GO` (vs the `NBD_OPT_EXPORT_NAME` fallback).
    pub via_go: bool,
    /// The session runs over TLS.
    pub tls: bool,
}

impl ClientNegotiated {
    /// Session parameters (useful to pre-validate requests before sending them).
    pub fn transmission_info(&self) -> TransmissionInfo {
        TransmissionInfo {
            size: self.export.size,
            flags: self.export.flags,
            structured_replies: self.structured_replies,
            has_meta_context: !self.meta_contexts.is_empty(),
            block_size: self.export.block_size,
            df_max_len: 65536,
            extended_headers: self.extended_headers,
        }
    }

    /// The framing phase of the transmission (compact or extended replies).
    pub fn transmission_phase(&self) -> ClientPhase {
        if self.extended_headers {
            ClientPhase::TransmissionExtended
        } else {
            ClientPhase::Transmission
        }
    }
}

/// One entry of an `NBD_OPT_LIST` answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportListing {
    /// Export name.
    pub name: String,
    /// Description (may be empty).
    pub description: String,
}

/// What happened after a message was handled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientEvent {
    /// Send the output (if any) and wait for the next message.
    Continue,
    /// Send the output (if any); the transmission phase starts now.
    Connected(Box<ClientNegotiated>),
    /// `NBD_OPT_LIST` result; an `NBD_OPT_ABORT` was queued: send it and close.
    Listed(Vec<ExportListing>),
    /// `NBD_OPT_INFO` result; an `NBD_OPT_ABORT` was queued: send it and close.
    Info(Box<ExportDetails>),
    /// The server acknowledged `NBD_OPT_STARTTLS`: run the TLS handshake, then call
    /// [`ClientHandshake::resume`](super::ClientHandshake::resume) and send what it appends, inside TLS.
    StartTls,
}

/// Handshake failure, client side. Unless stated, the connection should be dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Undecodable server message.
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// The server does not do fixed newstyle and the goal needs it (list / info / TLS).
    #[error("server does not support fixed newstyle negotiation")]
    NoFixedNewstyle,
    /// TLS was asked for and the server refused `NBD_OPT_STARTTLS`; an `NBD_OPT_ABORT` was
    /// queued. There is no plaintext fallback.
    #[error("the server refused TLS ({}: {message}); not going on without it", reply_name(*.reply))]
    TlsRefused {
        /// Error reply type (`NBD_REP_ERR_UNSUP` from a server without TLS).
        reply: u32,
        /// Server message.
        message: String,
    },
    /// The server refused an option with an error reply. An `NBD_OPT_ABORT` was
    /// queued (soft disconnect): send it, then close.
    #[error("server refused option {option} with {}: {message}", reply_name(*.reply))]
    Rejected {
        /// Option.
        option: u32,
        /// Error reply type (`NBD_REP_ERR_*`).
        reply: u32,
        /// Server message.
        message: String,
    },
    /// The server is shutting down (`NBD_REP_ERR_SHUTDOWN`); an `NBD_OPT_ABORT`
    /// was queued as the spec requires.
    #[error("server is shutting down")]
    ServerShutdown,
    /// A reply to an option that was not sent, or of a type not valid for it.
    #[error("unexpected reply {reply:#x} to option {option}")]
    UnexpectedReply {
        /// Option in the reply.
        option: u32,
        /// Reply type.
        reply: u32,
    },
    /// `NBD_REP_ACK` to `NBD_OPT_GO`/`NBD_OPT_INFO` without `NBD_INFO_EXPORT`.
    #[error("server acknowledged without NBD_INFO_EXPORT")]
    MissingExportInfo,
    /// Invalid block size constraints advertised.
    #[error("invalid block size constraints: {0}")]
    InvalidBlockSize(ProtoError),
    /// Too many replies to one option (bounded memory).
    #[error("too many replies")]
    TooManyReplies,
    /// Framing failure in the byte-stream interface.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A message arrived after the handshake ended.
    #[error("handshake already finished")]
    Finished,
}

/// An error reply's name, with what a user can do about the common ones.
pub fn reply_name(reply: u32) -> String {
    let name = match reply {
        c::REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        c::REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        c::REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        c::REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        c::REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD (the server requires TLS: use nbds://)",
        c::REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        c::REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        c::REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        c::REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        c::REP_ERR_EXT_HEADER_REQD => "NBD_REP_ERR_EXT_HEADER_REQD",
        other => return format!("reply {other:#x}"),
    };
    name.to_owned()
}
