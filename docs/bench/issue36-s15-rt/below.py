#!/usr/bin/env python3
"""For samples of one thread group whose chain holds FUNC: the frame just below FUNC (its callee
on the path to the leaf) and the leaf, per qpip op.  usage: below.py SCRIPT OPS GROUPPREFIX FUNC"""
import sys, collections
scr, ops, pre, func = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
below = collections.Counter(); comm = None; syms = []; n = 0
def flush():
    global n
    if comm and comm.startswith(pre) and func in syms:
        i = syms.index(func); n += 1
        below[('callee', syms[i - 1] if i > 0 else '(self)')] += 1
        below[('leaf', syms[0])] += 1
for l in open(scr, errors='replace'):
    if not l.strip(): flush(); comm = None; syms = []; continue
    if not l.startswith('\t'): comm = l.strip(); continue
    p = l.strip().split(' ', 1); syms.append(p[1] if len(p) > 1 else p[0])
flush()
print(f'{pre} {func}: {n} samples {n*1001/ops:.3f} us/op')
for (k, s), v in below.most_common(24): print('  %-6s %-45s %5d %.3f us/op' % (k, s[:45], v, v * 1001 / ops))
