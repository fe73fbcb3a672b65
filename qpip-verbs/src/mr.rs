//! Memory registration: regions the NIC may read and write, named by keys.
//!
//! A work request never carries a pointer the NIC trusts blindly: each scatter/gather
//! entry names a region by its `lkey`, and the backend checks the key, the bounds and the
//! access rights before it touches a byte ([`MemoryTable::resolve`]).

use std::any::Any;
use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::RwLock;

use crate::keymap::KeyMap;

/// What the NIC may do with a region's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// The NIC may write into the region (needed by receive WRs).
    pub local_write: bool,
}

impl Access {
    /// Read-only for the NIC: fit for send WRs only.
    pub const READ: Access = Access { local_write: false };
    /// Readable and writable by the NIC: fit for send and receive WRs.
    pub const READ_WRITE: Access = Access { local_write: true };
}

/// One scatter/gather entry: `len` bytes at virtual address `addr` inside the region `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address in the registered region.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's key.
    pub lkey: u32,
}

/// Why the NIC refused an SGE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtectionFault {
    /// No region has this key.
    #[error("no memory region has key {0:#x}")]
    UnknownKey(u32),
    /// The SGE reaches outside its region.
    #[error("{len} bytes at {addr:#x} fall outside region {lkey:#x}")]
    OutOfBounds {
        /// The region's key.
        lkey: u32,
        /// The SGE's address.
        addr: u64,
        /// Its length.
        len: u32,
    },
    /// The region with this key is not writable.
    #[error("region {0:#x} is not registered for NIC writes")]
    NotWritable(u32),
    /// This key names a file, not memory.
    #[error("region {0:#x} is a file: only a framer may place message bodies there")]
    NotMemory(u32),
}

/// Who keeps a region's memory alive.
enum Owner {
    /// A buffer the region allocated (from `Box::into_raw`); freed on drop.
    Owned,
    /// Memory owned by someone else; the keep-alive object (an mmap, say) is dropped last.
    Borrowed(#[allow(dead_code)] Option<Box<dyn Any + Send + Sync>>),
}

pub(crate) struct Region {
    lkey: u32,
    ptr: *mut u8,
    len: usize,
    access: Access,
    owner: Owner,
}

// SAFETY: the region is plain bytes; who may touch them when is the WR ownership contract
// (the NIC owns the memory of a posted WR until its completion), exactly as in verbs.
unsafe impl Send for Region {}
// SAFETY: as for Send: shared access is governed by the same WR ownership contract.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        if let Owner::Owned = self.owner {
            // SAFETY: ptr/len came from Box::<[u8]>::into_raw in `register_owned`.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
        }
    }
}

/// A registered memory region. Cloning shares the registration; it is removed from the NIC's
/// table when the last handle is dropped, and the memory lives on while in-flight WRs use it.
#[derive(Clone)]
pub struct MemoryRegion {
    region: Arc<Region>,
    _registration: Arc<Registration>,
}

