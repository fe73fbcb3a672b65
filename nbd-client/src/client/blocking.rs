//! The blocking calls: a byte range cut into requests of at most `max_io` (or the largest
//! TRIM / WRITE_ZEROES), run with the window full, the first error returned once every
//! request has finished. A call checks its export range once, where it enters
//! (`Client::check_range`); its requests, pieces of that range cut at multiples of the
//! minimum block size, are not checked against the export again (`Checks::InCheckedRange`).

use nbd_proto::consts as c;
use qpip_core::MemoryRegion;

use super::connect::round_down;
use super::pipeline::{Checks, INTERNAL};
use super::{Client, Extent, Op, Output};
use crate::error::{Error, Result};
use crate::region::MrSlice;

impl Client {
    /// Runs `ops` with the window full, each checked as `checks` says; `on_done(index,
    /// output)` for each success. The first error is returned after every request has
    /// finished.
    fn run<'a>(
        &mut self,
        checks: Checks,
        ops: impl IntoIterator<Item = Op<'a>>,
        mut on_done: impl FnMut(u64, Output),
    ) -> Result<()> {
        let mut pending = 0usize;
        let mut first_err: Option<Error> = None;
        let mut drain = |this: &mut Client, pending: &mut usize| {
            while let Some(i) = this.done.iter().position(|r| r.tag & INTERNAL != 0) {
                let r = this.done.remove(i).expect("position is in range");
                *pending -= 1;
                match r.result {
                    Ok(out) => on_done(r.tag & !INTERNAL, out),
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        };
        for (i, op) in ops.into_iter().enumerate() {
            if let Err(e) = self.submit_checking(INTERNAL | i as u64, op, checks) {
                drain(self, &mut pending);
                while pending > 0 {
                    self.pump(true)?;
                    drain(self, &mut pending);
                }
                return Err(e);
            }
            pending += 1;
            drain(self, &mut pending);
        }
        while pending > 0 {
            self.pump(true)?;
            drain(self, &mut pending);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(super) fn pieces(offset: u64, len: u64, max: u64) -> impl Iterator<Item = (u64, u32)> {
        let max = max.max(1);
        (0..len.div_ceil(max)).map(move |i| {
            let o = i * max;
            (offset + o, (len - o).min(max) as u32)
        })
    }

    /// Reads `buf.len()` bytes at `offset`, as many requests in flight as the window allows.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        let max = u64::from(self.max_io());
        let ops: Vec<Op> = Self::pieces(offset, buf.len() as u64, max)
            .map(|(offset, len)| Op::Read { offset, len })
            .collect();
        self.run(Checks::InCheckedRange, ops, |i, out| {
            if let Output::Data(d) = out {
                let at = (i * max) as usize;
                buf[at..at + d.len()].copy_from_slice(&d);
            }
        })
    }

    /// Writes `data` at `offset`; with `fua` (when the server offers it) durable on return.
    pub fn write_at(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        let max = self.max_io() as usize;
        let ops: Vec<Op> = data
            .chunks(max.max(1))
            .enumerate()
            .map(|(i, d)| Op::Write {
                offset: offset + (i * max) as u64,
                data: d,
                fua,
            })
            .collect();
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// The export range `offset..offset + slice.len()`, checked, cut into requests of at most
    /// `max_io`: (export offset, the piece of `slice` it moves). The slice was checked when
    /// it was made; its pieces stay inside it.
    fn slice_pieces<'m>(
        &self,
        offset: u64,
        slice: MrSlice<'m>,
    ) -> Result<impl Iterator<Item = (u64, MrSlice<'m>)> + use<'m>> {
        self.check_range(offset, slice.len() as u64)?;
        Ok(
            Self::pieces(offset, slice.len() as u64, u64::from(self.max_io()))
                .map(move |(o, n)| (o, slice.piece((o - offset) as usize, n as usize))),
        )
    }

    /// Reads `len` bytes at `offset` into registered memory (`mr` from `at`): the NIC places
    /// the data there, no copy (holes are zero-filled by the client).
    pub fn read_at_mr(
        &mut self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
    ) -> Result<()> {
        self.read_into(offset, MrSlice::new(mr, at, len)?)
    }

    /// Reads `into.len()` bytes at `offset` into registered memory, as
    /// [`Self::read_at_mr`] does.
    pub fn read_into(&mut self, offset: u64, into: MrSlice<'_>) -> Result<()> {
        let ops: Vec<Op> = self
            .slice_pieces(offset, into)?
            .map(|(offset, into)| Op::ReadInto { offset, into })
            .collect();
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// Writes `len` bytes of registered memory (`mr` from `at`) at `offset` without copying
    /// them: the NIC sends them from `mr`.
    pub fn write_at_mr(
        &mut self,
        offset: u64,
        mr: &MemoryRegion,
        at: usize,
        len: usize,
        fua: bool,
    ) -> Result<()> {
        self.write_from(offset, MrSlice::new(mr, at, len)?, fua)
    }

    /// Writes the bytes of `from` at `offset`, as [`Self::write_at_mr`] does.
    pub fn write_from(&mut self, offset: u64, from: MrSlice<'_>, fua: bool) -> Result<()> {
        let ops: Vec<Op> = self
            .slice_pieces(offset, from)?
            .map(|(offset, from)| Op::WriteFrom { offset, from, fua })
            .collect();
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// Writes the bytes of `from` at `offset` as [`Self::write_from`] does, except the
    /// ranges `zeroes` names (offsets relative to `offset`, in order, inside `from`): those
    /// go as WRITE_ZEROES (or as the buffer's bytes where the server lacks it, which the
    /// caller has seen to be zeroes), or not at all with `skip_zeroes`. One pipeline for the
    /// lot.
    pub fn write_from_zeroing<'m>(
        &mut self,
        offset: u64,
        from: MrSlice<'m>,
        zeroes: &[(u64, u64)],
        skip_zeroes: bool,
    ) -> Result<()> {
        let len = from.len();
        self.check_range(offset, len as u64)?;
        let (max, max_zero) = (u64::from(self.max_io()), self.max_zero());
        let zero_ok = self.can_write_zeroes();
        let mut ops: Vec<Op<'m>> = Vec::new();
        let data = |start: u64, to: u64, ops: &mut Vec<Op<'m>>| {
            ops.extend(
                Self::pieces(offset + start, to - start, max).map(|(o, n)| Op::WriteFrom {
                    offset: o,
                    from: from.piece((o - offset) as usize, n as usize),
                    fua: false,
                }),
            )
        };
        let min = self.block_size().min;
        let mut pos = 0u64;
        for &(z, n) in zeroes {
            let (z, e) = (z.max(pos).min(len as u64), (z + n).min(len as u64));
            if z >= e {
                continue;
            }
            // The range was checked; the pieces cut at a zero run's ends are aligned only if
            // those are.
            if !(z.is_multiple_of(u64::from(min)) && e.is_multiple_of(u64::from(min))) {
                return Err(Error::Unaligned {
                    offset: offset + z,
                    len: e - z,
                    min,
                });
            }
            data(pos, z, &mut ops);
            if !skip_zeroes {
                if zero_ok {
                    ops.extend(
                        Self::pieces(offset + z, e - z, max_zero).map(|(offset, len)| {
                            Op::WriteZeroes {
                                offset,
                                len,
                                fua: false,
                            }
                        }),
                    );
                } else {
                    data(z, e, &mut ops);
                }
            }
            pos = e;
        }
        data(pos, len as u64, &mut ops);
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// Makes every acknowledged write durable (a no-op if the server has no FLUSH).
    pub fn flush(&mut self) -> Result<()> {
        if !self.can_flush() {
            return Ok(());
        }
        self.run(Checks::All, [Op::Flush], |_, _| {})
    }

    /// Largest TRIM / WRITE_ZEROES length in one request: what a 32-bit length holds. The
    /// maximum block size limits payloads only; the spec lets commands without one reach
    /// further, and qemu-nbd, nbdkit and our server serve a hole that long in one request.
    fn max_zero(&self) -> u64 {
        let min = u64::from(self.info.block_size.min);
        round_down(u64::from(u32::MAX), min).max(min)
    }

    /// Discards a range (NBD_CMD_TRIM; its contents are unspecified afterwards).
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<()> {
        if !self.can_trim() {
            return Err(Error::Unsupported("TRIM"));
        }
        self.check_range(offset, len)?;
        let ops: Vec<Op> = Self::pieces(offset, len, self.max_zero())
            .map(|(offset, len)| Op::Trim { offset, len })
            .collect();
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// Zeroes a range (NBD_CMD_WRITE_ZEROES; the server may punch holes).
    pub fn write_zeroes(&mut self, offset: u64, len: u64, fua: bool) -> Result<()> {
        if !self.can_write_zeroes() {
            return Err(Error::Unsupported("WRITE_ZEROES"));
        }
        self.check_range(offset, len)?;
        let ops: Vec<Op> = Self::pieces(offset, len, self.max_zero())
            .map(|(offset, len)| Op::WriteZeroes { offset, len, fua })
            .collect();
        self.run(Checks::InCheckedRange, ops, |_, _| {})
    }

    /// Allocation status from `offset` (base:allocation). The server may describe less than
    /// `len` bytes; ask again from the end of the last extent.
    pub fn block_status(&mut self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.block_status_of(c::BASE_ALLOCATION, offset, len)
    }

    /// Block status from `offset` in the metadata context `context` (one of
    /// [`Self::contexts`]: `base:allocation`, `qemu:allocation-depth`, ...), its flags in
    /// [`Extent::flags`]. The server may describe less than `len` bytes; ask again from the
    /// end of the last extent.
    pub fn block_status_of(&mut self, context: &str, offset: u64, len: u64) -> Result<Vec<Extent>> {
        if self.session.mode().context_id(context).is_none() {
            return Err(Error::Unsupported(if context == c::BASE_ALLOCATION {
                "block status (base:allocation)"
            } else {
                "block status in a metadata context the server did not select"
            }));
        }
        let min = u64::from(self.info.block_size.min);
        let len = len.min(self.info.size.saturating_sub(offset));
        let len = round_down(len.min(u64::from(u32::MAX)), min).max(min.min(len));
        let mut got = Vec::new();
        self.run(
            Checks::All,
            [Op::BlockStatus {
                offset,
                len: len as u32,
            }],
            |_, out| {
                if let Output::Extents(e) = out {
                    got = e;
                }
            },
        )?;
        // The id on the connection that answered (a reconnect may have renumbered them).
        let id = self.session.mode().context_id(context);
        got.retain(|e| Some(e.context_id) == id);
        Ok(got)
    }

    /// Makes the export `size` bytes long (NBD_CMD_RESIZE, the experimental RESIZE
    /// extension; only where the server offers it, [`Self::can_resize`]). Every request in
    /// flight is answered first, as the extension asks; afterwards requests are checked
    /// against the new size. The server may refuse a shrink while others use the export
    /// (EPERM).
    pub fn resize(&mut self, size: u64) -> Result<()> {
        if !self.can_resize() {
            return Err(Error::Unsupported("RESIZE"));
        }
        self.drain()?;
        self.run(Checks::All, [Op::Resize { size }], |_, _| {})?;
        self.set_size(size);
        Ok(())
    }

    /// Waits for every request in flight (their replies stay queued for `reap`).
    pub fn drain(&mut self) -> Result<()> {
        while self.session.in_flight() > 0 {
            self.pump(true)?;
        }
        Ok(())
    }

    /// Finishes in-flight requests, sends NBD_CMD_DISC and closes the connection.
    pub fn disconnect(mut self) -> Result<()> {
        self.drain()?;
        let extended = self.extended_headers();
        self.link.disconnect(extended)
    }
}
