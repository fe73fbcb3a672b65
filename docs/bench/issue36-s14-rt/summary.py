#!/usr/bin/env python3
"""Medians per row and build of rtt.sh's outputs: round trip, every thread's CPU, and system
calls / context switches / task-clock per round trip (COUNT*1.1 round trips a run).
python3 summary.py DIR [COUNT]"""
import re, statistics, sys
from collections import defaultdict
from pathlib import Path
d = Path(sys.argv[1]); n = int(sys.argv[2]) * 1.1 if len(sys.argv) > 2 else 110_000
runs = defaultdict(lambda: defaultdict(list)); figs = defaultdict(lambda: defaultdict(list))
for f in sorted(d.glob("stat-*.csv")):
    m = re.match(r"stat-(.+?)(?:-(OLD|NEW))?-(\d+)\.csv", f.name)
    key = (m.group(1), m.group(2) or "-")
    for line in f.read_text().splitlines():
        p = line.split(",")
        if len(p) < 3 or not p[0] or p[0].startswith("<"):
            continue
        try: v = float(p[0])
        except ValueError: continue
        ev = p[2].replace("syscalls:sys_enter_", "")
        if ev == "task-clock": v *= 1e3
        runs[key][ev].append(v / n)
    out = (d / f.name.replace("stat-", "out-").replace(".csv", ".txt")).read_text()
    for k, pat in [("rtt µs", r"round trip ([\d.]+) µs"), ("cpu µs", r"CPU ([\d.]+) µs")]:
        mm = re.search(pat, out)
        if mm: figs[key][k].append(float(mm.group(1)))
for key in sorted(runs):
    print(f"== {key[0]} {key[1]} ({len(runs[key]['task-clock'])} runs)")
    for k, v in figs[key].items():
        print(f"  {k:24} {statistics.median(v):9.2f}   {v}")
    for ev, v in sorted(runs[key].items(), key=lambda kv: -statistics.median(kv[1])):
        if statistics.median(v) >= 0.005:
            print(f"  {ev:24} {statistics.median(v):9.3f}")
