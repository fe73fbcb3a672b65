//! Test peers: our qpip-nbd-server, qemu-nbd, nbdkit and Debian's nbd-server, each started as
//! a child process on 127.0.0.1 and killed when dropped. A missing peer skips the test, except
//! in CI (CI=true) where it is a failure.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub struct Peer {
    pub child: Child,
    /// For servers that daemonize (nbd-server): the PID file of the real server.
    pub pidfile: Option<PathBuf>,
    pub port: u16,
    pub uri: String,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Peer {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(pid) = self
            .pidfile
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            // SAFETY: plain syscall; the pid is the server this test started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

/// Is `tool` installed? In CI a missing tool fails the test; elsewhere it is skipped.
pub fn have(tool: &str) -> bool {
    let found = std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| d.join(tool).is_file())
            || ["/usr/sbin", "/sbin"]
                .iter()
                .any(|d| Path::new(d).join(tool).is_file())
    });
    if !found {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("{tool} is required in CI but is not installed");
        }
        eprintln!("skipping: {tool} is not installed");
    }
    found
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until something listens on `port`, without connecting (some servers handle one
/// connection only, or log probes).
pub fn wait_port(port: u16) {
    let t = Instant::now();
    let listening = || {
        ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
            std::fs::read_to_string(f).is_ok_and(|s| {
                s.lines().skip(1).any(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.len() > 3
                        && cols[3] == "0A"
                        && cols[1].rsplit(':').next() == Some(&format!("{port:04X}"))
                })
            })
        })
    };
    while !listening() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "peer did not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The qpip-nbd-server binary, built once.
pub fn qpip_server_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| workspace_bin("nbd-server", "qpip-nbd-server"))
        .clone()
}

/// Builds binary `bin` of workspace package `package` and returns its path (works in a clean
/// clone: it is built with the same cargo into the same target directory as the tests).
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    // target/debug/deps/<test> → target/debug
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let path = dir.join(bin);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // With the features scripts/test builds the workspace with (QPIP_FEATURES, e.g.
    // "--features nbd-server/rbd"), those of this package, so that this build does not
    // replace a binary the other tests run with one that lacks them.
    let all = std::env::var("QPIP_FEATURES").unwrap_or_default();
    let own: Vec<&str> = all
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|f| {
            f.strip_prefix(package)
                .is_some_and(|rest| rest.starts_with('/'))
        })
        .collect();
    let features = if own.is_empty() {
        Vec::new()
    } else {
        vec!["--features".to_string(), own.join(",")]
    };
    let status = Command::new(cargo)
        .args(["build", "-q", "-p", package, "--bin", bin])
        .args(&features)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap_or_else(|e| panic!("running cargo build for {bin}: {e}"));
    assert!(status.success(), "building {bin} failed");
    assert!(path.is_file(), "{} missing after build", path.display());
    path
}

/// Starts qpip-nbd-server on `port` (0: any) exporting `name` = `path`.
pub fn qpip_server(name: &str, path: &Path, port: u16) -> Peer {
    let mut child = Command::new(qpip_server_bin())
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--export",
            &format!("{name}={}", path.display()),
            "--log",
            "warn",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting qpip-nbd-server");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "qpip-nbd-server exited before listening"
        );
        if let Some(a) = line.trim().strip_prefix("qpip-nbd-server: listening on ") {
            break a.to_string();
        }
    };
    // Keep draining stdout so the server never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut s = String::new();
        while out.read_line(&mut s).is_ok_and(|n| n > 0) {
            s.clear();
        }
    });
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    Peer {
        child,
        port,
        uri: format!("nbd://127.0.0.1:{port}/{name}"),
        pidfile: None,
        _dir: None,
    }
}

pub fn qemu_nbd(name: &str, path: &Path) -> Option<Peer> {
    if !have("qemu-nbd") {
        return None;
    }
    let port = free_port();
    let child = Command::new("qemu-nbd")
        .args(["-f", "raw", "-b", "127.0.0.1", "-p", &port.to_string()])
        .args(["-x", name, "--persistent", "--shared=8", "--discard=unmap"])
        .arg(path)
        .stderr(Stdio::null())
        .spawn()
        .expect("starting qemu-nbd");
    wait_port(port);
    Some(Peer {
        child,
        port,
        uri: format!("nbd://127.0.0.1:{port}/{name}"),
        pidfile: None,
        _dir: None,
    })
}

