//! The report of `nbd qd1`: its figures per stack, qpip against qemu-storage-daemon + nbdkit
//! and the goals of issue 29, and the terminal table.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Params, Stack};
use crate::report::{Machine, TargetCheck};
use crate::rig::fio::RandDir;
use crate::stats::Stat;
use crate::units::human_bytes;

#[derive(Debug, Serialize)]
pub(crate) struct Qd1Report {
    /// Per stack: every measure (median, min, max, samples over the rounds).
    pub stacks: BTreeMap<String, BTreeMap<String, Stat>>,
    /// qpip over qsd-nbdkit, medians: IOPS and latencies per direction.
    pub ratios: BTreeMap<String, f64>,
    pub targets: Vec<TargetCheck>,
    pub params: Params,
    pub machine: Machine,
}

/// The goals: qpip's p50 at most this fraction of the peer's ...
const P50_AT_MOST: f64 = 0.8;
/// ... and its IOPS at least this multiple, both directions.
const IOPS_AT_LEAST: f64 = 1.25;

pub(super) fn targets(
    stacks: &BTreeMap<String, BTreeMap<String, Stat>>,
) -> (BTreeMap<String, f64>, Vec<TargetCheck>) {
    let (q, peer) = (Stack::Qpip.name(), Stack::QsdNbdkit.name());
    let mut ratios = BTreeMap::new();
    let mut checks = Vec::new();
    let (Some(qs), Some(ps)) = (stacks.get(q), stacks.get(peer)) else {
        return (ratios, checks);
    };
    for d in RandDir::BOTH {
        let rw = d.rw();
        let ratio = |m: &str| {
            let k = format!("{rw}_{m}");
            match (qs.get(&k), ps.get(&k)) {
                (Some(a), Some(b)) => a.median / b.median,
                _ => f64::NAN,
            }
        };
        for m in ["iops", "p50_us", "p99_us"] {
            ratios.insert(format!("{rw}_{m}_vs_{peer}"), ratio(m));
        }
        let p50 = ratio("p50_us");
        checks.push(TargetCheck {
            rule: format!("{q} {rw} p50 <= {P50_AT_MOST}x {peer}'s"),
            value: p50,
            threshold: P50_AT_MOST,
            met: p50 <= P50_AT_MOST,
        });
        let iops = ratio("iops");
        checks.push(TargetCheck {
            rule: format!("{q} {rw} IOPS >= {IOPS_AT_LEAST}x {peer}'s"),
            value: iops,
            threshold: IOPS_AT_LEAST,
            met: iops >= IOPS_AT_LEAST,
        });
    }
    (ratios, checks)
}

fn header(p: &Params) -> String {
    let mut s = format!(
        "nbd qd1: {} O_DIRECT random reads, then writes, one at a time (fio psync, iodepth 1), \
         {} s each, through a FUSE file;\n{} image of random data on tmpfs; median of {} \
         round(s) [min-max]; CPU in CPU-ms per 10 000 operations\n",
        human_bytes(p.bs_bytes),
        p.runtime_s,
        human_bytes(p.size_bytes),
        p.repeat
    );
    s += &crate::nbd::link_line(p.netns.as_ref());
    s += &format!(
        "{:<10} {:<9} {:>19} {:>15} {:>17} | {:>6} {:>6} {:>6} {:>6} {:>6} | {:>9}\n",
        "stack",
        "",
        "IOPS",
        "p50 µs",
        "p99 µs",
        "server",
        "c-NIC",
        "c-app",
        "fio",
        "all",
        "(machine)"
    );
    s
}

