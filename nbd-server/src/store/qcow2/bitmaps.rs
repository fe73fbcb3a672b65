//! A qcow2 image's persistent dirty bitmaps (header extension 0x23852875; qemu's
//! docs/interop/qcow2.txt, "Bitmaps"): the directory and the bitmap tables read and checked
//! as untrusted input within qemu's bounds, every consistent bitmap held in memory, served as
//! `qemu:dirty-bitmap:NAME`, and (writable images) set by every write and stored back at
//! close in qemu's order.
//!
//! As qemu keeps them: a writable open marks every bitmap it loaded "in use" in the
//! directory (in place: the flags word of each entry) before the first write, so that after a
//! crash they read as inconsistent; writes set the bits of the enabled ("auto") ones in
//! memory; a clean close writes the bitmaps that changed to new clusters (data, then table),
//! makes them durable, writes a new directory without the in-use flags, makes it durable,
//! points the header extension at it, and only then frees the old tables and directory. A
//! crash at any point leaves one whole directory in force and leaks clusters at worst. A
//! bitmap found in use (inconsistent) is kept as it is and never served, as qemu does.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::{Qcow2, State, be32, be64, read_table, unsupported};
use crate::store::Dirty;

/// Autoclear bit 0: the bitmaps extension is consistent with the image.
pub(super) const AUTOCLEAR_BITMAPS: u64 = 1;

/// Directory entry flags.
const IN_USE: u32 = 1;
const AUTO: u32 = 2;
const EXTRA_DATA_COMPATIBLE: u32 = 4;
/// The one bitmap type: dirty tracking.
const TYPE_DIRTY: u8 = 1;

/// qemu's bounds (qcow2.h, qcow2-bitmap.c): bitmaps in an image, the directory's size, a
/// table's entries, a bitmap's bytes in memory, a name's length, the granularity.
const MAX_BITMAPS: u32 = 65535;
const MAX_DIRECTORY: u64 = 1024 * MAX_BITMAPS as u64;
const MAX_TABLE_ENTRIES: u64 = 0x800_0000;
const MAX_BITMAP_BYTES: u64 = 0x2000_0000;
const MAX_NAME: usize = 1023;
const GRANULARITY_BITS: std::ops::RangeInclusive<u8> = 9..=31;

/// The fixed part of a directory entry.
const ENTRY: usize = 24;
/// A table entry: a cluster offset (bits 9-55), or with offset 0, bit 0 for all ones.
const TABLE_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
const TABLE_ALL_ONES: u64 = 1;

/// One bitmap of the directory.
pub(super) struct Bitmap {
    name: String,
    flags: u32,
    granularity_bits: u8,
    /// Extra data, kept as it is (only where the entry says it may be).
    extra: Vec<u8>,
    table_offset: u64,
    /// The table's entries as read.
    table: Vec<u64>,
    /// Its entry's place in the directory (for the in-use flag).
    at: u64,
    /// The bits (bit `i` of byte `i / 8` LSB first, as the format has them); None for one
    /// in use when the image was opened: inconsistent, kept as it is and never served.
    bits: Option<Vec<u8>>,
    /// Bits were set since the image was opened: stored at close.
    changed: bool,
}

impl Bitmap {
    fn granularity(&self) -> u64 {
        1 << self.granularity_bits
    }
}

/// The bitmaps of an image, with where their metadata lies.
#[derive(Default)]
pub(super) struct Bitmaps {
    list: Vec<Bitmap>,
    /// The extension's data in the header (nb_bitmaps, reserved, size, offset).
    ext_at: u64,
    dir_offset: u64,
    dir_size: u64,
    /// The clusters that hold bitmap data, and the directory's and tables' ranges (at, len):
    /// metadata no write may land on.
    data_clusters: HashSet<u64>,
    ranges: Vec<(u64, u64)>,
    /// Whether this server marked the bitmaps in use (a writable open) and must store them.
    claimed: bool,
}

/// Why a bitmap cannot be served, as qemu-nbd says it.
pub(super) fn not_found(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("bitmap {name:?} is not found"),
    )
}

fn inconsistent(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "bitmap {name:?} is inconsistent and cannot be used (it was in use when the image was last closed: a crash; qemu-img bitmap --remove deletes it)"
        ),
    )
}

fn crafted(what: String) -> io::Error {
    unsupported(format!("has a bitmap directory that {what}"))
}

