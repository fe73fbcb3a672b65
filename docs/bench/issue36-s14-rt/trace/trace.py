#!/usr/bin/env python3
"""Per thread medians from perf script of run.sh: look to look, read EAGAIN and hit, send (readv/writev, or the
socket rows' recvfrom/sendto), and from
the hit's exit to the next writev's entry. python3 trace.py TRACE.txt"""
import re, statistics, sys
from collections import defaultdict
ev = defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"\s*(\d+)\s+([\d.]+):\s+syscalls:sys_(enter|exit)_(readv|writev|recvfrom|sendto):\s*(\S+)", line)
    if not m: continue
    tid, t, kind, call, arg = m.groups()
    call = {"recvfrom": "readv", "sendto": "writev"}.get(call, call)  # the socket rows
    ev[int(tid)].append((float(t)*1e6, kind, call, arg))
res = defaultdict(list)
for tid, es in ev.items():
    last_hit = None; last_look = None
    for i, (t, kind, call, arg) in enumerate(es):
        if kind == "exit" and call == "readv":
            ret = int(arg, 16)
            if ret < (1 << 63) and ret > 0: last_hit = t
        if kind == "enter" and call == "writev" and last_hit is not None:
            res[(tid, "hit exit -> next writev enter")].append(t - last_hit); last_hit = None
        if kind == "enter" and call == "readv":
            if last_look is not None and t - last_look < 5: res[(tid, "look to look (enter->enter, <5us)")].append(t - last_look)
            last_look = t
        if kind == "exit" and call == "readv" and i and es[i-1][1] == "enter":
            ret = int(arg, 16)
            res[(tid, "readv EAGAIN" if ret >= (1<<63) else "readv hit")].append(t - es[i-1][0])
        if kind == "exit" and call == "writev" and es[i-1][2] == "writev":
            res[(tid, "writev")].append(t - es[i-1][0])
for k in sorted(res):
    v = res[k]
    if len(v) > 100: print(k, len(v), "median %.2f us" % statistics.median(v))
