//! The qpip-nbd command: info, list, copy both ways (and NBD to NBD), --verify, sparse
//! copies, a copy that survives a server restart, and block status of many extents.

mod common;

use std::os::unix::fs::FileExt;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use qpip_test_support::ci::require;

const MIB: u64 = 1 << 20;

fn qpip_nbd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(args)
        .output()
        .expect("running qpip-nbd")
}

fn ok(args: &[&str]) -> String {
    let out = qpip_nbd(args);
    assert!(
        out.status.success(),
        "qpip-nbd {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn same(a: &std::path::Path, b: &std::path::Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert_eq!(x.len(), y.len(), "{} vs {}", a.display(), b.display());
    if let Some(i) = x.iter().zip(&y).position(|(p, q)| p != q) {
        panic!("{} and {} differ at {i}", a.display(), b.display());
    }
}

fn allocated(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().blocks() * 512
}

#[test]
fn info_list_help_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 4 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    let text = ok(&["info", &server.uri]);
    assert!(text.contains("export-size: 4194304 (4M)"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["info", "--json", &server.uri])).unwrap();
    assert_eq!(json["exports"][0]["export-size"], 4 * MIB);
    assert!(json["exports"][0]["block_size_maximum"].as_u64().unwrap() > 0);
    let list = ok(&["list", &format!("nbd://127.0.0.1:{}", server.port)]);
    assert!(list.lines().any(|l| l.starts_with("disk")), "{list}");
    assert!(ok(&["--help"]).contains("nbd://HOST"));
    assert!(ok(&["copy", "--help"]).contains("--verify"));
    // Nothing listens on the socket: one line naming it.
    let sock = dir.path().join("none.sock");
    let bad = qpip_nbd(&[
        "info",
        &format!("nbd+unix:///disk?socket={}", sock.display()),
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("none.sock") && err.trim().lines().count() == 1,
        "{err}"
    );
    let port = free_port();
    let gone = qpip_nbd(&["info", &format!("nbd://127.0.0.1:{port}/x")]);
    assert!(!gone.status.success());
    assert!(String::from_utf8_lossy(&gone.stderr).contains(&port.to_string()));
    let missing = qpip_nbd(&["copy", "/nonexistent/src.img", &server.uri]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/src.img"));
}

#[test]
fn copy_both_ways_sparse_and_verified() {
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * MIB;
    // Data at the start, in the middle and at the end; holes between.
    let src = image(
        dir.path(),
        "src.img",
        size,
        &[(0, MIB), (20 * MIB, 3 * MIB + 4096), (size - MIB, MIB)],
    );
    let dst_img = image(dir.path(), "dst.img", size, &[(40 * MIB, 2 * MIB)]);
    let server = qpip_server("dst", &dst_img, &[]);
    ok(&["copy", src.to_str().unwrap(), &server.uri, "--verify"]);
    same(&src, &dst_img); // the stale data at 40 MiB was zeroed (WRITE_ZEROES)

    let back = dir.path().join("back.img");
    std::fs::write(&back, vec![7u8; MIB as usize]).unwrap(); // overwritten, resized
    ok(&["copy", &server.uri, back.to_str().unwrap(), "--verify"]);
    same(&src, &back);
    assert!(
        allocated(&back) < 16 * MIB,
        "holes of the source stay holes ({} bytes allocated)",
        allocated(&back)
    );

    // NBD to NBD, through another server.
    let third = image(dir.path(), "third.img", size, &[]);
    let server3 = qpip_server("third", &third, &[]);
    ok(&["copy", &server.uri, &server3.uri, "--verify", "-C", "2"]);
    same(&src, &third);
}

#[test]
fn copy_with_qemu_nbd_and_nbdkit() {
    let dir = tempfile::tempdir().unwrap();
    let size = 32 * MIB;
    let src = image(
        dir.path(),
        "src.img",
        size,
        &[(MIB, 5 * MIB), (30 * MIB, MIB)],
    );
    let q = image(dir.path(), "q.img", size, &[]);
    if let Some(peer) = qemu_nbd("q", &q) {
        ok(&["copy", src.to_str().unwrap(), &peer.uri, "--verify"]);
        let back = dir.path().join("back-q.img");
        ok(&["copy", &peer.uri, back.to_str().unwrap()]);
        same(&src, &back);
    }
    if let Some(peer) = nbdkit(&["memory", "32M"]) {
        ok(&["copy", src.to_str().unwrap(), &peer.uri, "--verify"]);
        let back = dir.path().join("back-k.img");
        ok(&["copy", &peer.uri, back.to_str().unwrap()]);
        same(&src, &back);
    }
    let d = image(dir.path(), "d.img", size, &[]);
    if let Some(peer) = debian_nbd_server("d", &d) {
        ok(&["copy", src.to_str().unwrap(), &peer.uri, "--verify"]);
        let back = dir.path().join("back-d.img");
        ok(&["copy", &peer.uri, back.to_str().unwrap()]);
        same(&src, &back);
    }
}

#[test]
fn local_to_local_copy_with_verify() {
    let dir = tempfile::tempdir().unwrap();
    let a = image(dir.path(), "a.img", 4 * MIB, &[(0, 4 * MIB)]);
    let b = dir.path().join("b.img");
    ok(&["copy", a.to_str().unwrap(), b.to_str().unwrap(), "--verify"]);
    same(&a, &b);
}

/// `-` streams standard input into an export and an export to standard output; `null:`
/// takes a copy and keeps nothing; `--requests` and `-p` are nbdcopy's spellings.
#[test]
fn copy_streams_stdin_and_stdout_and_discards_into_null() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let img = image(dir.path(), "s.img", size, &[]);
    let server = qpip_server("s", &img, &[]);
    let data = pattern(0, (5 * MIB + 123) as usize);
    let mut child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["copy", "-", &server.uri, "--requests", "4", "-p"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let fed = child.stdin.take().unwrap().write_all(&data);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // A copy that stops reading early breaks the pipe: what it said is the useful part.
    assert!(fed.is_ok(), "feeding the copy: {fed:?}; it said: {err}");
    assert!(out.status.success(), "stdin copy failed: {err}");
    assert!(err.contains("MiB"), "no progress lines with -p: {err}");
    let on_disk = std::fs::read(&img).unwrap();
    assert!(on_disk[..data.len()] == data[..], "stdin data differ");

    let out = qpip_nbd(&["copy", &server.uri, "-"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == on_disk, "stdout differs from the export");

    let out = qpip_nbd(&["copy", &server.uri, "null:"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["copy", "-", "null:"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let fed = child.stdin.take().unwrap().write_all(&data);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // A copy that stops reading early breaks the pipe: what it said is the useful part.
    assert!(fed.is_ok(), "feeding the copy: {fed:?}; it said: {err}");
    assert!(out.status.success(), "stdin to null: {err}");
    // Longer than the export, a source that null: cannot be, and --verify without a way back.
    let mut child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["copy", "-", &server.uri])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child
        .stdin
        .take()
        .unwrap()
        .write_all(&vec![1u8; (size + 1) as usize]);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("longer than"));
    let out = qpip_nbd(&["copy", "null:", &server.uri]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("only be a destination"));
    let out = qpip_nbd(&["copy", "--verify", &server.uri, "null:"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("read back"));
}

/// SIGINT in the middle of a copy: a destination file the copy created is removed and the
/// exit status is 130; an existing destination is reported incomplete.
#[test]
fn an_interrupted_copy_removes_what_it_created_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let size = 512 * MIB;
    let img = image(dir.path(), "big.img", size, &[(0, size)]);
    // A slow server, so that the copy is surely under way when the signal comes.
    let Some(peer) = nbdkit(&[
        "--filter=delay",
        "file",
        &format!("file={}", img.display()),
        "rdelay=20ms",
    ]) else {
        return;
    };
    for existing in [false, true] {
        let dst = dir.path().join(format!("out-{existing}.img"));
        if existing {
            std::fs::write(&dst, b"old").unwrap();
        }
        let child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
            .args(["copy", &peer.uri, dst.to_str().unwrap()])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = std::time::Instant::now();
        // Under way: the destination has the source's size and data in it.
        while std::fs::metadata(&dst).map_or(true, |m| m.len() != size) || allocated(&dst) < MIB {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the copy never started"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(130), "{:?}: {err}", out.status);
        if existing {
            assert!(dst.exists() && err.contains("is incomplete"), "{err}");
        } else {
            assert!(
                !dst.exists() && err.contains("removed the incomplete"),
                "{err}"
            );
        }
    }
}

/// Kill the server in the middle of a copy, restart it on the same port and image after
/// 0.5 s: the copy reconnects, reissues what was unanswered, and completes correctly.
#[test]
fn copy_survives_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let size = 256 * MIB;
    let src = image(dir.path(), "src.img", size, &[(0, size)]);
    let dst = image(dir.path(), "dst.img", size, &[]);
    let mut server = qpip_server("d", &dst, &[]);
    let port = server.port;
    let uri = server.uri.clone();
    let child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args([
            "copy",
            src.to_str().unwrap(),
            &uri,
            "--window",
            "8",
            "--log",
            "info",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the copy is under way, then kill the server.
    let t = std::time::Instant::now();
    while allocated(&dst) < 8 * MIB && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(10));
    }
    server.kill();
    std::thread::sleep(Duration::from_millis(500));
    let _server2 = qpip_server_on(port, "d", &dst, &[]);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "copy failed: {err}");
    assert!(
        err.contains("reconnect"),
        "the copy finished before the restart: {err}"
    );
    same(&src, &dst);
}

/// The issue's acceptance check: a 1 GiB image of incompressible data copied to a server and
/// back, then compared with cmp (on tmpfs where there is one, to spare the disk).
#[test]
fn copy_one_gib_both_ways_then_cmp() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .unwrap();
    let size = 1024 * MIB;
    let src = dir.path().join("src.img");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&src).unwrap());
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut chunk = vec![0u8; 4 * MIB as usize];
        for _ in 0..size / (4 * MIB) {
            for word in chunk.chunks_exact_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                word.copy_from_slice(&x.to_le_bytes());
            }
            f.write_all(&chunk).unwrap();
        }
    }
    let dst_img = dir.path().join("dst.img");
    std::fs::File::create(&dst_img)
        .unwrap()
        .set_len(size)
        .unwrap();
    let server = qpip_server("big", &dst_img, &[]);
    ok(&["copy", src.to_str().unwrap(), &server.uri]);
    let back = dir.path().join("back.img");
    ok(&["copy", &server.uri, back.to_str().unwrap()]);
    for (a, b) in [(&src, &dst_img), (&src, &back)] {
        let cmp = std::process::Command::new("cmp")
            .arg(a)
            .arg(b)
            .output()
            .unwrap();
        assert!(
            cmp.status.success(),
            "cmp {} {}: {}",
            a.display(),
            b.display(),
            String::from_utf8_lossy(&cmp.stdout)
        );
    }
}

