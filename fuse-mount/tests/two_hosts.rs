//! qpip-nbd-mount and its server on two hosts: the server in a network namespace of its own,
//! the mount here, across a veth link with a 1500-byte MTU (issue 36). Needs root, /dev/fuse
//! and `ip`; skipped with a note where network namespaces cannot be made (a failure in CI).

mod common;

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use qpip_test_support::netns::Netns;
use qpip_test_support::servers::qpip_server_in;

const MIB: u64 = 1 << 20;
/// What each writer writes, a MiB and an fsync at a time.
const SPAN: u64 = 32 * MIB;

/// Writes `SPAN` bytes of the offset pattern from `base` into `path`, 1 MiB then fsync at a
/// time; `acked` counts the bytes whose fsync has returned.
///
/// The file is open only in the writer's own fd table (unshare(CLONE_FILES)): a process the
/// test starts meanwhile (`ip`, the server) would otherwise inherit the descriptor, and its
/// exec closes it (O_CLOEXEC), which FUSE turns into a flush that waits for the write whose
/// reply is lost — so the `ip link set up` meant to end the outage would itself wait for the
/// mount to give up.
fn writer(path: PathBuf, base: u64, acked: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        // SAFETY: plain syscall: this thread gets a copy of the fd table of its own.
        if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
            panic!("unshare(CLONE_FILES): {}", std::io::Error::last_os_error());
        }
        let f = OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for off in (base..base + SPAN).step_by(MIB as usize) {
            f.write_all_at(&pattern(off, MIB as usize), off)
                .unwrap_or_else(|e| panic!("write at {off}: {e}"));
            f.sync_all()
                .unwrap_or_else(|e| panic!("fsync after the write at {off}: {e}"));
            acked.store(off + MIB - base, Ordering::SeqCst);
        }
    })
}

/// Waits until the writer has `at_least` bytes acknowledged.
fn wait_acked(acked: &AtomicU64, at_least: u64) {
    let t = Instant::now();
    while acked.load(Ordering::SeqCst) < at_least {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the writer is stuck at {} bytes",
            acked.load(Ordering::SeqCst)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The link goes down for 10 s in the middle of a stream of writes and fsyncs, then the
/// server restarts in the middle of another: every write and fsync succeeds, and everything
/// acknowledged is in the image and read back through the mount.
#[test]
fn a_mount_survives_its_link_down_for_10_s_and_a_server_restart_mid_write() {
    if !can_fuse() {
        return;
    }
    let Some(ns) = Netns::create(1500) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "t.img", 4 * SPAN);
    let server = qpip_server_in(&ns, 0, "t", &img, &[]);
    let port = server.port;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = mount(&server.uri, &mnt, "t", &["--connections", "1"]);
    let file = mnt.join("t");

    let acked = Arc::new(AtomicU64::new(0));
    let w = writer(file.clone(), 0, acked.clone());
    wait_acked(&acked, 4 * MIB);
    ns.set_link(false);
    let down_at = acked.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_secs(10));
    // The writes crossed the link: with it down, at most the fsync whose answer was already
    // here completed.
    let while_down = acked.load(Ordering::SeqCst);
    assert!(
        while_down <= down_at + MIB,
        "{} MiB acknowledged with the link down",
        (while_down - down_at) / MIB
    );
    ns.set_link(true);
    w.join()
        .expect("the writer failed across the link's outage");

    let acked = Arc::new(AtomicU64::new(0));
    let w = writer(file.clone(), SPAN, acked.clone());
    wait_acked(&acked, 4 * MIB);
    drop(server);
    std::thread::sleep(Duration::from_secs(1));
    let _server = qpip_server_in(&ns, port, "t", &img, &[]);
    w.join()
        .expect("the writer failed across the server's restart");

    let want = pattern(0, (2 * SPAN) as usize);
    let mut on_disk = vec![0u8; want.len()];
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut on_disk, 0)
        .unwrap();
    assert!(on_disk == want, "the image lost acknowledged writes");
    let f = std::fs::File::open(&file).unwrap();
    // SAFETY: plain syscall on an open fd: the reads below go to the server.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut back = vec![0u8; want.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == want, "the mount reads back other data");
}
