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
//! wanted), else or if refused `NBD_OPT_STRUCTURED_REPLY` (if wanted) → `NBD_OPT_LIST_META_CONTEXT`
//! (if wanted) → `NBD_OPT_SET_META_CONTEXT base:allocation` and the other contexts asked for
//! (if any and structured replies were accepted) → `NBD_OPT_GO` requesting `NAME`, `DESCRIPTION` and
//! `BLOCK_SIZE`, falling back to `NBD_OPT_EXPORT_NAME` if the server answers
//! `NBD_REP_ERR_UNSUP` (or does not do fixed newstyle at all) — except after extended
//! headers, which forbid `NBD_OPT_EXPORT_NAME` (a server offering them must do `GO`).
//!
//! What the client asks for is in `handshake/client/config.rs`; what it reports (events,
//! export details, errors) in `handshake/client/outcome.rs`.
//!
//! Over 600 lines: one state machine whose steps all act on the same negotiation state; split by step, each part would need all of it.

use crate::consts as c;
use crate::error::ProtoError;
use crate::flags::{ClientFlags, HandshakeFlags, TransmissionFlags};
use crate::framing::{ClientPhase, FrameLimits, Need, client_need};
use crate::handshake::messages::{
    BlockSize, ExportNameReply, Greeting, InfoReply, InfoRequest, MetaContextEntry,
    MetaContextRequest, OptionReplyHeader, ServerEntry, encode_client_flags, encode_option,
};

mod config;
mod outcome;

pub use config::ClientConfig;
pub use outcome::{
    ClientError, ClientEvent, ClientNegotiated, ExportDetails, ExportListing, reply_name,
};

