//! Bad input from the network: raw TCP clients with hand-made bytes (nbd-proto encodes the
//! well-formed parts). The server must give the spec's error reply or disconnect cleanly, and
//! keep serving everyone else.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use nbd_proto::consts as c;
use nbd_proto::handshake::messages::{InfoRequest, OptionHeader, OptionReplyHeader, encode_option};
use nbd_proto::reply::{SimpleReply, StructuredReplyHeader};
use nbd_proto::transmission::{Command as Cmd, ErrorValue, Request};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;
const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn server(dir: &std::path::Path) -> ServerProcess {
    let img = image(dir, "disk.img", SIZE);
    start_server_v4(&["--export".into(), format!("disk={}", img.display())])
}

/// A server on a fresh `SIZE` image "disk", with extra flags.
fn server_with(flags: &[&str]) -> (tempfile::TempDir, ServerProcess) {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let mut args: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    args.extend(["--export".into(), format!("disk={}", img.display())]);
    let srv = start_server_v4(&args);
    (dir, srv)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Reads the 18-byte greeting and checks it is fixed newstyle.
fn read_greeting(s: &mut TcpStream) {
    let mut g = [0u8; c::GREETING_LEN];
    s.read_exact(&mut g).unwrap();
    assert_eq!(u64::from_be_bytes(g[0..8].try_into().unwrap()), c::NBDMAGIC);
    assert_eq!(
        u64::from_be_bytes(g[8..16].try_into().unwrap()),
        c::IHAVEOPT
    );
    let flags = u16::from_be_bytes([g[16], g[17]]);
    assert_ne!(flags & c::FLAG_FIXED_NEWSTYLE, 0);
}

/// Greeting, then the client flags (fixed newstyle, no zeroes).
fn start(addr: SocketAddr) -> TcpStream {
    let mut s = connect(addr);
    read_greeting(&mut s);
    s.write_all(&(c::FLAG_C_FIXED_NEWSTYLE | c::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

fn send_opt(s: &mut TcpStream, option: u32, data: &[u8]) {
    let mut out = Vec::new();
    encode_option(option, data, &mut out);
    s.write_all(&out).unwrap();
}

fn read_opt_reply(s: &mut TcpStream) -> (OptionReplyHeader, Vec<u8>) {
    let mut h = [0u8; c::OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = OptionReplyHeader::parse(&h).unwrap();
    let mut data = vec![0u8; h.length as usize];
    s.read_exact(&mut data).unwrap();
    (h, data)
}

/// NBD_OPT_GO for `name`; returns the export size. Simple replies (no structured replies
/// were asked for).
fn go(s: &mut TcpStream, name: &str) -> u64 {
    let data = InfoRequest {
        name,
        items: vec![],
    }
    .encode()
    .unwrap();
    send_opt(s, c::OPT_GO, &data);
    let mut size = None;
    loop {
        let (h, d) = read_opt_reply(s);
        assert_eq!(h.option, c::OPT_GO);
        match h.reply_type {
            c::REP_INFO => {
                if u16::from_be_bytes([d[0], d[1]]) == c::INFO_EXPORT {
                    size = Some(u64::from_be_bytes(d[2..10].try_into().unwrap()));
                }
            }
            c::REP_ACK => return size.expect("NBD_INFO_EXPORT before the ACK"),
            t => panic!(
                "unexpected GO reply type {t:#x}: {:?}",
                String::from_utf8_lossy(&d)
            ),
        }
    }
}

/// A connection in the transmission phase on export "disk".
fn transmission(addr: SocketAddr) -> TcpStream {
    let mut s = start(addr);
    assert_eq!(go(&mut s, "disk"), SIZE);
    s
}

fn request(s: &mut TcpStream, command: Cmd, cookie: u64, offset: u64, length: u32) {
    let r = Request {
        flags: Default::default(),
        command,
        cookie,
        offset,
        length: length.into(),
    };
    s.write_all(&r.encode(false).unwrap()).unwrap();
}

fn simple_reply(s: &mut TcpStream) -> SimpleReply {
    let mut b = [0u8; c::SIMPLE_REPLY_LEN];
    s.read_exact(&mut b).unwrap();
    SimpleReply::parse(&b).unwrap()
}

/// Sends a request and returns the reply's error value (None = success); a read's data is
/// returned too.
fn roundtrip(
    s: &mut TcpStream,
    command: Cmd,
    cookie: u64,
    offset: u64,
    length: u32,
    payload: &[u8],
) -> (Option<ErrorValue>, Vec<u8>) {
    request(s, command, cookie, offset, length);
    s.write_all(payload).unwrap();
    let r = simple_reply(s);
    assert_eq!(r.cookie, cookie);
    let err = r.error_value();
    let mut data = Vec::new();
    if command == Cmd::Read && err.is_none() {
        data.resize(length as usize, 0);
        s.read_exact(&mut data).unwrap();
    }
    (err, data)
}

/// Asserts the server closes the connection (EOF or reset) within the I/O timeout, reading
/// and discarding anything it still sends. A timeout means the server hung on us.
fn assert_closed(s: &mut TcpStream, what: &str) {
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: the server neither replied nor closed within {IO_TIMEOUT:?}")
            }
            Err(_) => return, // reset
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the server keeps sending"
        );
    }
}

/// A full, good session still works: GO, write, read back.
fn assert_serves(srv: &mut ServerProcess, when: &str) {
    srv.assert_alive(when);
    let mut s = transmission(srv.addr);
    let data = pattern(8192, 5);
    let (e, _) = roundtrip(&mut s, Cmd::Write, 1, 4096, 8192, &data);
    assert_eq!(e, None, "write {when}");
    let (e, back) = roundtrip(&mut s, Cmd::Read, 2, 4096, 8192, &[]);
    assert_eq!(e, None, "read {when}");
    assert!(back == data, "read back differs {when}");
    request(&mut s, Cmd::Disc, 3, 0, 0);
}

#[test]
fn unknown_client_flags_disconnect_then_serves_others() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = connect(srv.addr);
    read_greeting(&mut s);
    s.write_all(&0xdead_beefu32.to_be_bytes()).unwrap();
    assert_closed(&mut s, "unknown client flags");
    assert_serves(&mut srv, "after unknown client flags");
}

#[test]
fn bad_option_magic_disconnects_then_serves_others() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = start(srv.addr);
    let mut h = OptionHeader {
        option: c::OPT_GO,
        length: 0,
    }
    .encode();
    h[0] ^= 0xff;
    s.write_all(&h).unwrap();
    assert_closed(&mut s, "bad option magic");
    assert_serves(&mut srv, "after a bad option magic");
}

