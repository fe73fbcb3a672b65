//! Shared helpers for the integration tests: a server process guard, image files, and a
//! runner for peer commands (qemu-img, qemu-io, nbdinfo, nbdcopy, fio) with a timeout.
#![allow(dead_code)] // each test crate uses a different subset

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_qpip-nbd-server");

/// True when running in CI, where a missing peer is a failure rather than a skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Checks that each peer program is installed. In CI a missing one panics; elsewhere the
/// caller skips the test (returns false) after a note on stderr.
pub fn require(peers: &[&str]) -> bool {
    let missing: Vec<&str> = peers
        .iter()
        .copied()
        .filter(|p| {
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {p}"))
                .stdout(Stdio::null())
                .status()
                .map(|s| !s.success())
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    if in_ci() {
        panic!("CI=true and required peer(s) {missing:?} are not installed (run scripts/setup)");
    }
    eprintln!("note: skipping this test: peer(s) {missing:?} not installed (run scripts/setup)");
    false
}

/// Creates a sparse image file of `size` bytes.
pub fn image(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    path
}

/// A running qpip-nbd-server, killed on drop.
pub struct ServerProcess {
    child: Option<Child>,
    pub addr: SocketAddr,
    /// The Unix-domain socket, for a server that printed one first (`--socket` alone).
    pub unix: Option<PathBuf>,
    pub pid: u32,
    stderr_log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts the server listening on `listen` (e.g. "127.0.0.1:0" or "[::1]:0"; "" for none:
    /// the args say where) with the extra `args`, and waits for its "listening on ADDR" line.
    pub fn start(listen: &str, args: &[String]) -> ServerProcess {
        Self::start_env(listen, args, &[])
    }

    /// As [`Self::start`], with extra environment variables for the server.
    pub fn start_env(listen: &str, args: &[String], env: &[(&str, &Path)]) -> ServerProcess {
        let logdir = tempfile::tempdir().unwrap();
        let stderr_log = logdir.path().join("server.stderr");
        let listen_args: &[&str] = if listen.is_empty() {
            &[]
        } else {
            &["--listen", listen]
        };
        let mut child = Command::new(BIN)
            .envs(env.iter().copied())
            .args(listen_args)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_log).unwrap())
            .spawn()
            .expect("starting qpip-nbd-server");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(a) = line.strip_prefix("qpip-nbd-server: listening on ") {
                    let _ = tx.send(a.trim().to_string());
                }
            }
        });
        let mut s = ServerProcess {
            pid: child.id(),
            child: Some(child),
            addr: "0.0.0.0:0".parse().unwrap(),
            unix: None,
            stderr_log,
            _logdir: logdir,
        };
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(a) => match a.strip_prefix("unix:") {
                Some(path) => s.unix = Some(path.into()),
                None => s.addr = a.parse().expect("listen address"),
            },
            Err(_) => panic!(
                "the server did not print its listening address; args {args:?}; stderr:\n{}",
                s.log()
            ),
        }
        s
    }

    /// Starts on 127.0.0.1:0 with the given args.
    pub fn start_v4(args: &[String]) -> ServerProcess {
        Self::start("127.0.0.1:0", args)
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `nbd://host:port/export`, with IPv6 hosts in brackets; `nbd+unix:///export?socket=`
    /// for a server on a Unix socket only.
    pub fn uri(&self, export: &str) -> String {
        match &self.unix {
            Some(p) => format!("nbd+unix:///{export}?socket={}", p.display()),
            None => format!("nbd://{}/{export}", self.addr),
        }
    }

    /// The server's stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Still running?
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// Panics (with the server's log) unless the process is still running.
    pub fn assert_alive(&mut self, when: &str) {
        if !self.alive() {
            let st = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            panic!(
                "the server died {when} (status {st:?}); stderr:\n{}",
                self.log()
            );
        }
    }

    /// Resident set size in KiB, from /proc/PID/status.
    pub fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Sends a signal to the server.
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        let r = unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        assert_eq!(r, 0, "kill({}, {sig})", self.pid);
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit, up to `timeout`; None if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let c = self.child.as_mut()?;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs a command with a timeout; returns its output (it is killed on timeout, and the test
/// panics).
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e}"));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = t_out.join().unwrap();
            let stderr = t_err.join().unwrap();
            panic!(
                "{desc} timed out after {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

/// Both streams as text, for assertions and panic messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a peer command (60 s limit) and asserts it succeeded; returns stdout + stderr.
pub fn peer_ok(cmd: &mut Command) -> String {
    let desc = format!("{cmd:?}");
    let o = run_with_timeout(cmd, Duration::from_secs(60));
    let t = text(&o);
    assert!(o.status.success(), "{desc} failed ({}):\n{t}", o.status);
    t
}

/// Runs a peer command (60 s limit) and asserts it failed; returns stdout + stderr.
pub fn peer_fails(cmd: &mut Command) -> String {
    let desc = format!("{cmd:?}");
    let o = run_with_timeout(cmd, Duration::from_secs(60));
    let t = text(&o);
    assert!(!o.status.success(), "{desc} should have failed:\n{t}");
    t
}

/// `qemu-io -f raw URI -c CMD...`, asserting success and that no command reported a failure
/// (qemu-io prints "Pattern verification failed" or "... failed: ..." for failed commands).
pub fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
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

/// Deterministic pseudo-random bytes (xorshift), so failures are reproducible.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// String args from literals.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}
