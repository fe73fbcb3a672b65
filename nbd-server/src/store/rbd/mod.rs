//! Exports backed by a Ceph RBD image, through librbd's C API (Debian's librbd-dev, Ceph 16).
//!
//! Our own thin binding: the few functions used are declared by hand in `ffi`, and all of
//! this crate's unsafe code for Ceph is in this module. The safe types are [`Cluster`] (a
//! connected `rados_t`), [`RbdImage`] (an open image with its I/O context) and a private
//! completion that owns an `rbd_completion_t`. Every request is an `rbd_aio_*` call on a
//! completion; reads and writes return at once with a [`Pending`] whose completion callback
//! (on a librbd thread) wakes the connection, which then replies; the others are waited for.
//! librbd runs them on its own threads, so connections on other threads (and other exports)
//! go on meanwhile.
//!
//! Reads land where the caller says: the connection passes a buffer in registered memory, which the
//! reply's send WR then points at, so the data is copied by librbd from its messenger into
//! that buffer and by the NIC into the socket, never in between.
//!
//! Failures: librbd reports `-errno`. A cluster that goes away mid-run makes its requests fail
//! with ETIMEDOUT once `rados_osd_op_timeout` (our `--ceph-timeout`) passes, answered to the
//! client as EIO; other exports keep serving.
//!
//! The module's files: `ffi.rs` (the declarations), `cluster.rs` (the export's name and the
//! cluster handle), `aio.rs` (completions and the size watch), this file (the image as a
//! store). All of the crate's unsafe code for Ceph is in them.

use std::ffi::{CString, c_char, c_int, c_void};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Waker;

use super::{CephOptions, Encryption, EncryptionFormat, Extent, Pending, Store};

mod aio;
mod cluster;
#[allow(non_camel_case_types)]
mod ffi;

use aio::{Completion, InFlight, SizeWatch, on_update};
pub use cluster::{Cluster, RbdSpec};

/// `-errno` from librados/librbd as an io::Error.
fn errno(r: impl Into<i64>) -> io::Error {
    io::Error::from_raw_os_error((-r.into()) as i32)
}

fn check(r: c_int) -> io::Result<()> {
    if r < 0 { Err(errno(r)) } else { Ok(()) }
}

fn cstring(what: &str, s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NUL in the {what} {s:?}"),
        )
    })
}

/// An open RBD image: an export's store.
///
/// Its size follows the image's (see `SizeWatch`): new connections are told the size of
/// the moment, and requests past the current end are refused here (ENOSPC for writes, EINVAL
/// for reads), whatever size their connection was told.
pub struct RbdImage {
    spec: RbdSpec,
    image: ffi::rbd_image_t,
    ioctx: ffi::rados_ioctx_t,
    watch: Box<SizeWatch>,
    /// rbd_update_watch's handle, once registered.
    watch_handle: Option<u64>,
    read_only: bool,
    /// Served through librbd's LUKS layer (`--encryption-format`): not resized through NBD.
    encrypted: bool,
    /// Keeps the cluster connected while the image is open.
    _cluster: Arc<Cluster>,
}

// SAFETY: librbd's image handle may be used from several threads at once for I/O (its aio
// calls queue work under the image's own locks); it is closed only in Drop, with &mut self.
unsafe impl Send for RbdImage {}
// SAFETY: as above.
unsafe impl Sync for RbdImage {}

