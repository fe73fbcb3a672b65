//! FUSE requests parsed and INIT negotiated, without I/O: the transports (/dev/fuse in
//! [`crate::dev`], io_uring in [`crate::ring`]) hand over the bytes the kernel wrote, this
//! module says what they ask for.
//!
//! A request is a `fuse_in_header`, the operation's fixed struct ("op in", e.g.
//! `fuse_read_in`) and the rest (a name, WRITE data). On /dev/fuse the three follow each other
//! in one buffer; on the ring the header and the op struct sit in the entry's header area and
//! the rest is the entry's payload. [`parse`] takes the op struct and the rest separately, so
//! it serves both.

use crate::abi::{self, fuse_in_header};

/// A request the kernel sent, by operation. Node ids, file handles and credentials the
/// one-file filesystem does not need are left out; `nodeid` is in the header.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Op {
    /// INIT, with the kernel's offer.
    Init(abi::fuse_init_in),
    /// LOOKUP of a name in a directory.
    Lookup {
        /// The name.
        name: Vec<u8>,
    },
    /// FORGET and BATCH_FORGET: no reply.
    Forget,
    /// GETATTR.
    Getattr,
    /// SETATTR, with what to change.
    Setattr(abi::fuse_setattr_in),
    /// OPEN of the file.
    Open {
        /// The open(2) flags.
        flags: u32,
    },
    /// OPENDIR.
    Opendir,
    /// READ of the file.
    Read {
        /// Offset in the file.
        offset: u64,
        /// Bytes asked for.
        size: u32,
    },
    /// `data` is where the bytes start in the rest (0: right after the op struct).
    Write {
        /// Offset in the file.
        offset: u64,
        /// Bytes to write.
        size: u32,
        /// Where they start after the op struct.
        data: usize,
    },
    /// STATFS.
    Statfs,
    /// RELEASE of the file.
    Release,
    /// RELEASEDIR.
    Releasedir,
    /// FLUSH (close(2) of a descriptor).
    Flush,
    /// FSYNC of the file.
    Fsync,
    /// FSYNCDIR.
    Fsyncdir,
    /// READDIR or READDIRPLUS.
    Readdir {
        /// Entries to skip.
        offset: u64,
        /// Bytes of entries that fit.
        size: u32,
        /// READDIRPLUS (entries with their attributes).
        plus: bool,
    },
    /// ACCESS.
    Access,
    /// INTERRUPT: no reply (the requests are short and are not aborted).
    Interrupt {
        /// The request to interrupt.
        unique: u64,
    },
    /// DESTROY: the kernel is done with the connection.
    Destroy,
    /// FALLOCATE: punch a hole, zero a range, or allocate.
    Fallocate(abi::fuse_fallocate_in),
    /// Anything else: answered ENOSYS.
    Other(u32),
}

/// Why a request could not be parsed (answered EINVAL; the kernel sent something this
/// implementation does not understand).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BadRequest {
    /// Fewer argument bytes than the opcode's struct.
    #[error("opcode {opcode}: {len} bytes of arguments, {want} needed")]
    Short {
        /// The opcode.
        opcode: u32,
        /// Bytes of arguments sent.
        len: usize,
        /// Bytes its struct needs.
        want: usize,
    },
    /// A message shorter than the request header.
    #[error("a message of {0} bytes is shorter than its header")]
    NoHeader(usize),
}

impl Op {
    /// Does the kernel wait for an answer?
    #[cfg(test)]
    pub(crate) fn wants_reply(&self) -> bool {
        !matches!(self, Op::Forget | Op::Interrupt { .. })
    }
}

/// The header of a message from /dev/fuse and the bytes after it.
pub(crate) fn split_message(msg: &[u8]) -> Result<(fuse_in_header, &[u8]), BadRequest> {
    let h: fuse_in_header = abi::read(msg).ok_or(BadRequest::NoHeader(msg.len()))?;
    let end = (h.len as usize).clamp(size_of::<fuse_in_header>(), msg.len());
    Ok((h, &msg[size_of::<fuse_in_header>()..end]))
}

