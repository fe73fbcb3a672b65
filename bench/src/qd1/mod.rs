//! `qpip-bench nbd qd1` (root): latency at queue depth 1 through a FUSE mount. 4 KiB
//! O_DIRECT random reads, then random writes, one at a time (fio's psync engine), on the file
//! that stands for an NBD export:
//! - qpip: qpip-nbd-server, and qpip-nbd-mount `--cache none` as the FUSE client (QPs);
//! - qsd-nbdkit: nbdkit's file plugin behind qemu-storage-daemon's FUSE export
//!   (`--blockdev driver=nbd`, `--export type=fuse`) over a kernel TCP socket.
//!
//! Caching is alike on both sides: neither FUSE file has a page cache (qpip-nbd-mount
//! `--cache none`; qemu-storage-daemon's export opens its file with FOPEN_DIRECT_IO, and its
//! nbd block driver has no host cache), fio opens it with O_DIRECT, and both servers serve
//! the same image on tmpfs through the page cache (qpip-nbd-server `--export`, nbdkit's file
//! plugin with its defaults, `cache=default`).
//!
//! One image of random data (default 1 GiB, on /dev/shm) serves every round. Per stack and
//! round (stacks interleaved, the order rotating): server and FUSE client started, fio
//! randread then randwrite, each `--runtime` long, then both stopped. Around each fio run:
//! the CPU of the server process and of the FUSE client process (from /proc/PID/stat), of
//! their soft NIC engine threads (named "qpip-soft-nic", in /proc/PID/task), and fio's own.
//!
//! On a shared machine another tool may pause processes (SIGSTOP) for a while; a request in
//! flight then takes as long as the pause. A run during which the server or the client was
//! seen stopped, or qpip-bench itself was (its watcher's 50 ms sleeps overran), is run again,
//! at most twice; the report says how long the kept runs were stopped.

mod report;
mod stops;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::cpu;
use crate::progress::Progress;
use crate::report::machine;
use crate::rig::fio::{self, FileJob, LatencyReport, RandDir};
use crate::rig::mount::{FuseClient, FuseProgram};
use crate::rig::netns::{NetnsArgs, Side};
use crate::rig::peers::{self, NIC_THREAD, Running, Server};
use crate::rig::workdir::{Image, WorkDir};
use crate::stats::{Interrupt, Samples, Stat};
use crate::units::human_bytes;
pub(crate) use report::{Qd1Report, table};

/// Request size.
const BS: u64 = 4096;
/// Runs of one direction per round at most: one during which the stack was stopped from
/// outside (stops::watching) is run again.
const TRIES: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stack {
    Qpip,
    /// nbdkit behind qemu-storage-daemon's FUSE export.
    QsdNbdkit,
}

impl Stack {
    pub(crate) const ALL: [Stack; 2] = [Stack::Qpip, Stack::QsdNbdkit];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Stack::Qpip => "qpip",
            Stack::QsdNbdkit => "qsd-nbdkit",
        }
    }

    fn server(self) -> Server {
        match self {
            Stack::Qpip => Server::Qpip,
            Stack::QsdNbdkit => Server::Nbdkit,
        }
    }

    fn fuse_program(self) -> FuseProgram {
        match self {
            Stack::Qpip => FuseProgram::QpipMount,
            Stack::QsdNbdkit => FuseProgram::QemuStorageDaemon,
        }
    }

    /// What the stack runs, for the report.
    fn describe(self) -> &'static str {
        match self {
            Stack::Qpip => "qpip-nbd-server --export; qpip-nbd-mount --cache none (QPs, soft NIC)",
            Stack::QsdNbdkit => {
                "nbdkit file plugin (defaults); qemu-storage-daemon --blockdev driver=nbd \
                 --export type=fuse,writable=on (TCP socket)"
            }
        }
    }
}

