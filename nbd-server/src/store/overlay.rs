//! Snapshot mode (qemu-nbd's `-s`/`--snapshot`): any store, opened read-only, with the
//! export's writes sent to a temporary overlay that is thrown away at exit, so the image never
//! changes. qemu-nbd makes a qcow2 overlay in $TMPDIR; this one works for every store alike.
//!
//! The overlay is an unnamed file in $TMPDIR (O_TMPFILE: nothing is left behind, even after
//! kill -9), sparse and the size of the disk, with a map in memory of what each cluster holds:
//! still the image's bytes, its own bytes in the overlay, or zeroes (WRITE_ZEROES, TRIM). A
//! partial write to a cluster the overlay does not hold copies the cluster up first.
//!
//! Several connections use the store at once. A cluster's state changes only under its
//! stripe lock, and only after its bytes are in the overlay file, so a copy-up never
//! overwrites a write to the same cluster from another connection: a write that finds the
//! cluster held writes straight into the file, one that does not waits for the lock.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{Dirty, Extent, Store};

/// The smallest cluster: qemu's default qcow2 cluster size.
const MIN_CLUSTER: u64 = 64 << 10;
/// The most clusters the map tracks (2 bits each: 16 MiB of map); larger disks get larger
/// clusters.
const MAX_CLUSTERS: u64 = 1 << 26;
/// The largest cluster (a copy-up buffer): with [`MAX_CLUSTERS`], disks up to 4 PiB.
const MAX_CLUSTER: u64 = 64 << 20;
/// Stripe locks serialising the state changes of clusters.
const STRIPES: usize = 1024;
/// The most extents one block-status answer gathers (a client asks again for the rest).
const MAX_EXTENTS: usize = 1024;

/// What a cluster holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The image's bytes (untouched).
    Image = 0,
    /// The overlay file's bytes.
    Data = 1,
    /// Zeroes (WRITE_ZEROES or TRIM); the overlay file's bytes there mean nothing.
    Zero = 2,
}

/// Why a snapshot overlay cannot be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OverlayError {
    /// The temporary file cannot be made in the directory.
    #[error("snapshot overlay for {location}: cannot make a temporary file in $TMPDIR {}", dir.display())]
    TempFile {
        /// The store.
        location: String,
        /// $TMPDIR.
        dir: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The disk is larger than the map can track.
    #[error(
        "snapshot overlay for {location}: a disk of {size} bytes is too large for snapshot mode (at most 4 PiB)"
    )]
    TooLarge {
        /// The store.
        location: String,
        /// Its size.
        size: u64,
    },
    /// The map's memory cannot be had.
    #[error("snapshot overlay for {location}: cannot allocate its {bytes}-byte cluster map")]
    Memory {
        /// The store.
        location: String,
        /// The map's size.
        bytes: usize,
    },
}

/// A store whose writes go to a temporary overlay.
pub struct Overlay {
    image: Box<dyn Store>,
    file: File,
    dir: PathBuf,
    size: u64,
    cluster: u64,
    /// 2 bits per cluster ([`State`]), 32 clusters a word.
    map: Vec<AtomicU64>,
    stripes: Vec<Mutex<()>>,
}

impl fmt::Debug for Overlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Overlay")
            .field("image", &self.image)
            .field("dir", &self.dir)
            .field("cluster", &self.cluster)
            .finish()
    }
}