/// Splits the bytes after a /dev/fuse header into the op struct and the rest.
pub(crate) fn split_args(opcode: u32, args: &[u8]) -> Result<(&[u8], &[u8]), BadRequest> {
    let want = abi::op_in_size(opcode);
    if args.len() < want {
        return Err(BadRequest::Short {
            opcode,
            len: args.len(),
            want,
        });
    }
    Ok(args.split_at(want))
}

fn need<T: abi::Pod>(opcode: u32, op_in: &[u8]) -> Result<T, BadRequest> {
    abi::read(op_in).ok_or(BadRequest::Short {
        opcode,
        len: op_in.len(),
        want: size_of::<T>(),
    })
}

/// Parses one request: its opcode, the op struct and the rest (see the module notes).
pub(crate) fn parse(opcode: u32, op_in: &[u8], rest: &[u8]) -> Result<Op, BadRequest> {
    Ok(match opcode {
        abi::INIT => Op::Init(need(opcode, op_in)?),
        abi::LOOKUP => {
            let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            Op::Lookup {
                name: rest[..end].to_vec(),
            }
        }
        abi::FORGET | abi::BATCH_FORGET => Op::Forget,
        abi::GETATTR => Op::Getattr,
        abi::SETATTR => Op::Setattr(need(opcode, op_in)?),
        abi::OPEN => Op::Open {
            flags: need::<abi::fuse_open_in>(opcode, op_in)?.flags,
        },
        abi::OPENDIR => Op::Opendir,
        abi::READ | abi::READDIR | abi::READDIRPLUS => {
            let r: abi::fuse_read_in = need(opcode, op_in)?;
            if opcode == abi::READ {
                Op::Read {
                    offset: r.offset,
                    size: r.size,
                }
            } else {
                Op::Readdir {
                    offset: r.offset,
                    size: r.size,
                    plus: opcode == abi::READDIRPLUS,
                }
            }
        }
        abi::WRITE => {
            let w: abi::fuse_write_in = need(opcode, op_in)?;
            if rest.len() < w.size as usize {
                return Err(BadRequest::Short {
                    opcode,
                    len: rest.len(),
                    want: w.size as usize,
                });
            }
            Op::Write {
                offset: w.offset,
                size: w.size,
                data: 0,
            }
        }
        abi::STATFS => Op::Statfs,
        abi::RELEASE => Op::Release,
        abi::RELEASEDIR => Op::Releasedir,
        abi::FLUSH => Op::Flush,
        abi::FSYNC => Op::Fsync,
        abi::FSYNCDIR => Op::Fsyncdir,
        abi::ACCESS => Op::Access,
        abi::INTERRUPT => Op::Interrupt {
            unique: need::<abi::fuse_interrupt_in>(opcode, op_in)?.unique,
        },
        abi::DESTROY => Op::Destroy,
        abi::FALLOCATE => Op::Fallocate(need(opcode, op_in)?),
        other => Op::Other(other),
    })
}

/// What the mount asks of the connection at INIT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wants {
    /// Largest WRITE the kernel may send.
    pub max_write: u32,
    /// Read-ahead the kernel may do, in bytes.
    pub max_readahead: u32,
    /// Background requests the kernel may have outstanding.
    pub max_background: u16,
    /// Outstanding background requests at which the kernel reports congestion.
    pub congestion_threshold: u16,
    /// Ask for the kernel's writeback cache.
    pub writeback_cache: bool,
    /// The file is opened with FOPEN_DIRECT_IO: ask that it may still be mmap()ed.
    pub direct_io: bool,
    /// Ask for FUSE over io_uring.
    pub io_uring: bool,
}

/// The INIT answer and what was agreed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Agreed {
    /// The INIT answer sent.
    pub(crate) out: abi::fuse_init_out,
    /// Flags the kernel offered (flags | flags2 << 32).
    pub offered: u64,
    /// Flags in the answer.
    pub flags: u64,
    /// The protocol minor version agreed.
    pub minor: u32,
}

