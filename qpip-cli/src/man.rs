//! Manual pages from the clap definitions, so that they never drift from `--help`. Every
//! binary calls [`generate_if_asked`] first thing in `main`; `scripts/install` runs
//! `BIN --generate-man-pages DIR` (a hidden option) to write BIN.1, plus BIN-SUB.1 for each
//! subcommand, into DIR. Nothing generated is committed. Each page ends with EXIT STATUS,
//! ENVIRONMENT and SEE ALSO sections, from [`sections`] (a subcommand's page has its
//! program's).

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
    // A subcommand's page (qpip-nbd-copy) takes its program's sections (qpip-nbd).
    let parts: Vec<&str> = title.split('-').collect();
    let known = (1..=parts.len())
        .rev()
        .find_map(|n| sections(&parts[..n].join("-")))
        .unwrap_or_else(|| Sections::common(&[]));
    let cmd = cmd.clone().name(name);
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut out)?;
    let mut page = String::from_utf8_lossy(&out).into_owned();
    // clap_mangen's synopsis names the options without their arguments ([-l|--listen]):
    // ours says what each takes ([-l|--listen ADDR:PORT]), as man pages do.
    if let Some(start) = page.find(".SH SYNOPSIS\n") {
        let body = start + ".SH SYNOPSIS\n".len();
        let end = page[body..].find(".SH ").map_or(page.len(), |n| body + n);
        // No hyphenation: an option split across lines (--exclu- sive) reads wrong.
        page.replace_range(body..end, &format!(".nh\n{}.hy\n", synopsis(&cmd)));
    }
    let extra = roff_sections(known);
    // Before VERSION and AUTHORS, where man pages keep them.
    match page.find(".SH VERSION") {
        Some(at) => page.insert_str(at, &extra),
        None => page.push_str(&extra),
    }
    std::fs::write(dir.join(format!("{title}.1")), page)
}

/// A page's closing sections.
pub struct Sections {
    /// (status, meaning)
    pub exit_status: Vec<(&'static str, &'static str)>,
    /// (variable, meaning)
    pub environment: Vec<(&'static str, &'static str)>,
    /// Pages as `name(section)`.
    pub see_also: Vec<&'static str>,
}

/// What every qpip program reads from its environment.
const COMMON_ENV: &[(&str, &str)] = &[
    (
        "RUST_LOG",
        "Log filter (a level, or directives such as nbd_server=debug,warn); overrides -v, -q \
         and --log. A bad value is refused.",
    ),
    (
        "NO_COLOR",
        "When set and not empty, logs are never coloured.",
    ),
    (
        "QPIP_SOFT_QUEUES",
        "The soft NIC's queues (engine threads); default one per CPU.",
    ),
    (
        "QPIP_SOFT_IO",
        "epoll: the soft NIC's engine uses epoll instead of io_uring.",
    ),
    (
        "QPIP_SOFT_SPIN_US",
        "How long the soft NIC's engine polls before sleeping, in microseconds (default 50).",
    ),
];

impl Sections {
    fn common(env: &[(&'static str, &'static str)]) -> Sections {
        Sections {
            exit_status: vec![
                ("0", "Success."),
                ("1", "An error, described on standard error."),
                ("2", "A usage error: an unknown option or a bad value."),
            ],
            environment: env.iter().chain(COMMON_ENV).copied().collect(),
            see_also: vec![],
        }
    }
}

/// The closing sections of `program`'s pages; `None` for a program this file does not know.
pub fn sections(program: &str) -> Option<Sections> {
    let mut s = Sections::common(&[]);
    match program {
        "qpip-nbd" => {
            s.exit_status = vec![
                ("0", "Success; for info --can, --is or --has, yes."),
                (
                    "1",
                    "An error, described on standard error (info --can/--is/--has: the \
                     question could not be answered).",
                ),
                (
                    "2",
                    "info --can, --is or --has answered no (--cannot, --isnt, --hasnt: yes); \
                     or a usage error.",
                ),
                (
                    "128+N",
                    "copy stopped by signal N (130 for SIGINT, 143 for SIGTERM); a destination \
                     file it created is removed.",
                ),
            ];
            s.environment.insert(
                0,
                (
                    "USER, LOGNAME",
                    "The PSK identity of an nbds:// URI with tls-psk-file and no tls-username.",
                ),
            );
            s.see_also = vec![
                "qpip-nbd-server(1)",
                "qpip-nbd-mount(1)",
                "nbdinfo(1)",
                "nbdcopy(1)",
                "qemu-img(1)",
                "nbdkit(1)",
            ];
        }
        "qpip-nbd-server" => {
            s.exit_status = vec![
                (
                    "0",
                    "Stopped by SIGINT or SIGTERM after serving; with --run, the command \
                     succeeded.",
                ),
                (
                    "1",
                    "An error, described on standard error (an image that cannot be opened, an \
                     address in use, ...).",
                ),
                ("2", "A usage error: an unknown option or a bad value."),
                (
                    "N",
                    "With --run: the command's exit status (128 + the signal that killed it).",
                ),
            ];
            s.environment.insert(
                0,
                (
                    "LISTEN_FDS, LISTEN_PID",
                    "systemd socket activation: the listening sockets handed over.",
                ),
            );
            s.see_also = vec![
                "qpip-nbd(1)",
                "qpip-nbd-mount(1)",
                "qemu-nbd(8)",
                "nbdkit(1)",
                "nbd-server(1)",
                "nbdinfo(1)",
                "systemd.socket(5)",
            ];
        }
        "qpip-nbd-mount" => {
            s.exit_status = vec![
                (
                    "0",
                    "Unmounted (fusermount3 -u, umount, SIGINT, SIGTERM or SIGHUP); with \
                     --daemon, mounted.",
                ),
                (
                    "1",
                    "An error before or while mounting (the mount point, the server, the \
                     export), described on standard error.",
                ),
                (
                    "2",
                    "A usage error: an unknown option, a bad value, or arguments in neither \
                     order.",
                ),
            ];
            s.see_also = vec![
                "qpip-nbd(1)",
                "qpip-nbd-server(1)",
                "nbdfuse(1)",
                "fusermount3(1)",
                "losetup(8)",
                "mount(8)",
            ];
        }
        "qpip-bench" => {
            s.see_also = vec![
                "qpip-nbd-server(1)",
                "qpip-nbd(1)",
                "fio(1)",
                "qemu-nbd(8)",
                "nbdkit(1)",
            ];
        }
        "qpip-lanai-bridge" => {
            s.see_also = vec!["qpip-nbd-server(1)", "qpip-nbd(1)"];
        }
        _ => return None,
    }
    Some(s)
}

