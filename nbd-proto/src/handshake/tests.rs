//! Handshake conversations: server and client driven against each other in
//! memory, plus byte-level checks of the server's answers.

use super::*;
use crate::ProtoError;
use crate::consts as c;
use crate::flags::{ClientFlags, HandshakeFlags, TransmissionFlags as TF};
use crate::framing::{FrameLimits, client_need, server_need};

fn disk() -> Export {
    Export {
        name: "disk".into(),
        description: "a test disk".into(),
        size: 1 << 30,
        flags: TF::SEND_FLUSH | TF::SEND_FUA | TF::SEND_TRIM | TF::SEND_DF | TF::CAN_MULTI_CONN,
        block_size: Some(BlockSize {
            min: 512,
            preferred: 4096,
            max: 1 << 25,
        }),
        require_block_size: false,
        contexts: Vec::new(),
    }
}

fn config() -> ServerConfig {
    let mut other = Export::new("other", 4096);
    other.flags = TF::READ_ONLY;
    ServerConfig::new(vec![disk(), other])
}

#[derive(Debug)]
struct Outcome {
    server: Option<Result<ServerEvent, ServerError>>,
    client: Option<Result<ClientEvent, ClientError>>,
}

fn pop(need: crate::framing::Need, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    let total = need.total()?;
    if buf.len() < total {
        return None;
    }
    let rest = buf.split_off(total);
    Some(core::mem::replace(buf, rest))
}

/// Drive both machines with the message-level API and the framers.
fn run(cfg: ServerConfig, mut client: ClientHandshake) -> Outcome {
    let mut server = ServerHandshake::new(cfg);
    let limits = FrameLimits::default();
    let mut s2c = server.greeting().to_vec();
    let mut c2s = Vec::new();
    let mut out = Outcome {
        server: None,
        client: None,
    };
    for _ in 0..100 {
        let mut progress = false;
        while out.client.is_none() {
            let Some(msg) = pop(
                client_need(client.phase(), &s2c, &limits, |_| None),
                &mut s2c,
            ) else {
                break;
            };
            progress = true;
            match client.handle_message(&msg, &mut c2s) {
                Ok(ClientEvent::Continue) => {}
                other => out.client = Some(other),
            }
        }
        while out.server.is_none() {
            let Some(msg) = pop(server_need(server.phase(), &c2s, &limits), &mut c2s) else {
                break;
            };
            progress = true;
            match server.handle_message(&msg, &mut s2c) {
                Ok(ServerEvent::Continue) => {}
                other => out.server = Some(other),
            }
        }
        if !progress {
            break;
        }
    }
    out
}

fn server_done(o: &Outcome) -> &ServerNegotiated {
    match &o.server {
        Some(Ok(ServerEvent::Done(n))) => n,
        other => panic!("server not done: {other:?}"),
    }
}

fn client_done(o: &Outcome) -> &ClientNegotiated {
    match &o.client {
        Some(Ok(ClientEvent::Connected(n))) => n,
        other => panic!("client not connected: {other:?}"),
    }
}

#[test]
fn go_with_structured_replies_and_meta_context() {
    let o = run(
        config(),
        ClientHandshake::connect(ClientConfig::new("disk")),
    );
    let s = server_done(&o);
    let cl = client_done(&o);
    assert!(s.via_go && cl.via_go);
    assert!(s.structured_replies && cl.structured_replies);
    assert!(s.no_zeroes && cl.no_zeroes);
    assert_eq!(
        s.meta_contexts,
        vec![(BASE_ALLOCATION_ID, c::BASE_ALLOCATION.to_owned())]
    );
    assert_eq!(cl.base_allocation, Some(BASE_ALLOCATION_ID));
    assert!(s.block_size_acknowledged);
    assert_eq!(cl.export.size, 1 << 30);
    assert_eq!(cl.export.flags, s.flags);
    assert!(
        cl.export
            .flags
            .contains(TF::HAS_FLAGS | TF::SEND_DF | TF::CAN_MULTI_CONN)
    );
    assert_eq!(cl.export.block_size, disk().block_size.unwrap());
    assert!(cl.export.block_size_advertised);
    assert_eq!(cl.export.name.as_deref(), Some("disk"));
    assert_eq!(cl.export.description.as_deref(), Some("a test disk"));
    assert_eq!(s.transmission_info(), {
        let mut t = cl.transmission_info();
        t.df_max_len = u32::MAX;
        t
    });
}

#[test]
fn client_lists_contexts_and_selects_several() {
    let mut cfg = config();
    cfg.exports[0].contexts = vec![c::QEMU_ALLOCATION_DEPTH.to_owned()];
    let mut cc = ClientConfig::new("disk");
    cc.list_contexts = true;
    cc.meta_contexts = vec![c::QEMU_ALLOCATION_DEPTH.to_owned(), "qemu:nope".to_owned()];
    let o = run(cfg.clone(), ClientHandshake::connect(cc.clone()));
    let (s, cl) = (server_done(&o), client_done(&o));
    let both = vec![
        (BASE_ALLOCATION_ID, c::BASE_ALLOCATION.to_owned()),
        (BASE_ALLOCATION_ID + 1, c::QEMU_ALLOCATION_DEPTH.to_owned()),
    ];
    assert_eq!(s.meta_contexts, both);
    assert_eq!(cl.meta_contexts, both);
    assert_eq!(cl.base_allocation, Some(BASE_ALLOCATION_ID));
    assert_eq!(
        cl.listed_contexts,
        vec![c::BASE_ALLOCATION, c::QEMU_ALLOCATION_DEPTH]
    );
    // qemu:allocation-depth alone, without base:allocation.
    cc.base_allocation = false;
    cc.list_contexts = false;
    let o = run(cfg, ClientHandshake::connect(cc));
    let cl = client_done(&o);
    assert_eq!(cl.base_allocation, None);
    assert_eq!(cl.meta_contexts, both[1..]);
    assert!(cl.listed_contexts.is_empty());
    assert!(cl.transmission_info().has_meta_context);
}