pub(crate) struct Options {
    pub size: u64,
    pub runtime: Duration,
    pub repeat: usize,
    pub server_bin: PathBuf,
    pub mount_bin: PathBuf,
    pub mount_args: Vec<String>,
    pub dir: Option<PathBuf>,
    pub netns: NetnsArgs,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Params {
    pub size_bytes: u64,
    pub bs_bytes: u64,
    pub runtime_s: f64,
    pub repeat: usize,
    pub server_bin: PathBuf,
    pub mount_bin: PathBuf,
    /// Given to qpip-nbd-mount after `--cache none`.
    pub mount_args: Vec<String>,
    pub dir: PathBuf,
    pub stacks: BTreeMap<&'static str, &'static str>,
    pub fio: String,
    pub cache: &'static str,
    pub cpu_accounting: &'static str,
    /// `--netns`: the servers run in this namespace, the mounts here, across a veth link.
    pub netns: Option<Side>,
}

// ---------------------------------------------------------------- prerequisites

fn check_prerequisites(o: &Options) -> Result<()> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root: the FUSE mounts need it (run with sudo)".to_string());
    }
    for (bin, name, pkg, opt) in [
        (
            &o.server_bin,
            "qpip-nbd-server",
            "nbd-server",
            "--server-bin",
        ),
        (&o.mount_bin, "qpip-nbd-mount", "fuse-mount", "--mount-bin"),
    ] {
        if !bin.is_file() {
            missing.push(format!(
                "{name} not found at {} (build it: cargo build --release -p {pkg}, or pass \
                 {opt} PATH)",
                bin.display()
            ));
        }
    }
    let progs = [
        ("fio", "fio"),
        ("nbdkit", "nbdkit"),
        ("qemu-storage-daemon", "qemu-system-common or qemu-utils"),
        ("fusermount3", "fuse3"),
    ];
    peers::require_fuse_and(&progs, missing)
}

// ---------------------------------------------------------------- one fio run

/// CPU counters of a stack's two processes at one instant.
struct Counters {
    server: Duration,
    server_nic: Duration,
    client: Duration,
    client_nic: Duration,
    machine: Duration,
}

impl Counters {
    fn read(server: &Running, client: &FuseClient, client_name: &str) -> Result<Counters> {
        let of = |pid: u32, what: &str| -> Result<(Duration, Duration)> {
            let all = cpu::process(pid)
                .with_context(|| format!("reading the CPU time of {what} (pid {pid})"))?;
            let nic = cpu::threads_named(pid, NIC_THREAD)
                .with_context(|| format!("reading the CPU time of {what}'s threads (pid {pid})"))?;
            Ok((all.total(), nic.total()))
        };
        let (server_all, server_nic) = of(server.pid(), server.server().name())?;
        let (client_all, client_nic) = of(client.pid(), client_name)?;
        Ok(Counters {
            server: server_all,
            server_nic,
            client: client_all,
            client_nic,
            machine: cpu::machine_busy().context("reading /proc/stat")?,
        })
    }
}

/// One fio run: what fio saw, and the CPU seconds each part used meanwhile.
struct Pass {
    fio: LatencyReport,
    server: f64,
    server_nic: f64,
    client: f64,
    client_nic: f64,
    machine: f64,
    /// How long the server or the client was seen stopped (SIGSTOP from outside).
    stopped_s: f64,
}

