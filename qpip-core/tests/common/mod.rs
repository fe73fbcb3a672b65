//! qpip-core's own test helpers (connected QP pairs, waiting for completions); patterns and
//! the CI rule are qpip-test-support's.
#![allow(dead_code, unused_imports)]

pub(crate) use qpip_test_support::pattern::{Rng, message_byte as pattern};

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use qpip_core::{Completion, CompletionQueue, Framer, LengthPrefixed, Nic, QpAttr, QueuePair};

pub(crate) const V6: &str = "[::1]:0";
pub(crate) const V4: &str = "127.0.0.1:0";

pub(crate) fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A connected pair of reliable QPs, both completing into `cq`.
pub(crate) fn pair(nic: &Nic, cq: &CompletionQueue, local: &str) -> (QueuePair, QueuePair) {
    pair_with(nic, cq, local, LengthPrefixed::default, 256)
}

pub(crate) fn pair_with<F: Framer>(
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
pub(crate) fn wait_n(cq: &CompletionQueue, n: usize, timeout: Duration) -> Vec<Completion> {
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
