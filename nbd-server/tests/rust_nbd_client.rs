//! The Rust `nbd` crate (crates.io) as a client: a simple synchronous client that negotiates
//! with NBD_OPT_EXPORT_NAME (no NO_ZEROES, so the server sends the 124 zero bytes) and uses
//! simple replies only.

mod common;

use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::net::TcpStream;

use common::*;
use nbd::client::{NbdClient, NbdExt, handshake};

const MIB: u64 = 1 << 20;

#[test]
fn nbd_crate_write_read_trim_via_export_name() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 16 * MIB);
    let srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);

    let mut tcp = TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"disk").expect("EXPORT_NAME handshake");
    assert_eq!(export.size, 16 * MIB);
    assert!(!export.readonly);
    assert!(export.send_flush && export.send_trim, "{export:?}");

    let mut c = NbdClient::new(tcp, &export);
    // 4 MiB in one request: four of the server's 1 MiB receive chunks, at an odd offset.
    let data = pattern(4 * MIB as usize, 42);
    let off = MIB + 512;
    c.seek(SeekFrom::Start(off)).unwrap();
    c.write_all(&data).unwrap();
    c.flush().unwrap();
    c.seek(SeekFrom::Start(off)).unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == data, "read back differs from what was written");

    // Trim the first MiB of the pattern; it reads back as zeroes, the rest is intact.
    c.seek(SeekFrom::Start(2 * MIB)).unwrap();
    c.trim(MIB as usize).unwrap();
    c.seek(SeekFrom::Start(2 * MIB)).unwrap();
    let mut z = vec![1u8; MIB as usize];
    c.read_exact(&mut z).unwrap();
    assert!(z.iter().all(|&b| b == 0), "trimmed range is not zero");
    c.seek(SeekFrom::Start(off)).unwrap();
    let mut head = vec![0u8; (2 * MIB - off) as usize];
    c.read_exact(&mut head).unwrap();
    assert!(head == data[..head.len()]);

    // The image file holds the data.
    let file = std::fs::read(&img).unwrap();
    let o = off as usize;
    assert!(file[o..o + head.len()] == data[..head.len()]);
    assert!(file[3 * MIB as usize..o + data.len()] == data[(3 * MIB - off) as usize..]);
}

#[test]
fn nbd_crate_default_export_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "ro.img", 2 * MIB);
    std::fs::write(&img, pattern(2 * MIB as usize, 9)).unwrap();
    let srv = start_server_v4(&[
        "--export".into(),
        format!("ro={}", img.display()),
        "--default-export".into(),
        "ro".into(),
        "--read-only".into(),
    ]);
    let mut tcp = TcpStream::connect(srv.addr).unwrap();
    // The empty name selects the default export.
    let export = handshake(&mut tcp, b"").expect("EXPORT_NAME handshake with the empty name");
    assert_eq!(export.size, 2 * MIB);
    assert!(export.readonly);
    let mut c = NbdClient::new(tcp, &export);
    let mut all = vec![0u8; 2 * MIB as usize];
    c.read_exact(&mut all).unwrap();
    assert!(all == pattern(2 * MIB as usize, 9));
    c.seek(SeekFrom::Start(0)).unwrap();
    let e = c
        .write(&[1u8; 4096])
        .expect_err("a write to a read-only export must fail");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    // The connection is still usable after the error.
    c.seek(SeekFrom::Start(4096)).unwrap();
    let mut b = vec![0u8; 4096];
    c.read_exact(&mut b).unwrap();
    assert!(b[..] == all[4096..8192]);
}
