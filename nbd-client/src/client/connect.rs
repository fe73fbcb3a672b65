//! Getting a [`Client`]: the handshake variants (NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_LIST)
//! with the options the caller asked for, and what the export's limits make of them.

use std::collections::VecDeque;

use nbd_proto::consts as c;
use nbd_proto::handshake::{
    ClientConfig, ClientError, ClientEvent, ClientHandshake, ExportListing,
};
use nbd_proto::transmission::client::ClientSession;
use qpip_core::Nic;

use super::link::Link;
use super::recovery::Recovery;
use super::{Client, ClientOptions, ExportInfo};
use crate::conn::{Conn, MAX_IO, MAX_WINDOW};
use crate::error::{Error, Result};
use crate::framer::Reads;
use crate::uri::NbdUri;

/// The largest export the client accepts: offsets are `off_t` (signed 64-bit) in every file
/// and block device API.
const MAX_EXPORT_SIZE: u64 = i64::MAX as u64;

/// The one check of an export's size as a server reports it — at the first connect, on a
/// reconnect and in a size probe alike: files, block devices and every offset we hand to
/// the kernel are signed 64-bit, so a bigger export cannot be used, whatever it holds (qemu
/// refuses it too).
pub(crate) fn usable_size(uri: &NbdUri, size: u64) -> Result<u64> {
    if size > MAX_EXPORT_SIZE {
        return Err(Error::Protocol {
            uri: uri.to_string(),
            why: format!(
                "it reports an export of {size} bytes, more than the 2^63 - 1 any file or block device can address"
            ),
        });
    }
    Ok(size)
}

pub(super) fn round_down(v: u64, to: u64) -> u64 {
    v - v % to.max(1)
}

impl Client {
    /// Connects to an NBD URI with the default options.
    pub fn connect(uri: &str) -> Result<Client> {
        Self::connect_with(uri, ClientOptions::default())
    }

    /// Connects with `opts`: OPT_GO with block sizes, structured replies and
    /// `base:allocation` when the server has them, falling back to simple replies and
    /// NBD_OPT_EXPORT_NAME when it does not.
    pub fn connect_with(uri: &str, mut opts: ClientOptions) -> Result<Client> {
        let uri = NbdUri::parse(uri)?;
        opts.window = opts.window.clamp(1, MAX_WINDOW);
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let reads = Reads::new();
        let (conn, ev) = Conn::open(
            &nic,
            &uri,
            &reads,
            ClientHandshake::connect(Self::config(&uri, &opts)),
            opts.connect_timeout,
        )?;
        let ClientEvent::Connected(neg) = ev else {
            return Err(Error::Protocol {
                uri: uri.to_string(),
                why: "handshake ended without entering transmission".into(),
            });
        };
        let info = neg.export.clone();
        usable_size(&uri, info.size)?;
        let bs = info.block_size;
        let max = u64::from(bs.max)
            .min(MAX_IO as u64)
            .min(opts.max_request.map_or(u64::MAX, u64::from));
        let max_io = round_down(max, u64::from(bs.min)).max(u64::from(bs.min)) as u32;
        tracing::debug!(%uri, ?info, structured = neg.structured_replies, extended = neg.extended_headers, "connected");
        Ok(Client {
            link: Link::new(nic, conn, opts.window, max_io),
            session: ClientSession::with_table(&neg, max_io, opts.window, reads),
            recovery: Recovery::new(opts.request_timeout, opts.reconnect_timeout),
            done: VecDeque::new(),
            uri,
            info,
            opts,
            listed_contexts: neg.listed_contexts.clone(),
        })
    }

    pub(super) fn config(uri: &NbdUri, opts: &ClientOptions) -> ClientConfig {
        let mut cfg = ClientConfig::new(uri.export.clone());
        cfg.structured_replies = opts.structured_replies;
        cfg.tls = uri.tls.is_some();
        cfg.extended_headers = opts.extended_headers && opts.structured_replies;
        cfg.base_allocation = opts.base_allocation && opts.structured_replies;
        if opts.structured_replies {
            cfg.meta_contexts = opts.meta_contexts.clone();
        }
        cfg.list_contexts = opts.list_contexts;
        cfg
    }
    /// The export's details without entering transmission (NBD_OPT_INFO); falls back to a
    /// full connect for servers without it.
    pub fn info(uri: &str) -> Result<ExportInfo> {
        Self::info_with(uri, &ClientOptions::default())
    }

