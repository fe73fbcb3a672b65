//! qpip-nbd-mount end to end: real servers, a real FUSE mount, loop devices and ext2.

mod common;

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::Duration;

use common::*;

const MIB: u64 = 1 << 20;

/// Every mount test runs twice: over /dev/fuse (`NAME::dev`) and over FUSE io_uring
/// (`NAME::uring`).
macro_rules! on_both_transports {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn dev() {
                if super::common::use_transport("dev") {
                    super::$name()
                }
            }
            #[test]
            fn uring() {
                if super::common::use_transport("uring") {
                    super::$name()
                }
            }
        }
    )*};
}

on_both_transports!(
    io_continues_across_a_server_restart,
    reconnects_give_back_every_descriptor_and_thread,
    a_server_gone_for_good_fails_io_with_eio_after_the_reconnect_timeout,
    a_mount_whose_server_is_gone_exits_promptly_once_unmounted,
    write_through_refuses_writes_past_the_end_at_once,
    cache_none_reads_and_writes_go_to_the_server,
    file_size_pattern_io_fsync_punch_hole_and_fusermount_exit,
    ext2_on_a_loop_device_over_the_fuse_file_survives_a_remount,
    ext2_on_a_loop_device_over_an_uncached_fuse_file_survives_a_remount,
    ext2_on_a_direct_io_loop_device_over_the_fuse_file_survives_a_remount,
    read_only_export_and_read_only_option_refuse_writes,
    sigterm_and_sigint_unmount_and_exit_zero,
    daemon_mode_returns_once_mounted,
    errors_are_clear_and_exit_non_zero,
    server_eio_reaches_the_application_as_eio,
    unaligned_io_against_a_4k_minimum_block_size,
    a_silent_server_fails_a_read_within_request_plus_reconnect_timeout,
    sigterm_ends_a_read_stuck_on_a_silent_server_and_exits,
);

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

fn fallocate(f: &std::fs::File, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: plain syscall on an open fd.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, len as i64) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn file_size_pattern_io_fsync_punch_hole_and_fusermount_exit() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "a.img", 64 * MIB);
    let server = qpip_server("disk", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(&server.uri, &mnt, "disk", &[]);

    // The directory holds the one file, with the export's size.
    let names: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["disk"]);
    let meta = std::fs::metadata(&m.file).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.len(), 64 * MIB);
    assert_eq!(meta.ino(), 2);
    assert_eq!(meta.mode() & 0o777, 0o644);
    assert_eq!(meta.blocks(), 64 * MIB / 512);

    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&m.file)
        .unwrap();
    // Odd offsets and lengths, one across many max_io splits and a page boundary.
    let writes = [
        (12_345u64, 300_001usize),
        (7, 1),
        (5 * MIB - 3, 2 * MIB as usize + 5),
    ];
    for &(off, len) in &writes {
        f.write_all_at(&pattern(off, len), off).unwrap();
    }
    f.sync_all().unwrap();
    let image = std::fs::File::open(&img).unwrap();
    for &(off, len) in &writes {
        let mut back = vec![0u8; len];
        f.read_exact_at(&mut back, off).unwrap();
        assert!(back == pattern(off, len), "read back at {off} differs");
        let mut server_side = vec![0u8; len];
        image.read_exact_at(&mut server_side, off).unwrap();
        assert!(server_side == pattern(off, len), "image at {off} differs");
    }

    // Punch a hole (TRIM) inside written data: zeroes through FUSE and in the image.
    let (hole, hole_len) = (5 * MIB + 4096, 256 * 1024);
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        hole,
        hole_len,
    )
    .unwrap();
    let mut z = vec![1u8; hole_len as usize];
    f.read_exact_at(&mut z, hole).unwrap();
    assert!(z.iter().all(|&b| b == 0), "punched hole reads non-zero");
    image.read_exact_at(&mut z, hole).unwrap();
    assert!(
        z.iter().all(|&b| b == 0),
        "punched hole not zero in the image"
    );
    // The data around it is intact.
    let mut edge = vec![0u8; 4096];
    f.read_exact_at(&mut edge, hole - 4096).unwrap();
    assert!(edge == pattern(hole - 4096, 4096));
    // ZERO_RANGE at an odd range → WRITE_ZEROES (plus written edges).
    let (zr, zr_len) = (12_345 + 10, 100_000u64);
    fallocate(
        &f,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        zr,
        zr_len,
    )
    .unwrap();
    let mut z = vec![1u8; zr_len as usize + 2];
    f.read_exact_at(&mut z, zr - 1).unwrap();
    assert_eq!(z[0], pattern(zr - 1, 1)[0]);
    assert!(z[1..=zr_len as usize].iter().all(|&b| b == 0));
    assert_eq!(z[zr_len as usize + 1], pattern(zr + zr_len, 1)[0]);

    // The size cannot change; writing past the end is ENOSPC: with the writeback cache (the
    // default) the page cache takes the byte and its writeback fails, which fsync reports.
    let e = f.set_len(MIB).unwrap_err();
    assert_eq!(errno(&e), libc::EINVAL, "{e}");
    // O_TRUNC (dd without conv=notrunc, cp) is ignored, as a block device ignores it.
    let before = std::fs::read(&m.file).unwrap();
    let g = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&m.file)
        .expect("open(O_TRUNC) of the export's file");
    g.write_all_at(b"trunc", 0).unwrap();
    drop(g);
    let after = std::fs::read(&m.file).unwrap();
    assert_eq!(after.len() as u64, 64 * MIB, "O_TRUNC changed the size");
    assert_eq!(&after[..5], b"trunc");
    assert_eq!(after[5..], before[5..], "O_TRUNC changed the contents");
    f.write_all_at(&before[..5], 0).unwrap();
    match f.write_at(b"x", 64 * MIB) {
        Err(e) => assert_eq!(errno(&e), libc::ENOSPC, "{e}"),
        Ok(_) => {
            let e = f.sync_all().unwrap_err();
            assert_eq!(errno(&e), libc::ENOSPC, "{e}");
        }
    }
    drop(f);

    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    let status = m.wait_exit();
    assert!(status.success(), "{status}");
}

