//! `qpip-bench lanai`: the paper's experiments on the emulated LANai 9 and Myrinet, run in
//! virtual time. Every figure is predicted by the model from its inputs
//! (`configs/lanai.toml`, `configs/fabric.toml`); nothing is measured on this machine, so two
//! runs print the same numbers.

use std::path::Path;

use anyhow::{Context, Result};
use qpip_core::lanai::params::ChecksumAt;
use qpip_core::lanai::pci::{PciBus, Use};
use qpip_core::lanai::sim::apps::{BulkConfig, PingPort, Proto};
use qpip_core::lanai::sim::experiments::{self, Setup, StageUs, TtcpResult, Utilisation};
use qpip_core::lanai::{FabricParams, LanaiParams};
use serde_json::{Value, json};

use crate::progress::Progress;

mod nbd;

/// How much to run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub rtt_rounds: u64,
    pub ttcp_bytes: u64,
    pub ttcp_msg: usize,
    /// Bytes each NBD run reads or writes.
    pub nbd_bytes: u64,
}

impl Sizes {
    /// The paper's: ttcp moves 10 MB (640 messages of 16 KiB).
    pub(crate) fn full() -> Self {
        Sizes {
            rtt_rounds: 100,
            ttcp_bytes: 640 * 16384,
            ttcp_msg: 16384,
            // 80 requests of 124 KiB: 10.2 MB, as much as ttcp moves.
            nbd_bytes: 80 * 126_976,
        }
    }
    /// Seconds even in a debug build (smoke tests).
    pub(crate) fn quick() -> Self {
        Sizes {
            rtt_rounds: 10,
            ttcp_bytes: 32 * 16384,
            ttcp_msg: 16384,
            nbd_bytes: 8 * 126_976,
        }
    }
}

