//! The raw file store: a disk image file (or block device) whose bytes are the disk.
//!
//! Reads are served from a shared read-only mapping of the file, registered with the NIC, so a
//! read reply's data goes from the page cache to the socket with no copy in user space. Writes
//! use `pwrite` (a full disk then fails the request with ENOSPC instead of killing the server
//! with SIGBUS, as a store into a mapping would), and the unified page cache keeps the mapping
//! coherent with them.
//!
//! An image whose format was probed as raw (no `--format`) keeps probing as raw: a guest
//! could otherwise write a qcow2 header into its first sector and be served a disk of its
//! making after a restart, or a vmdk one and stop the export from being served at all (and
//! qemu, which follows backing files, would open a host file of the guest's choosing). As
//! qemu's raw driver does for probed images, a write, zeroing or trim that would leave the
//! first [`HEAD`] bytes probing as another format (any qemu probes, by qemu's rules: see
//! [`probe`]) fails with EPERM.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapOptions};
use parking_lot::Mutex;

use super::probe::{self, HEAD, Probed};
use super::{Extent, ReadFrom, Store};

/// A raw image file: reads served from its mapping, writes with `pwrite`.
pub struct FileStore {
    path: PathBuf,
    file: File,
    size: u64,
    read_only: bool,
    map: Option<Mmap>,
    /// A read fault on a hole of this file allocates a page (tmpfs and memfd do; `pread`
    /// reads the hole as zeroes without).
    holes_fault_in: bool,
    /// A regular file (not a block device): another process may truncate it.
    regular: bool,
    /// Set for an image probed as raw: held while a change to its first [`HEAD`] bytes is
    /// checked and made, so that two changes that each leave them raw cannot together make
    /// a header (another connection's write landing between one's check and its write).
    probed_raw: Option<Mutex<()>>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.path)
            .field("size", &self.size)
            .finish()
    }
}

impl FileStore {
    /// Serves `file`, opened at `path` (a regular file or a block device), as raw. `probed`:
    /// raw was the probe's verdict, not the user's choice, so the first [`HEAD`] bytes must
    /// keep probing as raw.
    pub fn open(path: &Path, file: File, read_only: bool, probed: bool) -> io::Result<FileStore> {
        let meta = file.metadata()?;
        let size = if meta.file_type().is_file() {
            meta.len()
        } else {
            // A block device: its size is where seeking to the end lands.
            use std::io::Seek;
            (&file).seek(io::SeekFrom::End(0))?
        };
        let mut store = Self::from_file(path, file, size, read_only)?;
        if probed && !read_only {
            store.probed_raw = Some(Mutex::new(()));
        }
        Ok(store)
    }

