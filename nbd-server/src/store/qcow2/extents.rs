//! Block status of a qcow2 image: its own runs of data, zeroes and unallocated clusters, the
//! unallocated ones answered by the backing file.

use std::io;

use super::{Cluster, Qcow2, read_table};

impl Qcow2 {
    /// Data (`false`) and zero (`true`) runs from `offset` for up to `len` bytes, merged,
    /// at most `max` of them. A range without an L2 table is one zero run, however long; at
    /// most `EXTENT_TABLES` tables are read per call, so the answer may stop short (the
    /// client asks again from where it ends).
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        let end = offset.saturating_add(len).min(self.size);
        let cs = self.cluster_size();
        // Runs of this image's own: zero, data, or unallocated (the backing file's).
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

/// A run of clusters as the image itself maps them, for block status.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    Zero,
    Data,
    Unallocated,
}

/// L2 tables one block-status answer reads at most (each maps `cluster² / 8` bytes).
const EXTENT_TABLES: usize = 64;
