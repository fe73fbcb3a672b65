#!/bin/bash
# ab.sh OUT NEW_SERVER [ROUNDS]: interleaved `qpip-bench nbd raw` (1 connection, 256 KiB QD16) of
# main's server before the change (/work/base-bin, e0df4b0) and NEW_SERVER, loopback and
# --netns --mtu 1500, one round each per build and link, old then new; base-bin's qpip-bench
# drives both, so only the servers differ.
out=$1; new=$2; rounds=${3:-3}; mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for link in netns loopback; do
    extra=""; [ $link = netns ] && extra="--netns --mtu 1500"
    for b in base new; do
      srv=/work/base-bin/qpip-nbd-server; [ $b = new ] && srv=$new
      uptime > "$out/load-$link-$b-$r.txt"
      /work/base-bin/qpip-bench nbd raw --repeat 1 $extra --server-bin "$srv" > "$out/raw-$link-$b-$r.txt" 2>&1
    done
  done
done
