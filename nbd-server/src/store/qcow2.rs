//! The qcow2 store: a qcow2 image file served as its virtual disk, as qemu serves it, read
//! and written in place. Here: the image's state, its cluster tables read, and reads. In
//! `qcow2/`: the header (`header.rs`), refcounts and cluster allocation (`refcount.rs`),
//! writes, copy-on-write and zeroing (`write.rs`), compressed clusters (`compressed.rs`), the
//! backing file and the external data file (`external.rs`), block status (`extents.rs`),
//! LUKS encryption (`luks.rs`), persistent dirty bitmaps, served and kept current by writes
//! (`bitmaps.rs`).
//!
//! Served read-write: versions 3 and 2, any cluster size, byte-wide refcounts (8 to 64 bits),
//! compressed clusters, backing chains, external data files, internal snapshots and LUKS
//! encryption (below). Refused at open (`header.rs`), with one line: qcow2's legacy AES
//! encryption, encryption with an external data file, extended L2 entries (subclusters),
//! narrower refcounts, unknown incompatible features, images marked dirty or corrupt;
//! `store::open` refuses backing files over a protocol or in formats other than qcow2 and
//! raw, chains deeper than `open::MAX_BACKING_DEPTH` or that loop, and the files an image
//! names where the user did not allow them (`store::named`).
//!
//! An external data file (`data_file`, header extension 0x44415441) is opened beside the image
//! by `store::open` where `store::named` allows, locked as the image is: its name resolved
//! against the image's directory (qemu opens a relative name from its current directory; run
//! from the image's directory, both agree). Data clusters lie there at their guest offsets, unrefcounted, as qemu keeps
//! them (an L2 entry of offset 0 is the data file's first cluster where COPIED says so); with
//! `data_file_raw` the data file is kept a raw image of the disk (zeroing zeroes it too) and
//! the autoclear bit that says so is kept.
//!
//! A backing file (qcow2 or raw; its name resolved against this image's directory as qemu
//! resolves it, its format from the header extension or probed) is opened read-only by
//! `store::open` where `store::named` allows, which follows the chain up to `open::MAX_BACKING_DEPTH` images and locks
//! each file as qemu locks a backing file. Unallocated clusters read from it (zeroes past its
//! end); writes copy-on-write into this image (a partial cluster reads the backing cluster
//! first); zeroing sets the zero flag, which hides the backing data; block status asks the
//! backing file about unallocated runs. Compressed clusters (zlib, i.e. raw deflate, and zstd, as `qemu-img convert -c`
//! makes them) are read, decompressed into one cluster at most; a write into one allocates a
//! new cluster with the decompressed contents (copy-on-write) and drops the compressed
//! cluster's reference on every host cluster it spans, as qemu does.
//! Images with internal snapshots are written as qemu writes them, leaving the snapshots
//! intact: a cluster shared with a snapshot (no COPIED flag: refcount above 1), a zeroed one
//! that keeps such an allocation included, is copied to a new cluster before it changes (only
//! a COPIED one is written in place), and the shared one loses a reference; an L2 table shared
//! with a snapshot (L1 entry without COPIED) is copied first, and the copy made the active
//! one's. Version 2 has no zero flag: zeroing a whole cluster zeroes its bytes (a hole
//! punched) or, for a shared or compressed one, unmaps it; over a backing file, zeroes are
//! written (allocating), so that the backing data stays hidden.
//!
//! An image encrypted with LUKS (crypt_method 2, as `qemu-img create -o
//! encrypt.format=luks` makes it) is opened with a passphrase (`luks.rs` unlocks the LUKS
//! header the full disk encryption header extension points at): data clusters are
//! decrypted as they are read and encrypted as they are written, a 512-byte sector at a
//! time with its host offset as IV, as qemu does; a write that covers part of a sector
//! reads and decrypts the rest of it first. Zero and unallocated clusters read as zeroes
//! (or as the backing file, which is not encrypted) without the cipher. A compressed
//! cluster in an encrypted image (qemu makes none) is EIO; an encrypted backing file is
//! refused by `store::open`. The LUKS header's area is metadata no write may land on.
//!
//! Writes allocate clusters at the end of the file and keep the refcounts exact, in the order
//! qemu uses (refcount, then data, then the L2 entry pointing at it, with a write barrier
//! before the entries that make new clusters reachable), so that a crash or a power loss leaks
//! clusters at worst and `qemu-img check` stays clean; a full refcount table is replaced by a larger
//! one at the end of the file, as qemu does. Zeroing and trimming whole clusters set
//! the v3 "reads as zero" flag and keep the cluster allocated.
//!
//! Crafted headers are bounded as qemu bounds them (L1 table 32 MiB, refcount table 8 MiB;
//! of the L1 table only what the virtual disk needs is read), the tables of a backing chain's
//! images together by [`MAX_CHAIN_TABLE_BYTES`], and the tables must lie in the file, off
//! the header and off each other. A write through an L2 entry (or to an L2 table)
//! that lies on the image's own metadata fails with EIO and marks the image corrupt, as
//! qemu's overlap check does; so does a zeroing, trim or copy-on-write that would drop a
//! reference an entry pointing there holds (a crafted compressed entry in the header).

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::{Depth, Dirty, Extent, Store};

