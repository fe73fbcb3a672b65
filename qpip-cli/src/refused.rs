//! Options of the tools our users come from (qemu-nbd, nbdinfo, nbdcopy, nbdfuse) that a
//! binary does not take: each refused by name, in one line that says why and what to use
//! instead, where clap alone would say "unexpected argument" and guess at a similar name.
//!
//! A binary parses with [`parse`] and its table; what clap refuses as unknown is looked up
//! there by the spelling the user typed.

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// An option of another tool that this binary refuses, and why.
#[derive(Clone, Copy, Debug)]
pub struct Refused {
    /// Its spellings, as typed: `--connect`, `-c`.
    pub names: &'static [&'static str],
    /// Whose option it is, as the line names it: `qemu-nbd`.
    pub tool: &'static str,
    /// Why it is refused and what to use instead.
    pub why: &'static str,
}

/// Parses the command line as `P`, answering an option of `table` with its line (exit
/// status 2, as clap's usage errors); any other error is clap's.
pub fn parse<P: clap::Parser>(table: &[Refused]) -> P {
    match P::try_parse() {
        Ok(p) => p,
        Err(e) => {
            if let Some(line) = refusal(&e, table) {
                let cmd = <P as clap::CommandFactory>::command();
                eprintln!("{}: {line}", cmd.get_name());
                std::process::exit(2);
            }
            e.exit()
        }
    }
}

/// The line for clap error `e` when it is an unknown option of `table`.
pub fn refusal(e: &clap::Error, table: &[Refused]) -> Option<String> {
    if e.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(typed)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    // `--cache=none` is reported whole; `-cX` as `-c`.
    let name = typed.split_once('=').map_or(typed.as_str(), |(n, _)| n);
    let r = table.iter().find(|r| r.names.contains(&name))?;
    Some(format!("{name} ({}'s): {}", r.tool, r.why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    #[command(name = "x")]
    struct Cli {
        #[arg(short, long)]
        port: Option<u16>,
    }

    const TABLE: &[Refused] = &[Refused {
        names: &["--connect", "-c"],
        tool: "qemu-nbd",
        why: "no kernel NBD client here",
    }];

    fn line(args: &[&str]) -> Option<String> {
        let e = Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).unwrap_err();
        refusal(&e, TABLE)
    }

    #[test]
    fn a_refused_option_is_named_in_every_spelling_and_others_stay_clap_s() {
        let want = "(qemu-nbd's): no kernel NBD client here";
        assert_eq!(
            line(&["--connect", "/dev/nbd0"]).unwrap(),
            format!("--connect {want}")
        );
        assert_eq!(
            line(&["--connect=/dev/nbd0"]).unwrap(),
            format!("--connect {want}")
        );
        assert_eq!(
            line(&["-p", "1", "-c", "/dev/nbd0"]).unwrap(),
            format!("-c {want}")
        );
        assert_eq!(line(&["-c/dev/nbd0"]).unwrap(), format!("-c {want}"));
        assert_eq!(line(&["--bogus"]), None);
        assert_eq!(line(&["--port", "x"]), None);
    }
}
