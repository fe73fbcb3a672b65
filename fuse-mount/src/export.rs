//! The export behind the FUSE file: an [`nbd_client::Pool`] of connections (which widens
//! unaligned I/O and does read-modify-write), its failures logged and turned into the errno
//! the application gets.

use nbd_client::{Caps, Error, MrSlice, Pool};

/// An errno for the application.
pub type Errno = i32;

/// After unmounting: how long a lost server gets to come back for the last flush.
const CLOSE_RECONNECT: std::time::Duration = std::time::Duration::from_secs(2);

/// The errno an NBD client error reaches the application as. Anything that leaves the outcome
/// unknown (lost connection, protocol violation) is EIO: never success, never wrong data.
pub fn errno_of(e: &Error) -> Errno {
    e.errno()
}

fn log_err(what: &str, offset: u64, len: u64, e: &Error) -> Errno {
    let errno = errno_of(e);
    tracing::warn!(offset, len, "{what} failed: {e} (errno {errno})");
    errno
}

/// The mounted export.
pub struct Export {
    pool: Pool,
}

impl Export {
    /// The export behind `pool`'s connections.
    pub fn new(pool: Pool) -> Export {
        Export { pool }
    }

    /// What the export supports.
    pub fn caps(&self) -> &Caps {
        self.pool.caps()
    }

    /// The export's size now: the size at mount time until a reconnect finds it resized.
    pub fn size(&self) -> u64 {
        self.pool.size()
    }

    /// The server offers RESIZE on the export (its size may change under the mount).
    pub fn resizable(&self) -> bool {
        self.pool.resizable()
    }

    /// Asks the server for the export's size now (a handshake of its own, NBD_OPT_INFO).
    pub fn probe_size(&self) -> Option<u64> {
        match self.pool.probe_size() {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::debug!("asking the server for the export's size: {e}");
                None
            }
        }
    }

    /// Connections open to the server.
    pub fn connections(&self) -> usize {
        self.pool.connections()
    }

    /// Reads `into.len()` bytes at `offset` into registered memory, `into` (the caller keeps
    /// the range inside the export, and nothing else uses those bytes meanwhile).
    pub fn read_into(&self, offset: u64, into: MrSlice<'_>) -> Result<(), Errno> {
        self.pool
            .read_into(offset, into)
            .map_err(|e| log_err("read", offset, into.len() as u64, &e))
    }

    /// Writes the bytes of registered memory `from` at `offset`; the NIC sends them from
    /// there.
    pub fn write_from(&self, offset: u64, from: MrSlice<'_>) -> Result<(), Errno> {
        self.pool
            .write_from(offset, from)
            .map_err(|e| log_err("write", offset, from.len() as u64, &e))
    }

    /// Makes acknowledged writes durable (NBD FLUSH).
    pub fn flush(&self) -> Result<(), Errno> {
        self.pool.flush().map_err(|e| log_err("flush", 0, 0, &e))
    }

    /// Zeroes exactly `[offset, offset+len)`.
    pub fn zero(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.pool
            .zero(offset, len)
            .map_err(|e| log_err("write zeroes", offset, len, &e))
    }

    /// Punches a hole that reads as zeroes.
    pub fn punch(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.pool
            .punch(offset, len)
            .map_err(|e| log_err("punch", offset, len, &e))
    }

    /// Flushes and disconnects every connection. The file system is unmounted by now: a
    /// server that is gone gets `CLOSE_RECONNECT` to come back, not the whole reconnect
    /// timeout, so the process exits promptly.
    pub fn close(self) {
        self.pool.limit_reconnect_timeout(CLOSE_RECONNECT);
        if let Err(e) = self.flush() {
            tracing::warn!(
                "final flush failed (errno {e}): writes the server acknowledged may not be durable on it"
            );
        }
        for c in self.pool.into_clients() {
            if let Err(e) = c.disconnect() {
                tracing::warn!("disconnect: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos() {
        use nbd_proto::transmission::ErrorValue;
        let server = |error| Error::Server {
            error,
            message: String::new(),
        };
        assert_eq!(errno_of(&server(ErrorValue::Io)), libc::EIO);
        assert_eq!(errno_of(&server(ErrorValue::NoSpc)), libc::ENOSPC);
        assert_eq!(errno_of(&server(ErrorValue::Perm)), libc::EPERM);
        assert_eq!(errno_of(&Error::ReadOnly), libc::EROFS);
        let lost = Error::ConnectionLost {
            uri: "nbd://x".into(),
            after: std::time::Duration::from_secs(1),
            why: "gone".into(),
        };
        assert_eq!(errno_of(&lost), libc::EIO);
    }
}