mod bitmaps;
mod compressed;
mod extents;
mod external;
mod header;
pub use header::MAX_CHAIN_TABLE_BYTES;
mod luks;
mod refcount;
mod write;

use header::{AUTOCLEAR_DATA_FILE_RAW, Compression, INCOMPAT_DATA_FILE};

const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;
const ZERO: u64 = 1;

/// How one cluster of the virtual disk is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cluster {
    /// Not allocated: reads from the backing file, or as zeroes without one.
    Unallocated,
    /// Reads as zeroes (the v3 zero flag, which hides the backing file): allocated at
    /// `host`, or not (0).
    Zero {
        host: u64,
    },
    Data {
        host: u64,
        copied: bool,
    },
    /// A compressed cluster: its L2 entry (host offset and sector count).
    Compressed {
        entry: u64,
    },
}

/// Why an image is not served.
fn unsupported(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("qcow2 image {what}"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

/// A qcow2 image file, served as its virtual disk.
pub struct Qcow2 {
    path: PathBuf,
    read_only: bool,
    file: File,
    version: u32,
    cluster_bits: u32,
    size: u64,
    l1_offset: u64,
    compression: Compression,
    /// The backing file, opened read-only (by `store::open`, which follows the chain): what
    /// unallocated clusters read.
    backing: Option<Box<dyn Store>>,
    /// Its name as the header has it, and its format (header extension), if any; the
    /// external data file's name.
    names: header::Names,
    /// The external data file (set by `store::open`), where data clusters are: at their
    /// guest offset, not refcounted, as qemu keeps them.
    data: Option<File>,
    /// Whether the image has an external data file.
    external: bool,
    /// Whether that file is a raw image of the disk (`data_file_raw`), kept so.
    data_raw: bool,
    /// Refcount entry width in bytes.
    refcount_bytes: usize,
    /// The snapshot table and the snapshots' L1 tables (at, len): metadata no write may
    /// land on (this server makes no snapshots, so it never moves).
    snapshot_metadata: Vec<(u64, u64)>,
    /// An encrypted image's LUKS header area (at, len), which no write may land on, and the
    /// cipher its data clusters are encrypted with (keyed by the unlocked master key).
    luks_area: Option<(u64, u64)>,
    crypt: Option<luks::Cipher>,
    state: Mutex<State>,
    /// Barriers issued, for the tests.
    #[cfg(test)]
    barriers: std::sync::atomic::AtomicUsize,
}

struct State {
    l1: Vec<u64>,
    refcount_table: Vec<u64>,
    /// Where the refcount table is: it moves when it grows.
    refcount_table_offset: u64,
    /// The host offsets of the refcount blocks and of the L2 tables: metadata that data must
    /// not be written over.
    refcount_blocks: HashSet<u64>,
    l2_tables: HashSet<u64>,
    /// Where the next cluster is allocated: the end of the file, cluster aligned.
    next_free: u64,
    /// Set when a write would have gone over metadata: the image is marked corrupt and
    /// takes no more writes.
    corrupt: bool,
    /// The persistent dirty bitmaps, set by writes (`qcow2/bitmaps.rs`).
    bitmaps: bitmaps::Bitmaps,
    /// Closed ([`Store::close`]): the bitmaps stored, no more writes.
    closed: bool,
}

impl Qcow2 {
    /// Opens the qcow2 image in `file` (which starts with the magic), found at `path`, and
    /// refuses what this reader does not handle (the caller names the file). Its L1 and
    /// refcount tables are read into memory if they fit in `tables_left` bytes, which they
    /// then take from it (a backing chain shares one bound). With `snapshot`, the internal
    /// snapshot it names is the disk instead of the active one (the caller opens it
    /// read-only). An image encrypted with LUKS is unlocked with the passphrase in
    /// `passphrase` (the file's bytes as they are), and refused without one.
    pub fn open(
        path: &Path,
        file: File,
        read_only: bool,
        tables_left: &mut u64,
        snapshot: Option<&str>,
        passphrase: Option<&Path>,
    ) -> io::Result<Qcow2> {
        let opened = header::read(&file, tables_left, snapshot)?;
        let h = opened.header;
        let bitmaps = bitmaps::read(
            &file,
            h.bitmaps_ext,
            h.autoclear,
            h.cluster_bits,
            h.size,
            file.metadata()?.len(),
            tables_left,
        )?;
        let crypt = match (h.luks, passphrase) {
            (None, _) => None,
            (Some((at, len)), Some(passphrase)) => Some(luks::unlock(&file, at, len, passphrase)?),
            (Some(_), None) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "qcow2 image is encrypted (LUKS) and no passphrase was given for it (--encryption-passphrase-file)",
                ));
            }
        };
        let q = Qcow2 {
            path: path.to_owned(),
            read_only,
            file,
            version: h.version,
            cluster_bits: h.cluster_bits,
            size: h.size,
            l1_offset: h.l1_offset,
            compression: h.compression,
            backing: None,
            names: opened.names,
            data: None,
            external: h.incompat & INCOMPAT_DATA_FILE != 0,
            data_raw: h.incompat & INCOMPAT_DATA_FILE != 0
                && h.autoclear & AUTOCLEAR_DATA_FILE_RAW != 0,
            refcount_bytes: 1 << (h.refcount_order - 3),
            snapshot_metadata: opened.snapshot_metadata,
            luks_area: h.luks,
            crypt,
            state: Mutex::new(State {
                l1: opened.l1,
                refcount_table: opened.refcount_table,
                refcount_table_offset: opened.refcount_table_offset,
                refcount_blocks: opened.refcount_blocks,
                l2_tables: opened.l2_tables,
                next_free: opened.next_free,
                corrupt: false,
                bitmaps,
                closed: false,
            }),
            #[cfg(test)]
            barriers: Default::default(),
        };
        // Autoclear features describe data that a writer who does not know them would make
        // stale: such a writer clears them, as qemu does. A raw external data file is kept
        // raw, and the bitmaps kept current (marked in use until a clean close): the bits that
        // say so are kept.
        let mut keep = if q.data_raw {
            AUTOCLEAR_DATA_FILE_RAW
        } else {
            0
        };
        if !read_only {
            let mut st = q.state.lock();
            if !st.bitmaps.is_empty() {
                keep |= bitmaps::AUTOCLEAR_BITMAPS;
            }
            if h.autoclear & !keep != 0 {
                q.file
                    .write_all_at(&(h.autoclear & keep).to_be_bytes(), 88)?;
                q.file.sync_data()?;
            }
            st.bitmaps.claim(&q.file)?;
        }
        Ok(q)
    }

    /// The virtual disk's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn l2_entries(&self) -> u64 {
        self.cluster_size() / 8
    }

    /// The L2 table offset and entry index for a guest offset (table 0: none).
    fn l2_slot(&self, st: &State, guest: u64) -> (u64, usize, u64) {
        let ci = guest >> self.cluster_bits;
        let l1_idx = (ci / self.l2_entries()) as usize;
        let l2_idx = ci % self.l2_entries();
        (st.l1[l1_idx] & OFFSET_MASK, l1_idx, l2_idx)
    }

    fn decode(&self, entry: u64) -> Cluster {
        if entry & COMPRESSED != 0 {
            return Cluster::Compressed { entry };
        }
        let host = entry & OFFSET_MASK;
        if self.version >= 3 && entry & ZERO != 0 {
            Cluster::Zero { host }
        } else if host == 0 && !(self.external && entry & COPIED != 0) {
            // Offset 0 is a data file's first cluster where COPIED says so (qemu's rule).
            Cluster::Unallocated
        } else {
            Cluster::Data {
                host,
                copied: entry & COPIED != 0,
            }
        }
    }

    fn lookup(&self, st: &State, guest: u64) -> io::Result<Cluster> {
        let (l2, _, l2_idx) = self.l2_slot(st, guest);
        if l2 == 0 {
            return Ok(Cluster::Unallocated);
        }
        Ok(self.decode(read_u64(&self.file, l2 + l2_idx * 8)?))
    }

    /// Splits `[offset, offset + len)` at cluster boundaries: (guest offset, offset in the
    /// cluster, length) for each piece.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64)> + use<> {
        let cs = 1u64 << self.cluster_bits;
        let end = offset + len;
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let in_cluster = pos % cs;
            let n = (cs - in_cluster).min(end - pos);
            let piece = (pos, in_cluster, n);
            pos += n;
            Some(piece)
        })
    }

    /// Reads `buf.len()` bytes of the virtual disk at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(offset, buf.len() as u64, self.size)?;
        let st = self.state.lock();
        let mut done = 0usize;
        for (guest, in_cluster, n) in self.pieces(offset, buf.len() as u64) {
            let out = &mut buf[done..done + n as usize];
            match self.lookup(&st, guest)? {
                Cluster::Zero { .. } => out.fill(0),
                Cluster::Unallocated => self.read_backing(out, guest + in_cluster)?,
                Cluster::Data { host, .. } => self.read_data(out, host + in_cluster)?,
                Cluster::Compressed { entry } => {
                    let whole = self.decompress(entry)?;
                    out.copy_from_slice(&whole[in_cluster as usize..(in_cluster + n) as usize]);
                }
            }
            done += n as usize;
        }
        Ok(())
    }

    /// Bytes of the virtual disk one L2 table maps.
    fn l2_span(&self) -> u64 {
        self.cluster_size() * self.l2_entries()
    }

    /// Where the next L2 table after `pos` (which has none) begins, or `end`: a run of
    /// empty L1 entries is skipped in one scan.
    fn next_table(&self, st: &State, pos: u64, end: u64) -> u64 {
        let span = self.l2_span();
        let (first, last) = ((pos / span) as usize, ((end - 1) / span) as usize);
        st.l1[first..=last]
            .iter()
            .position(|e| e & OFFSET_MASK != 0)
            .map_or(end, |k| (first + k) as u64 * span)
    }
}

