#!/usr/bin/env bash
# qpip-nbd copy against nbdcopy, same server (qpip-nbd-server on tmpfs), alternating, ROUNDS
# rounds: upload (file -> export) and download (export -> new file) of SIZE MiB, each tool
# with its defaults (both detect zeroes and skip holes); KIND dense: random data throughout;
# sparse: 1 MiB of random data every 16 MiB, holes between. Prints each run's wall seconds and
# the medians. Usage:
#   docs/bench/copy.sh [ROUNDS=7] [SIZE_MIB=1024] [BIN_DIR=target/release] [KIND=dense|sparse]
set -eu
rounds=${1:-7} size=${2:-1024} bin=${3:-target/release} kind=${4:-dense}
W=$(mktemp -d /dev/shm/qpip-copy.XXXXXX)
trap 'kill $S 2>/dev/null; rm -rf "$W"' EXIT
if [ "$kind" = sparse ]; then
  truncate -s "${size}M" "$W/src.img"
  for at in $(seq 0 16 $((size - 1))); do
    dd if=/dev/urandom of="$W/src.img" bs=1M count=1 seek="$at" conv=notrunc status=none
  done
else
  dd if=/dev/urandom of="$W/src.img" bs=1M count="$size" status=none
fi
truncate -s "${size}M" "$W/export.img"
"$bin/qpip-nbd-server" --export "d=$W/export.img" -l 127.0.0.1:10994 --log error >/dev/null 2>&1 & S=$!
sleep 0.5
uri=nbd://127.0.0.1:10994/d
t() { local a b; a=$(date +%s.%N); "$@" >/dev/null 2>&1; b=$(date +%s.%N); echo "$b - $a" | bc; }
median() { sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
: > "$W/r"
for i in $(seq "$rounds"); do
  echo "qpip upload $(t "$bin/qpip-nbd" copy --no-progress "$W/src.img" "$uri")" >> "$W/r"
  echo "nbdcopy upload $(t nbdcopy "$W/src.img" "$uri")" >> "$W/r"
  rm -f "$W/out.img"; echo "qpip download $(t "$bin/qpip-nbd" copy --no-progress "$uri" "$W/out.img")" >> "$W/r"
  cmp -s "$W/src.img" "$W/out.img" || { echo "download differs" >&2; exit 1; }
  rm -f "$W/out.img"; echo "nbdcopy download $(t nbdcopy "$uri" "$W/out.img")" >> "$W/r"
done
cat "$W/r"
for k in "qpip upload" "nbdcopy upload" "qpip download" "nbdcopy download"; do
  m=$(grep "^$k " "$W/r" | awk '{print $3}' | median)
  echo "median $k ($kind): $m s ($(echo "$size * 1.048576 / $m" | bc) MB/s)"
done
