//! `qpip-bench micro`: the QP interface against plain kernel sockets, side by side in one
//! run: host overhead per 1-byte message (the paper's Table 1), 1-byte round-trip time over
//! TCP and UDP, and ttcp-style throughput with CPU time split into application and NIC engine
//! threads.
//!
//! Each side of a QP test has its own NIC (own engine thread), as two hosts would.
//!
//! One file over 600 lines on purpose: each measure's QP half and socket half sit side by
//! side, so that a change to one is seen next to the other.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use qpip_core::{
    Access, Completion, CompletionQueue, Nic, Opcode, QpAttr, QueuePair, RecvWr, SendWr, WcStatus,
};
use serde::Serialize;

use crate::cpu;

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

const LOOPBACK: &str = "127.0.0.1:0";
const T: Duration = Duration::from_secs(60);

fn any_addr() -> SocketAddr {
    LOOPBACK.parse().expect("literal address")
}

/// Two NICs and a connected pair of reliable QPs between them.
struct QpLink {
    a_nic: Nic,
    b_nic: Nic,
    a_cq: CompletionQueue,
    b_cq: CompletionQueue,
    a: QueuePair,
    b: QueuePair,
}

/// Side A of every measure (its application thread and, for QPs, its NIC's engine) runs on
/// CPU 0 and side B on CPU 1: two hosts of one core each, as the paper's two machines. Left to
/// the scheduler, the same run lands both sides on one core or on two, and the figures of
/// both stacks jump by several times between the two cases.
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

/// A thread of side `cpu`.
fn spawn_on<T: Send + 'static>(
    cpu: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> thread::JoinHandle<T> {
    thread::spawn(move || {
        let _on = OnCpu::new(cpu);
        f()
    })
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

fn qp_link(depth: usize) -> Result<QpLink> {
    let a_nic = nic_on(HOST_A)?;
    let b_nic = nic_on(HOST_B)?;
    let a_cq = a_nic.create_cq(depth * 2);
    let b_cq = b_nic.create_cq(depth * 2);
    let listener = b_nic.listen(any_addr())?;
    let b = b_nic.create_qp(QpAttr::new(&b_cq).depths(depth, depth));
    let a = a_nic.create_qp(QpAttr::new(&a_cq).depths(depth, depth));
    a.connect(listener.local_addr())?;
    listener.accept_timeout(&b, T)?;
    Ok(QpLink {
        a_nic,
        b_nic,
        a_cq,
        b_cq,
        a,
        b,
    })
}

fn tcp_pair() -> Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind(any_addr())?;
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
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
pub(crate) fn overhead_qp(msgs: u64) -> Result<f64> {
    let s = stream_qp(msgs, 1, 128)?;
    Ok(s.app_cpu.as_nanos() as f64 / msgs as f64)
}

pub(crate) fn overhead_socket(msgs: u64) -> Result<f64> {
    let _host_a = OnCpu::new(HOST_A);
    let (mut a, mut b) = tcp_pair()?;
    let receiver = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut byte = [0u8; 1];
        for _ in 0..msgs {
            b.read_exact(&mut byte)?;
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    for _ in 0..msgs {
        a.write_all(&[7])?;
    }
    let send_cpu = cpu::this_thread() - start;
    let recv_cpu = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    Ok((send_cpu + recv_cpu).as_nanos() as f64 / msgs as f64)
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

/// The QP's spin before a completion wait sleeps, for a latency-bound QP user.
const QP_SPIN: Duration = Duration::from_micros(200);

/// One round-trip run: the median latency and every thread's CPU (client, echo and, for QPs,
/// both NICs' engine threads; user + system) per round trip, both in µs.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct RttRow {
    pub us: f64,
    pub cpu_us: f64,
}

/// The CPU per round trip of a run of `total` rounds.
fn cpu_per_round(cpu: Duration, total: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / total as f64
}

/// Median 1-byte round trip over reliable QPs.
pub(crate) fn rtt_qp_tcp(rounds: u64, waiter: Waiter) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let link = qp_link(4)?;
    rtt_qp(
        link.a_nic.clone(),
        link.b_nic.clone(),
        link.a,
        link.b,
        link.a_cq,
        link.b_cq,
        None,
        rounds,
        waiter,
    )
}

/// Median 1-byte round trip over unreliable QPs.
pub(crate) fn rtt_qp_udp(rounds: u64, waiter: Waiter) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let a_nic = nic_on(HOST_A)?;
    let b_nic = nic_on(HOST_B)?;
    let a_cq = a_nic.create_cq(8);
    let b_cq = b_nic.create_cq(8);
    let a = a_nic.create_udp_qp(any_addr(), QpAttr::new(&a_cq).depths(4, 4))?;
    let b = b_nic.create_udp_qp(any_addr(), QpAttr::new(&b_cq).depths(4, 4))?;
    let b_addr = b.local_addr().context("bound UDP QP has an address")?;
    rtt_qp(a_nic, b_nic, a, b, a_cq, b_cq, Some(b_addr), rounds, waiter)
}

