//! The qcow2 store: a qcow2 image file served as its virtual disk, as qemu serves it, read
//! and written in place. Its header is read in `header.rs`, its refcounts kept in
//! `refcount.rs` (in `qcow2/`).
//!
//! Served read-write: versions 3 and 2, any cluster size, byte-wide refcounts (8 to 64 bits),
//! compressed clusters, backing chains, external data files and internal snapshots (below).
//! Refused at open (`header.rs`), with one line: encryption, extended L2 entries
//! (subclusters), narrower refcounts, unknown incompatible features, images marked dirty or
//! corrupt; `store::open` refuses backing files over a protocol or in formats other than
//! qcow2 and raw, and chains deeper than `open::MAX_BACKING_DEPTH`.
//!
//! An external data file (`data_file`, header extension 0x44415441) is opened beside the image
//! by `store::open`, locked as the image is: its name resolved against the image's directory
//! (qemu opens a relative name from its current directory; run from the image's directory,
//! both agree). Data clusters lie there at their guest offsets, unrefcounted, as qemu keeps
//! them (an L2 entry of offset 0 is the data file's first cluster where COPIED says so); with
//! `data_file_raw` the data file is kept a raw image of the disk (zeroing zeroes it too) and
//! the autoclear bit that says so is kept.
//!
//! A backing file (qcow2 or raw; its name resolved against this image's directory as qemu
//! resolves it, its format from the header extension or probed) is opened read-only by
//! `store::open`, which follows the chain up to `open::MAX_BACKING_DEPTH` images and locks
//! each file as qemu locks a backing file. Unallocated clusters read from it (zeroes past its
//! end); writes copy-on-write into this image (a partial cluster reads the backing cluster
//! first); zeroing sets the zero flag, which hides the backing data; block status asks the
//! backing file about unallocated runs. Compressed clusters (zlib, i.e. raw deflate, and zstd, as `qemu-img convert -c`
//! makes them) are read, decompressed into one cluster at most; a write into one allocates a
//! new cluster with the decompressed contents (copy-on-write) and drops the compressed
//! cluster's reference on every host cluster it spans, as qemu does.
//! Images with internal snapshots are written as qemu writes them, leaving the snapshots
//! intact: a cluster shared with a snapshot (no COPIED flag: refcount above 1) is copied to a
//! new cluster before it changes, and the shared one loses a reference; an L2 table shared
//! with a snapshot (L1 entry without COPIED) is copied first, and the copy made the active
//! one's. Version 2 has no zero flag: zeroing a whole cluster zeroes its bytes (a hole
//! punched) or, for a shared or compressed one, unmaps it; over a backing file, zeroes are
//! written (allocating), so that the backing data stays hidden.
//!
//! Writes allocate clusters at the end of the file and keep the refcounts exact, in the order
//! qemu uses (refcount, then data, then the L2 entry pointing at it, with a write barrier
//! before the entries that make new clusters reachable), so that a crash or a power loss leaks
//! clusters at worst and `qemu-img check` stays clean; a full refcount table is replaced by a larger
//! one at the end of the file, as qemu does. Zeroing and trimming whole clusters set
//! the v3 "reads as zero" flag and keep the cluster allocated.
//!
//! Crafted headers are bounded as qemu bounds them (L1 table 32 MiB, refcount table 8 MiB;
//! of the L1 table only what the virtual disk needs is read), and the tables must lie in the
//! file, off the header and off each other. A write through an L2 entry (or to an L2 table)
//! that lies on the image's own metadata fails with EIO and marks the image corrupt, as
//! qemu's overlap check does.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::{Extent, Store};

mod header;
mod refcount;

use header::{AUTOCLEAR_DATA_FILE_RAW, Compression, INCOMPAT_CORRUPT, INCOMPAT_DATA_FILE};

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
}

