#!/usr/bin/env python3
"""Pool qd1 rounds by (server build, mount build) over ab-* (b325 = b325/b325, brt = brt/brt)
and mix-* directories: medians of IOPS, server and c-app CPU per 10 000 ops, qpip/qsd ratio."""
import re, glob, statistics as st, collections
P = collections.defaultdict(list)
for f in sorted(glob.glob('ab-[1-9]*/qd1-*.txt') + glob.glob('mix-*/qd1-*.txt')):
    tag = re.sub(r'-\d+\.txt$', '', f.split('/qd1-')[1])
    pair = {'b325': 'b325-b325', 'brt': 'brt-brt'}.get(tag, tag)
    v = {}
    for l in open(f):
        m = re.match(r'(qpip|qsd-nbdkit)\s+rand(read|write)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)', l)
        if m: v[(m.group(1), m.group(2))] = [int(x) for x in m.groups()[2:]]
    if len(v) == 4: P[pair].append(v)
print('server/mount  n | read IOPS [min-max]  ratio  srv  c-app  all | write IOPS [min-max] ratio  srv  c-app  all')
for pair in ['b325-b325', 'brt-brt', 'brt-b325', 'b325-brt']:
    rs = P[pair]; out = '%-12s %2d |' % (pair, len(rs))
    for op in ('read', 'write'):
        q = [r[('qpip', op)] for r in rs]
        out += ' %6.0f [%d-%d] %5.3f %4.0f %5.0f %4.0f |' % (st.median(x[0] for x in q), min(x[0] for x in q), max(x[0] for x in q),
            st.median(r[('qpip', op)][0] / r[('qsd-nbdkit', op)][0] for r in rs),
            st.median(x[3] for x in q), st.median(x[5] for x in q), st.median(x[7] for x in q))
    print(out)
