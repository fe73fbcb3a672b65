//! Finding a test's prerequisites, and what a missing one means (the crate's CI rule).

use std::path::{Path, PathBuf};

/// True when `CI` is `true` or `1`: a missing prerequisite is then a failure, not a skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `what` is missing: in CI the test fails here; elsewhere a note goes to stderr and the
/// answer is `false`, for the caller to skip with (`if !... { return; }`).
pub fn missing(what: &str) -> bool {
    if in_ci() {
        panic!("CI is set and {what} is missing (scripts/setup installs the peers)");
    }
    eprintln!("note: skipping this test: {what} is missing (scripts/setup installs the peers)");
    false
}

/// Where `program` is: in PATH, or in /usr/sbin or /sbin (not in every user's PATH).
pub fn find(program: &str) -> Option<PathBuf> {
    let in_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    });
    in_path.or_else(|| {
        ["/usr/sbin", "/sbin"]
            .iter()
            .map(|d| Path::new(d).join(program))
            .find(|p| p.is_file())
    })
}

/// Is `program` installed? If not, [`missing`] decides: a failure in CI, else a skip.
pub fn have(program: &str) -> bool {
    require(&[program])
}

/// Are all of `programs` installed? Names every missing one at once, under [`missing`].
pub fn require(programs: &[&str]) -> bool {
    let absent: Vec<&str> = programs
        .iter()
        .copied()
        .filter(|p| find(p).is_none())
        .collect();
    absent.is_empty() || missing(&format!("{absent:?}"))
}

/// Is the test running as root? If not, [`missing`] decides.
pub fn root(why: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root || missing(&format!("root ({why})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_program_everyone_has_and_not_a_made_up_one() {
        assert!(find("sh").is_some());
        assert!(find("no-such-program-qpip").is_none());
    }
}