impl std::fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdImage")
            .field("spec", &self.spec)
            .field("size", &self.size())
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl RbdImage {
    /// Opens `spec` on `cluster`, or says in one line why it cannot. A snapshot is always
    /// served read-only. `exclusive` (for a writable image) takes its exclusive lock for as
    /// long as it is open (`RbdImage::lock_exclusive`). `encryption`: the image is LUKS
    /// encrypted, served decrypted (`RbdImage::load_encryption`).
    pub fn open(
        cluster: Arc<Cluster>,
        spec: &RbdSpec,
        read_only: bool,
        exclusive: bool,
        encryption: Option<&Encryption>,
    ) -> Result<RbdImage, String> {
        let read_only = read_only || spec.snapshot.is_some();
        let pool = cstring("pool", &spec.pool).map_err(|e| e.to_string())?;
        let name = cstring("image", &spec.image).map_err(|e| e.to_string())?;
        let snap = match &spec.snapshot {
            Some(s) => Some(cstring("snapshot", s).map_err(|e| e.to_string())?),
            None => None,
        };
        let who = format!("client.{}", cluster.id);
        let mut ioctx: ffi::rados_ioctx_t = std::ptr::null_mut();
        // SAFETY: the cluster is connected; ioctx is a valid out-pointer; pool outlives it.
        let r = unsafe { ffi::rados_ioctx_create(cluster.handle, pool.as_ptr(), &mut ioctx) };
        if r < 0 {
            return Err(match -r {
                libc::ENOENT => format!("Ceph pool {:?} does not exist", spec.pool),
                libc::EACCES | libc::EPERM => {
                    format!("{who} may not use Ceph pool {:?} ({})", spec.pool, errno(r))
                }
                _ => format!("opening Ceph pool {:?}: {}", spec.pool, errno(r)),
            });
        }
        let mut image: ffi::rbd_image_t = std::ptr::null_mut();
        let snap_ptr = snap.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        // SAFETY: ioctx is valid; image is a valid out-pointer; the strings outlive the call.
        let r = unsafe {
            if read_only {
                ffi::rbd_open_read_only(ioctx, name.as_ptr(), &mut image, snap_ptr)
            } else {
                ffi::rbd_open(ioctx, name.as_ptr(), &mut image, snap_ptr)
            }
        };
        if r < 0 {
            // SAFETY: the context was created above and nothing else uses it.
            unsafe { ffi::rados_ioctx_destroy(ioctx) };
            return Err(match (-r, &spec.snapshot) {
                (libc::ENOENT, Some(s)) => format!(
                    "RBD image {}/{} or its snapshot {s:?} does not exist",
                    spec.pool, spec.image
                ),
                (libc::ENOENT, None) => {
                    format!("RBD image {}/{} does not exist", spec.pool, spec.image)
                }
                (libc::EACCES | libc::EPERM, _) => format!(
                    "{who} may not open RBD image {}/{} ({}; its caps need 'profile rbd' on pool {})",
                    spec.pool,
                    spec.image,
                    errno(r),
                    spec.pool
                ),
                _ => format!("opening RBD image {spec}: {}", errno(r)),
            });
        }
        let mut img = RbdImage {
            spec: spec.clone(),
            image,
            ioctx,
            watch: Box::new(SizeWatch {
                image,
                size: AtomicU64::new(0),
                spec: spec.to_string(),
            }),
            watch_handle: None,
            read_only,
            encrypted: encryption.is_some(),
            _cluster: cluster,
        };
        if let Some(enc) = encryption {
            img.load_encryption(enc)?;
        }
        // SAFETY: all-zero is a valid rbd_image_info_t (integers and char arrays).
        let mut info: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        // SAFETY: the image is open; info is a valid struct of the size we pass.
        check(unsafe {
            ffi::rbd_stat(
                img.image,
                &mut info,
                std::mem::size_of::<ffi::rbd_image_info_t>(),
            )
        })
        .map_err(|e| format!("rbd_stat of {spec}: {e}"))?;
        img.watch.size.store(info.size, Ordering::SeqCst);
        let mut handle = 0u64;
        let arg = &*img.watch as *const SizeWatch as *mut c_void;
        // SAFETY: the image is open; the boxed SizeWatch stays where it is until Drop
        // unwatches.
        check(unsafe { ffi::rbd_update_watch(img.image, &mut handle, on_update, arg) })
            .map_err(|e| format!("watching RBD image {spec} for resizes: {e}"))?;
        img.watch_handle = Some(handle);
        // A resize between rbd_stat and the watch.
        // SAFETY: the watch is registered, on the open image.
        unsafe { on_update(arg) };
        if exclusive && !read_only {
            img.lock_exclusive()?;
        }
        Ok(img)
    }

    /// `--encryption-format`: loads the image's LUKS header with the passphrase in the file;
    /// from then on librbd encrypts what is written and decrypts what is read, and the
    /// image's size is that of the disk inside (without the header).
    fn load_encryption(&self, enc: &Encryption) -> Result<(), String> {
        let (pool, image) = (&self.spec.pool, &self.spec.image);
        let file = enc.passphrase_file.display();
        let passphrase = std::fs::read(&enc.passphrase_file)
            .map_err(|e| format!("reading the passphrase file {file}: {e}"))?;
        let mut opts = ffi::rbd_encryption_luks_format_options_t {
            alg: 0,
            passphrase: passphrase.as_ptr() as *const c_char,
            passphrase_size: passphrase.len(),
        };
        let format = match enc.format {
            EncryptionFormat::Luks1 => ffi::RBD_ENCRYPTION_FORMAT_LUKS1,
            EncryptionFormat::Luks2 => ffi::RBD_ENCRYPTION_FORMAT_LUKS2,
        };
        // SAFETY: the image is open; opts is the options struct of its size, pointing at
        // the passphrase, which outlives the call (librbd copies what it keeps).
        let r = unsafe {
            ffi::rbd_encryption_load(
                self.image,
                format,
                &mut opts as *mut _ as *mut c_void,
                std::mem::size_of::<ffi::rbd_encryption_luks_format_options_t>(),
            )
        };
        let name = enc.format.name();
        match -r {
            0 => {
                tracing::debug!("loaded the {name} encryption of {}", self.spec);
                Ok(())
            }
            libc::EPERM | libc::EACCES => Err(format!(
                "RBD image {pool}/{image}: the passphrase in {file} does not open its {name} encryption (a wrong passphrase; the file's bytes are used as they are, a trailing newline included)"
            )),
            libc::EINVAL => Err(format!(
                "RBD image {pool}/{image} is not encrypted as {name} (made by rbd encryption format {pool}/{image} {name}?): librbd: {}",
                errno(r)
            )),
            _ => Err(format!(
                "loading the {name} encryption of RBD image {pool}/{image}: {}",
                errno(r)
            )),
        }
    }

    /// `--exclusive`: takes the image's exclusive lock through librbd's managed lock
    /// (`rbd_lock_acquire`), which librbd then keeps until the image is closed instead of
    /// handing it to another client that asks for it; other clients' writes fail meanwhile.
    /// Refused, naming the holder, when another client holds it that way.
    ///
    /// Without `--exclusive` the image is opened as qemu and rbd-nbd open it by default:
    /// librbd's cooperative lock passes between writers as each one writes, so two servers
    /// can both write (and a guest file system on it would be corrupted).
    fn lock_exclusive(&self) -> Result<(), String> {
        let (pool, image) = (&self.spec.pool, &self.spec.image);
        let mut features = 0u64;
        // SAFETY: the image is open; features is a valid out-pointer.
        check(unsafe { ffi::rbd_get_features(self.image, &mut features) })
            .map_err(|e| format!("reading the features of RBD image {pool}/{image}: {e}"))?;
        if features & ffi::RBD_FEATURE_EXCLUSIVE_LOCK == 0 {
            return Err(format!(
                "--exclusive: RBD image {pool}/{image} has no exclusive-lock feature (rbd feature enable {pool}/{image} exclusive-lock)"
            ));
        }
        // SAFETY: the image is open.
        let r = unsafe { ffi::rbd_lock_acquire(self.image, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
        if r == 0 {
            tracing::debug!("took the exclusive lock of {}", self.spec);
            return Ok(());
        }
        let owners = self.lock_owners();
        Err(if owners.is_empty() {
            format!(
                "--exclusive: taking the exclusive lock of RBD image {pool}/{image}: {}",
                errno(r)
            )
        } else {
            format!(
                "RBD image {pool}/{image} is locked exclusively by {} (another server with --exclusive, rbd-nbd --exclusive, or rbd lock; librbd: {})",
                owners.join(", "),
                errno(r)
            )
        })
    }

    /// The clients that hold the image's exclusive lock: `client.N (ADDRESS)` where a
    /// watcher of the image has the owner's address, else the address librbd gives.
    fn lock_owners(&self) -> Vec<String> {
        let watchers = self.watchers();
        self.lock_owner_addrs()
            .into_iter()
            .map(|addr| match watchers.iter().find(|(a, _)| *a == addr) {
                Some((_, id)) => format!("client.{id} ({addr})"),
                None => addr,
            })
            .collect()
    }

    /// The image's watchers: (address, global client id).
    fn watchers(&self) -> Vec<(String, i64)> {
        // SAFETY: all-zero is a valid rbd_image_watcher_t (a null pointer and integers).
        let mut w: [ffi::rbd_image_watcher_t; 16] = unsafe { std::mem::zeroed() };
        let mut n = w.len();
        // SAFETY: the image is open; w has room for n watchers, whose addresses librbd
        // allocates and rbd_watchers_list_cleanup frees.
        if unsafe { ffi::rbd_watchers_list(self.image, w.as_mut_ptr(), &mut n) } < 0 {
            return Vec::new();
        }
        let n = n.min(w.len());
        let out = w[..n]
            .iter()
            .filter(|x| !x.addr.is_null())
            .map(|x| {
                // SAFETY: librbd set addr to a NUL-terminated string.
                let addr = unsafe { std::ffi::CStr::from_ptr(x.addr) };
                (addr.to_string_lossy().into_owned(), x.id)
            })
            .collect();
        // SAFETY: the n watchers librbd filled above, freed once.
        unsafe { ffi::rbd_watchers_list_cleanup(w.as_mut_ptr(), n) };
        out
    }

    /// The addresses of the clients that hold the image's exclusive lock, as librbd says.
    fn lock_owner_addrs(&self) -> Vec<String> {
        let mut owners: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
        let mut n = owners.len();
        let mut mode: c_int = 0;
        // SAFETY: the image is open; owners has room for n pointers, which librbd fills with
        // strings of its own that rbd_lock_get_owners_cleanup frees.
        let r =
            unsafe { ffi::rbd_lock_get_owners(self.image, &mut mode, owners.as_mut_ptr(), &mut n) };
        if r < 0 {
            return Vec::new();
        }
        let names = owners[..n.min(owners.len())]
            .iter()
            .filter(|p| !p.is_null())
            .map(|&p| {
                // SAFETY: librbd set these to NUL-terminated strings.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        // SAFETY: the n strings librbd allocated above, freed once.
        unsafe { ffi::rbd_lock_get_owners_cleanup(owners.as_mut_ptr(), n) };
        names
    }

    /// Submits one aio call with a fresh completion, then waits for it.
    fn aio(&self, submit: impl FnOnce(ffi::rbd_completion_t) -> c_int) -> io::Result<isize> {
        let mut c = Completion::new()?;
        c.submit(submit)?;
        c.wait()
    }

    /// Refuses a request that reaches past the image's current end (it may have shrunk since
    /// the connection was told its size): ENOSPC for a write, EINVAL for a read, as the NBD
    /// spec asks.
    fn within(&self, what: &str, offset: u64, len: u64, write: bool) -> io::Result<()> {
        let size = self.size();
        if offset.checked_add(len).is_some_and(|end| end <= size) {
            return Ok(());
        }
        tracing::debug!(
            "{what} at {offset} of {len} bytes on {}: past its end ({size} bytes; resized?)",
            self.spec
        );
        Err(errno(-(if write { libc::ENOSPC } else { libc::EINVAL })))
    }

    /// NBD_CMD_RESIZE: `rbd_resize` on the open image, as `rbd resize` does (a shrink drops
    /// the objects past the new end). A shrink is refused with EPERM while another
    /// connection of ours uses the export (`alone` false) or another client has the image
    /// open (a second watcher of its header: qemu, rbd-nbd, another server), as the
    /// extension allows: `rbd resize` itself wants `--allow-shrink`. A grow is never refused
    /// for that: it takes nothing from anyone.
    fn resize_image(&self, size: u64, alone: bool) -> io::Result<()> {
        let old = self.size();
        if size < old {
            let others = self.watchers().len().saturating_sub(1);
            if !alone || others > 0 {
                let why = format!(
                    "a shrink while {} uses the image",
                    if alone {
                        format!("{others} other client(s) of the cluster")
                    } else {
                        "another connection".to_owned()
                    }
                );
                tracing::warn!(
                    "{}: RESIZE from {old} to {size} bytes refused (EPERM): {why}",
                    self.spec
                );
                return Err(crate::error::Refusal::error(libc::EPERM, why));
            }
        }
        // SAFETY: the image is open; librbd waits for the requests in flight on it (the
        // connection has none: RESIZE waits for every request before it).
        let r = unsafe { ffi::rbd_resize(self.image, size) };
        if r < 0 {
            let e = errno(r);
            tracing::warn!("{}: resizing to {size} bytes: {e}", self.spec);
            return Err(e);
        }
        let mut now = size;
        // SAFETY: the image is open; now is a valid out-pointer.
        if unsafe { ffi::rbd_get_size(self.image, &mut now) } < 0 {
            now = size;
        }
        // The watch may have seen it already (librbd calls it back from within rbd_resize).
        self.watch.size.store(now, Ordering::SeqCst);
        tracing::info!(
            "{}: resized from {old} to {now} bytes by a client (NBD_CMD_RESIZE)",
            self.spec
        );
        Ok(())
    }

    fn log_failure<T>(&self, what: &str, r: io::Result<T>) -> io::Result<T> {
        if let Err(e) = &r {
            tracing::warn!("{what} on {}: {e}", self.spec);
        }
        r
    }
}

impl Drop for RbdImage {
    fn drop(&mut self) {
        if let Some(h) = self.watch_handle.take() {
            // SAFETY: registered in `open` on this image; librbd waits for a callback under
            // way before it returns, so the SizeWatch is no longer used after it.
            unsafe { ffi::rbd_update_unwatch(self.image, h) };
        }
        // SAFETY: the image and context were opened in `open` and no request is running
        // (they all borrow self and wait for their completion before returning).
        let r = unsafe { ffi::rbd_close(self.image) };
        // SAFETY: as above; the image made from the context is closed.
        unsafe { ffi::rados_ioctx_destroy(self.ioctx) };
        match r {
            0 => tracing::debug!("closed {}", self.spec),
            r => tracing::warn!("closing {}: {}", self.spec, errno(r)),
        }
    }
}

/// State for rbd_diff_iterate2's callback: the extents so far, from `pos`.
struct Diff {
    pos: u64,
    out: Vec<Extent>,
}

unsafe extern "C" fn diff_cb(off: u64, len: usize, exists: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: arg is the &mut Diff passed to rbd_diff_iterate2, which calls back on the
    // calling thread only while that call runs.
    let d = unsafe { &mut *(arg as *mut Diff) };
    if off > d.pos {
        d.out.push(Extent {
            len: off - d.pos,
            hole: true,
        });
    }
    d.out.push(Extent {
        len: len as u64,
        hole: exists == 0,
    });
    d.pos = off + len as u64;
    0
}

/// The most one block-status answer looks at: bounds the time rbd_diff_iterate2 takes on
/// an image without object-map (the client asks again for the rest).
const DIFF_MAX: u64 = 1 << 30;

impl Store for RbdImage {
    fn location(&self) -> String {
        self.spec.to_string()
    }
    fn kind(&self) -> &'static str {
        "rbd"
    }
    fn size(&self) -> u64 {
        self.watch.size.load(Ordering::SeqCst)
    }
    fn read_only(&self) -> bool {
        self.read_only
    }

    fn can_resize(&self) -> bool {
        !self.read_only && !self.encrypted
    }

    fn resize(&self, size: u64, alone: bool) -> io::Result<()> {
        if !self.can_resize() {
            return Err(errno(-libc::EPERM));
        }
        self.resize_image(size, alone)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.within("read", offset, buf.len() as u64, false)?;
        let (ptr, len) = (buf.as_mut_ptr() as *mut c_char, buf.len());
        // SAFETY: buf is exclusively borrowed until `aio` has waited for the completion, so
        // librbd writes into live memory that nothing else reads meanwhile.
        let r = self.aio(|c| unsafe { ffi::rbd_aio_read(self.image, offset, len, ptr, c) });
        let n = self.log_failure("read", r)? as usize;
        // librbd reads past the end of the image as nothing; the NBD layer never asks.
        buf[n.min(len)..].fill(0);
        Ok(())
    }

    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.within("write", offset, data.len() as u64, true)?;
        let (ptr, len) = (data.as_ptr() as *const c_char, data.len());
        // SAFETY: data is borrowed until the completion has been waited for.
        let r = self.aio(|c| unsafe { ffi::rbd_aio_write(self.image, offset, len, ptr, c) });
        self.log_failure("write", r)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    unsafe fn start_write(
        &self,
        data: *const u8,
        len: usize,
        offset: u64,
        done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        self.within("write", offset, len as u64, true)?;
        let mut completion = Completion::waking(done)?;
        // SAFETY: the caller keeps the bytes valid and unchanged until the returned write is
        // waited for or dropped, and dropping it waits for librbd to be done with them.
        completion.submit(|c| unsafe {
            ffi::rbd_aio_write(self.image, offset, len, data as *const c_char, c)
        })?;
        Ok(Some(Box::new(InFlight {
            completion,
            what: "write",
            len: None,
            spec: self.spec.to_string(),
        })))
    }

    unsafe fn start_read(
        &self,
        buf: *mut u8,
        len: usize,
        offset: u64,
        done: &Waker,
    ) -> io::Result<Option<Box<dyn Pending>>> {
        self.within("read", offset, len as u64, false)?;
        let mut completion = Completion::waking(done)?;
        // SAFETY: the caller keeps the bytes valid and to librbd alone until the returned
        // read is waited for or dropped, and dropping it waits for librbd to be done.
        completion.submit(|c| unsafe {
            ffi::rbd_aio_read(self.image, offset, len, buf as *mut c_char, c)
        })?;
        Ok(Some(Box::new(InFlight {
            completion,
            what: "read",
            len: Some(len),
            spec: self.spec.to_string(),
        })))
    }

    fn flush(&self) -> io::Result<()> {
        // SAFETY: the image is open; no buffer is involved.
        let r = self.aio(|c| unsafe { ffi::rbd_aio_flush(self.image, c) });
        self.log_failure("flush", r).map(drop)
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.within("discard", offset, len, true)?;
        // SAFETY: the image is open; no buffer is involved.
        let r = self.aio(|c| unsafe { ffi::rbd_aio_discard(self.image, offset, len, c) });
        self.log_failure("discard", r).map(drop)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        _may_write: bool,
        _may_unmap: bool,
    ) -> io::Result<bool> {
        // librbd zeroes by discarding whole objects and zeroing the edges, without writing
        // the zeroes: fast, so FAST_ZERO is honoured too.
        self.within("write zeroes", offset, len, true)?;
        let len = usize::try_from(len).map_err(|_| errno(-libc::EINVAL))?;
        // SAFETY: the image is open; no buffer is involved.
        let r =
            self.aio(|c| unsafe { ffi::rbd_aio_write_zeroes(self.image, offset, len, c, 0, 0) });
        self.log_failure("write zeroes", r).map(|_| true)
    }

    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let size = self.size();
        if offset >= size {
            // Shrunk under a connection told a larger size.
            return Err(errno(-libc::EINVAL));
        }
        let end = offset.saturating_add(len.min(DIFF_MAX)).min(size);
        let mut d = Diff {
            pos: offset,
            out: Vec::new(),
        };
        // SAFETY: the image is open; the callback gets &mut d, which lives across the call,
        // and is only called during it. NULL fromsnap: allocation since the image's creation,
        // its parent's included.
        check(unsafe {
            ffi::rbd_diff_iterate2(
                self.image,
                std::ptr::null(),
                offset,
                end - offset,
                1,
                0,
                diff_cb,
                &mut d as *mut Diff as *mut c_void,
            )
        })
        .inspect_err(|e| tracing::warn!("block status on {}: {e}", self.spec))?;
        if d.pos < end {
            d.out.push(Extent {
                len: end - d.pos,
                hole: true,
            });
        }
        Ok(d.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_like_qemus() {
        assert_eq!(
            RbdSpec::parse("rbd/disk").unwrap(),
            RbdSpec {
                pool: "rbd".into(),
                image: "disk".into(),
                snapshot: None
            }
        );
        let s = RbdSpec::parse("p/i@snap1").unwrap();
        assert_eq!(s.snapshot.as_deref(), Some("snap1"));
        assert_eq!(s.to_string(), "rbd:p/i@snap1");
        for bad in ["disk", "/disk", "p/", "p/i@", "p/ns/i", "p/i:conf=x"] {
            assert!(RbdSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
