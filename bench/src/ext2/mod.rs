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

mod cpu_split;
mod report;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::pattern::{BLOCK, Pattern};
use crate::progress::{Bar, Progress};
use crate::report::machine;
use crate::rig::mount::{self, ExtMount, FuseClient, FuseProgram, LoopDev};
use crate::rig::netns::{NetnsArgs, Side};
use crate::rig::peers::{self, Server};
use crate::rig::workdir::WorkDir;
use crate::stats::{Interrupt, Samples, Stat};
use cpu_split::{Split, probe, split};
use report::targets;
pub(crate) use report::{Ext2Report, table};

const CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stack {
    Qpip,
    /// qpip with the mount's `--cache none`: no page cache on the FUSE file, as
    /// qemu-storage-daemon's FUSE export keeps none for the socket stacks.
    QpipDirect,
    NbdServer,
    Nbdkit,
    QemuNbd,
}

impl Stack {
    pub(crate) const ALL: [Stack; 5] = [
        Stack::Qpip,
        Stack::QpipDirect,
        Stack::NbdServer,
        Stack::Nbdkit,
        Stack::QemuNbd,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Stack::QpipDirect => "qpip-direct",
            _ => self.server().name(),
        }
    }

    /// A qpip stack (server and mount over QPs)?
    pub(crate) fn is_qpip(self) -> bool {
        matches!(self, Stack::Qpip | Stack::QpipDirect)
    }

    /// What this stack adds to qpip-nbd-mount's arguments.
    fn mount_args(self) -> &'static [&'static str] {
        match self {
            Stack::QpipDirect => &["--cache", "none"],
            _ => &[],
        }
    }

    fn server(self) -> Server {
        match self {
            Stack::Qpip | Stack::QpipDirect => Server::Qpip,
            Stack::NbdServer => Server::NbdServer,
            Stack::Nbdkit => Server::Nbdkit,
            Stack::QemuNbd => Server::QemuNbd,
        }
    }

    pub(crate) fn client(self) -> &'static str {
        self.fuse_program().name()
    }

    fn fuse_program(self) -> FuseProgram {
        match self {
            Stack::Qpip | Stack::QpipDirect => FuseProgram::QpipMount,
            _ => FuseProgram::QemuStorageDaemon,
        }
    }

    pub(crate) fn parse(s: &str) -> Result<Stack> {
        Stack::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .with_context(|| {
                format!("unknown stack {s:?} (qpip, qpip-direct, nbd-server, nbdkit, qemu-nbd)")
            })
    }
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Params {
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
    /// `--loop-direct-io`: losetup --direct-io=on for which stacks (where off, the loop device
    /// caches in the FUSE file's page cache too).
    pub loop_direct_io: &'static str,
    #[serde(skip)]
    pub direct_io: LoopDirectIo,
    pub mkfs: &'static str,
    pub cpu_accounting: &'static str,
    /// `--netns`: the servers run in this namespace, the mounts here, across a veth link.
    pub netns: Option<Side>,
}

// ---------------------------------------------------------------- prerequisites

/// The qpip-nbd-mount next to this executable.
pub(crate) fn default_mount_bin() -> Result<PathBuf> {
    Ok(peers::default_server_bin()?.with_file_name("qpip-nbd-mount"))
}

fn check_prerequisites(stacks: &[Stack], server_bin: &Path, mount_bin: &Path) -> Result<()> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root: losetup, mount and drop_caches need it (run with sudo)".to_string());
    }
    let qpip = stacks.iter().any(|s| s.is_qpip());
    let socket = stacks.iter().any(|s| !s.is_qpip());
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
            Stack::Qpip | Stack::QpipDirect => {}
        }
    }
    peers::require_fuse_and(&progs, missing)
}

// ---------------------------------------------------------------- one round

struct Phase {
    seconds: f64,
    split: Split,
}

/// Runs `step(offset, piece)` over the file in `CHUNK` pieces, counting them on `bar`.
fn in_chunks(
    size: u64,
    stop: &Interrupt,
    bar: &mut Bar,
    mut step: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < size {
        stop.check()?;
        let n = (size - off).min(CHUNK as u64) as usize;
        step(off, &mut buf[..n])?;
        off += n as u64;
        bar.inc(n as u64);
    }
    Ok(())
}

