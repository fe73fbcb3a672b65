//! Reliable QPs over Unix-domain stream sockets on the soft NIC: the same messages as over
//! TCP, a socket file only its owner may use (mode 0600 before it appears at its path),
//! removed when the listener goes.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::time::Duration;

use common::wait_n;
use qpip_core::backend::UNIX_ADDR;
use qpip_core::{Access, Nic, QpAttr, RecvWr, SendWr, WcStatus};

const T: Duration = Duration::from_secs(10);

#[test]
fn messages_over_a_unix_socket_then_the_file_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qp.sock");
    let nic = Nic::soft().unwrap();
    let listener = nic.listen_unix(&path).unwrap();
    assert_eq!(listener.unix_path(), Some(path.as_path()));
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // Bound in a private directory beside it and renamed into place: nothing else is left.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["qp.sock"]);

    let cq = nic.create_cq(64);
    let server = nic.create_qp(QpAttr::new(&cq));
    let client = nic.create_qp(QpAttr::new(&cq));
    client.connect_unix(&path, T).unwrap();
    assert_eq!(listener.accept_timeout(&server, T).unwrap(), UNIX_ADDR);

    let mr = nic.alloc_region(1 << 20, Access::READ_WRITE);
    server
        .post_recv(RecvWr::new(1, &[mr.sge(0, 1 << 19)]))
        .unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    mr.write_at(1 << 19, &data);
    client
        .post_send(SendWr::new(2, &[mr.sge(1 << 19, data.len())]))
        .unwrap();
    let got = wait_n(&cq, 2, T);
    let recv = got.iter().find(|c| c.wr_id == 1).unwrap();
    assert_eq!(
        (recv.status, recv.byte_len as usize),
        (WcStatus::Success, data.len())
    );
    let mut back = vec![0u8; data.len()];
    mr.read_at(0, &mut back);
    assert!(back == data);

    drop(listener);
    let deadline = std::time::Instant::now() + T;
    while path.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "socket file left behind"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn stale_sockets_are_replaced_and_other_files_kept() {
    let dir = tempfile::tempdir().unwrap();
    let nic = Nic::soft().unwrap();
    // A stale socket: bound, its server gone.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let l = nic.listen_unix(&stale).unwrap();
    // A live one is not taken over.
    let e = nic.listen_unix(&stale).unwrap_err().to_string();
    assert!(e.contains("stale.sock"), "{e}");
    drop(l);
    // A regular file is never removed.
    let file = dir.path().join("data");
    std::fs::write(&file, b"keep").unwrap();
    let e = nic.listen_unix(&file).unwrap_err();
    assert!(e.to_string().contains("data"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
    // Nobody listening: a clear connect error naming the path.
    let cq = nic.create_cq(4);
    let qp = nic.create_qp(QpAttr::new(&cq));
    let e = qp
        .connect_unix(&dir.path().join("none.sock"), T)
        .unwrap_err();
    assert!(e.to_string().contains("none.sock"), "{e}");
}
