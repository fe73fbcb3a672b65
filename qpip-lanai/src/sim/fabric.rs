//! The Myrinet fabric in virtual time: one link per node into a single cut-through crossbar
//! switch, and seeded fault injection (drop, duplicate, delay) per direction for tests.
//!
//! Myrinet links have stop/go flow control and the switch only a few bytes of slack, so
//! nothing is queued in the fabric: a frame whose switch output is busy stops on its input
//! link, and a frame whose receiving NIC has no free receive buffer stops on the output link
//! and, through the switch, on its sender's link (wormhole blocking). The sender's NIC holds
//! it, and its send staging buffer, until its tail has left. At most one frame waits per
//! link; the simulation (`sim.rs`) turns the times returned here into events.

use std::collections::{BTreeMap, VecDeque};

use crate::firmware::OutFrame;
use crate::meter::Nanos;
use crate::params::FabricParams;

/// A small deterministic PRNG (xorshift64*): fault injection needs reproducible runs, not
/// cryptographic quality.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    pub(crate) fn new(seed: u64) -> Self {
        // Zero is the one state xorshift cannot leave.
        XorShift(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
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
    pub(crate) drop: f64,
    pub(crate) duplicate: f64,
    /// Probability that a frame is held back by up to `delay_ns` (later frames overtake it).
    pub delay: f64,
    pub(crate) delay_ns: Nanos,
}

impl Faults {
    /// No faults.
    #[cfg(test)]
    pub(crate) fn none() -> Self {
        Faults::default()
    }
}

/// What the fabric did, per direction (sender, receiver) by node index.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FabricStats {
    pub(crate) frames: BTreeMap<(usize, usize), u64>,
    pub(crate) bytes: BTreeMap<(usize, usize), u64>,
    pub(crate) dropped: u64,
    pub(crate) duplicated: u64,
    pub(crate) delayed: u64,
    /// Frames whose route led to no simulated node (the bridge port, say).
    pub unroutable: u64,
    /// Frames the switch refused (bad CRC, truncated).
    pub bad: u64,
    /// Frames stopped on the wire because their receiver had no free receive buffer, and
    /// the time they waited.
    pub stopped: u64,
    pub(crate) stopped_ns: Nanos,
    /// The most frame heads ever waiting at one receiver (each holds its link: bounded by the
    /// links into it, plus injected duplicates and delays).
    pub max_waiting: usize,
}

impl FabricStats {
    /// Frames that entered the switch from `from` toward `to`.
    pub fn frames_between(&self, from: usize, to: usize) -> u64 {
        self.frames.get(&(from, to)).copied().unwrap_or(0)
    }
}

/// A frame's head on its way, and what it holds while it waits.
#[derive(Debug)]
pub(crate) struct Head {
    /// The frame as the receiver gets it (route byte consumed).
    frame: Vec<u8>,
    /// The sender link it holds, and when its head left the sender; none for an injected
    /// copy (a duplicate or a delayed frame, which holds nothing).
    from: Option<(usize, Nanos, usize)>,
    /// The switch output it holds.
    port: Option<u8>,
    /// When it reached the receiver.
    at: Nanos,
}

/// A frame head that reaches receiver `node` at `at`.
pub(crate) struct ToReceiver {
    pub at: Nanos,
    pub node: usize,
    pub head: Head,
}

/// A frame taken into a receive buffer: its tail arrives at `node` at `tail`.
pub(crate) struct Admitted {
    pub node: usize,
    pub tail: Nanos,
    pub frame: Vec<u8>,
    /// The sender whose link it freed, when its tail left there, and its length.
    pub released: Option<(usize, Nanos, usize)>,
    /// The next frame the freed switch output lets through.
    pub next: Option<ToReceiver>,
}

#[derive(Default)]
struct Link {
    /// Frames the NIC handed to its network send DMA, not yet on the link (bounded by its
    /// send staging buffers).
    queue: VecDeque<OutFrame>,
    /// When the frame on the link took it, while it is there (its tail not yet gone).
    taken: Option<Nanos>,
    free: Nanos,
    /// Time carrying frames or stopped holding one since the reset.
    busy: Nanos,
}

#[derive(Default)]
struct OutPort {
    /// A frame holds the output (its tail has not passed).
    held: bool,
    free: Nanos,
    /// Heads stopped on their input links for this output, with when they reached it.
    waiting: VecDeque<(Head, Nanos)>,
}

