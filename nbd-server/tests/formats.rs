//! Image formats as qemu-nbd users meet them: a qcow2 image made by `qemu-img create` is
//! served as its virtual disk (written over NBD by qemu-io, then compared with the same writes
//! made locally), other formats are refused by name, and `--format` forces one.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// The same writes, made by qemu-io over NBD and locally: patterns that cross cluster, L2
/// table and refcount block boundaries (with 512-byte clusters), zeroes, discards, and
/// partial clusters.
const WRITES: &[&str] = &[
    "write -P 0xab 0 1M",
    "write -P 0xcd 3M 100k",
    "write -z 5M 128k",
    "write -P 0x11 10M 4096",
    "write -P 0x22 10M 512",
    "discard 10M 64k",
    "write -P 0x33 31M 1M",
    "write -P 0x44 20000 70000",
    "write -P 0x55 11M 200k",
    "write -z 11M 64k",
    "write -P 0x66 11M 1000",
    "write -z 11M 100",
];

fn qemu_img_create(dir: &Path, name: &str, opts: &[&str]) -> String {
    let path = dir.join(name);
    let path = path.to_str().unwrap().to_string();
    peer_ok(
        Command::new("qemu-img")
            .args(["create"])
            .args(opts)
            .args([&path, "32M"]),
    );
    path
}

fn written_over_nbd_equals_written_locally(cluster_opts: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = vec!["-f", "qcow2"];
    opts.extend_from_slice(cluster_opts);
    let served = qemu_img_create(dir.path(), "served.qcow2", &opts);
    let local = qemu_img_create(dir.path(), "local.qcow2", &opts);
    let map = writes_match(&served, &local, &[]);
    // Block status: the untouched end of the disk is a hole, the written start is data.
    assert!(map.contains(r#""start": 0, "length": 1048576, "depth": 0, "present": true, "zero": false, "data": true"#), "{map}");
    assert!(map.contains(r#""zero": true, "data": false"#), "{map}");
}

/// Serves `served` (extra server arguments `args`), makes [`WRITES`] over NBD and the same
/// writes locally on `local` (a copy of it made before, or the same image made again):
/// the NBD disk and `local` are then identical, and so are the two files once the server
/// has stopped; `qemu-img check` finds no error (no leak either) in `served`. Returns
/// `qemu-img map` of the NBD disk after the writes.
fn writes_match(served: &str, local: &str, args: &[&str]) -> String {
    writes_match_with(served, local, args, WRITES)
}

/// [`writes_match`] with other writes.
fn writes_match_with(served: &str, local: &str, args: &[&str], writes: &[&str]) -> String {
    let mut server_args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    server_args.extend(["--export".into(), format!("d={served}")]);
    let srv = start_server_v4(&server_args);
    let uri = srv.uri("d");
    // qemu opens a relative data file name from its current directory: the images'.
    let dir = Path::new(served).parent().unwrap();
    let qemu_img = || {
        let mut c = Command::new("qemu-img");
        c.current_dir(dir);
        c
    };

    let info = peer_ok(qemu_img().args(["info", &uri]));
    assert!(
        info.contains("virtual size: 32 MiB (33554432 bytes)"),
        "the NBD disk is not the qcow2 virtual disk:\n{info}"
    );
    // Before the writes: qemu's own view of the image.
    let cmp = peer_ok(qemu_img().args(["compare", "-f", "raw", "-F", "qcow2", &uri, local]));
    assert!(cmp.contains("Images are identical"), "{cmp}");
    qemu_io_in(dir, "raw", &uri, writes);
    qemu_io_in(dir, "qcow2", local, writes);
    let cmp = peer_ok(qemu_img().args(["compare", "-f", "raw", "-F", "qcow2", &uri, local]));
    assert!(cmp.contains("Images are identical"), "{cmp}");
    let map = peer_ok(qemu_img().args(["map", "-f", "raw", "--output=json", &uri]));

    stop(srv);
    // The file itself: consistent for qemu, and the same disk as the local one.
    check_clean_in(served, dir);
    let cmp = peer_ok(qemu_img().args(["compare", served, local]));
    assert!(cmp.contains("Images are identical"), "{cmp}");
    map
}

/// `qemu-img check` finds neither errors nor leaked clusters.
fn check_clean(path: &str) -> String {
    check_clean_in(path, Path::new("."))
}

/// A copy of `from` at `to` (in the same directory), for the local writes.
fn copy(from: &str, to: &str) -> String {
    std::fs::copy(from, to).unwrap();
    to.to_string()
}

/// An image with data over the first 12 MiB, in patterns and in bytes that do not
/// compress (so that compressed clusters of many sizes share host clusters).
fn source_image(dir: &Path) -> String {
    let src = qemu_img_create(dir, "source.qcow2", &["-f", "qcow2"]);
    let noise: Vec<u8> = (0u32..(1 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let noise_file = dir.join("noise.bin");
    std::fs::write(&noise_file, &noise).unwrap();
    let noise_write = format!("write -s {} 6M 1M", noise_file.display());
    peer_ok(Command::new("qemu-io").args([
        "-f",
        "qcow2",
        &src,
        "-c",
        "write -P 0xab 0 2M",
        "-c",
        "write -P 0x12 3M 300k",
        "-c",
        &noise_write,
        "-c",
        "write -P 0x77 9M 3M",
        "-c",
        "write -P 0x78 10M 4k",
    ]));
    src
}

/// A qcow2 with compressed clusters, as `qemu-img convert -c` makes cloud images (zlib or
/// zstd): read as qemu reads it, and written over (each write into a compressed cluster
/// allocates a new one and drops the compressed one's reference, so that `qemu-img check`
/// finds no leak even where compressed clusters shared host clusters).
fn compressed_image_is_read_and_written(compression: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = source_image(d);
    let comp = d.join("comp.qcow2").to_str().unwrap().to_string();
    peer_ok(Command::new("qemu-img").args([
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        &format!("compression_type={compression}"),
        &src,
        &comp,
    ]));
    let check = check_clean(&comp);
    assert!(!check.contains(" 0.00% compressed"), "{check}");
    let info = peer_ok(Command::new("qemu-img").args(["info", &comp]));
    assert!(
        info.contains(&format!("compression type: {compression}")),
        "{info}"
    );
    let local = copy(&comp, d.join("local.qcow2").to_str().unwrap());
    writes_match(&comp, &local, &[]);
}

#[test]
fn qcow2_compressed_zlib_is_read_and_written() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    compressed_image_is_read_and_written("zlib");
}

#[test]
fn qcow2_compressed_zstd_is_read_and_written() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    compressed_image_is_read_and_written("zstd");
}

#[test]
fn qcow2_is_served_as_its_virtual_disk() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    written_over_nbd_equals_written_locally(&[]);
}

#[test]
fn qcow2_with_small_clusters_grows_l2_tables_and_refcount_blocks() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    written_over_nbd_equals_written_locally(&["-o", "cluster_size=512"]);
}

#[test]
fn other_formats_and_unsupported_qcow2_features_are_refused_by_name() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (fmt, name) in [
        ("vmdk", "vmdk"),
        ("vdi", "vdi"),
        ("vhdx", "vhdx"),
        ("vpc", "vpc"),
        ("qcow", "qcow"),
        ("qed", "qed"),
        ("parallels", "parallels"),
    ] {
        let path = qemu_img_create(d, &format!("x.{fmt}"), &["-f", fmt]);
        refused(
            &["--export", &format!("x={path}")],
            &[&path, name, "--format raw"],
        );
    }
    // qemu probes dmg by the file's name alone (dmg_probe), and so do we.
    let dmg = qemu_img_create(d, "plain.dmg", &["-f", "raw"]);
    refused(
        &["--export", &format!("x={dmg}")],
        &[&dmg, "dmg image", "--format raw"],
    );
    // A backing chain that loops (an image its own backing file), and one whose backing
    // file is missing: refused, naming the overlay and its backing file.
    let looped = qemu_img_create(
        d,
        "loop.qcow2",
        &["-f", "qcow2", "-u", "-b", "loop.qcow2", "-F", "qcow2"],
    );
    refused(
        &["--export", &format!("x={looped}")],
        &[&looped, "backing file", "the backing chain loops"],
    );
    let orphan = qemu_img_create(
        d,
        "orphan.qcow2",
        &["-f", "qcow2", "-u", "-b", "missing.qcow2", "-F", "qcow2"],
    );
    refused(
        &["--export", &format!("x={orphan}")],
        &[&orphan, "backing file", "missing.qcow2"],
    );
    let raw = qemu_img_create(d, "plain.raw", &["-f", "raw"]);
    refused(
        &["-f", "qcow2", "--export", &format!("x={raw}")],
        &[&raw, "not a qcow2 image"],
    );
    refused(
        &[
            "-f",
            "qcow2",
            "--create",
            "1M",
            "--export",
            &format!("x={}/new.qcow2", d.display()),
        ],
        &["new.qcow2", "qemu-img create"],
    );
    let out = Command::new(BIN).args(["-f", "vmdk"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("'vmdk'") && err.contains("raw, qcow2"),
        "{err}"
    );
}

#[test]
fn format_raw_serves_the_files_bytes_and_version_2_is_served_read_only() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let q = qemu_img_create(dir.path(), "a.qcow2", &["-f", "qcow2"]);
    let v2 = qemu_img_create(
        dir.path(),
        "v2.qcow2",
        &["-f", "qcow2", "-o", "compat=0.10"],
    );
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &v2, "-c", "write -P 0x5a 1M 64k"]));
    // qemu's block layer rounds the size up to whole sectors.
    let file_len = std::fs::metadata(&q).unwrap().len().div_ceil(512) * 512;
    let srv = start_server_v4(&[
        "-f".into(),
        "raw".into(),
        "--export".into(),
        format!("q={q}"),
    ]);
    let info = peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("q")]));
    assert!(info.contains(&format!("({file_len} bytes)")), "{info}");
    drop(srv);
    let srv = start_server_v4(&["--read-only".into(), "--export".into(), format!("v={v2}")]);
    let out = peer_ok(Command::new("qemu-io").args([
        "-r",
        "-f",
        "raw",
        &srv.uri("v"),
        "-c",
        "read -P 0x5a 1M 64k",
        "-c",
        "read -P 0 0 1M",
    ]));
    assert!(!out.contains("fail"), "{out}");
}

