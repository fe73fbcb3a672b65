//! The storage experiment in `qpip-bench lanai`: the Linux 2.4 NBD client and nbd-server 2.0
//! as ported to QPs (docs/lanai.md, "The programs as ported"), each direction's prediction
//! with what bounds it, and the other plausible ports beside the simplest one.

use anyhow::{Context, Result};
use qpip_core::lanai::sim::experiments::{self, NbdResult, Setup};
use qpip_core::lanai::sim::nbd::{NbdConfig, NbdDir, NbdPort, ReplyRecv};
use serde_json::{Value, json};

use super::{bound, bound_cell, num};

/// What every NBD figure assumes.
pub(crate) const NBD_PORT: &str = "Linux 2.4 nbd.c and nbd-server 2.0 ported simply: 124 KiB \
     requests; the client sends each as the block layer hands it over (reads: 1 outstanding, \
     2.4's read-ahead window; writes: 64, its write request slots), waits for each send to \
     complete (the header is on nbd_send_req's stack), takes replies in one receive reposted \
     after each (a READ's data copied out); the server takes one request at a time on one \
     buffer (posted again when its reply is acknowledged) and copies through its page cache";

type PortChange = fn(&mut NbdPort);

/// The ports the sensitivity table tries: key, label, change from the simplest port.
pub(crate) fn rows() -> Vec<(&'static str, &'static str, PortChange)> {
    vec![
        ("as_ported", "as ported", |_| {}),
        ("depth1", "1 request outstanding", |p| p.depth = 1),
        ("depth2", "2 requests outstanding", |p| p.depth = 2),
        ("depth64", "64 requests outstanding", |p| p.depth = 64),
        ("sends_free", "client: sends not waited for", |p| {
            p.send_waits = false
        }),
        ("direct", "client: replies placed direct", |p| {
            p.reply_recv = ReplyRecv::Direct
        }),
        ("server_ahead", "server: 4 receives posted ahead", |p| {
            p.server_slots = 4
        }),
        ("no_copy", "server: image registered, no copy", |p| {
            p.server_copies = false
        }),
        ("pipelined", "all four, 64 outstanding", |p| {
            *p = NbdPort {
                depth: 64,
                send_waits: false,
                reply_recv: ReplyRecv::Direct,
                server_slots: 4,
                server_copies: false,
            }
        }),
    ]
}

pub(crate) const DIRS: [(&str, NbdDir); 2] = [("read", NbdDir::Read), ("write", NbdDir::Write)];

/// One run: `total` bytes in `dir`, the simplest port changed by `change`.
pub(crate) fn one(setup: &Setup, dir: NbdDir, total: u64, change: PortChange) -> Result<NbdResult> {
    let mut port = NbdPort::as_ported(dir);
    change(&mut port);
    let cfg = NbdConfig::as_ported(dir, total).with_port(port);
    experiments::nbd(setup, cfg).with_context(|| format!("NBD {dir:?} with {port:?}"))
}

/// The storage experiment's part of the report; `tick` after every run.
pub(crate) fn run(setup: &Setup, total: u64, tick: &dyn Fn()) -> Result<Value> {
    let mut mbps = serde_json::Map::new();
    let mut bounds = serde_json::Map::new();
    let mut cpu = serde_json::Map::new();
    let mut in_flight = serde_json::Map::new();
    let mut sens = serde_json::Map::new();
    for (key, label, change) in rows() {
        let mut row = serde_json::Map::new();
        row.insert("change".into(), json!(label));
        for (d, dir) in DIRS {
            let r = one(setup, dir, total, change)?;
            tick();
            if key == "as_ported" {
                mbps.insert(d.into(), json!(r.mbps));
                bounds.insert(d.into(), bound(&r.utilisation));
                cpu.insert(
                    d.into(),
                    json!({"client": r.client_cpu_pct, "server": r.server_cpu_pct}),
                );
                in_flight.insert(d.into(), json!(r.max_in_flight));
            }
            row.insert(
                d.into(),
                json!({"MBps": r.mbps, "bound": bound(&r.utilisation),
                       "max_in_flight": r.max_in_flight}),
            );
        }
        sens.insert(key.into(), Value::Object(row));
    }
    let ported = |dir| NbdPort::as_ported(dir);
    Ok(json!({
        "nbd_MBps": mbps,
        "nbd_bound": bounds,
        "nbd_host_cpu_pct": cpu,
        "nbd_max_in_flight": in_flight,
        "nbd_sensitivity": sens,
        "nbd_port": {
            "read_depth": ported(NbdDir::Read).depth,
            "write_depth": ported(NbdDir::Write).depth,
            "request_bytes": NbdConfig::REQUEST_BYTES,
        },
    }))
}

/// The NBD part of the tables.
pub(crate) fn table(r: &Value) -> String {
    let mut s = format!(
        "\n{:<30} {:>10}   {:<30} {}\n",
        format!(
            "NBD, {} KiB requests, as ported",
            num(&r["nbd_port"]["request_bytes"]) / 1024.0
        ),
        "MB/s",
        "bound by",
        "in flight, host CPU client/server"
    );
    for (d, _) in DIRS {
        let cpu = &r["nbd_host_cpu_pct"][d];
        s += &format!(
            "{d:<30} {:>10.1}   {:<30} {} at most, {:.0} % / {:.0} %\n",
            num(&r["nbd_MBps"][d]),
            bound_cell(&r["nbd_bound"][d]),
            r["nbd_max_in_flight"][d],
            num(&cpu["client"]),
            num(&cpu["server"])
        );
    }
    s += "\nNBD MB/s (bound by) for other ports of the programs (MTU 16384, hw rx csum)\n";
    s += &format!("{:<36}{:<36}{}\n", "port", "read", "write");
    for (key, label, _) in rows() {
        let row = &r["nbd_sensitivity"][key];
        let cell = |d: &str| {
            let v = &row[d];
            format!("{:.1} ({})", num(&v["MBps"]), bound_cell(&v["bound"]))
        };
        s += &format!("{label:<36}{:<36}{}\n", cell("read"), cell("write"));
    }
    s
}
