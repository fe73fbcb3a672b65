//! The one logging convention of every qpip binary: `-v`/`-q` (repeatable) raise or lower
//! the binary's default level, `--log` sets a level or tracing directives outright, RUST_LOG
//! overrides both, a bad value is refused with one line, and colour goes only to a terminal
//! (and never with NO_COLOR set). Flatten [`LogArgs`] into a clap parser and call
//! [`LogArgs::init`] first thing.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

/// Logging options.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct LogArgs {
    /// More log output; repeat for more (the levels: error, warn, info, debug, trace).
    /// RUST_LOG, if set, overrides -v, -q and --log.
    #[arg(short = 'v', long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Less log output; repeat for less (down to none).
    #[arg(short = 'q', long, global = true, action = clap::ArgAction::Count)]
    pub quiet: u8,
    /// The log level instead of the default (off, error, warn, info, debug, trace), or
    /// tracing directives such as `nbd_server=debug,warn`.
    #[arg(long, global = true, value_name = "LEVEL")]
    pub log: Option<String>,
}

const LADDER: [LevelFilter; 6] = [
    LevelFilter::OFF,
    LevelFilter::ERROR,
    LevelFilter::WARN,
    LevelFilter::INFO,
    LevelFilter::DEBUG,
    LevelFilter::TRACE,
];

/// Checks a level or a list of directives: each comma-separated part must be a level or
/// `TARGET=LEVEL` (tracing would take any other word as a target and log nothing).
fn directives(what: &str, value: &str) -> Result<EnvFilter, String> {
    let bad = || {
        format!(
            "{what} {value:?}: give a level (off, error, warn, info, debug, trace) or directives like nbd_server=debug,warn"
        )
    };
    let parts_ok = value.split(',').all(|p| {
        let p = p.trim();
        (!p.is_empty() && p.parse::<LevelFilter>().is_ok())
            || p.split_once('=')
                .is_some_and(|(t, l)| !t.is_empty() && l.parse::<LevelFilter>().is_ok())
            || p.contains('[')
    });
    if value.trim().is_empty() || !parts_ok {
        return Err(bad());
    }
    EnvFilter::builder()
        .with_regex(false)
        .parse(value)
        .map_err(|_| bad())
}

impl LogArgs {
    /// The filter these options (and RUST_LOG) give, for a binary whose level is `default`
    /// without them.
    pub fn filter(&self, default: LevelFilter) -> Result<EnvFilter, String> {
        if let Ok(env) = std::env::var("RUST_LOG")
            && !env.trim().is_empty()
        {
            return directives("RUST_LOG", &env);
        }
        let base = match &self.log {
            Some(v) => match v.trim().parse::<LevelFilter>() {
                Ok(level) if !v.trim().is_empty() => level,
                _ => {
                    if self.verbose > 0 || self.quiet > 0 {
                        return Err(format!(
                            "--log {v:?} with -v/-q: give --log a plain level to raise or lower"
                        ));
                    }
                    return directives("--log", v);
                }
            },
            None => default,
        };
        let at = LADDER.iter().position(|l| *l == base).unwrap_or(3) as i32;
        let level = (at + i32::from(self.verbose) - i32::from(self.quiet)).clamp(0, 5);
        Ok(EnvFilter::default().add_directive(LADDER[level as usize].into()))
    }

    /// Installs the global subscriber, writing to stderr. A bad value ends the process with
    /// status 2 and one line, `BIN: what is wrong`.
    pub fn init(&self, bin: &str, default: LevelFilter) {
        let filter = self.filter(default).unwrap_or_else(|e| {
            eprintln!("{bin}: {e}");
            std::process::exit(2);
        });
        let colour = std::io::stderr().is_terminal()
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(colour)
            .try_init();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: u8, q: u8, log: Option<&str>) -> LogArgs {
        LogArgs {
            verbose: v,
            quiet: q,
            log: log.map(Into::into),
        }
    }

    fn level(a: &LogArgs, default: LevelFilter) -> String {
        a.filter(default).unwrap().to_string()
    }

    #[test]
    fn counts_move_along_the_ladder_from_the_default() {
        // SAFETY: tests in this module do not read RUST_LOG concurrently with a writer.
        unsafe { std::env::remove_var("RUST_LOG") };
        assert_eq!(level(&args(0, 0, None), LevelFilter::INFO), "info");
        assert_eq!(level(&args(1, 0, None), LevelFilter::WARN), "info");
        assert_eq!(level(&args(2, 0, None), LevelFilter::INFO), "trace");
        assert_eq!(level(&args(9, 0, None), LevelFilter::INFO), "trace");
        assert_eq!(level(&args(0, 1, None), LevelFilter::INFO), "warn");
        assert_eq!(level(&args(0, 9, None), LevelFilter::INFO), "off");
        assert_eq!(level(&args(1, 0, Some("error")), LevelFilter::INFO), "warn");
        assert_eq!(
            level(
                &args(0, 0, Some("nbd_server=debug,warn")),
                LevelFilter::INFO
            ),
            "nbd_server=debug,warn"
        );
        for bad in ["verbose", "", "nbd_server", "info,loud", "x=y"] {
            assert!(
                args(0, 0, Some(bad)).filter(LevelFilter::INFO).is_err(),
                "{bad}"
            );
        }
        assert!(
            args(1, 0, Some("a=debug"))
                .filter(LevelFilter::INFO)
                .is_err()
        );
    }
}
