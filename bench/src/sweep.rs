//! `qpip-bench nbd sweep`: raw sequential NBD writes and reads over request sizes and queue
//! depths. qpip: a load generator in qpip-bench on nbd_client's pipelined submit/reap API,
//! against qpip-nbd-server (both over QPs). Peers: fio's nbd engine (libnbd, a TCP socket)
//! against nbdkit (file plugin) and qemu-nbd, served as in `nbd raw`.
//!
//! Per round and stack: one image on tmpfs, filled with non-zero data first (so reads never
//! hit holes), one server; then for every size, depth and direction one point of at most
//! `--point-size` bytes and `--point-time` seconds (whichever comes first; the figure is the
//! bytes moved over the time taken). Connecting is not timed.
//!
//! Our client sends NBD requests of at most nbd_client::MAX_IO (1 MiB) with at most
//! MAX_WINDOW (64) in flight: a larger request size is issued as consecutive MAX_IO requests
//! with depth x (size / MAX_IO) of them in flight, capped at 64. fio sends each request
//! whole. The JSON says so per point (`nbd_requests_per_request`, `window`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nbd_client::{Client, ClientOptions, Op};
use serde::Serialize;

use crate::cpu;
use crate::progress::{Bar, Progress};
use crate::report::{Machine, TargetCheck, machine};
use crate::rig::fio;
use crate::rig::netns::{NetnsArgs, Side};
use crate::rig::peers::{self, NIC_THREAD, Running, Server};
use crate::rig::workdir::{Image, WorkDir};
use crate::stats::{Interrupt, Samples, Stat};
use crate::units::human_bytes;

const STACKS: [Server; 3] = [Server::Qpip, Server::Nbdkit, Server::QemuNbd];

fn stack_name(s: Server) -> &'static str {
    match s {
        Server::Qpip => "qpip",
        Server::Nbdkit => "fio-nbdkit",
        Server::QemuNbd => "fio-qemu-nbd",
        Server::NbdServer => "fio-nbd-server",
        Server::QpipRbd => "qpip-rbd",
        Server::QemuNbdRbd => "fio-qemu-nbd-rbd",
    }
}

