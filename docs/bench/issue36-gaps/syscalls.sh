#!/bin/bash
# Part 0 (issue 33 item 5): system calls per 4 KiB QD1 read through the mount, per build.
# Runs `qpip-bench nbd qd1` with BUILD's server and mount, and while fio's randread runs
# (the first fio job), counts every system call of the mount and of the server for 3 s
# (perf stat on their pids) beside fio's preads over the same 3 s.
B=${B:-/tmp/s12/gaps}; BUILD=$1; OUT=${OUT:-.}
TOOL=${TOOL:-$B/NEW/qpip-bench}
$TOOL nbd qd1 --repeat 1 --runtime 8 --size 256M --server-bin $B/$BUILD/qpip-nbd-server \
  --mount-bin $B/$BUILD/qpip-nbd-mount > $OUT/sys-qd1-$BUILD.txt 2>&1 &
bench=$!
# fio of the qpip stack runs first: wait for it, then one second into it.
until pgrep -x fio > /dev/null; do sleep 0.2; done
sleep 1
fio=$(pgrep -n -x fio)  # the job process (forked after the parent)
mount=$(pgrep -n -f "$B/$BUILD/qpip-nbd-mount"); server=$(pgrep -n -f "$B/$BUILD/qpip-nbd-server")
perf stat -x, -e 'syscalls:sys_enter_*' -p $mount -- sleep 3 2> $OUT/sys-mount-$BUILD.csv &
perf stat -x, -e 'syscalls:sys_enter_*' -p $server -- sleep 3 2> $OUT/sys-server-$BUILD.csv &
perf stat -x, -e 'syscalls:sys_enter_pread64' -p $fio -- sleep 3 2> $OUT/sys-fio-$BUILD.csv &
wait %2 %3 %4 2>/dev/null; wait $bench
reads=$(awk -F, '/pread64/{s+=$1} END{print s}' $OUT/sys-fio-$BUILD.csv)
for side in mount server; do
  echo "== $BUILD $side: system calls per read ($reads reads in 3 s)"
  awk -F, -v r=$reads '$1+0>0 {sub("syscalls:sys_enter_","",$3); printf "%-22s %8.2f\n", $3, $1/r; t+=$1} END{printf "%-22s %8.2f\n", "total", t/r}' $OUT/sys-$side-$BUILD.csv | sort -k2 -n -r
done