#[test]
fn truncated_option_then_close() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = start(srv.addr);
    s.write_all(
        &OptionHeader {
            option: c::OPT_GO,
            length: 100,
        }
        .encode(),
    )
    .unwrap();
    s.write_all(&[0u8; 10]).unwrap();
    drop(s);
    assert_serves(&mut srv, "after a truncated option");
}

#[test]
fn oversized_option_length_disconnects_without_allocating_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let before = srv.rss_kib();
    let mut s = start(srv.addr);
    s.write_all(
        &OptionHeader {
            option: c::OPT_GO,
            length: 1 << 30,
        }
        .encode(),
    )
    .unwrap();
    // Start sending the "data": the server must drop us, not buffer a gigabyte.
    let chunk = vec![0u8; 1 << 20];
    let mut sent = 0usize;
    while sent < 64 << 20 {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert_closed(&mut s, "1 GiB option length");
    let after = srv.rss_kib();
    assert!(
        after < before + 32 * 1024,
        "RSS grew from {before} KiB to {after} KiB after a 1 GiB option length"
    );
    assert_serves(&mut srv, "after an oversized option");
}

#[test]
fn unknown_option_gets_err_unsup_and_handshake_continues() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path());
    let mut s = start(srv.addr);
    send_opt(&mut s, 0x4242, b"some data");
    let (h, _) = read_opt_reply(&mut s);
    assert_eq!(h.option, 0x4242);
    assert_eq!(h.reply_type, c::REP_ERR_UNSUP);
    assert_eq!(go(&mut s, "disk"), SIZE);
    let (e, _) = roundtrip(&mut s, Cmd::Read, 1, 0, 512, &[]);
    assert_eq!(e, None);
}

#[test]
fn starttls_gets_err_unsup_on_a_notls_server() {
    // nbd-proto's choice (spec, NOTLS mode): NBD_REP_ERR_UNSUP, and the handshake goes on.
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path());
    let mut s = start(srv.addr);
    send_opt(&mut s, c::OPT_STARTTLS, &[]);
    let (h, _) = read_opt_reply(&mut s);
    assert_eq!(h.option, c::OPT_STARTTLS);
    assert_eq!(h.reply_type, c::REP_ERR_UNSUP);
    assert_eq!(go(&mut s, "disk"), SIZE);
}

#[test]
fn transmission_errors_keep_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = transmission(srv.addr);

    // Unknown command → EINVAL.
    let (e, _) = roundtrip(&mut s, Cmd::Unknown(99), 1, 0, 512, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "unknown command");
    // Read past the end → EINVAL; straddling the end too.
    let (e, _) = roundtrip(&mut s, Cmd::Read, 2, SIZE, 512, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "read at the end");
    let (e, _) = roundtrip(&mut s, Cmd::Read, 3, SIZE - 512, 1024, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "read across the end");
    // Write past the end → ENOSPC, and its payload is consumed (the next request parses).
    let (e, _) = roundtrip(&mut s, Cmd::Write, 4, SIZE - 512, 4096, &[0x77; 4096]);
    assert_eq!(e, Some(ErrorValue::NoSpc), "write across the end");
    // Read above the maximum block size (32 MiB) → EINVAL (validate_request rule 7).
    let (e, _) = roundtrip(&mut s, Cmd::Read, 5, 0, (32 << 20) + 1, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "read of 32 MiB + 1");
    // Offset overflow.
    let (e, _) = roundtrip(&mut s, Cmd::Read, 6, u64::MAX - 100, 512, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "offset near u64::MAX");
    // Flush with a nonzero length → EINVAL.
    let (e, _) = roundtrip(&mut s, Cmd::Flush, 7, 0, 1, &[]);
    assert_eq!(e, Some(ErrorValue::Inval), "flush with a length");

    // Nothing reached the image, and the connection still works.
    let (e, d) = roundtrip(&mut s, Cmd::Read, 8, SIZE - 4096, 4096, &[]);
    assert_eq!(e, None);
    assert!(
        d.iter().all(|&b| b == 0),
        "the refused write left data behind"
    );
    let (e, _) = roundtrip(&mut s, Cmd::Write, 9, 0, 4096, &[0x12; 4096]);
    assert_eq!(e, None);
    let (e, d) = roundtrip(&mut s, Cmd::Read, 10, 0, 4096, &[]);
    assert_eq!(e, None);
    assert!(d.iter().all(|&b| b == 0x12));
    srv.assert_alive("after transmission errors");
}

/// A 1 MiB tmpfs mounted on a fresh directory, unmounted when dropped (the directory after
/// it); None, with a note, without root.
struct SmallTmpfs {
    dir: tempfile::TempDir,
}

