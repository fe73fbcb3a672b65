//! NBD servers as child processes on 127.0.0.1 (or a Unix socket, or qpip-nbd-server in a
//! network namespace: [`qpip_server_in`]), each killed when its guard drops:
//! qpip-nbd-server ([`ServerProcess`], or [`qpip_server`] as a plain [`Peer`]), and the peers
//! qemu-nbd, nbdkit and Debian's nbd-server. A peer that is not installed is `None` under the
//! CI rule ([`crate::ci::have`]).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::bins::qpip_server_bin;
use crate::ci::{have, require};
use crate::net::{LISTEN_TIMEOUT, free_port, wait_port, wait_socket};
use crate::netns::Netns;

/// What qpip-nbd-server prints once it listens, before the address.
const LISTENING: &str = "qpip-nbd-server: listening on ";

/// Reads a qpip-nbd-server's stderr until its "listening on ADDR" line (None if it exits
/// or stays silent for [`LISTEN_TIMEOUT`]), and keeps draining it, passing every line on to
/// the test's stderr, so that the server never blocks on a full pipe.
fn listen_line(stderr: ChildStderr) -> Option<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(a) = line.trim().strip_prefix(LISTENING) {
                let _ = tx.send(a.to_string());
            }
            eprintln!("{line}");
        }
    });
    rx.recv_timeout(LISTEN_TIMEOUT).ok()
}

