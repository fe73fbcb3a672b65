//! Every option that qemu-nbd, nbdinfo, nbdcopy and nbdfuse document (read from their
//! manual pages as installed here) is either taken by our counterpart with its meaning or
//! refused by name in one line: never clap's "unexpected argument". A new option of theirs
//! shows up as a row missing from the tables below.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use qpip_test_support::bins::workspace_bin;
use qpip_test_support::ci::require;

/// What our counterpart does with an option of the anchor's.
#[derive(Clone, Copy, Debug)]
enum Fate {
    /// Taken: these arguments (the option and its value) parse.
    Taken(&'static [&'static str]),
    /// Refused by name, with these arguments.
    Refused(&'static [&'static str]),
}
use Fate::*;

/// The options a manual page documents: every option in its SYNOPSIS (on the tool's own
/// lines) and every option that heads an entry of its OPTIONS section.
fn documented(tool: &str) -> BTreeSet<String> {
    let out = Command::new("man")
        .args(["-P", "cat", tool])
        .env("MANWIDTH", "200")
        .env("MAN_KEEP_FORMATTING", "0")
        .output()
        .expect("running man");
    assert!(out.status.success(), "man {tool}: {out:?}");
    // Overstrikes (bold, underline) as col -b removes them.
    let mut text = String::new();
    for c in String::from_utf8_lossy(&out.stdout).chars() {
        if c == '\u{8}' {
            text.pop();
        } else {
            text.push(c);
        }
    }
    let mut opts = BTreeSet::new();
    let mut section = "";
    for line in text.lines() {
        if !line.is_empty() && line.chars().all(|c| c.is_ascii_uppercase() || c == ' ') {
            section = line.trim();
            continue;
        }
        let body = line.trim_start();
        let indent = line.len() - body.len();
        let words: &str = match section {
            "SYNOPSIS" if body.starts_with(tool) || body.starts_with('[') => body,
            "OPTIONS" if body.starts_with('-') && indent <= 8 => {
                // The entry's head, before the text that explains it.
                body.split("  ").next().unwrap_or(body)
            }
            _ => continue,
        };
        for w in words.split(|c: char| " \t[]|,=".contains(c)) {
            let name = w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
            let long = name.strip_prefix("--").is_some_and(|n| {
                n.len() > 1
                    && n.starts_with(|c: char| c.is_ascii_lowercase())
                    && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            });
            let short = name.len() == 2
                && name.starts_with('-')
                && name.as_bytes()[1].is_ascii_alphabetic();
            if long || short {
                opts.insert(name.to_string());
            }
        }
    }
    opts
}