impl std::fmt::Debug for Qcow2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qcow2")
            .field("path", &self.path)
            .field("size", &self.size)
            .finish()
    }
}

/// The virtual disk as a store: no mapping (every request goes through the cluster tables),
/// so the NIC places no writes and reads are read into registered memory first.
impl Store for Qcow2 {
    fn location(&self) -> String {
        self.path.display().to_string()
    }
    fn kind(&self) -> &'static str {
        "qcow2"
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        Qcow2::read_at(self, buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        Qcow2::write_at(self, data, offset)?;
        if fua {
            // The whole file: the metadata that makes new clusters reachable too.
            Store::flush(self)?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        if let Some(data) = &self.data {
            data.sync_data()?;
        }
        self.file.sync_data()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero_range(offset, len)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        _may_write: bool,
        _may_unmap: bool,
    ) -> io::Result<bool> {
        self.zero_range(offset, len)?;
        Ok(true)
    }
    fn extents(&self, offset: u64, len: u64) -> io::Result<Vec<Extent>> {
        Ok(Qcow2::extents(self, offset, len, 64)?
            .into_iter()
            .map(|(len, hole)| Extent { len, hole })
            .collect())
    }
    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<Vec<Depth>> {
        Qcow2::allocation_depth(self, offset, len, 64)
    }
    /// This image's bitmap, else its backing chain's (qemu-nbd looks down the chain too).
    fn has_bitmap(&self, name: &str) -> io::Result<()> {
        match self.state.lock().bitmaps.find(name) {
            Some(found) => found.map(|_| ()),
            None => match self.backing.as_deref().map(|b| b.has_bitmap(name)) {
                Some(Ok(())) => Ok(()),
                Some(Err(e)) if e.kind() == io::ErrorKind::InvalidData => Err(e),
                _ => Err(bitmaps::not_found(name)),
            },
        }
    }
    fn dirty_bitmap(&self, name: &str, offset: u64, len: u64) -> io::Result<Vec<Dirty>> {
        let end = offset.saturating_add(len).min(self.size);
        match self.state.lock().bitmaps.find(name) {
            Some(found) => Ok(found?.runs(offset, end, DIRTY_RUNS)),
            None => match &self.backing {
                Some(b) => b.dirty_bitmap(name, offset, end.saturating_sub(offset)),
                None => Err(bitmaps::not_found(name)),
            },
        }
    }
    /// Flushes, and stores the dirty bitmaps a writable open marked in use, out of use.
    fn close(&self) -> io::Result<()> {
        let mut st = self.state.lock();
        if st.closed || self.read_only {
            return Ok(());
        }
        Store::flush(self)?;
        if !st.corrupt {
            self.store_bitmaps(&mut st)?;
        }
        st.closed = true;
        Ok(())
    }
}

/// Runs of a dirty bitmap one answer gives at most (the client asks again from its end).
const DIRTY_RUNS: usize = 64;

/// A writable image dropped without [`Store::close`] (a library user's, a test's) is closed
/// here, so that its bitmaps are stored.
impl Drop for Qcow2 {
    fn drop(&mut self) {
        if let Err(e) = Store::close(self) {
            tracing::error!("closing qcow2 image {}: {e}", self.path.display());
        }
    }
}

fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "beyond the end of the virtual disk",
        ));
    }
    Ok(())
}