impl Agreed {
    /// The answer has `flag`.
    pub fn has(&self, flag: u64) -> bool {
        self.flags & flag != 0
    }

    /// The kernel caches writes and sends them back in batches (`FUSE_WRITEBACK_CACHE`).
    pub fn writeback_cache(&self) -> bool {
        self.has(abi::WRITEBACK_CACHE)
    }
}

/// Why INIT cannot be answered with a working connection.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InitError {
    /// The kernel's protocol version (major, minor) is too old.
    #[error("the kernel speaks FUSE {0}.{1}; this mount needs 7.{min} or later", min = MIN_MINOR)]
    TooOld(u32, u32),
}

/// The oldest protocol minor this mount accepts (7.36: INIT flags2).
pub(crate) const MIN_MINOR: u32 = 36;

/// Does the kernel offer FUSE over io_uring in its INIT request?
pub(crate) fn offers_io_uring(init: &abi::fuse_init_in) -> bool {
    offered_flags(init) & abi::OVER_IO_URING != 0
}

fn offered_flags(init: &abi::fuse_init_in) -> u64 {
    let mut f = u64::from(init.flags);
    if f & abi::INIT_EXT != 0 {
        f |= u64::from(init.flags2) << 32;
    }
    f
}

/// Answers the kernel's INIT: the flags the mount wants that the kernel offers, sizes capped
/// by what the kernel allows (max_readahead can only lower the kernel's value).
pub(crate) fn negotiate(init: &abi::fuse_init_in, want: &Wants) -> Result<Agreed, InitError> {
    if init.major != abi::KERNEL_VERSION || init.minor < MIN_MINOR {
        return Err(InitError::TooOld(init.major, init.minor));
    }
    let offered = offered_flags(init);
    let mut wanted = abi::ASYNC_READ
        | abi::BIG_WRITES
        | abi::ASYNC_DIO
        | abi::PARALLEL_DIROPS
        | abi::MAX_PAGES
        | abi::INIT_EXT;
    if want.writeback_cache {
        wanted |= abi::WRITEBACK_CACHE;
    }
    if want.direct_io {
        wanted |= abi::DIRECT_IO_ALLOW_MMAP;
    }
    if want.io_uring {
        wanted |= abi::OVER_IO_URING;
    }
    let flags = offered & wanted;
    let minor = init.minor.min(abi::KERNEL_MINOR_VERSION);
    let max_pages = want.max_write.div_ceil(4096).clamp(1, u32::from(u16::MAX)) as u16;
    let out = abi::fuse_init_out {
        major: abi::KERNEL_VERSION,
        minor,
        max_readahead: want.max_readahead.min(init.max_readahead),
        flags: flags as u32,
        max_background: want.max_background,
        congestion_threshold: want.congestion_threshold,
        max_write: want.max_write,
        time_gran: 1,
        max_pages,
        flags2: (flags >> 32) as u32,
        ..Default::default()
    };
    Ok(Agreed {
        out,
        offered,
        flags,
        minor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::bytes_of;

    fn init(flags: u64) -> abi::fuse_init_in {
        abi::fuse_init_in {
            major: 7,
            minor: 44,
            max_readahead: 128 * 1024,
            flags: flags as u32,
            flags2: (flags >> 32) as u32,
            ..Default::default()
        }
    }

    fn wants(io_uring: bool) -> Wants {
        Wants {
            max_write: 1 << 20,
            max_readahead: 1 << 20,
            max_background: 64,
            congestion_threshold: 48,
            writeback_cache: true,
            direct_io: false,
            io_uring,
        }
    }

    #[test]
    fn negotiation_takes_only_what_the_kernel_offers() {
        let all = abi::ASYNC_READ
            | abi::BIG_WRITES
            | abi::WRITEBACK_CACHE
            | abi::ASYNC_DIO
            | abi::MAX_PAGES
            | abi::INIT_EXT
            | abi::OVER_IO_URING
            | abi::DO_READDIRPLUS;
        let a = negotiate(&init(all), &wants(true)).unwrap();
        assert!(a.has(abi::OVER_IO_URING) && a.has(abi::WRITEBACK_CACHE));
        assert!(!a.has(abi::DO_READDIRPLUS), "not asked for");
        assert_eq!(a.out.flags2, 1 << 9);
        assert_eq!(a.out.max_pages, 256);
        assert_eq!(a.out.max_write, 1 << 20);
        // max_readahead can only lower the kernel's figure.
        assert_eq!(a.out.max_readahead, 128 * 1024);
        assert_eq!(a.out.minor, abi::KERNEL_MINOR_VERSION);

        // No io_uring offered (enable_uring off): not in the answer even when wanted.
        let a = negotiate(&init(all & !abi::OVER_IO_URING), &wants(true)).unwrap();
        assert!(!a.has(abi::OVER_IO_URING));
        assert!(!offers_io_uring(&init(all & !abi::OVER_IO_URING)));
        // Offered but not wanted (--fuse-transport dev).
        let a = negotiate(&init(all), &wants(false)).unwrap();
        assert!(!a.has(abi::OVER_IO_URING));
        // flags2 means nothing without INIT_EXT.
        let i = init(abi::OVER_IO_URING);
        assert!(!offers_io_uring(&i));

        let mut old = init(all);
        old.minor = 31;
        assert_eq!(negotiate(&old, &wants(true)), Err(InitError::TooOld(7, 31)));
    }

    #[test]
    fn messages_split_and_parse() {
        let w = abi::fuse_write_in {
            offset: 4096,
            size: 3,
            ..Default::default()
        };
        let h = abi::fuse_in_header {
            len: (40 + 40 + 3) as u32,
            opcode: abi::WRITE,
            unique: 9,
            nodeid: 2,
            ..Default::default()
        };
        let mut msg = bytes_of(&h).to_vec();
        msg.extend_from_slice(bytes_of(&w));
        msg.extend_from_slice(b"abc");
        msg.extend_from_slice(&[0xee; 16]); // beyond len: ignored
        let (hh, args) = split_message(&msg).unwrap();
        assert_eq!(hh, h);
        let (op_in, rest) = split_args(hh.opcode, args).unwrap();
        assert_eq!(rest, b"abc");
        assert_eq!(
            parse(hh.opcode, op_in, rest).unwrap(),
            Op::Write {
                offset: 4096,
                size: 3,
                data: 0
            }
        );
        // Data shorter than the write says: refused, not trusted.
        assert!(parse(abi::WRITE, op_in, b"ab").is_err());
        assert_eq!(
            parse(abi::LOOKUP, &[], b"disk\0").unwrap(),
            Op::Lookup {
                name: b"disk".to_vec()
            }
        );
        assert!(matches!(
            split_args(abi::READ, &[0; 10]),
            Err(BadRequest::Short { want: 40, .. })
        ));
        assert!(matches!(
            parse(abi::READ, &[0; 8], &[]),
            Err(BadRequest::Short { .. })
        ));
        assert_eq!(split_message(&[0; 12]), Err(BadRequest::NoHeader(12)));
        assert_eq!(parse(9999, &[], &[]).unwrap(), Op::Other(9999));
        assert!(!parse(abi::FORGET, &[0; 8], &[]).unwrap().wants_reply());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic fuzz: every opcode with every short length.
        let mut seed = 0x1234_5678_u32;
        for opcode in 0..64 {
            for len in 0..200 {
                let bytes: Vec<u8> = (0..len)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        seed as u8
                    })
                    .collect();
                if let Ok((op_in, rest)) = split_args(opcode, &bytes) {
                    let _ = parse(opcode, op_in, rest);
                }
                let _ = split_message(&bytes);
            }
        }
    }
}
