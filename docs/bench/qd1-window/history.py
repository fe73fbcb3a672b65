#!/usr/bin/env python3
"""Every `qpip-bench nbd qd1` table under docs/bench (run from there), one line per run and
direction, sorted by how much CPU the machine spent beyond the two stacks' own ("other":
(machine - all) / all; at or below zero the machine was quiet): qpip's IOPS over
qsd-nbdkit's and both p50s."""
import glob, re
ROW = re.compile(r'^(qpip|qsd-nbdkit)\s+(randread|randwrite)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+'
                 r'(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)', re.M)
rows = []
for f in sorted(glob.glob('**/qd1*.txt', recursive=True)):
    q = {(m[1], m[2]): (int(m[3]), int(m[4]), int(m[10]), int(m[11])) for m in ROW.finditer(open(f).read())}
    for rw in ('randread', 'randwrite'):
        if ('qpip', rw) in q and ('qsd-nbdkit', rw) in q:
            a, b = q[('qpip', rw)], q[('qsd-nbdkit', rw)]
            rows.append(((a[3] - a[2]) / a[2], a[0] / b[0], a[1], b[1], rw, f))
for r in sorted(rows):
    print("other %5.2f  qpip/qsd IOPS %.2f  p50 qpip %3d qsd %3d µs  %-9s %s" % r)
