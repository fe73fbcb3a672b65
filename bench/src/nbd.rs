//! `qpip-bench nbd raw`: raw sequential NBD I/O, qpip-nbd-server side by side with nbdkit and
//! qemu-nbd in one run, fio's nbd engine (libnbd) as the client of all three.
//!
//! Per server and round: a fresh sparse image, the server started on a free port of
//! 127.0.0.1, one fio pass writing the whole image sequentially, one pass reading it back, the
//! server stopped and the image deleted. Servers are interleaved in every round (and the
//! order rotates from round to round) so that machine noise hits all of them alike; medians
//! and min/max over the rounds are reported.
//!
//! Fairness: all three servers serve a sparse raw file on the same file system through the
//! page cache (no O_DIRECT, no flush: fio sends no NBD_CMD_FLUSH unless asked, and we do not
//! ask). The page cache is not dropped between passes (that needs root): every read pass
//! reads data its write pass has just left in the page cache, identically for all servers.
//! - qpip-nbd-server: `--export bench=FILE` (writes with pwrite, reads from the file's mapping).
//! - nbdkit: the file plugin with its defaults (`cache=default`, `fadvise=normal`: the page
//!   cache) and its default 16 threads.
//! - qemu-nbd: `-f raw --cache=writeback --aio=threads --detect-zeroes=off --discard=ignore`
//!   (the defaults, spelled out: page cache, no O_DIRECT, no zero detection that the others do
//!   not do), `-t` so that it outlives the readiness probe and the first fio connection.
//!
//! With `--rbd-conf`, two more servers serve a fresh image of that Ceph cluster (e.g. the
//! one scripts/ceph-dev starts) in every round: qpip-nbd-server's `rbd:` export ("qpip-rbd")
//! and qemu-nbd's own rbd driver ("qemu-nbd-rbd", `rbd:POOL/IMAGE:conf=FILE`, the same
//! cache/zero/discard options), both through librbd with the cluster's defaults.
//!
//! Server CPU is the process's user+system time (all threads) from `/proc/PID/stat` around
//! each fio run; client CPU is fio's own usr_cpu/sys_cpu over its job runtime.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;

use crate::cpu;

pub(crate) const EXPORT: &str = "bench";
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The servers, in their default order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // NbdServer is the program's name: nbd-server
pub enum Server {
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
    pub const ALL: [Server; 3] = [Server::Qpip, Server::Nbdkit, Server::QemuNbd];

    pub fn name(self) -> &'static str {
        match self {
            Server::Qpip => "qpip",
            Server::Nbdkit => "nbdkit",
            Server::QemuNbd => "qemu-nbd",
            Server::NbdServer => "nbd-server",
            Server::QpipRbd => "qpip-rbd",
            Server::QemuNbdRbd => "qemu-nbd-rbd",
        }
    }

    fn is_rbd(self) -> bool {
        matches!(self, Server::QpipRbd | Server::QemuNbdRbd)
    }
}

/// The Ceph cluster of the RBD rows.
#[derive(Clone, Debug, Serialize)]
pub struct RbdBench {
    pub conf: PathBuf,
    pub pool: String,
}

/// What `nbd raw` runs.
#[derive(Clone, Debug, Serialize)]
pub struct Params {
    pub size_bytes: u64,
    pub bs_bytes: u64,
    pub iodepth: u32,
    pub repeat: usize,
    pub server_bin: PathBuf,
    pub dir: PathBuf,
    pub client: String,
    pub cache: &'static str,
    /// An untimed write pass before the timed one: the timed pass then overwrites allocated,
    /// cached blocks instead of filling a sparse file with freshly allocated pages.
    pub prewrite: bool,
    /// TLS (x509, credentials made for the run in this directory) for every server.
    pub tls: Option<PathBuf>,
    /// RBD rows too: qpip-rbd and qemu-nbd-rbd on this cluster.
    pub rbd: Option<RbdBench>,
}

impl Params {
    /// The servers of each round.
    fn servers(&self) -> Vec<Server> {
        let mut v = Server::ALL.to_vec();
        if self.rbd.is_some() {
            v.extend([Server::QpipRbd, Server::QemuNbdRbd]);
        }
        v
    }
}