impl Overlay {
    /// `image` (opened read-only) with an overlay in `dir` ($TMPDIR).
    pub fn new(image: Box<dyn Store>, dir: &Path) -> Result<Overlay, OverlayError> {
        let size = image.size();
        let location = image.location();
        let mut cluster = MIN_CLUSTER;
        while size.div_ceil(cluster) > MAX_CLUSTERS {
            cluster *= 2;
            if cluster > MAX_CLUSTER {
                return Err(OverlayError::TooLarge { location, size });
            }
        }
        let words = usize::try_from(size.div_ceil(cluster).div_ceil(32)).unwrap_or(usize::MAX);
        let mut map = Vec::new();
        map.try_reserve_exact(words)
            .map_err(|_| OverlayError::Memory {
                location: location.clone(),
                bytes: words.saturating_mul(8),
            })?;
        map.resize_with(words, || AtomicU64::new(0));
        let temp_err = |source| OverlayError::TempFile {
            location: location.clone(),
            dir: dir.to_owned(),
            source,
        };
        let file = temp_file(dir).map_err(temp_err)?;
        file.set_len(size).map_err(temp_err)?;
        Ok(Overlay {
            image,
            file,
            dir: dir.to_owned(),
            size,
            cluster,
            map,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        })
    }

    /// The memory the cluster map takes, in bytes.
    pub fn map_bytes(&self) -> usize {
        self.map.len() * 8
    }

    /// Where the overlay lives ($TMPDIR).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn state(&self, c: u64) -> State {
        let word = self.map[(c / 32) as usize].load(Ordering::Acquire);
        match (word >> ((c % 32) * 2)) & 3 {
            0 => State::Image,
            1 => State::Data,
            _ => State::Zero,
        }
    }

    /// Sets cluster `c`'s state, its stripe lock held (the bytes it names already in place).
    fn set_state(&self, c: u64, s: State) {
        let shift = (c % 32) * 2;
        // One atomic change: a reader never sees a state in between.
        let _ =
            self.map[(c / 32) as usize].fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some((w & !(3 << shift)) | ((s as u64) << shift))
            });
    }

    fn lock(&self, c: u64) -> parking_lot::MutexGuard<'_, ()> {
        self.stripes[(c % STRIPES as u64) as usize].lock()
    }

    /// The bytes of cluster `c`: from its start, how many.
    fn span(&self, c: u64) -> (u64, u64) {
        let start = c * self.cluster;
        (start, self.cluster.min(self.size - start))
    }

    /// The pieces of `[offset, offset + len)`, one per cluster: (cluster, offset, len).
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let c = at / self.cluster;
                let n = ((c + 1) * self.cluster).min(end) - at;
                let piece = (c, at, n);
                at += n;
                piece
            })
        })
    }

    /// The state of the cluster holding `at`, and where the run of clusters in that state
    /// from `at` ends (at most `end`).
    fn run(&self, at: u64, end: u64) -> (State, u64) {
        let state = self.state(at / self.cluster);
        let mut run_end = at;
        while run_end < end && self.state(run_end / self.cluster) == state {
            run_end = ((run_end / self.cluster + 1) * self.cluster).min(end);
        }
        (state, run_end)
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }

    /// Writes `data` at `at` within cluster `c`: into the overlay file if it holds the
    /// cluster, else with the rest of the cluster copied up (from the image, or zeroes).
    fn write_piece(&self, c: u64, data: &[u8], at: u64) -> io::Result<()> {
        if self.state(c) == State::Data {
            return self.file.write_all_at(data, at);
        }
        let _held = self.lock(c);
        let state = self.state(c);
        let (start, n) = self.span(c);
        if state != State::Data && data.len() as u64 != n {
            let mut buf = vec![0u8; n as usize];
            if state == State::Image {
                self.image.read_at(&mut buf, start)?;
            }
            let from = (at - start) as usize;
            buf[from..from + data.len()].copy_from_slice(data);
            self.file.write_all_at(&buf, start)?;
        } else {
            self.file.write_all_at(data, at)?;
        }
        self.set_state(c, State::Data);
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeroes: whole clusters marked, partial ones
    /// written.
    fn zero(&self, offset: u64, len: u64) -> io::Result<()> {
        for (c, at, n) in self.pieces(offset, len) {
            if n == self.span(c).1 {
                let _held = self.lock(c);
                self.set_state(c, State::Zero);
                // Gives the space back; the map says zeroes whether or not it can.
                punch_hole(&self.file, at, n);
            } else if self.state(c) != State::Zero {
                self.write_piece(c, &vec![0u8; n as usize], at)?;
            }
        }
        Ok(())
    }
}

