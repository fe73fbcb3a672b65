//! The receive machine driven without a socket: a stand-in connection hands out the wire a
//! few bytes at a time.

use super::*;
use crate::framer::{LengthPrefixed, RawStream};
use crate::shared::QpKind;
use crate::wr::{Completion, RecvWr};
use crate::{CompletionQueue, MemoryRegion};

/// A socket stand-in: hands out `wire` at most `step` bytes per read.
struct Trickle {
    wire: Vec<u8>,
    pos: usize,
    step: usize,
    reads: usize,
}

impl Trickle {
    fn new(wire: Vec<u8>, step: usize) -> Trickle {
        Trickle {
            wire,
            pos: 0,
            step,
            reads: 0,
        }
    }

    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        if self.pos == self.wire.len() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.reads += 1;
        let mut budget = self.step.min(self.wire.len() - self.pos);
        let mut n = 0;
        for buf in iov.iter_mut() {
            let k = buf.len().min(budget);
            buf[..k].copy_from_slice(&self.wire[self.pos..self.pos + k]);
            self.pos += k;
            n += k;
            budget -= k;
        }
        Ok(n)
    }
}

fn setup(
    slots: usize,
    slot: usize,
) -> (
    QpShared,
    CompletionQueue,
    std::sync::Arc<MemoryTable>,
    MemoryRegion,
) {
    let cq = CompletionQueue::new(1024);
    let cqs = (cq.shared.clone(), cq.shared.clone());
    let qp = QpShared::new(1, QpKind::Reliable, cqs, (slots, slots));
    let table = MemoryTable::new();
    let mr = table.register_owned(slots * slot, crate::Access::READ_WRITE);
    for i in 0..slots {
        let half = slot / 2;
        let sges = [mr.sge(i * slot, half), mr.sge(i * slot + half, slot - half)];
        qp.push_recv(RecvWr::new(i as u64, &sges)).unwrap();
    }
    (qp, cq, table, mr)
}

fn drain(cq: &CompletionQueue) -> Vec<Completion> {
    let mut out = [Completion::default(); 1024];
    let n = cq.poll(&mut out).unwrap();
    out[..n].to_vec()
}

fn framed(msgs: &[&[u8]]) -> Vec<u8> {
    let mut wire = Vec::new();
    for m in msgs {
        wire.extend_from_slice(&(m.len() as u32).to_be_bytes());
        wire.extend_from_slice(m);
    }
    wire
}

#[test]
fn any_split_of_the_stream_gives_the_same_messages() {
    let msgs: Vec<Vec<u8>> = (0..40).map(|i| vec![i as u8; (i * 37) % 200]).collect();
    let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
    let wire = framed(&refs);
    for step in [1, 2, 3, 5, 7, 64, 100, 1 << 20] {
        let (qp, cq, table, mr) = setup(40, 256);
        let mut rx = RxMachine::new();
        let mut framer = LengthPrefixed::default();
        let mut sock = Trickle::new(wire.clone(), step);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::NoWr, "step {step}");
        let done = drain(&cq);
        assert_eq!(done.len(), 40, "step {step}");
        for (i, c) in done.iter().enumerate() {
            let want = (i as u64, WcStatus::Success, msgs[i].len());
            assert_eq!((c.wr_id, c.status, c.byte_len as usize), want);
            let mut got = vec![0u8; msgs[i].len()];
            mr.read_at(i * 256, &mut got);
            assert_eq!(got, msgs[i], "message {i}, step {step}");
        }
        if step == 1 << 20 {
            // Small messages come out of the bounded read-ahead: fewer reads than messages.
            assert!(sock.reads < 40, "{} reads", sock.reads);
        }
    }
}

/// Length-prefixed messages whose bodies go to consecutive places of a region (the
/// prefix stays in the receive WR), as an NBD client places READ data: `sge(at, len)`
/// names them, in memory or in a registered file.
struct PlaceInto {
    sge: Box<dyn Fn(u64, u32) -> Sge + Send>,
    next: u64,
}

