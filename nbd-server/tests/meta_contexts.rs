//! Metadata contexts as qemu-nbd offers them (issue 35): `qemu:allocation-depth` (`-A`) and
//! the contexts listed, compared with qemu-nbd on the same images through nbdinfo, text for
//! text: raw images fresh and with holes, a qcow2 image alone, and a chain of three (a qcow2
//! overlay over a qcow2 over a shorter raw base) with data and zeroes written at each level.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use qpip_test_support::servers::qpip_server;

/// The images of the comparison, made in `d`: (file, format).
fn images(d: &Path) -> Vec<(&'static str, &'static str)> {
    const MIB: u64 = 1 << 20;
    image(d, "fresh.raw", 4 * MIB);
    qpip_test_support::pattern::image_with(d, "holes.raw", 4 * MIB, &[(192 << 10, 128 << 10)]);
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "alone.qcow2", "4M"]);
    qemu_io_in(
        d,
        "qcow2",
        "alone.qcow2",
        &["write -P 1 1M 64k", "write -z 2M 64k"],
    );
    // base.raw (3 MiB, shorter than the disk) <- mid.qcow2 <- top.qcow2
    qpip_test_support::pattern::image_with(d, "base.raw", 3 * MIB, &[(64 << 10, 64 << 10)]);
    qemu_img_in(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "mid.qcow2",
            "4M",
        ],
    );
    qemu_io_in(
        d,
        "qcow2",
        "mid.qcow2",
        &["write -P 2 512k 64k", "write -z 3M 64k"],
    );
    qemu_img_in(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "mid.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "4M",
        ],
    );
    qemu_io_in(
        d,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 3 1M 64k",
            "write -z 1536k 64k",
            "write -P 4 60k 8k",
        ],
    );
    vec![
        ("fresh.raw", "raw"),
        ("holes.raw", "raw"),
        ("alone.qcow2", "qcow2"),
        ("top.qcow2", "qcow2"),
    ]
}

