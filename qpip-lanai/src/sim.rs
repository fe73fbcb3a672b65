//! Hosts, their LANai NICs and the Myrinet fabric on one virtual clock: a discrete-event
//! scheduler in the spirit of quinn's test `Pair`, deterministic to the nanosecond.
//!
//! Events are ordered by (time, sequence number). A doorbell reaches the NIC once its PIO
//! write has crossed the NIC's PCI bus (shared with its DMA engines); a frame reaches a NIC when its tail arrives;
//! the firmware's timers fire at `poll_at`; the host sees completions at the firmware's
//! `host_visible_at` and pays its per-operation overhead for each.
//!
//! - `fabric`: links, the cut-through switch, fault injection;
//! - `host`: the host CPU model and the [`App`] trait;
//! - [`apps`]: ping-pong (UDP, TCP) and bulk transfer (ttcp, verified streams);
//! - [`nbd`]: the storage experiment's NBD client and server, as ported;
//! - [`experiments`]: the paper's measurements, as `qpip-bench lanai` runs them.
//!
//! Over 600 lines: the discrete-event loop and the event kinds it dispatches.

pub mod apps;
pub mod experiments;
pub(crate) mod fabric;
pub(crate) mod host;
pub mod nbd;
#[cfg(test)]
mod nbd_tests;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::net::Ipv6Addr;
use std::sync::Arc;

use qpip_verbs::backend::{Command, MgmtResult};
use qpip_verbs::mr::MemoryTable;
use qpip_verbs::shared::QpShared;
use qpip_verbs::wr::{Completion, Opcode, QpNum, RecvWr, SendWr};

use super::firmware::{Firmware, FirmwareConfig, OutFrame, Usage};
use super::meter::{Meter, Nanos};
use super::params::{FabricParams, LanaiParams};

pub use fabric::{FabricStats, Faults, XorShift};
pub use host::{App, Host};

use fabric::Fabric;
use host::Outbound;

/// The NIC as the simulation drives it: the firmware's sans-IO API. A trait so that the
/// scheduler can be tested with a stand-in NIC.
pub(crate) trait SimNic {
    fn command(&mut self, now: Nanos, cmd: Command);
    fn doorbell(&mut self, now: Nanos, qp: QpNum);
    fn receive(&mut self, now: Nanos, frame: &[u8]);
    fn poll(&mut self, now: Nanos);
    fn poll_at(&self) -> Option<Nanos>;
    fn transmit(&mut self) -> Option<OutFrame>;
    fn host_visible_at(&self) -> Nanos;
    /// When the next completion of `qp` (receive side if `recv`) made by the last handler is
    /// visible to the host, if the NIC wrote it on its own (else `host_visible_at`).
    fn completion_visible_at(&mut self, _qp: QpNum, _recv: bool) -> Option<Nanos> {
        None
    }
    fn meter(&self) -> &Meter;
    fn meter_mut(&mut self) -> &mut Meter;
    /// A host PIO write issued at `at`: when it lands in the NIC (a stand-in NIC has no bus
    /// to wait for).
    fn pio(&mut self, at: Nanos) -> Nanos {
        at + self.meter().costs().params().device.pio_write_ns
    }
    /// The oldest frame handed to the link has left: its tail at `tail`.
    fn link_done(&mut self, _tail: Nanos) {}
    /// A network DMA moved `bytes` through the NIC's memory over `[start, end)`.
    fn net_dma(&mut self, _start: Nanos, _end: Nanos, _bytes: usize) {}
    /// When the NIC can take a frame off the wire (a free receive buffer), from `now` on.
    fn rx_free_at(&mut self, now: Nanos) -> Nanos {
        now
    }
    /// Hardware busy time since the last reset (processor only for a stand-in NIC).
    fn usage(&self) -> Usage {
        Usage {
            processor_ns: self.meter().busy_ns(),
            ..Usage::default()
        }
    }
    fn reset_accounts(&mut self) {
        self.meter_mut().reset_accounts();
    }
}