/// Loads the model's inputs (the embedded defaults when no file is given).
pub(crate) fn load(
    params: Option<&Path>,
    fabric: Option<&Path>,
) -> Result<(LanaiParams, FabricParams)> {
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

/// How the programs were ported to QPs: what every headline figure assumes.
const TTCP_PORT: &str = "ttcp v1.4 ported simply: one buffer each side, so 1 send outstanding \
     (a write returns when the peer has acknowledged its bytes) and 1 receive posted, reposted \
     as each read returns";
const RTT_PORT: &str = "blocking ping-pong on one buffer: write returns when the send completes, \
     then read posts its receive";

/// The ports the sensitivity table tries: (sends outstanding, receives posted).
const PORTS: [(usize, usize); 6] = [(1, 1), (1, 16), (2, 1), (2, 16), (8, 1), (8, 16)];

fn port_key(sends: usize, recvs: usize) -> String {
    format!("s{sends}_r{recvs}")
}

fn with_checksum_cycles(p: &LanaiParams, cycles_per_word: f64) -> LanaiParams {
    // The loop's instructions set to give `cycles_per_word` with the loads' extra cycles.
    let mut p = with_checksum(p, ChecksumAt::Firmware);
    let d = &mut p.device;
    d.firmware_checksum_instructions_per_word =
        cycles_per_word - d.firmware_checksum_loads_per_word * d.sram_load_extra_cycles;
    p
}

type RttFn<'a> = dyn Fn(&LanaiParams, Proto, PingPort) -> Result<(f64, Utilisation)> + 'a;
type BulkFn<'a> = dyn Fn(&LanaiParams, &FabricParams, usize, usize) -> Result<TtcpResult> + 'a;
type TtcpFn<'a> = dyn Fn(&LanaiParams, &FabricParams) -> Result<TtcpResult> + 'a;

/// Sensitivity: the other plausible ports of ttcp, at each MTU and with the firmware sum.
fn ttcp_sensitivity(
    hw: &LanaiParams,
    fw: &LanaiParams,
    fabric: &FabricParams,
    mtus: &[usize],
    bulk: &BulkFn,
) -> Result<Value> {
    let mut sens = serde_json::Map::new();
    let columns: Vec<(String, &LanaiParams, usize)> = mtus
        .iter()
        .map(|&m| (format!("mtu{m}"), hw, m))
        .chain(std::iter::once(("mtu16384_fw_csum".to_string(), fw, 16384)))
        .collect();
    for (key, p, mtu) in &columns {
        let mut col = serde_json::Map::new();
        for (sends, recvs) in PORTS {
            let t = bulk(p, &with_mtu(fabric, *mtu), sends, recvs)?;
            col.insert(
                port_key(sends, recvs),
                json!({"sends_outstanding": sends, "receives_posted": recvs,
                       "MBps": t.mbps, "bound": bound(&t.utilisation)}),
            );
        }
        sens.insert(key.clone(), Value::Object(col));
    }
    Ok(Value::Object(sens))
}

/// The what-if table, from the LANai 9 as built (`fw`: receive checksum in firmware): each
/// change's TCP round trip, ttcp and NBD at MTU 16384, the programs as ported.
fn what_if(
    fw: &LanaiParams,
    fabric: &FabricParams,
    nbd_bytes: u64,
    rtt: &RttFn,
    ttcp: &TtcpFn,
    tick: &dyn Fn(),
) -> Result<Value> {
    let mut what_if = serde_json::Map::new();
    let f16 = with_mtu(fabric, 16384);
    for (key, label, change) in what_if_rows() {
        let mut p = fw.clone();
        change(&mut p);
        let (r, _) = rtt(&p, Proto::Tcp, PingPort::Blocking)?;
        let t = ttcp(&p, &f16)?;
        let mut row = json!({"change": label, "tcp_rtt_us": r, "ttcp_MBps": t.mbps,
                             "ttcp_bound": bound(&t.utilisation)});
        for (d, dir) in nbd::DIRS {
            let n = nbd::one(&setup(p.clone(), &f16), dir, nbd_bytes, |_| {})?;
            tick();
            row[format!("nbd_{d}_MBps")] = json!(n.mbps);
            row[format!("nbd_{d}_bound")] = bound(&n.utilisation);
        }
        what_if.insert(key.to_string(), row);
    }
    Ok(Value::Object(what_if))
}

/// ttcp and the TCP round trip at both ends of the firmware checksum's range of cycles per
/// word, beside the model's (`tcp_fw_us`, `t16fw`).
fn checksum_range(
    params: &LanaiParams,
    fabric: &FabricParams,
    rtt: &RttFn,
    ttcp: &TtcpFn,
    tcp_fw_us: f64,
    t16fw: &TtcpResult,
) -> Result<Value> {
    let [cs_lo, cs_hi] = params.device.firmware_checksum_cycles_per_word_range;
    let (lo, hi) = (
        with_checksum_cycles(params, cs_lo),
        with_checksum_cycles(params, cs_hi),
    );
    let f16 = with_mtu(fabric, 16384);
    let (t_lo, t_hi) = (ttcp(&lo, &f16)?, ttcp(&hi, &f16)?);
    let (r_lo, r_hi) = (
        rtt(&lo, Proto::Tcp, PingPort::Blocking)?,
        rtt(&hi, Proto::Tcp, PingPort::Blocking)?,
    );
    Ok(json!({
        "model": params.device.firmware_checksum_cycles_per_word(),
        "low": cs_lo,
        "high": cs_hi,
        "ttcp_MBps_mtu16384": {"model": t16fw.mbps, "low": t_lo.mbps, "high": t_hi.mbps},
        "ttcp_bound_mtu16384": {"low": bound(&t_lo.utilisation), "high": bound(&t_hi.utilisation)},
        "tcp_rtt_us": {"model": tcp_fw_us, "low": r_lo.0, "high": r_hi.0},
    }))
}

/// Runs everything; returns the JSON report.
pub(crate) fn run(
    params: &LanaiParams,
    fabric: &FabricParams,
    sizes: Sizes,
    progress: &Progress,
) -> Result<Value> {
    let hw = with_checksum(params, ChecksumAt::Hardware);
    let fw = with_checksum(params, ChecksumAt::Firmware);
    let rows = what_if_rows();
    let mtus = [16384usize, 9000, 1500];
    let bar = std::cell::RefCell::new(progress.steps(
        "virtual-time runs".into(),
        14 + 4 * rows.len() as u64
            + (PORTS.len() * (mtus.len() + 1)) as u64
            + 2 * nbd::rows().len() as u64,
    ));
    let rtt = |p: &LanaiParams, proto: Proto, port: PingPort| -> Result<(f64, Utilisation)> {
        let r = experiments::rtt_ported(&setup(p.clone(), fabric), proto, sizes.rtt_rounds, port)
            .with_context(|| format!("{proto:?} round trip ({port:?})"))?;
        bar.borrow_mut().inc(1);
        Ok(r)
    };
    let bulk = |p: &LanaiParams, f: &FabricParams, sends, recvs| -> Result<TtcpResult> {
        let cfg = BulkConfig::ttcp(sizes.ttcp_bytes, sizes.ttcp_msg).with_port(sends, recvs);
        let r = experiments::bulk(&setup(p.clone(), f), cfg, None).with_context(|| {
            format!(
                "ttcp at MTU {} with {sends} sends outstanding, {recvs} receives",
                f.mtu
            )
        })?;
        bar.borrow_mut().inc(1);
        Ok(r)
    };
    // The program as ported: BulkConfig::ttcp's sends and receives.
    let as_ported = BulkConfig::ttcp(0, 0);
    let (ps, pr) = (as_ported.window, as_ported.recv_depth);
    let ttcp = |p: &LanaiParams, f: &FabricParams| bulk(p, f, ps, pr);
    let udp_hw = rtt(&hw, Proto::Udp, PingPort::Blocking)?;
    let udp_fw = rtt(&fw, Proto::Udp, PingPort::Blocking)?;
    let tcp_hw = rtt(&hw, Proto::Tcp, PingPort::Blocking)?;
    let tcp_fw = rtt(&fw, Proto::Tcp, PingPort::Blocking)?;
    let udp_pre = rtt(&hw, Proto::Udp, PingPort::Preposted)?;
    let tcp_pre = rtt(&hw, Proto::Tcp, PingPort::Preposted)?;
    let t16 = ttcp(&hw, &with_mtu(fabric, 16384))?;
    let t9 = ttcp(&hw, &with_mtu(fabric, 9000))?;
    let t15 = ttcp(&hw, &with_mtu(fabric, 1500))?;
    let t16fw = ttcp(&fw, &with_mtu(fabric, 16384))?;
    let csum = checksum_range(params, fabric, &rtt, &ttcp, tcp_fw.0, &t16fw)?;
    let sens = ttcp_sensitivity(&hw, &fw, fabric, &mtus, &bulk)?;
    let tick = || bar.borrow_mut().inc(1);
    let nbd = nbd::run(
        &setup(hw.clone(), &with_mtu(fabric, 16384)),
        sizes.nbd_bytes,
        &tick,
    )?;
    let what_if = what_if(&fw, fabric, sizes.nbd_bytes, &rtt, &ttcp, &tick)?;
    bar.into_inner().finish("done");
    let o = &t16.occupancy;
    let bus = PciBus::new(&params.device);
    let mut report = json!({
        "app_port": {
            "ttcp": TTCP_PORT,
            "ttcp_sends_outstanding": ps,
            "ttcp_receives_posted": pr,
            "rtt": RTT_PORT,
            "nbd": nbd::NBD_PORT,
        },
        "rtt_us": {
            "udp": {"hw_csum": udp_hw.0, "fw_csum": udp_fw.0},
            "tcp": {"hw_csum": tcp_hw.0, "fw_csum": tcp_fw.0},
        },
        "rtt_bound": {
            "udp": {"hw_csum": bound(&udp_hw.1), "fw_csum": bound(&udp_fw.1)},
            "tcp": {"hw_csum": bound(&tcp_hw.1), "fw_csum": bound(&tcp_fw.1)},
        },
        "rtt_us_preposted": {"udp": udp_pre.0, "tcp": tcp_pre.0},
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
        "fw_csum_cycles_per_word": csum,
        "ttcp_sensitivity": sens,
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
            "host_copy_ns_per_byte": params.host.copy_ns_per_byte,
            "nbd_bytes": sizes.nbd_bytes,
        },
    });
    if let (Some(r), Value::Object(n)) = (report.as_object_mut(), nbd) {
        r.extend(n);
    }
    Ok(report)
}

