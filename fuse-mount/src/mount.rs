//! Mounting: opens /dev/fuse and mounts it (mount(2) as root, `fusermount3` otherwise, which
//! hands the opened device back over a socket), so that the mount owns the device fd and can
//! serve it over either transport.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// How the file system appears.
#[derive(Clone, Debug)]
pub struct Options {
    /// The "device" column of the mount table (the export's URI).
    pub fsname: String,
    /// The file system's subtype (`fuse.SUBTYPE` in the mount table).
    pub subtype: String,
    /// Mount read-only.
    pub read_only: bool,
    /// Let other users reach the mount (`allow_other`).
    pub allow_other: bool,
}

impl Options {
    fn common(&self) -> String {
        let mut o = String::from("default_permissions");
        if self.allow_other {
            o.push_str(",allow_other");
        }
        o
    }

    /// Escapes a value for fusermount3's comma-separated option list.
    fn escape(v: &str) -> String {
        v.replace('\\', "\\\\").replace(',', "\\,")
    }
}

/// Mounts a FUSE file system on `mnt` and returns the /dev/fuse fd serving it.
pub fn mount(mnt: &Path, opts: &Options) -> io::Result<OwnedFd> {
    // SAFETY: plain getter.
    if unsafe { libc::geteuid() } != 0 {
        return mount_fusermount(mnt, opts);
    }
    match mount_direct(mnt, opts) {
        // Root without CAP_SYS_ADMIN in its namespace.
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => mount_fusermount(mnt, opts),
        r => r,
    }
}

fn mount_direct(mnt: &Path, opts: &Options) -> io::Result<OwnedFd> {
    // SAFETY: a valid NUL-terminated path; the fd is checked and then owned.
    let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::other(format!(
            "opening /dev/fuse: {}",
            io::Error::last_os_error()
        )));
    }
    // SAFETY: fd was just opened and is owned here only.
    let dev = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain getters.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let data = format!(
        "fd={fd},rootmode=40000,user_id={uid},group_id={gid},{}",
        opts.common()
    );
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    if opts.read_only {
        flags |= libc::MS_RDONLY;
    }
    let src = CString::new(opts.fsname.as_bytes())?;
    let target = CString::new(mnt.as_os_str().as_bytes())?;
    let fstype = CString::new(format!("fuse.{}", opts.subtype))?;
    let data = CString::new(data)?;
    // SAFETY: valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(dev)
}

/// Unprivileged: `fusermount3` mounts and passes the opened /dev/fuse back (SCM_RIGHTS over
/// the socket named by `_FUSE_COMMFD`).
fn mount_fusermount(mnt: &Path, opts: &Options) -> io::Result<OwnedFd> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here only.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: plain fcntl on our own fd: only the child's end is inherited.
    unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    let mut o = format!(
        "{},nosuid,nodev,noatime,{},fsname={},subtype={}",
        if opts.read_only { "ro" } else { "rw" },
        opts.common(),
        Options::escape(&opts.fsname),
        Options::escape(&opts.subtype)
    );
    o.retain(|c| c != '\n');
    let status = std::process::Command::new("fusermount3")
        .arg("-o")
        .arg(&o)
        .arg("--")
        .arg(mnt)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .status()
        .map_err(|e| io::Error::other(format!("running fusermount3: {e}")))?;
    drop(theirs);
    if !status.success() {
        return Err(io::Error::other(format!("fusermount3 failed ({status})")));
    }
    receive_fd(ours.as_raw_fd())
}

fn receive_fd(sock: RawFd) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr is a valid empty header; the pointers set below outlive recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg describes valid buffers.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: msg was filled by recvmsg; the CMSG macros walk its control buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(io::Error::other("fusermount3 passed no file descriptor"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// The mount's device number (major, minor) from /proc/self/mountinfo, without asking the
/// file system anything.
pub fn device_of(mnt: &Path) -> Option<(u32, u32)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = mnt.as_os_str().as_bytes();
    info.lines().rev().find_map(|l| {
        let mut cols = l.split(' ');
        let dev = cols.nth(2)?;
        let point = cols.nth(1)?;
        if crate::mountpoint::unescape(point) != want {
            return None;
        }
        let (a, b) = dev.split_once(':')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    })
}

/// Sets the mount's read-ahead window (/sys/class/bdi/MAJ:MIN/read_ahead_kb): FUSE's INIT
/// can only lower the kernel's default of 128 KiB, and a pipelined transport wants more.
pub fn set_read_ahead(dev: (u32, u32), kb: u32) -> io::Result<()> {
    let p = format!("/sys/class/bdi/{}:{}/read_ahead_kb", dev.0, dev.1);
    std::fs::write(&p, format!("{kb}\n")).map_err(|e| io::Error::other(format!("{p}: {e}")))
}