/// The SYNOPSIS of `cmd`: its name, then every option it shows with the argument it takes,
/// the arguments, and its subcommand.
fn synopsis(cmd: &clap::Command) -> String {
    let mut words = vec![format!("\\fB{}\\fR", roff_text(cmd.get_name()))];
    for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
        let values: Vec<String> = a
            .get_value_names()
            .map(|v| {
                v.iter()
                    .map(|v| format!("\\fI{}\\fR", roff_text(v)))
                    .collect()
            })
            .unwrap_or_else(|| {
                vec![format!(
                    "\\fI{}\\fR",
                    roff_text(a.get_id().as_str()).to_uppercase()
                )]
            });
        let takes = a.get_action().takes_values();
        let optional_value = a.get_num_args().is_some_and(|n| n.min_values() == 0);
        let many = matches!(
            a.get_action(),
            clap::ArgAction::Count | clap::ArgAction::Append
        );
        let word = if a.is_positional() {
            let v = values.join(" ");
            let v = if many { format!("{v}...") } else { v };
            if a.is_required_set() {
                v
            } else {
                format!("[{v}]")
            }
        } else {
            let mut names = Vec::new();
            if let Some(s) = a.get_short() {
                names.push(format!("\\fB\\-{}\\fR", roff_text(&s.to_string())));
            }
            if let Some(l) = a.get_long() {
                names.push(format!("\\fB\\-\\-{}\\fR", roff_text(l)));
            }
            let mut w = names.join("|");
            if takes && optional_value {
                w.push_str(&format!("[={}]", values.join(" ")));
            } else if takes {
                w.push(' ');
                w.push_str(&values.join(" "));
            }
            let w = if a.is_required_set() {
                w
            } else {
                format!("[{w}]")
            };
            if many { format!("{w}...") } else { w }
        };
        words.push(word);
    }
    if cmd.has_subcommands() {
        words.push("\\fICOMMAND\\fR".into());
    }
    format!("{}\n", words.join(" "))
}

/// Roff for text: backslashes and hyphens escaped, no line taken for a request.
fn roff_text(t: &str) -> String {
    let t = t.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with('.') || t.starts_with('\'') {
        format!("\\&{t}")
    } else {
        t
    }
}

fn roff_sections(s: Sections) -> String {
    let mut out = String::new();
    let list = |out: &mut String, title: &str, items: &[(&str, &str)]| {
        out.push_str(&format!(".SH \"{title}\"\n"));
        for (k, v) in items {
            out.push_str(&format!(
                ".TP\n\\fB{}\\fR\n{}\n",
                roff_text(k),
                roff_text(v)
            ));
        }
    };
    list(&mut out, "EXIT STATUS", &s.exit_status);
    list(&mut out, "ENVIRONMENT", &s.environment);
    if !s.see_also.is_empty() {
        let refs: Vec<String> = s.see_also.iter().map(|r| r.to_string()).collect();
        out.push_str(&format!(".SH \"SEE ALSO\"\n{}\n", refs.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_program_has_the_closing_sections() {
        for p in [
            "qpip-nbd",
            "qpip-nbd-server",
            "qpip-nbd-mount",
            "qpip-bench",
            "qpip-lanai-bridge",
        ] {
            let r = roff_sections(sections(p).unwrap());
            assert!(r.contains(".SH \"EXIT STATUS\""), "{p}");
            assert!(
                r.contains(".SH \"ENVIRONMENT\"") && r.contains("RUST_LOG"),
                "{p}"
            );
            assert!(r.contains(".SH \"SEE ALSO\""), "{p}");
        }
        assert_eq!(roff_text(".x-y"), "\\&.x\\-y");
    }

    #[test]
    fn the_synopsis_names_what_each_option_takes() {
        #[derive(clap::Parser)]
        #[command(name = "x")]
        struct Cli {
            #[arg(short, long, value_name = "ADDR:PORT")]
            listen: Vec<String>,
            #[arg(short, long, action = clap::ArgAction::Count)]
            verbose: u8,
            #[arg(long, value_name = "FD", num_args = 0..=1, require_equals = true)]
            progress: Option<Option<i32>>,
            #[arg(long, hide = true)]
            secret: bool,
            file: Option<String>,
        }
        let cmd = <Cli as clap::CommandFactory>::command();
        let s = synopsis(&cmd);
        assert_eq!(
            s,
            "\\fBx\\fR [\\fB\\-l\\fR|\\fB\\-\\-listen\\fR \\fIADDR:PORT\\fR]... \
             [\\fB\\-v\\fR|\\fB\\-\\-verbose\\fR]... \
             [\\fB\\-\\-progress\\fR[=\\fIFD\\fR]] [\\fIFILE\\fR]\n"
        );
    }
}
