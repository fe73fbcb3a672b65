//! Peer commands (qemu-img, qemu-io, nbdinfo, nbdcopy, fio, …) run to completion under a time
//! limit, with their output for assertions.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long a peer command may run in [`peer_ok`] and [`peer_fails`].
pub const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs a command with a timeout; returns its output (it is killed on timeout, and the test
/// panics).
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e}"));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let t_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = t_out.join().unwrap();
            let stderr = t_err.join().unwrap();
            panic!(
                "{desc} timed out after {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: t_out.join().unwrap(),
        stderr: t_err.join().unwrap(),
    }
}

/// Both streams as text, for assertions and panic messages.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs a peer command ([`PEER_TIMEOUT`]) and asserts it succeeded; returns stdout + stderr.
pub fn peer_ok(cmd: &mut Command) -> String {
    let desc = format!("{cmd:?}");
    let o = run_with_timeout(cmd, PEER_TIMEOUT);
    let t = text(&o);
    assert!(o.status.success(), "{desc} failed ({}):\n{t}", o.status);
    t
}

/// Runs a peer command ([`PEER_TIMEOUT`]) and asserts it failed; returns stdout + stderr.
pub fn peer_fails(cmd: &mut Command) -> String {
    let desc = format!("{cmd:?}");
    let o = run_with_timeout(cmd, PEER_TIMEOUT);
    let t = text(&o);
    assert!(!o.status.success(), "{desc} should have failed:\n{t}");
    t
}