    /// [`Self::info`] with `opts` (its NIC and connect timeout).
    pub fn info_with(uri: &str, opts: &ClientOptions) -> Result<ExportInfo> {
        let parsed = NbdUri::parse(uri)?;
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let hs = ClientHandshake::info(Self::config(&parsed, opts));
        match Conn::open(&nic, &parsed, &Reads::new(), hs, opts.connect_timeout) {
            Ok((_, ClientEvent::Info(d))) => usable_size(&parsed, d.size).map(|_| *d),
            Ok(_) => Err(Error::Protocol {
                uri: parsed.to_string(),
                why: "unexpected answer to NBD_OPT_INFO".into(),
            }),
            Err(Error::Handshake {
                source: ClientError::NoFixedNewstyle,
                ..
            }) => Self::info_by_connect(uri, nic),
            Err(Error::Handshake {
                source: ClientError::Rejected { reply, .. },
                ..
            }) if reply == c::REP_ERR_UNSUP => Self::info_by_connect(uri, nic),
            Err(e) => Err(e),
        }
    }

    fn info_by_connect(uri: &str, nic: Nic) -> Result<ExportInfo> {
        let client = Self::connect_with(
            uri,
            ClientOptions {
                nic: Some(nic),
                window: 1,
                ..Default::default()
            },
        )?;
        let info = client.export_info().clone();
        client.disconnect()?;
        Ok(info)
    }

    /// When `err` is the server refusing the export `uri` names, and its export list (if
    /// it gives one) lacks that name: one line naming the export and the exports it has.
    pub fn explain_unknown_export(uri: &str, err: &Error, opts: &ClientOptions) -> Option<String> {
        let Error::Handshake {
            source: ClientError::Rejected { .. },
            ..
        } = err
        else {
            return None;
        };
        let parsed = NbdUri::parse(uri).ok()?;
        let mut base = parsed.clone();
        base.export.clear();
        let list = Self::list_with(&base.to_string(), opts).ok()?;
        if list.iter().any(|x| x.name == parsed.export) {
            return None;
        }
        let names: Vec<String> = list.iter().map(|x| format!("{:?}", x.name)).collect();
        let exports = if names.is_empty() {
            "(none listed)".to_string()
        } else {
            names.join(", ")
        };
        // The empty name is the server's default export: a URI without one asks for it.
        if parsed.export.is_empty() {
            let example = list.first().map_or(String::new(), |x| {
                base.export.clone_from(&x.name);
                format!(" (e.g. {base})")
            });
            return Some(format!(
                "{parsed}: the server has no default export (the URI names none); its exports: {exports}: name one in the URI{example}"
            ));
        }
        Some(format!(
            "{parsed}: the server has no export named {:?}; its exports: {exports}",
            parsed.export,
        ))
    }

    /// The server's exports (NBD_OPT_LIST).
    pub fn list(uri: &str) -> Result<Vec<ExportListing>> {
        Self::list_with(uri, &ClientOptions::default())
    }

    /// [`Self::list`] with `opts` (its NIC and connect timeout).
    pub fn list_with(uri: &str, opts: &ClientOptions) -> Result<Vec<ExportListing>> {
        let parsed = NbdUri::parse(uri)?;
        let nic = match &opts.nic {
            Some(n) => n.clone(),
            None => Nic::soft()?,
        };
        let hs = ClientHandshake::list_with(Self::config(&parsed, opts));
        match Conn::open(&nic, &parsed, &Reads::new(), hs, opts.connect_timeout)? {
            (_, ClientEvent::Listed(v)) => Ok(v),
            _ => Err(Error::Protocol {
                uri: parsed.to_string(),
                why: "unexpected answer to NBD_OPT_LIST".into(),
            }),
        }
    }
}
