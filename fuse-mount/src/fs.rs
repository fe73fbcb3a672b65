//! The filesystem: a directory (node 1) holding one regular file (node 2), the export.
//!
//! `NbdFs::handle` answers one parsed request (`proto::Op`) whichever transport
//! brought it. Its buffers are registered memory ([`Buffers`]): READ data is asked of the
//! server straight into the buffer that goes back to the kernel, WRITE data is sent to the
//! server from the buffer the kernel filled. Metadata never reaches the server: it is fixed at
//! mount time, but for the file's size, which follows the export's (a reconnect may find it
//! resized: [`NbdFs::size_changed`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use qpip_core::MemoryRegion;

use crate::abi::{self, bytes_of, fuse_attr, fuse_in_header};
use crate::export::Export;
use crate::proto::Op;
use nbd_client::MrSlice;
use std::sync::Arc;

/// Attributes change only when the export is found resized, and the kernel is then told
/// ([`NbdFs::size_changed`]), so it may keep them long.
const TTL: Duration = Duration::from_secs(3600);
/// The root directory's inode.
pub const DIR: u64 = abi::ROOT_ID;
/// The export file's inode.
pub const FILE: u64 = 2;

/// Largest FUSE READ/WRITE asked of the kernel (its `fs.fuse.max_pages_limit` caps it; 1 MiB
/// by default).
pub const MAX_IO: u32 = 1 << 20;

/// What a request comes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Success with this many reply bytes at the start of the output buffer.
    Reply(usize),
    /// An errno for the application.
    Error(i32),
    /// The kernel expects no answer (FORGET, INTERRUPT).
    Silent,
}

/// Where a request's bytes are and where its reply goes: offsets into one registered region.
/// On the ring both are the entry's payload buffer (the input is used up before the reply is
/// written); on /dev/fuse they are two halves of the worker's buffer.
pub struct Buffers<'a> {
    /// The registered region holding both.
    pub mr: &'a MemoryRegion,
    /// Where the bytes after the op struct (WRITE data) start.
    pub input: usize,
    /// Bytes of input from `input` on.
    pub input_len: usize,
    /// Where the reply goes, and how much fits.
    pub out: usize,
    /// Reply bytes that fit from `out` on.
    pub out_cap: usize,
}

impl Buffers<'_> {
    /// Copies a small reply struct into the output buffer.
    fn put(&self, bytes: &[u8]) -> Outcome {
        if bytes.len() > self.out_cap {
            return Outcome::Error(libc::EIO);
        }
        self.mr.write_at(self.out, bytes);
        Outcome::Reply(bytes.len())
    }
}

/// The file system: a root directory holding one file, the export.
pub struct NbdFs {
    export: Arc<Export>,
    name: Vec<u8>,
    dir: fuse_attr,
    file: fuse_attr,
    /// The file is opened with FOPEN_DIRECT_IO (`--cache none`).
    direct_io: bool,
    /// The file's node id now: [`FILE`] until the export is found resized under a writeback
    /// cache ([`NbdFs::renew_file_node`]); the earlier ones stay served (files open then).
    file_node: AtomicU64,
}

fn entry_out(attr: &fuse_attr) -> abi::fuse_entry_out {
    abi::fuse_entry_out {
        nodeid: attr.ino,
        generation: 0,
        entry_valid: TTL.as_secs(),
        attr_valid: TTL.as_secs(),
        entry_valid_nsec: 0,
        attr_valid_nsec: 0,
        attr: *attr,
    }
}