#[test]
fn export_name_fallback_when_go_unsupported() {
    let cfg = ServerConfig {
        support_go: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("disk")));
    let s = server_done(&o);
    let cl = client_done(&o);
    assert!(!s.via_go && !cl.via_go);
    assert_eq!(cl.export.size, 1 << 30);
    assert_eq!(cl.export.flags, s.flags);
    assert!(!cl.export.block_size_advertised);
    assert_eq!(cl.export.block_size, BlockSize::DEFAULT);
    // meta context negotiated before EXPORT_NAME still applies
    assert_eq!(cl.base_allocation, Some(BASE_ALLOCATION_ID));
    assert_eq!(s.meta_contexts.len(), 1);
}

#[test]
fn export_name_without_no_zeroes() {
    let cfg = ServerConfig {
        support_go: false,
        offer_no_zeroes: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("other")));
    assert!(!server_done(&o).no_zeroes);
    let cl = client_done(&o);
    assert!(!cl.no_zeroes);
    assert_eq!(cl.export.size, 4096);
    assert!(cl.export.flags.contains(TF::READ_ONLY));
}

#[test]
fn client_can_skip_go_and_structured() {
    let cc = ClientConfig {
        use_go: false,
        structured_replies: false,
        no_zeroes: false,
        ..ClientConfig::new("disk")
    };
    let o = run(config(), ClientHandshake::connect(cc));
    let cl = client_done(&o);
    assert!(!cl.structured_replies && cl.base_allocation.is_none() && !cl.via_go);
    // DF is never advertised without structured replies
    assert!(!cl.export.flags.contains(TF::SEND_DF));
}

#[test]
fn structured_and_meta_unsupported() {
    let cfg = ServerConfig {
        support_structured_replies: false,
        support_extended_headers: false,
        support_meta_contexts: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("disk")));
    let cl = client_done(&o);
    assert!(!cl.structured_replies);
    assert_eq!(cl.base_allocation, None);
    assert!(server_done(&o).meta_contexts.is_empty());

    let cfg = ServerConfig {
        support_meta_contexts: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("disk")));
    let cl = client_done(&o);
    assert!(cl.structured_replies);
    assert_eq!(cl.base_allocation, None);
}