/// Parses a size such as `1G`, `64M`, `256k`, `4096` (binary units, as fio reads them).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = num
        .parse()
        .with_context(|| format!("size {s:?}: expected a number with an optional k/M/G/T"))?;
    n.checked_mul(1 << shift)
        .filter(|&v| v > 0)
        .with_context(|| format!("size {s:?} is zero or too large"))
}

/// The qpip-nbd-server next to this executable (same target directory).
pub fn default_server_bin() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the qpip-bench executable")?;
    let dir = exe
        .parent()
        .with_context(|| format!("{} has no parent directory", exe.display()))?;
    Ok(dir.join("qpip-nbd-server"))
}

// ---------------------------------------------------------------- prerequisites

pub(crate) fn in_path(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// Fails with a message naming every missing program.
pub fn check_prerequisites(server_bin: &Path) -> Result<()> {
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

// ---------------------------------------------------------------- guards

/// The directory holding the images; a directory we created is removed on drop.
struct WorkDir {
    path: PathBuf,
    created: bool,
}

impl WorkDir {
    fn new(dir: Option<&Path>) -> Result<WorkDir> {
        match dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                Ok(WorkDir {
                    path: d.to_path_buf(),
                    created: false,
                })
            }
            None => {
                let path =
                    std::env::temp_dir().join(format!("qpip-bench-nbd-{}", std::process::id()));
                std::fs::create_dir_all(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
                Ok(WorkDir {
                    path,
                    created: true,
                })
            }
        }
    }
}

impl WorkDir {
    /// Interrupted (SIGINT, SIGTERM, SIGHUP): Drop guards do not run when a signal ends the
    /// process, so a watcher thread deletes the images (GiBs) and exits. The servers and fio
    /// get SIGTERM from the kernel when we die (PR_SET_PDEATHSIG).
    fn clean_up_on_signals(&self) -> Result<()> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
            .context("installing signal handlers")?;
        let (path, created) = (self.path.clone(), self.created);
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                if created {
                    let _ = std::fs::remove_dir_all(&path);
                } else {
                    for s in Server::ALL {
                        for ext in ["img", "log"] {
                            let _ = std::fs::remove_file(path.join(format!("{}.{ext}", s.name())));
                        }
                    }
                }
                eprintln!("qpip-bench nbd raw: interrupted; images deleted");
                std::process::exit(128 + sig);
            }
        });
        Ok(())
    }
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

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A fresh sparse image, deleted on drop.
struct Image {
    path: PathBuf,
}

