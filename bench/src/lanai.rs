//! `qpip-bench lanai`: the paper's experiments on the emulated LANai 9 and Myrinet, run in
//! virtual time. Every figure is predicted by the model from its inputs
//! (`configs/lanai.toml`, `configs/fabric.toml`); nothing is measured on this machine, so two
//! runs print the same numbers.

use std::path::Path;

use anyhow::{Context, Result};
use qpip_core::lanai::params::ChecksumAt;
use qpip_core::lanai::pci::{PciBus, Use};
use qpip_core::lanai::sim::apps::Proto;
use qpip_core::lanai::sim::experiments::{self, Setup, StageUs, TtcpResult, Utilisation};
use qpip_core::lanai::{FabricParams, LanaiParams};
use serde_json::{Value, json};

use crate::progress::Progress;

/// How much to run.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub rtt_rounds: u64,
    pub ttcp_bytes: u64,
    pub ttcp_msg: usize,
}

impl Sizes {
    /// The paper's: ttcp moves 10 MB (640 messages of 16 KiB).
    pub fn full() -> Self {
        Sizes {
            rtt_rounds: 100,
            ttcp_bytes: 640 * 16384,
            ttcp_msg: 16384,
        }
    }
    /// Seconds even in a debug build (smoke tests).
    pub fn quick() -> Self {
        Sizes {
            rtt_rounds: 10,
            ttcp_bytes: 32 * 16384,
            ttcp_msg: 16384,
        }
    }
}

/// Loads the model's inputs (the embedded defaults when no file is given).
pub fn load(params: Option<&Path>, fabric: Option<&Path>) -> Result<(LanaiParams, FabricParams)> {
    let p = match params {
        Some(path) => LanaiParams::load(path)
            .with_context(|| format!("loading LANai parameters from {}", path.display()))?,
        None => LanaiParams::default(),
    };
    let f = match fabric {
        Some(path) => FabricParams::load(path)
            .with_context(|| format!("loading fabric parameters from {}", path.display()))?,
        None => FabricParams::default(),
    };
    Ok((p, f))
}

fn with_checksum(p: &LanaiParams, at: ChecksumAt) -> LanaiParams {
    let mut p = p.clone();
    p.device.recv_checksum = at;
    p
}

fn setup(params: LanaiParams, fabric: &FabricParams) -> Setup {
    Setup {
        params,
        fabric: fabric.clone(),
        seed: 1,
    }
}

fn with_mtu(f: &FabricParams, mtu: usize) -> FabricParams {
    let mut f = f.clone();
    f.mtu = mtu;
    f
}

fn stages(s: &StageUs) -> Value {
    json!(
        s.iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
    )
}

/// The what-if rows: name, description, how the parameters change.
type Change = fn(&mut LanaiParams);

fn what_if_rows() -> Vec<(&'static str, &'static str, Change)> {
    vec![
        ("baseline", "LANai 9 (firmware receive checksum)", |_| {}),
        ("hw_doorbell", "+ doorbells decoded in hardware", |p| {
            p.device.hw_doorbell = true
        }),
        ("hw_checksum", "+ receive checksum in hardware", |p| {
            p.device.recv_checksum = ChecksumAt::Hardware
        }),
        ("hw_demux", "+ connection demultiplexing in hw", |p| {
            p.device.hw_demux = true
        }),
        ("hw_multiply", "+ hardware multiplier", |p| {
            p.device.hw_multiply = true
        }),
        ("clock_4x", "+ NIC processor at 4x the clock", |p| {
            p.device.clock_mhz *= 4.0
        }),
        ("all", "all of the above together", |p| {
            p.device.hw_doorbell = true;
            p.device.recv_checksum = ChecksumAt::Hardware;
            p.device.hw_demux = true;
            p.device.hw_multiply = true;
            p.device.clock_mhz *= 4.0;
        }),
    ]
}

