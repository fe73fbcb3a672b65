//! Server side of the fixed-newstyle handshake as a sans-IO state machine.
//!
//! Feed it whole framed client messages with [`ServerHandshake::handle_message`]
//! (use [`crate::framing::server_need`] with [`ServerHandshake::phase`] to frame
//! them), or a raw byte stream with [`ServerHandshake::feed`]. Replies are
//! appended to a caller-provided `Vec<u8>`.
//!
//! What the server is configured with (exports, TLS mode, limits) is in
//! `handshake/server/config.rs`.
//!
//! Over 600 lines: one state machine whose options all act on the same negotiation state; split by option, each part would need all of it.

use super::TransmissionInfo;
use crate::consts as c;
use crate::error::{ProtoError, parse_string};
use crate::flags::{ClientFlags, HandshakeFlags, TransmissionFlags};
use crate::framing::{FrameLimits, Need, ServerPhase, server_need};
use crate::handshake::messages::{
    BlockSize, ExportNameReply, Greeting, InfoReply, InfoRequest, MetaContextEntry,
    MetaContextRequest, OptionHeader, ServerEntry, encode_option_reply, parse_client_flags,
};
use crate::transmission::ContextSet;

mod config;

pub use config::{DEFAULT_MAX_OPTIONS, Export, ServerConfig, TlsMode};

/// Context id the server assigns to `base:allocation` in `NBD_OPT_SET_META_CONTEXT`, as
/// qemu-nbd numbers them: `base:allocation` 0, `qemu:allocation-depth` 1, an export's
/// other contexts ([`Export::contexts`], dirty bitmaps) 2 on, in order.
pub const BASE_ALLOCATION_ID: u32 = 0;

/// Whether `query` selects the context `name`: the name itself, or (`NBD_OPT_LIST_META_CONTEXT`
/// only) a prefix of it ending in `:`, so that `base:` lists `base:allocation`, `qemu:` every
/// `qemu:` context and `qemu:dirty-bitmap:` every bitmap, as the spec suggests for a bare
/// namespace and qemu-nbd answers. Each context is answered once, in the export's order,
/// however many queries select it.
fn query_matches(query: &str, name: &str, set: bool) -> bool {
    query == name || (!set && query.ends_with(':') && name.starts_with(query))
}

/// The outcome of a successful handshake, server side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerNegotiated {
    /// Index of the export in [`ServerConfig::exports`].
    pub export_index: usize,
    /// The export's canonical name.
    pub export_name: String,
    /// Export size.
    pub size: u64,
    /// Transmission flags sent to the client.
    pub flags: TransmissionFlags,
    /// Structured replies negotiated (also true with extended headers, which take
    /// precedence: every reply is then an extended chunk).
    pub structured_replies: bool,
    /// Extended headers negotiated: 32-byte requests and extended reply chunks.
    pub extended_headers: bool,
    /// Selected metadata contexts `(id, name)` (empty unless the last
    /// `NBD_OPT_SET_META_CONTEXT` named this export).
    pub meta_contexts: Vec<(u32, String)>,
    /// `NBD_FLAG_C_NO_ZEROES` negotiated.
    pub no_zeroes: bool,
    /// Block size constraints in force.
    pub block_size: BlockSize,
    /// The client requested `NBD_INFO_BLOCK_SIZE` in `NBD_OPT_GO` (and so promised
    /// to obey the constraints).
    pub block_size_acknowledged: bool,
    /// Transmission entered via `NBD_OPT_GO` (vs `NBD_OPT_EXPORT_NAME`).
    pub via_go: bool,
    /// The session runs over TLS.
    pub tls: bool,
}

impl ServerNegotiated {
    /// What the transmission phase needs to check requests ([`crate::transmission::server::ServerTransmission`]).
    pub fn transmission_info(&self) -> TransmissionInfo {
        TransmissionInfo {
            size: self.size,
            flags: self.flags,
            structured_replies: self.structured_replies,
            has_meta_context: !self.meta_contexts.is_empty(),
            block_size: self.block_size,
            df_max_len: u32::MAX,
            extended_headers: self.extended_headers,
        }
    }

    /// The framing phase of the transmission (compact or extended requests).
    pub fn transmission_phase(&self) -> ServerPhase {
        if self.extended_headers {
            ServerPhase::TransmissionExtended
        } else {
            ServerPhase::Transmission
        }
    }
}