/// Reads the bitmaps the extension at `ext` (data offset, length) describes, for a disk of
/// `disk` bytes in clusters of `1 << cluster_bits`, in a file of `file_len` bytes. Their
/// bits count against `mem_left`. Without the extension, or without the autoclear bit that
/// says it is current (a program that knew no bitmaps wrote the image since: qemu ignores
/// them), there are none.
pub(super) fn read(
    file: &File,
    ext: Option<(u64, usize)>,
    autoclear: u64,
    cluster_bits: u32,
    disk: u64,
    file_len: u64,
    mem_left: &mut u64,
) -> io::Result<Bitmaps> {
    let Some((ext_at, ext_len)) = ext else {
        return Ok(Bitmaps::default());
    };
    if autoclear & AUTOCLEAR_BITMAPS == 0 {
        tracing::warn!(
            "qcow2 image: a program lacking bitmap support wrote it, so its bitmaps are ignored"
        );
        return Ok(Bitmaps::default());
    }
    if ext_len != 24 {
        return Err(crafted(format!(
            "extension of {ext_len} bytes instead of 24"
        )));
    }
    let mut e = [0u8; 24];
    file.read_exact_at(&mut e, ext_at)?;
    let (count, reserved) = (be32(&e, 0), be32(&e, 4));
    let (dir_size, dir_offset) = (be64(&e, 8), be64(&e, 16));
    let cs = 1u64 << cluster_bits;
    if reserved != 0 || count == 0 || count > MAX_BITMAPS {
        return Err(crafted(format!(
            "says it holds {count} bitmaps (qemu: 1 to {MAX_BITMAPS}, reserved field 0)"
        )));
    }
    if dir_size > MAX_DIRECTORY
        || !dir_offset.is_multiple_of(cs)
        || dir_offset == 0
        || dir_offset
            .checked_add(dir_size)
            .is_none_or(|e| e > file_len)
    {
        return Err(crafted(format!(
            "of {dir_size} bytes lies at offset {dir_offset:#x}: not cluster aligned, past the end of the file or larger than qemu's {MAX_DIRECTORY} bytes"
        )));
    }
    let mut dir = vec![0u8; dir_size as usize];
    file.read_exact_at(&mut dir, dir_offset)?;
    let mut b = Bitmaps {
        ext_at,
        dir_offset,
        dir_size,
        ranges: vec![(dir_offset, dir_size)],
        ..Bitmaps::default()
    };
    let g = Geometry {
        cluster: cs,
        disk,
        file_len,
    };
    let mut pos = 0usize;
    for i in 0..count {
        let (bitmap, table_size, len) = parse_entry(&dir, pos, i)?;
        if b.list.iter().any(|x| x.name == bitmap.name) {
            return Err(crafted(format!("names bitmap {:?} twice", bitmap.name)));
        }
        pos += len;
        b.load(file, bitmap, table_size, &g, mem_left)?;
    }
    if pos as u64 != dir_size {
        return Err(crafted(format!(
            "has {} bytes past its {count} entries",
            dir_size - pos as u64
        )));
    }
    Ok(b)
}

/// Directory entry `i` at `pos`: the bitmap (its table not read yet), its table's entries
/// and the entry's length.
fn parse_entry(dir: &[u8], pos: usize, i: u32) -> io::Result<(Bitmap, u64, usize)> {
    let short = || crafted(format!("ends inside entry {i}"));
    let head = dir.get(pos..pos + ENTRY).ok_or_else(short)?;
    let table_offset = be64(head, 0);
    let table_size = be32(head, 8);
    let flags = be32(head, 12);
    let (ty, granularity_bits) = (head[16], head[17]);
    let name_len = u16::from_be_bytes([head[18], head[19]]) as usize;
    let extra_len = be32(head, 20) as usize;
    let body = pos + ENTRY;
    let extra = dir
        .get(body..body.checked_add(extra_len).ok_or_else(short)?)
        .ok_or_else(short)?;
    let name = dir
        .get(body + extra_len..body + extra_len + name_len)
        .ok_or_else(short)?;
    let name = String::from_utf8(name.to_vec())
        .map_err(|_| crafted(format!("has entry {i} with a name not in UTF-8")))?;
    let what = |why: &str| crafted(format!("has bitmap {name:?} with {why}"));
    if name.is_empty() || name_len > MAX_NAME {
        return Err(what("an empty name or one longer than qemu's 1023 bytes"));
    }
    if ty != TYPE_DIRTY {
        return Err(what(&format!("type {ty} (only 1, dirty tracking, exists)")));
    }
    if !GRANULARITY_BITS.contains(&granularity_bits) {
        return Err(what(&format!(
            "granularity 2^{granularity_bits} (qemu: 2^9 to 2^31)"
        )));
    }
    if flags & !(IN_USE | AUTO | EXTRA_DATA_COMPATIBLE) != 0 {
        return Err(what(&format!("reserved flags set ({flags:#x})")));
    }
    if extra_len != 0 && flags & EXTRA_DATA_COMPATIBLE == 0 {
        return Err(what(
            "extra data this server does not know and may not ignore",
        ));
    }
    let len = (ENTRY + extra_len + name_len).next_multiple_of(8);
    let bitmap = Bitmap {
        name,
        flags,
        granularity_bits,
        extra: extra.to_vec(),
        table_offset,
        table: Vec::new(),
        at: pos as u64,
        bits: None,
        changed: false,
    };
    Ok((bitmap, u64::from(table_size), len))
}

