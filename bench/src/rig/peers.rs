//! Peer servers: qpip-nbd-server, nbdkit, qemu-nbd and Debian's nbd-server (on a file) or
//! qpip-nbd-server and qemu-nbd on an RBD image, each a child process on a port of 127.0.0.1
//! (with `--netns`: of the namespace's address, the process started inside it), stopped (SIGTERM, then SIGKILL) by a guard. Also where the programs are found, and the
//! prerequisites of the fio-driven experiments.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::in_path;
use super::netns::Side;

pub(crate) const EXPORT: &str = "bench";
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The soft NIC's engine thread, as named by qpip-core.
pub(crate) const NIC_THREAD: &str = "qpip-soft-nic";

/// The servers, in their default order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // NbdServer is the program's name: nbd-server
pub(crate) enum Server {
    Qpip,
    Nbdkit,
    QemuNbd,
    /// Debian's nbd-server (used by `nbd ext2`; not part of `nbd raw`).
    NbdServer,
    /// qpip-nbd-server serving an RBD image (`nbd raw --rbd-conf`).
    QpipRbd,
    /// qemu-nbd serving an RBD image through its rbd driver (`nbd raw --rbd-conf`).
    QemuNbdRbd,
}

impl Server {
    pub(crate) const ALL: [Server; 3] = [Server::Qpip, Server::Nbdkit, Server::QemuNbd];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Server::Qpip => "qpip",
            Server::Nbdkit => "nbdkit",
            Server::QemuNbd => "qemu-nbd",
            Server::NbdServer => "nbd-server",
            Server::QpipRbd => "qpip-rbd",
            Server::QemuNbdRbd => "qemu-nbd-rbd",
        }
    }

    pub(crate) fn is_rbd(self) -> bool {
        matches!(self, Server::QpipRbd | Server::QemuNbdRbd)
    }
}

/// The Ceph cluster of the RBD rows.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RbdBench {
    pub conf: PathBuf,
    pub pool: String,
    /// qemu-nbd has its rbd driver (qemu-block-extra of the installed qemu): its row is run.
    pub qemu: bool,
}

/// Whether this machine's qemu has its rbd block driver: asking qemu-img about an image of
/// a pool that no cluster has fails either way, but without the driver it says so.
pub(crate) fn qemu_has_rbd(conf: &Path) -> bool {
    let out = Command::new("qemu-img")
        .args(["info", "-f", "raw"])
        .arg(format!(
            "rbd:qpip-bench-probe/none:conf={}:client_mount_timeout=3",
            conf.display()
        ))
        .output();
    match out {
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            !(err.contains("Unable to load module rbd") || err.contains("Unknown protocol"))
        }
        Err(_) => false,
    }
}

/// The qpip-nbd-server next to this executable (same target directory).
pub(crate) fn default_server_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the qpip-bench executable")?;
    let dir = exe
        .parent()
        .with_context(|| format!("{} has no parent directory", exe.display()))?;
    Ok(dir.join("qpip-nbd-server"))
}

// ---------------------------------------------------------------- prerequisites

/// For the mount experiments: fails with one message listing `missing` (what the caller
/// found wanting) and every program of `progs` (name, Debian package) not in PATH, and
/// /dev/fuse if it is absent.
pub(crate) fn require_fuse_and(progs: &[(&str, &str)], mut missing: Vec<String>) -> Result<()> {
    for (prog, pkg) in progs {
        if in_path(prog).is_none() {
            missing.push(format!("{prog} not found in PATH (package {pkg})"));
        }
    }
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse does not exist (modprobe fuse)".into());
    }
    if !missing.is_empty() {
        bail!("missing prerequisites:\n  {}", missing.join("\n  "));
    }
    Ok(())
}