/// Most `NBD_REP_SERVER` entries a client collects from `NBD_OPT_LIST`.
pub const MAX_LIST_ENTRIES: usize = 16 * 1024;
/// Most `NBD_REP_META_CONTEXT` / `NBD_REP_INFO` replies accepted for one option.
pub const MAX_REPLIES_PER_OPTION: usize = 1024;

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
    /// `NBD_OPT_LIST_META_CONTEXT` sent: the names so far.
    ListMeta(Vec<String>),
    /// `NBD_OPT_SET_META_CONTEXT` sent: the contexts selected so far.
    SetMeta(Vec<(u32, String)>),
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
    /// The contexts the last `NBD_OPT_SET_META_CONTEXT` selected.
    meta_contexts: Vec<(u32, String)>,
    listed_contexts: Vec<String>,
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
            meta_contexts: Vec::new(),
            listed_contexts: Vec::new(),
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
        if self.config.list_contexts {
            let data = MetaContextRequest {
                export: &self.config.export_name,
                queries: Vec::new(),
            }
            .encode()?;
            encode_option(c::OPT_LIST_META_CONTEXT, &data, out);
            self.state = State::ListMeta(Vec::new());
            Ok(())
        } else {
            self.set_meta(out)
        }
    }

    /// The queries of `NBD_OPT_SET_META_CONTEXT`: `base:allocation` if wanted, then the
    /// other contexts asked for.
    fn wanted_contexts(&self) -> Vec<&str> {
        let base = self.config.base_allocation.then_some(c::BASE_ALLOCATION);
        base.into_iter()
            .chain(self.config.meta_contexts.iter().map(String::as_str))
            .collect()
    }

    fn set_meta(&mut self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        let queries = self.wanted_contexts();
        if self.structured && !queries.is_empty() {
            let data = MetaContextRequest {
                export: &self.config.export_name,
                queries,
            }
            .encode()?;
            encode_option(c::OPT_SET_META_CONTEXT, &data, out);
            self.state = State::SetMeta(Vec::new());
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
            State::ListMeta(_) => c::OPT_LIST_META_CONTEXT,
            State::SetMeta(_) => c::OPT_SET_META_CONTEXT,
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
            State::ExportName => return self.handle_export_name_reply(msg),
            _ => {}
        }
        let (h, data) = self.option_reply(msg, out)?;
        let state = core::mem::replace(&mut self.state, State::Finished);
        match state {
            State::StartTls => self.on_starttls_reply(h, data, out),
            State::ExtendedHeaders => self.on_extended_headers_reply(h, out),
            State::StructuredReply => self.on_structured_reply(h, out),
            State::ListMeta(names) => self.on_list_meta_reply(h, data, names, out),
            State::SetMeta(selected) => self.on_meta_context_reply(h, data, selected, out),
            State::Go(acc) | State::Info(acc) => self.on_info_reply(h, data, acc, out),
            State::List(entries) => self.on_list_reply(h, data, entries, out),
            State::Greeting | State::TlsPending | State::ExportName | State::Finished => {
                Err(ClientError::Finished)
            }
        }
    }

    /// The reply to `NBD_OPT_EXPORT_NAME` ends the handshake (no block sizes, no GO details).
    fn handle_export_name_reply(&mut self, msg: &[u8]) -> Result<ClientEvent, ClientError> {
        let r = ExportNameReply::parse(msg, self.no_zeroes)?;
        Ok(ClientEvent::Connected(Box::new(ClientNegotiated {
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
            base_allocation: self.base_allocation(),
            meta_contexts: self.meta_contexts.clone(),
            listed_contexts: self.listed_contexts.clone(),
            no_zeroes: self.no_zeroes,
            via_go: false,
            tls: self.config.tls,
        })))
    }

    /// An option reply's header and data, checked against what every state expects: the
    /// length the header gives, the option in flight, and no `ERR_SHUTDOWN` (answered with
    /// `NBD_OPT_ABORT`).
    fn option_reply<'m>(
        &self,
        msg: &'m [u8],
        out: &mut Vec<u8>,
    ) -> Result<(OptionReplyHeader, &'m [u8]), ClientError> {
        let h = OptionReplyHeader::parse(msg)?;
        let data = &msg[c::OPTION_REPLY_HEADER_LEN..];
        if data.len() as u64 != u64::from(h.length) {
            return Err(ProtoError::LengthMismatch {
                expected: h.length as usize,
                got: data.len(),
            }
            .into());
        }
        if self.expected_option() != Some(h.option) {
            return Err(unexpected(h));
        }
        if h.reply_type == c::REP_ERR_SHUTDOWN {
            Self::abort(out);
            return Err(ClientError::ServerShutdown);
        }
        Ok((h, data))
    }

    fn on_starttls_reply(
        &mut self,
        h: OptionReplyHeader,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
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
            _ => Err(unexpected(h)),
        }
    }

    fn on_extended_headers_reply(
        &mut self,
        h: OptionReplyHeader,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
            c::REP_ACK => {
                self.extended = true;
                self.structured = true;
                self.after_structured(out)?;
            }
            // Refused (ERR_UNSUP from older servers): compact headers.
            _ if h.is_error() => self.ask_structured(out)?,
            _ => return Err(unexpected(h)),
        }
        Ok(ClientEvent::Continue)
    }

    fn on_structured_reply(
        &mut self,
        h: OptionReplyHeader,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
            c::REP_ACK => self.structured = true,
            _ if h.is_error() => self.structured = false,
            _ => return Err(unexpected(h)),
        }
        self.after_structured(out)?;
        Ok(ClientEvent::Continue)
    }

    /// The id the server gave `base:allocation`, if it selected it.
    fn base_allocation(&self) -> Option<u32> {
        self.meta_contexts
            .iter()
            .find(|(_, n)| n == c::BASE_ALLOCATION)
            .map(|(id, _)| *id)
    }

    /// A reply to `NBD_OPT_LIST_META_CONTEXT`: `names` are the contexts listed so far. An
    /// error leaves the list empty; either way the handshake goes on to select contexts.
    fn on_list_meta_reply(
        &mut self,
        h: OptionReplyHeader,
        data: &[u8],
        mut names: Vec<String>,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
            c::REP_META_CONTEXT => {
                if names.len() >= MAX_REPLIES_PER_OPTION {
                    return Err(ClientError::TooManyReplies);
                }
                names.push(MetaContextEntry::parse(data)?.name.to_owned());
                self.state = State::ListMeta(names);
            }
            c::REP_ACK => {
                self.listed_contexts = names;
                self.set_meta(out)?;
            }
            _ if h.is_error() => self.set_meta(out)?,
            _ => return Err(unexpected(h)),
        }
        Ok(ClientEvent::Continue)
    }

    /// A reply to `NBD_OPT_SET_META_CONTEXT`: `selected` are the contexts selected so far,
    /// each one the client asked for (others, and repeated ids or names, are ignored).
    fn on_meta_context_reply(
        &mut self,
        h: OptionReplyHeader,
        data: &[u8],
        mut selected: Vec<(u32, String)>,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
            c::REP_META_CONTEXT => {
                if selected.len() >= MAX_REPLIES_PER_OPTION {
                    return Err(ClientError::TooManyReplies);
                }
                let e = MetaContextEntry::parse(data)?;
                let asked = self.wanted_contexts().contains(&e.name);
                let repeated = selected.iter().any(|(id, n)| *id == e.id || n == e.name);
                if asked && !repeated {
                    selected.push((e.id, e.name.to_owned()));
                }
                self.state = State::SetMeta(selected);
                Ok(ClientEvent::Continue)
            }
            c::REP_ACK => {
                self.meta_contexts = selected;
                self.send_go_or_export_name(out)?;
                Ok(ClientEvent::Continue)
            }
            _ if h.is_error() => {
                // "If an error is returned, the client MUST disregard any context replies"
                self.meta_contexts.clear();
                self.send_go_or_export_name(out)?;
                Ok(ClientEvent::Continue)
            }
            _ => Err(unexpected(h)),
        }
    }

    /// A reply to `NBD_OPT_GO` or `NBD_OPT_INFO` (which one, `h.option` says): an `INFO`
    /// item goes into `acc`; the ACK connects (GO) or reports the details (INFO).
    fn on_info_reply(
        &mut self,
        h: OptionReplyHeader,
        data: &[u8],
        mut acc: InfoAcc,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
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
                        base_allocation: self.base_allocation(),
                        meta_contexts: self.meta_contexts.clone(),
                        listed_contexts: self.listed_contexts.clone(),
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
            _ if h.is_error() => Err(Self::rejected(h, data, out)),
            _ => Err(unexpected(h)),
        }
    }

    /// A reply to `NBD_OPT_LIST`: one export more in `entries`, or the end of the list.
    fn on_list_reply(
        &mut self,
        h: OptionReplyHeader,
        data: &[u8],
        mut entries: Vec<ExportListing>,
        out: &mut Vec<u8>,
    ) -> Result<ClientEvent, ClientError> {
        match h.reply_type {
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
            _ if h.is_error() => Err(Self::rejected(h, data, out)),
            _ => Err(unexpected(h)),
        }
    }

    /// The server refused the option: abort the handshake, with the server's message.
    fn rejected(h: OptionReplyHeader, data: &[u8], out: &mut Vec<u8>) -> ClientError {
        Self::abort(out);
        ClientError::Rejected {
            option: h.option,
            reply: h.reply_type,
            message: crate::peer_text::printable(data),
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

/// A reply of a type the option in flight does not have.
fn unexpected(h: OptionReplyHeader) -> ClientError {
    ClientError::UnexpectedReply {
        option: h.option,
        reply: h.reply_type,
    }
}
