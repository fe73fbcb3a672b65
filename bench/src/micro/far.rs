//! The far side of every `micro` measure (the echo of a round trip, the receiver of a
//! stream), as host B: a thread of this process on B's CPU, or with `--netns` a child process
//! (`qpip-bench micro-echo`) inside the namespace, across the veth link as a second host
//! would be. Either way it says where it listens, then that it is ready, and at the end what
//! CPU it used.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use qpip_core::{Access, Completion, Nic, Opcode, QpAttr, RecvWr, SendWr};

use super::{HOST_B, OnCpu, T, Waiter, check, nic_on, read_byte, receive, wait};
use crate::cpu;
use crate::rig::netns::Side;

/// What the far side does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Job {
    /// Echoes `total` 1-byte messages over a QP (`udp`: an unreliable one).
    RttQp {
        udp: bool,
        total: u64,
        waiter: Waiter,
    },
    /// Echoes `total` 1-byte messages over a socket.
    RttSocket {
        udp: bool,
        total: u64,
        waiter: Waiter,
    },
    /// Receives `msgs` messages of `msg` bytes over a reliable QP, `window` receives posted.
    StreamQp {
        msgs: u64,
        msg: usize,
        window: usize,
    },
    /// Reads `msgs` messages of `msg` bytes from a TCP socket.
    StreamSocket { msgs: u64, msg: usize },
}

fn proto(udp: bool) -> &'static str {
    if udp { "udp" } else { "tcp" }
}

impl Job {
    /// The job as `micro-echo`'s argument.
    fn to_arg(self) -> String {
        match self {
            Job::RttQp { udp, total, waiter } => {
                format!("rtt-qp:{}:{total}:{}", proto(udp), waiter.name())
            }
            Job::RttSocket { udp, total, waiter } => {
                format!("rtt-socket:{}:{total}:{}", proto(udp), waiter.name())
            }
            Job::StreamQp { msgs, msg, window } => format!("stream-qp:{msgs}:{msg}:{window}"),
            Job::StreamSocket { msgs, msg } => format!("stream-socket:{msgs}:{msg}"),
        }
    }

    pub(crate) fn parse(s: &str) -> Result<Job> {
        let f: Vec<&str> = s.split(':').collect();
        let n = |i: usize| -> Result<u64> {
            f.get(i)
                .and_then(|x| x.parse().ok())
                .with_context(|| format!("micro-echo job {s:?}: field {i} is not a number"))
        };
        let udp = |i: usize| match f.get(i) {
            Some(&"udp") => Ok(true),
            Some(&"tcp") => Ok(false),
            _ => bail!("micro-echo job {s:?}: expected tcp or udp"),
        };
        let waiter = |i: usize| Waiter::parse(f.get(i).copied().unwrap_or(""));
        let job = match (f[0], f.len()) {
            ("rtt-qp", 4) => Job::RttQp {
                udp: udp(1)?,
                total: n(2)?,
                waiter: waiter(3)?,
            },
            ("rtt-socket", 4) => Job::RttSocket {
                udp: udp(1)?,
                total: n(2)?,
                waiter: waiter(3)?,
            },
            ("stream-qp", 4) => Job::StreamQp {
                msgs: n(1)?,
                msg: n(2)? as usize,
                window: n(3)? as usize,
            },
            ("stream-socket", 3) => Job::StreamSocket {
                msgs: n(1)?,
                msg: n(2)? as usize,
            },
            _ => bail!("micro-echo: unknown job {s:?}"),
        };
        Ok(job)
    }
}

/// The CPU one side used over its part of a measure.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SideCpu {
    /// Its application thread, including the NIC work it drove itself while waiting.
    pub app: Duration,
    /// Its NIC's engine threads.
    pub engine: Duration,
    /// Of `app`, the NIC work the application thread drove (run to completion); counted
    /// by [`Meter::split`] only, zero otherwise.
    pub driven: Duration,
}

impl SideCpu {
    /// Every thread of the side.
    pub(crate) fn total(&self) -> Duration {
        self.app + self.engine
    }
}

/// Counts one side's CPU from `start` to `stop`, on the side's application thread.
pub(crate) struct Meter<'a> {
    engines: Vec<i32>,
    /// The NIC whose driven CPU is counted ([`Meter::split`]).
    driven_of: Option<&'a Nic>,
    at_start: SideCpu,
}