impl Store for Overlay {
    fn location(&self) -> String {
        self.image.location()
    }
    fn kind(&self) -> &'static str {
        self.image.kind()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        false
    }
    // No mapping (it would show the image's bytes where the overlay holds others) and no
    // placement file (every write must be seen): the defaults.

    fn still_holds(&self, end: u64) -> io::Result<bool> {
        self.image.still_holds(end)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            // A run of clusters in one state, read at once.
            let (state, run_end) = self.run(at, end);
            let part = &mut buf[(at - offset) as usize..(run_end - offset) as usize];
            match state {
                State::Image => self.image.read_at(part, at)?,
                State::Data => self.file.read_exact_at(part, at)?,
                State::Zero => part.fill(0),
            }
            at = run_end;
        }
        Ok(())
    }

    fn write_at(&self, data: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        self.check(offset, data.len() as u64)?;
        let mut done = 0usize;
        for (c, at, n) in self.pieces(offset, data.len() as u64) {
            self.write_piece(c, &data[done..done + n as usize], at)?;
            done += n as usize;
        }
        Ok(())
    }

    /// Nothing to make durable: the overlay is thrown away at exit, and the image is not
    /// written.
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    // The image's bitmaps, as qemu-nbd -s finds them below its overlay: the overlay's
    // writes leave them as they are.
    fn has_bitmap(&self, name: &str) -> io::Result<()> {
        self.image.has_bitmap(name)
    }
    fn dirty_bitmap(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<Dirty>> {
        self.image.dirty_bitmap(name, offset, len)
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        self.zero(offset, len)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_write: bool,
        _may_unmap: bool,
    ) -> io::Result<bool> {
        self.check(offset, len)?;
        // FAST_ZERO: only clusters partly covered would need writing.
        if !may_write
            && self
                .pieces(offset, len)
                .any(|(c, _, n)| n != self.span(c).1 && self.state(c) != State::Zero)
        {
            return Ok(false);
        }
        self.zero(offset, len)?;
        Ok(true)
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.image.prefetch(offset, len)
    }

    /// The image's extents where it shows through, data where the overlay holds the
    /// cluster, holes where it is zeroed.
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        let end = offset.saturating_add(len).min(self.size);
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |e: Extent| match out.last_mut() {
            Some(last) if last.hole == e.hole => last.len += e.len,
            _ => out.push(e),
        };
        let mut at = offset;
        let mut count = 0;
        while at < end && count < MAX_EXTENTS {
            let (state, run_end) = self.run(at, end);
            match state {
                State::Image => {
                    let mut p = at;
                    while p < run_end {
                        let mut got = self.image.extents(p, run_end - p)?;
                        got.retain(|e| e.len > 0);
                        if got.is_empty() {
                            // A store that answers nothing here: say data, always correct.
                            push(Extent {
                                len: run_end - p,
                                hole: false,
                            });
                            break;
                        }
                        for e in got {
                            if p >= run_end {
                                break;
                            }
                            let n = e.len.min(run_end - p);
                            push(Extent {
                                len: n,
                                hole: e.hole,
                            });
                            p += n;
                            count += 1;
                        }
                    }
                }
                State::Data | State::Zero => push(Extent {
                    len: run_end - at,
                    hole: state == State::Zero,
                }),
            }
            count += 1;
            at = run_end;
        }
        Ok(out)
    }
}