struct Registration {
    lkey: u32,
    table: Arc<MemoryTable>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.keys.write().remove(&self.lkey);
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("lkey", &self.lkey())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl MemoryRegion {
    /// The key WRs use to name this region.
    pub fn lkey(&self) -> u32 {
        self.region.lkey
    }
    /// The region's first virtual address.
    pub fn addr(&self) -> u64 {
        self.region.ptr as u64
    }
    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.region.len
    }
    /// The region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    /// What the NIC may do with it.
    pub fn access(&self) -> Access {
        self.region.access
    }
    /// An SGE covering `len` bytes from `offset`. Bounds are checked by the NIC, not here, so
    /// a wrong SGE shows up as a protection-error completion.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr().wrapping_add(offset as u64),
            len: u32::try_from(len).unwrap_or(u32::MAX),
            lkey: self.lkey(),
        }
    }
    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.ptr
    }

    /// The region's bytes.
    ///
    /// # Safety
    /// No WR naming these bytes may be outstanding for writing by the NIC (a posted receive),
    /// and no `&mut` view may exist at the same time.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the region's `len` bytes from `ptr` stay mapped while it lives; the caller
        // guarantees nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.region.ptr, self.region.len) }
    }

    /// The region's bytes, writable.
    ///
    /// # Safety
    /// No WR naming these bytes may be outstanding, and no other view may exist meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the caller guarantees this is the only view.
        unsafe { std::slice::from_raw_parts_mut(self.region.ptr, self.region.len) }
    }

    /// Copies `src` into the region at `offset`. The caller must not do this while a posted WR
    /// covers those bytes (the NIC owns them until the WR completes).
    ///
    /// # Panics
    /// If the range is outside the region (a programming error on the host side).
    pub fn write_at(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|end| end <= self.len()),
            "write_at out of bounds"
        );
        // SAFETY: bounds checked above; raw copy creates no long-lived reference.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.region.ptr.add(offset), src.len())
        }
    }

    /// Copies bytes of the region from `offset` into `dst` (same rule as [`Self::write_at`]).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|end| end <= self.len()),
            "read_at out of bounds"
        );
        // SAFETY: bounds checked above.
        unsafe {
            std::ptr::copy_nonoverlapping(self.region.ptr.add(offset), dst.as_mut_ptr(), dst.len())
        }
    }
}

/// A resolved, checked piece of registered memory, kept alive while the NIC uses it.
#[derive(Clone)]
pub struct Segment {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

impl Segment {
    /// Bytes in the segment.
    pub fn len(&self) -> usize {
        self.len
    }
    /// The segment has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes, for sending.
    ///
    /// # Safety
    /// Backend use only, while the WR that named the segment is owned by the NIC.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the segment lies inside its region (checked when it was resolved), which it
        // keeps alive; the caller owns the WR's memory for now.
        unsafe { std::slice::from_raw_parts(self.region.ptr.add(self.offset), self.len) }
    }
    /// The bytes, for receiving into (the region was checked writable when resolved).
    ///
    /// # Safety
    /// Backend use only, while the WR that named the segment is owned by the NIC.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as in `bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.region.ptr.add(self.offset), self.len) }
    }
}

/// A file registered with the NIC (a disk image, say): a framer may name a range of it as
/// the place for a message body ([`crate::Frame::MessageAt`]), and the NIC then writes the
/// body into the file at that offset itself, the way a storage-offload NIC places a write's
/// payload on the disk. The SGE's `addr` is the file offset. Send and receive WRs cannot name
/// it: it is not memory.
#[derive(Clone)]
pub struct FileRegion {
    region: Arc<FileSpace>,
    _registration: Arc<Registration>,
}

pub(crate) struct FileSpace {
    file: Arc<File>,
    len: u64,
    access: Access,
}

impl std::fmt::Debug for FileRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileRegion")
            .field("lkey", &self.lkey())
            .field("len", &self.len())
            .finish()
    }
}

impl FileRegion {
    /// The file's key, for SGEs.
    pub fn lkey(&self) -> u32 {
        self._registration.lkey
    }
    /// Bytes of the file the NIC may write (from offset 0).
    pub fn len(&self) -> u64 {
        self.region.len
    }
    /// The registered range is empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
    /// An SGE for `len` bytes at file offset `offset` (checked by the NIC, not here).
    pub fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: offset,
            len,
            lkey: self.lkey(),
        }
    }
}

/// A checked range of a registered file, kept open while the NIC writes it.
#[derive(Clone)]
pub struct FileSpan {
    space: Arc<FileSpace>,
    offset: u64,
    len: usize,
}

