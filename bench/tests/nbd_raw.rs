//! `qpip-bench nbd raw` end to end: the real qpip-nbd-server, nbdkit and qemu-nbd, with fio's
//! nbd engine, on 127.0.0.1. Outside CI a missing peer skips the test; with CI=true it fails.

use std::path::{Path, PathBuf};
use std::process::Command;

fn in_path(prog: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
        .unwrap_or(false)
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// qpip-nbd-server next to qpip-bench, built there if this test run did not build it (as
/// `cargo test -p qpip-bench` does not).
fn server_bin(bench: &Path) -> PathBuf {
    let dir = bench.parent().expect("binary has a directory");
    let server = dir.join("qpip-nbd-server");
    if !server.is_file() {
        let target_dir = dir.parent().expect("profile directory has a parent");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-p", "nbd-server", "--bin", "qpip-nbd-server"])
            .arg("--target-dir")
            .arg(target_dir)
            // The features scripts/test builds the workspace with (QPIP_FEATURES).
            .args(
                std::env::var("QPIP_FEATURES")
                    .unwrap_or_default()
                    .split_whitespace(),
            );
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd
            .status()
            .expect("running cargo build for qpip-nbd-server");
        assert!(status.success(), "building qpip-nbd-server failed");
    }
    assert!(server.is_file(), "{} missing", server.display());
    server
}

#[test]
fn nbd_raw_json_has_positive_figures_for_every_server() {
    let missing: Vec<&str> = ["fio", "nbdkit", "qemu-nbd"]
        .into_iter()
        .filter(|p| !in_path(p))
        .collect();
    if !missing.is_empty() {
        assert!(
            !ci(),
            "CI=true and prerequisites are missing: {}",
            missing.join(", ")
        );
        eprintln!("skipping: not installed: {}", missing.join(", "));
        return;
    }
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = server_bin(&bench);
    let out = Command::new(&bench)
        .args(["nbd", "raw", "--size", "64M", "--repeat", "1", "--json"])
        .arg("--server-bin")
        .arg(&server)
        .output()
        .expect("running qpip-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qpip-bench failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stderr}"));
    for server in ["qpip", "nbdkit", "qemu-nbd"] {
        for measure in [
            "write_MBps",
            "read_MBps",
            "write_server_cpu_s_per_GB",
            "read_server_cpu_s_per_GB",
            "write_client_cpu_s_per_GB",
            "read_client_cpu_s_per_GB",
        ] {
            let x = v["servers"][server][measure]
                .as_f64()
                .unwrap_or_else(|| panic!("servers.{server}.{measure} missing in {v}"));
            assert!(x.is_finite() && x > 0.0, "servers.{server}.{measure} = {x}");
        }
    }
    for ratio in ["write_vs_nbdkit", "read_vs_nbdkit"] {
        let x = v["ratios"][ratio].as_f64().expect("ratio present");
        assert!(x.is_finite() && x > 0.0, "ratios.{ratio} = {x}");
    }
    assert_eq!(v["params"]["size_bytes"], 64 << 20);
    assert_eq!(v["params"]["repeat"], 1);
}

#[test]
fn a_missing_server_binary_is_named() {
    let bench = env!("CARGO_BIN_EXE_qpip-bench");
    let out = Command::new(bench)
        .args(["nbd", "raw", "--size", "1M", "--repeat", "1"])
        .args(["--server-bin", "/nonexistent/qpip-nbd-server"])
        .output()
        .expect("running qpip-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/qpip-nbd-server"),
        "error does not name the path:\n{stderr}"
    );
}
