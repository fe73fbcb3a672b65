//! Client side of the fixed-newstyle handshake as a sans-IO state machine.
//!
//! Feed it whole framed server messages with [`ClientHandshake::handle_message`]
//! (frame them with [`crate::framing::client_need`] and [`ClientHandshake::phase`]),
//! or a raw byte stream with [`ClientHandshake::feed`]. Requests are appended to
//! a caller-provided `Vec<u8>`.
//!
//! With `tls`, every goal starts with `NBD_OPT_STARTTLS`: on its ACK the machine returns
//! [`ClientEvent::StartTls`], the caller runs the TLS handshake and calls
//! [`ClientHandshake::resume`]; any refusal ends the handshake (no plaintext fallback).
//!
//! Connect sequence: greeting → client flags → `NBD_OPT_EXTENDED_HEADERS` (if
//! wanted), else or if refused `NBD_OPT_STRUCTURED_REPLY` (if wanted) → `NBD_OPT_SET_META_CONTEXT base:allocation` (if wanted and structured
//! replies were accepted) → `NBD_OPT_GO` requesting `NAME`, `DESCRIPTION` and
//! `BLOCK_SIZE`, falling back to `NBD_OPT_EXPORT_NAME` if the server answers
//! `NBD_REP_ERR_UNSUP` (or does not do fixed newstyle at all) — except after extended
//! headers, which forbid `NBD_OPT_EXPORT_NAME` (a server offering them must do `GO`).
//!
//! Over 600 lines: one state machine whose steps all act on the same negotiation state; split by step, each part would need all of it.

use super::TransmissionInfo;
use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::{ClientFlags, HandshakeFlags, TransmissionFlags};
use crate::framing::{ClientPhase, FrameError, FrameLimits, Need, client_need};
use crate::handshake::messages::{
    BlockSize, ExportNameReply, Greeting, InfoReply, InfoRequest, MetaContextEntry,
    MetaContextRequest, OptionReplyHeader, ServerEntry, encode_client_flags, encode_option,
};

/// Most `NBD_REP_SERVER` entries a client collects from `NBD_OPT_LIST`.
pub const MAX_LIST_ENTRIES: usize = 16 * 1024;
/// Most `NBD_REP_META_CONTEXT` / `NBD_REP_INFO` replies accepted for one option.
pub const MAX_REPLIES_PER_OPTION: usize = 1024;

/// Client configuration for connecting to / querying an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Export name ("" = default export).
    pub export_name: String,
    /// Ask for structured replies.
    pub structured_replies: bool,
    /// Ask for extended headers first (only with `use_go`, as the spec requires).
    pub extended_headers: bool,
    /// Ask for the `base:allocation` metadata context (needs structured replies).
    pub base_allocation: bool,
    /// Use `NBD_FLAG_C_NO_ZEROES` if the server offers it.
    pub no_zeroes: bool,
    /// Use `NBD_OPT_GO` (else go straight to `NBD_OPT_EXPORT_NAME`).
    pub use_go: bool,
    /// Largest option reply accepted (bounded memory).
    pub max_option_reply_len: u32,
    /// Upgrade to TLS with `NBD_OPT_STARTTLS` before anything else, and fail rather than
    /// go on without it.
    pub tls: bool,
}

impl ClientConfig {
    /// Everything enabled for `export_name`.
    pub fn new(export_name: impl Into<String>) -> Self {
        Self {
            export_name: export_name.into(),
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            no_zeroes: true,
            use_go: true,
            max_option_reply_len: crate::framing::DEFAULT_MAX_OPTION_LEN,
            tls: false,
        }
    }
}

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
            has_meta_context: self.base_allocation.is_some(),
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
    /// [`ClientHandshake::resume`] and send what it appends, inside TLS.
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Goal {
    Connect,
    List,
    Info,
}

#[derive(Debug, Clone, Default)]
struct InfoAcc {
    export: Option<(u64, TransmissionFlags)>,
    block_size: Option<BlockSize>,
    name: Option<String>,
    description: Option<String>,
    replies: usize,
}

