//! The mount's command line: the logging options every qpip binary shares, and errors.

mod common;

use std::process::Command;

use common::*;

#[test]
fn logging_options_are_the_shared_ones_and_a_bad_rust_log_is_refused() {
    let bin = env!("CARGO_BIN_EXE_qpip-nbd-mount");
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    // -q/-v are accepted: the error is the mount point's (status 1), not a usage error.
    let out = Command::new(bin)
        .env_remove("RUST_LOG")
        .args(["-qq", "-v", "nbd://127.0.0.1:1/x"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let out = Command::new(bin)
        .env("RUST_LOG", "loud")
        .args(["nbd://127.0.0.1:1/x"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("qpip-nbd-mount: RUST_LOG"), "{err}");
}

#[test]
fn an_unknown_export_is_named_with_the_exports_there_are() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("d.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let server = qpip_server("disk", &img, &[]);
    let uri = server.uri.replace("/disk", "/nope");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let (status, err) = mount_fails(&[&uri, mnt.to_str().unwrap()]);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("no export named \"nope\"") && err.contains("\"disk\""),
        "{err}"
    );
}

#[test]
fn the_man_page_has_exit_status_environment_and_see_also() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-nbd-mount"))
        .arg("--generate-man-pages")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let roff = std::fs::read_to_string(dir.path().join("qpip-nbd-mount.1")).unwrap();
    for section in ["EXIT STATUS", "ENVIRONMENT", "SEE ALSO"] {
        assert!(
            roff.contains(&format!(".SH \"{section}\"")),
            "lacks {section}"
        );
    }
    assert!(roff.contains("nbdfuse(1)") && roff.contains("fusermount3(1)"));
}