/// Runs everything; returns the JSON report.
pub fn run(
    params: &LanaiParams,
    fabric: &FabricParams,
    sizes: Sizes,
    progress: &Progress,
) -> Result<Value> {
    let hw = with_checksum(params, ChecksumAt::Hardware);
    let fw = with_checksum(params, ChecksumAt::Firmware);
    let rows = what_if_rows();
    let bar = std::cell::RefCell::new(
        progress.steps("virtual-time runs".into(), 8 + 2 * rows.len() as u64),
    );
    let rtt = |p: &LanaiParams, proto: Proto| -> Result<(f64, Utilisation)> {
        let r = experiments::rtt(&setup(p.clone(), fabric), proto, sizes.rtt_rounds)
            .with_context(|| format!("{proto:?} round trip"))?;
        bar.borrow_mut().inc(1);
        Ok(r)
    };
    let ttcp = |p: &LanaiParams, f: &FabricParams| -> Result<TtcpResult> {
        let r = experiments::ttcp(&setup(p.clone(), f), sizes.ttcp_bytes, sizes.ttcp_msg)
            .with_context(|| format!("ttcp at MTU {}", f.mtu))?;
        bar.borrow_mut().inc(1);
        Ok(r)
    };
    let udp_hw = rtt(&hw, Proto::Udp)?;
    let udp_fw = rtt(&fw, Proto::Udp)?;
    let tcp_hw = rtt(&hw, Proto::Tcp)?;
    let tcp_fw = rtt(&fw, Proto::Tcp)?;
    let t16 = ttcp(&hw, &with_mtu(fabric, 16384))?;
    let t9 = ttcp(&hw, &with_mtu(fabric, 9000))?;
    let t15 = ttcp(&hw, &with_mtu(fabric, 1500))?;
    let t16fw = ttcp(&fw, &with_mtu(fabric, 16384))?;
    // The what-if table starts from the LANai 9 as built: receive checksum in firmware.
    let mut what_if = serde_json::Map::new();
    for (key, label, change) in &rows {
        let mut p = fw.clone();
        change(&mut p);
        let (r, _) = rtt(&p, Proto::Tcp)?;
        let t = ttcp(&p, &with_mtu(fabric, 16384))?;
        what_if.insert(
            key.to_string(),
            json!({"change": label, "tcp_rtt_us": r, "ttcp_MBps": t.mbps,
                   "ttcp_bound": bound(&t.utilisation)}),
        );
    }
    bar.into_inner().finish("done");
    let o = &t16.occupancy;
    let bus = PciBus::new(&params.device);
    Ok(json!({
        "rtt_us": {
            "udp": {"hw_csum": udp_hw.0, "fw_csum": udp_fw.0},
            "tcp": {"hw_csum": tcp_hw.0, "fw_csum": tcp_fw.0},
        },
        "rtt_bound": {
            "udp": {"hw_csum": bound(&udp_hw.1), "fw_csum": bound(&udp_fw.1)},
            "tcp": {"hw_csum": bound(&tcp_hw.1), "fw_csum": bound(&tcp_fw.1)},
        },
        "ttcp_MBps": {
            "mtu16384": t16.mbps,
            "mtu9000": t9.mbps,
            "mtu1500": t15.mbps,
            "mtu16384_fw_csum": t16fw.mbps,
        },
        "ttcp_bound": {
            "mtu16384": bound(&t16.utilisation),
            "mtu9000": bound(&t9.utilisation),
            "mtu1500": bound(&t15.utilisation),
            "mtu16384_fw_csum": bound(&t16fw.utilisation),
        },
        "ttcp_bytes_per_segment": {
            "mtu16384": t16.bytes as f64 / t16.occupancy.packets[0].max(1) as f64,
            "mtu1500": t15.bytes as f64 / t15.occupancy.packets[0].max(1) as f64,
        },
        "occupancy_us": {
            "send": {"data": stages(&o.send_data), "ack": stages(&o.send_ack)},
            "recv": {"data": stages(&o.recv_data), "ack": stages(&o.recv_ack)},
            "packets": {
                "send_data": o.packets[0], "send_ack": o.packets[1],
                "recv_data": o.packets[2], "recv_ack": o.packets[3],
            },
        },
        // The receiver's: the side the paper reports (it handles every message).
        "host_cpu_pct": t16.receiver_cpu_pct,
        "host_cpu_pct_receiver": t16.receiver_cpu_pct,
        "host_cpu_pct_sender": t16.sender_cpu_pct,
        "what_if": what_if,
        "what_if_baseline_recv_checksum": "firmware",
        "inputs": {
            "rtt_rounds": sizes.rtt_rounds,
            "ttcp_bytes": sizes.ttcp_bytes,
            "ttcp_msg_bytes": sizes.ttcp_msg,
            "clock_mhz": params.device.clock_mhz,
            "link_gbps": fabric.link_gbps,
            "pci_read_MBps": bus.rate_mbps(Use::Read),
            "pci_write_MBps": bus.rate_mbps(Use::Write),
            "send_staging_buffers": params.device.send_staging_buffers,
            "recv_staging_buffers": params.device.recv_staging_buffers,
            "sram_MBps": params.device.clock_mhz * params.device.sram_bytes_per_cycle as f64,
            "host_send_overhead_us": params.host.send_overhead_us,
            "host_recv_overhead_us": params.host.recv_overhead_us,
        },
    }))
}

/// The resource closest to saturation and every resource's utilisation.
fn bound(u: &Utilisation) -> Value {
    let (name, util) = experiments::bound(u);
    json!({
        "resource": name,
        "utilisation": util,
        "all": u.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
    })
}