fn pass(
    stack: Stack,
    dir: RandDir,
    file: &Path,
    p: &Params,
    procs: (&Running, &FuseClient),
) -> Result<Pass> {
    let (server, client) = procs;
    let client_name = stack.fuse_program().name();
    let job = FileJob {
        name: "qd1",
        file,
        dir,
        bs: p.bs_bytes,
        size: p.size_bytes,
        runtime: Duration::from_secs_f64(p.runtime_s),
        own_group: true,
    };
    let a = Counters::read(server, client, client_name)?;
    let (fio, stopped) = stops::watching(&[server.pid(), client.pid()], || {
        fio::run_file(&job, &format!("{} through {client_name}", dir.rw()))
    });
    let fio = fio?;
    let b = Counters::read(server, client, client_name)?;
    let d = |x: Duration, y: Duration| x.saturating_sub(y).as_secs_f64();
    Ok(Pass {
        fio,
        server: d(b.server, a.server),
        server_nic: d(b.server_nic, a.server_nic),
        client: d(b.client, a.client),
        client_nic: d(b.client_nic, a.client_nic),
        machine: d(b.machine, a.machine),
        stopped_s: stopped.as_secs_f64(),
    })
}

/// Adds a pass's figures to `s`: rates and latencies, and CPU-ms per 10 000 operations.
fn record(s: &mut Samples, dir: RandDir, x: &Pass) {
    let rw = dir.rw();
    s.push(&format!("{rw}_iops"), x.fio.iops);
    s.push(&format!("{rw}_p50_us"), x.fio.clat_p50_us);
    s.push(&format!("{rw}_p99_us"), x.fio.clat_p99_us);
    s.push(&format!("{rw}_p99_9_us"), x.fio.clat_p99_9_us);
    s.push(&format!("{rw}_max_us"), x.fio.clat_max_us);
    s.push(&format!("{rw}_ios"), x.fio.ios);
    s.push(&format!("{rw}_runtime_s"), x.fio.runtime_s);
    s.push(&format!("{rw}_stopped_s"), x.stopped_s);
    let per_10k = |cpu_s: f64| cpu_s * 1e3 * 1e4 / x.fio.ios;
    for (k, v) in [
        ("server", x.server),
        ("server_nic", x.server_nic),
        ("client", x.client),
        ("client_nic", x.client_nic),
        ("client_app", (x.client - x.client_nic).max(0.0)),
        ("fio", x.fio.cpu_s),
        ("all", x.server + x.client + x.fio.cpu_s),
        ("machine", x.machine),
    ] {
        s.push(&format!("{rw}_cpu_ms_per_10k_{k}"), per_10k(v));
    }
}

// ---------------------------------------------------------------- one round

fn round(
    stack: Stack,
    n: usize,
    image: &Path,
    p: &Params,
    stop: &Interrupt,
    progress: &Progress,
) -> Result<Vec<(RandDir, Pass)>> {
    let name = stack.name();
    // Dropped last: the mount point and logs live in it.
    let dir = WorkDir::created(p.dir.join(format!("{name}-{n}")))?;
    let mut server = peers::start(
        stack.server(),
        &p.server_bin,
        image,
        dir.path.join("server.log"),
        true,
        None,
        p.netns.as_ref(),
    )?;
    stop.check()?;
    let mount_args: Vec<String> = ["--cache", "none"]
        .iter()
        .map(|a| a.to_string())
        .chain(p.mount_args.iter().cloned())
        .collect();
    let mut client = FuseClient::start(
        stack.fuse_program(),
        name,
        &server,
        (&p.mount_bin, &mount_args),
        &dir.path,
    )?;
    progress.line(&format!(
        "{name}: server pid {} on {}, {} pid {} on {}",
        server.pid(),
        server.uri(),
        stack.fuse_program().name(),
        client.pid(),
        client.device.display()
    ));
    let mut passes = Vec::new();
    for d in RandDir::BOTH {
        let mut tries = 1;
        let x = loop {
            stop.check()?;
            let x = pass(stack, d, &client.device, p, (&server, &client))?;
            if x.stopped_s == 0.0 || tries == TRIES {
                break x;
            }
            progress.line(&format!(
                "round {} {name} {}: stopped from outside for {:.1} s; running it again",
                n + 1,
                d.rw(),
                x.stopped_s
            ));
            tries += 1;
        };
        progress.line(&format!(
            "round {} {name} {}: {:.0} IOPS, p50 {:.0} µs, p99 {:.0} µs",
            n + 1,
            d.rw(),
            x.fio.iops,
            x.fio.clat_p50_us,
            x.fio.clat_p99_us
        ));
        passes.push((d, x));
    }
    client.stop()?;
    server.stop()?;
    Ok(passes)
}

