#!/bin/sh
# Interleaved nbd qd1: before (/work/b325, main 325bcaf) and after (/work/brt, s15-rt f4405f5).
# usage: ROUNDS=3 ./ab.sh OUTDIR
set -e
OUT=$1; mkdir -p $OUT
for r in $(seq 1 ${ROUNDS:-3}); do
  for b in b325 brt; do
    B=/work/$b
    uptime > $OUT/load-$b-$r.txt
    $B/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
      --server-bin $B/qpip-nbd-server --mount-bin $B/qpip-nbd-mount > $OUT/qd1-$b-$r.txt 2>&1
  done
done