impl Image {
    fn create(path: PathBuf, size: u64) -> Result<Image> {
        let _ = std::fs::remove_file(&path);
        let f = std::fs::File::create_new(&path)
            .with_context(|| format!("creating image {}", path.display()))?;
        f.set_len(size)
            .with_context(|| format!("sizing image {} to {size} bytes", path.display()))?;
        Ok(Image { path })
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
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
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
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

/// Starts `server` exporting `image` as `bench` on 127.0.0.1; returns once it accepts.
/// `own_group`: in a process group of its own, so that a terminal's Ctrl-C reaches only us
/// (and our guards stop the server in order). `tls`: the x509 credentials directory (qemu's
/// layout) the server requires TLS with.
pub(crate) fn start(
    server: Server,
    server_bin: &Path,
    image: &Path,
    log: PathBuf,
    own_group: bool,
    tls: Option<&Path>,
) -> Result<Running> {
    let img = image.to_str().context("image path is not UTF-8")?;
    let certs = match tls {
        Some(d) => Some(d.to_str().context("TLS directory path is not UTF-8")?),
        None => None,
    };
    let (cmd, port) = match server {
        Server::Qpip => {
            let mut c = Command::new(server_bin);
            c.args(["--listen", "127.0.0.1:0", "--log", "warn", "--export"])
                .arg(format!("{EXPORT}={img}"));
            if let Some(d) = certs {
                c.args(["--tls", "require", "--tls-certs", d]);
            }
            (c, None)
        }
        Server::Nbdkit => {
            let port = free_port()?;
            let mut c = Command::new("nbdkit");
            c.args([
                "--foreground",
                "--exit-with-parent",
                "-i",
                "127.0.0.1",
                "-p",
            ])
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
            let mut c = qemu_nbd(port);
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
                    "[generic]\n    port = {port}\n    listenaddr = 127.0.0.1\n    \
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
    launch(server, cmd, port, log, own_group, certs.is_some())
}

/// qemu-nbd serving `EXPORT` raw on 127.0.0.1:`port`, persistent, with a writeback cache and
/// neither zero detection nor discards (the file and RBD rows share these settings).
fn qemu_nbd(port: u16) -> Command {
    let mut c = Command::new("qemu-nbd");
    c.args(["-f", "raw", "-b", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .args([
            "-x",
            EXPORT,
            "-t",
            "--cache=writeback",
            "--detect-zeroes=off",
            "--discard=ignore",
        ]);
    c
}

/// Starts `server` (qpip-rbd or qemu-nbd-rbd) exporting RBD image `pool/image` of the
/// cluster as `bench` on 127.0.0.1; returns once it accepts.
fn start_rbd(
    server: Server,
    server_bin: &Path,
    rbd: &RbdBench,
    image: &str,
    log: PathBuf,
) -> Result<Running> {
    let conf = rbd.conf.to_str().context("ceph.conf path is not UTF-8")?;
    let (cmd, port) = match server {
        Server::QpipRbd => {
            let mut c = Command::new(server_bin);
            c.args([
                "--listen",
                "127.0.0.1:0",
                "--log",
                "warn",
                "--ceph-conf",
                conf,
            ])
            .arg("--export")
            .arg(format!("{EXPORT}=rbd:{}/{image}", rbd.pool));
            (c, None)
        }
        Server::QemuNbdRbd => {
            let port = free_port()?;
            let mut c = qemu_nbd(port);
            c.arg(format!("rbd:{}/{image}:conf={conf}", rbd.pool));
            (c, Some(port))
        }
        _ => bail!("{} does not serve RBD images", server.name()),
    };
    launch(server, cmd, port, log, false, false)
}

/// An RBD image made for one round, removed on drop (after its server has stopped).
struct RbdImage {
    rbd: RbdBench,
    name: String,
}

impl RbdImage {
    fn create(rbd: &RbdBench, name: String, size: u64) -> Result<RbdImage> {
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

/// Spawns a server's command and waits until it accepts (qpip's: until it prints its
/// address, `port` None).
/// `tls`: it requires TLS (its URI is nbds://).
fn launch(
    server: Server,
    mut cmd: Command,
    port: Option<u16>,
    log: PathBuf,
    own_group: bool,
    tls: bool,
) -> Result<Running> {
    let logf =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(if port.is_none() {
            Stdio::piped()
        } else {
            Stdio::from(logf.try_clone()?)
        })
        .stderr(logf);
    die_with_parent(&mut cmd);
    if own_group {
        cmd.process_group(0);
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {} ({program})", server.name()))?;
    let pid = child.id();
    let mut running = Running {
        server,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port.unwrap_or(0))),
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
            listening(running.addr.port())
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

/// Whether some socket listens on TCP `port` of IPv4 (from /proc/net/tcp, state 0A).
fn listening(port: u16) -> bool {
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let want = format!(":{port:04X}");
    text.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_ascii_whitespace().collect();
        f.len() > 3 && f[1].ends_with(&want) && f[3] == "0A"
    })
}

/// Reads qpip-nbd-server's `listening on ADDR` line; keeps draining its stdout afterwards.
fn qpip_listen_addr(r: &mut Running) -> Result<SocketAddr> {
    let stdout = r.child.stdout.take().context("server stdout is piped")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout);
        let mut line = String::new();
        let mut sent = false;
        while lines.read_line(&mut line).unwrap_or(0) > 0 {
            if !sent && let Some(a) = line.trim().strip_prefix("qpip-nbd-server: listening on ") {
                sent = tx.send(a.to_string()).is_ok();
            }
            line.clear();
        }
    });
    let a = rx.recv_timeout(START_TIMEOUT).map_err(|_| {
        anyhow::anyhow!(
            "qpip-nbd-server (pid {}) printed no \"listening on\" line within {START_TIMEOUT:?}:\n{}",
            r.pid(),
            r.log_tail()
        )
    })?;
    a.parse()
        .with_context(|| format!("qpip-nbd-server printed an unparsable address {a:?}"))
}

// ---------------------------------------------------------------- one fio pass

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Write,
    Read,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Write => "write",
            Dir::Read => "read",
        }
    }
}

/// Figures of one fio pass.
#[derive(Clone, Copy, Debug)]
struct Pass {
    mbps: f64,
    server_s_per_gb: f64,
    /// Of the server's CPU, what its NIC engine thread used (qpip only; 0 for the others).
    nic_s_per_gb: f64,
    client_s_per_gb: f64,
}

/// The soft NIC's engine thread, as named by qpip-core.
pub(crate) const NIC_THREAD: &str = "qpip-soft-nic";

fn num(v: &Value, path: &[&str]) -> Result<f64> {
    let mut cur = v;
    for p in path {
        cur = cur
            .get(p)
            .with_context(|| format!("fio JSON has no {}", path.join(".")))?;
    }
    cur.as_f64()
        .with_context(|| format!("fio JSON {} is not a number", path.join(".")))
}

fn fio_pass(r: &Running, dir: Dir, p: &Params) -> Result<Pass> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=nbd-raw",
        "--ioengine=nbd",
        &format!("--uri={}", r.uri()),
        &format!("--rw={}", dir.name()),
        &format!("--bs={}", p.bs_bytes),
        &format!("--iodepth={}", p.iodepth),
        &format!("--size={}", p.size_bytes),
        "--numjobs=1",
        "--output-format=json",
    ]);
    die_with_parent(&mut cmd);
    let before = cpu::process(r.pid())
        .with_context(|| format!("reading CPU time of {} (pid {})", r.server.name(), r.pid()))?;
    let nic_before = cpu::threads_named(r.pid(), NIC_THREAD)?;
    let out = cmd.stdin(Stdio::null()).output().context("running fio")?;
    let after = cpu::process(r.pid())
        .with_context(|| format!("reading CPU time of {} (pid {})", r.server.name(), r.pid()))?;
    let nic_after = cpu::threads_named(r.pid(), NIC_THREAD)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio {} against {} ({}) failed with {}:\n{}{}\nserver log:\n{}",
            dir.name(),
            r.server.name(),
            r.uri(),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout,
            r.log_tail()
        );
    }
    // fio may print notices before the JSON object.
    let json = &stdout[stdout.find('{').context("fio printed no JSON")?..];
    let v: Value = serde_json::from_str(json).context("parsing fio's JSON output")?;
    let job = v
        .get("jobs")
        .and_then(|j| j.get(0))
        .context("fio JSON has no jobs[0]")?;
    let err = num(job, &["error"])?;
    if err != 0.0 {
        bail!(
            "fio {} against {}: job error {err}",
            dir.name(),
            r.server.name()
        );
    }
    let io_bytes = num(job, &[dir.name(), "io_bytes"])?;
    if io_bytes < p.size_bytes as f64 {
        bail!(
            "fio {} against {} moved {io_bytes} of {} bytes",
            dir.name(),
            r.server.name(),
            p.size_bytes
        );
    }
    let bw = num(job, &[dir.name(), "bw_bytes"])?;
    let runtime_s = num(job, &["job_runtime"])? / 1e3;
    let client_cpu_s = (num(job, &["usr_cpu"])? + num(job, &["sys_cpu"])?) / 100.0 * runtime_s;
    let gb = io_bytes / 1e9;
    Ok(Pass {
        mbps: bw / 1e6,
        server_s_per_gb: (after - before).total().as_secs_f64() / gb,
        nic_s_per_gb: (nic_after - nic_before).total().as_secs_f64() / gb,
        client_s_per_gb: client_cpu_s / gb,
    })
}