pub(crate) struct Options {
    pub repeat: usize,
    pub sizes: Vec<u64>,
    pub depths: Vec<u32>,
    pub point_size: u64,
    pub point_time: Duration,
    pub server_bin: PathBuf,
    pub dir: Option<PathBuf>,
    pub netns: NetnsArgs,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Params {
    pub repeat: usize,
    pub sizes: Vec<u64>,
    pub depths: Vec<u32>,
    pub image_bytes: u64,
    pub point_time_s: f64,
    pub server_bin: PathBuf,
    pub dir: PathBuf,
    pub clients: BTreeMap<&'static str, String>,
    /// `--netns`: the servers run in this namespace, the clients here, across a veth link.
    pub netns: Option<Side>,
}

#[derive(Clone, Debug, Serialize)]
#[allow(non_snake_case)]
pub(crate) struct Point {
    pub stack: &'static str,
    pub dir: &'static str,
    pub size: u64,
    pub depth: u32,
    pub MBps: Stat,
    pub server_cpu_s_per_GB: Stat,
    pub client_cpu_s_per_GB: Stat,
    /// Of qpip's CPU, the NIC engine threads (server's and client's).
    pub nic_cpu_s_per_GB: Stat,
    pub bytes: Stat,
    pub nbd_requests_per_request: u64,
    pub window: u64,
}

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Ratio {
    pub dir: &'static str,
    pub size: u64,
    pub depth: u32,
    pub best_peer: &'static str,
    pub ratio: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct SweepReport {
    pub points: Vec<Point>,
    /// qpip's MB/s over the best peer's, per point.
    pub ratios: Vec<Ratio>,
    pub target: TargetCheck,
    pub params: Params,
    pub machine: Machine,
}

struct Measured {
    bytes: u64,
    secs: f64,
    server_cpu: f64,
    client_cpu: f64,
    nic_cpu: f64,
}

fn nic(pid: u32) -> f64 {
    cpu::threads_named(pid, NIC_THREAD)
        .map(|c| c.total().as_secs_f64())
        .unwrap_or(0.0)
}

fn proc_cpu(pid: u32) -> Result<f64> {
    Ok(cpu::process(pid)
        .with_context(|| format!("reading CPU time of pid {pid}"))?
        .total()
        .as_secs_f64())
}

/// Our client: `depth` requests of `size` in flight (see the module doc for sizes above
/// MAX_IO).
fn qpip_point(
    server: &Running,
    write: bool,
    size: u64,
    depth: u32,
    bytes: u64,
    time: Duration,
) -> Result<(Measured, u64, u64)> {
    let want = (u64::from(depth) * size.div_ceil(nbd_client::MAX_IO as u64))
        .min(nbd_client::MAX_WINDOW as u64);
    let opts = ClientOptions {
        window: want as usize,
        base_allocation: false,
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&server.uri(), opts)
        .with_context(|| format!("connecting to {}", server.uri()))?;
    let chunk = size.min(u64::from(c.max_io()));
    let per = size.div_ceil(chunk);
    let window = (u64::from(depth) * per).min(c.window() as u64);
    let data = vec![0x5au8; chunk as usize];
    let me = std::process::id();
    let (s0, c0, n0) = (
        proc_cpu(server.pid())?,
        proc_cpu(me)?,
        nic(server.pid()) + nic(me),
    );
    let t0 = Instant::now();
    let mut off = 0u64;
    let mut tag = 0u64;
    while off + size <= bytes && t0.elapsed() < time {
        for k in 0..per {
            while c.in_flight() as u64 >= window {
                c.reap()?.result?;
            }
            let o = off + k * chunk;
            let op = if write {
                Op::Write {
                    offset: o,
                    data: &data,
                    fua: false,
                }
            } else {
                Op::Read {
                    offset: o,
                    len: chunk as u32,
                }
            };
            c.submit(tag, op)?;
            tag += 1;
        }
        off += size;
    }
    while c.in_flight() > 0 {
        c.reap()?.result?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let (s1, c1, n1) = (
        proc_cpu(server.pid())?,
        proc_cpu(me)?,
        nic(server.pid()) + nic(me),
    );
    let _ = c.disconnect();
    Ok((
        Measured {
            bytes: off,
            secs,
            server_cpu: s1 - s0,
            client_cpu: c1 - c0,
            nic_cpu: n1 - n0,
        },
        per,
        window,
    ))
}

fn fio_point(
    server: &Running,
    write: bool,
    size: u64,
    depth: u32,
    bytes: u64,
    time: Duration,
) -> Result<Measured> {
    let rw = if write { "write" } else { "read" };
    let job = fio::Job {
        name: "nbd-sweep",
        rw,
        bs: size,
        iodepth: depth,
        jobs: 1,
        size: bytes - bytes % size,
        runtime: Some(time),
        own_group: true,
    };
    let s0 = proc_cpu(server.pid())?;
    let fio = fio::run(&job, server, &format!("{rw} bs={size} iodepth={depth}"))?;
    let s1 = proc_cpu(server.pid())?;
    Ok(Measured {
        bytes: fio.io_bytes as u64,
        secs: fio.runtime_s.max(1e-6),
        server_cpu: s1 - s0,
        client_cpu: fio.cpu_s,
        nic_cpu: 0.0,
    })
}

type Key = (&'static str, &'static str, u64, u32);

/// What one round's measurements add up to, per point.
#[derive(Default)]
struct Collected {
    samples: BTreeMap<Key, Samples>,
    /// NBD requests per request and the window, per point.
    shape: BTreeMap<Key, (u64, u64)>,
}

pub(crate) fn run_all(o: Options, progress: &Progress) -> Result<SweepReport> {
    let image_bytes = check_options(&o)?;
    peers::check_prerequisites(&o.server_bin)?;
    let stop = Interrupt::install()?;
    let work = WorkDir::on_tmpfs(o.dir.as_deref(), "sweep")?;
    let base = work.path.clone();
    // Dropped after every server (each stops within its round).
    let link = o.netns.create()?;
    let net = link.as_ref().map(|l| l.side.clone());
    let params = params(&o, image_bytes, base.clone(), net.clone());
    let npoints = (o.sizes.len() * o.depths.len() * 2 * STACKS.len() * params.repeat) as u64;
    let mut bar = progress.steps("points".into(), npoints);
    let mut collected = Collected::default();
    for i in 0..params.repeat {
        let round = Round {
            o: &o,
            base: &base,
            image_bytes,
            number: i + 1,
            stop: &stop,
            net: net.as_ref(),
        };
        for k in 0..STACKS.len() {
            stop.check()?;
            round.stack(STACKS[(i + k) % STACKS.len()], &mut bar, &mut collected)?;
        }
    }
    bar.finish("done");
    let points = points(&collected);
    let ratios = ratios(&points, &o.sizes, &o.depths);
    let target = target(&ratios);
    Ok(SweepReport {
        points,
        ratios,
        target,
        params,
        machine: machine(),
    })
}

/// Checks the sizes and depths asked for; returns the image's size: at least a point's
/// bytes, a whole number of the largest request.
fn check_options(o: &Options) -> Result<u64> {
    if o.sizes.is_empty() || o.depths.is_empty() {
        bail!("--sizes and --depths must not be empty");
    }
    if let Some(d) = o.depths.iter().find(|&&d| d == 0 || d > 64) {
        bail!("queue depth {d} is outside 1..=64");
    }
    let largest = *o.sizes.iter().max().expect("not empty");
    if o.sizes
        .iter()
        .any(|s| !largest.is_multiple_of(*s) || s % 512 != 0)
    {
        bail!("request sizes must be multiples of 512 that divide the largest one");
    }
    Ok(o.point_size.max(largest).next_multiple_of(largest))
}

/// The report's record of how the sweep ran.
fn params(o: &Options, image_bytes: u64, dir: PathBuf, netns: Option<Side>) -> Params {
    let fio_version = fio::version();
    let fio = format!("{fio_version} --ioengine=nbd (libnbd, TCP), 1 job, 1 connection");
    Params {
        repeat: o.repeat.max(1),
        sizes: o.sizes.clone(),
        depths: o.depths.clone(),
        image_bytes,
        point_time_s: o.point_time.as_secs_f64(),
        server_bin: o.server_bin.clone(),
        dir,
        netns,
        clients: BTreeMap::from([
            (
                "qpip",
                "qpip-bench's load generator on nbd_client (QPs), 1 connection; requests above \
                 1 MiB go as 1 MiB NBD requests, at most 64 in flight"
                    .to_string(),
            ),
            ("fio-nbdkit", fio.clone()),
            ("fio-qemu-nbd", fio),
        ]),
    }
}

/// One stack's turn in one round.
struct Round<'a> {
    o: &'a Options,
    base: &'a Path,
    image_bytes: u64,
    /// Counted from 1.
    number: usize,
    stop: &'a Interrupt,
    /// `--netns`: the namespace the servers run in.
    net: Option<&'a Side>,
}

impl Round<'_> {
    /// Serves a fresh filled image with `server` and measures every size, depth and
    /// direction against it.
    fn stack(&self, server: Server, bar: &mut Bar, collected: &mut Collected) -> Result<()> {
        let name = stack_name(server);
        let image = Image::filled(
            self.base.join(format!("{name}.img")),
            self.image_bytes,
            0xa5,
        )?;
        let mut running = peers::start(
            server,
            &self.o.server_bin,
            &image.path,
            self.base.join(format!("{name}.log")),
            true,
            None,
            self.net,
        )?;
        for &size in &self.o.sizes {
            for &depth in &self.o.depths {
                for (dir, write) in [("write", true), ("read", false)] {
                    self.stop.check()?;
                    bar.set_message(format!(
                        "round {} {name} {dir} {} qd{depth}",
                        self.number,
                        human_bytes(size)
                    ));
                    let key = (name, dir, size, depth);
                    self.point(&running, server, key, write, collected)?;
                    bar.inc(1);
                }
            }
        }
        running.stop()
    }

    /// Measures one point and adds it to `collected`.
    fn point(
        &self,
        running: &Running,
        server: Server,
        key: Key,
        write: bool,
        collected: &mut Collected,
    ) -> Result<()> {
        let (name, dir, size, depth) = key;
        let (bytes, time) = (self.image_bytes, self.o.point_time);
        let (m, per, window) = if server == Server::Qpip {
            qpip_point(running, write, size, depth, bytes, time)?
        } else {
            let m = fio_point(running, write, size, depth, bytes, time)?;
            (m, 1, u64::from(depth))
        };
        if m.bytes == 0 {
            bail!("{name} {dir} {size} qd{depth}: no bytes moved");
        }
        let gb = m.bytes as f64 / 1e9;
        let s = collected.samples.entry(key).or_default();
        s.push("MBps", m.bytes as f64 / 1e6 / m.secs);
        s.push("server", m.server_cpu / gb);
        s.push("client", m.client_cpu / gb);
        s.push("nic", m.nic_cpu / gb);
        s.push("bytes", m.bytes as f64);
        collected.shape.insert(key, (per, window));
        Ok(())
    }
}

/// Each point's figures over the rounds, writes first, by size, depth and stack.
fn points(c: &Collected) -> Vec<Point> {
    let mut points = Vec::new();
    for (key, s) in &c.samples {
        let st = s.stats();
        let (per, window) = c.shape[key];
        points.push(Point {
            stack: key.0,
            dir: key.1,
            size: key.2,
            depth: key.3,
            MBps: st["MBps"].clone(),
            server_cpu_s_per_GB: st["server"].clone(),
            client_cpu_s_per_GB: st["client"].clone(),
            nic_cpu_s_per_GB: st["nic"].clone(),
            bytes: st["bytes"].clone(),
            nbd_requests_per_request: per,
            window,
        });
    }
    points.sort_by_key(|p| (p.dir != "write", p.size, p.depth, p.stack));
    points
}

/// qpip's median MB/s over the best peer's, per direction, size and depth.
fn ratios(points: &[Point], sizes: &[u64], depths: &[u32]) -> Vec<Ratio> {
    let mbps = |stack: &str, dir: &str, size: u64, depth: u32| {
        points
            .iter()
            .find(|p| p.stack == stack && p.dir == dir && p.size == size && p.depth == depth)
            .map(|p| p.MBps.median)
    };
    let mut ratios = Vec::new();
    for dir in ["write", "read"] {
        for &size in sizes {
            for &depth in depths {
                let Some(q) = mbps("qpip", dir, size, depth) else {
                    continue;
                };
                let best = ["fio-nbdkit", "fio-qemu-nbd"]
                    .into_iter()
                    .filter_map(|p| Some((p, mbps(p, dir, size, depth)?)))
                    .max_by(|a, b| a.1.total_cmp(&b.1));
                if let Some((peer, v)) = best {
                    ratios.push(Ratio {
                        dir,
                        size,
                        depth,
                        best_peer: peer,
                        ratio: q / v,
                    });
                }
            }
        }
    }
    ratios
}

/// The sweep's target: qpip at least 1.2x the best peer wherever requests are 256 KiB and up.
fn target(ratios: &[Ratio]) -> TargetCheck {
    let big: Vec<&Ratio> = ratios.iter().filter(|r| r.size >= 256 << 10).collect();
    let worst = big.iter().map(|r| r.ratio).fold(f64::INFINITY, f64::min);
    TargetCheck {
        rule: "qpip MB/s >= 1.2x the best peer at every point with requests of 256 KiB and up \
               (value: the worst such point)"
            .into(),
        value: worst,
        threshold: 1.2,
        met: !big.is_empty() && worst >= 1.2,
    }
}

/// The report as a terminal table.
pub(crate) fn table(r: &SweepReport) -> String {
    let p = &r.params;
    let mut s = format!(
        "nbd sweep: sequential raw NBD I/O, at most {} and {:.1} s per point, median of {} \
         round(s) [min-max]; MB = 10^6 bytes\nqpip = nbd_client load generator -> \
         qpip-nbd-server (QPs); peers = fio nbd engine (libnbd, TCP) -> nbdkit / qemu-nbd\n",
        human_bytes(p.image_bytes),
        p.point_time_s,
        p.repeat
    );
    s += &crate::nbd::link_line(p.netns.as_ref());
    s += &format!(
        "{:<5} {:>8} {:>3} | {:>16} {:>16} {:>16} | {:>6} | {:>20}\n",
        "dir",
        "size",
        "qd",
        "qpip MB/s",
        "nbdkit MB/s",
        "qemu-nbd MB/s",
        "q/best",
        "srv CPU s/GB q/k/qn"
    );
    for ratio in &r.ratios {
        let get = |stack: &str| {
            r.points.iter().find(|x| {
                x.stack == stack
                    && x.dir == ratio.dir
                    && x.size == ratio.size
                    && x.depth == ratio.depth
            })
        };
        let cell = |stack: &str| get(stack).map_or("-".to_string(), |x| x.MBps.cell(0));
        let cpu = |stack: &str| {
            get(stack).map_or("-".to_string(), |x| {
                format!("{:.2}", x.server_cpu_s_per_GB.median)
            })
        };
        s += &format!(
            "{:<5} {:>8} {:>3} | {:>16} {:>16} {:>16} | {:>5.2}x | {:>20}\n",
            ratio.dir,
            human_bytes(ratio.size),
            ratio.depth,
            cell("qpip"),
            cell("fio-nbdkit"),
            cell("fio-qemu-nbd"),
            ratio.ratio,
            format!(
                "{}/{}/{}",
                cpu("qpip"),
                cpu("fio-nbdkit"),
                cpu("fio-qemu-nbd")
            ),
        );
    }
    s += &format!(
        "\ntarget ({}): {:.2}x {}\n",
        r.target.rule,
        r.target.value,
        if r.target.met { "met" } else { "MISSED" }
    );
    s
}
