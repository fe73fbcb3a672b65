#!/usr/bin/env python3
"""Medians [rounds] per build of run.sh's outputs: python3 summary.py DIR OLD NEW."""
import re, statistics, sys
from pathlib import Path

d = Path(sys.argv[1]); builds = sys.argv[2:]
rows = {
    "QD1 reads IOPS": ("qd1", r"^qpip\s+randread\s+(\d+)"),
    "QD1 reads p50 µs": ("qd1", r"^qpip\s+randread\s+\d+\s+(\d+)"),
    "QD1 reads every thread CPU-ms/10k": ("qd1", r"^qpip\s+randread.*\|\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)\s+\|"),
    "QD1 writes IOPS": ("qd1", r"^qpip\s+randwrite\s+(\d+)"),
    "QD1 writes p50 µs": ("qd1", r"^qpip\s+randwrite\s+\d+\s+(\d+)"),
    "QD1 writes every thread CPU-ms/10k": ("qd1", r"^qpip\s+randwrite.*\|\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)\s+\|"),
    "raw 1 conn write MB/s": ("raw1", r"^qpip\s+write\s+(\d+)"),
    "raw 1 conn read MB/s": ("raw1", r"^qpip\s+read\s+(\d+)"),
    "micro RTT TCP spin µs": ("micro", r"^round trip TCP, spin/busy-poll\s+([\d.]+)"),
    "micro RTT UDP spin µs": ("micro", r"^round trip UDP, spin/busy-poll\s+([\d.]+)"),
    "micro RTT TCP sleep µs": ("micro", r"^round trip TCP, sleep/blocking\s+([\d.]+)"),
    "micro ttcp 16 KiB MB/s": ("micro", r"^ttcp 10 MB in 16 KiB msgs\s+([\d.]+)"),
    "micro ttcp 128 KiB MB/s": ("micro", r"^ttcp in 128 KiB msgs\s+([\d.]+)"),
    "micro every thread CPU/GB 16 KiB": ("micro", r"^every thread CPU per GB, 16 KiB\s+([\d.]+)"),
    "micro every thread CPU/GB 128 KiB": ("micro", r"^every thread CPU per GB, 128 KiB\s+([\d.]+)"),
}
print("| measure | " + " | ".join(builds) + " |")
print("|---|" + "---:|" * len(builds))
for name, (kind, pat) in rows.items():
    cells = []
    for b in builds:
        vals = []
        for f in sorted(d.glob(f"{kind}-{b}-*.txt")):
            m = re.search(pat, f.read_text(), re.M)
            if m:
                vals.append(float(m.group(1)))
        cells.append(f"{statistics.median(vals):g} {[round(v, 2) for v in vals]}" if vals else "–")
    print(f"| {name} | " + " | ".join(cells) + " |")