// ---------------------------------------------------------------- the whole run

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Spread {
    pub min: f64,
    pub max: f64,
}

/// Medians over the rounds, then min/max and every sample.
#[derive(Clone, Debug, Serialize)]
#[allow(non_snake_case)]
pub struct ServerFigures {
    pub write_MBps: f64,
    pub read_MBps: f64,
    pub write_server_cpu_s_per_GB: f64,
    pub read_server_cpu_s_per_GB: f64,
    /// The part of the server CPU spent in the soft NIC's engine thread (qpip only).
    pub write_nic_cpu_s_per_GB: f64,
    pub read_nic_cpu_s_per_GB: f64,
    pub write_client_cpu_s_per_GB: f64,
    pub read_client_cpu_s_per_GB: f64,
    pub spread: BTreeMap<&'static str, Spread>,
    pub samples: BTreeMap<&'static str, Vec<f64>>,
}

#[derive(Debug, Serialize)]
pub struct Target {
    pub rule: &'static str,
    pub met: bool,
}

#[derive(Debug, Serialize)]
pub struct NbdRawReport {
    pub servers: BTreeMap<&'static str, ServerFigures>,
    /// qpip over the peer: throughput ratios (>1 is better for qpip) and server CPU per GB
    /// ratios (<1 is better for qpip).
    pub ratios: BTreeMap<String, f64>,
    pub target: Target,
    pub params: Params,
}