/// The report as a terminal table.
pub(crate) fn table(r: &Qd1Report) -> String {
    let mut s = header(&r.params);
    let mut wide = false;
    for stack in Stack::ALL {
        let Some(f) = r.stacks.get(stack.name()) else {
            continue;
        };
        for d in RandDir::BOTH {
            let rw = d.rw();
            let Some(iops) = f.get(&format!("{rw}_iops")) else {
                continue;
            };
            wide |= iops.wide(0.15);
            let cell = |m: &str| {
                f.get(&format!("{rw}_{m}"))
                    .map_or("-".into(), |x| x.cell(0))
            };
            let cpu = |k: &str| {
                f.get(&format!("{rw}_cpu_ms_per_10k_{k}"))
                    .map_or(f64::NAN, |x| x.median)
            };
            s += &format!(
                "{:<10} {:<9} {:>19} {:>15} {:>17} | {:>6.0} {:>6.0} {:>6.0} {:>6.0} {:>6.0} | {:>9.0}\n",
                stack.name(),
                rw,
                iops.cell(0),
                cell("p50_us"),
                cell("p99_us"),
                cpu("server"),
                cpu("client_nic"),
                cpu("client_app"),
                cpu("fio"),
                cpu("all"),
                cpu("machine"),
            );
        }
    }
    s += "\nstacks: ";
    s += &Stack::ALL
        .iter()
        .map(|k| format!("{} = {}", k.name(), k.describe()))
        .collect::<Vec<_>>()
        .join(";\n        ");
    s += "\nCPU: server = the server process; c-NIC = the FUSE client's qpip-soft-nic engine \
          threads, c-app = its other threads (all of qemu-storage-daemon's); all = server + \
          client + fio; machine = all busy CPU of the machine, other processes included\n";
    if let Some(q) = r.stacks.get(Stack::Qpip.name()) {
        let nic = |rw: &str| {
            let g = |k: &str| {
                q.get(&format!("{rw}_cpu_ms_per_10k_{k}"))
                    .map_or(f64::NAN, |x| x.median)
            };
            (g("server_nic"), g("server"))
        };
        let (rn, ra) = nic("randread");
        let (wn, wa) = nic("randwrite");
        s += &format!(
            "of qpip's server CPU, its engine threads used {rn:.0} of {ra:.0} (reads) and \
             {wn:.0} of {wa:.0} (writes); with run to completion, engine turns that \
             application threads run themselves count as theirs\n"
        );
    }
    s += &targets_text(r);
    for (stack, f) in &r.stacks {
        for d in RandDir::BOTH {
            let Some(st) = f.get(&format!("{}_stopped_s", d.rw())) else {
                continue;
            };
            let total: f64 = st.samples.iter().sum();
            if total > 0.0 {
                s += &format!(
                    "note: {stack} was stopped from outside the benchmark (SIGSTOP) for \
                     {total:.1} s during its kept {} runs (each such run is tried again twice): \
                     their IOPS and max latencies say so, not the stack\n",
                    d.rw()
                );
            }
        }
    }
    if stalled(r) {
        s += "note: in some runs the mean latency (1/IOPS) was over twice the p50: latencies \
              in two modes, or rare stalls far beyond p99 (p99.9 and max: --json)\n";
    }
    if wide {
        s += "note: some IOPS spreads exceed 15%: the machine was noisy; consider a larger \
              --repeat\n";
    }
    s
}

/// Some run's mean latency (1/IOPS) was more than twice its median: its IOPS tell of a slow
/// mode or rare stalls more than of the typical request.
fn stalled(r: &Qd1Report) -> bool {
    r.stacks.values().any(|f| {
        RandDir::BOTH.iter().any(|d| {
            let rw = d.rw();
            match (f.get(&format!("{rw}_iops")), f.get(&format!("{rw}_p50_us"))) {
                (Some(iops), Some(p50)) => iops
                    .samples
                    .iter()
                    .zip(&p50.samples)
                    .any(|(i, p)| i * p / 1e6 < 0.5),
                _ => false,
            }
        })
    })
}

fn targets_text(r: &Qd1Report) -> String {
    if r.targets.is_empty() {
        return String::new();
    }
    let mut s = "\ntargets (issue 29):\n".to_string();
    for t in &r.targets {
        s += &format!(
            "  {:<42} {:>5.2}x  {}\n",
            t.rule,
            t.value,
            if t.met { "met" } else { "MISSED" }
        );
    }
    let met = r.targets.iter().filter(|t| t.met).count();
    s += &format!(
        "verdict: {met} of {} goals met (qpip p50 <= {P50_AT_MOST}x and IOPS >= \
         {IOPS_AT_LEAST}x qsd-nbdkit, reads and writes): {}\n",
        r.targets.len(),
        if met == r.targets.len() {
            "met"
        } else {
            "MISSED"
        }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(x: f64) -> Stat {
        Stat::of(&[x])
    }

    #[test]
    fn goals_compare_medians_both_ways() {
        let figures = |iops: f64, p50: f64| -> BTreeMap<String, Stat> {
            ["randread", "randwrite"]
                .iter()
                .flat_map(|rw| {
                    [
                        (format!("{rw}_iops"), stat(iops)),
                        (format!("{rw}_p50_us"), stat(p50)),
                        (format!("{rw}_p99_us"), stat(p50 * 3.0)),
                    ]
                })
                .collect()
        };
        let mut stacks = BTreeMap::new();
        stacks.insert("qpip".to_string(), figures(13_000.0, 60.0));
        stacks.insert("qsd-nbdkit".to_string(), figures(10_000.0, 80.0));
        let (ratios, checks) = targets(&stacks);
        assert_eq!(checks.len(), 4);
        assert!((ratios["randread_iops_vs_qsd-nbdkit"] - 1.3).abs() < 1e-9);
        assert!((ratios["randwrite_p50_us_vs_qsd-nbdkit"] - 0.75).abs() < 1e-9);
        assert!(checks.iter().all(|c| c.met), "{checks:?}");
        stacks.insert("qpip".to_string(), figures(12_000.0, 70.0));
        let (_, checks) = targets(&stacks);
        assert!(checks.iter().all(|c| !c.met), "{checks:?}");
        // Without the peer there is nothing to hold qpip to.
        stacks.remove("qsd-nbdkit");
        assert!(targets(&stacks).1.is_empty());
    }
}
