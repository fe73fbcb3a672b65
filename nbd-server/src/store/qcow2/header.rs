//! The qcow2 header and tables an image is opened with: parsed, and refused where this
//! server does not handle them, within the bounds qemu puts on crafted headers.

use std::collections::HashSet;
use std::fs::File;
use std::io;

use super::{OFFSET_MASK, be32, be64, read_some, read_table, unsupported};

/// crypt_method: qcow2's legacy AES, and LUKS.
const CRYPT_AES: u32 = 1;
const CRYPT_LUKS: u32 = 2;

/// Incompatible feature bits.
const INCOMPAT_DIRTY: u64 = 1 << 0;
pub(super) const INCOMPAT_CORRUPT: u64 = 1 << 1;
pub(super) const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;
/// Autoclear bit: the external data file is a raw image of the disk.
pub(super) const AUTOCLEAR_DATA_FILE_RAW: u64 = 1 << 1;

/// qemu's bound on an L1 table (QCOW_MAX_L1_SIZE, 32 MiB), in entries.
const MAX_L1_ENTRIES: usize = (32 << 20) / 8;

/// qemu's bound on a refcount table (QCOW_MAX_REFTABLE_SIZE, 8 MiB), in entries.
pub(super) const MAX_REFTABLE_ENTRIES: usize = (8 << 20) / 8;

/// How many bytes of L1 and refcount tables the images of one export (the served one and its
/// backing chain) may hold in memory together. qemu bounds each image's (32 MiB of L1 table,
/// 8 MiB of refcount table), not a chain's; 256 MiB is six images with the largest tables
/// qemu allows, far past what image tools make (a 1 TiB image with 64 KiB clusters has a
/// 16 KiB L1 table and a 64 KiB refcount table).
pub const MAX_CHAIN_TABLE_BYTES: u64 = 256 << 20;

/// qemu's bound on internal snapshots (QCOW_MAX_SNAPSHOTS).
const MAX_SNAPSHOTS: u32 = 65536;
/// qemu's bounds on the snapshot table: its whole size (QCOW_MAX_SNAPSHOTS_SIZE, 1 KiB a
/// snapshot) and one entry's extra data (QCOW_MAX_SNAPSHOT_EXTRA_DATA).
const MAX_SNAPSHOT_TABLE: u64 = 1024 * MAX_SNAPSHOTS as u64;
const MAX_SNAPSHOT_EXTRA: u64 = 1024;
/// The fixed part of a snapshot table entry (QCowSnapshotHeader).
const SNAPSHOT_ENTRY: u64 = 40;

/// The header's fields this server reads.
#[derive(Clone, Copy)]
pub(super) struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub size: u64,
    l1_size: usize,
    pub l1_offset: u64,
    refcount_table_offset: u64,
    refcount_table_clusters: usize,
    nb_snapshots: u32,
    snapshots_offset: u64,
    pub incompat: u64,
    pub autoclear: u64,
    pub refcount_order: u32,
    /// How compressed clusters are compressed.
    pub compression: Compression,
    /// The bitmaps extension's data (offset in the file, length), if the header has one.
    pub bitmaps_ext: Option<(u64, usize)>,
    /// Encrypted with LUKS (crypt_method 2): where its LUKS header lies (at, len), from the
    /// full disk encryption header extension.
    pub luks: Option<Range>,
}

/// What the header names beside the image: its backing file (as written: the caller
/// resolves it) and that file's format (header extension 0xe2792aca), if any.
#[derive(Clone, Debug, Default)]
pub(super) struct Names {
    pub backing: Option<String>,
    pub backing_format: Option<String>,
    /// The external data file (header extension 0x44415441), when the incompatible feature
    /// bit says the data is there.
    pub data_file: Option<String>,
}

const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_DATA_FILE: u32 = 0x4441_5441;
const EXT_CRYPTO_HEADER: u32 = 0x0537_be77;
/// The persistent dirty bitmaps' extension (`bitmaps.rs` reads what it points at).
const EXT_BITMAPS: u32 = 0x2385_2875;

/// The compression type of compressed clusters (header byte 104).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Compression {
    /// Raw deflate (no zlib header), as qemu writes it with window bits -12.
    Zlib,
    Zstd,
}

