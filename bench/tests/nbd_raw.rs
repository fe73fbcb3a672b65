//! `qpip-bench nbd raw` end to end: the real qpip-nbd-server, nbdkit and qemu-nbd, with fio's
//! nbd engine, on 127.0.0.1. A missing peer skips the test, or fails it in CI
//! (qpip-test-support's CI rule).

use std::path::PathBuf;
use std::process::Command;

use qpip_test_support::bins::workspace_bin;
use qpip_test_support::ci::{require, root};

#[test]
fn nbd_raw_json_has_positive_figures_for_every_server() {
    if !require(&["fio", "nbdkit", "qemu-nbd"]) {
        return;
    }
    let v = raw_json(&[]);
    assert!(v["params"]["netns"].is_null(), "{}", v["params"]);
}

/// With `--netns --mtu 9000` the servers listen in a namespace of their own, on the far
/// address of a veth pair of that MTU, and fio reaches them across it; the namespace is gone
/// afterwards.
#[test]
fn nbd_raw_netns_runs_the_servers_across_a_veth_link_and_removes_it() {
    if !root("--netns makes network namespaces") || !require(&["fio", "nbdkit", "qemu-nbd", "ip"]) {
        return;
    }
    let v = raw_json(&["--netns", "--mtu", "9000"]);
    let net = &v["params"]["netns"];
    assert_eq!(net["mtu"], 9000, "{net}");
    let ns = net["namespace"].as_str().expect("namespace name");
    assert!(!std::path::Path::new("/run/netns").join(ns).exists());
    let ip = net["ns_ip"].as_str().expect("namespace address");
    assert!(ip.starts_with("10.77."), "{net}");
}

/// `qpip-bench nbd raw` on 256 MiB, one round, with `extra` options: its JSON, checked for a
/// positive figure of every measure of every server. A server's CPU comes from its process's
/// clock ticks (10 ms): a 64 MiB read pass took about one, and sometimes none was counted.
fn raw_json(extra: &[&str]) -> serde_json::Value {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = workspace_bin("nbd-server", "qpip-nbd-server");
    let out = Command::new(&bench)
        .args(["nbd", "raw", "--size", "256M", "--repeat", "1", "--json"])
        .args(extra)
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
    assert_eq!(v["params"]["size_bytes"], 256 << 20);
    assert_eq!(v["params"]["repeat"], 1);
    v
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
