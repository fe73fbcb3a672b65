//! Which bytes of a READ the server's reply chunks have filled.
//!
//! Every offset and length in a structured reply comes from the server and is hostile until
//! checked: a chunk must lie inside its request (checked arithmetic, no wrapping) and must not
//! overlap an earlier chunk of the same reply (the spec forbids it, and an overlap would let
//! the chunks' lengths add up to the request while part of the buffer was never written).

use std::collections::BTreeMap;
use std::ops::Range;

/// Ranges a reply may leave before it is refused as too fragmented. Adjacent chunks merge,
/// so a server that sends its chunks in order (every real server) uses one range; the cap
/// bounds the memory a server can make us spend on one reply (about 48 bytes a range).
pub const MAX_RANGES: usize = 65_536;

/// Why a chunk of a read reply was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkError {
    #[error(
        "a chunk of {len} bytes at offset {offset} lies outside the read of {req_len} bytes at offset {req_offset}"
    )]
    /// The chunk is not inside its request (or its end wraps past 2^64).
    Outside {
        /// The chunk's offset.
        offset: u64,
        /// The chunk's length.
        len: u64,
        /// The request's offset.
        req_offset: u64,
        /// The request's length.
        req_len: u64,
    },
    #[error(
        "a chunk of {len} bytes at offset {offset} overlaps an earlier chunk of the same reply"
    )]
    /// The chunk covers bytes an earlier chunk already covered.
    Overlap {
        /// The chunk's offset.
        offset: u64,
        /// The chunk's length.
        len: u64,
    },
    #[error("a reply split into more than {MAX_RANGES} separate chunks")]
    /// More separate pieces than [`MAX_RANGES`].
    TooFragmented,
}

/// The part of one READ request (`len` bytes at `offset`) that its reply has covered so far.
#[derive(Debug, Clone)]
pub struct ReadCoverage {
    offset: u64,
    len: u64,
    /// start → end, relative to `offset`; disjoint and never adjacent (adjacent ones merge).
    ranges: BTreeMap<u64, u64>,
    covered: u64,
}

impl ReadCoverage {
    /// Nothing covered yet of a read of `len` bytes at `offset`.
    pub fn new(offset: u64, len: u64) -> Self {
        ReadCoverage {
            offset,
            len,
            ranges: BTreeMap::new(),
            covered: 0,
        }
    }

    /// Checks a chunk of `len` bytes at absolute `offset`, records it and returns where it
    /// goes in the request's buffer. A refused chunk changes nothing.
    pub fn place(&mut self, offset: u64, len: u64) -> Result<Range<usize>, ChunkError> {
        let outside = || ChunkError::Outside {
            offset,
            len,
            req_offset: self.offset,
            req_len: self.len,
        };
        let start = offset.checked_sub(self.offset).ok_or_else(outside)?;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .ok_or_else(outside)?;
        if len == 0 {
            return Ok(start as usize..start as usize);
        }
        let before = self
            .ranges
            .range(..=start)
            .next_back()
            .map(|(&s, &e)| (s, e));
        let after = self.ranges.range(start..).next().map(|(&s, &e)| (s, e));
        if before.is_some_and(|(_, e)| e > start) || after.is_some_and(|(s, _)| s < end) {
            return Err(ChunkError::Overlap { offset, len });
        }
        // Merge with the neighbours this chunk touches.
        let mut new = (start, end);
        let merge_before = before.filter(|&(_, e)| e == start);
        let merge_after = after.filter(|&(s, _)| s == end);
        if merge_before.is_none() && merge_after.is_none() && self.ranges.len() >= MAX_RANGES {
            return Err(ChunkError::TooFragmented);
        }
        if let Some((s, _)) = merge_before {
            self.ranges.remove(&s);
            new.0 = s;
        }
        if let Some((s, e)) = merge_after {
            self.ranges.remove(&s);
            new.1 = e;
        }
        self.ranges.insert(new.0, new.1);
        self.covered += len;
        // Both fit in usize: the request's buffer of `self.len` bytes exists.
        Ok(start as usize..end as usize)
    }

