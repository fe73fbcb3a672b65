//! qcow2 images: the subset that `qemu-img create -f qcow2` makes, read and written in place.
//!
//! Supported: version 3 (and version 2 read-only), any cluster size, byte-wide refcounts
//! (8 to 64 bits), no backing file, no encryption, no external data file, no extended L2
//! entries. Reads of compressed clusters fail with EIO (qemu-img convert decompresses).
//! Images with internal snapshots are served read-only only: their clusters are shared and
//! writing them would need copy-on-write.
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

use parking_lot::Mutex;

pub const MAGIC: &[u8; 4] = b"QFI\xfb";

const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COPIED: u64 = 1 << 63;
const COMPRESSED: u64 = 1 << 62;
const ZERO: u64 = 1;

/// Incompatible feature bits.
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// How one cluster of the virtual disk is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cluster {
    /// Reads as zeroes: unallocated, or allocated at `host` with the zero flag.
    Zero {
        host: u64,
    },
    Data {
        host: u64,
        copied: bool,
    },
    Compressed,
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

pub struct Qcow2 {
    file: File,
    version: u32,
    cluster_bits: u32,
    size: u64,
    l1_offset: u64,
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
    /// Parses the header of `file` (which starts with [`MAGIC`]) and refuses what this
    /// reader does not handle (the caller names the file).
    pub fn open(file: File, read_only: bool) -> io::Result<Qcow2> {
        let mut h = vec![0u8; 112];
        let n = read_some(&file, &mut h, 0)?;
        if n < 72 {
            return Err(unsupported("header is truncated"));
        }
        let version = be32(&h, 4);
        if version == 1 {
            return Err(unsupported(
                "is version 1 (qcow): not supported; convert it with qemu-img convert -O qcow2",
            ));
        }
        if version != 2 && version != 3 {
            return Err(unsupported(format!("has unknown version {version}")));
        }
        if be64(&h, 8) != 0 {
            return Err(unsupported(
                "has a backing file: not supported; flatten it with qemu-img convert -O qcow2",
            ));
        }
        let cluster_bits = be32(&h, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(unsupported(format!("has cluster_bits {cluster_bits}")));
        }
        let size = be64(&h, 24);
        if be32(&h, 32) != 0 {
            return Err(unsupported("is encrypted: not supported"));
        }
        let l1_size = be32(&h, 36) as usize;
        let l1_offset = be64(&h, 40);
        let refcount_table_offset = be64(&h, 48);
        let refcount_table_clusters = be32(&h, 56) as usize;
        let nb_snapshots = be32(&h, 60);
        let (incompat, autoclear, refcount_order) = if version == 3 {
            if n < 104 {
                return Err(unsupported("header is truncated"));
            }
            (be64(&h, 72), be64(&h, 88), be32(&h, 96))
        } else {
            (0, 0, 4)
        };
        if incompat & INCOMPAT_DIRTY != 0 {
            return Err(unsupported(
                "is marked dirty (lazy refcounts, not closed cleanly): repair it with qemu-img check -r all",
            ));
        }
        if incompat & INCOMPAT_CORRUPT != 0 {
            return Err(unsupported(
                "is marked corrupt: repair it with qemu-img check -r all",
            ));
        }
        if incompat & INCOMPAT_DATA_FILE != 0 {
            return Err(unsupported(
                "keeps its data in an external file: not supported",
            ));
        }
        if incompat & INCOMPAT_EXTL2 != 0 {
            return Err(unsupported(
                "has extended L2 entries (subclusters): not supported",
            ));
        }
        let unknown = incompat & !INCOMPAT_COMPRESSION;
        if unknown != 0 {
            return Err(unsupported(format!(
                "has unknown incompatible features {unknown:#x}"
            )));
        }
        if !(3..=6).contains(&refcount_order) {
            return Err(unsupported(format!(
                "has {}-bit refcounts: only 8 to 64 are supported",
                1u32 << refcount_order.min(31)
            )));
        }
        if !read_only && version == 2 {
            return Err(unsupported(
                "is version 2 (compat=0.10): served read-only only (add --read-only, or upgrade it with qemu-img amend -o compat=1.1)",
            ));
        }
        if !read_only && nb_snapshots != 0 {
            return Err(unsupported(format!(
                "has {nb_snapshots} internal snapshot(s): served read-only only (add --read-only)"
            )));
        }
        let cluster = 1u64 << cluster_bits;
        let l2_entries = cluster / 8;
        let needed_l1 = size.div_ceil(cluster).div_ceil(l2_entries);
        if l1_size > MAX_L1_ENTRIES {
            return Err(unsupported(format!(
                "has an L1 table of {l1_size} entries: more than qemu's limit of {MAX_L1_ENTRIES} (32 MiB)"
            )));
        }
        if (l1_size as u64) < needed_l1 {
            return Err(unsupported(format!(
                "has an L1 table of {l1_size} entries for {size} bytes"
            )));
        }
        let rt_entries = refcount_table_clusters << cluster_bits >> 3;
        if refcount_table_clusters == 0 || rt_entries > MAX_REFTABLE_ENTRIES {
            return Err(unsupported(format!(
                "has a refcount table of {refcount_table_clusters} clusters: qemu's limit is 8 MiB"
            )));
        }
        // Entries past what the virtual disk needs are never used: they are not read.
        let l1_used = needed_l1 as usize;
        // The tables lie in the file, cluster aligned, off the header and off each other
        // (qemu's validate_table_offset, and more).
        let file_len = file.metadata()?.len();
        let l1_range = (l1_offset, l1_used as u64 * 8);
        let rt_range = (refcount_table_offset, rt_entries as u64 * 8);
        let header = (0, cluster);
        for (name, (at, len), others) in [
            (
                "L1 table",
                l1_range,
                [("header", header), ("refcount table", rt_range)],
            ),
            (
                "refcount table",
                rt_range,
                [("header", header), ("L1 table", l1_range)],
            ),
        ] {
            if len == 0 {
                continue;
            }
            if !at.is_multiple_of(cluster) {
                return Err(unsupported(format!(
                    "has its {name} at offset {at:#x}, not cluster aligned"
                )));
            }
            if at.checked_add(len).is_none_or(|end| end > file_len) {
                return Err(unsupported(format!(
                    "has its {name} at offset {at:#x}, past the end of the file"
                )));
            }
            for (other, (o_at, o_len)) in others {
                if o_len != 0 && at < o_at + o_len && o_at < at + len {
                    return Err(unsupported(format!(
                        "has its {name} at offset {at:#x}, which overlaps the {other}"
                    )));
                }
            }
        }
        let l1 = read_table(&file, l1_offset, l1_used)?;
        let refcount_table = read_table(&file, refcount_table_offset, rt_entries)?;
        let mut refcount_blocks = HashSet::new();
        for e in &refcount_table {
            let block = e & OFFSET_MASK;
            if block == 0 {
                continue;
            }
            let on_table = |(at, len): (u64, u64)| block < at + len && at < block + cluster;
            if !block.is_multiple_of(cluster)
                || on_table(header)
                || on_table(l1_range)
                || on_table(rt_range)
            {
                return Err(unsupported(format!(
                    "has a refcount block at offset {block:#x}, on its header or tables: repair it with qemu-img check -r all"
                )));
            }
            refcount_blocks.insert(block);
        }
        let l2_tables = l1
            .iter()
            .map(|e| e & OFFSET_MASK)
            .filter(|&t| t != 0)
            .collect();
        let next_free = file_len.div_ceil(cluster) * cluster;
        let q = Qcow2 {
            file,
            version,
            cluster_bits,
            size,
            l1_offset,
            refcount_bytes: 1 << (refcount_order - 3),
            state: Mutex::new(State {
                l1,
                refcount_table,
                refcount_table_offset,
                refcount_blocks,
                l2_tables,
                next_free,
                corrupt: false,
            }),
            #[cfg(test)]
            barriers: Default::default(),
        };
        // Autoclear features (bitmaps, a raw external data file) describe data that a writer
        // who does not know them would make stale: such a writer clears them, as qemu does.
        if !read_only && autoclear != 0 {
            q.file.write_all_at(&0u64.to_be_bytes(), 88)?;
            q.file.sync_data()?;
        }
        Ok(q)
    }