/// Without the writeback cache every write(2) goes to the server before it returns: one past
/// the end fails at once.
fn write_through_refuses_writes_past_the_end_at_once() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "w.img", 8 * MIB);
    let server = qpip_server("w", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = mount(&server.uri, &mnt, "w", &["--cache", "writethrough"]);
    let f = OpenOptions::new().write(true).open(&m.file).unwrap();
    let e = f.write_at(b"x", 8 * MIB).unwrap_err();
    assert_eq!(errno(&e), libc::ENOSPC, "{e}");
    f.write_all_at(&pattern(4096, 8192), 4096).unwrap();
    let mut back = vec![0u8; 8192];
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut back, 4096)
        .unwrap();
    assert!(
        back == pattern(4096, 8192),
        "written through before write(2) returned"
    );
    assert_eq!(std::fs::metadata(&m.file).unwrap().len(), 8 * MIB);
}

/// `--cache none` (FOPEN_DIRECT_IO): a read on an open file sees what changed in the image
/// since the last read (a page cache would answer from memory), a write is in the image when
/// write(2) returns, and a shared mapping still works (FUSE_DIRECT_IO_ALLOW_MMAP).
fn cache_none_reads_and_writes_go_to_the_server() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "n.img", 8 * MIB);
    let image = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    image.write_all_at(&pattern(0, 65536), 0).unwrap();
    let server = qpip_server("n", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = mount(&server.uri, &mnt, "n", &["--cache", "none"]);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&m.file)
        .unwrap();
    let mut back = vec![0u8; 65536];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == pattern(0, 65536), "first read");
    image.write_all_at(&pattern(99, 65536), 0).unwrap();
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(
        back == pattern(99, 65536),
        "a second read was answered from a cache"
    );

    f.write_all_at(&pattern(7, 300_000), MIB + 512).unwrap();
    let mut server_side = vec![0u8; 300_000];
    image.read_exact_at(&mut server_side, MIB + 512).unwrap();
    assert!(
        server_side == pattern(7, 300_000),
        "not in the image when write(2) returned"
    );

    let len = 2 * MIB as usize;
    // SAFETY: a fresh shared read-only mapping of an open file, unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "shared mmap: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping is len bytes long and stays mapped while the slice lives.
    let mapped = unsafe { std::slice::from_raw_parts(map as *const u8, len) };
    assert!(mapped[..65536] == pattern(99, 65536));
    assert!(mapped[MIB as usize + 512..][..300_000] == pattern(7, 300_000));
    // SAFETY: unmapping what mmap returned, with its length.
    unsafe { libc::munmap(map, len) };
}