impl FileSpan {
    /// The file.
    pub fn file(&self) -> &File {
        &self.space.file
    }
    /// The file offset of the span's first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Bytes in the span.
    pub fn len(&self) -> usize {
        self.len
    }
    /// The span has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a framer's [`crate::Frame::MessageAt`] puts a body: memory, or a registered file.
#[derive(Clone)]
pub enum Placement {
    /// Registered memory.
    Memory(Segment),
    /// A range of a registered file.
    File(FileSpan),
}

impl Placement {
    /// Bytes of the body.
    pub fn len(&self) -> usize {
        match self {
            Placement::Memory(s) => s.len(),
            Placement::File(f) => f.len(),
        }
    }
    /// The body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What an lkey names.
enum Registered {
    Memory(Arc<Region>),
    File(Arc<FileSpace>),
}

/// The NIC's table of registered regions and files, keyed by lkey: one lock and one lookup
/// per SGE (every message resolves one on each side).
#[derive(Default)]
pub struct MemoryTable {
    keys: RwLock<KeyMap<u32, Registered>>,
    next_key: AtomicU32,
}

impl MemoryTable {
    /// An empty table.
    pub fn new() -> Arc<Self> {
        Arc::new(MemoryTable {
            keys: RwLock::default(),
            // Keys start away from zero so that a zeroed SGE never names a region.
            next_key: AtomicU32::new(0x100),
        })
    }

