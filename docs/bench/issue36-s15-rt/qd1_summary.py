#!/usr/bin/env python3
"""Medians per build tag of qd1 tables in DIR/qd1-TAG-N.txt: IOPS, p50, CPU columns, peer ratio.
usage: qd1_summary.py DIR"""
import re, sys, glob, statistics as st, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + '/qd1-*.txt')):
    tag = re.sub(r'-\d+\.txt$', '', f.split('/qd1-')[1])
    vals = {}
    for l in open(f):
        m = re.match(r'(qpip|qsd-nbdkit)\s+rand(read|write)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)', l)
        if m: vals[(m.group(1), m.group(2))] = [int(x) for x in m.groups()[2:]]
    if len(vals) == 4: rows[tag].append(vals)
cols = ['IOPS', 'p50', 'p99', 'server', 'c-NIC', 'c-app', 'fio', 'all', 'machine']
for tag, rs in rows.items():
    print(f'== {tag} ({len(rs)} rounds)')
    for k in [('qpip', 'read'), ('qpip', 'write'), ('qsd-nbdkit', 'read'), ('qsd-nbdkit', 'write')]:
        print('  %-10s %-5s ' % k + '  '.join('%s %g' % (c, st.median(r[k][i] for r in rs)) for i, c in enumerate(cols))
              + '   IOPS rounds ' + str([r[k][0] for r in rs]))
    for op in ('read', 'write'):
        print('  qpip/qsd IOPS %s: median %.3f rounds %s' % (op, st.median(r[('qpip', op)][0] / r[('qsd-nbdkit', op)][0] for r in rs),
              [round(r[('qpip', op)][0] / r[('qsd-nbdkit', op)][0], 3) for r in rs]))