impl SmallTmpfs {
    fn mount(name: &str) -> Option<SmallTmpfs> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a small tmpfs needs root");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", name])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(mounted.success(), "mount a 1 MiB tmpfs");
        Some(SmallTmpfs { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for SmallTmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// WRITEs the image's filesystem has no room for get ENOSPC and the connection goes on —
/// large ones, whose payload the NIC writes into the image itself (the server's framer names
/// the file range), and small ones, which the server writes from the receive slot.
#[test]
fn writes_to_a_full_disk_get_enospc_and_the_connection_goes_on() {
    let Some(disk) = SmallTmpfs::mount("qpip-full-disk") else {
        return;
    };
    let mut srv = server(disk.path()); // a sparse 16 MiB image on 1 MiB of room
    let mut s = transmission(srv.addr);

    // Small writes first (they fill the disk), then large ones (none fits any more).
    let mut written = None;
    for (len, first_cookie, base) in [(8u32 << 10, 100u64, 0), (256 << 10, 200, 8 * MIB)] {
        let payload = vec![0x5a; len as usize];
        let mut full = 0;
        for i in 0..(2 * MIB / u64::from(len)) {
            let off = base + i * u64::from(len);
            let (e, _) = roundtrip(&mut s, Cmd::Write, first_cookie + i, off, len, &payload);
            match e {
                None => {
                    written.get_or_insert(off);
                }
                Some(ErrorValue::NoSpc) => full += 1,
                other => panic!("{len}-byte write at {off}: {other:?}"),
            }
        }
        assert!(full > 0, "{len}-byte writes: 2 MiB fit in 1 MiB of room");
        // The connection is in step: a read answers with data a write left.
        let at = written.expect("the first writes found room");
        let (e, d) = roundtrip(&mut s, Cmd::Read, first_cookie + 99, at, 4096, &[]);
        assert_eq!(e, None);
        assert!(
            d.iter().all(|&b| b == 0x5a),
            "{len}-byte writes, then a read"
        );
    }
    srv.assert_alive("after ENOSPC");
}

/// READs of never-written ranges of an image on tmpfs answer zeroes without taking room: a
/// read through the image's mapping would make tmpfs allocate a page per hole (and, with
/// the file system full, fail the reply's send and drop the connection), so such reads are
/// copied with pread, which reads holes as zeroes.
#[test]
fn reads_of_holes_on_tmpfs_take_no_room_and_work_on_a_full_disk() {
    let Some(disk) = SmallTmpfs::mount("qpip-holes") else {
        return;
    };
    let mut srv = server(disk.path()); // a sparse 16 MiB image on 1 MiB of room
    let mut s = transmission(srv.addr);
    let used = || {
        let st = statvfs(disk.path());
        (st.0 - st.1) * st.2
    };
    let before = used();
    // 8 MiB of holes: eight times the room the file system has.
    for i in 0..8u64 {
        let (e, d) = roundtrip(&mut s, Cmd::Read, 300 + i, i * MIB, MIB as u32, &[]);
        assert_eq!(e, None, "read of a hole at {} MiB", i);
        assert!(d.iter().all(|&b| b == 0), "a hole reads as zeroes");
    }
    assert!(
        used() <= before + 64 * 1024,
        "reading holes took {} bytes of tmpfs",
        used() - before
    );
    // Data and holes in one read: the written part comes back, the rest is zeroes.
    let (e, _) = roundtrip(&mut s, Cmd::Write, 400, 12 * MIB, 4096, &[0x77; 4096]);
    assert_eq!(e, None);
    let (e, d) = roundtrip(&mut s, Cmd::Read, 401, 12 * MIB - 4096, 3 * 4096, &[]);
    assert_eq!(e, None);
    assert!(d[..4096].iter().all(|&b| b == 0));
    assert!(d[4096..8192].iter().all(|&b| b == 0x77));
    assert!(d[8192..].iter().all(|&b| b == 0));
    srv.assert_alive("after reading holes");
}

/// (blocks, free blocks, block size) of the file system at `path`.
fn statvfs(path: &std::path::Path) -> (u64, u64, u64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_blocks, st.f_bfree, st.f_frsize)
}

#[test]
fn write_longer_than_32_mib_disconnects() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = transmission(srv.addr);
    request(&mut s, Cmd::Write, 1, 0, (32 << 20) + 1);
    let _ = s.write_all(&[0u8; 65536]);
    assert_closed(&mut s, "a 32 MiB + 1 write");
    assert_serves(&mut srv, "after an oversized write");
}

#[test]
fn client_vanishing_mid_write_leaves_the_server_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut other = transmission(srv.addr);
    for len in [4096u32, 4 << 20] {
        let mut s = transmission(srv.addr);
        request(&mut s, Cmd::Write, 1, 0, len);
        s.write_all(&vec![0x66; len as usize / 2]).unwrap();
        drop(s);
    }
    // A client that was connected all along is unaffected, and new ones are served.
    let (e, _) = roundtrip(&mut other, Cmd::Read, 1, 0, 4096, &[]);
    assert_eq!(e, None);
    std::thread::sleep(Duration::from_millis(200));
    assert_serves(&mut srv, "after clients vanished mid-write");
}

/// A garbage connection: some are pure noise, some a good greeting exchange followed by
/// noise, some a good GO followed by a bad request header.
fn garbage_connection(addr: SocketAddr, i: u64) {
    let noise = pattern(64 + (i as usize % 200), i + 1);
    match i % 3 {
        0 => {
            let mut s = connect(addr);
            let _ = s.write_all(&noise);
        }
        1 => {
            let mut s = start(addr);
            let _ = s.write_all(&noise);
            let mut b = [0u8; 64];
            let _ = s.read(&mut b);
        }
        _ => {
            let mut s = transmission(addr);
            let _ = s.write_all(&noise);
            let mut b = [0u8; 64];
            let _ = s.read(&mut b);
        }
    }
}

