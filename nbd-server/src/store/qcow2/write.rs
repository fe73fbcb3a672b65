//! Writing a qcow2 image: clusters allocated, copied on write (out of the backing file, a
//! compressed cluster, or a cluster shared with a snapshot) and made reachable in qemu's crash
//! order; zeroing and trimming; the overlap check that keeps data off the metadata.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::header::INCOMPAT_CORRUPT;
use super::{COPIED, Cluster, OFFSET_MASK, Qcow2, State, ZERO, check_range, read_table, read_u64};

impl Qcow2 {
    /// Writes `data` at `offset` of the virtual disk, allocating clusters (and copying on write) as needed.
    pub fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.size)?;
        let mut st = self.state.lock();
        refuse_if_corrupt(&st)?;
        st.bitmaps.mark(offset, data.len() as u64);
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
                    self.write_data(piece, host + in_cluster)?;
                    continue;
                }
                Cluster::Data {
                    host: old,
                    copied: false,
                } => {
                    // Shared with a snapshot (refcount above 1): copy-on-write into a new
                    // cluster; the shared one loses this reference after the link.
                    self.guard_freed(st, entry)?;
                    let mut whole = vec![0u8; cs as usize];
                    if n < cs {
                        self.read_data(&mut whole, old)?;
                    }
                    whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
                    let host = self.alloc_data(st, guest - in_cluster)?;
                    allocated = true;
                    self.guard(st, host, HostUse::Data)?;
                    self.write_data(&whole, host)?;
                    links.push((entry_at, host | COPIED));
                    frees.push(entry);
                    continue;
                }
                Cluster::Compressed { entry } => {
                    // Copy-on-write: the decompressed cluster, with the piece over it, in a
                    // new cluster; the compressed one loses this reference after the link.
                    self.guard_freed(st, entry)?;
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
                // Zeroed keeping its allocation, and that cluster ours alone (COPIED; data
                // clusters in an external data file are not refcounted): written in place.
                Cluster::Zero { host } if host != 0 && (entry & COPIED != 0 || self.external) => {
                    host
                }
                Cluster::Zero { host } if host != 0 => {
                    // Zeroed keeping an allocation a snapshot shares (refcount above 1): as
                    // qemu's handle_alloc, a new cluster, zeroes around the piece; the shared
                    // one loses this reference after the link.
                    self.guard_freed(st, entry)?;
                    frees.push(entry);
                    allocated = true;
                    self.alloc_data(st, guest - in_cluster)?
                }
                Cluster::Unallocated | Cluster::Zero { .. } => {
                    allocated = true;
                    self.alloc_data(st, guest - in_cluster)?
                }
            };
            self.guard(st, host, HostUse::Data)?;
            // A cluster that read as zeroes, or from the backing file (copy-on-write; not
            // read where the piece covers it): written whole, then pointed at.
            let mut whole = vec![0u8; cs as usize];
            if self.decode(entry) == Cluster::Unallocated && n < cs {
                self.read_backing(&mut whole, guest - in_cluster)?;
            }
            whole[in_cluster as usize..(in_cluster + n) as usize].copy_from_slice(piece);
            self.write_data(&whole, host)?;
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

    /// Checks that host cluster `host`, about to be written as `what`, lies off the image's
    /// metadata (qemu's qcow2_check_metadata_overlap: header, L1 table, refcount table,
    /// refcount blocks, the snapshot table and the snapshots' inactive L1 tables, the LUKS
    /// header, the dirty bitmaps' directory, tables and bits, and L2 tables for data). If it
    /// does not, the image is marked corrupt,
    /// as qemu marks it, and the write fails with EIO.
    pub(super) fn guard(&self, st: &mut State, host: u64, what: HostUse) -> io::Result<()> {
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
        } else if self.snapshot_metadata.iter().any(|&(at, len)| on(at, len)) {
            Some("an internal snapshot's table")
        } else if self.luks_area.is_some_and(|(at, len)| on(at, len)) {
            Some("the LUKS header")
        } else if what != HostUse::L2Table && st.l2_tables.contains(&host) {
            Some("an L2 table")
        } else if what != HostUse::BitmapFreed && st.bitmaps.lies_on(host, cs) {
            Some("a dirty bitmap's directory, table or bits")
        } else {
            None
        };
        let Some(lies_on) = lies_on else {
            return Ok(());
        };
        let what = match what {
            HostUse::Data => "data cluster",
            HostUse::L2Table => "L2 table",
            HostUse::Freed => "cluster an L2 entry frees",
            HostUse::BitmapFreed => "cluster a dirty bitmap frees",
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

    /// Checks that the host clusters L2 entry `entry` holds a reference to, about to lose
    /// it, lie off the image's metadata: a crafted entry (a compressed one starting in the
    /// header, say) must not drop the refcounts of the header or of tables. If one does not,
    /// the image is marked corrupt as [`guard`](Self::guard) marks it, and the request fails
    /// with EIO before that entry or any refcount changes.
    fn guard_freed(&self, st: &mut State, entry: u64) -> io::Result<()> {
        let cs = self.cluster_size();
        if let Some((first, end)) = self.referenced(entry) {
            for host in (first..end).step_by(cs as usize) {
                self.guard(st, host, HostUse::Freed)?;
            }
        }
        Ok(())
    }

    /// A write barrier (fdatasync): what was written before is durable before what is
    /// written after.
    pub(super) fn barrier(&self) -> io::Result<()> {
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
        st.bitmaps.mark(offset, len);
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
                    // Version 2 has no zero flag: with no backing file the cluster is freed
                    // (below) and reads as zeroes unallocated, as qemu's zeroing discards it;
                    // over a backing file its own bytes are zeroed.
                    Cluster::Data { host, copied: true }
                        if self.backing.is_some() && self.crypt.is_none() =>
                    {
                        self.guard(&mut st, host, HostUse::Data)?;
                        zero_file(self.data(), host, cs)?;
                        continue;
                    }
                    Cluster::Unallocated if v3 => ZERO,
                    _ if !v3 && self.backing.is_some() => {
                        // Unallocated would show the backing file: zeroes are written
                        // (encrypted, in an encrypted image: its zero bytes are not zeroes).
                        partial.push((guest, in_cluster, n));
                        continue;
                    }
                    // Shared or compressed (or, version 2 with no backing file, any): the
                    // entry drops its reference, as qemu's does, and reads as zero (version 2:
                    // unallocated).
                    _ => {
                        self.guard_freed(&mut st, table[idx])?;
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
}

/// What a host cluster is about to be written as.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum HostUse {
    Data,
    L2Table,
    /// A cluster about to lose a data or compressed L2 entry's reference.
    Freed,
    /// A cluster of a dirty bitmap's old table, bits or directory, about to be freed at
    /// close: it must lie off the image's other metadata.
    BitmapFreed,
}

/// Writes to an image marked corrupt fail with EIO (qemu stops all I/O to it); so do
/// writes after the image was closed (its bitmaps stored).
fn refuse_if_corrupt(st: &State) -> io::Result<()> {
    if st.corrupt {
        return Err(io::Error::other("qcow2 image is marked corrupt"));
    }
    if st.closed {
        return Err(io::Error::other("qcow2 image is closed"));
    }
    Ok(())
}

/// Zeroes `[at, at + len)` of `data` (up to its end): holes punched, or zeroes written where
/// the file cannot have holes.
pub(super) fn zero_file(data: &File, at: u64, len: u64) -> io::Result<()> {
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
