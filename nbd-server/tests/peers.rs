//! Interop with real NBD clients: qemu-img, qemu-io, nbdinfo, nbdcopy and fio (nbd engine)
//! against a qpip-nbd-server process on 127.0.0.1 and [::1].

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use qpip_test_support::process::PEER_TIMEOUT;

const MIB: u64 = 1 << 20;

/// A server on `listen` exporting "disk" (64 MiB) and "other" (16 MiB), with descriptions.
fn two_exports(listen: &str, dir: &Path) -> ServerProcess {
    let disk = image(dir, "disk.img", 64 * MIB);
    let other = image(dir, "other.img", 16 * MIB);
    start_server(
        listen,
        &[
            "--export".into(),
            format!("disk={}", disk.display()),
            "--export".into(),
            format!("other={}", other.display()),
            "--description".into(),
            "disk=the main disk".into(),
            "--description".into(),
            "other=a second, smaller disk".into(),
        ],
    )
}

/// When `peers` are installed (else None: a skip, under the CI rule), a fresh directory with
/// [`two_exports`] on `listen` serving from it.
fn peers_and_two_exports(
    peers: &[&str],
    listen: &str,
) -> Option<(tempfile::TempDir, ServerProcess)> {
    if !require(peers) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = two_exports(listen, dir.path());
    Some((dir, srv))
}

/// Asserts that each range `(offset, len, byte)` of the file at `path` holds only `byte`.
fn assert_filled(path: &Path, ranges: &[(u64, u64, u8)]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    for &(off, len, byte) in ranges {
        let mut v = vec![0; len as usize];
        f.read_exact_at(&mut v, off).unwrap();
        if let Some(i) = v.iter().position(|&b| b != byte) {
            panic!(
                "{} at {}: {:#x}, expected {byte:#x} in [{off}, +{len})",
                path.display(),
                off + i as u64,
                v[i]
            );
        }
    }
}

/// `qemu-img convert -f FROM -O TO SRC DST` (`-n`: into an existing target).
fn convert(from: &str, to: &str, src: &str, dst: &str, existing: bool) {
    let mut c = Command::new("qemu-img");
    c.arg("convert");
    if existing {
        c.arg("-n");
    }
    peer_ok(c.args(["-f", from, "-O", to, src, dst]));
}

/// `qemu-img compare -f FA -F FB A B`: its output, and whether it found them identical (it
/// exits with 1 when they differ).
fn compare(fa: &str, a: &str, fb: &str, b: &str) -> (bool, String) {
    let o = run_with_timeout(
        Command::new("qemu-img").args(["compare", "-f", fa, "-F", fb, a, b]),
        PEER_TIMEOUT,
    );
    let t = text(&o);
    match o.status.code() {
        Some(0) => (true, t),
        Some(1) => (false, t),
        _ => panic!("qemu-img compare {a} {b} failed ({}):\n{t}", o.status),
    }
}