/// Where some metadata lies in the file: (offset, length).
type Range = (u64, u64);

/// An internal snapshot as the snapshot table names it.
struct Snapshot {
    id: String,
    name: String,
    l1_offset: u64,
    l1_entries: u64,
    /// The virtual disk's size when the snapshot was taken (v3 extra data), if recorded.
    disk_size: Option<u64>,
}

/// Whether `s` is the snapshot qemu-nbd's `--load-snapshot` names with `want`:
/// `snapshot.id=ID`, `snapshot.name=NAME` (either or both, comma-separated), or an ID or a
/// name alone.
fn matches(want: &str, s: &Snapshot) -> bool {
    let mut id = None;
    let mut name = None;
    for part in want.split(',') {
        if let Some(v) = part.strip_prefix("snapshot.id=") {
            id = Some(v);
        } else if let Some(v) = part.strip_prefix("snapshot.name=") {
            name = Some(v);
        }
    }
    if id.is_none() && name.is_none() {
        return s.id == want || s.name == want;
    }
    id.is_none_or(|i| s.id == i) && name.is_none_or(|n| s.name == n)
}

/// An image as it is opened: its header and what was read of its tables.
pub(super) struct Opened {
    pub header: Header,
    pub names: Names,
    pub l1: Vec<u64>,
    pub refcount_table: Vec<u64>,
    pub refcount_table_offset: u64,
    /// The host offsets of the refcount blocks and of the L2 tables.
    pub refcount_blocks: HashSet<u64>,
    pub l2_tables: HashSet<u64>,
    /// Where the internal snapshots' metadata lies (at, len): the snapshot table, then
    /// each snapshot's (inactive) L1 table. Nothing may be written over them.
    pub snapshot_metadata: Vec<(u64, u64)>,
    /// The end of the file, cluster aligned.
    pub next_free: u64,
}

/// Parses the header of `file` (which starts with the qcow2 magic), refuses what this
/// reader does not handle, and reads the L1 and refcount tables (the caller names the file)
/// if they fit in `tables_left` bytes, which they then take from it.
///
/// With `snapshot`, the internal snapshot it names is served instead of the active image: its
/// L1 table is read in place of the active one, and the disk has the snapshot's size.
pub(super) fn read(
    file: &File,
    tables_left: &mut u64,
    snapshot: Option<&str>,
) -> io::Result<Opened> {
    let (mut h, names) = parse(file)?;
    check_features(&h)?;
    let file_len = file.metadata()?.len();
    let (snapshot_metadata, snapshots) = read_snapshots(file, &h, file_len)?;
    if let Some(want) = snapshot {
        // An ID is tried before a name, as qemu does.
        let Some(s) = snapshots
            .iter()
            .find(|s| s.id == want)
            .or_else(|| snapshots.iter().find(|s| matches(want, s)))
        else {
            let names: Vec<String> = snapshots
                .iter()
                .map(|s| format!("{:?} (id {})", s.name, s.id))
                .collect();
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "qcow2 image has no internal snapshot {want:?}; its snapshots: {}",
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                ),
            ));
        };
        // The snapshot's L1 table stands in for the active one: what follows reads and
        // checks it as it would the active table.
        h.size = s.disk_size.unwrap_or(h.size);
        h.l1_offset = s.l1_offset;
        h.l1_size = usize::try_from(s.l1_entries).unwrap_or(usize::MAX);
    }
    let Header {
        cluster_bits,
        size,
        l1_size,
        l1_offset,
        refcount_table_offset,
        refcount_table_clusters,
        ..
    } = h;
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
    let l1_range = (l1_offset, l1_used as u64 * 8);
    let rt_range = (refcount_table_offset, rt_entries as u64 * 8);
    let header = (0, cluster);
    let luks = h.luks.unwrap_or((0, 0));
    check_tables(
        cluster,
        file_len,
        &[
            ("header", header),
            ("L1 table", l1_range),
            ("refcount table", rt_range),
            ("LUKS header", luks),
        ],
    )?;
    let tables = l1_range.1 + rt_range.1;
    if tables > *tables_left {
        return Err(unsupported(format!(
            "has an L1 and a refcount table of {} KiB together, more than the {} KiB left of the {} MiB that the tables of one backing chain may take in memory",
            tables >> 10,
            *tables_left >> 10,
            MAX_CHAIN_TABLE_BYTES >> 20
        )));
    }
    *tables_left -= tables;
    let l1 = read_table(file, l1_offset, l1_used)?;
    let refcount_table = read_table(file, refcount_table_offset, rt_entries)?;
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
            || on_table(luks)
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
    Ok(Opened {
        snapshot_metadata,
        header: h,
        names,
        l1,
        refcount_table,
        refcount_table_offset,
        refcount_blocks,
        l2_tables,
        next_free,
    })
}

