//! scripts/install as a user runs it: the programs land in PREFIX/bin, their manual pages
//! (generated from the clap definitions) in PREFIX/share/man/man1, and the installed
//! programs work together by their installed names.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const BINS: &[&str] = &[
    "qpip-nbd-server",
    "qpip-nbd",
    "qpip-nbd-mount",
    "qpip-bench",
    "qpip-lanai-bridge",
];

#[test]
fn install_puts_programs_and_man_pages_under_the_prefix() {
    if !require(&["man"]) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let prefix = tempfile::tempdir().unwrap();
    // Debug builds: the test build has made them already, so this does not rebuild the world.
    let out = run_with_timeout(
        Command::new(root.join("scripts/install"))
            .args(["--debug", "--prefix"])
            .arg(prefix.path()),
        Duration::from_secs(280),
    );
    assert!(
        out.status.success(),
        "scripts/install failed:\n{}",
        text(&out)
    );
    let bin = prefix.path().join("bin");
    let man = prefix.path().join("share/man");
    for b in BINS {
        let help = peer_ok(Command::new(bin.join(b)).arg("--help"));
        assert!(help.contains("Usage:"), "{b} --help:\n{help}");
        let page = peer_ok(
            Command::new("man")
                .env("MANPATH", &man)
                .env("MANWIDTH", "100")
                .env("MANPAGER", "cat")
                .arg(b),
        );
        assert!(
            page.contains("NAME") && page.contains("--verbose") && page.contains("--help"),
            "man {b}:\n{page}"
        );
    }
    assert!(man.join("man1/qpip-nbd-copy.1").exists());
    // The example config the server's --help points at.
    let example = prefix.path().join("share/qpip/server.toml");
    assert!(example.exists(), "{} was not installed", example.display());
    assert!(!bin.join("--generate-man-pages").exists());

    // The installed server and client, by name on PATH, together.
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let out = run_with_timeout(
        Command::new("qpip-nbd-server")
            .env("PATH", &path)
            .args(["--run", "qpip-nbd info \"$uri\""]),
        Duration::from_secs(30),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("67108864") || t.contains("64 MiB"), "{t}");
}

/// README's commands use the installed names, and its links resolve inside the repository.
#[test]
fn readme_uses_installed_names_and_links_only_inside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let root = root.canonicalize().unwrap();
    for doc in ["README.md", "docs/design.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        assert!(
            !text.contains("target/release/") && !text.contains("target/debug/"),
            "{doc} runs a build-tree binary instead of the installed name"
        );
        for (i, _) in text.match_indices("](") {
            let rest = &text[i + 2..];
            let link = &rest[..rest.find(')').unwrap()];
            if link.starts_with('#') || link.starts_with("http") {
                continue;
            }
            let file = link.split('#').next().unwrap();
            let dir = root.join(doc).parent().unwrap().to_owned();
            let target = dir.join(file).canonicalize();
            assert!(
                target.as_ref().is_ok_and(|t| t.starts_with(&root)),
                "{doc}: link {link:?} does not resolve inside the repository"
            );
        }
    }
    assert!(
        std::fs::read_to_string(root.join("README.md"))
            .unwrap()
            .contains("./scripts/install"),
        "README's opening has no install step"
    );
}
