//! What every report carries besides its figures: the machine it ran on, and the targets it
//! is held to.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub(crate) struct Machine {
    pub cpu: String,
    pub cpus: usize,
    pub kernel: String,
    pub os: String,
}

pub(crate) fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let os = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|l| l.trim_matches('"').to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    Machine {
        cpu,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernel,
        os,
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct TargetCheck {
    pub rule: String,
    pub value: f64,
    pub threshold: f64,
    pub met: bool,
}