fn ext2_on_a_loop_device_over_the_fuse_file_survives_a_remount() {
    ext2_survives_a_remount(&[], LoopDev::attach);
}

fn ext2_on_a_loop_device_over_an_uncached_fuse_file_survives_a_remount() {
    ext2_survives_a_remount(&["--cache", "none"], LoopDev::attach);
}

/// README's recipe: the default (writeback) mount under a loop device with direct I/O, so the
/// loop device's reads and writes bypass the FUSE file's page cache.
fn ext2_on_a_direct_io_loop_device_over_the_fuse_file_survives_a_remount() {
    ext2_survives_a_remount(&[], LoopDev::attach_direct);
}

fn ext2_survives_a_remount(mount_args: &[&str], attach: fn(&Path) -> LoopDev) {
    if !can_fuse() || !have("losetup") || !have("mkfs.ext2") || !have("mount") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "fs.img", 64 * MIB);
    let server = qpip_server("fs", &img, &[]);
    let mnt = dir.path().join("mnt");
    let ext = dir.path().join("ext");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::create_dir(&ext).unwrap();
    let mut m = mount(&server.uri, &mnt, "fs", mount_args);

    let files: Vec<(String, Vec<u8>)> = (0..8u64)
        .map(|i| {
            (
                format!("f{i}"),
                pattern(i * 7919, (i * 300_000 + 17) as usize),
            )
        })
        .collect();
    {
        let lo = attach(&m.file);
        run("mkfs.ext2", &["-q", "-F", &lo.0]);
        let fs = Mounted::new(&lo.0, &ext);
        std::fs::create_dir(ext.join("sub")).unwrap();
        for (name, data) in &files {
            std::fs::write(ext.join("sub").join(name), data).unwrap();
        }
        fs.umount();
        drop(lo);
    }
    {
        let lo = attach(&m.file);
        let fs = Mounted::new(&lo.0, &ext);
        for (name, data) in &files {
            let back = std::fs::read(ext.join("sub").join(name)).unwrap();
            assert!(&back == data, "{name} differs after the remount");
        }
        fs.umount();
        drop(lo);
    }
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    assert!(m.wait_exit().success());
}

fn read_only_export_and_read_only_option_refuse_writes() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "ro.img", 8 * MIB);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .write_all_at(&pattern(0, 4096), 0)
        .unwrap();
    let ro_server = qpip_server("ro", &img, &["--read-only"]);
    // One image served read-only and writable at once: the writable server must be told to
    // share it (-U), since image locks forbid exactly that.
    let rw_server = qpip_server("rw", &img, &["-U"]);
    for (uri, name, extra) in [
        (&ro_server.uri, "ro", &[][..]),
        (&rw_server.uri, "rw", &["--read-only"][..]),
    ] {
        let mnt = dir.path().join(format!("mnt-{name}"));
        std::fs::create_dir(&mnt).unwrap();
        let mut m = mount(uri, &mnt, name, extra);
        let meta = std::fs::metadata(&m.file).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o444, "{name}");
        let e = OpenOptions::new().write(true).open(&m.file).unwrap_err();
        assert!(
            [libc::EROFS, libc::EACCES, libc::EPERM].contains(&errno(&e)),
            "{name}: {e}"
        );
        let mut b = vec![0u8; 4096];
        std::fs::File::open(&m.file)
            .unwrap()
            .read_exact_at(&mut b, 0)
            .unwrap();
        assert!(b == pattern(0, 4096), "{name}");
        run("fusermount3", &["-u", mnt.to_str().unwrap()]);
        assert!(m.wait_exit().success());
    }
}