#[test]
fn qemu_img_info_convert_and_compare() {
    let Some((dir, srv)) = peers_and_two_exports(&["qemu-img", "qemu-io"], "127.0.0.1:0") else {
        return;
    };
    let uri = srv.uri("other");

    let info = peer_ok(Command::new("qemu-img").args(["info", &uri]));
    assert!(
        info.contains("virtual size: 16 MiB (16777216 bytes)"),
        "qemu-img info:\n{info}"
    );

    // Local raw -> nbd: data in the first 4 MiB and at 12 MiB, holes elsewhere.
    let src = dir.path().join("src.raw");
    let mut data = vec![0u8; 16 * MIB as usize];
    data[..4 * MIB as usize].copy_from_slice(&pattern(4 * MIB as usize, 1));
    data[12 * MIB as usize..13 * MIB as usize].copy_from_slice(&pattern(MIB as usize, 2));
    std::fs::write(&src, &data).unwrap();
    let src_s = src.to_str().unwrap();
    convert("raw", "raw", src_s, &uri, true);
    let (same, cmp) = compare("raw", src_s, "raw", &uri);
    assert!(same && cmp.contains("Images are identical"), "{cmp}");
    assert_eq!(
        std::fs::read(dir.path().join("other.img")).unwrap(),
        data,
        "the server's image file differs from what was converted into it"
    );

    // nbd -> qcow2 -> compare with the source, and byte for byte through a raw copy.
    let q = dir.path().join("out.qcow2");
    let q_s = q.to_str().unwrap();
    convert("raw", "qcow2", &uri, q_s, false);
    let (same, cmp) = compare("qcow2", q_s, "raw", src_s);
    assert!(same && cmp.contains("Images are identical"), "{cmp}");
    let back = dir.path().join("back.raw");
    convert("qcow2", "raw", q_s, back.to_str().unwrap(), false);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbd -> qcow2 -> raw differs from the source"
    );

    // A difference must be detected: change one byte behind the server's back... through it.
    peer_ok(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 13631488 512", &uri]));
    let (same, cmp) = compare("raw", src_s, "raw", &uri);
    assert!(!same, "qemu-img compare should see the change:\n{cmp}");
}

#[test]
fn qemu_io_patterns_zeroes_discard_fua_large_write_flush() {
    let Some((dir, srv)) = peers_and_two_exports(&["qemu-io"], "127.0.0.1:0") else {
        return;
    };
    let uri = srv.uri("disk");
    qemu_io(
        &uri,
        &[
            "write -P 0xab 0 1M",
            "read -P 0xab 0 1M",
            "write -P 0x11 1M 1M",
            "write -z 1M 1M",
            "read -P 0 1M 1M",
            "write -P 0x22 4M 1M",
            "discard 4M 1M",
            "read -P 0 4M 1M",
            "write -f -P 0x33 8M 64k",
            "read -P 0x33 8M 64k",
            "write -P 0x44 2109497 1000",
            "read -P 0x44 2109497 1000",
            // 32 MiB: 32 pieces of the server's 1 MiB receive chunk.
            "write -P 0x5c 16M 32M",
            "read -P 0x5c 16M 32M",
            "flush",
        ],
    );
    // The writes are in the image file itself, not only in what the server answers.
    assert_filled(
        &dir.path().join("disk.img"),
        &[
            (0, MIB, 0xab),
            (MIB, MIB, 0),
            (4 * MIB, MIB, 0),
            (8 * MIB, 65536, 0x33),
            (16 * MIB, 32 * MIB, 0x5c),
            (48 * MIB, MIB, 0),
        ],
    );

    // The verification can fail: a wrong expected pattern is reported.
    let o = run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0xac 0 4k", &uri]),
        PEER_TIMEOUT,
    );
    assert!(
        text(&o).contains("Pattern verification failed"),
        "qemu-io should fail to verify a wrong pattern:\n{}",
        text(&o)
    );
}

#[test]
fn nbdinfo_size_flags_content_and_list() {
    let Some((_dir, srv)) = peers_and_two_exports(&["nbdinfo", "qemu-io"], "127.0.0.1:0") else {
        return;
    };
    // An MBR boot signature, for nbdinfo's content detection (file(1)).
    qemu_io(
        &srv.uri("disk"),
        &["write -P 0x55 510 1", "write -P 0xaa 511 1"],
    );
    let info = peer_ok(Command::new("nbdinfo").arg(srv.uri("disk")));
    for want in [
        "export=\"disk\"",
        "description: the main disk",
        "export-size: 67108864",
        "content: DOS/MBR boot sector",
        "is_read_only: false",
        "can_flush: true",
        "can_fua: true",
        "can_trim: true",
        "can_zero: true",
        "base:allocation",
        "block_size_maximum: 33554432",
    ] {
        assert!(info.contains(want), "nbdinfo lacks {want:?}:\n{info}");
    }
    let size = peer_ok(Command::new("nbdinfo").args(["--size", &srv.uri("other")]));
    assert_eq!(size.trim(), "16777216");

    let list = peer_ok(Command::new("nbdinfo").args(["--list", &srv.uri("")]));
    for want in [
        "export=\"disk\"",
        "description: the main disk",
        "export=\"other\"",
        "description: a second, smaller disk",
        "export-size: 16777216",
    ] {
        assert!(
            list.contains(want),
            "nbdinfo --list lacks {want:?}:\n{list}"
        );
    }
    // A session that lists and aborts leaves nothing alarming in the log (the ABORT's ACK
    // used to be deregistered before the NIC sent it: "send WR refused").
    let log = srv.log();
    assert!(!log.contains("WARN"), "warnings after nbdinfo:\n{log}");
}

