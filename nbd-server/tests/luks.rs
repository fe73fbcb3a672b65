//! Encrypted qcow2 images (LUKS inside qcow2, as `qemu-img create -o encrypt.format=luks`
//! makes them), served decrypted with the passphrase from a file: read as qemu reads them,
//! written so that qemu reads the writes back, and refused in one line where the passphrase
//! is wrong or missing, the encryption is qcow2's legacy AES or a cipher not served, or the
//! LUKS header is crafted (issue 35, item 5).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// The passphrase of every image here (in the file `pw` of the test's directory).
const PASS: &str = "correct horse";

/// qemu's secret object for the passphrase file in `d`, which it writes.
fn secret(d: &Path) -> String {
    let pw = d.join("pw");
    std::fs::write(&pw, PASS).unwrap();
    format!("secret,id=sec0,file={}", pw.display())
}

/// The passphrase file in `d` (written by [`secret`]).
fn pw(d: &Path) -> String {
    d.join("pw").display().to_string()
}

/// `qemu-img create` of the encrypted qcow2 image `name` in `d`, `size` bytes, with `more`
/// options after the encryption's (key slots made fast: iter-time 10 ms). Its path.
fn create(d: &Path, name: &str, size: &str, more: &str) -> String {
    let img = d.join(name).display().to_string();
    let o = format!("encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10{more}");
    peer_ok(Command::new("qemu-img").args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        &secret(d),
        "-o",
        &o,
        &img,
        size,
    ]));
    img
}

/// The `--image-opts` spelling of the encrypted image `img` opened with the secret.
fn opts(img: &str) -> String {
    format!("driver=qcow2,file.filename={img},encrypt.key-secret=sec0")
}

/// qemu-io on the encrypted image `img` (in `d`), every command succeeding.
fn qemu_io_secret(d: &Path, img: &str, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.args(["--object", &secret(d), "--image-opts", &opts(img)]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = peer_ok(&mut c);
    assert!(
        !out.contains("failed") && !out.contains("error"),
        "qemu-io {img}: a command failed:\n{out}"
    );
}

/// The disk of the encrypted image `img` as qemu reads it (qemu-img convert with the secret;
/// sharing the image with a server that serves it).
fn qemu_disk(d: &Path, img: &str) -> Vec<u8> {
    let out = d.join("qemu.raw");
    peer_ok(Command::new("qemu-img").args([
        "convert",
        "-U",
        "--object",
        &secret(d),
        "--image-opts",
        &opts(img),
        "-O",
        "raw",
        out.to_str().unwrap(),
    ]));
    std::fs::read(out).unwrap()
}

/// The disk at `uri` as read over NBD.
fn nbd_disk(d: &Path, uri: &str) -> Vec<u8> {
    let out = d.join("nbd.raw");
    peer_ok(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        uri,
        "-O",
        "raw",
        out.to_str().unwrap(),
    ]));
    std::fs::read(out).unwrap()
}

/// `qemu-img check` of the encrypted image `img`, with the secret: no errors, no leaks.
fn check_clean_secret(d: &Path, img: &str) {
    let check = peer_ok(Command::new("qemu-img").args([
        "check",
        "--object",
        &secret(d),
        "--image-opts",
        &opts(img),
    ]));
    assert!(check.contains("No errors were found"), "{check}");
}

/// Images qemu-img made and qemu-io wrote (aes-256-xts with sha256, qemu-img's default),
/// and one that qemu-img convert encrypted from a raw disk (aes-128-xts with sha1, 4 KiB
/// clusters): read through the server, each is the disk qemu reads with the secret.
#[test]
fn luks_qcow2_is_read_decrypted_as_qemu_reads_it() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = create(d, "a.qcow2", "16M", "");
    qemu_io_secret(
        d,
        &a,
        &[
            "write -P 0x5a 0 100k",
            "write -P 0x33 1M 513",
            "write -P 0x44 3000 7000",
            "write -z 64k 64k",
            "write -P 0x66 15M 1M",
        ],
    );
    let src = d.join("src.raw");
    std::fs::write(&src, pattern(4 << 20, 35)).unwrap();
    let b = d.join("b.qcow2").display().to_string();
    peer_ok(Command::new("qemu-img").args([
        "convert",
        "--object",
        &secret(d),
        "-f",
        "raw",
        src.to_str().unwrap(),
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4096,encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,encrypt.cipher-alg=aes-128,encrypt.hash-alg=sha1",
        &b,
    ]));

    let srv = start_server_v4(&args(&[
        "--encryption-passphrase-file",
        &pw(d),
        "--export",
        &format!("a={a}"),
        "--export",
        &format!("b={b}"),
    ]));
    let disk_a = nbd_disk(d, &srv.uri("a"));
    assert!(disk_a[0] == 0x5a && disk_a[3000] == 0x44 && disk_a[1 << 20] == 0x33);
    assert!(disk_a[64 << 10..128 << 10].iter().all(|&x| x == 0));
    assert!(disk_a == qemu_disk(d, &a), "export a is not qemu's disk");
    let disk_b = nbd_disk(d, &srv.uri("b"));
    assert!(disk_b == qemu_disk(d, &b), "export b is not qemu's disk");
    assert!(disk_b == std::fs::read(&src).unwrap());
    stop(srv);
}

