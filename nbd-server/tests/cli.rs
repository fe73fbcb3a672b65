//! The command line as a user meets it: bad values give one clear line naming what is wrong
//! and a non-zero exit, before anything is served.

mod common;

use std::process::Command;

use common::*;

/// Runs the server with `args`; it must fail at once with `code` and one line of stderr
/// containing every one of `words`.
fn refused(args: &[&str], code: i32, words: &[&str]) {
    let out = run_with_timeout(
        Command::new(BIN).args(args),
        std::time::Duration::from_secs(20),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.contains(" INFO ")).collect();
    assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
    for w in words {
        assert!(lines[0].contains(w), "{args:?}: {w:?} not in {stderr}");
    }
}

#[test]
fn a_bad_log_level_is_refused_not_silently_off() {
    refused(&["--log", "verbose"], 2, &["--log", "verbose", "level"]);
}

#[test]
fn create_zero_and_create_of_another_size_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let new = dir.path().join("new.img");
    let spec = format!("disk={}", new.display());
    refused(
        &[
            "--export",
            &spec,
            "--create",
            "0",
            "--listen",
            "127.0.0.1:0",
        ],
        1,
        &["--create 0"],
    );
    assert!(!new.exists(), "a 0-byte image was created");
    let old = image(dir.path(), "old.img", 1 << 20);
    let spec = format!("disk={}", old.display());
    refused(
        &[
            "--export",
            &spec,
            "--create",
            "2M",
            "--listen",
            "127.0.0.1:0",
        ],
        1,
        &["old.img", "1048576", "2097152"],
    );
}

#[test]
fn an_image_on_a_read_only_file_system_suggests_read_only() {
    if !root("mounting a read-only tmpfs needs it") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 1 << 20);
    // A read-only bind mount of the directory: the file exists but cannot be opened to write.
    let ro = tempfile::tempdir().unwrap();
    let mount = |args: &[&str]| {
        let st = Command::new("mount").args(args).status().unwrap();
        assert!(st.success(), "mount {args:?}");
    };
    mount(&[
        "--bind",
        dir.path().to_str().unwrap(),
        ro.path().to_str().unwrap(),
    ]);
    mount(&["-o", "remount,bind,ro", ro.path().to_str().unwrap()]);
    let spec = format!("disk={}", ro.path().join("disk.img").display());
    let out = run_with_timeout(
        Command::new(BIN).args(["--export", &spec, "--listen", "127.0.0.1:0"]),
        std::time::Duration::from_secs(20),
    );
    let _ = Command::new("umount").arg(ro.path()).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("disk.img") && stderr.contains("--read-only"),
        "{stderr}"
    );
    drop(img);
}

#[test]
fn an_address_in_use_fails_before_any_image_is_created() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("new.img");
    let spec = format!("disk={}", img.display());
    refused(
        &["--export", &spec, "--create", "1M", "--listen", &addr],
        1,
        &[&addr, "in use"],
    );
    assert!(
        !img.exists(),
        "the image was created before the address was tried"
    );
}

#[test]
fn port_bind_and_bare_port_listen_like_qemu_nbd() {
    let port = |p: std::net::TcpListener| p.local_addr().unwrap().port();
    // Free ports: bind, read, release (the server binds them a moment later).
    let (a, b) = (
        port(std::net::TcpListener::bind("127.0.0.1:0").unwrap()),
        port(std::net::TcpListener::bind("127.0.0.1:0").unwrap()),
    );
    let srv = start_server(
        "",
        &["-b".into(), "localhost".into(), "-p".into(), a.to_string()],
    );
    assert_eq!(srv.addr.port(), a);
    assert!(srv.addr.ip().is_loopback());
    drop(srv);
    let srv = start_server(&b.to_string(), &[]);
    assert_eq!(srv.addr.port(), b);
    drop(srv);
    // -c and -d no longer mean --config and --description (qemu-nbd's connect/disconnect).
    let out = Command::new(BIN).args(["-c", "x.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-c (qemu-nbd's): the kernel's NBD client"),
        "{err}"
    );
}

