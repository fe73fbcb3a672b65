//! The mount point: checked before mounting, unmounted on a signal.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Why a directory cannot be the mount point.
#[derive(Debug, thiserror::Error)]
pub enum MountpointError {
    /// The mount point does not exist.
    #[error("mount point {0} does not exist")]
    Missing(PathBuf),
    /// It is not a directory.
    #[error("mount point {0} is not a directory")]
    NotDirectory(PathBuf),
    /// Something is mounted there already.
    #[error("mount point {0} is busy: something is already mounted there")]
    AlreadyMounted(PathBuf),
    /// Looking at it failed.
    #[error("mount point {path}: {source}")]
    Io {
        /// The mount point.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: io::Error,
    },
}

/// Decodes the octal escapes (`\040` for a space, ...) of /proc/self/mountinfo.
pub(crate) fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && let Some(v) = b
                .get(i + 1..i + 4)
                .and_then(|o| std::str::from_utf8(o).ok())
                .and_then(|o| u8::from_str_radix(o, 8).ok())
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

/// Is `path` (canonical) a mount point in this mount namespace?
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let want = path.as_os_str().as_bytes();
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape(m) == want))
}

/// Checks that `path` is an existing directory with nothing mounted on it; returns its
/// canonical form.
pub fn check(path: &Path) -> Result<PathBuf, MountpointError> {
    let io_err = |source| MountpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(MountpointError::Missing(path.to_path_buf()));
        }
        // ENOTCONN: a FUSE mount whose daemon is gone is still a mount.
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(MountpointError::AlreadyMounted(path.to_path_buf()));
        }
        Err(e) => return Err(io_err(e)),
    };
    if !meta.is_dir() {
        return Err(MountpointError::NotDirectory(path.to_path_buf()));
    }
    let canonical = path.canonicalize().map_err(io_err)?;
    if is_mount_point(&canonical).map_err(io_err)? {
        return Err(MountpointError::AlreadyMounted(canonical));
    }
    Ok(canonical)
}

/// Unmounts `path`: umount(2) as root, `fusermount3 -u` otherwise. EBUSY (the file is still
/// open, e.g. by a loop device) is returned and the mount stays.
pub fn unmount(path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EPERM) {
        return Err(err);
    }
    let out = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(path)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "fusermount3 -u: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/mnt/a\040b"), b"/mnt/a b");
        assert_eq!(unescape(r"/x\134y"), b"/x\\y");
    }

    #[test]
    fn root_is_a_mount_point_and_missing_dirs_are_reported() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        let dir = std::env::temp_dir().join("qpip-nbd-mount-no-such-dir");
        assert!(matches!(check(&dir), Err(MountpointError::Missing(_))));
        let file = tempfile_path();
        assert!(matches!(
            check(&file),
            Err(MountpointError::NotDirectory(_))
        ));
        std::fs::remove_file(file).unwrap();
    }

    fn tempfile_path() -> PathBuf {
        let p = std::env::temp_dir().join(format!("qpip-nbd-mount-file-{}", std::process::id()));
        std::fs::write(&p, b"x").unwrap();
        p
    }
}