/// Fails with a message naming every missing program.
pub(crate) fn check_prerequisites(server_bin: &Path) -> Result<()> {
    let mut missing = Vec::new();
    if !server_bin.is_file() {
        missing.push(format!(
            "qpip-nbd-server not found at {} (build it: cargo build --release -p nbd-server, \
             or pass --server-bin PATH)",
            server_bin.display()
        ));
    }
    for (prog, why) in [
        ("fio", "the NBD client (package fio, with its nbd engine)"),
        ("nbdkit", "a peer server (package nbdkit, file plugin)"),
        ("qemu-nbd", "a peer server (package qemu-utils)"),
    ] {
        if in_path(prog).is_none() {
            missing.push(format!("{prog} not found in PATH: it is {why}"));
        }
    }
    if missing.is_empty() {
        let ok = Command::new("fio")
            .arg("--enghelp=nbd")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            missing.push("fio has no nbd engine (fio --enghelp=nbd fails)".into());
        }
    }
    if !missing.is_empty() {
        bail!("missing prerequisites:\n  {}", missing.join("\n  "));
    }
    Ok(())
}

pub(crate) fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe; the closure touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            // Dies with us even if we are killed before our guards run.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

/// A running server process: SIGTERM, then SIGKILL after a timeout, on drop.
pub(crate) struct Running {
    server: Server,
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// The server requires TLS.
    tls: bool,
}

impl Running {
    pub(crate) fn server(&self) -> Server {
        self.server
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(20)..];
        if tail.is_empty() {
            "(no output)".into()
        } else {
            tail.join("\n")
        }
    }

    pub(crate) fn uri(&self) -> String {
        if self.tls {
            // fio's libnbd may not read local files (the CA), so the certificate is not checked.
            format!("nbds://{}/{EXPORT}?tls-verify-peer=false", self.addr)
        } else {
            format!("nbd://{}/{EXPORT}", self.addr)
        }
    }

    /// Stops the server; reports how it ended.
    pub(crate) fn stop(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        // SAFETY: kill with a pid we own (our unreaped child) has no memory-safety concerns.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        while t0.elapsed() < STOP_TIMEOUT {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!(
            "{} (pid {}) ignored SIGTERM for {STOP_TIMEOUT:?}; killed",
            self.server.name(),
            self.child.id()
        )
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("qpip-bench nbd raw: {e:#}");
        }
    }
}

