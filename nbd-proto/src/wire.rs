//! Bounds-checked big-endian reading and writing helpers (crate-internal).

/// A cursor over a byte slice; every read is checked and returns `None` on underrun.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N).and_then(|b| b.try_into().ok())
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    pub(crate) fn rest(self) -> &'a [u8] {
        self.buf
    }
}

/// Read a big-endian `u32` at `at`, if the slice is long enough.
pub(crate) fn be_u32(buf: &[u8], at: usize) -> Option<u32> {
    let end = at.checked_add(4)?;
    buf.get(at..end)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_be_bytes)
}

/// Read a big-endian `u64` at `at`, if the slice is long enough.
pub(crate) fn be_u64(buf: &[u8], at: usize) -> Option<u64> {
    let end = at.checked_add(8)?;
    buf.get(at..end)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes)
}

/// Read a big-endian `u16` at `at`, if the slice is long enough.
pub(crate) fn be_u16(buf: &[u8], at: usize) -> Option<u16> {
    let end = at.checked_add(2)?;
    buf.get(at..end)
        .and_then(|b| b.try_into().ok())
        .map(u16::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_is_bounds_checked() {
        let mut r = Reader::new(&[0, 1, 0, 0, 0, 2, 9]);
        assert_eq!(r.u16(), Some(1));
        assert_eq!(r.u32(), Some(2));
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.u16(), None);
        assert_eq!(r.bytes(1), Some(&[9u8][..]));
        assert_eq!(r.u64(), None);
        assert!(r.rest().is_empty());
        assert_eq!(be_u32(&[0, 0, 0, 7], 0), Some(7));
        assert_eq!(be_u32(&[0, 0, 0, 7], 1), None);
        assert_eq!(be_u64(&[0; 8], usize::MAX), None);
        assert_eq!(be_u16(&[1, 2], 0), Some(0x0102));
    }
}
