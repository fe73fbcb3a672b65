//! The server with TLS (--tls, --tls-certs, --tls-psk): qemu-img and qemu-io with their
//! tls-creds-x509 and tls-creds-psk objects, nbdinfo and nbdcopy over nbds://, and the
//! refusals: plaintext against --tls require, wrong CA, wrong PSK, garbage in the handshake.
//! Credentials are made at test time (scripts/tls-test-certs).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use nbd_proto::consts as c;
use nbd_proto::handshake::messages::{OptionReplyHeader, encode_option};

const MIB: u64 = 1 << 20;

fn certs() -> Option<tempfile::TempDir> {
    if !require(&["certtool", "psktool"]) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tls-test-certs");
    assert!(
        Command::new(script)
            .arg(dir.path())
            .status()
            .unwrap()
            .success()
    );
    Some(dir)
}

fn server(img: &Path, tls: &[&str]) -> ServerProcess {
    let mut a = args(tls);
    a.extend(args(&["--export", &format!("disk={}", img.display())]));
    start_server_v4(&a)
}

fn x509_object(dir: &Path) -> String {
    format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        dir.display()
    )
}

fn psk_object(dir: &Path) -> String {
    format!(
        "tls-creds-psk,id=tls0,dir={},username=alice,endpoint=client",
        dir.display()
    )
}

/// qemu-io over TLS with the creds `object`; returns its output.
fn qemu_io_tls(srv: &ServerProcess, object: &str, cmds: &[&str]) -> String {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["--object", object, "--image-opts"]);
    cmd.arg(format!(
        "driver=nbd,host=127.0.0.1,port={},export=disk,tls-creds=tls0",
        srv.port()
    ));
    for c in cmds {
        cmd.args(["-c", c]);
    }
    peer_ok(&mut cmd)
}

#[test]
fn qemu_io_nbdinfo_nbdcopy_with_x509_and_psk() {
    if !require(&["qemu-io", "nbdinfo", "nbdcopy"]) {
        return;
    }
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 8 * MIB);
    for (flags, object, query) in [
        (
            vec!["--tls-certs", d.to_str().unwrap()],
            x509_object(d),
            format!("tls-certificates={}", d.display()),
        ),
        (
            vec![
                "--tls",
                "require",
                "--tls-psk",
                d.join("keys.psk").to_str().unwrap(),
            ],
            psk_object(d),
            format!("tls-psk-file={}", d.join("keys.psk").display()),
        ),
    ] {
        let srv = server(&img, &flags);
        qemu_io_tls(
            &srv,
            &object,
            &["write -P 0x7e 1M 1M", "read -P 0x7e 1M 1M", "flush"],
        );
        // libnbd takes the PSK identity from the URI's user part.
        let uri = format!("nbds://alice@localhost:{}/disk?{query}", srv.port());
        let size = peer_ok(Command::new("nbdinfo").args(["--size", &uri]));
        assert_eq!(size.trim(), (8 * MIB).to_string());
        let copy = dir.path().join("copy.img");
        peer_ok(Command::new("nbdcopy").args([&uri, copy.to_str().unwrap()]));
        assert!(std::fs::read(&copy).unwrap() == std::fs::read(&img).unwrap());
        assert!(srv.log().contains("tls=true"), "{}", srv.log());
    }
}

#[test]
fn client_certificates_are_checked_with_verify_peer() {
    if !require(&["qemu-img", "nbdinfo"]) {
        return;
    }
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let srv = server(
        &img,
        &["--tls-certs", d.to_str().unwrap(), "--tls-verify-peer"],
    );
    // qemu-img presents client-cert.pem from the directory.
    let info = peer_ok(Command::new("qemu-img").args([
        "info",
        "--object",
        &x509_object(d),
        "--image-opts",
        &format!(
            "driver=nbd,host=127.0.0.1,port={},export=disk,tls-creds=tls0",
            srv.port()
        ),
    ]));
    assert!(info.contains("1 MiB"), "{info}");
    // A client without a certificate is turned away.
    let anon = tempfile::tempdir().unwrap();
    std::fs::copy(d.join("ca-cert.pem"), anon.path().join("ca-cert.pem")).unwrap();
    let uri = format!(
        "nbds://localhost:{}/disk?tls-certificates={}",
        srv.port(),
        anon.path().display()
    );
    peer_fails(Command::new("nbdinfo").args(["--size", &uri]));
}

