#!/usr/bin/env bash
# 1 GiB of 1 MiB reads through qpip-nbd-mount (O_DIRECT, then buffered after dropping caches),
# two mount binaries alternating, three rounds: MB/s and the mount process's CPU per GiB.
# Root. Usage: sudo docs/bench/mount_reads.sh OLD_MOUNT NEW_MOUNT [SERVER]
set -u
old=$1 new=$2 server=${3:-target/release/qpip-nbd-server}
W=$(mktemp -d /dev/shm/qpip-reads.XXXXXX); mkdir -p "$W/mnt"
trap 'fusermount3 -u "$W/mnt" 2>/dev/null; kill $S 2>/dev/null; rm -rf "$W"' EXIT
dd if=/dev/urandom of="$W/d.img" bs=1M count=1100 status=none
"$server" --export "d=$W/d.img" -l 127.0.0.1:10995 --log error >/dev/null 2>&1 & S=$!
sleep 0.5
run() { # $1 mount binary, $2 label
  "$1" nbd://127.0.0.1:10995/d "$W/mnt" >/dev/null 2>&1 & M=$!
  for _ in $(seq 50); do [ -e "$W/mnt/d" ] && break; sleep 0.1; done
  cpu() { awk '{print $14+$15}' /proc/$M/stat; }
  c0=$(cpu); a=$(dd if="$W/mnt/d" of=/dev/null bs=1M count=1024 iflag=direct 2>&1 | tail -1 | awk '{print $(NF-1)$NF}')
  echo 3 > /proc/sys/vm/drop_caches; c1=$(cpu)
  b=$(dd if="$W/mnt/d" of=/dev/null bs=1M count=1024 2>&1 | tail -1 | awk '{print $(NF-1)$NF}')
  c2=$(cpu); tck=$(getconf CLK_TCK)
  echo "$2: O_DIRECT $a, mount CPU $(( (c1-c0)*1000/tck )) ms/GiB | buffered $b, mount CPU $(( (c2-c1)*1000/tck )) ms/GiB"
  fusermount3 -u "$W/mnt"; wait $M
}
for round in 1 2 3; do run "$old" "round $round old"; run "$new" "round $round new"; done