#[test]
fn images_are_locked_the_way_qemu_locks_them() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 1 << 20);
    let spec = format!("disk={}", img.display());
    let writer = start_server_v4(&["--export".into(), spec.clone()]);
    // A second writer and a reader are refused while the first writes.
    refused(
        &["--export", &spec, "--listen", "127.0.0.1:0"],
        1,
        &["disk.img", "in use", "--force-share"],
    );
    refused(
        &["-r", "--export", &spec, "--listen", "127.0.0.1:0"],
        1,
        &["disk.img", "in use"],
    );
    // ... unless told to share.
    let shared = start_server_v4(&["-U".into(), "--export".into(), spec.clone()]);
    drop(shared);
    // qemu sees our locks.
    if require(&["qemu-io"]) {
        let out = run_with_timeout(
            Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 512", img.to_str().unwrap()]),
            std::time::Duration::from_secs(20),
        );
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("lock"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    drop(writer);
    // Readers share with readers.
    let r1 = start_server_v4(&["-r".into(), "--export".into(), spec.clone()]);
    let r2 = start_server_v4(&["-r".into(), "--export".into(), spec.clone()]);
    drop((r1, r2));
}

#[test]
fn logging_follows_the_one_convention_of_every_binary() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 1 << 20);
    let export = format!("d={}", img.display());
    // The server logs at info by default; stderr is a pipe here, so no colour codes.
    let run = |args: &[&str], rust_log: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args(["--export", &export, "--run", "exit 0"])
            .args(args);
        match rust_log {
            Some(v) => cmd.env("RUST_LOG", v),
            None => cmd.env_remove("RUST_LOG"),
        };
        let out = run_with_timeout(&mut cmd, std::time::Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let log = run(&[], None);
    assert!(log.contains(" INFO "), "{log}");
    assert!(
        !log.contains('\x1b'),
        "colour codes in a redirected log: {log:?}"
    );
    let log = run(&["-q"], None);
    assert!(!log.contains(" INFO "), "-q: {log}");
    let log = run(&["-qv"], None);
    assert!(log.contains(" INFO "), "-qv: {log}");
    let log = run(&["-vv"], None);
    assert!(log.contains("TRACE") || log.contains("DEBUG"), "-vv: {log}");
    let log = run(&["--log", "error", "-v"], None);
    assert!(
        !log.contains(" INFO ") && !log.contains("DEBUG"),
        "--log error -v: {log}"
    );
    let log = run(&["-vv"], Some("warn"));
    assert!(
        !log.contains(" INFO "),
        "RUST_LOG=warn overrides -vv: {log}"
    );
    for bad in ["loud", "nbd_server"] {
        let out = run_with_timeout(
            Command::new(BIN).env("RUST_LOG", bad),
            std::time::Duration::from_secs(20),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "RUST_LOG={bad}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("RUST_LOG") && err.contains(bad), "{err}");
    }
}

#[test]
fn limits_of_zero_are_refused() {
    refused(
        &["--max-connections", "0"],
        1,
        &["--max-connections 0", "above 0"],
    );
    refused(
        &["--max-handshakes", "0"],
        1,
        &["--max-handshakes 0", "above 0"],
    );
}

#[test]
fn qemu_nbd_forms_that_make_no_sense_here_are_refused_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let a = image(dir.path(), "a.img", 1 << 20);
    let b = image(dir.path(), "b.img", 1 << 20);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let l = ["--listen", "127.0.0.1:0"];
    // qemu-nbd serves one image.
    refused(
        &[&l[..], &[a, b]].concat(),
        1,
        &["2 image files", "--export"],
    );
    // -x names the positional image.
    refused(
        &[&l[..], &["-x", "disk"]].concat(),
        1,
        &["-x", "FILE", "--export disk="],
    );
    // As qemu-nbd: unmapping zero writes needs discards passed on.
    refused(
        &[&l[..], &["--discard=ignore", "--detect-zeroes=unmap", a]].concat(),
        1,
        &["--detect-zeroes unmap", "--discard unmap"],
    );
    let out = run_with_timeout(
        Command::new(BIN).args([&l[..], &["--discard=trim", a]].concat()),
        std::time::Duration::from_secs(20),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("'trim'") && stderr.contains("ignore"),
        "{stderr}"
    );
    // The export must keep at least a byte, as qemu-nbd's "Offset has to be smaller".
    refused(
        &[&l[..], &["-o", "1M", a]].concat(),
        1,
        &["--offset 1048576", "a.img", "1048576 bytes"],
    );
    refused(
        &[&l[..], &["--offset", "x", a]].concat(),
        1,
        &["--offset", "\"x\""],
    );
    // -D and a plain --description TEXT want one export.
    let (ea, eb) = (format!("a={a}"), format!("b={b}"));
    refused(
        &[&l[..], &["-e", &ea, "-e", &eb, "-D", "t"]].concat(),
        1,
        &["-D", "2 exports", "NAME=TEXT"],
    );
    refused(
        &[&l[..], &["-e", &ea, "--description", "x=y"]].concat(),
        1,
        &["no export named \"x\"", "-D TEXT"],
    );
}

#[test]
fn handshake_limit_drops_a_silent_client_as_qemu_nbds_does() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let a = image(dir.path(), "a.img", 1 << 20);
    // A client that says nothing after the greeting is dropped after --handshake-limit.
    let s = start_server_v4(&args(&[
        "--handshake-limit",
        "1",
        "-e",
        &format!("d={}", a.display()),
    ]));
    let mut c = std::net::TcpStream::connect(s.addr).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(8)))
        .unwrap();
    let t = std::time::Instant::now();
    let mut buf = [0u8; 256];
    let mut got = 0;
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => panic!("still open after {:?} ({got} bytes read): {e}", t.elapsed()),
        }
    }
    assert!(got >= 18, "no greeting before the close ({got} bytes)");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn an_export_that_is_a_fifo_is_left_out_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let ok = image(dir.path(), "ok.img", 1 << 20);
    let t = std::time::Instant::now();
    let s = start_server_v4(&args(&[
        "--export",
        &format!("pipe={}", fifo.display()),
        "--export",
        &format!("ok={}", ok.display()),
    ]));
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    assert!(s.log().contains("is a FIFO"), "{}", s.log());
    qemu_io(&s.uri("ok"), &["read 0 4k"]);
}