/// The header's fields and the names it holds, with the checks that need no others.
fn parse(file: &File) -> io::Result<(Header, Names)> {
    let mut h = vec![0u8; 112];
    let n = read_some(file, &mut h, 0)?;
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
    let backing_offset = be64(&h, 8);
    let backing_len = be32(&h, 16) as u64;
    let cluster_bits = be32(&h, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(unsupported(format!("has cluster_bits {cluster_bits}")));
    }
    let size = be64(&h, 24);
    let crypt_method = be32(&h, 32);
    match crypt_method {
        0 | CRYPT_LUKS => {}
        CRYPT_AES => {
            return Err(unsupported(
                "is encrypted with the legacy AES of qcow2 (crypt_method 1), which qemu refuses for new use: not supported (re-encrypt it with qemu-img convert -O qcow2 -o encrypt.format=luks)",
            ));
        }
        m => return Err(unsupported(format!("has unknown crypt_method {m}"))),
    }
    let l1_size = be32(&h, 36) as usize;
    let l1_offset = be64(&h, 40);
    let refcount_table_offset = be64(&h, 48);
    let refcount_table_clusters = be32(&h, 56) as usize;
    let (incompat, autoclear, refcount_order, header_length) = if version == 3 {
        if n < 104 {
            return Err(unsupported("header is truncated"));
        }
        (be64(&h, 72), be64(&h, 88), be32(&h, 96), be32(&h, 100))
    } else {
        (0, 0, 4, 72)
    };
    // qemu: "qcow2 header too short".
    if version == 3 && header_length < 104 {
        return Err(unsupported(format!(
            "has a header of {header_length} bytes, shorter than version 3's 104"
        )));
    }
    if u64::from(header_length) > 1u64 << cluster_bits {
        // qemu: "qcow2 header exceeds cluster size".
        return Err(unsupported(format!(
            "has a header of {header_length} bytes, longer than its cluster"
        )));
    }
    let nb_snapshots = be32(&h, 60);
    let snapshots_offset = be64(&h, 64);
    // qemu's validate_table for the snapshot table: a bounded count at a cluster-aligned
    // offset.
    if nb_snapshots > MAX_SNAPSHOTS {
        return Err(unsupported(format!(
            "has {nb_snapshots} internal snapshots: more than qemu's limit of {MAX_SNAPSHOTS}"
        )));
    }
    if !snapshots_offset.is_multiple_of(1u64 << cluster_bits) || snapshots_offset > i64::MAX as u64
    {
        return Err(unsupported(format!(
            "has its snapshot table at offset {snapshots_offset:#x}, not cluster aligned"
        )));
    }
    // The compression type is in the header when it is longer than 104 bytes.
    let compression = match (header_length > 104 && n > 104).then(|| h[104]) {
        None | Some(0) => Compression::Zlib,
        Some(1) => Compression::Zstd,
        Some(t) => {
            return Err(unsupported(format!(
                "has unknown compression type {t}: not supported"
            )));
        }
    };
    if compression != Compression::Zlib && incompat & INCOMPAT_COMPRESSION == 0 {
        return Err(unsupported(
            "has a compression type other than zlib without the incompatible feature bit that says so",
        ));
    }
    // The header extensions and the backing file's name lie in the first cluster.
    let cluster = 1u64 << cluster_bits;
    let mut first = vec![0u8; cluster as usize];
    let got = read_some(file, &mut first, 0)?;
    first.truncate(got);
    let mut names = Names::default();
    if backing_offset != 0 {
        // qemu's bound: 1023 bytes, in the first cluster.
        if backing_len > 1023
            || backing_offset
                .checked_add(backing_len)
                .is_none_or(|end| end > got as u64)
        {
            return Err(unsupported(
                "has a backing file name that is too long or lies past its first cluster",
            ));
        }
        let name = &first[backing_offset as usize..(backing_offset + backing_len) as usize];
        names.backing = Some(
            String::from_utf8(name.to_vec())
                .map_err(|_| unsupported("has a backing file name that is not UTF-8"))?,
        );
    }
    let ext_end = if backing_offset != 0 {
        backing_offset as usize
    } else {
        got
    };
    let mut bitmaps_ext = None;
    let mut luks = None;
    let mut at = header_length as usize;
    while at + 8 <= ext_end {
        let (ty, len) = (be32(&first, at), be32(&first, at + 4) as usize);
        if ty == 0 {
            break;
        }
        let data = at + 8;
        if data + len > ext_end {
            return Err(unsupported(format!(
                "has a header extension {ty:#x} past the end of its area"
            )));
        }
        let text = || {
            String::from_utf8(first[data..data + len].to_vec())
                .map_err(|_| unsupported(format!("has a header extension {ty:#x} not in UTF-8")))
        };
        if ty == EXT_BACKING_FORMAT {
            names.backing_format = Some(text()?);
        } else if ty == EXT_DATA_FILE && incompat & INCOMPAT_DATA_FILE != 0 {
            names.data_file = Some(text()?);
        } else if ty == EXT_BITMAPS {
            bitmaps_ext = Some((data as u64, len));
        } else if ty == EXT_CRYPTO_HEADER && crypt_method == CRYPT_LUKS {
            if len != 16 {
                return Err(unsupported(format!(
                    "has a full disk encryption header extension of {len} bytes, not 16"
                )));
            }
            luks = Some((be64(&first, data), be64(&first, data + 8)));
        }
        at = data + len.div_ceil(8) * 8;
    }
    if autoclear & AUTOCLEAR_DATA_FILE_RAW != 0 && incompat & INCOMPAT_DATA_FILE == 0 {
        // qemu: "data-file-raw requires a data file".
        return Err(unsupported(
            "says its data file is raw (data-file-raw) but has no data file",
        ));
    }
    if incompat & INCOMPAT_DATA_FILE != 0 && names.data_file.as_deref().is_none_or(str::is_empty) {
        return Err(unsupported(
            "keeps its data in an external file but does not name it (qemu takes it as the data-file option): not supported",
        ));
    }
    if crypt_method == CRYPT_LUKS {
        // qemu: "Missing crypto header for crypt method 2"; the area's placement is
        // checked with the tables'.
        let Some((at, len)) = luks else {
            return Err(unsupported(
                "is encrypted with LUKS but has no full disk encryption header extension",
            ));
        };
        if len == 0 {
            return Err(unsupported("has an empty LUKS header area"));
        }
        if incompat & INCOMPAT_DATA_FILE != 0 {
            return Err(unsupported(
                "is encrypted and keeps its data in an external file: not supported",
            ));
        }
        luks = Some((at, len));
    }
    let header = Header {
        version,
        cluster_bits,
        size,
        l1_size,
        l1_offset,
        refcount_table_offset,
        refcount_table_clusters,
        nb_snapshots,
        snapshots_offset,
        incompat,
        autoclear,
        refcount_order,
        compression,
        bitmaps_ext,
        luks,
    };
    Ok((header, names))
}