/// Parses `nbdinfo --map` lines: offset, length, type number, description.
fn parse_map(map: &str) -> Vec<(u64, u64, u32, String)> {
    map.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert!(f.len() >= 4, "unexpected map line {l:?}");
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
                f[3..].join(" "),
            )
        })
        .collect()
}

/// The map entry type at `off`.
fn kind_at(map: &[(u64, u64, u32, String)], off: u64) -> &str {
    map.iter()
        .find(|(o, l, _, _)| *o <= off && off < o + l)
        .map(|(_, _, _, d)| d.as_str())
        .unwrap_or_else(|| panic!("offset {off} not covered by the map {map:?}"))
}

#[test]
fn nbdinfo_map_shows_holes_and_data() {
    let Some((_dir, srv)) = peers_and_two_exports(&["nbdinfo", "qemu-io"], "127.0.0.1:0") else {
        return;
    };
    let uri = srv.uri("disk");
    let fresh = peer_ok(Command::new("nbdinfo").args(["--map", &uri]));
    let m = parse_map(&fresh);
    assert_eq!(
        m,
        vec![(0, 64 * MIB, 3, "hole,zero".to_string())],
        "a fresh sparse image is one hole:\n{fresh}"
    );

    qemu_io(
        &uri,
        &[
            "write -P 1 0 1M",
            "write -P 2 4M 2M",
            "discard 5M 1M",
            "write -P 3 32M 64k",
            "flush",
        ],
    );
    let text = peer_ok(Command::new("nbdinfo").args(["--map", &uri]));
    let m = parse_map(&text);
    // Contiguous, covering the whole export.
    let mut next = 0;
    for (o, l, _, _) in &m {
        assert_eq!(*o, next, "map not contiguous:\n{text}");
        next += l;
    }
    assert_eq!(next, 64 * MIB, "map does not cover the export:\n{text}");
    assert_eq!(kind_at(&m, 0), "data", "{text}");
    assert_eq!(kind_at(&m, MIB - 1), "data", "{text}");
    assert_eq!(kind_at(&m, 2 * MIB), "hole,zero", "{text}");
    assert_eq!(kind_at(&m, 4 * MIB), "data", "{text}");
    assert_eq!(kind_at(&m, 5 * MIB), "hole,zero", "trimmed range:\n{text}");
    assert_eq!(
        kind_at(&m, 6 * MIB - 1),
        "hole,zero",
        "trimmed range:\n{text}"
    );
    assert_eq!(kind_at(&m, 32 * MIB), "data", "{text}");
    assert_eq!(kind_at(&m, 40 * MIB), "hole,zero", "{text}");
    assert_eq!(kind_at(&m, 64 * MIB - 1), "hole,zero", "{text}");
}