    /// Creates a sparse image of `size` bytes, or opens the existing one if it has that size.
    /// A new file is created with O_EXCL, which never follows a symlink.
    pub fn create(path: &Path, size: u64) -> io::Result<FileStore> {
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
        {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                OpenOptions::new().read(true).write(true).open(path)?
            }
            r => r?,
        };
        let len = file.metadata()?.len();
        if len != size {
            if len != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("exists with {len} bytes, not the {size} asked for"),
                ));
            }
            file.set_len(size)?;
        }
        Self::from_file(path, file, size, false)
    }

    /// A sparse image of `size` bytes in anonymous memory (a memfd): no path anyone else can
    /// reach or plant a symlink at, gone when the server exits. `name` shows in
    /// /proc/PID/fd and is the image's path in logs.
    pub fn anonymous(name: &str, size: u64) -> io::Result<FileStore> {
        let cname = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in memfd name"))?;
        // SAFETY: cname is a valid C string; the returned descriptor is owned by the File.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(size)?;
        Self::from_file(Path::new(&format!("memfd:{name}")), file, size, false)
    }

    fn from_file(path: &Path, file: File, size: u64, read_only: bool) -> io::Result<FileStore> {
        let map = if size == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only; the file is only ever resized by us (never),
            // and concurrent pwrite/punch-hole through the page cache are coherent with it.
            Some(unsafe { MmapOptions::new().len(size as usize).map(&file)? })
        };
        let holes_fault_in = map.is_some() && on_shmem(&file);
        let regular = file.metadata()?.file_type().is_file();
        Ok(FileStore {
            path: path.to_owned(),
            file,
            size,
            read_only,
            holes_fault_in,
            regular,
            map,
            probed_raw: None,
        })
    }

    /// The image file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The image's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
    /// Opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The whole image, mapped read-only (None for an empty image).
    pub fn mapping(&self) -> Option<(*const u8, usize)> {
        self.map.as_ref().map(|m| (m.as_ptr(), m.len()))
    }

    /// Whether `[offset, offset + len)` holds a page that a read through the mapping would
    /// have to allocate (a hole of a file on tmpfs or a memfd): such a read takes memory, and
    /// on a full tmpfs it fails the reply's send and with it the connection. READ copies such
    /// ranges with `pread`, which reads holes as zeroes, instead. `mincore` tells which pages
    /// are in the page cache; it costs one call per 2 MiB, on tmpfs images only (`lseek`'s
    /// SEEK_HOLE would walk the whole file past a range without holes).
    pub fn mapping_would_fill_holes(&self, offset: u64, len: u64) -> bool {
        let (true, Some(map)) = (self.holes_fault_in, &self.map) else {
            return false;
        };
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let end = offset
            .saturating_add(len)
            .min(self.size)
            .next_multiple_of(page);
        let mut at = offset - offset % page;
        let mut resident = [0u8; 512];
        while at < end {
            let chunk = (end - at).min(resident.len() as u64 * page);
            // SAFETY: [at, at + chunk) lies inside the mapping (the image's size rounded up
            // to a page, which the mapping covers), and `resident` has a byte per page.
            let r = unsafe {
                libc::mincore(
                    map.as_ptr().add(at as usize) as *mut libc::c_void,
                    chunk as usize,
                    resident.as_mut_ptr(),
                )
            };
            let pages = chunk.div_ceil(page) as usize;
            // An error leaves the read to the mapping, as before.
            if r == 0 && resident[..pages].iter().any(|&b| b & 1 == 0) {
                return true;
            }
            at += chunk;
        }
        false
    }

    /// Whether the file still holds `end` bytes. Another process may truncate an image
    /// under the server; reading the mapping past the new end would fail the send (the
    /// kernel's copy faults) and with it the connection, so READ checks first and answers
    /// EIO, as qemu-nbd does. Block devices cannot shrink under an open descriptor.
    pub fn still_holds(&self, end: u64) -> io::Result<bool> {
        Ok(!self.regular || self.file.metadata()?.len() >= end)
    }

    /// Where READ takes `[offset, offset + len)` from: the mapping, unless the file is
    /// shorter now ([`Self::still_holds`], EIO) or the range holds a hole that a read through
    /// the mapping would fill ([`Self::mapping_would_fill_holes`], then `pread`). On tmpfs
    /// the second look answers both, one system call per READ instead of two: a truncated
    /// file's pages past its new end leave the page cache at once, so they show as holes,
    /// and `pread` then reads short, which READ answers with EIO.
    pub fn read_from(&self, offset: u64, len: u64) -> io::Result<ReadFrom> {
        if self.holes_fault_in {
            return Ok(match self.mapping_would_fill_holes(offset, len) {
                true => ReadFrom::Reads,
                false => ReadFrom::Mapping,
            });
        }
        Ok(ReadFrom::unless_shorter(
            self.still_holds(offset.saturating_add(len))?,
        ))
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Whether writes below this offset must come through [`FileStore::write_at`] (where they
    /// are checked) rather than be placed in the file by the NIC: [`HEAD`] for an image
    /// probed as raw, else 0.
    pub fn checked_below(&self) -> u64 {
        if self.probed_raw.is_some() { HEAD } else { 0 }
    }

    /// For an image probed as raw: runs `change` (which puts `new` at `offset`, or zeroes
    /// there with `new` None) if it leaves the first [`HEAD`] bytes probing as raw, else
    /// fails with EPERM. Changes past the head run as they are.
    fn guard_head<T>(
        &self,
        offset: u64,
        len: u64,
        new: Option<&[u8]>,
        change: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let Some(lock) = &self.probed_raw else {
            return change();
        };
        let head_len = HEAD.min(self.size);
        if offset >= head_len || len == 0 {
            return change();
        }
        let _held = lock.lock();
        let mut head = vec![0u8; head_len as usize];
        self.file.read_exact_at(&mut head, 0)?;
        let end = offset.saturating_add(len).min(head_len) as usize;
        let at = &mut head[offset as usize..end];
        match new {
            Some(data) => at.copy_from_slice(&data[..at.len()]),
            None => at.fill(0),
        }
        match probe::probe(&head, None) {
            Probed::Raw => change(),
            Probed::Qcow2 | Probed::Other(_) => {
                tracing::debug!(
                    image = %self.path.display(),
                    offset,
                    len,
                    "refused a write that would give a probed raw image another format's header"
                );
                Err(io::Error::from_raw_os_error(libc::EPERM))
            }
        }
    }

    /// Writes `data` at `offset`; with `fua`, durable on return.
    pub fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.guard_head(offset, data.len() as u64, Some(data), || {
            self.file.write_all_at(data, offset)
        })?;
        if fua {
            self.flush_range(offset, data.len() as u64)?;
        }
        Ok(())
    }

    /// Makes all completed writes durable.
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Makes the writes to a range durable (FUA). Falls back to a whole-file sync, which is
    /// what keeps metadata (allocation of a sparse range) durable too.
    fn flush_range(&self, _offset: u64, _len: u64) -> io::Result<()> {
        self.file.sync_data()
    }

    /// TRIM: punches a hole (the range then reads as zeroes).
    pub fn punch_hole(&self, offset: u64, len: u64) -> io::Result<()> {
        // Zeroes can finish a magic too ("QED\0" from "QEDx").
        self.guard_head(offset, len, None, || {
            self.fallocate(
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            )
        })
    }

    /// WRITE_ZEROES: the range reads as zeroes afterwards and stays allocated. Returns false if
    /// the file system cannot do it without writing (the caller decides whether that is
    /// allowed: FAST_ZERO says it is not).
    pub fn zero_range(&self, offset: u64, len: u64, may_write: bool) -> io::Result<bool> {
        self.guard_head(offset, len, None, || self.zero_raw(offset, len, may_write))
    }

    fn zero_raw(&self, offset: u64, len: u64, may_write: bool) -> io::Result<bool> {
        match self.fallocate(
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                if !may_write {
                    return Ok(false);
                }
                let zeroes = vec![0u8; 1 << 20];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(zeroes.len() as u64) as usize;
                    self.file.write_all_at(&zeroes[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(true)
            }
            Err(e) => Err(e),
        }
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain system call on an owned descriptor.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// CACHE: asks the kernel to read the range ahead.
    pub fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain system call on an owned descriptor.
        let r = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(r))
        }
    }

    /// Data and holes from `offset` for up to `len` bytes, from SEEK_DATA / SEEK_HOLE.
    pub fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size);
        let fd = self.file.as_raw_fd();
        let seek = |pos: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
            // SAFETY: plain system call on an owned descriptor.
            let r = unsafe { libc::lseek(fd, pos as libc::off_t, whence) };
            if r >= 0 {
                return Ok(Some(r as u64));
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                Ok(None)
            } else {
                Err(e)
            }
        };
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let data = match seek(pos, libc::SEEK_DATA) {
                Ok(d) => d.unwrap_or(end).min(end),
                // No SEEK_DATA (a block device, an old file system): all data.
                Err(_) => pos,
            };
            if data > pos {
                out.push(Extent {
                    len: data - pos,
                    hole: true,
                });
                pos = data;
                continue;
            }
            let hole = seek(pos, libc::SEEK_HOLE)
                .ok()
                .flatten()
                .unwrap_or(end)
                .min(end);
            let hole = if hole <= pos { end } else { hole };
            out.push(Extent {
                len: hole - pos,
                hole: false,
            });
            pos = hole;
        }
        Ok(out)
    }
}