// ---------------------------------------------------------------- the whole run

fn params(o: &Options, dir: PathBuf, netns: Option<Side>) -> Params {
    Params {
        netns,
        size_bytes: o.size,
        bs_bytes: BS,
        runtime_s: o.runtime.as_secs_f64(),
        repeat: o.repeat.max(1),
        server_bin: o.server_bin.clone(),
        mount_bin: o.mount_bin.clone(),
        mount_args: o.mount_args.clone(),
        dir,
        stacks: Stack::ALL
            .iter()
            .map(|s| (s.name(), s.describe()))
            .collect(),
        fio: format!(
            "{} --ioengine=psync --iodepth=1 --direct=1 --bs=4k --time_based, randread then \
             randwrite, offsets over the whole image (fio's default seed: the same sequence \
             for every stack)",
            fio::version()
        ),
        cache: "no page cache on either FUSE file (qpip-nbd-mount --cache none; \
                qemu-storage-daemon's FUSE export uses FOPEN_DIRECT_IO), O_DIRECT opens; both \
                servers serve the image on tmpfs through the page cache",
        cpu_accounting: "CPU-ms per 10 000 operations, from /proc/PID/stat around each fio \
             run: server = the server process (all threads; server_nic = its qpip-soft-nic \
             engine threads), client = the FUSE process (client_nic = its qpip-soft-nic \
             engine threads, client_app = the rest), fio = fio's usr+sys, all = server + \
             client + fio, machine = /proc/stat busy time (other processes included)",
    }
}

pub(crate) fn run_all(o: Options, progress: &Progress) -> Result<Qd1Report> {
    if o.size < (1 << 20) || !o.size.is_multiple_of(BS) {
        bail!("--size must be at least 1 MiB and a multiple of 4 KiB");
    }
    if !(o.runtime >= Duration::from_millis(100) && o.runtime <= Duration::from_secs(3600)) {
        bail!(
            "--runtime {:?}: expected between 0.1 and 3600 seconds",
            o.runtime
        );
    }
    check_prerequisites(&o)?;
    let stop = Interrupt::install()?;
    let work = WorkDir::fresh_in(o.dir.as_deref(), "qd1")?;
    // Dropped after every server (each stops within its round).
    let link = o.netns.create()?;
    let p = params(&o, work.path.clone(), link.as_ref().map(|l| l.side.clone()));
    progress.line(&format!(
        "writing a {} image of random data to {}",
        human_bytes(p.size_bytes),
        work.path.display()
    ));
    let image = Image::random(work.path.join("image.raw"), p.size_bytes, 0x0d1_5eed)?;
    let mut samples: BTreeMap<&'static str, Samples> = BTreeMap::new();
    for i in 0..p.repeat {
        for k in 0..Stack::ALL.len() {
            let stack = Stack::ALL[(i + k) % Stack::ALL.len()];
            stop.check()?;
            progress.line(&format!("round {}/{}: {}", i + 1, p.repeat, stack.name()));
            let passes = round(stack, i, &image.path, &p, &stop, progress)
                .with_context(|| format!("{} (round {})", stack.name(), i + 1))?;
            let s = samples.entry(stack.name()).or_default();
            for (d, x) in &passes {
                record(s, *d, x);
            }
        }
    }
    let stacks: BTreeMap<String, BTreeMap<String, Stat>> = samples
        .iter()
        .map(|(k, v)| (k.to_string(), v.stats()))
        .collect();
    let (ratios, targets) = report::targets(&stacks);
    Ok(Qd1Report {
        stacks,
        ratios,
        targets,
        params: p,
        machine: machine(),
    })
}
