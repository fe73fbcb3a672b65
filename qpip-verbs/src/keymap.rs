//! Maps keyed by numbers this process hands out itself (lkeys, QP numbers): a multiplicative
//! hash in place of std's SipHash, which costs a message two hashings of ~20 ns on each side
//! (BENCHMARKS, "A message's own path"). SipHash's keyed randomness guards a map against keys
//! an adversary chooses to collide; only our own counters insert keys here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by a number this process assigned.
pub type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// FxHash's step: rotate, mix in the word, multiply by an odd constant (the multiplication
/// carries the key's low bits, which a counter varies, into the high bits the table's
/// control bytes use).
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

const SEED: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(SEED);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_keys_spread_over_buckets_and_control_bytes() {
        let hash = |k: u32| {
            let mut h = KeyHasher::default();
            h.write_u32(k);
            h.finish()
        };
        // Consecutive keys, as a counter hands them out: distinct low bits (the bucket) and
        // more than a few distinct top-7-bit tags (hashbrown's control bytes).
        let low: std::collections::HashSet<u64> = (0x100..0x140).map(|k| hash(k) & 63).collect();
        let top: std::collections::HashSet<u64> = (0x100..0x140).map(|k| hash(k) >> 57).collect();
        assert!(low.len() >= 32, "{} buckets for 64 keys", low.len());
        assert!(top.len() >= 32, "{} tags for 64 keys", top.len());
        let mut map = KeyMap::default();
        for k in 0..10_000u32 {
            map.insert(k, k * 2);
        }
        assert!((0..10_000u32).all(|k| map.get(&k) == Some(&(k * 2))));
    }
}
