//! Ports of 127.0.0.1, and waiting until a peer listens.

use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a peer may take to start listening.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(20);

/// A port of 127.0.0.1 that was free a moment ago (for peers that cannot pick their own).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding 127.0.0.1:0")
        .local_addr()
        .expect("local address")
        .port()
}

/// Whether a socket listens on TCP `port` (IPv4 or IPv6), from /proc: without connecting,
/// as some peers serve one connection only, or log probes.
pub fn listening(port: u16) -> bool {
    let want = format!("{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|s| {
            s.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[3] == "0A" && cols[1].rsplit(':').next() == Some(&want)
            })
        })
    })
}

/// Waits until something listens on `port`; panics after [`LISTEN_TIMEOUT`].
pub fn wait_port(port: u16) {
    let t = Instant::now();
    while !listening(port) {
        assert!(t.elapsed() < LISTEN_TIMEOUT, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until a server accepts on its Unix socket at `path`; panics after
/// [`LISTEN_TIMEOUT`].
pub fn wait_socket(path: &Path) {
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(path).is_err() {
        assert!(
            t.elapsed() < LISTEN_TIMEOUT,
            "nothing listens on {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_listener_is_seen_and_a_free_port_is_not() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening(port));
        wait_port(port);
        drop(l);
        assert!(!listening(port));
    }
}
