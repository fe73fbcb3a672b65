//! Running the server from scripts and service managers: `--fork`, `--pid-file`,
//! `--exit-with-parent` and systemd socket activation. Only process plumbing lives here; the
//! sockets themselves are handed to the NIC.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The first descriptor systemd passes (SD_LISTEN_FDS_START).
const LISTEN_FDS_START: i32 = 3;

/// The listening sockets passed by systemd socket activation (LISTEN_PID is us, LISTEN_FDS
/// counts them from fd 3), or None when the server was not socket-activated. The variables
/// are removed, so that children (`--run`) do not take the sockets for theirs.
pub(crate) fn socket_activation() -> Result<Option<Vec<OwnedFd>>> {
    let (Ok(pid), Ok(n)) = (std::env::var("LISTEN_PID"), std::env::var("LISTEN_FDS")) else {
        return Ok(None);
    };
    // SAFETY: removing variables before any thread is started (the NIC is not open yet).
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None); // meant for another process
    }
    let n: i32 = n
        .trim()
        .parse()
        .ok()
        .filter(|n| (1..=64).contains(n))
        .with_context(|| {
            format!("socket activation: LISTEN_FDS={n:?} is not a count of 1 to 64")
        })?;
    let mut fds = Vec::new();
    for fd in LISTEN_FDS_START..LISTEN_FDS_START + n {
        let mut listening: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a local int of the right size.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&raw mut listening).cast(),
                &mut len,
            )
        };
        if r != 0 || listening == 0 {
            bail!(
                "socket activation: fd {fd} (of LISTEN_FDS={n}) is not a listening socket: {}",
                if r != 0 {
                    io::Error::last_os_error().to_string()
                } else {
                    "not listening".into()
                }
            );
        }
        // SAFETY: systemd passed this descriptor to us; nothing else in the process owns it.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain fcntl on an owned descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        fds.push(owned);
    }
    Ok(Some(fds))
}

/// The parent's side of `--fork`: it waits until the server says it is ready, then exits 0;
/// if the server fails first, it exits with the server's status (whose error is already on
/// stderr). The child's side: a [`Readiness`] to signal with.
pub(crate) fn fork() -> Result<Readiness> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 into a local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error()).context("--fork: pipe");
    }
    // SAFETY: the descriptors are fresh and ours.
    let (r, w) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // SAFETY: the process has one thread here (the NIC is not open yet), so the child may
    // run anything.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error()).context("--fork");
    }
    if pid > 0 {
        drop(w);
        let mut byte = [0u8; 1];
        let ready = matches!((&r).read(&mut byte), Ok(1));
        if ready {
            std::process::exit(0);
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status).max(1)
        } else {
            1
        };
        std::process::exit(code);
    }
    drop(r);
    // SAFETY: a new session, away from the caller's terminal and its signals.
    unsafe { libc::setsid() };
    Ok(Readiness { pipe: Some(w) })
}

/// Tells a waiting `--fork` parent that the server is ready.
pub(crate) struct Readiness {
    pipe: Option<File>,
}

impl Readiness {
    /// The server is serving: release the parent, and detach from its stdin and stdout (and
    /// from stderr if it is a pipe, which would hold a caller's `$(...)` open; a terminal or a
    /// log file keeps getting the log).
    pub(crate) fn ready(&mut self) {
        let Some(mut pipe) = self.pipe.take() else {
            return;
        };
        let _ = std::io::stdout().flush();
        let null = File::options().read(true).write(true).open("/dev/null");
        if let Ok(null) = null {
            let stderr_is_pipe = std::fs::metadata("/proc/self/fd/2")
                .map(|m| {
                    use std::os::unix::fs::FileTypeExt;
                    m.file_type().is_fifo() || m.file_type().is_socket()
                })
                .unwrap_or(false);
            // SAFETY: dup2 onto the standard descriptors.
            unsafe {
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(null.as_raw_fd(), 1);
                if stderr_is_pipe {
                    libc::dup2(null.as_raw_fd(), 2);
                }
            }
        }
        let _ = pipe.write_all(b"1");
    }
}

/// `--exit-with-parent`: SIGTERM (a graceful shutdown) when the parent process exits.
pub(crate) fn exit_with_parent() -> Result<()> {
    // SAFETY: the process's own parent at this moment.
    let parent = unsafe { libc::getppid() };
    // SAFETY: prctl with plain integer arguments.
    if unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGTERM as libc::c_ulong,
            0,
            0,
            0,
        )
    } != 0
    {
        return Err(io::Error::last_os_error()).context("--exit-with-parent: prctl");
    }
    // SAFETY: as above.
    if unsafe { libc::getppid() } != parent {
        bail!("--exit-with-parent: the parent process has already exited");
    }
    Ok(())
}

/// A pid file, removed when dropped (at a clean exit).
pub(crate) struct PidFile(PathBuf);

impl PidFile {
    /// Writes our pid to `path` (through a new temporary file of an unguessable name and a
    /// rename, so a reader never sees it half written and a symlink planted in the directory
    /// is never written through).
    pub(crate) fn write(path: &Path) -> Result<PidFile> {
        qpip_cli::files::write_pid_file(path)
            .with_context(|| format!("--pid-file {}", path.display()))?;
        Ok(PidFile(path.to_owned()))
    }
}

impl Drop for PidFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
