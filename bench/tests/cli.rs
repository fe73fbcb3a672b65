//! qpip-bench's command line: the logging options every qpip binary shares.

use std::process::Command;

#[test]
fn logging_options_are_the_shared_ones_and_a_bad_rust_log_is_refused() {
    let bin = env!("CARGO_BIN_EXE_qpip-bench");
    let out = Command::new(bin)
        .args(["-v", "-q", "--help"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--verbose") && help.contains("--quiet"),
        "{help}"
    );
    // Refused before any benchmark runs.
    let out = Command::new(bin)
        .env("RUST_LOG", "loud")
        .arg("micro")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("qpip-bench: RUST_LOG"), "{err}");
}

/// `micro` opens and drops a NIC per measure: at its end the process holds no more
/// descriptors and threads than before the first (`--check-leaks` makes it fail otherwise).
#[test]
fn micro_gives_back_every_descriptor_and_thread() {
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
        .args([
            "micro",
            "--quick",
            "--repeat",
            "1",
            "--json",
            "--check-leaks",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `micro --json` reports round trips on an idle machine and with every CPU loaded, for QPs
/// that spin and that sleep and for sockets that busy-poll and that block, each with its CPU
/// per round trip.
#[test]
fn micro_reports_round_trips_idle_and_under_load() {
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
        .args(["micro", "--quick", "--repeat", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["rtt", "rtt_loaded"] {
        for proto in ["tcp", "udp"] {
            for way in ["qp_spin", "socket_busy_poll", "qp_sleep", "socket_blocking"] {
                for fig in ["us", "cpu_us"] {
                    let x = v[key][proto][way][fig].as_f64();
                    assert!(
                        x.is_some_and(|x| x > 0.0),
                        "{key}.{proto}.{way}.{fig}: {x:?}"
                    );
                }
            }
            // One run: each gain is that run's socket time over its QP time.
            for (gain, qp, socket) in [
                ("spin_gain", "qp_spin", "socket_busy_poll"),
                ("sleep_gain", "qp_sleep", "socket_blocking"),
            ] {
                let w = &v[key][proto];
                let want = w[socket]["us"].as_f64().unwrap() / w[qp]["us"].as_f64().unwrap();
                let got = w[gain].as_f64().unwrap();
                assert!(
                    (got - want).abs() < 1e-9,
                    "{key}.{proto}.{gain}: {got} vs {want}"
                );
            }
        }
    }
    assert!(v["netns"].is_null());
    assert_eq!(
        v["rtt_comparisons"],
        serde_json::json!([
            ["qp_spin", "socket_busy_poll"],
            ["qp_sleep", "socket_blocking"]
        ])
    );
}

/// `micro --netns` runs side B as `qpip-bench micro-echo` inside a namespace of its own,
/// across a veth pair of the MTU asked for, and removes the namespace afterwards.
#[test]
fn micro_netns_runs_the_far_side_across_a_veth_link() {
    use qpip_test_support::ci::{have, root};
    if !root("--netns makes network namespaces") || !have("ip") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
        .args(["micro", "--quick", "--repeat", "1", "--json"])
        .args(["--netns", "--mtu", "9000"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["netns"]["mtu"], 9000, "{}", v["netns"]);
    for fig in [
        &v["rtt"]["udp"]["qp_sleep"]["cpu_us"],
        &v["rtt"]["tcp"]["socket_busy_poll"]["us"],
        &v["throughput_MBps"]["128k"]["qp"],
        &v["overhead_ns"]["socket"],
    ] {
        assert!(fig.as_f64().is_some_and(|x| x > 0.0), "{v}");
    }
    let ns = v["netns"]["namespace"].as_str().unwrap();
    assert!(!std::path::Path::new("/run/netns").join(ns).exists());
}

/// `micro --only ROW` runs that row alone, `--repeat` times, a line of figures per run (what
/// a profiler is pointed at); `--count` without `--only` is refused.
#[test]
fn micro_only_runs_one_row_a_line_per_run() {
    let bin = env!("CARGO_BIN_EXE_qpip-bench");
    for (row, count, says) in [("qp-tcp", "200", "round trip"), ("qp-16k", "2", "MB/s")] {
        let out = Command::new(bin)
            .args(["micro", "--only", row, "--count", count, "--repeat", "2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{row}: {err}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text.lines().count(), 2, "{row}: {text}");
        assert!(text.lines().all(|l| l.contains(says)), "{row}: {text}");
    }
    let out = Command::new(bin)
        .args(["micro", "--count", "5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
