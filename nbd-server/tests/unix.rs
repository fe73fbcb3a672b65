//! The server on a Unix-domain socket (`--socket`, qemu-nbd's -k): qemu-io, qemu-img and
//! nbdinfo reach it through nbd+unix:// URIs; the socket is its owner's only and goes away
//! when the server exits.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::Command;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

#[test]
fn qemu_io_and_nbdinfo_over_a_unix_socket() {
    if !require(&["qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 16 * MIB);
    let sock = dir.path().join("nbd.sock");
    let mut srv = start_server(
        "",
        &args(&[
            "--socket",
            sock.to_str().unwrap(),
            "--export",
            &format!("disk={}", img.display()),
        ]),
    );
    assert_eq!(srv.unix.as_deref(), Some(sock.as_path()));
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    let uri = srv.uri("disk");
    qemu_io(
        &uri,
        &[
            "write -P 0x5a 1M 1M",
            "read -P 0x5a 1M 1M",
            "write -z 0 64k",
            "flush",
        ],
    );
    let info = peer_ok(Command::new("nbdinfo").args(["--size", &uri]));
    assert_eq!(info.trim(), (16 * MIB).to_string());
    let qinfo = peer_ok(Command::new("qemu-img").args(["info", &uri]));
    assert!(qinfo.contains("16 MiB"), "{qinfo}");

    srv.signal(libc::SIGTERM);
    let st = srv
        .wait_timeout(Duration::from_secs(20))
        .expect("exit after SIGTERM");
    assert!(st.success(), "{st:?}");
    assert!(!sock.exists(), "the socket file is left behind");
}

#[test]
fn run_gets_a_unix_uri_and_tcp_is_not_opened() {
    if !require(&["nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 4 * MIB);
    let sock = dir.path().join("run.sock");
    let o = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_qpip-nbd-server")).args([
            "-k",
            sock.to_str().unwrap(),
            "--export",
            &format!("disk={}", img.display()),
            "--run",
            "echo \"uri=$uri sock=$unixsocket port=$port\"; nbdinfo --size \"$uri\"",
        ]),
        Duration::from_secs(60),
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let want = format!(
        "uri=nbd+unix:///disk?socket={} sock={} port=\n",
        sock.display(),
        sock.display()
    );
    assert!(out.contains(&want), "{out}");
    assert!(out.contains(&(4 * MIB).to_string()), "{out}");
    // Only the socket: no TCP listener on the default port.
    assert!(!out.contains("listening on 127.0.0.1"), "{out}");
    assert!(!sock.exists());
}

#[test]
fn a_socket_path_in_the_way_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"x").unwrap();
    let o = run_with_timeout(
        Command::new(env!("CARGO_BIN_EXE_qpip-nbd-server")).args([
            "--socket",
            file.to_str().unwrap(),
            "--export",
            &format!("disk={}", img.display()),
        ]),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(file.to_str().unwrap()) && err.contains("not a socket"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}
