#!/usr/bin/env python3
"""Medians [rounds] of ab.sh's `nbd qd1 --json` outputs, OLD against NEW (the qpip stack; the
peer's figures of the same rounds for scale), pooled over every DIR given.
python3 qd1_summary.py DIR..."""
import json, statistics, sys
from pathlib import Path
dirs = [Path(a) for a in sys.argv[1:]]
keys = ["randread_iops", "randread_p50_us", "randread_cpu_ms_per_10k_all", "randread_cpu_ms_per_10k_client",
        "randwrite_iops", "randwrite_p50_us", "randwrite_cpu_ms_per_10k_all", "randwrite_cpu_ms_per_10k_client"]
print("| qd1 (qpip stack) | before (main) | after | peer, same rounds (before / after) |")
print("|---|---:|---:|---:|")
for k in keys:
    cells, peers = [], []
    for b in ("OLD", "NEW"):
        js = [json.loads(f.read_text()) for d in dirs for f in sorted(d.glob(f"qd1-{b}-*.json"))]
        v = [j["stacks"]["qpip"][k]["median"] for j in js]
        cells.append(f"{statistics.median(v):.4g} {[round(x) for x in v]}")
        other = [s for s in js[0]["stacks"] if s != "qpip"]
        if other:
            peers.append(f"{statistics.median([j['stacks'][other[0]][k]['median'] for j in js]):.4g}")
    print(f"| {k} | " + " | ".join(cells) + f" | {' / '.join(peers)} |")