/// Writes of every shape (inside a sector, across sectors, clusters and L2 tables, zeroes,
/// discards) made over NBD and the same ones made by qemu-io with the secret on a copy.
const WRITES: &[&str] = &[
    "write -P 0xab 0 1M",
    "write -P 0x11 100 10",
    "write -P 0xcd 3M 100k",
    "write -z 5M 128k",
    "write -P 0x22 10M 513",
    "discard 10M 64k",
    "write -P 0x44 20000 70000",
    "write -P 0x55 11M 200k",
    "write -z 11M 64k",
    "write -P 0x66 11M 1000",
    "write -z 11M 100",
    "write -P 0x77 15M 1M",
];

/// Serves `served` and makes [`WRITES`] through the server, and locally on `local` (a copy
/// of it): qemu then reads the same disk from both, over NBD and from the files, and
/// `qemu-img check` finds `served` clean. `v2_backed`: a version 2 image over a backing
/// file, where qemu's discard shows the backing file and ours reads as zeroes (README):
/// locally a zeroing.
fn writes_match(d: &Path, served: &str, local: &str, v2_backed: bool) {
    let srv = start_server_v4(&args(&[
        "--encryption-passphrase-file",
        &pw(d),
        "--export",
        &format!("x={served}"),
    ]));
    let uri = srv.uri("x");
    qemu_io_in(d, "raw", &uri, WRITES);
    let local_writes: Vec<String> = WRITES
        .iter()
        .map(|w| match w.strip_prefix("discard ") {
            Some(range) if v2_backed => format!("write -z {range}"),
            _ => w.to_string(),
        })
        .collect();
    qemu_io_secret(
        d,
        local,
        &local_writes.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let expect = qemu_disk(d, local);
    assert!(
        nbd_disk(d, &uri) == expect,
        "{served}: the NBD disk is not qemu's"
    );
    stop(srv);
    check_clean_secret(d, served);
    assert!(
        qemu_disk(d, served) == expect,
        "qemu reads another disk from the image written through the server"
    );
}

/// New clusters are written encrypted, partial sectors and clusters are read, decrypted,
/// changed and encrypted again, zeroes read as zeroes: qemu reads back what was written
/// through the server (64 KiB and 4 KiB clusters, version 2, and overlays over a plain
/// backing file, whose partial clusters are copied up encrypted, and where version 2 zeroes
/// by writing encrypted zeroes), and the image stays consistent.
#[test]
fn writes_through_the_server_are_read_by_qemu() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (name, more) in [
        ("big", ""),
        ("small", ",cluster_size=4096"),
        ("v2", ",compat=0.10"),
    ] {
        let served = create(d, &format!("{name}.qcow2"), "16M", more);
        qemu_io_secret(
            d,
            &served,
            &["write -P 0x5a 64k 1M", "write -P 0x3c 12M 3M"],
        );
        let local = d.join(format!("{name}-local.qcow2")).display().to_string();
        std::fs::copy(&served, &local).unwrap();
        writes_match(d, &served, &local, false);
    }
    let base = d.join("base.qcow2").display().to_string();
    peer_ok(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", &base, "16M"]));
    qemu_io_in(d, "qcow2", &base, &["write -P 0x99 0 16M"]);
    for (name, more, v2) in [("overlay", "", false), ("overlay-v2", ",compat=0.10", true)] {
        let overlay = create(
            d,
            &format!("{name}.qcow2"),
            "16M",
            &format!(",backing_file=base.qcow2,backing_fmt=qcow2{more}"),
        );
        let local = d.join(format!("{name}-local.qcow2")).display().to_string();
        std::fs::copy(&overlay, &local).unwrap();
        writes_match(d, &overlay, &local, v2);
    }
}

/// Where the LUKS header of `img` lies: the full disk encryption header extension's
/// offset, and the extension's own offset in the file.
fn luks_header(img: &str) -> (u64, u64) {
    let head = std::fs::read(img).unwrap();
    let mut at = u32::from_be_bytes(head[100..104].try_into().unwrap()) as usize;
    loop {
        let ty = u32::from_be_bytes(head[at..at + 4].try_into().unwrap());
        let len = u32::from_be_bytes(head[at + 4..at + 8].try_into().unwrap()) as usize;
        assert_ne!(ty, 0, "no full disk encryption header extension in {img}");
        if ty == 0x0537_be77 {
            return (be_u64(&head, at + 8), at as u64 + 8);
        }
        at += 8 + len.div_ceil(8) * 8;
    }
}

/// A wrong passphrase, none, qcow2's legacy AES, a cipher mode not served, an encrypted
/// backing file, and --encryption-format on an image file: one line each, naming the
/// image (and the passphrase file), and the server exits 1.
#[test]
fn wrong_or_missing_passphrases_and_unserved_encryptions_are_one_line() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = create(d, "e.qcow2", "1M", "");
    let bad = d.join("bad");
    std::fs::write(&bad, format!("{PASS}\n")).unwrap();
    let bad = bad.display().to_string();
    refused(
        &[
            "--encryption-passphrase-file",
            &bad,
            "--export",
            &format!("x={img}"),
        ],
        &["export x", &img, "no key slot", &bad],
    );
    refused(
        &["--export", &format!("x={img}")],
        &[
            "export x",
            &img,
            "encrypted",
            "--encryption-passphrase-file",
        ],
    );
    refused(
        &[
            "--encryption-format",
            "x=luks1",
            "--encryption-passphrase-file",
            &pw(d),
            "--export",
            &format!("x={img}"),
        ],
        &["export x", "--encryption-format is for rbd"],
    );
    let aes = d.join("aes.qcow2").display().to_string();
    peer_ok(Command::new("qemu-img").args([
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        &secret(d),
        "-o",
        "encrypt.format=aes,encrypt.key-secret=sec0",
        &aes,
        "1M",
    ]));
    let with_pw = |img: &str| {
        vec![
            "--encryption-passphrase-file".to_string(),
            pw(d),
            "--export".into(),
            format!("x={img}"),
        ]
    };
    let refused_with_pw = |img: &str, words: &[&str]| {
        let a = with_pw(img);
        refused(&a.iter().map(String::as_str).collect::<Vec<_>>(), words);
    };
    refused_with_pw(&aes, &[&aes, "legacy AES"]);
    let cbc = create(
        d,
        "cbc.qcow2",
        "1M",
        ",encrypt.cipher-mode=cbc,encrypt.ivgen-alg=essiv,encrypt.ivgen-hash-alg=sha256",
    );
    refused_with_pw(&cbc, &[&cbc, "aes-cbc-essiv:sha256", "aes-xts-plain64"]);
    let over = d.join("over.qcow2").display().to_string();
    peer_ok(Command::new("qemu-img").args([
        "create", "-q", "-f", "qcow2", "-b", "e.qcow2", "-F", "qcow2", "-u", &over, "1M",
    ]));
    refused_with_pw(&over, &[&over, "backing file", "e.qcow2", "encrypted"]);
}