/// qemu-io -f raw on `uri` running `cmds`; its output, whether or not a command failed.
fn qemu_io_any(uri: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", uri]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    text(&run_with_timeout(&mut c, Duration::from_secs(60)))
}

fn first_sector(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()[..512].to_vec()
}

/// A guest of an image probed as raw must not turn it into another format by writing a
/// header into its first sector: after a restart the server would serve the file as a qcow2
/// disk of the guest's making, or leave out a vmdk one. qemu's raw driver prevents it for
/// probed images (raw_check_write). The write fails with EPERM, small or large
/// (one the NIC would otherwise place in the file itself), whole or assembled from pieces;
/// other writes to the first sector still work; `--format raw` lifts the check.
#[test]
fn a_guest_cannot_change_the_format_of_its_probed_raw_image() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, "guest.img", 4 << 20);
    // A header as qemu-img makes it (64 MiB virtual disk), and one padded to 64 KiB.
    let q = qemu_img_create(d, "h.qcow2", &["-f", "qcow2"]);
    let header = first_sector(Path::new(&q));
    let hdr = d.join("hdr.bin");
    std::fs::write(&hdr, &header).unwrap();
    let mut big = header.clone();
    big.resize(64 << 10, 0x5a);
    let hdr_big = d.join("hdr64k.bin");
    std::fs::write(&hdr_big, &big).unwrap();
    let mut vmdk = b"KDMV".to_vec();
    vmdk.resize(512, 0);
    let vmdk_file = d.join("vmdk.bin");
    std::fs::write(&vmdk_file, &vmdk).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let write_hdr = format!("write -s {} 0 512", s(&hdr));
    let write_big = format!("write -s {} 0 64k", s(&hdr_big));
    let write_vmdk = format!("write -s {} 0 512", s(&vmdk_file));

    let srv = start_server_v4(&["--export".into(), format!("g={}", img.display())]);
    let uri = srv.uri("g");
    let refused = [
        vec![write_hdr.as_str()],
        vec![write_big.as_str()],
        vec![write_vmdk.as_str()],
        // Byte by byte: each write alone leaves raw bytes (a qcow2 magic needs a version
        // from 2), the last one would not.
        vec![
            "write -P 0x03 7 1",
            "write -P 0x51 0 1",
            "write -P 0x46 1 1",
            "write -P 0x49 2 1",
            "write -P 0xfb 3 1",
        ],
        // Zeroes can finish a magic too ("QED\0" from "QEDX").
        vec![
            "write -P 0x51 0 1",
            "write -P 0x45 1 1",
            "write -P 0x58 3 1",
            "write -P 0x44 2 1",
            "write -z 3 1",
        ],
    ];
    for cmds in refused {
        let out = qemu_io_any(&uri, &cmds);
        let failed: Vec<&str> = out.lines().filter(|l| l.contains("failed")).collect();
        assert_eq!(failed.len(), 1, "{cmds:?}: {out}");
        assert!(
            failed[0].contains("Operation not permitted"),
            "{cmds:?}: {out}"
        );
        let head = first_sector(&img);
        assert_eq!(
            qemu_io_any(&uri, &["write -z 0 8"])
                .matches("failed")
                .count(),
            0
        );
        assert_ne!(&head[..4], &header[..4], "{cmds:?}");
        assert_ne!(&head[..4], b"KDMV", "{cmds:?}");
    }
    assert!(first_sector(&img).iter().all(|&b| b == 0));
    // Writes that leave a raw disk: an MBR's signature, data over the whole sector, data
    // after the first sector, and a large write from the first sector (placed or not).
    qemu_io(
        &uri,
        &[
            "write -P 0x55 510 1",
            "write -P 0xaa 511 1",
            "write -P 0x11 512 64k",
            "write -P 0x22 0 64k",
            "read -P 0x22 0 64k",
            "write -P 0x33 0 512",
            "read -P 0x33 0 512",
        ],
    );
    drop(srv);
    // After a restart: still raw, with its own size.
    let srv = start_server_v4(&["--export".into(), format!("g={}", img.display())]);
    let info = peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("g")]));
    assert!(info.contains("virtual size: 4 MiB"), "{info}");
    assert!(srv.log().contains("(raw, 4194304 bytes)"), "{}", srv.log());
    drop(srv);

    // Chosen with --format raw: the bytes are the host's to write as the guest likes.
    let srv = start_server_v4(&[
        "--format".into(),
        "raw".into(),
        "--export".into(),
        format!("g={}", img.display()),
    ]);
    qemu_io(&srv.uri("g"), &[&write_hdr]);
    assert_eq!(first_sector(&img), header);
}

/// The first 512 bytes of `path` as qemu's probe reads them (zeroes past its end).
fn probe_head(path: &Path) -> Vec<u8> {
    let mut head = std::fs::read(path).unwrap();
    head.resize(512, 0);
    head
}

/// `bytes` over 512 zero bytes from `at`.
fn sector_with(mut sector: Vec<u8>, at: usize, bytes: &[u8]) -> Vec<u8> {
    sector.resize(512, 0);
    sector[at..at + bytes.len()].copy_from_slice(bytes);
    sector
}

