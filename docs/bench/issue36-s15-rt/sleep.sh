#!/bin/sh
# Where the mount's and the server's threads sleep and who wakes them: sched_switch and
# sched_waking with call chains during one nbd qd1 run.  usage: ./sleep.sh BUILD OUTDIR TAG
set -e
B=/work/$1; OUT=$2; TAG=$3; mkdir -p $OUT
uptime > $OUT/load-sleep-$TAG.txt
perf record -a -g -c 1 -e sched:sched_switch,sched:sched_waking -o /tmp/s15-rt/sleep-$TAG.data \
  -- $B/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
     --server-bin $B/qpip-nbd-server --mount-bin $B/qpip-nbd-mount > $OUT/qd1-sleep-$TAG.txt 2>&1
perf script -i /tmp/s15-rt/sleep-$TAG.data -F comm,event,ip,sym 2>/dev/null > /tmp/s15-rt/sleep-$TAG.script
