//! The Myrinet fabric in virtual time: one link per node into a single cut-through crossbar
//! switch, and seeded fault injection (drop, duplicate, delay) per direction for tests.
//!
//! Myrinet links have stop/go flow control and the switch only a few bytes of slack: a frame
//! whose output port is busy is not queued in the switch, it stops on its input link, and
//! the sender's NIC holds it (and its staging buffer) until the port frees (wormhole
//! blocking).

use std::collections::BTreeMap;

use crate::meter::Nanos;
use crate::params::FabricParams;

/// A small deterministic PRNG (xorshift64*): fault injection needs reproducible runs, not
/// cryptographic quality.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        // Zero is the one state xorshift cannot leave.
        XorShift(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Faults injected on one direction (sender node to receiver node), as probabilities per
/// frame.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    pub drop: f64,
    pub duplicate: f64,
    /// Probability that a frame is held back by up to `delay_ns` (later frames overtake it).
    pub delay: f64,
    pub delay_ns: Nanos,
}

impl Faults {
    pub fn none() -> Self {
        Faults::default()
    }
}

/// What the fabric did, per direction (sender, receiver) by node index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricStats {
    pub frames: BTreeMap<(usize, usize), u64>,
    pub bytes: BTreeMap<(usize, usize), u64>,
    pub dropped: u64,
    pub duplicated: u64,
    pub delayed: u64,
    /// Frames whose route led to no simulated node (the bridge port, say).
    pub unroutable: u64,
    /// Frames the switch refused (bad CRC, truncated).
    pub bad: u64,
}

impl FabricStats {
    /// Frames that entered the switch from `from` toward `to`.
    pub fn frames_between(&self, from: usize, to: usize) -> u64 {
        self.frames.get(&(from, to)).copied().unwrap_or(0)
    }
}

/// Where and when a frame ends up.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Delivery {
    pub node: usize,
    /// The tail has arrived: the network receive DMA is done.
    pub at: Nanos,
    pub frame: Vec<u8>,
}

/// When a frame's tail left its sender and its head reached the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sent {
    pub tail_left: Nanos,
    pub head: Nanos,
}

pub(crate) struct Fabric {
    pub params: FabricParams,
    /// When each node's link to the switch is next free.
    link_free: Vec<Nanos>,
    /// Time each node's link carried frames (or was stopped holding one) since the reset.
    link_busy: Vec<Nanos>,
    /// When each switch output port is next free.
    port_free: BTreeMap<u8, Nanos>,
    /// Switch port -> node index.
    ports: BTreeMap<u8, usize>,
    faults: BTreeMap<(usize, usize), Faults>,
    rng: XorShift,
    pub stats: FabricStats,
}

impl Fabric {
    pub fn new(params: FabricParams, seed: u64) -> Self {
        Fabric {
            params,
            link_free: Vec::new(),
            link_busy: Vec::new(),
            port_free: BTreeMap::new(),
            ports: BTreeMap::new(),
            faults: BTreeMap::new(),
            rng: XorShift::new(seed),
            stats: FabricStats::default(),
        }
    }

    /// Attaches node `node` to switch port `port`.
    pub fn attach(&mut self, node: usize, port: u8) {
        if self.link_free.len() <= node {
            self.link_free.resize(node + 1, 0);
            self.link_busy.resize(node + 1, 0);
        }
        self.ports.insert(port, node);
    }

    /// Time node `node`'s link was busy since the last reset.
    pub fn link_busy_ns(&self, node: usize) -> Nanos {
        self.link_busy.get(node).copied().unwrap_or(0)
    }

    pub fn reset_accounts(&mut self) {
        self.link_busy.iter_mut().for_each(|b| *b = 0);
    }

    pub fn set_faults(&mut self, from: usize, to: usize, faults: Faults) {
        self.faults.insert((from, to), faults);
    }

    /// The sender's NIC puts `frame` on its link from `ready_at`. The head goes as soon as
    /// the link is free and, with stop/go, only when the switch's output port can take it;
    /// the output port is reserved from then on.
    pub fn send(&mut self, from: usize, ready_at: Nanos, frame: &[u8]) -> Sent {
        if self.link_free.len() <= from {
            self.link_free.resize(from + 1, 0);
            self.link_busy.resize(from + 1, 0);
        }
        let hop = self.params.cable_ns + self.params.switch_latency_ns;
        let out = super::super::frame::switch(frame).ok();
        let port = out
            .as_ref()
            .map(|(p, _)| *p)
            .filter(|p| self.ports.contains_key(p));
        let mut start = ready_at.max(self.link_free[from]);
        // From here the link is the frame's, carrying it or stopped holding it.
        let taken = start;
        if let Some(p) = port {
            let free = self.port_free.get(&p).copied().unwrap_or(0);
            start = start.max(free.saturating_sub(hop));
        }
        let tail_left = start + self.params.wire_ns(frame.len());
        self.link_free[from] = tail_left;
        self.link_busy[from] += tail_left - taken;
        let head = start + hop;
        if let (Some(p), Some((_, out))) = (port, out) {
            self.port_free
                .insert(p, head + self.params.wire_ns(out.len()));
        }
        Sent { tail_left, head }
    }