fn sigterm_and_sigint_unmount_and_exit_zero() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "s.img", 8 * MIB);
    let server = qpip_server("s", &img, &[]);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mnt = dir.path().join(format!("mnt{sig}"));
        std::fs::create_dir(&mnt).unwrap();
        let mut m = mount(&server.uri, &mnt, "s", &[]);
        // SAFETY: plain syscall to the child this test started.
        assert_eq!(unsafe { libc::kill(m.pid(), sig) }, 0);
        let status = m.wait_exit();
        assert!(status.success(), "signal {sig}: {status}");
        assert!(!m.file.exists(), "still mounted after signal {sig}");
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mountinfo.contains(mnt.to_str().unwrap()));
    }
}

fn daemon_mode_returns_once_mounted() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "d.img", 8 * MIB);
    let server = qpip_server("d", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let pid_file = dir.path().join("pid");
    let out = std::process::Command::new(mount_bin())
        .args(transport_args())
        .args(["--daemon", "--pid-file", pid_file.to_str().unwrap()])
        .arg(&server.uri)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Mounted when the foreground process returned.
    let guard = Mount {
        child: None,
        dir: mnt.clone(),
        file: mnt.join("d"),
    };
    assert_eq!(std::fs::metadata(&guard.file).unwrap().len(), 8 * MIB);
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    let t = std::time::Instant::now();
    // SAFETY: signal 0 only probes whether the daemon still exists.
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "daemon did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(guard);
}

fn errors_are_clear_and_exit_non_zero() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "e.img", 8 * MIB);
    let server = qpip_server("disk", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mnt_s = mnt.to_str().unwrap();

    // Unknown export: the message names the ones that exist.
    let base = server.uri.trim_end_matches("disk");
    let (s, err) = mount_fails(&[&format!("{base}nope"), mnt_s]);
    assert!(!s.success());
    assert!(err.contains("nope") && err.contains("\"disk\""), "{err}");

    // Unreachable server.
    let port = free_port();
    let (s, err) = mount_fails(&[&format!("nbd://127.0.0.1:{port}/disk"), mnt_s]);
    assert!(!s.success());
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");

    // Missing mount point, and one that is a file.
    let missing = dir.path().join("no-such-dir");
    let (s, err) = mount_fails(&[&server.uri, missing.to_str().unwrap()]);
    assert!(!s.success());
    assert!(
        err.contains("does not exist") && err.contains("no-such-dir"),
        "{err}"
    );
    let (s, err) = mount_fails(&[&server.uri, img.to_str().unwrap()]);
    assert!(!s.success());
    assert!(err.contains("not a directory"), "{err}");

    // A mount point that is busy (already mounted).
    let m = mount(&server.uri, &mnt, "disk", &[]);
    let (s, err) = mount_fails(&[&server.uri, mnt_s]);
    assert!(!s.success());
    assert!(
        err.contains("busy") && err.contains("already mounted"),
        "{err}"
    );
    drop(m);

    // Not an NBD URI.
    let (s, err) = mount_fails(&["http://example/disk", mnt_s]);
    assert!(!s.success());
    assert!(err.contains("not an NBD URI"), "{err}");
}

/// nbdkit's error filter switched on after mounting (by creating its error file): reads fail
/// with EIO; switched off again, they return the right data.
fn server_eio_reaches_the_application_as_eio() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let trigger = dir.path().join("inject");
    let Some(server) = nbdkit(&[
        "--filter=error",
        "memory",
        "64M",
        "error=EIO",
        "error-rate=1",
        &format!("error-file={}", trigger.display()),
    ]) else {
        return;
    };
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = mount(&server.uri, &mnt, "nbd", &[]);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mnt.join("nbd"))
        .unwrap();
    let off = 16 * MIB + 512;
    let data = pattern(off, 3 * MIB as usize);
    f.write_all_at(&data, off).unwrap();
    f.sync_all().unwrap();
    // Drop the page cache so the reads below reach the server.
    // SAFETY: plain syscall on an open fd.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };

    std::fs::write(&trigger, b"").unwrap();
    let mut back = vec![0u8; data.len()];
    let e = f.read_exact_at(&mut back, off).unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "{e}");
    let e = f.write_at(&data[..4096], off).unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "{e}");

    std::fs::remove_file(&trigger).unwrap();
    // SAFETY: as above.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    f.read_exact_at(&mut back, off).unwrap();
    assert!(back == data, "data differs after the errors stopped");
}