/// Reads the snapshot table as qemu's qcow2_read_snapshots bounds it (the table at most 1 KiB
/// a snapshot, each entry's extra data at most 1 KiB) and returns where the table and each
/// snapshot's L1 table lie, checked as qemu checks an L1 table (cluster aligned, at most
/// qemu's 32 MiB, in the file), so that writes can be kept off them; and the snapshots.
fn read_snapshots(
    file: &File,
    h: &Header,
    file_len: u64,
) -> io::Result<(Vec<Range>, Vec<Snapshot>)> {
    let cluster = 1u64 << h.cluster_bits;
    let mut at = h.snapshots_offset;
    let mut l1s = Vec::new();
    let mut snapshots = Vec::new();
    for i in 0..h.nb_snapshots {
        let mut e = [0u8; SNAPSHOT_ENTRY as usize];
        if read_some(file, &mut e, at)? < e.len() {
            return Err(unsupported(format!(
                "has snapshot {i}'s entry past the end of the file"
            )));
        }
        let (l1_offset, l1_size) = (be64(&e, 0), u64::from(be32(&e, 8)));
        let id_len = u64::from(u16::from_be_bytes([e[12], e[13]]));
        let name_len = u64::from(u16::from_be_bytes([e[14], e[15]]));
        let extra = u64::from(be32(&e, 36));
        if extra > MAX_SNAPSHOT_EXTRA {
            return Err(unsupported(format!(
                "has {extra} bytes of extra data in snapshot {i}'s entry: more than qemu's limit of {MAX_SNAPSHOT_EXTRA}"
            )));
        }
        // Extra data (v3: vm_state_size_large, then disk_size), the ID, the name.
        let mut rest = vec![0u8; (extra + id_len + name_len) as usize];
        if read_some(file, &mut rest, at + SNAPSHOT_ENTRY)? < rest.len() {
            return Err(unsupported(format!(
                "has snapshot {i}'s entry past the end of the file"
            )));
        }
        let disk_size = (extra >= 16).then(|| be64(&rest, 8));
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let id = text(&rest[extra as usize..(extra + id_len) as usize]);
        let name = text(&rest[(extra + id_len) as usize..]);
        at += (SNAPSHOT_ENTRY + extra + id_len + name_len).next_multiple_of(8);
        if at - h.snapshots_offset > MAX_SNAPSHOT_TABLE {
            return Err(unsupported(format!(
                "has a snapshot table larger than qemu's limit of {} MiB",
                MAX_SNAPSHOT_TABLE >> 20
            )));
        }
        if l1_size > MAX_L1_ENTRIES as u64
            || !l1_offset.is_multiple_of(cluster)
            || l1_offset
                .checked_add(l1_size * 8)
                .is_none_or(|end| end > file_len)
        {
            return Err(unsupported(format!(
                "has snapshot {i}'s L1 table of {l1_size} entries at offset {l1_offset:#x}: not cluster aligned, too large or past the end of the file"
            )));
        }
        l1s.push((l1_offset, l1_size * 8));
        snapshots.push(Snapshot {
            id,
            name,
            l1_offset,
            l1_entries: l1_size,
            disk_size,
        });
    }
    if h.nb_snapshots == 0 {
        return Ok((Vec::new(), snapshots));
    }
    let mut ranges = vec![(h.snapshots_offset, at - h.snapshots_offset)];
    ranges.extend(l1s.into_iter().filter(|&(_, len)| len > 0));
    Ok((ranges, snapshots))
}