    /// Registers `len` zeroed bytes owned by the region.
    pub fn register_owned(self: &Arc<Self>, len: usize, access: Access) -> MemoryRegion {
        let buf = vec![0u8; len].into_boxed_slice();
        let ptr = Box::into_raw(buf) as *mut u8;
        self.insert(ptr, len, access, Owner::Owned)
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid for reads (and writes, with `local_write`) until the last
    /// clone of the returned region and every WR naming it are gone; `keep_alive` is dropped
    /// only then, so it may own the memory (an mmap, say).
    pub(crate) unsafe fn register_borrowed(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
        access: Access,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> MemoryRegion {
        self.insert(ptr, len, access, Owner::Borrowed(keep_alive))
    }

    fn insert(
        self: &Arc<Self>,
        ptr: *mut u8,
        len: usize,
        access: Access,
        owner: Owner,
    ) -> MemoryRegion {
        let lkey = self.next_key.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(Region {
            lkey,
            ptr,
            len,
            access,
            owner,
        });
        self.keys
            .write()
            .insert(lkey, Registered::Memory(region.clone()));
        MemoryRegion {
            region,
            _registration: Arc::new(Registration {
                lkey,
                table: self.clone(),
            }),
        }
    }

    /// Registers the first `len` bytes of `file` as a place framers may name for message
    /// bodies; with `Access::READ` the NIC refuses to write there, as for memory.
    pub fn register_file(
        self: &Arc<Self>,
        file: Arc<File>,
        len: u64,
        access: Access,
    ) -> FileRegion {
        let lkey = self.next_key.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(FileSpace { file, len, access });
        self.keys
            .write()
            .insert(lkey, Registered::File(region.clone()));
        FileRegion {
            region,
            _registration: Arc::new(Registration {
                lkey,
                table: self.clone(),
            }),
        }
    }

    /// Checks where a framer wants a body placed: memory as for a receive WR's SGE, or a
    /// writable registered file, inside its registered length.
    pub fn resolve_placement(&self, sge: &Sge) -> Result<Placement, ProtectionFault> {
        let space = match self.keys.read().get(&sge.lkey) {
            Some(Registered::File(space)) => space.clone(),
            Some(Registered::Memory(region)) => {
                return check_memory(region.clone(), sge, true).map(Placement::Memory);
            }
            None => return Err(ProtectionFault::UnknownKey(sge.lkey)),
        };
        if !space.access.local_write {
            return Err(ProtectionFault::NotWritable(sge.lkey));
        }
        let end = sge.addr.checked_add(u64::from(sge.len));
        if end.is_none_or(|end| end > space.len) {
            return Err(ProtectionFault::OutOfBounds {
                lkey: sge.lkey,
                addr: sge.addr,
                len: sge.len,
            });
        }
        Ok(Placement::File(FileSpan {
            space,
            offset: sge.addr,
            len: sge.len as usize,
        }))
    }

    /// Checks an SGE against the table: known key, inside the region, writable if `write`.
    pub fn resolve(&self, sge: &Sge, write: bool) -> Result<Segment, ProtectionFault> {
        let region = match self.keys.read().get(&sge.lkey) {
            Some(Registered::Memory(region)) => region.clone(),
            Some(Registered::File(_)) => return Err(ProtectionFault::NotMemory(sge.lkey)),
            None => return Err(ProtectionFault::UnknownKey(sge.lkey)),
        };
        check_memory(region, sge, write)
    }
}

/// An SGE inside `region` (and writable there, if `write`), as a segment.
fn check_memory(region: Arc<Region>, sge: &Sge, write: bool) -> Result<Segment, ProtectionFault> {
    let start = region.ptr as u64;
    let out = ProtectionFault::OutOfBounds {
        lkey: sge.lkey,
        addr: sge.addr,
        len: sge.len,
    };
    let offset = sge.addr.checked_sub(start).ok_or(out)?;
    let end = offset.checked_add(u64::from(sge.len)).ok_or(out)?;
    if end > region.len as u64 {
        return Err(out);
    }
    if write && !region.access.local_write {
        return Err(ProtectionFault::NotWritable(sge.lkey));
    }
    Ok(Segment {
        region,
        offset: offset as usize,
        len: sge.len as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_checks_key_bounds_and_access() {
        let table = MemoryTable::new();
        let mr = table.register_owned(100, Access::READ);
        assert!(table.resolve(&mr.sge(0, 100), false).is_ok());
        assert!(table.resolve(&mr.sge(50, 50), false).is_ok());
        assert!(matches!(
            table.resolve(&mr.sge(50, 51), false),
            Err(ProtectionFault::OutOfBounds { .. })
        ));
        let before = Sge {
            addr: mr.addr() - 1,
            len: 1,
            lkey: mr.lkey(),
        };
        assert!(matches!(
            table.resolve(&before, false),
            Err(ProtectionFault::OutOfBounds { .. })
        ));
        assert!(matches!(
            table.resolve(&mr.sge(0, 1), true),
            Err(ProtectionFault::NotWritable(_))
        ));
        let bad = Sge {
            lkey: mr.lkey() + 1000,
            ..mr.sge(0, 1)
        };
        assert!(matches!(
            table.resolve(&bad, false),
            Err(ProtectionFault::UnknownKey(_))
        ));
    }

    #[test]
    fn dropping_the_last_handle_deregisters() {
        let table = MemoryTable::new();
        let mr = table.register_owned(8, Access::READ_WRITE);
        let sge = mr.sge(0, 8);
        let seg = table.resolve(&sge, true).unwrap();
        let clone = mr.clone();
        drop(mr);
        assert!(
            table.resolve(&sge, true).is_ok(),
            "a clone keeps the registration"
        );
        drop(clone);
        assert!(matches!(
            table.resolve(&sge, true),
            Err(ProtectionFault::UnknownKey(_))
        ));
        // The segment resolved earlier still keeps its memory alive.
        // SAFETY: no WR names the segment; the test is its only user.
        unsafe { seg.bytes_mut()[7] = 1 };
    }

    #[test]
    fn borrowed_memory_is_used_in_place() {
        let table = MemoryTable::new();
        let mut backing = vec![7u8; 16];
        // SAFETY: `backing` outlives the region (dropped before it is read below).
        let mr =
            unsafe { table.register_borrowed(backing.as_mut_ptr(), 16, Access::READ_WRITE, None) };
        let seg = table.resolve(&mr.sge(4, 4), true).unwrap();
        // SAFETY: no WR names the segment; the test is its only user.
        unsafe { seg.bytes_mut().copy_from_slice(&[1, 2, 3, 4]) };
        drop((seg, mr));
        assert_eq!(&backing[4..8], &[1, 2, 3, 4]);
    }
}