impl Store for FileStore {
    fn location(&self) -> String {
        self.path.display().to_string()
    }
    fn kind(&self) -> &'static str {
        "raw"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn mapping(&self) -> Option<(*const u8, usize)> {
        FileStore::mapping(self)
    }
    fn still_holds(&self, end: u64) -> io::Result<bool> {
        FileStore::still_holds(self, end)
    }
    fn read_from(&self, offset: u64, len: u64) -> io::Result<ReadFrom> {
        FileStore::read_from(self, offset, len)
    }

    fn placement_file(&self) -> Option<File> {
        if self.read_only {
            return None;
        }
        self.file.try_clone().ok()
    }
    fn placement_from(&self) -> u64 {
        self.checked_below()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileStore::read_at(self, buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        FileStore::write_at(self, data, offset, fua)
    }
    fn flush(&self) -> io::Result<()> {
        FileStore::flush(self)
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.punch_hole(offset, len)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_write: bool,
        may_unmap: bool,
    ) -> io::Result<bool> {
        if may_unmap {
            // A hole reads as zeroes and costs no room (on tmpfs, where ZERO_RANGE is not
            // supported, writing the zeroes would fill memory); qemu-nbd punches too.
            match self.punch_hole(offset, len) {
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
                r => return r.map(|()| true),
            }
        }
        self.zero_range(offset, len, may_write)
    }
    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        FileStore::prefetch(self, offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        FileStore::extents(self, offset, len)
    }
}

/// Whether `file` lives in shared memory (tmpfs, or a memfd, whose file system reports the
/// same magic).
fn on_shmem(file: &File) -> bool {
    // SAFETY: a zeroed statfs is a valid out-parameter for fstatfs on an owned descriptor.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid statfs to fill; the descriptor is the file's, open.
    let ok = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0;
    ok && st.f_type == libc::TMPFS_MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shared_memory_images_send_holes_by_copy() {
        // A memfd is tmpfs: a read fault on its holes would allocate pages.
        let img = FileStore::anonymous("holes", 1 << 20).unwrap();
        img.write_at(&[7; 4096], 64 << 10, false).unwrap();
        assert!(!img.mapping_would_fill_holes(64 << 10, 4096), "all data");
        assert!(img.mapping_would_fill_holes(0, 4096), "all hole");
        assert!(
            img.mapping_would_fill_holes(60 << 10, 8192),
            "hole, then data"
        );
        assert!(
            img.mapping_would_fill_holes(64 << 10, 8192),
            "data, then hole"
        );
        // On a disk file system a hole read through the mapping takes only page cache.
        let dir = tempfile::tempdir().unwrap();
        let img = FileStore::create(&dir.path().join("disk.img"), 1 << 20).unwrap();
        if !on_shmem(&img.file) {
            assert!(!img.mapping_would_fill_holes(0, 4096));
        }
    }

    #[test]
    fn a_read_takes_the_mapping_only_where_the_file_still_holds_it() {
        // tmpfs (a memfd): one look at the page cache answers for holes and truncation.
        let img = FileStore::anonymous("truncated", 1 << 20).unwrap();
        img.write_at(&[7; 8192], 64 << 10, false).unwrap();
        assert_eq!(img.read_from(64 << 10, 8192).unwrap(), ReadFrom::Mapping);
        assert_eq!(img.read_from(0, 4096).unwrap(), ReadFrom::Reads, "a hole");
        // Another holder of the file cuts it short: its pages past the new end are gone,
        // so the read goes through pread, which reads short (EIO for the client).
        img.file.set_len(68 << 10).unwrap();
        assert_eq!(img.read_from(64 << 10, 4096).unwrap(), ReadFrom::Mapping);
        assert_eq!(img.read_from(64 << 10, 8192).unwrap(), ReadFrom::Reads);
        let mut buf = [0u8; 8192];
        assert!(
            img.read_at(&mut buf, 64 << 10).is_err(),
            "pread reads short"
        );
        // A disk file system: the file's length says.
        let dir = tempfile::tempdir().unwrap();
        let img = FileStore::create(&dir.path().join("disk.img"), 1 << 20).unwrap();
        if !on_shmem(&img.file) {
            assert_eq!(img.read_from(0, 4096).unwrap(), ReadFrom::Mapping);
            img.file.set_len(512 << 10).unwrap();
            assert_eq!(img.read_from(0, 4096).unwrap(), ReadFrom::Mapping);
            assert_eq!(img.read_from(508 << 10, 8192).unwrap(), ReadFrom::Gone);
        }
    }

    #[test]
    fn sparse_image_extents_follow_writes_trims_and_zeroes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let img = FileStore::create(&path, 16 << 20).unwrap();
        assert_eq!(
            img.extents(0, 16 << 20).unwrap(),
            vec![Extent {
                len: 16 << 20,
                hole: true
            }]
        );
        img.write_at(&vec![1u8; 1 << 20], 4 << 20, false).unwrap();
        let ext = img.extents(0, 16 << 20).unwrap();
        assert!(
            ext.contains(&Extent {
                len: 1 << 20,
                hole: false
            }),
            "{ext:?}"
        );
        let mut buf = vec![0u8; 1 << 20];
        img.read_at(&mut buf, 4 << 20).unwrap();
        assert!(buf.iter().all(|&b| b == 1));
        // The read-only mapping sees the write.
        let (ptr, len) = img.mapping().unwrap();
        assert_eq!(len, 16 << 20);
        // SAFETY: the mapping is `len` (16 MiB) bytes long and lives as long as `img`.
        assert_eq!(unsafe { *ptr.add(4 << 20) }, 1);

        img.punch_hole(4 << 20, 1 << 20).unwrap();
        assert_eq!(
            img.extents(0, 16 << 20).unwrap(),
            vec![Extent {
                len: 16 << 20,
                hole: true
            }]
        );
        img.read_at(&mut buf, 4 << 20).unwrap();
        assert!(buf.iter().all(|&b| b == 0));

        assert!(img.zero_range(8 << 20, 1 << 20, true).unwrap());
        img.read_at(&mut buf, 8 << 20).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        img.flush().unwrap();
        assert_eq!(
            img.extents(0, 16 << 20)
                .unwrap()
                .iter()
                .map(|e| e.len)
                .sum::<u64>(),
            16 << 20
        );
    }

