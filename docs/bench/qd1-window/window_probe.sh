#!/bin/bash
# (docs/bench/qd1-window) A mount built with the WINDBG counters (window-probe.txt) prints its
# histogram to /tmp/win/mount-dbg.err; any other build runs it too. B: the build directory.
# epoll_wait calls of the mount, zero timeout (a poll) and otherwise (a sleep), per op
B=${B:-/tmp/win/NEW}; RW=${RW:-randread}; RT=${RT:-3}
W=$(mktemp -d /dev/shm/qpip-probe.XXXXXX); mkdir -p $W/mnt
dd if=/dev/urandom of=$W/d.img bs=1M count=256 status=none
$B/qpip-nbd-server --listen 127.0.0.1:10977 --log warn --export bench=$W/d.img >/dev/null 2>&1 & S=$!
sleep 0.3
$B/qpip-nbd-mount --cache none ${MOUNT_ARGS:-} nbd://127.0.0.1:10977/bench $W/mnt >/dev/null 2>/tmp/win/mount-dbg.err & M=$!
for _ in $(seq 50); do [ -e $W/mnt/bench ] && break; sleep 0.1; done
perf stat -x, -o $W/stat -p $M -e 'syscalls:sys_enter_epoll_wait' --filter 'timeout == 0' -e 'syscalls:sys_enter_epoll_wait' --filter 'timeout != 0' -e 'syscalls:sys_enter_readv' -e context-switches & P=$!
sleep 0.3
fio --name=qd1 --filename=$W/mnt/bench --rw=$RW --bs=4k --iodepth=1 --ioengine=psync --direct=1 --time_based --runtime=$RT --size=256M --output-format=json 2>/dev/null | python3 -c '
import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["read"] if j["read"]["io_bytes"] else j["write"]; print("IOPS %.0f p50 %.0f ios %d" % (d["iops"], d["clat_ns"]["percentile"]["50.000000"]/1e3, d["total_ios"]))' > $W/fio
kill -INT $P; wait $P
ios=$(awk '{print $6}' $W/fio); cat $W/fio
awk -F, -v n=$ios '/^[0-9]/ {printf "  %-40s %8.3f per op\n", $3 ($6 ? " " $6 : ""), $1/n}' $W/stat
fusermount3 -u $W/mnt; wait $M; kill $S; wait $S; rm -rf $W