#[test]
fn list_exports() {
    let o = run(config(), ClientHandshake::list());
    match o.client {
        Some(Ok(ClientEvent::Listed(l))) => {
            assert_eq!(
                l,
                vec![
                    ExportListing {
                        name: "disk".into(),
                        description: "a test disk".into()
                    },
                    ExportListing {
                        name: "other".into(),
                        description: String::new()
                    }
                ]
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(o.server, Some(Ok(ServerEvent::Abort)));
}

#[test]
fn list_refused_by_policy() {
    let cfg = ServerConfig {
        allow_list: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::list());
    assert!(matches!(
        o.client,
        Some(Err(ClientError::Rejected {
            reply: c::REP_ERR_POLICY,
            ..
        }))
    ));
    assert_eq!(o.server, Some(Ok(ServerEvent::Abort)));
}

#[test]
fn info_export() {
    let o = run(config(), ClientHandshake::info(ClientConfig::new("other")));
    match o.client {
        Some(Ok(ClientEvent::Info(d))) => {
            assert_eq!(d.size, 4096);
            assert!(d.flags.contains(TF::READ_ONLY | TF::HAS_FLAGS));
            assert_eq!(d.name.as_deref(), Some("other"));
            assert_eq!(d.description, None);
            // requested, so the defaults are advertised
            assert!(d.block_size_advertised);
            assert_eq!(d.block_size, BlockSize::DEFAULT);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(o.server, Some(Ok(ServerEvent::Abort)));
}

#[test]
fn unknown_export_with_info_and_go() {
    for client in [
        ClientHandshake::info(ClientConfig::new("nope")),
        ClientHandshake::connect(ClientConfig::new("nope")),
    ] {
        let o = run(config(), client);
        assert!(
            matches!(
                &o.client,
                Some(Err(ClientError::Rejected {
                    reply: c::REP_ERR_UNKNOWN,
                    ..
                }))
            ),
            "{o:?}"
        );
        assert_eq!(o.server, Some(Ok(ServerEvent::Abort)));
    }
}

#[test]
fn unknown_export_with_export_name_is_hard_disconnect() {
    let cfg = ServerConfig {
        support_go: false,
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("nope")));
    assert_eq!(
        o.server,
        Some(Err(ServerError::UnknownExport("nope".into())))
    );
    assert_eq!(o.client, None);
}

#[test]
fn default_export() {
    let cfg = ServerConfig {
        default_export: Some("other".into()),
        ..config()
    };
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("")));
    assert_eq!(server_done(&o).export_name, "other");
    assert_eq!(client_done(&o).export.name.as_deref(), Some("other"));
    // no default configured
    let o = run(config(), ClientHandshake::connect(ClientConfig::new("")));
    assert!(matches!(o.client, Some(Err(ClientError::Rejected { .. }))));
}

#[test]
fn stream_feed_byte_by_byte_with_pipelined_request() {
    let mut server = ServerHandshake::new(config());
    let mut client = ClientHandshake::connect(ClientConfig::new("disk"));
    let mut s2c = server.greeting().to_vec();
    let mut c2s = Vec::new();
    let mut sdone = None;
    let mut cdone = None;
    for _ in 0..50 {
        if cdone.is_none() {
            for b in core::mem::take(&mut s2c) {
                match client.feed(&[b], &mut c2s).unwrap() {
                    ClientEvent::Continue => {}
                    ev => cdone = Some(ev),
                }
            }
        }
        if sdone.is_none() && !c2s.is_empty() {
            let input = core::mem::take(&mut c2s);
            match server.feed(&input, &mut s2c).unwrap() {
                ServerEvent::Continue => {}
                ev => sdone = Some(ev),
            }
        }
        if sdone.is_some() && cdone.is_some() {
            break;
        }
    }
    assert!(matches!(sdone, Some(ServerEvent::Done(_))));
    assert!(matches!(cdone, Some(ClientEvent::Connected(_))));
    assert!(server.take_leftover().is_empty());
    assert_eq!(
        server.phase(),
        crate::framing::ServerPhase::TransmissionExtended
    );
    assert!(server.feed(&[], &mut Vec::new()).is_err());
    assert!(client.take_leftover().is_empty());
}

#[test]
fn stream_feed_keeps_pipelined_request() {
    let mut server = ServerHandshake::new(config());
    let mut input = 1u32.to_be_bytes().to_vec();
    input.extend_from_slice(&opt(c::OPT_EXPORT_NAME, b"disk"));
    let req = crate::transmission::Request {
        flags: crate::flags::CmdFlags::empty(),
        command: crate::transmission::Command::Write,
        cookie: 1,
        offset: 0,
        length: 4,
    };
    input.extend_from_slice(&req.encode(false).unwrap());
    input.extend_from_slice(b"data");
    let mut out = Vec::new();
    assert!(matches!(
        server.feed(&input, &mut out),
        Ok(ServerEvent::Done(_))
    ));
    assert_eq!(out.len(), 134);
    let left = server.take_leftover();
    assert_eq!(left.len(), 32);
    assert_eq!(crate::transmission::Request::parse(&left, false), Ok(req));
}

// ---- byte-level server checks ------------------------------------------------------

fn opt(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_option(option, data, &mut v);
    v
}

type Reply = (u32, u32, Vec<u8>);

fn replies(mut buf: &[u8]) -> Vec<Reply> {
    let mut v = Vec::new();
    while !buf.is_empty() {
        let h = OptionReplyHeader::parse(buf).unwrap();
        let end = 20 + h.length as usize;
        v.push((h.option, h.reply_type, buf[20..end].to_vec()));
        buf = &buf[end..];
    }
    v
}

fn started(cfg: ServerConfig, flags: u32) -> ServerHandshake {
    let mut s = ServerHandshake::new(cfg);
    assert_eq!(
        s.handle_message(&flags.to_be_bytes(), &mut Vec::new()),
        Ok(ServerEvent::Continue)
    );
    s
}

fn ask(
    s: &mut ServerHandshake,
    option: u32,
    data: &[u8],
) -> (Result<ServerEvent, ServerError>, Vec<Reply>) {
    let mut out = Vec::new();
    let r = s.handle_message(&opt(option, data), &mut out);
    if option == c::OPT_EXPORT_NAME {
        return (r, Vec::new());
    }
    (r, replies(&out))
}

fn types(r: &[Reply]) -> Vec<u32> {
    r.iter().map(|x| x.1).collect()
}

#[test]
fn greeting_is_spec_bytes() {
    let s = ServerHandshake::new(config());
    let mut expect = b"NBDMAGICIHAVEOPT".to_vec();
    expect.extend_from_slice(&[0, 3]);
    assert_eq!(s.greeting().to_vec(), expect);
    let s = ServerHandshake::new(ServerConfig {
        offer_no_zeroes: false,
        ..config()
    });
    assert_eq!(s.greeting()[16..], [0, 1]);
    assert_eq!(s.handshake_flags(), HandshakeFlags::FIXED_NEWSTYLE);
}

#[test]
fn export_name_reply_bytes() {
    // size 2^30, flags HAS_FLAGS|SEND_FLUSH|SEND_FUA|SEND_TRIM|CAN_MULTI_CONN = 0x012d
    // (SEND_DF dropped: no structured replies)
    let head = [0, 0, 0, 0, 0x40, 0, 0, 0, 0x01, 0x2d];
    for (flags, len) in [(3u32, 10usize), (1, 134)] {
        let mut s = started(config(), flags);
        let mut out = Vec::new();
        let r = s.handle_message(&opt(c::OPT_EXPORT_NAME, b"disk"), &mut out);
        assert!(matches!(r, Ok(ServerEvent::Done(_))));
        assert_eq!(out.len(), len);
        assert_eq!(out[..10], head);
        assert!(out[10..].iter().all(|&b| b == 0));
    }
}

#[test]
fn starttls_and_unknown_options_are_refused_and_negotiation_continues() {
    let mut s = started(config(), 3);
    let (r, rep) = ask(&mut s, c::OPT_STARTTLS, &[]);
    assert_eq!(r, Ok(ServerEvent::Continue));
    assert_eq!(types(&rep), vec![c::REP_ERR_UNSUP]);
    assert_eq!(rep[0].0, c::OPT_STARTTLS);
    for o in [c::OPT_PEEK_EXPORT, 99, 0xffff_ffff] {
        let (r, rep) = ask(&mut s, o, b"junk");
        assert_eq!(r, Ok(ServerEvent::Continue));
        assert_eq!(
            rep,
            vec![(o, c::REP_ERR_UNSUP, b"unsupported option".to_vec())]
        );
    }
    let go = InfoRequest {
        name: "disk",
        items: vec![],
    }
    .encode()
    .unwrap();
    let (r, rep) = ask(&mut s, c::OPT_GO, &go);
    assert!(matches!(r, Ok(ServerEvent::Done(_))));
    // unrequested BLOCK_SIZE (non-default constraints), EXPORT, ACK
    assert_eq!(types(&rep), vec![c::REP_INFO, c::REP_INFO, c::REP_ACK]);
    assert_eq!(
        InfoReply::parse(&rep[1].2),
        Ok(InfoReply::Export {
            size: 1 << 30,
            flags: TF(0x012d)
        })
    );
}

#[test]
fn abort_is_acked_then_finished() {
    let mut s = started(config(), 1);
    let (r, rep) = ask(&mut s, c::OPT_ABORT, b"ignored");
    assert_eq!(r, Ok(ServerEvent::Abort));
    assert_eq!(rep, vec![(c::OPT_ABORT, c::REP_ACK, vec![])]);
    assert_eq!(
        s.handle_message(&opt(c::OPT_LIST, &[]), &mut Vec::new()),
        Err(ServerError::Finished)
    );
}

#[test]
fn list_bytes_and_invalid_list() {
    let mut s = started(config(), 1);
    let (_, rep) = ask(&mut s, c::OPT_LIST, &[]);
    assert_eq!(types(&rep), vec![c::REP_SERVER, c::REP_SERVER, c::REP_ACK]);
    let mut first = vec![0, 0, 0, 4];
    first.extend_from_slice(b"diska test disk");
    assert_eq!(rep[0].2, first);
    let (r, rep) = ask(&mut s, c::OPT_LIST, &[0]);
    assert_eq!(r, Ok(ServerEvent::Continue));
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
}

#[test]
fn bad_client_flags_disconnect() {
    let mut s = ServerHandshake::new(config());
    assert_eq!(
        s.handle_message(&[0, 0, 0, 4], &mut Vec::new()),
        Err(ServerError::UnknownClientFlags(4))
    );
    let mut s = ServerHandshake::new(ServerConfig {
        offer_no_zeroes: false,
        ..config()
    });
    assert_eq!(
        s.handle_message(&[0, 0, 0, 3], &mut Vec::new()),
        Err(ServerError::NoZeroesNotOffered)
    );
    let mut s = ServerHandshake::new(config());
    assert!(matches!(
        s.handle_message(&[0, 0, 3], &mut Vec::new()),
        Err(ServerError::Proto(_))
    ));
}

#[test]
fn non_fixed_newstyle_clients() {
    let mut s = started(config(), 0);
    let mut out = Vec::new();
    assert!(matches!(
        s.handle_message(&opt(c::OPT_EXPORT_NAME, b"other"), &mut out),
        Ok(ServerEvent::Done(_))
    ));
    assert_eq!(out.len(), 134);
    let mut s = started(config(), 0);
    assert_eq!(
        ask(&mut s, c::OPT_LIST, &[]).0,
        Err(ServerError::NonFixedOption(c::OPT_LIST))
    );
    let mut s = ServerHandshake::new(ServerConfig {
        allow_non_fixed_newstyle: false,
        ..config()
    });
    assert_eq!(
        s.handle_message(&[0, 0, 0, 0], &mut Vec::new()),
        Err(ServerError::NotFixedNewstyle)
    );
}

#[test]
fn client_against_non_fixed_server() {
    let mut client = ClientHandshake::connect(ClientConfig::new("x"));
    let mut out = Vec::new();
    let greeting = Greeting {
        flags: HandshakeFlags::empty(),
    }
    .encode();
    assert_eq!(
        client.handle_message(&greeting, &mut out),
        Ok(ClientEvent::Continue)
    );
    let mut expect = vec![0, 0, 0, 0];
    expect.extend_from_slice(&opt(c::OPT_EXPORT_NAME, b"x"));
    assert_eq!(out, expect);
    assert_eq!(client.phase(), crate::framing::ClientPhase::ExportNameReply);
    let mut reply = Vec::new();
    ExportNameReply {
        size: 7,
        flags: TF::HAS_FLAGS,
    }
    .encode(false, &mut reply);
    match client.handle_message(&reply, &mut out) {
        Ok(ClientEvent::Connected(n)) => assert_eq!(n.export.size, 7),
        other => panic!("{other:?}"),
    }
    let mut lister = ClientHandshake::list();
    assert_eq!(
        lister.handle_message(&greeting, &mut Vec::new()),
        Err(ClientError::NoFixedNewstyle)
    );
}

#[test]
fn option_length_limits() {
    let mut s = started(config(), 1);
    let mut msg = opt(c::OPT_LIST, &[]);
    msg[12..16].copy_from_slice(&(64 * 1024 + 1u32).to_be_bytes());
    assert!(matches!(
        s.handle_message(&msg, &mut Vec::new()),
        Err(ServerError::OptionTooLong { .. })
    ));
    // header length disagreeing with the framed message
    let mut s = started(config(), 1);
    let mut msg = opt(c::OPT_LIST, &[]);
    msg.push(0);
    assert!(matches!(
        s.handle_message(&msg, &mut Vec::new()),
        Err(ServerError::Proto(ProtoError::LengthMismatch { .. }))
    ));
    // stream interface rejects oversized lengths before buffering the data
    let mut s = started(config(), 1);
    let mut msg = opt(c::OPT_LIST, &[]);
    msg[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        s.feed(&msg, &mut Vec::new()),
        Err(ServerError::OptionTooLong { .. })
    ));
    let mut s = started(config(), 1);
    assert!(s.feed(&[0; 16], &mut Vec::new()).is_err());
}

#[test]
fn malformed_options_get_invalid_and_continue() {
    let mut s = started(config(), 1);
    let cases: &[(u32, &[u8])] = &[
        (c::OPT_GO, &[0, 0, 0]),
        (c::OPT_GO, &[0, 0, 0, 9, b'd', 0, 0]),
        (c::OPT_INFO, &[0, 0, 0, 0, 0, 1]),
        (c::OPT_STRUCTURED_REPLY, &[1]),
        (c::OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 1]),
        (c::OPT_GO, &[0, 0, 0, 1, 0xff, 0, 0]),
    ];
    for (o, d) in cases {
        let (r, rep) = ask(&mut s, *o, d);
        assert_eq!(r, Ok(ServerEvent::Continue));
        assert_eq!(types(&rep), vec![c::REP_ERR_INVALID], "{o} {d:?}");
    }
    // still usable
    let (r, _) = ask(&mut s, c::OPT_EXPORT_NAME, b"disk");
    assert!(matches!(r, Ok(ServerEvent::Done(_))));
}