/// What each of `payloads`, written whole over the first sector by qemu-io at `uri`, came
/// to: "refused" (EPERM), "written", or qemu-io's line.
fn first_sector_writes(uri: &str, dir: &Path, payloads: &[(String, Vec<u8>)]) -> Vec<String> {
    let mut cmds = Vec::new();
    for (i, (_, bytes)) in payloads.iter().enumerate() {
        let file = dir.join(format!("payload{i}.bin"));
        std::fs::write(&file, bytes).unwrap();
        cmds.push(format!("write -s {} 0 512", file.display()));
    }
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let out = qemu_io_any(uri, &cmds);
    let outcomes: Vec<String> = out
        .lines()
        .filter(|l| l.starts_with("wrote ") || l.contains("failed"))
        .map(|l| match l {
            _ if l.starts_with("wrote 512/512") => "written".to_string(),
            _ if l.contains("Operation not permitted") => "refused".to_string(),
            _ => l.to_string(),
        })
        .collect();
    assert_eq!(outcomes.len(), payloads.len(), "{out}");
    outcomes
}

/// Issue 34 (D2): the probe guard is as wide as qemu's probes, and no wider. A guest of a
/// probed raw image writes, over its first sector, the header of each format qemu 10 can
/// probe by content (made by qemu-img where it makes them; vmdk text descriptors as a
/// guest would write them, naming a host file as their FLAT extent) and ordinary data and
/// near misses. Each write meets the same answer from qpip-nbd-server as from qemu-nbd
/// without `-f` (whose raw driver guards probed images): EPERM for a header, written for
/// the rest. (dmg is probed by file name only, which no write changes.)
#[test]
fn first_sector_writes_are_refused_exactly_where_qemu_nbd_refuses_them() {
    if !require(&["qemu-img", "qemu-io", "qemu-nbd"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let made = |name: &str, opts: &[&str]| probe_head(Path::new(&qemu_img_create(d, name, opts)));
    let mut headers: Vec<(String, Vec<u8>)> = vec![
        ("qcow".into(), made("h.qcow", &["-f", "qcow"])),
        ("qcow2".into(), made("h.qcow2", &["-f", "qcow2"])),
        (
            "qcow2 v2".into(),
            made("h2.qcow2", &["-f", "qcow2", "-o", "compat=0.10"]),
        ),
        ("qed".into(), made("h.qed", &["-f", "qed"])),
        ("vdi".into(), made("h.vdi", &["-f", "vdi"])),
        ("vpc".into(), made("h.vpc", &["-f", "vpc"])),
        ("vhdx".into(), made("h.vhdx", &["-f", "vhdx"])),
        ("vmdk sparse".into(), made("h.vmdk", &["-f", "vmdk"])),
        (
            "vmdk flat descriptor".into(),
            made("f.vmdk", &["-f", "vmdk", "-o", "subformat=monolithicFlat"]),
        ),
        (
            "parallels".into(),
            made("h.parallels", &["-f", "parallels"]),
        ),
        (
            "luks".into(),
            made(
                "h.luks",
                &[
                    "-f",
                    "luks",
                    "--object",
                    "secret,id=s0,data=pass",
                    "-o",
                    "key-secret=s0,iter-time=10",
                ],
            ),
        ),
    ];
    let hand = |at: usize, bytes: &[u8]| sector_with(Vec::new(), at, bytes);
    let flat = "RW 8192 FLAT \"/etc/hostname\" 0\n";
    let bochs = |version: u32| {
        let s = hand(0, b"Bochs Virtual HD Image");
        let s = sector_with(s, 32, b"Redolog");
        let s = sector_with(s, 48, b"Growing");
        sector_with(s, 64, &version.to_le_bytes())
    };
    let cloop =
        b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
    let parallels_v1 = sector_with(headers[9].1.clone(), 0, b"WithoutFreeSpace");
    headers.extend([
        ("vmdk COWD".into(), hand(0, b"COWD")),
        (
            "vmdk descriptor after comments".into(),
            hand(
                0,
                format!("# a guest's descriptor\n#\nversion=1\n{flat}").as_bytes(),
            ),
        ),
        (
            "vmdk descriptor, version=1 first, CRLF".into(),
            hand(0, format!("version=1\r\n{flat}").as_bytes()),
        ),
        (
            "vmdk descriptor after blank lines of spaces".into(),
            hand(0, format!("   \n \r\n# c\nversion=3\n{flat}").as_bytes()),
        ),
        ("parallels, first magic".into(), parallels_v1),
        ("bochs v1".into(), bochs(0x0001_0000)),
        ("bochs v2".into(), bochs(0x0002_0000)),
        ("cloop".into(), hand(0, cloop)),
    ]);
    let mut mbr = pattern(512, 7);
    mbr[510..].copy_from_slice(&[0x55, 0xaa]);
    let ordinary: Vec<(String, Vec<u8>)> = vec![
        ("zeroes".into(), hand(0, b"")),
        ("an MBR".into(), mbr),
        ("text".into(), hand(0, b"# notes\nhello, version=1\n")),
        (
            "an empty line, then version=1".into(),
            hand(0, b"\nversion=1\n"),
        ),
        ("an indented version=1".into(), hand(0, b" version=1\n")),
        ("version=4".into(), hand(0, b"version=4\n")),
        ("version=1 without a line end".into(), hand(0, b"version=1")),
        ("qcow2 magic, version 0".into(), hand(0, b"QFI\xfb\0\0\0\0")),
        ("QEDX".into(), hand(0, b"QEDX")),
        ("LUKS version 2".into(), hand(0, b"LUKS\xba\xbe\0\x02")),
        (
            "parallels version 3".into(),
            hand(0, b"WithouFreSpacExt\x03"),
        ),
        (
            "bochs, subtype Undoable".into(),
            sector_with(bochs(0x0002_0000), 48, b"Undoable"),
        ),
        (
            "cloop's first line only".into(),
            hand(0, &cloop[..cloop.len() - 1]),
        ),
        (
            "vdi's signature at 0".into(),
            hand(0, &[0x7f, 0x10, 0xda, 0xbe]),
        ),
    ];
    let payloads: Vec<(String, Vec<u8>)> = headers.iter().chain(&ordinary).cloned().collect();

    let ours = image(d, "ours.img", 4 << 20);
    let theirs = image(d, "theirs.img", 4 << 20);
    let srv = start_server_v4(&["--export".into(), format!("g={}", ours.display())]);
    let theirs_path = theirs.display().to_string();
    let Some(qemu_nbd) = qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &["-b", "127.0.0.1", "-x", "g", "--persistent", &theirs_path],
        "nbd://127.0.0.1:PORT/g",
    ) else {
        return;
    };
    let by_us = first_sector_writes(&srv.uri("g"), d, &payloads);
    let by_qemu = first_sector_writes(&qemu_nbd.uri, d, &payloads);
    let mut wrong = Vec::new();
    for (i, (name, _)) in payloads.iter().enumerate() {
        let expected = if i < headers.len() {
            "refused"
        } else {
            "written"
        };
        if by_us[i] != expected || by_qemu[i] != expected {
            wrong.push(format!(
                "{name}: qpip {}, qemu-nbd {}, expected {expected}",
                by_us[i], by_qemu[i]
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // Data past the first sector is never checked: an ext2 superblock at 1024.
    let mut sb = pattern(1024, 9);
    sb[56..58].copy_from_slice(&[0x53, 0xef]);
    let sb_file = d.join("sb.bin");
    std::fs::write(&sb_file, &sb).unwrap();
    qemu_io(
        &srv.uri("g"),
        &[&format!("write -s {} 1024 1024", sb_file.display())],
    );
    drop(srv);
    // The image is still raw to qemu, with the last ordinary sector written.
    let info = peer_ok(Command::new("qemu-img").args(["info", "-U", &ours.display().to_string()]));
    assert!(info.contains("file format: raw"), "{info}");
    assert_eq!(first_sector(&ours), ordinary.last().unwrap().1);
}

/// A file in a format the server does not serve takes down its own export only: the server
/// starts, serves the others, and logs one error naming the export and the file.
#[test]
fn an_export_in_an_unserved_format_is_left_out_and_the_others_served() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let good = image(dir.path(), "good.img", 2 << 20);
    let bad = image(dir.path(), "bad.img", 2 << 20);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&bad)
        .unwrap()
        .write_all_at(b"KDMV", 0)
        .unwrap();
    let mut srv = start_server_v4(&[
        "--export".into(),
        format!("bad={}", bad.display()),
        "--export".into(),
        format!("good={}", good.display()),
    ]);
    let info = peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("good")]));
    assert!(info.contains("virtual size: 2 MiB"), "{info}");
    peer_fails(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("bad")]));
    srv.assert_alive("after a client asked for the left-out export");
    let log = srv.log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert_eq!(errors.len(), 1, "{log}");
    let bad_path = bad.display().to_string();
    for w in ["export bad", bad_path.as_str(), "vmdk", "--format raw"] {
        assert!(errors[0].contains(w), "{w:?} not in {log}");
    }
}

