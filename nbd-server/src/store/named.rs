//! The files an image names: a qcow2 image's backing file and external data file. Whoever
//! made the image chose those names (a guest's owner, a downloaded image), so they are
//! untrusted: a named file is opened only when it really lies (symlinks followed) beneath an
//! allowed directory — the served image's own directory, or one the user named
//! (`--allow-backing-dir`) — and only when it is a regular file outside /proc, /sys and the
//! kernel's other pseudo file systems, reached without a magic link (`/proc/PID/fd/N`,
//! `/proc/PID/root`). qemu opens whatever the image names; an image naming `/proc/self/mem`
//! as its data file would otherwise let its guest read and write the server's memory.
//!
//! Opening never blocks and never opens a device: the name is first resolved to an `O_PATH`
//! descriptor (which opens nothing), checked, and only then opened for I/O beneath the
//! allowed directory it lies in, without following any symlink (openat2 with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), with `O_NONBLOCK`, and checked to be the same file.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A file's identity: its device and inode numbers.
pub type Identity = (u64, u64);

/// The kernel's pseudo file systems, whose files are not images even where they look like
/// regular files (`/proc/self/mem`, sysfs attributes).
const PSEUDO_FILE_SYSTEMS: [u32; 8] = [
    libc::PROC_SUPER_MAGIC as u32,
    libc::SYSFS_MAGIC as u32,
    libc::DEBUGFS_MAGIC as u32,
    libc::TRACEFS_MAGIC as u32,
    libc::SECURITYFS_MAGIC as u32,
    libc::CGROUP_SUPER_MAGIC as u32,
    libc::CGROUP2_SUPER_MAGIC as u32,
    libc::BPF_FS_MAGIC as u32,
];

/// A directory names are resolved in: that of an image as it was named (qemu resolves a
/// relative name against the directory of the image's path, symlinks not followed).
pub struct Dir(OwnedFd);

impl Dir {
    /// The directory of `image`, a path the user gave.
    pub fn of(image: &Path) -> io::Result<Dir> {
        Ok(Dir(open_dir(parent(image))?))
    }

    /// The directory of `name`, as it is named from `self` (where the names in the image
    /// `name` are resolved).
    pub fn of_named(&self, name: &str) -> io::Result<Dir> {
        let dir = parent(Path::new(name));
        let fd = openat2(
            self.0.as_raw_fd(),
            dir,
            libc::O_PATH | libc::O_DIRECTORY,
            libc::RESOLVE_NO_MAGICLINKS,
        )?;
        Ok(Dir(fd))
    }
}

/// An allowed directory: a descriptor, and where it really is.
struct Root {
    fd: OwnedFd,
    real: PathBuf,
}

impl Root {
    fn open(path: &Path) -> io::Result<Root> {
        let fd = open_dir(path)?;
        let real = real_path(&fd)?;
        Ok(Root { fd, real })
    }
}

/// Where the files an image names may lie: beneath the served image's directory (as named,
/// and where it really is) or beneath a directory the user allowed.
pub struct Allowed {
    roots: Vec<Root>,
}

