#!/usr/bin/env python3
"""Medians of run.sh's outputs: summary.py OUT"""
import glob, os, re, statistics, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "raw-*.txt"))):
    _, link, build, rnd = os.path.basename(f)[:-4].split("-")
    for line in open(f):
        m = re.match(r"^(qpip|nbdkit)\s+(write|read)\s+(\d+) \[.*?\]\s+([\d.]+) \[.*?\]\s+([\d.]+)", line)
        if m:
            srv, d, mbs, scpu, fcpu = m.groups()
            rows.setdefault((link, d, build, srv), []).append((int(mbs), float(scpu), float(fcpu)))
for (link, d, build, srv), v in sorted(rows.items()):
    med = lambda i: statistics.median(x[i] for x in v)
    print(f"{link:8} {d:5} {build:6} {srv:6} MB/s {med(0):6.0f} {[x[0] for x in v]}  server s/GB {med(1):.3f}  fio s/GB {med(2):.3f}  all {med(1)+med(2):.3f}")
# per-round ratio qpip/nbdkit
for link in ("loopback", "netns"):
    for d in ("write", "read"):
        for build in ("before", "after"):
            q = rows.get((link, d, build, "qpip"), []); k = rows.get((link, d, build, "nbdkit"), [])
            r = [a[0] / b[0] for a, b in zip(q, k)]
            if r:
                print(f"ratio {link:8} {d:5} {build:6} qpip/nbdkit median {statistics.median(r):.2f} {[round(x, 2) for x in r]}")