/// A server with a 4 KiB minimum block size that refuses anything unaligned (nbdkit's
/// blocksize-policy filter): byte-granular I/O through the file is widened and
/// read-modify-written, and every byte lands where it should.
fn unaligned_io_against_a_4k_minimum_block_size() {
    if !can_fuse() {
        return;
    }
    let Some(server) = nbdkit(&[
        "--filter=blocksize-policy",
        "memory",
        "16M",
        "blocksize-minimum=4096",
        "blocksize-error-policy=error",
    ]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = mount(&server.uri, &mnt, "nbd", &[]);
    let path = mnt.join("nbd");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut model = vec![0u8; 2 * MIB as usize];
    for &(off, len) in &[(1u64, 3usize), (4095, 2), (10_000, 70_001), (8191, 4098)] {
        let data = pattern(off, len);
        f.write_all_at(&data, off).unwrap();
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    f.sync_all().unwrap();
    // Read back from the server, not the page cache: drop it first.
    // SAFETY: plain syscall on an open fd.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut back = vec![0u8; model.len()];
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == model, "contents differ from the model");
    // Zeroing an unaligned range: written edges, WRITE_ZEROES in the middle.
    fallocate(
        &f,
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        10_001,
        20_000,
    )
    .unwrap();
    model[10_001..30_001].fill(0);
    // SAFETY: as above.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    f.read_exact_at(&mut back, 0).unwrap();
    assert!(back == model, "contents differ after zero range");
}

/// The server goes away and comes back on the same port: the mount reconnects and the data
/// written before is there, and new writes reach the new server.
fn io_continues_across_a_server_restart() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "r.img", 16 * MIB);
    let server = qpip_server("r", &img, &[]);
    let port = server.port;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = mount(&server.uri, &mnt, "r", &["--connections", "1"]);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(mnt.join("r"))
        .unwrap();
    let first = pattern(MIB, 2 * MIB as usize);
    f.write_all_at(&first, MIB).unwrap();
    f.sync_all().unwrap();

    drop(server);
    let _server = qpip_server_on(port, "r", &img, &[]);
    // SAFETY: plain syscall on an open fd: the reads below go to the server.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let mut back = vec![0u8; first.len()];
    f.read_exact_at(&mut back, MIB).unwrap();
    assert!(back == first, "data differs after the reconnection");
    // The loss and the reconnection are both warnings: a log at the default level that
    // says "reconnecting" also says when it did.
    let log = std::fs::read_to_string(mount_log(&mnt)).unwrap();
    let warns = |what: &str| log.lines().any(|l| l.contains("WARN") && l.contains(what));
    assert!(
        warns("reconnecting") && warns("reconnected"),
        "mount log: {log}"
    );
    let second = pattern(8 * MIB, MIB as usize);
    f.write_all_at(&second, 8 * MIB).unwrap();
    f.sync_all().unwrap();
    let mut on_disk = vec![0u8; second.len()];
    std::fs::File::open(&img)
        .unwrap()
        .read_exact_at(&mut on_disk, 8 * MIB)
        .unwrap();
    assert!(
        on_disk == second,
        "a write after the reconnection is not in the image"
    );
}

/// The mount's process after each of several reconnections (its server restarted on the same
/// port, a read going to the new one) holds no more descriptors and threads than before the
/// first: a connection that went gives back its sockets and everything its NIC made for it.
fn reconnects_give_back_every_descriptor_and_thread() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "l.img", 16 * MIB);
    let mut server = qpip_server("l", &img, &[]);
    let port = server.port;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = mount(&server.uri, &mnt, "l", &["--connections", "1"]);
    let f = std::fs::File::open(mnt.join("l")).unwrap();
    let read_from_server = || {
        // SAFETY: plain syscall on an open fd: the read below goes to the server.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut buf = vec![0u8; 64 * 1024];
        f.read_exact_at(&mut buf, 0).unwrap();
    };
    read_from_server();
    let held = |what: &str| {
        std::fs::read_dir(format!("/proc/{}/{what}", m.pid()))
            .unwrap()
            .count()
    };
    let before = (held("fd"), held("task"));
    for _ in 0..5 {
        drop(server);
        server = qpip_server_on(port, "l", &img, &[]);
        read_from_server();
    }
    let after = (held("fd"), held("task"));
    assert!(
        after.0 <= before.0 && after.1 <= before.1,
        "(descriptors, threads) of the mount: {after:?} after 5 reconnections, {before:?} before"
    );
}