#[test]
fn info_items_are_answered() {
    let mut s = started(config(), 1);
    let req = InfoRequest {
        name: "disk",
        items: vec![
            c::INFO_NAME,
            c::INFO_NAME,
            77,
            c::INFO_DESCRIPTION,
            c::INFO_BLOCK_SIZE,
        ],
    }
    .encode()
    .unwrap();
    let (r, rep) = ask(&mut s, c::OPT_INFO, &req);
    assert_eq!(r, Ok(ServerEvent::Continue));
    let infos: Vec<_> = rep[..rep.len() - 1]
        .iter()
        .map(|x| InfoReply::parse(&x.2).unwrap())
        .collect();
    assert_eq!(
        infos,
        vec![
            InfoReply::Name("disk"),
            InfoReply::Description("a test disk"),
            InfoReply::BlockSize(disk().block_size.unwrap()),
            InfoReply::Export {
                size: 1 << 30,
                flags: TF(0x012d)
            },
        ]
    );
    assert_eq!(rep.last().unwrap().1, c::REP_ACK);
}

#[test]
fn block_size_required() {
    let mut e = disk();
    e.require_block_size = true;
    let cfg = ServerConfig::new(vec![e]);
    let mut s = started(cfg.clone(), 1);
    let go = InfoRequest {
        name: "disk",
        items: vec![c::INFO_NAME],
    }
    .encode()
    .unwrap();
    let (r, rep) = ask(&mut s, c::OPT_GO, &go);
    assert_eq!(r, Ok(ServerEvent::Continue));
    assert_eq!(types(&rep), vec![c::REP_INFO, c::REP_ERR_BLOCK_SIZE_REQD]);
    // INFO is not refused
    let (_, rep) = ask(&mut s, c::OPT_INFO, &go);
    assert_eq!(rep.last().unwrap().1, c::REP_ACK);
    let (r, _) = ask(&mut s, c::OPT_EXPORT_NAME, b"disk");
    assert_eq!(r, Err(ServerError::BlockSizeRequired("disk".into())));
    // our client asks for block sizes and gets through
    let o = run(cfg, ClientHandshake::connect(ClientConfig::new("disk")));
    assert!(server_done(&o).block_size_acknowledged);
}

