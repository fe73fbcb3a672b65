//! Standard output as the peers' tools treat it: a reader that stops early (`| head -c 1`,
//! `| true`) ends the program as SIGPIPE ends nbdinfo and nbdcopy — quietly, killed by the
//! signal (status 141 in a shell) — never with a panic or an error line.
//!
//! Rust ignores SIGPIPE, so a closed pipe is an `EPIPE` error of the write; `println!` panics
//! on it. The binaries print through [`outln!`](crate::outln) and [`out!`](crate::out), which
//! turn it into [`StdoutClosed`], and hand their errors to [`exit_if_closed`] first. SIGPIPE
//! itself stays ignored while they run: the soft NIC's splices into sockets must see EPIPE.

use std::io::{self, Write};

/// Standard output's reader went away.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed")]
pub struct StdoutClosed;

/// `e`, a write to standard output's error: [`StdoutClosed`] for a closed pipe, else itself.
pub fn closed_or(e: io::Error) -> anyhow::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        StdoutClosed.into()
    } else {
        anyhow::Error::new(e).context("writing standard output")
    }
}

/// Writes formatted text to standard output (what [`out!`](crate::out) expands to).
pub fn write_fmt(args: std::fmt::Arguments) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    out.write_fmt(args).map_err(closed_or)?;
    // Standard output is line-buffered: text after the last newline would wait for the
    // exit's flush, which drops its error.
    out.flush().map_err(closed_or)
}

/// `e` says standard output was closed (anywhere in its chain of causes).
pub fn is_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<StdoutClosed>())
}

/// Ends the process as SIGPIPE would have, if `e` says standard output was closed; returns
/// otherwise.
pub fn exit_if_closed(e: &anyhow::Error) {
    if !is_closed(e) {
        return;
    }
    // SAFETY: restoring a signal's default disposition and raising it; nothing else runs
    // after this point in the process.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(128 + libc::SIGPIPE);
}

/// `print!` that returns [`StdoutClosed`] for a closed pipe instead of panicking.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::stdout::write_fmt(format_args!($($arg)*))
    };
}

/// `println!` that returns [`StdoutClosed`] for a closed pipe instead of panicking.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::stdout::write_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::stdout::write_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_pipe_is_stdout_closed_and_other_errors_keep_their_cause() {
        let e = closed_or(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(is_closed(&e));
        let e = closed_or(io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(!is_closed(&e));
        assert!(
            format!("{e:#}").contains("writing standard output"),
            "{e:#}"
        );
    }
}