/// The server goes away and does not come back: after `--reconnect-timeout` the request
/// fails with EIO (no hang), and the mount stays usable enough to be unmounted.
fn a_server_gone_for_good_fails_io_with_eio_after_the_reconnect_timeout() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "g.img", 16 * MIB);
    let server = qpip_server("g", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let _m = mount(
        &server.uri,
        &mnt,
        "g",
        &["--connections", "1", "--reconnect-timeout", "1"],
    );
    // Nothing of the file was read yet: the read below must go to the server.
    let f = std::fs::File::open(mnt.join("g")).unwrap();
    drop(server);
    read_fails_with_eio_within(&f, 20);
}

/// Unmounted after its server died (with the default 30 s reconnect timeout): the last flush
/// gets a short reconnect budget, so the process exits within seconds, not 30 s.
fn a_mount_whose_server_is_gone_exits_promptly_once_unmounted() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "p.img", 16 * MIB);
    let server = qpip_server("p", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(&server.uri, &mnt, "p", &["--connections", "1"]);
    let f = OpenOptions::new().write(true).open(&m.file).unwrap();
    f.write_all_at(b"before the server went", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    drop(server);
    let t = std::time::Instant::now();
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    m.wait_exit();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "the mount took {:?} to exit",
        t.elapsed()
    );
}

/// With the kernel's io_uring switch off, the default transport (auto) is /dev/fuse and one
/// log line says why; `--fuse-transport uring` refuses to mount; switched back on, auto takes
/// the ring. The switch is restored even if the test fails, and tests that need it on wait
/// (a lock across test processes) while it is off.
#[test]
fn auto_falls_back_to_dev_fuse_while_enable_uring_is_off() {
    if !can_fuse() {
        return;
    }
    let Ok(orig) = std::fs::read_to_string(ENABLE_URING) else {
        missing(&format!("FUSE over io_uring ({ENABLE_URING})"));
        return;
    };
    let _lock = UringLock::take(true);
    struct Restore(String);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = std::fs::write(ENABLE_URING, &self.0);
        }
    }
    let _restore = Restore(orig.trim().to_string());

    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "f.img", 8 * MIB);
    let server = qpip_server("f", &img, &[]);
    std::fs::write(ENABLE_URING, "N").unwrap();
    let mnt = dir.path().join("off");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(&server.uri, &mnt, "f", &[]);
    OpenOptions::new()
        .write(true)
        .open(&m.file)
        .unwrap()
        .write_all_at(b"still works", 0)
        .unwrap();
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    assert!(m.wait_exit().success());
    let log = std::fs::read_to_string(mount_log(&mnt)).unwrap();
    assert_eq!(transport_in_log(&log), Some("dev"), "{log}");
    let why: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("instead of io_uring"))
        .collect();
    assert_eq!(why.len(), 1, "{log}");
    assert!(why[0].contains("enable_uring is N"), "{log}");

    let (s, err) = mount_fails(&[
        "--fuse-transport",
        "uring",
        &server.uri,
        mnt.to_str().unwrap(),
    ]);
    assert!(!s.success());
    assert!(err.contains("enable_uring is N"), "{err}");
    assert!(!mnt.join("f").exists(), "left mounted after refusing");

    std::fs::write(ENABLE_URING, "Y").unwrap();
    let mnt = dir.path().join("on");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(&server.uri, &mnt, "f", &[]);
    assert_eq!(std::fs::read(&m.file).unwrap()[..11], *b"still works");
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    assert!(m.wait_exit().success());
    let log = std::fs::read_to_string(mount_log(&mnt)).unwrap();
    assert_eq!(transport_in_log(&log), Some("uring"), "{log}");
    assert!(!log.contains("instead of io_uring"), "{log}");
}