impl InfoAcc {
    fn finish(self) -> Result<ExportDetails, ClientError> {
        let (size, flags) = self.export.ok_or(ClientError::MissingExportInfo)?;
        Ok(ExportDetails {
            size,
            flags,
            block_size: self.block_size.unwrap_or(BlockSize::DEFAULT),
            block_size_advertised: self.block_size.is_some(),
            name: self.name,
            description: self.description,
        })
    }
}

#[derive(Debug, Clone)]
enum State {
    Greeting,
    StartTls,
    /// `NBD_OPT_STARTTLS` acknowledged; the caller runs TLS, then calls `resume`.
    TlsPending,
    ExtendedHeaders,
    StructuredReply,
    SetMeta {
        id: Option<u32>,
        replies: usize,
    },
    Go(InfoAcc),
    Info(InfoAcc),
    List(Vec<ExportListing>),
    ExportName,
    Finished,
}

/// The client handshake state machine.
#[derive(Debug, Clone)]
pub struct ClientHandshake {
    config: ClientConfig,
    goal: Goal,
    state: State,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    base_allocation: Option<u32>,
    inbuf: Vec<u8>,
}

const INFO_ITEMS: [u16; 3] = [c::INFO_BLOCK_SIZE, c::INFO_NAME, c::INFO_DESCRIPTION];

impl ClientHandshake {
    fn with_goal(config: ClientConfig, goal: Goal) -> Self {
        Self {
            config,
            goal,
            state: State::Greeting,
            no_zeroes: false,
            structured: false,
            extended: false,
            base_allocation: None,
            inbuf: Vec::new(),
        }
    }

    /// Connect to `config.export_name` and enter transmission.
    pub fn connect(config: ClientConfig) -> Self {
        Self::with_goal(config, Goal::Connect)
    }

    /// List the server's exports (`NBD_OPT_LIST`), then abort.
    pub fn list() -> Self {
        Self::list_with(ClientConfig::new(""))
    }

    /// [`Self::list`] with `config`'s TLS and limits (its export name is not used).
    pub fn list_with(config: ClientConfig) -> Self {
        Self::with_goal(config, Goal::List)
    }

    /// Query `config.export_name` with `NBD_OPT_INFO`, then abort.
    pub fn info(config: ClientConfig) -> Self {
        Self::with_goal(config, Goal::Info)
    }

    /// The framing phase for the next server message.
    pub fn phase(&self) -> ClientPhase {
        match self.state {
            State::Greeting => ClientPhase::Greeting,
            State::ExportName if self.no_zeroes => ClientPhase::ExportNameReplyNoZeroes,
            State::ExportName => ClientPhase::ExportNameReply,
            State::Finished => ClientPhase::Closed,
            _ => ClientPhase::Options,
        }
    }

    /// Frame limits matching this configuration.
    pub fn frame_limits(&self) -> FrameLimits {
        FrameLimits {
            max_option_len: self.config.max_option_reply_len,
            ..FrameLimits::default()
        }
    }

    /// Handle one complete server message; requests are appended to `out`.
    pub fn handle_message(
        &mut self,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        let res = self.handle_inner(msg, out);
        match &res {
            Ok(ClientEvent::Continue) | Ok(ClientEvent::StartTls) => {}
            Ok(ClientEvent::Connected(_)) => {
                self.state = State::Finished;
            }
            _ => self.state = State::Finished,
        }
        res
    }