#[test]
fn nbdcopy_both_directions() {
    let Some((dir, srv)) = peers_and_two_exports(&["nbdcopy"], "127.0.0.1:0") else {
        return;
    };
    let uri = srv.uri("other");
    let src = dir.path().join("src.raw");
    let data = pattern(16 * MIB as usize, 7);
    std::fs::write(&src, &data).unwrap();
    peer_ok(Command::new("nbdcopy").args([src.to_str().unwrap(), &uri]));
    let back = dir.path().join("back.raw");
    peer_ok(Command::new("nbdcopy").args([&uri, back.to_str().unwrap()]));
    let got = std::fs::read(&back).unwrap();
    assert_eq!(got.len(), data.len());
    if let Some(i) = got.iter().zip(&data).position(|(a, b)| a != b) {
        panic!("nbdcopy round trip differs first at byte {i}");
    }
    assert!(std::fs::read(dir.path().join("other.img")).unwrap() == data);
}

#[test]
fn fio_nbd_engine_randwrite_verify() {
    let Some((_dir, srv)) = peers_and_two_exports(&["fio"], "127.0.0.1:0") else {
        return;
    };
    let out = peer_ok(Command::new("fio").args([
        "--name=qpip",
        "--ioengine=nbd",
        &format!("--uri={}", srv.uri("other")),
        "--rw=randwrite",
        "--bsrange=4k-256k",
        "--size=16M",
        "--iodepth=16",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--randseed=1234",
    ]));
    assert!(out.contains("err= 0"), "fio reported an error:\n{out}");
    for bad in ["verify failed", "bad magic", "mismatch"] {
        assert!(!out.contains(bad), "fio verify complaint {bad:?}:\n{out}");
    }
    // Both the write pass and the verifying read pass moved the whole 16 MiB.
    assert!(
        out.contains("WRITE: bw=") && out.contains("READ: bw="),
        "{out}"
    );
    assert_eq!(out.matches("io=16.0MiB").count(), 2, "{out}");
}

