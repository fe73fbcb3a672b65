//! Captive mode (`--run CMD`), as nbdkit's: the command runs once the server serves, with
//! the default export's URI in its environment, and the server exits when it does.

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Child;

use anyhow::{Context, Result};
use qpip_core::Endpoint;

/// Starts `sh -c CMD` with $uri (and $nbd) naming `export` at the first IPv4 address served
/// (else the first IPv6 one), and $port; with only a Unix socket, its nbd+unix URI and
/// $unixsocket.
pub(crate) fn spawn(
    cmd: &str,
    addrs: &[Endpoint],
    socket: Option<&Path>,
    export: &str,
) -> Result<Child> {
    let ip = addrs.iter().filter_map(|e| match e {
        Endpoint::Ip(a) => Some(*a),
        Endpoint::Unix(_) => None,
    });
    let v4 = ip.clone().find(|a| a.is_ipv4());
    let mut sh = std::process::Command::new("sh");
    sh.arg("-c").arg(cmd);
    match v4.or(ip.clone().next()) {
        Some(a) => {
            let host = match a.ip() {
                std::net::IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_string(),
                std::net::IpAddr::V4(ip) => ip.to_string(),
                std::net::IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".to_string(),
                std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            };
            let uri = format!("nbd://{host}:{}/{export}", a.port());
            sh.env("uri", &uri)
                .env("nbd", &uri)
                .env("port", a.port().to_string());
        }
        // Only a Unix socket: nbdkit's $unixsocket, and the URI naming it.
        None => {
            let path = socket.context("--run: no listening address")?;
            let uri = format!("nbd+unix:///{export}?socket={}", path.display());
            sh.env("uri", &uri).env("nbd", &uri).env("unixsocket", path);
        }
    }
    sh.spawn()
        .with_context(|| format!("--run {cmd:?}: starting sh"))
}

/// The exit status a shell would report for the command.
pub(crate) fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// After the server stopped: a command still running (a signal stopped the server first)
/// gets SIGTERM too, and its status is the exit status; else `code`.
pub(crate) fn finish(child: Option<Child>, code: i32) -> i32 {
    let Some(mut child) = child else {
        return code;
    };
    if child.try_wait().ok().flatten().is_some() {
        return code;
    }
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    match child.wait() {
        Ok(status) => status.code().unwrap_or(1),
        Err(_) => code,
    }
}