/// What happened after a message was handled.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerEvent {
    /// Send the output (if any) and wait for the next message.
    Continue,
    /// Send the output; the transmission phase starts now.
    Done(Box<ServerNegotiated>),
    /// The client sent `NBD_OPT_ABORT`: send the output (the ACK) and close.
    Abort,
    /// The client sent `NBD_OPT_STARTTLS`: send the output (the ACK), then run the TLS
    /// handshake on the connection before anything else is read; the option haggling starts
    /// over inside TLS (what was negotiated before is forgotten).
    StartTls,
}

/// A condition that requires a hard disconnect (drop the connection without
/// sending anything further).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Undecodable message (bad magic, truncated, length mismatch).
    #[error(transparent)]
    Proto(#[from] ProtoError),
    /// Client flags with unknown bits ("the server MUST drop the TCP connection").
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    /// `NBD_FLAG_C_NO_ZEROES` without the server offering it.
    #[error("client set NO_ZEROES which was not offered")]
    NoZeroesNotOffered,
    /// Client did not set `NBD_FLAG_C_FIXED_NEWSTYLE` and this server refuses that.
    #[error("client does not support fixed newstyle")]
    NotFixedNewstyle,
    /// A non-fixed-newstyle client sent an option other than `NBD_OPT_EXPORT_NAME`.
    #[error("option {0} from a non-fixed-newstyle client")]
    NonFixedOption(u32),
    /// Option data above [`ServerConfig::max_option_len`].
    #[error("option length {len} exceeds limit {limit}")]
    OptionTooLong {
        /// Announced length.
        len: u32,
        /// Limit.
        limit: u32,
    },
    /// More than [`ServerConfig::max_options`] options.
    #[error("too many options")]
    TooManyOptions,
    /// `NBD_OPT_EXPORT_NAME` with an invalid name (cannot be answered with an error).
    #[error("invalid export name")]
    InvalidExportName,
    /// `NBD_OPT_EXPORT_NAME` for an unknown export ("the server MUST terminate the session").
    #[error("unknown export {0:?}")]
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` for an export that requires block size negotiation.
    #[error("export {0:?} requires NBD_OPT_GO with NBD_INFO_BLOCK_SIZE")]
    BlockSizeRequired(String),
    /// `NBD_OPT_EXPORT_NAME` while shutting down (cannot be answered with an error).
    #[error("server is shutting down")]
    ShuttingDown,
    /// A message arrived after the handshake ended.
    #[error("handshake already finished")]
    Finished,
    /// `NBD_OPT_EXPORT_NAME` before `NBD_OPT_STARTTLS` on a server that requires TLS (it
    /// cannot be answered with an error).
    #[error("NBD_OPT_EXPORT_NAME without TLS, which this server requires")]
    TlsRequired,
    /// `NBD_OPT_EXPORT_NAME` after extended headers were negotiated ("a client MUST NOT
    /// use" it then; it cannot be answered with an error).
    #[error("NBD_OPT_EXPORT_NAME after NBD_OPT_EXTENDED_HEADERS")]
    ExportNameWithExtendedHeaders,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    Finished,
}

/// The server handshake state machine.
#[derive(Debug, Clone)]
pub struct ServerHandshake {
    config: ServerConfig,
    state: State,
    fixed: bool,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    /// TLS is running (`NBD_OPT_STARTTLS` was acknowledged).
    tls: bool,
    /// Export index and contexts selected by the last `NBD_OPT_SET_META_CONTEXT`.
    meta: Option<(usize, Vec<(u32, String)>)>,
    options_seen: u32,
    shutting_down: bool,
    inbuf: Vec<u8>,
}

fn reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    encode_option_reply(option, reply_type, data, out);
}

fn reply_err(out: &mut Vec<u8>, option: u32, reply_type: u32, message: &str) {
    encode_option_reply(option, reply_type, message.as_bytes(), out);
}

impl ServerHandshake {
    /// A fresh handshake. Send [`Self::greeting`] first.
    pub fn new(config: ServerConfig) -> Self {
        Self {
            config,
            state: State::ClientFlags,
            fixed: false,
            no_zeroes: false,
            structured: false,
            extended: false,
            tls: false,
            meta: None,
            options_seen: 0,
            shutting_down: false,
            inbuf: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Handshake flags offered in the greeting.
    pub fn handshake_flags(&self) -> HandshakeFlags {
        HandshakeFlags::FIXED_NEWSTYLE.with(HandshakeFlags::NO_ZEROES, self.config.offer_no_zeroes)
    }

    /// The 18-byte greeting to send as soon as the connection is up.
    pub fn greeting(&self) -> [u8; c::GREETING_LEN] {
        Greeting {
            flags: self.handshake_flags(),
        }
        .encode()
    }

    /// The framing phase for the next client message.
    pub fn phase(&self) -> ServerPhase {
        match self.state {
            State::ClientFlags => ServerPhase::ClientFlags,
            State::Options => ServerPhase::Options,
            State::Finished if self.extended => ServerPhase::TransmissionExtended,
            State::Finished => ServerPhase::Transmission,
        }
    }

    /// Frame limits matching this configuration (writes use the default cap).
    pub fn frame_limits(&self) -> FrameLimits {
        FrameLimits {
            max_option_len: self.config.max_option_len,
            ..FrameLimits::default()
        }
    }

    /// From now on, answer options (other than `NBD_OPT_ABORT`) with
    /// `NBD_REP_ERR_SHUTDOWN`, as the spec recommends for a server shutting down.
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
    }

    /// Handle one complete client message (client flags, or option header + data).
    /// Replies are appended to `out`. An `Err` means: hard disconnect.
    pub fn handle_message(
        &mut self,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ServerEvent, ServerError> {
        let res = match self.state {
            State::ClientFlags => self.handle_client_flags(msg),
            State::Options => {
                let h = OptionHeader::parse(msg);
                match h {
                    Ok(h) => {
                        let data = &msg[c::OPTION_HEADER_LEN..];
                        if h.length > self.config.max_option_len {
                            Err(ServerError::OptionTooLong {
                                len: h.length,
                                limit: self.config.max_option_len,
                            })
                        } else if data.len() as u64 != u64::from(h.length) {
                            Err(ProtoError::LengthMismatch {
                                expected: h.length as usize,
                                got: data.len(),
                            }
                            .into())
                        } else {
                            self.handle_option(h.option, data, out)
                        }
                    }
                    Err(e) => Err(e.into()),
                }
            }
            State::Finished => return Err(ServerError::Finished),
        };
        match &res {
            Err(_) | Ok(ServerEvent::Done(_)) | Ok(ServerEvent::Abort) => {
                self.state = State::Finished;
            }
            Ok(ServerEvent::Continue) | Ok(ServerEvent::StartTls) => {}
        }
        res
    }

    /// Byte-stream interface: buffer `input`, handle every complete message, and
    /// stop at the first terminal event. Bytes received after the handshake
    /// ended (pipelined requests) are kept; fetch them with [`Self::take_leftover`].
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<ServerEvent, ServerError> {
        if self.state == State::Finished {
            return Err(ServerError::Finished);
        }
        self.inbuf.extend_from_slice(input);
        let limits = self.frame_limits();
        loop {
            let need = server_need(self.phase(), &self.inbuf, &limits);
            let total = match need {
                Need::Header(_) => return Ok(ServerEvent::Continue),
                Need::Invalid(crate::framing::FrameError::TooLong { len, limit }) => {
                    self.state = State::Finished;
                    // an option length is a u32
                    let len = u32::try_from(len).unwrap_or(u32::MAX);
                    return Err(ServerError::OptionTooLong { len, limit });
                }
                Need::Invalid(_) => {
                    self.state = State::Finished;
                    return Err(ProtoError::Invalid("bad option magic").into());
                }
                Need::Message {
                    header_len,
                    body_len,
                } => header_len + body_len,
            };
            if self.inbuf.len() < total {
                return Ok(ServerEvent::Continue);
            }
            let rest = self.inbuf.split_off(total);
            let msg = core::mem::replace(&mut self.inbuf, rest);
            match self.handle_message(&msg, out)? {
                ServerEvent::Continue => continue,
                terminal => return Ok(terminal),
            }
        }
    }

    /// Bytes fed after the handshake finished (the start of the transmission phase).
    pub fn take_leftover(&mut self) -> Vec<u8> {
        core::mem::take(&mut self.inbuf)
    }

    fn handle_client_flags(&mut self, msg: &[u8]) -> Result<ServerEvent, ServerError> {
        let flags = parse_client_flags(msg)?;
        if flags.unknown_bits() != 0 {
            return Err(ServerError::UnknownClientFlags(flags.bits()));
        }
        if flags.contains(ClientFlags::NO_ZEROES) && !self.config.offer_no_zeroes {
            return Err(ServerError::NoZeroesNotOffered);
        }
        self.fixed = flags.contains(ClientFlags::FIXED_NEWSTYLE);
        if !self.fixed && !self.config.allow_non_fixed_newstyle {
            return Err(ServerError::NotFixedNewstyle);
        }
        self.no_zeroes = flags.contains(ClientFlags::NO_ZEROES);
        self.state = State::Options;
        Ok(ServerEvent::Continue)
    }

    fn handle_option(
        &mut self,
        option: u32,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ServerEvent, ServerError> {
        self.options_seen = self.options_seen.saturating_add(1);
        if self.options_seen > self.config.max_options {
            return Err(ServerError::TooManyOptions);
        }
        if !self.fixed && option != c::OPT_EXPORT_NAME {
            return Err(ServerError::NonFixedOption(option));
        }
        if self.shutting_down {
            match option {
                c::OPT_ABORT => {}
                c::OPT_EXPORT_NAME => return Err(ServerError::ShuttingDown),
                _ => {
                    reply_err(out, option, c::REP_ERR_SHUTDOWN, "server is shutting down");
                    return Ok(ServerEvent::Continue);
                }
            }
        }
        if self.config.tls == TlsMode::Require && !self.tls {
            match option {
                c::OPT_ABORT | c::OPT_STARTTLS => {}
                c::OPT_EXPORT_NAME => return Err(ServerError::TlsRequired),
                _ => {
                    reply_err(out, option, c::REP_ERR_TLS_REQD, "TLS is required");
                    return Ok(ServerEvent::Continue);
                }
            }
        }
        match option {
            c::OPT_EXPORT_NAME => self.export_name(data, out),
            c::OPT_ABORT => {
                // "a server SHOULD ignore any data sent by the client"
                reply(out, option, c::REP_ACK, &[]);
                Ok(ServerEvent::Abort)
            }
            c::OPT_LIST => {
                self.list(data, out);
                Ok(ServerEvent::Continue)
            }
            c::OPT_STARTTLS if self.config.tls == TlsMode::Off => {
                // NOTLS mode: "NBD_REP_ERR_UNSUP (if it does not support the
                // NBD_OPT_STARTTLS option at all)".
                reply_err(out, option, c::REP_ERR_UNSUP, "TLS is not supported");
                Ok(ServerEvent::Continue)
            }
            c::OPT_STARTTLS => Ok(self.start_tls(data, out)),
            c::OPT_INFO | c::OPT_GO if self.config.support_go => self.info_or_go(option, data, out),
            c::OPT_STRUCTURED_REPLY if self.extended => {
                // "The client has already successfully negotiated extended headers, which
                // takes precedence over this option."
                reply_err(
                    out,
                    option,
                    c::REP_ERR_EXT_HEADER_REQD,
                    "extended headers are already negotiated",
                );
                Ok(ServerEvent::Continue)
            }
            // "the server MUST also support NBD_OPT_GO" (the client may not fall back).
            c::OPT_EXTENDED_HEADERS
                if self.config.support_extended_headers && self.config.support_go =>
            {
                if data.is_empty() {
                    // Extended replies are structured replies with longer headers.
                    self.extended = true;
                    self.structured = true;
                    reply(out, option, c::REP_ACK, &[]);
                } else {
                    reply_err(
                        out,
                        option,
                        c::REP_ERR_INVALID,
                        "NBD_OPT_EXTENDED_HEADERS takes no data",
                    );
                }
                Ok(ServerEvent::Continue)
            }
            c::OPT_STRUCTURED_REPLY if self.config.support_structured_replies => {
                if data.is_empty() {
                    self.structured = true;
                    reply(out, option, c::REP_ACK, &[]);
                } else {
                    reply_err(
                        out,
                        option,
                        c::REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
                Ok(ServerEvent::Continue)
            }
            c::OPT_LIST_META_CONTEXT | c::OPT_SET_META_CONTEXT
                if self.config.support_meta_contexts =>
            {
                self.meta_context(option, data, out);
                Ok(ServerEvent::Continue)
            }
            _ => {
                reply_err(out, option, c::REP_ERR_UNSUP, "unsupported option");
                Ok(ServerEvent::Continue)
            }
        }
    }

    /// `NBD_OPT_LIST`: every export the server may list, or why not.
    fn list(&self, data: &[u8], out: &mut Vec<u8>) {
        let option = c::OPT_LIST;
        if !data.is_empty() {
            reply_err(
                out,
                option,
                c::REP_ERR_INVALID,
                "NBD_OPT_LIST takes no data",
            );
        } else if !self.config.allow_list {
            reply_err(out, option, c::REP_ERR_POLICY, "listing is disabled");
        } else {
            for e in &self.config.exports {
                let entry = ServerEntry {
                    name: &e.name,
                    description: &e.description,
                };
                // exports with over-long names cannot be listed; skip them
                if let Ok(d) = entry.encode() {
                    reply(out, option, c::REP_SERVER, &d);
                }
            }
            reply(out, option, c::REP_ACK, &[]);
        }
    }

    /// `NBD_OPT_STARTTLS` where TLS is offered: acknowledged, and the negotiation starts over.
    fn start_tls(&mut self, data: &[u8], out: &mut Vec<u8>) -> ServerEvent {
        let option = c::OPT_STARTTLS;
        if self.tls {
            // "the server MUST respond with NBD_REP_ERR_INVALID" to a second one.
            reply_err(out, option, c::REP_ERR_INVALID, "TLS is already running");
            return ServerEvent::Continue;
        }
        if !data.is_empty() {
            reply_err(
                out,
                option,
                c::REP_ERR_INVALID,
                "NBD_OPT_STARTTLS takes no data",
            );
            return ServerEvent::Continue;
        }
        reply(out, option, c::REP_ACK, &[]);
        // The negotiation starts over inside TLS.
        self.tls = true;
        self.structured = false;
        self.extended = false;
        self.meta = None;
        ServerEvent::StartTls
    }

    fn negotiated(&self, idx: usize, via_go: bool, acked: bool) -> Option<ServerNegotiated> {
        let e = self.config.exports.get(idx)?;
        let meta_contexts = match &self.meta {
            Some((i, ctx)) if *i == idx => ctx.clone(),
            _ => Vec::new(),
        };
        let mut flags = e.transmission_flags(self.structured);
        // The payload form of BLOCK_STATUS, as qemu-nbd offers it: with extended headers and
        // contexts selected (the spec's SHOULD), while a selection fits a ContextSet.
        flags.set(
            TransmissionFlags::BLOCK_STATUS_PAYLOAD,
            self.extended && (1..=ContextSet::MAX).contains(&meta_contexts.len()),
        );
        Some(ServerNegotiated {
            export_index: idx,
            export_name: e.name.clone(),
            size: e.size,
            flags,
            structured_replies: self.structured,
            extended_headers: self.extended,
            meta_contexts,
            no_zeroes: self.no_zeroes,
            block_size: e.effective_block_size(),
            block_size_acknowledged: acked,
            via_go,
            tls: self.tls,
        })
    }

    fn export_name(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<ServerEvent, ServerError> {
        if self.extended {
            return Err(ServerError::ExportNameWithExtendedHeaders);
        }
        let name = parse_string(data, "export name").map_err(|_| ServerError::InvalidExportName)?;
        let idx = self
            .config
            .lookup(name)
            .ok_or_else(|| ServerError::UnknownExport(name.to_owned()))?;
        let neg = self
            .negotiated(idx, false, false)
            .ok_or_else(|| ServerError::UnknownExport(name.to_owned()))?;
        if self.config.exports[idx].require_block_size {
            return Err(ServerError::BlockSizeRequired(neg.export_name));
        }
        ExportNameReply {
            size: neg.size,
            flags: neg.flags,
        }
        .encode(self.no_zeroes, out);
        Ok(ServerEvent::Done(Box::new(neg)))
    }

    fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ServerEvent, ServerError> {
        let req = match InfoRequest::parse(data) {
            Ok(r) => r,
            Err(_) => {
                reply_err(out, option, c::REP_ERR_INVALID, "malformed info request");
                return Ok(ServerEvent::Continue);
            }
        };
        let Some(idx) = self.config.lookup(req.name) else {
            reply_err(out, option, c::REP_ERR_UNKNOWN, "unknown export");
            return Ok(ServerEvent::Continue);
        };
        let want_bs = req.items.contains(&c::INFO_BLOCK_SIZE);
        let Some(neg) = self.negotiated(idx, option == c::OPT_GO, want_bs) else {
            reply_err(out, option, c::REP_ERR_UNKNOWN, "unknown export");
            return Ok(ServerEvent::Continue);
        };
        let export = &self.config.exports[idx];
        let bs_info = |out: &mut Vec<u8>| {
            reply(
                out,
                option,
                c::REP_INFO,
                &InfoReply::BlockSize(neg.block_size).encode(),
            );
        };
        if option == c::OPT_GO && export.require_block_size && !want_bs {
            bs_info(out);
            reply_err(
                out,
                option,
                c::REP_ERR_BLOCK_SIZE_REQD,
                "this export requires NBD_INFO_BLOCK_SIZE",
            );
            return Ok(ServerEvent::Continue);
        }
        let mut sent_bs = false;
        let mut seen = [false; 4];
        for &item in &req.items {
            let Some(slot) = seen.get_mut(usize::from(item)) else {
                continue; // unknown info types are ignored
            };
            if core::mem::replace(slot, true) {
                continue; // duplicates answered once
            }
            match item {
                c::INFO_NAME => reply(
                    out,
                    option,
                    c::REP_INFO,
                    &InfoReply::Name(&export.name).encode(),
                ),
                c::INFO_DESCRIPTION if !export.description.is_empty() => reply(
                    out,
                    option,
                    c::REP_INFO,
                    &InfoReply::Description(&export.description).encode(),
                ),
                c::INFO_BLOCK_SIZE => {
                    bs_info(out);
                    sent_bs = true;
                }
                _ => {}
            }
        }
        // A server with non-default constraints SHOULD advertise them; unrequested
        // info is allowed ("The server MAY send information requests back which
        // are not explicitly requested").
        if !sent_bs && export.block_size.is_some() {
            bs_info(out);
        }
        reply(
            out,
            option,
            c::REP_INFO,
            &InfoReply::Export {
                size: neg.size,
                flags: neg.flags,
            }
            .encode(),
        );
        reply(out, option, c::REP_ACK, &[]);
        if option == c::OPT_GO {
            Ok(ServerEvent::Done(Box::new(neg)))
        } else {
            Ok(ServerEvent::Continue)
        }
    }

    fn meta_context(&mut self, option: u32, data: &[u8], out: &mut Vec<u8>) {
        let set = option == c::OPT_SET_META_CONTEXT;
        if set {
            // "replaces all previously-set metadata contexts (including when this command fails)"
            self.meta = None;
            if !self.structured {
                reply_err(
                    out,
                    option,
                    c::REP_ERR_INVALID,
                    "structured replies must be negotiated first",
                );
                return;
            }
        }
        let req = match MetaContextRequest::parse(data) {
            Ok(r) => r,
            Err(_) => {
                reply_err(
                    out,
                    option,
                    c::REP_ERR_INVALID,
                    "malformed meta context request",
                );
                return;
            }
        };
        let Some(idx) = self.config.lookup(req.export) else {
            reply_err(out, option, c::REP_ERR_UNKNOWN, "unknown export");
            return;
        };
        let mut selected = Vec::new();
        for (id, name) in self.config.exports[idx].offered_contexts() {
            // LIST with no query lists every context, as qemu-nbd does.
            let wanted = (!set && req.queries.is_empty())
                || req.queries.iter().any(|q| query_matches(q, name, set));
            if !wanted {
                continue;
            }
            // "the server MUST use a context ID of 0" in LIST replies.
            let id = if set { id } else { 0 };
            reply(
                out,
                option,
                c::REP_META_CONTEXT,
                &MetaContextEntry { id, name }.encode(),
            );
            selected.push((id, name.to_owned()));
        }
        reply(out, option, c::REP_ACK, &[]);
        if set {
            self.meta = Some((idx, selected));
        }
    }
}