/// With 512-byte clusters and 16-bit refcounts, one refcount table cluster covers 8 MiB of
/// file: writing more than that grows the refcount table (at the end of the file, as qemu
/// does), and the image stays consistent for qemu.
#[test]
fn qcow2_refcount_table_grows() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("small.qcow2");
    let img = img.to_str().unwrap().to_string();
    peer_ok(Command::new("qemu-img").args([
        "create",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        &img,
        "128M",
    ]));
    let srv = start_server_v4(&["--export".into(), format!("d={img}")]);
    let uri = srv.uri("d");
    let writes: Vec<String> = (0..10)
        .map(|i| format!("write -P 0xab {}M 8M", i * 8))
        .collect();
    let cmds: Vec<&str> = writes.iter().map(String::as_str).collect();
    qemu_io(&uri, &cmds);
    qemu_io(&uri, &["read -P 0xab 0 80M", "read -P 0 80M 48M"]);
    stop(srv);
    let check = peer_ok(Command::new("qemu-img").args(["check", &img]));
    assert!(check.contains("No errors were found"), "{check}");
    let out = peer_ok(Command::new("qemu-io").args([
        "-f",
        "qcow2",
        &img,
        "-c",
        "read -P 0xab 0 80M",
        "-c",
        "read -P 0 80M 48M",
    ]));
    assert!(!out.contains("fail"), "{out}");
}

/// Crafted headers: tables larger than qemu allows, or overlapping each other or the header,
/// or past the end of the file, are refused at open with one line naming the file; an L1
/// table larger than the virtual disk needs (up to qemu's limit) is served, and only the
/// entries the disk needs are read.
#[test]
fn qcow2_oversized_or_misplaced_tables_are_refused() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fresh = |name: &str| qemu_img_create(d, name, &["-f", "qcow2"]);
    // qemu-img create's layout (64 KiB clusters): header, refcount table, refcount block, L1.
    let probe = fresh("probe.qcow2");
    let head = std::fs::read(&probe).unwrap();
    let (l1_at, rt_at) = (be_u64(&head, 40), be_u64(&head, 48));
    assert_eq!((rt_at, l1_at), (0x10000, 0x30000));

    // 2^25 L1 entries (256 MiB of table) for a 32 MiB disk, the file long enough to hold them.
    let big_l1 = fresh("big-l1.qcow2");
    patch(&big_l1, 36, &(1u32 << 25).to_be_bytes());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&big_l1)
        .unwrap()
        .set_len(l1_at + (8 << 25))
        .unwrap();
    refused(
        &["--export", &format!("x={big_l1}")],
        &[&big_l1, "L1 table"],
    );
    // A refcount table of 2^20 clusters (64 GiB).
    let big_rt = fresh("big-rt.qcow2");
    patch(&big_rt, 56, &(1u32 << 20).to_be_bytes());
    refused(
        &["--export", &format!("x={big_rt}")],
        &[&big_rt, "refcount table"],
    );
    // The L1 table on the refcount table, on the header, past the end of the file.
    for (name, l1, words) in [
        ("l1-on-rt.qcow2", rt_at, "overlaps"),
        ("l1-on-header.qcow2", 0, "overlaps"),
        ("l1-past-end.qcow2", 1 << 30, "past the end"),
    ] {
        let p = fresh(name);
        patch(&p, 40, &l1.to_be_bytes());
        refused(&["--export", &format!("x={p}")], &[&p, "L1 table", words]);
    }
    // The refcount table on the header.
    let p = fresh("rt-on-header.qcow2");
    patch(&p, 48, &0u64.to_be_bytes());
    refused(
        &["--export", &format!("x={p}")],
        &[&p, "refcount table", "overlaps"],
    );

    // qemu's largest L1 table (2^22 entries, 32 MiB) for a 32 MiB disk: served, reading one
    // entry; the server stays small.
    let max_l1 = fresh("max-l1.qcow2");
    patch(&max_l1, 36, &(1u32 << 22).to_be_bytes());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&max_l1)
        .unwrap()
        .set_len(l1_at + (8 << 22))
        .unwrap();
    let srv = start_server_v4(&["--export".into(), format!("x={max_l1}")]);
    let info = peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("x")]));
    assert!(info.contains("virtual size: 32 MiB"), "{info}");
    let rss = srv.rss_kib();
    drop(srv);
    let srv = start_server_v4(&["--export".into(), format!("x={probe}")]);
    peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &srv.uri("x")]));
    let plain = srv.rss_kib();
    assert!(
        rss < plain + (8 << 10),
        "the server's RSS is {rss} KiB, {plain} KiB with the same image made by qemu-img"
    );
}

/// A data cluster that lies on the image's own metadata (here: the refcount table, and an
/// unaligned offset inside the header cluster) is not written through: the guest's write
/// gets EIO, the metadata is unchanged, and the image is marked corrupt, as qemu's overlap
/// check does; it is refused at the next start.
#[test]
fn qcow2_data_cluster_on_metadata_is_not_written_and_marks_the_image_corrupt() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, host) in [("on-rt.qcow2", 0x10000u64), ("on-header.qcow2", 0x200)] {
        let img = qemu_img_create(dir.path(), name, &["-f", "qcow2"]);
        peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &img, "-c", "write -P 0x5a 0 64k"]));
        let head = std::fs::read(&img).unwrap();
        let l1_at = be_u64(&head, 40) as usize;
        let l2_at = be_u64(&head, l1_at) & 0x00ff_ffff_ffff_fe00;
        patch(&img, l2_at, &((1u64 << 63) | host).to_be_bytes());
        let before = std::fs::read(&img).unwrap();

        let srv = start_server_v4(&["--export".into(), format!("x={img}")]);
        let out = qemu_io_any(&srv.uri("x"), &["write -P 0xee 0 4k"]);
        assert!(out.contains("write failed: Input/output error"), "{out}");
        drop(srv);
        let after = std::fs::read(&img).unwrap();
        assert_eq!(after.len(), before.len());
        // Only the incompatible features changed: bit 1, "corrupt".
        assert_eq!(be_u64(&after, 72), be_u64(&before, 72) | 2);
        assert_eq!(after[..72], before[..72]);
        assert_eq!(after[80..], before[80..], "{name}");
        let info = peer_ok(Command::new("qemu-img").args(["info", &img]));
        assert!(info.contains("corrupt: true"), "{info}");
        refused(&["--export", &format!("x={img}")], &[&img, "corrupt"]);
    }
}

