//! The caller's registered memory that requests read into or write from.
//!
//! [`MrSlice`] is a range of a memory region checked once, where it enters the client (the
//! mount's FUSE buffer, `qpip-nbd copy`'s worker buffer, a caller of
//! [`crate::Client::read_at_mr`]); the read and write operations carry it down to the send
//! WR or the framer's placement and cut it into pieces that stay inside it by construction.
//! `Region` is the owned form the session keeps for a request in flight.

use nbd_proto::transmission::client::ReadTarget;
use qpip_core::MemoryRegion;

use crate::error::{Error, Result};

/// `len` bytes of the registered memory `mr` from byte `at`, checked to lie inside it.
#[derive(Clone, Copy, Debug)]
pub struct MrSlice<'a> {
    mr: &'a MemoryRegion,
    at: usize,
    len: usize,
}

impl<'a> MrSlice<'a> {
    /// `len` bytes of `mr` from `at`; an error if they do not lie inside it.
    pub fn new(mr: &'a MemoryRegion, at: usize, len: usize) -> Result<Self> {
        match at.checked_add(len) {
            Some(end) if end <= mr.len() => Ok(MrSlice { mr, at, len }),
            _ => Err(Error::Invalid("buffer outside its memory region")),
        }
    }

    /// The whole of `mr`.
    pub fn all(mr: &'a MemoryRegion) -> Self {
        MrSlice {
            mr,
            at: 0,
            len: mr.len(),
        }
    }

    /// The memory region.
    pub fn mr(&self) -> &'a MemoryRegion {
        self.mr
    }

    /// Where the slice starts in the region.
    pub fn at(&self) -> usize {
        self.at
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty slice.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes of this slice from `from`, clamped to it: the pieces the client cuts a
    /// slice into stay inside it without another check.
    pub fn piece(&self, from: usize, len: usize) -> MrSlice<'a> {
        let from = from.min(self.len);
        MrSlice {
            mr: self.mr,
            at: self.at + from,
            len: len.min(self.len - from),
        }
    }

    /// The bytes, to read while nothing writes them.
    ///
    /// # Safety
    /// No receive WR may name these bytes and nothing else may write them while the slice
    /// the call returns lives.
    pub unsafe fn bytes(&self) -> &'a [u8] {
        // SAFETY: in bounds (checked when the slice was made, kept by `piece`); the caller
        // guarantees nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.mr.as_ptr().add(self.at), self.len) }
    }

    /// The owned form a request in flight keeps.
    pub(crate) fn region(&self) -> Region {
        Region {
            mr: self.mr.clone(),
            at: self.at,
        }
    }
}

/// The caller's registered memory a request reads into or writes from: `mr` from `at`.
#[derive(Clone, Debug)]
pub(crate) struct Region {
    pub mr: MemoryRegion,
    pub at: usize,
}

impl ReadTarget for Region {
    fn write_at(&self, at: usize, bytes: &[u8]) {
        self.mr.write_at(self.at + at, bytes);
    }
}