const MEASURES: [&str; 8] = [
    "write_MBps",
    "read_MBps",
    "write_server_cpu_s_per_GB",
    "read_server_cpu_s_per_GB",
    "write_nic_cpu_s_per_GB",
    "read_nic_cpu_s_per_GB",
    "write_client_cpu_s_per_GB",
    "read_client_cpu_s_per_GB",
];

fn figures(samples: BTreeMap<&'static str, Vec<f64>>) -> ServerFigures {
    let med = |k: &str| cpu::median(samples[k].clone());
    let spread = samples
        .iter()
        .map(|(&k, v)| {
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (k, Spread { min, max })
        })
        .collect();
    ServerFigures {
        write_MBps: med("write_MBps"),
        read_MBps: med("read_MBps"),
        write_server_cpu_s_per_GB: med("write_server_cpu_s_per_GB"),
        read_server_cpu_s_per_GB: med("read_server_cpu_s_per_GB"),
        write_nic_cpu_s_per_GB: med("write_nic_cpu_s_per_GB"),
        read_nic_cpu_s_per_GB: med("read_nic_cpu_s_per_GB"),
        write_client_cpu_s_per_GB: med("write_client_cpu_s_per_GB"),
        read_client_cpu_s_per_GB: med("read_client_cpu_s_per_GB"),
        spread,
        samples,
    }
}