/// A data cluster past the end of a truncated image (a copy cut short) reads as zeroes, as
/// qemu reads it, instead of failing the read; the clusters before it read as written.
#[test]
fn qcow2_data_cluster_past_the_end_of_a_truncated_image_reads_as_zeroes() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = qemu_img_create(dir.path(), "cut.qcow2", &["-f", "qcow2"]);
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &img, "-c", "write -P 0x55 0 128k"]));
    // Two 64 KiB data clusters at the end of the file: cut the second off.
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(len - 65536)
        .unwrap();
    let reads = ["read -P 0x55 0 64k", "read -P 0 64k 64k"];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "qcow2", "-r", &img]);
    for r in reads {
        cmd.args(["-c", r]);
    }
    let qemu = peer_ok(&mut cmd);
    assert!(!qemu.contains("failed"), "qemu reads it so: {qemu}");
    let srv = start_server_v4(&["--export".into(), format!("x={img}")]);
    qemu_io(&srv.uri("x"), &reads);
}

/// A chain top.qcow2 -> mid.qcow2 -> base.raw, named relative to their directory (the
/// server runs elsewhere), the raw base smaller than the disk, mid with data of its own and a
/// zeroed cluster over the base's data: read as qemu reads it, and written copy-on-write into
/// the top (partial clusters read from below first, zeroes hiding the backing data). The
/// backing files are left as they were, and locked against writers while served.
#[test]
fn qcow2_backing_chain_is_read_and_written_copy_on_write() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = source_image(d);
    qemu_img_in(
        d,
        &["convert", "-f", "qcow2", "-O", "raw", &src, "base.raw"],
    );
    let base = d.join("base.raw");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&base)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "mid.qcow2",
            "32M",
        ],
    );
    let mid = d.join("mid.qcow2").to_str().unwrap().to_string();
    peer_ok(Command::new("qemu-io").args([
        "-f",
        "qcow2",
        &mid,
        "-c",
        "write -P 0x99 8M 1M",
        "-c",
        "write -z 9M 64k",
        "-c",
        "write -P 0x98 15M 2M",
    ]));
    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            "mid.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
            "32M",
        ],
    );
    let top = d.join("top.qcow2").to_str().unwrap().to_string();
    let local = copy(&top, d.join("local.qcow2").to_str().unwrap());
    let (base_before, mid_before) = (std::fs::read(&base).unwrap(), std::fs::read(&mid).unwrap());

    let map = writes_match(&top, &local, &[]);
    assert_eq!(std::fs::read(&base).unwrap(), base_before);
    assert_eq!(std::fs::read(&mid).unwrap(), mid_before);
    // Block status through the chain: the base's incompressible data is data, the end of
    // the disk (past the base, unwritten in mid) a hole.
    for run in [
        r#""start": 6291456, "length": 1048576, "depth": 0, "present": true, "zero": false, "data": true"#,
        r#""start": 17825792, "length": 14680064, "depth": 0, "present": true, "zero": true, "data": false"#,
    ] {
        assert!(map.contains(run), "{map}");
    }

    // While the top is served, the backing files take no writer; readers still open them.
    let srv = start_server_v4(&["--export".into(), format!("d={top}")]);
    let out = peer_fails(Command::new("qemu-io").args([
        "-f",
        "raw",
        base.to_str().unwrap(),
        "-c",
        "write -P 1 0 512",
    ]));
    assert!(out.contains("lock"), "{out}");
    peer_fails(Command::new("qemu-io").args(["-f", "qcow2", &mid, "-c", "write -P 1 0 512"]));
    peer_ok(Command::new("qemu-img").args(["info", &mid]));
    qemu_io(&srv.uri("d"), &["read -P 0x99 8M 64k"]);
}

/// An image whose data is in an external data file (`data_file`, named relative to the
/// image's directory; the server runs elsewhere): read and written as qemu does, the L2
/// tables in the image, the data at its guest offsets in the data file. With
/// `data_file_raw=on` the data file stays a raw image of the disk.
fn external_data_file_is_read_and_written(raw: bool) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let raw_opt = if raw { "on" } else { "off" };
    for (img, data) in [
        ("served.qcow2", "served-data.raw"),
        ("local.qcow2", "local-data.raw"),
    ] {
        qemu_img_in(
            d,
            &[
                "create",
                "-f",
                "qcow2",
                "-o",
                &format!("data_file={data},data_file_raw={raw_opt}"),
                img,
                "32M",
            ],
        );
        peer_ok(Command::new("qemu-io").current_dir(d).args([
            "-f",
            "qcow2",
            img,
            "-c",
            "write -P 0x41 2M 3M",
            "-c",
            "write -P 0x42 20M 100k",
        ]));
    }
    let served = d.join("served.qcow2").to_str().unwrap().to_string();
    let local = d.join("local.qcow2").to_str().unwrap().to_string();
    writes_match(&served, &local, &[]);
    let info = qemu_img_in(d, &["info", &served]);
    assert!(info.contains("data file: served-data.raw"), "{info}");
    assert!(info.contains(&format!("data file raw: {raw}")), "{info}");
    // The image file holds no data: every data cluster is in the data file.
    assert!(std::fs::metadata(&served).unwrap().len() < 1 << 20);
    if raw {
        let data = d.join("served-data.raw");
        let cmp = qemu_img_in(
            d,
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "qcow2",
                data.to_str().unwrap(),
                &served,
            ],
        );
        assert!(cmp.contains("Images are identical"), "{cmp}");
    }
}

#[test]
fn qcow2_external_data_file_is_read_and_written() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    external_data_file_is_read_and_written(false);
}

#[test]
fn qcow2_external_raw_data_file_stays_a_raw_image_of_the_disk() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    external_data_file_is_read_and_written(true);
}

/// Replaces `from` with `to` (as long) in the first cluster of `img`: one header field
/// edited, as a crafted image has it.
fn edit_header(img: &str, from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let mut first = vec![0u8; 65536];
    let n = f.read_at(&mut first, 0).unwrap();
    let at = first[..n]
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .unwrap_or_else(|| panic!("{from:?} is not in {img}'s header"));
    f.write_all_at(to.as_bytes(), at as u64).unwrap();
}

/// A path as a string, for arguments.
fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// D1 (issue 34): an image whose external data file is /proc/self/mem would have its guest
/// read and write the server's own memory. It is refused in one line naming the image, the
/// file and the rule: not beneath the image's directory; and still refused where the user
/// allows every directory (/), as a file of /proc.
#[test]
fn qcow2_data_file_in_proc_is_refused() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A name as long as "/proc/self/mem", then that name written over it.
    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file=datafile.bytes",
            "mem.qcow2",
            "32M",
        ],
    );
    let img = s(&d.join("mem.qcow2"));
    edit_header(&img, "datafile.bytes", "/proc/self/mem");
    refused(
        &["--export", &format!("x={img}")],
        &[
            &img,
            "its data file /proc/self/mem: refused: not beneath the image's directory or an --allow-backing-dir directory",
        ],
    );
    refused(
        &["--allow-backing-dir", "/", "--export", &format!("x={img}")],
        &[&img, "/proc/self/mem", "refused", "/proc, /sys"],
    );
}