#[test]
fn a_thousand_garbage_connections() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let before = srv.rss_kib();
    let addr = srv.addr;
    let t0 = Instant::now();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..250u64 {
                    garbage_connection(addr, t * 1000 + i);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = t0.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    srv.assert_alive("after 1000 garbage connections");
    let info = peer_ok(Command::new("qemu-img").args(["info", &srv.uri("disk")]));
    assert!(info.contains("16 MiB (16777216 bytes)"), "{info}");
    assert_serves(&mut srv, "after 1000 garbage connections");
    let after = srv.rss_kib();
    eprintln!(
        "1000 garbage connections in {elapsed:?}; server RSS {before} KiB before, {after} KiB after"
    );
    // Bound: each connection in the transmission phase maps 32 x 1 MiB receive slots, which
    // are freed when it ends; a leak of even one slot per connection (1000 x 1 MiB) or of the
    // 64 KiB handshake buffer per connection (64 MiB) would break this bound.
    assert!(
        after < 200 * 1024 && after < before + 48 * 1024,
        "server RSS {after} KiB (was {before} KiB) after 1000 garbage connections"
    );
}

#[test]
fn connections_beyond_max_connections_are_refused_then_served_again() {
    beyond_the_connection_limit(&["--max-connections", "2"]);
}

#[test]
fn qemu_nbds_shared_is_max_connections() {
    beyond_the_connection_limit(&["--shared=2"]);
}

/// `limit` admits two clients: a third is refused until one leaves.
fn beyond_the_connection_limit(limit: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let mut args = vec!["--export".to_string(), format!("disk={}", img.display())];
    args.extend(limit.iter().map(|a| a.to_string()));
    let mut srv = start_server_v4(&args);
    let mut a = transmission(srv.addr);
    let mut b = transmission(srv.addr);
    // The third is closed without a greeting.
    let mut third = connect(srv.addr);
    assert_closed(&mut third, "a connection beyond --max-connections 2");
    // The two open ones still work; when one leaves, a new client gets in.
    for s in [&mut a, &mut b] {
        let (e, _) = roundtrip(s, Cmd::Read, 1, 0, 512, &[]);
        assert_eq!(e, None);
    }
    request(&mut a, Cmd::Disc, 2, 0, 0);
    assert_closed(&mut a, "after NBD_CMD_DISC");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // The slot is released when the connection thread ends: retry briefly.
        let mut s = connect(srv.addr);
        let mut g = [0u8; c::GREETING_LEN];
        match s.read_exact(&mut g) {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "no slot freed after DISC: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    srv.assert_alive("after refusing connections");
    drop(b);
}

#[test]
fn image_truncated_under_the_server_fails_reads_with_eio_and_keeps_the_connection() {
    // On a disk file system and on tmpfs, whose READs look at the page cache instead.
    let dirs = [Some(std::env::temp_dir()), tmpfs_dir()];
    for dir in dirs.into_iter().flatten() {
        truncated_under_the_server(&dir);
    }
}

/// /dev/shm where it is a tmpfs.
fn tmpfs_dir() -> Option<std::path::PathBuf> {
    let shm = std::path::Path::new("/dev/shm");
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let tmpfs = mounts
        .lines()
        .any(|l| l.split(' ').take(3).eq(["tmpfs", "/dev/shm", "tmpfs"]));
    tmpfs.then(|| shm.to_owned())
}

fn truncated_under_the_server(under: &std::path::Path) {
    let dir = tempfile::tempdir_in(under).unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let mut srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut s = transmission(srv.addr);
    let (e, _) = roundtrip(&mut s, Cmd::Write, 1, SIZE - 4096, 4096, &[0x42; 4096]);
    assert_eq!(e, None);
    // Another process cuts the image in half.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(SIZE / 2)
        .unwrap();
    let (e, _) = roundtrip(&mut s, Cmd::Read, 2, SIZE - 4096, 4096, &[]);
    assert_eq!(
        e,
        Some(ErrorValue::Io),
        "read past the new end, in {}",
        under.display()
    );
    // The connection goes on: the part that is still there reads.
    let (e, d) = roundtrip(&mut s, Cmd::Read, 3, 0, 4096, &[]);
    assert_eq!(e, None);
    assert_eq!(d.len(), 4096);
    srv.assert_alive("after the image shrank");
}

#[test]
fn read_only_export_answers_eperm_to_every_writing_command() {
    let (_dir, mut srv) = server_with(&["--read-only"]);
    let mut s = transmission(srv.addr);
    for (cookie, cmd) in [(1, Cmd::Trim), (2, Cmd::WriteZeroes)] {
        let (e, _) = roundtrip(&mut s, cmd, cookie, 0, 4096, &[]);
        assert_eq!(e, Some(ErrorValue::Perm), "{cmd:?}");
    }
    let (e, _) = roundtrip(&mut s, Cmd::Write, 3, 0, 4096, &[1; 4096]);
    assert_eq!(e, Some(ErrorValue::Perm));
    srv.assert_alive("after writes to a read-only export");
}

/// VmRSS of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn idle_sockets_cannot_lock_out_a_client() {
    // 400 sockets that connect and never send a byte (slowloris), against 64 handshake places:
    // the oldest are dropped as new ones come, and a real client still gets in at once.
    let (_dir, mut srv) = server_with(&["--max-handshakes", "64"]);
    let idle: Vec<TcpStream> = (0..400).map(|_| connect(srv.addr)).collect();
    let t = Instant::now();
    let mut s = transmission(srv.addr);
    let (e, _) = roundtrip(&mut s, Cmd::Read, 1, 0, 4096, &[]);
    assert_eq!(e, None);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "a real client waited {took:?}"
    );
    let rss = rss(srv.pid);
    assert!(
        rss < 256 << 20,
        "server RSS {} MiB with 400 idle sockets",
        rss >> 20
    );
    assert!(
        srv.log().contains("handshakes unfinished"),
        "no log line about the evictions:\n{}",
        srv.log()
    );
    drop(idle);
    srv.assert_alive("after 400 idle sockets");
}