#[derive(Default)]
struct Input {
    /// A frame is streaming into the NIC (its tail has not arrived).
    streaming: bool,
    /// Heads stopped at the NIC, in arrival order.
    waiting: VecDeque<Head>,
}

pub(crate) struct Fabric {
    pub params: FabricParams,
    links: Vec<Link>,
    inputs: Vec<Input>,
    outputs: BTreeMap<u8, OutPort>,
    /// Switch port -> node index.
    ports: BTreeMap<u8, usize>,
    faults: BTreeMap<(usize, usize), Faults>,
    rng: XorShift,
    pub stats: FabricStats,
}

impl Fabric {
    pub(crate) fn new(params: FabricParams, seed: u64) -> Self {
        Fabric {
            params,
            links: Vec::new(),
            inputs: Vec::new(),
            outputs: BTreeMap::new(),
            ports: BTreeMap::new(),
            faults: BTreeMap::new(),
            rng: XorShift::new(seed),
            stats: FabricStats::default(),
        }
    }

    fn grow(&mut self, node: usize) {
        if self.links.len() <= node {
            self.links.resize_with(node + 1, Link::default);
            self.inputs.resize_with(node + 1, Input::default);
        }
    }

    /// Attaches node `node` to switch port `port`.
    pub(crate) fn attach(&mut self, node: usize, port: u8) {
        self.grow(node);
        self.ports.insert(port, node);
    }

    /// Time node `node`'s link was busy since the last reset.
    pub(crate) fn link_busy_ns(&self, node: usize) -> Nanos {
        self.links.get(node).map_or(0, |l| l.busy)
    }

    pub(crate) fn reset_accounts(&mut self) {
        self.links.iter_mut().for_each(|l| l.busy = 0);
    }

    pub(crate) fn set_faults(&mut self, from: usize, to: usize, faults: Faults) {
        self.faults.insert((from, to), faults);
    }

    /// Switch latency plus the cables on both sides: head from sender to receiver.
    fn path_ns(&self) -> Nanos {
        2 * self.params.cable_ns + self.params.switch_latency_ns
    }

    /// The sender's NIC hands `frame` to its network send DMA.
    pub(crate) fn offer(&mut self, from: usize, frame: OutFrame) {
        self.grow(from);
        self.links[from].queue.push_back(frame);
    }

    /// Puts the next queued frame of `from` on its link if the link is free: returns when
    /// its head reaches the switch, the frame and when its head left.
    pub(crate) fn start(&mut self, from: usize) -> Option<(Nanos, Vec<u8>, Nanos)> {
        let link = self.links.get_mut(from)?;
        if link.taken.is_some() {
            return None;
        }
        let f = link.queue.pop_front()?;
        let sent = f.ready_at.max(link.free);
        link.taken = Some(sent);
        let at = sent + self.params.cable_ns + self.params.switch_latency_ns;
        Some((at, f.bytes, sent))
    }

    /// The `len`-byte frame on `from`'s link has left it entirely at `tail`.
    fn release(&mut self, from: usize, tail: Nanos, len: usize) -> (usize, Nanos, usize) {
        let link = &mut self.links[from];
        if let Some(taken) = link.taken.take() {
            link.busy += tail.saturating_sub(taken);
        }
        link.free = link.free.max(tail);
        (from, tail, len)
    }

