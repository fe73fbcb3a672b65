//! `qpip-bench nbd ext2` (root): the network storage benchmark of the paper. An ext2 file
//! system on a loop device on a FUSE file backed by an NBD export; a large file written
//! sequentially and synced, then read back cold and verified.
//!
//! Stacks, all in one invocation (the order rotates from round to round):
//! - qpip: qpip-nbd-server, and qpip-nbd-mount as the FUSE client (both over QPs);
//! - nbd-server, nbdkit, qemu-nbd: each behind qemu-storage-daemon's FUSE export
//!   (`--export type=fuse`) over a kernel TCP socket, the socket stacks users have today.
//!
//! Per stack and round: a fresh image on tmpfs (so that dropping caches empties the client
//! side's caches without turning the read into a read of the VM's disk: the server's store is
//! memory for all stacks), server started, FUSE client started, `losetup --direct-io=on` on the
//! FUSE file, `mkfs.ext2`, mount; write phase: the file written in 1 MiB buffered writes, then
//! `sync` (timed together); unmount, `drop_caches`, remount; read phase: the file read in
//! 1 MiB reads and compared to its pattern (every 4 KiB block carries its index, the run's seed
//! and 4 KiB of a pseudo-random table chosen by the index). Everything is undone in reverse
//! order by guards, also on errors and on SIGINT/SIGTERM/SIGHUP.
//!
//! CPU over each phase: the machine from `/proc/stat` (user+nice+system+irq+softirq), the
//! server's and the FUSE client's process trees (minus their "qpip-soft-nic" threads, which
//! are the NIC engine), qpip-bench itself (the writer/reader, counted apart as "bench"), other
//! user processes of the machine (not ours: reported, and left out of the figures), and the
//! kernel: the machine minus all of those (loop and writeback workers, FUSE and page cache
//! work done in interrupt or kernel-thread context).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::cpu::{self, ProcEntry};
use crate::nbd::{self, EXPORT, NIC_THREAD, Running, Server};
use crate::progress::Progress;
use crate::stats::{Interrupt, Samples, Stat};

const CHUNK: usize = 1 << 20;
const BLOCK: usize = 4096;
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    Qpip,
    NbdServer,
    Nbdkit,
    QemuNbd,
}

impl Stack {
    pub const ALL: [Stack; 4] = [Stack::Qpip, Stack::NbdServer, Stack::Nbdkit, Stack::QemuNbd];

    pub fn name(self) -> &'static str {
        self.server().name()
    }

    fn server(self) -> Server {
        match self {
            Stack::Qpip => Server::Qpip,
            Stack::NbdServer => Server::NbdServer,
            Stack::Nbdkit => Server::Nbdkit,
            Stack::QemuNbd => Server::QemuNbd,
        }
    }

    pub fn client(self) -> &'static str {
        match self {
            Stack::Qpip => "qpip-nbd-mount",
            _ => "qemu-storage-daemon",
        }
    }

    pub fn parse(s: &str) -> Result<Stack> {
        Stack::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .with_context(|| format!("unknown stack {s:?} (qpip, nbd-server, nbdkit, qemu-nbd)"))
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Params {
    pub file_size_bytes: u64,
    pub image_size_bytes: u64,
    pub repeat: usize,
    pub stacks: Vec<String>,
    pub server_bin: PathBuf,
    pub mount_bin: PathBuf,
    /// Extra arguments given to qpip-nbd-mount.
    pub mount_args: Vec<String>,
    pub dir: PathBuf,
    pub io: &'static str,
    pub loop_device: &'static str,
    /// losetup --direct-io=on (else off: the loop device then caches in the page cache too).
    pub loop_direct_io: bool,
    pub mkfs: &'static str,
    pub cpu_accounting: &'static str,
}

#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cpus: usize,
    pub kernel: String,
    pub os: String,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let os = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|l| l.trim_matches('"').to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    Machine {
        cpu,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernel,
        os,
    }
}

#[derive(Debug, Serialize)]
pub struct TargetCheck {
    pub rule: String,
    pub value: f64,
    pub threshold: f64,
    pub met: bool,
}