impl NbdFs {
    /// `name`: the file's name in the mount point; `direct_io`: the kernel keeps no page
    /// cache for it.
    pub fn new(export: Arc<Export>, name: &str, direct_io: bool) -> NbdFs {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        // SAFETY: plain getters without arguments.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let caps = *export.caps();
        let dir = fuse_attr {
            ino: DIR,
            atime: now.as_secs(),
            mtime: now.as_secs(),
            ctime: now.as_secs(),
            atimensec: now.subsec_nanos(),
            mtimensec: now.subsec_nanos(),
            ctimensec: now.subsec_nanos(),
            mode: libc::S_IFDIR | 0o755,
            nlink: 2,
            uid,
            gid,
            blksize: 4096,
            ..Default::default()
        };
        let file = fuse_attr {
            ino: FILE,
            size: caps.size,
            blocks: caps.size / 512,
            mode: libc::S_IFREG | if caps.read_only { 0o444 } else { 0o644 },
            nlink: 1,
            ..dir
        };
        NbdFs {
            export,
            name: name.as_bytes().to_vec(),
            dir,
            file,
            direct_io,
            file_node: AtomicU64::new(FILE),
        }
    }

    /// The file's name in the mount point.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Whether `ino` is the file: its node id now, or an earlier one still open.
    fn is_file(&self, ino: u64) -> bool {
        (FILE..=self.file_node.load(Ordering::SeqCst)).contains(&ino)
    }

