# ext2sum.py DIR: per build, median MB/s, MB/CPU-s and its ratio to the same run nbdkit row, for qpip and qpip-direct
import re,sys,glob,statistics as st,collections
d=collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1]+'/*.txt')):
    tag=f.split('/')[-1].rsplit('-',1)[0]; rows={}
    for l in open(f):
        m=re.match(r'(qpip-direct|qpip|nbdkit)\s+(write|read)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|',l)
        if m: rows[(m[1],m[2])]=(int(m[3]),int(m[5]))
    for st_ in ('qpip','qpip-direct'):
        for dr in ('write','read'):
            if (st_,dr) in rows and ('nbdkit',dr) in rows:
                q=rows[(st_,dr)];k=rows[('nbdkit',dr)]
                d[(tag,st_,dr)].append((q[0],q[1],q[1]/k[1]))
for (tag,s_,dr),xs in sorted(d.items()):
    print(f"{tag:8} {s_:11} {dr:5} MB/s {st.median(x[0] for x in xs):5.0f} MB/CPU-s {st.median(x[1] for x in xs):5.0f} ratio {st.median(x[2] for x in xs):.2f} [{' '.join('%.2f'%x[2] for x in xs)}]")