    /// The switch decodes a head that left `from` at `sent` and reaches it at `now`: the
    /// route byte is consumed and faults applied. Returns the sender link it freed (a frame
    /// the switch sinks streams through unhindered) and the heads that go on toward their
    /// receivers (none, the frame, or the frame and an injected copy).
    pub(crate) fn switch(
        &mut self,
        now: Nanos,
        from: usize,
        frame: &[u8],
        sent: Nanos,
    ) -> (Option<(usize, Nanos, usize)>, Vec<ToReceiver>) {
        let len = frame.len();
        let natural = sent + self.params.wire_ns(len);
        let (port, out) = match super::super::frame::switch(frame) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(from, error = %e, "switch drops a frame");
                self.stats.bad += 1;
                return (Some(self.release(from, natural, len)), Vec::new());
            }
        };
        let Some(&to) = self.ports.get(&port) else {
            self.stats.unroutable += 1;
            return (Some(self.release(from, natural, len)), Vec::new());
        };
        *self.stats.frames.entry((from, to)).or_default() += 1;
        *self.stats.bytes.entry((from, to)).or_default() += frame.len() as u64;
        let faults = self.faults.get(&(from, to)).copied().unwrap_or_default();
        // Draw every number for every frame so that one fault's probability does not shift
        // the others' sequence.
        let (d, u, l) = (self.rng.unit(), self.rng.unit(), self.rng.unit());
        let extra = self.rng.range(faults.delay_ns / 2, faults.delay_ns);
        let cable = self.params.cable_ns;
        let wire = self.params.wire_ns(out.len());
        if d < faults.drop {
            self.stats.dropped += 1;
            return (Some(self.release(from, natural, len)), Vec::new());
        }
        let mut heads = Vec::new();
        if u < faults.duplicate {
            self.stats.duplicated += 1;
            let at = now + cable + wire;
            heads.push(ToReceiver {
                at,
                node: to,
                head: Head {
                    frame: out.clone(),
                    from: None,
                    port: None,
                    at,
                },
            });
        }
        if l < faults.delay {
            // Held back inside the fabric: later frames overtake it; it holds nothing.
            self.stats.delayed += 1;
            let at = now + cable + extra;
            heads.push(ToReceiver {
                at,
                node: to,
                head: Head {
                    frame: out,
                    from: None,
                    port: None,
                    at,
                },
            });
            return (Some(self.release(from, natural, len)), heads);
        }
        let head = Head {
            frame: out,
            from: Some((from, sent, frame.len())),
            port: Some(port),
            at: 0,
        };
        let o = self.outputs.entry(port).or_default();
        if o.held {
            o.waiting.push_back((head, now));
        } else {
            heads.insert(0, Self::grant(o, head, now, cable, to));
        }
        (None, heads)
    }

    /// The output port takes `head` (which reached it at `now`) once it is free.
    fn grant(o: &mut OutPort, mut head: Head, now: Nanos, cable: Nanos, to: usize) -> ToReceiver {
        o.held = true;
        let at = now.max(o.free) + cable;
        head.at = at;
        ToReceiver { at, node: to, head }
    }

    /// A head reaches receiver `node`: it waits there, holding its links, until the NIC
    /// takes it.
    pub(crate) fn arrive_head(&mut self, node: usize, head: Head) {
        let input = &mut self.inputs[node];
        input.waiting.push_back(head);
        self.stats.max_waiting = self.stats.max_waiting.max(input.waiting.len());
    }

    /// The tail of the frame streaming into `node` has arrived.
    pub(crate) fn tail_in(&mut self, node: usize) {
        self.inputs[node].streaming = false;
    }

    /// Whether `node`'s NIC has a head waiting and is taking no frame.
    pub(crate) fn wants_buffer(&self, node: usize) -> bool {
        let input = &self.inputs[node];
        !input.streaming && !input.waiting.is_empty()
    }

    /// The NIC of `node` has a free receive buffer at `now`: the first waiting frame streams
    /// in (stop/go's GO); the sender's link and the switch output free when its tail passes.
    pub(crate) fn admit(&mut self, node: usize, now: Nanos) -> Option<Admitted> {
        let path = self.path_ns();
        let cable = self.params.cable_ns;
        let input = &mut self.inputs[node];
        if input.streaming {
            return None;
        }
        let head = input.waiting.pop_front()?;
        input.streaming = true;
        if now > head.at {
            self.stats.stopped += 1;
            self.stats.stopped_ns += now - head.at;
        }
        let tail = now + self.params.wire_ns(head.frame.len());
        let released = head.from.map(|(from, sent, len)| {
            // Held since its head left; streams again once GO is back.
            let left = (sent + self.params.wire_ns(len))
                .max(now.saturating_sub(path) + self.params.wire_ns(len));
            self.release(from, left, len)
        });
        let mut next = None;
        if let Some(p) = head.port {
            let o = self.outputs.entry(p).or_default();
            o.held = false;
            o.free = tail.saturating_sub(cable);
            if let Some((h, reached)) = o.waiting.pop_front() {
                let to = self.ports.get(&p).copied().unwrap_or(node);
                next = Some(Self::grant(o, h, reached, cable, to));
            }
        }
        Some(Admitted {
            node,
            tail,
            frame: head.frame,
            released,
            next,
        })
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
        f.attach(2, 3);
        f
    }

    fn out(route: u8, len: usize, ready_at: Nanos) -> OutFrame {
        OutFrame {
            bytes: frame::encode(&[route], &vec![0u8; len]),
            ready_at,
        }
    }

    #[test]
    fn cut_through_timing_and_stop_go_at_a_busy_output() {
        let mut f = fabric();
        let p = f.params.clone();
        let hop = p.cable_ns + p.switch_latency_ns;
        f.offer(0, out(2, 996, 1000));
        let (at, fr, sent) = f.start(0).unwrap();
        assert_eq!((at, sent), (1000 + hop, 1000));
        // One frame on the link at a time.
        f.offer(0, out(2, 10, 1000));
        assert!(f.start(0).is_none());
        let (freed, heads) = f.switch(at, 0, &fr, sent);
        assert!(freed.is_none());
        let h = &heads[0];
        assert_eq!((h.at, h.node), (at + p.cable_ns, 1));
        // Another node sends to the same output: it stops on its own link.
        f.offer(2, out(2, 996, 1000));
        let (at2, fr2, sent2) = f.start(2).unwrap();
        let (_, heads2) = f.switch(at2, 2, &fr2, sent2);
        assert!(heads2.is_empty());
        for t in heads {
            f.arrive_head(t.node, t.head);
        }
        let a = f.admit(1, at + p.cable_ns).unwrap();
        let wire = p.wire_ns(fr.len() - 1);
        assert_eq!(a.tail, at + p.cable_ns + wire);
        assert_eq!(a.released, Some((0, 1000 + p.wire_ns(fr.len()), fr.len())));
        // The output frees as the tail passes it: the stopped head goes on then.
        let next = a.next.unwrap();
        assert_eq!(next.at, a.tail - p.cable_ns + p.cable_ns);
        // The first sender's link is free for its next frame.
        assert!(f.start(0).is_some());
    }

    #[test]
    fn a_full_receiver_stops_the_frame_and_holds_the_senders_link() {
        let mut f = fabric();
        let p = f.params.clone();
        f.offer(0, out(2, 996, 0));
        let (at, fr, sent) = f.start(0).unwrap();
        let (_, heads) = f.switch(at, 0, &fr, sent);
        let t = heads.into_iter().next().unwrap();
        let reached = t.at;
        f.arrive_head(t.node, t.head);
        // The NIC's buffers are full until 50 µs: the frame waits on the wire, its sender's
        // link stays held and nothing queues.
        assert!(f.wants_buffer(1));
        let a = f.admit(1, 50_000).unwrap();
        assert_eq!(a.tail, 50_000 + p.wire_ns(fr.len() - 1));
        let path = 2 * p.cable_ns + p.switch_latency_ns;
        assert_eq!(
            a.released,
            Some((0, 50_000 - path + p.wire_ns(fr.len()), fr.len()))
        );
        assert_eq!(f.stats.stopped, 1);
        assert_eq!(f.stats.stopped_ns, 50_000 - reached);
        assert_eq!(f.link_busy_ns(0), 50_000 - path + p.wire_ns(fr.len()));
        // One frame streams in at a time.
        assert!(f.admit(1, 50_000).is_none());
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
                delivered += f.switch(i * 10_000, 0, &fr, 0).1.len();
                // Free the output for the next frame.
                f.outputs.values_mut().for_each(|o| o.held = false);
            }
            (delivered, f.stats.clone())
        };
        let (n, s) = run();
        assert_eq!(run(), (n, s.clone()));
        assert!((120..280).contains(&s.dropped), "{s:?}");
        assert!((120..280).contains(&s.duplicated), "{s:?}");
        assert!(s.delayed > 100, "{s:?}");
        assert_eq!(n as u64, 2000 - s.dropped + s.duplicated);
    }

    #[test]
    fn unroutable_and_corrupt_frames_are_counted_not_delivered() {
        let mut f = fabric();
        let (freed, heads) = f.switch(0, 0, &frame::encode(&[9], b"x"), 0);
        assert!(heads.is_empty());
        // An unroutable frame still occupied its sender's link, for its wire time.
        assert!(freed.is_some_and(|(n, t, _)| n == 0 && t > 0));
        let mut bad = frame::encode(&[2], b"x");
        bad[3] ^= 0xff;
        assert!(f.switch(0, 0, &bad, 0).1.is_empty());
        assert_eq!((f.stats.unroutable, f.stats.bad), (1, 1));
    }
}