impl SimNic for Firmware {
    fn command(&mut self, now: Nanos, cmd: Command) {
        Firmware::command(self, now, cmd)
    }
    fn doorbell(&mut self, now: Nanos, qp: QpNum) {
        Firmware::doorbell(self, now, qp)
    }
    fn receive(&mut self, now: Nanos, frame: &[u8]) {
        Firmware::receive(self, now, frame)
    }
    fn poll(&mut self, now: Nanos) {
        Firmware::poll(self, now)
    }
    fn poll_at(&self) -> Option<Nanos> {
        Firmware::poll_at(self)
    }
    fn transmit(&mut self) -> Option<OutFrame> {
        Firmware::transmit(self)
    }
    fn host_visible_at(&self) -> Nanos {
        Firmware::host_visible_at(self)
    }
    fn meter(&self) -> &Meter {
        Firmware::meter(self)
    }
    fn meter_mut(&mut self) -> &mut Meter {
        Firmware::meter_mut(self)
    }
    fn pio(&mut self, at: Nanos) -> Nanos {
        Firmware::pio(self, at)
    }
    fn completion_visible_at(&mut self, qp: QpNum, recv: bool) -> Option<Nanos> {
        Firmware::completion_visible_at(self, qp, recv)
    }
    fn link_done(&mut self, tail: Nanos) {
        Firmware::link_done(self, tail)
    }
    fn net_dma(&mut self, start: Nanos, end: Nanos, bytes: usize) {
        Firmware::net_dma(self, start, end, bytes)
    }
    fn rx_free_at(&mut self, now: Nanos) -> Nanos {
        Firmware::rx_free_at(self, now)
    }
    fn usage(&self) -> Usage {
        Firmware::usage(self)
    }
    fn reset_accounts(&mut self) {
        Firmware::reset_accounts(self)
    }
}

/// Why a simulation stopped without every application finishing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A node the experiment names is not in the fabric config.
    #[error("no node named {0:?} in the fabric")]
    UnknownNode(String),
    /// The simulated fabric is one switch: every node's route is one output port.
    #[error("node {0:?} has no route of one switch hop")]
    BadRoute(String),
    /// The run's virtual time budget ran out.
    #[error("virtual time limit of {limit} ns reached with applications unfinished")]
    TimeLimit {
        /// The budget, in virtual nanoseconds.
        limit: Nanos,
    },
    /// No event is pending, yet an application has not finished.
    #[error("nothing left to happen at {at} ns but applications are unfinished")]
    Stalled {
        /// The virtual time it stopped at.
        at: Nanos,
    },
    /// More events than any experiment needs, without the applications finishing.
    #[error("{0} events without finishing: the NIC keeps asking to be polled")]
    EventLimit(u64),
    /// An application failed.
    #[error("application on {node}: {message}")]
    App {
        /// The node it ran on.
        node: String,
        /// Why it failed.
        message: String,
    },
}

enum Event {
    Command {
        node: usize,
        cmd: Command,
    },
    Doorbell {
        node: usize,
        qp: QpNum,
    },
    /// A frame's head, which left `from` at `sent`, has reached the switch's decision point.
    Switch {
        from: usize,
        frame: Vec<u8>,
        sent: Nanos,
    },
    /// A frame's head has reached its receiver's NIC.
    AtReceiver(fabric::ToReceiver),
    /// A receive buffer of `node` has freed: a stopped frame may come in.
    Admit {
        node: usize,
    },
    /// A frame's tail has arrived at `node`.
    Arrive {
        node: usize,
        frame: Vec<u8>,
    },
    Timer {
        node: usize,
    },
    HostWake {
        node: usize,
    },
    /// The host writes a WR into a ring (then rings the doorbell).
    Post {
        node: usize,
        qp: Arc<QpShared>,
        wr: Posted,
    },
}

enum Posted {
    Send(SendWr),
    Recv(RecvWr),
}

struct Scheduled {
    at: Nanos,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Reversed: the heap's top is the earliest event, ties broken by insertion order.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

enum Visible {
    Completion(Completion),
    Reply(u64, MgmtResult),
}

struct Node {
    name: String,
    nic: Box<dyn SimNic>,
    host: Host,
    app: Option<Box<dyn App>>,
    started: bool,
    /// Completions and replies written by the NIC, with when the host can see them.
    visible: VecDeque<(Nanos, Visible)>,
    /// The pending firmware timer, if one is scheduled.
    timer: Option<Nanos>,
    /// When a stopped frame is next offered a receive buffer, if it waits.
    rx_retry: Option<Nanos>,
}

/// `v` becomes visible to the host at `at`: kept in time order (each completion has its own
/// time), after those visible at the same time.
fn show(visible: &mut VecDeque<(Nanos, Visible)>, at: Nanos, v: Visible) {
    let i = visible.partition_point(|(t, _)| *t <= at);
    visible.insert(i, (at, v));
}

/// Nodes, fabric and the event queue.
pub struct Sim {
    now: Nanos,
    seq: u64,
    events: BinaryHeap<Scheduled>,
    nodes: Vec<Node>,
    fabric: Fabric,
    /// Events handled so far (a runaway guard).
    handled: u64,
    /// When the last measurement window started ([`Host::mark`]).
    mark_at: Option<Nanos>,
}

impl Sim {
    /// A fabric; `seed` drives fault injection.
    pub fn new(fabric: FabricParams, seed: u64) -> Self {
        Sim {
            now: 0,
            seq: 0,
            events: BinaryHeap::new(),
            nodes: Vec::new(),
            fabric: Fabric::new(fabric, seed),
            handled: 0,
            mark_at: None,
        }
    }