/// B1 (issue 34): a backing file outside the image's directory (through a symlink to a
/// root-only file, or by an absolute name, as `qemu-img create -b /abs/path` writes it) is
/// refused, naming where it really is; served once the user allows its directory, with
/// `--allow-backing-dir` or the config file's `allow_backing_dir`.
#[test]
fn qcow2_backing_file_outside_the_image_directory_needs_allowing() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let (vms, bases) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (v, b) = (vms.path(), bases.path());
    let secret = b.join("secret.raw");
    std::fs::write(&secret, vec![0x5a; 1 << 20]).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&secret, v.join("base.raw")).unwrap();
    qemu_img_in(
        v,
        &[
            "create",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "base.raw",
            "-F",
            "raw",
            "top.qcow2",
            "1M",
        ],
    );
    let top = s(&v.join("top.qcow2"));
    refused(
        &["--export", &format!("x={top}")],
        &[
            &top,
            "its backing file",
            "base.raw: refused: not beneath",
            &format!("(it is {})", secret.display()),
        ],
    );
    qemu_img_in(b, &["create", "-f", "qcow2", "base.qcow2", "1M"]);
    let base = s(&b.join("base.qcow2"));
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &base, "-c", "write -P 0x77 0 64k"]));
    qemu_img_in(
        v,
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            &base,
            "-F",
            "qcow2",
            "abs.qcow2",
            "1M",
        ],
    );
    let abs = s(&v.join("abs.qcow2"));
    refused(
        &["--export", &format!("y={abs}")],
        &[
            &abs,
            &format!("its backing file {base}: refused: not beneath"),
        ],
    );

    let srv = start_server_v4(&args(&[
        "--allow-backing-dir",
        &s(b),
        "--export",
        &format!("x={top}"),
        "--export",
        &format!("y={abs}"),
    ]));
    qemu_io(&srv.uri("x"), &["read -P 0x5a 0 1M"]);
    qemu_io(&srv.uri("y"), &["read -P 0x77 0 64k"]);
    drop(srv);
    let cfg = v.join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"y\"\npath = {abs:?}\nallow_backing_dir = [{:?}]\n",
            s(b)
        ),
    )
    .unwrap();
    let srv = start_server_v4(&args(&["--config", &s(&cfg)]));
    qemu_io(&srv.uri("y"), &["read -P 0x77 0 64k"]);
}

/// B2 (issue 34): a FIFO as backing file (which nobody writes) or as data file is refused as
/// not a regular file, without blocking: the server starts at once and serves its other
/// exports, each refused one left out with a line naming it.
#[test]
fn qcow2_fifo_backing_or_data_file_is_refused_without_blocking_other_exports() {
    if !require(&["qemu-img", "qemu-io", "mkfifo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-u",
            "-b",
            "pipe",
            "-F",
            "raw",
            "fifo-backed.qcow2",
            "1M",
        ],
    );
    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "data_file=pipe-data",
            "fifo-data.qcow2",
            "1M",
        ],
    );
    std::fs::remove_file(d.join("pipe-data")).unwrap();
    peer_ok(
        Command::new("mkfifo")
            .current_dir(d)
            .args(["pipe", "pipe-data"]),
    );
    let good = qemu_img_create(d, "good.qcow2", &["-f", "qcow2"]);
    let (backed, data) = (
        s(&d.join("fifo-backed.qcow2")),
        s(&d.join("fifo-data.qcow2")),
    );
    let t = std::time::Instant::now();
    let srv = start_server_v4(&args(&[
        "--export",
        &format!("a={backed}"),
        "--export",
        &format!("b={data}"),
        "--export",
        &format!("good={good}"),
    ]));
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    qemu_io(&srv.uri("good"), &["read -P 0 0 64k"]);
    let log = srv.log();
    for (img, file) in [(&backed, "its backing file"), (&data, "its data file")] {
        assert!(
            log.lines().any(|l| l.contains(img.as_str())
                && l.contains(file)
                && l.contains("refused: it is a FIFO, not a regular file")),
            "{img}: {log}"
        );
    }
    peer_fails(Command::new("qemu-io").args(["-f", "raw", &srv.uri("a"), "-c", "read 0 512"]));
}

/// Whatever the user allows, a named file that is not a regular file, or is reached through
/// a magic link, is refused: a device (in /dev, allowed; or made in the image's own
/// directory), a directory, /proc/self/fd/N.
#[test]
fn qcow2_named_devices_directories_and_magic_links_are_refused_even_where_allowed() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("sub")).unwrap();
    use std::os::unix::fs::FileTypeExt;
    let block = std::fs::read_dir("/dev").unwrap().find_map(|e| {
        let e = e.unwrap();
        e.file_type()
            .unwrap()
            .is_block_device()
            .then(|| s(&e.path()))
    });
    // In the image's own directory (allowed by default), then in directories allowed with
    // --allow-backing-dir /.
    let mut cases = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        peer_ok(
            Command::new("mknod")
                .current_dir(d)
                .args(["null", "c", "1", "3"]),
        );
        cases.push((
            "null".to_string(),
            false,
            "it is a character device, not a regular file",
        ));
    }
    cases.push(("sub".into(), false, "it is a directory, not a regular file"));
    cases.extend([
        (
            "/dev/null".to_string(),
            true,
            "it is a character device, not a regular file",
        ),
        ("/proc/self/fd/0".to_string(), true, "magic link"),
    ]);
    if let Some(block) = block {
        cases.push((block, true, "it is a block device, not a regular file"));
    }
    for (i, (name, allow, why)) in cases.iter().enumerate() {
        let img = format!("over-{i}.qcow2");
        qemu_img_in(
            d,
            &[
                "create", "-f", "qcow2", "-u", "-b", name, "-F", "raw", &img, "1M",
            ],
        );
        let img = s(&d.join(img));
        let export = format!("x={img}");
        let mut args = vec!["--export", &export];
        if *allow {
            args.extend(["--allow-backing-dir", "/"]);
        }
        refused(&args, &[&img, "its backing file", name, why]);
    }
}

/// Two images made with qemu's largest L1 tables (32 MiB), each the other's backing file.
fn looped_pair(d: &Path) -> String {
    for (name, backing) in [("a.qcow2", "b.qcow2"), ("b.qcow2", "a.qcow2")] {
        qemu_img_in(
            d,
            &[
                "create", "-f", "qcow2", "-u", "-b", backing, "-F", "qcow2", name, "2P",
            ],
        );
    }
    s(&d.join("a.qcow2"))
}

/// The largest resident set of the children waited for so far, in KiB.
fn children_max_rss_kib() -> u64 {
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is valid to fill.
    let r = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    assert_eq!(r, 0);
    ru.ru_maxrss as u64
}

/// B4 (issue 34): a backing chain that loops is refused by the images' identity (device and
/// inode) the first time an image comes back, before its tables are read again: at once,
/// with a line that says it loops, in well under the memory of 33 images' tables (1 GiB).
#[test]
fn qcow2_backing_loop_is_refused_by_identity() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = looped_pair(dir.path());
    let b = s(&dir.path().join("b.qcow2"));
    let t = std::time::Instant::now();
    refused(
        &["--export", &format!("x={a}")],
        &[
            &a,
            &format!("the backing chain loops: {b} names {a}, which is already in the chain"),
        ],
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let rss = children_max_rss_kib();
    assert!(rss < 300 << 10, "the server took {} MiB", rss >> 10);
}

/// B4 (issue 34): the tables of a chain's images count against one bound
/// (`MAX_CHAIN_TABLE_BYTES`, 256 MiB): a chain of eight images with 32 MiB L1 tables each is
/// refused at the eighth, saying so.
#[test]
fn qcow2_backing_chain_tables_are_bounded_together() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for i in (0..8).rev() {
        let name = format!("c{i}.qcow2");
        let backing = format!("c{}.qcow2", i + 1);
        let mut create = vec!["create", "-f", "qcow2"];
        if i < 7 {
            create.extend(["-b", &backing, "-F", "qcow2"]);
        }
        create.extend([&name, "2P"]);
        qemu_img_in(d, &create);
    }
    let top = s(&d.join("c0.qcow2"));
    refused(
        &["--export", &format!("x={top}")],
        &[
            &top,
            "c7.qcow2",
            "of the 256 MiB that the tables of one backing chain may take in memory",
        ],
    );
}

