#!/usr/bin/env python3
"""Medians [rounds] of micro.sh's JSON outputs, OLD against NEW. python3 micro_summary.py [DIR]"""
import json, statistics, sys
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
rows = {
    "round trip TCP, QP spin µs": ("rtt", "tcp", "qp_spin", "us"),
    "  its CPU µs": ("rtt", "tcp", "qp_spin", "cpu_us"),
    "round trip TCP, busy-poll socket µs": ("rtt", "tcp", "socket_busy_poll", "us"),
    "  its CPU µs ": ("rtt", "tcp", "socket_busy_poll", "cpu_us"),
    "round trip UDP, QP spin µs": ("rtt", "udp", "qp_spin", "us"),
    "  its CPU µs  ": ("rtt", "udp", "qp_spin", "cpu_us"),
    "round trip UDP, busy-poll socket µs": ("rtt", "udp", "socket_busy_poll", "us"),
    "  its CPU µs   ": ("rtt", "udp", "socket_busy_poll", "cpu_us"),
    "round trip TCP, QP sleep µs": ("rtt", "tcp", "qp_sleep", "us"),
    "round trip TCP, blocking socket µs": ("rtt", "tcp", "socket_blocking", "us"),
    "round trip UDP, QP sleep µs": ("rtt", "udp", "qp_sleep", "us"),
    "round trip UDP, blocking socket µs": ("rtt", "udp", "socket_blocking", "us"),
    "host overhead QP ns": ("overhead_ns", "qp"),
    "host overhead socket ns": ("overhead_ns", "socket"),
    "ttcp 16 KiB QP MB/s": ("throughput_MBps", "16k", "qp"),
    "ttcp 16 KiB socket MB/s": ("throughput_MBps", "16k", "socket"),
    "ttcp 128 KiB QP MB/s": ("throughput_MBps", "128k", "qp"),
    "ttcp 128 KiB socket MB/s": ("throughput_MBps", "128k", "socket"),
    "every thread CPU/GB 16 KiB QP s": lambda j: j["app_cpu_s_per_GB"]["16k"]["qp"] + j["engine_cpu_s_per_GB"]["16k"]["qp"],
    "every thread CPU/GB 16 KiB socket s": lambda j: j["app_cpu_s_per_GB"]["16k"]["socket"],
    "every thread CPU/GB 128 KiB QP s": lambda j: j["app_cpu_s_per_GB"]["128k"]["qp"] + j["engine_cpu_s_per_GB"]["128k"]["qp"],
    "every thread CPU/GB 128 KiB socket s": lambda j: j["app_cpu_s_per_GB"]["128k"]["socket"],
}
def get(j, path):
    if callable(path):
        return path(j)
    for p in path:
        j = j[p]
    return j
print("| measure | before (main) | after |")
print("|---|---:|---:|")
for name, path in rows.items():
    cells = []
    for b in ("OLD", "NEW"):
        v = [get(json.loads(f.read_text()), path) for f in sorted(d.glob(f"micro-{b}-*.json"))]
        cells.append(f"{statistics.median(v):.3g} {[round(x, 2) for x in v]}" if v else "–")
    print(f"| {name.strip()} | " + " | ".join(cells) + " |")
