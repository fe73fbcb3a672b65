//! The mount's command line: the logging options every qpip binary shares.

use std::process::Command;

#[test]
fn logging_options_are_the_shared_ones_and_a_bad_rust_log_is_refused() {
    let bin = env!("CARGO_BIN_EXE_qpip-nbd-mount");
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    // -q/-v are accepted: the error is the mount point's (status 1), not a usage error.
    let out = Command::new(bin)
        .env_remove("RUST_LOG")
        .args(["-qq", "-v", "nbd://127.0.0.1:1/x"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let out = Command::new(bin)
        .env("RUST_LOG", "loud")
        .args(["nbd://127.0.0.1:1/x"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("qpip-nbd-mount: RUST_LOG"), "{err}");
}
