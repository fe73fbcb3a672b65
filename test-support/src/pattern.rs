//! Deterministic test data, so that a failure reproduces and a misplaced byte is seen, and
//! image files holding it.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Bytes that depend on their absolute offset: a range read back from the wrong place
/// differs from the range expected there.
pub fn at_offset(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (offset + i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 56) as u8 ^ ((offset + i) >> 12) as u8
        })
        .collect()
}

/// `len` pseudo-random bytes from `seed` (xorshift).
pub fn seeded(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

/// The byte at offset `i` of message number `msg` (messages differ from each other).
pub fn message_byte(msg: u64, i: usize) -> u8 {
    (msg.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8
}

/// Deterministic pseudo-random numbers (xorshift64); the seed must not be 0.
pub struct Rng(pub u64);

impl Rng {
    /// The next number (xorshift64).
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A sparse image file `dir/name` of `size` bytes.
pub fn sparse_image(dir: &Path, name: &str, size: u64) -> PathBuf {
    image_with(dir, name, size, &[])
}

/// A sparse image file `dir/name` of `size` bytes with [`at_offset`] data in the ranges
/// `(offset, len)` of `data`.
pub fn image_with(dir: &Path, name: &str, size: u64, data: &[(u64, u64)]) -> PathBuf {
    let path = dir.join(name);
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    for &(off, len) in data {
        f.write_all_at(&at_offset(off, len as usize), off).unwrap();
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_stable_and_tell_places_apart() {
        assert_eq!(at_offset(4096, 8), at_offset(0, 4104)[4096..]);
        assert_ne!(at_offset(0, 4096), at_offset(4096, 4096));
        assert_eq!(seeded(64, 7), seeded(64, 7));
        assert_ne!(seeded(64, 7), seeded(64, 8));
        assert_ne!(message_byte(1, 0), message_byte(2, 0));
    }
}