impl Allowed {
    /// The directories of `image` (the served one, a path the user gave) and `dirs` (the
    /// user's `--allow-backing-dir`).
    pub fn new(image: &Path, dirs: &[PathBuf]) -> io::Result<Allowed> {
        let real = std::fs::canonicalize(image)?;
        let mut roots = vec![Root::open(parent(image))?, Root::open(parent(&real))?];
        for dir in dirs {
            roots.push(Root::open(dir).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("--allow-backing-dir {}: {e}", dir.display()),
                )
            })?);
        }
        let mut unique: Vec<Root> = Vec::new();
        for r in roots {
            if !unique.iter().any(|u| u.real == r.real) {
                unique.push(r);
            }
        }
        Ok(Allowed { roots: unique })
    }

    /// Opens `name`, which an image in `dir` names (shown as `shown`): read-only, or
    /// read-write when `write`, if it lies beneath an allowed directory and is a regular
    /// file outside the kernel's pseudo file systems (else an error of kind Unsupported
    /// saying which rule refused it). Returns the file and its identity.
    pub fn open(
        &self,
        dir: &Dir,
        name: &str,
        shown: &Path,
        write: bool,
    ) -> io::Result<(File, Identity)> {
        // Resolving opens nothing: a FIFO does not block, a device is not opened.
        let probe = openat2(
            dir.0.as_raw_fd(),
            Path::new(name),
            libc::O_PATH,
            libc::RESOLVE_NO_MAGICLINKS,
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused(
                "it passes through a magic link (as /proc/PID/fd/N is) or through symlinks that loop",
            ),
            _ => e,
        })?;
        let real = real_path(&probe)?;
        let Some((root, beneath)) = self
            .roots
            .iter()
            .find_map(|r| Some((r, real.strip_prefix(&r.real).ok()?)))
        else {
            let at = if real == shown {
                String::new()
            } else {
                format!(" (it is {})", real.display())
            };
            return Err(refused(format!(
                "not beneath the image's directory or an --allow-backing-dir directory{at}"
            )));
        };
        let (st, fs) = (fstat(&probe)?, fstatfs(&probe)?);
        let kind = st.st_mode & libc::S_IFMT;
        if kind != libc::S_IFREG {
            return Err(refused(format!(
                "it is {}, not a regular file",
                kind_name(kind)
            )));
        }
        if PSEUDO_FILE_SYSTEMS.contains(&(fs.f_type as u32)) {
            return Err(refused(
                "it is in /proc, /sys or another of the kernel's pseudo file systems",
            ));
        }
        let access = if write { libc::O_RDWR } else { libc::O_RDONLY };
        // Where it really is, beneath the allowed directory, with no symlink to follow: a
        // file swapped meanwhile is not opened in its place (and is caught just below).
        let fd = openat2(
            root.fd.as_raw_fd(),
            beneath,
            access | libc::O_NONBLOCK | libc::O_NOCTTY,
            libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
        )?;
        let opened = fstat(&fd)?;
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) {
            return Err(refused("it was replaced while it was opened"));
        }
        // The stores do blocking I/O: O_NONBLOCK was for the open only.
        // SAFETY: F_GETFL and F_SETFL on a descriptor we own.
        let ok = unsafe {
            let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(io::Error::last_os_error());
        }
        Ok((File::from(fd), (st.st_dev, st.st_ino)))
    }
}

/// The identity of an open file.
pub fn identity(file: &File) -> io::Result<Identity> {
    let st = fstat(file)?;
    Ok((st.st_dev, st.st_ino))
}

/// An error that says which rule refused a named file; of kind Unsupported, so that it takes
/// down its own export only.
fn refused(why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("refused: {why}"))
}

/// A file type (`st_mode & S_IFMT`) other than a regular file's, as a refusal names it.
pub(crate) fn kind_name(kind: libc::mode_t) -> &'static str {
    match kind {
        libc::S_IFDIR => "a directory",
        libc::S_IFBLK => "a block device",
        libc::S_IFCHR => "a character device",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        _ => "of an unknown kind",
    }
}

/// The directory of `path` ("." for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    openat2(libc::AT_FDCWD, path, libc::O_PATH | libc::O_DIRECTORY, 0)
}

/// Where an open file really is (its path with every symlink resolved), as the kernel says.
fn real_path(fd: &impl AsRawFd) -> io::Result<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("finding where it is (/proc/self/fd): {e}"),
        )
    })
}

/// openat2(2): `path` from `dir`, with `flags` (close-on-exec added) and `resolve`.
fn openat2(dir: RawFd, path: &Path, flags: libc::c_int, resolve: u64) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "the name has a NUL byte"))?;
    // SAFETY: open_how is plain integers; all zero is its default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    // EAGAIN: a rename elsewhere raced a RESOLVE_BENEATH lookup; the kernel asks for a retry.
    for _ in 0..16 {
        // SAFETY: a valid C string and open_how, whose size is passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir,
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd >= 0 {
            // SAFETY: a new descriptor, ours alone.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) });
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EINTR) => continue,
            Some(libc::ENOSYS) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "opening the files an image names needs openat2 (Linux 5.6 or later)",
                ));
            }
            _ => return Err(e),
        }
    }
    Err(io::Error::from_raw_os_error(libc::EAGAIN))
}

fn fstat(fd: &impl AsRawFd) -> io::Result<libc::stat> {
    // SAFETY: a zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is valid to fill; the descriptor is open.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn fstatfs(fd: &impl AsRawFd) -> io::Result<libc::statfs> {
    // SAFETY: a zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is valid to fill; the descriptor is open.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}