/// Version 2 images (compat=0.10, no zero flag) are written: zeroing deallocates or zeroes
/// the clusters' bytes, and writes zeroes over a backing file rather than expose it.
#[test]
fn qcow2_version_2_is_written_alone_and_over_a_backing_file() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = source_image(d);
    qemu_img_in(
        d,
        &[
            "convert",
            "-O",
            "qcow2",
            "-o",
            "compat=0.10",
            &src,
            "v2.qcow2",
        ],
    );
    let v2 = d.join("v2.qcow2").to_str().unwrap().to_string();
    let local = copy(&v2, d.join("v2-local.qcow2").to_str().unwrap());
    writes_match(&v2, &local, &[]);
    let info = peer_ok(Command::new("qemu-img").args(["info", &v2]));
    assert!(info.contains("compat: 0.10"), "{info}");

    qemu_img_in(
        d,
        &[
            "create",
            "-f",
            "qcow2",
            "-o",
            "compat=0.10",
            "-b",
            "source.qcow2",
            "-F",
            "qcow2",
            "v2-top.qcow2",
            "32M",
        ],
    );
    let top = d.join("v2-top.qcow2").to_str().unwrap().to_string();
    let local = copy(&top, d.join("v2-top-local.qcow2").to_str().unwrap());
    // qemu's discard on a version 2 overlay lets the backing file show through (NBD allows
    // it: a trimmed range's contents are unspecified); ours reads as zeroes, as every TRIM
    // of ours does. The local side zeroes there instead.
    let writes: Vec<&str> = WRITES
        .iter()
        .map(|w| {
            if *w == "discard 10M 64k" {
                "write -z 10M 64k"
            } else {
                w
            }
        })
        .collect();
    writes_match_with(&top, &local, &[], &writes);
}

/// An image with internal snapshots (v3 and v2) is written: clusters and L2 tables shared
/// with the snapshots are copied before they change, and the shared ones lose a reference;
/// the snapshots are left as they were (listed, read back, and applied by qemu-img).
#[test]
fn qcow2_with_internal_snapshots_is_written_copy_on_write() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = source_image(d);
    for compat in ["1.1", "0.10"] {
        let name = format!("snap-{compat}.qcow2");
        qemu_img_in(
            d,
            &[
                "convert",
                "-O",
                "qcow2",
                "-o",
                &format!("compat={compat}"),
                &src,
                &name,
            ],
        );
        let img = d.join(&name).to_str().unwrap().to_string();
        peer_ok(Command::new("qemu-img").args(["snapshot", "-c", "one", &img]));
        peer_ok(Command::new("qemu-io").args([
            "-f",
            "qcow2",
            &img,
            "-c",
            "write -P 0x21 1M 2M",
            "-c",
            "write -z 9M 128k",
        ]));
        peer_ok(Command::new("qemu-img").args(["snapshot", "-c", "two", &img]));
        let pristine = copy(
            &img,
            d.join(format!("pristine-{compat}.qcow2")).to_str().unwrap(),
        );
        let local = copy(
            &img,
            d.join(format!("local-{compat}.qcow2")).to_str().unwrap(),
        );
        let before: Vec<Vec<u8>> = ["one", "two"]
            .iter()
            .map(|s| snapshot_disk(&pristine, s, &d.join(format!("{s}-before.raw"))))
            .collect();

        writes_match(&img, &local, &[]);

        let list = peer_ok(Command::new("qemu-img").args(["snapshot", "-l", &img]));
        assert!(list.contains("one") && list.contains("two"), "{list}");
        for (s, before) in ["one", "two"].iter().zip(&before) {
            let after = snapshot_disk(&img, s, &d.join(format!("{s}-after.raw")));
            assert!(after == *before, "snapshot {s} of {name} changed");
        }
        // Applying a snapshot: the disk is the snapshot's again, and the image consistent.
        peer_ok(Command::new("qemu-img").args(["snapshot", "-a", "one", &img]));
        check_clean(&img);
        let one = d.join("one-before.raw");
        let cmp = peer_ok(Command::new("qemu-img").args([
            "compare",
            "-f",
            "raw",
            "-F",
            "qcow2",
            one.to_str().unwrap(),
            &img,
        ]));
        assert!(cmp.contains("Images are identical"), "{cmp}");
    }
}

/// What stays unsupported is refused at open, in one line naming the file (and, for a
/// backing file, the overlay too): extended L2 entries (subclusters), refcounts
/// narrower than a byte, backing files in other formats or over a protocol.
#[test]
fn unsupported_qcow2_features_are_refused_in_one_line() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Encrypted images are served (tests/luks.rs: refused without their passphrase).
    let extl2 = qemu_img_create(d, "extl2.qcow2", &["-f", "qcow2", "-o", "extended_l2=on"]);
    let narrow = qemu_img_create(d, "narrow.qcow2", &["-f", "qcow2", "-o", "refcount_bits=1"]);
    let vmdk = qemu_img_create(d, "base.vmdk", &["-f", "vmdk"]);
    let over_vmdk = qemu_img_create(
        d,
        "over-vmdk.qcow2",
        &["-f", "qcow2", "-b", &vmdk, "-F", "vmdk"],
    );
    let over_nbd = qemu_img_create(
        d,
        "over-nbd.qcow2",
        &[
            "-f",
            "qcow2",
            "-u",
            "-b",
            "nbd://127.0.0.1:1/x",
            "-F",
            "raw",
        ],
    );
    for (img, words) in [
        (&extl2, vec!["extended L2"]),
        (&narrow, vec!["1-bit refcounts"]),
        (&over_vmdk, vec!["backing file", "base.vmdk", "vmdk"]),
        (
            &over_nbd,
            vec!["backing file", "nbd://127.0.0.1:1/x", "protocol"],
        ),
    ] {
        let mut all = vec![img.as_str(), "not supported"];
        all.extend(words);
        refused(&["--export", &format!("x={img}")], &all);
    }
}

/// Internal snapshots' metadata is kept off as the active tables are: a data cluster that
/// lies on the snapshot table or on a snapshot's (inactive) L1 table is not written, and the
/// image is marked corrupt, as qemu's default overlap check does.
#[test]
fn qcow2_data_cluster_on_snapshot_metadata_is_not_written() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, on_table) in [("on-snap-table.qcow2", true), ("on-snap-l1.qcow2", false)] {
        let img = qemu_img_create(dir.path(), name, &["-f", "qcow2"]);
        // The snapshot of the empty disk shares no L2 table: the data written after it is
        // the active image's alone.
        qemu_img_in(dir.path(), &["snapshot", "-c", "s1", &img]);
        peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &img, "-c", "write -P 0x5a 0 64k"]));
        let head = std::fs::read(&img).unwrap();
        let snapshots_at = be_u64(&head, 64);
        let host = if on_table {
            snapshots_at
        } else {
            be_u64(&head, snapshots_at as usize)
        };
        let l1_at = be_u64(&head, 40) as usize;
        let l2_at = be_u64(&head, l1_at) & 0x00ff_ffff_ffff_fe00;
        patch(&img, l2_at, &((1u64 << 63) | host).to_be_bytes());
        let before = std::fs::read(&img).unwrap();

        let srv = start_server_v4(&["--export".into(), format!("x={img}")]);
        let out = qemu_io_any(&srv.uri("x"), &["write -P 0xee 0 4k"]);
        assert!(
            out.contains("write failed: Input/output error"),
            "{name}: {out}"
        );
        drop(srv);
        let after = std::fs::read(&img).unwrap();
        assert_eq!(
            after[80..],
            before[80..],
            "{name}: the snapshot's metadata changed"
        );
        assert_eq!(
            be_u64(&after, 72),
            be_u64(&before, 72) | 2,
            "{name}: not marked corrupt"
        );
    }
}

