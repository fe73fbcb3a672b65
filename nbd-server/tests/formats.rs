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

fn qemu_io_writes(format: &str, target: &str) {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", format, target]);
    for w in WRITES {
        cmd.args(["-c", w]);
    }
    let out = peer_ok(&mut cmd);
    assert!(!out.contains("error") && !out.contains("failed"), "{out}");
}

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
    let mut srv = start_server_v4(&["--export".into(), format!("d={served}")]);
    let uri = srv.uri("d");

    let info = peer_ok(Command::new("qemu-img").args(["info", &uri]));
    assert!(
        info.contains("virtual size: 32 MiB (33554432 bytes)"),
        "the NBD disk is not the qcow2 virtual disk:\n{info}"
    );
    qemu_io_writes("raw", &uri);
    qemu_io_writes("qcow2", &local);
    let cmp = peer_ok(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "qcow2", &uri, &local]),
    );
    assert!(cmp.contains("Images are identical"), "{cmp}");
    // Block status: the untouched end of the disk is a hole, the written start is data.
    let map = peer_ok(Command::new("qemu-img").args(["map", "-f", "raw", "--output=json", &uri]));
    assert!(map.contains(r#""start": 0, "length": 1048576, "depth": 0, "present": true, "zero": false, "data": true"#), "{map}");
    assert!(map.contains(r#""zero": true, "data": false"#), "{map}");

    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_timeout(Duration::from_secs(20))
            .is_some_and(|s| s.success()),
        "{}",
        srv.log()
    );
    // The file itself: consistent for qemu, and the same disk as the local one.
    let check = peer_ok(Command::new("qemu-img").args(["check", &served]));
    assert!(check.contains("No errors were found"), "{check}");
    let cmp = peer_ok(Command::new("qemu-img").args(["compare", &served, &local]));
    assert!(cmp.contains("Images are identical"), "{cmp}");
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

/// The server must fail at once, exit 1, with one line naming the file and every word.
fn refused(args: &[&str], words: &[&str]) {
    let out = run_with_timeout(
        Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args),
        Duration::from_secs(20),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.contains(" INFO ")).collect();
    assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
    for w in words {
        assert!(lines[0].contains(w), "{args:?}: {w:?} not in {stderr}");
    }
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
    ] {
        let path = qemu_img_create(d, &format!("x.{fmt}"), &["-f", fmt]);
        refused(
            &["--export", &format!("x={path}")],
            &[&path, name, "--format raw"],
        );
    }
    let base = qemu_img_create(d, "base.qcow2", &["-f", "qcow2"]);
    let overlay = qemu_img_create(
        d,
        "overlay.qcow2",
        &["-f", "qcow2", "-b", &base, "-F", "qcow2"],
    );
    refused(
        &["--export", &format!("x={overlay}")],
        &[&overlay, "backing file"],
    );
    let v2 = qemu_img_create(d, "v2.qcow2", &["-f", "qcow2", "-o", "compat=0.10"]);
    refused(
        &["--export", &format!("x={v2}")],
        &[&v2, "version 2", "--read-only"],
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
        // Byte by byte: each write alone leaves raw bytes, the last one would not.
        vec![
            "write -P 0x51 0 1",
            "write -P 0x46 1 1",
            "write -P 0x49 2 1",
            "write -P 0xfb 3 1",
        ],
        // Zeroes can finish a magic too ("QED\0").
        vec![
            "write -P 0x51 0 1",
            "write -P 0x45 1 1",
            "write -P 0x44 2 1",
            "write -P 0x58 3 1",
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
            qemu_io_any(&uri, &["write -z 0 4"])
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
    let mut srv = start_server_v4(&["--export".into(), format!("d={img}")]);
    let uri = srv.uri("d");
    let writes: Vec<String> = (0..10)
        .map(|i| format!("write -P 0xab {}M 8M", i * 8))
        .collect();
    let cmds: Vec<&str> = writes.iter().map(String::as_str).collect();
    qemu_io(&uri, &cmds);
    qemu_io(&uri, &["read -P 0xab 0 80M", "read -P 0 80M 48M"]);
    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_timeout(Duration::from_secs(20))
            .is_some_and(|s| s.success()),
        "{}",
        srv.log()
    );
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