    /// Adds the fabric's node `name` with the LANai firmware as its NIC.
    pub fn add_lanai_node(
        &mut self,
        name: &str,
        params: &LanaiParams,
        seed: u64,
    ) -> Result<usize, SimError> {
        let addr = self.node_addr(name)?;
        let memory = MemoryTable::new();
        let cfg = FirmwareConfig {
            addr,
            params: params.clone(),
            fabric: self.fabric.params.clone(),
            seed,
        };
        let fw = Firmware::new(cfg, memory.clone());
        self.add_node(name, Box::new(fw), memory, params)
    }

    fn node_addr(&self, name: &str) -> Result<Ipv6Addr, SimError> {
        self.fabric
            .params
            .node(name)
            .map(|n| n.addr)
            .ok_or_else(|| SimError::UnknownNode(name.to_string()))
    }

    /// Adds the fabric's node `name` with any NIC; `memory` is the table the NIC resolves
    /// SGEs through.
    pub(crate) fn add_node(
        &mut self,
        name: &str,
        nic: Box<dyn SimNic>,
        memory: Arc<MemoryTable>,
        params: &LanaiParams,
    ) -> Result<usize, SimError> {
        let n = self
            .fabric
            .params
            .node(name)
            .ok_or_else(|| SimError::UnknownNode(name.to_string()))?;
        // One crossbar: every route is a single output port.
        let &[port] = n.route.as_slice() else {
            return Err(SimError::BadRoute(name.to_string()));
        };
        let addr = n.addr;
        let idx = self.nodes.len();
        self.fabric.attach(idx, port);
        self.nodes.push(Node {
            name: name.to_string(),
            nic,
            host: Host::new(memory, params.host.clone(), addr),
            app: None,
            started: false,
            visible: VecDeque::new(),
            timer: None,
            rx_retry: None,
        });
        Ok(idx)
    }

    pub(crate) fn set_app(&mut self, node: usize, app: Box<dyn App>) {
        self.nodes[node].app = Some(app);
    }

    /// The application on `node`, as its concrete type.
    pub fn app<T: App>(&self, node: usize) -> Option<&T> {
        self.nodes[node].app.as_ref()?.as_any().downcast_ref()
    }

    pub(crate) fn set_faults(&mut self, from: usize, to: usize, faults: Faults) {
        self.fabric.set_faults(from, to, faults);
    }

    pub(crate) fn host(&self, node: usize) -> &Host {
        &self.nodes[node].host
    }

    pub(crate) fn nic(&self, node: usize) -> &dyn SimNic {
        self.nodes[node].nic.as_ref()
    }

    /// Time node `node`'s link to the switch was busy since the measurement mark.
    pub fn link_busy_ns(&self, node: usize) -> Nanos {
        self.fabric.link_busy_ns(node)
    }

    pub(crate) fn fabric_stats(&self) -> &FabricStats {
        &self.fabric.stats
    }

    /// When the last measurement window started.
    pub fn mark_at(&self) -> Option<Nanos> {
        self.mark_at
    }

    fn schedule(&mut self, at: Nanos, event: Event) {
        self.seq += 1;
        self.events.push(Scheduled {
            at: at.max(self.now),
            seq: self.seq,
            event,
        });
    }

    fn all_done(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| n.app.as_ref().is_none_or(|a| a.done()))
    }