/// One server, one round: fresh image, start, write pass, read pass, stop, delete.
fn round(server: Server, p: &Params, progress: &dyn Fn(&str)) -> Result<(Pass, Pass)> {
    let name = server.name();
    let log = p.dir.join(format!("{name}.log"));
    // Dropped after the server (declared first): the image outlives its server.
    let (_file, _rbd_image, mut running);
    if let (true, Some(rbd)) = (server.is_rbd(), &p.rbd) {
        let img = RbdImage::create(
            rbd,
            format!("qpip-bench-{name}-{}", std::process::id()),
            p.size_bytes,
        )?;
        running = start_rbd(server, &p.server_bin, rbd, &img.name, log)?;
        _rbd_image = Some(img);
        _file = None;
    } else {
        let image = Image::create(p.dir.join(format!("{name}.img")), p.size_bytes)?;
        running = start(
            server,
            &p.server_bin,
            &image.path,
            log,
            false,
            p.tls.as_deref(),
        )?;
        _file = Some(image);
        _rbd_image = None;
    }
    progress(&format!(
        "{name}: pid {} on {}, writing",
        running.pid(),
        running.uri()
    ));
    if p.prewrite {
        fio_pass(&running, Dir::Write, p)?;
        progress(&format!("{name}: untimed prewrite done; writing"));
    }
    let w = fio_pass(&running, Dir::Write, p)?;
    progress(&format!(
        "{name}: write {:.0} MB/s, server {:.3} s/GB; reading",
        w.mbps, w.server_s_per_gb
    ));
    let r = fio_pass(&running, Dir::Read, p)?;
    progress(&format!(
        "{name}: read {:.0} MB/s, server {:.3} s/GB",
        r.mbps, r.server_s_per_gb
    ));
    running.stop()?;
    Ok((w, r))
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    size: u64,
    bs: u64,
    iodepth: u32,
    repeat: usize,
    server_bin: PathBuf,
    dir: Option<&Path>,
    prewrite: bool,
    tls: bool,
    rbd: Option<RbdBench>,
    progress: &dyn Fn(&str),
) -> Result<NbdRawReport> {
    let repeat = repeat.max(1);
    if !size.is_multiple_of(bs) {
        bail!("--size {size} is not a multiple of --bs {bs}");
    }
    check_prerequisites(&server_bin)?;
    if let Some(r) = &rbd {
        if in_path("rbd").is_none() {
            bail!("--rbd-conf: rbd not found in PATH (package ceph-common)");
        }
        if !r.conf.is_file() {
            bail!(
                "--rbd-conf: {} does not exist (scripts/ceph-dev starts a cluster)",
                r.conf.display()
            );
        }
    }
    let work = WorkDir::new(dir)?;
    work.clean_up_on_signals()?;
    let fio_version = Command::new("fio")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let params = Params {
        size_bytes: size,
        bs_bytes: bs,
        iodepth,
        repeat,
        server_bin,
        dir: work.path.clone(),
        client: format!("{fio_version} --ioengine=nbd, 1 job, 1 connection"),
        cache: "page cache, hot, same for all servers (not dropped; no flush)",
        prewrite,
        tls: if tls {
            let d = work.path.join("tls");
            // Throwaway credentials, made as the tests make theirs.
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/tls-test-certs");
            let st = Command::new(script)
                .arg(&d)
                .status()
                .with_context(|| format!("running {script} (needs certtool: scripts/setup)"))?;
            if !st.success() {
                bail!("{script} {} failed ({st})", d.display());
            }
            Some(d)
        } else {
            None
        },
        rbd,
    };
    let servers = params.servers();
    let mut samples: BTreeMap<&'static str, BTreeMap<&'static str, Vec<f64>>> = servers
        .iter()
        .map(|s| {
            (
                s.name(),
                MEASURES.iter().map(|&m| (m, Vec::new())).collect(),
            )
        })
        .collect();
    for i in 0..repeat {
        // Interleave, rotating the order so no server always goes first.
        for k in 0..servers.len() {
            let server = servers[(i + k) % servers.len()];
            progress(&format!("round {}/{repeat}: {}", i + 1, server.name()));
            let (w, r) = round(server, &params, progress)?;
            let s = samples
                .get_mut(server.name())
                .expect("every server has samples");
            for (m, v) in MEASURES.iter().zip([
                w.mbps,
                r.mbps,
                w.server_s_per_gb,
                r.server_s_per_gb,
                w.nic_s_per_gb,
                r.nic_s_per_gb,
                w.client_s_per_gb,
                r.client_s_per_gb,
            ]) {
                s.get_mut(m).expect("every measure has samples").push(v);
            }
        }
    }
    let servers: BTreeMap<&'static str, ServerFigures> =
        samples.into_iter().map(|(k, v)| (k, figures(v))).collect();
    let q = &servers["qpip"];
    let mut ratios = BTreeMap::new();
    for peer in ["nbdkit", "qemu-nbd"] {
        let o = &servers[peer];
        ratios.insert(format!("write_vs_{peer}"), q.write_MBps / o.write_MBps);
        ratios.insert(format!("read_vs_{peer}"), q.read_MBps / o.read_MBps);
        ratios.insert(
            format!("write_server_cpu_vs_{peer}"),
            q.write_server_cpu_s_per_GB / o.write_server_cpu_s_per_GB,
        );
        ratios.insert(
            format!("read_server_cpu_vs_{peer}"),
            q.read_server_cpu_s_per_GB / o.read_server_cpu_s_per_GB,
        );
    }
    if params.rbd.is_some() {
        let (q, o) = (&servers["qpip-rbd"], &servers["qemu-nbd-rbd"]);
        ratios.insert("rbd_write_vs_qemu-nbd".into(), q.write_MBps / o.write_MBps);
        ratios.insert("rbd_read_vs_qemu-nbd".into(), q.read_MBps / o.read_MBps);
        ratios.insert(
            "rbd_write_server_cpu_vs_qemu-nbd".into(),
            q.write_server_cpu_s_per_GB / o.write_server_cpu_s_per_GB,
        );
        ratios.insert(
            "rbd_read_server_cpu_vs_qemu-nbd".into(),
            q.read_server_cpu_s_per_GB / o.read_server_cpu_s_per_GB,
        );
    }
    let met = ratios["write_vs_nbdkit"] >= 1.2
        && ratios["read_vs_nbdkit"] >= 1.2
        && ratios["write_server_cpu_vs_nbdkit"] <= 1.0
        && ratios["read_server_cpu_vs_nbdkit"] <= 1.0;
    Ok(NbdRawReport {
        servers,
        ratios,
        target: Target {
            rule: "qpip >= 1.2x nbdkit MB/s both ways at <= nbdkit's server CPU per GB",
            met,
        },
        params,
    })
}

pub(crate) fn human_bytes(b: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{b} B")
}