/// The sizes a bitmap is checked against.
struct Geometry {
    cluster: u64,
    disk: u64,
    file_len: u64,
}

impl Bitmaps {
    /// Reads `bitmap`'s table (`entries` of them, checked as qemu checks them: sized for the
    /// disk, in the file, cluster aligned, reserved bits clear) and, unless it is in use,
    /// its bits, which take their bytes from `mem_left`.
    fn load(
        &mut self,
        file: &File,
        mut bitmap: Bitmap,
        entries: u64,
        g: &Geometry,
        mem_left: &mut u64,
    ) -> io::Result<()> {
        let name = bitmap.name.clone();
        let what = |why: String| crafted(format!("has bitmap {name:?} with {why}"));
        let bytes = g.disk.div_ceil(bitmap.granularity()).div_ceil(8);
        if bytes > MAX_BITMAP_BYTES || entries > MAX_TABLE_ENTRIES {
            return Err(what(format!(
                "{bytes} bytes of bits in a table of {entries} entries: more than qemu's limits (512 MiB, {MAX_TABLE_ENTRIES} entries)"
            )));
        }
        if entries != bytes.div_ceil(g.cluster) {
            return Err(what(format!(
                "a table of {entries} entries for {bytes} bytes of bits"
            )));
        }
        let at = bitmap.table_offset;
        if at == 0
            || !at.is_multiple_of(g.cluster)
            || at.checked_add(entries * 8).is_none_or(|e| e > g.file_len)
        {
            return Err(what(format!(
                "its table at offset {at:#x}: not cluster aligned or past the end of the file"
            )));
        }
        let loaded = bitmap.flags & IN_USE == 0;
        let need = entries * 8 + if loaded { bytes } else { 0 };
        if need > *mem_left {
            return Err(what(format!(
                "{} KiB of table and bits: more than the {} KiB left of what one backing chain may hold in memory",
                need >> 10,
                *mem_left >> 10
            )));
        }
        *mem_left -= need;
        let table = read_table(file, at, entries as usize)?;
        for &e in &table {
            let off = e & TABLE_OFFSET;
            if e & !(TABLE_OFFSET | TABLE_ALL_ONES) != 0
                || (off != 0 && e & TABLE_ALL_ONES != 0)
                || off
                    .checked_add(g.cluster)
                    .is_none_or(|end| end > g.file_len)
            {
                return Err(what(format!(
                    "a table entry {e:#x}: reserved bits set, or data past the end of the file"
                )));
            }
        }
        if loaded {
            let mut bits = vec![0u8; bytes as usize];
            for (chunk, &e) in bits.chunks_mut(g.cluster as usize).zip(&table) {
                match e & TABLE_OFFSET {
                    0 if e & TABLE_ALL_ONES != 0 => chunk.fill(0xff),
                    0 => {}
                    off => file.read_exact_at(chunk, off)?,
                }
            }
            // Bits past the disk's end are zero.
            let used = g.disk.div_ceil(bitmap.granularity());
            if let Some(last) = bits.last_mut()
                && !used.is_multiple_of(8)
            {
                *last &= (1u8 << (used % 8)) - 1;
            }
            bitmap.bits = Some(bits);
        }
        bitmap.table = table;
        self.list.push(bitmap);
        self.index();
        Ok(())
    }

    /// Where the directory, the tables and the bits lie, from the list.
    fn index(&mut self) {
        self.ranges = vec![(self.dir_offset, self.dir_size)];
        self.data_clusters.clear();
        for b in &self.list {
            self.ranges.push((b.table_offset, b.table.len() as u64 * 8));
            self.data_clusters
                .extend(b.table.iter().map(|e| e & TABLE_OFFSET).filter(|&o| o != 0));
        }
    }