impl PlaceInto {
    fn memory(dst: MemoryRegion) -> PlaceInto {
        let sge = move |at, len| dst.sge(at as usize, len as usize);
        PlaceInto {
            sge: Box::new(sge),
            next: 0,
        }
    }
    fn file(dst: crate::FileRegion) -> PlaceInto {
        let sge = move |at, len| dst.sge(at, len);
        PlaceInto {
            sge: Box::new(sge),
            next: 0,
        }
    }
}

impl Framer for PlaceInto {
    fn frame(&mut self, header: &[u8]) -> Frame {
        let Some(prefix) = header.first_chunk::<4>() else {
            return Frame::NeedHeader(4);
        };
        let len = u32::from_be_bytes(*prefix);
        let body = (self.sge)(self.next, len);
        self.next += u64::from(len);
        Frame::MessageAt {
            header_len: 4,
            strip: 0,
            body,
        }
    }
}

/// Each message completed with its 4-byte prefix in an 8-byte receive WR of `mr` and its
/// body, in order, where `body(at, buf)` reads consecutive bodies back from.
fn check_placed(
    done: &[Completion],
    mr: &MemoryRegion,
    msgs: &[Vec<u8>],
    body: impl Fn(u64, &mut [u8]),
    step: usize,
) {
    assert_eq!(done.len(), msgs.len(), "step {step}");
    let mut at = 0u64;
    for (i, c) in done.iter().enumerate() {
        let want = (WcStatus::Success, 4, msgs[i].len() as u32);
        assert_eq!((c.status, c.byte_len, c.placed), want, "step {step}");
        let mut prefix = [0u8; 4];
        mr.read_at(i * 8, &mut prefix);
        assert_eq!(u32::from_be_bytes(prefix) as usize, msgs[i].len());
        let mut got = vec![0u8; msgs[i].len()];
        body(at, &mut got);
        assert_eq!(got, msgs[i], "message {i}, step {step}");
        at += msgs[i].len() as u64;
    }
}

#[test]
fn bodies_go_where_the_framer_says_and_headers_into_the_wr() {
    let msgs: Vec<Vec<u8>> = (1..20).map(|i| vec![i as u8; (i * 53) % 300]).collect();
    let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
    let wire = framed(&refs);
    for step in [1, 3, 4, 5, 64, 1 << 20] {
        let (qp, cq, table, mr) = setup(19, 8);
        let dst = table.register_owned(8192, crate::Access::READ_WRITE);
        let mut framer = PlaceInto::memory(dst.clone());
        let mut rx = RxMachine::new();
        let mut sock = Trickle::new(wire.clone(), step);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::NoWr, "step {step}");
        let body = |at: u64, got: &mut [u8]| dst.read_at(at as usize, got);
        check_placed(&drain(&cq), &mr, &msgs, body, step);
    }
}

fn file_of(len: u64, writable: bool) -> (tempfile::NamedTempFile, std::sync::Arc<File>) {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    tmp.as_file().set_len(len).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(tmp.path())
        .unwrap();
    (tmp, std::sync::Arc::new(f))
}

#[test]
fn file_bodies_are_written_to_the_file_and_headers_into_the_wr() {
    // Bodies longer than the bounce buffer too, so that one takes several rounds.
    let mut msgs: Vec<Vec<u8>> = (1..12).map(|i| vec![i as u8; (i * 53) % 300]).collect();
    msgs.push((0..BOUNCE * 2 + 7).map(|i| (i % 251) as u8).collect());
    let refs: Vec<&[u8]> = msgs.iter().map(|m| m.as_slice()).collect();
    let wire = framed(&refs);
    let total: usize = msgs.iter().map(Vec::len).sum();
    for step in [1, 3, 5, 64, 1 << 20] {
        if step == 1 && wire.len() > 100_000 {
            continue; // a byte a read through 128 KiB is slow and proves nothing more
        }
        let (qp, cq, table, mr) = setup(msgs.len(), 8);
        let (_tmp, file) = file_of(total as u64, true);
        let dst = table.register_file(file.clone(), total as u64, crate::Access::READ_WRITE);
        let mut framer = PlaceInto::file(dst);
        let mut rx = RxMachine::new();
        let mut sock = Trickle::new(wire.clone(), step);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::NoWr, "step {step}");
        let body = |at: u64, got: &mut [u8]| file.read_exact_at(got, at).unwrap();
        check_placed(&drain(&cq), &mr, &msgs, body, step);
    }
}

