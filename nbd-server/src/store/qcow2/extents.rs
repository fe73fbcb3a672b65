//! Block status of a qcow2 image: its own runs of data, zeroes and unallocated clusters, the
//! unallocated ones answered by the backing file; and qemu's allocation depth, which layer of
//! the backing chain holds each run.

use std::io;

use super::{Cluster, Qcow2, read_table};
use crate::store::Depth;

impl Qcow2 {
    /// Runs of this image's own from `offset` for up to `len` bytes: zero, data, or
    /// unallocated (the backing file's), merged, at most `max` of them. A range without an L2
    /// table is one unallocated run, however long; at most `EXTENT_TABLES` tables are read
    /// per call, so the answer may stop short (the client asks again from where it ends).
    fn own_runs(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, Run)>> {
        let end = offset.saturating_add(len).min(self.size);
        let cs = self.cluster_size();
        let mut runs: Vec<(u64, Run)> = Vec::new();
        {
            let st = self.state.lock();
            let push = |runs: &mut Vec<(u64, Run)>, n: u64, run: Run| {
                if let Some((l, r)) = runs.last_mut()
                    && *r == run
                {
                    *l += n;
                    return true;
                }
                if runs.len() == max {
                    return false;
                }
                runs.push((n, run));
                true
            };
            let mut tables_read = 0;
            let mut pos = offset;
            'spans: while pos < end {
                let span_end = (pos / self.l2_span() + 1)
                    .saturating_mul(self.l2_span())
                    .min(end);
                let (l2, _, first_idx) = self.l2_slot(&st, pos);
                if l2 == 0 {
                    let next = self.next_table(&st, pos, end);
                    if !push(&mut runs, next - pos, Run::Unallocated) {
                        break;
                    }
                    pos = next;
                    continue;
                }
                if tables_read == EXTENT_TABLES {
                    break;
                }
                tables_read += 1;
                let table = read_table(&self.file, l2, self.l2_entries() as usize)?;
                for (guest, _, n) in self.pieces(pos, span_end - pos) {
                    let idx = (first_idx + (guest - pos + pos % cs) / cs) as usize;
                    let run = match self.decode(table[idx]) {
                        Cluster::Zero { .. } => Run::Zero,
                        Cluster::Unallocated => Run::Unallocated,
                        Cluster::Data { .. } | Cluster::Compressed { .. } => Run::Data,
                    };
                    if !push(&mut runs, n, run) {
                        break 'spans;
                    }
                }
                pos = span_end;
            }
        }
        Ok(runs)
    }

    /// Data (`false`) and zero (`true`) runs from `offset` for up to `len` bytes, merged,
    /// at most `max` of them; they may stop short, as `own_runs` does.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        let runs = self.own_runs(offset, len, max)?;
        // Unallocated runs are what the backing file says they are.
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut push = |n: u64, zero: bool| {
            if let Some((l, z)) = out.last_mut()
                && *z == zero
            {
                *l += n;
                return true;
            }
            if out.len() == max {
                return false;
            }
            out.push((n, zero));
            true
        };
        let mut pos = offset;
        'runs: for (n, run) in runs {
            let run_end = pos + n;
            match (run, &self.backing) {
                (Run::Data, _) => {
                    if !push(n, false) {
                        break;
                    }
                }
                (Run::Zero, _) | (Run::Unallocated, None) => {
                    if !push(n, true) {
                        break;
                    }
                }
                (Run::Unallocated, Some(backing)) => {
                    let mut p = pos;
                    let has = backing.size().clamp(pos, run_end);
                    while p < has {
                        let got = backing.extents(p, has - p)?;
                        if got.iter().all(|e| e.len == 0) {
                            // Said nothing: data, which is always a correct answer.
                            if !push(has - p, false) {
                                break 'runs;
                            }
                            p = has;
                        }
                        for e in got {
                            let e_len = e.len.min(has - p);
                            if e_len == 0 {
                                continue;
                            }
                            if !push(e_len, e.hole) {
                                break 'runs;
                            }
                            p += e_len;
                        }
                    }
                    // Past the backing file's end: zeroes.
                    if has < run_end && !push(run_end - has, true) {
                        break;
                    }
                }
            }
            pos = run_end;
        }
        Ok(out)
    }
}

impl Qcow2 {
    /// qemu's allocation depth from `offset` for up to `len` bytes, at most `max` runs (they
    /// may stop short, as `own_runs` does): 1 where this image allocates the
    /// clusters (data or zeroes), the backing file's answer plus one where it does not, and
    /// 0 without a backing file. Past a shorter backing file's end its zeroes count as the
    /// backing file's own, as qemu counts them (`bdrv_co_common_block_status_above`).
    pub fn allocation_depth(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Depth>> {
        let runs = self.own_runs(offset, len, max)?;
        let mut out: Vec<Depth> = Vec::new();
        let mut push = |len: u64, depth: u32| {
            if let Some(last) = out.last_mut()
                && last.depth == depth
            {
                last.len += len;
                return true;
            }
            if out.len() == max {
                return false;
            }
            out.push(Depth { len, depth });
            true
        };
        let mut pos = offset;
        'runs: for (n, run) in runs {
            let run_end = pos + n;
            match (run, &self.backing) {
                (Run::Data | Run::Zero, _) => {
                    if !push(n, 1) {
                        break;
                    }
                }
                (Run::Unallocated, None) => {
                    if !push(n, 0) {
                        break;
                    }
                }
                (Run::Unallocated, Some(backing)) => {
                    let mut p = pos;
                    let has = backing.size().clamp(pos, run_end);
                    while p < has {
                        let got = backing.allocation_depth(p, has - p)?;
                        let before = p;
                        for d in got {
                            let d_len = d.len.min(has - p);
                            if d_len == 0 {
                                continue;
                            }
                            // Unallocated below stays unallocated; else one layer deeper.
                            let depth = if d.depth == 0 {
                                0
                            } else {
                                d.depth.saturating_add(1)
                            };
                            if !push(d_len, depth) {
                                break 'runs;
                            }
                            p += d_len;
                        }
                        if p == before {
                            // Said nothing: the backing file's own, which is never wrong.
                            if !push(has - p, 2) {
                                break 'runs;
                            }
                            p = has;
                        }
                    }
                    if has < run_end && !push(run_end - has, 2) {
                        break;
                    }
                }
            }
            pos = run_end;
        }
        Ok(out)
    }
}

/// A run of clusters as the image itself maps them, for block status.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    Zero,
    Data,
    Unallocated,
}

/// L2 tables one block-status answer reads at most (each maps `cluster² / 8` bytes).
const EXTENT_TABLES: usize = 64;
