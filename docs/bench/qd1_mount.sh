#!/usr/bin/env bash
# 4 KiB random reads and writes at queue depth 1 (O_DIRECT, fio psync, 8 s each) through
# qpip-nbd-mount --cache none on a 1 GiB image in /dev/shm, two mount binaries alternating,
# three rounds: IOPS, completion-latency p50/p99 (µs) and the mount process's CPU per 10 000
# operations. Root. Usage: sudo docs/bench/qd1_mount.sh OLD_MOUNT NEW_MOUNT [SERVER]
set -u
old=$1 new=$2 server=${3:-target/release/qpip-nbd-server}
W=$(mktemp -d /dev/shm/qpip-qd1.XXXXXX); mkdir -p "$W/mnt"
trap 'fusermount3 -u "$W/mnt" 2>/dev/null; kill $S 2>/dev/null; rm -rf "$W"' EXIT
dd if=/dev/urandom of="$W/d.img" bs=1M count=1024 status=none
"$server" --export "d=$W/d.img" -l 127.0.0.1:10996 --log error >/dev/null 2>&1 & S=$!
sleep 0.5
tck=$(getconf CLK_TCK)
fio_run() { # $1 rw; prints "IOPS p50 p99"
  fio --name=qd1 --filename="$W/mnt/d" --rw="$1" --bs=4k --iodepth=1 --ioengine=psync \
    --direct=1 --time_based --runtime=8 --size=1G --output-format=json 2>/dev/null |
    python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
d = j["read"] if j["read"]["io_bytes"] else j["write"]
p = d["clat_ns"]["percentile"]
print("%.0f %.0f %.0f %d" % (d["iops"], p["50.000000"] / 1e3, p["99.000000"] / 1e3, d["total_ios"]))'
}
run() { # $1 mount binary, $2 label
  "$1" --cache none nbd://127.0.0.1:10996/d "$W/mnt" >/dev/null 2>&1 & M=$!
  for _ in $(seq 50); do [ -e "$W/mnt/d" ] && break; sleep 0.1; done
  cpu() { awk '{print $14+$15}' /proc/$M/stat; }
  for rw in randread randwrite; do
    c0=$(cpu); read -r iops p50 p99 ios < <(fio_run $rw); c1=$(cpu)
    echo "$2 $rw: $iops IOPS, p50 $p50 us, p99 $p99 us, mount CPU $(( (c1-c0)*1000*10000/tck/ios )) ms per 10k ops"
  done
  fusermount3 -u "$W/mnt"; wait $M
}
for round in 1 2 3; do run "$old" "round $round old"; run "$new" "round $round new"; done
