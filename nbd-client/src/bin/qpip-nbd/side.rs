//! What `qpip-nbd copy` copies from and to: an [`Endpoint`] as the user names it, and a
//! [`Side`] once opened — a local file, an export (one [`Pool`] of connections shared by the
//! workers), or `null:` — with the reads, writes, zeroing and extent queries a copy needs.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use nbd_client::uri::looks_like_uri;
use nbd_client::{ClientOptions, MrSlice, Pool};
use qpip_core::MemoryRegion;

/// Bytes read then written per step of a worker (each step is many requests in flight).
pub(crate) const BATCH: u64 = 4 << 20;

#[derive(Clone, Debug)]
pub(crate) enum Endpoint {
    File(PathBuf),
    Nbd(String),
    /// `-`: standard input as a source, standard output as a destination (streamed in order).
    Stdio,
    /// `null:`: a destination that discards everything (nbdcopy's).
    Null,
}

impl Endpoint {
    pub(crate) fn parse(s: &str) -> Endpoint {
        match s {
            "-" => Endpoint::Stdio,
            "null:" => Endpoint::Null,
            _ if looks_like_uri(s) => Endpoint::Nbd(s.to_owned()),
            _ => Endpoint::File(PathBuf::from(s)),
        }
    }
    pub(crate) fn name(&self) -> String {
        match self {
            Endpoint::File(p) => p.display().to_string(),
            Endpoint::Nbd(u) => u.clone(),
            Endpoint::Stdio => "-".into(),
            Endpoint::Null => "null:".into(),
        }
    }
}

/// One open side of a copy (one connection, or one file handle).
pub(crate) enum Side {
    File {
        file: File,
        path: PathBuf,
        size: u64,
        /// A destination we truncated: holes already read as zeroes.
        fresh: bool,
    },
    /// An export: one pool of connections, shared by the workers.
    Nbd(Arc<Pool>),
    /// `null:`: takes everything, keeps nothing.
    Null { size: u64 },
}

impl Side {
    pub(crate) fn open_src(ep: &Endpoint, opts: &ClientOptions) -> Result<Side> {
        match ep {
            Endpoint::Null => bail!("null: can only be a destination (it discards what it gets)"),
            Endpoint::Stdio => bail!("standard input is streamed, not opened as a side"),
            Endpoint::File(path) => {
                let file =
                    File::open(path).with_context(|| format!("opening {}", path.display()))?;
                let size =
                    file_size(&file).with_context(|| format!("size of {}", path.display()))?;
                Ok(Side::File {
                    file,
                    path: path.clone(),
                    size,
                    fresh: false,
                })
            }
            Endpoint::Nbd(uri) => Ok(Side::Nbd(Arc::new(connect(uri, opts)?))),
        }
    }