#[test]
fn max_connections_counts_clients_past_the_handshake() {
    let (_dir, mut srv) = server_with(&["--max-connections", "2"]);
    // Unfinished handshakes do not take places.
    let _pending: Vec<TcpStream> = (0..5).map(|_| start(srv.addr)).collect();
    let a = transmission(srv.addr);
    let mut b = transmission(srv.addr);
    // A third client is refused: its connection closes before the handshake ends.
    let mut c = start(srv.addr);
    let data = InfoRequest {
        name: "disk",
        items: vec![],
    }
    .encode()
    .unwrap();
    send_opt(&mut c, c::OPT_GO, &data);
    let mut got = Vec::new();
    let r = c.read_to_end(&mut got);
    assert!(
        r.is_ok()
            || r.as_ref()
                .is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
        "{r:?}"
    );
    assert!(
        srv.log().contains("already serving 2"),
        "no log line for the refusal:\n{}",
        srv.log()
    );
    // The two admitted ones work; when one leaves, a new client gets its place.
    let (e, _) = roundtrip(&mut b, Cmd::Read, 1, 0, 512, &[]);
    assert_eq!(e, None);
    drop(a);
    let t = Instant::now();
    loop {
        let mut d = start(srv.addr);
        send_opt(&mut d, c::OPT_GO, &data);
        let mut h = [0u8; c::OPTION_REPLY_HEADER_LEN];
        if d.read_exact(&mut h).is_ok() {
            break;
        }
        // The first client's departure is noticed by its connection thread, not at once.
        assert!(t.elapsed() < Duration::from_secs(5), "no place freed");
    }
    srv.assert_alive("after refusing a client");
}

#[test]
fn idle_timeout_closes_a_quiet_connection() {
    let (_dir, mut srv) = server_with(&["--idle-timeout", "1"]);
    let mut s = transmission(srv.addr);
    let (e, _) = roundtrip(&mut s, Cmd::Read, 1, 0, 512, &[]);
    assert_eq!(e, None);
    let t = Instant::now();
    let mut rest = Vec::new();
    let r = s.read_to_end(&mut rest);
    let took = t.elapsed();
    assert!(r.is_ok() && rest.is_empty(), "{r:?} {rest:?}");
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(5),
        "closed after {took:?}"
    );
    assert!(srv.log().contains("idle-timeout"), "{}", srv.log());
    srv.assert_alive("after an idle close");
}

#[test]
fn one_write_at_a_time_touches_a_few_receive_slots_not_all() {
    // 64 writes of 1 MiB, one in flight at a time: the connection reuses the slot it just
    // emptied, so the server's RSS grows by a few MiB, not by its 32 slots of 1 MiB.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut s = start(srv.addr);
    assert_eq!(go(&mut s, "disk"), 64 * MIB);
    let before = rss(srv.pid);
    let data = vec![0x5au8; MIB as usize];
    for i in 0..64u64 {
        let (e, _) = roundtrip(&mut s, Cmd::Write, i, i * MIB, MIB as u32, &data);
        assert_eq!(e, None);
    }
    let grown = rss(srv.pid).saturating_sub(before);
    assert!(
        grown < 12 * MIB,
        "RSS grew by {} MiB for one write in flight",
        grown / MIB
    );
}

#[test]
fn a_placed_write_that_trickles_in_is_answered_at_its_last_byte() {
    // The NIC waits for the rest of a body placed in the image before it wakes the
    // connection (SO_RCVLOWAT): never for more than the body owes, so a client that sends
    // its payload in pieces, pausing between them, is answered when the last byte is in,
    // and the request after it is served at once.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut s = transmission(srv.addr);
    let data = pattern(MIB as usize + 4096, 11);
    request(&mut s, Cmd::Write, 1, MIB, data.len() as u32);
    let pause = || std::thread::sleep(Duration::from_millis(30));
    let mut at = 0;
    for piece in [10, 300 << 10, 500 << 10, data.len() - (800 << 10) - 11, 1] {
        pause();
        s.write_all(&data[at..at + piece]).unwrap();
        at += piece;
    }
    assert_eq!(at, data.len());
    // A reply that waited for bytes that never come would time out here (IO_TIMEOUT).
    let r = simple_reply(&mut s);
    assert_eq!((r.cookie, r.error_value()), (1, None));
    // A placed write, then a read of it, sent together; then one more, header split.
    let small = pattern(64 << 10, 12);
    request(&mut s, Cmd::Write, 2, 4 * MIB, small.len() as u32);
    s.write_all(&small).unwrap();
    request(&mut s, Cmd::Read, 3, 4 * MIB, small.len() as u32);
    assert_eq!(simple_reply(&mut s).cookie, 2);
    let r = simple_reply(&mut s);
    assert_eq!((r.cookie, r.error_value()), (3, None));
    let mut back = vec![0u8; small.len()];
    s.read_exact(&mut back).unwrap();
    assert!(back == small, "read after a placed write differs");
    let mut hdr = Request {
        flags: Default::default(),
        command: Cmd::Write,
        cookie: 4,
        offset: 6 * MIB,
        length: (small.len() as u32).into(),
    }
    .encode(false)
    .unwrap()
    .to_vec();
    hdr.extend_from_slice(&small[..100]);
    for piece in hdr.chunks(20) {
        s.write_all(piece).unwrap();
        pause();
    }
    s.write_all(&small[100..]).unwrap();
    assert_eq!(simple_reply(&mut s).error_value(), None);
    let (e, _) = roundtrip(&mut s, Cmd::Flush, 5, 0, 0, &[]);
    assert_eq!(e, None);
    let file = std::fs::read(&img).unwrap();
    let m = MIB as usize;
    assert!(file[m..m + data.len()] == data[..], "the trickled write");
    assert!(file[4 * m..4 * m + small.len()] == small[..]);
    assert!(file[6 * m..6 * m + small.len()] == small[..]);
}