/// Crafted LUKS headers and header extensions (stripes, iteration counts that would keep
/// the open busy for hours, key material outside the header's area, a header area unaligned,
/// on the L1 table or past the end of the file, no magic) are refused at once, in one
/// line naming the image.
#[test]
fn crafted_luks_headers_are_refused_at_once() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fresh = create(d, "fresh.qcow2", "1M", "");
    let (luks, ext) = luks_header(&fresh);
    let l1 = be_u64(&std::fs::read(&fresh).unwrap(), 40);
    let slot0 = luks + 208;
    let cases: &[(u64, Vec<u8>, &str)] = &[
        (slot0 + 44, 4001u32.to_be_bytes().to_vec(), "4001 stripes"),
        (
            slot0 + 4,
            u32::MAX.to_be_bytes().to_vec(),
            "PBKDF2 iterations for key slot 0",
        ),
        (
            luks + 164,
            u32::MAX.to_be_bytes().to_vec(),
            "PBKDF2 iterations for the master key",
        ),
        (
            slot0 + 40,
            0x00ff_ffffu32.to_be_bytes().to_vec(),
            "key material",
        ),
        (slot0 + 40, 0u32.to_be_bytes().to_vec(), "key material"),
        (luks, b"LUKZ".to_vec(), "no LUKS magic"),
        // Slot 1 made active (1000 iterations, 4000 stripes) on slot 0's key material.
        (
            slot0 + 48,
            [
                &0x00ac_71f3u32.to_be_bytes()[..],
                &1000u32.to_be_bytes(),
                &[0; 32],
                &8u32.to_be_bytes(),
                &4000u32.to_be_bytes(),
            ]
            .concat(),
            "key slot 1's key material overlapping",
        ),
        (luks + 8, b"ae\ns".to_vec(), "names cipher ae?s-xts-plain64"),
        (
            ext,
            (luks + 512).to_be_bytes().to_vec(),
            "not cluster aligned",
        ),
        (ext, l1.to_be_bytes().to_vec(), "overlaps the L1 table"),
        (
            ext + 8,
            (1u64 << 60).to_be_bytes().to_vec(),
            "past the end of the file",
        ),
    ];
    for (i, (at, bytes, words)) in cases.iter().enumerate() {
        let img = d.join(format!("crafted{i}.qcow2")).display().to_string();
        std::fs::copy(&fresh, &img).unwrap();
        patch(&img, *at, bytes);
        let started = std::time::Instant::now();
        refused(
            &[
                "--encryption-passphrase-file",
                &pw(d),
                "--export",
                &format!("x={img}"),
            ],
            &[&img, words],
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{words}");
    }
}