    /// Runs until every application is done; fails past virtual time `limit`, or when
    /// nothing is left to happen.
    pub fn run(&mut self, limit: Nanos) -> Result<Nanos, SimError> {
        for i in 0..self.nodes.len() {
            if !self.nodes[i].started {
                self.nodes[i].started = true;
                let now = self.now;
                let node = &mut self.nodes[i];
                node.host.clock = node.host.clock.max(now);
                if let Some(app) = node.app.as_mut() {
                    app.start(&mut node.host);
                }
                self.after_host(i)?;
            }
        }
        // Runaway guard: far more events than any of our experiments needs.
        let max_events = 20_000_000;
        while !self.all_done() {
            let Some(ev) = self.events.pop() else {
                return Err(SimError::Stalled { at: self.now });
            };
            if ev.at > limit {
                self.events.push(ev);
                return Err(SimError::TimeLimit { limit });
            }
            self.now = ev.at;
            self.handled += 1;
            if self.handled > max_events {
                return Err(SimError::EventLimit(self.handled));
            }
            self.handle(ev.event)?;
        }
        Ok(self.now)
    }

    fn handle(&mut self, event: Event) -> Result<(), SimError> {
        let now = self.now;
        match event {
            Event::Command { node, cmd } => {
                self.nodes[node].nic.command(now, cmd);
                self.after_nic(node);
            }
            Event::Doorbell { node, qp } => {
                self.nodes[node].nic.doorbell(now, qp);
                self.after_nic(node);
            }
            Event::Arrive { node, frame } => {
                self.fabric.tail_in(node);
                self.nodes[node].nic.receive(now, &frame);
                self.after_nic(node);
                self.admit(node);
            }
            Event::Timer { node } => {
                if self.nodes[node].timer != Some(now) {
                    return Ok(()); // superseded
                }
                self.nodes[node].timer = None;
                self.nodes[node].nic.poll(now);
                self.after_nic(node);
            }
            Event::Switch { from, frame, sent } => {
                let (freed, heads) = self.fabric.switch(now, from, &frame, sent);
                for h in heads {
                    self.schedule(h.at, Event::AtReceiver(h));
                }
                if let Some((node, tail, len)) = freed {
                    self.link_released(node, tail, len);
                }
            }
            Event::AtReceiver(h) => {
                let node = h.node;
                self.fabric.arrive_head(node, h.head);
                self.admit(node);
            }
            Event::Admit { node } => {
                if self.nodes[node].rx_retry == Some(now) {
                    self.nodes[node].rx_retry = None;
                    self.admit(node);
                }
            }
            Event::HostWake { node } => self.wake_host(node)?,
            Event::Post { node, qp, wr } => {
                let ok = match wr {
                    Posted::Send(wr) => qp.push_send(wr),
                    Posted::Recv(wr) => qp.push_recv(wr),
                };
                if ok.is_err() {
                    return Err(SimError::App {
                        node: self.nodes[node].name.clone(),
                        message: format!("QP {}: more WRs posted than its rings hold", qp.num),
                    });
                }
                qp.doorbell
                    .store(true, std::sync::atomic::Ordering::Release);
                let at = self.nodes[node].nic.pio(now);
                self.schedule(at, Event::Doorbell { node, qp: qp.num });
            }
        }
        Ok(())
    }

    /// After a firmware handler: frames onto the fabric, new completions and replies toward
    /// the host, the next timer.
    fn after_nic(&mut self, i: usize) {
        while let Some(f) = self.nodes[i].nic.transmit() {
            self.fabric.offer(i, f);
        }
        if let Some((at, frame, sent)) = self.fabric.start(i) {
            self.schedule(
                at,
                Event::Switch {
                    from: i,
                    frame,
                    sent,
                },
            );
        }
        let now = self.now;
        let node = &mut self.nodes[i];
        let visible_at = node.nic.host_visible_at().max(now);
        let mut wakes = Vec::new();
        let mut buf = [Completion::default(); 64];
        let Node {
            nic, host, visible, ..
        } = node;
        for cq in &host.cqs {
            // A CQ error is an overflow: the completions that fit are still delivered and
            // the application sees the loss as missing completions.
            while let Ok(n @ 1..) = cq.poll(&mut buf) {
                for c in &buf[..n] {
                    let at = nic
                        .completion_visible_at(c.qp_num, c.opcode == Opcode::Recv)
                        .map_or(visible_at, |t| t.max(now));
                    wakes.push(at);
                    show(visible, at, Visible::Completion(*c));
                }
            }
        }
        let mut k = 0;
        while k < host.waiting.len() {
            if let Some(r) = host.waiting[k].rx.try_recv() {
                let w = host.waiting.remove(k);
                wakes.push(visible_at);
                show(visible, visible_at, Visible::Reply(w.tag, r));
            } else {
                k += 1;
            }
        }
        wakes.sort_unstable();
        wakes.dedup();
        for at in wakes {
            self.schedule(at, Event::HostWake { node: i });
        }
        let node = &mut self.nodes[i];
        if let Some(t) = node.nic.poll_at() {
            // The processor cannot start before it is free.
            let t = t.max(node.nic.meter().now()).max(self.now);
            if node.timer.is_none_or(|cur| t < cur) {
                node.timer = Some(t);
                self.schedule(t, Event::Timer { node: i });
            }
        }
    }