/// `--pid-file` in a directory others can write: a symlink planted at the path is replaced
/// by the pid file, not followed (root would otherwise overwrite the file it points at), and
/// the pid file is removed at exit. One transport: the pid file is written after mounting.
#[test]
fn pid_file_replaces_a_symlink_at_its_path() {
    use std::os::unix::fs::PermissionsExt;
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "p.img", 8 * MIB);
    let server = qpip_server("p", &img, &[]);
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let pid_file = shared.join("mount.pid");
    std::os::unix::fs::symlink(&victim, &pid_file).unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(
        &server.uri,
        &mnt,
        "p",
        &["--pid-file", pid_file.to_str().unwrap()],
    );
    // Written after the file appears: wait until the path holds a pid or the victim changed.
    let t = std::time::Instant::now();
    let pid = loop {
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.strip_suffix('\n')?.parse::<i32>().ok());
        if let Some(pid) = pid {
            break pid;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no pid file");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "precious\n",
        "the mount wrote through the symlink"
    );
    assert!(std::fs::symlink_metadata(&pid_file).unwrap().is_file());
    assert_eq!(pid, m.pid());
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    assert!(m.wait_exit().success());
    let left: Vec<_> = std::fs::read_dir(&shared).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}

/// Issue 24 item 9: a server that completes the handshake and never answers. The read fails
/// with EIO after the request timeout plus the reconnect timeout (6 + 1 s here), as the README
/// says, not after a second request timeout for the request reissued on the reconnection.
fn a_silent_server_fails_a_read_within_request_plus_reconnect_timeout() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uri = silent_server("q", 16 * MIB);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let opts = [
        "--connections",
        "1",
        "--request-timeout",
        "6",
        "--reconnect-timeout",
        "1",
    ];
    let _m = mount(&uri, &mnt, "q", &opts);
    let f = std::fs::File::open(mnt.join("q")).unwrap();
    // 7 s and the client's 1 s polling; twice the request timeout would be 12 s and more.
    read_fails_with_eio_within(&f, 10);
}

/// Issue 24 item 9: with the default timeouts (60 + 30 s) a read is stuck on a server that
/// never answers; SIGTERM makes it fail with EIO and the process exit within seconds.
fn sigterm_ends_a_read_stuck_on_a_silent_server_and_exits() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uri = silent_server("t", 16 * MIB);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = mount(&uri, &mnt, "t", &["--connections", "1"]);
    let file = m.file.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let f = std::fs::File::open(file).unwrap();
        let mut buf = vec![0u8; 4096];
        let r = f.read_exact_at(&mut buf, 8 * MIB);
        drop(f);
        let _ = tx.send(r);
    });
    // The read is stuck, well inside the 60 s request timeout.
    assert!(
        rx.recv_timeout(std::time::Duration::from_secs(2)).is_err(),
        "the read did not wait for the server"
    );
    let t = std::time::Instant::now();
    // SAFETY: plain syscall to the child this test started.
    assert_eq!(unsafe { libc::kill(m.pid(), libc::SIGTERM) }, 0);
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the read still waits 10 s after SIGTERM");
    let e = r.unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "{e}");
    let status = m.wait_exit();
    assert!(status.success(), "{status}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "exited {:?} after SIGTERM",
        t.elapsed()
    );
    assert!(!m.file.exists(), "still mounted after SIGTERM");
}