fn meta(export: &str, queries: &[&str]) -> Vec<u8> {
    MetaContextRequest {
        export,
        queries: queries.to_vec(),
    }
    .encode()
    .unwrap()
}

#[test]
fn meta_context_rules() {
    let mut s = started(config(), 1);
    // SET before structured replies → invalid
    let (_, rep) = ask(
        &mut s,
        c::OPT_SET_META_CONTEXT,
        &meta("disk", &[c::BASE_ALLOCATION]),
    );
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
    // LIST is allowed without structured replies; wildcard and empty query list
    for q in [
        &["base:"][..],
        &[],
        &[c::BASE_ALLOCATION, "x-foo:bar", "base:nope"],
    ] {
        let (_, rep) = ask(&mut s, c::OPT_LIST_META_CONTEXT, &meta("disk", q));
        assert_eq!(types(&rep), vec![c::REP_META_CONTEXT, c::REP_ACK], "{q:?}");
        assert_eq!(
            MetaContextEntry::parse(&rep[0].2),
            Ok(MetaContextEntry {
                id: 0,
                name: c::BASE_ALLOCATION
            })
        );
    }
    // unknown namespace only → just ACK
    let (_, rep) = ask(
        &mut s,
        c::OPT_LIST_META_CONTEXT,
        &meta("disk", &["qemu:dirty"]),
    );
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    // missing colon → ignored, as qemu-nbd does; unknown export → unknown
    let (_, rep) = ask(
        &mut s,
        c::OPT_LIST_META_CONTEXT,
        &meta("disk", &["nocolon", "", c::BASE_ALLOCATION]),
    );
    assert_eq!(types(&rep), vec![c::REP_META_CONTEXT, c::REP_ACK]);
    let (_, rep) = ask(&mut s, c::OPT_LIST_META_CONTEXT, &meta("zzz", &[]));
    assert_eq!(types(&rep), vec![c::REP_ERR_UNKNOWN]);

    let (_, rep) = ask(&mut s, c::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    // SET: "base:" is ignored; zero queries select nothing
    let (_, rep) = ask(&mut s, c::OPT_SET_META_CONTEXT, &meta("disk", &["base:"]));
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    let (_, rep) = ask(&mut s, c::OPT_SET_META_CONTEXT, &meta("disk", &[]));
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    let (_, rep) = ask(
        &mut s,
        c::OPT_SET_META_CONTEXT,
        &meta("disk", &[c::BASE_ALLOCATION, c::BASE_ALLOCATION]),
    );
    assert_eq!(types(&rep), vec![c::REP_META_CONTEXT, c::REP_ACK]);
    assert_eq!(
        MetaContextEntry::parse(&rep[0].2).unwrap().id,
        BASE_ALLOCATION_ID
    );
    // contexts selected for "disk" do not apply to "other"
    let mut s2 = s.clone();
    let (r, _) = ask(&mut s2, c::OPT_EXPORT_NAME, b"other");
    match r {
        Ok(ServerEvent::Done(n)) => {
            assert!(n.meta_contexts.is_empty());
            assert!(!n.transmission_info().has_meta_context);
        }
        other => panic!("{other:?}"),
    }
    let (r, _) = ask(&mut s, c::OPT_EXPORT_NAME, b"disk");
    match r {
        Ok(ServerEvent::Done(n)) => assert!(n.transmission_info().has_meta_context),
        other => panic!("{other:?}"),
    }
}

/// The names (and ids) of the `NBD_REP_META_CONTEXT` replies in `rep`, which must end in an ACK.
fn context_names(rep: &[Reply]) -> Vec<(u32, String)> {
    assert_eq!(rep.last().map(|r| r.1), Some(c::REP_ACK), "{rep:?}");
    rep[..rep.len() - 1]
        .iter()
        .map(|r| {
            assert_eq!(r.1, c::REP_META_CONTEXT);
            let e = MetaContextEntry::parse(&r.2).unwrap();
            (e.id, e.name.to_owned())
        })
        .collect()
}

#[test]
fn qemu_contexts_are_listed_and_selected_as_qemu_nbd_does() {
    let mut cfg = config();
    cfg.exports[0].contexts = vec![c::QEMU_ALLOCATION_DEPTH.to_owned()];
    let mut s = started(cfg, 1);
    let list = |s: &mut ServerHandshake, export: &str, q: &[&str]| {
        context_names(&ask(s, c::OPT_LIST_META_CONTEXT, &meta(export, q)).1)
    };
    let both = vec![
        (0, c::BASE_ALLOCATION.to_owned()),
        (0, c::QEMU_ALLOCATION_DEPTH.to_owned()),
    ];
    let depth = vec![(0, c::QEMU_ALLOCATION_DEPTH.to_owned())];
    // No query lists everything; a bare namespace lists that namespace; each context once,
    // in the export's order, whatever the order of the queries.
    assert_eq!(list(&mut s, "disk", &[]), both);
    assert_eq!(list(&mut s, "disk", &["qemu:"]), depth);
    assert_eq!(list(&mut s, "disk", &["qemu:allocation-depth"]), depth);
    assert_eq!(
        list(
            &mut s,
            "disk",
            &["qemu:", c::QEMU_ALLOCATION_DEPTH, "base:"]
        ),
        both
    );
    assert!(list(&mut s, "disk", &["qemu:dirty-bitmap:"]).is_empty());
    assert!(list(&mut s, "disk", &["qemu:allocation"]).is_empty());
    // An export without it offers base:allocation only.
    assert!(list(&mut s, "other", &["qemu:"]).is_empty());
    assert_eq!(
        list(&mut s, "other", &[]),
        vec![(0, c::BASE_ALLOCATION.to_owned())]
    );

    let _ = ask(&mut s, c::OPT_STRUCTURED_REPLY, &[]);
    let set = |s: &mut ServerHandshake, q: &[&str]| {
        context_names(&ask(s, c::OPT_SET_META_CONTEXT, &meta("disk", q)).1)
    };
    // SET takes exact names only.
    assert!(set(&mut s, &["qemu:"]).is_empty());
    assert_eq!(
        set(&mut s, &[c::QEMU_ALLOCATION_DEPTH]),
        vec![(BASE_ALLOCATION_ID + 1, c::QEMU_ALLOCATION_DEPTH.to_owned())]
    );
    let both_set = vec![
        (BASE_ALLOCATION_ID, c::BASE_ALLOCATION.to_owned()),
        (BASE_ALLOCATION_ID + 1, c::QEMU_ALLOCATION_DEPTH.to_owned()),
    ];
    assert_eq!(
        set(&mut s, &[c::QEMU_ALLOCATION_DEPTH, c::BASE_ALLOCATION]),
        both_set
    );
    let go = InfoRequest {
        name: "disk",
        items: vec![],
    }
    .encode()
    .unwrap();
    let (r, _) = ask(&mut s, c::OPT_GO, &go);
    let Ok(ServerEvent::Done(n)) = r else {
        panic!("{r:?}");
    };
    assert_eq!(n.meta_contexts, both_set);
    let t = crate::transmission::server::ServerTransmission::new(&n);
    assert_eq!(t.contexts(), both_set.as_slice());
    assert_eq!(t.base_allocation(), Some(BASE_ALLOCATION_ID));
    assert_eq!(
        t.context_id(c::QEMU_ALLOCATION_DEPTH),
        Some(BASE_ALLOCATION_ID + 1)
    );
}

#[test]
fn failed_set_meta_context_clears_selection() {
    let mut s = started(config(), 1);
    let _ = ask(&mut s, c::OPT_STRUCTURED_REPLY, &[]);
    let _ = ask(
        &mut s,
        c::OPT_SET_META_CONTEXT,
        &meta("disk", &[c::BASE_ALLOCATION]),
    );
    let (_, rep) = ask(&mut s, c::OPT_SET_META_CONTEXT, &[1, 2]);
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
    let (r, _) = ask(&mut s, c::OPT_EXPORT_NAME, b"disk");
    assert!(matches!(r, Ok(ServerEvent::Done(n)) if n.meta_contexts.is_empty()));
}

#[test]
fn shutdown() {
    let mut s = started(config(), 1);
    s.begin_shutdown();
    let (r, rep) = ask(&mut s, c::OPT_LIST, &[]);
    assert_eq!(r, Ok(ServerEvent::Continue));
    assert_eq!(types(&rep), vec![c::REP_ERR_SHUTDOWN]);
    let mut s2 = s.clone();
    assert_eq!(
        ask(&mut s2, c::OPT_EXPORT_NAME, b"disk").0,
        Err(ServerError::ShuttingDown)
    );
    assert_eq!(ask(&mut s, c::OPT_ABORT, &[]).0, Ok(ServerEvent::Abort));

    // client side: SHUTDOWN → soft disconnect
    let mut client = ClientHandshake::list();
    let mut out = Vec::new();
    let g = Greeting {
        flags: HandshakeFlags::FIXED_NEWSTYLE,
    }
    .encode();
    client.handle_message(&g, &mut out).unwrap();
    out.clear();
    let mut msg = Vec::new();
    encode_option_reply(c::OPT_LIST, c::REP_ERR_SHUTDOWN, &[], &mut msg);
    assert_eq!(
        client.handle_message(&msg, &mut out),
        Err(ClientError::ServerShutdown)
    );
    assert_eq!(out, opt(c::OPT_ABORT, &[]));
}

#[test]
fn too_many_options() {
    let mut s = started(
        ServerConfig {
            max_options: 3,
            ..config()
        },
        1,
    );
    for _ in 0..3 {
        assert_eq!(ask(&mut s, 99, &[]).0, Ok(ServerEvent::Continue));
    }
    assert_eq!(ask(&mut s, 99, &[]).0, Err(ServerError::TooManyOptions));
}

#[test]
fn client_rejects_bad_server_replies() {
    let g = Greeting {
        flags: HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES,
    }
    .encode();
    let start = || {
        let mut client = ClientHandshake::connect(ClientConfig {
            extended_headers: false,
            ..ClientConfig::new("disk")
        });
        let mut out = Vec::new();
        client.handle_message(&g, &mut out).unwrap();
        // flags with NO_ZEROES, then STRUCTURED_REPLY
        assert_eq!(
            out[..4],
            (ClientFlags::FIXED_NEWSTYLE | ClientFlags::NO_ZEROES)
                .bits()
                .to_be_bytes()
        );
        assert_eq!(out[4..], opt(c::OPT_STRUCTURED_REPLY, &[]));
        client
    };
    // reply to the wrong option
    let mut msg = Vec::new();
    encode_option_reply(c::OPT_LIST, c::REP_ACK, &[], &mut msg);
    assert!(matches!(
        start().handle_message(&msg, &mut Vec::new()),
        Err(ClientError::UnexpectedReply { .. })
    ));
    // non-error unexpected reply type
    msg.clear();
    encode_option_reply(c::OPT_STRUCTURED_REPLY, c::REP_SERVER, &[], &mut msg);
    assert!(matches!(
        start().handle_message(&msg, &mut Vec::new()),
        Err(ClientError::UnexpectedReply { .. })
    ));
    // GO acked without INFO_EXPORT, and invalid block sizes
    let to_go = |client: &mut ClientHandshake| {
        let mut out = Vec::new();
        let mut m = Vec::new();
        encode_option_reply(c::OPT_STRUCTURED_REPLY, c::REP_ERR_UNSUP, &[], &mut m);
        client.handle_message(&m, &mut out).unwrap();
        assert_eq!(out[8..12], c::OPT_GO.to_be_bytes());
    };
    let mut client = start();
    to_go(&mut client);
    msg.clear();
    encode_option_reply(c::OPT_GO, c::REP_ACK, &[], &mut msg);
    assert_eq!(
        client.handle_message(&msg, &mut Vec::new()),
        Err(ClientError::MissingExportInfo)
    );
    let mut client = start();
    to_go(&mut client);
    msg.clear();
    let bad = InfoReply::BlockSize(BlockSize {
        min: 3,
        preferred: 4096,
        max: 4096,
    });
    encode_option_reply(c::OPT_GO, c::REP_INFO, &bad.encode(), &mut msg);
    assert!(matches!(
        client.handle_message(&msg, &mut Vec::new()),
        Err(ClientError::InvalidBlockSize(_))
    ));
    assert_eq!(
        client.handle_message(&msg, &mut Vec::new()),
        Err(ClientError::Finished)
    );
}

// ---- extended headers ---------------------------------------------------------------

#[test]
fn go_with_extended_headers() {
    let o = run(
        config(),
        ClientHandshake::connect(ClientConfig::new("disk")),
    );
    let (s, cl) = (server_done(&o), client_done(&o));
    assert!(s.extended_headers && cl.extended_headers);
    // extended headers carry structured replies, with everything that needs them
    assert!(s.structured_replies && cl.structured_replies);
    assert!(cl.export.flags.contains(TF::SEND_DF));
    assert_eq!(cl.base_allocation, Some(BASE_ALLOCATION_ID));
    assert_eq!(
        s.transmission_phase(),
        crate::framing::ServerPhase::TransmissionExtended
    );
    assert_eq!(
        cl.transmission_phase(),
        crate::framing::ClientPhase::TransmissionExtended
    );
    assert!(s.transmission_info().extended_headers);
    assert!(cl.transmission_info().extended_headers);
}

#[test]
fn extended_headers_refused_falls_back_to_structured_replies() {
    for cfg in [
        ServerConfig {
            support_extended_headers: false,
            ..config()
        },
        // A server without GO must not offer extended headers (the client could not fall
        // back to EXPORT_NAME).
        ServerConfig {
            support_go: false,
            ..config()
        },
    ] {
        let go = cfg.support_go;
        let o = run(cfg, ClientHandshake::connect(ClientConfig::new("disk")));
        let (s, cl) = (server_done(&o), client_done(&o));
        assert!(!s.extended_headers && !cl.extended_headers);
        assert!(s.structured_replies && cl.structured_replies);
        assert_eq!(cl.via_go, go);
        assert_eq!(
            cl.transmission_phase(),
            crate::framing::ClientPhase::Transmission
        );
    }
}

#[test]
fn extended_headers_option_rules() {
    let mut s = started(config(), 3);
    let (r, rep) = ask(&mut s, c::OPT_EXTENDED_HEADERS, b"x");
    assert_eq!(r, Ok(ServerEvent::Continue));
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
    let (_, rep) = ask(&mut s, c::OPT_EXTENDED_HEADERS, &[]);
    assert_eq!(rep, vec![(c::OPT_EXTENDED_HEADERS, c::REP_ACK, vec![])]);
    // structured replies are superseded
    let (_, rep) = ask(&mut s, c::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(types(&rep), vec![c::REP_ERR_EXT_HEADER_REQD]);
    // meta contexts work: extended headers imply structured replies
    let (_, rep) = ask(
        &mut s,
        c::OPT_SET_META_CONTEXT,
        &meta("disk", &[c::BASE_ALLOCATION]),
    );
    assert_eq!(types(&rep), vec![c::REP_META_CONTEXT, c::REP_ACK]);
    assert_eq!(s.phase(), crate::framing::ServerPhase::Options);
    let mut ex = s.clone();
    // EXPORT_NAME is forbidden after extended headers: hard disconnect
    let (r, _) = ask(&mut ex, c::OPT_EXPORT_NAME, b"disk");
    assert_eq!(r, Err(ServerError::ExportNameWithExtendedHeaders));
    let go = InfoRequest {
        name: "disk",
        items: vec![],
    }
    .encode()
    .unwrap();
    let (r, _) = ask(&mut s, c::OPT_GO, &go);
    assert!(matches!(r, Ok(ServerEvent::Done(n)) if n.extended_headers));
    assert_eq!(s.phase(), crate::framing::ServerPhase::TransmissionExtended);
}

#[test]
fn client_with_extended_headers_never_falls_back_to_export_name() {
    let g = Greeting {
        flags: HandshakeFlags::FIXED_NEWSTYLE | HandshakeFlags::NO_ZEROES,
    }
    .encode();
    let mut client = ClientHandshake::connect(ClientConfig {
        base_allocation: false,
        ..ClientConfig::new("disk")
    });
    let mut out = Vec::new();
    client.handle_message(&g, &mut out).unwrap();
    assert_eq!(out[4..], opt(c::OPT_EXTENDED_HEADERS, &[]));
    let mut m = Vec::new();
    encode_option_reply(c::OPT_EXTENDED_HEADERS, c::REP_ACK, &[], &mut m);
    out.clear();
    client.handle_message(&m, &mut out).unwrap();
    assert_eq!(out[8..12], c::OPT_GO.to_be_bytes());
    m.clear();
    encode_option_reply(c::OPT_GO, c::REP_ERR_UNSUP, &[], &mut m);
    assert!(matches!(
        client.handle_message(&m, &mut Vec::new()),
        Err(ClientError::Rejected {
            option: c::OPT_GO,
            ..
        })
    ));
}

// ---- STARTTLS -----------------------------------------------------------------------

fn tls_config(mode: TlsMode) -> ServerConfig {
    ServerConfig {
        tls: mode,
        ..config()
    }
}

#[test]
fn require_tls_refuses_options_before_starttls() {
    let mut s = started(tls_config(TlsMode::Require), 3);
    for o in [c::OPT_LIST, c::OPT_GO, c::OPT_INFO, c::OPT_STRUCTURED_REPLY] {
        let (r, rep) = ask(&mut s, o, &[]);
        assert_eq!(r, Ok(ServerEvent::Continue));
        assert_eq!(types(&rep), vec![c::REP_ERR_TLS_REQD], "option {o}");
    }
    // the connection stays usable for ABORT
    let mut aborted = s.clone();
    let (r, rep) = ask(&mut aborted, c::OPT_ABORT, &[]);
    assert_eq!(r, Ok(ServerEvent::Abort));
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    // EXPORT_NAME cannot be answered with an error
    let mut en = s.clone();
    assert_eq!(
        ask(&mut en, c::OPT_EXPORT_NAME, b"disk").0,
        Err(ServerError::TlsRequired)
    );
    // STARTTLS with data is invalid; without, acknowledged, then the options work
    let (_, rep) = ask(&mut s, c::OPT_STARTTLS, b"x");
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
    let (r, rep) = ask(&mut s, c::OPT_STARTTLS, &[]);
    assert_eq!(r, Ok(ServerEvent::StartTls));
    assert_eq!(rep, vec![(c::OPT_STARTTLS, c::REP_ACK, vec![])]);
    let (_, rep) = ask(&mut s, c::OPT_STARTTLS, &[]);
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID], "a second STARTTLS");
    let (_, rep) = ask(&mut s, c::OPT_LIST, &[]);
    assert_eq!(*types(&rep).last().unwrap(), c::REP_ACK);
}

