//! Median, spread and samples of a measure over rounds; the interrupt flag shared by the
//! benchmarks that clean up in order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::cpu;

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub samples: Vec<f64>,
}

impl Stat {
    pub(crate) fn of(samples: &[f64]) -> Stat {
        Stat {
            median: cpu::median(samples.to_vec()),
            min: samples.iter().copied().fold(f64::INFINITY, f64::min),
            max: samples.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            samples: samples.to_vec(),
        }
    }

    /// `median [min-max]` with `prec` decimals (just the median for one sample).
    pub(crate) fn cell(&self, prec: usize) -> String {
        if self.samples.len() < 2 {
            format!("{:.prec$}", self.median)
        } else {
            format!(
                "{:.prec$} [{:.prec$}-{:.prec$}]",
                self.median, self.min, self.max
            )
        }
    }

    /// Spread wider than `frac` of the median.
    pub(crate) fn wide(&self, frac: f64) -> bool {
        self.max - self.min > self.median.abs() * frac
    }
}

/// Samples keyed by measure name, turned into [`Stat`]s.
#[derive(Default)]
pub(crate) struct Samples(pub BTreeMap<String, Vec<f64>>);

impl Samples {
    pub(crate) fn push(&mut self, key: &str, v: f64) {
        self.0.entry(key.to_string()).or_default().push(v);
    }

    pub(crate) fn stats(&self) -> BTreeMap<String, Stat> {
        self.0
            .iter()
            .map(|(k, v)| (k.clone(), Stat::of(v)))
            .collect()
    }
}

/// Set by SIGINT, SIGTERM or SIGHUP; a second signal ends the process at once (exit 130).
/// Long phases poll it and return an error, so that the guards (unmount, detach, stop, delete)
/// run in order on the way out.
#[derive(Clone)]
pub(crate) struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    pub(crate) fn install() -> Result<Interrupt> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
        let flag = Arc::new(AtomicBool::new(false));
        for sig in [SIGINT, SIGTERM, SIGHUP] {
            signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())
                .context("installing signal handlers")?;
            signal_hook::flag::register(sig, flag.clone()).context("installing signal handlers")?;
        }
        Ok(Interrupt(flag))
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.0.load(Ordering::Relaxed) {
            bail!("interrupted (signal); cleaning up");
        }
        Ok(())
    }
}
