//! The kernel's FUSE interface (include/uapi/linux/fuse.h), the parts this mount speaks:
//! message headers, the per-operation structs it reads and writes, the INIT flags, and the
//! FUSE-over-io_uring structs (protocol 7.42+). Sizes and offsets are checked against the
//! kernel header's values in the tests below.
//!
//! Every struct here is plain old data: `repr(C)`, integer fields only, no implicit padding
//! (the tests check that the field sizes add up to the struct size), so any byte pattern is a
//! valid value and [`read`] / [`bytes_of`] are sound.

// The opcodes, flags and structs below keep the kernel's names and are documented where
// they are defined, in include/uapi/linux/fuse.h (the module is the crate's own, so
// missing_docs leaves them be); the layouts are checked by the tests below.
#![allow(non_camel_case_types)]

/// Protocol major version.
pub(crate) const KERNEL_VERSION: u32 = 7;
/// The minor version this implementation speaks (7.42 added FUSE over io_uring).
pub(crate) const KERNEL_MINOR_VERSION: u32 = 42;
/// The root directory's node id.
pub(crate) const ROOT_ID: u64 = 1;
/// The kernel should drop an inode's cached attributes and page-cache range
/// (`fuse_notify_code`'s FUSE_NOTIFY_INVAL_INODE, in the error field of an unsolicited
/// message).
pub(crate) const NOTIFY_INVAL_INODE: i32 = 2;
/// The kernel should drop a name's cached directory entry (FUSE_NOTIFY_INVAL_ENTRY).
pub(crate) const NOTIFY_INVAL_ENTRY: i32 = 3;
/// The smallest read buffer /dev/fuse accepts.
pub(crate) const MIN_READ_BUFFER: usize = 8192;

// Opcodes (enum fuse_opcode).
pub(crate) const LOOKUP: u32 = 1;
pub(crate) const FORGET: u32 = 2;
pub(crate) const GETATTR: u32 = 3;
pub(crate) const SETATTR: u32 = 4;
pub(crate) const OPEN: u32 = 14;
pub(crate) const READ: u32 = 15;
pub(crate) const WRITE: u32 = 16;
pub(crate) const STATFS: u32 = 17;
pub(crate) const RELEASE: u32 = 18;
pub(crate) const FSYNC: u32 = 20;
pub(crate) const FLUSH: u32 = 25;
pub(crate) const INIT: u32 = 26;
pub(crate) const OPENDIR: u32 = 27;
pub(crate) const READDIR: u32 = 28;
pub(crate) const RELEASEDIR: u32 = 29;
pub(crate) const FSYNCDIR: u32 = 30;
pub(crate) const ACCESS: u32 = 34;
pub(crate) const INTERRUPT: u32 = 36;
pub(crate) const DESTROY: u32 = 38;
pub(crate) const BATCH_FORGET: u32 = 42;
pub(crate) const FALLOCATE: u32 = 43;
pub(crate) const READDIRPLUS: u32 = 44;

// INIT flags (fuse_init_in.flags / flags2 << 32).
pub(crate) const ASYNC_READ: u64 = 1 << 0;
pub(crate) const BIG_WRITES: u64 = 1 << 5;
#[cfg(test)]
pub(crate) const DO_READDIRPLUS: u64 = 1 << 13;
pub(crate) const ASYNC_DIO: u64 = 1 << 15;
pub(crate) const WRITEBACK_CACHE: u64 = 1 << 16;
pub(crate) const PARALLEL_DIROPS: u64 = 1 << 18;
pub(crate) const MAX_PAGES: u64 = 1 << 22;
pub(crate) const INIT_EXT: u64 = 1 << 30;
pub(crate) const DIRECT_IO_ALLOW_MMAP: u64 = 1 << 36;
pub(crate) const OVER_IO_URING: u64 = 1 << 41;

// fuse_open_out.open_flags
pub(crate) const FOPEN_DIRECT_IO: u32 = 1 << 0;
pub(crate) const FOPEN_PARALLEL_DIRECT_WRITES: u32 = 1 << 6;

// fuse_setattr_in.valid
pub(crate) const FATTR_MODE: u32 = 1 << 0;
pub(crate) const FATTR_UID: u32 = 1 << 1;
pub(crate) const FATTR_GID: u32 = 1 << 2;
pub(crate) const FATTR_SIZE: u32 = 1 << 3;

// FUSE over io_uring.
pub(crate) const URING_IN_OUT_HEADER_SZ: usize = 128;
pub(crate) const URING_OP_IN_OUT_SZ: usize = 128;
/// enum fuse_uring_cmd
pub(crate) const IO_URING_CMD_REGISTER: u32 = 1;
pub(crate) const IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;