/// The server's write-class system calls so far (`syscw` of /proc/PID/io: write, pwrite,
/// writev and their kin; not splice).
fn write_calls(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    let line = io.lines().find(|l| l.starts_with("syscw:")).unwrap();
    line["syscw:".len()..].trim().parse().unwrap()
}

#[test]
fn a_placed_write_s_first_bytes_go_into_the_image_with_the_rest() {
    // The first payload bytes of a WRITE arrive with its header (read ahead in one read); on
    // a raw image they go into the file with the spliced rest, not in a `pwrite` of their
    // own: one write-class call per write left, the reply's `writev`.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut s = transmission(srv.addr);
    let n = 32u64;
    let len = 256 << 10;
    let before = write_calls(srv.pid);
    for i in 0..n {
        let data = pattern(len, i + 20);
        let mut msg = Request {
            flags: Default::default(),
            command: Cmd::Write,
            cookie: i,
            offset: i * len as u64,
            length: (len as u32).into(),
        }
        .encode(false)
        .unwrap()
        .to_vec();
        msg.extend_from_slice(&data);
        s.write_all(&msg).unwrap();
        let r = simple_reply(&mut s);
        assert_eq!((r.cookie, r.error_value()), (i, None));
    }
    let calls = write_calls(srv.pid) - before;
    assert!(calls <= n + n / 4, "{calls} write calls for {n} writes");
    let file = std::fs::read(&img).unwrap();
    for i in 0..n as usize {
        assert!(
            file[i * len..(i + 1) * len] == pattern(len, i as u64 + 20)[..],
            "write {i}"
        );
    }
}

/// A connection in the transmission phase with extended headers negotiated.
fn extended_transmission(addr: SocketAddr) -> TcpStream {
    let mut s = start(addr);
    send_opt(&mut s, c::OPT_EXTENDED_HEADERS, &[]);
    let (h, _) = read_opt_reply(&mut s);
    assert_eq!(h.reply_type, c::REP_ACK, "extended headers refused");
    assert_eq!(go(&mut s, "disk"), SIZE);
    s
}

/// Sends an extended request (with `payload` after it) and returns its one-chunk reply:
/// (reply type, error value of an error chunk).
fn ext_roundtrip(s: &mut TcpStream, req: Request, payload: &[u8]) -> (u16, Option<u32>) {
    s.write_all(&req.encode(true).unwrap()).unwrap();
    s.write_all(payload).unwrap();
    let mut h = [0u8; c::EXTENDED_REPLY_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let h = StructuredReplyHeader::parse_as(&h, true).unwrap();
    assert_eq!((h.cookie, h.offset), (req.cookie, Some(req.offset)));
    assert!(h.is_done());
    let mut p = vec![0u8; h.length as usize];
    s.read_exact(&mut p).unwrap();
    let err = (h.reply_type & c::REPLY_TYPE_FLAG_ERROR != 0)
        .then(|| u32::from_be_bytes(p[..4].try_into().unwrap()));
    (h.reply_type, err)
}

#[test]
fn extended_headers_payload_rules() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = server(dir.path());
    let mut s = extended_transmission(srv.addr);
    let req = |flags: u16, command, cookie, length| Request {
        flags: nbd_proto::flags::CmdFlags(flags),
        command,
        cookie,
        offset: 4096,
        length,
    };
    let pl = c::CMD_FLAG_PAYLOAD_LEN;
    // a WRITE with its payload flag, read back
    let data = pattern(4096, 9);
    let w = ext_roundtrip(&mut s, req(pl, Cmd::Write, 1, 4096), &data);
    assert_eq!(w, (c::REPLY_TYPE_NONE, None));
    // a WRITE without the flag still has its payload, as qemu sends it
    let w = ext_roundtrip(&mut s, req(0, Cmd::Write, 2, 4096), &data);
    assert_eq!(w, (c::REPLY_TYPE_NONE, None));
    // a payload on a READ is read (not taken for requests) and refused
    let r = ext_roundtrip(&mut s, req(pl, Cmd::Read, 3, 100), &[0x55; 100]);
    assert_eq!(r, (c::REPLY_TYPE_ERROR, Some(c::EINVAL)));
    // a 64-bit effect length: past the end, so EINVAL, but understood as 64 bits
    let t = ext_roundtrip(&mut s, req(0, Cmd::Trim, 4, 1 << 40), &[]);
    assert_eq!(t, (c::REPLY_TYPE_ERROR, Some(c::EINVAL)));
    // the data written is intact
    s.write_all(&req(0, Cmd::Read, 5, 4096).encode(true).unwrap())
        .unwrap();
    let mut h = [0u8; c::EXTENDED_REPLY_HEADER_LEN + 8];
    s.read_exact(&mut h).unwrap();
    let rh = StructuredReplyHeader::parse_as(&h, true).unwrap();
    assert_eq!(rh.reply_type, c::REPLY_TYPE_OFFSET_DATA);
    let mut back = vec![0u8; 4096];
    s.read_exact(&mut back).unwrap();
    assert!(back == data);
    // a compact request on an extended connection is a protocol violation: disconnect
    s.write_all(&req(0, Cmd::Read, 6, 512).encode(false).unwrap())
        .unwrap();
    s.write_all(&[0; 4]).unwrap();
    assert_closed(&mut s, "compact request after extended headers");
    assert_serves(
        &mut srv,
        "after a compact request on an extended connection",
    );
}

