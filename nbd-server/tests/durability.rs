//! Durability and shutdown: acknowledged, flushed writes survive a kill -9 of the server;
//! SIGTERM during a running write job ends the server cleanly (exit 0) within seconds.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

#[test]
fn flushed_writes_survive_kill_9() {
    if !require(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 32 * MIB);
    let args = vec!["--export".to_string(), format!("disk={}", img.display())];
    let mut srv = start_server_v4(&args);
    qemu_io(
        &srv.uri("disk"),
        &[
            "write -P 0xc3 0 4M",
            "write -P 0x3c 8M 1M",
            "write -f -P 0x5a 20M 64k",
            "flush",
        ],
    );
    srv.kill9();
    assert!(!srv.alive());

    let srv = start_server_v4(&args);
    qemu_io(
        &srv.uri("disk"),
        &[
            "read -P 0xc3 0 4M",
            "read -P 0 4M 4M",
            "read -P 0x3c 8M 1M",
            "read -P 0x5a 20M 64k",
        ],
    );
    let file = std::fs::read(&img).unwrap();
    assert!(file[..4 << 20].iter().all(|&b| b == 0xc3));
    assert!(file[8 << 20..9 << 20].iter().all(|&b| b == 0x3c));
}

#[test]
fn sigterm_during_fio_write_job_exits_zero() {
    if !require(&["fio"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "disk.img", 64 * MIB);
    let mut srv = start_server_v4(&["--export".into(), format!("disk={}", img.display())]);
    let mut fio = Command::new("fio")
        .args([
            "--name=busy",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("disk")),
            "--rw=randwrite",
            "--bs=64k",
            "--size=64M",
            "--iodepth=16",
            "--time_based",
            "--runtime=30",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting fio");
    // Wait until fio's connection is in the transmission phase and writing.
    let t0 = Instant::now();
    while !srv.log().contains("client connected") {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "fio never connected; server log:\n{}",
            srv.log()
        );
        assert!(fio.try_wait().unwrap().is_none(), "fio exited early");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio should still be writing"
    );

    let sent = Instant::now();
    srv.signal(libc::SIGTERM);
    let status = srv.wait_timeout(Duration::from_secs(8));
    let took = sent.elapsed();
    let _ = fio.kill();
    let _ = fio.wait();
    let status = status.unwrap_or_else(|| {
        panic!(
            "the server did not exit within 8 s of SIGTERM; log:\n{}",
            srv.log()
        )
    });
    assert!(
        status.success(),
        "exit status {status} after SIGTERM; log:\n{}",
        srv.log()
    );
    assert!(took < Duration::from_secs(8), "took {took:?}");
    assert!(srv.log().contains("shutting down"), "{}", srv.log());
}
