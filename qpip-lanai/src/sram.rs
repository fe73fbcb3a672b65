//! The LANai's on-board SRAM as an allocator: QP state, TCP control blocks, WR caches and
//! socket buffers all live there, so running out is a real limit the host can hit.

use std::io;

/// Bytes of SRAM in use against a fixed budget.
#[derive(Clone, Debug)]
pub(crate) struct Sram {
    /// The whole SRAM (for messages).
    total: u64,
    /// What is left after the firmware image.
    budget: u64,
    used: u64,
}

/// The SRAM cannot hold another object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("LANai SRAM exhausted: need {need} bytes, {free} of {total} free")]
pub struct SramExhausted {
    pub need: u64,
    pub free: u64,
    pub total: u64,
}

impl From<SramExhausted> for io::Error {
    fn from(e: SramExhausted) -> io::Error {
        io::Error::new(io::ErrorKind::OutOfMemory, e)
    }
}

impl Sram {
    /// `total` bytes of SRAM of which `reserved` hold the firmware.
    pub(crate) fn new(total: u64, reserved: u64) -> Self {
        Sram {
            total,
            budget: total.saturating_sub(reserved),
            used: 0,
        }
    }

    pub(crate) fn free(&self) -> u64 {
        self.budget - self.used
    }

    /// Bytes allocated now.
    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// Takes `need` bytes, or says how much is missing.
    pub(crate) fn alloc(&mut self, need: u64) -> Result<(), SramExhausted> {
        if need > self.free() {
            return Err(SramExhausted {
                need,
                free: self.free(),
                total: self.total,
            });
        }
        self.used += need;
        Ok(())
    }

    /// Gives back bytes taken by [`Self::alloc`].
    pub(crate) fn release(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.used, "SRAM release of more than is in use");
        self.used = self.used.saturating_sub(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_is_an_out_of_memory_error_naming_the_sizes() {
        let mut s = Sram::new(1000, 200);
        s.alloc(500).unwrap();
        let e = s.alloc(301).unwrap_err();
        assert_eq!(e.free, 300);
        let io: io::Error = e.into();
        assert_eq!(io.kind(), io::ErrorKind::OutOfMemory);
        assert_eq!(
            io.to_string(),
            "LANai SRAM exhausted: need 301 bytes, 300 of 1000 free"
        );
        s.release(500);
        assert_eq!(s.free(), 800);
        s.alloc(800).unwrap();
    }
}
