#!/bin/sh
# Two server builds against each other (and nbdkit, qemu-nbd) in `nbd raw`, alternating.
# usage: docs/bench/issue36-s13-quiet/ab.sh QPIP_BENCH OLD_SERVER NEW_SERVER OUTDIR [--netns --mtu 1500]
set -eu
T=$1; A=$2; B=$3; O=$4; shift 4; mkdir -p "$O"
for i in 1 2; do
  for s in "$A" "$B"; do
    n=$(basename "$(dirname "$s")")
    "$T" nbd raw --repeat 3 --server-bin "$s" "$@" > "$O/raw-$n-$i.txt" 2>&1
  done
done
grep -H "^qpip \|^nbdkit " "$O"/raw-*.txt
