#!/usr/bin/env python3
"""Medians of the runs under docs/bench/qd1-window/: per harness (the tool's 8 s / 1 GiB runs,
its 3 s / 256 MiB runs, the plain script's 3 s / 256 MiB runs), per stack and direction:
IOPS, p50, and qpip's IOPS over qsd-nbdkit's of the same round (median of the per-round
ratios). Usage: summary.py DIR..."""
import re, sys, glob, statistics as st, os
TOOL = re.compile(r'^(qpip|qsd-nbdkit)\s+(randread|randwrite)\s+(\d+)\s+(\d+)\s+(\d+)', re.M)
SCRIPT = re.compile(r'^(\S+) (randread|randwrite): (\d+) IOPS, p50 (\d+) us \| per op: client CPU (\d+) us, server CPU (\d+) us, client csw ([\d.]+), server csw ([\d.]+)', re.M)
runs = {}  # (harness, stack, rw) -> [(iops, p50, extra)] ; ratios[(harness, stack, rw)] -> []
ratios = {}
def add(h, rnd):
    for (stack, rw), v in rnd.items():
        runs.setdefault((h, stack, rw), []).append(v)
        q = rnd.get(('qsd-nbdkit', rw))
        if stack != 'qsd-nbdkit' and q:
            ratios.setdefault((h, stack, rw), []).append(v[0] / q[0])
for d in sys.argv[1:]:
    for f in sorted(glob.glob(os.path.join(d, '*.txt'))):
        t = open(f).read(); name = os.path.basename(f)
        if name.startswith('qd1-') or name.startswith('tool-short'):
            h = 'tool 8 s, 1 GiB' if name.startswith('qd1-') else 'tool 3 s, 256 MiB'
            build = name.split('-')[1] if name.startswith('qd1-') else 'NEW'
            rnd = {}
            for m in TOOL.finditer(t):
                stack = m[1] if m[1] == 'qsd-nbdkit' else build
                rnd[(stack, m[2])] = (int(m[3]), int(m[4]))
            add(h, rnd)
        elif name.startswith('short-') or name.startswith('script-'):
            for part in re.split(r'^round \d+:.*$', t, flags=re.M):
                rnd = {(m[1], m[2]): (int(m[3]), int(m[4]), float(m[7]), float(m[8]), int(m[5]), int(m[6])) for m in SCRIPT.finditer(part)}
                if rnd: add('script 3 s, 256 MiB', rnd)
for k in sorted(runs):
    v = runs[k]
    line = "%-20s %-11s %-9s n=%d  IOPS %6.0f  p50 %3.0f µs" % (k[0], k[1], k[2], len(v), st.median(x[0] for x in v), st.median(x[1] for x in v))
    if len(v[0]) > 2:
        line += "  per op: client csw %.2f server csw %.2f, client CPU %.0f µs server CPU %.0f µs" % tuple(st.median(x[i] for x in v) for i in (2, 3, 4, 5))
    if k in ratios:
        line += "  / qsd-nbdkit %.2f× [%.2f–%.2f]" % (st.median(ratios[k]), min(ratios[k]), max(ratios[k]))
    print(line)
