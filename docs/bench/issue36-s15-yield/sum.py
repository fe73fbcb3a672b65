# sum.py DIR: medians of the qpip write/read rows per variant (file name VARIANT-ROUND.txt),
# the ratio to the same run's nbdkit row, and server + fio CPU per GB.
import sys,glob,re,statistics,collections
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    v=f.split('/')[-1].rsplit('-',1)[0]
    rows={}
    for line in open(f):
        m=re.match(r'(qpip|nbdkit)\s+(write|read)\s+(\d+) \[.*?\]\s+([\d.]+) \[.*?\]\s+([\d.]+)',line)
        if m: rows[(m[1],m[2])]=(int(m[3]),float(m[4]),float(m[5]))
    for dr in ('write','read'):
        if ('qpip',dr) in rows and ('nbdkit',dr) in rows:
            q=rows[('qpip',dr)];k=rows[('nbdkit',dr)]
            d[(v,dr)].append((q[0],q[0]/k[0],q[1]+q[2],k[1]+k[2]))
for (v,dr),xs in sorted(d.items()):
    print(f"{v:5} {dr:5} n={len(xs)} MB/s med {statistics.median(x[0] for x in xs):6.0f}  ratio med {statistics.median(x[1] for x in xs):.2f} [{min(x[1] for x in xs):.2f}-{max(x[1] for x in xs):.2f}]  srv+fio s/GB {statistics.median(x[2] for x in xs):.3f} (nbdkit {statistics.median(x[3] for x in xs):.3f})  all: {' '.join(str(x[0]) for x in xs)}")