#[test]
fn wrong_ca_and_wrong_psk_are_refused() {
    if !require(&["nbdinfo"]) {
        return;
    }
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let srv = server(&img, &["--tls-certs", d.to_str().unwrap()]);
    let uri = format!(
        "nbds://localhost:{}/disk?tls-certificates={}",
        srv.port(),
        d.join("other-ca").display()
    );
    peer_fails(Command::new("nbdinfo").args(["--size", &uri]));
    let img = image(dir.path(), "other.img", MIB);
    let psk_srv = server(&img, &["--tls-psk", d.join("keys.psk").to_str().unwrap()]);
    let wrong = dir.path().join("wrong.psk");
    std::fs::write(&wrong, format!("alice:{}\n", "ab".repeat(32))).unwrap();
    let uri = format!(
        "nbds://alice@localhost:{}/disk?tls-psk-file={}",
        psk_srv.port(),
        wrong.display()
    );
    peer_fails(Command::new("nbdinfo").args(["--size", &uri]));
}

fn start(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut g = [0u8; c::GREETING_LEN];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(c::FLAG_C_FIXED_NEWSTYLE | c::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

fn option(s: &mut TcpStream, option: u32, data: &[u8]) -> u32 {
    let mut out = Vec::new();
    encode_option(option, data, &mut out);
    s.write_all(&out).unwrap();
    let mut h = [0u8; c::OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = OptionReplyHeader::parse(&h).unwrap();
    let mut rest = vec![0u8; h.length as usize];
    s.read_exact(&mut rest).unwrap();
    h.reply_type
}

#[test]
fn plaintext_against_require_gets_tls_reqd_and_can_abort() {
    if !require(&["nbdinfo"]) {
        return;
    }
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let srv = server(
        &img,
        &["--tls", "require", "--tls-certs", d.to_str().unwrap()],
    );
    let mut s = start(srv.port());
    for o in [c::OPT_LIST, c::OPT_STRUCTURED_REPLY, c::OPT_GO] {
        assert_eq!(option(&mut s, o, &[]), c::REP_ERR_TLS_REQD, "option {o}");
    }
    assert_eq!(option(&mut s, c::OPT_ABORT, &[]), c::REP_ACK);
    // With --tls on, plaintext clients are served too.
    let img = image(dir.path(), "other.img", MIB);
    let on = server(&img, &["--tls", "on", "--tls-certs", d.to_str().unwrap()]);
    let size = peer_ok(Command::new("nbdinfo").args(["--size", &on.uri("disk")]));
    assert_eq!(size.trim(), MIB.to_string());
}

#[test]
fn garbage_in_the_tls_handshake_is_a_clean_disconnect() {
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let mut srv = server(&img, &["--tls-certs", d.to_str().unwrap()]);
    let mut s = start(srv.port());
    assert_eq!(option(&mut s, c::OPT_STARTTLS, &[]), c::REP_ACK);
    s.write_all(b"\x16\x03\x01\x00\x05garbage that is no ClientHello")
        .unwrap();
    let mut buf = [0u8; 1024];
    // The server may answer with a TLS alert, then closes.
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    srv.assert_alive("after garbage in a TLS handshake");
    // The connection's end is logged once its thread has seen the failure.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !srv.log().contains("TLS handshake") {
        assert!(std::time::Instant::now() < deadline, "{}", srv.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // And the server still serves TLS clients.
    let mut s = start(srv.port());
    assert_eq!(option(&mut s, c::OPT_LIST, &[]), c::REP_ERR_TLS_REQD);
}

#[test]
fn tls_options_are_checked_before_serving() {
    let Some(creds) = certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", MIB);
    let run = |a: &[&str]| {
        let mut all = args(a);
        all.extend(args(&["--export", &format!("disk={}", img.display())]));
        let o = run_with_timeout(Command::new(BIN).args(&all), Duration::from_secs(30));
        assert!(!o.status.success(), "{a:?} was accepted");
        let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    let e = run(&["--tls", "require"]);
    assert!(e.contains("--tls-certs") && e.contains("--tls-psk"), "{e}");
    let missing = dir.path().join("nocerts");
    std::fs::create_dir(&missing).unwrap();
    let e = run(&["--tls-certs", missing.to_str().unwrap()]);
    assert!(e.contains("server-cert.pem"), "{e}");
    let e = run(&["--tls", "off", "--tls-certs", d.to_str().unwrap()]);
    assert!(e.contains("--tls off"), "{e}");
    let bad = dir.path().join("bad.psk");
    std::fs::write(&bad, "alice:xyz\n").unwrap();
    let e = run(&["--tls-psk", bad.to_str().unwrap()]);
    assert!(e.contains("bad.psk") && e.contains("line 1"), "{e}");
}
