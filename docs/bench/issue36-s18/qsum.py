# qsum.py DIR BUILD...: medians of qd1ab.sh runs DIR/BUILD-RW-ROUND: IOPS (every round),
# server and mount CPU per operation (µs).
import glob,statistics as st,sys
d0=sys.argv[1]; builds=sys.argv[2:]
for rw in ['randread','randwrite']:
  for b in builds:
    xs=[];ios=[]
    for d in sorted(glob.glob(f'{d0}/{b}-{rw}-*')):
        f=open(d+'/fio.txt').read().split(';'); i=int(f[7] if rw=='randread' else f[48]); srv,mnt=map(int,open(d+'/cpu.txt').read().split())
        ops=i*3; xs.append((srv/ops, mnt/ops)); ios.append(i)
    print(f"{rw:9} {b:8} IOPS {st.median(ios):7.0f} {sorted(ios)} srv us/op {st.median(x[0] for x in xs):5.1f} mnt us/op {st.median(x[1] for x in xs):5.1f}")
