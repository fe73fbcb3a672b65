//! The workspace's shell scripts where they can go wrong without a cluster or a build:
//! scripts/demo runs the server from CARGO_TARGET_DIR, and scripts/ceph-dev leaves a cluster
//! that runs in its directory alone. Stub programs stand in for cargo, scripts/setup and Ceph.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn stub(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// PATH with `bin` first.
fn path_with(bin: &Path) -> String {
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
fn demo_runs_the_server_from_cargo_target_dir() {
    let t = tempfile::tempdir().unwrap();
    // A copy of the demo in a tree of its own: setup and cargo do nothing.
    let tree = t.path().join("tree");
    std::fs::create_dir_all(tree.join("scripts")).unwrap();
    std::fs::copy(root().join("scripts/demo"), tree.join("scripts/demo")).unwrap();
    stub(&tree.join("scripts/setup"), "exit 0");
    let bin = t.path().join("bin");
    stub(&bin.join("cargo"), "exit 0");
    let target = t.path().join("elsewhere");
    stub(
        &target.join("release/qpip-nbd-server"),
        "echo \"server from elsewhere: $*\"",
    );
    let out = Command::new(tree.join("scripts/demo"))
        .arg("--flag")
        .env("PATH", path_with(&bin))
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout.trim(), "server from elsewhere: --flag", "{out:?}");
}

#[test]
fn ceph_dev_leaves_a_cluster_running_in_its_directory_alone() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("ceph");
    std::fs::create_dir_all(dir.join("run")).unwrap();
    // Another cluster's monitor (a stand-in process), on another port.
    let mut mon = Command::new("sleep").arg("60").spawn().unwrap();
    std::fs::write(dir.join("run/mon.a.pid"), mon.id().to_string()).unwrap();
    std::fs::write(
        dir.join("ceph.conf"),
        "[global]\nmon_host = v2:127.0.0.1:3399\n",
    )
    .unwrap();
    // Ceph's programs fail: nothing must come as far as using them.
    let bin = t.path().join("bin");
    for b in [
        "ceph-mon",
        "ceph-mgr",
        "ceph-osd",
        "ceph",
        "ceph-authtool",
        "monmaptool",
        "rbd",
    ] {
        stub(&bin.join(b), "exit 1");
    }
    let out = Command::new(root().join("scripts/ceph-dev"))
        .arg("start")
        .env("PATH", path_with(&bin))
        .env("QPIP_CEPH_DIR", &dir)
        .env("QPIP_CEPH_PORT", "3398")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let alive = mon.try_wait().unwrap().is_none();
    let _ = mon.kill();
    let _ = mon.wait();
    assert!(alive, "ceph-dev killed the other cluster's daemon: {err}");
    assert!(
        dir.join("ceph.conf").exists(),
        "ceph-dev deleted {}: {err}",
        dir.display()
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(dir.to_str().unwrap()) && err.contains("QPIP_CEPH_DIR"),
        "{err}"
    );
}