/// Issue 25 item 4: nbdfuse's order `MOUNTPOINT[/FILENAME] URI`, its `-o` and `-P`; a mix-up
/// says which orders there are; `[ CMD ]` is refused by name.
#[test]
fn nbdfuse_argument_order_o_and_p() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "n.img", 8 * MIB);
    let server = qpip_server("n", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let pid_file = dir.path().join("pid");
    let daemon = |args: &[&str]| {
        let out = std::process::Command::new(mount_bin())
            .args(transport_args())
            .arg("--daemon")
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    let unmount = || {
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        run("fusermount3", &["-u", mnt.to_str().unwrap()]);
        let t = std::time::Instant::now();
        // SAFETY: signal 0 only probes whether the daemon still exists.
        while unsafe { libc::kill(pid, 0) } == 0 {
            assert!(t.elapsed() < Duration::from_secs(20), "daemon did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // MOUNTPOINT/FILENAME URI, -P PIDFILE, -o allow_other,ro.
    let named = mnt.join("disk.raw");
    daemon(&[
        "-P",
        pid_file.to_str().unwrap(),
        "-o",
        "allow_other,ro",
        named.to_str().unwrap(),
        &server.uri,
    ]);
    let md = std::fs::metadata(&named).unwrap();
    assert_eq!(md.len(), 8 * MIB);
    assert_eq!(md.mode() & 0o777, 0o444, "-o ro mounts read-only");
    unmount();
    // MOUNTPOINT URI: nbdfuse's file name, "nbd"; --pidfile is nbdfuse's long spelling.
    daemon(&[
        "--pidfile",
        pid_file.to_str().unwrap(),
        mnt.to_str().unwrap(),
        &server.uri,
    ]);
    assert_eq!(std::fs::metadata(mnt.join("nbd")).unwrap().len(), 8 * MIB);
    unmount();

    // Mix-ups and what is not taken: one line each, status 2.
    let m = mnt.to_str().unwrap();
    for (args, want) in [
        (vec![m, "/tmp"], "MOUNTPOINT[/FILENAME] URI"),
        (vec![&server.uri, &server.uri], "MOUNTPOINT[/FILENAME] URI"),
        (vec![m, "[", "nbdkit", "memory", "1M", "]"], "[ CMD"),
        (vec!["-o", "uid=5", m, &server.uri], "uid=5"),
    ] {
        let (status, err) = mount_fails(&args);
        assert_eq!(status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            err.contains("URI MOUNTPOINT") || want == "uid=5",
            "{args:?}: {err}"
        );
    }
}

/// Issue 25 item 5: `--daemon` keeps its log in `--log-file` (appended), not in /dev/null.
#[test]
fn daemon_keeps_its_log_in_log_file() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "l.img", 8 * MIB);
    let server = qpip_server("l", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let log = dir.path().join("mount.log");
    std::fs::write(&log, "before\n").unwrap();
    let pid_file = dir.path().join("pid");
    let out = std::process::Command::new(mount_bin())
        .args(transport_args())
        .args(["-v", "--daemon", "--log-file", log.to_str().unwrap()])
        .args(["--pid-file", pid_file.to_str().unwrap()])
        .arg(&server.uri)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    run("fusermount3", &["-u", mnt.to_str().unwrap()]);
    let t = std::time::Instant::now();
    // SAFETY: signal 0 only probes whether the daemon still exists.
    while unsafe { libc::kill(pid, 0) } == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "daemon did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.starts_with("before\n"), "appended: {text}");
    assert!(
        text.contains("mounted") && text.contains("unmounted"),
        "{text}"
    );
    // A log file that cannot be opened is an error before anything is mounted.
    let (status, err) = mount_fails(&[
        "--daemon",
        "--log-file",
        "/nonexistent/dir/log",
        &server.uri,
        mnt.to_str().unwrap(),
    ]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/dir/log"), "{err}");
}

/// A 4 KiB read of `f` at 8 MiB fails with EIO within `secs` seconds.
fn read_fails_with_eio_within(f: &std::fs::File, secs: u64) {
    let t = std::time::Instant::now();
    let mut buf = vec![0u8; 4096];
    let e = f.read_exact_at(&mut buf, 8 * MIB).unwrap_err();
    assert_eq!(errno(&e), libc::EIO, "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(secs),
        "EIO after {:?}",
        t.elapsed()
    );
}

/// An image on a file system that hangs (here: this mount, its server stopped) does not stop
/// qpip-nbd-server's other exports: its open misses --open-timeout, it is left out with one
/// line, and the others are served.
#[test]
fn an_export_on_a_hung_file_system_is_left_out_after_the_open_timeout() {
    if !can_fuse() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = sparse_image(dir.path(), "under.img", 16 * MIB);
    let under = qpip_server("under", &img, &[]);
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let m = mount(&under.uri, &mnt, "under", &["--cache", "none"]);
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(under.child.id() as i32, libc::SIGSTOP) };
    let other = sparse_image(dir.path(), "other.img", MIB);
    let t = std::time::Instant::now();
    let served = std::panic::catch_unwind(|| {
        qpip_server(
            "hung",
            &m.file,
            &[
                "--open-timeout",
                "2",
                "--export",
                &format!("ok={}", other.display()),
            ],
        )
    });
    // SAFETY: as above.
    unsafe { libc::kill(under.child.id() as i32, libc::SIGCONT) };
    let srv = served.expect("the server did not start beside the hung export");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let ok = srv.uri.replace("/hung", "/ok");
    let out = std::process::Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 4k", &ok])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
