//! `--metrics`: the server's live statistics ([`nbd_server::metrics`]) over HTTP, as
//! Prometheus scrapes them: `GET /metrics` on a TCP address or a Unix-domain socket.
//!
//! This is a management port on the host's own network stack (std's listeners), not on the
//! NIC that serves NBD. It is bounded so that a scraper, a port scanner or a slow client
//! cannot disturb serving: one thread, at most [`MAX_CLIENTS`] requests at once (a thread
//! each; more are closed unanswered), a request head of at most [`MAX_HEAD`] bytes read
//! within [`REQUEST_TIME`] all told (a client sending a byte at a time is cut off then), one
//! request per connection, and anything but `GET`/`HEAD /metrics` answered with an error.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nbd_server::metrics::{CONTENT_TYPE, render};
use nbd_server::server::Stats;

/// Requests answered at once.
const MAX_CLIENTS: usize = 4;
/// The longest request head (request line and headers) read.
const MAX_HEAD: usize = 8 * 1024;
/// The time a client has to send its request, and then to read the answer.
const REQUEST_TIME: Duration = Duration::from_secs(5);

/// Where `--metrics` listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum MetricsAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl MetricsAddr {
    /// `ADDR:PORT` (IPv6 in brackets), `HOST:PORT`, or a Unix socket: `unix:PATH`, or a path
    /// with a `/` in it.
    pub(crate) fn parse(s: &str) -> Result<MetricsAddr> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                bail!("--metrics {s:?}: give the socket's path after unix:");
            }
            return Ok(MetricsAddr::Unix(path.into()));
        }
        if s.contains('/') {
            return Ok(MetricsAddr::Unix(s.into()));
        }
        let bad = || {
            format!(
                "--metrics {s:?} is not ADDR:PORT (IPv6 in brackets: [::1]:9100), HOST:PORT or unix:PATH"
            )
        };
        let mut addrs = s.to_socket_addrs().with_context(bad)?;
        addrs.next().with_context(bad).map(MetricsAddr::Tcp)
    }
}

/// The bound listener, before the server starts.
pub(crate) enum MetricsListener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl MetricsListener {
    /// Binds `addr`; a stale Unix socket (nothing listens on it) is replaced, any other file
    /// there refused.
    pub(crate) fn bind(addr: &MetricsAddr) -> Result<MetricsListener> {
        match addr {
            MetricsAddr::Tcp(a) => TcpListener::bind(a)
                .map(MetricsListener::Tcp)
                .with_context(|| format!("--metrics: listening on {a}")),
            MetricsAddr::Unix(path) => {
                let what = || format!("--metrics: listening on Unix socket {}", path.display());
                if let Ok(m) = std::fs::symlink_metadata(path) {
                    if !m.file_type().is_socket() {
                        bail!("{}: a file that is not a socket is in the way", what());
                    }
                    match UnixStream::connect(path) {
                        Ok(_) => bail!("{}: another server is listening on it", what()),
                        // Stale: its server is gone.
                        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                            std::fs::remove_file(path).with_context(what)?;
                        }
                        Err(e) => return Err(e).with_context(what),
                    }
                }
                let l = UnixListener::bind(path).with_context(what)?;
                Ok(MetricsListener::Unix(l, path.clone()))
            }
        }
    }

    /// What to tell the user: the URL scraped, or the socket.
    pub(crate) fn describe(&self) -> String {
        match self {
            MetricsListener::Tcp(l) => match l.local_addr() {
                Ok(a) => format!("http://{a}/metrics"),
                Err(_) => "a TCP address".into(),
            },
            MetricsListener::Unix(_, p) => format!("unix:{} (GET /metrics)", p.display()),
        }
    }

    /// Answers scrapes with `stats` on a thread of its own; the returned guard removes a Unix
    /// socket's file when dropped.
    pub(crate) fn serve(self, stats: Stats) -> Result<MetricsGuard> {
        let active = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new().name("metrics".into());
        let guard = match self {
            MetricsListener::Tcp(l) => {
                thread.spawn(move || accept_loop(|| l.accept().map(|(s, _)| s), stats, active))?;
                MetricsGuard(None)
            }
            MetricsListener::Unix(l, path) => {
                thread.spawn(move || accept_loop(|| l.accept().map(|(s, _)| s), stats, active))?;
                MetricsGuard(Some(path))
            }
        };
        Ok(guard)
    }
}

/// Removes the Unix socket's file at exit.
pub(crate) struct MetricsGuard(Option<PathBuf>);

impl Drop for MetricsGuard {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A client connection: TCP or Unix.
trait Client: Read + Write + Send + 'static {
    fn timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()>;
}

