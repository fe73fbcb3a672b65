#!/usr/bin/env python3
"""Per round trip (110 000 a run) or per 16 KiB message (6 104 a run): medians over the
rounds of profile.sh's perf stat outputs, per row and build. python3 summary.py [DIR]"""
import re, statistics, sys
from collections import defaultdict
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
per = {"tcp": 110_000, "udp": 110_000, "16k": 6_104}
runs = defaultdict(lambda: defaultdict(list))  # (row, build) -> event -> [per unit]
figs = defaultdict(lambda: defaultdict(list))
for f in sorted(d.glob("stat-*.csv")):
    m = re.match(r"stat-(\w+-(tcp|udp|16k))(?:-(B\d))?-(\d)\.csv", f.name)
    row, kind, build = m.group(1), m.group(2), m.group(3) or "B2"
    n = per[kind]
    for line in f.read_text().splitlines():
        p = line.split(",")
        if len(p) < 3 or not p[0] or p[0].startswith("<"):
            continue
        try:
            v = float(p[0])
        except ValueError:
            continue
        ev = p[2].replace("syscalls:sys_enter_", "")
        if ev == "task-clock":
            v *= 1e3  # ms -> µs
        runs[(row, build)][ev].append(v / n)
    out = (d / f.name.replace("stat-", "out-").replace(".csv", ".txt")).read_text()
    for k, pat in [("µs", r"round trip ([\d.]+) µs"), ("cpu µs", r"CPU ([\d.]+) µs"), ("MB/s", r"(\d+) MB/s")]:
        mm = re.search(pat, out)
        if mm:
            figs[(row, build)][k].append(float(mm.group(1)))
for key in sorted(runs):
    evs = runs[key]
    print(f"== {key[0]} {key[1]} ({len(evs['task-clock'])} runs)")
    for k, v in figs[key].items():
        print(f"  {k:28} {statistics.median(v):10.2f}   {v}")
    for ev, v in sorted(evs.items(), key=lambda kv: -statistics.median(kv[1])):
        med = statistics.median(v)
        if med >= 0.005:
            print(f"  {ev:28} {med:10.3f}")