pub(crate) fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0 to find a port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `server` exporting `image` as `bench` on 127.0.0.1 (or in the namespace `net`, on
/// its address); returns once it accepts. `own_group`: in a process group of its own, so that
/// a terminal's Ctrl-C reaches only us (and our guards stop the server in order). `tls`: the
/// x509 credentials directory (qemu's layout) the server requires TLS with.
pub(crate) fn start(
    server: Server,
    server_bin: &Path,
    image: &Path,
    log: PathBuf,
    own_group: bool,
    tls: Option<&Path>,
    net: Option<&Side>,
) -> Result<Running> {
    let host = host_ip(net);
    let listen = format!("{host}:0");
    let img = image.to_str().context("image path is not UTF-8")?;
    let certs = match tls {
        Some(d) => Some(d.to_str().context("TLS directory path is not UTF-8")?),
        None => None,
    };
    let (cmd, port) = match server {
        Server::Qpip => {
            let mut c = Command::new(server_bin);
            c.args(["--listen", &listen, "--log", "warn", "--export"])
                .arg(format!("{EXPORT}={img}"));
            if let Some(d) = certs {
                c.args(["--tls", "require", "--tls-certs", d]);
            }
            (c, None)
        }
        Server::Nbdkit => {
            let port = free_port()?;
            let mut c = Command::new("nbdkit");
            c.args(["--foreground", "--exit-with-parent", "-i"])
                .arg(host.to_string())
                .arg("-p")
                .arg(port.to_string());
            if let Some(d) = certs {
                c.arg("--tls=require")
                    .arg(format!("--tls-certificates={d}"));
            }
            c.args(["-e", EXPORT, "file"]).arg(format!("file={img}"));
            (c, Some(port))
        }
        Server::QemuNbd => {
            let port = free_port()?;
            let mut c = qemu_nbd(host, port);
            c.arg("--aio=threads");
            if let Some(d) = certs {
                c.arg("--object")
                    .arg(format!(
                        "tls-creds-x509,id=tls0,dir={d},endpoint=server,verify-peer=off"
                    ))
                    .args(["--tls-creds", "tls0"]);
            }
            c.arg(img);
            (c, Some(port))
        }
        Server::NbdServer if certs.is_some() => bail!("the nbd-server runs here do not use TLS"),
        Server::NbdServer => {
            let port = free_port()?;
            let cfg = log.with_extension("conf");
            std::fs::write(
                &cfg,
                format!(
                    "[generic]\n    port = {port}\n    listenaddr = {host}\n    \
                     allowlist = true\n[{EXPORT}]\n    exportname = {img}\n    \
                     flush = true\n    fua = true\n    trim = true\n"
                ),
            )
            .with_context(|| format!("writing {}", cfg.display()))?;
            let mut c = Command::new("nbd-server");
            // -d: stay in the foreground (we stop it with SIGTERM).
            c.arg("-C").arg(&cfg).arg("-d");
            (c, Some(port))
        }
        Server::QpipRbd | Server::QemuNbdRbd => bail!("{} serves RBD images", server.name()),
    };
    launch(server, cmd, port, log, own_group, certs.is_some(), net)
}

/// The address servers listen on: loopback, or the namespace's side of the link.
fn host_ip(net: Option<&Side>) -> Ipv4Addr {
    net.map_or(Ipv4Addr::LOCALHOST, |n| n.ns_ip)
}

/// qemu-nbd serving `EXPORT` raw on `host`:`port`, persistent, to any number of clients at
/// once (its default is one: the others would wait for it, one after another), with a
/// writeback cache and neither zero detection nor discards (the file and RBD rows share these
/// settings).
fn qemu_nbd(host: Ipv4Addr, port: u16) -> Command {
    let mut c = Command::new("qemu-nbd");
    c.args(["-f", "raw", "-b"])
        .arg(host.to_string())
        .arg("-p")
        .arg(port.to_string())
        .args([
            "-x",
            EXPORT,
            "-t",
            "--shared=0",
            "--cache=writeback",
            "--detect-zeroes=off",
            "--discard=ignore",
        ]);
    c
}

/// Starts `server` (qpip-rbd or qemu-nbd-rbd) exporting RBD image `pool/image` of the
/// cluster as `bench` on 127.0.0.1 (or in the namespace `net`); returns once it accepts.
pub(crate) fn start_rbd(
    server: Server,
    server_bin: &Path,
    rbd: &RbdBench,
    image: &str,
    log: PathBuf,
    net: Option<&Side>,
) -> Result<Running> {
    let conf = rbd.conf.to_str().context("ceph.conf path is not UTF-8")?;
    let host = host_ip(net);
    let listen = format!("{host}:0");
    let (cmd, port) = match server {
        Server::QpipRbd => {
            let mut c = Command::new(server_bin);
            c.args(["--listen", &listen, "--log", "warn", "--ceph-conf", conf])
                .arg("--export")
                .arg(format!("{EXPORT}=rbd:{}/{image}", rbd.pool));
            (c, None)
        }
        Server::QemuNbdRbd => {
            let port = free_port()?;
            let mut c = qemu_nbd(host, port);
            c.arg(format!("rbd:{}/{image}:conf={conf}", rbd.pool));
            (c, Some(port))
        }
        _ => bail!("{} does not serve RBD images", server.name()),
    };
    launch(server, cmd, port, log, false, false, net)
}

/// An RBD image made for one round, removed on drop (after its server has stopped).
pub(crate) struct RbdImage {
    rbd: RbdBench,
    pub name: String,
}

impl RbdImage {
    pub(crate) fn create(rbd: &RbdBench, name: String, size: u64) -> Result<RbdImage> {
        let img = RbdImage {
            rbd: rbd.clone(),
            name,
        };
        let _ = img.rbd_cmd("rm").output();
        let out = img
            .rbd_cmd("create")
            .args(["--size", &format!("{}M", size.div_ceil(1 << 20))])
            .output()
            .context("running rbd create (package ceph-common)")?;
        if !out.status.success() {
            bail!(
                "rbd create {}/{}: {}",
                rbd.pool,
                img.name,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(img)
    }

    fn rbd_cmd(&self, verb: &str) -> Command {
        let mut c = Command::new("rbd");
        c.arg("-c")
            .arg(&self.rbd.conf)
            .args([verb, "--no-progress"])
            .arg(format!("{}/{}", self.rbd.pool, self.name))
            .stdin(Stdio::null());
        c
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        let _ = self.rbd_cmd("rm").output();
    }
}

/// Spawns a server's command (inside the namespace `net`, if any) and waits until it accepts
/// (qpip's: until it prints its address, `port` None).
/// `tls`: it requires TLS (its URI is nbds://).
fn launch(
    server: Server,
    mut cmd: Command,
    port: Option<u16>,
    log: PathBuf,
    own_group: bool,
    tls: bool,
    net: Option<&Side>,
) -> Result<Running> {
    let logf =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(logf.try_clone()?))
        .stderr(logf);
    die_with_parent(&mut cmd);
    if own_group {
        cmd.process_group(0);
    }
    if let Some(n) = net {
        n.enter(&mut cmd)?;
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {} ({program})", server.name()))?;
    let pid = child.id();
    let mut running = Running {
        server,
        child,
        addr: SocketAddr::from((IpAddr::V4(host_ip(net)), port.unwrap_or(0))),
        log,
        tls,
    };
    if port.is_none() {
        running.addr = qpip_listen_addr(&mut running)?;
    }
    // Poll until it accepts a connection.
    let t0 = Instant::now();
    loop {
        if let Some(status) = running.child.try_wait()? {
            bail!(
                "{} (pid {pid}) exited with {status} before accepting on {}:\n{}",
                server.name(),
                running.addr,
                running.log_tail()
            );
        }
        // nbd-server -d serves one connection and exits: a probe connection would be it, so
        // we wait for its listening socket instead.
        let up = if server == Server::NbdServer {
            listening(pid, running.addr.port())
        } else {
            TcpStream::connect_timeout(&running.addr, Duration::from_millis(200)).is_ok()
        };
        if up {
            return Ok(running);
        }
        if t0.elapsed() > START_TIMEOUT {
            bail!(
                "{} (pid {pid}) did not accept on {} within {START_TIMEOUT:?}:\n{}",
                server.name(),
                running.addr,
                running.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether some socket listens on TCP `port` of IPv4 in the network namespace of process
/// `pid` (from /proc/PID/net/tcp, state 0A).
fn listening(pid: u32, port: u16) -> bool {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let want = format!(":{port:04X}");
    text.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_ascii_whitespace().collect();
        f.len() > 3 && f[1].ends_with(&want) && f[3] == "0A"
    })
}

/// Waits for qpip-nbd-server's `listening on ADDR` line in its log (its stderr).
fn qpip_listen_addr(r: &mut Running) -> Result<SocketAddr> {
    let t0 = Instant::now();
    let a = loop {
        let text = std::fs::read_to_string(&r.log).unwrap_or_default();
        if let Some(a) = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("qpip-nbd-server: listening on "))
        {
            break a.to_string();
        }
        if t0.elapsed() > START_TIMEOUT || r.child.try_wait()?.is_some() {
            bail!(
                "qpip-nbd-server (pid {}) printed no \"listening on\" line within {START_TIMEOUT:?}:\n{}",
                r.pid(),
                r.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    a.parse()
        .with_context(|| format!("qpip-nbd-server printed an unparsable address {a:?}"))
}
