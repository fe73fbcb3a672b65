#!/usr/bin/env python3
"""sum.py OUT...: medians per build of prof.sh's runs OUT/NAME-ROUND: MB/s, server and fio CPU
per GB (perf stat task-clock of every server thread, and of the fio process), and per 256 KiB
request the server's context switches and system calls, fio's context switches, and the
order-3 page allocations fio's context took from the zone under its lock (kmem events when
prof.sh ran with FIO_EVENTS)."""
import collections, glob, json, os, statistics, sys

def load(path):
    d = collections.Counter()
    for l in open(path):
        f = l.strip().split(',')
        if l.startswith('#') or len(f) < 3:
            continue
        # Per-thread lines (the server) start with the thread's name, the others with the value.
        try:
            v, ev = float(f[0]), f[2]
        except ValueError:
            try:
                v, ev = float(f[1]), f[3]
            except ValueError:
                continue
        ev = ev.replace('syscalls:sys_enter_', '').replace('kmem:mm_', '')
        d[ev] += v
    return d

res = collections.defaultdict(list)
for out in sys.argv[1:]:
    for d in sorted(glob.glob(out + '/*-*')):
        if not os.path.isdir(d):
            continue
        name = os.path.basename(d).rsplit('-', 1)[0]
        s, f = load(d + '/srv-stat.txt'), load(d + '/fio-stat.txt')
        t = open(d + '/fio.json').read()
        j = json.loads(t[t.index('{'):])['jobs'][0]
        rw = 'read' if j['read']['io_bytes'] else 'write'
        gb = j[rw]['io_bytes'] / 1e9
        reqs = j[rw]['io_bytes'] / (256 << 10)
        res[(out, name)].append(dict(
            mbs=j[rw]['bw_bytes'] / 1e6, srv=s['task-clock'] / 1e3 / gb, fio=f['task-clock'] / 1e3 / gb,
            cs=s['context-switches'] / reqs, spl=s['splice'] / reqs, ep=s['epoll_wait'] / reqs,
            rd=(s['readv'] + s['read']) / reqs, ssopt=s['setsockopt'] / reqs,
            fiocs=f['context-switches'] / reqs, zlock=f['page_alloc_zone_locked'] / reqs))
keys = ['mbs', 'srv', 'fio', 'cs', 'spl', 'ep', 'rd', 'ssopt', 'fiocs', 'zlock']
print('%-28s' % 'median of rounds', ' '.join('%7s' % k for k in keys))
for k, v in sorted(res.items()):
    print('%-28s' % ('%s %s (%d)' % (os.path.basename(k[0]), k[1], len(v))),
          ' '.join('%7.3g' % statistics.median(x[c] for x in v) for c in keys),
          ' MB/s:', [round(x['mbs']) for x in v])
