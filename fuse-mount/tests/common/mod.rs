//! fuse-mount's own test harness: the qpip-nbd-mount under test, its FUSE transport, and
//! Drop guards that undo mounts and loop devices even when a test fails. Needs root and
//! /dev/fuse. Servers, peers, ports, patterns and the CI rule (a missing prerequisite skips
//! a test, or fails it in CI) are qpip-test-support's.
#![allow(dead_code, unused_imports)] // each test crate uses a different subset

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub(crate) use qpip_test_support::ci::{have, missing, root};
pub(crate) use qpip_test_support::net::free_port;
pub(crate) use qpip_test_support::pattern::{at_offset as pattern, sparse_image};
pub(crate) use qpip_test_support::servers::{Peer, nbdkit, qpip_server, qpip_server_on};

/// Root, /dev/fuse and fusermount3: what every mount test needs.
pub(crate) fn can_fuse() -> bool {
    if !root("FUSE mounts and loop devices need it") {
        return false;
    }
    if !Path::new("/dev/fuse").exists() {
        return missing("/dev/fuse");
    }
    have("fusermount3")
}

pub(crate) const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

thread_local! {
    /// The FUSE transport this test's mounts use ("dev" or "uring"; None: the mount's
    /// default, auto) and the lock on the io_uring switch held meanwhile.
    static TRANSPORT: RefCell<Option<(&'static str, Option<UringLock>)>> = const { RefCell::new(None) };
}

/// A lock on the kernel's enable_uring switch, across test processes: tests that need it on
/// hold it shared, the test that switches it off for a moment holds it exclusively.
pub(crate) struct UringLock(std::fs::File);

impl UringLock {
    pub(crate) fn take(exclusive: bool) -> UringLock {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/qpip-nbd-mount-enable-uring.lock")
            .unwrap();
        let op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        // SAFETY: plain syscall on an open fd; released when the file closes.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), op) }, 0);
        UringLock(f)
    }
}

/// Makes this test's mounts use `transport`. For "uring" the kernel must offer FUSE over
/// io_uring (scripts/setup switches it on): false (skip) when it does not, a failure in CI.
pub(crate) fn use_transport(transport: &'static str) -> bool {
    let lock = if transport == "uring" {
        let lock = UringLock::take(false);
        match std::fs::read_to_string(ENABLE_URING) {
            Ok(v) if v.trim() == "Y" => {}
            Ok(_) => return missing(&format!("FUSE over io_uring ({ENABLE_URING} is N)")),
            Err(_) => return missing(&format!("FUSE over io_uring ({ENABLE_URING})")),
        }
        Some(lock)
    } else {
        None
    };
    TRANSPORT.with(|t| *t.borrow_mut() = Some((transport, lock)));
    true
}

/// The mount arguments that select this test's transport.
pub(crate) fn transport_args() -> Vec<&'static str> {
    TRANSPORT.with(|t| match &*t.borrow() {
        Some((name, _)) => vec!["--fuse-transport", name],
        None => vec![],
    })
}

/// Which transport a mount's log (at -v) says it uses.
pub(crate) fn transport_in_log(log: &str) -> Option<&'static str> {
    let line = log.lines().find(|l| l.contains("mounted"))?;
    if line.contains("\"io_uring\"") {
        Some("uring")
    } else if line.contains("\"/dev/fuse\"") {
        Some("dev")
    } else {
        None
    }
}

/// A running qpip-nbd-mount. Dropping it unmounts lazily and kills the process.
pub(crate) struct Mount {
    pub child: Option<Child>,
    pub dir: PathBuf,
    pub file: PathBuf,
}

/// The log file of a mount on `dir`.
pub(crate) fn mount_log(dir: &Path) -> PathBuf {
    dir.with_extension("log")
}

impl Mount {
    /// Waits for the process to exit (after an unmount or a signal); returns its status.
    pub(crate) fn wait_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("still running");
        let t = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                return s;
            }
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("qpip-nbd-mount did not exit");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) fn mount_bin() -> &'static str {
    env!("CARGO_BIN_EXE_qpip-nbd-mount")
}

