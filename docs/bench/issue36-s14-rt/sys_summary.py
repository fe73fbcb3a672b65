#!/usr/bin/env python3
"""Per 4 KiB write (the server's pwrite64 in the same 3 s): system calls, context switches
and task-clock µs of the mount and the server, medians over rounds. python3 sys_summary.py DIR"""
import re, statistics, sys
from collections import defaultdict
from pathlib import Path
d = Path(sys.argv[1]); per = defaultdict(lambda: defaultdict(list))
def vals(f):
    out = {}
    for line in f.read_text().splitlines():
        p = line.split(",")
        if len(p) >= 3 and p[0] and not p[0].startswith(("<", "#")):
            try: out[p[2].replace("syscalls:sys_enter_", "")] = float(p[0])
            except ValueError: pass
    return out
for f in sorted(d.glob("sys-server-*.csv")):
    _, _, build, r = f.stem.split("-")
    n = vals(f)["pwrite64"]
    for side in ("mount", "server"):
        for ev, v in vals(d / f"sys-{side}-{build}-{r}.csv").items():
            per[(side, build)][ev].append(v * (1e3 if ev == "task-clock" else 1) / n)
for key in sorted(per):
    evs = per[key]
    print(f"== {' '.join(key)} ({len(evs['task-clock'])} rounds)")
    for ev, v in sorted(evs.items(), key=lambda kv: -statistics.median(kv[1])):
        if statistics.median(v) >= 0.01:
            print(f"  {ev:22} {statistics.median(v):8.2f}  {[round(x, 2) for x in v]}")