/// Headers qemu refuses at open, each made by editing one field of an image qemu-img made:
/// refused here too, with the reason.
#[test]
fn qcow2_headers_qemu_refuses_are_refused() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // (image, the fields written into its header (offset, bytes), the refusal's words)
    type Case<'a> = (&'a str, &'a [(u64, &'a [u8])], &'a str);
    let cases: [Case; 4] = [
        // 2^32 - 1 snapshots at an unaligned offset.
        (
            "snapshots.qcow2",
            &[(60, &[0xff; 4]), (64, &0x10001u64.to_be_bytes())],
            "internal snapshots",
        ),
        // The snapshot table at an unaligned offset, with a count qemu allows.
        (
            "snapshot-table.qcow2",
            &[(60, &1u32.to_be_bytes()), (64, &0x10008u64.to_be_bytes())],
            "snapshot table",
        ),
        // A header longer than a cluster (header_length 0xfffffff0).
        (
            "header-length.qcow2",
            &[(100, &0xffff_fff0u32.to_be_bytes())],
            "longer than its cluster",
        ),
        // data_file_raw (autoclear bit 1) without a data file.
        (
            "data-file-raw.qcow2",
            &[(88, &2u64.to_be_bytes())],
            "data-file-raw",
        ),
    ];
    for (name, fields, words) in cases {
        let img = qemu_img_create(d, name, &["-f", "qcow2"]);
        for (at, bytes) in fields {
            patch(&img, *at, bytes);
        }
        // qemu-io opens an image as qemu-nbd does (qemu-img info opens it without I/O).
        let qemu = Command::new("qemu-io")
            .args(["-f", "qcow2", "-r", &img, "-c", "read 0 512"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&qemu.stderr);
        assert!(said.contains("can't open"), "{name}: qemu opens it: {said}");
        refused(&["--export", &format!("x={img}")], &[&img, words]);
    }
    // Images with snapshots, as qemu-img makes them, are served.
    let snap = qemu_img_create(d, "snapped.qcow2", &["-f", "qcow2"]);
    qemu_img_in(d, &["snapshot", "-c", "s1", &snap]);
    qemu_img_in(
        d,
        &["snapshot", "-c", "a-longer-name-for-the-second", &snap],
    );
    let srv = start_server_v4(&["--export".into(), format!("x={snap}")]);
    qemu_io(
        &srv.uri("x"),
        &["write -P 0x11 0 64k", "read -P 0x11 0 64k"],
    );
    drop(srv);
    check_clean(&snap);
}

/// `--load-snapshot` serves a qcow2 image's internal snapshot read-only, as qemu-nbd's does:
/// by name, by ID or in qemu's snapshot.name= form, at the size the disk had then; an
/// unknown snapshot is one line naming those there are.
#[test]
fn an_internal_snapshot_is_served_read_only_as_qemu_nbd_serves_it() {
    if !require(&["qemu-img", "qemu-io", "qemu-nbd", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = qemu_img_create(d, "snaps.qcow2", &["-f", "qcow2"]);
    let io = |cmd: &str| {
        peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &img, "-c", cmd]));
    };
    io("write -P 0x11 0 1M");
    qemu_img_in(d, &["snapshot", "-c", "s1", &img]);
    io("write -P 0x22 0 512k");
    qemu_img_in(d, &["resize", &img, "48M"]);
    io("write -P 0x33 40M 64k");
    qemu_img_in(d, &["snapshot", "-c", "s2", &img]);
    io("write -P 0x44 0 64k");
    let reads_s1 = ["read -P 0x11 0 1M", "read -P 0 1M 31M"];
    // Read-only exports: qemu-io must open them so.
    let read = |uri: &str, cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw", "-r", uri]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        let out = peer_ok(&mut c);
        assert!(!out.contains("fail"), "{uri}: {out}");
    };
    for (which, reads, size) in [
        ("s1", &reads_s1[..], "33554432"),
        ("1", &reads_s1[..], "33554432"),
        ("snapshot.name=s1", &reads_s1[..], "33554432"),
        (
            "snapshot.id=2,snapshot.name=s2",
            &[
                "read -P 0x22 0 512k",
                "read -P 0x11 512k 512k",
                "read -P 0x33 40M 64k",
            ][..],
            "50331648",
        ),
    ] {
        let srv = start_server_v4(&args(&[
            "--load-snapshot",
            which,
            "--export",
            &format!("x={img}"),
        ]));
        read(&srv.uri("x"), reads);
        let n = peer_ok(Command::new("nbdinfo").args(["--size", &srv.uri("x")]));
        assert_eq!(n.trim(), size, "{which}");
        let ro = Command::new("nbdinfo")
            .args(["--is", "read-only", &srv.uri("x")])
            .status()
            .unwrap();
        assert!(ro.success(), "{which}: the snapshot's export is writable");
    }
    // qemu-nbd serves the same bytes.
    if let Some(q) = qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            "-b",
            "127.0.0.1",
            "-x",
            "x",
            "-l",
            "s1",
            "--persistent",
            &img,
        ],
        "nbd://127.0.0.1:PORT/x",
    ) {
        read(&q.uri, &reads_s1);
    }
    // The active disk is untouched and the image clean.
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", "-r", &img, "-c", "read -P 0x44 0 64k"]));
    check_clean(&img);
    refused(
        &["--load-snapshot", "nope", "--export", &format!("x={img}")],
        &[
            &img,
            "no internal snapshot \"nope\"",
            "\"s1\" (id 1)",
            "\"s2\" (id 2)",
        ],
    );
    let raw = qemu_img_create(d, "plain.raw", &["-f", "raw"]);
    refused(
        &["--load-snapshot", "s1", "--export", &format!("x={raw}")],
        &[&raw, "no internal snapshots"],
    );
}

/// WRITE_ZEROES on a version 2 image without a backing file frees the clusters, as qemu-nbd's
/// zeroing does there (version 2 has no zero flag, and qemu discards instead): the same map
/// and the same clean check after the same zeroing through both servers.
#[test]
fn qcow2_v2_write_zeroes_frees_clusters_as_qemu_nbd() {
    if !require(&["qemu-img", "qemu-io", "qemu-nbd"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut maps = Vec::new();
    for which in ["ours", "qemu"] {
        let img = qemu_img_create(
            d,
            &format!("{which}.qcow2"),
            &["-f", "qcow2", "-o", "compat=0.10"],
        );
        peer_ok(Command::new("qemu-io").args(["-f", "qcow2", &img, "-c", "write -P 0x5a 0 2M"]));
        let peer = if which == "ours" {
            let srv = start_server_v4(&["--export".into(), format!("x={img}")]);
            qemu_io(
                &srv.uri("x"),
                &["write -z 0 1M", "write -z -u 1M 512k", "read -P 0 0 1536k"],
            );
            drop(srv);
            None
        } else {
            let q = qpip_test_support::servers::tcp_peer(
                "qemu-nbd",
                "-p",
                &[
                    "-b",
                    "127.0.0.1",
                    "-x",
                    "x",
                    "-f",
                    "qcow2",
                    "--persistent",
                    &img,
                ],
                "nbd://127.0.0.1:PORT/x",
            )
            .expect("qemu-nbd");
            qemu_io(
                &q.uri,
                &["write -z 0 1M", "write -z -u 1M 512k", "read -P 0 0 1536k"],
            );
            Some(q)
        };
        // Stopped before its image is checked.
        drop(peer);
        check_clean(&img);
        maps.push(peer_ok(Command::new("qemu-img").args([
            "map",
            "--output=json",
            "-f",
            "qcow2",
            &img,
        ])));
    }
    assert_eq!(
        maps[0], maps[1],
        "ours:\n{}\nqemu-nbd's:\n{}",
        maps[0], maps[1]
    );
}
