# ttcpsum.py DIR: per ttcp row and build, median MB/s and CPU per GB (application + NIC) of `micro --only qp-16k ...` runs
import re,sys,glob,statistics as st,collections
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    tag=f.split('/')[-1].rsplit('-',1)[0]; row=None
    for l in open(f):
        if l.startswith('== '): row=l[3:].strip()
        m=re.match(r'(\d+) MB/s, CPU per GB: application ([\d.]+) s, NIC ([\d.]+) s',l)
        if m and row: d[(row,tag)].append((int(m[1]),float(m[2])+float(m[3])))
for (row,tag),xs in sorted(d.items()):
    print(f"{row:11} {tag:8} n={len(xs)} MB/s med {st.median(x[0] for x in xs):6.0f} [{min(x[0] for x in xs)}-{max(x[0] for x in xs)}]  CPU s/GB med {st.median(x[1] for x in xs):.3f}")
