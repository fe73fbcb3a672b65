#!/bin/sh
# Interleaved nbd qd1 over four pairings: server build / mount build (b325 = before, brt = after).
# usage: ROUNDS=3 ./mix.sh OUTDIR
set -e
OUT=$1; mkdir -p $OUT
for r in $(seq 1 ${ROUNDS:-3}); do
  for p in b325/b325 brt/brt brt/b325 b325/brt; do
    S=/work/${p%/*}; M=/work/${p#*/}; tag=$(echo $p | tr / -)
    uptime > $OUT/load-$tag-$r.txt
    $S/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
      --server-bin $S/qpip-nbd-server --mount-bin $M/qpip-nbd-mount > $OUT/qd1-$tag-$r.txt 2>&1
  done
done
