//! `qpip-bench nbd raw` end to end: the real qpip-nbd-server, nbdkit and qemu-nbd, with fio's
//! nbd engine, on 127.0.0.1. A missing peer skips the test, or fails it in CI
//! (qpip-test-support's CI rule).

use std::path::PathBuf;
use std::process::Command;

use qpip_test_support::bins::workspace_bin;
use qpip_test_support::ci::require;

#[test]
fn nbd_raw_json_has_positive_figures_for_every_server() {
    if !require(&["fio", "nbdkit", "qemu-nbd"]) {
        return;
    }
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = workspace_bin("nbd-server", "qpip-nbd-server");
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