/// Runs one phase, and splits the CPU it took with the server `sp` and the client `cp`.
fn measured(sp: u32, cp: u32, phase: impl FnOnce() -> Result<f64>) -> Result<Phase> {
    let a = probe(sp, cp)?;
    let seconds = phase()?;
    let b = probe(sp, cp)?;
    debug_assert!(b.t >= a.t);
    Ok(Phase {
        seconds,
        split: split(&a, &b, sp, cp),
    })
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
    let mut bar = progress.bytes(label, p.file_size_bytes);
    let t0 = Instant::now();
    in_chunks(p.file_size_bytes, stop, &mut bar, |off, buf| {
        pattern.fill(off, buf);
        f.write_all(buf)
            .with_context(|| format!("writing {} at {off}", path.display()))
    })?;
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
    let mut bar = progress.bytes(label, p.file_size_bytes);
    let t0 = Instant::now();
    in_chunks(p.file_size_bytes, stop, &mut bar, |off, buf| {
        f.read_exact(buf)
            .with_context(|| format!("reading {} at {off}", path.display()))?;
        pattern.check(off, buf)
    })?;
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
    let dir = WorkDir::created(p.dir.join(format!("{name}-{n}")))?;
    let img = dir.path.join("image.raw");
    File::create(&img)
        .and_then(|f| f.set_len(p.image_size_bytes))
        .with_context(|| format!("creating {}", img.display()))?;
    let mut server = peers::start(
        stack.server(),
        &p.server_bin,
        &img,
        dir.path.join("server.log"),
        true,
        None,
        p.netns.as_ref(),
    )?;
    stop.check()?;
    let mount_args: Vec<String> = (stack.mount_args().iter().map(|a| a.to_string()))
        .chain(p.mount_args.iter().cloned())
        .collect();
    let mut client = FuseClient::start(
        stack.fuse_program(),
        name,
        &server,
        (&p.mount_bin, &mount_args),
        &dir.path,
    )?;
    stop.check()?;
    let mut lo = LoopDev::attach(&client.device, p.direct_io.for_stack(stack))?;
    mount::run(
        "mkfs.ext2",
        &["-F", "-q", "-m", "0", "-b", "4096", lo.path()],
    )?;
    stop.check()?;
    let mnt_path = dir.path.join("ext2");
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
    mount::drop_caches()?;
    let write = measured(sp, cp, || {
        let label = format!("round {} {name} write", n + 1);
        write_phase(&file, p, &pattern, stop, progress, label)
    })?;

    mnt.unmount()?;
    mount::drop_caches()?;
    stop.check()?;
    let mut mnt = ExtMount::mount(lo.path(), &mnt_path)?;
    let read = measured(sp, cp, || {
        let label = format!("round {} {name} read", n + 1);
        read_phase(&file, p, &pattern, stop, progress, label)
    })?;

    mnt.unmount()?;
    lo.detach()?;
    client.stop()?;
    server.stop()?;
    let dio = lo.direct_io;
    Ok((write, read, dio))
}

// ---------------------------------------------------------------- the whole run

pub(crate) struct Options {
    pub file_size: u64,
    pub repeat: usize,
    pub stacks: Vec<Stack>,
    pub server_bin: PathBuf,
    pub mount_bin: PathBuf,
    pub mount_args: Vec<String>,
    pub dir: Option<PathBuf>,
    pub loop_direct_io: LoopDirectIo,
    pub netns: NetnsArgs,
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

pub(crate) fn run_all(o: Options, progress: &Progress) -> Result<Ext2Report> {
    let repeat = o.repeat.max(1);
    if o.file_size < (1 << 20) || !o.file_size.is_multiple_of(BLOCK as u64) {
        bail!("--file-size must be at least 1 MiB and a multiple of 4 KiB");
    }
    check_prerequisites(&o.stacks, &o.server_bin, &o.mount_bin)?;
    let stop = Interrupt::install()?;
    let work = WorkDir::on_tmpfs(o.dir.as_deref(), "ext2")?;
    // Dropped after every server (each stops within its round).
    let link = o.netns.create()?;
    let base = work.path.clone();
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
        loop_direct_io: o.loop_direct_io.describe(),
        direct_io: o.loop_direct_io,
        mkfs: "mkfs.ext2 -F -q -m 0 -b 4096",
        cpu_accounting: "machine = /proc/stat user+nice+system+irq+softirq; server and client = \
             process trees minus their qpip-soft-nic threads (= nic); bench = qpip-bench \
             (writer/reader); other = user processes not ours (excluded from MB per CPU-s); \
             MB per host CPU-s also excludes nic; \
             kernel = machine - server - nic - client - bench - other",
        netns: link.as_ref().map(|l| l.side.clone()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_parse_by_name() {
        for s in Stack::ALL {
            assert_eq!(Stack::parse(s.name()).unwrap(), s);
        }
        assert!(Stack::parse("nfs").is_err());
    }
}

/// `--loop-direct-io`: whether the loop device reads and writes the FUSE file with O_DIRECT.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LoopDirectIo {
    /// On for the qpip stacks (README's recipe), off for qemu-storage-daemon's FUSE export
    /// (corrupt blocks with it on, QEMU 10.0).
    Auto,
    /// On for every stack.
    On,
    /// Off for every stack.
    Off,
}

impl LoopDirectIo {
    /// Whether `stack`'s loop device is attached with direct I/O.
    pub(crate) fn for_stack(self, stack: Stack) -> bool {
        match self {
            LoopDirectIo::Auto => stack.is_qpip(),
            LoopDirectIo::On => true,
            LoopDirectIo::Off => false,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            LoopDirectIo::Auto => "auto: on for the qpip stacks, off for qemu-storage-daemon's",
            LoopDirectIo::On => "on",
            LoopDirectIo::Off => "off",
        }
    }
}