    /// Opens the destination; `size` is the source size. `first`: this is the first handle
    /// (the one that prepares a local file). `keep`: a local file keeps what it holds (only
    /// part of the source is written, `--map`): it is grown to `size` if shorter, never
    /// truncated.
    pub(crate) fn open_dst(
        ep: &Endpoint,
        opts: &ClientOptions,
        size: u64,
        first: bool,
        keep: bool,
    ) -> Result<Side> {
        match ep {
            Endpoint::Null => Ok(Side::Null { size }),
            Endpoint::Stdio => bail!("standard output is streamed, not opened as a side"),
            Endpoint::File(path) => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                let regular = file.metadata()?.file_type().is_file();
                if regular && first && keep {
                    if file_size(&file)? < size {
                        file.set_len(size)
                            .with_context(|| format!("sizing {}", path.display()))?;
                    }
                } else if regular && first {
                    // A fresh sparse file: holes of the source need no writes at all.
                    file.set_len(0)
                        .and_then(|()| file.set_len(size))
                        .with_context(|| format!("sizing {}", path.display()))?;
                }
                let have = file_size(&file)?;
                if have < size {
                    bail!(
                        "{} holds {have} bytes, the source has {size}",
                        path.display()
                    );
                }
                Ok(Side::File {
                    file,
                    path: path.clone(),
                    size: have,
                    fresh: regular && !keep,
                })
            }
            Endpoint::Nbd(uri) => {
                let p = connect(uri, opts)?;
                if p.caps().size < size {
                    bail!(
                        "{uri}: the export has {} bytes, the source has {size}",
                        p.caps().size
                    );
                }
                if p.caps().read_only {
                    bail!("{uri}: the export is read-only");
                }
                Ok(Side::Nbd(Arc::new(p)))
            }
        }
    }

    /// An export gets `n` connections (a worker each); files and null: need nothing.
    pub(crate) fn widen(&mut self, n: usize) -> Result<()> {
        let Side::Nbd(p) = self else {
            return Ok(());
        };
        let pool = Arc::get_mut(p).context("widening a pool already shared")?;
        while pool.connections() < n {
            pool.add_connection()
                .with_context(|| format!("connecting to {}", pool.uri()))?;
        }
        Ok(())
    }

    pub(crate) fn size(&self) -> u64 {
        match self {
            Side::File { size, .. } | Side::Null { size } => *size,
            Side::Nbd(p) => p.caps().size,
        }
    }

    pub(crate) fn multi_conn(&self) -> bool {
        match self {
            Side::File { .. } | Side::Null { .. } => true,
            Side::Nbd(p) => p.caps().multi_conn,
        }
    }

    pub(crate) fn name(&self) -> String {
        match self {
            Side::File { path, .. } => path.display().to_string(),
            Side::Nbd(p) => p.uri().to_string(),
            Side::Null { .. } => "null:".into(),
        }
    }

    pub(crate) fn read(&mut self, off: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Side::File { file, path, .. } => file
                .read_exact_at(buf, off)
                .with_context(|| format!("reading {} at {off}", path.display())),
            Side::Nbd(p) => p
                .with(|c| c.read_at(off, buf))
                .with_context(|| format!("reading {} at {off}", p.uri())),
            Side::Null { .. } => bail!("null: cannot be read back"),
        }
    }

    /// Reads `n` bytes at `off` into the start of the registered buffer: from an export, the
    /// NIC places the data there without a copy.
    pub(crate) fn read_mr(&mut self, off: u64, mr: &MemoryRegion, n: usize) -> Result<()> {
        match self {
            Side::Nbd(p) => p
                .with(|c| c.read_at_mr(off, mr, 0, n))
                .with_context(|| format!("reading {} at {off}", p.uri())),
            // SAFETY: the buffer is this worker's and no WR names it between its requests.
            _ => self.read(off, unsafe { &mut mr.as_mut_slice()[..n] }),
        }
    }

    /// Writes the first `n` bytes of the registered buffer at `off`: to an export, the send
    /// WR points at the buffer, no copy.
    pub(crate) fn write_mr(&mut self, off: u64, mr: &MemoryRegion, n: usize) -> Result<()> {
        match self {
            Side::Nbd(p) => p
                .with(|c| c.write_at_mr(off, mr, 0, n, false))
                .with_context(|| format!("writing {} at {off}", p.uri())),
            // SAFETY: as in read_mr.
            _ => self.write(off, unsafe { &mr.as_slice()[..n] }),
        }
    }

    /// As [`Self::write_mr`], but the ranges of `zeroes` (relative to `off`; the buffer holds
    /// zeroes there) are zeroed as [`Self::zero`] does, or left alone with `skip_zeroes` (the
    /// destination is known to read as zeroes there).
    pub(crate) fn write_mr_zeroing(
        &mut self,
        off: u64,
        mr: &MemoryRegion,
        n: usize,
        zeroes: &[(u64, u64)],
        skip_zeroes: bool,
    ) -> Result<()> {
        if let Side::Nbd(p) = self {
            return p
                .with(|c| {
                    let from = MrSlice::new(mr, 0, n)?;
                    c.write_from_zeroing(off, from, zeroes, skip_zeroes)
                })
                .with_context(|| format!("writing {} at {off}", p.uri()));
        }
        // SAFETY: the buffer is this worker's and no WR names it between its requests.
        let data = unsafe { &mr.as_slice()[..n] };
        let mut pos = 0u64;
        for &(z, len) in zeroes.iter().chain([&(n as u64, 0)]) {
            if z > pos {
                self.write(off + pos, &data[pos as usize..z as usize])?;
            }
            if len > 0 && !skip_zeroes {
                self.zero(off + z, len)?;
            }
            pos = z + len;
        }
        Ok(())
    }

    pub(crate) fn write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        match self {
            Side::File { file, path, .. } => file
                .write_all_at(data, off)
                .with_context(|| format!("writing {} at {off}", path.display())),
            Side::Nbd(p) => p
                .with(|c| c.write_at(off, data, false))
                .with_context(|| format!("writing {} at {off}", p.uri())),
            Side::Null { .. } => Ok(()),
        }
    }

    /// Makes `len` bytes at `off` read as zeroes, without writing data where possible.
    pub(crate) fn zero(&mut self, off: u64, len: u64) -> Result<()> {
        match self {
            Side::File { fresh: true, .. } | Side::Null { .. } => Ok(()),
            Side::File { file, .. } => {
                // SAFETY: plain syscall on an open descriptor.
                let r = unsafe {
                    libc::fallocate(
                        file.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        off as libc::off_t,
                        len as libc::off_t,
                    )
                };
                if r == 0 {
                    Ok(())
                } else {
                    self.write_zero_bytes(off, len)
                }
            }
            // WRITE_ZEROES (the server may punch a hole); TRIM is not used: its contents
            // afterwards are unspecified.
            Side::Nbd(p) if p.caps().write_zeroes => p
                .with(|c| c.write_zeroes(off, len, false))
                .with_context(|| format!("zeroing {} at {off}", p.uri())),
            Side::Nbd(_) => self.write_zero_bytes(off, len),
        }
    }

    pub(crate) fn write_zero_bytes(&mut self, off: u64, len: u64) -> Result<()> {
        let zeroes = vec![0u8; BATCH.min(len) as usize];
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(BATCH) as usize;
            self.write(at, &zeroes[..n])?;
            at += n as u64;
        }
        Ok(())
    }

    /// The next extent from `off` (at most `len` bytes): (length, reads as zeroes). Without
    /// `extents` (no block status or SEEK_DATA), all of it is data.
    pub(crate) fn extent(&mut self, off: u64, len: u64, extents: bool) -> Result<(u64, bool)> {
        if !extents {
            return Ok((len, false));
        }
        match self {
            Side::File { file, .. } => {
                let fd = file.as_raw_fd();
                // SAFETY: plain syscalls on an open descriptor.
                let data = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
                if data < 0 {
                    // ENXIO: no data after `off`; other errors: treat as data.
                    let e = std::io::Error::last_os_error();
                    return Ok((len, e.raw_os_error() == Some(libc::ENXIO)));
                }
                let data = data as u64;
                if data > off {
                    return Ok(((data - off).min(len), true));
                }
                // SAFETY: lseek on a descriptor this side owns; no memory is passed.
                let hole = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_HOLE) };
                let end = if hole < 0 { off + len } else { hole as u64 };
                Ok(((end - off).clamp(1, len), false))
            }
            Side::Nbd(p) if p.caps().block_status => {
                let ext = p
                    .with(|c| c.block_status(off, len.min(1 << 30)))
                    .with_context(|| format!("block status of {} at {off}", p.uri()))?;
                let first = ext[0];
                // Merge following extents of the same kind.
                let mut n = 0;
                for e in &ext {
                    if e.zero != first.zero {
                        break;
                    }
                    n += e.length;
                }
                Ok((n.clamp(1, len), first.zero))
            }
            Side::Nbd(_) | Side::Null { .. } => Ok((len, false)),
        }
    }

    /// The next run from `off` (at most `len` bytes) in the metadata context `ctx` of an
    /// export (`--map`): (length, marked: its flags are not 0).
    pub(crate) fn marked(&mut self, off: u64, len: u64, ctx: &str) -> Result<(u64, bool)> {
        let Side::Nbd(p) = self else {
            bail!("--map {ctx}: {} has no metadata contexts", self.name());
        };
        let ext = p
            .with(|c| c.block_status_of(ctx, off, len.min(1 << 30)))
            .with_context(|| format!("block status ({ctx}) of {} at {off}", p.uri()))?;
        let Some(first) = ext.first() else {
            bail!(
                "{}: block status ({ctx}) at {off} described nothing",
                p.uri()
            );
        };
        let marked = first.flags != 0;
        // Merge following extents of the same kind.
        let n: u64 = ext
            .iter()
            .take_while(|e| (e.flags != 0) == marked)
            .map(|e| e.length)
            .sum();
        Ok((n.clamp(1, len), marked))
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        match self {
            Side::File { file, path, .. } => file
                .sync_all()
                .with_context(|| format!("syncing {}", path.display())),
            Side::Nbd(p) => p
                .with(|c| c.flush())
                .with_context(|| format!("flushing {}", p.uri())),
            Side::Null { .. } => Ok(()),
        }
    }

    pub(crate) fn finish(self) -> Result<u64> {
        match self {
            Side::File { .. } | Side::Null { .. } => Ok(0),
            // The workers share the pool: the last of them disconnects it.
            Side::Nbd(p) => {
                let Ok(pool) = Arc::try_unwrap(p) else {
                    return Ok(0);
                };
                let n = pool.reconnects();
                let uri = pool.uri().to_string();
                for c in pool.into_clients() {
                    c.disconnect()
                        .with_context(|| format!("disconnecting from {uri}"))?;
                }
                Ok(n)
            }
        }
    }
}

/// A pool on `uri`; an unknown export is named with those there are, as `info` words it.
fn connect(uri: &str, opts: &ClientOptions) -> Result<Pool> {
    Pool::connect(uri, opts.clone())
        .map_err(|e| crate::info::unknown_export(uri, e, opts, "connecting to"))
}

pub(crate) fn file_size(f: &File) -> std::io::Result<u64> {
    let md = f.metadata()?;
    if md.file_type().is_file() {
        return Ok(md.len());
    }
    // Block devices: seek to the end.
    // SAFETY: plain syscall on an open descriptor.
    let end = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(end as u64)
}
