#!/bin/bash
# System calls of the server per 256 KiB write, 1 connection QD16, old vs new server.
# Usage: raw1-write.sh OLD|NEW OUTNAME PORT (B/OLD, B/NEW: release builds; B=/tmp/rt).
B=$1; OUT=$2; port=$3
[ -f /dev/shm/rt-img ] || dd if=/dev/urandom of=/dev/shm/rt-img bs=1M count=512 status=none
/tmp/rt/$B/qpip-nbd-server -l 127.0.0.1:$port -e bench=/dev/shm/rt-img -q > /dev/null 2>&1 &
srv=$!
sleep 0.5
fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$port/bench --rw=write --bs=256k --iodepth=16 --numjobs=1 --size=128M --offset_increment=128M --time_based --runtime=2 --group_reporting --output-format=terse > /dev/null 2>&1  # warm
perf stat -x, -e 'syscalls:sys_enter_*,context-switches,task-clock' -p $srv -o $OUT.csv -- sleep 3 &
st=$!
fio --name=w --ioengine=nbd --uri=nbd://127.0.0.1:$port/bench --rw=write --bs=256k --iodepth=16 --numjobs=1 --size=128M --offset_increment=128M --time_based --runtime=3 --group_reporting > $OUT.fio 2>&1
wait $st
kill $srv; wait $srv 2>/dev/null
