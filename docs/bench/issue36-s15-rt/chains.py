#!/usr/bin/env python3
"""Samples per qpip op whose call chain holds a given kernel function, per thread group,
from `perf script -F comm,ip,sym` of a -g profile (999 Hz: a sample ~ 1 ms).
usage: chains.py SCRIPT OPS"""
import sys, collections
KEYS = ['lock_sock_nested', '__lock_sock', 'release_sock', '__release_sock', 'tcp_add_backlog',
        'sk_add_backlog', '_raw_spin_lock_bh', 'tcp_recvmsg', 'tcp_sendmsg', 'sock_def_readable',
        'ep_poll_callback', 'try_to_wake_up', 'do_epoll_wait', 'schedule', 'do_readv', 'do_writev',
        'tcp_v4_rcv', 'net_rx_action', 'tcp_ack', 'io_uring_enter', '__x64_sys_io_uring_enter',
        'finish_task_switch.isra.0', '_raw_spin_unlock_irqrestore', 'tcp_rcv_established',
        'tcp_data_queue', 'fuse_uring_cmd', 'fuse_dev_do_read', '__vdso_clock_gettime']
def g(c):
    if c.startswith('nbd-127'): return 'server-conn'
    if c.startswith('fuse-ring'): return 'mount-fuse-ring'
    return None
ops = int(sys.argv[2]); tot = collections.Counter(); hit = collections.Counter(); leaf = collections.Counter()
comm = None; syms = []
def flush():
    grp = g(comm or '')
    if grp and syms:
        tot[grp] += 1; leaf[(grp, syms[0])] += 1
        for k in set(syms) & set(KEYS): hit[(grp, k)] += 1
for l in open(sys.argv[1], errors='replace'):
    if not l.strip():
        flush(); comm = None; syms = []; continue
    if not l.startswith('\t'):
        comm = l.strip(); continue
    parts = l.strip().split(' ', 1)
    syms.append(parts[1] if len(parts) > 1 else parts[0])
flush()
for grp in sorted(tot):
    print(f'{grp}: {tot[grp]} samples, {tot[grp]*1001/ops:.2f} us/op')
    for k in KEYS:
        if hit[(grp, k)]: print('   %-32s %6d  %.3f us/op  (in chain)' % (k, hit[(grp, k)], hit[(grp, k)] * 1001 / ops))
    for (gg, s), v in leaf.most_common():
        if gg == grp and v >= 0.01 * tot[grp]: print('   leaf %-40s %6d  %.3f us/op' % (s[:40], v, v * 1001 / ops))
