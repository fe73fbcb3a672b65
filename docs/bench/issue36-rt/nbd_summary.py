#!/usr/bin/env python3
"""Medians [rounds] of nbd.sh's outputs, OLD against NEW: python3 nbd_summary.py [DIR]"""
import re, statistics, sys
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else "nbd")
rows = {
    "qd1 reads IOPS": ("qd1", r"^qpip\s+randread\s+(\d+)"),
    "qd1 reads p50 µs": ("qd1", r"^qpip\s+randread\s+\d+\s+(\d+)"),
    "qd1 reads every thread CPU-ms/10k": ("qd1", r"^qpip\s+randread.*\|\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)\s+\|"),
    "qd1 writes IOPS": ("qd1", r"^qpip\s+randwrite\s+(\d+)"),
    "qd1 writes p50 µs": ("qd1", r"^qpip\s+randwrite\s+\d+\s+(\d+)"),
    "qd1 writes every thread CPU-ms/10k": ("qd1", r"^qpip\s+randwrite.*\|\s+\d+\s+\d+\s+\d+\s+\d+\s+(\d+)\s+\|"),
    "raw 1 conn write MB/s": ("raw1", r"^qpip\s+write\s+(\d+)"),
    "raw 1 conn write server s/GB": ("raw1", r"^qpip\s+write\s+\d+ \[\S+\]\s+([\d.]+)"),
    "raw 1 conn read MB/s": ("raw1", r"^qpip\s+read\s+(\d+)"),
    "raw 1 conn read server s/GB": ("raw1", r"^qpip\s+read\s+\d+ \[\S+\]\s+([\d.]+)"),
    "raw 4 conn write MB/s": ("raw4", r"^qpip\s+write\s+(\d+)"),
    "raw 4 conn write server s/GB": ("raw4", r"^qpip\s+write\s+\d+ \[\S+\]\s+([\d.]+)"),
    "raw 4 conn read MB/s": ("raw4", r"^qpip\s+read\s+(\d+)"),
    "raw 4 conn read server s/GB": ("raw4", r"^qpip\s+read\s+\d+ \[\S+\]\s+([\d.]+)"),
}
print("| measure | before (main) | after |")
print("|---|---:|---:|")
for name, (kind, pat) in rows.items():
    cells = []
    for b in ("OLD", "NEW"):
        vals = []
        for f in sorted(d.glob(f"{kind}-{b}-*.txt")):
            m = re.search(pat, f.read_text(), re.M)
            if m:
                vals.append(float(m.group(1)))
        cells.append(f"{statistics.median(vals):g} {[round(v, 3) for v in vals]}" if vals else "–")
    print(f"| {name} | " + " | ".join(cells) + " |")
