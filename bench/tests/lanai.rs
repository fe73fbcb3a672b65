//! `qpip-bench lanai --json --quick`: the virtual-time predictions have every key, are
//! finite and positive, and two runs print identical JSON.

use std::process::Command;

fn run() -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
        .args(["lanai", "--json", "--quick"])
        .output()
        .expect("running qpip-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qpip-bench lanai failed:\n{stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stderr}"))
}

fn positive(v: &serde_json::Value, path: &[&str]) -> f64 {
    let x = path
        .iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or_else(|| panic!("{} missing in {v}", path.join(".")));
    assert!(x.is_finite() && x > 0.0, "{} = {x}", path.join("."));
    x
}

#[test]
fn lanai_json_has_every_prediction_and_is_deterministic() {
    let v = run();
    for proto in ["udp", "tcp"] {
        for c in ["hw_csum", "fw_csum"] {
            positive(&v, &["rtt_us", proto, c]);
        }
        // Summing in firmware costs time on the receive path.
        assert!(v["rtt_us"][proto]["fw_csum"].as_f64() >= v["rtt_us"][proto]["hw_csum"].as_f64());
    }
    for k in ["mtu16384", "mtu9000", "mtu1500", "mtu16384_fw_csum"] {
        positive(&v, &["ttcp_MBps", k]);
    }
    // Each throughput names the resource that bounds it, with its utilisation.
    for k in ["mtu16384", "mtu9000", "mtu1500", "mtu16384_fw_csum"] {
        let b = &v["ttcp_bound"][k];
        let name = b["resource"].as_str().unwrap_or("");
        assert!(
            [
                "wire",
                "PCI read",
                "PCI write",
                "NIC processor",
                "staging",
                "rx staging"
            ]
            .contains(&name),
            "{k}: {b}"
        );
        let u = positive(b, &["utilisation"]);
        assert!(u <= 1.01, "{k}: {u}");
    }
    let big = positive(&v, &["ttcp_MBps", "mtu16384"]);
    let small = positive(&v, &["ttcp_MBps", "mtu1500"]);
    assert!(small < big, "MTU 1500 {small} MB/s vs MTU 16384 {big} MB/s");
    for side in ["send", "recv"] {
        for kind in ["data", "ack"] {
            positive(&v, &["occupancy_us", side, kind, "total"]);
        }
    }
    // Every figure says which port of the program it assumes.
    assert!(
        v["app_port"]["ttcp"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    assert!(v["app_port"]["rtt"].as_str().is_some_and(|s| !s.is_empty()));
    positive(&v, &["app_port", "ttcp_sends_outstanding"]);
    for proto in ["udp", "tcp"] {
        positive(&v, &["rtt_us_preposted", proto]);
    }
    // The sensitivity table: each port of ttcp at each MTU, with its bound.
    for col in ["mtu16384", "mtu9000", "mtu1500", "mtu16384_fw_csum"] {
        for port in ["s1_r1", "s1_r16", "s2_r1", "s2_r16", "s8_r1", "s8_r16"] {
            positive(&v, &["ttcp_sensitivity", col, port, "MBps"]);
            positive(&v, &["ttcp_sensitivity", col, port, "bound", "utilisation"]);
        }
    }
    // The firmware checksum's range: fewer cycles per word never make ttcp slower.
    let c = &v["fw_csum_cycles_per_word"];
    let (lo, model, hi) = (
        positive(c, &["low"]),
        positive(c, &["model"]),
        positive(c, &["high"]),
    );
    assert!(lo <= model && model <= hi, "{lo} {model} {hi}");
    let t = |k: &str| positive(c, &["ttcp_MBps_mtu16384", k]);
    assert!(t("low") >= t("model") && t("model") >= t("high"), "{c}");
    let cpu = positive(&v, &["host_cpu_pct"]);
    assert!(cpu <= 100.0, "host CPU {cpu} %");
    positive(&v, &["host_cpu_pct_sender"]);
    for row in [
        "baseline",
        "hw_doorbell",
        "hw_checksum",
        "hw_demux",
        "hw_multiply",
        "clock_4x",
        "all",
    ] {
        positive(&v, &["what_if", row, "tcp_rtt_us"]);
        positive(&v, &["what_if", row, "ttcp_MBps"]);
    }
    // Everything at once beats the LANai 9 as built.
    assert!(
        v["what_if"]["all"]["tcp_rtt_us"].as_f64()
            < v["what_if"]["baseline"]["tcp_rtt_us"].as_f64()
    );
    // The storage experiment: each direction as ported, with its bound and its port.
    let resources = [
        "wire",
        "PCI read",
        "PCI write",
        "NIC processor",
        "staging",
        "rx staging",
        "host CPU",
    ];
    assert!(v["app_port"]["nbd"].as_str().is_some_and(|s| !s.is_empty()));
    for d in ["read", "write"] {
        positive(&v, &["nbd_MBps", d]);
        let b = &v["nbd_bound"][d];
        assert!(
            resources.contains(&b["resource"].as_str().unwrap_or("")),
            "{b}"
        );
        assert!(b["saturated"].is_boolean(), "{b}");
        positive(&v, &["nbd_host_cpu_pct", d, "server"]);
        for row in [
            "as_ported",
            "depth1",
            "depth2",
            "depth64",
            "sends_free",
            "direct",
            "server_ahead",
            "no_copy",
            "pipelined",
        ] {
            positive(&v, &["nbd_sensitivity", row, d, "MBps"]);
        }
        for row in ["baseline", "all"] {
            positive(&v, &["what_if", row, &format!("nbd_{d}_MBps")]);
        }
    }
    // As ported, a sequential read has one request outstanding, writes use their slots.
    assert_eq!(v["nbd_max_in_flight"]["read"], 1);
    let w = positive(&v, &["nbd_max_in_flight", "write"]);
    assert!(
        w > 1.0 && w <= positive(&v, &["nbd_port", "write_depth"]),
        "{w}"
    );
    assert_eq!(v, run(), "two runs differ");
}
