//! `qpip-bench micro`: the QP interface against plain kernel sockets, side by side in one
//! run: host overhead per 1-byte message (the paper's Table 1), 1-byte round-trip time over
//! TCP and UDP, and ttcp-style throughput with CPU time split into application and NIC engine
//! threads.
//!
//! Each side of a QP test has its own NIC (own engine thread), as two hosts would.
//!
//! One file over 600 lines on purpose: each measure's QP half and socket half sit side by
//! side, so that a change to one is seen next to the other.

pub(crate) mod far;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use qpip_core::{
    Access, Completion, CompletionQueue, Nic, Opcode, QpAttr, QueuePair, RecvWr, SendWr, WcStatus,
};
use serde::Serialize;

use crate::cpu;
use crate::rig::netns::Side;
use far::{FarSide, Job, Meter, SideCpu};

/// Both figures of one comparison.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct Pair {
    pub qp: f64,
    pub socket: f64,
}

/// The round trips of one protocol: each QP waiter beside the socket that waits as it does.
#[derive(Debug, Serialize)]
pub(crate) struct RttWays {
    /// QP completion waits that spin up to 200 µs: against `socket_busy_poll`.
    pub qp_spin: RttRow,
    /// Non-blocking `recv` in a loop on both sides (busy polling).
    pub socket_busy_poll: RttRow,
    /// QP completion waits that sleep at once (`set_spin(0)`): against `socket_blocking`.
    pub qp_sleep: RttRow,
    /// Blocking `recv` on both sides.
    pub socket_blocking: RttRow,
    /// The QP's gain in round-trip time against its peer (socket time / QP time), median of
    /// each run's ratio: spin against busy-poll, and sleep against blocking. The runs
    /// alternate, so a machine that changes speed between runs moves both sides of a ratio;
    /// a ratio of two medians can pair runs from different spells.
    pub spin_gain: f64,
    pub sleep_gain: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Rtt {
    pub tcp: RttWays,
    pub udp: RttWays,
}

#[derive(Debug, Serialize)]
pub(crate) struct BySize {
    #[serde(rename = "16k")]
    pub k16: Pair,
    #[serde(rename = "128k")]
    pub k128: Pair,
}

#[derive(Debug, Serialize)]
#[allow(non_snake_case)]
pub(crate) struct MicroReport {
    pub overhead_ns: Pair,
    /// 1-byte round trips: latency and every thread's CPU per round trip, in µs.
    pub rtt: Rtt,
    /// The same round trips with a busy thread on every CPU ([`CpuLoad`]): what a NIC that
    /// polls costs when the cores have other work.
    pub rtt_loaded: Rtt,
    /// Which round-trip rows are compared: a spinning QP waiter with busy-polling sockets, a
    /// sleeping one with blocking sockets.
    pub rtt_comparisons: [[&'static str; 2]; 2],
    pub throughput_MBps: BySize,
    /// The application threads' own CPU per GB: for QPs without the NIC's work they ran
    /// while waiting (run to completion), which is counted in `engine_cpu_s_per_GB`.
    pub app_cpu_s_per_GB: BySize,
    /// The NIC's work per GB, wherever it ran: engine threads plus application threads
    /// driving their queues (QP only; a socket's "engine" is the kernel, which runs in the
    /// application threads' system time).
    pub engine_cpu_s_per_GB: BySize,
    pub repeat: usize,
    pub messages: MicroSizes,
    /// `--netns`: side B ran in this namespace, across a veth link.
    pub netns: Option<Side>,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct MicroSizes {
    pub overhead_msgs: u64,
    pub rtt_rounds: u64,
    pub ttcp_16k_bytes: u64,
    pub ttcp_128k_bytes: u64,
}

impl MicroSizes {
    pub(crate) fn full() -> Self {
        MicroSizes {
            overhead_msgs: 200_000,
            rtt_rounds: 20_000,
            ttcp_16k_bytes: 10_000_000,
            ttcp_128k_bytes: 1 << 30,
        }
    }
    pub(crate) fn quick() -> Self {
        MicroSizes {
            overhead_msgs: 20_000,
            rtt_rounds: 2_000,
            ttcp_16k_bytes: 10_000_000,
            ttcp_128k_bytes: 64 << 20,
        }
    }
}

const T: Duration = Duration::from_secs(60);

/// Side A of every measure (its application thread and, for QPs, its NIC's engine) runs on
/// CPU 0 and side B on CPU 1: two hosts of one core each, as the paper's two machines. Left to
/// the scheduler, the same run lands both sides on one core or on two, and the figures of
/// both stacks jump by several times between the two cases. Side B is the far side
/// ([`far`]): a thread here, or a process in `--netns`'s namespace.
const HOST_A: usize = 0;
const HOST_B: usize = 1;

fn pinning() -> bool {
    cpu::online_cpus() >= 2
}

/// Keeps the calling thread on one CPU while alive.
struct OnCpu;

impl OnCpu {
    fn new(cpu: usize) -> OnCpu {
        if pinning() {
            let _ = cpu::pin(0, cpu);
        }
        OnCpu
    }
}

impl Drop for OnCpu {
    fn drop(&mut self) {
        if pinning() {
            let _ = cpu::unpin(0);
        }
    }
}

/// A soft NIC whose engine thread runs on `cpu`.
fn nic_on(cpu: usize) -> Result<Nic> {
    let nic = Nic::soft()?;
    if pinning() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while nic.engine_threads().is_empty() {
            if Instant::now() > deadline {
                bail!("the soft NIC engine thread did not start");
            }
            thread::sleep(Duration::from_millis(1));
        }
        for tid in nic.engine_threads() {
            cpu::pin(tid, cpu).context("pinning the NIC engine thread")?;
        }
    }
    Ok(nic)
}

/// Side A's reliable QP of `depth` WRs each way, connected to the far side at `addr`.
fn connect_qp(
    nic: &Nic,
    cq: &CompletionQueue,
    depth: usize,
    addr: SocketAddr,
) -> Result<QueuePair> {
    let qp = nic.create_qp(QpAttr::new(cq).depths(depth, depth));
    qp.connect(addr)?;
    Ok(qp)
}

/// Side A's TCP socket, connected to the far side at `addr`.
fn connect_tcp(addr: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, T)?;
    s.set_nodelay(true)?;
    Ok(s)
}

fn check(c: &Completion) -> Result<()> {
    if c.status != WcStatus::Success {
        bail!("work request failed: {c:?}");
    }
    Ok(())
}

/// Waits for completions; an empty wait after `T` is an error, not a hang.
fn wait(cq: &CompletionQueue, buf: &mut [Completion]) -> Result<usize> {
    let n = cq.wait(buf, Some(T))?;
    if n == 0 {
        bail!("no completion within {T:?}");
    }
    Ok(n)
}

// ---------------------------------------------------------------- host overhead

/// Application-thread CPU per 1-byte message, send path plus receive path, in ns.
pub(crate) fn overhead_qp(net: Option<&Side>, msgs: u64) -> Result<f64> {
    let s = stream_qp(net, msgs, 1, 128)?;
    Ok(s.app_cpu.as_nanos() as f64 / msgs as f64)
}

pub(crate) fn overhead_socket(net: Option<&Side>, msgs: u64) -> Result<f64> {
    let (cpu, _) = stream_socket(net, msgs, 1)?;
    Ok(cpu.as_nanos() as f64 / msgs as f64)
}

// ---------------------------------------------------------------- round-trip time

/// How the waiting side of a round trip waits for its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waiter {
    /// QP: completion waits spin up to 200 µs before sleeping. Socket: a non-blocking recv
    /// in a loop (busy polling), never sleeping.
    Spin,
    /// QP: completion waits sleep at once (`set_spin(0)`). Socket: a blocking recv.
    Sleep,
}

impl Waiter {
    /// How long a QP completion wait spins before it sleeps.
    fn qp_spin(self) -> Duration {
        match self {
            // As a latency-bound QP user would.
            Waiter::Spin => Duration::from_micros(200),
            Waiter::Sleep => Duration::ZERO,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Waiter::Spin => "spin",
            Waiter::Sleep => "sleep",
        }
    }