impl<'a> Meter<'a> {
    /// Every thread of the side: its application thread and `nic`'s engine threads.
    pub(crate) fn start(nic: Option<&'a Nic>) -> Meter<'a> {
        Self::begin(nic, None)
    }

    /// [`Meter::start`], and of the application thread's CPU the NIC work it drove itself
    /// ([`SideCpu::driven`]). Asking turns the NIC's count on, which reads the thread's CPU
    /// clock around every drive (two system calls): only for measures that report the split.
    pub(crate) fn split(nic: &'a Nic) -> Meter<'a> {
        Self::begin(Some(nic), Some(nic))
    }

    fn begin(nic: Option<&'a Nic>, driven_of: Option<&'a Nic>) -> Meter<'a> {
        let engines = nic.map(|n| n.engine_threads()).unwrap_or_default();
        let mut m = Meter {
            engines,
            driven_of,
            at_start: SideCpu::default(),
        };
        m.at_start = m.now();
        m
    }

    fn now(&self) -> SideCpu {
        SideCpu {
            app: cpu::this_thread(),
            engine: cpu::threads(&self.engines),
            driven: self.driven_of.map_or(Duration::ZERO, |n| n.driven_cpu()),
        }
    }

    pub(crate) fn stop(&self) -> SideCpu {
        let (now, s) = (self.now(), self.at_start);
        SideCpu {
            app: now.app.saturating_sub(s.app),
            engine: now.engine.saturating_sub(s.engine),
            driven: now.driven.saturating_sub(s.driven),
        }
    }
}

/// What the far side tells the near side, in order.
pub(crate) enum Event {
    Addr(SocketAddr),
    Ready,
}

/// Runs `job` as host B on address `ip`, telling `say` where it listens and when it is ready.
fn serve(job: Job, ip: IpAddr, say: &mut dyn FnMut(Event) -> Result<()>) -> Result<SideCpu> {
    let _on = OnCpu::new(HOST_B);
    let any = SocketAddr::new(ip, 0);
    match job {
        Job::RttQp { udp, total, waiter } => {
            let nic = nic_on(HOST_B)?;
            let cq = nic.create_cq(8);
            cq.set_spin(waiter.qp_spin());
            let attr = QpAttr::new(&cq).depths(4, 4);
            let qp = if udp {
                let qp = nic.create_udp_qp(any, attr)?;
                say(Event::Addr(
                    qp.local_addr().context("bound UDP QP has an address")?,
                ))?;
                qp
            } else {
                let listener = nic.listen(any)?;
                say(Event::Addr(listener.local_addr()))?;
                let qp = nic.create_qp(attr);
                listener.accept_timeout(&qp, T)?;
                qp
            };
            let mr = nic.alloc_region(2, Access::READ_WRITE);
            qp.post_recv(RecvWr::new(0, &[mr.sge(0, 1)]))?;
            say(Event::Ready)?;
            let meter = Meter::start(Some(&nic));
            let mut buf = [Completion::default(); 4];
            let mut echoed = 0;
            while echoed < total {
                let n = wait(&cq, &mut buf)?;
                for c in &buf[..n] {
                    check(c)?;
                    if c.opcode == Opcode::Recv {
                        qp.post_recv(RecvWr::new(0, &[mr.sge(0, 1)]))?;
                        let mut wr = SendWr::new(1, &[mr.sge(1, 1)]);
                        wr.dest = c.src;
                        qp.post_send(wr)?;
                        echoed += 1;
                    }
                }
            }
            // Let the last echo's send complete before the QP goes away.
            while qp.outstanding_sends() > 0 {
                wait(&cq, &mut buf)?;
            }
            Ok(meter.stop())
        }
        Job::RttSocket {
            udp: false,
            total,
            waiter,
        } => {
            let listener = TcpListener::bind(any)?;
            say(Event::Addr(listener.local_addr()?))?;
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            s.set_nonblocking(waiter == Waiter::Spin)?;
            say(Event::Ready)?;
            let meter = Meter::start(None);
            let mut byte = [0u8; 1];
            for _ in 0..total {
                read_byte(&mut s, &mut byte, waiter)?;
                // One byte into an empty send buffer: never EAGAIN.
                s.write_all(&byte)?;
            }
            Ok(meter.stop())
        }
        Job::RttSocket {
            udp: true,
            total,
            waiter,
        } => {
            let s = UdpSocket::bind(any)?;
            s.set_read_timeout(Some(T))?;
            s.set_nonblocking(waiter == Waiter::Spin)?;
            say(Event::Addr(s.local_addr()?))?;
            say(Event::Ready)?;
            let meter = Meter::start(None);
            let mut byte = [0u8; 1];
            for _ in 0..total {
                let (_, from) = receive(waiter, || s.recv_from(&mut byte))?;
                s.send_to(&byte, from)?;
            }
            Ok(meter.stop())
        }
        Job::StreamQp { msgs, msg, window } => {
            let nic = nic_on(HOST_B)?;
            let cq = nic.create_cq(window * 2);
            cq.set_spin(Duration::ZERO);
            let listener = nic.listen(any)?;
            say(Event::Addr(listener.local_addr()))?;
            let qp = nic.create_qp(QpAttr::new(&cq).depths(window, window));
            listener.accept_timeout(&qp, T)?;
            let rx_mr = nic.alloc_region(window * msg, Access::READ_WRITE);
            for i in 0..window {
                qp.post_recv(RecvWr::new(i as u64, &[rx_mr.sge(i * msg, msg)]))?;
            }
            say(Event::Ready)?;
            let meter = Meter::split(&nic);
            let mut got = 0u64;
            let mut buf = [Completion::default(); 64];
            while got < msgs {
                let n = wait(&cq, &mut buf)?;
                for c in &buf[..n] {
                    check(c)?;
                    got += 1;
                    if got + window as u64 <= msgs {
                        let slot = c.wr_id as usize;
                        qp.post_recv(RecvWr::new(c.wr_id, &[rx_mr.sge(slot * msg, msg)]))?;
                    }
                }
            }
            Ok(meter.stop())
        }
        Job::StreamSocket { msgs, msg } => {
            let listener = TcpListener::bind(any)?;
            say(Event::Addr(listener.local_addr()?))?;
            let (mut s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            say(Event::Ready)?;
            let meter = Meter::start(None);
            let mut buf = vec![0u8; msg];
            for _ in 0..msgs {
                s.read_exact(&mut buf)?;
            }
            Ok(meter.stop())
        }
    }
}

/// `qpip-bench micro-echo JOB --listen IP`: the far side as a process of its own, reporting
/// on stdout (`addr ADDR`, `ready`, `cpu APP ENGINE DRIVEN` in ns).
pub(crate) fn child_main(job: &str, ip: IpAddr) -> Result<()> {
    let job = Job::parse(job)?;
    let mut out = std::io::stdout().lock();
    let cpu = {
        let mut say = |e: Event| -> Result<()> {
            match e {
                Event::Addr(a) => writeln!(out, "addr {a}")?,
                Event::Ready => writeln!(out, "ready")?,
            }
            out.flush()?;
            Ok(())
        };
        serve(job, ip, &mut say)?
    };
    writeln!(
        out,
        "cpu {} {} {}",
        cpu.app.as_nanos(),
        cpu.engine.as_nanos(),
        cpu.driven.as_nanos()
    )?;
    Ok(())
}

/// The far side of one measure, running.
pub(crate) enum FarSide {
    Thread {
        events: mpsc::Receiver<Event>,
        handle: Option<thread::JoinHandle<Result<SideCpu>>>,
    },
    Child {
        child: Child,
        out: BufReader<ChildStdout>,
    },
}

/// The near side's address: loopback, or ours on the veth link.
pub(crate) fn near_ip(net: Option<&Side>) -> IpAddr {
    net.map_or(IpAddr::from([127, 0, 0, 1]), |n| IpAddr::V4(n.host_ip))
}

impl FarSide {
    /// Starts `job`: in a thread, or with `net` in a child process inside its namespace.
    pub(crate) fn start(net: Option<&Side>, job: Job) -> Result<FarSide> {
        let Some(side) = net else {
            let (tx, events) = mpsc::channel();
            let handle = thread::spawn(move || {
                let mut say = |e| tx.send(e).context("the near side went away");
                serve(job, IpAddr::from([127, 0, 0, 1]), &mut say)
            });
            return Ok(FarSide::Thread {
                events,
                handle: Some(handle),
            });
        };
        let exe = std::env::current_exe().context("locating the qpip-bench executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg("micro-echo")
            .arg(job.to_arg())
            .arg("--listen")
            .arg(side.ns_ip.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        crate::rig::peers::die_with_parent(&mut cmd);
        side.enter(&mut cmd)?;
        let mut child = cmd
            .spawn()
            .context("starting qpip-bench micro-echo in the namespace")?;
        let out = BufReader::new(child.stdout.take().context("piped stdout")?);
        Ok(FarSide::Child { child, out })
    }

    /// The next line of the child, or why there is none.
    fn line(child: &mut Child, out: &mut BufReader<ChildStdout>) -> Result<String> {
        let mut line = String::new();
        if out.read_line(&mut line)? == 0 {
            let status = child.wait()?;
            bail!("qpip-bench micro-echo (the far side) ended early: {status}");
        }
        Ok(line.trim_end().to_string())
    }

    fn next(&mut self) -> Result<Event> {
        match self {
            FarSide::Thread { events, handle } => match events.recv_timeout(T) {
                Ok(e) => Ok(e),
                Err(mpsc::RecvTimeoutError::Timeout) => bail!("the far side was silent for {T:?}"),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    match handle.take().map(|h| h.join()) {
                        Some(Ok(Err(e))) => Err(e.context("the far side")),
                        Some(Err(_)) => bail!("the far side panicked"),
                        _ => bail!("the far side ended early"),
                    }
                }
            },
            FarSide::Child { child, out } => {
                let line = Self::line(child, out)?;
                if line == "ready" {
                    return Ok(Event::Ready);
                }
                match line.strip_prefix("addr ").map(str::parse) {
                    Some(Ok(a)) => Ok(Event::Addr(a)),
                    _ => bail!("qpip-bench micro-echo said {line:?}, expected its address"),
                }
            }
        }
    }

    /// Where the far side listens.
    pub(crate) fn addr(&mut self) -> Result<SocketAddr> {
        match self.next()? {
            Event::Addr(a) => Ok(a),
            Event::Ready => bail!("the far side was ready before it had an address"),
        }
    }

    /// Waits until the far side is ready (connected, receives posted).
    pub(crate) fn ready(&mut self) -> Result<()> {
        match self.next()? {
            Event::Ready => Ok(()),
            Event::Addr(_) => bail!("the far side gave its address twice"),
        }
    }

    /// Waits for the far side's end; what CPU it used.
    pub(crate) fn finish(mut self) -> Result<SideCpu> {
        match &mut self {
            FarSide::Thread { handle, .. } => handle
                .take()
                .context("the far side ended early")?
                .join()
                .map_err(|_| anyhow::anyhow!("the far side panicked"))?,
            FarSide::Child { child, out } => {
                let line = Self::line(child, out)?;
                let ns: Vec<u64> = line
                    .strip_prefix("cpu ")
                    .map(|r| r.split(' ').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or_default();
                let status = child.wait()?;
                if !status.success() || ns.len() != 3 {
                    bail!("qpip-bench micro-echo ended with {status}, last said {line:?}");
                }
                Ok(SideCpu {
                    app: Duration::from_nanos(ns[0]),
                    engine: Duration::from_nanos(ns[1]),
                    driven: Duration::from_nanos(ns[2]),
                })
            }
        }
    }
}

impl Drop for FarSide {
    fn drop(&mut self) {
        // A near side that failed leaves no far process behind.
        if let FarSide::Child { child, .. } = self {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_survive_the_command_line() {
        for job in [
            Job::RttQp {
                udp: true,
                total: 22,
                waiter: Waiter::Spin,
            },
            Job::RttSocket {
                udp: false,
                total: 3,
                waiter: Waiter::Sleep,
            },
            Job::StreamQp {
                msgs: 10,
                msg: 16384,
                window: 128,
            },
            Job::StreamSocket { msgs: 7, msg: 1 },
        ] {
            assert_eq!(Job::parse(&job.to_arg()).unwrap(), job);
        }
        assert!(Job::parse("rtt-qp:sctp:1:spin").is_err());
        assert!(Job::parse("stream-socket:x:1").is_err());
        assert!(Job::parse("").is_err());
    }
}
