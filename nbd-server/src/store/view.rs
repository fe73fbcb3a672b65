//! A view of a store, as qemu-nbd's `--offset`, `--discard`, `--detect-zeroes` and `--cache`
//! shape it: the disk from an offset on, TRIM ignored, WRITEs of zeroes turned into
//! WRITE_ZEROES, every write made durable before its reply or FLUSH made a no-op.
//! [`apply`] wraps a store in a [`View`] only when one of them differs from the default.
//!
//! A view with an offset, zero detection or write-through has no placement file: the NIC
//! would place WRITE payloads at the export's offsets in the file, unshifted, unseen by the
//! zero detection and unflushed, so every write goes through [`Store::write_at`] (one more
//! copy, from the receive slot).

use std::fmt;
use std::io;
use std::task::Waker;

use super::{Depth, Dirty, Extent, Pending, ReadFrom, Store};

/// What TRIM does, as qemu's `discard` option says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Discard {
    /// TRIM is accepted and does nothing; WRITE_ZEROES frees no space.
    Ignore,
    /// TRIM frees space (punches holes); WRITE_ZEROES may (the server's default).
    #[default]
    Unmap,
}

/// What a WRITE of all-zero data becomes, as qemu's `detect-zeroes` option says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DetectZeroes {
    /// Written as data (the default).
    #[default]
    Off,
    /// A WRITE_ZEROES that keeps the range allocated.
    On,
    /// A WRITE_ZEROES that may free the range (with [`Discard::Unmap`] only).
    Unmap,
}

/// When writes become durable, as qemu's `cache` option says. Only the durability of
/// qemu's modes applies here: the host page cache is never bypassed (O_DIRECT), since read
/// replies are sent from the image's mapping, which is the page cache (`none` is
/// `writeback`'s durability, `directsync` `writethrough`'s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Cache {
    /// Writes are durable after a FLUSH or with FUA (the default).
    #[default]
    Writeback,
    /// Every write, zeroing and trim is durable before its reply.
    Writethrough,
    /// FLUSH and FUA are acknowledged without making anything durable (scratch disks).
    Unsafe,
}

/// How an export shapes its store (qemu-nbd's `--offset`, `--discard`, `--detect-zeroes`,
/// `--cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewOptions {
    /// The disk starts at this byte of the store's.
    pub offset: u64,
    /// What TRIM and WRITE_ZEROES may free.
    pub discard: Discard,
    /// Whether WRITEs of zeroes become WRITE_ZEROES.
    pub detect_zeroes: DetectZeroes,
    /// When writes become durable.
    pub cache: Cache,
}

/// Why a view cannot be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// `--offset` at or past the store's end.
    #[error("--offset {offset} is not below the size of {location} ({size} bytes)")]
    OffsetPastEnd {
        /// The offset asked for.
        offset: u64,
        /// The store's size.
        size: u64,
        /// The store.
        location: String,
    },
    /// `--detect-zeroes unmap` with `--discard ignore`.
    #[error("--detect-zeroes unmap needs --discard unmap (as qemu-nbd)")]
    UnmapWithoutDiscard,
}

/// `store` as `opts` shape it: the store itself with the default options.
pub fn apply(store: Box<dyn Store>, opts: ViewOptions) -> Result<Box<dyn Store>, ViewError> {
    if opts.detect_zeroes == DetectZeroes::Unmap && opts.discard == Discard::Ignore {
        return Err(ViewError::UnmapWithoutDiscard);
    }
    if opts == ViewOptions::default() {
        return Ok(store);
    }
    if opts.offset >= store.size() {
        return Err(ViewError::OffsetPastEnd {
            offset: opts.offset,
            size: store.size(),
            location: store.location(),
        });
    }
    Ok(Box::new(View { inner: store, opts }))
}

/// A store shaped by [`ViewOptions`].
pub struct View {
    inner: Box<dyn Store>,
    opts: ViewOptions,
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("inner", &self.inner)
            .field("opts", &self.opts)
            .finish()
    }
}

impl View {
    fn at(&self, offset: u64) -> u64 {
        offset + self.opts.offset
    }

    /// A change with `fua` must be durable before its reply: FUA asked for it (unless the
    /// cache is unsafe), or the cache writes through.
    fn durable(&self, fua: bool) -> bool {
        match self.opts.cache {
            Cache::Writeback => fua,
            Cache::Writethrough => true,
            Cache::Unsafe => false,
        }
    }

    /// After a change other than a write: made durable when the cache writes through.
    fn written_through(&self) -> io::Result<()> {
        match self.opts.cache {
            Cache::Writethrough => self.inner.flush(),
            Cache::Writeback | Cache::Unsafe => Ok(()),
        }
    }

    /// The NIC may place WRITE payloads in the store's file: nothing here needs to see them.
    fn places(&self) -> bool {
        self.opts.offset == 0
            && self.opts.detect_zeroes == DetectZeroes::Off
            && self.opts.cache != Cache::Writethrough
    }