    /// Node `i`'s NIC takes the first frame stopped at its input if it has a free receive
    /// buffer now; otherwise it is offered one when the next buffer frees.
    fn admit(&mut self, i: usize) {
        if !self.fabric.wants_buffer(i) {
            return;
        }
        let now = self.now;
        let free = self.nodes[i].nic.rx_free_at(now);
        if free > now {
            if self.nodes[i].rx_retry.is_none_or(|t| free < t) {
                self.nodes[i].rx_retry = Some(free);
                self.schedule(free, Event::Admit { node: i });
            }
            return;
        }
        let Some(a) = self.fabric.admit(i, now) else {
            return;
        };
        // The network receive DMA writes the frame into SRAM as it streams in.
        self.nodes[i].nic.net_dma(now, a.tail, a.frame.len());
        self.schedule(
            a.tail,
            Event::Arrive {
                node: a.node,
                frame: a.frame,
            },
        );
        if let Some(next) = a.next {
            self.schedule(next.at, Event::AtReceiver(next));
        }
        if let Some((node, tail, len)) = a.released {
            self.link_released(node, tail, len);
        }
    }

    /// The `len`-byte frame on node `i`'s link has left it at `tail` (the network send DMA
    /// read it from SRAM over its last wire time): its send staging buffer frees and the
    /// link takes the next frame.
    fn link_released(&mut self, i: usize, tail: Nanos, len: usize) {
        let wire = self.fabric.params.wire_ns(len);
        self.nodes[i]
            .nic
            .net_dma(tail.saturating_sub(wire), tail, len);
        self.nodes[i].nic.link_done(tail);
        self.after_nic(i);
    }

    /// The host handles what has become visible, on its CPU clock.
    fn wake_host(&mut self, i: usize) -> Result<(), SimError> {
        let now = self.now;
        let node = &mut self.nodes[i];
        node.host.clock = node.host.clock.max(now);
        while node.visible.front().is_some_and(|(t, _)| *t <= now) {
            let Some((_, v)) = node.visible.pop_front() else {
                break;
            };
            let Some(app) = node.app.as_mut() else {
                continue;
            };
            match v {
                Visible::Completion(c) => {
                    if c.opcode == Opcode::Recv {
                        node.host.charge_recv();
                    }
                    app.on_completion(&mut node.host, c);
                }
                Visible::Reply(tag, r) => app.on_reply(&mut node.host, tag, r),
            }
        }
        self.after_host(i)
    }

    /// After an application callback: its PCI writes toward the NIC, the measurement mark,
    /// its errors.
    fn after_host(&mut self, i: usize) -> Result<(), SimError> {
        let node = &mut self.nodes[i];
        if let Some(message) = node.app.as_ref().and_then(|a| a.error()) {
            return Err(SimError::App {
                node: node.name.clone(),
                message,
            });
        }
        let out: Vec<_> = node.host.out.drain(..).collect();
        let mark = std::mem::take(&mut node.host.mark);
        let mark_time = node.host.clock;
        for (at, o) in out {
            match o {
                Outbound::Command(cmd) => {
                    let at = self.nodes[i].nic.pio(at);
                    self.schedule(at, Event::Command { node: i, cmd })
                }
                Outbound::Doorbell(qp) => {
                    let at = self.nodes[i].nic.pio(at);
                    self.schedule(at, Event::Doorbell { node: i, qp })
                }
                Outbound::PostSend(qp, wr) => self.schedule(
                    at,
                    Event::Post {
                        node: i,
                        qp,
                        wr: Posted::Send(wr),
                    },
                ),
                Outbound::PostRecv(qp, wr) => self.schedule(
                    at,
                    Event::Post {
                        node: i,
                        qp,
                        wr: Posted::Recv(wr),
                    },
                ),
            }
        }
        if mark {
            self.mark_at = Some(mark_time);
            for n in &mut self.nodes {
                n.nic.reset_accounts();
                n.host.busy = 0;
            }
            self.fabric.reset_accounts();
        }
        Ok(())
    }
}