#[derive(Debug, Serialize)]
pub struct Ext2Report {
    /// Per stack: every measure (median, min, max, samples over the rounds).
    pub stacks: BTreeMap<String, BTreeMap<String, Stat>>,
    /// Whether the loop device really ran with direct I/O on each stack's FUSE file.
    pub loop_direct_io: BTreeMap<String, bool>,
    /// The best socket stack per measure, and qpip over it.
    pub best_socket: BTreeMap<String, String>,
    pub ratios: BTreeMap<String, f64>,
    pub targets: Vec<TargetCheck>,
    pub params: Params,
    pub machine: Machine,
}

// ---------------------------------------------------------------- prerequisites

/// The qpip-nbd-mount next to this executable.
pub fn default_mount_bin() -> Result<PathBuf> {
    Ok(nbd::default_server_bin()?.with_file_name("qpip-nbd-mount"))
}

fn check_prerequisites(stacks: &[Stack], server_bin: &Path, mount_bin: &Path) -> Result<()> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root: losetup, mount and drop_caches need it (run with sudo)".to_string());
    }
    let qpip = stacks.contains(&Stack::Qpip);
    let socket = stacks.iter().any(|&s| s != Stack::Qpip);
    if qpip && !server_bin.is_file() {
        missing.push(format!(
            "qpip-nbd-server not found at {} (build it: cargo build --release -p nbd-server, \
             or pass --server-bin PATH)",
            server_bin.display()
        ));
    }
    if qpip && !mount_bin.is_file() {
        missing.push(format!(
            "qpip-nbd-mount not found at {} (build it: cargo build --release -p fuse-mount, \
             or pass --mount-bin PATH)",
            mount_bin.display()
        ));
    }
    let mut progs = vec![
        ("losetup", "util-linux"),
        ("mkfs.ext2", "e2fsprogs"),
        ("mount", "mount"),
        ("umount", "mount"),
        ("fusermount3", "fuse3"),
    ];
    if socket {
        progs.push(("qemu-storage-daemon", "qemu-system-common or qemu-utils"));
    }
    for &s in stacks {
        match s {
            Stack::NbdServer => progs.push(("nbd-server", "nbd-server")),
            Stack::Nbdkit => progs.push(("nbdkit", "nbdkit")),
            Stack::QemuNbd => progs.push(("qemu-nbd", "qemu-utils")),
            Stack::Qpip => {}
        }
    }
    for (prog, pkg) in progs {
        if nbd::in_path(prog).is_none() {
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

// ---------------------------------------------------------------- helpers and guards

fn run(prog: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {prog}"))?;
    if !out.status.success() {
        bail!(
            "{prog} {} failed with {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Mount points of the machine (field 5 of /proc/self/mountinfo, octal escapes undone).
pub fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| {
            PathBuf::from(
                m.replace("\\040", " ")
                    .replace("\\011", "\t")
                    .replace("\\012", "\n")
                    .replace("\\134", "\\"),
            )
        })
        .collect()
}

fn is_mountpoint(p: &Path) -> bool {
    mount_points().iter().any(|m| m == p)
}

fn drop_caches() -> Result<()> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("writing /proc/sys/vm/drop_caches")
}

/// The work directory (on tmpfs by default), removed with everything in it on drop.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A FUSE client: qpip-nbd-mount on a directory, or qemu-storage-daemon on a file.
struct FuseClient {
    stack: Stack,
    child: Child,
    /// What is mounted: the directory (qpip-nbd-mount) or the file (qemu-storage-daemon).
    mount: PathBuf,
    /// The file that stands for the export.
    device: PathBuf,
    log: PathBuf,
}

impl FuseClient {
    fn start(
        stack: Stack,
        server: &Running,
        mount: (&Path, &[String]),
        dir: &Path,
    ) -> Result<FuseClient> {
        let (mount_bin, mount_args) = mount;
        let log = dir.join(format!("{}-client.log", stack.name()));
        let logf = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let (mut cmd, mount, device) = if stack == Stack::Qpip {
            let mnt = dir.join("fuse");
            std::fs::create_dir_all(&mnt)?;
            let mut c = Command::new(mount_bin);
            c.args(mount_args).arg(server.uri()).arg(&mnt);
            let dev = mnt.join(EXPORT);
            (c, mnt, dev)
        } else {
            let file = dir.join("fuse-file");
            File::create(&file).with_context(|| format!("creating {}", file.display()))?;
            let port = server.uri();
            let port = port
                .rsplit_once(':')
                .and_then(|(_, p)| p.split('/').next())
                .context("server URI has no port")?
                .to_string();
            let mut c = Command::new("qemu-storage-daemon");
            c.arg("--blockdev")
                .arg(format!(
                    "driver=nbd,node-name=n,server.type=inet,server.host=127.0.0.1,\
                     server.port={port},export={EXPORT}"
                ))
                .arg("--export")
                .arg(format!(
                    "type=fuse,id=e,node-name=n,mountpoint={},writable=on",
                    file.display()
                ));
            (c, file.clone(), file)
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(logf.try_clone()?))
            .stderr(logf)
            .process_group(0);
        nbd::die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", stack.client()))?;
        let mut c = FuseClient {
            stack,
            child,
            mount,
            device,
            log,
        };
        let t0 = Instant::now();
        loop {
            if let Some(status) = c.child.try_wait()? {
                bail!(
                    "{} exited with {status} before mounting {}:\n{}",
                    stack.client(),
                    c.mount.display(),
                    std::fs::read_to_string(&c.log).unwrap_or_default().trim()
                );
            }
            if is_mountpoint(&c.mount) && c.device.exists() {
                return Ok(c);
            }
            if t0.elapsed() > MOUNT_TIMEOUT {
                bail!(
                    "{} did not mount {} within {MOUNT_TIMEOUT:?}:\n{}",
                    stack.client(),
                    c.mount.display(),
                    std::fs::read_to_string(&c.log).unwrap_or_default().trim()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Unmounts (lazily if it is still busy) and stops the process.
    fn stop(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        if is_mountpoint(&self.mount) {
            let m = self.mount.to_string_lossy().into_owned();
            if let Err(e) = run("fusermount3", &["-u", &m]) {
                errors.push(format!("{e:#}"));
                let _ = run("fusermount3", &["-u", "-z", &m]);
            }
        }
        if self.child.try_wait()?.is_none() {
            // qpip-nbd-mount exits once unmounted; qemu-storage-daemon needs the signal.
            let t0 = Instant::now();
            while self.stack == Stack::Qpip
                && t0.elapsed() < Duration::from_secs(2)
                && self.child.try_wait()?.is_none()
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: kill with the pid of our unreaped child.
            unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
            let t0 = Instant::now();
            while self.child.try_wait()?.is_none() {
                if t0.elapsed() > STOP_TIMEOUT {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    errors.push(format!(
                        "{} ignored SIGTERM for {STOP_TIMEOUT:?}; killed",
                        self.stack.client()
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if !errors.is_empty() {
            bail!("{}", errors.join("; "));
        }
        Ok(())
    }
}

impl Drop for FuseClient {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!(
                "qpip-bench nbd ext2: stopping {}: {e:#}",
                self.stack.client()
            );
        }
    }
}

/// A loop device on a file, detached on drop.
struct LoopDev {
    dev: Option<String>,
    direct_io: bool,
}

impl LoopDev {
    fn attach(file: &Path, direct_io: bool) -> Result<LoopDev> {
        let f = file.to_string_lossy();
        let dio = if direct_io {
            "--direct-io=on"
        } else {
            "--direct-io=off"
        };
        let dev = run("losetup", &["-f", "--show", dio, &f])?;
        let mut l = LoopDev {
            dev: Some(dev),
            direct_io: false,
        };
        let dio = run("losetup", &["-n", "-O", "DIO", "-l", l.path()])?;
        l.direct_io = dio.trim() == "1";
        Ok(l)
    }

    fn path(&self) -> &str {
        self.dev.as_deref().unwrap_or("")
    }

    fn detach(&mut self) -> Result<()> {
        let Some(dev) = self.dev.take() else {
            return Ok(());
        };
        // The kernel may still hold it for a moment after an unmount.
        let mut last = None;
        for _ in 0..50 {
            match run("losetup", &["-d", &dev]) {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last.expect("at least one try"))
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            eprintln!("qpip-bench nbd ext2: {e:#}");
        }
    }
}

/// The mounted ext2 file system; unmounted (lazily if busy) on drop.
struct ExtMount {
    path: PathBuf,
    mounted: bool,
}

impl ExtMount {
    fn mount(dev: &str, path: &Path) -> Result<ExtMount> {
        std::fs::create_dir_all(path)?;
        run("mount", &["-t", "ext2", dev, &path.to_string_lossy()])?;
        Ok(ExtMount {
            path: path.to_path_buf(),
            mounted: true,
        })
    }

    fn unmount(&mut self) -> Result<()> {
        if self.mounted {
            self.mounted = false;
            let p = self.path.to_string_lossy().into_owned();
            if let Err(e) = run("umount", &[&p]) {
                let _ = run("umount", &["-l", &p]);
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Drop for ExtMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!("qpip-bench nbd ext2: {e:#}");
        }
    }
}

// ---------------------------------------------------------------- the data pattern

/// Block-indexed pseudo-random data: block `b` (4 KiB) is 4 KiB of a 1 MiB pseudo-random
/// table (chosen by `b`), with `b` and `seed ^ b` in its first 16 bytes.
pub struct Pattern {
    table: Vec<u8>,
    seed: u64,
}

impl Pattern {
    pub fn new(seed: u64) -> Pattern {
        let mut x = seed | 1;
        let mut table = Vec::with_capacity(CHUNK);
        while table.len() < CHUNK {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            table.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
        }
        Pattern { table, seed }
    }

    fn block(&self, b: u64, out: &mut [u8]) {
        let slot = (b.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % (CHUNK / BLOCK);
        out.copy_from_slice(&self.table[slot * BLOCK..][..BLOCK]);
        out[..8].copy_from_slice(&b.to_le_bytes());
        out[8..16].copy_from_slice(&(self.seed ^ b).to_le_bytes());
    }

    /// Fills `buf` (a multiple of 4 KiB) with the data at file offset `off` (4 KiB aligned).
    pub fn fill(&self, off: u64, buf: &mut [u8]) {
        for (i, blk) in buf.chunks_exact_mut(BLOCK).enumerate() {
            self.block(off / BLOCK as u64 + i as u64, blk);
        }
    }

    /// Checks `buf` against the pattern at `off`; names the first bad block.
    pub fn check(&self, off: u64, buf: &[u8]) -> Result<()> {
        let mut want = vec![0u8; BLOCK];
        for (i, blk) in buf.chunks_exact(BLOCK).enumerate() {
            let b = off / BLOCK as u64 + i as u64;
            self.block(b, &mut want);
            if blk != want.as_slice() {
                let got = u64::from_le_bytes(blk[..8].try_into().expect("8 bytes"));
                let first = blk.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
                let bad = blk.iter().zip(&want).filter(|(x, y)| x != y).count();
                let zero = blk[first..].iter().take_while(|&&x| x == 0).count();
                bail!(
                    "data mismatch in the 4 KiB block at file offset {} (it carries block \
                     index {got}, expected {b}): {bad} bytes differ from byte {first} on \
                     ({zero} zero bytes there)",
                    b * BLOCK as u64
                );
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- CPU over a phase

struct Probe {
    t: Instant,
    machine: Duration,
    procs: HashMap<u32, ProcEntry>,
    server_nic: Duration,
    client_nic: Duration,
}

fn probe(server: u32, client: u32) -> Result<Probe> {
    let nic = |pid| cpu::threads_named(pid, NIC_THREAD).map(|c| c.total());
    Ok(Probe {
        t: Instant::now(),
        machine: cpu::machine_busy().context("reading /proc/stat")?,
        procs: cpu::all_processes(),
        server_nic: nic(server)?,
        client_nic: nic(client)?,
    })
}

/// CPU seconds of one phase, by component (they add up to `machine`).
#[derive(Clone, Copy, Debug, Default)]
struct Split {
    machine: f64,
    server: f64,
    nic: f64,
    client: f64,
    bench: f64,
    kernel: f64,
    kthreads: f64,
    other: f64,
}

fn split(a: &Probe, b: &Probe, server: u32, client: u32) -> Split {
    let delta = |pids: &mut dyn Iterator<Item = u32>| -> f64 {
        pids.filter_map(|p| {
            let end = b.procs.get(&p)?.cpu;
            let start = a.procs.get(&p).map_or(Duration::ZERO, |e| e.cpu);
            Some(end.saturating_sub(start).as_secs_f64())
        })
        .sum()
    };
    let st: HashSet<u32> = cpu::tree(&b.procs, server);
    let ct: HashSet<u32> = cpu::tree(&b.procs, client);
    let me = std::process::id();
    let server_all = delta(&mut st.iter().copied());
    let client_all = delta(&mut ct.iter().copied());
    let bench = delta(&mut std::iter::once(me));
    let kthreads = delta(&mut b.procs.iter().filter(|(_, e)| e.kthread).map(|(&p, _)| p));
    let other = delta(
        &mut b
            .procs
            .iter()
            .filter(|(p, e)| !e.kthread && **p != me && !st.contains(p) && !ct.contains(p))
            .map(|(&p, _)| p),
    );
    let machine = b.machine.saturating_sub(a.machine).as_secs_f64();
    let server_nic = b.server_nic.saturating_sub(a.server_nic).as_secs_f64();
    let client_nic = b.client_nic.saturating_sub(a.client_nic).as_secs_f64();
    Split {
        machine,
        server: (server_all - server_nic).max(0.0),
        nic: server_nic + client_nic,
        client: (client_all - client_nic).max(0.0),
        bench,
        kernel: (machine - server_all - client_all - bench - other).max(0.0),
        kthreads,
        other,
    }
}

// ---------------------------------------------------------------- one round

struct Phase {
    seconds: f64,
    split: Split,
}

fn write_phase(
    path: &Path,
    p: &Params,
    pattern: &Pattern,
    stop: &Interrupt,
    progress: &Progress,
    label: String,
) -> Result<f64> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut buf = vec![0u8; CHUNK];
    let mut bar = progress.bytes(label, p.file_size_bytes);
    let t0 = Instant::now();
    let mut off = 0u64;
    while off < p.file_size_bytes {
        stop.check()?;
        let n = (p.file_size_bytes - off).min(CHUNK as u64) as usize;
        pattern.fill(off, &mut buf[..n]);
        f.write_all(&buf[..n])
            .with_context(|| format!("writing {} at {off}", path.display()))?;
        off += n as u64;
        bar.inc(n as u64);
    }
    bar.set_message("sync".into());
    drop(f);
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    let s = t0.elapsed().as_secs_f64();
    bar.finish(&format!(
        "{:.0} MB/s (incl. sync)",
        p.file_size_bytes as f64 / 1e6 / s
    ));
    Ok(s)
}

fn read_phase(
    path: &Path,
    p: &Params,
    pattern: &Pattern,
    stop: &Interrupt,
    progress: &Progress,
    label: String,
) -> Result<f64> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    if len != p.file_size_bytes {
        bail!(
            "{} has {len} bytes after remount, expected {}",
            path.display(),
            p.file_size_bytes
        );
    }
    let mut buf = vec![0u8; CHUNK];
    let mut bar = progress.bytes(label, p.file_size_bytes);
    let t0 = Instant::now();
    let mut off = 0u64;
    while off < p.file_size_bytes {
        stop.check()?;
        let n = (p.file_size_bytes - off).min(CHUNK as u64) as usize;
        f.read_exact(&mut buf[..n])
            .with_context(|| format!("reading {} at {off}", path.display()))?;
        pattern.check(off, &buf[..n])?;
        off += n as u64;
        bar.inc(n as u64);
    }
    let s = t0.elapsed().as_secs_f64();
    bar.finish(&format!(
        "{:.0} MB/s, data verified",
        p.file_size_bytes as f64 / 1e6 / s
    ));
    Ok(s)
}

fn round(
    stack: Stack,
    n: usize,
    p: &Params,
    stop: &Interrupt,
    progress: &Progress,
) -> Result<(Phase, Phase, bool)> {
    let name = stack.name();
    let dir = WorkDir(p.dir.join(format!("{name}-{n}")));
    std::fs::create_dir_all(&dir.0).with_context(|| format!("creating {}", dir.0.display()))?;
    let img = dir.0.join("image.raw");
    File::create(&img)
        .and_then(|f| f.set_len(p.image_size_bytes))
        .with_context(|| format!("creating {}", img.display()))?;
    let mut server = nbd::start(
        stack.server(),
        &p.server_bin,
        &img,
        dir.0.join("server.log"),
        true,
        None,
    )?;
    stop.check()?;
    let mut client = FuseClient::start(stack, &server, (&p.mount_bin, &p.mount_args), &dir.0)?;
    stop.check()?;
    let mut lo = LoopDev::attach(&client.device, p.loop_direct_io)?;
    run(
        "mkfs.ext2",
        &["-F", "-q", "-m", "0", "-b", "4096", lo.path()],
    )?;
    stop.check()?;
    let mnt_path = dir.0.join("ext2");
    let file = mnt_path.join("data");
    let pattern = Pattern::new(0x5150_1b00 ^ ((n as u64) << 32) ^ stack as u64);
    let (sp, cp) = (server.pid(), client.pid());
    progress.line(&format!(
        "{name}: server pid {sp} on {}, {} pid {cp}, {} (direct I/O {})",
        server.uri(),
        stack.client(),
        lo.path(),
        if lo.direct_io { "on" } else { "off" }
    ));

    let mut mnt = ExtMount::mount(lo.path(), &mnt_path)?;
    drop_caches()?;
    let a = probe(sp, cp)?;
    let ws = write_phase(
        &file,
        p,
        &pattern,
        stop,
        progress,
        format!("round {} {name} write", n + 1),
    )?;
    let b = probe(sp, cp)?;
    let write = Phase {
        seconds: ws,
        split: split(&a, &b, sp, cp),
    };
    debug_assert!(b.t >= a.t);

    mnt.unmount()?;
    drop_caches()?;
    stop.check()?;
    let mut mnt = ExtMount::mount(lo.path(), &mnt_path)?;
    let a = probe(sp, cp)?;
    let rs = read_phase(
        &file,
        p,
        &pattern,
        stop,
        progress,
        format!("round {} {name} read", n + 1),
    )?;
    let b = probe(sp, cp)?;
    let read = Phase {
        seconds: rs,
        split: split(&a, &b, sp, cp),
    };

    mnt.unmount()?;
    lo.detach()?;
    client.stop()?;
    server.stop()?;
    let dio = lo.direct_io;
    Ok((write, read, dio))
}

// ---------------------------------------------------------------- the whole run

pub struct Options {
    pub file_size: u64,
    pub repeat: usize,
    pub stacks: Vec<Stack>,
    pub server_bin: PathBuf,
    pub mount_bin: PathBuf,
    pub mount_args: Vec<String>,
    pub dir: Option<PathBuf>,
    pub loop_direct_io: bool,
}

fn record(s: &mut Samples, dir: &str, bytes: u64, ph: &Phase) {
    let mb = bytes as f64 / 1e6;
    let gb = bytes as f64 / 1e9;
    let x = &ph.split;
    let ours = (x.machine - x.other).max(1e-9);
    // The paper counts the NIC's work apart from the host's: the soft NIC's engine threads
    // play the NIC processor, so the host's CPU is everything else.
    let host = (x.machine - x.other - x.nic).max(1e-9);
    s.push(&format!("{dir}_seconds"), ph.seconds);
    s.push(&format!("{dir}_MBps"), mb / ph.seconds);
    s.push(&format!("{dir}_MB_per_cpu_s"), mb / ours);
    s.push(&format!("{dir}_MB_per_host_cpu_s"), mb / host);
    s.push(
        &format!("{dir}_MB_per_machine_cpu_s"),
        mb / x.machine.max(1e-9),
    );
    for (k, v) in [
        ("machine", x.machine),
        ("attributed", ours),
        ("server", x.server),
        ("nic", x.nic),
        ("client", x.client),
        ("bench", x.bench),
        ("kernel", x.kernel),
        ("kthreads", x.kthreads),
        ("other", x.other),
    ] {
        s.push(&format!("{dir}_cpu_s_per_GB_{k}"), v / gb);
    }
}

pub fn run_all(o: Options, progress: &Progress) -> Result<Ext2Report> {
    let repeat = o.repeat.max(1);
    if o.file_size < (1 << 20) || !o.file_size.is_multiple_of(BLOCK as u64) {
        bail!("--file-size must be at least 1 MiB and a multiple of 4 KiB");
    }
    check_prerequisites(&o.stacks, &o.server_bin, &o.mount_bin)?;
    let stop = Interrupt::install()?;
    let base = o.dir.clone().unwrap_or_else(|| {
        let shm = Path::new("/dev/shm");
        let root = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        root.join(format!("qpip-bench-ext2-{}", std::process::id()))
    });
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let _work = WorkDir(base.clone());
    // Room for ext2's metadata (inode tables, bitmaps, indirect blocks) around the file.
    let image = (o.file_size + o.file_size / 4 + (64 << 20)).next_multiple_of(1 << 20);
    let params = Params {
        file_size_bytes: o.file_size,
        image_size_bytes: image,
        repeat,
        stacks: o.stacks.iter().map(|s| s.name().to_string()).collect(),
        server_bin: o.server_bin,
        mount_bin: o.mount_bin,
        mount_args: o.mount_args,
        dir: base.clone(),
        io: "1 MiB buffered write()s then sync(), timed together; read after umount + \
             drop_caches + mount, 1 MiB read()s, every block verified",
        loop_device: "losetup on the FUSE file",
        loop_direct_io: o.loop_direct_io,
        mkfs: "mkfs.ext2 -F -q -m 0 -b 4096",
        cpu_accounting: "machine = /proc/stat user+nice+system+irq+softirq; server and client = \
             process trees minus their qpip-soft-nic threads (= nic); bench = qpip-bench \
             (writer/reader); other = user processes not ours (excluded from MB per CPU-s); \
             MB per host CPU-s also excludes nic; \
             kernel = machine - server - nic - client - bench - other",
    };
    let mut samples: BTreeMap<Stack, Samples> = BTreeMap::new();
    let mut dio = BTreeMap::new();
    for i in 0..repeat {
        for k in 0..o.stacks.len() {
            let stack = o.stacks[(i + k) % o.stacks.len()];
            stop.check()?;
            progress.line(&format!("round {}/{repeat}: {}", i + 1, stack.name()));
            let (w, r, d) = round(stack, i, &params, &stop, progress)
                .with_context(|| format!("{} (round {})", stack.name(), i + 1))?;
            dio.insert(stack.name().to_string(), d);
            let s = samples.entry(stack).or_default();
            record(s, "write", o.file_size, &w);
            record(s, "read", o.file_size, &r);
        }
    }
    let stacks: BTreeMap<String, BTreeMap<String, Stat>> = samples
        .iter()
        .map(|(k, v)| (k.name().to_string(), v.stats()))
        .collect();
    let (best_socket, ratios, targets) = targets(&stacks);
    Ok(Ext2Report {
        stacks,
        loop_direct_io: dio,
        best_socket,
        ratios,
        targets,
        params,
        machine: machine(),
    })
}

impl PartialOrd for Stack {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Stack {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (*self as u8).cmp(&(*other as u8))
    }
}

type Targets = (
    BTreeMap<String, String>,
    BTreeMap<String, f64>,
    Vec<TargetCheck>,
);

fn targets(stacks: &BTreeMap<String, BTreeMap<String, Stat>>) -> Targets {
    let mut best = BTreeMap::new();
    let mut ratios = BTreeMap::new();
    let mut checks = Vec::new();
    let Some(q) = stacks.get("qpip") else {
        return (best, ratios, checks);
    };
    for (measure, threshold) in [
        ("write_MBps", 1.5),
        ("read_MBps", 1.5),
        ("write_MB_per_host_cpu_s", 2.0),
        ("read_MB_per_host_cpu_s", 2.0),
        ("write_MB_per_cpu_s", 1.0),
        ("read_MB_per_cpu_s", 1.0),
    ] {
        let Some((name, peer)) = stacks
            .iter()
            .filter(|(k, _)| k.as_str() != "qpip")
            .map(|(k, v)| (k, v[measure].median))
            .max_by(|a, b| a.1.total_cmp(&b.1))
        else {
            continue;
        };
        let r = q[measure].median / peer;
        best.insert(measure.to_string(), name.clone());
        ratios.insert(format!("{measure}_vs_best_socket"), r);
        checks.push(TargetCheck {
            rule: format!("qpip {measure} >= {threshold}x the best socket stack ({name})"),
            value: r,
            threshold,
            met: r >= threshold,
        });
    }
    (best, ratios, checks)
}

/// The report as a terminal table.
pub fn table(r: &Ext2Report) -> String {
    let p = &r.params;
    let mut s = format!(
        "nbd ext2: {} file written + sync, then read back cold and verified, on ext2 on a loop \
         device on a FUSE file;\nimage {} on tmpfs; median of {} round(s) [min-max]; MB = 10^6 \
         bytes; CPU split in CPU-seconds per GB moved\n\n",
        nbd::human_bytes(p.file_size_bytes),
        nbd::human_bytes(p.image_size_bytes),
        p.repeat
    );
    s += &format!(
        "{:<11} {:<5} {:>17} {:>15} {:>15} | {:>6} {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6}\n",
        "stack",
        "dir",
        "MB/s",
        "MB/host-CPU-s",
        "MB/CPU-s",
        "server",
        "NIC",
        "client",
        "bench",
        "kernel",
        "(other",
        "machine)"
    );
    let mut wide = false;
    for stack in Stack::ALL {
        let Some(f) = r.stacks.get(stack.name()) else {
            continue;
        };
        for dir in ["write", "read"] {
            let g = |m: &str| &f[&format!("{dir}_{m}")];
            wide |= g("MBps").wide(0.15);
            let c = |k: &str| g(&format!("cpu_s_per_GB_{k}")).median;
            s += &format!(
                "{:<11} {:<5} {:>17} {:>15} {:>15} | {:>6.2} {:>6.2} {:>6.2} {:>6.2} {:>6.2} | {:>6.2} {:>8.2}\n",
                stack.name(),
                dir,
                g("MBps").cell(0),
                g("MB_per_host_cpu_s").cell(0),
                g("MB_per_cpu_s").cell(0),
                c("server"),
                c("nic"),
                c("client"),
                c("bench"),
                c("kernel"),
                c("other"),
                c("machine"),
            );
        }
    }
    s += "\nclients: qpip = qpip-nbd-mount (QPs); the others = qemu-storage-daemon FUSE export \
          (TCP socket)\n";
    s += "MB/CPU-s = MB moved per CPU-second of the machine, other processes left out \
          (kernel includes loop/writeback workers and interrupt work); MB/host-CPU-s leaves \
          out the NIC column too (the soft NIC's engine threads, the paper's NIC processor; \
          socket stacks have none)\n";
    if p.loop_direct_io && r.loop_direct_io.values().any(|d| !d) {
        s += &format!(
            "note: the loop device fell back to buffered I/O on: {:?}\n",
            r.loop_direct_io
                .iter()
                .filter(|(_, d)| !**d)
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
        );
    }
    if !r.targets.is_empty() {
        s += "\ntargets:\n";
        for t in &r.targets {
            s += &format!(
                "  {:<62} {:>5.2}x  {}\n",
                t.rule,
                t.value,
                if t.met { "met" } else { "MISSED" }
            );
        }
    }
    if wide {
        s += "note: some throughput spreads exceed 15%: the machine was noisy; consider a \
              larger --repeat\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_catches_misplaced_blocks() {
        let p = Pattern::new(7);
        let mut a = vec![0u8; 3 * BLOCK];
        p.fill(8 * BLOCK as u64, &mut a);
        p.check(8 * BLOCK as u64, &a).unwrap();
        assert!(p.check(9 * BLOCK as u64, &a).is_err());
        let mut b = a.clone();
        b[BLOCK + 100] ^= 1;
        let e = p.check(8 * BLOCK as u64, &b).unwrap_err().to_string();
        assert!(e.contains(&format!("{}", 9 * BLOCK)), "{e}");
        // Different seeds differ.
        let mut c = vec![0u8; BLOCK];
        Pattern::new(8).fill(8 * BLOCK as u64, &mut c);
        assert_ne!(&c[..], &a[..BLOCK]);
    }

    #[test]
    fn stacks_parse_by_name() {
        for s in Stack::ALL {
            assert_eq!(Stack::parse(s.name()).unwrap(), s);
        }
        assert!(Stack::parse("nfs").is_err());
    }
}