    /// Byte-stream interface: buffer `input` and handle every complete message,
    /// stopping at the first terminal event. Bytes after the handshake (the
    /// start of transmission) are kept for [`Self::take_leftover`].
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<ClientEvent, ClientError> {
        if matches!(self.state, State::Finished) {
            return Err(ClientError::Finished);
        }
        self.inbuf.extend_from_slice(input);
        let limits = self.frame_limits();
        loop {
            let total = match client_need(self.phase(), &self.inbuf, &limits, |_| None) {
                Need::Header(_) => return Ok(ClientEvent::Continue),
                Need::Invalid(e) => {
                    self.state = State::Finished;
                    return Err(e.into());
                }
                Need::Message {
                    header_len,
                    body_len,
                } => header_len + body_len,
            };
            if self.inbuf.len() < total {
                return Ok(ClientEvent::Continue);
            }
            let rest = self.inbuf.split_off(total);
            let msg = core::mem::replace(&mut self.inbuf, rest);
            match self.handle_message(&msg, out)? {
                ClientEvent::Continue => continue,
                terminal => return Ok(terminal),
            }
        }
    }

    /// Bytes fed after the handshake finished.
    pub fn take_leftover(&mut self) -> Vec<u8> {
        core::mem::take(&mut self.inbuf)
    }

    fn send_go_or_export_name(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        if self.config.use_go {
            let data = InfoRequest {
                name: &self.config.export_name,
                items: INFO_ITEMS.to_vec(),
            }
            .encode()?;
            encode_option(c::OPT_GO, &data, out);
            self.state = State::Go(InfoAcc::default());
        } else {
            self.send_export_name(out)?;
        }
        Ok(())
    }

    fn send_export_name(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        crate::error::parse_string(self.config.export_name.as_bytes(), "export name")?;
        encode_option(c::OPT_EXPORT_NAME, self.config.export_name.as_bytes(), out);
        self.state = State::ExportName;
        Ok(())
    }

    fn ask_structured(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        if self.config.structured_replies {
            encode_option(c::OPT_STRUCTURED_REPLY, &[], out);
            self.state = State::StructuredReply;
            Ok(())
        } else {
            self.after_structured(out)
        }
    }

    fn after_structured(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        if self.structured && self.config.base_allocation {
            let data = MetaContextRequest {
                export: &self.config.export_name,
                queries: vec![c::BASE_ALLOCATION],
            }
            .encode()?;
            encode_option(c::OPT_SET_META_CONTEXT, &data, out);
            self.state = State::SetMeta {
                id: None,
                replies: 0,
            };
            Ok(())
        } else {
            self.send_go_or_export_name(out)
        }
    }

    fn expected_option(&self) -> Option<u32> {
        Some(match self.state {
            State::StartTls => c::OPT_STARTTLS,
            State::ExtendedHeaders => c::OPT_EXTENDED_HEADERS,
            State::StructuredReply => c::OPT_STRUCTURED_REPLY,
            State::SetMeta { .. } => c::OPT_SET_META_CONTEXT,
            State::Go(_) => c::OPT_GO,
            State::Info(_) => c::OPT_INFO,
            State::List(_) => c::OPT_LIST,
            _ => return None,
        })
    }

    fn abort(out: &mut Vec<u8>) {
        encode_option(c::OPT_ABORT, &[], out);
    }