/// Refuses the features this server does not handle.
fn check_features(h: &Header) -> io::Result<()> {
    let Header {
        incompat,
        refcount_order,
        ..
    } = *h;
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
    if incompat & INCOMPAT_EXTL2 != 0 {
        return Err(unsupported(
            "has extended L2 entries (subclusters): not supported",
        ));
    }
    let unknown = incompat & !(INCOMPAT_COMPRESSION | INCOMPAT_DATA_FILE);
    if unknown != 0 {
        return Err(unsupported(format!(
            "has unknown incompatible features {unknown:#x}"
        )));
    }
    if !(3..=6).contains(&refcount_order) {
        return Err(unsupported(format!(
            "has {}-bit refcounts: not supported (only 8 to 64 bits)",
            1u32 << refcount_order.min(31)
        )));
    }
    Ok(())
}

/// The tables (at, len) lie in the file, cluster aligned, off each other (the header, at
/// 0, is checked as one); those of length 0 are absent.
fn check_tables(cluster: u64, file_len: u64, tables: &[(&str, Range)]) -> io::Result<()> {
    for (i, &(name, (at, len))) in tables.iter().enumerate().skip(1) {
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
        for &(other, (o_at, o_len)) in &tables[..i] {
            if o_len != 0 && at < o_at + o_len && o_at < at + len {
                return Err(unsupported(format!(
                    "has its {name} at offset {at:#x}, which overlaps the {other}"
                )));
            }
        }
    }
    Ok(())
}
