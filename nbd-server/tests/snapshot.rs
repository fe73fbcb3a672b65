//! Snapshot mode (`-s`/`--snapshot`, as qemu-nbd's): writes, zeroings and trims through NBD
//! land in a temporary overlay in $TMPDIR; the image file never changes, and nothing is left
//! in $TMPDIR after the server exits, cleanly or killed.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use qpip_test_support::pattern::Rng;
use qpip_test_support::servers::tcp_peer;

const SIZE: u64 = 32 << 20;

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// The disk behind `uri` (or an image file, in `format`), as raw bytes.
fn disk(src: &str, format: &str, dir: &Path) -> Vec<u8> {
    let out = dir.join("disk-copy.raw");
    let _ = std::fs::remove_file(&out);
    peer_ok(Command::new("qemu-img").args(["convert", "-f", format, "-O", "raw", src, &s(&out)]));
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    bytes
}

/// Random qemu-io commands (writes, write-zeroes and, with `trims`, discards; 512-byte
/// aligned, some across 64 KiB clusters) applied to `model` as the disk must take them.
fn random_ops(seed: u64, n: usize, trims: bool, model: &mut [u8]) -> Vec<String> {
    let mut rng = Rng(seed);
    let mut cmds = Vec::new();
    for i in 0..n {
        let len = (1 + rng.below(300)) * 512;
        let at = rng.below((SIZE - len) / 512) * 512;
        let range = at as usize..(at + len) as usize;
        let kinds = if trims { 3 } else { 2 };
        match rng.below(kinds) {
            0 => {
                let p = (i % 250) as u8 + 1;
                cmds.push(format!("write -P {p} {at} {len}"));
                model[range].fill(p);
            }
            1 => {
                cmds.push(format!("write -z {at} {len}"));
                model[range].fill(0);
            }
            _ => {
                cmds.push(format!("discard {at} {len}"));
                model[range].fill(0);
            }
        }
    }
    cmds
}

/// The server with `-s` on `image`, its $TMPDIR `tmp`.
fn serve(image: &str, tmp: &Path, extra: &[&str]) -> ServerProcess {
    let mut a = args(&["-s", "--export"]);
    a.push(format!("d={image}"));
    a.extend(args(extra));
    start_server_env("127.0.0.1:0", &a, &[("TMPDIR", tmp)])
}

/// The files the server holds open in `tmp` (the overlay: unnamed, "(deleted)").
fn open_in(pid: u32, tmp: &Path) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|p| p.starts_with(&s(tmp)))
        .collect()
}

