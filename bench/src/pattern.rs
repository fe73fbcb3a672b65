//! The data `nbd ext2` writes and verifies: every 4 KiB block names itself, so a block read
//! back from the wrong place is caught and reported by its offset.

use anyhow::{Result, bail};

const TABLE: usize = 1 << 20;
pub(crate) const BLOCK: usize = 4096;

/// Block-indexed pseudo-random data: block `b` (4 KiB) is 4 KiB of a 1 MiB pseudo-random
/// table (chosen by `b`), with `b` and `seed ^ b` in its first 16 bytes.
pub(crate) struct Pattern {
    table: Vec<u8>,
    seed: u64,
}

impl Pattern {
    pub(crate) fn new(seed: u64) -> Pattern {
        let mut x = seed | 1;
        let mut table = Vec::with_capacity(TABLE);
        while table.len() < TABLE {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            table.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
        }
        Pattern { table, seed }
    }

    fn block(&self, b: u64, out: &mut [u8]) {
        let slot = (b.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize % (TABLE / BLOCK);
        out.copy_from_slice(&self.table[slot * BLOCK..][..BLOCK]);
        out[..8].copy_from_slice(&b.to_le_bytes());
        out[8..16].copy_from_slice(&(self.seed ^ b).to_le_bytes());
    }

    /// Fills `buf` (a multiple of 4 KiB) with the data at file offset `off` (4 KiB aligned).
    pub(crate) fn fill(&self, off: u64, buf: &mut [u8]) {
        for (i, blk) in buf.chunks_exact_mut(BLOCK).enumerate() {
            self.block(off / BLOCK as u64 + i as u64, blk);
        }
    }

    /// Checks `buf` against the pattern at `off`; names the first bad block.
    pub(crate) fn check(&self, off: u64, buf: &[u8]) -> Result<()> {
        let mut want = vec![0u8; BLOCK];
        for (i, blk) in buf.chunks_exact(BLOCK).enumerate() {
            let b = off / BLOCK as u64 + i as u64;
            self.block(b, &mut want);
            if blk != want.as_slice() {
                let got = u64::from_le_bytes(blk[..8].try_into().expect("8 bytes"));
                let first = blk.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
                let bad = blk.iter().zip(&want).filter(|(x, y)| x != y).count();
                let zero = blk[first..].iter().take_while(|&&x| x == 0).count();
                bail!(
                    "data mismatch in the 4 KiB block at file offset {} (it carries block \
                     index {got}, expected {b}): {bad} bytes differ from byte {first} on \
                     ({zero} zero bytes there)",
                    b * BLOCK as u64
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_round_trips_and_catches_misplaced_blocks() {
        let p = Pattern::new(7);
        let mut a = vec![0u8; 3 * BLOCK];
        p.fill(8 * BLOCK as u64, &mut a);
        p.check(8 * BLOCK as u64, &a).unwrap();
        assert!(p.check(9 * BLOCK as u64, &a).is_err());
        let mut b = a.clone();
        b[BLOCK + 100] ^= 1;
        let e = p.check(8 * BLOCK as u64, &b).unwrap_err().to_string();
        assert!(e.contains(&format!("{}", 9 * BLOCK)), "{e}");
        // Different seeds differ.
        let mut c = vec![0u8; BLOCK];
        Pattern::new(8).fill(8 * BLOCK as u64, &mut c);
        assert_ne!(&c[..], &a[..BLOCK]);
    }
}