#[test]
fn read_only_export_refuses_writes() {
    if !require(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "ro.img", 4 * MIB);
    std::fs::write(&img, vec![0x7e; 4 * MIB as usize]).unwrap();
    let srv = start_server_v4(&[
        "--export".into(),
        format!("ro={}", img.display()),
        "--read-only".into(),
    ]);
    let uri = srv.uri("ro");
    let t = peer_fails(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 1 0 4k", &uri]));
    assert!(
        t.contains("Permission denied"),
        "expected a permission error:\n{t}"
    );
    // Reads work (qemu needs -r to open a read-only export at all).
    let t =
        peer_ok(Command::new("qemu-io").args(["-r", "-f", "raw", "-c", "read -P 0x7e 0 4M", &uri]));
    assert!(!t.contains("failed"), "{t}");
    assert!(std::fs::read(&img).unwrap().iter().all(|&b| b == 0x7e));
}

#[test]
fn ipv6_qemu_img_nbdinfo_qemu_io() {
    let Some((_dir, srv)) = peers_and_two_exports(&["qemu-img", "nbdinfo", "qemu-io"], "[::1]:0")
    else {
        return;
    };
    assert!(srv.addr.is_ipv6(), "{}", srv.addr);
    let uri = srv.uri("disk");
    assert!(uri.starts_with("nbd://[::1]:"), "{uri}");
    let info = peer_ok(Command::new("qemu-img").args(["info", &uri]));
    assert!(
        info.contains("virtual size: 64 MiB (67108864 bytes)"),
        "{info}"
    );
    let info = peer_ok(Command::new("nbdinfo").arg(&uri));
    assert!(info.contains("export-size: 67108864"), "{info}");
    qemu_io(&uri, &["write -P 0x66 0 64k", "read -P 0x66 0 64k"]);
}

#[test]
fn unknown_export_fails_and_server_keeps_serving() {
    let Some((_dir, mut srv)) = peers_and_two_exports(&["qemu-img", "nbdinfo"], "127.0.0.1:0")
    else {
        return;
    };
    let t = peer_fails(Command::new("nbdinfo").arg(srv.uri("nope")));
    assert!(t.contains("nope"), "nbdinfo should name the export:\n{t}");
    let t = peer_fails(Command::new("qemu-img").args(["info", &srv.uri("nope")]));
    assert!(t.contains("export"), "{t}");
    srv.assert_alive("after an unknown export");
    let info = peer_ok(Command::new("qemu-img").args(["info", &srv.uri("disk")]));
    assert!(info.contains("67108864"), "{info}");
}

#[test]
fn qemu_io_with_extended_headers_and_64_bit_lengths() {
    if !require(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Sparse: only the patterns below take space.
    let img = image(dir.path(), "big.img", 6 << 30);
    let srv = start_server_v4(&["--export".into(), format!("big={}", img.display())]);
    let uri = srv.uri("big");
    qemu_io(
        &uri,
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd 5G 1M",
            "read -P 0xab 0 1M",
            // more than 2^32 bytes in one go: extended headers carry it whole
            "write -z -n 1M 5119M",
            "read -P 0 1M 1M",
            "read -P 0 5119M 1M",
            "discard 1M 2047M",
            "read -P 0xcd 5G 1M",
            "flush",
        ],
    );
    let map = peer_ok(Command::new("qemu-img").args(["map", "--output=json", &uri]));
    assert!(map.contains("\"data\": true"), "{map}");
    assert!(
        srv.log().contains("extended=true"),
        "qemu-io did not negotiate extended headers:\n{}",
        srv.log()
    );
    assert_filled(&img, &[(5 << 30, MIB, 0xcd)]);
}

/// Uploads of a sparse image with holes of 40 MiB, 128 MiB and 2 GiB (longer than the
/// maximum block size, so each is one WRITE_ZEROES or TRIM past it): qemu-img convert -n and
/// nbdcopy into a raw and a qcow2 export whose holes held data before, then the exports
/// compared with the source. The raw export's holes are punched (no NO_HOLE asked).
#[test]
fn sparse_uploads_with_qemu_img_and_nbdcopy_into_raw_and_qcow2() {
    if !require(&["qemu-img", "qemu-io", "nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (src, size) = sparse_upload_source(dir.path());
    let src_s = src.to_str().unwrap();
    let raw = image(d, "raw.img", size);
    let qcow = d.join("q.qcow2");
    peer_ok(Command::new("qemu-img").args([
        "create",
        "-f",
        "qcow2",
        qcow.to_str().unwrap(),
        &size.to_string(),
    ]));
    let srv = start_server_v4(&args(&[
        "--export",
        &format!("raw={}", raw.display()),
        "--export",
        &format!("q={}", qcow.display()),
    ]));
    for (export, fmt) in [("raw", "raw"), ("q", "qcow2")] {
        let uri = srv.uri(export);
        for tool in ["qemu-img", "nbdcopy"] {
            // Data in every hole first, which the upload must zero.
            let junk = junk_in_upload_holes();
            qemu_io(&uri, &junk.iter().map(String::as_str).collect::<Vec<_>>());
            let (same, _) = compare("raw", src_s, "raw", &uri);
            assert!(!same, "{export}: the junk did not land");
            match tool {
                "qemu-img" => convert("raw", "raw", src_s, &uri, true),
                _ => drop(peer_ok(Command::new("nbdcopy").args([src_s, &uri]))),
            }
            let (same, cmp) = compare("raw", src_s, "raw", &uri);
            assert!(same, "{tool} into the {fmt} export {export}: {cmp}");
        }
    }
    drop(srv); // its image locks
    let (same, cmp) = compare("raw", src_s, "raw", raw.to_str().unwrap());
    assert!(same, "the raw image file: {cmp}");
    let (same, cmp) = compare("raw", src_s, "qcow2", qcow.to_str().unwrap());
    assert!(same, "the qcow2 image file: {cmp}");
    peer_ok(Command::new("qemu-img").args(["check", qcow.to_str().unwrap()]));
    use std::os::unix::fs::MetadataExt;
    let allocated = std::fs::metadata(&raw).unwrap().blocks() * 512;
    assert!(
        allocated < 64 * MIB,
        "the raw export's holes were written, not punched: {allocated} bytes allocated"
    );
}

/// qemu-nbd, persistent, with `flags` and the positional `image`, on a free port; its URI
/// names `export`.
fn qemu_nbd_with(flags: &[&str], image: &Path, export: &str) -> qpip_test_support::servers::Peer {
    let image = image.to_str().unwrap();
    qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &[&["-b", "127.0.0.1", "-t", "-f", "raw"], flags, &[image]].concat(),
        &format!("nbd://127.0.0.1:PORT/{export}"),
    )
    .expect("qemu-nbd")
}

/// `nbdinfo --list` of `uri`, the lines naming the export and its description and size.
fn listed(uri: &str) -> Vec<String> {
    let out = peer_ok(Command::new("nbdinfo").args(["--list", uri]));
    out.lines()
        .map(str::trim)
        .filter(|l| {
            l.starts_with("export=")
                || l.starts_with("description:")
                || l.starts_with("export-size:")
        })
        .map(String::from)
        .collect()
}

#[test]
fn qemu_nbds_positional_form_serves_the_image_as_qemu_nbd_does() {
    if !require(&["qemu-nbd", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ours = image(dir.path(), "ours.img", 4 * MIB);
    let theirs = image(dir.path(), "theirs.img", 4 * MIB);
    for (x, d) in [(None, "one disk"), (Some("vm"), "a disk named vm")] {
        let mut flags = vec!["-D", d];
        if let Some(x) = x {
            flags.extend(["-x", x]);
        }
        let q = qemu_nbd_with(&flags, &theirs, x.unwrap_or(""));
        let mut a: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        // -t changes nothing: without it too the server outlives its first client (the
        // qemu-io runs below are several clients).
        if x.is_some() {
            a.push("-t".into());
        }
        a.push(ours.to_str().unwrap().into());
        let srv = start_server_v4(&a);
        // The same export name (default "") and description as qemu-nbd.
        assert_eq!(listed(&srv.uri("")), listed(&q.uri), "{flags:?}");
        // The image is the default export: a client naming none gets it.
        qemu_io(&srv.uri(""), &["write -P 0x5c 0 64k", "read -P 0x5c 0 64k"]);
        qemu_io(&srv.uri(x.unwrap_or("")), &["read -P 0x5c 0 64k"]);
    }
}

/// The same qemu-io commands through qemu-nbd and our server, each with `flags` and on its
/// own copy of one dense image: the copies end up identical, with as much space allocated,
/// and the clients see the same size and block status. Without --discard in `flags`, qemu-nbd
/// gets --discard=unmap, our default.
fn same_as_qemu_nbd(flags: &[&str], cmds: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB as usize;
    let bytes = pattern(size, 25);
    let (ours, theirs) = (dir.path().join("ours.img"), dir.path().join("theirs.img"));
    std::fs::write(&ours, &bytes).unwrap();
    std::fs::write(&theirs, &bytes).unwrap();
    // Our default is qemu-nbd's --discard=unmap (qemu-nbd's own is ignore).
    let default_discard: &[&str] = match flags.iter().any(|f| f.starts_with("--discard")) {
        true => &[],
        false => &["--discard=unmap"],
    };
    let q = qemu_nbd_with(
        &[flags, default_discard, &["-x", "d"]].concat(),
        &theirs,
        "d",
    );
    let mut a: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
    a.extend([
        "-f".into(),
        "raw".into(),
        "-x".into(),
        "d".into(),
        ours.to_str().unwrap().into(),
    ]);
    let srv = start_server_v4(&a);
    let uri = srv.uri("d");
    let info = |u: &str| {
        let t = peer_ok(Command::new("qemu-img").args(["info", "--output=json", u]));
        t.lines()
            .find(|l| l.contains("virtual-size"))
            .unwrap()
            .to_string()
    };
    assert_eq!(info(&uri), info(&q.uri), "{flags:?}");
    qemu_io(&q.uri, cmds);
    qemu_io(&uri, cmds);
    let map =
        |u: &str| peer_ok(Command::new("qemu-img").args(["map", "-f", "raw", u])).replace(u, "URI");
    assert_eq!(map(&uri), map(&q.uri), "{flags:?}: block status");
    drop(srv);
    drop(q);
    assert!(
        std::fs::read(&ours).unwrap() == std::fs::read(&theirs).unwrap(),
        "{flags:?}: the images differ"
    );
    use std::os::unix::fs::MetadataExt;
    let blocks = |p: &Path| std::fs::metadata(p).unwrap().blocks();
    // Within 64 KiB: the file system's own blocks (an ext4 extent tree block) may differ;
    // what the commands allocate or free differs by 512 KiB or more.
    let (o, t) = (blocks(&ours), blocks(&theirs));
    assert!(
        o.abs_diff(t) <= 128,
        "{flags:?}: {o} 512-byte blocks allocated by ours, {t} by qemu-nbd's"
    );
}

#[test]
fn offset_discard_and_detect_zeroes_mean_what_they_mean_to_qemu_nbd() {
    if !require(&["qemu-nbd", "qemu-io", "qemu-img"]) {
        return;
    }
    // Data, a zero write of data, a TRIM and a WRITE_ZEROES at places of the export.
    let cmds = [
        "write -P 0xa1 0 64k",
        "write -P 0 1M 1M",
        "discard 3M 1M",
        "write -z 5M 512k",
        "read -P 0xa1 0 64k",
    ];
    for flags in [
        &["-o", "1048576"][..],
        &["--offset=2097152", "--discard=unmap"],
        &["--discard=ignore"],
        &["--discard=off"],
        &["--discard=unmap"],
        &["--discard=on", "--detect-zeroes=off"],
        &["--detect-zeroes=on"],
        &["--discard=unmap", "--detect-zeroes=on"],
        &["--discard=unmap", "--detect-zeroes=unmap"],
        &["-o", "1048576", "--discard=unmap", "--detect-zeroes=unmap"],
    ] {
        same_as_qemu_nbd(flags, &cmds);
    }
}

#[test]
fn offset_on_a_qcow2_image_is_into_its_virtual_disk_as_in_qemu_nbd() {
    if !require(&["qemu-nbd", "qemu-io", "qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (ours, theirs) = (
        dir.path().join("ours.qcow2"),
        dir.path().join("theirs.qcow2"),
    );
    peer_ok(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&theirs)
            .arg("8M"),
    );
    peer_ok(
        Command::new("qemu-io")
            .args(["-c", "write -P 0x33 1M 1M", "-c", "write -P 0x44 2M 64k"])
            .arg(&theirs),
    );
    std::fs::copy(&theirs, &ours).unwrap();
    let flags = ["-f", "qcow2", "-o", "1048576", "-x", "q"];
    let q = qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            &["-b", "127.0.0.1", "-t", "--discard=unmap"],
            &flags[..],
            &[theirs.to_str().unwrap()],
        ]
        .concat(),
        "nbd://127.0.0.1:PORT/q",
    )
    .expect("qemu-nbd");
    let mut a = args(&flags);
    a.push(ours.to_str().unwrap().into());
    let srv = start_server_v4(&a);
    let cmds = [
        "read -P 0x33 0 1M",
        "read -P 0x44 1M 64k",
        "write -P 0x55 3M 64k",
        "discard 0 64k",
        "write -z 4M 1M",
    ];
    for uri in [&q.uri, &srv.uri("q")] {
        let info = peer_ok(Command::new("qemu-img").args(["info", uri]));
        assert!(info.contains("(7340032 bytes)"), "{uri}: {info}");
        qemu_io(uri, &cmds);
    }
    drop(srv);
    drop(q);
    peer_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "qcow2", "-F", "qcow2"])
            .arg(&ours)
            .arg(&theirs),
    );
    peer_ok(Command::new("qemu-img").args(["check", "-q"]).arg(&ours));
}