#[test]
fn logging_options_are_the_shared_ones_and_a_bad_rust_log_is_refused() {
    // -q/-v are accepted (the error is the connection's, status 1, not a usage error).
    let out = qpip_nbd(&["-q", "-vv", "info", "nbd://127.0.0.1:1/x"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (env, args) in [
        (Some("loud"), vec!["info", "nbd://127.0.0.1:1/x"]),
        (None, vec!["--log", "loud", "list", "nbd://127.0.0.1:1"]),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"));
        match env {
            Some(v) => cmd.env("RUST_LOG", v),
            None => cmd.env_remove("RUST_LOG"),
        };
        let out = cmd.args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("qpip-nbd: ") && err.contains("loud"),
            "{err}"
        );
    }
}

#[test]
fn info_answers_size_can_is_and_map_like_nbdinfo() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 4 * MIB, &[(0, MIB), (2 * MIB, MIB)]);
    let server = qpip_server("disk", &img, &[]);
    let uri = server.uri.as_str();
    assert_eq!(ok(&["info", "--size", uri]), "4194304\n");
    let status = |args: &[&str]| {
        let out = qpip_nbd(args);
        assert!(out.stdout.is_empty(), "{args:?} printed something");
        out.status.code()
    };
    for (args, want) in [
        (vec!["--can", "write"], 0),
        (vec!["--can", "trim"], 0),
        (vec!["--can", "multi-conn"], 0),
        (vec!["--can", "extents"], 0),
        (vec!["--is", "read-only"], 2),
        (vec!["--is", "tls"], 2),
    ] {
        let mut a = vec!["info"];
        a.extend(&args);
        a.push(uri);
        assert_eq!(status(&a), Some(want), "{a:?}");
    }
    let map = ok(&["info", "--map", uri]);
    let rows: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec!["0", "1048576", "0", "data"],
            vec!["1048576", "1048576", "3", "hole,zero"],
            vec!["2097152", "1048576", "0", "data"],
            vec!["3145728", "1048576", "3", "hole,zero"],
        ],
        "{map}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["info", "--map", "--json", uri])).unwrap();
    assert_eq!(json[1]["description"], "hole,zero");

    // A read-only export, asked from the server's captive command.
    let ro = Command::new(qpip_server_bin())
        .args([
            "--read-only",
            "-U",
            "--export",
            &format!("r={}", img.display()),
        ])
        .args(["--log", "warn", "--run"])
        .arg(format!(
            "{q} info --is read-only \"$uri\" && {q} info --can write \"$uri\"",
            q = env!("CARGO_BIN_EXE_qpip-nbd")
        ))
        .output()
        .unwrap();
    assert_eq!(
        ro.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&ro.stderr)
    );

    // An unknown export: one line naming it and the exports there are.
    let out = qpip_nbd(&["info", &format!("nbd://127.0.0.1:{}/nope", server.port)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("no export named \"nope\"") && err.contains("\"disk\""),
        "{err}"
    );
}