/// `nbdinfo --list --content` without the lines where qpip-nbd-server deliberately differs
/// from qemu-nbd (multi-conn, which qemu-nbd offers only with --shared; the minimum block
/// size, which qemu-nbd raises to 512 for a raw file).
fn listing(peer: &Peer) -> String {
    nbdinfo(&["--list", "--content"], peer)
        .lines()
        .filter(|l| !l.contains("can_multi_conn") && !l.contains("block_size_minimum"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn qemu_nbd(d: &Path, file: &str, format: &str, extra: &[&str]) -> Option<Peer> {
    qemu_nbd_x(d, file, format, &[&["-r"], extra].concat())
}

#[test]
fn allocation_depth_and_listed_contexts_are_qemu_nbds() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut differ = Vec::new();
    for (file, format) in images(d) {
        for with_a in [true, false] {
            let a: &[&str] = if with_a { &["-A"] } else { &[] };
            let Some(theirs) = qemu_nbd(d, file, format, a) else {
                return;
            };
            let ours = qpip_server("x", &d.join(file), &[&["-r", "-f", format], a].concat());
            let mut maps = vec![vec!["--map"], vec!["--map", "--totals"]];
            if with_a {
                maps.push(vec!["--map=qemu:allocation-depth"]);
                maps.push(vec!["--map=qemu:allocation-depth", "--totals"]);
            }
            for m in maps {
                let (q, o) = (nbdinfo(&m, &theirs), nbdinfo(&m, &ours));
                if q != o {
                    differ.push(format!(
                        "{file} nbdinfo {m:?}:\nqemu-nbd:\n{q}\nqpip-nbd-server:\n{o}"
                    ));
                }
            }
            let (q, o) = (listing(&theirs), listing(&ours));
            if q != o {
                differ.push(format!(
                    "{file} {a:?} nbdinfo --list --content:\nqemu-nbd:\n{q}\nqpip-nbd-server:\n{o}"
                ));
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n\n"));
}

#[test]
fn allocation_depth_per_export_in_the_config_file() {
    if !require(&["qemu-img", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, "a.raw", 1 << 20);
    image(d, "b.raw", 1 << 20);
    let cfg = d.join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\npath = \"{}\"\nallocation_depth = true\n\n\
             [[export]]\nname = \"b\"\npath = \"{}\"\n",
            d.join("a.raw").display(),
            d.join("b.raw").display()
        ),
    )
    .unwrap();
    let srv = start_server_v4(&args(&["--config", cfg.to_str().unwrap()]));
    let contexts = |export: &str| {
        let out = peer_ok(Command::new("nbdinfo").arg(srv.uri(export)));
        out.lines()
            .skip_while(|l| !l.contains("contexts:"))
            .skip(1)
            .take_while(|l| l.starts_with("\t\t"))
            .map(|l| l.trim().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(contexts("a"), ["base:allocation", "qemu:allocation-depth"]);
    assert_eq!(contexts("b"), ["base:allocation"]);
    let map = peer_ok(
        Command::new("nbdinfo")
            .arg("--map=qemu:allocation-depth")
            .arg(srv.uri("a")),
    );
    assert_eq!(map.trim(), "0     1048576    1  local");
}

/// A raw connection to `port`, through the greeting and the fixed-newstyle client flags.
fn newstyle_client(port: u16) -> std::net::TcpStream {
    use nbd_proto::consts as c;
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut greeting = [0u8; c::GREETING_LEN];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&(c::FLAG_C_FIXED_NEWSTYLE | c::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

/// The next option reply on `s`: (reply type, data).
fn reply(s: &mut std::net::TcpStream) -> (u32, Vec<u8>) {
    use nbd_proto::consts as c;
    use nbd_proto::handshake::messages::OptionReplyHeader;
    use std::io::Read;
    let mut h = [0u8; c::OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = OptionReplyHeader::parse(&h).unwrap();
    let mut data = vec![0u8; h.length as usize];
    s.read_exact(&mut data).unwrap();
    (h.reply_type, data)
}

/// Option `option` with option data `data` over a raw connection to `port`, after
/// NBD_OPT_STRUCTURED_REPLY when `structured`: the replies up to the final ACK or error, as
/// (reply type, data), less the text of errors (the server's own; context ids are compared:
/// we number them as qemu-nbd does).
fn meta_replies(port: u16, option: u32, structured: bool, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
    use nbd_proto::consts as c;
    use nbd_proto::handshake::messages::encode_option;
    use std::io::Write;
    let mut s = newstyle_client(port);
    let mut out = Vec::new();
    if structured {
        encode_option(c::OPT_STRUCTURED_REPLY, &[], &mut out);
        s.write_all(&out).unwrap();
        assert_eq!(reply(&mut s).0, c::REP_ACK);
        out.clear();
    }
    encode_option(option, data, &mut out);
    encode_option(c::OPT_ABORT, &[], &mut out);
    s.write_all(&out).unwrap();
    let mut replies = Vec::new();
    loop {
        match reply(&mut s) {
            (c::REP_META_CONTEXT, data) => replies.push((c::REP_META_CONTEXT, data)),
            (t, data) => {
                let error = t & (1 << 31) != 0;
                replies.push((t, if error { Vec::new() } else { data }));
                return replies;
            }
        }
    }
}

/// NBD_OPT_{LIST,SET}_META_CONTEXT data for export "x" with `queries` as raw bytes.
fn meta_request(queries: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&1u32.to_be_bytes());
    out.push(b'x');
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        out.extend_from_slice(&(q.len() as u32).to_be_bytes());
        out.extend_from_slice(q);
    }
    out
}

#[test]
fn meta_context_queries_are_answered_as_qemu_nbd_answers_them() {
    use nbd_proto::consts as c;
    if !require(&["qemu-nbd", "qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "a.qcow2", "1M"]);
    qemu_img_in(d, &["bitmap", "--add", "a.qcow2", "b0"]);
    qemu_img_in(d, &["bitmap", "--add", "a.qcow2", "b1"]);
    let long = [&b"base:"[..], &[b'a'; 4092]].concat();
    let queries: &[&[&[u8]]] = &[
        &[],
        &[b"qemu:"],
        &[b"base:"],
        &[b"qemu:allocation-depth"],
        &[b"qemu:allocation"],
        &[b"qemu:dirty-bitmap:"],
        &[b"qemu:dirty-bitmap:b1"],
        &[b"qemu:dirty-bitmap:b1", b"qemu:dirty-bitmap:b0"],
        &[b"qemu:dirty-bitmap:nope", b"qemu:dirty-bitmap"],
        &[b"qemu:allocation-depth", b"base:allocation", b"qemu:"],
        &[b"base:allocation", b"base:allocation"],
        &[b"x-other:", b"base:allocation"],
        &[
            b"x-other:base:allocation",
            b"nbd-server:",
            b":",
            b":allocation",
        ],
        // no namespace: ignored, as queries of an unknown namespace are
        &[b"allocation"],
        &[b""],
        &[b"base", b"qemu"],
        &[b"allocation", b"base:allocation"],
        &[
            b"base:allocation:",
            b"BASE:allocation",
            b"base:Allocation",
            b" base:allocation",
        ],
        &[b"qemu:dirty-bitmap:b0:", b"qemu:allocation-depth "],
        // a query longer than a string may be is skipped (still a query: a LIST of it alone
        // lists nothing)
        &[&long, b"base:allocation"],
        &[&long],
        &[b"qemu:\xff\xfe"],
        &[&long[..4096], b"base:allocation"],
        &[b"qemu:\xff\xfe", b"base:allocation"],
        // a NUL: invalid, unless the query is too long to be read
        &[b"base:allocation\0junk"],
        &[b"base:allocation", b"qemu:allocation-depth\0"],
        &[&[&long[..], b"\0"].concat(), b"base:allocation"],
    ];
    let mut cases: Vec<Vec<u8>> = queries.iter().map(|q| meta_request(q)).collect();
    let valid = meta_request(&[b"base:allocation"]);
    // malformed: a query longer than the data, a count beyond the data, no count, no export
    // name, an unknown export (trailing bytes: below)
    cases.push(valid[..valid.len() - 1].to_vec());
    cases.push([&meta_request(&[])[..5], &1000u32.to_be_bytes()].concat());
    cases.push(valid[..5].to_vec());
    cases.push(Vec::new());
    cases.push([&2u32.to_be_bytes()[..], b"yy", &0u32.to_be_bytes()].concat());
    let mut differ = Vec::new();
    for a in [&["-A", "-B", "b0", "-B", "b1"][..], &["-B", "b1"], &[]] {
        let Some(theirs) = qemu_nbd(d, "a.qcow2", "qcow2", a) else {
            return;
        };
        let ours = qpip_server("x", &d.join("a.qcow2"), &[&["-r"], a].concat());
        for (option, structured) in [
            (c::OPT_LIST_META_CONTEXT, false),
            (c::OPT_LIST_META_CONTEXT, true),
            (c::OPT_SET_META_CONTEXT, true),
        ] {
            for data in &cases {
                let q = meta_replies(theirs.port, option, structured, data);
                let o = meta_replies(ours.port, option, structured, data);
                if q != o {
                    differ.push(format!(
                        "{a:?} option {option} {:?}: qemu-nbd {q:?}, qpip-nbd-server {o:?}",
                        String::from_utf8_lossy(&data[..data.len().min(64)])
                    ));
                }
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // Trailing bytes after the queries: qemu-nbd ignores them; the spec's "syntactically
    // invalid" gets NBD_REP_ERR_INVALID here, deliberately (README).
    let ours = qpip_server("x", &d.join("a.qcow2"), &["-r"]);
    let trailing = [&valid[..], b"z"].concat();
    let o = meta_replies(ours.port, c::OPT_LIST_META_CONTEXT, true, &trailing);
    assert_eq!(o, [(c::REP_ERR_INVALID, Vec::new())]);
}

/// What `qpip-nbd info OPTS` prints on `peer` where nbdinfo prints something else (or it
/// fails), with both outputs.
fn unlike_nbdinfo(opts: &[&str], peer: &Peer) -> Option<String> {
    let theirs = nbdinfo(opts, peer);
    let out = Command::new(qpip_test_support::bins::workspace_bin(
        "nbd-client",
        "qpip-nbd",
    ))
    .arg("info")
    .args(opts)
    .arg(&peer.uri)
    .output()
    .unwrap();
    let ours = String::from_utf8_lossy(&out.stdout).replace(&format!(":{}/", peer.port), ":PORT/");
    (theirs != ours || !out.status.success()).then(|| {
        format!(
            "{opts:?}:\nnbdinfo:\n{theirs}\nqpip-nbd info:\n{ours}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// `qpip-nbd info` prints what nbdinfo prints, text and JSON (its key order, its tabs, its
/// escapes), one export or the list, on qemu-nbd with contexts and on our server with two
/// exports, one empty, one with a description that needs escaping.
#[test]
fn info_prints_what_nbdinfo_prints() {
    if !require(&["qemu-nbd", "qemu-img", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "bm.qcow2", "4M"]);
    qemu_img_in(d, &["bitmap", "--add", "bm.qcow2", "b0"]);
    image(d, "a.raw", 1 << 20);
    image(d, "b.raw", 0);
    let Some(theirs) = qemu_nbd(d, "bm.qcow2", "qcow2", &["-A", "-B", "b0"]) else {
        return;
    };
    let b = format!("b={}", d.join("b.raw").display());
    let ours = qpip_server(
        "a",
        &d.join("a.raw"),
        &[
            "--export",
            &b,
            "--description",
            // (no control character: our text escapes those, deliberately)
            "a=the \"main\" disk\\of two",
        ],
    );
    let mut differ = Vec::new();
    for peer in [&theirs, &ours] {
        for opts in [
            &[][..],
            &["--list"],
            &["--json"],
            &["--json", "--no-content"],
            &["--json", "--list"],
            &["--json", "--list", "--content"],
        ] {
            differ.extend(unlike_nbdinfo(opts, peer));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n\n"));
}

/// `qpip-nbd info --map` prints what nbdinfo prints, byte for byte, JSON included, for every
/// context and with `--totals`: the images of the comparison, an empty one, one whose shares
/// are not round (printf's %g), and a qcow2 image with a dirty bitmap, served by qemu-nbd.
#[test]
fn info_map_prints_what_nbdinfo_prints() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut files = images(d);
    image(d, "empty.raw", 0);
    qpip_test_support::pattern::image_with(d, "third.raw", 3 << 20, &[(0, 1 << 20)]);
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "bm.qcow2", "4M"]);
    qemu_img_in(d, &["bitmap", "--add", "bm.qcow2", "b0"]);
    qemu_io_in(
        d,
        "qcow2",
        "bm.qcow2",
        &["write -P 1 1M 64k", "write -z 2M 64k"],
    );
    files.extend([
        ("empty.raw", "raw"),
        ("third.raw", "raw"),
        ("bm.qcow2", "qcow2"),
    ]);
    let mut differ = Vec::new();
    for (file, format) in files {
        let bitmap = file == "bm.qcow2";
        let extra: &[&str] = if bitmap { &["-A", "-B", "b0"] } else { &["-A"] };
        let Some(peer) = qemu_nbd(d, file, format, extra) else {
            return;
        };
        let mut maps = vec!["--map", "--map=qemu:allocation-depth"];
        if bitmap {
            maps.push("--map=qemu:dirty-bitmap:b0");
        }
        for m in maps {
            for extra in [&[][..], &["--totals"], &["--json"], &["--totals", "--json"]] {
                let opts = [&[m][..], extra].concat();
                differ.extend(unlike_nbdinfo(&opts, &peer).map(|d| format!("{file} {d}")));
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n\n"));
}

/// A raw connection to `port` with extended headers, `queries` selected for export "x",
/// NBD_OPT_INFO and NBD_OPT_GO done: the stream, the transmission flags (of INFO, of GO),
/// the contexts selected (id, name).
fn extended_session(
    port: u16,
    queries: &[&str],
) -> (std::net::TcpStream, [u16; 2], Vec<(u32, String)>) {
    use nbd_proto::consts as c;
    use nbd_proto::handshake::messages::{MetaContextEntry, MetaContextRequest, encode_option};
    use std::io::Write;
    let mut s = newstyle_client(port);
    let mut out = Vec::new();
    encode_option(c::OPT_EXTENDED_HEADERS, &[], &mut out);
    let req = MetaContextRequest {
        export: "x",
        queries: queries.to_vec(),
    };
    encode_option(c::OPT_SET_META_CONTEXT, &req.encode().unwrap(), &mut out);
    encode_option(c::OPT_INFO, &[0, 0, 0, 1, b'x', 0, 0], &mut out);
    encode_option(c::OPT_GO, &[0, 0, 0, 1, b'x', 0, 0], &mut out);
    s.write_all(&out).unwrap();
    assert_eq!(reply(&mut s).0, c::REP_ACK, "extended headers");
    let mut contexts = Vec::new();
    loop {
        match reply(&mut s) {
            (c::REP_META_CONTEXT, d) => {
                let e = MetaContextEntry::parse(&d).unwrap();
                contexts.push((e.id, e.name.to_owned()));
            }
            (t, _) => {
                assert_eq!(t, c::REP_ACK, "SET_META_CONTEXT");
                break;
            }
        }
    }
    let mut flags = [0; 2];
    for f in &mut flags {
        loop {
            match reply(&mut s) {
                (c::REP_INFO, d) if d.len() == 12 && d[..2] == [0, 0] => {
                    *f = u16::from_be_bytes([d[10], d[11]]);
                }
                (c::REP_INFO, _) => {}
                (t, _) => {
                    assert_eq!(t, c::REP_ACK, "INFO, GO");
                    break;
                }
            }
        }
    }
    (s, flags, contexts)
}

/// Sends NBD_CMD_BLOCK_STATUS (`flags`, `offset`, `length`, then `payload`) on `s` and reads
/// its reply: one line per chunk, a context named rather than numbered, an error by its
/// value (the message is the server's own).
fn block_status(
    s: &mut std::net::TcpStream,
    contexts: &[(u32, String)],
    flags: u16,
    offset: u64,
    length: u64,
    payload: &[u8],
) -> Vec<String> {
    use nbd_proto::consts as c;
    use nbd_proto::reply::StructuredReplyHeader;
    use nbd_proto::transmission::{Command, Request};
    use std::io::{Read, Write};
    let req = Request {
        flags: nbd_proto::flags::CmdFlags(flags),
        command: Command::BlockStatus,
        cookie: 7,
        offset,
        length,
    };
    s.write_all(&req.encode(true).unwrap()).unwrap();
    s.write_all(payload).unwrap();
    let mut chunks = Vec::new();
    loop {
        let mut h = [0u8; c::EXTENDED_REPLY_HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let h = StructuredReplyHeader::parse_as(&h, true).unwrap();
        let mut p = vec![0u8; h.length as usize];
        s.read_exact(&mut p).unwrap();
        let be32 = |at: usize| u32::from_be_bytes(p[at..at + 4].try_into().unwrap());
        let be64 = |at: usize| u64::from_be_bytes(p[at..at + 8].try_into().unwrap());
        chunks.push(match h.reply_type {
            c::REPLY_TYPE_BLOCK_STATUS_EXT => {
                let id = be32(0);
                let name = contexts
                    .iter()
                    .find(|(i, _)| *i == id)
                    .map(|(_, n)| n.as_str());
                let extents: Vec<_> = (8..p.len())
                    .step_by(16)
                    .map(|at| format!("{}/{}", be64(at), be64(at + 8)))
                    .collect();
                format!("{name:?}: {}", extents.join(" "))
            }
            t if t & c::REPLY_TYPE_FLAG_ERROR != 0 => format!("error {}", be32(0)),
            t => format!("chunk type {t}"),
        });
        if h.is_done() {
            return chunks;
        }
    }
}

/// NBD_CMD_BLOCK_STATUS with a payload that selects some of the contexts (extended headers,
/// NBD_FLAG_BLOCK_STATUS_PAYLOAD) answers as qemu-nbd answers, chunk for chunk: a subset in
/// the server's order, REQ_ONE, and EINVAL for duplicate, unknown or missing ids, a payload
/// of the wrong length, a zero or out-of-bounds effect length; the connection goes on.
#[test]
fn block_status_payload_selects_contexts_as_qemu_nbd() {
    use nbd_proto::consts as c;
    if !require(&["qemu-nbd", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "bm.qcow2", "4M"]);
    qemu_img_in(d, &["bitmap", "--add", "bm.qcow2", "b0"]);
    qemu_io_in(
        d,
        "qcow2",
        "bm.qcow2",
        &["write -P 1 1M 64k", "write -z 2M 64k"],
    );
    let flags = ["-A", "-B", "b0"];
    let Some(theirs) = qemu_nbd(d, "bm.qcow2", "qcow2", &flags) else {
        return;
    };
    let ours = qpip_server(
        "x",
        &d.join("bm.qcow2"),
        &[&["-r", "-f", "qcow2"], &flags[..]].concat(),
    );
    let queries = [
        c::BASE_ALLOCATION,
        c::QEMU_ALLOCATION_DEPTH,
        "qemu:dirty-bitmap:b0",
    ];
    let size = 4u64 << 20;
    let answers = |port: u16| {
        let (mut s, tflags, contexts) = extended_session(port, &queries);
        let id = |name: &str| contexts.iter().find(|(_, n)| n == name).unwrap().0;
        let (base, depth, bm) = (id(queries[0]), id(queries[1]), id(queries[2]));
        let payload = |effect: u64, ids: &[u32]| {
            let mut p = effect.to_be_bytes().to_vec();
            ids.iter()
                .for_each(|i| p.extend_from_slice(&i.to_be_bytes()));
            p
        };
        let pl = c::CMD_FLAG_PAYLOAD_LEN;
        let one = c::CMD_FLAG_REQ_ONE;
        let cases: Vec<(u16, u64, Vec<u8>)> = vec![
            (0, 0, Vec::new()),
            (pl, 0, payload(size, &[depth])),
            (pl, 0, payload(size, &[bm, base])),
            (pl, 1 << 20, payload(1 << 20, &[bm, depth, base])),
            (pl | one, 0, payload(2 << 20, &[base])),
            (pl, 0, payload(size, &[base, base])),
            (pl, 0, payload(size, &[999])),
            (pl, 0, payload(size, &[])),
            (pl, 0, [&payload(size, &[base])[..], &[0, 0]].concat()),
            (pl, 0, payload(size, &[base, depth, bm, 999])),
            (pl, 0, payload(size, &[base, depth, bm, base, depth])),
            (pl, 0, payload(0, &[base])),
            (pl, 0, payload(size + 512, &[base])),
            (pl, size, payload(512, &[base])),
            (pl, 0, payload(1 << 40, &[bm])),
            (0, 2 << 20, Vec::new()),
        ];
        let mut out = vec![format!(
            "BLOCK_STATUS_PAYLOAD {:?}",
            tflags.map(|f| f & c::FLAG_BLOCK_STATUS_PAYLOAD != 0)
        )];
        // the case by its number (the ids in the payloads are looked up on each server)
        for (i, (f, offset, p)) in cases.into_iter().enumerate() {
            let length = if f & pl != 0 {
                p.len() as u64
            } else {
                size - offset
            };
            let r = block_status(&mut s, &contexts, f, offset, length, &p);
            out.push(format!("case {i}: flags {f:#x} offset {offset}: {r:?}"));
        }
        out
    };
    let (q, o) = (answers(theirs.port), answers(ours.port));
    let differ: Vec<_> = q
        .iter()
        .zip(&o)
        .filter(|(q, o)| q != o)
        .map(|(q, o)| format!("qemu-nbd:        {q}\nqpip-nbd-server: {o}"))
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(q[0], "BLOCK_STATUS_PAYLOAD [true, true]");
}
