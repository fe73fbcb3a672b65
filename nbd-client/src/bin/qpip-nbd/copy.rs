//! `qpip-nbd copy`: local files and NBD exports in any combination, several connections when
//! the servers allow multi-conn, sparse-aware through block status / SEEK_DATA; `-` streams
//! standard input or output, `null:` discards. SIGINT/SIGTERM stop a copy between batches:
//! a destination file the copy created is removed, any other is reported incomplete.

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use nbd_client::{ClientOptions, Nic};
use qpip_core::{Access, MemoryRegion};

pub(crate) use crate::side::Endpoint;
use crate::side::{BATCH, Side};

/// The copy stopped at a signal: the process should exit with 128 + `signal`.
#[derive(Debug)]
pub(crate) struct Interrupted {
    pub signal: i32,
    /// What became of the destination.
    pub what: String,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by signal {}: {}", self.signal, self.what)
    }
}

impl std::error::Error for Interrupted {}

/// The signal that asked the copy to stop (0: none), set by the handlers of [`stop_on_signals`].
pub(crate) type StopFlag = Arc<AtomicUsize>;

/// SIGINT and SIGTERM set the returned flag (a second one ends the process at once).
pub(crate) fn stop_on_signals() -> Result<StopFlag> {
    let flag = StopFlag::default();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register_conditional_shutdown(sig, 130, armed.clone())
            .context("installing a signal handler")?;
        signal_hook::flag::register(sig, armed).context("installing a signal handler")?;
        signal_hook::flag::register_usize(sig, flag.clone(), sig as usize)
            .context("installing a signal handler")?;
    }
    Ok(flag)
}

/// The error for a stop between batches.
#[derive(Debug)]
struct Stopped;

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped by a signal")
    }
}

impl std::error::Error for Stopped {}

pub(crate) struct CopyOptions {
    /// Ask the source where its holes are (block status, SEEK_DATA); nbdcopy's
    /// `--no-extents` turns it off.
    pub extents: bool,
    /// Zero detection: aligned blocks of this many bytes that read as zeroes are zeroed (or
    /// skipped), not written as data; 0: off (nbdcopy's `-S`).
    pub detect_zeroes: u64,
    /// Write zeroes as data: a fully allocated destination (nbdcopy's `--allocated`).
    pub allocated: bool,
    /// The destination already reads as zeroes: zero ranges are not written at all.
    pub destination_is_zero: bool,
    /// Make the destination durable at the end (fsync, NBD FLUSH): nbdcopy's `--flush`.
    pub flush: bool,
    pub verify: bool,
    pub connections: usize,
    /// At most this many workers (each a thread with a connection per side); 0: no limit.
    pub threads: usize,
    pub client: ClientOptions,
    /// `--map CONTEXT`: copy only the source's extents whose flags in this metadata context
    /// are not 0 (a dirty bitmap's dirty ones); the rest of the destination is left alone.
    pub map: Option<String>,
    pub progress: ProgressBar,
    /// Set (to the signal's number) when the copy should stop.
    pub stop: StopFlag,
}

