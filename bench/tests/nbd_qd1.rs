//! `qpip-bench nbd qd1` end to end at a small size: qpip-nbd-mount over qpip-nbd-server and
//! qemu-storage-daemon's FUSE export over nbdkit, with fio. Needs root, /dev/fuse and the
//! peers; a missing prerequisite skips the test with a note, or fails it in CI
//! (qpip-test-support's CI rule).

use std::path::{Path, PathBuf};
use std::process::Command;

use qpip_test_support::bins::workspace_bin;
use qpip_test_support::ci::{missing, require, root};

/// Mounts and work directories that a run of ours could leave behind.
fn leftovers(dir: &Path) -> Vec<String> {
    let mut left: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("qpip-bench-qd1"))
        .map(str::to_string)
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        left.extend(entries.flatten().map(|e| e.path().display().to_string()));
    }
    left
}

#[test]
fn qd1_json_has_latencies_cpu_and_four_goals_and_leaves_nothing_behind() {
    if !root("the FUSE mounts need it")
        || !(Path::new("/dev/fuse").exists() || missing("/dev/fuse"))
        || !require(&["fio", "nbdkit", "qemu-storage-daemon", "fusermount3"])
    {
        return;
    }
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = workspace_bin("nbd-server", "qpip-nbd-server");
    let mount = workspace_bin("fuse-mount", "qpip-nbd-mount");
    // --dir: the run makes its work directory inside and removes it, not the directory.
    let dir = std::env::temp_dir().join(format!("qpip-bench-qd1-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(&bench)
        .args([
            "nbd",
            "qd1",
            "--runtime",
            "1",
            "--size",
            "64M",
            "--repeat",
            "1",
        ])
        .arg("--json")
        .arg("--server-bin")
        .arg(&server)
        .arg("--mount-bin")
        .arg(&mount)
        .arg("--dir")
        .arg(&dir)
        .output()
        .expect("running qpip-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let left = leftovers(&dir);
    let kept = dir.is_dir();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "qpip-bench failed:\n{stderr}");
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(kept, "--dir {} itself was removed", dir.display());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stderr}"));
    let get = |stack: &str, measure: &str| {
        v["stacks"][stack][measure]["median"]
            .as_f64()
            .unwrap_or_else(|| panic!("stacks.{stack}.{measure} missing in {v}"))
    };
    for stack in ["qpip", "qsd-nbdkit"] {
        for rw in ["randread", "randwrite"] {
            for m in ["iops", "p50_us", "p99_us", "ios", "cpu_ms_per_10k_all"] {
                let x = get(stack, &format!("{rw}_{m}"));
                assert!(x.is_finite() && x > 0.0, "stacks.{stack}.{rw}_{m} = {x}");
            }
            assert!(get(stack, &format!("{rw}_p99_us")) >= get(stack, &format!("{rw}_p50_us")));
            // One process's share can be below /proc's 10 ms tick in a 1 s run.
            for k in ["server", "server_nic", "client_nic", "client_app", "fio"] {
                let x = get(stack, &format!("{rw}_cpu_ms_per_10k_{k}"));
                assert!(x.is_finite() && x >= 0.0, "stacks.{stack}.{rw} {k} = {x}");
            }
        }
    }
    // The socket stack has no soft NIC.
    assert_eq!(get("qsd-nbdkit", "randread_cpu_ms_per_10k_client_nic"), 0.0);
    let targets = v["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 4, "{v}");
    for t in targets {
        assert!(t["value"].as_f64().is_some_and(|x| x > 0.0), "{t}");
    }
    assert!(stderr.contains("verdict:"), "no verdict line:\n{stderr}");
    assert_eq!(v["params"]["size_bytes"], 64 << 20);
}

#[test]
fn qd1_refuses_a_bad_runtime_or_size_in_one_line() {
    for args in [
        ["--runtime=-1", "--size=64M"],
        ["--runtime=0.01", "--size=64M"],
        ["--runtime=1", "--size=1000"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
            .args(["nbd", "qd1"])
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains("--runtime") || stderr.contains("--size"),
            "{args:?}: {stderr}"
        );
    }
}