/// An unnamed file in `dir`, gone when closed (O_TMPFILE); where the file system cannot
/// make one, a new file unlinked at once.
fn temp_file(dir: &Path) -> io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(true).mode(0o600);
    match opts.clone().custom_flags(libc::O_TMPFILE).open(dir) {
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) => {}
        other => return other,
    }
    opts.create_new(true).custom_flags(libc::O_NOFOLLOW);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for n in 0..100u32 {
        let path = dir.join(format!(
            ".qpip-snapshot-{}-{stamp:x}-{n}",
            std::process::id()
        ));
        match opts.open(&path) {
            Ok(file) => {
                std::fs::remove_file(&path)?;
                return Ok(file);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::from(io::ErrorKind::AlreadyExists))
}

fn punch_hole(file: &File, offset: u64, len: u64) {
    // SAFETY: plain system call on an owned descriptor.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::open;

    const C: u64 = MIN_CLUSTER;

    /// An image of `size` bytes, each byte (i % 251) + 1.
    fn image(size: u64) -> Box<dyn Store> {
        let s = open::anonymous("overlay-test.img", size).unwrap();
        let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
        s.write_at(&bytes, 0, false).unwrap();
        s
    }

    fn read(s: &dyn Store, offset: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        s.read_at(&mut b, offset).unwrap();
        b
    }

    #[test]
    fn writes_zeroes_and_trims_go_to_the_overlay_and_never_to_the_image() {
        let size = 4 * C + 1000; // a short last cluster
        let img = image(size);
        let before = read(&*img, 0, size as usize);
        let dir = tempfile::tempdir().unwrap();
        let o = Overlay::new(img, dir.path()).unwrap();
        let mut model = before.clone();
        let mut apply = |at: u64, data: &[u8]| {
            model[at as usize..at as usize + data.len()].copy_from_slice(data);
        };
        o.write_at(&[0xAA; 100], C - 50, false).unwrap(); // across two clusters
        apply(C - 50, &[0xAA; 100]);
        o.write_zeroes(C + 10, 2 * C, true, true).unwrap(); // partial, whole, partial
        apply(C + 10, &vec![0; 2 * C as usize]);
        o.trim(4 * C, 1000).unwrap(); // the whole short cluster
        apply(4 * C, &[0; 1000]);
        o.write_at(&[0xBB; 10], 2 * C + 5, false).unwrap(); // into a zeroed cluster
        apply(2 * C + 5, &[0xBB; 10]);
        assert_eq!(read(&o, 0, size as usize), model);
        assert!(o.mapping().is_none() && o.placement_file().is_none());
        o.flush().unwrap();
        let ext = o.extents(0, size).unwrap();
        assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), size);
        assert!(ext.last().unwrap().hole, "{ext:?}");
        // FAST_ZERO on a partial cluster it would have to write: refused, nothing changed.
        assert!(!o.write_zeroes(3 * C + 1, 10, false, true).unwrap());
        assert_eq!(read(&o, 0, size as usize), model);
        assert_eq!(read(&*o.image, 0, size as usize), before);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_missing_tmpdir_is_one_line_naming_it() {
        let err = Overlay::new(image(C), Path::new("/nonexistent/qpip-tmp"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("$TMPDIR /nonexistent/qpip-tmp") && !err.contains('\n'),
            "{err}"
        );
    }

    #[test]
    fn concurrent_writes_to_one_untouched_cluster_keep_both() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..200u64 {
            let o = Overlay::new(image(8 * C), dir.path()).unwrap();
            let c = round % 8;
            std::thread::scope(|s| {
                // Connections each copying up the same cluster for their own bytes.
                for t in 0..4u64 {
                    let o = &o;
                    s.spawn(move || {
                        let at = c * C + t * 4096 + 17;
                        o.write_at(&[0xC0 + t as u8; 1000], at, false).unwrap();
                    });
                }
            });
            for t in 0..4u64 {
                let at = c * C + t * 4096 + 17;
                assert_eq!(
                    read(&o, at, 1000),
                    vec![0xC0 + t as u8; 1000],
                    "round {round}"
                );
                // The image's bytes between them, copied up.
                assert_eq!(read(&o, at + 1000, 1), vec![((at + 1000) % 251) as u8 + 1]);
            }
        }
    }
}