fn read_some(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64)? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn read_u64(file: &File, at: u64) -> io::Result<u64> {
    let mut b = [0u8; 8];
    file.read_exact_at(&mut b, at)?;
    Ok(u64::from_be_bytes(b))
}

fn read_table(file: &File, at: u64, entries: usize) -> io::Result<Vec<u64>> {
    let mut raw = vec![0u8; entries * 8];
    file.read_exact_at(&mut raw, at)?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::probe::QCOW2_MAGIC as MAGIC;
    use std::sync::atomic::Ordering;

    const CS: u64 = 1 << 16;

    /// A 64 MiB version 3 image with 64 KiB clusters, laid out as qemu-img makes it:
    /// header, refcount table, refcount block, L1 table (one entry).
    fn image(dir: &std::path::Path) -> File {
        let mut b = vec![0u8; 4 * CS as usize];
        let put64 =
            |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        let put32 =
            |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_be_bytes());
        b[..4].copy_from_slice(MAGIC);
        put32(&mut b, 4, 3);
        put32(&mut b, 20, 16);
        put64(&mut b, 24, 64 << 20);
        put32(&mut b, 36, 1);
        put64(&mut b, 40, 3 * CS);
        put64(&mut b, 48, CS);
        put32(&mut b, 56, 1);
        put32(&mut b, 96, 4);
        put32(&mut b, 100, 104);
        put64(&mut b, CS as usize, 2 * CS);
        for c in 0..4 {
            b[(2 * CS + c * 2 + 1) as usize] = 1;
        }
        let path = dir.join("t.qcow2");
        std::fs::write(&path, &b).unwrap();
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    /// A write that allocates issues one barrier before the L2 (and L1) entries that make its
    /// clusters reachable; a write to clusters already allocated issues none.
    #[test]
    fn allocating_writes_order_refcounts_before_l2_entries_with_one_barrier() {
        let dir = tempfile::tempdir().unwrap();
        let mut no_bound = u64::MAX;
        let q = Qcow2::open(
            Path::new("t.qcow2"),
            image(dir.path()),
            false,
            &mut no_bound,
            None,
            None,
        )
        .unwrap();
        let barriers = || q.barriers.load(Ordering::Relaxed);
        // A new L2 table and a new cluster.
        q.write_at(&[0x11; 4096], 0).unwrap();
        assert_eq!(barriers(), 1);
        // The same cluster again: no barrier.
        q.write_at(&[0x22; 4096], 8192).unwrap();
        assert_eq!(barriers(), 1);
        // Three new clusters in one request: one barrier.
        q.write_at(&vec![0x33; 3 * CS as usize], 1 << 20).unwrap();
        assert_eq!(barriers(), 2);
        // Zeroing whole clusters keeps them allocated: no barrier; writing them again neither.
        q.zero_range(1 << 20, 2 * CS).unwrap();
        q.write_at(&[0x44; 512], 1 << 20).unwrap();
        assert_eq!(barriers(), 2);
        let mut back = vec![0u8; 16384];
        q.read_at(&mut back, 0).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0x11));
        assert!(back[4096..8192].iter().all(|&b| b == 0));
        assert!(back[8192..12288].iter().all(|&b| b == 0x22));
        let mut back = vec![0u8; 3 * CS as usize];
        q.read_at(&mut back, 1 << 20).unwrap();
        assert!(back[..512].iter().all(|&b| b == 0x44));
        assert!(back[512..2 * CS as usize].iter().all(|&b| b == 0));
        assert!(back[2 * CS as usize..].iter().all(|&b| b == 0x33));
    }

    /// B5: a crafted compressed L2 entry starting in the header and reaching into the
    /// refcount table, then trimmed: the request fails with EIO and the image is marked
    /// corrupt, and the refcounts of the header and of the table keep their 1 (they dropped
    /// to 0), the entry untouched.
    #[test]
    fn trimming_a_compressed_entry_on_the_header_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = image(dir.path());
        // L2 table at cluster 4 (refcount 1); its first entry: 2 sectors from CS - 512.
        f.write_all_at(&((4 * CS) | COPIED).to_be_bytes(), 3 * CS)
            .unwrap();
        f.write_all_at(&[0, 1], 2 * CS + 8).unwrap();
        f.set_len(5 * CS).unwrap();
        let entry = COMPRESSED | (1 << 54) | (CS - 512);
        f.write_all_at(&entry.to_be_bytes(), 4 * CS).unwrap();
        let mut no_bound = u64::MAX;
        let q = Qcow2::open(
            Path::new("t.qcow2"),
            f.try_clone().unwrap(),
            false,
            &mut no_bound,
            None,
            None,
        )
        .unwrap();
        let err = q.zero_range(0, CS).unwrap_err();
        assert!(err.to_string().contains("lies on the header"), "{err}");
        let st = q.state.lock();
        assert_eq!(q.refcount(&st, 0).unwrap(), 1);
        assert_eq!(q.refcount(&st, CS).unwrap(), 1);
        assert_eq!(read_u64(&f, 4 * CS).unwrap(), entry);
        assert!(st.corrupt);
    }

    /// A crafted compressed cluster decompresses into one cluster at most: a zlib stream of
    /// more than a cluster gives its first cluster (as qemu reads it), a zstd frame of more
    /// than a cluster and garbage are EIO; nothing panics or allocates past a cluster.
    #[test]
    fn crafted_compressed_clusters_are_bounded_by_the_cluster() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let f = image(dir.path());
        // L2 table at cluster 4, compressed data at cluster 5 (refcounts 1).
        f.write_all_at(&((4 * CS) | COPIED).to_be_bytes(), 3 * CS)
            .unwrap();
        f.write_all_at(&[0, 1, 0, 1], 2 * CS + 8).unwrap();
        let entry = |len: usize| {
            let sectors = len.div_ceil(512) as u64;
            COMPRESSED | ((sectors - 1) << 54) | (5 * CS)
        };
        let big = vec![0x5au8; 1 << 20];
        let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&big).unwrap();
        let deflated = z.finish().unwrap();
        let zstd_frame = zstd::bulk::compress(&big, 1).unwrap();
        let garbage = vec![0xffu8; 4096];
        f.write_all_at(&deflated, 5 * CS).unwrap();
        f.write_all_at(&zstd_frame, 5 * CS + 16384).unwrap();
        f.write_all_at(&garbage, 5 * CS + 32768).unwrap();
        f.set_len(6 * CS).unwrap();
        let l2 = |i: u64, e: u64| f.write_all_at(&e.to_be_bytes(), 4 * CS + i * 8).unwrap();
        l2(0, entry(deflated.len()));
        l2(1, entry(garbage.len()) + 32768);
        let mut no_bound = u64::MAX;
        let q = Qcow2::open(
            Path::new("t.qcow2"),
            f.try_clone().unwrap(),
            true,
            &mut no_bound,
            None,
            None,
        )
        .unwrap();
        let mut back = vec![0u8; CS as usize];
        q.read_at(&mut back, 0).unwrap();
        assert!(back.iter().all(|&b| b == 0x5a));
        assert!(q.read_at(&mut back, CS).is_err());
        drop(q);
        // The same image with zstd compression (header length 112, type 1, incompatible
        // bit 3): the frame holds more than a cluster.
        f.write_all_at(&112u32.to_be_bytes(), 100).unwrap();
        f.write_all_at(&[1], 104).unwrap();
        f.write_all_at(&8u64.to_be_bytes(), 72).unwrap();
        l2(0, entry(zstd_frame.len()) + 16384);
        let q = Qcow2::open(Path::new("t.qcow2"), f, true, &mut no_bound, None, None).unwrap();
        let err = q.read_at(&mut back, 0).unwrap_err();
        assert!(err.to_string().contains("more than a cluster"), "{err}");
        assert!(q.read_at(&mut back, CS).is_err());
    }
}