/// A data cluster whose L2 entry points at the LUKS header (a crafted entry) is not written
/// through: the guest's write fails with EIO, the LUKS header is unchanged (the image still
/// opens with its passphrase in qemu), and the image is marked corrupt, as qemu's overlap
/// check does.
#[test]
fn a_data_cluster_on_the_luks_header_is_not_written() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = create(d, "e.qcow2", "1M", "");
    qemu_io_secret(d, &img, &["write -P 0x5a 0 64k"]);
    let (luks, _) = luks_header(&img);
    let head = std::fs::read(&img).unwrap();
    let l2 = be_u64(&head, be_u64(&head, 40) as usize) & 0x00ff_ffff_ffff_fe00;
    patch(&img, l2, &((1u64 << 63) | luks).to_be_bytes());
    let before = std::fs::read(&img).unwrap();
    let srv = start_server_v4(&args(&[
        "--encryption-passphrase-file",
        &pw(d),
        "--export",
        &format!("x={img}"),
    ]));
    let out = text(&run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", &srv.uri("x"), "-c", "write -P 0xee 0 4k"]),
        Duration::from_secs(30),
    ));
    assert!(out.contains("write failed: Input/output error"), "{out}");
    stop(srv);
    let after = std::fs::read(&img).unwrap();
    assert_eq!(
        be_u64(&after, 72),
        be_u64(&before, 72) | 2,
        "not marked corrupt"
    );
    assert_eq!(after[80..], before[80..], "the image changed");
}

/// The passphrase per export, in the config file (`encryption_passphrase_file`) and as
/// `--encryption-passphrase-file NAME=FILE`, beside an image that is not encrypted; and
/// snapshot mode (`-s`) over an encrypted image: its writes are read back, the image file
/// stays byte for byte as it was.
#[test]
fn passphrase_per_export_and_snapshot_mode() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = create(d, "a.qcow2", "4M", "");
    let b = create(d, "b.qcow2", "4M", "");
    qemu_io_secret(d, &a, &["write -P 0xa1 0 64k"]);
    qemu_io_secret(d, &b, &["write -P 0xb2 0 64k"]);
    let plain = d.join("plain.qcow2").display().to_string();
    peer_ok(Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", &plain, "4M"]));
    let cfg = d.join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\npath = \"{a}\"\nencryption_passphrase_file = \"{}\"\n\n\
             [[export]]\nname = \"plain\"\npath = \"{plain}\"\n",
            pw(d)
        ),
    )
    .unwrap();
    let before = std::fs::read(&b).unwrap();
    let srv = start_server_v4(&args(&[
        "--config",
        cfg.to_str().unwrap(),
        "--export",
        &format!("b={b}"),
        "--encryption-passphrase-file",
        &format!("b={}", pw(d)),
        "-s",
    ]));
    qemu_io(&srv.uri("a"), &["read -P 0xa1 0 64k"]);
    qemu_io(&srv.uri("plain"), &["read -P 0 0 64k"]);
    qemu_io(
        &srv.uri("b"),
        &[
            "read -P 0xb2 0 64k",
            "write -P 0xee 512 1000",
            "read -P 0xee 512 1000",
        ],
    );
    stop(srv);
    assert!(
        std::fs::read(&b).unwrap() == before,
        "snapshot mode changed the image"
    );
}