/// "PCI read 83 %": what bounds a prediction.
fn bound_cell(v: &Value) -> String {
    format!(
        "{} {:.0} %",
        v["resource"].as_str().unwrap_or("?"),
        100.0 * num(&v["utilisation"])
    )
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The report as tables.
pub fn table(r: &Value) -> String {
    let mut s = String::from("LANai 9 / Myrinet, predicted in virtual time\n");
    s += &format!(
        "PCI 64-bit/33 MHz: DMA read {:.0} MB/s, write {:.0} MB/s (one bus for both and PIO); \
         {} send and {} receive staging buffers; SRAM {:.0} MB/s shared by processor and DMA\n\n",
        num(&r["inputs"]["pci_read_MBps"]),
        num(&r["inputs"]["pci_write_MBps"]),
        r["inputs"]["send_staging_buffers"],
        r["inputs"]["recv_staging_buffers"],
        num(&r["inputs"]["sram_MBps"])
    );
    s += &format!(
        "{:<30} {:>10} {:>10}   {}\n",
        "1-byte round trip (µs)", "hw rx csum", "fw rx csum", "busiest resource (hw csum)"
    );
    for proto in ["udp", "tcp"] {
        s += &format!(
            "{:<30} {:>10.1} {:>10.1}   {}\n",
            proto.to_uppercase(),
            num(&r["rtt_us"][proto]["hw_csum"]),
            num(&r["rtt_us"][proto]["fw_csum"]),
            bound_cell(&r["rtt_bound"][proto]["hw_csum"])
        );
    }
    s += &format!(
        "\n{:<30} {:>10}   {}\n",
        "ttcp, 16 KiB messages", "MB/s", "bound by (utilisation)"
    );
    for (k, label) in [
        ("mtu16384", "MTU 16384"),
        ("mtu9000", "MTU 9000"),
        ("mtu1500", "MTU 1500"),
        ("mtu16384_fw_csum", "MTU 16384, fw rx csum"),
    ] {
        let b = &r["ttcp_bound"][k];
        let all: Vec<String> = b["all"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(n, v)| format!("{n} {:.0}", 100.0 * num(v)))
                    .collect()
            })
            .unwrap_or_default();
        s += &format!(
            "{label:<30} {:>10.1}   {}  [{} %]\n",
            num(&r["ttcp_MBps"][k]),
            bound_cell(b),
            all.join(", ")
        );
    }
    s += &format!(
        "payload per data segment: {:.0} B at MTU 1500, {:.0} B at MTU 16384\n",
        num(&r["ttcp_bytes_per_segment"]["mtu1500"]),
        num(&r["ttcp_bytes_per_segment"]["mtu16384"])
    );
    s += &format!(
        "host CPU during ttcp (MTU 16384): receiver {:.1} %, sender {:.1} %\n",
        num(&r["host_cpu_pct_receiver"]),
        num(&r["host_cpu_pct_sender"])
    );
    s += "\nNIC occupancy per packet during ttcp (MTU 16384), µs\n";
    for (side, kinds) in [("send", ["data", "ack"]), ("recv", ["data", "ack"])] {
        for kind in kinds {
            let o = &r["occupancy_us"][side][kind];
            let Some(m) = o.as_object() else { continue };
            let parts: Vec<String> = m
                .iter()
                .filter(|(k, _)| k.as_str() != "total")
                .map(|(k, v)| format!("{k} {:.2}", num(v)))
                .collect();
            s += &format!(
                "  {side} {kind:<4} total {:>6.2}: {}\n",
                num(&o["total"]),
                parts.join(", ")
            );
        }
    }
    s += &format!(
        "\nWhat if (from the LANai 9 with its firmware receive checksum)\n{:<38} {:>10} {:>10}   {}\n",
        "change", "TCP RTT µs", "ttcp MB/s", "ttcp bound by"
    );
    if let Some(m) = r["what_if"].as_object() {
        for (_, row) in what_if_order(m) {
            s += &format!(
                "{:<38} {:>10.1} {:>10.1}   {}\n",
                row["change"].as_str().unwrap_or("?"),
                num(&row["tcp_rtt_us"]),
                num(&row["ttcp_MBps"]),
                bound_cell(&row["ttcp_bound"])
            );
        }
    }
    s
}

/// The what-if rows in the order they were run (JSON objects sort their keys).
fn what_if_order(m: &serde_json::Map<String, Value>) -> Vec<(&'static str, &Value)> {
    what_if_rows()
        .into_iter()
        .filter_map(|(k, _, _)| m.get(k).map(|v| (k, v)))
        .collect()
}