/// Marker for the plain-old-data structs of this module.
///
/// # Safety
/// Implementors are `repr(C)`, made of integers only, without padding.
pub(crate) unsafe trait Pod: Copy + Default + 'static {}

/// Reads a `T` from the start of `b` (None if `b` is too short).
pub(crate) fn read<T: Pod>(b: &[u8]) -> Option<T> {
    if b.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: T is Pod (any bytes are a valid T) and `b` holds enough bytes; read_unaligned
    // does not need alignment.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

/// The bytes of a `T`.
pub(crate) fn bytes_of<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: T is Pod: no padding, so every byte is initialised.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }
}

macro_rules! pod {
    ($($name:ident { $($field:ident : $ty:ty),* $(,)? })*) => {$(
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub(crate) struct $name { $(pub(crate) $field: $ty),* }
        // SAFETY: repr(C), integer fields; the tests check there is no padding.
        unsafe impl Pod for $name {}
        impl $name {
            /// The sum of the field sizes (equal to the struct's size when it has no padding).
            #[cfg(test)]
            pub(crate) const FIELD_BYTES: usize = 0 $(+ size_of::<$ty>())*;
        }
    )*};
}

pod! {
    fuse_in_header {
        len: u32, opcode: u32, unique: u64, nodeid: u64, uid: u32, gid: u32, pid: u32,
        total_extlen: u16, padding: u16,
    }
    fuse_out_header { len: u32, error: i32, unique: u64 }
    fuse_notify_inval_inode_out { ino: u64, off: i64, len: i64 }
    fuse_notify_inval_entry_out { parent: u64, namelen: u32, flags: u32 }
    fuse_init_in {
        major: u32, minor: u32, max_readahead: u32, flags: u32, flags2: u32, unused: [u32; 11],
    }
    fuse_init_out {
        major: u32, minor: u32, max_readahead: u32, flags: u32, max_background: u16,
        congestion_threshold: u16, max_write: u32, time_gran: u32, max_pages: u16,
        map_alignment: u16, flags2: u32, max_stack_depth: u32, request_timeout: u16,
        unused: [u16; 11],
    }
    fuse_attr {
        ino: u64, size: u64, blocks: u64, atime: u64, mtime: u64, ctime: u64, atimensec: u32,
        mtimensec: u32, ctimensec: u32, mode: u32, nlink: u32, uid: u32, gid: u32, rdev: u32,
        blksize: u32, flags: u32,
    }
    fuse_entry_out {
        nodeid: u64, generation: u64, entry_valid: u64, attr_valid: u64,
        entry_valid_nsec: u32, attr_valid_nsec: u32, attr: fuse_attr,
    }
    fuse_attr_out { attr_valid: u64, attr_valid_nsec: u32, dummy: u32, attr: fuse_attr }
    fuse_getattr_in { getattr_flags: u32, dummy: u32, fh: u64 }
    fuse_setattr_in {
        valid: u32, padding: u32, fh: u64, size: u64, lock_owner: u64, atime: u64, mtime: u64,
        ctime: u64, atimensec: u32, mtimensec: u32, ctimensec: u32, mode: u32, unused4: u32,
        uid: u32, gid: u32, unused5: u32,
    }
    fuse_open_in { flags: u32, open_flags: u32 }
    fuse_open_out { fh: u64, open_flags: u32, backing_id: i32 }
    fuse_read_in {
        fh: u64, offset: u64, size: u32, read_flags: u32, lock_owner: u64, flags: u32,
        padding: u32,
    }
    fuse_write_in {
        fh: u64, offset: u64, size: u32, write_flags: u32, lock_owner: u64, flags: u32,
        padding: u32,
    }
    fuse_write_out { size: u32, padding: u32 }
    fuse_release_in { fh: u64, flags: u32, release_flags: u32, lock_owner: u64 }
    fuse_flush_in { fh: u64, unused: u32, padding: u32, lock_owner: u64 }
    fuse_fsync_in { fh: u64, fsync_flags: u32, padding: u32 }
    fuse_fallocate_in { fh: u64, offset: u64, length: u64, mode: u32, padding: u32 }
    fuse_access_in { mask: u32, padding: u32 }
    fuse_interrupt_in { unique: u64 }
    fuse_forget_in { nlookup: u64 }
    fuse_kstatfs {
        blocks: u64, bfree: u64, bavail: u64, files: u64, ffree: u64, bsize: u32,
        namelen: u32, frsize: u32, padding: u32, spare: [u32; 6],
    }
    fuse_statfs_out { st: fuse_kstatfs }
    fuse_dirent { ino: u64, off: u64, namelen: u32, typ: u32 }
    fuse_uring_ent_in_out { flags: u64, commit_id: u64, payload_sz: u32, padding: u32, reserved: u64 }
    fuse_uring_cmd_req { flags: u64, commit_id: u64, qid: u16, padding: [u8; 6] }
}