#[test]
fn starttls_forgets_what_was_negotiated_before() {
    let mut s = started(tls_config(TlsMode::On), 3);
    let (_, rep) = ask(&mut s, c::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(types(&rep), vec![c::REP_ACK]);
    let (r, _) = ask(&mut s, c::OPT_STARTTLS, &[]);
    assert_eq!(r, Ok(ServerEvent::StartTls));
    // structured replies must be negotiated again inside TLS
    let (_, rep) = ask(
        &mut s,
        c::OPT_SET_META_CONTEXT,
        &meta("disk", &[c::BASE_ALLOCATION]),
    );
    assert_eq!(types(&rep), vec![c::REP_ERR_INVALID]);
    let go = InfoRequest {
        name: "disk",
        items: vec![],
    }
    .encode()
    .unwrap();
    let (r, _) = ask(&mut s, c::OPT_GO, &go);
    assert!(matches!(r, Ok(ServerEvent::Done(n)) if n.tls && !n.structured_replies));
}

/// Drives client and server through STARTTLS (the "TLS handshake" is a no-op here).
fn run_tls(cfg: ServerConfig, mut client: ClientHandshake) -> Outcome {
    let mut server = ServerHandshake::new(cfg);
    let limits = FrameLimits::default();
    let mut s2c = server.greeting().to_vec();
    let mut c2s = Vec::new();
    let mut out = Outcome {
        server: None,
        client: None,
    };
    for _ in 0..100 {
        let mut progress = false;
        while out.client.is_none() {
            let need = client_need(client.phase(), &s2c, &limits, |_| None);
            let Some(msg) = pop(need, &mut s2c) else {
                break;
            };
            progress = true;
            match client.handle_message(&msg, &mut c2s) {
                Ok(ClientEvent::Continue) => {}
                Ok(ClientEvent::StartTls) => client.resume(&mut c2s).unwrap(),
                other => out.client = Some(other),
            }
        }
        while out.server.is_none() {
            let Some(msg) = pop(server_need(server.phase(), &c2s, &limits), &mut c2s) else {
                break;
            };
            progress = true;
            match server.handle_message(&msg, &mut s2c) {
                Ok(ServerEvent::Continue) | Ok(ServerEvent::StartTls) => {}
                other => out.server = Some(other),
            }
        }
        if !progress {
            break;
        }
    }
    out
}

#[test]
fn client_with_tls_upgrades_first_then_negotiates() {
    let tls = ClientConfig {
        tls: true,
        ..ClientConfig::new("disk")
    };
    for mode in [TlsMode::On, TlsMode::Require] {
        let o = run_tls(tls_config(mode), ClientHandshake::connect(tls.clone()));
        let (s, cl) = (server_done(&o), client_done(&o));
        assert!(s.tls && cl.tls);
        assert!(s.extended_headers && cl.extended_headers);
        assert_eq!(cl.base_allocation, Some(BASE_ALLOCATION_ID));
    }
    let o = run_tls(
        tls_config(TlsMode::Require),
        ClientHandshake::list_with(tls.clone()),
    );
    assert!(matches!(o.client, Some(Ok(ClientEvent::Listed(ref l))) if l.len() == 2));
}

#[test]
fn client_with_tls_never_falls_back_to_plaintext() {
    let tls = ClientConfig {
        tls: true,
        ..ClientConfig::new("disk")
    };
    let mut client = ClientHandshake::connect(tls);
    let g = Greeting {
        flags: HandshakeFlags::FIXED_NEWSTYLE,
    }
    .encode();
    let mut out = Vec::new();
    client.handle_message(&g, &mut out).unwrap();
    assert_eq!(out[4..], opt(c::OPT_STARTTLS, &[]));
    let mut m = Vec::new();
    encode_option_reply(
        c::OPT_STARTTLS,
        c::REP_ERR_UNSUP,
        b"TLS is not supported",
        &mut m,
    );
    out.clear();
    let e = client.handle_message(&m, &mut out).unwrap_err();
    assert!(matches!(
        e,
        ClientError::TlsRefused {
            reply: c::REP_ERR_UNSUP,
            ..
        }
    ));
    assert!(e.to_string().contains("TLS is not supported"), "{e}");
    // only ABORT follows
    assert_eq!(out, opt(c::OPT_ABORT, &[]));
    // a server without fixed newstyle cannot do STARTTLS at all
    let mut old = ClientHandshake::connect(ClientConfig {
        tls: true,
        ..ClientConfig::new("disk")
    });
    let g = Greeting {
        flags: HandshakeFlags::empty(),
    }
    .encode();
    assert_eq!(
        old.handle_message(&g, &mut Vec::new()),
        Err(ClientError::NoFixedNewstyle)
    );
}
