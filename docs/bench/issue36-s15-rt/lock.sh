#!/bin/sh
# Contended locks (lock:contention_begin, with call chains) during one nbd qd1 run.
# usage: ./lock.sh BUILD OUTDIR TAG
set -e
B=/work/$1; OUT=$2; TAG=$3; mkdir -p $OUT
uptime > $OUT/load-lock-$TAG.txt
perf record -a -g -c 1 -e lock:contention_begin -o /tmp/s15-rt/lock-$TAG.data \
  -- $B/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
     --server-bin $B/qpip-nbd-server --mount-bin $B/qpip-nbd-mount > $OUT/qd1-lock-$TAG.txt 2>&1
perf report -i /tmp/s15-rt/lock-$TAG.data --sort comm -n --stdio -g none 2>/dev/null | grep -v '^$' > $OUT/lock-comm-$TAG.txt
perf report -i /tmp/s15-rt/lock-$TAG.data --comms "$(grep -oE 'nbd-127[^ ]*' $OUT/lock-comm-$TAG.txt | head -1),fuse-ring-0.4,fuse-ring-0.5,fuse-ring-1.4,fuse-ring-1.5" \
  --sort comm,sym --no-children -g caller,1,callee,function,percent -n --stdio 2>/dev/null | grep -v '^$' | head -400 > $OUT/lock-chains-$TAG.txt
