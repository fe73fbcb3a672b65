//! The stores: what holds an export's disk, behind one trait ([`Store`]) that the connection
//! (`crate::conn`) reads, writes, flushes, trims and zeroes through, whatever holds the disk.
//!
//! - [`file`](mod@file): a raw file or block device, served zero-copy from its registered mapping (and
//!   a memfd for the demo image);
//! - [`qcow2`]: a qcow2 image file, served as its virtual disk through its cluster tables;
//! - `rbd` (feature `rbd`): an image in a Ceph cluster through librbd;
//! - [`open`]: the one place a store is chosen and opened: the `rbd:` scheme, the format
//!   probe, `--create`, and the image locks (with [`lock`] and [`probe`]); the files a qcow2
//!   image names (backing and data files) opened only where the user allowed ([`named`]);
//! - [`view`]: any store from an offset on, with TRIM ignored or zero WRITEs detected
//!   (qemu-nbd's `--offset`, `--discard`, `--detect-zeroes`);
//! - [`overlay`]: any store with its writes sent to a temporary overlay thrown away at exit
//!   (qemu-nbd's `--snapshot`).
//!
//! Adding a store (NFS, S3, ...) is a new file here implementing [`Store`] and one arm in
//! [`open::Opener::open`]; nothing outside `store/` names a store type.
//!
//! A store without a mapping has its reads placed in a registered buffer that the reply's
//! send WR then points at, so no store costs a user-space copy beyond the one into that
//! buffer (which for RBD is librbd's own landing of the data).
//!
//! The calls are blocking, but for reads and writes, a store that is asynchronous underneath
//! (librbd's aio) can start them and hand back a [`Pending`] operation instead
//! ([`Store::start_write`], [`Store::start_read`]) that wakes the connection when it is done:
//! a connection then keeps as many of its client's requests at the store as the client
//! sends, and answers each as it completes. Other connections go on meanwhile on their own
//! threads.

pub mod file;
pub mod lock;
pub mod named;
pub mod open;
pub mod overlay;
pub mod probe;
pub mod qcow2;
#[cfg(feature = "rbd")]
pub mod rbd;
pub mod view;

use std::fmt::Debug;
use std::io;
use std::path::PathBuf;
use std::task::Waker;
use std::time::Duration;

/// How to reach the Ceph cluster of `rbd:` stores, as qemu's rbd driver takes it (unused
/// without the `rbd` feature).
#[derive(Clone, Debug, Default)]
pub struct CephOptions {
    /// ceph.conf; None: librados' search ($CEPH_CONF, /etc/ceph/ceph.conf, ~/.ceph/config,
    /// ./ceph.conf).
    pub conf: Option<PathBuf>,
    /// The client id, without "client." (default "admin").
    pub id: Option<String>,
    /// A keyring file; None: the one ceph.conf names, or the default places.
    pub keyring: Option<PathBuf>,
    /// How long connecting, and then each operation, may take before it fails.
    pub timeout: Duration,
}

/// An `rbd:` image's LUKS encryption, loaded through librbd (`rbd_encryption_load`), as
/// `rbd encryption format` made it: the export is then the decrypted disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encryption {
    /// The LUKS version.
    pub format: EncryptionFormat,
    /// The file holding the passphrase: its bytes as they are (a trailing newline is part of
    /// it), as `rbd encryption format` and rbd-nbd read it.
    pub passphrase_file: PathBuf,
}

/// The LUKS version of an encrypted RBD image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncryptionFormat {
    /// LUKS version 1.
    Luks1,
    /// LUKS version 2.
    Luks2,
}

impl EncryptionFormat {
    /// The name on the command line (`luks1`, `luks2`).
    pub fn name(self) -> &'static str {
        match self {
            EncryptionFormat::Luks1 => "luks1",
            EncryptionFormat::Luks2 => "luks2",
        }
    }
}

/// Where READ takes a range from ([`Store::read_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFrom {
    /// The store's mapping ([`Store::mapping`]), where there is one; else its reads.
    Mapping,
    /// The store's own reads ([`Store::start_read`]): a read through the mapping would
    /// allocate memory for the range's holes (a file on tmpfs).
    Reads,
    /// Nowhere: the disk no longer holds the range (truncated by another process), EIO.
    Gone,
}

