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

/// Option `option` with `queries` for export "x" over a raw connection to `port`, after
/// NBD_OPT_STRUCTURED_REPLY when `structured`: the context names the server answers (or
/// its error reply type).
fn ask_contexts(
    port: u16,
    option: u32,
    structured: bool,
    queries: &[&str],
) -> Result<Vec<String>, u32> {
    use nbd_proto::consts as c;
    use nbd_proto::handshake::messages::{
        MetaContextEntry, MetaContextRequest, OptionReplyHeader, encode_option,
    };
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut greeting = [0u8; c::GREETING_LEN];
    s.read_exact(&mut greeting).unwrap();
    s.write_all(&(c::FLAG_C_FIXED_NEWSTYLE | c::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    let reply = |s: &mut std::net::TcpStream| {
        let mut h = [0u8; c::OPTION_REPLY_HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let h = OptionReplyHeader::parse(&h).unwrap();
        let mut data = vec![0u8; h.length as usize];
        s.read_exact(&mut data).unwrap();
        (h.reply_type, data)
    };
    let mut out = Vec::new();
    if structured {
        encode_option(c::OPT_STRUCTURED_REPLY, &[], &mut out);
        s.write_all(&out).unwrap();
        assert_eq!(reply(&mut s).0, c::REP_ACK);
        out.clear();
    }
    let req = MetaContextRequest {
        export: "x",
        queries: queries.to_vec(),
    };
    encode_option(option, &req.encode().unwrap(), &mut out);
    encode_option(c::OPT_ABORT, &[], &mut out);
    s.write_all(&out).unwrap();
    let mut names = Vec::new();
    loop {
        match reply(&mut s) {
            (c::REP_META_CONTEXT, data) => {
                names.push(MetaContextEntry::parse(&data).unwrap().name.to_owned())
            }
            (c::REP_ACK, _) => return Ok(names),
            (err, _) => return Err(err),
        }
    }
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
    let queries: &[&[&str]] = &[
        &[],
        &["qemu:"],
        &["base:"],
        &["qemu:allocation-depth"],
        &["qemu:allocation"],
        &["qemu:dirty-bitmap:"],
        &["qemu:allocation-depth", "base:allocation", "qemu:"],
        &["x-other:", "base:allocation"],
    ];
    let mut differ = Vec::new();
    for a in [&["-A"][..], &[]] {
        let Some(theirs) = qemu_nbd(d, "a.qcow2", "qcow2", a) else {
            return;
        };
        let ours = qpip_server("x", &d.join("a.qcow2"), &[&["-r"], a].concat());
        for (option, structured) in [
            (c::OPT_LIST_META_CONTEXT, false),
            (c::OPT_LIST_META_CONTEXT, true),
            (c::OPT_SET_META_CONTEXT, true),
        ] {
            for q in queries {
                let q_ = ask_contexts(theirs.port, option, structured, q);
                let o = ask_contexts(ours.port, option, structured, q);
                if q_ != o {
                    differ.push(format!(
                        "{a:?} option {option} {q:?}: qemu-nbd {q_:?}, qpip-nbd-server {o:?}"
                    ));
                }
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}