#[test]
fn copy_info_and_list_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let src = image(dir.path(), "src.img", 8 * MIB, &[(MIB, 2 * MIB)]);
    let dst = image(dir.path(), "dst.img", 8 * MIB, &[]);
    let Some(peer) = unix_peer(
        qpip_server_bin().to_str().unwrap(),
        "-k",
        &["--export", &format!("d={}", dst.display())],
        "d",
    ) else {
        return;
    };
    ok(&["copy", src.to_str().unwrap(), &peer.uri, "--verify"]);
    same(&src, &dst);
    assert!(ok(&["info", "--size", &peer.uri]).contains(&(8 * MIB).to_string()));
    let all = peer.uri.replace("/d?", "/?");
    assert!(ok(&["list", &all]).lines().any(|l| l.starts_with('d')));
}

#[test]
fn block_status_with_many_extents_under_extended_headers() {
    // 4 KiB of data every 64 KiB over 8 MiB: 256 extents, more than fit in one 512-byte
    // reply slot as an extended block-status chunk (a reply of 30 or more extents once
    // answered EIO, and a copy from our own server failed).
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    let data: Vec<(u64, u64)> = (0..size / (64 << 10))
        .map(|i| (i * (64 << 10), 4096))
        .collect();
    let img = image(dir.path(), "disk.img", size, &data);
    let server = qpip_server("disk", &img, &[]);
    let uri = server.uri.as_str();

    // (a) The copy asks for block status under extended headers (the log says so).
    let out_img = dir.path().join("out.img");
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["--log", "nbd_client=debug", "copy", uri])
        .arg(&out_img)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qpip-nbd copy failed: {err}");
    assert!(
        err.contains("extended=true"),
        "extended headers not negotiated: {err}"
    );
    same(&img, &out_img);
    assert!(
        allocated(&out_img) < 4 * MIB,
        "the holes stay holes ({} bytes allocated)",
        allocated(&out_img)
    );

    // Every extent, through our own client (extended headers) ...
    let want: Vec<String> = (0..size / (64 << 10))
        .flat_map(|i| {
            let at = i * (64 << 10);
            [
                format!("{at} 4096 0 data"),
                format!("{} {} 3 hole,zero", at + 4096, (64 << 10) - 4096),
            ]
        })
        .collect();
    let rows = |map: &str| -> Vec<String> {
        map.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect()
    };
    let map = ok(&["info", "--map", uri]);
    assert_eq!(rows(&map), want, "{map}");

    // (b) ... and through nbdinfo (libnbd asks for extended headers from 1.20 on; older
    // ones use compact structured replies).
    if !have("nbdinfo") {
        return;
    }
    let out = Command::new("nbdinfo")
        .args(["--map", uri])
        .output()
        .unwrap();
    let map = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nbdinfo --map failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(rows(&map), want, "{map}");
}

/// The keys of a JSON object (and of its first `exports` entry, prefixed "exports/").
fn json_keys(v: &serde_json::Value) -> Vec<String> {
    let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    if let Some(e) = v["exports"].as_array().and_then(|a| a.first()) {
        keys.extend(
            e.as_object()
                .unwrap()
                .keys()
                .map(|k| format!("exports/{k}")),
        );
    }
    keys.sort();
    keys
}