#[allow(clippy::too_many_arguments)]
fn rtt_qp(
    a_nic: Nic,
    b_nic: Nic,
    a: QueuePair,
    b: QueuePair,
    a_cq: CompletionQueue,
    b_cq: CompletionQueue,
    b_addr: Option<SocketAddr>,
    rounds: u64,
    waiter: Waiter,
) -> Result<RttRow> {
    let spin = match waiter {
        Waiter::Spin => QP_SPIN,
        Waiter::Sleep => Duration::ZERO,
    };
    a_cq.set_spin(spin);
    b_cq.set_spin(spin);
    let a_mr = a_nic.alloc_region(2, Access::READ_WRITE);
    let b_mr = b_nic.alloc_region(2, Access::READ_WRITE);
    let engines: Vec<i32> = a_nic
        .engine_threads()
        .into_iter()
        .chain(b_nic.engine_threads())
        .collect();
    let engine0 = cpu::threads(&engines);
    let warmup = rounds / 10;
    let total = rounds + warmup;
    b.post_recv(RecvWr::new(0, &[b_mr.sge(0, 1)]))?;
    let echo = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut buf = [Completion::default(); 4];
        let mut echoed = 0;
        while echoed < total {
            let n = wait(&b_cq, &mut buf)?;
            for c in &buf[..n] {
                check(c)?;
                if c.opcode == Opcode::Recv {
                    b.post_recv(RecvWr::new(0, &[b_mr.sge(0, 1)]))?;
                    let mut wr = SendWr::new(1, &[b_mr.sge(1, 1)]);
                    wr.dest = c.src;
                    b.post_send(wr)?;
                    echoed += 1;
                }
            }
        }
        // Let the last echo's send complete before the QP goes away.
        while b.outstanding_sends() > 0 {
            wait(&b_cq, &mut buf)?;
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    let mut samples = Vec::with_capacity(rounds as usize);
    let mut buf = [Completion::default(); 4];
    a.post_recv(RecvWr::new(0, &[a_mr.sge(0, 1)]))?;
    for i in 0..total {
        let t0 = Instant::now();
        let mut wr = SendWr::new(1, &[a_mr.sge(1, 1)]);
        wr.dest = b_addr;
        a.post_send(wr)?;
        let (mut sent, mut back) = (false, false);
        while !(sent && back) {
            let n = wait(&a_cq, &mut buf)?;
            for c in &buf[..n] {
                check(c)?;
                match c.opcode {
                    Opcode::Send => sent = true,
                    Opcode::Recv => back = true,
                }
            }
        }
        let rtt = t0.elapsed();
        a.post_recv(RecvWr::new(0, &[a_mr.sge(0, 1)]))?;
        if i >= warmup {
            samples.push(rtt.as_secs_f64() * 1e6);
        }
    }
    let client = cpu::this_thread() - start;
    let echo = echo
        .join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    let engines = cpu::threads(&engines).saturating_sub(engine0);
    Ok(RttRow {
        us: cpu::median(samples),
        cpu_us: cpu_per_round(client + echo + engines, total),
    })
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

pub(crate) fn rtt_socket_tcp(rounds: u64, waiter: Waiter) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let (mut a, mut b) = tcp_pair()?;
    let busy = waiter == Waiter::Spin;
    a.set_nonblocking(busy)?;
    b.set_nonblocking(busy)?;
    let warmup = rounds / 10;
    let total = rounds + warmup;
    let echo = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut byte = [0u8; 1];
        for _ in 0..total {
            read_byte(&mut b, &mut byte, waiter)?;
            // One byte into an empty send buffer: never EAGAIN.
            b.write_all(&byte)?;
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    let mut samples = Vec::with_capacity(rounds as usize);
    let mut byte = [7u8; 1];
    for i in 0..total {
        let t0 = Instant::now();
        a.write_all(&byte)?;
        read_byte(&mut a, &mut byte, waiter)?;
        if i >= warmup {
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let client = cpu::this_thread() - start;
    let echo = echo
        .join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(RttRow {
        us: cpu::median(samples),
        cpu_us: cpu_per_round(client + echo, total),
    })
}

pub(crate) fn rtt_socket_udp(rounds: u64, waiter: Waiter) -> Result<RttRow> {
    let _host_a = OnCpu::new(HOST_A);
    let a = UdpSocket::bind(any_addr())?;
    let b = UdpSocket::bind(any_addr())?;
    let busy = waiter == Waiter::Spin;
    for s in [&a, &b] {
        s.set_read_timeout(Some(T))?;
        s.set_nonblocking(busy)?;
    }
    let b_addr = b.local_addr()?;
    let warmup = rounds / 10;
    let total = rounds + warmup;
    let echo = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut byte = [0u8; 1];
        for _ in 0..total {
            let (_, from) = receive(waiter, || b.recv_from(&mut byte))?;
            b.send_to(&byte, from)?;
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    let mut samples = Vec::with_capacity(rounds as usize);
    let mut byte = [7u8; 1];
    for i in 0..total {
        let t0 = Instant::now();
        a.send_to(&byte, b_addr)?;
        receive(waiter, || a.recv_from(&mut byte))?;
        if i >= warmup {
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let client = cpu::this_thread() - start;
    let echo = echo
        .join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(RttRow {
        us: cpu::median(samples),
        cpu_us: cpu_per_round(client + echo, total),
    })
}

// ---------------------------------------------------------------- throughput (ttcp)

/// One ttcp run: MB/s, application CPU seconds per GB, engine CPU seconds per GB.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ttcp {
    pub mbps: f64,
    pub app_s_per_gb: f64,
    pub engine_s_per_gb: f64,
}

pub(crate) fn ttcp_qp(bytes: u64, msg: usize) -> Result<Ttcp> {
    // Enough WRs in flight to cover ~2 MiB, as a socket buffer would.
    let window = ((2 << 20) / msg).clamp(4, 128);
    let msgs = bytes.div_ceil(msg as u64);
    let s = stream_qp(msgs, msg, window)?;
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
fn stream_qp(msgs: u64, msg: usize, window: usize) -> Result<Stream> {
    let _host_a = OnCpu::new(HOST_A);
    let link = qp_link(window)?;
    link.a_cq.set_spin(Duration::ZERO);
    link.b_cq.set_spin(Duration::ZERO);
    let tx_mr = link.a_nic.alloc_region(msg, Access::READ);
    let rx_mr = link.b_nic.alloc_region(window * msg, Access::READ_WRITE);
    let engines: Vec<i32> = link
        .a_nic
        .engine_threads()
        .into_iter()
        .chain(link.b_nic.engine_threads())
        .collect();
    let QpLink {
        a,
        b,
        a_cq,
        b_cq,
        a_nic,
        b_nic,
    } = link;
    for i in 0..window {
        b.post_recv(RecvWr::new(i as u64, &[rx_mr.sge(i * msg, msg)]))?;
    }
    let driven = || a_nic.driven_cpu() + b_nic.driven_cpu();
    let (engine0, driven0) = (cpu::threads(&engines), driven());
    let wall = Instant::now();
    let receiver = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut got = 0u64;
        let mut buf = [Completion::default(); 64];
        while got < msgs {
            let n = wait(&b_cq, &mut buf)?;
            for c in &buf[..n] {
                check(c)?;
                got += 1;
                if got + window as u64 <= msgs {
                    let slot = c.wr_id as usize;
                    b.post_recv(RecvWr::new(c.wr_id, &[rx_mr.sge(slot * msg, msg)]))?;
                }
            }
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    let (mut posted, mut done) = (0u64, 0u64);
    let mut buf = [Completion::default(); 64];
    while done < msgs {
        while posted < msgs && posted - done < window as u64 {
            a.post_send(SendWr::new(posted, &[tx_mr.sge(0, msg)]))?;
            posted += 1;
        }
        let n = wait(&a_cq, &mut buf)?;
        for c in &buf[..n] {
            check(c)?;
            done += 1;
        }
    }
    let send_cpu = cpu::this_thread() - start;
    let recv_cpu = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    let driven = driven() - driven0;
    Ok(Stream {
        app_cpu: (send_cpu + recv_cpu).saturating_sub(driven),
        engine_cpu: cpu::threads(&engines) - engine0 + driven,
        wall: wall.elapsed(),
    })
}

pub(crate) fn ttcp_socket(bytes: u64, msg: usize) -> Result<Ttcp> {
    let _host_a = OnCpu::new(HOST_A);
    let (mut a, mut b) = tcp_pair()?;
    let msgs = bytes.div_ceil(msg as u64);
    let wall = Instant::now();
    let receiver = spawn_on(HOST_B, move || -> Result<Duration> {
        let start = cpu::this_thread();
        let mut buf = vec![0u8; msg];
        for _ in 0..msgs {
            b.read_exact(&mut buf)?;
        }
        Ok(cpu::this_thread() - start)
    });
    let start = cpu::this_thread();
    let buf = vec![7u8; msg];
    for _ in 0..msgs {
        a.write_all(&buf)?;
    }
    let send_cpu = cpu::this_thread() - start;
    let recv_cpu = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    let secs = wall.elapsed().as_secs_f64();
    let gb = (msgs * msg as u64) as f64 / 1e9;
    Ok(Ttcp {
        mbps: gb * 1e3 / secs,
        app_s_per_gb: (send_cpu + recv_cpu).as_secs_f64() / gb,
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
        q.push(ttcp_qp(bytes, msg)?);
        s.push(ttcp_socket(bytes, msg)?);
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
    let [a, b, c, d] = rows.map(|v| RttRow {
        us: cpu::median(v.iter().map(|r| r.us).collect()),
        cpu_us: cpu::median(v.iter().map(|r| r.cpu_us).collect()),
    });
    Ok(RttWays {
        qp_spin: a,
        socket_busy_poll: b,
        qp_sleep: c,
        socket_blocking: d,
    })
}

/// TCP and UDP round trips, QP and socket, medians of `repeat` runs of `rounds` each.
fn round_trips(repeat: usize, rounds: u64, progress: &dyn Fn(&str), what: &str) -> Result<Rtt> {
    progress(&format!("round-trip time, TCP{what}"));
    let tcp = rtt_ways(repeat, |qp, w| {
        if qp {
            rtt_qp_tcp(rounds, w)
        } else {
            rtt_socket_tcp(rounds, w)
        }
    })?;
    progress(&format!("round-trip time, UDP{what}"));
    let udp = rtt_ways(repeat, |qp, w| {
        if qp {
            rtt_qp_udp(rounds, w)
        } else {
            rtt_socket_udp(rounds, w)
        }
    })?;
    Ok(Rtt { tcp, udp })
}

pub(crate) fn run(
    repeat: usize,
    sizes: MicroSizes,
    progress: &dyn Fn(&str),
) -> Result<MicroReport> {
    let repeat = repeat.max(1);
    progress("host overhead, 1-byte messages");
    let overhead = Pair {
        qp: med(repeat, || overhead_qp(sizes.overhead_msgs))?,
        socket: med(repeat, || overhead_socket(sizes.overhead_msgs))?,
    };
    let rtt = round_trips(repeat, sizes.rtt_rounds, progress, "")?;
    let rtt_loaded = {
        let _load = CpuLoad::start();
        // Under load a round trip waits for the scheduler: fewer rounds, the same repeats.
        round_trips(
            repeat,
            (sizes.rtt_rounds / 10).max(200),
            progress,
            ", CPUs loaded",
        )?
    };
    // The 10 MB run is over in milliseconds: take more samples of it.
    let (q16, s16) = ttcp_pair(repeat * 3, sizes.ttcp_16k_bytes, 16 * 1024, progress)?;
    let (q128, s128) = ttcp_pair(repeat, sizes.ttcp_128k_bytes, 128 * 1024, progress)?;
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
    })
}

/// The report as a terminal table.
pub(crate) fn table(r: &MicroReport) -> String {
    let row = |name: &str, unit: &str, p: Pair, better_low: bool| {
        let ratio = if better_low {
            p.socket / p.qp
        } else {
            p.qp / p.socket
        };
        format!(
            "{name:<44} {:>12.2} {:>12.2}  {unit:<8} {:>6.2}x\n",
            p.qp, p.socket, ratio
        )
    };
    let mut s = format!(
        "{:<44} {:>12} {:>12}  {:<8} {:>7}\n",
        "measure", "QP", "socket", "unit", "QP gain"
    );
    s += &row("host overhead, 1-byte msg", "ns", r.overhead_ns, true);
    for (rtt, loaded) in [(&r.rtt, ""), (&r.rtt_loaded, ", CPUs loaded")] {
        for (proto, w) in [("TCP", &rtt.tcp), ("UDP", &rtt.udp)] {
            for (qp, sock, how) in [
                (w.qp_spin, w.socket_busy_poll, "spin/busy-poll"),
                (w.qp_sleep, w.socket_blocking, "sleep/blocking"),
            ] {
                let name = format!("round trip {proto}, {how}{loaded}");
                s += &row(
                    &name,
                    "µs",
                    Pair {
                        qp: qp.us,
                        socket: sock.us,
                    },
                    true,
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
          threads), user + system.\n";
    s
}