/// A connection that places file bodies itself, as the soft NIC's splice does: each call
/// writes the prefix it is handed and the bytes after it in one file write.
struct Splicing {
    sock: Trickle,
    /// (offset, prefix length, bytes from the connection) of every file write.
    writes: Vec<(u64, usize, usize)>,
}

impl RxIo for Splicing {
    fn read(&mut self, iov: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        self.sock.read(iov)
    }
    fn read_into_file(
        &mut self,
        file: &File,
        offset: u64,
        prefix: &[u8],
        max: usize,
    ) -> Option<io::Result<(usize, Option<io::Error>)>> {
        let mut buf = vec![0u8; max];
        let n = match self.sock.read(&mut [IoSliceMut::new(&mut buf)]) {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        let mut all = prefix.to_vec();
        all.extend_from_slice(&buf[..n]);
        self.writes.push((offset, prefix.len(), n));
        Some(Ok((n, file.write_all_at(&all, offset).err())))
    }
}

#[test]
fn body_bytes_read_with_the_header_go_into_the_file_with_the_rest() {
    // 4-byte length prefixes, bodies of 100 bytes into the file: the header's read (up to
    // MAX_HEADER bytes) takes the first 60 body bytes with it.
    let bodies: Vec<Vec<u8>> = (0..3).map(|i| vec![b'a' + i as u8; 100]).collect();
    let refs: Vec<&[u8]> = bodies.iter().map(|b| b.as_slice()).collect();
    let wire = framed(&refs);
    let (qp, cq, table, _mr) = setup(8, 256);
    let (_tmp, file) = file_of(300, true);
    let dst = table.register_file(file.clone(), 300, crate::Access::READ_WRITE);
    let mut framer = PlaceInto::file(dst);
    let mut io = Splicing {
        sock: Trickle::new(wire, 1 << 20),
        writes: Vec::new(),
    };
    let mut rx = RxMachine::new();
    assert_eq!(
        rx.pump_io(&qp, &table, &mut framer, &mut io),
        RxStop::WouldBlock
    );
    let done = drain(&cq);
    assert_eq!(done.len(), 3);
    assert!(done.iter().all(|c| c.status == WcStatus::Success));
    // One file write per body, its read-ahead first.
    assert_eq!(
        io.writes,
        [(0, 60, 40), (100, 60, 40), (200, 60, 40)],
        "{:?}",
        io.writes
    );
    let mut got = vec![0u8; 300];
    file.read_exact_at(&mut got, 0).unwrap();
    assert_eq!(got, bodies.concat());
}

#[test]
fn a_file_that_refuses_the_write_fails_that_message_only() {
    // Registered writable, but the descriptor is read-only: the OS refuses (EBADF).
    let (qp, cq, table, mr) = setup(3, 16);
    let (_tmp, file) = file_of(64, false);
    let dst = table.register_file(file, 64, crate::Access::READ_WRITE);
    let mut framer = PlaceInto::file(dst);
    let mut rx = RxMachine::new();
    let mut sock = Trickle::new(framed(&[b"lost", &[7u8; 40], b"x"]), 7);
    let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
    assert_eq!(stop, RxStop::NoWr);
    let c = drain(&cq);
    let got: Vec<_> = c.iter().map(|c| (c.status, c.byte_len, c.placed)).collect();
    let failed = WcStatus::PlacementError;
    assert_eq!(got, [(failed, 4, 4), (failed, 4, 40), (failed, 4, 1)]);
    assert!(c.iter().all(|c| c.os_error == 9), "EBADF: {c:?}");
    // The stream stayed in step: every header landed where it belongs.
    let mut prefix = [0u8; 4];
    mr.read_at(2 * 16, &mut prefix);
    assert_eq!(u32::from_be_bytes(prefix), 1);
}

#[test]
fn file_placement_checks_bounds_and_access() {
    for (len, access) in [(8, crate::Access::READ_WRITE), (64, crate::Access::READ)] {
        let (qp, cq, table, _mr) = setup(2, 64);
        let (_tmp, file) = file_of(64, true);
        let dst = table.register_file(file.clone(), len, access);
        let mut framer = PlaceInto::file(dst);
        let mut rx = RxMachine::new();
        let mut sock = Trickle::new(framed(&[b"too long for it"]), 100);
        let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
        assert_eq!(stop, RxStop::Failed);
        let c = drain(&cq);
        assert_eq!((c[0].status, c[0].placed), (WcStatus::ProtectionError, 0));
        let mut got = [1u8; 15];
        file.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(got, [0u8; 15], "nothing written");
    }
}

#[test]
fn a_file_region_is_not_memory_for_work_requests() {
    let table = MemoryTable::new();
    let (_tmp, file) = file_of(64, true);
    let dst = table.register_file(file, 64, crate::Access::READ_WRITE);
    let sge = dst.sge(0, 8);
    assert!(matches!(
        table.resolve(&sge, false),
        Err(crate::ProtectionFault::NotMemory(_))
    ));
    drop(dst);
    assert!(matches!(
        table.resolve_placement(&sge),
        Err(crate::ProtectionFault::UnknownKey(_))
    ));
}

#[test]
fn a_body_placed_in_read_only_memory_is_a_protection_error() {
    let (qp, cq, table, _mr) = setup(2, 64);
    let dst = table.register_owned(64, crate::Access::READ);
    let mut framer = PlaceInto::memory(dst);
    let mut rx = RxMachine::new();
    let mut sock = Trickle::new(framed(&[b"secret"]), 100);
    let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
    assert_eq!(stop, RxStop::Failed);
    let c = drain(&cq);
    assert_eq!((c[0].status, c[0].placed), (WcStatus::ProtectionError, 0));
}

#[test]
fn no_receive_wr_means_no_read() {
    let (qp, cq, table, _mr) = setup(1, 64);
    let mut rx = RxMachine::new();
    let mut framer = LengthPrefixed::default();
    let mut sock = Trickle::new(framed(&[b"one", b"two"]), 3);
    let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| sock.read(iov));
    assert_eq!(stop, RxStop::NoWr);
    assert_eq!(drain(&cq).len(), 1);
    // The second message stays in the "kernel" (beyond at most MAX_HEADER of read-ahead).
    assert!(sock.pos < sock.wire.len());
}