impl ReadFrom {
    /// The mapping while the disk still holds the range ([`Store::still_holds`]), else gone.
    pub(crate) fn unless_shorter(holds: bool) -> ReadFrom {
        match holds {
            true => ReadFrom::Mapping,
            false => ReadFrom::Gone,
        }
    }
}

/// One extent of a block-status answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Bytes in the extent.
    pub len: u64,
    /// A hole: reads as zeroes, no storage allocated.
    pub hole: bool,
}

/// One run of [`Store::allocation_depth`]: `len` bytes held at `depth` of the store's backing
/// chain, as qemu's `qemu:allocation-depth` context counts: 0 nowhere (they read as zeroes),
/// 1 the image itself, N its (N-1)th backing file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Depth {
    /// Bytes in the run.
    pub len: u64,
    /// The layer that holds them.
    pub depth: u32,
}

/// One run of [`Store::dirty_bitmap`]: `len` bytes that a dirty bitmap says were written
/// (dirty) or not since it was made, as qemu's `qemu:dirty-bitmap:NAME` context answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dirty {
    /// Bytes in the run.
    pub len: u64,
    /// Written since the bitmap was made (or last cleared).
    pub dirty: bool,
}

/// A read or write that [`Store::start_read`] or [`Store::start_write`] started;
/// dropping it waits for it.
pub trait Pending: Send {
    /// Whether the operation is done: [`Pending::wait`] would not block (for long). The
    /// waker given when it was started is woken when this turns true.
    fn is_done(&self) -> bool;
    /// Waits for the operation to complete; its result.
    fn wait(self: Box<Self>) -> io::Result<()>;
}

/// A disk behind an export.
pub trait Store: Send + Sync + Debug {
    /// Where the disk is, for logs and errors: a path, or `rbd:pool/image`.
    fn location(&self) -> String;
    /// The format or kind shown in the log ("raw", "qcow2", "rbd").
    fn kind(&self) -> &'static str;
    /// The disk's size in bytes.
    fn size(&self) -> u64;
    /// Writes are refused.
    fn read_only(&self) -> bool;

    /// The whole disk mapped read-only in our address space, when the store has such a
    /// mapping: read replies are then sent straight from it (registered once per export).
    fn mapping(&self) -> Option<(*const u8, usize)> {
        None
    }

    /// The file that holds the disk byte for byte (a raw image), writable: the NIC may then
    /// write WRITE payloads into it itself (the connection's write placement). None for stores
    /// that must see every write (qcow2, RBD) and for read-only ones.
    fn placement_file(&self) -> Option<std::fs::File> {
        None
    }

    /// The NIC places only writes from this offset on: a store that checks the writes below
    /// it (the first sector of a raw image whose format was probed) must see them in
    /// [`Store::write_at`].
    fn placement_from(&self) -> u64 {
        0
    }

    /// Where READ takes `[offset, offset + len)` from. By default the mapping (where there is
    /// one), unless the disk no longer holds the range ([`Store::still_holds`]).
    fn read_from(&self, offset: u64, len: u64) -> io::Result<ReadFrom> {
        Ok(ReadFrom::unless_shorter(
            self.still_holds(offset.saturating_add(len))?,
        ))
    }

    /// Whether the disk still holds `end` bytes (a file can be truncated under the server).
    fn still_holds(&self, _end: u64) -> io::Result<bool> {
        Ok(true)
    }

