#!/bin/bash
# System calls per 4 KiB QD1 write through the mount, per build, during `qpip-bench nbd qd1`
# (qpip stack first: randread, then randwrite): perf stat on the mount's and the server's pids
# for 3 s, 1 s into the randwrite job, a few events only (every syscall tracepoint slows the
# mount 4x); per request = per server pwrite64 (one per 4 KiB write) in the same window.
# Usage: BUILD=OLD|NEW R=round OUT=dir ./syscalls.sh   (OLD=/work/base-bin, NEW=/tmp/rt/new)
OLD=${OLD:-/work/base-bin}; NEW=${NEW:-/tmp/rt/new}; BUILD=${BUILD:-NEW}; OUT=${OUT:-.}; R=${R:-1}
dir=${!BUILD}
EV=$(printf 'syscalls:sys_enter_%s,' epoll_wait readv writev ppoll futex io_uring_enter sched_yield read write pwrite64 recvmsg sendmsg)context-switches,task-clock
mkdir -p "$OUT"
$NEW/qpip-bench nbd qd1 --repeat 1 --runtime 6 --size 256M --server-bin $dir/qpip-nbd-server \
  --mount-bin $dir/qpip-nbd-mount > $OUT/qd1-$BUILD-$R.txt 2>&1 &
bench=$!
until grep -q 'qpip randread:' $OUT/qd1-$BUILD-$R.txt 2>/dev/null; do sleep 0.2; done
sleep 1.5
mount=$(pgrep -n -f "$dir/qpip-nbd-mount"); server=$(pgrep -n -f "$dir/qpip-nbd-server")
perf stat -x, -e "$EV" -p $mount -o $OUT/sys-mount-$BUILD-$R.csv -- sleep 3 &
perf stat -x, -e "$EV" -p $server -o $OUT/sys-server-$BUILD-$R.csv -- sleep 3
wait $bench
