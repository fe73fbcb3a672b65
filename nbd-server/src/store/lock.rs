//! qemu's image locks, taken on an image file (raw or qcow2) so that qemu (qemu-nbd,
//! qemu-img, qemu-storage-daemon) and a second qpip-nbd-server see the image as in use, and
//! we see theirs.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Why an image could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another program (qemu, or another server) holds the image in a way ours conflicts with.
    #[error(
        "the image is in use: another program {what} its {permission} permission (qemu-nbd, qemu-img, another qpip-nbd-server?); --force-share skips locking"
    )]
    InUse {
        /// What the other program does: holds, or wants.
        what: &'static str,
        /// Which of qemu's permissions (read, write, ...).
        permission: &'static str,
    },
    /// Taking or testing a lock failed.
    #[error("locking: {0}")]
    Io(io::Error),
}

/// Takes qemu's locks on `file`. qemu holds open file description locks on single bytes:
/// 100 + p while it uses permission p, 200 + p while it forbids others p (p = 0 consistent
/// read, 1 write, ...). A writable export uses and forbids write; a read-only one uses
/// consistent read and forbids write, as qemu's readers do. The locks belong to the open file
/// description, so they last as long as any descriptor of it (the store's) is open.
pub fn lock(file: &File, read_only: bool) -> Result<(), LockError> {
    const CONSISTENT_READ: i64 = 0;
    const WRITE: i64 = 1;
    let (uses, forbids): (&[i64], &[i64]) = if read_only {
        (&[CONSISTENT_READ], &[WRITE])
    } else {
        (&[CONSISTENT_READ, WRITE], &[WRITE])
    };
    // Someone forbids what we use, or uses what we forbid.
    for &p in uses {
        ofd_lock_free(file, 200 + p, "forbids", p)?;
    }
    for &p in forbids {
        ofd_lock_free(file, 100 + p, "uses", p)?;
    }
    for byte in uses
        .iter()
        .map(|p| 100 + p)
        .chain(forbids.iter().map(|p| 200 + p))
    {
        ofd_lock(file, libc::F_OFD_SETLK, libc::F_RDLCK as i16, byte).map_err(LockError::Io)?;
    }
    Ok(())
}

/// Err when another open file description holds a lock on `byte`.
fn ofd_lock_free(file: &File, byte: i64, what: &'static str, perm: i64) -> Result<(), LockError> {
    let l = ofd_lock(file, libc::F_OFD_GETLK, libc::F_WRLCK as i16, byte).map_err(LockError::Io)?;
    if l.l_type == libc::F_UNLCK as i16 {
        return Ok(());
    }
    Err(LockError::InUse {
        what,
        permission: if perm == 1 {
            "write"
        } else {
            "consistent read"
        },
    })
}

fn ofd_lock(file: &File, cmd: libc::c_int, ty: i16, byte: i64) -> io::Result<libc::flock> {
    // SAFETY: an all-zero flock is valid; l_pid must be 0 for OFD locks.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = ty;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = byte;
    l.l_len = 1;
    // SAFETY: the descriptor is open and `l` a valid flock for the duration of the call.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut l) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(l)
}
