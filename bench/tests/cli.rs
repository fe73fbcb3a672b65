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
/// and sockets alike.
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
    for key in ["rtt_us", "rtt_loaded_us"] {
        for proto in ["tcp", "udp"] {
            for side in ["qp", "socket"] {
                let x = v[key][proto][side].as_f64();
                assert!(x.is_some_and(|x| x > 0.0), "{key}.{proto}.{side}: {x:?}");
            }
        }
    }
}
