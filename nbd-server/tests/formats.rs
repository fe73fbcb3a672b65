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

fn qemu_io_writes(format: &str, target: &str, cwd: &Path, writes: &[&str]) {
    let mut cmd = Command::new("qemu-io");
    cmd.current_dir(cwd).args(["-f", format, target]);
    for w in writes {
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
    let mut srv = start_server_v4(&server_args);
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
    qemu_io_writes("raw", &uri, dir, writes);
    qemu_io_writes("qcow2", local, dir, writes);
    let cmp = peer_ok(qemu_img().args(["compare", "-f", "raw", "-F", "qcow2", &uri, local]));
    assert!(cmp.contains("Images are identical"), "{cmp}");
    let map = peer_ok(qemu_img().args(["map", "-f", "raw", "--output=json", &uri]));

    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_timeout(Duration::from_secs(20))
            .is_some_and(|s| s.success()),
        "{}",
        srv.log()
    );
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
    // A backing chain that loops (an image its own backing file), and one whose backing
    // file is missing: refused, naming the overlay and its backing file.
    let looped = qemu_img_create(
        d,
        "loop.qcow2",
        &["-f", "qcow2", "-u", "-b", "loop.qcow2", "-F", "qcow2"],
    );
    refused(
        &["--export", &format!("x={looped}")],
        &[&looped, "backing file", "deeper than 32"],
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

fn be_u64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Patches `bytes` into the file at `at`.
fn patch(path: &str, at: u64, bytes: &[u8]) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, at)
        .unwrap();
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

/// qemu-img in `dir` (so that backing file names given relative stay relative).
fn qemu_img_in(dir: &Path, args: &[&str]) -> String {
    peer_ok(Command::new("qemu-img").current_dir(dir).args(args))
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
/// backing file, the overlay too): encryption, extended L2 entries (subclusters), refcounts
/// narrower than a byte, backing files in other formats or over a protocol.
#[test]
fn unsupported_qcow2_features_are_refused_in_one_line() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let encrypted = d.join("encrypted.qcow2").to_str().unwrap().to_string();
    peer_ok(Command::new("qemu-img").args([
        "create",
        "--object",
        "secret,id=sec0,data=123456",
        "-f",
        "qcow2",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
        &encrypted,
        "32M",
    ]));
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
        (&encrypted, vec!["encrypted"]),
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