    /// Whether the cluster at `host` holds some of the bitmaps' metadata.
    pub(super) fn lies_on(&self, host: u64, cluster: u64) -> bool {
        self.data_clusters.contains(&host)
            || self
                .ranges
                .iter()
                .any(|&(at, len)| len != 0 && host < at.saturating_add(len) && at < host + cluster)
    }

    /// Whether the image has no bitmaps (or ignores them).
    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The bitmap `name`, if the image has it: Err for one that is inconsistent.
    pub(super) fn find(&self, name: &str) -> Option<io::Result<&Bitmap>> {
        let b = self.list.iter().find(|b| b.name == name)?;
        Some(if b.bits.is_some() {
            Ok(b)
        } else {
            Err(inconsistent(name))
        })
    }

    /// A writable open: every bitmap loaded is marked in use in the directory (its flags word
    /// written in place, 4 bytes that no sector boundary splits) and made durable before the
    /// first write, so that a crash leaves them inconsistent rather than wrong.
    pub(super) fn claim(&mut self, file: &File) -> io::Result<()> {
        for b in self.list.iter_mut().filter(|b| b.bits.is_some()) {
            b.flags |= IN_USE;
            file.write_all_at(&b.flags.to_be_bytes(), self.dir_offset + b.at + 12)?;
            self.claimed = true;
        }
        if self.claimed {
            file.sync_data()?;
        }
        Ok(())
    }

    /// A write, zeroing or trim of `[offset, offset + len)`: the bits that cover it are set
    /// in every enabled ("auto") bitmap.
    pub(super) fn mark(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in &mut self.list {
            let g = b.granularity();
            let Some(bits) = b.bits.as_mut().filter(|_| b.flags & AUTO != 0) else {
                continue;
            };
            set_bits(bits, offset / g, (offset + len - 1) / g + 1);
            b.changed = true;
        }
    }

    /// The directory as it is written at close: the bitmaps with their tables, out of use.
    fn directory(&mut self) -> Vec<u8> {
        let mut d = Vec::new();
        for b in &mut self.list {
            b.at = d.len() as u64;
            d.extend(b.table_offset.to_be_bytes());
            d.extend((b.table.len() as u32).to_be_bytes());
            d.extend(b.flags.to_be_bytes());
            d.extend([TYPE_DIRTY, b.granularity_bits]);
            d.extend((b.name.len() as u16).to_be_bytes());
            d.extend((b.extra.len() as u32).to_be_bytes());
            d.extend(&b.extra);
            d.extend(b.name.as_bytes());
            d.resize(d.len().next_multiple_of(8), 0);
        }
        d
    }
}

/// Sets bits `[first, end)`, whole bytes at a time in the middle.
fn set_bits(bits: &mut [u8], first: u64, end: u64) {
    let mut i = first;
    while i < end {
        if i.is_multiple_of(8) && end - i >= 8 {
            let whole = ((end - i) / 8) as usize;
            let at = (i / 8) as usize;
            bits[at..at + whole].fill(0xff);
            i += whole as u64 * 8;
        } else {
            bits[(i / 8) as usize] |= 1 << (i % 8);
            i += 1;
        }
    }
}

impl Bitmap {
    /// Runs of clean and dirty bytes from `offset` to `end` (within the disk), at the
    /// bitmap's granularity and cut at both ends, as qemu-nbd answers: at most `max`.
    pub(super) fn runs(&self, offset: u64, end: u64, max: usize) -> Vec<Dirty> {
        let g = self.granularity();
        let bits = self.bits.as_deref().unwrap_or_default();
        let bit = |i: u64| {
            bits.get((i / 8) as usize)
                .is_some_and(|b| b >> (i % 8) & 1 == 1)
        };
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < max {
            let dirty = bit(pos / g);
            let whole = if dirty { 0xff } else { 0 };
            let mut j = pos / g + 1;
            while j * g < end {
                if j.is_multiple_of(8) && bits.get((j / 8) as usize) == Some(&whole) {
                    j += 8;
                } else if bit(j) == dirty {
                    j += 1;
                } else {
                    break;
                }
            }
            let run_end = (j * g).min(end);
            out.push(Dirty {
                len: run_end - pos,
                dirty,
            });
            pos = run_end;
        }
        out
    }
}