    /// The switch routes a frame whose head it has decoded at `now` (its output port was
    /// reserved by [`Fabric::send`]): the route byte is consumed, faults are applied and the
    /// tail's arrival at the receiver is returned. Nothing, one or two deliveries (a
    /// duplicate follows the original on the port).
    pub fn switch(&mut self, now: Nanos, from: usize, frame: &[u8]) -> Vec<Delivery> {
        let (port, out) = match super::super::frame::switch(frame) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(from, error = %e, "switch drops a frame");
                self.stats.bad += 1;
                return Vec::new();
            }
        };
        let Some(&to) = self.ports.get(&port) else {
            self.stats.unroutable += 1;
            return Vec::new();
        };
        *self.stats.frames.entry((from, to)).or_default() += 1;
        *self.stats.bytes.entry((from, to)).or_default() += frame.len() as u64;
        let faults = self.faults.get(&(from, to)).copied().unwrap_or_default();
        // Draw every number for every frame so that one fault's probability does not shift
        // the others' sequence.
        let (d, u, l) = (self.rng.unit(), self.rng.unit(), self.rng.unit());
        let extra = self.rng.range(faults.delay_ns / 2, faults.delay_ns);
        if d < faults.drop {
            self.stats.dropped += 1;
            return Vec::new();
        }
        let copies = if u < faults.duplicate {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        let wire = self.params.wire_ns(out.len());
        let mut deliveries = Vec::with_capacity(copies);
        for i in 0..copies {
            let mut start = now;
            if i > 0 {
                let free = self.port_free.entry(port).or_default();
                start = now.max(*free);
                *free = start + wire;
            }
            let mut at = start + self.params.cable_ns + wire;
            if i == 0 && l < faults.delay {
                self.stats.delayed += 1;
                at += extra;
            }
            deliveries.push(Delivery {
                node: to,
                at,
                frame: out.clone(),
            });
        }
        deliveries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame;

    fn fabric() -> Fabric {
        let mut f = Fabric::new(FabricParams::default(), 1);
        f.attach(0, 1);
        f.attach(1, 2);
        f
    }

    #[test]
    fn cut_through_timing_and_stop_go_back_pressure() {
        let mut f = fabric();
        f.attach(2, 3);
        let p = f.params.clone();
        let fr = frame::encode(&[2], &[0u8; 996]);
        let hop = p.cable_ns + p.switch_latency_ns;
        let sent = f.send(0, 1000, &fr);
        assert_eq!(sent.head, 1000 + hop);
        assert_eq!(sent.tail_left, 1000 + p.wire_ns(fr.len()));
        let d = f.switch(sent.head, 0, &fr);
        assert_eq!(d.len(), 1);
        let wire = p.wire_ns(fr.len() - 1);
        assert_eq!(d[0].at, sent.head + p.cable_ns + wire);
        assert_eq!(d[0].node, 1);
        assert_eq!(frame::decode(&d[0].frame).unwrap(), &[0u8; 996][..]);
        // Another node sends to the same output port at the same moment: stop/go holds it on
        // its own link until the port is free, so it reaches the switch as the first frame's
        // tail leaves it and nothing waits inside the switch.
        let other = f.send(2, 1000, &fr);
        assert_eq!(other.head, sent.head + wire);
        assert_eq!(other.tail_left, other.head - hop + p.wire_ns(fr.len()));
        let d2 = f.switch(other.head, 2, &fr);
        assert_eq!(d2[0].at, d[0].at + wire);
        // That sender's link stayed stopped: its next frame (to another port) goes after.
        let next = f.send(2, 1000, &frame::encode(&[1], &[0u8; 10]));
        assert_eq!(next.head, other.tail_left + hop);
    }

    #[test]
    fn faults_follow_their_probabilities_deterministically() {
        let run = || {
            let mut f = fabric();
            f.set_faults(
                0,
                1,
                Faults {
                    drop: 0.1,
                    duplicate: 0.1,
                    delay: 0.1,
                    delay_ns: 50_000,
                },
            );
            let fr = frame::encode(&[2], b"x");
            let mut delivered = 0;
            for i in 0..2000u64 {
                delivered += f.switch(i * 10_000, 0, &fr).len();
            }
            (delivered, f.stats.clone())
        };
        let (n, s) = run();
        assert_eq!(run(), (n, s.clone()));
        assert!((120..280).contains(&s.dropped), "{s:?}");
        assert!((120..280).contains(&s.duplicated), "{s:?}");
        assert!(s.delayed > 100, "{s:?}");
        assert_eq!(n as u64, 2000 - s.dropped + s.duplicated);
        // The other direction is clean.
        let mut f = fabric();
        f.attach(2, 3);
        let fr = frame::encode(&[1], b"x");
        assert_eq!(f.switch(0, 1, &fr).len(), 1);
    }

    #[test]
    fn unroutable_and_corrupt_frames_are_counted_not_delivered() {
        let mut f = fabric();
        assert!(f.switch(0, 0, &frame::encode(&[9], b"x")).is_empty());
        // An unroutable frame still occupies its sender's link.
        let sent = f.send(0, 0, &frame::encode(&[9], b"x"));
        assert!(sent.tail_left > 0);
        let mut bad = frame::encode(&[2], b"x");
        bad[3] ^= 0xff;
        assert!(f.switch(0, 0, &bad).is_empty());
        assert_eq!((f.stats.unroutable, f.stats.bad), (1, 1));
    }
}