    /// The export was found resized and the kernel keeps the file's size itself (a
    /// writeback cache, where it never takes a size from us for an inode it holds): the
    /// file gets a new node id, which the next lookup of its name returns with the new size
    /// (once the kernel has dropped the name's cached entry). Files open before keep their
    /// old node, and their size. Returns the new node id.
    pub fn renew_file_node(&self) -> u64 {
        self.file_node.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The file's node id now.
    pub fn file_node(&self) -> u64 {
        self.file_node.load(Ordering::SeqCst)
    }

    /// The export behind the file.
    pub fn export(&self) -> &Arc<Export> {
        &self.export
    }

    fn attr(&self, ino: u64) -> Option<fuse_attr> {
        if ino == DIR {
            return Some(self.dir);
        }
        if !self.is_file(ino) {
            return None;
        }
        let size = self.size();
        Some(fuse_attr {
            ino,
            size,
            blocks: size / 512,
            ..self.file
        })
    }

    /// The file's attributes under its node id now.
    fn file_attr(&self) -> fuse_attr {
        self.attr(self.file_node()).unwrap_or(self.file)
    }

    /// The export's size now (a reconnect may have found it resized).
    fn size(&self) -> u64 {
        self.export.size()
    }

    /// The export's size if it differs from `known` (what the kernel was last told): the
    /// caller then drops the kernel's attributes and pages of the file
    /// (`dev::notify_inval_inode`), so that `stat` shows the new size and no byte
    /// past a shrunk end is served from the page cache.
    pub fn size_changed(&self, known: u64) -> Option<u64> {
        let now = self.size();
        (now != known).then_some(now)
    }

    fn read_only(&self) -> bool {
        self.export.caps().read_only
    }

    /// Answers one request (INIT is the transport's business and answered there).
    pub(crate) fn handle(&self, h: &fuse_in_header, op: &Op, buf: &Buffers) -> Outcome {
        use Outcome::{Error, Reply, Silent};
        let ino = h.nodeid;
        match op {
            Op::Forget | Op::Interrupt { .. } => Silent,
            Op::Lookup { name } => {
                if ino == DIR && *name == self.name {
                    buf.put(bytes_of(&entry_out(&self.file_attr())))
                } else {
                    Error(libc::ENOENT)
                }
            }
            Op::Getattr => match self.attr(ino) {
                Some(a) => buf.put(bytes_of(&abi::fuse_attr_out {
                    attr_valid: TTL.as_secs(),
                    attr: a,
                    ..Default::default()
                })),
                None => Error(libc::ENOENT),
            },
            Op::Setattr(s) => match self.setattr(ino, s) {
                Ok(a) => buf.put(bytes_of(&abi::fuse_attr_out {
                    attr_valid: TTL.as_secs(),
                    attr: a,
                    ..Default::default()
                })),
                Err(e) => Error(e),
            },
            Op::Open { flags } => {
                if !self.is_file(ino) {
                    return Error(libc::EISDIR);
                }
                let flags = *flags as i32;
                if flags & libc::O_ACCMODE != libc::O_RDONLY && self.read_only() {
                    return Error(libc::EROFS);
                }
                let open_flags = if self.direct_io {
                    abi::FOPEN_DIRECT_IO | abi::FOPEN_PARALLEL_DIRECT_WRITES
                } else {
                    0
                };
                buf.put(bytes_of(&abi::fuse_open_out {
                    open_flags,
                    ..Default::default()
                }))
            }
            Op::Opendir => {
                if ino != DIR {
                    return Error(libc::ENOTDIR);
                }
                buf.put(bytes_of(&abi::fuse_open_out::default()))
            }
            Op::Read { offset, size } => self.read(ino, *offset, *size, buf),
            Op::Write { offset, size, data } => self.write(ino, *offset, *size, *data, buf),
            // close(2): writes already went to the server when they were acknowledged;
            // durability is fsync's business.
            Op::Flush | Op::Release | Op::Releasedir | Op::Fsyncdir | Op::Access => Reply(0),
            Op::Destroy => Reply(0),
            // fsync / fdatasync → NBD FLUSH.
            Op::Fsync => match self.export.flush() {
                Ok(()) => Reply(0),
                Err(e) => Error(e),
            },
            Op::Readdir { offset, size, plus } => self.readdir(ino, *offset, *size, *plus, buf),
            Op::Statfs => {
                let blocks = self.size().div_ceil(4096);
                buf.put(bytes_of(&abi::fuse_statfs_out {
                    st: abi::fuse_kstatfs {
                        blocks,
                        files: 2,
                        bsize: 4096,
                        namelen: 255,
                        frsize: 4096,
                        ..Default::default()
                    },
                }))
            }
            Op::Fallocate(f) => match self.fallocate(ino, f.offset, f.length, f.mode as i32) {
                Ok(()) => Reply(0),
                Err(e) => Error(e),
            },
            Op::Init(_) | Op::Other(_) => Error(libc::ENOSYS),
        }
    }

    /// The size is the export's. Truncation to 0 is what `open(O_TRUNC)` asks (the kernel
    /// sends it as a SETATTR, FUSE's atomic O_TRUNC being off): accepted and ignored, as a
    /// block device ignores O_TRUNC and as nbdfuse does, so that `dd of=` and `cp` onto the
    /// file work; to any other size EINVAL. Ownership and mode cannot change (EPERM); times
    /// are accepted and ignored.
    fn setattr(&self, ino: u64, s: &abi::fuse_setattr_in) -> Result<fuse_attr, i32> {
        let attr = self.attr(ino).ok_or(libc::ENOENT)?;
        if s.valid & abi::FATTR_SIZE != 0 {
            if !self.is_file(ino) {
                return Err(libc::EISDIR);
            }
            if self.read_only() {
                return Err(libc::EROFS);
            }
            if s.size != self.size() && s.size != 0 {
                return Err(libc::EINVAL);
            }
        }
        if (s.valid & abi::FATTR_MODE != 0 && s.mode & 0o7777 != attr.mode & 0o7777)
            || (s.valid & abi::FATTR_UID != 0 && s.uid != attr.uid)
            || (s.valid & abi::FATTR_GID != 0 && s.gid != attr.gid)
        {
            return Err(libc::EPERM);
        }
        Ok(attr)
    }

    fn read(&self, ino: u64, offset: u64, size: u32, buf: &Buffers) -> Outcome {
        if !self.is_file(ino) {
            return Outcome::Error(libc::EISDIR);
        }
        let len = u64::from(size)
            .min(self.size().saturating_sub(offset))
            .min(buf.out_cap as u64);
        if len == 0 {
            return Outcome::Reply(0);
        }
        // The one check of the buffer range: the client carries the slice down.
        let Ok(into) = MrSlice::new(buf.mr, buf.out, len as usize) else {
            return Outcome::Error(libc::EINVAL);
        };
        match self.export.read_into(offset, into) {
            Ok(()) => Outcome::Reply(len as usize),
            Err(e) => Outcome::Error(e),
        }
    }

    /// Writes past the end are ENOSPC; one that straddles the end is short, as on a block
    /// device.
    fn write(&self, ino: u64, offset: u64, size: u32, data: usize, buf: &Buffers) -> Outcome {
        if !self.is_file(ino) {
            return Outcome::Error(libc::EISDIR);
        }
        if self.read_only() {
            return Outcome::Error(libc::EROFS);
        }
        if data + size as usize > buf.input_len {
            return Outcome::Error(libc::EINVAL);
        }
        let len = u64::from(size).min(self.size().saturating_sub(offset));
        if len == 0 {
            return if size == 0 {
                buf.put(bytes_of(&abi::fuse_write_out::default()))
            } else {
                Outcome::Error(libc::ENOSPC)
            };
        }
        let Ok(from) = MrSlice::new(buf.mr, buf.input + data, len as usize) else {
            return Outcome::Error(libc::EINVAL);
        };
        match self.export.write_from(offset, from) {
            Ok(()) => buf.put(bytes_of(&abi::fuse_write_out {
                size: len as u32,
                padding: 0,
            })),
            Err(e) => Outcome::Error(e),
        }
    }

    fn readdir(&self, ino: u64, offset: u64, size: u32, plus: bool, buf: &Buffers) -> Outcome {
        if ino != DIR {
            return Outcome::Error(libc::ENOTDIR);
        }
        let file = self.file_attr();
        let entries: [(&fuse_attr, &[u8], u32); 3] = [
            (&self.dir, b".", libc::DT_DIR.into()),
            (&self.dir, b"..", libc::DT_DIR.into()),
            (&file, &self.name, libc::DT_REG.into()),
        ];
        let cap = (size as usize).min(buf.out_cap);
        let mut out = Vec::with_capacity(512);
        for (i, (attr, name, typ)) in entries.iter().enumerate().skip(offset as usize) {
            let mut one = Vec::with_capacity(256);
            if plus {
                // "." and ".." carry no entry (node id 0): the kernel skips them.
                let e = if i < 2 {
                    abi::fuse_entry_out::default()
                } else {
                    entry_out(attr)
                };
                one.extend_from_slice(bytes_of(&e));
            }
            one.extend_from_slice(bytes_of(&abi::fuse_dirent {
                ino: attr.ino,
                off: i as u64 + 1,
                namelen: name.len() as u32,
                typ: *typ,
            }));
            one.extend_from_slice(name);
            one.resize(one.len().next_multiple_of(8), 0);
            if out.len() + one.len() > cap {
                break;
            }
            out.extend_from_slice(&one);
        }
        buf.put(&out)
    }

    /// mode 0 / KEEP_SIZE inside the export: the blocks exist already. PUNCH_HOLE → TRIM (then
    /// zeroes wherever the server does not report them); ZERO_RANGE → WRITE_ZEROES. Nothing can
    /// grow the file; other modes are EOPNOTSUPP.
    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), i32> {
        if !self.is_file(ino) {
            return Err(libc::EISDIR);
        }
        if self.read_only() {
            return Err(libc::EROFS);
        }
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let kind = mode & !libc::FALLOC_FL_KEEP_SIZE;
        let end = offset.saturating_add(length);
        if end > self.size() && !keep_size {
            return Err(libc::EOPNOTSUPP);
        }
        let len = end.min(self.size()).saturating_sub(offset);
        match kind {
            0 => Ok(()),
            _ if len == 0 => Ok(()),
            libc::FALLOC_FL_PUNCH_HOLE => self.export.punch(offset, len),
            libc::FALLOC_FL_ZERO_RANGE => self.export.zero(offset, len),
            _ => Err(libc::EOPNOTSUPP),
        }
    }
}
