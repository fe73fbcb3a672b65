# microsum.py DIR: per micro row and build (files BUILD-ROUND.txt of `micro --only ROW` runs),
# medians of the round trip and every thread's CPU per round trip, or of ttcp's MB/s and CPU per GB
import re,sys,glob,statistics as st,collections
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    tag=f.split('/')[-1].rsplit('-',1)[0]; row=None
    for l in open(f):
        if l.startswith('== '): row=l[3:].strip()
        m=re.match(r'round trip ([\d.]+) µs, every thread.s CPU ([\d.]+) µs',l)
        if m and row: d[(row,tag)].append((float(m[1]),float(m[2])))
        m=re.match(r'(\d+) MB/s, CPU per GB: application ([\d.]+) s, NIC ([\d.]+) s',l)
        if m and row: d[(row,tag)].append((float(m[1]),float(m[2])+float(m[3])))
for (row,tag),xs in sorted(d.items()):
    what=('MB/s','CPU s/GB') if row.endswith('k') else ('rt µs','cpu/rt µs')
    print(f"{row:11} {tag:8} n={len(xs)} {what[0]} med {st.median(x[0] for x in xs):7.2f} [{min(x[0] for x in xs):.2f}-{max(x[0] for x in xs):.2f}]  {what[1]} med {st.median(x[1] for x in xs):6.3f}")
