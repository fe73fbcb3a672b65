# qd1sum.py DIR: per build (file BUILD-ROUND.txt), medians of qpip IOPS, qpip/qsd-nbdkit ratio, server/c-app/all CPU-ms per 10 000 ops
import re,sys,glob,statistics as st,collections
rows=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    tag=f.split('/')[-1].rsplit('-',1)[0]
    v={}
    for l in open(f):
        m=re.match(r'(qpip|qsd-nbdkit)\s+rand(read|write)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)',l)
        if m: v[(m[1],m[2])]=[int(x) for x in m.groups()[2:]]
    if len(v)==4: rows[tag].append(v)
for tag,rs in rows.items():
    for op in ('read','write'):
        q=[r[('qpip',op)] for r in rs]; k=[r[('qsd-nbdkit',op)] for r in rs]
        print(f"{tag:8} {op:5} n={len(rs)} IOPS {st.median(x[0] for x in q):6.0f} ratio {st.median(a[0]/b[0] for a,b in zip(q,k)):.3f} [{' '.join('%.2f'%(a[0]/b[0]) for a,b in zip(q,k))}] server {st.median(x[3] for x in q)} c-app {st.median(x[5] for x in q)} all {st.median(x[7] for x in q)}  IOPS {[x[0] for x in q]}")
