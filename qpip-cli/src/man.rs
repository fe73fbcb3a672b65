//! Manual pages from the clap definitions, so that they never drift from `--help`. Every
//! binary calls [`generate_if_asked`] first thing in `main`; `scripts/install` runs
//! `BIN --generate-man-pages DIR` (a hidden option) to write BIN.1, plus BIN-SUB.1 for each
//! subcommand, into DIR. Nothing generated is committed.

use std::path::Path;

/// The hidden first argument that asks for the pages.
pub const FLAG: &str = "--generate-man-pages";

/// When the first argument is [`FLAG`], writes the manual pages of `cmd` into the directory
/// that follows it and exits (0, or 1 with one line on an error).
pub fn generate_if_asked(cmd: impl FnOnce() -> clap::Command) {
    let mut args = std::env::args_os().skip(1);
    if args.next().is_none_or(|a| a != FLAG) {
        return;
    }
    let cmd = cmd();
    let name = cmd.get_name().to_string();
    let Some(dir) = args.next() else {
        eprintln!("{name}: {FLAG} DIR: give the directory to write the pages into");
        std::process::exit(2);
    };
    if let Err(e) = write_pages(cmd, Path::new(&dir)) {
        eprintln!("{name}: {FLAG} {}: {e}", Path::new(&dir).display());
        std::process::exit(1);
    }
    std::process::exit(0);
}

/// Writes `cmd`'s page and one per subcommand (`NAME-SUB.1`) into `dir`.
pub fn write_pages(cmd: clap::Command, dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = cmd;
    cmd.build();
    write_page(&cmd, cmd.get_name(), dir)?;
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        write_page(sub, &format!("{}-{}", cmd.get_name(), sub.get_name()), dir)?;
    }
    Ok(())
}

fn write_page(cmd: &clap::Command, title: &str, dir: &Path) -> std::io::Result<()> {
    // A process that exits right after: leaking the name is how clap takes a computed one.
    let name: &'static str = Box::leak(title.to_string().into_boxed_str());
    let cmd = cmd.clone().name(name);
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut out)?;
    std::fs::write(dir.join(format!("{title}.1")), out)
}