/// Clients that pipeline 32 READs of 32 MiB each and never read the replies, on an export
/// whose reads go through registered buffers (`export`: qcow2, or the holes of a tmpfs
/// image): the server's memory grows by its bound (`--buffer-memory 16M` and a few MiB per
/// connection), not by the 1 GiB each client asked for; a client that then reads its
/// replies gets every byte right.
fn unread_replies_hold_bounded_memory(dir: &std::path::Path, export: &std::path::Path) {
    let srv = start_server_v4(&args(&[
        "--buffer-memory",
        "16M",
        "--export",
        &format!("disk={}", export.display()),
    ]));
    let before = rss(srv.pid);
    let mut clients: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = start(srv.addr);
            assert_eq!(go(&mut s, "disk"), 64 * MIB);
            for i in 0..32u64 {
                request(&mut s, Cmd::Read, i, (i % 2) * 32 * MIB, 32 * MIB as u32);
            }
            s
        })
        .collect();
    // Long enough for the old server to read 2 GiB into buffers.
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss(srv.pid).saturating_sub(before);
    assert!(
        grown < 64 * MIB,
        "{}: RSS grew by {} MiB for replies nobody reads",
        export.display(),
        grown / MIB
    );
    // The replies are all there, in order of the reads' pieces.
    let want = std::fs::read(dir.join("expected")).unwrap();
    let s = &mut clients[0];
    let mut data = vec![0u8; 32 * MIB as usize];
    for _ in 0..32 {
        let r = simple_reply(s);
        assert_eq!(r.error_value(), None);
        s.read_exact(&mut data).unwrap();
        let at = (r.cookie % 2 * 32 * MIB) as usize;
        assert!(
            data == want[at..at + data.len()],
            "read {} came back wrong",
            r.cookie
        );
    }
}

#[test]
fn unread_replies_on_qcow2_hold_bounded_memory() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("disk.qcow2");
    let q_s = q.to_str().unwrap();
    peer_ok(Command::new("qemu-img").args(["create", "-f", "qcow2", q_s, "64M"]));
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0x3c 1M 2M", q_s]));
    peer_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", "write -P 0xc3 40M 1M", q_s]));
    let mut expected = vec![0u8; 64 * MIB as usize];
    expected[MIB as usize..3 * MIB as usize].fill(0x3c);
    expected[40 * MIB as usize..41 * MIB as usize].fill(0xc3);
    std::fs::write(dir.path().join("expected"), expected).unwrap();
    unread_replies_hold_bounded_memory(dir.path(), &q);
}

#[test]
fn unread_replies_of_tmpfs_holes_hold_bounded_memory() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=128m", "qpip-unread"])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(mounted.success(), "mount a tmpfs");
    struct Unmount<'a>(&'a std::path::Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
    let _unmount = Unmount(dir.path());
    let img = qpip_test_support::pattern::image_with(dir.path(), "disk.img", 64 * MIB, &[(0, MIB)]);
    let mut expected = vec![0u8; 64 * MIB as usize];
    expected[..MIB as usize]
        .copy_from_slice(&qpip_test_support::pattern::at_offset(0, MIB as usize));
    std::fs::write(dir.path().join("expected"), expected).unwrap();
    unread_replies_hold_bounded_memory(dir.path(), &img);
}

#[test]
fn disc_after_pipelined_requests_answers_them_all_first() {
    // The spec: on NBD_CMD_DISC the server finishes the requests in flight and sends their
    // replies before it closes. Here they all come in one send, so that the server sees the
    // DISC in the same batch of completions as the requests before it.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut s = transmission(srv.addr);
    const WRITES: u64 = 8;
    const LEN: u32 = 4096;
    let mut out = Vec::new();
    for i in 0..WRITES {
        let r = Request {
            flags: Default::default(),
            command: Cmd::Write,
            cookie: 100 + i,
            offset: i * 65536,
            length: LEN.into(),
        };
        out.extend_from_slice(&r.encode(false).unwrap());
        out.extend_from_slice(&pattern(LEN as usize, i + 1));
    }
    for (cookie, command) in [(200, Cmd::Flush), (300, Cmd::Disc)] {
        let r = Request {
            flags: Default::default(),
            command,
            cookie,
            offset: 0,
            length: 0u32.into(),
        };
        out.extend_from_slice(&r.encode(false).unwrap());
    }
    s.write_all(&out).unwrap();
    for cookie in (100..100 + WRITES).chain([200]) {
        let r = simple_reply(&mut s);
        assert_eq!(r.cookie, cookie, "replies in order");
        assert_eq!(r.error_value(), None, "reply to {cookie}");
    }
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "nothing after the FLUSH's reply: {rest:?}");
    let disk = std::fs::read(&img).unwrap();
    for i in 0..WRITES {
        let at = (i * 65536) as usize;
        assert!(
            disk[at..at + LEN as usize] == pattern(LEN as usize, i + 1)[..],
            "write {i} on the disk"
        );
    }
}