/// The anchor's options against `table`: every documented one has a row, and each row's
/// arguments, followed by --help (which clap answers only once everything before it
/// parsed), are taken or refused by name as the row says.
fn check(tool: &str, bin: PathBuf, sub: &[&str], table: &[(&str, Fate)]) {
    let mut failures = Vec::new();
    let docs = documented(tool);
    assert!(
        docs.len() >= 10,
        "man {tool}: too few options found: {docs:?}"
    );
    for opt in docs {
        if !table.iter().any(|(name, _)| *name == opt) {
            failures.push(format!(
                "{tool} documents {opt}, which the table does not name"
            ));
        }
    }
    for (opt, fate) in table {
        let args = match fate {
            Taken(a) | Refused(a) => a,
        };
        let out = Command::new(&bin)
            .args(sub)
            .args(*args)
            .arg("--help")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let line = err.trim();
        let ok = match fate {
            Taken(_) => out.status.success(),
            Refused(_) => {
                out.status.code() == Some(2)
                    && line.lines().count() == 1
                    && line.contains(&format!("{opt} ({tool}'s): "))
            }
        };
        if !ok {
            failures.push(format!(
                "{tool} {opt}: expected {fate:?}, got {:?}: {line}",
                out.status
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn qemu_nbd_options_are_the_servers_or_refused_by_name() {
    if !require(&["man", "qemu-nbd"]) {
        return;
    }
    let table: &[(&str, Fate)] = &[
        ("-A", Taken(&["-A"])),
        ("--allocation-depth", Taken(&["--allocation-depth"])),
        ("--aio", Taken(&["--aio=io_uring"])),
        ("-b", Taken(&["-b", "::1"])),
        ("--bind", Taken(&["--bind=::1"])),
        ("-B", Taken(&["-B", "b0"])),
        ("--bitmap", Taken(&["--bitmap=b0"])),
        ("--cache", Taken(&["--cache=writethrough"])),
        ("-c", Refused(&["-c", "/dev/nbd0"])),
        ("--connect", Refused(&["--connect=/dev/nbd0"])),
        ("-d", Refused(&["-d", "/dev/nbd0"])),
        ("--disconnect", Refused(&["--disconnect"])),
        ("-D", Taken(&["-D", "a disk"])),
        ("--description", Taken(&["--description=a disk"])),
        ("--detect-zeroes", Taken(&["--detect-zeroes=on"])),
        ("--discard", Taken(&["--discard=unmap"])),
        // Ours: --export NAME=PATH (README's clash list); qemu-nbd's is --shared.
        ("-e", Taken(&["-e", "d=/dev/null"])),
        ("--shared", Taken(&["--shared=2"])),
        ("-x", Taken(&["-x", "disk"])),
        ("--export-name", Taken(&["--export-name=disk"])),
        ("-f", Taken(&["-f", "raw"])),
        ("--format", Taken(&["--format=qcow2"])),
        ("--fork", Taken(&["--fork"])),
        ("--handshake-limit", Taken(&["--handshake-limit=5"])),
        ("-h", Taken(&[])),
        ("--help", Taken(&[])),
        ("--image-opts", Refused(&["--image-opts"])),
        // Ours: --listen (README's clash list); qemu-nbd's is --load-snapshot.
        ("-l", Taken(&["-l", "127.0.0.1:10809"])),
        ("--load-snapshot", Taken(&["--load-snapshot=s1"])),
        ("-L", Refused(&["-L"])),
        ("--list", Refused(&["--list"])),
        ("-n", Taken(&["-n"])),
        ("--nocache", Taken(&["--nocache"])),
        ("--object", Refused(&["--object", "secret,id=s0,file=f"])),
        ("-o", Taken(&["-o", "1M"])),
        ("--offset", Taken(&["--offset=1M"])),
        ("-p", Taken(&["-p", "10809"])),
        ("--port", Taken(&["--port=10809"])),
        ("--pid-file", Taken(&["--pid-file=/run/q.pid"])),
        ("-r", Taken(&["-r"])),
        ("--read-only", Taken(&["--read-only"])),
        ("-s", Taken(&["-s"])),
        ("--snapshot", Taken(&["--snapshot"])),
        ("-k", Taken(&["-k", "/run/q.sock"])),
        ("--socket", Taken(&["--socket=/run/q.sock"])),
        ("-t", Taken(&["-t"])),
        ("--persistent", Taken(&["--persistent"])),
        ("--tls-creds", Refused(&["--tls-creds=tls0"])),
        ("--tls-authz", Refused(&["--tls-authz=authz0"])),
        ("--tls-hostname", Refused(&["--tls-hostname=host"])),
        ("-T", Refused(&["-T", "nbd_*"])),
        ("--trace", Refused(&["--trace=nbd_*"])),
        ("-v", Taken(&["-v"])),
        ("--verbose", Taken(&["--verbose"])),
        ("-V", Taken(&["-V"])),
        ("--version", Taken(&["--version"])),
    ];
    check(
        "qemu-nbd",
        workspace_bin("nbd-server", "qpip-nbd-server"),
        &[],
        table,
    );
}

#[test]
fn nbdfuse_options_are_the_mounts_or_refused_by_name() {
    if !require(&["man", "nbdfuse"]) {
        return;
    }
    let table: &[(&str, Fate)] = &[
        ("-C", Taken(&["-C", "2"])),
        ("--connections", Taken(&["--connections", "2"])),
        ("-d", Refused(&["-d"])),
        ("--fuse-help", Refused(&["--fuse-help"])),
        ("-o", Taken(&["-o", "allow_other"])),
        ("-P", Taken(&["-P", "/run/m.pid"])),
        ("--pidfile", Taken(&["--pidfile", "/run/m.pid"])),
        ("-r", Taken(&["-r"])),
        ("--readonly", Taken(&["--readonly"])),
        ("-s", Taken(&["-s"])),
        ("-v", Taken(&["-v"])),
        ("--verbose", Taken(&["--verbose"])),
        ("-V", Taken(&["-V"])),
        ("--version", Taken(&["--version"])),
        ("--help", Taken(&[])),
        (
            "--command",
            Refused(&["--command", "nbdkit", "memory", "1G"]),
        ),
        ("--fd", Refused(&["--fd", "3"])),
        ("--tcp", Refused(&["--tcp", "localhost", "10809"])),
        ("--unix", Refused(&["--unix", "/run/nbd.sock"])),
        ("--vsock", Refused(&["--vsock", "2", "10809"])),
        (
            "--socket-activation",
            Refused(&["--socket-activation", "nbdkit"]),
        ),
    ];
    check(
        "nbdfuse",
        workspace_bin("fuse-mount", "qpip-nbd-mount"),
        &[],
        table,
    );
}
#[test]
fn nbdinfo_options_are_qpip_nbd_infos_or_refused_by_name() {
    if !require(&["man", "nbdinfo"]) {
        return;
    }
    let table: &[(&str, Fate)] = &[
        ("--can", Taken(&["--can", "df"])),
        ("--is", Taken(&["--is", "rotational"])),
        ("--color", Taken(&["--color"])),
        ("--colour", Taken(&["--colour"])),
        ("--no-color", Taken(&["--no-color"])),
        ("--no-colour", Taken(&["--no-colour"])),
        ("--content", Taken(&["--content"])),
        ("--no-content", Taken(&["--no-content"])),
        ("--json", Taken(&["--json"])),
        ("-L", Taken(&["-L"])),
        ("--list", Taken(&["--list"])),
        ("--map", Taken(&["--map=base:allocation"])),
        ("--totals", Taken(&["--map", "--totals"])),
        ("--size", Taken(&["--size"])),
        ("--help", Taken(&[])),
        ("-V", Taken(&["-V"])),
        ("--version", Taken(&["--version"])),
    ];
    check(
        "nbdinfo",
        workspace_bin("nbd-client", "qpip-nbd"),
        &["info"],
        table,
    );
}

#[test]
fn nbdcopy_options_are_qpip_nbd_copys_or_refused_by_name() {
    if !require(&["man", "nbdcopy"]) {
        return;
    }
    let table: &[(&str, Fate)] = &[
        ("--allocated", Taken(&["--allocated"])),
        ("-C", Taken(&["-C", "2"])),
        ("--connections", Taken(&["--connections=2"])),
        ("--destination-is-zero", Taken(&["--destination-is-zero"])),
        ("--target-is-zero", Taken(&["--target-is-zero"])),
        ("--flush", Taken(&["--flush"])),
        ("--no-extents", Taken(&["--no-extents"])),
        ("-p", Taken(&["-p"])),
        ("--progress", Taken(&["--progress=2"])),
        ("--queue-size", Taken(&["--queue-size=1M"])),
        ("--request-size", Taken(&["--request-size=1M"])),
        ("-R", Taken(&["-R", "4"])),
        ("--requests", Taken(&["--requests=4"])),
        ("-S", Taken(&["-S", "0"])),
        ("--sparse", Taken(&["--sparse=4096"])),
        ("--synchronous", Taken(&["--synchronous"])),
        ("-T", Taken(&["-T", "2"])),
        ("--threads", Taken(&["--threads=2"])),
        ("-v", Taken(&["-v"])),
        ("--verbose", Taken(&["--verbose"])),
        ("-V", Taken(&["-V"])),
        ("--version", Taken(&["--version"])),
        ("--help", Taken(&[])),
    ];
    check(
        "nbdcopy",
        workspace_bin("nbd-client", "qpip-nbd"),
        &["copy"],
        table,
    );
}