/// Mounts `uri` on `dir` and waits until the file `name` appears.
pub(crate) fn mount(uri: &str, dir: &Path, name: &str, extra: &[&str]) -> Mount {
    // Its log goes to a file beside the mount point (a pipe nobody reads could fill up).
    let log = mount_log(dir);
    let mut child = Command::new(mount_bin())
        .arg("-v")
        .args(transport_args())
        .args(extra)
        .arg(uri)
        .arg(dir)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("starting qpip-nbd-mount");
    let file = dir.join(name);
    let t = Instant::now();
    while !file.exists() {
        if let Some(s) = child.try_wait().unwrap() {
            let err = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("qpip-nbd-mount exited ({s}) before mounting: {err}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{} did not appear",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The transport asked for is the one in use (the "mounted" line precedes serving).
    if let Some((want, _)) = TRANSPORT.with(|t| t.borrow().as_ref().map(|(n, _)| (*n, ()))) {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(transport_in_log(&text), Some(want), "mount log: {text}");
    }
    Mount {
        child: Some(child),
        dir: dir.to_path_buf(),
        file,
    }
}

/// Runs qpip-nbd-mount to completion (for the error cases): (status, stderr).
pub(crate) fn mount_fails(args: &[&str]) -> (ExitStatus, String) {
    let out = Command::new(mount_bin()).args(args).output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop device, detached on drop.
pub(crate) struct LoopDev(pub String);

impl LoopDev {
    pub(crate) fn attach(file: &Path) -> LoopDev {
        let dev = run("losetup", &["-f", "--show", file.to_str().unwrap()]);
        LoopDev(dev.trim().to_string())
    }

    /// Attaches with `losetup --direct-io=on`, README's recipe for a file system on the mount,
    /// and checks that the loop device really reads and writes the file with O_DIRECT (losetup
    /// falls back to buffered I/O with a warning where the file refuses it).
    pub(crate) fn attach_direct(file: &Path) -> LoopDev {
        let dev = run(
            "losetup",
            &["-f", "--show", "--direct-io=on", file.to_str().unwrap()],
        );
        let lo = LoopDev(dev.trim().to_string());
        let name = lo.0.trim_start_matches("/dev/");
        let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap();
        assert_eq!(
            dio.trim(),
            "1",
            "{} kept buffered I/O on {}",
            lo.0,
            file.display()
        );
        lo
    }
}

impl Drop for LoopDev {
    /// Detaches the device and waits until it has let go of its file: a detach while
    /// something (udev's probe after the file system's unmount) still has the device open
    /// only marks it for auto-clear, and the file stays busy until that opener is gone.
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
        let name = self.0.trim_start_matches("/dev/");
        let backing = PathBuf::from(format!("/sys/block/{name}/loop/backing_file"));
        let t = Instant::now();
        while backing.exists() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A mounted file system, lazily unmounted on drop (if still mounted).
pub(crate) struct Mounted(pub PathBuf);

impl Mounted {
    pub(crate) fn new(dev: &str, dir: &Path) -> Mounted {
        run("mount", &[dev, dir.to_str().unwrap()]);
        Mounted(dir.to_path_buf())
    }
    pub(crate) fn umount(self) {
        run("umount", &[self.0.to_str().unwrap()]);
        std::mem::forget(self);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A fake NBD server that completes every handshake (export `name`, `size` bytes) and then
/// reads requests and never answers one. Returns its URI; it lives as long as the test.
pub(crate) fn silent_server(name: &str, size: u64) -> String {
    use nbd_proto::handshake::{Export, ServerConfig};
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let export = name.to_string();
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            let export = export.clone();
            std::thread::spawn(move || {
                let config = ServerConfig::new(vec![Export::new(export, size)]);
                if qpip_test_support::fake::handshake(&mut s, config).is_none() {
                    return;
                }
                let mut buf = vec![0u8; 64 << 10];
                // Requests are read (so that the client's sends complete) and never answered.
                while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
            });
        }
    });
    format!("nbd://{addr}/{name}")
}
