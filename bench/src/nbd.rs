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
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::cpu;
use crate::rig::fio;
use crate::rig::netns::{NetnsArgs, Side};
use crate::rig::peers::{self, NIC_THREAD, RbdBench, RbdImage, Running, Server};
use crate::rig::workdir::{Image, WorkDir};
use crate::units::human_bytes;

/// What `nbd raw` runs.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Params {
    pub size_bytes: u64,
    pub bs_bytes: u64,
    pub iodepth: u32,
    /// Connections (fio jobs), each with `iodepth` requests in flight.
    pub jobs: u32,
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
    /// `--netns`: the servers run in this namespace, fio here, across a veth link.
    pub netns: Option<Side>,
}

impl Params {
    /// The servers of each round.
    fn servers(&self) -> Vec<Server> {
        let mut v = Server::ALL.to_vec();
        if let Some(r) = &self.rbd {
            v.push(Server::QpipRbd);
            if r.qemu {
                v.push(Server::QemuNbdRbd);
            }
        }
        v
    }
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
fn fio_pass(r: &Running, dir: Dir, p: &Params) -> Result<Pass> {
    let job = fio::Job {
        name: "nbd-raw",
        rw: dir.name(),
        bs: p.bs_bytes,
        iodepth: p.iodepth,
        jobs: p.jobs,
        size: p.size_bytes,
        runtime: None,
        own_group: false,
    };
    let server = r.server().name();
    let cpu_now = || {
        cpu::process(r.pid())
            .with_context(|| format!("reading CPU time of {server} (pid {})", r.pid()))
    };
    let before = cpu_now()?;
    let nic_before = cpu::threads_named(r.pid(), NIC_THREAD)?;
    let fio = fio::run(&job, r, &format!("{} against {server}", dir.name()))?;
    let after = cpu_now()?;
    let nic_after = cpu::threads_named(r.pid(), NIC_THREAD)?;
    if fio.io_bytes < p.size_bytes as f64 {
        bail!(
            "fio {} against {server} moved {} of {} bytes",
            dir.name(),
            fio.io_bytes,
            p.size_bytes
        );
    }
    let gb = fio.io_bytes / 1e9;
    // With several connections, fio's group bandwidth adds up each job's own rate, which
    // overstates a server that serves its clients one after another: take the bytes over the
    // whole run's wall time instead (it includes fio's start, the same for every server).
    let mbps = if p.jobs > 1 {
        fio.io_bytes / fio.wall_s / 1e6
    } else {
        fio.bw_bytes / 1e6
    };
    Ok(Pass {
        mbps,
        server_s_per_gb: (after - before).total().as_secs_f64() / gb,
        nic_s_per_gb: (nic_after - nic_before).total().as_secs_f64() / gb,
        client_s_per_gb: fio.cpu_s / gb,
    })
}

// ---------------------------------------------------------------- the whole run

#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct Spread {
    pub min: f64,
    pub max: f64,
}

/// Medians over the rounds, then min/max and every sample.
#[derive(Clone, Debug, Serialize)]
#[allow(non_snake_case)]
pub(crate) struct ServerFigures {
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
pub(crate) struct Target {
    pub rule: &'static str,
    pub met: bool,
}

#[derive(Debug, Serialize)]
pub(crate) struct NbdRawReport {
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
        running = peers::start_rbd(server, &p.server_bin, rbd, &img.name, log, p.netns.as_ref())?;
        _rbd_image = Some(img);
        _file = None;
    } else {
        let image = Image::sparse(p.dir.join(format!("{name}.img")), p.size_bytes)?;
        running = peers::start(
            server,
            &p.server_bin,
            &image.path,
            log,
            false,
            p.tls.as_deref(),
            p.netns.as_ref(),
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
pub(crate) fn run(
    size: u64,
    bs: u64,
    iodepth: u32,
    jobs: u32,
    repeat: usize,
    server_bin: PathBuf,
    dir: Option<&Path>,
    prewrite: bool,
    tls: bool,
    rbd: Option<RbdBench>,
    netns: NetnsArgs,
    progress: &dyn Fn(&str),
) -> Result<NbdRawReport> {
    let repeat = repeat.max(1);
    if !size.is_multiple_of(bs) {
        bail!("--size {size} is not a multiple of --bs {bs}");
    }
    if jobs == 0 || !(size / bs).is_multiple_of(u64::from(jobs)) {
        bail!(
            "--jobs {jobs}: --size {size} must split into that many slices of whole --bs requests"
        );
    }
    peers::check_prerequisites(&server_bin)?;
    if let Some(r) = &rbd {
        if crate::rig::in_path("rbd").is_none() {
            bail!("--rbd-conf: rbd not found in PATH (package ceph-common)");
        }
        if !r.conf.is_file() {
            bail!(
                "--rbd-conf: {} does not exist (scripts/ceph-dev starts a cluster)",
                r.conf.display()
            );
        }
    }
    let work = WorkDir::new(dir, "nbd")?;
    // In a directory of the user's, only the files of a round: images and logs.
    let files = Server::ALL
        .iter()
        .flat_map(|s| ["img", "log"].map(|ext| format!("{}.{ext}", s.name())))
        .collect();
    work.clean_up_on_signals(files, "qpip-bench nbd raw: interrupted; images deleted")?;
    // Dropped after every server (each stops within its round).
    let link = netns.create()?;
    let fio_version = fio::version();
    let params = Params {
        size_bytes: size,
        bs_bytes: bs,
        iodepth,
        jobs,
        repeat,
        server_bin,
        dir: work.path.clone(),
        client: format!(
            "{fio_version} --ioengine=nbd, {jobs} job(s), {jobs} connection(s), one slice of the image each"
        ),
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
        netns: link.as_ref().map(|l| l.side.clone()),
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
    if params.rbd.as_ref().is_some_and(|r| r.qemu) {
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

/// The table's line on where the servers ran: over loopback, or across the veth link.
pub(crate) fn link_line(net: Option<&Side>) -> String {
    match net {
        None => "servers on 127.0.0.1 (loopback, MTU 65536)\n\n".into(),
        Some(n) => format!(
            "servers in network namespace {} at {}, clients here at {}: veth link, MTU {}\n\n",
            n.namespace, n.ns_ip, n.host_ip, n.mtu
        ),
    }
}

/// The report as a terminal table.
pub(crate) fn table(r: &NbdRawReport) -> String {
    let p = &r.params;
    let mut s = format!(
        "nbd raw: sequential write then read of {} in {} requests, {} in flight on each of {} \
         connection(s), fio nbd engine;\n\
         page-cache-hot {} raw files for all servers; median of {} rounds [min-max]{}\n",
        human_bytes(p.size_bytes),
        human_bytes(p.bs_bytes),
        p.iodepth,
        p.jobs,
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
    s += &link_line(p.netns.as_ref());
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
    if p.rbd.as_ref().is_some_and(|r| r.qemu) {
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