impl CopyOptions {
    fn check_stop(&self) -> Result<()> {
        if self.stop.load(Ordering::Relaxed) != 0 {
            return Err(Stopped.into());
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
pub(crate) struct CopyStats {
    pub size: u64,
    pub data_bytes: u64,
    pub zero_bytes: u64,
    pub connections: usize,
    pub reconnects: u64,
}

fn copy_range(
    src: &mut Side,
    dst: &mut Side,
    start: u64,
    end: u64,
    opts: &CopyOptions,
    nic: &Nic,
) -> Result<(u64, u64)> {
    let buf = nic.alloc_region(BATCH as usize, Access::READ_WRITE);
    let Some(ctx) = &opts.map else {
        return copy_run(src, dst, start, end, opts, &buf);
    };
    // --map: the runs the context marks, each copied as a whole copy would copy it.
    let (mut data, mut zero) = (0, 0);
    let mut pos = start;
    while pos < end {
        opts.check_stop()?;
        let (len, marked) = src.marked(pos, end - pos, ctx)?;
        if marked {
            let (d, z) = copy_run(src, dst, pos, pos + len, opts, &buf)?;
            data += d;
            zero += z;
        } else {
            opts.progress.inc(len);
        }
        pos += len;
    }
    Ok((data, zero))
}

/// Copies `start..end` of `src` to `dst` through `buf`: data as data, zeroes as zeroes.
fn copy_run(
    src: &mut Side,
    dst: &mut Side,
    start: u64,
    end: u64,
    opts: &CopyOptions,
    buf: &MemoryRegion,
) -> Result<(u64, u64)> {
    let (mut data, mut zero) = (0, 0);
    let mut pos = start;
    while pos < end {
        opts.check_stop()?;
        let (len, is_zero) = src.extent(pos, end - pos, opts.extents)?;
        if is_zero {
            if opts.allocated {
                dst.write_zero_bytes(pos, len)?;
            } else if !opts.destination_is_zero {
                dst.zero(pos, len)?;
            }
            zero += len;
            opts.progress.inc(len);
        } else {
            let mut at = pos;
            while at < pos + len {
                opts.check_stop()?;
                let n = (pos + len - at).min(BATCH) as usize;
                src.read_mr(at, buf, n)?;
                let z = write_detecting_zeroes(dst, at, buf, n, opts)?;
                at += n as u64;
                data += n as u64 - z;
                zero += z;
                opts.progress.inc(n as u64);
            }
        }
        pos += len;
    }
    Ok((data, zero))
}

/// Writes the first `n` bytes of `buf` at `at` of `dst`; its blocks of zeroes (`-S`) are
/// zeroed instead, or left alone where the destination reads as zeroes. Returns the bytes
/// zeroed so.
fn write_detecting_zeroes(
    dst: &mut Side,
    at: u64,
    buf: &MemoryRegion,
    n: usize,
    opts: &CopyOptions,
) -> Result<u64> {
    // SAFETY: the buffer is this worker's and no WR names it between its requests.
    let zeroes = zero_blocks(unsafe { &buf.as_slice()[..n] }, at, opts.detect_zeroes);
    if zeroes.is_empty() {
        dst.write_mr(at, buf, n)?;
    } else {
        dst.write_mr_zeroing(at, buf, n, &zeroes, opts.destination_is_zero)?;
    }
    Ok(zeroes.iter().map(|(_, l)| l).sum())
}

/// The runs of `buf` (which sits at `offset` of its side) made of whole `block`-aligned
/// blocks of `block` bytes that are all zero: (offset in `buf`, length). None with `block` 0.
fn zero_blocks(buf: &[u8], offset: u64, block: u64) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    if block == 0 {
        return runs;
    }
    let mut i = 0u64;
    let n = buf.len() as u64;
    while i < n {
        let next = ((offset + i) / block + 1) * block - offset;
        let end = next.min(n);
        let whole = (offset + i).is_multiple_of(block) && end - i == block;
        if whole && buf[i as usize..end as usize].iter().all(|&b| b == 0) {
            match runs.last_mut() {
                Some((o, l)) if *o + *l == i => *l += end - i,
                _ => runs.push((i, end - i)),
            }
        }
        i = end;
    }
    runs
}

/// Copies `src` to `dst`; with `verify`, re-reads both and compares. A signal stops it with
/// an [`Interrupted`] error.
pub(crate) fn copy(src: &Endpoint, dst: &Endpoint, opts: &CopyOptions) -> Result<CopyStats> {
    let created = matches!(dst, Endpoint::File(p) if !p.exists());
    let opened = AtomicBool::new(false);
    let r = copy_any(src, dst, opts, &opened);
    let Err(e) = r else {
        return r;
    };
    // A reader of standard output that went away ends the copy as SIGPIPE ends nbdcopy.
    if qpip_cli::stdout::is_closed(&e) {
        return Err(e);
    }
    // What became of the destination: a file the copy created is removed, as a stopped copy
    // does; any other destination it opened is incomplete.
    let what = match dst {
        Endpoint::File(p) if created && p.exists() => match std::fs::remove_file(p) {
            Ok(()) => Some(format!("removed the incomplete {}", p.display())),
            Err(e) => Some(format!("{} is incomplete (removing it: {e})", p.display())),
        },
        _ if !opened.load(Ordering::Relaxed) => None,
        Endpoint::Null | Endpoint::Stdio => Some("the output is incomplete".into()),
        other => Some(format!("{} is incomplete", other.name())),
    };
    let signal = opts.stop.load(Ordering::Relaxed);
    if signal != 0 && e.downcast_ref::<Stopped>().is_some() {
        return Err(Interrupted {
            signal: signal as i32,
            what: what.unwrap_or_else(|| "nothing was written".into()),
        }
        .into());
    }
    Err(match what {
        Some(w) => anyhow::anyhow!("{e:#} ({w})"),
        None => e,
    })
}

/// Ends the progress bar at its position (the length, when it was known), drawn once more
/// whatever its rate limit: a `-p` log's last line shows where the copy ended.
fn finish_progress(pb: &ProgressBar) {
    if pb.length().is_none_or(|l| l < pb.position()) {
        pb.set_length(pb.position());
    }
    pb.finish();
}

fn copy_any(
    src: &Endpoint,
    dst: &Endpoint,
    opts: &CopyOptions,
    opened: &AtomicBool,
) -> Result<CopyStats> {
    let nic = match &opts.client.nic {
        Some(n) => n.clone(),
        None => Nic::soft().context("starting the soft NIC")?,
    };
    let copts = ClientOptions {
        nic: Some(nic.clone()),
        ..opts.client.clone()
    };
    if opts.verify && matches!(dst, Endpoint::Null | Endpoint::Stdio) {
        bail!("--verify needs a destination that can be read back");
    }
    if let Some(ctx) = &opts.map {
        check_map(ctx, src, dst, opts)?;
    }
    match (src, dst) {
        (Endpoint::Stdio, Endpoint::Stdio) => bail!("standard input to standard output: use cat"),
        (Endpoint::Stdio, _) => {
            if opts.verify {
                bail!("--verify needs a source that can be read again");
            }
            let d = Side::open_dst(dst, &copts, 0, true, false)?;
            opened.store(true, Ordering::Relaxed);
            return stream_in(d, &nic, opts);
        }
        (_, Endpoint::Stdio) => {
            let s = Side::open_src(src, &copts)?;
            opened.store(true, Ordering::Relaxed);
            return stream_out(s, &nic, opts);
        }
        _ => {}
    }
    // The source selects the --map context too.
    let src_opts = ClientOptions {
        meta_contexts: opts.map.iter().cloned().collect(),
        ..copts.clone()
    };
    let mut srcs = vec![Side::open_src(src, &src_opts)?];
    if let (Some(ctx), Side::Nbd(p)) = (&opts.map, &srcs[0])
        && !p.with(|c| c.contexts().iter().any(|(_, n)| n == ctx))
    {
        bail!(
            "--map {ctx}: {} offers no such metadata context (see qpip-nbd info --list)",
            p.uri()
        );
    }
    let size = srcs[0].size();
    let mut dsts = vec![Side::open_dst(dst, &copts, size, true, opts.map.is_some())?];
    opened.store(true, Ordering::Relaxed);
    let n = if srcs[0].multi_conn() && dsts[0].multi_conn() {
        opts.connections.max(1)
    } else {
        1
    };
    let n = if opts.threads > 0 {
        n.min(opts.threads)
    } else {
        n
    };
    // Not worth more connections than 64 MiB pieces.
    let n = n.min(size.div_ceil(64 << 20).max(1) as usize);
    srcs[0].widen(n)?;
    dsts[0].widen(n)?;
    for _ in 1..n {
        let more = match &srcs[0] {
            Side::Nbd(p) => Side::Nbd(p.clone()),
            _ => Side::open_src(src, &src_opts)?,
        };
        srcs.push(more);
        let more = match &dsts[0] {
            Side::Nbd(p) => Side::Nbd(p.clone()),
            _ => Side::open_dst(dst, &copts, size, false, opts.map.is_some())?,
        };
        dsts.push(more);
    }
    opts.progress.set_length(size);
    let piece = (size.div_ceil(n as u64)).div_ceil(1 << 20) << 20;
    let results: Vec<Result<(u64, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = srcs
            .iter_mut()
            .zip(dsts.iter_mut())
            .enumerate()
            .map(|(i, (sr, ds))| {
                let nic = &nic;
                let start = (i as u64 * piece).min(size);
                let end = ((i as u64 + 1) * piece).min(size);
                s.spawn(move || {
                    let r = copy_range(sr, ds, start, end, opts, nic)?;
                    if opts.flush {
                        ds.flush()?;
                    }
                    Ok(r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("a copy worker panicked")))
            .collect()
    });
    let mut stats = CopyStats {
        size,
        connections: n,
        ..Default::default()
    };
    for r in results {
        let (d, z) = r?;
        stats.data_bytes += d;
        stats.zero_bytes += z;
    }
    finish_progress(&opts.progress);
    if opts.verify
        && let Some(off) = first_mismatch(&mut srcs[0], &mut dsts[0], size, opts.extents)?
    {
        bail!(
            "verify: {} and {} differ at offset {off}",
            srcs[0].name(),
            dsts[0].name()
        );
    }
    for s in srcs.into_iter().chain(dsts) {
        stats.reconnects += s.finish()?;
    }
    Ok(stats)
}

/// `--map CONTEXT` needs an export as the source (only a server has metadata contexts), a
/// destination written at offsets, and another context than base:allocation, which every
/// copy already reads to skip holes.
fn check_map(ctx: &str, src: &Endpoint, dst: &Endpoint, opts: &CopyOptions) -> Result<()> {
    if ctx == crate::info::BASE_ALLOCATION {
        bail!(
            "--map {ctx}: every copy reads base:allocation already (holes become zeroes); \
             --map takes another context, e.g. qemu:dirty-bitmap:NAME or qemu:allocation-depth"
        );
    }
    if !matches!(src, Endpoint::Nbd(_)) {
        bail!(
            "--map {ctx}: the source must be an NBD export (only a server has metadata contexts)"
        );
    }
    if matches!(dst, Endpoint::Stdio) {
        bail!("--map {ctx}: standard output is written in order; copy into a file or an export");
    }
    if opts.verify {
        bail!("--map {ctx}: --verify compares whole images, and --map copies only part of one");
    }
    Ok(())
}

/// Standard input, in order, to `dst` from offset 0 until end of input.
fn stream_in(mut dst: Side, nic: &Nic, opts: &CopyOptions) -> Result<CopyStats> {
    let buf = nic.alloc_region(BATCH as usize, Access::READ_WRITE);
    let room = match &dst {
        Side::File { .. } | Side::Null { .. } => u64::MAX,
        other => other.size(),
    };
    let mut stdin = std::io::stdin().lock();
    let (mut pos, mut zero) = (0u64, 0u64);
    loop {
        opts.check_stop()?;
        // SAFETY: the buffer is ours; no WR names it between requests.
        let n =
            fill(&mut stdin, unsafe { buf.as_mut_slice() }).context("reading standard input")?;
        if n == 0 {
            break;
        }
        if pos + n as u64 > room {
            bail!(
                "standard input is longer than {} ({room} bytes)",
                dst.name()
            );
        }
        // Zero blocks of the stream, as nbdcopy's: WRITE_ZEROES to an export, nothing to the
        // fresh (truncated) file.
        zero += write_detecting_zeroes(&mut dst, pos, &buf, n, opts)?;
        pos += n as u64;
        opts.progress.inc(n as u64);
    }
    if let Side::File { file, path, .. } = &dst
        && file.metadata()?.file_type().is_file()
    {
        // Trailing zeroes of a fresh file were skipped: its length is the stream's.
        file.set_len(pos)
            .with_context(|| format!("sizing {}", path.display()))?;
    }
    if opts.flush {
        dst.flush()?;
    }
    finish_progress(&opts.progress);
    let reconnects = dst.finish()?;
    Ok(CopyStats {
        size: pos,
        data_bytes: pos - zero,
        zero_bytes: zero,
        connections: 1,
        reconnects,
    })
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn fill(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// `src`, in order, to standard output (holes as zeroes).
fn stream_out(mut src: Side, nic: &Nic, opts: &CopyOptions) -> Result<CopyStats> {
    let size = src.size();
    opts.progress.set_length(size);
    let buf = nic.alloc_region(BATCH as usize, Access::READ_WRITE);
    let zeroes = vec![0u8; BATCH as usize];
    let mut out = std::io::stdout().lock();
    let (mut data, mut zero) = (0, 0);
    let mut pos = 0;
    while pos < size {
        opts.check_stop()?;
        let (len, is_zero) = src.extent(pos, (size - pos).min(BATCH), opts.extents)?;
        let n = len as usize;
        if is_zero {
            out.write_all(&zeroes[..n])
                .map_err(qpip_cli::stdout::closed_or)?;
            zero += len;
        } else {
            src.read_mr(pos, &buf, n)?;
            // SAFETY: the read has completed; no WR names the buffer now.
            out.write_all(unsafe { &buf.as_slice()[..n] })
                .map_err(qpip_cli::stdout::closed_or)?;
            data += len;
        }
        pos += len;
        opts.progress.inc(len);
    }
    out.flush().map_err(qpip_cli::stdout::closed_or)?;
    finish_progress(&opts.progress);
    let reconnects = src.finish()?;
    Ok(CopyStats {
        size,
        data_bytes: data,
        zero_bytes: zero,
        connections: 1,
        reconnects,
    })
}

/// The first offset where `a` and `b` differ. Sparse-aware, as `qemu-img compare`: a range
/// that reads as zeroes on both sides (block status, SEEK_DATA) is not read; where only one
/// side reads as zeroes, the other is read and must be zeroes. Without `extents`, both are
/// read whole.
fn first_mismatch(a: &mut Side, b: &mut Side, size: u64, extents: bool) -> Result<Option<u64>> {
    let mut x = vec![0u8; BATCH as usize];
    let mut y = vec![0u8; BATCH as usize];
    // Compared against where one side reads as zeroes (slice equality is one memcmp).
    let zeroes = vec![0u8; BATCH as usize];
    let mut pos = 0;
    while pos < size {
        let (la, za) = a.extent(pos, size - pos, extents)?;
        let (lb, zb) = b.extent(pos, la, extents)?;
        let end = pos + la.min(lb);
        if za && zb {
            pos = end;
            continue;
        }
        while pos < end {
            let n = (end - pos).min(BATCH) as usize;
            let (p, q) = match (za, zb) {
                (true, _) => {
                    b.read(pos, &mut y[..n])?;
                    (&zeroes[..n], &y[..n])
                }
                (false, true) => {
                    a.read(pos, &mut x[..n])?;
                    (&x[..n], &zeroes[..n])
                }
                (false, false) => {
                    a.read(pos, &mut x[..n])?;
                    b.read(pos, &mut y[..n])?;
                    (&x[..n], &y[..n])
                }
            };
            if p != q
                && let Some(i) = p.iter().zip(q).position(|(u, v)| u != v)
            {
                return Ok(Some(pos + i as u64));
            }
            pos += n as u64;
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::zero_blocks;

    #[test]
    fn zero_detection_takes_whole_aligned_blocks_only() {
        let mut b = vec![1u8; 16];
        b[4..12].fill(0);
        assert_eq!(zero_blocks(&b, 0, 4), vec![(4, 8)]);
        assert_eq!(zero_blocks(&b, 0, 0), vec![]);
        // At offset 2 the buffer's blocks start at 2, 6, 10: only [6, 10) is whole and zero.
        assert_eq!(zero_blocks(&b, 2, 4), vec![(6, 4)]);
        assert_eq!(zero_blocks(&b[4..12], 4, 4), vec![(0, 8)]);
        assert_eq!(zero_blocks(&b[4..10], 4, 4), vec![(0, 4)]);
    }
}
