#!/usr/bin/env python3
"""absum.py OUT: medians of ab.sh's rounds per link and build: qpip's and nbdkit's MB/s, server
and fio CPU per GB (s), and qpip / nbdkit of each round, for writes and reads; with the load."""
import collections, glob, os, re, statistics, sys
out = sys.argv[1]
rows = collections.defaultdict(list)
for f in sorted(glob.glob(out + '/raw-*-*-*.txt')):
    _, link, build, r = os.path.basename(f)[:-4].split('-')
    got = {}
    for l in open(f):
        m = re.match(r'(qpip|nbdkit)\s+(write|read)\s+(\d+) \[.*?\]\s+([\d.]+) \[.*?\]\s+([\d.]+)', l)
        if m:
            got[(m[1], m[2])] = (float(m[3]), float(m[4]), float(m[5]))
    load = open(f'{out}/load-{link}-{build}-{r}.txt').read().split('average:')[1].split(',')[0].strip()
    rows[(link, build)].append((got, float(load)))
med = statistics.median
print('link      build  dir    qpip MB/s [rounds]                 nbdkit MB/s  ratio(median of rounds)  srv CPU q/n   fio CPU q/n   load')
for (link, build), v in sorted(rows.items()):
    for d in ('write', 'read'):
        q = [g[('qpip', d)] for g, _ in v if ('qpip', d) in g]
        n = [g[('nbdkit', d)] for g, _ in v if ('nbdkit', d) in g]
        ratio = [a[0] / b[0] for a, b in zip(q, n)]
        print(f'{link:9} {build:5}  {d:5}  {med(x[0] for x in q):6.0f} {str([round(x[0]) for x in q]):26} {med(x[0] for x in n):6.0f}      {med(ratio):.2f} {str([round(x, 2) for x in ratio]):22} '
              f'{med(x[1] for x in q):.3f}/{med(x[1] for x in n):.3f} {med(x[2] for x in q):.3f}/{med(x[2] for x in n):.3f}  {med(l for _, l in v):.1f}')
