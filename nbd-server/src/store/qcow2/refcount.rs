//! A qcow2 image's refcounts: allocating clusters at the end of the file, counting them in
//! the refcount blocks, and growing the refcount table when it is full, as qemu does.

use std::io;
use std::os::unix::fs::FileExt;

use super::header::MAX_REFTABLE_ENTRIES;
use super::{OFFSET_MASK, Qcow2, State};

impl Qcow2 {
    /// Allocates one cluster at the end of the file, with refcount 1. The caller writes it
    /// whole.
    pub(super) fn alloc(&self, st: &mut State) -> io::Result<u64> {
        self.alloc_run(st, 1)
    }

    /// Allocates `n` clusters in one piece at the end of the file (a table, a directory),
    /// each with refcount 1; the refcount blocks they need go after them. The caller writes
    /// them whole.
    pub(super) fn alloc_run(&self, st: &mut State, n: u64) -> io::Result<u64> {
        let at = st.next_free;
        st.next_free += n * self.cluster_size();
        for i in 0..n {
            self.set_refcount(st, at + i * self.cluster_size(), 1)?;
        }
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

    /// The refcount of host cluster `host` (0 where no block counts it).
    pub(super) fn refcount(&self, st: &State, host: u64) -> io::Result<u64> {
        let bi = self.block_index(host);
        let block = st.refcount_table.get(bi).map_or(0, |e| e & OFFSET_MASK);
        if block == 0 {
            return Ok(0);
        }
        let ci = host >> self.cluster_bits;
        let w = self.refcount_bytes;
        let mut bytes = [0u8; 8];
        self.file.read_exact_at(
            &mut bytes[8 - w..],
            block + (ci % self.refcounts_per_block()) * w as u64,
        )?;
        Ok(u64::from_be_bytes(bytes))
    }

    /// Drops the reference an L2 entry held, as qemu's qcow2_free_any_cluster does: a
    /// compressed cluster's every host cluster (several compressed clusters may share one),
    /// a data cluster's one. A refcount already at 0 is left so (the image was inconsistent)
    /// and logged.
    pub(super) fn free_entry(&self, st: &mut State, entry: u64) -> io::Result<()> {
        let Some((first, end)) = self.referenced(entry) else {
            return Ok(());
        };
        for host in (first..end).step_by(self.cluster_size() as usize) {
            self.unref(st, host)?;
        }
        Ok(())
    }

    /// Drops one reference to host cluster `host`. A refcount already at 0 is left so (the
    /// image was inconsistent) and logged.
    pub(super) fn unref(&self, st: &mut State, host: u64) -> io::Result<()> {
        match self.refcount(st, host)? {
            0 => tracing::warn!(
                "qcow2 {}: cluster {host:#x} freed with refcount 0 already",
                self.path.display()
            ),
            n => self.set_refcount(st, host, n - 1)?,
        }
        Ok(())
    }

    /// The host clusters an L2 entry holds a reference to, `[first, end)` (cluster aligned
    /// at `first`): a compressed cluster's every host cluster, a data cluster's one; none
    /// for an entry without an offset or for data in an external data file (not refcounted).
    pub(super) fn referenced(&self, entry: u64) -> Option<(u64, u64)> {
        let cs = self.cluster_size();
        if self.external && entry & super::COMPRESSED == 0 {
            return None;
        }
        let (start, len) = if entry & super::COMPRESSED != 0 {
            let (at, len) = self.compressed_range(entry);
            (at & !511, (len + (at & 511)))
        } else {
            (entry & OFFSET_MASK, cs)
        };
        if start == 0 {
            return None;
        }
        Some((start / cs * cs, start + len))
    }

    pub(super) fn set_refcount(&self, st: &mut State, host: u64, value: u64) -> io::Result<()> {
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
}
