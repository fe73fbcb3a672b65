//! The report of `nbd ext2`: its figures per stack, qpip against the best socket stack and
//! the targets, and the terminal table.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Params, Stack};
use crate::report::{Machine, TargetCheck};
use crate::stats::Stat;
use crate::units::human_bytes;

#[derive(Debug, Serialize)]
pub(crate) struct Ext2Report {
    /// Per stack: every measure (median, min, max, samples over the rounds).
    pub stacks: BTreeMap<String, BTreeMap<String, Stat>>,
    /// Whether the loop device really ran with direct I/O on each stack's FUSE file.
    pub loop_direct_io: BTreeMap<String, bool>,
    /// The best socket stack per measure, and each qpip stack over it.
    pub best_socket: BTreeMap<String, String>,
    pub ratios: BTreeMap<String, f64>,
    pub targets: Vec<TargetCheck>,
    pub params: Params,
    pub machine: Machine,
}

type Targets = (
    BTreeMap<String, String>,
    BTreeMap<String, f64>,
    Vec<TargetCheck>,
);

pub(super) fn targets(stacks: &BTreeMap<String, BTreeMap<String, Stat>>) -> Targets {
    let is_qpip = |name: &str| Stack::parse(name).is_ok_and(|s| s.is_qpip());
    // The best socket stack per measure, with the goal qpip is held to there.
    let mut peers = Vec::new();
    for (measure, threshold) in [
        ("write_MBps", 1.5),
        ("read_MBps", 1.5),
        ("write_MB_per_host_cpu_s", 2.0),
        ("read_MB_per_host_cpu_s", 2.0),
        ("write_MB_per_cpu_s", 1.0),
        ("read_MB_per_cpu_s", 1.0),
    ] {
        if let Some((name, peer)) = stacks
            .iter()
            .filter(|(k, _)| !is_qpip(k))
            .map(|(k, v)| (k, v[measure].median))
            .max_by(|a, b| a.1.total_cmp(&b.1))
        {
            peers.push((measure, threshold, name, peer));
        }
    }
    let best = peers
        .iter()
        .map(|(measure, _, name, _)| (measure.to_string(), name.to_string()))
        .collect();
    let mut ratios = BTreeMap::new();
    let mut checks = Vec::new();
    for qpip in Stack::ALL.into_iter().filter(|s| s.is_qpip()) {
        let Some(q) = stacks.get(qpip.name()) else {
            continue;
        };
        let qpip = qpip.name();
        for &(measure, threshold, name, peer) in &peers {
            let r = q[measure].median / peer;
            ratios.insert(format!("{qpip}_{measure}_vs_best_socket"), r);
            checks.push(TargetCheck {
                rule: format!("{qpip} {measure} >= {threshold}x the best socket stack ({name})"),
                value: r,
                threshold,
                met: r >= threshold,
            });
        }
    }
    (best, ratios, checks)
}

/// The report as a terminal table.
pub(crate) fn table(r: &Ext2Report) -> String {
    let p = &r.params;
    let mut s = format!(
        "nbd ext2: {} file written + sync, then read back cold and verified, on ext2 on a loop \
         device on a FUSE file;\nimage {} on tmpfs; median of {} round(s) [min-max]; MB = 10^6 \
         bytes; CPU split in CPU-seconds per GB moved\n",
        human_bytes(p.file_size_bytes),
        human_bytes(p.image_size_bytes),
        p.repeat
    );
    s += &crate::nbd::link_line(p.netns.as_ref());
    s += &format!(
        "{:<11} {:<5} {:>17} {:>15} {:>15} | {:>6} {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6}\n",
        "stack",
        "dir",
        "MB/s",
        "MB/host-CPU-s",
        "MB/CPU-s",
        "server",
        "NIC",
        "client",
        "bench",
        "kernel",
        "(other",
        "machine)"
    );
    let mut wide = false;
    for stack in Stack::ALL {
        let Some(f) = r.stacks.get(stack.name()) else {
            continue;
        };
        for dir in ["write", "read"] {
            let g = |m: &str| &f[&format!("{dir}_{m}")];
            wide |= g("MBps").wide(0.15);
            let c = |k: &str| g(&format!("cpu_s_per_GB_{k}")).median;
            s += &format!(
                "{:<11} {:<5} {:>17} {:>15} {:>15} | {:>6.2} {:>6.2} {:>6.2} {:>6.2} {:>6.2} | {:>6.2} {:>8.2}\n",
                stack.name(),
                dir,
                g("MBps").cell(0),
                g("MB_per_host_cpu_s").cell(0),
                g("MB_per_cpu_s").cell(0),
                c("server"),
                c("nic"),
                c("client"),
                c("bench"),
                c("kernel"),
                c("other"),
                c("machine"),
            );
        }
    }
    s += "\nclients: qpip = qpip-nbd-mount (QPs); qpip-direct = qpip-nbd-mount --cache none (no \
          page cache on the FUSE file, like qemu-storage-daemon's export); the others = \
          qemu-storage-daemon FUSE export (TCP socket)\n";
    s += "MB/CPU-s = MB moved per CPU-second of the machine, other processes left out \
          (kernel includes loop/writeback workers and interrupt work); MB/host-CPU-s leaves \
          out the NIC column too (the soft NIC's engine threads, the paper's NIC processor; \
          socket stacks have none)\n";
    let fell_back: Vec<&String> = r
        .loop_direct_io
        .iter()
        .filter(|(k, d)| !**d && Stack::parse(k).is_ok_and(|s| p.direct_io.for_stack(s)))
        .map(|(k, _)| k)
        .collect();
    if !fell_back.is_empty() {
        s += &format!("note: the loop device fell back to buffered I/O on: {fell_back:?}\n");
    }
    if !r.targets.is_empty() {
        s += "\ntargets:\n";
        for t in &r.targets {
            s += &format!(
                "  {:<69} {:>5.2}x  {}\n",
                t.rule,
                t.value,
                if t.met { "met" } else { "MISSED" }
            );
        }
    }
    if wide {
        s += "note: some throughput spreads exceed 15%: the machine was noisy; consider a \
              larger --repeat\n";
    }
    s
}
