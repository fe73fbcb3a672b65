#!/usr/bin/env python3
"""mcsum.py FILE...: medians of mc.sh's lines ("WHAT RW QD IOPS"), per what, rw and queue
depth, with every run's figure, and each one's ratio to qsd's median where qsd ran."""
import statistics
import sys
from collections import defaultdict

runs = defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path):
        *what, rw, qd, iops = line.split()
        if iops.isdigit():
            runs[(" ".join(what), rw, int(qd))].append(int(iops))
med = {k: statistics.median(v) for k, v in runs.items()}
for (what, rw, qd), v in sorted(runs.items(), key=lambda kv: (kv[0][1], -kv[0][2], kv[0][0])):
    peer = med.get(("qsd", rw, qd))
    ratio = f" {med[(what, rw, qd)] / peer:.2f}x qsd" if peer and what != "qsd" else ""
    print(f"{what:16} {rw:9} QD{qd:<3} {med[(what, rw, qd)]:8.0f}{ratio}  {v}")
