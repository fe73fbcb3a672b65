//! `qpip-bench nbd ext2` and `nbd sweep` end to end at small sizes: every stack, real
//! mounts. ext2 needs root, /dev/fuse, qpip-nbd-mount and the peers; a missing prerequisite
//! skips the test with a note, or fails it in CI (qpip-test-support's CI rule).

use std::path::{Path, PathBuf};
use std::process::Command;

use qpip_test_support::bins::workspace_bin;
use qpip_test_support::ci::{missing, require, root};

/// Mounts and loop devices that a run of ours could leave behind.
fn leftovers() -> Vec<String> {
    let mut left: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("qpip-bench-ext2"))
        .map(str::to_string)
        .collect();
    if let Ok(out) = Command::new("losetup").arg("-a").output() {
        left.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.contains("qpip-bench-ext2"))
                .map(str::to_string),
        );
    }
    left
}

#[test]
fn ext2_json_has_positive_figures_for_every_stack_and_leaves_nothing_behind() {
    if !root("losetup, mount and drop_caches need it")
        || !(Path::new("/dev/fuse").exists() || missing("/dev/fuse"))
        || !require(&[
            "qemu-storage-daemon",
            "nbd-server",
            "nbdkit",
            "qemu-nbd",
            "fusermount3",
            "losetup",
            "mkfs.ext2",
        ])
    {
        return;
    }
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = workspace_bin("nbd-server", "qpip-nbd-server");
    let mount = workspace_bin("fuse-mount", "qpip-nbd-mount");
    let plots = std::env::temp_dir().join(format!("qpip-bench-ext2-test-{}", std::process::id()));
    std::fs::create_dir_all(&plots).unwrap();
    let out = Command::new(&bench)
        .args([
            "nbd",
            "ext2",
            "--file-size",
            "32M",
            "--repeat",
            "1",
            "--json",
        ])
        .arg("--server-bin")
        .arg(&server)
        .arg("--mount-bin")
        .arg(&mount)
        .arg("--plot-dir")
        .arg(&plots)
        .output()
        .expect("running qpip-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let left = leftovers();
    let svg = plots.join("qpip-bench-ext2.svg");
    let has_plot = svg.is_file();
    let _ = std::fs::remove_dir_all(&plots);
    assert!(out.status.success(), "qpip-bench failed:\n{stderr}");
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(has_plot, "no plot at {}", svg.display());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stderr}"));
    for stack in ["qpip", "qpip-direct", "nbd-server", "nbdkit", "qemu-nbd"] {
        for measure in [
            "write_MBps",
            "read_MBps",
            "write_MB_per_cpu_s",
            "read_MB_per_cpu_s",
            "write_MB_per_host_cpu_s",
            "read_MB_per_host_cpu_s",
            "write_cpu_s_per_GB_machine",
            "read_cpu_s_per_GB_machine",
        ] {
            let x = v["stacks"][stack][measure]["median"]
                .as_f64()
                .unwrap_or_else(|| panic!("stacks.{stack}.{measure} missing in {v}"));
            assert!(x.is_finite() && x > 0.0, "stacks.{stack}.{measure} = {x}");
        }
        // One process's share can be below the 10 ms tick of /proc's accounting at this tiny
        // size (qpip's server threads barely run on reads the NIC serves from the mapping).
        for measure in ["write_cpu_s_per_GB_client", "read_cpu_s_per_GB_server"] {
            let x = v["stacks"][stack][measure]["median"]
                .as_f64()
                .unwrap_or_else(|| panic!("stacks.{stack}.{measure} missing in {v}"));
            assert!(x.is_finite() && x >= 0.0, "stacks.{stack}.{measure} = {x}");
        }
    }
    // qpip's NIC engine threads did run.
    let nic = v["stacks"]["qpip"]["write_cpu_s_per_GB_nic"]["median"]
        .as_f64()
        .unwrap();
    assert!(nic >= 0.0);
    // Six targets for each qpip stack (with and without the mount's page cache).
    assert_eq!(v["targets"].as_array().map(Vec::len), Some(12), "{v}");
}

#[test]
fn sweep_runs_at_a_tiny_size() {
    if !require(&["fio", "nbdkit", "qemu-nbd"]) {
        return;
    }
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_qpip-bench"));
    let server = workspace_bin("nbd-server", "qpip-nbd-server");
    let out = Command::new(&bench)
        .args([
            "nbd",
            "sweep",
            "--sizes",
            "4k,1m",
            "--depths",
            "1,4",
            "--point-size",
            "4M",
            "--point-time",
            "0.3",
            "--no-plot",
            "--json",
        ])
        .arg("--server-bin")
        .arg(&server)
        .output()
        .expect("running qpip-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qpip-bench failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{stderr}"));
    let points = v["points"].as_array().expect("points");
    // 3 stacks x 2 sizes x 2 depths x 2 directions.
    assert_eq!(points.len(), 24, "{v}");
    for p in points {
        let x = p["MBps"]["median"].as_f64().unwrap();
        assert!(x.is_finite() && x > 0.0, "{p}");
    }
    assert_eq!(v["ratios"].as_array().map(Vec::len), Some(8));
    // A request goes to qpip-nbd-server as NBD requests of at most nbd_client::MAX_IO.
    let pieces = (1u64 << 20).div_ceil(nbd_client::MAX_IO as u64);
    assert!(
        points.iter().any(|p| p["stack"] == "qpip"
            && p["size"] == 1 << 20
            && p["nbd_requests_per_request"] == pieces),
        "{v}"
    );
}

#[test]
fn a_plot_dir_that_cannot_be_written_fails_before_the_run_in_one_line() {
    for sub in ["ext2", "sweep"] {
        let t = std::time::Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_qpip-bench"))
            .args(["nbd", sub, "--plot-dir", "/nonexistent/plots"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sub}: {stderr}");
        assert!(
            stderr.trim().lines().count() == 1 && stderr.contains("/nonexistent/plots"),
            "{sub}: {stderr}"
        );
        assert!(t.elapsed().as_secs() < 10, "{sub} ran before checking");
    }
}