/// Serves `image` (in `format`, its virtual disk `local`) with `-s`, runs random writes,
/// zeroings and trims, and checks the disk against the model, block status, the image file
/// unchanged and $TMPDIR empty, after a clean exit and after kill -9.
fn snapshot_leaves_the_image_alone(dir: &Path, image: &str, format: &str) {
    let files = |image: &str| -> Vec<Vec<u8>> {
        let mut v = vec![std::fs::read(image).unwrap()];
        if let Ok(base) = std::fs::read(dir.join("base.raw")) {
            v.push(base);
        }
        v
    };
    let before = files(image);
    let tmp = tempfile::tempdir().unwrap();
    let mut model = disk(image, format, dir);
    assert_eq!(model.len() as u64, SIZE);

    let srv = serve(image, tmp.path(), &[]);
    let log = srv.log();
    assert!(
        log.contains("writes go to a temporary overlay in") && log.contains(&s(tmp.path())),
        "{log}"
    );
    let uri = srv.uri("d");
    let cmds = random_ops(0x5eed, 120, true, &mut model);
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io(&uri, &cmds);
    // Known ranges for block status: data written, whole clusters zeroed.
    qemu_io(&uri, &["write -P 0x5a 3M 128k", "write -z 8M 256k"]);
    model[3 << 20..(3 << 20) + (128 << 10)].fill(0x5a);
    model[8 << 20..(8 << 20) + (256 << 10)].fill(0);
    assert!(
        disk(&uri, "raw", dir) == model,
        "the NBD disk is not the model"
    );
    // The overlay lies in $TMPDIR, unnamed.
    let held = open_in(srv.pid, tmp.path());
    assert!(
        held.len() == 1 && held[0].ends_with("(deleted)"),
        "{held:?}"
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);

    let map = peer_ok(Command::new("nbdinfo").args(["--map", &uri]));
    // "OFFSET LENGTH TYPE DESCRIPTION": the extent holding `at` is data (type 0) or a hole.
    let kind_at = |at: u64| -> u32 {
        map.lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let (o, n, t): (u64, u64, u32) =
                    (f[0].parse().ok()?, f[1].parse().ok()?, f[2].parse().ok()?);
                (o <= at && at < o + n).then_some(t)
            })
            .unwrap_or_else(|| panic!("{at} not in the map:\n{map}"))
    };
    for at in [3 << 20, (3 << 20) + (128 << 10) - 1] {
        assert_eq!(kind_at(at), 0, "written at {at}:\n{map}");
    }
    assert_eq!(kind_at(8 << 20), 3, "zeroed:\n{map}");
    let total: u64 = map
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, SIZE, "{map}");

    stop(srv);
    assert!(files(image) == before, "the image changed");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    if format == "qcow2" {
        let check = peer_ok(
            Command::new("qemu-img")
                .current_dir(dir)
                .args(["check", image]),
        );
        assert!(check.contains("No errors were found"), "{check}");
    }

    // Killed: nothing left either, and the image as it was.
    let mut srv = serve(image, tmp.path(), &[]);
    qemu_io(&srv.uri("d"), &["write -P 0x77 0 1M", "write -z 2M 64k"]);
    srv.kill9();
    assert!(files(image) == before, "the image changed");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn snapshot_of_a_raw_image_takes_writes_and_leaves_it_unchanged() {
    if !require(&["qemu-io", "qemu-img", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = qpip_test_support::pattern::image_with(
        dir.path(),
        "disk.raw",
        SIZE,
        &[(0, 4 << 20), (10 << 20, 1 << 20)],
    );
    snapshot_leaves_the_image_alone(dir.path(), &s(&img), "raw");
}

#[test]
fn snapshot_of_a_qcow2_image_and_of_an_overlay_with_a_backing_file() {
    if !require(&["qemu-io", "qemu-img", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = s(&dir.path().join("disk.qcow2"));
    peer_ok(Command::new("qemu-img").args(["create", "-f", "qcow2", &img, "32M"]));
    peer_ok(Command::new("qemu-io").args([
        "-f",
        "qcow2",
        "-c",
        "write -P 0x31 1M 2M",
        "-c",
        "write -P 0x32 20M 100k",
        &img,
    ]));
    snapshot_leaves_the_image_alone(dir.path(), &img, "qcow2");

    let dir = tempfile::tempdir().unwrap();
    let base = qpip_test_support::pattern::image_with(
        dir.path(),
        "base.raw",
        SIZE,
        &[(0, 6 << 20), (16 << 20, 2 << 20)],
    );
    let top = s(&dir.path().join("top.qcow2"));
    peer_ok(Command::new("qemu-img").args([
        "create",
        "-f",
        "qcow2",
        "-b",
        &s(&base),
        "-F",
        "raw",
        &top,
    ]));
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0x41 5M 2M", &top]));
    snapshot_leaves_the_image_alone(dir.path(), &top, "qcow2");
}

#[test]
fn snapshot_reads_as_qemu_nbd_snapshot_after_the_same_writes() {
    if !require(&["qemu-io", "qemu-img", "qemu-nbd"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = qpip_test_support::pattern::image_with(
        dir.path(),
        "disk.raw",
        SIZE,
        &[(0, 8 << 20), (12 << 20, 3 << 20)],
    );
    let before = std::fs::read(&img).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Both on the same image at once: each opens it read-only, with shared locks.
    let ours = serve(&s(&img), tmp.path(), &[]);
    let theirs = tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            "-b",
            "127.0.0.1",
            "-f",
            "raw",
            "-s",
            "-t",
            "-x",
            "d",
            &s(&img),
        ],
        "nbd://127.0.0.1:PORT/d",
    )
    .unwrap();
    // Discards are left out: qemu-nbd ignores them by default (and qcow2 drops partial ones).
    let mut model = std::fs::read(&img).unwrap();
    let cmds = random_ops(0xbeef, 120, false, &mut model);
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    qemu_io(&ours.uri("d"), &cmds);
    qemu_io(&theirs.uri, &cmds);
    let a = disk(&ours.uri("d"), "raw", dir.path());
    let b = disk(&theirs.uri, "raw", dir.path());
    assert!(a == b, "qpip's and qemu-nbd's snapshots read differently");
    assert!(a == model, "the snapshot is not the model");
    assert!(std::fs::read(&img).unwrap() == before, "the image changed");
}

#[test]
fn snapshot_per_export_in_the_config_file() {
    if !require(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kept = image(dir.path(), "kept.raw", 1 << 20);
    let scratch =
        qpip_test_support::pattern::image_with(dir.path(), "s.raw", 1 << 20, &[(0, 1 << 20)]);
    let before = std::fs::read(&scratch).unwrap();
    let cfg = dir.path().join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"s\"\npath = \"{}\"\nsnapshot = true\n\n[[export]]\nname = \"k\"\npath = \"{}\"\n",
            scratch.display(),
            kept.display()
        ),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let srv = start_server_env(
        "127.0.0.1:0",
        &args(&["--config", &s(&cfg)]),
        &[("TMPDIR", tmp.path())],
    );
    qemu_io(
        &srv.uri("s"),
        &["write -P 0x99 4096 8192", "read -P 0x99 4096 8192"],
    );
    qemu_io(&srv.uri("k"), &["write -P 0x99 4096 8192"]);
    assert!(
        std::fs::read(&scratch).unwrap() == before,
        "the snapshot export's image changed"
    );
    // The other export is written as usual.
    assert_eq!(std::fs::read(&kept).unwrap()[4096], 0x99);
}

#[test]
fn a_missing_tmpdir_stops_the_server_with_one_line_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.raw", 1 << 20);
    let out = run_with_timeout(
        Command::new(BIN)
            .env("TMPDIR", "/nonexistent/qpip-tmp")
            .args(["--listen", "127.0.0.1:0", "-s", "--export"])
            .arg(format!("d={}", img.display())),
        Duration::from_secs(20),
    );
    let err = text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("$TMPDIR /nonexistent/qpip-tmp") && err.trim().lines().count() == 1,
        "{err}"
    );
}