#[test]
fn raw_stream_completes_each_read() {
    let (qp, cq, table, mr) = setup(4, 16);
    let mut rx = RxMachine::new();
    let wire = b"abcdefghijklmnopqrstuvwxyz".to_vec();
    let mut sock = Trickle::new(wire, 10);
    rx.pump(&qp, &table, &mut RawStream, &mut |iov| sock.read(iov));
    let lens: Vec<u32> = drain(&cq).iter().map(|c| c.byte_len).collect();
    assert_eq!(
        lens,
        vec![10, 10, 6],
        "one completion per read, never waiting to fill"
    );
    let mut got = [0u8; 16];
    mr.read_at(0, &mut got);
    assert_eq!(&got[..10], b"abcdefghij");
}

#[test]
fn truncated_message_at_eof_is_remote_closed() {
    let (qp, cq, table, _mr) = setup(2, 64);
    let mut rx = RxMachine::new();
    let mut framer = LengthPrefixed::default();
    let mut wire = framed(&[b"0123456789"]);
    wire.truncate(8);
    let mut sock = Trickle::new(wire, 100);
    let stop = rx.pump(&qp, &table, &mut framer, &mut |iov| match sock.read(iov) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0), // then the peer closes
        r => r,
    });
    assert_eq!(stop, RxStop::Failed);
    let c = drain(&cq);
    assert_eq!((c[0].status, c[0].byte_len), (WcStatus::RemoteClosed, 4));
}