/// The report as a terminal table.
pub fn table(r: &NbdRawReport) -> String {
    let p = &r.params;
    let mut s = format!(
        "nbd raw: sequential write then read of {} in {} requests, {} in flight, fio nbd engine;\n\
         page-cache-hot {} raw files for all servers; median of {} rounds [min-max]{}\n\n",
        human_bytes(p.size_bytes),
        human_bytes(p.bs_bytes),
        p.iodepth,
        if p.prewrite {
            "prewritten (untimed first write)"
        } else {
            "fresh sparse"
        },
        p.repeat,
        if p.tls.is_some() {
            ";\nTLS required by every server (x509), nbds:// from fio"
        } else {
            ""
        }
    );
    s += &format!(
        "{:<10} {:<6} {:>22} {:>24} {:>20}\n",
        "server", "dir", "MB/s", "server CPU s/GB", "fio CPU s/GB"
    );
    let mut wide = false;
    for server in p.servers() {
        let f = &r.servers[server.name()];
        for (dir, mbps, srv, cli) in [
            (
                "write",
                f.write_MBps,
                f.write_server_cpu_s_per_GB,
                f.write_client_cpu_s_per_GB,
            ),
            (
                "read",
                f.read_MBps,
                f.read_server_cpu_s_per_GB,
                f.read_client_cpu_s_per_GB,
            ),
        ] {
            let sp = |m: &str| f.spread[format!("{dir}_{m}").as_str()];
            let (a, b, c) = (
                sp("MBps"),
                sp("server_cpu_s_per_GB"),
                sp("client_cpu_s_per_GB"),
            );
            if a.max > a.min * 1.15 {
                wide = true;
            }
            let cell = |m: f64, sp: Spread, prec: usize| {
                format!("{m:.prec$} [{:.prec$}-{:.prec$}]", sp.min, sp.max)
            };
            s += &format!(
                "{:<10} {:<6} {:>22} {:>24} {:>20}\n",
                server.name(),
                dir,
                cell(mbps, a, 0),
                cell(srv, b, 3),
                cell(cli, c, 3)
            );
        }
    }
    let q = &r.servers["qpip"];
    s += &format!(
        "\nof qpip's server CPU, its soft NIC engine thread (the emulated NIC) used {:.3} s/GB \
         writing and {:.3} s/GB reading;\nits application threads used the rest: {:.3} and {:.3} s/GB\n",
        q.write_nic_cpu_s_per_GB,
        q.read_nic_cpu_s_per_GB,
        q.write_server_cpu_s_per_GB - q.write_nic_cpu_s_per_GB,
        q.read_server_cpu_s_per_GB - q.read_nic_cpu_s_per_GB,
    );
    s += "\nqpip relative to     write MB/s  read MB/s  write srv CPU/GB  read srv CPU/GB\n";
    for peer in ["nbdkit", "qemu-nbd"] {
        s += &format!(
            "  {:<18} {:>9.2}x {:>9.2}x {:>16.2}x {:>15.2}x\n",
            peer,
            r.ratios[&format!("write_vs_{peer}")],
            r.ratios[&format!("read_vs_{peer}")],
            r.ratios[&format!("write_server_cpu_vs_{peer}")],
            r.ratios[&format!("read_server_cpu_vs_{peer}")],
        );
    }
    if p.rbd.is_some() {
        s += &format!(
            "  {:<18} {:>9.2}x {:>9.2}x {:>16.2}x {:>15.2}x   (qpip-rbd to qemu-nbd-rbd)\n",
            "qemu-nbd, rbd:",
            r.ratios["rbd_write_vs_qemu-nbd"],
            r.ratios["rbd_read_vs_qemu-nbd"],
            r.ratios["rbd_write_server_cpu_vs_qemu-nbd"],
            r.ratios["rbd_read_server_cpu_vs_qemu-nbd"],
        );
    }
    s += &format!(
        "\ntarget ({}): {}\n",
        r.target.rule,
        if r.target.met { "met" } else { "MISSED" }
    );
    if wide {
        s += "note: some throughput spreads exceed 15%: the machine was noisy; \
              consider a larger --repeat\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("256k").unwrap(), 256 << 10);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("0").is_err());
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(1 << 30), "1 GiB");
        assert_eq!(human_bytes(256 << 10), "256 KiB");
        assert_eq!(human_bytes(1000), "1000 B");
    }
}