    fn handle_inner(&mut self, msg: &[u8], out: &mut Vec<u8>) -> Result<ClientEvent, ClientError> {
        match self.state {
            State::Finished => return Err(ClientError::Finished),
            State::Greeting => return self.handle_greeting(msg, out),
            State::ExportName => {
                let r = ExportNameReply::parse(msg, self.no_zeroes)?;
                return Ok(ClientEvent::Connected(Box::new(ClientNegotiated {
                    export: ExportDetails {
                        size: r.size,
                        flags: r.flags,
                        block_size: BlockSize::DEFAULT,
                        block_size_advertised: false,
                        name: None,
                        description: None,
                    },
                    structured_replies: self.structured,
                    extended_headers: false,
                    base_allocation: self.base_allocation,
                    no_zeroes: self.no_zeroes,
                    via_go: false,
                    tls: self.config.tls,
                })));
            }
            _ => {}
        }
        let h = OptionReplyHeader::parse(msg)?;
        let data = &msg[c::OPTION_REPLY_HEADER_LEN..];
        if data.len() as u64 != u64::from(h.length) {
            return Err(ProtoError::LengthMismatch {
                expected: h.length as usize,
                got: data.len(),
            }
            .into());
        }
        let expected = self.expected_option();
        if expected != Some(h.option) {
            return Err(ClientError::UnexpectedReply {
                option: h.option,
                reply: h.reply_type,
            });
        }
        if h.reply_type == c::REP_ERR_SHUTDOWN {
            Self::abort(out);
            return Err(ClientError::ServerShutdown);
        }
        let unexpected = Err(ClientError::UnexpectedReply {
            option: h.option,
            reply: h.reply_type,
        });
        let state = core::mem::replace(&mut self.state, State::Finished);
        match state {
            State::StartTls => match h.reply_type {
                c::REP_ACK => {
                    self.state = State::TlsPending;
                    Ok(ClientEvent::StartTls)
                }
                _ if h.is_error() => {
                    Self::abort(out);
                    Err(ClientError::TlsRefused {
                        reply: h.reply_type,
                        message: crate::peer_text::printable(data),
                    })
                }
                _ => unexpected,
            },
            State::ExtendedHeaders => {
                match h.reply_type {
                    c::REP_ACK => {
                        self.extended = true;
                        self.structured = true;
                        self.after_structured(out)?;
                    }
                    // Refused (ERR_UNSUP from older servers): compact headers.
                    _ if h.is_error() => self.ask_structured(out)?,
                    _ => return unexpected,
                }
                Ok(ClientEvent::Continue)
            }
            State::StructuredReply => {
                match h.reply_type {
                    c::REP_ACK => self.structured = true,
                    _ if h.is_error() => self.structured = false,
                    _ => return unexpected,
                }
                self.after_structured(out)?;
                Ok(ClientEvent::Continue)
            }
            State::SetMeta { id, replies } => match h.reply_type {
                c::REP_META_CONTEXT => {
                    if replies >= MAX_REPLIES_PER_OPTION {
                        return Err(ClientError::TooManyReplies);
                    }
                    let e = MetaContextEntry::parse(data)?;
                    let id = if e.name == c::BASE_ALLOCATION {
                        Some(e.id)
                    } else {
                        id
                    };
                    self.state = State::SetMeta {
                        id,
                        replies: replies + 1,
                    };
                    Ok(ClientEvent::Continue)
                }
                c::REP_ACK => {
                    self.base_allocation = id;
                    self.send_go_or_export_name(out)?;
                    Ok(ClientEvent::Continue)
                }
                _ if h.is_error() => {
                    // "If an error is returned, the client MUST disregard any context replies"
                    self.base_allocation = None;
                    self.send_go_or_export_name(out)?;
                    Ok(ClientEvent::Continue)
                }
                _ => unexpected,
            },
            State::Go(mut acc) | State::Info(mut acc) => {
                let go = h.option == c::OPT_GO;
                match h.reply_type {
                    c::REP_INFO => {
                        acc.replies += 1;
                        if acc.replies > MAX_REPLIES_PER_OPTION {
                            return Err(ClientError::TooManyReplies);
                        }
                        match InfoReply::parse(data)? {
                            InfoReply::Export { size, flags } => acc.export = Some((size, flags)),
                            InfoReply::Name(n) => acc.name = Some(n.to_owned()),
                            InfoReply::Description(d) => acc.description = Some(d.to_owned()),
                            InfoReply::BlockSize(bs) => {
                                bs.check().map_err(ClientError::InvalidBlockSize)?;
                                acc.block_size = Some(bs);
                            }
                            _ => {}
                        }
                        self.state = if go { State::Go(acc) } else { State::Info(acc) };
                        Ok(ClientEvent::Continue)
                    }
                    c::REP_ACK => {
                        let details = acc.finish()?;
                        if go {
                            Ok(ClientEvent::Connected(Box::new(ClientNegotiated {
                                export: details,
                                structured_replies: self.structured,
                                extended_headers: self.extended,
                                base_allocation: self.base_allocation,
                                no_zeroes: self.no_zeroes,
                                via_go: true,
                                tls: self.config.tls,
                            })))
                        } else {
                            Self::abort(out);
                            Ok(ClientEvent::Info(Box::new(details)))
                        }
                    }
                    c::REP_ERR_UNSUP if go && !self.extended => {
                        // "clients SHOULD be prepared to also handle NBD_REP_ERR_UNSUP
                        // by falling back to using NBD_OPT_EXPORT_NAME"
                        self.send_export_name(out)?;
                        Ok(ClientEvent::Continue)
                    }
                    _ if h.is_error() => {
                        Self::abort(out);
                        Err(ClientError::Rejected {
                            option: h.option,
                            reply: h.reply_type,
                            message: crate::peer_text::printable(data),
                        })
                    }
                    _ => unexpected,
                }
            }
            State::List(mut entries) => match h.reply_type {
                c::REP_SERVER => {
                    if entries.len() >= MAX_LIST_ENTRIES {
                        return Err(ClientError::TooManyReplies);
                    }
                    let e = ServerEntry::parse(data)?;
                    entries.push(ExportListing {
                        name: e.name.to_owned(),
                        description: e.description.to_owned(),
                    });
                    self.state = State::List(entries);
                    Ok(ClientEvent::Continue)
                }
                c::REP_ACK => {
                    Self::abort(out);
                    Ok(ClientEvent::Listed(entries))
                }
                _ if h.is_error() => {
                    Self::abort(out);
                    Err(ClientError::Rejected {
                        option: h.option,
                        reply: h.reply_type,
                        message: crate::peer_text::printable(data),
                    })
                }
                _ => unexpected,
            },
            State::Greeting | State::TlsPending | State::ExportName | State::Finished => {
                Err(ClientError::Finished)
            }
        }
    }

