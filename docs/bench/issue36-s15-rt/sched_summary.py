#!/usr/bin/env python3
"""Per qpip op: wakings by waker->wakee group, sleeps (sched_switch prev_state S/D) vs
preemptions (R) per group, IPIs sent per group.  usage: sched_summary.py TXT QD1TXT"""
import re, sys, collections
def g(c):
    c = c.strip()
    if c.startswith('nbd-127'): return 'server-conn'
    if c.startswith('fuse-ring'): return 'mount-fuse-ring'
    if c.startswith('qpip-soft-nic'): return 'soft-nic'
    if c.startswith('fio'): return 'fio'
    if c.startswith('swapper'): return 'idle'
    if c.startswith(('qemu-storage','nbdkit','pool','worker')): return 'peer'
    return 'other'
ops = 0
for l in open(sys.argv[2]):
    m = re.match(r'qpip\s+rand(read|write)\s+(\d+)', l)
    if m: ops += int(m.group(2)) * 5
cnt = collections.Counter()
for l in open(sys.argv[1]):
    m = re.match(r'\s*(.+?)\s+\[(\d+)\]\s+(\S+):\s*(.*)$', l)
    if not m: continue
    comm, cpu, ev, tr = m.groups(); src = g(comm)
    if ev == 'sched:sched_waking':
        t = re.search(r'comm=(.+?) pid=', tr); cnt[('waking', src, g(t.group(1)) if t else '?')] += 1
    elif ev == 'sched:sched_switch':
        pc = re.search(r'prev_comm=(.+?) prev_pid=.*prev_state=(\S+)', tr)
        if pc: cnt[('switch-out', g(pc.group(1)), 'R(preempted)' if pc.group(2).startswith('R') else 'sleep')] += 1
    else:
        cnt[(ev.split(':')[1], src, '')] += 1
print(f'qpip ops {ops} (counts include the qsd-nbdkit row: read only the qpip groups)')
for k, v in sorted(cnt.items()):
    if k[1] in ('server-conn', 'mount-fuse-ring', 'soft-nic', 'fio') or k[2] in ('server-conn', 'mount-fuse-ring'):
        print('%-26s %-16s %-16s %8.3f /op' % (k[0], k[1], k[2], v / ops))