    /// Bytes covered so far.
    pub fn covered(&self) -> u64 {
        self.covered
    }

    /// Every byte of the request is covered.
    pub fn is_complete(&self) -> bool {
        self.covered == self.len
    }

    /// Forgets every chunk (the request is sent again).
    pub fn clear(&mut self) {
        self.ranges.clear();
        self.covered = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_inside_the_request_are_placed_and_merge() {
        let mut c = ReadCoverage::new(4096, 8192);
        assert_eq!(c.place(4096 + 4096, 4096), Ok(4096..8192));
        assert_eq!(c.place(4096, 4096), Ok(0..4096));
        assert!(c.is_complete());
        assert_eq!(c.ranges.len(), 1);
    }

    #[test]
    fn wrapping_offsets_are_outside() {
        // The panic of issue 18: start = 2^64 - 8 wrapped start + len back into range.
        let mut c = ReadCoverage::new(0, 1 << 20);
        assert!(matches!(
            c.place(u64::MAX - 7, 16),
            Err(ChunkError::Outside { .. })
        ));
        let mut c = ReadCoverage::new(4096, 4096);
        assert!(matches!(c.place(0, 4096), Err(ChunkError::Outside { .. })));
        assert!(matches!(
            c.place(4096, 4097),
            Err(ChunkError::Outside { .. })
        ));
        assert!(matches!(
            c.place(8192, u64::MAX),
            Err(ChunkError::Outside { .. })
        ));
        assert_eq!(c.covered(), 0);
    }

    #[test]
    fn overlaps_are_refused() {
        let mut c = ReadCoverage::new(0, 100);
        c.place(10, 10).unwrap();
        assert!(matches!(c.place(15, 10), Err(ChunkError::Overlap { .. })));
        assert!(matches!(c.place(5, 10), Err(ChunkError::Overlap { .. })));
        assert!(matches!(c.place(0, 100), Err(ChunkError::Overlap { .. })));
        assert!(matches!(c.place(12, 2), Err(ChunkError::Overlap { .. })));
        assert_eq!(c.place(0, 10), Ok(0..10));
        assert_eq!(c.place(20, 80), Ok(20..100));
        assert!(c.is_complete());
    }

    #[test]
    fn fragmentation_is_bounded() {
        let n = (MAX_RANGES as u64 + 1) * 2;
        let mut c = ReadCoverage::new(0, n);
        for i in 0..MAX_RANGES as u64 {
            c.place(i * 2, 1).unwrap();
        }
        assert_eq!(
            c.place(MAX_RANGES as u64 * 2, 1),
            Err(ChunkError::TooFragmented)
        );
        // Filling a gap merges and is still accepted.
        c.place(1, 1).unwrap();
    }

    /// Random chunks against a bitmap of the request: every accepted chunk lies inside the
    /// request and covers only bytes nothing covered before; `covered` counts them exactly.
    #[test]
    fn random_chunks_match_a_bitmap() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..2_000 {
            let req_off = match next() % 3 {
                0 => 0,
                1 => u64::MAX - 300,
                _ => next() % (1 << 40),
            };
            let req_len = next() % 300;
            let mut c = ReadCoverage::new(req_off, req_len);
            let mut bits = vec![false; req_len as usize];
            for _ in 0..40 {
                let off = match next() % 4 {
                    0 => next(),
                    _ => req_off.wrapping_add(next() % 320).wrapping_sub(10),
                };
                let len = match next() % 5 {
                    0 => next(),
                    _ => next() % 80,
                };
                let before = c.covered();
                match c.place(off, len) {
                    Ok(r) => {
                        assert_eq!(r.start as u64, off - req_off);
                        assert_eq!((r.end - r.start) as u64, len);
                        for b in &mut bits[r] {
                            assert!(!*b, "byte covered twice");
                            *b = true;
                        }
                    }
                    Err(_) => assert_eq!(c.covered(), before),
                }
                assert_eq!(c.covered(), bits.iter().filter(|&&b| b).count() as u64);
            }
            assert_eq!(c.is_complete(), bits.iter().all(|&b| b));
        }
    }
}