impl Qcow2 {
    /// Opens the qcow2 image in `file` (which starts with the magic), found at `path`, and
    /// refuses what this reader does not handle (the caller names the file).
    pub fn open(path: &Path, file: File, read_only: bool) -> io::Result<Qcow2> {
        let opened = header::read(&file)?;
        let h = opened.header;
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
            state: Mutex::new(State {
                l1: opened.l1,
                refcount_table: opened.refcount_table,
                refcount_table_offset: opened.refcount_table_offset,
                refcount_blocks: opened.refcount_blocks,
                l2_tables: opened.l2_tables,
                next_free: opened.next_free,
                corrupt: false,
            }),
            #[cfg(test)]
            barriers: Default::default(),
        };
        // Autoclear features (bitmaps) describe data that a writer who does not know them
        // would make stale: such a writer clears them, as qemu does. A raw external data file
        // is kept raw, and the bit that says so kept.
        let keep = if q.data_raw {
            AUTOCLEAR_DATA_FILE_RAW
        } else {
            0
        };
        if !read_only && h.autoclear & !keep != 0 {
            q.file.write_all_at(&keep.to_be_bytes(), 88)?;
            q.file.sync_data()?;
        }
        Ok(q)
    }

    /// The backing file the header names, resolved as qemu resolves it (a relative name
    /// against the directory of this image's path as given), and its format if the header
    /// names one. A name with a protocol (`nbd:...`, `json:...`) is refused.
    pub fn backing_file(&self) -> io::Result<Option<(PathBuf, Option<&str>)>> {
        let Some(name) = self.names.backing.as_deref() else {
            return Ok(None);
        };
        if name.is_empty() {
            return Err(unsupported("has an empty backing file name"));
        }
        // qemu's path_has_protocol: a colon before any slash.
        if name
            .split('/')
            .next()
            .is_some_and(|head| head.contains(':'))
        {
            return Err(unsupported(format!(
                "has backing file {name:?}, which names a protocol: not supported"
            )));
        }
        let path = match self.path.parent() {
            Some(dir) if !Path::new(name).is_absolute() => dir.join(name),
            _ => PathBuf::from(name),
        };
        Ok(Some((path, self.names.backing_format.as_deref())))
    }

    /// The external data file the header names, resolved against this image's directory.
    pub fn data_file(&self) -> Option<PathBuf> {
        let name = self.names.data_file.as_deref()?;
        Some(match self.path.parent() {
            Some(dir) if !Path::new(name).is_absolute() => dir.join(name),
            _ => PathBuf::from(name),
        })
    }

    /// Attaches the external data file (opened writable unless the image is read-only).
    pub fn set_data_file(&mut self, data: File) {
        self.data = Some(data);
    }

    /// The file data clusters are in.
    fn data(&self) -> &File {
        self.data.as_ref().unwrap_or(&self.file)
    }

    /// Attaches the backing file (opened read-only): what unallocated clusters read.
    pub fn set_backing(&mut self, backing: Box<dyn Store>) {
        self.backing = Some(backing);
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

    pub fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.size)?;
        let mut st = self.state.lock();
        refuse_if_corrupt(&st)?;
        self.write_locked(&mut st, data, offset)
    }

    /// Writes `data` at guest `offset`, allocating the clusters (and L2 tables) it lacks.
    ///
    /// Crash order, as qemu keeps it with cache=writeback (qcow2_cache_set_dependency): the
    /// new clusters' refcounts, their data and the new L2 tables' zeroes are written first;
    /// one barrier; then the L2 entries, then the L1 entries, that make them reachable. A
    /// power loss can then leak clusters, never leave an entry pointing at a cluster whose
    /// refcount is 0 (or at a table not yet zeroed). A write to clusters already allocated
    /// issues no barrier.
    fn write_locked(&self, st: &mut State, data: &[u8], offset: u64) -> io::Result<()> {
        let cs = self.cluster_size();
        // New L2 tables by L1 index, and the L2 entries to write after the barrier.
        let mut new_tables: Vec<(usize, u64)> = Vec::new();
        let mut links: Vec<(u64, u64)> = Vec::new();
        // The entries the links replace, whose clusters lose a reference after them.
        let mut frees: Vec<u64> = Vec::new();
        let mut allocated = false;
        let mut done = 0usize;
        for (guest, in_cluster, n) in self.pieces(offset, data.len() as u64) {
            let piece = &data[done..done + n as usize];
            done += n as usize;
            let (l2, l1_idx, l2_idx) = self.l2_slot(st, guest);
            let (l2, fresh) = if l2 != 0 {
                // A table shared with a snapshot is copied before it is changed.
                let l2 = if st.l1[l1_idx] & COPIED == 0 {
                    self.copy_table(st, l1_idx)?
                } else {
                    l2
                };
                self.guard(st, l2, HostUse::L2Table)?;
                (l2, false)
            } else if let Some(&(_, t)) = new_tables.iter().find(|(i, _)| *i == l1_idx) {
                (t, true)
            } else {
                let t = self.alloc(st)?;
                self.file.write_all_at(&vec![0u8; cs as usize], t)?;
                st.l2_tables.insert(t);
                new_tables.push((l1_idx, t));
                allocated = true;
                (t, true)
            };
            let entry_at = l2 + l2_idx * 8;
            let entry = if fresh {
                0
            } else {
                read_u64(&self.file, entry_at)?
            };
            let host = match self.decode(entry) {
                Cluster::Data { host, copied: true } => {
                    self.guard(st, host, HostUse::Data)?;
                    self.data().write_all_at(piece, host + in_cluster)?;
                    continue;
                }
                Cluster::Data {
                    host: old,
                    copied: false,
                } => {
                    // Shared with a snapshot (refcount above 1): copy-on-write into a new
                    // cluster; the shared one loses this reference after the link.
                    let mut whole = vec![0u8; cs as usize];
                    if n < cs {
                        self.read_data(&mut whole, old)?;
                    }
                    whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
                    let host = self.alloc_data(st, guest - in_cluster)?;
                    allocated = true;
                    self.guard(st, host, HostUse::Data)?;
                    self.data().write_all_at(&whole, host)?;
                    links.push((entry_at, host | COPIED));
                    frees.push(entry);
                    continue;
                }
                Cluster::Compressed { entry } => {
                    // Copy-on-write: the decompressed cluster, with the piece over it, in a
                    // new cluster; the compressed one loses this reference after the link.
                    let mut whole = self.decompress(entry)?;
                    whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
                    let host = self.alloc(st)?;
                    allocated = true;
                    self.guard(st, host, HostUse::Data)?;
                    self.file.write_all_at(&whole, host)?;
                    links.push((entry_at, host | COPIED));
                    frees.push(entry);
                    continue;
                }
                Cluster::Unallocated | Cluster::Zero { host: 0 } => {
                    allocated = true;
                    self.alloc_data(st, guest - in_cluster)?
                }
                Cluster::Zero { host } => host,
            };
            self.guard(st, host, HostUse::Data)?;
            // A cluster that read as zeroes, or from the backing file (copy-on-write; not
            // read where the piece covers it): written whole, then pointed at.
            let mut whole = vec![0u8; cs as usize];
            if self.decode(entry) == Cluster::Unallocated && n < cs {
                self.read_backing(&mut whole, guest - in_cluster)?;
            }
            whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
            self.data().write_all_at(&whole, host)?;
            links.push((entry_at, host | COPIED));
        }
        if allocated {
            self.barrier()?;
        }
        for (at, entry) in links {
            self.file.write_all_at(&entry.to_be_bytes(), at)?;
        }
        for (l1_idx, table) in new_tables {
            let entry = table | COPIED;
            self.file
                .write_all_at(&entry.to_be_bytes(), self.l1_offset + l1_idx as u64 * 8)?;
            st.l1[l1_idx] = entry;
        }
        self.release(st, &frees)
    }

    /// Drops one reference to the clusters of each of `entries`, L2 entries that no longer
    /// point at them: after a barrier, so that a power loss leaks them at worst and never
    /// leaves an entry pointing at a cluster whose refcount has dropped.
    fn release(&self, st: &mut State, entries: &[u64]) -> io::Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        self.barrier()?;
        for &entry in entries {
            self.free_entry(st, entry)?;
        }
        Ok(())
    }

    /// The host range a compressed cluster's entry names: (offset, length in bytes).
    fn compressed_range(&self, entry: u64) -> (u64, u64) {
        let shift = 62 - (self.cluster_bits - 8);
        let offset = entry & ((1 << shift) - 1);
        let sectors = ((entry >> shift) & ((1 << (self.cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// The contents of a compressed cluster: exactly one cluster, however the stream is
    /// crafted (at most two clusters of input are read, and output past the cluster is not
    /// made). Like qemu, a stream that fills the cluster is accepted; one that ends short
    /// of it, or is corrupt, is EIO.
    fn decompress(&self, entry: u64) -> io::Result<Vec<u8>> {
        let (at, len) = self.compressed_range(entry);
        if self.external {
            return Err(io::Error::other(
                "a compressed cluster in an image with an external data file (qemu makes none)",
            ));
        }
        let mut input = vec![0u8; len as usize];
        // The last compressed cluster may end before its last sector does.
        read_some(&self.file, &mut input, at)?;
        let mut out = vec![0u8; self.cluster_size() as usize];
        let bad = |why: String| {
            io::Error::other(format!(
                "compressed cluster at host offset {at:#x} does not decompress: {why}"
            ))
        };
        match self.compression {
            Compression::Zlib => {
                let mut z = flate2::Decompress::new(false);
                z.decompress(&input, &mut out, flate2::FlushDecompress::Finish)
                    .map_err(|e| bad(e.to_string()))?;
                if z.total_out() != out.len() as u64 {
                    return Err(bad(format!("{} bytes, not a cluster", z.total_out())));
                }
            }
            Compression::Zstd => {
                use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
                let mut z = Decoder::new()?;
                let mut inb = InBuffer::around(&input);
                let mut outb = OutBuffer::around(&mut out[..]);
                let mut left = 1;
                while outb.pos() < outb.capacity() {
                    let (was_in, was_out) = (inb.pos(), outb.pos());
                    left = z.run(&mut inb, &mut outb).map_err(|e| bad(e.to_string()))?;
                    if inb.pos() == was_in && outb.pos() == was_out {
                        return Err(bad(format!("{} bytes, not a cluster", outb.pos())));
                    }
                }
                // The frame ends with the cluster (qemu's check): else it held more.
                if left != 0 {
                    return Err(bad("more than a cluster".into()));
                }
            }
        }
        Ok(out)
    }

    /// Copies the L2 table of L1 entry `l1_idx`, shared with a snapshot (no COPIED flag), to
    /// a new cluster that the active L1 table then points at, as qemu does before it changes
    /// such a table (get_cluster_table): the copy durable before the L1 entry, the L1 entry
    /// before the old table loses a reference. The clusters the table points at keep their
    /// refcounts: they already count one reference per L1 table that reaches them.
    fn copy_table(&self, st: &mut State, l1_idx: usize) -> io::Result<u64> {
        let old = st.l1[l1_idx] & OFFSET_MASK;
        let mut table = vec![0u8; self.cluster_size() as usize];
        self.file.read_exact_at(&mut table, old)?;
        let t = self.alloc(st)?;
        self.guard(st, t, HostUse::L2Table)?;
        self.file.write_all_at(&table, t)?;
        st.l2_tables.insert(t);
        self.barrier()?;
        let entry = t | COPIED;
        self.file
            .write_all_at(&entry.to_be_bytes(), self.l1_offset + l1_idx as u64 * 8)?;
        st.l1[l1_idx] = entry;
        self.release(st, &[old | COPIED])?;
        Ok(t)
    }

    /// A new, empty L2 table for L1 entry `l1_idx` (which has none), made reachable at once
    /// (its zeroes and refcount durable first).
    fn new_table(&self, st: &mut State, l1_idx: usize) -> io::Result<u64> {
        let t = self.alloc(st)?;
        self.file
            .write_all_at(&vec![0u8; self.cluster_size() as usize], t)?;
        st.l2_tables.insert(t);
        self.barrier()?;
        let entry = t | COPIED;
        self.file
            .write_all_at(&entry.to_be_bytes(), self.l1_offset + l1_idx as u64 * 8)?;
        st.l1[l1_idx] = entry;
        Ok(t)
    }

    /// Fills `out` with the backing file's bytes from guest offset `at`: zeroes past its end,
    /// or without one.
    fn read_backing(&self, out: &mut [u8], at: u64) -> io::Result<()> {
        let Some(backing) = &self.backing else {
            out.fill(0);
            return Ok(());
        };
        let has = backing.size().saturating_sub(at).min(out.len() as u64) as usize;
        if has > 0 {
            backing.read_at(&mut out[..has], at)?;
        }
        out[has..].fill(0);
        Ok(())
    }

    /// Checks that host cluster `host`, about to be written as `what`, lies off the image's
    /// metadata (qemu's qcow2_check_metadata_overlap: header, L1 table, refcount table,
    /// refcount blocks, and L2 tables for data). If it does not, the image is marked corrupt,
    /// as qemu marks it, and the write fails with EIO.
    fn guard(&self, st: &mut State, host: u64, what: HostUse) -> io::Result<()> {
        let cs = self.cluster_size();
        let on = |at: u64, len: u64| host < at.saturating_add(len) && at < host + cs;
        let lies_on = if !host.is_multiple_of(cs) {
            Some("an unaligned offset")
        } else if self.external && what == HostUse::Data {
            // Data in an external data file lies off this file's metadata.
            None
        } else if on(0, cs) {
            Some("the header")
        } else if on(self.l1_offset, st.l1.len() as u64 * 8) {
            Some("the L1 table")
        } else if on(st.refcount_table_offset, st.refcount_table.len() as u64 * 8) {
            Some("the refcount table")
        } else if st.refcount_blocks.contains(&host) {
            Some("a refcount block")
        } else if what == HostUse::Data && st.l2_tables.contains(&host) {
            Some("an L2 table")
        } else {
            None
        };
        let Some(lies_on) = lies_on else {
            return Ok(());
        };
        let what = match what {
            HostUse::Data => "data cluster",
            HostUse::L2Table => "L2 table",
        };
        let why = format!("a {what} at host offset {host:#x} lies on {lies_on}");
        tracing::error!("qcow2 image corrupt, marked so and refusing writes: {why}");
        if !st.corrupt {
            st.corrupt = true;
            let incompat = read_u64(&self.file, 72)? | INCOMPAT_CORRUPT;
            self.file.write_all_at(&incompat.to_be_bytes(), 72)?;
            self.file.sync_data()?;
        }
        Err(io::Error::other(format!("qcow2 image is corrupt: {why}")))
    }

    /// A write barrier (fdatasync): what was written before is durable before what is
    /// written after.
    fn barrier(&self) -> io::Result<()> {
        #[cfg(test)]
        self.barriers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(data) = &self.data {
            data.sync_data()?;
        }
        self.file.sync_data()
    }

    /// A host cluster for the data of guest cluster `guest`: in an external data file, the
    /// guest offset itself, not refcounted (as qemu places them); else a new cluster.
    fn alloc_data(&self, st: &mut State, guest: u64) -> io::Result<u64> {
        if self.external {
            Ok(guest)
        } else {
            self.alloc(st)
        }
    }

    /// Reads data cluster bytes at host offset `at`: past the end of an external data file,
    /// zeroes (qemu creates it sparse, but another tool may have left it short).
    fn read_data(&self, out: &mut [u8], at: u64) -> io::Result<()> {
        if self.data.is_none() {
            return self.file.read_exact_at(out, at);
        }
        let n = read_some(self.data(), out, at)?;
        out[n..].fill(0);
        Ok(())
    }

    /// Zeroes `[at, at + len)` of the raw external data file.
    fn zero_data(&self, at: u64, len: u64) -> io::Result<()> {
        zero_file(self.data(), at, len)
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

    /// WRITE_ZEROES and TRIM: whole clusters get the zero flag (keeping their allocation);
    /// the partial ones at the ends are written with zeroes unless they read as zero already.
    /// A range without an L2 table reads as zeroes already and is skipped whole; each table
    /// met is read once and written back once.
    pub fn zero_range(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, len, self.size)?;
        let cs = self.cluster_size();
        let end = offset + len;
        let mut st = self.state.lock();
        refuse_if_corrupt(&st)?;
        if self.data_raw {
            // The raw data file is the disk: it reads as zeroes too.
            self.zero_data(offset, len)?;
        }
        let mut pos = offset;
        while pos < end {
            let span_end = (pos / self.l2_span() + 1)
                .saturating_mul(self.l2_span())
                .min(end);
            let (mut l2, l1_idx, first_idx) = self.l2_slot(&st, pos);
            if l2 == 0 {
                if self.backing.is_none() {
                    pos = self.next_table(&st, pos, end);
                    continue;
                }
                // Unallocated reads the backing file: zero flags must hide it.
                l2 = self.new_table(&mut st, l1_idx)?;
            }
            let mut table = read_table(&self.file, l2, self.l2_entries() as usize)?;
            let mut changed: Option<(usize, usize)> = None;
            let mut partial = Vec::new();
            let mut frees = Vec::new();
            for (guest, in_cluster, n) in self.pieces(pos, span_end - pos) {
                let idx = (first_idx + (guest - pos + pos % cs) / cs) as usize;
                let cluster = self.decode(table[idx]);
                match cluster {
                    Cluster::Zero { .. } => continue,
                    Cluster::Unallocated if self.backing.is_none() => continue,
                    _ => {}
                }
                // Up to the virtual end counts as whole.
                let whole = in_cluster == 0 && (n == cs || guest + n == self.size);
                if !whole {
                    partial.push((guest, in_cluster, n));
                    continue;
                }
                let v3 = self.version >= 3;
                table[idx] = match cluster {
                    Cluster::Data { host, copied: true } if v3 => host | COPIED | ZERO,
                    Cluster::Data { host, copied: true } => {
                        // Version 2 has no zero flag: the cluster's own bytes are zeroed.
                        self.guard(&mut st, host, HostUse::Data)?;
                        zero_file(self.data(), host, cs)?;
                        continue;
                    }
                    Cluster::Unallocated if v3 => ZERO,
                    _ if !v3 && self.backing.is_some() => {
                        // Unallocated would show the backing file: zeroes are written.
                        partial.push((guest, in_cluster, n));
                        continue;
                    }
                    // Shared or compressed: the entry drops its reference, as qemu's does,
                    // and reads as zero (version 2: unallocated, with no backing file).
                    _ => {
                        frees.push(table[idx]);
                        if v3 { ZERO } else { 0 }
                    }
                };
                changed = Some(changed.map_or((idx, idx), |(lo, _)| (lo, idx)));
            }
            if let Some((lo, hi)) = changed {
                if st.l1[l1_idx] & COPIED == 0 {
                    // Shared with a snapshot: changed in a copy.
                    l2 = self.copy_table(&mut st, l1_idx)?;
                }
                self.guard(&mut st, l2, HostUse::L2Table)?;
                let bytes: Vec<u8> = table[lo..=hi]
                    .iter()
                    .flat_map(|e| e.to_be_bytes())
                    .collect();
                self.file.write_all_at(&bytes, l2 + lo as u64 * 8)?;
            }
            self.release(&mut st, &frees)?;
            // The partial clusters (the range's ends; with version 2 over a backing file, any):
            // entries the write-back left alone.
            for (guest, _, n) in partial {
                self.write_locked(&mut st, &vec![0u8; n as usize], guest)?;
            }
            pos = span_end;
        }
        Ok(())
    }

    /// Data (`false`) and zero (`true`) runs from `offset` for up to `len` bytes, merged,
    /// at most `max` of them. A range without an L2 table is one zero run, however long; at
    /// most [`EXTENT_TABLES`] tables are read per call, so the answer may stop short (the
    /// client asks again from where it ends).
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        let end = offset.saturating_add(len).min(self.size);
        let cs = self.cluster_size();
        // Runs of this image's own: zero, data, or unallocated (the backing file's).
        let mut runs: Vec<(u64, Run)> = Vec::new();
        {
            let st = self.state.lock();
            let push = |runs: &mut Vec<(u64, Run)>, n: u64, run: Run| {
                if let Some((l, r)) = runs.last_mut()
                    && *r == run
                {
                    *l += n;
                    return true;
                }
                if runs.len() == max {
                    return false;
                }
                runs.push((n, run));
                true
            };
            let mut tables_read = 0;
            let mut pos = offset;
            'spans: while pos < end {
                let span_end = (pos / self.l2_span() + 1)
                    .saturating_mul(self.l2_span())
                    .min(end);
                let (l2, _, first_idx) = self.l2_slot(&st, pos);
                if l2 == 0 {
                    let next = self.next_table(&st, pos, end);
                    if !push(&mut runs, next - pos, Run::Unallocated) {
                        break;
                    }
                    pos = next;
                    continue;
                }
                if tables_read == EXTENT_TABLES {
                    break;
                }
                tables_read += 1;
                let table = read_table(&self.file, l2, self.l2_entries() as usize)?;
                for (guest, _, n) in self.pieces(pos, span_end - pos) {
                    let idx = (first_idx + (guest - pos + pos % cs) / cs) as usize;
                    let run = match self.decode(table[idx]) {
                        Cluster::Zero { .. } => Run::Zero,
                        Cluster::Unallocated => Run::Unallocated,
                        Cluster::Data { .. } | Cluster::Compressed { .. } => Run::Data,
                    };
                    if !push(&mut runs, n, run) {
                        break 'spans;
                    }
                }
                pos = span_end;
            }
        }
        // Unallocated runs are what the backing file says they are.
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut push = |n: u64, zero: bool| {
            if let Some((l, z)) = out.last_mut()
                && *z == zero
            {
                *l += n;
                return true;
            }
            if out.len() == max {
                return false;
            }
            out.push((n, zero));
            true
        };
        let mut pos = offset;
        'runs: for (n, run) in runs {
            let run_end = pos + n;
            match (run, &self.backing) {
                (Run::Data, _) => {
                    if !push(n, false) {
                        break;
                    }
                }
                (Run::Zero, _) | (Run::Unallocated, None) => {
                    if !push(n, true) {
                        break;
                    }
                }
                (Run::Unallocated, Some(backing)) => {
                    let mut p = pos;
                    let has = backing.size().clamp(pos, run_end);
                    while p < has {
                        let got = backing.extents(p, has - p)?;
                        if got.iter().all(|e| e.len == 0) {
                            // Said nothing: data, which is always a correct answer.
                            if !push(has - p, false) {
                                break 'runs;
                            }
                            p = has;
                        }
                        for e in got {
                            let e_len = e.len.min(has - p);
                            if e_len == 0 {
                                continue;
                            }
                            if !push(e_len, e.hole) {
                                break 'runs;
                            }
                            p += e_len;
                        }
                    }
                    // Past the backing file's end: zeroes.
                    if has < run_end && !push(run_end - has, true) {
                        break;
                    }
                }
            }
            pos = run_end;
        }
        Ok(out)
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
}

/// A run of clusters as the image itself maps them, for block status.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    Zero,
    Data,
    Unallocated,
}

/// What a host cluster is about to be written as.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HostUse {
    Data,
    L2Table,
}

