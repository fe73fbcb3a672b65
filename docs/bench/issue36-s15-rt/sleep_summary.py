#!/usr/bin/env python3
"""Per qpip op, for the mount's fuse-ring threads and the server's connection thread: where they
switch out (first syscall-ish frame of the chain) and, for wakings done by them, the path.
usage: sleep_summary.py SCRIPT OPS"""
import sys, collections
MARK = ['do_epoll_wait', 'io_cqring_wait', '__x64_sys_io_uring_enter', 'futex_wait', 'do_sys_poll',
        'sock_def_readable', 'ep_poll_callback', 'io_uring_cmd_done', 'fuse_uring_', 'tcp_sendmsg',
        'do_writev', 'do_readv', 'irqentry_exit', 'exit_to_user_mode_loop', 'raw_spin_rq_unlock',
        'fuse_request_end', 'io_req_task_work_add', '__wake_up_sync_key', 'tcp_recvmsg', 'release_sock']
ops = int(sys.argv[2]); c = collections.Counter(); comm = ev = None; syms = []
def grp(x):
    return 'mount' if x.startswith('fuse-ring') else 'server' if x.startswith('nbd-127') else None
def flush():
    g = grp(comm or '')
    if g and ev:
        marks = [m for m in MARK if any(s.startswith(m) for s in syms)]
        c[(g, ev, ' > '.join(marks[:4]) or (syms[2] if len(syms) > 2 else '?'))] += 1
for l in open(sys.argv[1], errors='replace'):
    if not l.strip(): flush(); comm = ev = None; syms = []; continue
    if not l.startswith('\t'):
        p = l.split(); comm = p[0]; ev = next((x.rstrip(':') for x in p if x.startswith('sched:')), None); continue
    q = l.strip().split(' ', 1); syms.append(q[1] if len(q) > 1 else q[0])
flush()
for k, v in sorted(c.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[1])):
    if v / ops >= 0.01: print('%-7s %-20s %7.3f /op  %s' % (k[0], k[1], v / ops, k[2]))