impl Qcow2 {
    /// A clean close: the bitmaps that changed are written to new clusters (bits, then
    /// table), a new directory with every bitmap out of use after them, all made durable;
    /// then the header extension points at the new directory (durable too); then the old
    /// tables, bits and directory lose their references. qemu's order: a crash leaves the
    /// old directory (the bitmaps in use) or the new one in force, and leaks at worst.
    pub(super) fn store_bitmaps(&self, st: &mut State) -> io::Result<()> {
        if !st.bitmaps.claimed {
            return Ok(());
        }
        let cs = self.cluster_size();
        let clusters = |at: u64, len: u64| (at..at + len.div_ceil(cs) * cs).step_by(cs as usize);
        // What loses its reference at the end, checked first: a crafted table must not make
        // us drop the references of the image's other metadata.
        let mut frees: Vec<u64> = clusters(st.bitmaps.dir_offset, st.bitmaps.dir_size).collect();
        for b in st.bitmaps.list.iter().filter(|b| b.changed) {
            frees.extend(clusters(b.table_offset, b.table.len() as u64 * 8));
            frees.extend(b.table.iter().map(|e| e & TABLE_OFFSET).filter(|&o| o != 0));
        }
        for &host in &frees {
            self.guard(st, host, super::write::HostUse::BitmapFreed)?;
        }
        let mut bm = std::mem::take(&mut st.bitmaps);
        let result = self.write_bitmaps(st, &mut bm, cs);
        st.bitmaps = bm;
        result?;
        for host in frees {
            self.unref(st, host)?;
        }
        st.bitmaps.index();
        Ok(())
    }

    /// The new clusters of [`Qcow2::store_bitmaps`], up to the header extension's switch.
    fn write_bitmaps(&self, st: &mut State, bm: &mut Bitmaps, cs: u64) -> io::Result<()> {
        let padded = |mut v: Vec<u8>| {
            v.resize((v.len() as u64).next_multiple_of(cs) as usize, 0);
            v
        };
        for b in &mut bm.list {
            if let Some(bits) = &b.bits
                && b.changed
            {
                let mut table = Vec::new();
                for chunk in bits.chunks(cs as usize) {
                    if chunk.iter().all(|&x| x == 0) {
                        table.push(0);
                        continue;
                    }
                    let at = self.alloc(st)?;
                    self.file.write_all_at(&padded(chunk.to_vec()), at)?;
                    table.push(at);
                }
                let raw: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
                let at = self.alloc_run(st, (raw.len() as u64).div_ceil(cs))?;
                self.file.write_all_at(&padded(raw), at)?;
                b.table = table;
                b.table_offset = at;
                b.changed = false;
            }
            if b.bits.is_some() {
                b.flags &= !IN_USE;
            }
        }
        let dir = bm.directory();
        let dir_at = self.alloc_run(st, (dir.len() as u64).div_ceil(cs))?;
        let dir_size = dir.len() as u64;
        self.file.write_all_at(&padded(dir), dir_at)?;
        self.barrier()?;
        let mut ext = [0u8; 24];
        ext[..4].copy_from_slice(&(bm.list.len() as u32).to_be_bytes());
        ext[8..16].copy_from_slice(&dir_size.to_be_bytes());
        ext[16..].copy_from_slice(&dir_at.to_be_bytes());
        self.file.write_all_at(&ext, bm.ext_at)?;
        self.barrier()?;
        bm.dir_offset = dir_at;
        bm.dir_size = dir_size;
        bm.claimed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bitmap(bits: Vec<u8>, granularity_bits: u8) -> Bitmap {
        Bitmap {
            name: "b".into(),
            flags: AUTO,
            granularity_bits,
            extra: Vec::new(),
            table_offset: 0,
            table: Vec::new(),
            at: 0,
            bits: Some(bits),
            changed: false,
        }
    }

    /// Runs follow the bits LSB first across whole bytes of 0x00 and 0xff, are cut at both
    /// ends of the request, and stop at `max`; setting a range sets its bits and no others.
    #[test]
    fn runs_and_set_bits_follow_the_bits() {
        let mut bits = vec![0u8; 8];
        set_bits(&mut bits, 3, 29);
        assert_eq!(bits[..5], [0xf8, 0xff, 0xff, 0x1f, 0]);
        let b = bitmap(bits, 9);
        let runs = |off, end, max| -> Vec<(u64, bool)> {
            b.runs(off, end, max)
                .into_iter()
                .map(|d| (d.len, d.dirty))
                .collect()
        };
        assert_eq!(
            runs(0, 64 * 512, 10),
            [(3 * 512, false), (26 * 512, true), (35 * 512, false)]
        );
        // Cut inside granules at both ends.
        assert_eq!(
            runs(100, 4 * 512 + 7, 10),
            [(3 * 512 - 100, false), (512 + 7, true)]
        );
        assert_eq!(runs(0, 64 * 512, 1), [(3 * 512, false)]);
    }
}