    /// With detect-zeroes on: `data` is all zeroes and was written as WRITE_ZEROES (true).
    fn zeroes_written(&self, data: &[u8], offset: u64) -> io::Result<bool> {
        let may_unmap = match self.opts.detect_zeroes {
            DetectZeroes::Off => return Ok(false),
            DetectZeroes::On => false,
            DetectZeroes::Unmap => true,
        };
        if data.is_empty() || data.iter().any(|&b| b != 0) {
            return Ok(false);
        }
        self.inner
            .write_zeroes(self.at(offset), data.len() as u64, true, may_unmap)
    }
}

impl Store for View {
    fn location(&self) -> String {
        match self.opts.offset {
            0 => self.inner.location(),
            o => format!("{} from byte {o}", self.inner.location()),
        }
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn size(&self) -> u64 {
        // An image shrunk below the offset (rbd resize) is an empty disk, not a wrap.
        self.inner.size().saturating_sub(self.opts.offset)
    }
    fn can_resize(&self) -> bool {
        self.inner.can_resize()
    }
    /// The disk from the offset on becomes `size` bytes: the store, `offset` more.
    fn resize(&self, size: u64, alone: bool) -> io::Result<()> {
        let total = size
            .checked_add(self.opts.offset)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.inner.resize(total, alone)
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn mapping(&self) -> Option<(*const u8, usize)> {
        let (ptr, len) = self.inner.mapping()?;
        let skip = usize::try_from(self.opts.offset)
            .ok()
            .filter(|&s| s < len)?;
        // SAFETY: `skip` is within the mapping of `len` bytes.
        Some((unsafe { ptr.add(skip) }, len - skip))
    }
    fn placement_file(&self) -> Option<std::fs::File> {
        // With an offset, zero detection or write-through: none (the module's comment says
        // why).
        self.places().then(|| self.inner.placement_file()).flatten()
    }
    fn placement_from(&self) -> u64 {
        self.inner.placement_from()
    }
    fn read_from(&self, offset: u64, len: u64) -> io::Result<ReadFrom> {
        self.inner.read_from(self.at(offset), len)
    }
    fn still_holds(&self, end: u64) -> io::Result<bool> {
        self.inner.still_holds(self.at(end))
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, self.at(offset))
    }
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let fua = self.durable(fua);
        if self.zeroes_written(data, offset)? {
            return if fua { self.inner.flush() } else { Ok(()) };
        }
        self.inner.write_at(data, self.at(offset), fua)
    }
    unsafe fn start_write(
        &self,
        data: *const u8,
        len: usize,
        offset: u64,
        done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        if self.opts.detect_zeroes != DetectZeroes::Off || self.opts.cache == Cache::Writethrough {
            // SAFETY: the caller vouches for the bytes, and nothing outlives this call.
            let buf = unsafe { std::slice::from_raw_parts(data, len) };
            if self.opts.cache == Cache::Writethrough {
                // Written and flushed here, before the reply (Ok(None): done).
                self.write_at(buf, offset, true)?;
                return Ok(None);
            }
            if self.zeroes_written(buf, offset)? {
                return Ok(None);
            }
        }
        // SAFETY: passed on with the caller's guarantee.
        unsafe { self.inner.start_write(data, len, self.at(offset), done) }
    }
    unsafe fn start_read(
        &self,
        buf: *mut u8,
        len: usize,
        offset: u64,
        done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        // SAFETY: passed on with the caller's guarantee.
        unsafe { self.inner.start_read(buf, len, self.at(offset), done) }
    }
    fn flush(&self) -> io::Result<()> {
        match self.opts.cache {
            Cache::Unsafe => Ok(()),
            Cache::Writeback | Cache::Writethrough => self.inner.flush(),
        }
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.opts.discard {
            Discard::Ignore => Ok(()),
            Discard::Unmap => {
                self.inner.trim(self.at(offset), len)?;
                self.written_through()
            }
        }
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_write: bool,
        may_unmap: bool,
    ) -> io::Result<bool> {
        let may_unmap = may_unmap && self.opts.discard == Discard::Unmap;
        let done = self
            .inner
            .write_zeroes(self.at(offset), len, may_write, may_unmap)?;
        if done {
            self.written_through()?;
        }
        Ok(done)
    }
    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.prefetch(self.at(offset), len)
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        self.inner.extents(self.at(offset), len)
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<Vec<Depth>> {
        self.inner.allocation_depth(self.at(offset), len)
    }
    fn has_bitmap(&self, name: &str) -> io::Result<()> {
        self.inner.has_bitmap(name)
    }
    fn dirty_bitmap(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<Dirty>> {
        self.inner.dirty_bitmap(name, self.at(offset), len)
    }
    // Even with cache=unsafe: what the store keeps in memory is stored at close, as qemu's.
    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::open;

    fn store(size: u64) -> Box<dyn Store> {
        let s = open::anonymous("view-test.img", size).unwrap();
        let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
        s.write_at(&bytes, 0, false).unwrap();
        s
    }

    #[test]
    fn an_offset_view_shifts_every_access() {
        let v = apply(
            store(64 << 10),
            ViewOptions {
                offset: 4096,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(v.size(), 60 << 10);
        assert!(v.placement_file().is_none());
        let mut b = [0u8; 4];
        v.read_at(&mut b, 0).unwrap();
        assert_eq!(b[0], (4096 % 251) as u8 + 1);
        let (ptr, len) = v.mapping().unwrap();
        assert_eq!(len, 60 << 10);
        // SAFETY: the mapping covers `len` bytes while the store lives.
        assert_eq!(unsafe { *ptr }, b[0]);
        v.write_at(&[0xAA; 4], 0, false).unwrap();
        v.trim(8192, 4096).unwrap();
        let mut back = [0u8; 4];
        v.read_at(&mut back, 8192).unwrap();
        assert_eq!(back, [0; 4]);
        v.read_at(&mut back, 0).unwrap();
        assert_eq!(back, [0xAA; 4]);
    }

    #[test]
    fn an_offset_at_or_past_the_end_and_unmap_without_discard_are_refused() {
        let o = |offset| ViewOptions {
            offset,
            ..Default::default()
        };
        assert!(matches!(
            apply(store(4096), o(4096)),
            Err(ViewError::OffsetPastEnd { .. })
        ));
        assert!(apply(store(4096), o(4095)).is_ok());
        let bad = ViewOptions {
            discard: Discard::Ignore,
            detect_zeroes: DetectZeroes::Unmap,
            ..Default::default()
        };
        assert!(matches!(
            apply(store(4096), bad),
            Err(ViewError::UnmapWithoutDiscard)
        ));
    }

    /// A store that counts what reaches it durably: flushes and FUA writes.
    #[derive(Debug)]
    struct Durable {
        inner: Box<dyn Store>,
        /// Flushes, then FUA writes.
        seen: std::sync::Arc<[std::sync::atomic::AtomicUsize; 2]>,
    }

    impl Store for Durable {
        fn location(&self) -> String {
            self.inner.location()
        }
        fn kind(&self) -> &'static str {
            self.inner.kind()
        }
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_only(&self) -> bool {
            false
        }
        fn placement_file(&self) -> Option<std::fs::File> {
            self.inner.placement_file()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            if fua {
                self.seen[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.inner.write_at(data, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            self.seen[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.inner.flush()
        }
        fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.trim(offset, len)
        }
        fn write_zeroes(&self, o: u64, l: u64, w: bool, u: bool) -> io::Result<bool> {
            self.inner.write_zeroes(o, l, w, u)
        }
    }

    /// Flushes and FUA writes that reach the store under `cache` for a plain write, a FUA
    /// write, a FLUSH, a TRIM and a WRITE_ZEROES; and whether the NIC may place writes.
    fn durability(cache: Cache) -> (usize, usize, bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let seen = std::sync::Arc::new([Default::default(), Default::default()]);
        let d = Box::new(Durable {
            inner: open::anonymous("cache-test.img", 64 << 10).unwrap(),
            seen: seen.clone(),
        });
        let v = apply(
            d,
            ViewOptions {
                cache,
                ..Default::default()
            },
        )
        .unwrap();
        v.write_at(&[1; 512], 0, false).unwrap();
        v.write_at(&[2; 512], 512, true).unwrap();
        v.flush().unwrap();
        v.trim(4096, 4096).unwrap();
        v.write_zeroes(8192, 4096, true, true).unwrap();
        let places = v.placement_file().is_some();
        (seen[0].load(Relaxed), seen[1].load(Relaxed), places)
    }

    #[test]
    fn cache_modes_make_writes_durable_as_qemus_do() {
        // writeback: the FLUSH and the FUA write; the NIC places writes.
        assert_eq!(durability(Cache::Writeback), (1, 1, true));
        // writethrough: every write FUA, the FLUSH, and a flush after TRIM and WRITE_ZEROES;
        // the server writes (and flushes) every payload itself.
        assert_eq!(durability(Cache::Writethrough), (3, 2, false));
        // unsafe: nothing is made durable; the NIC still places writes.
        assert_eq!(durability(Cache::Unsafe), (0, 0, true));
    }

    #[test]
    fn discard_ignore_keeps_the_data() {
        let v = apply(
            store(16 << 10),
            ViewOptions {
                discard: Discard::Ignore,
                ..Default::default()
            },
        )
        .unwrap();
        v.trim(0, 8192).unwrap();
        let mut b = [0u8; 1];
        v.read_at(&mut b, 0).unwrap();
        assert_eq!(b[0], 1);
    }
}
