#!/usr/bin/env python3
"""Per-op system calls and context switches per thread group from `perf report --sort comm -n`
of a `perf record -c 1 -e syscalls:...` run (prof/sys-comm-TAG.txt), ops = qpip rows'
(read IOPS + write IOPS) * 5 s from prof/qd1-sys-TAG.txt.  usage: sys_summary.py DIR TAG..."""
import re, sys
def groups(comm):
    if comm.startswith('nbd-127'): return 'server conn'
    if comm.startswith('qpip-nbd-serv'): return 'server other'
    if comm.startswith('fuse-ring'): return 'mount fuse-ring'
    if comm.startswith('qpip-nbd-moun'): return 'mount other'
    if comm.startswith('qpip-soft-nic'): return 'soft-nic (either)'
    return None
d = sys.argv[1]
for tag in sys.argv[2:]:
    ops = 0
    for l in open(f'{d}/qd1-sys-{tag}.txt'):
        m = re.match(r'qpip\s+rand(read|write)\s+(\d+)', l)
        if m: ops += int(m.group(2)) * 5
    ev = None; tab = {}
    for l in open(f'{d}/sys-comm-{tag}.txt'):
        m = re.match(r"# Samples: .* of event '([^']+)'", l)
        if m: ev = m.group(1).replace('syscalls:sys_enter_', ''); continue
        m = re.match(r'\s+[\d.]+%\s+(\d+)\s+(.+?)\s*$', l)
        if m and ev:
            g = groups(m.group(2))
            if g: tab.setdefault(g, {}).setdefault(ev, 0); tab[g][ev] += int(m.group(1))
    print(f'== {tag}: qpip ops {ops}')
    evs = sorted({e for g in tab.values() for e in g})
    print('%-18s' % 'group' + ''.join('%14s' % e[:13] for e in evs))
    for g in sorted(tab):
        print('%-18s' % g + ''.join('%14.3f' % (tab[g].get(e, 0) / ops) for e in evs))
