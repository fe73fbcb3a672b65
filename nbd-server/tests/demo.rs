//! Demo mode (no exports named): the generated image lives where no other local user can
//! reach it. It used to be `$TMPDIR/qpip-demo-UID/demo.img`, a predictable path at which any
//! local user could plant a symlink to a file of root's and then read and overwrite that file
//! over NBD once root started the server.

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::net::TcpStream;

use common::*;
use nbd::client::{NbdClient, handshake};

const SECRET: &[u8] = b"root-only secret: must never be served\n";

#[test]
fn demo_mode_does_not_follow_a_planted_symlink() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    // The attacker's plant, at every name the old demo used (whatever uid runs the test).
    // SAFETY: getuid takes nothing and cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut planted = vec![format!("qpip-demo-{uid}"), "qpip-demo-0".into()];
    planted.dedup();
    for name in &planted {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&secret, dir.join("demo.img")).unwrap();
    }

    let srv = start_server_env("127.0.0.1:0", &[], &[("TMPDIR", tmp.path())]);
    let mut tcp = TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"demo").expect("demo export");
    assert_eq!(export.size, 64 << 20, "the demo is its own 64 MiB image");
    let mut c = NbdClient::new(tcp, &export);
    let mut head = vec![0u8; 64];
    c.read_exact(&mut head).unwrap();
    assert!(
        head.starts_with(b"qpip demo image"),
        "served bytes are not the demo banner: {:?}",
        String::from_utf8_lossy(&head)
    );
    c.seek(SeekFrom::Start(0)).unwrap();
    c.write_all(&[0xAA; 4096]).unwrap();
    c.flush().unwrap();
    drop(c);
    drop(srv);
    assert_eq!(
        std::fs::read(&secret).unwrap(),
        SECRET,
        "the secret was changed"
    );
    // Nothing was created under $TMPDIR either.
    let mut names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), planted.len() + 1, "{names:?}");
}

#[test]
fn demo_writes_read_back_while_the_server_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let srv = start_server_env("127.0.0.1:0", &[], &[("TMPDIR", tmp.path())]);
    let mut tcp = TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"").expect("the demo is the default export");
    let mut c = NbdClient::new(tcp, &export);
    let data = pattern(1 << 20, 7);
    c.seek(SeekFrom::Start(3 << 20)).unwrap();
    c.write_all(&data).unwrap();
    c.seek(SeekFrom::Start(3 << 20)).unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == data);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    // The hint names the port it listens on (not NBD's default here), so it works as given.
    let want = format!("try: nbdinfo nbd://127.0.0.1:{}/demo", srv.addr.port());
    assert!(srv.log().contains(&want), "{}", srv.log());
}