/// A TRIM of a whole 1 PiB qcow2 disk (one extended request, 64-bit length) is answered,
/// and a second connection's READs meanwhile are each answered within a second: the store
/// is not held for long at a time. WRITE_ZEROES of the whole disk likewise, then block
/// status of the whole disk (qemu-img map) answers at once.
#[test]
fn whole_disk_trim_of_a_petabyte_qcow2_leaves_reads_answered() {
    if !require(&["qemu-img"]) {
        return;
    }
    const PIB: u64 = 1 << 50;
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("huge.qcow2");
    let q_s = q.to_str().unwrap();
    peer_ok(Command::new("qemu-img").args(["create", "-f", "qcow2", q_s, "1P"]));
    let srv = start_server_v4(&["--export".into(), format!("disk={q_s}")]);
    let mut reader = start(srv.addr);
    assert_eq!(go(&mut reader, "disk"), PIB);
    for (i, command) in [Cmd::Trim, Cmd::WriteZeroes].into_iter().enumerate() {
        let mut s = start(srv.addr);
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        send_opt(&mut s, c::OPT_EXTENDED_HEADERS, &[]);
        let (h, _) = read_opt_reply(&mut s);
        assert_eq!(h.reply_type, c::REP_ACK, "extended headers refused");
        assert_eq!(go(&mut s, "disk"), PIB);
        let req = Request {
            flags: Default::default(),
            command,
            cookie: 7,
            offset: 0,
            length: PIB,
        };
        let started = Instant::now();
        let whole = std::thread::spawn(move || {
            let r = ext_roundtrip(&mut s, req, &[]);
            (r, started.elapsed())
        });
        let mut slowest = Duration::ZERO;
        let mut reads = 0u64;
        while !whole.is_finished() {
            let at = (reads * 0x1234_5678_9000 + (i as u64) * 4096) % PIB;
            let t = Instant::now();
            let (err, data) = roundtrip(&mut reader, Cmd::Read, reads, at, 4096, &[]);
            slowest = slowest.max(t.elapsed());
            assert_eq!(err, None);
            assert!(data.iter().all(|&b| b == 0));
            reads += 1;
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{command:?} of 1 PiB not answered"
            );
        }
        let ((reply_type, err), took) = whole.join().unwrap();
        assert_eq!((reply_type, err), (c::REPLY_TYPE_NONE, None), "{command:?}");
        eprintln!(
            "{command:?} of 1 PiB: {took:?}; {reads} reads meanwhile, the slowest {slowest:?}"
        );
        assert!(
            slowest < Duration::from_secs(1),
            "a READ during the {command:?} took {slowest:?}"
        );
    }
    let t = Instant::now();
    let map = run_with_timeout(
        Command::new("qemu-img").args(["map", "-f", "raw", "--output=json", &srv.uri("disk")]),
        Duration::from_secs(60),
    );
    let map = text(&map);
    assert!(
        map.contains(r#""start": 0, "length": 1125899906842624, "depth": 0, "present": true, "zero": true, "data": false"#),
        "{map}"
    );
    eprintln!("qemu-img map of 1 PiB: {:?}", t.elapsed());
}

#[test]
fn idle_timeout_frees_the_places_of_clients_that_never_read_their_replies() {
    // Issue 24 item 11: clients that pipeline big READs and never read a reply hold their
    // connection places. With --idle-timeout 2, a connection whose client has read no reply
    // for 2 s is closed, and a new client gets in within seconds (not after 60 s).
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let srv = start_server_v4(&args(&[
        "--idle-timeout",
        "2",
        "--max-connections",
        "4",
        "--export",
        &format!("disk={}", img.display()),
    ]));
    let hogs: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = start(srv.addr);
            assert_eq!(go(&mut s, "disk"), 64 * MIB);
            for i in 0..32u64 {
                request(&mut s, Cmd::Read, i, (i % 2) * 32 * MIB, 32 * MIB as u32);
            }
            s
        })
        .collect();
    let t = Instant::now();
    let addr = srv.addr;
    let mut s = loop {
        // Refused (all places taken): the server closes during the GO, and `go` panics.
        if let Ok(s) = std::panic::catch_unwind(|| {
            let mut s = start(addr);
            go(&mut s, "disk");
            s
        }) {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no place freed in {:?}:\n{}",
            t.elapsed(),
            srv.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = t.elapsed();
    let (e, back) = roundtrip(&mut s, Cmd::Read, 1, 0, 4096, &[]);
    assert_eq!(e, None);
    assert_eq!(back.len(), 4096);
    assert!(
        took < Duration::from_secs(8),
        "a new client waited {took:?}"
    );
    assert!(
        srv.log().contains("has not read a reply for 2 s"),
        "no log line saying why:\n{}",
        srv.log()
    );
    drop(hogs);
}

#[test]
fn a_connect_and_reset_flood_is_logged_a_line_a_second_not_a_line_a_connection() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", SIZE);
    let mut srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let t = Instant::now();
    for _ in 0..600 {
        let s = TcpStream::connect(srv.addr).unwrap();
        // SO_LINGER 0: close sends a reset, as a port scanner or a crashed client does.
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: setsockopt on a socket this loop owns, with a linger struct that outlives
        // the call.
        let r = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&raw const linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
        drop(s);
    }
    assert_serves(&mut srv, "after 600 connect-and-reset clients");
    // Their connection threads may still be ending.
    std::thread::sleep(Duration::from_secs(1));
    let secs = t.elapsed().as_secs() + 1;
    let log = srv.log();
    let lines = log
        .lines()
        .filter(|l| l.contains("connection ended"))
        .count() as u64;
    assert!(
        lines <= secs + 1,
        "{lines} log lines about ended connections in {secs} s:\n{log}"
    );
}