/// Waits for the "listening on ADDR" line in the server's stderr log `log` (None if `child`
/// exits or the line does not come within [`LISTEN_TIMEOUT`]).
fn listen_line_in(log: &Path, child: &mut Child) -> Option<String> {
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        // Only whole lines: the server may be half-way through writing this one (a cut
        // address failed to parse once, in CI).
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        if let Some(a) = whole.lines().find_map(|l| l.trim().strip_prefix(LISTENING)) {
            return Some(a.to_string());
        }
        if t.elapsed() > LISTEN_TIMEOUT || child.try_wait().ok().flatten().is_some() {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A server process and how to reach it, killed on drop.
pub struct Peer {
    /// The server process (for a daemonizing one, the process that started it).
    pub child: Child,
    /// For servers that daemonize (nbd-server): the PID file of the real server.
    pub pidfile: Option<PathBuf>,
    /// 0 for a server on a Unix socket.
    pub port: u16,
    /// The NBD URI of its export.
    pub uri: String,
    _dir: Option<tempfile::TempDir>,
}

impl Peer {
    fn new(child: Child, port: u16, uri: String) -> Peer {
        Peer {
            child,
            pidfile: None,
            port,
            uri,
            _dir: None,
        }
    }

    /// Kills the server and waits for it.
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

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// qpip-nbd-server (built by [`qpip_server_bin`]) on a free port exporting `name` = `path`,
/// with `extra` arguments.
pub fn qpip_server(name: &str, path: &Path, extra: &[&str]) -> Peer {
    qpip_server_on(0, name, path, extra)
}

/// [`qpip_server`] on `port` (0: a free one).
pub fn qpip_server_on(port: u16, name: &str, path: &Path, extra: &[&str]) -> Peer {
    qpip_server_at(None, port, name, path, extra)
}

/// [`qpip_server_on`] inside the network namespace `ns`, on its address.
pub fn qpip_server_in(ns: &Netns, port: u16, name: &str, path: &Path, extra: &[&str]) -> Peer {
    qpip_server_at(Some(ns), port, name, path, extra)
}

fn qpip_server_at(ns: Option<&Netns>, port: u16, name: &str, path: &Path, extra: &[&str]) -> Peer {
    let host = ns.map_or("127.0.0.1", |n| &n.ns_ip);
    let mut cmd = Command::new(qpip_server_bin());
    cmd.args(["--listen", &format!("{host}:{port}"), "--log", "warn"])
        .arg("--export")
        .arg(format!("{name}={}", path.display()))
        .args(extra)
        .stderr(Stdio::piped());
    if let Some(n) = ns {
        n.enter(&mut cmd);
    }
    let mut child = cmd.spawn().expect("starting qpip-nbd-server");
    let addr = listen_line(child.stderr.take().expect("piped stderr"));
    let Some(addr) = addr else {
        let _ = child.kill();
        panic!("qpip-nbd-server exited or stayed silent before listening");
    };
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    Peer::new(child, port, format!("nbd://{host}:{port}/{name}"))
}

/// qemu-nbd exporting `path` (raw) as `name`, persistent, 8 clients, discards passed on.
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
    Some(Peer::new(
        child,
        port,
        format!("nbd://127.0.0.1:{port}/{name}"),
    ))
}

/// nbdkit with `args` (a plugin, filters and parameters); its URI names the default export.
pub fn nbdkit(args: &[&str]) -> Option<Peer> {
    let uri = "nbd://127.0.0.1:PORT/";
    tcp_peer(
        "nbdkit",
        "-p",
        &[&["-f", "-i", "127.0.0.1", "--exit-with-parent"], args].concat(),
        uri,
    )
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
    Some(Peer::new(
        child,
        port,
        uri.replace("PORT", &port.to_string()),
    ))
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
    let uri = format!("nbd+unix:///{export}?socket={}", sock.display());
    let mut peer = Peer::new(child, 0, uri);
    peer._dir = Some(dir);
    Some(peer)
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
    let mut peer = Peer::new(child, port, format!("nbd://127.0.0.1:{port}/{name}"));
    peer.pidfile = Some(pidfile);
    peer._dir = Some(dir);
    Some(peer)
}

/// Throwaway TLS credentials (scripts/tls-test-certs): ca-cert.pem, server-cert.pem,
/// server-key.pem, client-cert.pem, client-key.pem, keys.psk (user alice), other-ca/.
/// None (a skip, under the CI rule) without certtool and psktool.
pub fn tls_certs() -> Option<tempfile::TempDir> {
    if !require(&["certtool", "psktool"]) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tls-test-certs");
    let status = Command::new(&script).arg(dir.path()).status().unwrap();
    assert!(status.success(), "{} failed ({status})", script.display());
    Some(dir)
}

/// A running qpip-nbd-server with its stderr kept in a log, killed on drop: for the tests
/// that watch the server itself (its log, memory, signals, exit).
pub struct ServerProcess {
    child: Option<Child>,
    /// The address it printed that it listens on.
    pub addr: SocketAddr,
    /// The Unix-domain socket, for a server that printed one first (`--socket` alone).
    pub unix: Option<PathBuf>,
    /// Its process id.
    pub pid: u32,
    stderr_log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl ServerProcess {
    /// Starts `bin` listening on `listen` (e.g. `127.0.0.1:0` or `[::1]:0`; "" for none: the
    /// args say where) with the extra `args` and environment `env`, and waits for its
    /// "listening on ADDR" line on stderr.
    pub fn start(bin: &Path, listen: &str, args: &[String], env: &[(&str, &Path)]) -> Self {
        let logdir = tempfile::tempdir().unwrap();
        let stderr_log = logdir.path().join("server.stderr");
        let listen_args: &[&str] = if listen.is_empty() {
            &[]
        } else {
            &["--listen", listen]
        };
        let mut child = Command::new(bin)
            .envs(env.iter().copied())
            .args(listen_args)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr_log).unwrap())
            .spawn()
            .expect("starting qpip-nbd-server");
        let line = listen_line_in(&stderr_log, &mut child);
        let mut s = ServerProcess {
            pid: child.id(),
            child: Some(child),
            addr: "0.0.0.0:0".parse().unwrap(),
            unix: None,
            stderr_log,
            _logdir: logdir,
        };
        match line {
            Some(a) => match a.strip_prefix("unix:") {
                Some(path) => s.unix = Some(path.into()),
                None => s.addr = a.parse().expect("listen address"),
            },
            None => panic!(
                "the server did not print its listening address; args {args:?}; stderr:\n{}",
                s.log()
            ),
        }
        s
    }

    /// The TCP port it listens on.
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