impl Client for TcpStream {
    fn timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

impl Client for UnixStream {
    fn timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

fn accept_loop<C: Client>(
    mut accept: impl FnMut() -> io::Result<C>,
    stats: Stats,
    active: Arc<AtomicUsize>,
) {
    loop {
        let client = match accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("--metrics: accept: {e}");
                // Out of descriptors, say: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!("--metrics: {MAX_CLIENTS} requests under way; one more closed");
            continue;
        }
        let stats = stats.clone();
        let done = active.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-client".into())
            .spawn(move || {
                if let Err(e) = answer(client, &stats) {
                    tracing::debug!("--metrics: {e}");
                }
                done.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("--metrics: cannot start a thread: {e}");
        }
    }
}

/// Reads one request head (within the time and size limits) and answers it.
fn answer<C: Client>(mut client: C, stats: &Stats) -> io::Result<()> {
    let deadline = Instant::now() + REQUEST_TIME;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0; 1024];
    let reply = loop {
        if let Some(end) = head_end(&head) {
            break respond(&head[..end], || render(&stats.snapshot()));
        }
        if head.len() >= MAX_HEAD {
            break error(431, "Request Header Fields Too Large");
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break error(408, "Request Timeout");
        }
        client.timeouts(Some(left), Some(REQUEST_TIME))?;
        let n = match client.read(&mut buf[..(MAX_HEAD - head.len()).min(1024)]) {
            Ok(0) => return Ok(()), // gone before asking anything
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue; // the deadline check above answers
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        head.extend_from_slice(&buf[..n]);
    };
    client.write_all(&reply)?;
    client.flush()
}

/// Where the request head ends (after its blank line), if it has arrived.
fn head_end(b: &[u8]) -> Option<usize> {
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The answer to a request head: the text of `metrics()` for `GET /metrics` (its headers
/// alone for `HEAD`), an error otherwise. No I/O.
fn respond(head: &[u8], metrics: impl FnOnce() -> String) -> Vec<u8> {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return error(400, "Bad Request");
    };
    let mut words = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return error(400, "Bad Request");
    };
    if !version.starts_with("HTTP/1.") {
        return error(400, "Bad Request");
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return error(404, "Not Found");
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return error(405, "Method Not Allowed"),
    };
    let body = metrics();
    let mut out = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

/// An error answer, its reason as the body.
fn error(code: u16, reason: &str) -> Vec<u8> {
    let allow = if code == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {code} {reason}\r\n{allow}Content-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reason}\n",
        reason.len() + 1
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(head: &[u8]) -> String {
        let out = respond(head, || "figures\n".into());
        let text = String::from_utf8(out).unwrap();
        text.lines().next().unwrap().to_string()
    }

    #[test]
    fn get_metrics_is_answered_with_the_text() {
        let out = respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", || {
            "a 1\n".into()
        });
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(
            text.contains("Content-Type: text/plain; version=0.0.4"),
            "{text}"
        );
        assert!(text.contains("Content-Length: 4\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\na 1\n"), "{text}");
        let head = respond(b"HEAD /metrics?x=1 HTTP/1.0\n\n", || "a 1\n".into());
        assert!(String::from_utf8(head).unwrap().ends_with("\r\n\r\n"));
    }

    #[test]
    fn anything_else_gets_an_error() {
        assert_eq!(status(b"GET / HTTP/1.1\r\n\r\n"), "HTTP/1.1 404 Not Found");
        assert_eq!(
            status(b"POST /metrics HTTP/1.1\r\n\r\n"),
            "HTTP/1.1 405 Method Not Allowed"
        );
        for garbage in [
            &b"\xff\xfe\x00garbage\r\n\r\n"[..],
            b"GET /metrics\r\n\r\n",
            b"GET /metrics SPDY/3\r\n\r\n",
            b"GET  /metrics HTTP/1.1 x\r\n\r\n",
            b"\r\n\r\n",
            b"",
        ] {
            assert_eq!(status(garbage), "HTTP/1.1 400 Bad Request", "{garbage:?}");
        }
    }

    #[test]
    fn the_head_ends_at_its_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nbody"), Some(16));
    }

    #[test]
    fn addresses_are_tcp_or_unix() {
        assert_eq!(
            MetricsAddr::parse("127.0.0.1:9100").unwrap(),
            MetricsAddr::Tcp("127.0.0.1:9100".parse().unwrap())
        );
        assert_eq!(
            MetricsAddr::parse("[::1]:0").unwrap(),
            MetricsAddr::Tcp("[::1]:0".parse().unwrap())
        );
        assert_eq!(
            MetricsAddr::parse("unix:m.sock").unwrap(),
            MetricsAddr::Unix("m.sock".into())
        );
        assert_eq!(
            MetricsAddr::parse("/run/q/m.sock").unwrap(),
            MetricsAddr::Unix("/run/q/m.sock".into())
        );
        for bad in ["9100", "localhost", "unix:", "[::1]"] {
            let e = MetricsAddr::parse(bad).unwrap_err().to_string();
            assert!(e.contains("--metrics"), "{bad}: {e}");
        }
    }
}
