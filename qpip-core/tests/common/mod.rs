#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use qpip_core::{Completion, CompletionQueue, Framer, LengthPrefixed, Nic, QpAttr, QueuePair};

pub const V6: &str = "[::1]:0";
pub const V4: &str = "127.0.0.1:0";

pub fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A connected pair of reliable QPs, both completing into `cq`.
pub fn pair(nic: &Nic, cq: &CompletionQueue, local: &str) -> (QueuePair, QueuePair) {
    pair_with(nic, cq, local, LengthPrefixed::default, 256)
}

pub fn pair_with<F: Framer>(
    nic: &Nic,
    cq: &CompletionQueue,
    local: &str,
    framer: impl Fn() -> F,
    depth: usize,
) -> (QueuePair, QueuePair) {
    let listener = nic.listen(addr(local)).unwrap();
    let server = nic.create_qp(QpAttr::new(cq).framer(framer()).depths(depth, depth));
    let client = nic.create_qp(QpAttr::new(cq).framer(framer()).depths(depth, depth));
    client
        .connect_timeout(listener.local_addr(), Duration::from_secs(10))
        .unwrap();
    listener
        .accept_timeout(&server, Duration::from_secs(10))
        .unwrap();
    (client, server)
}

/// Waits for exactly `n` completions; panics (instead of hanging) after `timeout`.
pub fn wait_n(cq: &CompletionQueue, n: usize, timeout: Duration) -> Vec<Completion> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    let mut buf = [Completion::default(); 64];
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out with {} of {n} completions: {:?}",
            out.len(),
            out.last()
        );
        let want = (n - out.len()).min(buf.len());
        let got = cq.wait(&mut buf[..want], Some(left)).unwrap();
        out.extend_from_slice(&buf[..got]);
    }
    out
}

/// Deterministic pseudo-random numbers (xorshift), so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The pattern byte of message `msg` at offset `i`.
pub fn pattern(msg: u64, i: usize) -> u8 {
    (msg.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8
}
