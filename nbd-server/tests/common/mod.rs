//! nbd-server's own test helpers: starting the binary under test, and qemu-io with its
//! failure check. The rest (peers, the CI rule, patterns, timed peer runs) is
//! qpip-test-support's.
#![allow(dead_code, unused_imports)] // each test crate uses a different subset

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

pub(crate) use qpip_test_support::ci::{missing, require, root};
pub(crate) use qpip_test_support::pattern::seeded as pattern;
pub(crate) use qpip_test_support::pattern::sparse_image as image;
pub(crate) use qpip_test_support::process::{peer_fails, peer_ok, run_with_timeout, text};
pub(crate) use qpip_test_support::servers::{Peer, ServerProcess, tcp_peer};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_qpip-nbd-server");

/// The server under test on `listen` (see [`ServerProcess::start`]) with the extra `args`.
pub(crate) fn start_server(listen: &str, args: &[String]) -> ServerProcess {
    ServerProcess::start(Path::new(BIN), listen, args, &[])
}

/// As [`start_server`], with extra environment variables for the server.
pub(crate) fn start_server_env(
    listen: &str,
    args: &[String],
    env: &[(&str, &Path)],
) -> ServerProcess {
    ServerProcess::start(Path::new(BIN), listen, args, env)
}

/// [`start_server`] on 127.0.0.1:0.
pub(crate) fn start_server_v4(args: &[String]) -> ServerProcess {
    start_server("127.0.0.1:0", args)
}

/// `qemu-io -f raw URI -c CMD...`, asserting success and that no command reported a failure
/// (qemu-io prints "Pattern verification failed" or "... failed: ..." for failed commands).
pub(crate) fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut c = std::process::Command::new("qemu-io");
    c.arg("-f").arg("raw");
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    c.arg(uri);
    let t = peer_ok(&mut c);
    assert!(
        !t.contains("failed") && !t.contains("error"),
        "qemu-io {cmds:?} on {uri} reported a failure:\n{t}"
    );
    t
}

/// `qemu-img check` of `path`, run in `cwd` (where relative backing names resolve), finds
/// neither errors nor leaked clusters.
pub(crate) fn check_clean_in(path: &str, cwd: &Path) -> String {
    let check = peer_ok(
        std::process::Command::new("qemu-img")
            .current_dir(cwd)
            .args(["check", path]),
    );
    assert!(check.contains("No errors were found"), "{check}");
    check
}

/// The disk of internal snapshot `snap` of `img`, as raw bytes (qemu-img convert -l), by
/// way of the file `out`.
pub(crate) fn snapshot_disk(img: &str, snap: &str, out: &Path) -> Vec<u8> {
    peer_ok(std::process::Command::new("qemu-img").args([
        "convert",
        "-l",
        &format!("snapshot.name={snap}"),
        "-O",
        "raw",
        img,
        out.to_str().unwrap(),
    ]));
    std::fs::read(out).unwrap()
}

/// String args from literals.
/// `qemu-img ARGS` in `dir` (so that backing file names given relative stay relative).
pub(crate) fn qemu_img_in(dir: &Path, args: &[&str]) -> String {
    peer_ok(
        std::process::Command::new("qemu-img")
            .current_dir(dir)
            .args(args),
    )
}

/// `qemu-io -f FORMAT TARGET -c CMD...` in `dir`, asserting that no command failed (qemu-io
/// exits 0 and prints "failed" or "error" for a command that did not succeed).
pub(crate) fn qemu_io_in<S: AsRef<str>>(dir: &Path, format: &str, target: &str, cmds: &[S]) {
    let mut c = std::process::Command::new("qemu-io");
    c.current_dir(dir).args(["-f", format, target]);
    for cmd in cmds {
        c.args(["-c", cmd.as_ref()]);
    }
    let out = peer_ok(&mut c);
    assert!(
        !out.contains("failed") && !out.contains("error"),
        "qemu-io {target}: a command failed:\n{out}"
    );
}

/// `nbdinfo ARGS URI`'s output, the URI's port written as PORT.
pub(crate) fn nbdinfo(args: &[&str], peer: &Peer) -> String {
    let out = peer_ok(
        std::process::Command::new("nbdinfo")
            .args(args)
            .arg(&peer.uri),
    );
    // Only the URI's port: a bare number would also match extents (port 39321 in 393216).
    out.replace(&format!(":{}/", peer.port), ":PORT/")
}

/// qemu-nbd serving `d/file` in `format` as export "x" on 127.0.0.1, persistent, with the
/// `extra` flags (None: qemu-nbd is missing, outside CI).
pub(crate) fn qemu_nbd_x(d: &Path, file: &str, format: &str, extra: &[&str]) -> Option<Peer> {
    let path = d.join(file).display().to_string();
    let args = [
        &["-t", "-f", format, "-x", "x", "-b", "127.0.0.1"][..],
        extra,
        &[&path],
    ]
    .concat();
    tcp_peer("qemu-nbd", "-p", &args, "nbd://127.0.0.1:PORT/x")
}

pub(crate) fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// The holes of the sparse-upload tests, each longer than the maximum block size (32 MiB), so
/// that an upload sends each as one WRITE_ZEROES or TRIM past it (issue 25).
pub(crate) const UPLOAD_HOLES: [u64; 3] = [40 << 20, 128 << 20, 2048 << 20];

/// `dir/src.raw`: 1 MiB of data before, between and after the [`UPLOAD_HOLES`]; its size.
pub(crate) fn sparse_upload_source(dir: &Path) -> (std::path::PathBuf, u64) {
    const MIB: u64 = 1 << 20;
    let size = UPLOAD_HOLES.iter().sum::<u64>() + 4 * MIB;
    let mut data = Vec::new();
    let mut at = 0;
    for hole in UPLOAD_HOLES {
        data.push((at, MIB));
        at += MIB + hole;
    }
    data.push((at, MIB));
    let src = qpip_test_support::pattern::image_with(dir, "src.raw", size, &data);
    (src, size)
}

/// qemu-io commands that write 1 MiB of 0x77 into the middle of each of the source's holes:
/// data an upload must zero.
pub(crate) fn junk_in_upload_holes() -> Vec<String> {
    const MIB: u64 = 1 << 20;
    let mut at = MIB;
    UPLOAD_HOLES
        .iter()
        .map(|hole| {
            let w = format!("write -P 0x77 {} 1M", at + hole / 2);
            at += MIB + hole;
            w
        })
        .collect()
}

/// The server must fail at once, exit 1, with one line naming the file and every word.
pub(crate) fn refused(args: &[&str], words: &[&str]) {
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

/// The big-endian u64 at `at` of `b`.
pub(crate) fn be_u64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

/// Patches `bytes` into the file at `at`.
pub(crate) fn patch(path: &str, at: u64, bytes: &[u8]) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, at)
        .unwrap();
}

/// Stops `srv` with SIGTERM and waits for its clean exit (a qcow2 image's bitmaps and
/// metadata stored).
pub(crate) fn stop(mut srv: ServerProcess) {
    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_timeout(Duration::from_secs(20))
            .is_some_and(|s| s.success()),
        "{}",
        srv.log()
    );
}