/// Writes to an image marked corrupt fail with EIO (qemu stops all I/O to it).
fn refuse_if_corrupt(st: &State) -> io::Result<()> {
    if st.corrupt {
        return Err(io::Error::other("qcow2 image is marked corrupt"));
    }
    Ok(())
}

/// L2 tables one block-status answer reads at most (each maps `cluster² / 8` bytes).
const EXTENT_TABLES: usize = 64;

fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "beyond the end of the virtual disk",
        ));
    }
    Ok(())
}

/// Zeroes `[at, at + len)` of `data` (up to its end): holes punched, or zeroes written where
/// the file cannot have holes.
fn zero_file(data: &File, at: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let end = (at + len).min(data.metadata()?.len());
    if end <= at {
        return Ok(());
    }
    // SAFETY: a plain fallocate on a descriptor we own.
    let punched = unsafe {
        libc::fallocate(
            data.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at as libc::off_t,
            (end - at) as libc::off_t,
        )
    } == 0;
    if !punched {
        let zeroes = vec![0u8; (1 << 20).min(end - at) as usize];
        let mut pos = at;
        while pos < end {
            let n = (end - pos).min(zeroes.len() as u64) as usize;
            data.write_all_at(&zeroes[..n], pos)?;
            pos += n as u64;
        }
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
        let q = Qcow2::open(Path::new("t.qcow2"), image(dir.path()), false).unwrap();
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
        let q = Qcow2::open(Path::new("t.qcow2"), f.try_clone().unwrap(), true).unwrap();
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
        let q = Qcow2::open(Path::new("t.qcow2"), f, true).unwrap();
        let err = q.read_at(&mut back, 0).unwrap_err();
        assert!(err.to_string().contains("more than a cluster"), "{err}");
        assert!(q.read_at(&mut back, CS).is_err());
    }
}
