# microsum.py DIR: per micro row and build, median round trip and every thread CPU per round trip (micro --only, --repeat 3 per file)
import re,sys,glob,statistics as st,collections
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    tag=f.split('/')[-1].rsplit('-',1)[0]; row=None
    for l in open(f):
        if l.startswith('== '): row=l[3:].strip()
        m=re.match(r'round trip ([\d.]+) µs, every thread.s CPU ([\d.]+) µs',l)
        if m and row: d[(row,tag)].append((float(m[1]),float(m[2])))
for (row,tag),xs in sorted(d.items()):
    print(f"{row:11} {tag:8} n={len(xs)} rt med {st.median(x[0] for x in xs):6.2f} [{min(x[0] for x in xs):.2f}-{max(x[0] for x in xs):.2f}]  cpu/rt med {st.median(x[1] for x in xs):6.2f}")