#[test]
fn info_takes_nbdinfos_spellings_and_json_keys() {
    if !require(&["nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 4 * MIB, &[(0, MIB)]);
    let server = qpip_server("disk", &img, &[]);
    let uri = server.uri.as_str();
    let base = format!("nbd://127.0.0.1:{}", server.port);
    let nbdinfo = |args: &[&str]| {
        let out = Command::new("nbdinfo").args(args).output().unwrap();
        assert!(out.status.success(), "nbdinfo {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let parse = |s: &str| -> serde_json::Value { serde_json::from_str(s).unwrap() };
    // The same keys as nbdinfo's, for one export and for --list (with and without content).
    for args in [
        vec!["--json"],
        vec!["--json", "--no-content"],
        vec!["--list", "--json"],
        vec!["-L", "--json", "--content"],
    ] {
        let target = if args.iter().any(|a| a.starts_with("-L") || *a == "--list") {
            base.as_str()
        } else {
            uri
        };
        let mut a = args.clone();
        a.push(target);
        let theirs = parse(&nbdinfo(&a));
        let mut b = vec!["info"];
        b.extend(&a);
        let ours = parse(&ok(&b));
        assert_eq!(json_keys(&ours), json_keys(&theirs), "{a:?}");
        assert_eq!(ours["exports"][0]["export-size"], 4 * MIB);
    }
    // --content: file(1)'s word, as nbdinfo's.
    let theirs = parse(&nbdinfo(&["--json", uri]));
    let ours = parse(&ok(&["info", "--json", "--content", uri]));
    assert_eq!(
        ours["exports"][0]["content"],
        theirs["exports"][0]["content"]
    );
    assert!(ok(&["info", "--list", &base]).contains("export=\"disk\""));
    // --size, --map=CONTEXT and --map --totals.
    assert_eq!(ok(&["info", "--size", uri]), nbdinfo(&["--size", uri]));
    let cols = |s: &str| -> Vec<Vec<String>> {
        s.lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect())
            .collect()
    };
    assert_eq!(
        cols(&ok(&["info", "--map=base:allocation", uri])),
        cols(&nbdinfo(&["--map=base:allocation", uri]))
    );
    assert_eq!(
        cols(&ok(&["info", "--map", "--totals", uri])),
        cols(&nbdinfo(&["--map", "--totals", uri]))
    );
    let totals = parse(&ok(&["info", "--map", "--totals", "--json", uri]));
    assert_eq!(totals[0]["size"], MIB);
    let other = qpip_nbd(&["info", "--map=qemu:dirty-bitmap:b", uri]);
    let err = String::from_utf8_lossy(&other.stderr);
    assert_eq!(other.status.code(), Some(1), "{err}");
    assert!(
        err.contains("qemu:dirty-bitmap:b") && err.lines().count() == 1,
        "{err}"
    );
    // --has/--can/--is and their negations: exit status 0 yes, 2 no, 1 unknown.
    for (args, want) in [
        (["--has", "base:allocation"], 0),
        (["--has", "structured-reply"], 0),
        (["--can", "fast_zero"], 0),
        (["--can", "multi-conn"], 0),
        (["--is", "read-only"], 2),
        (["--isnt", "read-only"], 0),
        (["--cannot", "write"], 2),
        (["--hasnt", "tls"], 0),
        (["--has", "teleport"], 1),
    ] {
        let mut a = vec!["info"];
        a.extend(&args);
        a.push(uri);
        let out = qpip_nbd(&a);
        assert!(out.stdout.is_empty(), "{a:?} printed something");
        assert_eq!(out.status.code(), Some(want), "{a:?}: {out:?}");
    }
}

/// The summary line's data and zero amounts ("copied 8.0 MiB (2.0 MiB data, 6.0 MiB
/// zero/holes) ...").
fn summary(stderr: &[u8]) -> (String, String) {
    let s = String::from_utf8_lossy(stderr);
    let line = s
        .lines()
        .find(|l| l.starts_with("copied"))
        .unwrap_or_else(|| panic!("{s}"));
    let inner = &line[line.find('(').unwrap() + 1..line.find(')').unwrap()];
    let mut parts = inner.split(", ");
    (parts.next().unwrap().into(), parts.next().unwrap().into())
}

#[test]
fn copy_takes_nbdcopys_spellings_flush_and_zero_detection() {
    if !require(&["nbdcopy", "nbdkit"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB;
    // Allocated zeroes in the middle: 1 MiB data, 6 MiB of written zero bytes, 1 MiB data.
    let src = dir.path().join("src.img");
    let mut bytes = pattern(0, size as usize);
    bytes[MIB as usize..7 * MIB as usize].fill(0);
    std::fs::write(&src, &bytes).unwrap();
    assert!(allocated(&src) >= size, "the zeroes are allocated");
    let s = src.to_str().unwrap();
    let stale = || {
        let p = dir.path().join("dst.img");
        std::fs::write(&p, vec![0xEEu8; size as usize]).unwrap();
        p
    };

    // nbdcopy and qpip-nbd take the same flags and make the same destination.
    for flags in [
        vec![],
        vec!["--flush"],
        vec!["-S", "0"],
        vec!["--sparse=65536"],
        vec!["--allocated"],
        vec!["--no-extents"],
        vec!["--request-size=262144", "--queue-size=1048576"],
        vec!["--queue-size=1M"],
        vec!["--synchronous"],
        vec!["-R", "8", "-T", "2", "-C", "2"],
        vec!["--requests=4", "--threads=1", "--connections=1"],
    ] {
        for tool in ["nbdcopy", "qpip-nbd"] {
            let dst = stale();
            let server = qpip_server("dst", &dst, &[]);
            let mut cmd = if tool == "nbdcopy" {
                Command::new("nbdcopy")
            } else {
                let mut c = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"));
                c.arg("copy");
                c
            };
            let out = cmd.args(&flags).args([s, &server.uri]).output().unwrap();
            assert!(out.status.success(), "{tool} {flags:?}: {out:?}");
            drop(server);
            same(&src, &dst);
        }
    }

    // Zero detection on by default: the allocated zeroes go as WRITE_ZEROES, not data.
    let dst = stale();
    let server = qpip_server("dst", &dst, &[]);
    let out = qpip_nbd(&["copy", s, &server.uri]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        summary(&out.stderr),
        ("2.0 MiB data".into(), "6.0 MiB zero/holes".into()),
        "{out:?}"
    );
    same(&src, &dst);
    // -S 0: no detection, everything is data.
    let out = qpip_nbd(&["copy", "-S", "0", s, &server.uri]);
    assert_eq!(summary(&out.stderr).0, "8.0 MiB data", "{out:?}");
    // --destination-is-zero (and qemu-img's --target-is-zero): zeroes are not written at all.
    drop(server);
    for flag in ["--destination-is-zero", "--target-is-zero"] {
        let dst = stale();
        let server = qpip_server("dst", &dst, &[]);
        ok(&["copy", flag, s, &server.uri]);
        drop(server);
        let got = std::fs::read(&dst).unwrap();
        assert!(
            got[MIB as usize..7 * MIB as usize]
                .iter()
                .all(|&b| b == 0xEE),
            "{flag}"
        );
        assert_eq!(got[..MIB as usize], bytes[..MIB as usize], "{flag}");
    }
    // A local destination: zeroes stay holes, or are allocated with --allocated.
    let back = dir.path().join("back.img");
    ok(&["copy", s, back.to_str().unwrap()]);
    same(&src, &back);
    assert!(allocated(&back) <= 3 * MIB, "{}", allocated(&back));
    ok(&["copy", "--allocated", s, back.to_str().unwrap()]);
    same(&src, &back);
    assert!(allocated(&back) >= size, "{}", allocated(&back));

    // FLUSH only with --flush (nbdcopy's default), seen through nbdkit's log filter.
    let log = dir.path().join("nbdkit.log");
    let log_arg = format!("logfile={}", log.display());
    let peer = nbdkit(&["--filter=log", "memory", "8M", &log_arg]).unwrap();
    let flushes = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches("Flush")
            .count()
    };
    ok(&["copy", s, &peer.uri]);
    assert_eq!(flushes(), 0, "no FLUSH without --flush");
    ok(&["copy", "--flush", s, &peer.uri]);
    assert!(flushes() > 0, "--flush sends FLUSH");

    // -V is the version, as nbdcopy's.
    for v in ["-V", "--version"] {
        assert!(ok(&["copy", v]).starts_with("qpip-nbd"), "copy {v}");
    }
    // -q silences the summary; a window past 1..=64 is refused.
    let out = qpip_nbd(&["-q", "copy", s, &peer.uri]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
    let out = qpip_nbd(&["copy", "-q", s, &peer.uri]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
    for bad in [["--window", "100"], ["-R", "0"], ["--requests", "65"]] {
        let out = qpip_nbd(&["copy", bad[0], bad[1], s, &peer.uri]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("1..=64"),
            "{out:?}"
        );
    }
}

/// Issue 25 item 5: a missing TLS file is one line naming it (not OpenSSL's error stack), and
/// a client without the certificate a server requires hears that it may need one.
#[test]
fn tls_errors_name_the_file_and_the_missing_client_certificate() {
    let Some(certs) = tls_certs() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", MIB, &[]);
    // The server's certificate is missing.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::copy(certs.path().join("ca-cert.pem"), empty.join("ca-cert.pem")).unwrap();
    let out = Command::new(qpip_server_bin())
        .args(["--tls-certs", empty.to_str().unwrap(), "-l", "127.0.0.1:0"])
        .args(["--export", &format!("d={}", img.display())])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("server-cert.pem") && !err.contains("bss_file.c") && !err.contains("error:"),
        "{err}"
    );
    // A client with only the CA, against servers that require a client certificate.
    let verify = certs.path().to_str().unwrap();
    let server = qpip_server("d", &img, &["--tls-certs", verify, "--tls-verify-peer"]);
    let mut uris = vec![format!(
        "nbds://127.0.0.1:{}/d?tls-certificates={}",
        server.port,
        empty.display()
    )];
    let kit = nbdkit(&[
        "--tls=require",
        &format!("--tls-certificates={verify}"),
        "--tls-verify-peer",
        "memory",
        "1M",
    ]);
    if let Some(k) = &kit {
        uris.push(format!(
            "nbds://127.0.0.1:{}/?tls-certificates={}",
            k.port,
            empty.display()
        ));
    }
    for uri in &uris {
        for args in [
            vec!["info", uri.as_str()],
            vec!["copy", uri.as_str(), "null:"],
        ] {
            let out = qpip_nbd(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(
                err.contains("may require a client certificate"),
                "{args:?}: {err}"
            );
        }
    }
    // With the client's certificate it works.
    let ok_uri = format!(
        "nbds://127.0.0.1:{}/d?tls-certificates={verify}",
        server.port
    );
    ok(&["info", "--size", &ok_uri]);
}

/// Issue 25 item 5: `-p` ends at 100 %, a failed copy removes the file it created (and keeps
/// one it did not), and `copy` words an unknown export as `info` does.
#[test]
fn copy_progress_failure_cleanup_and_unknown_export() {
    let dir = tempfile::tempdir().unwrap();
    let src = image(dir.path(), "src.img", 256 * MIB, &[(0, 256 * MIB)]);
    let s = src.to_str().unwrap();
    // -p into a pipe: the last line shows all of it, from a file and from standard input.
    let last_progress = |out: &std::process::Output| {
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let last = err
            .lines()
            .rfind(|l| l.contains(" [") && l.contains('/'))
            .unwrap_or_else(|| panic!("no progress line: {err}"))
            .to_string();
        let (done, rest) = last.split_once('/').unwrap();
        let total = rest.split(" [").next().unwrap();
        assert_eq!(done.trim(), total.trim(), "{err}");
        assert!(total.starts_with("256"), "{err}");
    };
    last_progress(&qpip_nbd(&["copy", "-p", s, "null:"]));
    let piped = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["copy", "-p", "-", "null:"])
        .stdin(std::fs::File::open(&src).unwrap())
        .output()
        .unwrap();
    last_progress(&piped);

    // An unknown export: the one wording of info.
    let server = qpip_server("disk", &src, &[]);
    let nope = format!("nbd://127.0.0.1:{}/nope", server.port);
    let want = "the server has no export named \"nope\"; its exports: \"disk\"";
    for args in [
        vec!["info", nope.as_str()],
        vec!["copy", nope.as_str(), "null:"],
        vec!["copy", s, nope.as_str()],
    ] {
        let out = qpip_nbd(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(want) && err.lines().count() == 1,
            "{args:?}: {err}"
        );
    }
    // No export in the URI, and no default export: said so, with a URI that works.
    let none = format!("nbd://127.0.0.1:{}/", server.port);
    let err = String::from_utf8_lossy(&qpip_nbd(&["info", &none]).stderr).to_string();
    let want = format!(
        "no default export (the URI names none); its exports: \"disk\": name one in the URI (e.g. nbd://127.0.0.1:{}/disk)",
        server.port
    );
    assert!(err.contains(&want) && err.lines().count() == 1, "{err}");

    // A source that fails every read: the new destination is removed, an old one kept.
    let Some(bad) = nbdkit(&[
        "--filter=error",
        "pattern",
        "8M",
        "error-pread=EIO",
        "error-pread-rate=100%",
    ]) else {
        return;
    };
    let fresh = dir.path().join("fresh.img");
    let out = qpip_nbd(&["copy", &bad.uri, fresh.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!fresh.exists(), "the partial file is left: {err}");
    assert!(err.contains("removed"), "{err}");
    let old = dir.path().join("old.img");
    std::fs::write(&old, b"keep me").unwrap();
    let out = qpip_nbd(&["copy", &bad.uri, old.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(old.exists() && err.contains("incomplete"), "{err}");
}

/// Issue 25 item 5: the manual pages have EXIT STATUS, ENVIRONMENT and SEE ALSO sections.
#[test]
fn man_pages_have_exit_status_environment_and_see_also() {
    let dir = tempfile::tempdir().unwrap();
    for bin in [
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_qpip-nbd")),
        qpip_server_bin(),
    ] {
        let out = Command::new(&bin)
            .arg("--generate-man-pages")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    for (page, mentions) in [
        ("qpip-nbd.1", &["nbdinfo(1)", "nbdcopy(1)", "RUST_LOG"][..]),
        ("qpip-nbd-info.1", &["nbdinfo(1)", "2"][..]),
        ("qpip-nbd-copy.1", &["nbdcopy(1)", "130"][..]),
        (
            "qpip-nbd-server.1",
            &["qemu-nbd(8)", "nbdkit(1)", "LISTEN_FDS"][..],
        ),
    ] {
        let roff = std::fs::read_to_string(dir.path().join(page)).unwrap();
        for section in ["EXIT STATUS", "ENVIRONMENT", "SEE ALSO"] {
            assert!(
                roff.contains(&format!(".SH \"{section}\"")),
                "{page} lacks {section}"
            );
        }
        for m in mentions {
            assert!(roff.contains(m), "{page} does not mention {m}");
        }
    }
    // The synopsis says what each option takes, as man shows it.
    let text = Command::new("man")
        .arg("-l")
        .arg(dir.path().join("qpip-nbd-server.1"))
        .env("MANWIDTH", "1000")
        .output()
        .unwrap();
    // Overstrikes (bold, underline) undone, as col -b does.
    let mut plain_text = String::new();
    for c in String::from_utf8_lossy(&text.stdout).chars() {
        if c == '\u{8}' {
            plain_text.pop();
        } else {
            plain_text.push(c);
        }
    }
    let text = plain_text;
    for want in ["[-l|--listen ADDR:PORT]...", "[--cache CACHE]", "[FILE...]"] {
        let plain: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(plain.contains(want), "the SYNOPSIS lacks {want}: {text}");
    }
}

/// Runs `program args` with its standard output a pipe whose reader is already gone, as
/// `| true` leaves it when the reader wins the race: every write fails with EPIPE. The
/// command must end as nbdinfo and nbdcopy end then (killed by SIGPIPE, status 141 in a
/// shell) or succeed, never panic.
fn with_stdout_closed(program: &std::path::Path, args: &[&str]) {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(program)
        .args(args)
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let what = format!(
        "{} {args:?}: {:?}, stderr: {err}",
        program.display(),
        out.status
    );
    assert!(!err.contains("panicked"), "{what}");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "{what}"
    );
}

#[test]
fn every_command_that_prints_ends_quietly_when_its_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 4 * MIB, &[(0, 64 * 1024)]);
    let server = qpip_server("disk", &img, &[]);
    let nbd = std::path::Path::new(env!("CARGO_BIN_EXE_qpip-nbd"));
    let at = format!("nbd://127.0.0.1:{}", server.port);
    for args in [
        vec!["info", &server.uri],
        vec!["info", "--json", &server.uri],
        vec!["info", "--list", &at],
        vec!["info", "--size", &server.uri],
        vec!["info", "--map", &server.uri],
        vec!["info", "--json", "--map", &server.uri],
        vec!["info", "--map", "--totals", &server.uri],
        vec!["info", "--json", "--map", "--totals", &server.uri],
        vec!["list", &at],
        vec!["list", "--json", &at],
        vec!["copy", &server.uri, "-"],
        vec!["--help"],
        vec!["copy", "--help"],
        vec!["--version"],
        vec!["copy", "-V"],
    ] {
        with_stdout_closed(nbd, &args);
    }
    let bench = workspace_bin("qpip-bench", "qpip-bench");
    with_stdout_closed(&bench, &["lanai", "--quick"]);
    with_stdout_closed(&bench, &["--help"]);
    for (package, bin) in [
        ("nbd-server", "qpip-nbd-server"),
        ("fuse-mount", "qpip-nbd-mount"),
        ("qpip-cli", "qpip-lanai-bridge"),
    ] {
        with_stdout_closed(&workspace_bin(package, bin), &["--help"]);
    }
}

/// Issue 34 (habits): `info`, `--list`, `--map` and `--map --totals` print nbdinfo's text
/// byte for byte against the same export: its columns and widths, no blank line between
/// listed exports, and can_df as libnbd reads it (from the connection's flags, which carry
/// SEND_DF once structured replies are negotiated).
#[test]
fn info_text_is_nbdinfos_byte_for_byte() {
    if !require(&["nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Offsets past ten digits, so that the map's columns widen as nbdinfo's do.
    let size = 16 << 30;
    let img = image(
        dir.path(),
        "a.img",
        size,
        &[(0, MIB), (5 * MIB, 3 * MIB), (size - MIB, MIB)],
    );
    let other = image(dir.path(), "b.img", 4 * MIB, &[(MIB, MIB)]);
    let server = qpip_server(
        "disk",
        &img,
        &[
            "--export",
            &format!("other={}", other.display()),
            "--description",
            "other=a second disk",
        ],
    );
    let uri = server.uri.as_str();
    let base = format!("nbd://127.0.0.1:{}", server.port);
    for args in [
        vec![uri],
        vec!["--no-content", uri],
        vec!["--map", uri],
        vec!["--map=base:allocation", uri],
        vec!["--map", "--totals", uri],
        vec!["--list", &base],
        vec!["--list", "--content", &base],
    ] {
        let theirs = Command::new("nbdinfo").args(&args).output().unwrap();
        assert!(theirs.status.success(), "nbdinfo {args:?}: {theirs:?}");
        let mut ours = vec!["info"];
        ours.extend(&args);
        let ours = ok(&ours);
        let theirs = String::from_utf8(theirs.stdout).unwrap();
        assert!(
            ours == theirs,
            "{args:?}:\nnbdinfo:\n{theirs}\nqpip-nbd:\n{ours}"
        );
    }
    for feature in ["df", "structured-reply", "fua", "multi-conn"] {
        let theirs = Command::new("nbdinfo")
            .args(["--can", feature, uri])
            .status()
            .unwrap();
        let ours = qpip_nbd(&["info", "--can", feature, uri]);
        assert_eq!(ours.status.code(), theirs.code(), "--can {feature}");
    }
}

/// Issue 34 (habits): a server that cannot be reached is one line that names its URI once
/// ("cannot connect to URI: ..."), for info, list and either side of a copy.
#[test]
fn a_refused_connection_names_the_uri_once() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", MIB, &[(0, MIB)]);
    let uri = format!("nbd://127.0.0.1:{}/x", free_port());
    let at = format!("nbd://127.0.0.1:{}", free_port());
    let back = dir.path().join("back.img");
    let (img, back) = (img.to_str().unwrap(), back.to_str().unwrap());
    for (args, named) in [
        (vec!["info", &uri], &uri),
        (vec!["info", "--map", &uri], &uri),
        (vec!["info", "--list", &at], &at),
        (vec!["list", &at], &at),
        (vec!["copy", img, &uri], &uri),
        (vec!["copy", &uri, back], &uri),
    ] {
        let out = qpip_nbd(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert_eq!(err.matches(named.as_str()).count(), 1, "{args:?}: {err}");
        assert!(err.contains("cannot connect to"), "{args:?}: {err}");
    }
}

/// The bytes READ asked of an nbdkit export, from its log filter's file.
fn nbdkit_read_bytes(log: &std::path::Path) -> u64 {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(" Read "))
        .filter_map(|l| l.split(" count=0x").nth(1))
        .filter_map(|c| u64::from_str_radix(c.split_whitespace().next()?, 16).ok())
        .sum()
}

/// Issue 34 (habits): `copy --verify` is sparse-aware, as `qemu-img compare`: what reads as
/// zeroes on both sides is not read (a 256 MiB export holding 2 MiB of data is read for
/// those 2 MiB, where it was read whole); a side that reads as zeroes where the other holds
/// data is still caught, either way round.
#[test]
fn verify_reads_only_what_holds_data() {
    if !require(&["nbdkit"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 256 * MIB;
    let src = image(dir.path(), "src.img", size, &[(0, MIB), (100 * MIB, MIB)]);
    let s = src.to_str().unwrap();
    let log = dir.path().join("nbdkit.log");
    let peer = nbdkit(&[
        "--filter=log",
        "memory",
        "256M",
        &format!("logfile={}", log.display()),
    ])
    .unwrap();
    ok(&["copy", "--verify", s, &peer.uri]);
    let read = nbdkit_read_bytes(&log);
    assert!(read <= 2 * MIB, "--verify read {read} bytes of the export");
    let back = dir.path().join("back.img");
    ok(&["copy", "--verify", &peer.uri, back.to_str().unwrap()]);
    same(&src, &back);
    drop(peer);

    // Data where the source has a hole: stale bytes the copy was told not to zero.
    let stale = image(dir.path(), "stale.img", size, &[(50 * MIB, MIB)]);
    let server = qpip_server("stale", &stale, &[]);
    let out = qpip_nbd(&["copy", "--verify", "--destination-is-zero", s, &server.uri]);
    let err = String::from_utf8_lossy(&out.stderr);
    let first = |off: u64| {
        off + pattern(off, MIB as usize)
            .iter()
            .position(|&b| b != 0)
            .unwrap() as u64
    };
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("differ at offset {}", first(50 * MIB))),
        "{err}"
    );
    // Holes where the source has data: a destination that drops every write.
    let null = nbdkit(&["null", "256M"]).unwrap();
    let out = qpip_nbd(&["copy", "--verify", s, &null.uri]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("differ at offset {}", first(0))),
        "{err}"
    );
}

/// `qpip-nbd ARGS` with `input` on its standard input (a pipe, as `cat img |` gives it).
fn qpip_nbd_fed(args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let fed = child.stdin.take().unwrap().write_all(input);
    let out = child.wait_with_output().unwrap();
    // A copy that stops reading early breaks the pipe: what it said is the useful part.
    assert!(fed.is_ok(), "feeding {args:?}: {fed:?}; {out:?}");
    out
}

/// Issue 34 (habits): a sparse image piped in stays sparse, as with nbdcopy: blocks of
/// zeroes (-S, 4 KiB by default) go as WRITE_ZEROES to an export (which then holds the
/// image's data, not 64 MiB) and stay holes in a local file, and the summary says so; -S 0
/// writes them as data.
#[test]
fn a_sparse_image_piped_in_stays_sparse() {
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * MIB;
    let mut bytes = vec![0u8; size as usize];
    for (off, len) in [(0, MIB), (20 * MIB, 2 * MIB)] {
        bytes[off as usize..(off + len) as usize].copy_from_slice(&pattern(off, len as usize));
    }
    let stale = |name: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, vec![0xEEu8; size as usize]).unwrap();
        p
    };
    let dst = stale("dst.img");
    let server = qpip_server("dst", &dst, &[]);
    for sparse in [vec![], vec!["-S", "4096"]] {
        let mut args = vec!["copy"];
        args.extend(&sparse);
        args.extend(["-", &server.uri]);
        let out = qpip_nbd_fed(&args, &bytes);
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert_eq!(
            summary(&out.stderr),
            ("3.0 MiB data".into(), "61.0 MiB zero/holes".into()),
            "{args:?}"
        );
        assert!(
            std::fs::read(&dst).unwrap() == bytes,
            "{args:?}: the export differs"
        );
        assert!(
            allocated(&dst) <= 4 * MIB,
            "{args:?}: {} bytes allocated",
            allocated(&dst)
        );
    }
    let out = qpip_nbd_fed(&["copy", "-S", "0", "-", &server.uri], &bytes);
    assert_eq!(summary(&out.stderr).0, "64.0 MiB data", "{out:?}");
    drop(server);
    assert!(std::fs::read(&dst).unwrap() == bytes);

    let local = dir.path().join("local.img");
    let out = qpip_nbd_fed(&["copy", "-", local.to_str().unwrap()], &bytes);
    assert!(out.status.success(), "{out:?}");
    assert!(std::fs::read(&local).unwrap() == bytes);
    assert!(
        allocated(&local) <= 4 * MIB,
        "{} bytes allocated",
        allocated(&local)
    );
}

/// Issue 34 (habits): -S 0 allocates a local destination's zeroes, as nbdcopy's -S 0 does (a
/// fresh file kept them as holes whatever -S said, and the summary counted them as data):
/// a source file holding allocated zeroes and holes makes the same file as nbdcopy's.
#[test]
fn s0_allocates_a_local_destinations_zeroes_as_nbdcopy() {
    if !require(&["nbdcopy"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * MIB;
    let src = image(dir.path(), "src.img", size, &[(0, MIB)]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&src)
        .unwrap()
        .write_all_at(&vec![0u8; 8 * MIB as usize], 8 * MIB)
        .unwrap();
    let s = src.to_str().unwrap();
    let (ours, theirs) = (dir.path().join("ours.img"), dir.path().join("theirs.img"));
    ok(&["copy", "-S", "0", s, ours.to_str().unwrap()]);
    let st = Command::new("nbdcopy")
        .args(["-S", "0", s, theirs.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
    same(&src, &ours);
    assert_eq!(
        allocated(&ours),
        allocated(&theirs),
        "-S 0: ours vs nbdcopy's"
    );
    assert!(allocated(&ours) >= 9 * MIB, "{}", allocated(&ours));
    // And with zero detection on, both leave the zeroes as holes.
    ok(&["copy", s, ours.to_str().unwrap()]);
    assert!(allocated(&ours) <= 2 * MIB, "{}", allocated(&ours));
}

#[test]
fn progress_to_a_descriptor_writes_nbdcopys_percent_lines() {
    let dir = tempfile::tempdir().unwrap();
    let src = image(dir.path(), "src.img", 16 * MIB, &[(0, 4 * MIB)]);
    let (dst, lines) = (dir.path().join("dst.img"), dir.path().join("progress"));
    let out = Command::new("sh")
        .arg("-c")
        .arg(r#""$0" copy --progress=3 "$1" "$2" 3>"$3""#)
        .args([
            env!("CARGO_BIN_EXE_qpip-nbd").as_ref(),
            src.as_os_str(),
            dst.as_os_str(),
            lines.as_os_str(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    same(&src, &dst);
    let text = std::fs::read_to_string(&lines).unwrap();
    assert_eq!(text.lines().last(), Some("100/100"), "{text:?}");
    for l in text.lines() {
        let n = l.strip_suffix("/100").and_then(|n| n.parse::<u32>().ok());
        assert!(n.is_some_and(|n| n <= 100), "{l:?} in {text:?}");
    }
    // A descriptor that is not open is one line naming it.
    let bad = qpip_nbd(&[
        "copy",
        "--progress=200",
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--progress=200") && err.trim().lines().count() == 1,
        "{err}"
    );
}

/// `qpip-nbd info --map=qemu:allocation-depth` (and `--totals`) and the contexts `info
/// --list` shows are nbdinfo's, text for text, against qemu-nbd -A and qpip-nbd-server -A
/// serving a qcow2 overlay over a qcow2 over a raw base (issue 35).
#[test]
fn info_maps_any_context_and_lists_contexts_as_nbdinfo() {
    if !require(&["nbdinfo", "qemu-nbd", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, "base.raw", 3 * MIB, &[(64 << 10, 64 << 10)]);
    let sh = |cmd: &str| {
        let out = Command::new("sh")
            .current_dir(d)
            .args(["-c", cmd])
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd}: {out:?}");
    };
    sh(
        "qemu-img create -q -f qcow2 -b base.raw -F raw mid.qcow2 4M \
        && qemu-io -f qcow2 -c 'write -P 2 512k 64k' mid.qcow2 >/dev/null \
        && qemu-img create -q -f qcow2 -b mid.qcow2 -F qcow2 top.qcow2 4M \
        && qemu-io -f qcow2 -c 'write -P 3 1M 64k' -c 'write -z 1536k 64k' top.qcow2 >/dev/null",
    );
    let top = d.join("top.qcow2");
    let ours = qpip_server("x", &top, &["-r", "-A"]);
    let top_s = top.display().to_string();
    let Some(theirs) = qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            "-r",
            "-t",
            "-A",
            "-f",
            "qcow2",
            "-x",
            "x",
            "-b",
            "127.0.0.1",
            &top_s,
        ],
        "nbd://127.0.0.1:PORT/x",
    ) else {
        return;
    };
    let nbdinfo = |args: &[&str]| {
        let out = Command::new("nbdinfo").args(args).output().unwrap();
        assert!(out.status.success(), "nbdinfo {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let contexts = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("\t\t"))
            .map(|l| l.trim().to_string())
            .collect()
    };
    for uri in [ours.uri.as_str(), theirs.uri.as_str()] {
        for args in [
            vec!["--map=qemu:allocation-depth"],
            vec!["--map=qemu:allocation-depth", "--totals"],
            vec!["--map=base:allocation"],
        ] {
            let mut a = args.clone();
            a.push(uri);
            let mut b = vec!["info"];
            b.extend(&a);
            assert_eq!(ok(&b), nbdinfo(&a), "{a:?}");
        }
        let listed = contexts(&ok(&["info", "--list", uri]));
        assert_eq!(listed, ["base:allocation", "qemu:allocation-depth"]);
        assert_eq!(listed, contexts(&nbdinfo(&["--list", uri])), "{uri}");
    }
    assert!(ok(&["info", "--map=qemu:allocation-depth", &ours.uri]).contains("backing depth 3"));
}

/// `qpip-nbd copy --map CONTEXT` copies only the extents the context marks (flags not 0) and
/// leaves the rest of an existing destination file as it was (issue 35): with
/// qemu:allocation-depth of a qcow2 image, its data and zero clusters, not what it lacks.
#[test]
fn copy_map_copies_only_the_marked_extents() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("a.qcow2");
    let out = Command::new("sh")
        .current_dir(d)
        .args([
            "-c",
            "qemu-img create -q -f qcow2 a.qcow2 4M \
             && qemu-io -f qcow2 -c 'write -P 1 1M 64k' -c 'write -z 2M 64k' a.qcow2 >/dev/null",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let server = qpip_server("a", &img, &["-r", "-A"]);
    let dst = d.join("backup.raw");
    std::fs::write(&dst, vec![0xee; 4 * MIB as usize]).unwrap();
    let dst_s = dst.to_str().unwrap();
    ok(&["copy", "--map", "qemu:allocation-depth", &server.uri, dst_s]);
    let got = std::fs::read(&dst).unwrap();
    assert_eq!(got.len(), 4 * MIB as usize);
    let (data, zero) = (
        (MIB as usize)..(MIB as usize + (64 << 10)),
        (2 * MIB as usize)..(2 * MIB as usize + (64 << 10)),
    );
    for (i, b) in got.iter().enumerate() {
        let want = if data.contains(&i) {
            1
        } else if zero.contains(&i) {
            0
        } else {
            0xee
        };
        assert_eq!(*b, want, "byte {i}");
    }
    // Refused in one line each: base:allocation, a file source, --verify, a context the
    // server does not offer.
    let src_file = d.join("src.raw");
    std::fs::write(&src_file, [0u8; 4096]).unwrap();
    for (args, word) in [
        (
            vec!["--map", "base:allocation", &server.uri, dst_s],
            "base:allocation",
        ),
        (
            vec![
                "--map",
                "qemu:allocation-depth",
                src_file.to_str().unwrap(),
                dst_s,
            ],
            "NBD export",
        ),
        (
            vec![
                "--map",
                "qemu:allocation-depth",
                "--verify",
                &server.uri,
                dst_s,
            ],
            "--verify",
        ),
        (
            vec!["--map", "qemu:dirty-bitmap:b0", &server.uri, dst_s],
            "no such metadata context",
        ),
    ] {
        let mut a = vec!["copy"];
        a.extend(&args);
        let out = qpip_nbd(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{a:?}: {err}");
        assert!(
            err.contains(word) && err.lines().count() == 1,
            "{a:?}: {err}"
        );
    }
    // The destination was left alone by the refused copies.
    assert_eq!(std::fs::read(&dst).unwrap(), got);

    // An incremental copy of a qcow2 dirty bitmap's dirty extents, from qemu-nbd -B.
    let out = Command::new("sh")
        .current_dir(d)
        .args([
            "-c",
            "qemu-img create -q -f qcow2 bm.qcow2 4M && qemu-img bitmap --add bm.qcow2 b0 \
             && qemu-io -f qcow2 -c 'write -P 7 3M 64k' bm.qcow2 >/dev/null",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let bm = d.join("bm.qcow2").display().to_string();
    let Some(qemu) = qpip_test_support::servers::tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            "-r",
            "-t",
            "-f",
            "qcow2",
            "-B",
            "b0",
            "-x",
            "b",
            "-b",
            "127.0.0.1",
            &bm,
        ],
        "nbd://127.0.0.1:PORT/b",
    ) else {
        return;
    };
    std::fs::write(&dst, vec![0xee; 4 * MIB as usize]).unwrap();
    ok(&["copy", "--map", "qemu:dirty-bitmap:b0", &qemu.uri, dst_s]);
    let got = std::fs::read(&dst).unwrap();
    let dirty = (3 * MIB as usize)..(3 * MIB as usize + (64 << 10));
    for (i, b) in got.iter().enumerate() {
        assert_eq!(*b, if dirty.contains(&i) { 7 } else { 0xee }, "byte {i}");
    }
}