/// nbdkit with `args` (a plugin and its parameters).
pub fn nbdkit(args: &[&str]) -> Option<Peer> {
    if !have("nbdkit") {
        return None;
    }
    let port = free_port();
    let child = Command::new("nbdkit")
        .args([
            "-f",
            "-p",
            &port.to_string(),
            "-i",
            "127.0.0.1",
            "--exit-with-parent",
        ])
        .args(args)
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nbdkit");
    wait_port(port);
    Some(Peer {
        child,
        port,
        uri: format!("nbd://127.0.0.1:{port}/"),
        pidfile: None,
        _dir: None,
    })
}

/// Waits until a server has created its Unix socket at `path`.
pub fn wait_socket(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing listens on {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `program` with `args` serving on a Unix socket in a fresh directory: `socket_flag PATH`
/// is added. The URI names `export`.
pub fn unix_peer(program: &str, socket_flag: &str, args: &[&str], export: &str) -> Option<Peer> {
    if !have(program) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("peer.sock");
    let child = Command::new(program)
        .arg(socket_flag)
        .arg(&sock)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {program}: {e}"));
    wait_socket(&sock);
    Some(Peer {
        child,
        port: 0,
        uri: format!("nbd+unix:///{export}?socket={}", sock.display()),
        pidfile: None,
        _dir: Some(dir),
    })
}

/// Debian's nbd-server (simple replies only) exporting `path` as `name`.
pub fn debian_nbd_server(name: &str, path: &Path) -> Option<Peer> {
    if !have("nbd-server") {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = dir.path().join("config");
    std::fs::write(
        &cfg,
        format!(
            "[generic]\n    port = {port}\n    listenaddr = 127.0.0.1\n    oldstyle = false\n    allowlist = true\n\
             [{name}]\n    exportname = {}\n    flush = true\n    fua = true\n    trim = true\n",
            path.display()
        ),
    )
    .unwrap();
    let pidfile = dir.path().join("pid");
    let child = Command::new("nbd-server")
        .arg("-C")
        .arg(&cfg)
        .arg("-p")
        .arg(&pidfile)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nbd-server");
    wait_port(port);
    Some(Peer {
        child,
        port,
        uri: format!("nbd://127.0.0.1:{port}/{name}"),
        pidfile: Some(pidfile),
        _dir: Some(dir),
    })
}

/// A sparse image of `size` bytes with a recognisable pattern in the given ranges.
pub fn image(dir: &Path, name: &str, size: u64, data: &[(u64, u64)]) -> PathBuf {
    use std::os::unix::fs::FileExt;
    let path = dir.join(name);
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    for &(off, len) in data {
        f.write_all_at(&pattern(off, len as usize), off).unwrap();
    }
    path
}

/// Deterministic bytes that depend on the absolute offset.
pub fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (offset + i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 56) as u8 ^ ((offset + i) >> 12) as u8
        })
        .collect()
}

/// Throwaway TLS credentials (scripts/tls-test-certs): ca-cert.pem, server-cert.pem,
/// server-key.pem, client-cert.pem, client-key.pem, keys.psk (user alice), other-ca/.
pub fn tls_certs() -> Option<tempfile::TempDir> {
    if !have("certtool") || !have("psktool") {
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

/// `program` with `args` listening on a free port of 127.0.0.1 (`port_flag PORT` added);
/// the URI is `uri` with PORT replaced.
pub fn tcp_peer(program: &str, port_flag: &str, args: &[&str], uri: &str) -> Option<Peer> {
    if !have(program) {
        return None;
    }
    let port = free_port();
    let child = Command::new(program)
        .arg(port_flag)
        .arg(port.to_string())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {program}: {e}"));
    wait_port(port);
    Some(Peer {
        child,
        port,
        uri: uri.replace("PORT", &port.to_string()),
        pidfile: None,
        _dir: None,
    })
}
