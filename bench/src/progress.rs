//! Progress on stderr: indicatif bars on a terminal, plain lines otherwise (logs, CI, pipes).

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Prints phase lines and makes byte and step bars, prefixed with the command's name.
pub(crate) struct Progress {
    prefix: &'static str,
    tty: bool,
}

impl Progress {
    pub(crate) fn new(prefix: &'static str) -> Progress {
        Progress {
            prefix,
            tty: std::io::stderr().is_terminal(),
        }
    }

    /// One line about what happens next (printed above any running bar).
    pub(crate) fn line(&self, s: &str) {
        eprintln!("{}: {s}", self.prefix);
    }

    /// A bar over `total` bytes (MB/s and ETA on a terminal).
    pub(crate) fn bytes(&self, label: String, total: u64) -> Bar {
        self.bar(
            label,
            total,
            "{prefix:.bold} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
    }

    /// A bar over `total` steps (e.g. the points of a sweep).
    pub(crate) fn steps(&self, label: String, total: u64) -> Bar {
        self.bar(label, total, "{prefix:.bold} [{bar:30}] {pos}/{len} {msg}")
    }

    fn bar(&self, label: String, total: u64, template: &str) -> Bar {
        let pb = if self.tty {
            let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            pb.set_style(
                ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            pb.set_prefix(format!("{}: {label}", self.prefix));
            Some(pb)
        } else {
            eprintln!("{}: {label} ...", self.prefix);
            None
        };
        Bar {
            pb,
            label,
            prefix: self.prefix,
            total,
            pos: 0,
            next_line: Instant::now() + PLAIN_EVERY,
        }
    }
}

/// Plain mode prints at most one progress line per this interval.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct Bar {
    pb: Option<ProgressBar>,
    label: String,
    prefix: &'static str,
    total: u64,
    pos: u64,
    next_line: Instant,
}

impl Bar {
    pub(crate) fn inc(&mut self, n: u64) {
        self.pos += n;
        match &self.pb {
            Some(pb) => pb.inc(n),
            None => {
                if Instant::now() >= self.next_line {
                    self.next_line = Instant::now() + PLAIN_EVERY;
                    eprintln!(
                        "{}: {}: {}/{}",
                        self.prefix, self.label, self.pos, self.total
                    );
                }
            }
        }
    }

    pub(crate) fn set_message(&self, msg: String) {
        if let Some(pb) = &self.pb {
            pb.set_message(msg);
        }
    }

    /// Ends the bar with a result line.
    pub(crate) fn finish(self, result: &str) {
        if let Some(pb) = &self.pb {
            pb.finish_and_clear();
        }
        eprintln!("{}: {}: {result}", self.prefix, self.label);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let Some(pb) = self.pb.take() {
            pb.finish_and_clear();
        }
    }
}
