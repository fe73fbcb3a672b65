# sum.py DIR...: medians per set and variant of run.sh's runs (DIR/TAG-ROUND-VARIANT/ with
# TAG-ROUND-VARIANT.mbs beside it): MB/s, the server's and fio's CPU (ms per 4 GiB), writevs.
import sys, glob, re, statistics, collections, os
rows = collections.defaultdict(list)
for top in sys.argv[1:]:
    for mbs in sorted(glob.glob(top + '/*.mbs')):
        d = mbs[:-4]
        tag, rnd, var = os.path.basename(d).rsplit('-', 2)
        m = re.search(r'MB/s ([\d.]+)', open(mbs).read())
        if not m:
            continue
        srv = fio = wv = 0.0
        for line in open(d + '/srv-stat.txt'):
            f = line.strip().split(',')
            if len(f) > 3 and f[1].replace('.', '').isdigit():
                if f[3] == 'task-clock': srv += float(f[1])
                if f[3] == 'syscalls:sys_enter_writev': wv += float(f[1])
        for line in open(d + '/fio-stat.txt'):
            f = line.strip().split(',')
            if len(f) > 2 and f[2] == 'task-clock': fio = float(f[0])
        rows[(tag, var)].append((float(m[1]), srv, fio, wv))
for (tag, var), xs in sorted(rows.items()):
    med = lambda i: statistics.median(x[i] for x in xs)
    print(f"{tag:5} {var:7} n={len(xs)}  MB/s {med(0):6.0f} [{' '.join(f'{x[0]:.0f}' for x in xs)}]  server ms {med(1):6.0f}  fio ms {med(2):5.0f}  writev {med(3):6.0f}")
