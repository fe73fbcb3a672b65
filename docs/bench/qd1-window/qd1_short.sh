#!/usr/bin/env bash
# Issue 36 item 3's "short QD1 runs": 4 KiB O_DIRECT random reads then writes, one at a time
# (fio psync), RUNTIME s each (3 by default) on a 256 MiB image in /dev/shm, through a FUSE
# file: qpip-nbd-server + qpip-nbd-mount --cache none for each build given, and nbdkit's file
# plugin behind qemu-storage-daemon's FUSE export, set up as `qpip-bench nbd qd1` sets them
# up. Stacks alternate within each round (qsd, then each build in turn), ROUNDS rounds (3).
# Per run: IOPS, clat p50 (µs), and per operation: the client's and the server's CPU (µs),
# their context switches (every thread), and the machine's busy CPU (µs, /proc/stat).
# Root. Usage: sudo qd1_short.sh LABEL=DIR [LABEL=DIR ...]   (DIR holds qpip-nbd-server and
# qpip-nbd-mount); env ROUNDS, RUNTIME, SIZE (MiB), MOUNT_ARGS (extra qpip-nbd-mount options).
set -u
ROUNDS=${ROUNDS:-3} RUNTIME=${RUNTIME:-3} SIZE=${SIZE:-256}
W=$(mktemp -d /dev/shm/qpip-qd1s.XXXXXX)
cleanup() {
  fusermount3 -u "$W/mnt" 2>/dev/null
  for p in ${PIDS:-}; do kill "$p" 2>/dev/null; done
  sleep 0.3; rm -rf "$W"
}
trap cleanup EXIT
mkdir -p "$W/mnt"
dd if=/dev/urandom of="$W/d.img" bs=1M count="$SIZE" status=none
tck=$(getconf CLK_TCK)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }               # ticks
csw() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/ctxt_switches/ {s+=$2} END {print s}'; }
busy() { awk '/^cpu / {print $2+$3+$4+$7+$8}' /proc/stat; }     # ticks, all CPUs
fio_run() { # $1 file, $2 rw; prints "IOPS p50 ios"
  fio --name=qd1 --filename="$1" --rw="$2" --bs=4k --iodepth=1 --ioengine=psync --direct=1 \
    --time_based --runtime="$RUNTIME" --size="${SIZE}M" --output-format=json 2>/dev/null |
    python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
d = j["read"] if j["read"]["io_bytes"] else j["write"]
print("%.0f %.0f %d" % (d["iops"], d["clat_ns"]["percentile"]["50.000000"] / 1e3, d["total_ios"]))'
}
measure() { # $1 label, $2 file, $3 server pid, $4 client pid
  for rw in randread randwrite; do
    c0=$(cpu "$4") s0=$(cpu "$3") x0=$(csw "$4") y0=$(csw "$3") b0=$(busy)
    read -r iops p50 ios < <(fio_run "$2" $rw)
    c1=$(cpu "$4") s1=$(cpu "$3") x1=$(csw "$4") y1=$(csw "$3") b1=$(busy)
    us() { echo $(( ($2 - $1) * 1000000 / tck / ios )); }
    echo "$1 $rw: $iops IOPS, p50 $p50 us | per op: client CPU $(us "$c0" "$c1") us, server CPU $(us "$s0" "$s1") us, client csw $(echo "scale=2; ($x1-$x0)/$ios" | bc), server csw $(echo "scale=2; ($y1-$y0)/$ios" | bc), machine busy $(us "$b0" "$b1") us"
  done
}
qpip() { # $1 label, $2 dir
  local p; p=$(port)
  "$2/qpip-nbd-server" --listen "127.0.0.1:$p" --log warn --export "bench=$W/d.img" >/dev/null 2>&1 & S=$!
  for _ in $(seq 50); do ss -ltn | grep -q ":$p " && break; sleep 0.1; done
  # shellcheck disable=SC2086
  "$2/qpip-nbd-mount" --cache none ${MOUNT_ARGS:-} "nbd://127.0.0.1:$p/bench" "$W/mnt" >/dev/null 2>&1 & M=$!
  PIDS="$S $M"
  for _ in $(seq 50); do [ -e "$W/mnt/bench" ] && break; sleep 0.1; done
  measure "$1" "$W/mnt/bench" $S $M
  fusermount3 -u "$W/mnt"; wait $M; kill $S; wait $S 2>/dev/null
}
qsd() {
  local p; p=$(port)
  nbdkit --foreground --exit-with-parent -i 127.0.0.1 -p "$p" -e bench file "file=$W/d.img" >/dev/null 2>&1 & S=$!
  for _ in $(seq 50); do ss -ltn | grep -q ":$p " && break; sleep 0.1; done
  : > "$W/fuse-file"
  qemu-storage-daemon --blockdev "driver=nbd,node-name=n,server.type=inet,server.host=127.0.0.1,server.port=$p,export=bench" \
    --export "type=fuse,id=e,node-name=n,mountpoint=$W/fuse-file,writable=on" >/dev/null 2>&1 & M=$!
  PIDS="$S $M"
  for _ in $(seq 50); do [ "$(stat -c %s "$W/fuse-file")" -gt 0 ] && break; sleep 0.1; done
  measure qsd-nbdkit "$W/fuse-file" $S $M
  kill $M; wait $M 2>/dev/null; kill $S; wait $S 2>/dev/null
}
for round in $(seq "$ROUNDS"); do
  echo "round $round: $(uptime)"
  qsd
  for b in "$@"; do qpip "${b%%=*}" "${b#*=}"; done
done