    /// The virtual disk's size.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn file(&self) -> &File {
        &self.file
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
            return Cluster::Compressed;
        }
        let host = entry & OFFSET_MASK;
        if host == 0 || (self.version >= 3 && entry & ZERO != 0) {
            Cluster::Zero { host }
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
            return Ok(Cluster::Zero { host: 0 });
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
                Cluster::Data { host, .. } => self.file.read_exact_at(out, host + in_cluster)?,
                Cluster::Compressed => {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        format!(
                            "compressed cluster at guest offset {guest}: not supported (decompress with qemu-img convert -O qcow2)"
                        ),
                    ));
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
        let mut allocated = false;
        let mut done = 0usize;
        for (guest, in_cluster, n) in self.pieces(offset, data.len() as u64) {
            let piece = &data[done..done + n as usize];
            done += n as usize;
            let (l2, l1_idx, l2_idx) = self.l2_slot(st, guest);
            let (l2, fresh) = if l2 != 0 {
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
                    self.file.write_all_at(piece, host + in_cluster)?;
                    continue;
                }
                Cluster::Data { copied: false, .. } => {
                    return Err(io::Error::other(
                        "cluster shared with a snapshot: copy-on-write is not supported",
                    ));
                }
                Cluster::Compressed => {
                    return Err(io::Error::other(
                        "writing into a compressed cluster is not supported",
                    ));
                }
                Cluster::Zero { host: 0 } => {
                    allocated = true;
                    self.alloc(st)?
                }
                Cluster::Zero { host } => host,
            };
            self.guard(st, host, HostUse::Data)?;
            // A cluster that read as zeroes: written whole, then pointed at.
            let mut whole = vec![0u8; cs as usize];
            whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
            self.file.write_all_at(&whole, host)?;
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

    /// Allocates one cluster at the end of the file, with refcount 1. The caller writes it
    /// whole.
    fn alloc(&self, st: &mut State) -> io::Result<u64> {
        let at = st.next_free;
        st.next_free += self.cluster_size();
        self.set_refcount(st, at, 1)?;
        Ok(at)
    }

    /// Clusters one refcount block counts.
    fn refcounts_per_block(&self) -> u64 {
        self.cluster_size() / self.refcount_bytes as u64
    }

    /// The refcount table index of the block that counts host cluster `host`.
    fn block_index(&self, host: u64) -> usize {
        ((host >> self.cluster_bits) / self.refcounts_per_block()) as usize
    }

    /// Writes the refcount of host cluster `host` into refcount block `block`.
    fn write_refcount(&self, block: u64, host: u64, value: u64) -> io::Result<()> {
        let ci = host >> self.cluster_bits;
        let w = self.refcount_bytes;
        let bytes = value.to_be_bytes();
        self.file.write_all_at(
            &bytes[8 - w..],
            block + (ci % self.refcounts_per_block()) * w as u64,
        )
    }

    fn set_refcount(&self, st: &mut State, host: u64, value: u64) -> io::Result<()> {
        let cs = self.cluster_size();
        let bi = self.block_index(host);
        if bi >= st.refcount_table.len() {
            self.grow_refcount_table(st, bi)?;
        }
        let mut block = st.refcount_table[bi] & OFFSET_MASK;
        if block == 0 {
            // A new refcount block, at the end of the file; it counts itself when it falls in
            // its own range, or is counted by the next block otherwise.
            block = st.next_free;
            st.next_free += cs;
            let mut fresh = vec![0u8; cs as usize];
            if self.block_index(block) == bi {
                let at = ((block >> self.cluster_bits) % self.refcounts_per_block()) as usize
                    * self.refcount_bytes;
                fresh[at + self.refcount_bytes - 1] = 1;
            } else {
                self.set_refcount(st, block, 1)?;
            }
            self.file.write_all_at(&fresh, block)?;
            st.refcount_blocks.insert(block);
            // The block (and its own count) is durable before the refcount table points at
            // it, as qemu orders it (alloc_refcount_block): else a power loss could leave the
            // table pointing at garbage.
            self.barrier()?;
            self.file.write_all_at(
                &block.to_be_bytes(),
                st.refcount_table_offset + bi as u64 * 8,
            )?;
            st.refcount_table[bi] = block;
        }
        self.write_refcount(block, host, value)
    }

    /// Grows the refcount table so that it has an entry for refcount block `bi`, as qemu
    /// does (qcow2-refcount.c, qcow2_refcount_area): a new, larger table, followed by the
    /// refcount blocks that count it, is written at the end of the file and flushed; then
    /// one header write points at it (and is flushed); the old table's clusters are freed
    /// last. A crash at any point leaves either table in force, and leaks clusters at worst.
    fn grow_refcount_table(&self, st: &mut State, bi: usize) -> io::Result<()> {
        let cs = self.cluster_size();
        let per_cluster = (cs / 8) as usize;
        let start = st.next_free;
        let old_len = st.refcount_table.len();
        let has_block = |table: &[u64], b: usize| b < table.len() && table[b] & OFFSET_MASK != 0;
        // The layout: the table's clusters at `start`, then the blocks its area lacks.
        let mut entries = (old_len + old_len / 2).max(bi + 1);
        let (table_clusters, end) = loop {
            entries = entries.div_ceil(per_cluster) * per_cluster;
            let table_clusters = (entries / per_cluster) as u64;
            let mut new_blocks = 0u64;
            let end = loop {
                let end = start + (table_clusters + new_blocks) * cs;
                let missing = (self.block_index(start)..=self.block_index(end - 1))
                    .filter(|&b| !has_block(&st.refcount_table, b))
                    .count() as u64;
                if missing <= new_blocks {
                    break end;
                }
                new_blocks = missing;
            };
            let last = self.block_index(end - 1);
            if last < entries {
                break (table_clusters, end);
            }
            entries = last + 1 + entries / 2;
        };
        if entries > MAX_REFTABLE_ENTRIES {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "the qcow2 refcount table would outgrow qemu's limit (8 MiB)",
            ));
        }
        let mut table = st.refcount_table.clone();
        table.resize(entries, 0);
        let mut next_block = start + table_clusters * cs;
        for b in self.block_index(start)..=self.block_index(end - 1) {
            if !has_block(&table, b) {
                self.file
                    .write_all_at(&vec![0u8; cs as usize], next_block)?;
                table[b] = next_block;
                st.refcount_blocks.insert(next_block);
                next_block += cs;
            }
        }
        debug_assert_eq!(next_block, end);
        // The new area counts itself, in its new blocks or in old ones that cover it.
        for host in (start..end).step_by(cs as usize) {
            self.write_refcount(table[self.block_index(host)] & OFFSET_MASK, host, 1)?;
        }
        let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.file.write_all_at(&bytes, start)?;
        self.barrier()?;
        // refcount_table_offset and refcount_table_clusters, in one write.
        let mut fields = [0u8; 12];
        fields[..8].copy_from_slice(&start.to_be_bytes());
        fields[8..].copy_from_slice(&(table_clusters as u32).to_be_bytes());
        self.file.write_all_at(&fields, 48)?;
        self.barrier()?;
        let old_at = st.refcount_table_offset;
        let old_clusters = (old_len * 8) as u64 / cs;
        st.refcount_table = table;
        st.refcount_table_offset = start;
        st.next_free = end;
        for i in 0..old_clusters {
            self.set_refcount(st, old_at + i * cs, 0)?;
        }
        Ok(())
    }

    /// A write barrier (fdatasync): what was written before is durable before what is
    /// written after.
    fn barrier(&self) -> io::Result<()> {
        #[cfg(test)]
        self.barriers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.file.sync_data()
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
        let mut pos = offset;
        while pos < end {
            let span_end = (pos / self.l2_span() + 1)
                .saturating_mul(self.l2_span())
                .min(end);
            let (l2, _, first_idx) = self.l2_slot(&st, pos);
            if l2 == 0 {
                pos = self.next_table(&st, pos, end);
                continue;
            }
            let mut table = read_table(&self.file, l2, self.l2_entries() as usize)?;
            let mut changed: Option<(usize, usize)> = None;
            let mut partial = Vec::new();
            for (guest, in_cluster, n) in self.pieces(pos, span_end - pos) {
                let idx = (first_idx + (guest - pos + pos % cs) / cs) as usize;
                let cluster = self.decode(table[idx]);
                if let Cluster::Zero { .. } = cluster {
                    continue;
                }
                // Up to the virtual end counts as whole.
                let whole = in_cluster == 0 && (n == cs || guest + n == self.size);
                if !whole {
                    partial.push((guest, in_cluster, n));
                    continue;
                }
                table[idx] = match cluster {
                    Cluster::Data { host, copied: true } => host | COPIED | ZERO,
                    // Shared or compressed: drop the reference (leaking it) rather than
                    // change what a snapshot sees.
                    _ => ZERO,
                };
                changed = Some(changed.map_or((idx, idx), |(lo, _)| (lo, idx)));
            }
            if let Some((lo, hi)) = changed {
                self.guard(&mut st, l2, HostUse::L2Table)?;
                let bytes: Vec<u8> = table[lo..=hi]
                    .iter()
                    .flat_map(|e| e.to_be_bytes())
                    .collect();
                self.file.write_all_at(&bytes, l2 + lo as u64 * 8)?;
            }
            // The partial clusters are the range's ends: entries the write-back left alone.
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
        let st = self.state.lock();
        let mut out: Vec<(u64, bool)> = Vec::new();
        // Extends the last run or starts one; false when `max` runs are full.
        let push = |out: &mut Vec<(u64, bool)>, n: u64, zero: bool| {
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
        let mut tables_read = 0;
        let mut pos = offset;
        'spans: while pos < end {
            let span_end = (pos / self.l2_span() + 1)
                .saturating_mul(self.l2_span())
                .min(end);
            let (l2, _, first_idx) = self.l2_slot(&st, pos);
            if l2 == 0 {
                let next = self.next_table(&st, pos, end);
                if !push(&mut out, next - pos, true) {
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
                let zero = matches!(self.decode(table[idx]), Cluster::Zero { .. });
                if !push(&mut out, n, zero) {
                    break 'spans;
                }
            }
            pos = span_end;
        }
        Ok(out)
    }
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

/// qemu's bound on an L1 table (QCOW_MAX_L1_SIZE, 32 MiB), in entries.
const MAX_L1_ENTRIES: usize = (32 << 20) / 8;

/// qemu's bound on a refcount table (QCOW_MAX_REFTABLE_SIZE, 8 MiB), in entries.
const MAX_REFTABLE_ENTRIES: usize = (8 << 20) / 8;

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

/// What the first bytes of an image say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    Raw,
    Qcow2,
    /// A format this server does not serve, by its usual name.
    Other(&'static str),
}

/// Probes a file's format from its first bytes, as qemu does: qcow2 by its magic, the
/// formats we do not serve by theirs, anything else raw.
pub fn probe(head: &[u8]) -> Probed {
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    if at(0, MAGIC) {
        return if head.len() >= 8 && be32(head, 4) == 1 {
            Probed::Other("qcow (version 1)")
        } else {
            Probed::Qcow2
        };
    }
    const OTHERS: &[(usize, &[u8], &str)] = &[
        (0, b"KDMV", "vmdk"),
        (0, b"COWD", "vmdk"),
        (0, b"# Disk DescriptorFile", "vmdk"),
        (64, &[0x7f, 0x10, 0xda, 0xbe], "vdi"),
        (0, b"vhdxfile", "vhdx"),
        (0, b"conectix", "vpc (vhd)"),
        (0, b"QED\0", "qed"),
        (0, b"LUKS\xba\xbe", "luks"),
        (0, b"WithoutFreeSpace", "parallels"),
        (0, b"WithouFreSpacExt", "parallels"),
        (0, b"Bochs Virtual HD Image", "bochs"),
        (0, b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop", "cloop"),
    ];
    for (off, magic, name) in OTHERS {
        if at(*off, magic) {
            return Probed::Other(name);
        }
    }
    Probed::Raw
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let q = Qcow2::open(image(dir.path()), false).unwrap();
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
}