    fn parse(s: &str) -> Result<Waiter> {
        match s {
            "spin" => Ok(Waiter::Spin),
            "sleep" => Ok(Waiter::Sleep),
            _ => bail!("expected spin or sleep, not {s:?}"),
        }
    }
}

/// One round-trip run: the median latency and every thread's CPU (client, echo and, for QPs,
/// both NICs' engine threads; user + system) per round trip, both in µs.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct RttRow {
    pub us: f64,
    pub cpu_us: f64,
}

/// The row of a run of `total` rounds whose timed ones took `samples` µs, `near` and `far`
/// the CPU of its two sides.
fn rtt_row(samples: Vec<f64>, near: SideCpu, far: SideCpu, total: u64) -> RttRow {
    RttRow {
        us: cpu::median(samples),
        cpu_us: (near.total() + far.total()).as_secs_f64() * 1e6 / total as f64,
    }
}

/// Median 1-byte round trip over QPs: reliable, or unreliable (`udp`).
pub(crate) fn rtt_qp(net: Option<&Side>, udp: bool, rounds: u64, waiter: Waiter) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let warmup = rounds / 10;
    let total = rounds + warmup;
    let mut far = FarSide::start(net, Job::RttQp { udp, total, waiter })?;
    let addr = far.addr()?;
    let nic = nic_on(HOST_A)?;
    let cq = nic.create_cq(8);
    cq.set_spin(waiter.qp_spin());
    let (a, dest) = if udp {
        let me = SocketAddr::new(far::near_ip(net), 0);
        let qp = nic.create_udp_qp(me, QpAttr::new(&cq).depths(4, 4))?;
        (qp, Some(addr))
    } else {
        (connect_qp(&nic, &cq, 4, addr)?, None)
    };
    let mr = nic.alloc_region(2, Access::READ_WRITE);
    a.post_recv(RecvWr::new(0, &[mr.sge(0, 1)]))?;
    far.ready()?;
    let meter = Meter::start(Some(&nic));
    let mut samples = Vec::with_capacity(rounds as usize);
    let mut buf = [Completion::default(); 4];
    for i in 0..total {
        let t0 = Instant::now();
        let mut wr = SendWr::new(1, &[mr.sge(1, 1)]);
        wr.dest = dest;
        a.post_send(wr)?;
        let (mut sent, mut back) = (false, false);
        while !(sent && back) {
            let n = wait(&cq, &mut buf)?;
            for c in &buf[..n] {
                check(c)?;
                match c.opcode {
                    Opcode::Send => sent = true,
                    Opcode::Recv => back = true,
                }
            }
        }
        let rtt = t0.elapsed();
        a.post_recv(RecvWr::new(0, &[mr.sge(0, 1)]))?;
        if i >= warmup {
            samples.push(rtt.as_secs_f64() * 1e6);
        }
    }
    let near = meter.stop();
    Ok(rtt_row(samples, near, far.finish()?, total))
}

