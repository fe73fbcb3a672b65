#!/bin/sh
# Issue 36's table on an idle machine, two builds alternating (session 14): session 13's run.sh
# (micro, nbd raw over loopback and veth MTU 1500, nbd qd1) plus nbd ext2, for each build in turn.
# usage: docs/bench/issue36-s14-quiet/retake.sh OUTDIR ROUNDS NAME=BINDIR...   (root; each
# BINDIR holds release qpip-bench, qpip-nbd-server, qpip-nbd-mount)
set -eu
O=$1; R=$2; shift 2; D=$(dirname "$0")
for r in $(seq 1 "$R"); do
  for spec in "$@"; do
    n=${spec%%=*}; b=${spec#*=}
    "$D/../issue36-s13-quiet/run.sh" "$b" "$O/$n-$r"
    uptime > "$O/$n-$r/ext2.load"
    "$b/qpip-bench" nbd ext2 --repeat 1 --no-plot > "$O/$n-$r/ext2.txt" 2>&1
    uptime >> "$O/$n-$r/ext2.load"
  done
done