/// The header part of a ring entry (iov[0] of its REGISTER): the kernel writes
/// `fuse_in_header` into `in_out` and the op struct into `op_in`; the daemon answers with
/// `fuse_out_header` in `in_out` and the reply's length in `ring_ent_in_out.payload_sz`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct fuse_uring_req_header {
    pub in_out: [u8; URING_IN_OUT_HEADER_SZ],
    pub op_in: [u8; URING_OP_IN_OUT_SZ],
    pub ring_ent_in_out: fuse_uring_ent_in_out,
}

impl Default for fuse_uring_req_header {
    fn default() -> Self {
        fuse_uring_req_header {
            in_out: [0; URING_IN_OUT_HEADER_SZ],
            op_in: [0; URING_OP_IN_OUT_SZ],
            ring_ent_in_out: fuse_uring_ent_in_out::default(),
        }
    }
}

// SAFETY: repr(C), byte arrays and a Pod struct; 128 + 128 + 32 bytes without padding.
unsafe impl Pod for fuse_uring_req_header {}

#[cfg(test)]
impl fuse_uring_req_header {
    pub(crate) const FIELD_BYTES: usize = URING_IN_OUT_HEADER_SZ + URING_OP_IN_OUT_SZ + 32;
}

/// The size of the fixed per-operation struct the kernel sends first (the op header, in the
/// ring's `op_in`; on /dev/fuse, right after `fuse_in_header`). The rest (names, write data)
/// follows it on /dev/fuse and is the payload on the ring.
pub(crate) fn op_in_size(opcode: u32) -> usize {
    match opcode {
        INIT => size_of::<fuse_init_in>(),
        GETATTR => size_of::<fuse_getattr_in>(),
        SETATTR => size_of::<fuse_setattr_in>(),
        OPEN | OPENDIR => size_of::<fuse_open_in>(),
        READ | READDIR | READDIRPLUS => size_of::<fuse_read_in>(),
        WRITE => size_of::<fuse_write_in>(),
        RELEASE | RELEASEDIR => size_of::<fuse_release_in>(),
        FLUSH => size_of::<fuse_flush_in>(),
        FSYNC | FSYNCDIR => size_of::<fuse_fsync_in>(),
        FALLOCATE => size_of::<fuse_fallocate_in>(),
        ACCESS => size_of::<fuse_access_in>(),
        INTERRUPT => size_of::<fuse_interrupt_in>(),
        FORGET => size_of::<fuse_forget_in>(),
        // LOOKUP's name, STATFS, DESTROY: no fixed struct (LOOKUP's first argument is empty
        // since the ring transport came, so its name is payload).
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    macro_rules! no_padding {
        ($($t:ident = $size:expr),* $(,)?) => {$(
            assert_eq!(size_of::<$t>(), $size, stringify!($t));
            assert_eq!($t::FIELD_BYTES, $size, concat!(stringify!($t), " has padding"));
        )*};
    }

    /// Sizes from include/uapi/linux/fuse.h (protocol 7.42+, x86_64 and every other ABI: the
    /// header pads everything to 64 bits explicitly).
    #[test]
    fn struct_sizes_match_the_kernel_header() {
        no_padding!(
            fuse_in_header = 40,
            fuse_out_header = 16,
            fuse_notify_inval_inode_out = 24,
            fuse_notify_inval_entry_out = 16,
            fuse_init_in = 64,
            fuse_init_out = 64,
            fuse_attr = 88,
            fuse_entry_out = 128,
            fuse_attr_out = 104,
            fuse_getattr_in = 16,
            fuse_setattr_in = 88,
            fuse_open_in = 8,
            fuse_open_out = 16,
            fuse_read_in = 40,
            fuse_write_in = 40,
            fuse_write_out = 8,
            fuse_release_in = 24,
            fuse_flush_in = 24,
            fuse_fsync_in = 16,
            fuse_fallocate_in = 32,
            fuse_access_in = 8,
            fuse_interrupt_in = 8,
            fuse_forget_in = 8,
            fuse_kstatfs = 80,
            fuse_statfs_out = 80,
            fuse_dirent = 24,
            fuse_uring_ent_in_out = 32,
            fuse_uring_req_header = 288,
            fuse_uring_cmd_req = 24,
        );
    }

    #[test]
    fn field_offsets_match_the_kernel_header() {
        assert_eq!(offset_of!(fuse_in_header, opcode), 4);
        assert_eq!(offset_of!(fuse_in_header, unique), 8);
        assert_eq!(offset_of!(fuse_in_header, nodeid), 16);
        assert_eq!(offset_of!(fuse_in_header, total_extlen), 36);
        assert_eq!(offset_of!(fuse_init_in, flags2), 16);
        assert_eq!(offset_of!(fuse_init_out, max_background), 16);
        assert_eq!(offset_of!(fuse_init_out, max_write), 20);
        assert_eq!(offset_of!(fuse_init_out, max_pages), 28);
        assert_eq!(offset_of!(fuse_init_out, flags2), 32);
        assert_eq!(offset_of!(fuse_init_out, request_timeout), 40);
        assert_eq!(offset_of!(fuse_attr, mode), 60);
        assert_eq!(offset_of!(fuse_attr, blksize), 80);
        assert_eq!(offset_of!(fuse_entry_out, attr), 40);
        assert_eq!(offset_of!(fuse_attr_out, attr), 16);
        assert_eq!(offset_of!(fuse_setattr_in, size), 16);
        assert_eq!(offset_of!(fuse_setattr_in, mode), 68);
        assert_eq!(offset_of!(fuse_setattr_in, uid), 76);
        assert_eq!(offset_of!(fuse_read_in, size), 16);
        assert_eq!(offset_of!(fuse_write_in, size), 16);
        assert_eq!(offset_of!(fuse_fallocate_in, mode), 24);
        assert_eq!(offset_of!(fuse_kstatfs, bsize), 40);
        assert_eq!(offset_of!(fuse_dirent, namelen), 16);
        // The ring structs.
        assert_eq!(offset_of!(fuse_uring_ent_in_out, commit_id), 8);
        assert_eq!(offset_of!(fuse_uring_ent_in_out, payload_sz), 16);
        assert_eq!(offset_of!(fuse_uring_ent_in_out, reserved), 24);
        assert_eq!(offset_of!(fuse_uring_req_header, in_out), 0);
        assert_eq!(offset_of!(fuse_uring_req_header, op_in), 128);
        assert_eq!(offset_of!(fuse_uring_req_header, ring_ent_in_out), 256);
        assert_eq!(offset_of!(fuse_uring_cmd_req, commit_id), 8);
        assert_eq!(offset_of!(fuse_uring_cmd_req, qid), 16);
        // The command area of a 128-byte SQE is 80 bytes: the request fits.
        const { assert!(size_of::<fuse_uring_cmd_req>() <= 80) };
    }

    #[test]
    fn flag_values_match_the_kernel_header() {
        assert_eq!(ASYNC_READ, 0x1);
        assert_eq!(BIG_WRITES, 0x20);
        assert_eq!(ASYNC_DIO, 0x8000);
        assert_eq!(WRITEBACK_CACHE, 0x1_0000);
        assert_eq!(PARALLEL_DIROPS, 0x4_0000);
        assert_eq!(MAX_PAGES, 0x40_0000);
        assert_eq!(INIT_EXT, 0x4000_0000);
        // FUSE_DIRECT_IO_ALLOW_MMAP (1ULL << 36): bit 4 of init flags2.
        assert_eq!(DIRECT_IO_ALLOW_MMAP >> 32, 1 << 4);
        assert_eq!((FOPEN_DIRECT_IO, FOPEN_PARALLEL_DIRECT_WRITES), (0x1, 0x40));
        // FUSE_OVER_IO_URING (1ULL << 41): bit 9 of init flags2.
        assert_eq!(OVER_IO_URING >> 32, 1 << 9);
        assert_eq!(
            (IO_URING_CMD_REGISTER, IO_URING_CMD_COMMIT_AND_FETCH),
            (1, 2)
        );
        assert_eq!(
            (INIT, READ, WRITE, FALLOCATE, READDIRPLUS),
            (26, 15, 16, 43, 44)
        );
    }

    #[test]
    fn read_refuses_short_input_and_round_trips() {
        assert_eq!(read::<fuse_in_header>(&[0u8; 39]), None);
        let h = fuse_in_header {
            len: 40,
            opcode: READ,
            unique: 7,
            ..Default::default()
        };
        assert_eq!(read::<fuse_in_header>(bytes_of(&h)), Some(h));
    }
}
