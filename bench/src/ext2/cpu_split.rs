//! CPU over one phase of `nbd ext2`, split by who used it: the server's and the FUSE
//! client's process trees (minus their soft NIC engine threads, counted as the NIC),
//! qpip-bench itself, kernel threads, other user processes, and the kernel (the rest).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::cpu::{self, ProcEntry};
use crate::rig::peers::NIC_THREAD;

/// The counters at one instant.
pub(super) struct Probe {
    pub t: Instant,
    machine: Duration,
    procs: HashMap<u32, ProcEntry>,
    server_nic: Duration,
    client_nic: Duration,
}

pub(super) fn probe(server: u32, client: u32) -> Result<Probe> {
    let nic = |pid| cpu::threads_named(pid, NIC_THREAD).map(|c| c.total());
    Ok(Probe {
        t: Instant::now(),
        machine: cpu::machine_busy().context("reading /proc/stat")?,
        procs: cpu::all_processes(),
        server_nic: nic(server)?,
        client_nic: nic(client)?,
    })
}

/// CPU seconds of one phase, by component (they add up to `machine`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Split {
    pub machine: f64,
    pub server: f64,
    pub nic: f64,
    pub client: f64,
    pub bench: f64,
    pub kernel: f64,
    pub kthreads: f64,
    pub other: f64,
}

pub(super) fn split(a: &Probe, b: &Probe, server: u32, client: u32) -> Split {
    let delta = |pids: &mut dyn Iterator<Item = u32>| -> f64 {
        pids.filter_map(|p| {
            let end = b.procs.get(&p)?.cpu;
            let start = a.procs.get(&p).map_or(Duration::ZERO, |e| e.cpu);
            Some(end.saturating_sub(start).as_secs_f64())
        })
        .sum()
    };
    let st: HashSet<u32> = cpu::tree(&b.procs, server);
    let ct: HashSet<u32> = cpu::tree(&b.procs, client);
    let me = std::process::id();
    let server_all = delta(&mut st.iter().copied());
    let client_all = delta(&mut ct.iter().copied());
    let bench = delta(&mut std::iter::once(me));
    let kthreads = delta(&mut b.procs.iter().filter(|(_, e)| e.kthread).map(|(&p, _)| p));
    let other = delta(
        &mut b
            .procs
            .iter()
            .filter(|(p, e)| !e.kthread && **p != me && !st.contains(p) && !ct.contains(p))
            .map(|(&p, _)| p),
    );
    let machine = b.machine.saturating_sub(a.machine).as_secs_f64();
    let server_nic = b.server_nic.saturating_sub(a.server_nic).as_secs_f64();
    let client_nic = b.client_nic.saturating_sub(a.client_nic).as_secs_f64();
    Split {
        machine,
        server: (server_all - server_nic).max(0.0),
        nic: server_nic + client_nic,
        client: (client_all - client_nic).max(0.0),
        bench,
        kernel: (machine - server_all - client_all - bench - other).max(0.0),
        kthreads,
        other,
    }
}