/// Receives with `recv`: once, blocking (`Sleep`), or polled in a loop on a non-blocking
/// socket (`Spin`, as `recv(MSG_DONTWAIT)` in a loop), failing after `T` either way.
fn receive<R>(waiter: Waiter, mut recv: impl FnMut() -> std::io::Result<R>) -> Result<R> {
    if waiter == Waiter::Sleep {
        return Ok(recv()?);
    }
    let t0 = Instant::now();
    for i in 0u64.. {
        match recv() {
            Ok(r) => return Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
        if i % 4096 == 4095 && t0.elapsed() > T {
            break;
        }
    }
    bail!("nothing received within {T:?}")
}

/// A 1-byte TCP read under `waiter`; the end of the stream is an error.
fn read_byte(s: &mut TcpStream, byte: &mut [u8; 1], waiter: Waiter) -> Result<()> {
    if receive(waiter, || s.read(byte))? == 0 {
        bail!("the peer closed the connection");
    }
    Ok(())
}

/// Median 1-byte round trip over a TCP or UDP socket.
pub(crate) fn rtt_socket(
    net: Option<&Side>,
    udp: bool,
    rounds: u64,
    waiter: Waiter,
) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let warmup = rounds / 10;
    let total = rounds + warmup;
    let busy = waiter == Waiter::Spin;
    let mut far = FarSide::start(net, Job::RttSocket { udp, total, waiter })?;
    let addr = far.addr()?;
    let mut samples = Vec::with_capacity(rounds as usize);
    let mut byte = [7u8; 1];
    let meter;
    if udp {
        let a = UdpSocket::bind(SocketAddr::new(far::near_ip(net), 0))?;
        a.set_read_timeout(Some(T))?;
        a.set_nonblocking(busy)?;
        far.ready()?;
        meter = Meter::start(None);
        for i in 0..total {
            let t0 = Instant::now();
            a.send_to(&byte, addr)?;
            receive(waiter, || a.recv_from(&mut byte))?;
            if i >= warmup {
                samples.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    } else {
        let mut a = connect_tcp(addr)?;
        a.set_nonblocking(busy)?;
        far.ready()?;
        meter = Meter::start(None);
        for i in 0..total {
            let t0 = Instant::now();
            a.write_all(&byte)?;
            read_byte(&mut a, &mut byte, waiter)?;
            if i >= warmup {
                samples.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let near = meter.stop();
    Ok(rtt_row(samples, near, far.finish()?, total))
}

// ---------------------------------------------------------------- throughput (ttcp)

/// One ttcp run: MB/s, application CPU seconds per GB, engine CPU seconds per GB.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ttcp {
    pub mbps: f64,
    pub app_s_per_gb: f64,
    pub engine_s_per_gb: f64,
}

pub(crate) fn ttcp_qp(net: Option<&Side>, bytes: u64, msg: usize) -> Result<Ttcp> {
    // Enough WRs in flight to cover ~2 MiB, as a socket buffer would.
    let window = ((2 << 20) / msg).clamp(4, 128);
    let msgs = bytes.div_ceil(msg as u64);
    let s = stream_qp(net, msgs, msg, window)?;
    let gb = (msgs * msg as u64) as f64 / 1e9;
    Ok(Ttcp {
        mbps: gb * 1e3 / s.wall.as_secs_f64(),
        app_s_per_gb: s.app_cpu.as_secs_f64() / gb,
        engine_s_per_gb: s.engine_cpu.as_secs_f64() / gb,
    })
}

/// What one one-way stream of QP messages cost.
struct Stream {
    /// Sender plus receiver application threads, less the NIC work they ran while waiting.
    app_cpu: Duration,
    /// Both NICs' work: their engine threads and the application threads' drives.
    engine_cpu: Duration,
    wall: Duration,
}

/// Streams `msgs` messages of `msg` bytes from one NIC's QP to another's, `window` WRs in
/// flight on each side; both application threads sleep on their CQs when idle.
fn stream_qp(net: Option<&Side>, msgs: u64, msg: usize, window: usize) -> Result<Stream> {
    let _host_a = OnCpu::new(HOST_A);
    let mut far = FarSide::start(net, Job::StreamQp { msgs, msg, window })?;
    let addr = far.addr()?;
    let nic = nic_on(HOST_A)?;
    let cq = nic.create_cq(window * 2);
    cq.set_spin(Duration::ZERO);
    let a = connect_qp(&nic, &cq, window, addr)?;
    let tx_mr = nic.alloc_region(msg, Access::READ);
    far.ready()?;
    let wall = Instant::now();
    let meter = Meter::split(&nic);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut buf = [Completion::default(); 64];
    while done < msgs {
        while posted < msgs && posted - done < window as u64 {
            a.post_send(SendWr::new(posted, &[tx_mr.sge(0, msg)]))?;
            posted += 1;
        }
        let n = wait(&cq, &mut buf)?;
        for c in &buf[..n] {
            check(c)?;
            done += 1;
        }
    }
    let near = meter.stop();
    let far = far.finish()?;
    let wall = wall.elapsed();
    let driven = near.driven + far.driven;
    Ok(Stream {
        app_cpu: (near.app + far.app).saturating_sub(driven),
        engine_cpu: near.engine + far.engine + driven,
        wall,
    })
}

/// Streams `msgs` messages of `msg` bytes over TCP: both threads' CPU, and the wall time.
fn stream_socket(net: Option<&Side>, msgs: u64, msg: usize) -> Result<(Duration, Duration)> {
    let _host_a = OnCpu::new(HOST_A);
    let mut far = FarSide::start(net, Job::StreamSocket { msgs, msg })?;
    let mut a = connect_tcp(far.addr()?)?;
    far.ready()?;
    let buf = vec![7u8; msg];
    let wall = Instant::now();
    let meter = Meter::start(None);
    for _ in 0..msgs {
        a.write_all(&buf)?;
    }
    let near = meter.stop();
    let far = far.finish()?;
    Ok((near.total() + far.total(), wall.elapsed()))
}

pub(crate) fn ttcp_socket(net: Option<&Side>, bytes: u64, msg: usize) -> Result<Ttcp> {
    let msgs = bytes.div_ceil(msg as u64);
    let (cpu, wall) = stream_socket(net, msgs, msg)?;
    let gb = (msgs * msg as u64) as f64 / 1e9;
    Ok(Ttcp {
        mbps: gb * 1e3 / wall.as_secs_f64(),
        app_s_per_gb: cpu.as_secs_f64() / gb,
        engine_s_per_gb: 0.0,
    })
}

// ---------------------------------------------------------------- the whole run

/// Runs `f` `n` times, alternating with its peer inside the caller, and returns the median.
fn med(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(f()?);
    }
    Ok(cpu::median(v))
}

fn ttcp_pair(
    net: Option<&Side>,
    repeat: usize,
    bytes: u64,
    msg: usize,
    progress: &dyn Fn(&str),
) -> Result<(Ttcp, Ttcp)> {
    let (mut q, mut s) = (Vec::new(), Vec::new());
    for i in 0..repeat {
        progress(&format!(
            "ttcp {} KiB messages, run {}/{repeat}",
            msg / 1024,
            i + 1
        ));
        // Interleave so that machine noise hits both stacks alike.
        q.push(ttcp_qp(net, bytes, msg)?);
        s.push(ttcp_socket(net, bytes, msg)?);
    }
    let pick = |v: &[Ttcp]| Ttcp {
        mbps: cpu::median(v.iter().map(|t| t.mbps).collect()),
        app_s_per_gb: cpu::median(v.iter().map(|t| t.app_s_per_gb).collect()),
        engine_s_per_gb: cpu::median(v.iter().map(|t| t.engine_s_per_gb).collect()),
    };
    Ok((pick(&q), pick(&s)))
}

/// A busy thread on every online CPU (pinned there, at the benchmark's own priority) while
/// alive: other work that wants the cores the NICs and applications run on.
struct CpuLoad {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl CpuLoad {
    fn start() -> CpuLoad {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let threads = (0..cpu::online_cpus())
            .map(|c| {
                let stop = stop.clone();
                thread::spawn(move || {
                    let _ = cpu::pin(0, c);
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        CpuLoad { stop, threads }
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The rows of `RttWays`, in its order: (QP?, waiter).
const WAYS: [(bool, Waiter); 4] = [
    (true, Waiter::Spin),
    (false, Waiter::Spin),
    (true, Waiter::Sleep),
    (false, Waiter::Sleep),
];

/// The four round trips of one protocol, interleaved in every one of `repeat` runs of
/// `rounds` each; medians of latency and of CPU.
fn rtt_ways(repeat: usize, run: impl Fn(bool, Waiter) -> Result<RttRow>) -> Result<RttWays> {
    let mut rows: [Vec<RttRow>; 4] = Default::default();
    for _ in 0..repeat {
        for (v, &(qp, waiter)) in rows.iter_mut().zip(&WAYS) {
            v.push(run(qp, waiter)?);
        }
    }
    let gain = |qp: &[RttRow], socket: &[RttRow]| {
        cpu::median(qp.iter().zip(socket).map(|(q, s)| s.us / q.us).collect())
    };
    let (spin_gain, sleep_gain) = (gain(&rows[0], &rows[1]), gain(&rows[2], &rows[3]));
    let [a, b, c, d] = rows.map(|v| RttRow {
        us: cpu::median(v.iter().map(|r| r.us).collect()),
        cpu_us: cpu::median(v.iter().map(|r| r.cpu_us).collect()),
    });
    Ok(RttWays {
        qp_spin: a,
        socket_busy_poll: b,
        qp_sleep: c,
        socket_blocking: d,
        spin_gain,
        sleep_gain,
    })
}

/// TCP and UDP round trips, QP and socket, medians of `repeat` runs of `rounds` each.
fn round_trips(
    net: Option<&Side>,
    repeat: usize,
    rounds: u64,
    progress: &dyn Fn(&str),
    what: &str,
) -> Result<Rtt> {
    let ways = |udp: bool| {
        rtt_ways(repeat, |qp, w| {
            if qp {
                rtt_qp(net, udp, rounds, w)
            } else {
                rtt_socket(net, udp, rounds, w)
            }
        })
    };
    progress(&format!("round-trip time, TCP{what}"));
    let tcp = ways(false)?;
    progress(&format!("round-trip time, UDP{what}"));
    let udp = ways(true)?;
    Ok(Rtt { tcp, udp })
}

pub(crate) fn run(
    repeat: usize,
    sizes: MicroSizes,
    net: Option<&Side>,
    progress: &dyn Fn(&str),
) -> Result<MicroReport> {
    let repeat = repeat.max(1);
    progress("host overhead, 1-byte messages");
    let overhead = Pair {
        qp: med(repeat, || overhead_qp(net, sizes.overhead_msgs))?,
        socket: med(repeat, || overhead_socket(net, sizes.overhead_msgs))?,
    };
    let rtt = round_trips(net, repeat, sizes.rtt_rounds, progress, "")?;
    let rtt_loaded = {
        let _load = CpuLoad::start();
        // Under load a round trip waits for the scheduler: fewer rounds, the same repeats.
        round_trips(
            net,
            repeat,
            (sizes.rtt_rounds / 10).max(200),
            progress,
            ", CPUs loaded",
        )?
    };
    // The 10 MB run is over in milliseconds: take more samples of it.
    let (q16, s16) = ttcp_pair(net, repeat * 3, sizes.ttcp_16k_bytes, 16 * 1024, progress)?;
    let (q128, s128) = ttcp_pair(net, repeat, sizes.ttcp_128k_bytes, 128 * 1024, progress)?;
    Ok(MicroReport {
        overhead_ns: overhead,
        rtt,
        rtt_loaded,
        rtt_comparisons: [
            ["qp_spin", "socket_busy_poll"],
            ["qp_sleep", "socket_blocking"],
        ],
        throughput_MBps: BySize {
            k16: Pair {
                qp: q16.mbps,
                socket: s16.mbps,
            },
            k128: Pair {
                qp: q128.mbps,
                socket: s128.mbps,
            },
        },
        app_cpu_s_per_GB: BySize {
            k16: Pair {
                qp: q16.app_s_per_gb,
                socket: s16.app_s_per_gb,
            },
            k128: Pair {
                qp: q128.app_s_per_gb,
                socket: s128.app_s_per_gb,
            },
        },
        engine_cpu_s_per_GB: BySize {
            k16: Pair {
                qp: q16.engine_s_per_gb,
                socket: 0.0,
            },
            k128: Pair {
                qp: q128.engine_s_per_gb,
                socket: 0.0,
            },
        },
        repeat,
        messages: sizes,
        netns: net.cloned(),
    })
}

/// One row of `micro` alone (`--only`), to profile it: the same measure, pinned the same way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Row {
    /// 1-byte TCP round trips, QP waits spinning.
    QpTcp,
    /// 1-byte TCP round trips, sockets busy-polling.
    SocketTcp,
    /// 1-byte UDP round trips, QP waits spinning.
    QpUdp,
    /// 1-byte UDP round trips, sockets busy-polling.
    SocketUdp,
    /// ttcp over QPs in 16 KiB messages.
    #[value(name = "qp-16k")]
    Qp16k,
    /// ttcp over TCP sockets in 16 KiB messages.
    #[value(name = "socket-16k")]
    Socket16k,
    /// ttcp over QPs in 128 KiB messages.
    #[value(name = "qp-128k")]
    Qp128k,
    /// ttcp over TCP sockets in 128 KiB messages.
    #[value(name = "socket-128k")]
    Socket128k,
}

impl Row {
    /// Round trips, or MB for a ttcp row, of one run when `--count` does not say: about a
    /// second each (a ttcp row's count is MB, and the round trips' 100 000 MB took an hour).
    fn default_count(self) -> u64 {
        match self {
            Row::QpTcp | Row::SocketTcp | Row::QpUdp | Row::SocketUdp => 100_000,
            Row::Qp16k | Row::Socket16k | Row::Qp128k | Row::Socket128k => 1_000,
        }
    }
}

/// Runs `row` `repeat` times, `count` round trips or MB each (None: the row's default), and
/// prints a line per run.
pub(crate) fn run_row(
    row: Row,
    repeat: usize,
    count: Option<u64>,
    net: Option<&Side>,
    print: &mut dyn FnMut(String) -> Result<()>,
) -> Result<()> {
    let count = count.unwrap_or(row.default_count());
    let rtt = |r: RttRow| {
        format!(
            "round trip {:.2} µs, every thread's CPU {:.2} µs",
            r.us, r.cpu_us
        )
    };
    let ttcp = |t: Ttcp| {
        format!(
            "{:.0} MB/s, CPU per GB: application {:.3} s, NIC {:.3} s",
            t.mbps, t.app_s_per_gb, t.engine_s_per_gb
        )
    };
    let (spin, bytes) = (Waiter::Spin, count.saturating_mul(1_000_000));
    let (k16, k128) = (16 * 1024, 128 * 1024);
    for _ in 0..repeat.max(1) {
        print(match row {
            Row::QpTcp => rtt(rtt_qp(net, false, count, spin)?),
            Row::SocketTcp => rtt(rtt_socket(net, false, count, spin)?),
            Row::QpUdp => rtt(rtt_qp(net, true, count, spin)?),
            Row::SocketUdp => rtt(rtt_socket(net, true, count, spin)?),
            Row::Qp16k => ttcp(ttcp_qp(net, bytes, k16)?),
            Row::Socket16k => ttcp(ttcp_socket(net, bytes, k16)?),
            Row::Qp128k => ttcp(ttcp_qp(net, bytes, k128)?),
            Row::Socket128k => ttcp(ttcp_socket(net, bytes, k128)?),
        })?;
    }
    Ok(())
}

/// What the process holds: open descriptors and threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    descriptors: usize,
    threads: usize,
}

impl Held {
    fn now() -> Result<Held> {
        let count = |dir: &str| -> Result<usize> {
            Ok(std::fs::read_dir(dir)
                .with_context(|| format!("reading {dir}"))?
                .count())
        };
        Ok(Held {
            descriptors: count("/proc/self/fd")?,
            threads: count("/proc/self/task")?,
        })
    }

    fn within(self, before: Held) -> bool {
        self.descriptors <= before.descriptors && self.threads <= before.threads
    }
}

/// Runs `f` and fails if the process then holds more descriptors or threads than before:
/// every NIC it opened must have given back all it took.
pub(crate) fn without_leaks<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let before = Held::now()?;
    let out = f()?;
    // The kernel lists an exited thread until it has reaped it, which may come a moment
    // after its join returned.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = Held::now()?;
    while !after.within(before) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
        after = Held::now()?;
    }
    if !after.within(before) {
        bail!(
            "the run leaked: {} descriptors and {} threads after it, {} and {} before",
            after.descriptors,
            after.threads,
            before.descriptors,
            before.threads
        );
    }
    Ok(out)
}

/// The report as a terminal table.
pub(crate) fn table(r: &MicroReport) -> String {
    let row_with = |name: &str, unit: &str, p: Pair, gain: f64| {
        format!(
            "{name:<44} {:>12.2} {:>12.2}  {unit:<8} {:>6.2}x\n",
            p.qp, p.socket, gain
        )
    };
    let row = |name: &str, unit: &str, p: Pair, better_low: bool| {
        let gain = if better_low {
            p.socket / p.qp
        } else {
            p.qp / p.socket
        };
        row_with(name, unit, p, gain)
    };
    let mut s = match &r.netns {
        None => "side B in this process, over loopback (MTU 65536)\n\n".to_string(),
        Some(n) => format!(
            "side B in network namespace {} at {} (qpip-bench micro-echo), side A here at {}: \
             veth link, MTU {}\n\n",
            n.namespace, n.ns_ip, n.host_ip, n.mtu
        ),
    };
    s += &format!(
        "{:<44} {:>12} {:>12}  {:<8} {:>7}\n",
        "measure", "QP", "socket", "unit", "QP gain"
    );
    s += &row("host overhead, 1-byte msg", "ns", r.overhead_ns, true);
    for (rtt, loaded) in [(&r.rtt, ""), (&r.rtt_loaded, ", CPUs loaded")] {
        for (proto, w) in [("TCP", &rtt.tcp), ("UDP", &rtt.udp)] {
            for (qp, sock, gain, how) in [
                (w.qp_spin, w.socket_busy_poll, w.spin_gain, "spin/busy-poll"),
                (
                    w.qp_sleep,
                    w.socket_blocking,
                    w.sleep_gain,
                    "sleep/blocking",
                ),
            ] {
                let name = format!("round trip {proto}, {how}{loaded}");
                s += &row_with(
                    &name,
                    "µs",
                    Pair {
                        qp: qp.us,
                        socket: sock.us,
                    },
                    gain,
                );
                s += &row(
                    "  every thread CPU per round trip",
                    "µs",
                    Pair {
                        qp: qp.cpu_us,
                        socket: sock.cpu_us,
                    },
                    true,
                );
            }
        }
    }
    s += &row(
        "ttcp 10 MB in 16 KiB msgs",
        "MB/s",
        r.throughput_MBps.k16,
        false,
    );
    s += &row(
        "ttcp in 128 KiB msgs",
        "MB/s",
        r.throughput_MBps.k128,
        false,
    );
    s += &row(
        "app CPU per GB, 16 KiB",
        "s/GB",
        r.app_cpu_s_per_GB.k16,
        true,
    );
    s += &row(
        "app CPU per GB, 128 KiB",
        "s/GB",
        r.app_cpu_s_per_GB.k128,
        true,
    );
    s += &format!(
        "{:<44} {:>12.3} {:>12}  {:<8}\n",
        "NIC work CPU per GB, 128 KiB", r.engine_cpu_s_per_GB.k128.qp, "(kernel)", "s/GB"
    );
    let every = |size: &str, app: Pair, nic: Pair| {
        let p = Pair {
            qp: app.qp + nic.qp,
            socket: app.socket,
        };
        row(&format!("every thread CPU per GB, {size}"), "s/GB", p, true)
    };
    s += &every("16 KiB", r.app_cpu_s_per_GB.k16, r.engine_cpu_s_per_GB.k16);
    s += &every(
        "128 KiB",
        r.app_cpu_s_per_GB.k128,
        r.engine_cpu_s_per_GB.k128,
    );
    s += "\nround trips, each QP waiter against the socket that waits as it does:\n  \
          spin/busy-poll: QP completion waits spin up to 200 µs, sockets poll a non-blocking \
          recv in a loop;\n  sleep/blocking: QP completion waits sleep at once (set_spin(0)), \
          sockets block in recv.\n  CPU: client and echo threads (and both NICs' engine \
          threads), user + system.\n  A round trip's QP gain is the median of each run's \
          ratio (QP and socket runs alternate), the other rows' the ratio of the medians.\n";
    for w in lost_core_warnings(&r.rtt, &r.rtt_loaded) {
        s += &format!("warning: {w}\n");
    }
    s
}

/// A QP round trip this many times its socket peer's is no longer a matter of cost: a wait
/// lost its core (BENCHMARKS.md, session 20: polled waits that yielded to a CPU hog took a
/// tick, 3 999 µs, against a socket's 6.7).
const LOST_CORE_RATIO: f64 = 10.0;

/// The round-trip rows (idle CPUs, then loaded) where the QP took [`LOST_CORE_RATIO`] times
/// its peer's time or more.
fn lost_core_warnings(idle: &Rtt, loaded_cpus: &Rtt) -> Vec<String> {
    let mut out = Vec::new();
    for (rtt, loaded) in [(idle, ""), (loaded_cpus, ", CPUs loaded")] {
        for (proto, w) in [("TCP", &rtt.tcp), ("UDP", &rtt.udp)] {
            for (qp, sock, how) in [
                (w.qp_spin, w.socket_busy_poll, "spin/busy-poll"),
                (w.qp_sleep, w.socket_blocking, "sleep/blocking"),
            ] {
                if sock.us > 0.0 && qp.us >= LOST_CORE_RATIO * sock.us {
                    out.push(format!(
                        "round trip {proto}, {how}{loaded}: the QP's {:.1} µs is {:.0}x the \
                         socket's {:.2} µs: a QP wait is losing its core",
                        qp.us,
                        qp.us / sock.us,
                        sock.us
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qp_round_trip_ten_times_its_sockets_is_called_out() {
        let row = |us: f64| RttRow { us, cpu_us: us };
        let ways = |qp_spin: f64| RttWays {
            qp_spin: row(qp_spin),
            socket_busy_poll: row(6.7),
            qp_sleep: row(33.0),
            socket_blocking: row(30.0),
            spin_gain: 6.7 / qp_spin,
            sleep_gain: 30.0 / 33.0,
        };
        let idle = Rtt {
            tcp: ways(8.0),
            udp: ways(6.8),
        };
        assert!(lost_core_warnings(&idle, &idle).is_empty());
        let loaded = Rtt {
            tcp: ways(3999.0),
            udp: ways(66.0),
        };
        let warnings = lost_core_warnings(&idle, &loaded);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with(
                "round trip TCP, spin/busy-poll, CPUs loaded: the QP's 3999.0 µs is 597x"
            ),
            "{}",
            warnings[0]
        );
    }

    /// A round trip's gain pairs each QP run with the socket run beside it: where the machine
    /// changed speed between runs, the ratio of the two medians would pair runs from
    /// different spells (here 1.15x, where every pair but one says about 0.8x).
    #[test]
    fn a_round_trips_gain_is_the_median_of_each_runs_ratio() {
        let runs = [(12.0, 9.9), (8.4, 6.7), (8.5, 9.8)];
        let at = std::cell::Cell::new(0);
        let ways = rtt_ways(runs.len(), |qp, _| {
            let (q, s) = runs[at.get() / 4];
            at.set(at.get() + 1);
            let us = if qp { q } else { s };
            Ok(RttRow { us, cpu_us: us })
        })
        .unwrap();
        let per_run = |(q, s): (f64, f64)| s / q;
        assert_eq!(ways.spin_gain, per_run(runs[0]));
        assert_eq!(ways.sleep_gain, per_run(runs[0]));
        let of_medians = ways.socket_busy_poll.us / ways.qp_spin.us;
        assert!(of_medians > 1.1, "{of_medians}");
    }

    /// `--only` without `--count` runs about a second: round trips count round trips, ttcp
    /// rows count MB (the round trips' 100 000 as MB streamed for an hour).
    #[test]
    fn a_row_without_a_count_runs_about_a_second() {
        for row in [Row::QpTcp, Row::SocketTcp, Row::QpUdp, Row::SocketUdp] {
            assert_eq!(row.default_count(), 100_000, "{row:?}");
        }
        for row in [Row::Qp16k, Row::Socket16k, Row::Qp128k, Row::Socket128k] {
            let mb = row.default_count();
            assert!((100..=10_000).contains(&mb), "{row:?}: {mb} MB");
        }
    }
}