    #[test]
    fn a_probed_raw_image_keeps_probing_raw() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        let open = |probed| {
            let file = OpenOptions::new().read(true).write(true).open(&path);
            FileStore::open(&path, file.unwrap(), false, probed).unwrap()
        };
        let img = open(true);
        assert_eq!(img.checked_below(), HEAD);
        let eperm = |e: io::Error| e.raw_os_error() == Some(libc::EPERM);
        assert!(eperm(
            img.write_at(b"QFI\xfb\0\0\0\x03", 0, false).unwrap_err()
        ));
        assert!(eperm(
            img.write_at(&[0x7f, 0x10, 0xda, 0xbe], 64, false)
                .unwrap_err()
        ));
        // A vmdk text descriptor after comment lines (issue 34, D2).
        let descriptor = b"# a guest's\nversion=1\nRW 8 FLAT \"/etc/hostname\" 0\n";
        assert!(eperm(img.write_at(descriptor, 0, false).unwrap_err()));
        img.write_at(b"QFI\xfb", 0, false).unwrap(); // version 0: raw to qemu too
        img.write_at(b"\0\0\0\0", 0, false).unwrap();
        // Pieces that each leave it raw, until the last.
        img.write_at(b"QE", 0, false).unwrap();
        img.write_at(b"Dx", 2, false).unwrap();
        assert!(eperm(img.zero_range(3, 1, true).unwrap_err()));
        assert!(eperm(img.punch_hole(3, 1).unwrap_err()));
        img.write_at(b"KDMV", 4, false).unwrap(); // not where vmdk's magic is
        img.write_at(&[7; 4096], HEAD, false).unwrap(); // past the head: unchecked
        let mut head = [0u8; 8];
        img.read_at(&mut head, 0).unwrap();
        assert_eq!(&head, b"QEDxKDMV");
        assert!(
            img.zero_range(0, 4096, true).unwrap(),
            "zeroing it all is raw"
        );
        // Chosen as raw: the guest's bytes are the disk, whatever they say.
        let img = open(false);
        assert_eq!(img.checked_below(), 0);
        img.write_at(b"QFI\xfb\0\0\0\x03", 0, false).unwrap();
    }

    #[test]
    fn create_refuses_an_existing_file_of_another_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        FileStore::create(&path, 1 << 20).unwrap();
        assert!(
            FileStore::create(&path, 1 << 20).is_ok(),
            "same size reopens"
        );
        let e = FileStore::create(&path, 2 << 20).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
    }
}