    /// Fills `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `data` at `offset`; with `fua`, durably before it returns.
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Starts writing the `len` bytes at `data` to `offset`, returning before the write is
    /// done where the store can run writes concurrently (RBD); `done` is woken when it is.
    /// None: the write is done already (the default, [`Store::write_at`]).
    ///
    /// # Safety
    /// The `len` bytes at `data` must stay valid and unchanged until the returned write has
    /// been waited for or dropped.
    unsafe fn start_write(
        &self,
        data: *const u8,
        len: usize,
        offset: u64,
        _done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        // SAFETY: the caller vouches for the bytes, and nothing outlives this call.
        let buf = unsafe { std::slice::from_raw_parts(data, len) };
        self.write_at(buf, offset, false).map(|()| None)
    }
    /// Starts reading `len` bytes from `offset` into the memory at `buf`, returning before
    /// the read is done where the store can run reads concurrently (RBD); `done` is woken
    /// when it is. None: the bytes are there already (the default, [`Store::read_at`]).
    ///
    /// # Safety
    /// The `len` bytes at `buf` must stay valid, and neither read nor written by anyone else,
    /// until the returned read has been waited for or dropped.
    unsafe fn start_read(
        &self,
        buf: *mut u8,
        len: usize,
        offset: u64,
        _done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        // SAFETY: the caller vouches for the bytes, and nothing outlives this call.
        let buf = unsafe { std::slice::from_raw_parts_mut(buf, len) };
        self.read_at(buf, offset).map(|()| None)
    }
    /// Makes all completed writes durable.
    fn flush(&self) -> io::Result<()>;
    /// TRIM: the range may be deallocated; it reads as zeroes afterwards.
    fn trim(&self, offset: u64, len: u64) -> io::Result<()>;
    /// WRITE_ZEROES: the range reads as zeroes afterwards. Returns false if that cannot be
    /// done without writing the zeroes and `may_write` is false (FAST_ZERO). `may_unmap`
    /// (no NO_HOLE) lets the store deallocate the range instead, as qemu's MAY_UNMAP does.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_write: bool,
        may_unmap: bool,
    ) -> io::Result<bool>;
    /// Whether [`Store::resize`] can change the disk's size: the export then offers NBD's
    /// (experimental) RESIZE extension. False unless a store says otherwise (RBD does).
    fn can_resize(&self) -> bool {
        false
    }
    /// NBD_CMD_RESIZE: makes the disk `size` bytes long (a shrink drops what lies past it).
    /// `alone`: the asking connection is the only one on the export; a store may refuse a
    /// shrink otherwise (EPERM, as the extension allows), and when it knows of other users
    /// of the disk outside this server.
    fn resize(&self, _size: u64, _alone: bool) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EINVAL))
    }
    /// CACHE: a hint to read the range ahead.
    fn prefetch(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Data and holes from `offset` for up to `len` bytes. A store that does not report
    /// allocation says it is all data, which is always a correct answer.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size());
        Ok(vec![Extent {
            len: end.saturating_sub(offset),
            hole: false,
        }])
    }
    /// Which layer of the backing chain holds the bytes from `offset`, for up to `len`
    /// bytes (qemu-nbd's `-A`). A store without a backing chain holds every byte itself,
    /// holes included, as qemu answers for a raw file: depth 1 throughout.
    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<Vec<Depth>> {
        let end = offset.saturating_add(len).min(self.size());
        Ok(vec![Depth {
            len: end.saturating_sub(offset),
            depth: 1,
        }])
    }
    /// Whether the store has the persistent dirty bitmap `name` and can serve it (qemu-nbd's
    /// `-B`): an error saying why not otherwise (ErrorKind::NotFound: no such bitmap;
    /// InvalidData: inconsistent, in use when the image was last closed). Only qcow2 images
    /// keep bitmaps.
    fn has_bitmap(&self, _name: &str) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "a {} image has no dirty bitmaps (only qcow2 images keep them)",
                self.kind()
            ),
        ))
    }
    /// The runs of dirty bitmap `name` (one [`Store::has_bitmap`] accepted) from `offset`
    /// for up to `len` bytes, at the bitmap's granularity, cut at both ends; possibly
    /// stopping short (the client asks again from where it ends).
    fn dirty_bitmap(&self, name: &str, _offset: u64, _len: u64) -> io::Result<Vec<Dirty>> {
        self.has_bitmap(name).map(|()| Vec::new())
    }
    /// The last call, at shutdown: makes all completed writes durable, with what the store
    /// keeps in memory (a qcow2 image's dirty bitmaps, stored and marked consistent). Writes
    /// after it fail.
    fn close(&self) -> io::Result<()> {
        self.flush()
    }
}