    fn handle_greeting(
        &mut self,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        let g = Greeting::parse(msg)?;
        let fixed = g.flags.contains(HandshakeFlags::FIXED_NEWSTYLE);
        self.no_zeroes = self.config.no_zeroes && g.flags.contains(HandshakeFlags::NO_ZEROES);
        let flags = ClientFlags::empty()
            .with(ClientFlags::FIXED_NEWSTYLE, fixed)
            .with(ClientFlags::NO_ZEROES, self.no_zeroes);
        out.extend_from_slice(&encode_client_flags(flags));
        if !fixed {
            return match self.goal {
                _ if self.config.tls => Err(ClientError::NoFixedNewstyle),
                Goal::Connect => {
                    self.send_export_name(out)?;
                    Ok(ClientEvent::Continue)
                }
                Goal::List | Goal::Info => Err(ClientError::NoFixedNewstyle),
            };
        }
        if self.config.tls {
            encode_option(c::OPT_STARTTLS, &[], out);
            self.state = State::StartTls;
            return Ok(ClientEvent::Continue);
        }
        self.start_goal(out)?;
        Ok(ClientEvent::Continue)
    }

    /// After [`ClientEvent::StartTls`] and a successful TLS handshake: the negotiation
    /// goes on (inside TLS); send what is appended to `out`.
    pub fn resume(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        if !matches!(self.state, State::TlsPending) {
            return Err(ClientError::Finished);
        }
        self.start_goal(out)
    }

    fn start_goal(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        match self.goal {
            Goal::Connect => {
                if self.config.extended_headers && self.config.use_go {
                    encode_option(c::OPT_EXTENDED_HEADERS, &[], out);
                    self.state = State::ExtendedHeaders;
                } else {
                    self.ask_structured(out)?;
                }
            }
            Goal::List => {
                encode_option(c::OPT_LIST, &[], out);
                self.state = State::List(Vec::new());
            }
            Goal::Info => {
                let data = InfoRequest {
                    name: &self.config.export_name,
                    items: INFO_ITEMS.to_vec(),
                }
                .encode()?;
                encode_option(c::OPT_INFO, &data, out);
                self.state = State::Info(InfoAcc::default());
            }
        }
        Ok(())
    }
}
