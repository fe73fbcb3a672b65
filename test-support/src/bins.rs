//! The workspace's own binaries, built for a test that needs one of another package (or an
//! example), with the same cargo into the same target directory and profile as the test.
//!
//! Features: scripts/test builds the workspace with `QPIP_FEATURES` (e.g. `--features
//! nbd-server/rbd`). A build here passes on the ones of its own package, so that it does
//! not replace a binary other tests run with one that lacks them, nor ask a package for a
//! feature it does not have.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Binary `bin` of workspace package `package`, built (once per test process) and located.
pub fn workspace_bin(package: &str, bin: &str) -> PathBuf {
    built(package, "--bin", bin, profile_dir().join(bin))
}

/// Example `example` of workspace package `package`, built (once per test process) and
/// located.
pub fn workspace_example(package: &str, example: &str) -> PathBuf {
    let path = profile_dir().join("examples").join(example);
    built(package, "--example", example, path)
}

/// The qpip-nbd-server binary, for the tests of other packages (nbd-server's own use
/// `CARGO_BIN_EXE_qpip-nbd-server`, built with whatever features the run has).
pub fn qpip_server_bin() -> PathBuf {
    workspace_bin("nbd-server", "qpip-nbd-server")
}

/// `--features A,B` for the features of `package` in `QPIP_FEATURES`, or nothing.
pub fn own_features(package: &str) -> Vec<String> {
    features_for(&std::env::var("QPIP_FEATURES").unwrap_or_default(), package)
}

fn features_for(all: &str, package: &str) -> Vec<String> {
    let own: Vec<&str> = all
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|f| {
            f.strip_prefix(package)
                .is_some_and(|rest| rest.starts_with('/'))
        })
        .collect();
    if own.is_empty() {
        Vec::new()
    } else {
        vec!["--features".to_string(), own.join(",")]
    }
}

/// The directory of the running test's profile (target/debug for target/debug/deps/TEST,
/// or for target/debug/BIN).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's executable");
    let dir = exe.parent().expect("executable in a directory");
    let dir = if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().expect("deps in a profile directory")
    } else {
        dir
    };
    dir.to_path_buf()
}

fn built(package: &str, kind: &str, name: &str, path: PathBuf) -> PathBuf {
    static DONE: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    let done = DONE.get_or_init(Default::default);
    let mut done = done.lock().unwrap_or_else(|e| e.into_inner());
    if done.contains(&path) {
        return path;
    }
    let profile = profile_dir();
    let target_dir = profile
        .parent()
        .expect("profile directory in a target directory");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "-p", package, kind, name])
        .arg("--target-dir")
        .arg(target_dir)
        .args(own_features(package))
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    match profile.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(other) => {
            cmd.args(["--profile", other]);
        }
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running cargo build for {name}: {e}"));
    assert!(status.success(), "building {name} of {package} failed");
    assert!(path.is_file(), "{} missing after build", path.display());
    done.insert(path.clone());
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_packages_own_features_are_passed_on() {
        let all = "--features nbd-server/rbd,fuse-mount/x";
        assert_eq!(
            features_for(all, "nbd-server"),
            ["--features", "nbd-server/rbd"]
        );
        assert_eq!(
            features_for(all, "fuse-mount"),
            ["--features", "fuse-mount/x"]
        );
        assert!(features_for(all, "nbd-client").is_empty());
        assert!(features_for(all, "nbd").is_empty());
        assert!(features_for("", "nbd-server").is_empty());
    }
}
