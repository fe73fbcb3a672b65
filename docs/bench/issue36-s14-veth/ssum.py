#!/usr/bin/env python3
"""ssum.py DIR...: from prof.sh's ss.txt, per sample the server socket's Recv-Q and the client's
Send-Q; prints medians and how often the client had nothing unsent (Send-Q 0)."""
import re, statistics, sys
for d in sys.argv[1:]:
    srv_rq, cli_sq, cli_unacked, drops, cwnd = [], [], [], [], []
    blocks = open(f"{d}/ss.txt").read().split("== ")[1:]
    for b in blocks:
        rows = re.findall(r"ESTAB\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s*\n\s*(.*)", b)
        if len(rows) < 2:
            continue
        s, c = rows[0], rows[1]
        srv_rq.append(int(s[0])); cli_sq.append(int(c[1]))
        m = re.search(r"unacked:(\d+)", c[4]); cli_unacked.append(int(m.group(1)) if m else 0)
        m = re.search(r",d(\d+)\)", s[4]); drops.append(int(m.group(1)) if m else 0)
    if not srv_rq:
        continue
    med = statistics.median
    print(f"{d}: samples {len(srv_rq)} server Recv-Q median {med(srv_rq)/1e3:.0f} KB; client Send-Q median "
          f"{med(cli_sq)/1e3:.0f} KB, zero in {sum(1 for x in cli_sq if x == 0)/len(cli_sq):.0%}; unacked median "
          f"{med(cli_unacked)}; server drops at end {drops[-1]}")