/// Busy at least this share of the time, a resource sets the rate; below it, nothing is
/// saturated and what sets the rate is the programs' waits (a reply, an acknowledgement, a
/// receive posted again), which no single resource's figure shows.
const SATURATED: f64 = 0.9;

/// The resource closest to saturation, whether it is saturated ([`SATURATED`]), and every
/// resource's utilisation.
fn bound(u: &Utilisation) -> Value {
    let (name, util) = experiments::bound(u);
    json!({
        "resource": name,
        "utilisation": util,
        "saturated": util >= SATURATED,
        "all": u.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
    })
}

/// "PCI read 93 %": what bounds a prediction; "waits; staging 62 %" when no resource is
/// saturated, with the busiest.
fn bound_cell(v: &Value) -> String {
    let busiest = format!(
        "{} {:.0} %",
        v["resource"].as_str().unwrap_or("?"),
        100.0 * num(&v["utilisation"])
    );
    if v["saturated"].as_bool().unwrap_or(true) {
        busiest
    } else {
        format!("waits; {busiest}")
    }
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// The report as tables.
pub(crate) fn table(r: &Value) -> String {
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
        "Programs as ported (every figure below unless it says otherwise):\n  round trips: {}\n  ttcp: {}\n  NBD: {}\n\n",
        r["app_port"]["rtt"].as_str().unwrap_or("?"),
        r["app_port"]["ttcp"].as_str().unwrap_or("?"),
        r["app_port"]["nbd"].as_str().unwrap_or("?")
    );
    s += &format!(
        "{:<30} {:>10} {:>10}   {:<28} {}\n",
        "1-byte round trip (µs)",
        "hw rx csum",
        "fw rx csum",
        "busiest resource (hw csum)",
        "receives posted ahead (hw)"
    );
    for proto in ["udp", "tcp"] {
        s += &format!(
            "{:<30} {:>10.1} {:>10.1}   {:<28} {:.1}\n",
            proto.to_uppercase(),
            num(&r["rtt_us"][proto]["hw_csum"]),
            num(&r["rtt_us"][proto]["fw_csum"]),
            bound_cell(&r["rtt_bound"][proto]["hw_csum"]),
            num(&r["rtt_us_preposted"][proto])
        );
    }
    s += &format!(
        "\n{:<30} {:>10}   {}\n",
        format!(
            "ttcp, 16 KiB, {} send/{} recv",
            r["app_port"]["ttcp_sends_outstanding"], r["app_port"]["ttcp_receives_posted"]
        ),
        "MB/s",
        "bound by (utilisation)"
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
    let c = &r["fw_csum_cycles_per_word"];
    s += &format!(
        "firmware checksum {:.2} cycles/word (range {:.2}-{:.2}): ttcp MTU 16384 {:.1} MB/s \
         ({:.1} at {:.2}, {:.1} at {:.2}; bound {} / {}), TCP RTT {:.1} µs ({:.1}-{:.1})\n",
        num(&c["model"]),
        num(&c["low"]),
        num(&c["high"]),
        num(&c["ttcp_MBps_mtu16384"]["model"]),
        num(&c["ttcp_MBps_mtu16384"]["low"]),
        num(&c["low"]),
        num(&c["ttcp_MBps_mtu16384"]["high"]),
        num(&c["high"]),
        bound_cell(&c["ttcp_bound_mtu16384"]["low"]),
        bound_cell(&c["ttcp_bound_mtu16384"]["high"]),
        num(&c["tcp_rtt_us"]["model"]),
        num(&c["tcp_rtt_us"]["low"]),
        num(&c["tcp_rtt_us"]["high"])
    );
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
    s += &ttcp_sensitivity_table(r);
    s += &nbd::table(r);
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
    s += &what_if_table(r);
    s
}

/// The what-if table: TCP round trip, ttcp and NBD for each change.
fn what_if_table(r: &Value) -> String {
    let mut s = format!(
        "\nWhat if (from the LANai 9 with its firmware receive checksum; programs as ported)\n\
         {:<38} {:>10} {:>10} {:<30} {:>9} {:<30} {:>9} {}\n",
        "change",
        "TCP RTT µs",
        "ttcp MB/s",
        " (bound by)",
        "NBD read",
        " (bound by)",
        "NBD write",
        " (bound by)"
    );
    let Some(m) = r["what_if"].as_object() else {
        return s;
    };
    for (_, row) in what_if_order(m) {
        let cell = |k: &str| [" (", &bound_cell(&row[k]), ")"].concat();
        s += &format!(
            "{:<38} {:>10.1} {:>10.1} {:<30} {:>9.1} {:<30} {:>9.1} {}\n",
            row["change"].as_str().unwrap_or("?"),
            num(&row["tcp_rtt_us"]),
            num(&row["ttcp_MBps"]),
            cell("ttcp_bound"),
            num(&row["nbd_read_MBps"]),
            cell("nbd_read_bound"),
            num(&row["nbd_write_MBps"]),
            cell("nbd_write_bound")
        );
    }
    s
}

/// ttcp's sensitivity to its port, at each MTU.
fn ttcp_sensitivity_table(r: &Value) -> String {
    let mut s = String::new();
    s += "\nttcp MB/s (bound by) for other ports of the program: sends outstanding x receives posted\n";
    let cols = ["mtu16384", "mtu9000", "mtu1500", "mtu16384_fw_csum"];
    s += &format!(
        "{:<22}{}\n",
        "sends x receives",
        ["MTU 16384", "MTU 9000", "MTU 1500", "MTU 16384 fw csum"]
            .iter()
            .map(|h| format!("{h:<34}"))
            .collect::<String>()
    );
    for (sends, recvs) in PORTS {
        let key = port_key(sends, recvs);
        let ported = sends as u64
            == r["app_port"]["ttcp_sends_outstanding"]
                .as_u64()
                .unwrap_or(0)
            && recvs as u64 == r["app_port"]["ttcp_receives_posted"].as_u64().unwrap_or(0);
        let label = format!(
            "{sends} x {recvs}{}",
            if ported { " (as ported)" } else { "" }
        );
        let cells: String = cols
            .iter()
            .map(|c| {
                let v = &r["ttcp_sensitivity"][*c][&key];
                format!(
                    "{:<34}",
                    format!("{:.1} ({})", num(&v["MBps"]), bound_cell(&v["bound"]))
                )
            })
            .collect();
        s += &format!("{label:<22}{cells}\n");
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
