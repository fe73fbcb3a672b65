//! The FUSE filesystem: a directory (inode 1) holding one regular file (inode 2), the export.
//!
//! fuser runs several event-loop threads over the one /dev/fuse connection; every request is
//! handled and answered on the thread that read it, which takes a connection from the
//! [`Backend`]'s pool. Metadata never reaches the server: it is fixed at mount time.

use std::ffi::{OsStr, OsString};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use crate::backend::Backend;

/// Attributes never change while mounted (the export's size is fixed), so the kernel may keep
/// them long.
const TTL: Duration = Duration::from_secs(3600);
const DIR: INodeNo = INodeNo::ROOT;
const FILE: INodeNo = INodeNo(2);

/// Largest FUSE READ/WRITE asked of the kernel (its `fs.fuse.max_pages_limit` caps it; 1 MiB
/// by default).
pub const MAX_IO: u32 = 1 << 20;

pub struct NbdFs {
    backend: Arc<Backend>,
    name: OsString,
    dir: FileAttr,
    file: FileAttr,
}

fn errno(e: i32) -> Errno {
    Errno::from_i32(e)
}

impl NbdFs {
    /// `name`: the file's name in the mount point.
    pub fn new(backend: Arc<Backend>, name: &str) -> NbdFs {
        let now = SystemTime::now();
        // SAFETY: plain getters without arguments.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let caps = *backend.caps();
        let dir = FileAttr {
            ino: DIR,
            size: 0,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind: FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid,
            gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        };
        let file = FileAttr {
            ino: FILE,
            size: caps.size,
            blocks: caps.size / 512,
            kind: FileType::RegularFile,
            perm: if caps.read_only { 0o444 } else { 0o644 },
            nlink: 1,
            ..dir
        };
        NbdFs {
            backend,
            name: name.into(),
            dir,
            file,
        }
    }

    fn attr(&self, ino: INodeNo) -> Option<&FileAttr> {
        match ino {
            DIR => Some(&self.dir),
            FILE => Some(&self.file),
            _ => None,
        }
    }

    fn size(&self) -> u64 {
        self.file.size
    }

    fn read_only(&self) -> bool {
        self.backend.caps().read_only
    }
}

impl Filesystem for NbdFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // On Err the setters report the nearest value the kernel allows: take that one.
        let max_write = config.set_max_write(MAX_IO).map_or_else(
            |max| {
                let _ = config.set_max_write(max);
                max
            },
            |_| MAX_IO,
        );
        let max_readahead = config.set_max_readahead(MAX_IO).map_or_else(
            |max| {
                let _ = config.set_max_readahead(max);
                max
            },
            |_| MAX_IO,
        );
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        tracing::debug!(max_write, max_readahead, "FUSE connection initialised");
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == DIR && name == self.name.as_os_str() {
            reply.entry(&TTL, &self.file, Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, a),
            None => reply.error(Errno::ENOENT),
        }
    }

    /// The size is the export's: truncation to any other size is EINVAL (as for a block
    /// device); ownership and mode cannot change (EPERM); times are accepted and ignored.
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.attr(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if let Some(s) = size {
            if ino != FILE {
                return reply.error(Errno::EISDIR);
            }
            if self.read_only() {
                return reply.error(Errno::EROFS);
            }
            if s != self.size() {
                return reply.error(Errno::EINVAL);
            }
        }
        if mode.is_some_and(|m| m & 0o7777 != u32::from(attr.perm))
            || uid.is_some_and(|u| u != attr.uid)
            || gid.is_some_and(|g| g != attr.gid)
        {
            return reply.error(Errno::EPERM);
        }
        reply.attr(&TTL, attr);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY && self.read_only() {
            return reply.error(Errno::EROFS);
        }
        if flags.0 & libc::O_TRUNC != 0 && self.size() != 0 {
            return reply.error(Errno::EINVAL);
        }
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        let len = u64::from(size).min(self.size().saturating_sub(offset));
        if len == 0 {
            return reply.data(&[]);
        }
        match self.backend.read(offset, len) {
            Ok(buf) => reply.data(&buf),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Writes past the end are ENOSPC; one that straddles the end is short, as on a block
    /// device.
    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if self.read_only() {
            return reply.error(Errno::EROFS);
        }
        let len = (data.len() as u64).min(self.size().saturating_sub(offset));
        if len == 0 {
            return if data.is_empty() {
                reply.written(0)
            } else {
                reply.error(Errno::ENOSPC)
            };
        }
        match self.backend.write(offset, &data[..len as usize]) {
            Ok(()) => reply.written(len as u32),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// close(2): writes already went to the server when they were acknowledged; durability is
    /// fsync's business.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    /// fsync / fdatasync → NBD FLUSH.
    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.backend.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != DIR {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (DIR, FileType::Directory, OsStr::new(".")),
            (DIR, FileType::Directory, OsStr::new("..")),
            (FILE, FileType::RegularFile, self.name.as_os_str()),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks = self.size().div_ceil(4096);
        reply.statfs(blocks, 0, 0, 2, 0, 4096, 255, 4096);
    }

    /// mode 0 / KEEP_SIZE inside the export: the blocks exist already. PUNCH_HOLE → TRIM (then
    /// zeroes wherever the server does not report them); ZERO_RANGE → WRITE_ZEROES. Nothing can
    /// grow the file; other modes are EOPNOTSUPP.
    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        if self.read_only() {
            return reply.error(Errno::EROFS);
        }
        let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let kind = mode & !libc::FALLOC_FL_KEEP_SIZE;
        let end = offset.saturating_add(length);
        if end > self.size() && !keep_size {
            return reply.error(Errno::EOPNOTSUPP);
        }
        let len = end.min(self.size()).saturating_sub(offset);
        let result = match kind {
            0 => Ok(()),
            _ if len == 0 => Ok(()),
            libc::FALLOC_FL_PUNCH_HOLE => self.backend.punch(offset, len),
            libc::FALLOC_FL_ZERO_RANGE => self.backend.zero(offset, len),
            _ => Err(libc::EOPNOTSUPP),
        };
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }
}
