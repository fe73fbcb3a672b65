#!/bin/bash
# (docs/bench/qd1-window) Per-thread context switches and CPU ticks of the mount and the
# server over one QD1 fio run (TRACE=1: also perf trace -s of the mount). B: the build directory.
# per-thread context switches and syscalls of the mount and server during a QD1 fio run
B=${B:-/tmp/win/NEW}; RW=${RW:-randread}; RT=${RT:-3}
W=$(mktemp -d /dev/shm/qpip-probe.XXXXXX); mkdir -p $W/mnt
dd if=/dev/urandom of=$W/d.img bs=1M count=256 status=none
$B/qpip-nbd-server --listen 127.0.0.1:10977 --log warn --export bench=$W/d.img >/dev/null 2>&1 & S=$!
sleep 0.3
$B/qpip-nbd-mount --cache none ${MOUNT_ARGS:-} nbd://127.0.0.1:10977/bench $W/mnt >/dev/null 2>&1 & M=$!
for _ in $(seq 50); do [ -e $W/mnt/bench ] && break; sleep 0.1; done
snap() { for t in /proc/$1/task/*; do echo "$(basename $t) $(cat $t/comm | tr ' ' _) $(awk '/ctxt/ {s+=$2} END {print s}' $t/status) $(awk '{print $14+$15}' $t/stat)"; done | sort; }
snap $M > $W/m0; snap $S > $W/s0
if [ -n "${TRACE:-}" ]; then perf trace -s -p $M -o $W/trace.txt & P=$!; sleep 0.5; fi
fio --name=qd1 --filename=$W/mnt/bench --rw=$RW --bs=4k --iodepth=1 --ioengine=psync --direct=1 --time_based --runtime=$RT --size=256M --output-format=json 2>/dev/null | python3 -c '
import json,sys; j=json.load(sys.stdin)["jobs"][0]; d=j["read"] if j["read"]["io_bytes"] else j["write"]; print("IOPS %.0f p50 %.0f ios %d" % (d["iops"], d["clat_ns"]["percentile"]["50.000000"]/1e3, d["total_ios"]))' | tee $W/fio
if [ -n "${TRACE:-}" ]; then kill -INT $P; wait $P; fi
snap $M > $W/m1; snap $S > $W/s1; cp $W/m0 $W/m1 $W/s0 $W/s1 /tmp/win/
ios=$(awk '{print $6}' $W/fio)
echo "mount threads (csw/op, cpu ticks):"; join $W/m0 $W/m1 | awk -v n=$ios '{d=$6-$3; if (d>0) printf "  %s %s %.3f csw/op %d ticks\n", $1, $2, d/n, $7-$4}'
echo "server threads:"; join $W/s0 $W/s1 | awk -v n=$ios '{d=$6-$3; if (d>0) printf "  %s %s %.3f csw/op %d ticks\n", $1, $2, d/n, $7-$4}'
[ -n "${TRACE:-}" ] && cp $W/trace.txt /tmp/win/trace-$RW.txt
fusermount3 -u $W/mnt; wait $M; kill $S; wait $S; rm -rf $W
